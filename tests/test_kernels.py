"""verispec's native CPU kernels against naive oracles, and the invariance that makes them a valid target.

Every build variant this CPU runs (native: AVX-512 where present; avx2; portable C++) is checked against the
same float64 oracles: the weights dequantized from the packed blocks, the activations quantized by an
independent torch implementation of the rule (per row and block of 32: scale max|x| / 127, round half to
even). Then the guarantee speculation needs: a row's outputs are bit-identical whatever else is in the call
(other rows, their number, the thread count), for the products and for the whole native forward.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from native_oracle import oracle_quantize, quantizing_oracle, random_gguf_blocks
from verispec.kernels import build
from verispec.kernels.cpu import (
    FORMATS,
    GGUF_TYPES,
    PackedMatrix,
    native_available,
    quantize_rows,
    rmsnorm,
)
from verispec.models import Llama, LlamaConfig
from verispec.options import SamplingParams

if native_available() is not None:
    pytest.skip(f"the native kernels do not run here: {native_available()}", allow_module_level=True)


def runnable_variants() -> list[str]:
    out = []
    for variant in build.VARIANTS:
        try:
            build.load(variant)
        except build.NativeUnavailable:
            continue
        out.append(variant)
    return out


VARIANTS = runnable_variants()
GREEDY = SamplingParams(temperature=0)


def oracle_product(matrix: PackedMatrix, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    xs = x.double() if matrix.format == "fp16" else oracle_quantize(x)
    y = xs @ matrix.dequantized().double().T
    return y if bias is None else y + bias.double()


def random_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * cols**-0.5
    w[0, :32] = 0.0  # an all-zero block
    w[1, 5] = 3.0  # an outlier in a block
    return w


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cols", [32, 96, 576])  # one block, an odd number of blocks, SmolLM2's width
def test_products_match_the_naive_oracle(variant, fmt, cols):
    rows = 37  # not a multiple of any tile or thread split
    w, bias = (
        random_weight(rows, cols, seed=cols),
        torch.randn(rows, generator=torch.Generator().manual_seed(1)),
    )
    matrix = PackedMatrix.pack(w, bias, fmt, variant=variant)
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(2))  # [9, cols]: 2 tiles and a rest
    x[3, :32] = 0.0  # an all-zero activation block
    y = matrix(x)  # [9, rows]
    expected = oracle_product(matrix, x, bias)
    scale = expected.abs().max()
    assert (y.double() - expected).abs().max() <= 2e-6 * scale
    unrounded = x.double() @ w.double().T + bias.double()  # the format's rounding is visible, but bounded
    bound = {"fp16": 1e-3, "q8_0": 3e-2, "q4_1": 0.3}[fmt]
    assert (y.double() - unrounded).abs().max() <= bound * scale


BLOCK_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def gguf_matrix(type_name: str, rows: int, cols: int, seed: int, variant: str = "native") -> PackedMatrix:
    raw = random_gguf_blocks(type_name, rows, cols, seed)
    return PackedMatrix.from_gguf(type_name, rows, cols, raw, None, variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_every_gguf_block_type_is_its_own_blocks_and_multiplies_like_the_oracle(variant, type_name):
    """Random blocks (every bit pattern of values and packed scales): the kernels hold exactly what gguf's
    own dequantization reads from them, and multiply by it."""
    cols = 512 if type_name.endswith("_K") else 96  # two super-blocks; three blocks
    rows = 37
    raw = random_gguf_blocks(type_name, rows, cols, seed=len(type_name) + cols)
    matrix = PackedMatrix.from_gguf(type_name, rows, cols, raw, None, variant)
    expected_weight = quants.dequantize(raw, GGMLQuantizationType[type_name])
    assert np.array_equal(matrix.dequantized().numpy(), expected_weight)  # bit for bit
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(2))  # [9, cols]
    x[3, :32] = 0.0
    expected = oracle_quantize(x) @ torch.from_numpy(expected_weight).double().T
    assert (matrix(x).double() - expected).abs().max() <= 2e-6 * expected.abs().max()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("type_name", [*BLOCK_TYPES, "F16", "F32"])
def test_a_selection_of_rows_multiplies_as_the_whole_matrix(variant, type_name):
    """A matrix of some of a matrix's rows (an output head's rows for a draft vocabulary), in any order and
    with repeats, gives the whole matrix's outputs for those rows, bit for bit, bias included; ids outside
    the matrix are refused in one line."""
    cols = 512 if type_name.endswith("_K") else 96
    rows = 37
    if type_name in BLOCK_TYPES:
        raw = random_gguf_blocks(type_name, rows, cols, seed=len(type_name))
    else:
        dtype = np.float16 if type_name == "F16" else np.float32
        raw = np.random.default_rng(0).standard_normal((rows, cols)).astype(dtype).view(np.uint8)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(3))
    matrix = PackedMatrix.from_gguf(type_name, rows, cols, raw, bias, variant)
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(2))  # [9, cols]
    for ids in ([5, 36, 0, 17, 17, 8, 9, 10, 11, 12, 33, 20, 21, 22, 23, 24, 25], [36], list(range(rows))):
        picked = matrix.select(torch.tensor(ids))
        assert picked.rows == len(ids)
        assert torch.equal(picked(x), matrix(x)[:, ids])
    with pytest.raises(ValueError, match="row ids must be"):
        matrix.select(torch.tensor([rows]))


@pytest.mark.parametrize("type_name", ["F32", "BF16", "F16"])
def test_float_gguf_types_are_their_own_values(type_name):
    w = np.random.default_rng(3).standard_normal((21, 40)).astype(np.float32)  # [21, 40]
    bf16 = (w.view(np.uint32) >> 16).astype(np.uint16)
    stored = {"F32": w, "F16": w.astype(np.float16), "BF16": bf16}[type_name]
    raw = stored.view(np.uint8).reshape(21, -1)
    matrix = PackedMatrix.from_gguf(type_name, 21, 40, raw)
    expected_weight = quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)
    assert np.array_equal(matrix.dequantized().numpy(), expected_weight)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ torch.from_numpy(expected_weight).double().T
    assert (matrix(x).double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_gguf_matrices_are_refused_with_one_line():
    with pytest.raises(ValueError, match="no native kernel for GGUF tensor type Q2_K; supported: F32, BF16"):
        PackedMatrix.from_gguf("Q2_K", 4, 256, np.zeros((4, 84), np.uint8))
    with pytest.raises(ValueError, match=r"Q4_K matrix \[4, 512\] is uint8 \[4, 288\], got uint8 \[4, 144\]"):
        PackedMatrix.from_gguf("Q4_K", 4, 512, np.zeros((4, 144), np.uint8))
    with pytest.raises(ValueError, match="Q6_K matrix .* is uint8"):
        PackedMatrix.from_gguf("Q6_K", 4, 96, np.zeros((4, 96 // 256 * 210), np.uint8))
    assert set(GGUF_TYPES) >= {"F32", "BF16", "F16", *BLOCK_TYPES}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_block_sums_stay_exact_at_their_largest(variant, fmt):
    # without VNNI the kernels add pairs of integer products in 16-bit lanes (q8_0: up to 2 * 127 * 127):
    # weights and activations at the top of their ranges, of equal or opposite signs, give the exact sums
    cols = 96
    w = torch.ones(24, cols)  # [24, cols]: q8_0 weights 127; q4_1 nibbles 15 (a block's first value: 0)
    w[:, ::32] = -1.0 if fmt == "q8_0" else 0.0
    w[12:] = -w[12:]
    x = torch.ones(4, cols)  # [4, cols]: every activation quantized to ±127
    x[1] = -1.0
    x[2, 1::2] = -1.0
    matrix = PackedMatrix.pack(w, None, fmt, variant=variant)
    y = matrix(x)  # [4, 24]
    expected = oracle_product(matrix, x, None)
    assert (y.double() - expected).abs().max() <= 2e-6 * expected.abs().max()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", [*FORMATS, *BLOCK_TYPES[2:]])
def test_a_row_of_a_product_is_the_same_in_any_company(variant, fmt):
    if fmt in FORMATS:
        matrix = PackedMatrix.pack(random_weight(50, 96, seed=3), None, fmt, variant=variant)
    else:  # a GGUF type with no packing of its own: random blocks
        matrix = gguf_matrix(fmt, 50, 256, seed=3, variant=variant)
    x = torch.randn(11, matrix.cols, generator=torch.Generator().manual_seed(4))
    together = matrix(x)
    alone = torch.cat([matrix(x[i : i + 1]) for i in range(11)])
    assert torch.equal(together, alone)
    assert torch.equal(matrix(x[2:7]), together[2:7])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = matrix(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(single, together)


@pytest.mark.parametrize("variant", VARIANTS)
def test_activation_quantization_is_the_rule(variant):
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(6)) * 3
    x[0, :32] = 0.0
    x[1, 40] = 127.5 * (x[1, 32:64].abs().max() / 127)  # not a tie after the division, but near the top
    q, d, s, sums, lo = quantize_rows(x, variant=variant)
    dequantized = (q.double().view(5, 3, 32) * d.double()[..., None]).view(5, 96)
    assert torch.equal(dequantized, oracle_quantize(x))
    assert torch.equal(sums, q.view(5, 3, 32).sum(-1, dtype=torch.int32))
    assert torch.equal(lo, q.view(5, 3, 32)[..., :16].sum(-1, dtype=torch.int32))
    assert torch.equal(s, d * sums.float())
    assert q.abs().max() <= 127 and torch.equal(q[0, :32], torch.zeros(32, dtype=torch.int8))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_gguf_blocks_are_recovered_block_for_block(fmt):
    """A GGUF file's blocks, dequantized to float32 (as a conversion stores them) and packed again, are the
    very same blocks: the model computes with the file's own weights."""
    ggml = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1}[fmt]
    original = quants.quantize(np.random.default_rng(7).standard_normal((24, 128)).astype(np.float32), ggml)
    dequantized = torch.from_numpy(quants.dequantize(original, ggml).astype(np.float32))
    from_file = PackedMatrix.from_blocks(fmt, 24, 128, original)
    repacked = PackedMatrix.pack(dequantized, None, fmt)
    for a, b in zip(from_file.tensors, repacked.tensors, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert np.array_equal(repacked.blocks(), original)  # the kernels' layout holds the very blocks
    assert torch.equal(repacked.dequantized(), dequantized)


def test_packing_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="format q8_0 needs a multiple of 32 columns, got 40"):
        PackedMatrix.pack(torch.zeros(4, 40), None, "q8_0")
    with pytest.raises(ValueError, match="weight format must be one of fp16, q8_0, q4_1, got 'q2'"):
        PackedMatrix.pack(torch.zeros(4, 32), None, "q2")
    with pytest.raises(ValueError, match=r"x must be a float32 CPU tensor \[n, 32\]"):
        PackedMatrix.pack(torch.zeros(4, 32), None, "fp16")(torch.zeros(2, 33))


@pytest.mark.parametrize("variant", VARIANTS)
def test_rmsnorm_matches_torch(variant):
    x, w = torch.randn(6, 96), torch.rand(96) + 0.5
    expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(rmsnorm(x, w, 1e-5, variant=variant), expected, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------- the whole model

CONFIG = LlamaConfig(
    vocab_size=80,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=64,
    rope_theta=1000.0,
    tie_word_embeddings=True,
    attention_bias=True,
)


def random_llama(config: LlamaConfig = CONFIG, seed: int = 0) -> Llama:
    model = Llama(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                scale = 1.0 if "embed" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def native(fmt: str) -> Llama:
    model = random_llama()
    assert model.optimize_for_cpu(precision=fmt) and model.cpu_precision == fmt
    return model


def pos(start: int, b: int, t: int) -> torch.Tensor:
    return (start + torch.arange(t)).expand(b, t)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_forward_is_the_quantized_model(fmt):
    model = native(fmt)
    oracle = quantizing_oracle(random_llama(), fmt)
    ids = torch.randint(0, 80, (2, 20), generator=torch.Generator().manual_seed(8))
    caches = {m: m.new_cache(2, 20) for m in (model, oracle)}
    errors, scale = [], 0.0
    for start, end in [(0, 11), (11, 12), (12, 16), (16, 20)]:  # prefill, decode, verification blocks
        part = ids[:, start:end]
        got, want = (m(part, pos(start, 2, end - start), caches[m]) for m in (model, oracle))
        errors.append((got - want).abs().amax(-1).flatten())  # [2 T]: each position's largest error
        scale = max(scale, float(want.abs().max()))
    error = torch.cat(errors)  # [40]
    # Summation order moves values by ~1e-6 relative. Without activation quantization (fp16) that is all;
    # with it, such a move now and then flips one activation's rounding by a step, which then shows in
    # that position's logits (and its successors'): most positions stay tight, none goes far.
    tight = (error <= 3e-5 * scale).float().mean()
    assert tight >= (1.0 if fmt == "fp16" else 0.7)
    assert error.max() <= 1e-2 * scale


def split(matrix: PackedMatrix, sizes: list[int]) -> tuple[PackedMatrix, ...]:
    """A stacked matrix as separate ones of ``sizes`` outputs each, the same blocks (and bias slices)."""
    blocks, bias, parts, start = matrix.blocks(), matrix.bias, [], 0
    for size in sizes:
        part_bias = None if bias is None else bias[start : start + size]
        rows = blocks[start : start + size]
        parts.append(PackedMatrix.from_blocks(matrix.format, size, matrix.cols, rows, part_bias))
        start += size
    return tuple(parts)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_projections_stacked_or_apart_compute_the_same(fmt):
    """q, k, v (and gate, up) as one matrix or as separate ones, as a GGUF file stores them (each in its own
    type): the same outputs, bit for bit."""
    model, apart = native(fmt), native(fmt)
    assert apart._native is not None
    c, hd = CONFIG, CONFIG.hidden_size // CONFIG.num_heads
    qkv_sizes = [c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd]
    layers = [
        dataclasses.replace(
            layer,
            qkv=split(layer.qkv, qkv_sizes),
            gate_up=split(layer.gate_up, [c.intermediate_size] * 2),
        )
        for layer in apart._native.layers
    ]
    apart._native = apart._native.replaced(layers)
    assert apart.cpu_precision == fmt
    ids = torch.randint(0, 80, (2, 12), generator=torch.Generator().manual_seed(9))
    stacked_logits, apart_logits = (m(ids, pos(0, 2, 12), m.new_cache(2, 16)) for m in (model, apart))
    assert torch.equal(stacked_logits, apart_logits)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_rows_are_bit_identical_alone_in_a_block_beside_others_and_in_a_tree(fmt):
    model = native(fmt)
    ids = torch.randint(0, 80, (2, 12), generator=torch.Generator().manual_seed(9))
    alone = model(ids[:1, :10], pos(0, 1, 10), model.new_cache(1, 16))[0, -1]  # [V]: position 9 alone
    block = model(ids[:, :12], pos(0, 2, 12), model.new_cache(2, 16))[0, 9]  # in a block, beside row 1
    assert torch.equal(block, alone)
    cache = model.new_cache(1, 16)
    model.prefill(ids[:1, :9], pos(0, 1, 9), cache)
    one = model(ids[:1, 9:10], pos(9, 1, 1), cache)[0, 0]  # decoded after a prefill
    assert torch.equal(one, alone)
    cache.truncate(9)  # a tree: token 9 with a sibling, each attending to itself only
    tree = torch.tensor([[True, False], [False, True]])
    siblings = torch.tensor([[int(ids[0, 9]), (int(ids[0, 9]) + 1) % 80]])
    assert torch.equal(model(siblings, torch.tensor([[9, 9]]), cache, tree_mask=tree)[0, 0], alone)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)
        other_threads = model(ids[:1, :10], pos(0, 1, 10), model.new_cache(1, 16))[0, -1]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(other_threads, alone)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tree_nodes_after_masked_siblings_are_bit_identical_to_their_path_decoded_alone(fmt):
    """A tree node's slot sits after its masked siblings, so it falls at another vector lane than the same
    token decoded alone: its logits must not change (the attention weights of every slot are computed and
    summed the same wherever the slot falls, and attention chunks go by the rank of a visible slot, not by
    its slot). Contexts of every length modulo 16 and around the 128-slot chunk boundary, every node of a
    3x2 tree."""
    model = random_llama(dataclasses.replace(CONFIG, max_position_embeddings=200))
    assert model.optimize_for_cpu(precision=fmt)
    g = torch.Generator().manual_seed(12)
    parents = [-1, 0, 0, 0, 1, 1, 2]  # the root, three children, two grandchildren under the first, one after
    mask = torch.eye(7, dtype=torch.bool)  # [7, 7]: each node and its ancestors
    for i in range(1, 7):
        mask[i] |= mask[parents[i]]
    depth = mask.sum(1) - 1  # [7]
    for context in [*range(3, 40, 2), *range(121, 131)]:
        ids = torch.randint(0, 80, (1, context), generator=g)  # the root is its last token
        nodes = torch.cat([ids[:, -1:], torch.randint(0, 80, (1, 6), generator=g)], 1)  # [1, 7]
        cache = model.new_cache(1, 160)
        model.prefill(ids[:, :-1], pos(0, 1, context - 1), cache)
        tree = model(nodes, (context - 1 + depth)[None], cache, tree_mask=mask)[0]  # [7, V]
        for node in range(7):
            path = nodes[0, mask[node]]  # the root .. the node
            alone = model.new_cache(1, 160)
            model.prefill(ids[:, :-1], pos(0, 1, context - 1), alone)
            for step, token in enumerate(path.tolist()):
                out = model(torch.tensor([[token]]), torch.tensor([[context - 1 + step]]), alone)[0, 0]
            assert torch.equal(tree[node], out), (context, node)


def test_native_long_prompt_in_chunks_equals_one_block():
    config = dataclasses.replace(CONFIG, max_position_embeddings=200)
    model = random_llama(config)
    assert model.optimize_for_cpu(precision="q8_0")
    ids = torch.randint(0, 80, (1, 150), generator=torch.Generator().manual_seed(10))
    whole = model(ids, pos(0, 1, 150), model.new_cache(1, 150))  # 150 > NATIVE_CHUNK: three blocks
    cache = model.new_cache(1, 150)
    pieces = [model(ids[:, i : i + 30], pos(i, 1, 30), cache) for i in range(0, 150, 30)]
    assert torch.equal(torch.cat(pieces, 1), whole)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 1), (8, 8)])
def test_a_causal_block_scores_each_token_as_decoding_it_alone(heads, kv_heads):
    """A causal block's tokens share their key and value loads (several tokens per attention tile, the later
    ones' unseen slots masked): each position must still be bit-identical to its token decoded alone, for
    3, 4 and 1 query heads per kv head, blocks that start anywhere in a 16-slot tile and cross the 128-slot
    attention chunks."""
    config = dataclasses.replace(
        CONFIG, num_heads=heads, num_kv_heads=kv_heads, hidden_size=16 * heads, max_position_embeddings=200
    )
    model = random_llama(config, seed=13)
    assert model.optimize_for_cpu(precision="q8_0")
    ids = torch.randint(0, 80, (1, 170), generator=torch.Generator().manual_seed(14))
    cache = model.new_cache(1, 170)
    alone = torch.cat([model(ids[:, t : t + 1], pos(t, 1, 1), cache) for t in range(170)], 1)  # [1, 170, V]
    for start, end in [(0, 37), (37, 120), (120, 170), (5, 150)]:
        cache = model.new_cache(1, 170)
        if start:
            model.prefill(ids[:, :start], pos(0, 1, start), cache)
        block = model(ids[:, start:end], pos(start, 1, end - start), cache)  # [1, end - start, V]
        assert torch.equal(block, alone[:, start:end]), (start, end)


def test_native_cache_after_random_accept_reject_equals_from_scratch():
    model = native("q4_1")
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 80, (1, 40), generator=g)
    cache = model.new_cache(1, 40)
    model.prefill(ids[:, :5], pos(0, 1, 5), cache)
    committed = 5
    while committed < 35:
        k = int(torch.randint(1, 5, (1,), generator=g))
        block = torch.cat([ids[:, committed : committed + 1], torch.randint(0, 80, (1, k), generator=g)], 1)
        model(block, pos(committed, 1, k + 1), cache)
        accepted = int(torch.randint(0, k + 1, (1,), generator=g))
        ids[:, committed + 1 : committed + 1 + accepted] = block[:, 1 : 1 + accepted]
        committed += 1 + accepted
        cache.truncate(committed)
    last = model(ids[:, committed : committed + 1], pos(committed, 1, 1), cache)[0, 0]
    fresh = model(ids[:, : committed + 1], pos(0, 1, committed + 1), model.new_cache(1, 40))[0, -1]
    assert torch.equal(last, fresh)


def test_native_early_exit_shares_the_first_layers():
    model = native("fp16")
    draft = model.first_layers(1)
    ids = torch.randint(0, 80, (1, 8), generator=torch.Generator().manual_seed(12))
    cache = model.new_cache(1, 8)
    model(ids, pos(0, 1, 8), cache)
    one_layer = Llama(dataclasses.replace(CONFIG, num_layers=1))
    state = {k: v for k, v in random_llama().state_dict().items() if ".layers.1." not in k}
    one_layer.load_state_dict(state)
    assert one_layer.optimize_for_cpu(precision="fp16")
    expected = one_layer(ids, pos(0, 1, 8), one_layer.new_cache(1, 8))
    torch.testing.assert_close(draft(ids, pos(0, 1, 8), draft.new_cache(1, 8)), expected, atol=1e-5, rtol=0)
    # the draft reads the slots the full model wrote for its layers
    early = draft(ids[:, 7:8], pos(7, 1, 1), _truncated(cache.first_layers(1), 7))[0, 0]
    torch.testing.assert_close(early, expected[0, 7], atol=1e-5, rtol=0)


def _truncated(cache, length):
    cache.truncate(length)
    return cache


def test_native_precision_is_refused_for_shapes_it_cannot_hold():
    odd = random_llama(dataclasses.replace(CONFIG, intermediate_size=80))
    with pytest.raises(
        ValueError,
        match=r"precision q4_1 needs .* multiple of 32, .*\[64, 80\]; available: "
        r"fp32, fp16, auto",
    ):
        odd.optimize_for_cpu(precision="q4_1")
    assert odd.cpu_precision is None
    assert odd.optimize_for_cpu(precision="auto", min_weight_elements=0, stored="q4_1")
    assert odd.cpu_precision == "fp16"  # auto falls back to float16 where the stored format cannot go


def test_a_self_draft_is_the_target_packed_again():
    """``requantized``: the target's own weights, as its kernels hold them, packed in a lower precision; it
    computes what a model built from those values in that precision computes, bit for bit."""
    target = native("q8_0")
    oracle = random_llama()
    with torch.no_grad():
        for name, p in oracle.named_parameters():
            if name.endswith("proj.weight"):  # the values the q8_0 kernels multiply by
                p.copy_(PackedMatrix.pack(p.detach(), None, "q8_0").dequantized())
    assert oracle.optimize_for_cpu(precision="q4_1")
    ids = torch.randint(0, 80, (1, 12), generator=torch.Generator().manual_seed(13))
    draft = target.requantized("q4_1")
    assert draft.cpu_precision == "q4_1" and draft.model.embed_tokens is target.model.embed_tokens
    expected = oracle(ids, pos(0, 1, 12), oracle.new_cache(1, 12))
    assert torch.equal(draft(ids, pos(0, 1, 12), draft.new_cache(1, 12)), expected)
    first = target.requantized("q4_1", num_layers=1)
    assert first.config.num_layers == 1
    assert first(ids, pos(0, 1, 12), first.new_cache(1, 12)).shape == (1, 12, 80)
    with pytest.raises(ValueError, match="needs a target on the native kernels"):
        random_llama().requantized("q4_1")
    with pytest.raises(ValueError, match="packed in q8_0 or q4_1"):
        target.requantized("fp16")
    with pytest.raises(ValueError, match=r"num_layers must be an integer in \[1, 2\], got 3"):
        target.requantized("q4_1", num_layers=3)


def test_self_drafts_are_exact_through_the_engine():
    """``--draft self:q4_1`` and ``layers:N:q4_1`` draft for a q8_0 target: greedy output equals plain."""
    from fakes import LetterTokenizer
    from verispec.api import Speculator

    target = native("q8_0")
    loaded = (target, LetterTokenizer(80))
    plain = Speculator(loaded, drafter="none").generate("abcab", max_new_tokens=20, sampling=GREEDY, k=0)
    for spec in ("self:q4_1", "layers:1:q4_1"):
        speculative = Speculator(loaded, draft=spec, drafter="model")
        output = speculative.generate("abcab", max_new_tokens=20, sampling=GREEDY, k=3)
        assert output.token_ids == plain.token_ids and output.stats["drafted"] > 0
    with pytest.raises(ValueError, match=r"a self-draft is written layers:N:PRECISION with N an integer"):
        Speculator(loaded, draft="layers:x:q4_1", drafter="model")


def test_a_cached_build_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    """A truncated or corrupt library in the cache ("invalid ELF header") is built again once, not reported
    as kernels this machine cannot run (a GGUF target then fell back, silently, to another precision); a
    build that itself does not load is NativeUnavailable, in one line."""
    built, corrupt = build.library_path("native"), tmp_path / "kernels" / "verispec-cpu-native.so"
    monkeypatch.setattr(build, "library_path", lambda variant: corrupt)
    corrupt.parent.mkdir()
    corrupt.write_bytes(b"\x7fELF truncated")
    builds: list[Path] = []

    def rebuilt(target: Path, variant: str) -> None:  # the compiler's work, as the machine's build did it
        builds.append(target)
        shutil.copy(built, target.with_suffix(".tmp"))
        os.replace(target.with_suffix(".tmp"), target)  # as _build: a new file, never one loaded rewritten

    monkeypatch.setattr(build, "_build", rebuilt)
    assert build.load.__wrapped__("native").vs_abi_version() == build.ABI_VERSION and builds == [corrupt]
    again = tmp_path / "kernels" / "again.so"  # (the library loaded above stays as it is: mapped)
    again.write_bytes(b"corrupt again")
    monkeypatch.setattr(build, "library_path", lambda variant: again)
    monkeypatch.setattr(build, "_build", lambda target, variant: target.write_bytes(b"not a library"))
    with pytest.raises(build.NativeUnavailable, match="cannot load the native kernels") as info:
        build.load.__wrapped__("native")
    assert "\n" not in str(info.value)
