"""The transformers adapter: HFModel's forward + cache (with rollbacks) against transformers' own decoding,
and HFTokenizer against the Tokenizer protocol. Every model and tokenizer here is tiny and built locally."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    T5ForConditionalGeneration,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from verispec.models.base import Cache, LanguageModel
from verispec.models.base import Tokenizer as TokenizerProtocol
from verispec.models.hf import HFModel, HFTokenizer

VOCAB = 97


def tiny_model(kind: str):
    """A random tiny causal LM: "llama" (grouped-query attention, RoPE) or "gpt2" (learned positions), with
    weights large enough that greedy decoding does not just repeat one token."""
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.3,
        )
        return LlamaForCausalLM(config)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
    )
    return GPT2LMHeadModel(config)


@pytest.fixture(params=["llama", "gpt2"])
def saved(request, tmp_path) -> tuple[HFModel, torch.nn.Module]:
    """(HFModel loaded from a saved directory, the original transformers model)."""
    model = tiny_model(request.param).eval()
    model.save_pretrained(tmp_path / request.param)
    return HFModel.from_pretrained(tmp_path / request.param), model


def test_protocols_and_limits(saved):
    hf, model = saved
    assert isinstance(hf, LanguageModel)
    assert (hf.vocab_size, hf.max_context, hf.device) == (VOCAB, 64, torch.device("cpu"))
    cache = hf.new_cache(batch_size=2, capacity=10)
    assert isinstance(cache, Cache) and (cache.length, cache.capacity) == (0, 10)


def test_greedy_decoding_with_rollbacks_matches_generate(saved):
    """Each step feeds the last token plus two junk "draft" tokens, keeps the first logits, and rolls the
    junk back: the tokens must be exactly those of transformers' greedy generate."""
    hf, model = saved
    prompt = [5, 17, 3, 44, 9, 60]
    steps = 20
    expected = model.generate(
        torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps
    )
    cache = hf.new_cache()
    ids = list(prompt)
    logits = hf.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)  # [1, 6, V]
    ids.append(int(logits[0, -1].argmax()))
    while len(ids) < len(prompt) + steps:
        start = cache.length
        fed = torch.tensor([[ids[-1], 7, 8]])  # [1, 3]
        logits = hf.forward(fed, torch.arange(start, start + 3)[None], cache)
        assert cache.length == start + 3
        cache.truncate(start + 1)
        ids.append(int(logits[0, 0].argmax()))
    assert ids == expected[0].tolist()
    assert len(set(ids[len(prompt) :])) > 2  # the test is not vacuous


def test_logits_after_rollbacks_match_a_fresh_full_forward(saved):
    hf, model = saved
    torch.manual_seed(1)
    seq = torch.randint(0, VOCAB, (2, 20))  # [B=2, 20]
    cache = hf.new_cache(batch_size=2)

    def feed(lo: int, hi: int, tokens: torch.Tensor) -> torch.Tensor:
        assert cache.length == lo
        return hf.forward(tokens, torch.arange(lo, hi).expand(2, -1), cache)  # [2, hi - lo, V]

    feed(0, 8, seq[:, :8])
    feed(8, 14, torch.randint(0, VOCAB, (2, 6)))  # wrong continuation, rolled back below
    cache.truncate(8)
    feed(8, 12, seq[:, 8:12])
    cache.truncate(10)
    last = feed(10, 20, seq[:, 10:20])
    with torch.no_grad():
        full = model(seq).logits  # [2, 20, V]
    assert last.dtype == torch.float32 and last.shape == (2, 10, VOCAB)
    torch.testing.assert_close(last, full[:, 10:], rtol=0, atol=1e-5)
    cache.truncate(0)
    torch.testing.assert_close(feed(0, 20, seq), full, rtol=0, atol=1e-5)


def test_prefill_fills_the_cache_as_forward_does(saved):
    hf, model = saved
    torch.manual_seed(2)
    seq = torch.randint(0, VOCAB, (2, 12))  # [B=2, 12]
    cache = hf.new_cache(batch_size=2)
    assert hf.prefill(seq[:, :9], torch.arange(9).expand(2, -1), cache) is None and cache.length == 9
    last = hf.forward(seq[:, 9:], torch.arange(9, 12).expand(2, -1), cache)  # [2, 3, V]
    with torch.no_grad():
        full = model(seq).logits  # [2, 12, V]
    torch.testing.assert_close(last, full[:, 9:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="overflow"):
        hf.prefill(seq, torch.arange(12).expand(2, -1), hf.new_cache(batch_size=2, capacity=8))


def test_sliding_window_models_are_capped_below_the_window_and_exact():
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=8,
    )
    model = MistralForCausalLM(config).eval()
    hf = HFModel(model)
    assert hf.max_context == 7
    seq = torch.randint(0, VOCAB, (1, 7))
    cache = hf.new_cache()
    hf.forward(seq[:, :6], torch.arange(6)[None], cache)
    cache.truncate(3)
    logits = hf.forward(seq[:, 3:], torch.arange(3, 7)[None], cache)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(seq).logits[:, 3:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="overflow"):
        hf.forward(seq[:, :1], torch.tensor([[7]]), cache)


@pytest.mark.parametrize(
    ("model_class", "message"),
    [
        (MambaForCausalLM, "mamba models are not supported: .* cannot be rolled back exactly"),
        (T5ForConditionalGeneration, "encoder-decoder"),
    ],
)
def test_models_whose_cache_cannot_be_rolled_back_are_refused(model_class, message):
    with torch.device("meta"):  # no memory needed to check the architecture
        model = model_class(model_class.config_class())
    with pytest.raises(ValueError, match=message):
        HFModel(model)


def test_argument_errors(saved):
    hf, _ = saved
    cache = hf.new_cache(capacity=4)
    one = torch.zeros(1, 1, dtype=torch.long)
    for bad in (
        {"batch_size": 0},
        {"capacity": 0},
        {"capacity": 65},
        {"capacity": 2.0},
        {"batch_size": True},
    ):
        with pytest.raises(ValueError, match="must be an integer"):
            hf.new_cache(**bad)
    with pytest.raises(ValueError, match="shape"):
        hf.forward(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="shape"):
        hf.forward(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="must match"):
        hf.forward(one, torch.zeros(1, 2, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="int64"):
        hf.forward(one.int(), one, cache)
    with pytest.raises(ValueError, match="own new_cache"):
        hf.forward(one, one, object())
    hf.forward(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], cache)
    with pytest.raises(ValueError, match="overflow"):
        hf.forward(torch.zeros(1, 2, dtype=torch.long), torch.arange(3, 5)[None], cache)
    for bad in (-1, 4, 1.0):
        with pytest.raises(ValueError, match="cannot truncate a cache of length 3"):
            cache.truncate(bad)
    assert cache.length == 3


# --- HFTokenizer --------------------------------------------------------------------------------------------

SPECIALS = ["<s>", "</s>", "<|user|>", "<|end|>"]  # ids 0..3
TEMPLATE = "{{ bos_token }}{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"


def save_tokenizer(directory: Path, add_bos: bool, chat_template: str | None = TEMPLATE) -> Path:
    """A byte-level BPE tokenizer (no merges) saved to ``directory``, with a generation config naming
    ``<|end|>`` as a second EOS token."""
    vocab = {token: i for i, token in enumerate(SPECIALS + list(bytes_to_unicode().values()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[2:],
        chat_template=chat_template,
    )
    tokenizer.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return directory


@pytest.mark.parametrize("add_bos", [True, False])
def test_tokenizer_protocol(tmp_path, add_bos):
    tokenizer = HFTokenizer.from_pretrained(save_tokenizer(tmp_path, add_bos))
    assert isinstance(tokenizer, TokenizerProtocol)
    assert tokenizer.vocab_size == 4 + 256
    assert tokenizer.bos_token_id == (0 if add_bos else None)
    assert tokenizer.eos_token_ids == frozenset({1, 3})
    text = "héllo , world !"  # no clean-up of the spaces before punctuation
    ids = tokenizer.encode(text)
    plain = tokenizer.encode(text, add_bos=False)
    assert 0 not in plain and ids == ([0] if add_bos else []) + plain
    assert tokenizer.decode(ids + [3, 1]) == text  # special tokens skipped
    prompt = tokenizer.chat_prompt("hi")
    assert prompt == ("<|user|>hi<|end|>" if add_bos else "<s><|user|>hi<|end|>")  # one BOS either way
    assert tokenizer.encode(prompt)[:2] == [0, 2]


def test_decoding_is_prefix_stable(tmp_path):
    tokenizer = HFTokenizer.from_pretrained(save_tokenizer(tmp_path, add_bos=False))
    ids = tokenizer.encode("a , b . ü ! c")
    for cut in range(len(ids) + 1):
        head = tokenizer.decode(ids[:cut])
        if "\ufffd" not in head:  # ends on a whole character
            assert tokenizer.decode(ids).startswith(head)


def test_chat_prompt_without_template_is_a_value_error(tmp_path):
    tokenizer = HFTokenizer.from_pretrained(save_tokenizer(tmp_path, add_bos=False, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.chat_prompt("hi")
