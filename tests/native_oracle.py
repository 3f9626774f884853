"""The oracles of the native kernels' precisions, on the plain torch path: what ``fp16``, ``q8_0`` and
``q4_1`` promise, computed the slow and obvious way (float64 products of dequantized weights, activations
quantized by an independent torch implementation of the rule, keys and values rounded to float16)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec.kernels.cpu import PackedMatrix
from verispec.models import Llama
from verispec.models.llama import _Attention, _Linear, _rotate


def oracle_quantize(x: torch.Tensor) -> torch.Tensor:
    """x [n, cols] → the float64 values the block formats multiply: per row and block of 32, round(x / d) · d
    with d = max|x| / 127 (float32 arithmetic, ties to even), 0 for an all-zero block."""
    n, cols = x.shape
    blocks = x.view(n, cols // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0  # [n, nb, 1] float32
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.round(blocks * inv)  # half to even
    return (q.double() * d.double()).view(n, cols)


def float16_cache_attention(attn: _Attention):
    """The plain attention with its cache writes rounded to float16, as the native cache stores them."""

    def forward(x, cos, sin, keys, values, start, mask):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, -1, attn.head_dim).transpose(1, 2) for y in attn._qkv(x))
        end = start + t
        keys[:, :, start:end] = _rotate(k, cos, sin).half().float()
        values[:, :, start:end] = v.half().float()
        out = torch.nn.functional.scaled_dot_product_attention(
            _rotate(q, cos, sin), keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=True
        )
        return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    return forward


def quantizing_oracle(oracle: Llama, fmt: str) -> Llama:
    """What precision ``fmt`` promises for the plain model ``oracle``, which becomes that promise: every
    projection's weight replaced by the values the kernels multiply, its input quantized by the oracle rule
    (block formats), keys and values rounded to float16 in the cache, and the head the same way (Q8_0 for
    q4_1)."""
    head_fmt = "q8_0" if fmt == "q4_1" else fmt

    def wrap(linear: _Linear) -> None:
        packed = PackedMatrix.pack(linear.weight.detach(), None, fmt)
        with torch.no_grad():
            linear.weight.copy_(packed.dequantized())
        if fmt != "fp16":
            plain = linear.forward
            linear.forward = lambda x: plain(quantized(x))

    def quantized(x: torch.Tensor) -> torch.Tensor:  # [..., cols]: the values the kernels multiply
        return oracle_quantize(x.reshape(-1, x.shape[-1])).float().view(x.shape)

    for m in oracle.model.modules():
        if isinstance(m, _Linear):
            wrap(m)
        if isinstance(m, _Attention):
            m.forward = float16_cache_attention(m)
    head = oracle.model.embed_tokens if oracle.lm_head is None else oracle.lm_head
    weight = PackedMatrix.pack(head.weight.detach(), None, head_fmt).dequantized()

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        xs = flat if head_fmt == "fp16" else oracle_quantize(flat).float()
        return (xs @ weight.T).view(*hidden.shape[:-1], -1)

    oracle.logits = logits  # type: ignore[method-assign]
    return oracle


# byte offsets of the float16 fields (d, and m or dmin) in a block of each GGUF type
_HALF_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2]}
_HALF_FIELDS |= {"Q5_K": [0, 2], "Q6_K": [208]}


def random_gguf_blocks(type_name: str, rows: int, cols: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """Random GGUF blocks of a block type, uint8 [rows, bytes per row]: every integer field (values, packed
    scales) random bytes, the float16 fields uniform in ±scale."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[type_name]:
        half = rng.uniform(-scale, scale, (rows, cols // block)).astype(np.float16)
        raw[..., offset : offset + 2] = half.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)
