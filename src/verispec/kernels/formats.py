"""GGUF's block formats as the native kernels keep them, and the weights read back from that layout.

Every block format is an unsigned integer u per weight with w = scale · (u − offset) + minimum, per block of
32 columns; the kernels (``vs_repack`` in ``cpu.cpp``, which gives the layout) interleave the integers by
groups of outputs, in chunks of 4 bytes per output lane (8-bit values whole, the others as nibbles plus one
bit plane per bit above the fourth), and the scales likewise. :func:`deinterleave` reads that layout back
and :func:`weights` gives the float32 values with the same float operations as ``gguf``'s own
dequantization: the oracle that proves the repacking (bit for bit, tested).

A K-quant's block scale is its super-block's float16 d times a small integer (6 bits, or int8 for Q6_K's
halves), exact in float32, so the kernels multiply by exactly the file's scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

__all__ = ["BLOCK_FORMATS", "BlockFormat", "Decoded", "deinterleave", "weights"]

QK, QK_K = 32, 256  # columns per block; per K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block format as the kernels multiply it.

    code: its number in ``cpu.cpp``; bits: of u (8, 6, 5 or 4); offset: subtracted from u; scales: "block"
    (float16 per block), "super" (float16 per super-block times a u8 per block, minimums likewise, subtracted)
    or "halves" (float16 per super-block times an int8 per 16 columns); minimum: whether it has minimums."""

    name: str
    code: int
    ggml: GGMLQuantizationType
    bits: int
    offset: int
    scales: str
    minimum: bool

    @property
    def chunks(self) -> int:
        """Chunks of 4 bytes per lane and block: 8 for 8 bits, else 4 of nibbles and a plane per extra bit."""
        return 8 if self.bits == 8 else self.bits

    @property
    def columns(self) -> int:
        """What the number of columns must be a multiple of."""
        return QK if self.scales == "block" else QK_K


BLOCK_FORMATS = {
    f.name: f
    for f in (
        BlockFormat("q8_0", 2, GGMLQuantizationType.Q8_0, 8, 128, "block", False),
        BlockFormat("q4_1", 3, GGMLQuantizationType.Q4_1, 4, 0, "block", True),
        BlockFormat("q4_0", 4, GGMLQuantizationType.Q4_0, 4, 8, "block", False),
        BlockFormat("q5_0", 5, GGMLQuantizationType.Q5_0, 5, 16, "block", False),
        BlockFormat("q5_1", 6, GGMLQuantizationType.Q5_1, 5, 0, "block", True),
        BlockFormat("q4_k", 7, GGMLQuantizationType.Q4_K, 4, 0, "super", True),
        BlockFormat("q5_k", 8, GGMLQuantizationType.Q5_K, 5, 0, "super", True),
        BlockFormat("q6_k", 9, GGMLQuantizationType.Q6_K, 6, 32, "halves", False),
    )
}


@dataclass(frozen=True)
class Decoded:
    """Rows of a block-format matrix as integers and scales (R rows, nb blocks, ns super-blocks).

    u: uint8 [R, nb, 32]; d: float16 [R, nb] ("block") or [R, ns]; m: float16 minimums [R, nb] ("block"),
    dmin [R, ns] ("super"), or None; sc: uint8 [R, nb] ("super"), int8 [R, nb, 2] ("halves"), or None; sm:
    uint8 [R, nb] ("super") or None."""

    u: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None
    sc: np.ndarray | None = None
    sm: np.ndarray | None = None


def weights(fmt: BlockFormat, dec: Decoded) -> np.ndarray:
    """The float32 weights [R, nb · 32], computed as ``gguf``'s dequantization computes them."""
    rows, nb, _ = dec.u.shape
    f32 = np.float32
    w = dec.u.astype(f32)  # [R, nb, 32], computed in place: the same operations in the same order, and no
    # temporary of its size (a vocabulary's embedding is hundreds of MB in float32)
    if fmt.scales == "block":
        d = dec.d.astype(f32)[..., None]
        if dec.m is None:  # d · (u − offset)
            w -= f32(fmt.offset)
            w *= d
        else:  # d · u + m
            w *= d
            w += dec.m.astype(f32)[..., None]
    elif fmt.scales == "super":  # d · u − dm
        assert dec.m is not None and dec.sc is not None and dec.sm is not None
        d = np.repeat(dec.d.astype(f32), 8, axis=1) * dec.sc.astype(f32)  # [R, nb]: exact
        dm = np.repeat(dec.m.astype(f32), 8, axis=1) * dec.sm.astype(f32)
        w *= d[..., None]
        w -= dm[..., None]
    else:  # d · (u − offset), a scale per half block
        assert dec.sc is not None
        d = np.repeat(dec.d.astype(f32), 8, axis=1)[..., None] * dec.sc.astype(f32)  # [R, nb, 2]
        w -= f32(fmt.offset)
        w.reshape(rows, nb, 2, 16)[...] *= d[..., None]
    return w.reshape(rows, nb * QK)


# the output-lane axis of each of the kernels' arrays of a matrix: values [G, nb, chunks, lanes, 4]; d, m, sc
# and sm [G, ..., lanes] (G groups of ``lanes`` outputs; row g · lanes + lane)
LANE_AXES = (-2, -1, -1, -1, -1)


def deinterleave(fmt: BlockFormat, arrays: tuple[np.ndarray | None, ...], rows: int) -> Decoded:
    """The kernels' arrays of a matrix (values, d, m, sc, sm; None where the format has none) read back: the
    first ``rows`` rows' integers and scales."""

    def rows_of(x: np.ndarray | None, axis: int) -> np.ndarray | None:  # [G, ..., lanes, ...] → [rows, ...]
        if x is None:
            return None
        lanes = np.moveaxis(x, axis, 1)
        return lanes.reshape(-1, *lanes.shape[2:])[:rows]

    chunks, d, m, sc, sm = (rows_of(x, axis) for x, axis in zip(arrays, LANE_AXES, strict=True))
    assert chunks is not None and d is not None  # chunks: [rows, nb, chunks, 4]
    if fmt.bits == 8:
        u = chunks.reshape(rows, -1, 32)
    else:
        nibbles = chunks[:, :, :4].reshape(rows, -1, 16)
        u = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)
        for i, bit in enumerate(range(4, fmt.bits)):
            plane = chunks[:, :, 4 + i]  # [rows, nb, 4 (j)]
            shifts = (np.arange(2)[:, None] * 4 + np.arange(4)[None, :]).astype(np.uint8)  # [half, c]
            b = plane[:, :, None, None, :] >> shifts[None, None, :, :, None] & 1  # [rows, nb, half, c, j]
            u = u | (b.reshape(rows, -1, 32) << bit)
    half = np.float16
    return Decoded(
        u,
        d.view(half),
        None if m is None else m.view(half),
        None if sc is None else sc.view(np.int8 if fmt.scales == "halves" else np.uint8),
        sm,
    )
