"""The native Llama against transformers, its KV cache under rollback, and its CPU fast path.

Every model here is tiny and random, built with transformers, saved with ``save_pretrained`` and loaded with
``Llama.from_pretrained``, so names, layouts and RoPE conventions are checked end to end.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from native_oracle import quantizing_oracle
from verispec.models import KVCache, LanguageModel, Llama, LlamaConfig, RopeScaling
from verispec.models import llama as llama_module
from verispec.models.llama import available_precisions, resolve_precision

ATOL = 1e-4
VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, max_position_embeddings=64
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# name → (transformers model class, config); covers MHA/GQA, tied/untied heads, biases and RoPE variants
CASES = {
    "llama-gqa-untied": (
        LlamaForCausalLM,
        HFLlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "llama-mha-tied-linear-rope": (
        LlamaForCausalLM,
        HFLlamaConfig(
            **COMMON,
            num_attention_heads=4,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
        ),
    ),
    "llama3-rope-head-dim": (
        LlamaForCausalLM,
        HFLlamaConfig(
            **COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=24, rope_parameters=LLAMA3_ROPE
        ),
    ),
    "qwen2-bias-tied": (
        Qwen2ForCausalLM,
        Qwen2Config(**COMMON, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "mistral": (
        MistralForCausalLM,
        MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    ),
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is as fast and far steadier on a shared, loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_hf(case: str, seed: int = 0) -> torch.nn.Module:
    """The transformers model of ``case`` with weights of a realistic scale (the default init gives near-zero
    logits, which would make any tolerance meaningless)."""
    cls, config = CASES[case]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            else:  # linear weights [out, in] and the embedding [vocab, hidden]
                p.normal_(0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """case → (transformers model, its save_pretrained directory)."""
    out = {}
    for case in CASES:
        hf = random_hf(case)
        directory = tmp_path_factory.mktemp(case)
        hf.save_pretrained(directory)
        out[case] = (hf, directory)
    return out


def hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, L] → transformers' logits [B, L, V] float32 of a full forward without cache."""
    with torch.no_grad():
        return hf(ids, use_cache=False).logits.float()


def fresh_logits(model: Llama, ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, L] → logits [B, L, V] of one forward over all of ids into an empty cache."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    return model(ids, positions(0, ids), cache)


def positions(start: int, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] positions start .. start + T - 1 for ids: [B, T]."""
    b, t = ids.shape
    return (start + torch.arange(t)).expand(b, t)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_through_prefill_decode_and_rollback(saved, case):
    hf, directory = saved[case]
    model = Llama.from_pretrained(directory)
    assert isinstance(model, LanguageModel)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))  # [2, 20]
    ref = hf_logits(hf, ids)  # [2, 20, V]

    cache = model.new_cache(2, 32)
    torch.testing.assert_close(
        model(ids[:, :12], positions(0, ids[:, :12]), cache), ref[:, :12], atol=ATOL, rtol=0
    )
    for j in range(12, 16):  # incremental decoding, one token at a time
        step = model(ids[:, j : j + 1], positions(j, ids[:, j : j + 1]), cache)  # [2, 1, V]
        torch.testing.assert_close(step[:, 0], ref[:, j], atol=ATOL, rtol=0)
    assert cache.length == 16

    # roll back 3 rejected tokens, then verify a chunk of different tokens in one forward
    cache.truncate(13)
    other = ids.clone()
    other[:, 13:20] = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    chunk = model(other[:, 13:20], positions(13, other[:, 13:20]), cache)  # [2, 7, V]
    torch.testing.assert_close(chunk, hf_logits(hf, other)[:, 13:20], atol=ATOL, rtol=0)
    torch.testing.assert_close(chunk, fresh_logits(model, other)[:, 13:20], atol=ATOL, rtol=0)

    # a prefill without logits leaves the cache as a forward does
    cache.truncate(0)
    assert model.prefill(ids[:, :17], positions(0, ids[:, :17]), cache) is None and cache.length == 17
    rest = model(ids[:, 17:], positions(17, ids[:, 17:]), cache)  # [2, 3, V]
    torch.testing.assert_close(rest, ref[:, 17:], atol=ATOL, rtol=0)


def test_hidden_states_match_transformers_and_give_the_logits(saved):
    hf, directory = saved["llama-gqa-untied"]
    model = Llama.from_pretrained(directory)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))  # [1, 9]
    hidden = model.forward_hidden(ids, positions(0, ids), model.new_cache(1, 9))  # [1, 9, hidden]
    with torch.no_grad():
        torch.testing.assert_close(hidden, hf.model(ids).last_hidden_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(model.logits(hidden), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(saved, tmp_path):
    hf, _ = saved["llama-gqa-untied"]
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = Llama.from_pretrained(tmp_path)
    ids = torch.arange(10)[None] % VOCAB  # [1, 10]
    torch.testing.assert_close(fresh_logits(model, ids), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_bfloat16_model_runs_close_to_float32(saved):
    hf, directory = saved["qwen2-bias-tied"]
    model = Llama.from_pretrained(directory, dtype=torch.bfloat16)
    ids = torch.arange(8)[None] % VOCAB  # [1, 8]
    logits = fresh_logits(model, ids)  # [1, 8, V]
    assert logits.dtype == torch.float32 and model.new_cache().keys.dtype == torch.bfloat16
    ref = hf_logits(hf, ids)  # [1, 8, V]
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("case", ["llama-gqa-untied", "qwen2-bias-tied"])
def test_cache_after_random_accept_reject_equals_from_scratch_forward(saved, case):
    """Feed chunks, roll back to random lengths, feed again: the logits of every chunk always equal those of
    a from-scratch forward over the committed sequence."""
    model = Llama.from_pretrained(saved[case][1])
    rng = random.Random(4)
    cache = model.new_cache(1, 48)
    committed: list[int] = []
    for _ in range(12):
        chunk = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        if len(committed) + len(chunk) > cache.capacity:
            break
        ids = torch.tensor([chunk])  # [1, T]
        logits = model(ids, positions(len(committed), ids), cache)  # [1, T, V]
        committed += chunk
        assert cache.length == len(committed)
        full = fresh_logits(model, torch.tensor([committed]))  # [1, L, V]
        torch.testing.assert_close(logits, full[:, -len(chunk) :], atol=ATOL, rtol=0)
        keep = rng.randint(max(1, len(committed) - 6), len(committed))  # reject a random suffix
        cache.truncate(keep)
        committed = committed[:keep]
    assert len(committed) > 0


def test_cache_errors(saved):
    model = Llama.from_pretrained(saved["llama-gqa-untied"][1])
    cache = model.new_cache(1, 8)
    assert isinstance(cache, KVCache) and (cache.length, cache.capacity) == (0, 8)
    model(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], cache)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(6)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(-1)
    with pytest.raises(ValueError, match="cache overflow"):
        model(torch.zeros(1, 4, dtype=torch.long), (5 + torch.arange(4))[None], cache)
    assert cache.length == 5  # a refused forward commits nothing
    with pytest.raises(ValueError, match="capacity"):
        model.new_cache(1, model.max_context + 1)
    with pytest.raises(ValueError, match="positions must lie"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[model.max_context]]), cache)
    with pytest.raises(ValueError, match="batch of 2"):
        model(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="int64 shaped like tokens"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long), cache)
    cache.truncate(0)
    assert cache.length == 0


@pytest.mark.parametrize("case", ["llama-gqa-untied", "qwen2-bias-tied"])
def test_cpu_fast_path_matches_plain_path(saved, case):
    plain = Llama.from_pretrained(saved[case][1])
    fast = Llama.from_pretrained(saved[case][1])
    if not fast.optimize_for_cpu(min_weight_elements=0):  # pack even these tiny weights
        pytest.skip(
            "oneDNN linears unavailable in this torch build; the fast path falls back to the plain one"
        )
    assert all(m.packed for m in fast.modules() if hasattr(m, "packed"))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))  # [2, 16]
    caches = {m: m.new_cache(2, 16) for m in (plain, fast)}
    for start, end in [(0, 9), (9, 10), (10, 14), (14, 16)]:  # prefill, decode, verification chunks
        part = ids[:, start:end]
        out_plain, out_fast = (m(part, positions(start, part), caches[m]) for m in (plain, fast))
        torch.testing.assert_close(out_fast, out_plain, atol=ATOL, rtol=0)
    hidden = fast.forward_hidden(ids[:, :3], positions(0, ids[:, :3]), fast.new_cache(2, 3))  # [2, 3, hidden]
    assert hidden.shape == (2, 3, 64)
    with pytest.raises(ValueError, match="optimized for CPU"):
        fast.load_weights([])
    # by default weights this small stay on F.linear, where oneDNN's fixed cost per call would dominate
    assert not Llama.from_pretrained(saved[case][1], fast=True).optimized_for_cpu
    auto = Llama.from_pretrained(saved[case][1], fast=True, precision="auto")  # nor does auto round them
    assert not auto.optimized_for_cpu
    torch.testing.assert_close(fresh_logits(auto, ids), fresh_logits(plain, ids), atol=0, rtol=0)


@pytest.mark.parametrize("case", ["llama-gqa-untied", "qwen2-bias-tied"])
def test_fp16_fast_path_is_the_rounded_model_row_by_row(saved, case):
    if "fp16" not in available_precisions():
        pytest.skip("verispec's native kernels do not run here; precision fp16 is refused")
    oracle = quantizing_oracle(Llama.from_pretrained(saved[case][1]), "fp16")
    fast = Llama.from_pretrained(saved[case][1])
    assert fast.optimize_for_cpu(min_weight_elements=0, precision="fp16") and fast.cpu_precision == "fp16"
    small = Llama.from_pretrained(saved[case][1], fast=True, precision="fp16")  # tiny weights: not packed
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))  # [2, 16]
    caches = {m: m.new_cache(2, 16) for m in (oracle, fast, small)}
    for start, end in [(0, 9), (9, 10), (10, 14), (14, 16)]:  # prefill, decode, verification chunks
        part = ids[:, start:end]
        expected = oracle(part, positions(start, part), caches[oracle])
        for model in (fast, small):  # a key or value within ~1e-7 of a float16 rounding boundary may round
            # the other way than in the oracle: one float16 step, ~1e-3 relative, in one cache entry
            torch.testing.assert_close(
                model(part, positions(start, part), caches[model]), expected, atol=2e-3, rtol=0
            )
    # a row depends on its own prefix only, bit for bit: the same token scored alone, in a block, beside
    # another row
    alone = fast(ids[:1, :10], positions(0, ids[:1, :10]), fast.new_cache(1, 16))[:, -1]  # [1, V]
    batch = fast(ids[:, :12], positions(0, ids[:, :12]), fast.new_cache(2, 16))[:1, 9]  # [1, V]
    assert torch.equal(batch, alone)
    plain = Llama.from_pretrained(saved[case][1])
    assert (oracle(ids, positions(0, ids), oracle.new_cache(2, 16)) != fresh_logits(plain, ids)).any()


def test_precision_errors(saved, monkeypatch):
    model = Llama.from_pretrained(saved["llama-gqa-untied"][1])
    with pytest.raises(ValueError, match="precision must be one of fp32, fp16, q8_0, q4_1, auto, got 'int3'"):
        model.optimize_for_cpu(precision="int3")
    with pytest.raises(ValueError, match="precision fp16 runs float32 models on a CPU, not torch.bfloat16"):
        Llama(model.config, dtype=torch.bfloat16).optimize_for_cpu(precision="fp16")
    with pytest.raises(ValueError, match=r"precision q8_0 needs .* multiple of 32, .*\[64, 80\]"):
        model.optimize_for_cpu(precision="q8_0")  # intermediate_size 80: no blocks of 32
    monkeypatch.setattr(llama_module, "native_available", lambda: "no C++ compiler found")  # no kernels
    assert available_precisions() == ("fp32",) and resolve_precision("auto", "q4_1") == "fp32"
    with pytest.raises(
        ValueError,
        match=r"precision 'fp16' is not available on this machine \(no C\+\+ "
        r"compiler found\); available: fp32, auto",
    ):
        model.optimize_for_cpu(precision="fp16")
    assert model.cpu_precision is None  # nothing was changed by the refused calls


def test_config_validation_and_hf_parsing(saved):
    with pytest.raises(ValueError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        LlamaConfig(
            vocab_size=8, hidden_size=24, intermediate_size=8, num_layers=1, num_heads=6, num_kv_heads=4
        )
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 1"):
        LlamaConfig(
            vocab_size=0, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1
        )
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        RopeScaling(kind="yarn", factor=2.0)

    base = json.loads((saved["llama-gqa-untied"][1] / "config.json").read_text())
    config = LlamaConfig.from_hf_config(base)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (
        4,
        2,
        16,
        False,
    )
    legacy = {
        **base,
        "rope_parameters": None,
        "rope_theta": 5e5,
        "rope_scaling": {**LLAMA3_ROPE, "rope_theta": None},
    }
    del legacy["rope_scaling"]["rope_theta"]
    assert LlamaConfig.from_hf_config(legacy).rope_theta == 5e5
    assert LlamaConfig.from_hf_config(legacy).rope_scaling == RopeScaling.from_hf(LLAMA3_ROPE, 64)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        LlamaConfig.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        LlamaConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="config has no 'intermediate_size'"):
        LlamaConfig.from_hf_config({k: v for k, v in base.items() if k != "intermediate_size"})

    mistral = json.loads((saved["mistral"][1] / "config.json").read_text())
    assert LlamaConfig.from_hf_config({**mistral, "sliding_window": 16}).max_context == 16  # window caps it
    qwen = json.loads((saved["qwen2-bias-tied"][1] / "config.json").read_text())
    parsed = LlamaConfig.from_hf_config(qwen)
    assert parsed.attention_bias and not parsed.attention_out_bias and parsed.sliding_window is None


def test_from_pretrained_errors(saved, tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        Llama.from_pretrained(tmp_path)
    directory = saved["llama-gqa-untied"][1]
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(ValueError, match="missing weights file"):
        Llama.from_pretrained(tmp_path)
    model = Llama.from_pretrained(directory)
    with pytest.raises(ValueError, match="weights missing"):
        model.load_weights([])
    with pytest.raises(ValueError, match="unexpected weight 'model.extra'"):
        model.load_weights([("model.extra", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


# config.json of released checkpoints (abridged to the keys that matter)
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "head_dim": 64,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}


@pytest.mark.parametrize(
    "hf_config, expected",
    [
        (SMOLLM2_135M, dict(head_dim=64, tie_word_embeddings=True, max_context=8192, eos_token_ids=(0,))),
        (LLAMA_32_1B, dict(head_dim=64, max_context=131072, eos_token_ids=(128001, 128008, 128009))),
        (QWEN25_05B, dict(head_dim=64, attention_bias=True, attention_out_bias=False, max_context=32768)),
        (MISTRAL_7B_V01, dict(head_dim=128, sliding_window=4096, max_context=4096)),
    ],
)
def test_released_configs_parse_and_give_transformers_rope_frequencies(hf_config, expected):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig.from_hf_config(hf_config)
    for name, value in expected.items():
        assert getattr(config, name) == value, name
    hf = AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    torch.testing.assert_close(config.rope_inv_freq(), LlamaRotaryEmbedding(hf).inv_freq, atol=0, rtol=1e-6)
