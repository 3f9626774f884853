"""llama2.c: the stories260K checkpoint and tok512 tokenizer against the reference text, a naive tokenizer and
transformers."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from verispec.models import Llama, Llama2cTokenizer, Tokenizer, load_llama2c

REFERENCE = (  # stories260K's greedy text (once quoted in the README, wrapped)
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high. "
    "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do."
)
SAMPLES = [
    "Once upon a time",
    "",
    " leading and trailing spaces  ",
    "Tabs\tand\nnewlines\n\n",
    "café, naïve, Zürich",
    "日本語のテキスト",
    "emoji 🙂🚀 and math ∑x²",
    "<0x41> <s> </s> look like special pieces",
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is as fast and far steadier on a shared, loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stories(shared_model):
    return shared_model("stories260K", "stories260K.bin", "tok512.bin")


@pytest.fixture(scope="module")
def tokenizer(stories) -> Llama2cTokenizer:
    return Llama2cTokenizer(stories / "tok512.bin")


@pytest.fixture(scope="module")
def model(stories) -> Llama:
    return load_llama2c(stories / "stories260K.bin")


def greedy(model: Llama, prompt: list[int], max_new: int, stop: frozenset[int]) -> list[int]:
    """Argmax decoding through the cache: the prompt, then one token per forward."""
    cache = model.new_cache(1, len(prompt) + max_new)
    logits = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)  # [1, L, V]
    out = list(prompt)
    for _ in range(max_new):
        token = int(logits[0, -1].argmax())
        if token in stop:
            break
        out.append(token)
        logits = model(torch.tensor([[token]]), torch.tensor([[cache.length]]), cache)  # [1, 1, V]
    return out


def test_greedy_generation_reproduces_the_reference_text(model, tokenizer):
    ids = greedy(model, tokenizer.encode("Once upon a time"), 200, tokenizer.eos_token_ids)
    text = tokenizer.decode(ids)
    assert " ".join(text.split()).startswith(" ".join(REFERENCE.split()))


def test_logits_match_transformers_with_the_converted_weights(model):
    c = model.config
    hf_config = HFLlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings,
    )
    hf = LlamaForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    ids = torch.randint(3, c.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))  # [2, 40]
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits  # [2, 40, V]
    ours = model(ids, torch.arange(40).expand(2, 40), model.new_cache(2, 40))  # [2, 40, V]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_tokenizer_round_trips_and_streams(tokenizer):
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.vocab_size == 512 and tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == {1, 2}
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        assert ids[:1] == [1] and tokenizer.encode(text, add_bos=False) == ids[1:]
        assert tokenizer.decode(ids) == text
        for cut in range(len(ids)):  # streaming: a prefix that ends on a whole character is a prefix
            head = tokenizer.decode(ids[:cut])
            if "\ufffd" not in head:
                assert tokenizer.decode(ids).startswith(head)
    assert any(3 <= t < 259 for t in tokenizer.encode("日本語のテキスト"))  # byte fallback was exercised
    assert tokenizer.decode([1, 2, 0]) == ""
    assert tokenizer.decode(tokenizer.encode("a日")[:-1]) == "a\ufffd"  # a partial character at the very end
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.chat_prompt("hi")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([512])


def naive_encode(tokenizer: Llama2cTokenizer, text: str) -> list[int]:
    """run.c's encoder, quadratic as written there: rescan every pair after each merge."""
    pieces, scores = tokenizer._pieces, tokenizer._scores
    lookup = {p: i for i, p in reversed(list(enumerate(pieces)))}
    ids = [lookup[b" "]] if text else []
    for ch in text:
        b = ch.encode()
        ids += [lookup[b]] if b in lookup else [byte + 3 for byte in b]
    while True:
        best, best_score = None, -1e10
        for i in range(len(ids) - 1):
            merged = lookup.get(pieces[ids[i]] + pieces[ids[i + 1]])
            if merged is not None and scores[merged] > best_score:
                best, best_score = (i, merged), scores[merged]
        if best is None:
            return [1, *ids]
        i, merged = best
        ids[i : i + 2] = [merged]


def test_heap_merging_equals_run_c_rescanning(tokenizer):
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz      ,.!'\"\nThe Lily Tim day ésü日🙂"
    texts = [
        *SAMPLES,
        *("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(200)),
    ]
    for text in texts:
        assert tokenizer.encode(text) == naive_encode(tokenizer, text), text


def test_file_errors(stories, tmp_path):
    with pytest.raises(ValueError, match="no llama2.c checkpoint"):
        load_llama2c(tmp_path / "absent.bin")
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes((stories / "stories260K.bin").read_bytes()[:5000])
    with pytest.raises(ValueError, match="floats after its header"):
        load_llama2c(truncated)
    versioned = tmp_path / "v1.bin"
    versioned.write_bytes(struct.pack("<Ii", 0x616B3432, 1) + bytes(256))
    with pytest.raises(ValueError, match="only version 0"):
        load_llama2c(versioned)
    with pytest.raises(ValueError, match="no llama2.c tokenizer"):
        Llama2cTokenizer(tmp_path / "absent.bin")
    bad_tokenizer = tmp_path / "tok.bin"
    bad_tokenizer.write_bytes((stories / "tok512.bin").read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated"):
        Llama2cTokenizer(bad_tokenizer)


def write_llama2c(path, hf: LlamaForCausalLM) -> None:
    """Write ``hf`` as a llama2.c version-0 checkpoint with a separate output matrix (negative vocab_size),
    its q/k rows put back in llama2.c's interleaved RoPE order, as export.py writes Meta weights."""
    c = hf.config
    sd = {k: v.detach().float() for k, v in hf.state_dict().items()}
    layers = range(c.num_hidden_layers)
    head_dim = c.hidden_size // c.num_attention_heads

    def interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:  # [heads * head_dim, in]
        return w.view(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    def stack(name: str, heads: int | None = None) -> torch.Tensor:
        ws = [sd[f"model.layers.{i}.{name}.weight"] for i in layers]
        return torch.stack([interleaved(w, heads) if heads else w for w in ws])

    parts = [
        sd["model.embed_tokens.weight"],
        stack("input_layernorm"),
        stack("self_attn.q_proj", c.num_attention_heads),
        stack("self_attn.k_proj", c.num_key_value_heads),
        stack("self_attn.v_proj"),
        stack("self_attn.o_proj"),
        stack("post_attention_layernorm"),
        stack("mlp.gate_proj"),
        stack("mlp.down_proj"),
        stack("mlp.up_proj"),
        sd["model.norm.weight"],
        torch.zeros(2, c.max_position_embeddings, head_dim // 2),  # the legacy RoPE tables
        sd["lm_head.weight"],
    ]
    header = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads)
    header += (c.num_key_value_heads, -c.vocab_size, c.max_position_embeddings)
    path.write_bytes(struct.pack("<7i", *header) + b"".join(p.numpy().astype("<f4").tobytes() for p in parts))


def test_untied_checkpoint_written_like_export_py_matches_transformers(tmp_path):
    torch.manual_seed(0)
    config = HFLlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.ndim == 2 else 0.2).add_(1.0 if p.ndim == 1 else 0.0)
    write_llama2c(tmp_path / "tiny.bin", hf)
    model = load_llama2c(tmp_path / "tiny.bin")
    assert not model.config.tie_word_embeddings and model.lm_head is not None
    ids = torch.randint(0, 40, (1, 20), generator=torch.Generator().manual_seed(1))  # [1, 20]
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits  # [1, 20, V]
    torch.testing.assert_close(
        model(ids, torch.arange(20)[None], model.new_cache(1, 20)), ref, atol=1e-4, rtol=0
    )
