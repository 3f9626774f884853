"""GGUF's block formats as the native kernels keep them: each block read into unsigned integers and scales,
then interleaved by groups of outputs (``cpu.cpp`` gives the layout), and back.

Every block format is an unsigned integer u per weight with w = scale · (u − offset) + minimum, per block of
32 columns. :func:`decode` reads GGUF blocks into those integers and scales; :func:`interleave` lays them
out for the kernels (values in chunks of 4 bytes per output lane: 8-bit values whole, the others as nibbles
plus one bit plane per bit above the fourth); :func:`deinterleave` undoes it and :func:`weights` gives the
float32 values with the same float operations as ``gguf``'s own dequantization (bit for bit, tested).

A K-quant's block scale is its super-block's float16 d times a small integer (6 bits, or int8 for Q6_K's
halves), exact in float32, so the kernels multiply by exactly the file's scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["BLOCK_FORMATS", "BlockFormat", "Decoded", "decode", "deinterleave", "interleave", "weights"]

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
    """Rows of a block-format matrix read into integers and scales (R rows, nb blocks, ns super-blocks).

    u: uint8 [R, nb, 32]; d: float16 [R, nb] ("block") or [R, ns]; m: float16 minimums [R, nb] ("block"),
    dmin [R, ns] ("super"), or None; sc: uint8 [R, nb] ("super"), int8 [R, nb, 2] ("halves"), or None; sm:
    uint8 [R, nb] ("super") or None."""

    u: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None
    sc: np.ndarray | None = None
    sm: np.ndarray | None = None

    def padded(self, rows: int) -> Decoded:
        """The same with zero rows (zero integers and scales) appended up to ``rows``."""

        def pad(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])

        return Decoded(
            pad(self.u), pad(self.d), *(None if a is None else pad(a) for a in (self.m, self.sc, self.sm))
        )


def _split(raw: np.ndarray, fmt: BlockFormat, sizes: list[int]) -> list[np.ndarray]:
    """raw uint8 [R, bytes per row] → its blocks' fields, each [R, blocks, size]."""
    block_bytes = GGML_QUANT_SIZES[fmt.ggml][1]
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)
    return np.split(blocks, np.cumsum(sizes)[:-1], axis=2)


def _halves(qs: np.ndarray) -> np.ndarray:
    """GGUF's nibbles [..., 16] (byte j: value j | value j + 16 << 4) → values [..., 32]."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bits: uint8 [..., count / 8] → 0/1 uint8 [..., count]."""
    return np.unpackbits(packed, axis=-1, count=count, bitorder="little")


def decode(fmt: BlockFormat, raw: np.ndarray) -> Decoded:
    """GGUF blocks of ``fmt`` (uint8 [R, bytes per row]) → integers and scales."""
    rows = raw.shape[0]
    half = np.float16
    if fmt.name == "q8_0":
        d, q = _split(raw, fmt, [2, 32])
        return Decoded((q.view(np.int8).astype(np.int16) + 128).astype(np.uint8), d.view(half)[..., 0])
    if fmt.name in ("q4_0", "q4_1"):
        parts = _split(raw, fmt, [2, 16] if fmt.name == "q4_0" else [2, 2, 16])
        m = parts[1].view(half)[..., 0] if fmt.minimum else None
        return Decoded(_halves(parts[-1]), parts[0].view(half)[..., 0], m)
    if fmt.name in ("q5_0", "q5_1"):
        parts = _split(raw, fmt, [2, 4, 16] if fmt.name == "q5_0" else [2, 2, 4, 16])
        m = parts[1].view(half)[..., 0] if fmt.minimum else None
        u = _halves(parts[-1]) | _bits(parts[-2], 32) << 4
        return Decoded(u, parts[0].view(half)[..., 0], m)
    if fmt.name in ("q4_k", "q5_k"):
        sizes = [2, 2, 12, 128] if fmt.name == "q4_k" else [2, 2, 12, 32, 128]
        parts = _split(raw, fmt, sizes)
        d, dmin, scales, qs = parts[0], parts[1], parts[2], parts[-1]
        ns = d.shape[1]
        a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
        sc = np.concatenate([a & 63, (c & 15) | (a >> 6) << 4], axis=-1)  # [R, ns, 8]
        sm = np.concatenate([b & 63, (c >> 4) | (b >> 6) << 4], axis=-1)
        # 4 runs of 64 columns: 32 bytes, low nibbles the first 32 columns, high nibbles the next
        nib = qs.reshape(rows, ns, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1) & 15
        u = nib.reshape(rows, ns * 8, 32)
        if fmt.name == "q5_k":  # bit 4 of column 32 j + l: bit j of qh[l]
            high = parts[3].reshape(rows, ns, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1) & 1
            u = u | (high.reshape(rows, ns * 8, 32) << 4)
        return Decoded(
            u, d.view(half)[..., 0], dmin.view(half)[..., 0], sc.reshape(rows, -1), sm.reshape(rows, -1)
        )
    if fmt.name == "q6_k":
        ql, qh, scales, d = _split(raw, fmt, [128, 64, 16, 2])
        ns = d.shape[1]
        # halves of 128 columns: 4 runs of 32, run k from ql[32 (k % 2) + l] >> 4 (k // 2), qh[l] >> 2 k
        low = ql.reshape(rows, ns, 2, 1, 2, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1, 1) & 15
        high = qh.reshape(rows, ns, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1) & 3
        u = low.reshape(rows, ns * 8, 32) | (high.reshape(rows, ns * 8, 32) << 4)
        sc = scales.view(np.int8).reshape(rows, ns * 8, 2)
        return Decoded(u, d.view(half)[..., 0], sc=sc)
    raise ValueError(f"no decoder for {fmt.name}")  # BLOCK_FORMATS holds only the formats above


def weights(fmt: BlockFormat, dec: Decoded) -> np.ndarray:
    """The float32 weights [R, nb · 32], computed as ``gguf``'s dequantization computes them."""
    rows, nb, _ = dec.u.shape
    u = dec.u.astype(np.float32)  # [R, nb, 32]
    f32 = np.float32
    if fmt.scales == "block":
        d = dec.d.astype(f32)[..., None]
        w = d * (u - f32(fmt.offset)) if dec.m is None else d * u + dec.m.astype(f32)[..., None]
    elif fmt.scales == "super":
        assert dec.m is not None and dec.sc is not None and dec.sm is not None
        d = np.repeat(dec.d.astype(f32), 8, axis=1) * dec.sc.astype(f32)  # [R, nb]: exact
        dm = np.repeat(dec.m.astype(f32), 8, axis=1) * dec.sm.astype(f32)
        w = d[..., None] * u - dm[..., None]
    else:
        assert dec.sc is not None
        d = np.repeat(dec.d.astype(f32), 8, axis=1)[..., None] * dec.sc.astype(f32)  # [R, nb, 2]
        w = (d[..., None] * (u - f32(fmt.offset)).reshape(rows, nb, 2, 16)).reshape(rows, nb, 32)
    return w.reshape(rows, nb * QK).astype(f32)


def _lanes(x: np.ndarray, group: int, axis: int) -> np.ndarray:
    """x [G · group, ...] (rows first) → [G, ...] with the group's lanes moved to ``axis`` of the rest."""
    grouped = x.reshape(x.shape[0] // group, group, *x.shape[1:])
    return np.ascontiguousarray(np.moveaxis(grouped, 1, axis))


def _planes(u: np.ndarray, bit: int) -> np.ndarray:
    """The chunk of bit ``bit`` of u [R, nb, 32]: byte j (of 4) holds it for column 4 c + j at bit c and for
    column 16 + 4 c + j at bit 4 + c, c = 0 .. 3 → [R, nb, 1, 4]."""
    b = (u >> bit & 1).reshape(*u.shape[:2], 2, 4, 4)  # [R, nb, half, c, j]
    shifts = (np.arange(2)[:, None] * 4 + np.arange(4)[None, :]).astype(np.uint8)  # [half, c]
    return (b << shifts[None, None, :, :, None]).sum(axis=(2, 3), dtype=np.uint8)[:, :, None, :]


def interleave(fmt: BlockFormat, dec: Decoded, group: int) -> tuple[np.ndarray | None, ...]:
    """The kernels' arrays (values, d, m, sc, sm; None where the format has none) of rows a multiple of
    ``group`` (padding rows: zero scales)."""
    u = dec.u
    if fmt.bits == 8:
        chunks = u.reshape(*u.shape[:2], 8, 4)
    else:
        nibbles = (u[..., :16] & 15) | (u[..., 16:] & 15) << 4  # [R, nb, 16]
        parts = [nibbles.reshape(*u.shape[:2], 4, 4)] + [_planes(u, bit) for bit in range(4, fmt.bits)]
        chunks = np.concatenate(parts, axis=2)  # [R, nb, chunks, 4]
    values = _lanes(chunks, group, -2)  # [G, nb, chunks, group, 4]

    def scales(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else _lanes(x.view(np.uint8) if x.dtype == np.int8 else x, group, -1)

    d = _lanes(dec.d.view(np.int16), group, -1)
    m = None if dec.m is None else _lanes(dec.m.view(np.int16), group, -1)
    return values, d, m, scales(dec.sc), scales(dec.sm)


def deinterleave(fmt: BlockFormat, arrays: tuple[np.ndarray | None, ...], rows: int) -> Decoded:
    """:func:`interleave` undone: the first ``rows`` rows' integers and scales."""
    values, d, m, sc, sm = arrays

    def rows_of(x: np.ndarray, axis: int) -> np.ndarray:  # [G, ..., lanes at axis, ...] → [rows, ...]
        lanes = np.moveaxis(x, axis, 1)
        return lanes.reshape(-1, *lanes.shape[2:])[:rows]

    assert values is not None and d is not None
    chunks = rows_of(values, -2)  # [rows, nb, chunks, 4]
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
        rows_of(d, -1).view(half),
        None if m is None else rows_of(m, -1).view(half),
        None if sc is None else rows_of(sc, -1).view(np.int8 if fmt.scales == "halves" else np.uint8),
        None if sm is None else rows_of(sm, -1),
    )
