"""Python side of the native CPU kernels (``cpu.cpp``): weight packing, and the calls into the library.

Weight formats (:data:`FORMATS`), each a matrix W [rows, cols] multiplied as y = x Wᵀ (+ bias) with float32
x and y:

- ``fp16``: W rounded to float16; products and sums in float32.
- ``q8_0``: GGUF's Q8_0 blocks (per row and block of 32 columns, int8 values and a float16 scale); x is
  quantized the same way, row by row (per row and block: scale max|x| / 127, values rounded to nearest
  even), and the block dot products are exact integer sums.
- ``q4_1``: GGUF's Q4_1 blocks (4-bit values, a float16 scale and a float16 minimum per block of 32) against
  x quantized as for ``q8_0``.

Quantization uses the ``gguf`` package's reference implementation, so a matrix that came from a GGUF file of
that format is recovered block for block (tested). The kernels keep the blocks' values interleaved by groups
of outputs (one vector lane per output; ``cpu.cpp`` gives the layout); :meth:`PackedMatrix.blocks` gives the
GGUF blocks back. Every output element depends on its own row of x alone: activations are quantized per
row, never with a scale shared across a call.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from torch import Tensor

from verispec.errors import UsageError
from verispec.kernels import formats
from verispec.kernels.build import NativeUnavailable, load
from verispec.kernels.formats import BLOCK_FORMATS
from verispec.kernels.threads import THREADS

__all__ = [
    "ACTIVATIONS",
    "BLOCK",
    "FORMATS",
    "DraftHead",
    "GGUF_TYPES",
    "KERNEL_FORMATS",
    "NativeLayer",
    "NativeStack",
    "PackedMatrix",
    "Projection",
    "native_available",
    "quantize_rows",
    "rmsnorm",
    "stacked",
]

FORMATS = ("fp16", "q8_0", "q4_1")  # what a float32 matrix is packed in (PackedMatrix.pack)
KERNEL_FORMATS = ("fp16", "f32", *BLOCK_FORMATS)  # every format the products multiply
BLOCK = 32  # columns per quantization block
_CODES = {"fp16": 1, "f32": 10} | {name: f.code for name, f in BLOCK_FORMATS.items()}
# GGUF tensor types a matrix may be stored in, and the kernels' format each becomes (PackedMatrix.from_gguf)
GGUF_TYPES = {"F32": "f32", "BF16": "f32", "F16": "fp16"} | {f.ggml.name: n for n, f in BLOCK_FORMATS.items()}

_p = ctypes.c_void_p


class _Matrix(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
        ("q", _p),
        ("d", _p),
        ("m", _p),
        ("sc", _p),
        ("sm", _p),
        ("bias", _p),
    ]


_STACK = 3  # matrices a projection may stack (VS_STACK)


class _Stack(ctypes.Structure):
    _fields_ = [("count", ctypes.c_int32), ("part", _Matrix * _STACK)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _p),
        ("mlp_norm", _p),
        ("qkv", _Stack),
        ("o", _Matrix),
        ("gate_up", _Stack),
        ("down", _Matrix),
        ("q_norm", _p),
        ("k_norm", _p),
        ("post_attn_norm", _p),
        ("post_mlp_norm", _p),
        ("window", ctypes.c_int32),
        ("local_rope", ctypes.c_int32),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
        ("activation", ctypes.c_int32),
        ("layers", ctypes.POINTER(_Layer)),
    ]


class _Batch(ctypes.Structure):
    _fields_ = [
        ("n", ctypes.c_int32),
        ("cos", _p),
        ("sin", _p),
        ("seq", _p),
        ("slot", _p),
        ("base", _p),
        ("mask", _p),
        ("mask_cols", ctypes.c_int32),
        ("pos", _p),
        ("cos_local", _p),
        ("sin_local", _p),
    ]


class _Cache(ctypes.Structure):
    _fields_ = [("k", _p), ("v", _p), ("batch", ctypes.c_int32), ("capacity", ctypes.c_int32)]


@cache
def _library(variant: str = "native") -> ctypes.CDLL:
    """The loaded library with its functions' signatures declared (NativeUnavailable when it cannot be)."""
    lib = load(variant)
    i32 = ctypes.c_int
    lib.vs_matmul.argtypes = [ctypes.POINTER(_Matrix), i32, _p, _p, i32]
    lib.vs_matmul.restype = i32
    lib.vs_rmsnorm.argtypes = [i32, i32, _p, _p, ctypes.c_float, _p, i32]
    lib.vs_rmsnorm.restype = None
    lib.vs_quantize_rows.argtypes = [i32, i32, _p, _p, _p, _p, _p, _p]
    lib.vs_quantize_rows.restype = None
    lib.vs_forward.argtypes = [
        ctypes.POINTER(_Model),
        i32,
        i32,
        ctypes.POINTER(_Batch),
        ctypes.POINTER(_Cache),
        _p,
        i32,
    ]
    lib.vs_forward.restype = i32
    matrix, batch, kv = ctypes.POINTER(_Matrix), ctypes.POINTER(_Batch), ctypes.POINTER(_Cache)
    head: list[Any] = [ctypes.POINTER(_Model), matrix, _p, matrix]  # both drafts' first
    lib.vs_draft.argtypes = [*head, _p, _p, batch, kv, _p, i32, _p, _p, i32]
    lib.vs_draft.restype = i32
    lib.vs_draft_greedy.argtypes = [*head, _p, _p, i32, _p, _p, _p, _p, _p, _p, _p, kv, _p, i32]
    lib.vs_draft_greedy.restype = i32
    lib.vs_repack.argtypes = [ctypes.POINTER(_Matrix), _p, ctypes.c_size_t, i32]
    lib.vs_repack.restype = i32
    lib.vs_group_size.argtypes = []
    lib.vs_group_size.restype = i32
    return lib


def native_available() -> str | None:
    """None when the native kernels run on this machine, else why not (one line)."""
    try:
        _library()
    except NativeUnavailable as err:
        return str(err)
    return None


def _check_float_rows(x: Tensor, cols: int, what: str) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.ndim != 2 or x.shape[1] != cols:
        raise UsageError(f"{what} must be a float32 CPU tensor [n, {cols}], got {x.dtype} {list(x.shape)}")


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True, eq=False)
class PackedMatrix:
    """A weight matrix W [rows, cols] in one of :data:`KERNEL_FORMATS`, ready for the native kernels.

    tensors: what the kernels read, kept alive here: fp16 (W as int16 bits [rows, cols]); f32 (W [rows,
    cols]); a block format in the kernels' interleaved layout for groups of ``group`` outputs (values, scales
    as int16 bits, minimums, K-quants' integer scales and minimums; None where the format has none), rows
    padded to a multiple of ``group`` (:mod:`verispec.kernels.formats`)."""

    format: str
    rows: int
    cols: int
    tensors: tuple[Tensor | None, ...]
    bias: Tensor | None
    group: int
    variant: str = "native"  # the build of the kernels it runs on (verispec.kernels.build.VARIANTS)
    struct: _Matrix = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pointers = [_ptr(t) for t in self.tensors] + [None] * (5 - len(self.tensors))
        struct = _Matrix(_CODES[self.format], self.rows, self.cols, *pointers, _ptr(self.bias))
        object.__setattr__(self, "struct", struct)

    @staticmethod
    def fits(format: str, cols: int) -> bool:
        """Whether a matrix of ``cols`` columns has a ``format`` form (block formats need cols % 32 == 0, the
        K-quants cols % 256 == 0)."""
        return format not in BLOCK_FORMATS or cols % BLOCK_FORMATS[format].columns == 0

    @classmethod
    def pack(
        cls, weight: Tensor, bias: Tensor | None = None, format: str = "fp16", variant: str = "native"
    ) -> PackedMatrix:
        """W [rows, cols] (float32) and its bias [rows] (or None) in ``format`` (:data:`FORMATS`); UsageError
        for an unknown format or a shape it cannot hold."""
        if format not in FORMATS:
            raise UsageError(f"weight format must be one of {', '.join(FORMATS)}, got {format!r}")
        if weight.ndim != 2 or weight.dtype != torch.float32:
            raise UsageError(f"weight must be a float32 matrix, got {weight.dtype} {list(weight.shape)}")
        rows, cols = weight.shape
        if not cls.fits(format, cols):
            raise UsageError(f"format {format} needs a multiple of {BLOCK} columns, got {cols}")
        bias = None if bias is None else bias.detach().float().contiguous()  # [rows]
        w = weight.detach().contiguous()  # [rows, cols]
        if format == "fp16":
            return cls(format, rows, cols, (w.half().view(torch.int16),), bias, 1, variant)
        blocks = quants.quantize(w.numpy(), BLOCK_FORMATS[format].ggml)  # uint8 [rows, bytes per row]
        return cls.from_blocks(format, rows, cols, blocks, bias, variant)

    @classmethod
    def from_blocks(
        cls,
        format: str,
        rows: int,
        cols: int,
        blocks: np.ndarray,
        bias: Tensor | None = None,
        variant: str = "native",
    ) -> PackedMatrix:
        """From GGUF blocks of the block format ``format`` (uint8 [rows, bytes per row], as a GGUF file stores
        them; a view of a memory-mapped file is read in place), repacked by the kernels on every thread."""
        fmt, lib = BLOCK_FORMATS[format], _library(variant)
        group, nb = lib.vs_group_size(), cols // BLOCK
        groups, per = -(-rows // group), nb if fmt.scales == "block" else nb // 8  # scales per lane

        def zeros(*shape: int, dtype: torch.dtype = torch.uint8) -> Tensor:
            return torch.zeros(groups, *shape, group, dtype=dtype)  # padding rows: zero scales

        tensors = (
            torch.zeros(groups, nb, fmt.chunks, group, 4, dtype=torch.uint8),  # values, interleaved
            zeros(per, dtype=torch.int16),  # d: float16 bits
            zeros(per, dtype=torch.int16) if fmt.minimum else None,  # m or dmin: float16 bits
            None if fmt.scales == "block" else zeros(nb, 2) if fmt.scales == "halves" else zeros(nb),  # sc
            zeros(nb) if fmt.scales == "super" else None,  # sm
        )
        matrix = cls(format, rows, cols, tensors, bias, group, variant)
        raw = np.ascontiguousarray(blocks, dtype=np.uint8)  # [rows, bytes per row]
        if lib.vs_repack(ctypes.byref(matrix.struct), raw.ctypes.data, raw.shape[1], torch.get_num_threads()):
            raise UsageError(f"{format} has no blocks to repack")
        return matrix

    @classmethod
    def from_gguf(
        cls,
        type_name: str,
        rows: int,
        cols: int,
        data: np.ndarray,
        bias: Tensor | None = None,
        variant: str = "native",
    ) -> PackedMatrix:
        """A matrix W [rows, cols] as a GGUF file stores it: ``type_name`` (a GGUF tensor type's name, one of
        :data:`GGUF_TYPES`) and ``data``, its raw bytes (uint8 [rows, bytes per row], e.g. a view of the
        memory-mapped file, read and never written). UsageError naming the type and the supported ones when
        there is no kernel for it, or when ``data`` does not hold such a matrix."""
        if type_name not in GGUF_TYPES:
            raise UsageError(
                f"no native kernel for GGUF tensor type {type_name}; supported: {', '.join(GGUF_TYPES)}"
            )
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        if cols % block or data.dtype != np.uint8 or data.shape != (rows, cols // block * size):
            raise UsageError(
                f"a {type_name} matrix [{rows}, {cols}] is uint8 [{rows}, {cols // block * size}], got "
                f"{data.dtype} {list(data.shape)}"
            )
        format = GGUF_TYPES[type_name]
        if format in BLOCK_FORMATS:
            if not cls.fits(format, cols):
                raise UsageError(f"{type_name} needs a multiple of {BLOCK_FORMATS[format].columns} columns")
            return cls.from_blocks(format, rows, cols, data, bias, variant)
        if type_name == "F16":
            weight = torch.from_numpy(np.array(data).view(np.int16))  # [rows, cols] float16 bits, a copy
        elif type_name == "BF16":  # bfloat16 is float32's upper half: exact
            bits = np.asarray(data).view(np.uint16).astype(np.uint32) << 16  # [rows, cols]
            weight = torch.from_numpy(bits.view(np.float32))
        else:
            weight = torch.from_numpy(np.array(data).view(np.float32))  # [rows, cols], a copy
        return cls(format, rows, cols, (weight,), bias, 1, variant)

    def select(self, ids: Tensor) -> PackedMatrix:
        """The matrix of the rows ``ids`` [n] (int64) of this one, W[ids] [n, cols] (and its bias), in this
        format and layout: each row's values and scales copied as they lie (a block format's from its lane of
        a group, padding lanes zero), so that its products are this matrix's for that row, bit for bit, at
        n / rows of the cost (an output head's rows for a draft vocabulary)."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if ids.ndim != 1 or (ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.rows):
            raise UsageError(f"row ids must be one-dimensional, in [0, {self.rows})")
        bias = None if self.bias is None else self.bias[ids].contiguous()  # [n]
        n, group = ids.numel(), self.group
        groups = -(-n // group)

        def rows_of(t: Tensor, axis: int) -> Tensor:  # t [groups, ..., group (its lane axis), ...]
            lane = axis % t.ndim
            index: tuple[Tensor | slice, ...] = (ids // group, *[slice(None)] * (lane - 1), ids % group)
            picked = t[index]  # [n, the other axes]
            out = picked.new_zeros(groups * group, *picked.shape[1:])
            out[:n] = picked
            return out.reshape(groups, group, *picked.shape[1:]).movedim(1, lane).contiguous()

        if self.format not in BLOCK_FORMATS:  # fp16, f32: W [rows, cols] as it is
            weight = self.tensors[0]
            assert weight is not None
            tensors: tuple[Tensor | None, ...] = (weight[ids].contiguous(),)
        else:  # each array's lanes as formats.LANE_AXES lays them out
            tensors = tuple(
                None if t is None else rows_of(t, axis)
                for t, axis in zip(self.tensors, formats.LANE_AXES, strict=True)
            )
        return PackedMatrix(self.format, n, self.cols, tensors, bias, group, self.variant)

    def blocks(self) -> np.ndarray:
        """The GGUF blocks of a q8_0 or q4_1 matrix (uint8 [rows, cols / 32 * bytes per block]), as
        :meth:`from_blocks` takes them: what a GGUF file of that format stores."""
        if self.format not in ("q8_0", "q4_1"):
            raise UsageError(f"only q8_0 and q4_1 matrices give their blocks back, not {self.format}")
        dec = self._decoded()
        half = [dec.d.view(np.uint8).reshape(self.rows, -1, 2)]
        if self.format == "q8_0":
            q = (dec.u.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
            parts = [*half, q]
        else:
            assert dec.m is not None
            nibbles = dec.u[..., :16] | dec.u[..., 16:] << 4
            parts = [*half, dec.m.view(np.uint8).reshape(self.rows, -1, 2), nibbles]
        return np.concatenate(parts, axis=2).reshape(self.rows, -1)

    def _decoded(self) -> formats.Decoded:
        arrays = tuple(None if t is None else t.numpy() for t in self.tensors)
        return formats.deinterleave(BLOCK_FORMATS[self.format], arrays, self.rows)

    def dequantized(self) -> Tensor:
        """The float32 weight [rows, cols] the kernels multiply by (for oracles, tests and repacking):
        a block format's values as ``gguf`` dequantizes its blocks, bit for bit."""
        weight = self.tensors[0]
        assert weight is not None
        if self.format == "fp16":
            return weight.view(torch.float16).float()
        if self.format == "f32":
            return weight.clone()
        return torch.from_numpy(formats.weights(BLOCK_FORMATS[self.format], self._decoded()))

    def __call__(self, x: Tensor) -> Tensor:
        """y [n, rows] = x [n, cols] Wᵀ (+ bias), x float32 on the CPU."""
        _check_float_rows(x, self.cols, "x")
        x = x.contiguous()
        y = x.new_empty(x.shape[0], self.rows)  # [n, rows]
        status = _library(self.variant).vs_matmul(
            ctypes.byref(self.struct), x.shape[0], x.data_ptr(), y.data_ptr(), THREADS.count()
        )
        if status:
            raise MemoryError("the native matmul ran out of memory")
        return y


def quantize_rows(x: Tensor, variant: str = "native") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [n, cols] (cols % 32 == 0) quantized as the block formats' products quantize their input: int8
    values [n, cols], scales d [n, cols / 32], d · Σ values, Σ values and Σ of each block's first 16 values
    per block [n, cols / 32]."""
    if x.ndim != 2 or x.shape[1] % BLOCK:
        raise UsageError(f"x must be [n, cols] with cols a multiple of {BLOCK}, got {list(x.shape)}")
    _check_float_rows(x, x.shape[1], "x")
    x = x.contiguous()
    n, cols = x.shape
    q = torch.empty(n, cols, dtype=torch.int8)  # [n, cols]
    d, s = torch.empty(n, cols // BLOCK), torch.empty(n, cols // BLOCK)  # [n, cols / 32] each
    sums, lo = (torch.empty(n, cols // BLOCK, dtype=torch.int32) for _ in range(2))  # [n, cols / 32] each
    _library(variant).vs_quantize_rows(
        n, cols, x.data_ptr(), q.data_ptr(), d.data_ptr(), s.data_ptr(), sums.data_ptr(), lo.data_ptr()
    )
    return q, d, s, sums, lo


def rmsnorm(x: Tensor, weight: Tensor, eps: float, variant: str = "native") -> Tensor:
    """x [n, dim] / rms(x) · weight [dim], as the native forward normalises."""
    _check_float_rows(x, weight.shape[0], "x")
    x, weight = x.contiguous(), weight.float().contiguous()
    y = torch.empty_like(x)  # [n, dim]
    lib = _library(variant)
    lib.vs_rmsnorm(
        x.shape[0], x.shape[1], x.data_ptr(), weight.data_ptr(), eps, y.data_ptr(), THREADS.count()
    )
    return y


Projection = PackedMatrix | tuple[PackedMatrix, ...]  # matrices of one input, their outputs side by side
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's activation of its gate (VS_SILU, VS_GELU_TANH)


def stacked(projection: Projection) -> tuple[PackedMatrix, ...]:
    """The matrices of a projection, in output order."""
    return projection if isinstance(projection, tuple) else (projection,)


@dataclass(frozen=True)
class NativeLayer:
    """One decoder layer's weights for the native forward: the two norms' weights [hidden] and the packed
    projections (q, k, v one matrix or three; gate and up one or two, each in its own format); optionally
    Qwen3's and Gemma 3's per-head q/k norms [head_dim], Gemma 3's norms of the attention's and the MLP's
    outputs [hidden], a sliding window (the last ``window`` positions; 0: all) and the batch's local RoPE."""

    attn_norm: Tensor
    mlp_norm: Tensor
    qkv: Projection
    o: PackedMatrix
    gate_up: Projection
    down: PackedMatrix
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    post_attn_norm: Tensor | None = None
    post_mlp_norm: Tensor | None = None
    window: int = 0
    local_rope: bool = False

    def matrices(self) -> tuple[PackedMatrix, ...]:
        """Every matrix of the layer."""
        return (*stacked(self.qkv), self.o, *stacked(self.gate_up), self.down)


_VECTORS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")


def _stack(projection: Projection) -> _Stack:
    parts = stacked(projection)
    if not 0 < len(parts) <= _STACK:
        raise UsageError(f"a projection stacks 1 to {_STACK} matrices, got {len(parts)}")
    return _Stack(len(parts), (_Matrix * _STACK)(*(m.struct for m in parts)))


class NativeStack:
    """A stack of decoder layers run by ``vs_forward``: RMSNorm, q/k/v (q/k norms), RoPE, grouped-query
    attention over a KV cache (sliding windows), a gated MLP (SwiGLU or GELU-tanh), residuals (post-norms);
    one call for all layers. attn_scale: the scores' scale (default 1 / sqrt(head_dim)). measured: whether
    its forwards' times go to :data:`~verispec.kernels.threads.THREADS`, which picks the thread count by the
    target's forwards (a learned drafter's stack, far cheaper per token, is not measured, nor a self-draft's
    requantized stack, nor a forward over only the first layers: an early exit's draft)."""

    def __init__(
        self,
        *,
        hidden: int,
        intermediate: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        layers: Sequence[NativeLayer],
        variant: str = "native",
        attn_scale: float | None = None,
        activation: str = "silu",
        measured: bool = True,
    ) -> None:
        if activation not in ACTIVATIONS:
            raise UsageError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        self.layers = tuple(layers)
        self.head_dim = head_dim
        self.variant = variant
        self.measured = measured
        self._lib = _library(variant)
        array = (_Layer * len(self.layers))()
        for i, layer in enumerate(self.layers):
            for name in _VECTORS:  # float32, contiguous, kept alive by the layer
                vector = getattr(layer, name)
                if vector is not None:
                    object.__setattr__(layer, name, vector.float().contiguous())
            array[i] = _Layer(
                layer.attn_norm.data_ptr(),
                layer.mlp_norm.data_ptr(),
                _stack(layer.qkv),
                layer.o.struct,
                _stack(layer.gate_up),
                layer.down.struct,
                *(_ptr(getattr(layer, name)) for name in _VECTORS[2:]),
                layer.window,
                int(layer.local_rope),
            )
        self._array = array
        scale = head_dim**-0.5 if attn_scale is None else attn_scale
        self._settings: dict[str, Any] = dict(hidden=hidden, intermediate=intermediate, heads=heads)
        self._settings |= dict(kv_heads=kv_heads, head_dim=head_dim, eps=eps, variant=variant)
        self._settings |= dict(attn_scale=scale, activation=activation, measured=measured)
        self._model = _Model(
            hidden,
            intermediate,
            heads,
            kv_heads,
            head_dim,
            len(self.layers),
            eps,
            scale,
            ACTIVATIONS.index(activation),
            array,
        )

    def replaced(self, layers: Sequence[NativeLayer]) -> NativeStack:
        """A stack of the same architecture with other layers (a self-draft's requantized ones), not measured
        (its forwards cost another amount than the target's)."""
        return NativeStack(layers=layers, **(self._settings | {"measured": False}))

    @property
    def precision(self) -> str:
        """The format of its matrices, or of each kind where they differ, sorted and joined by "+"."""
        return "+".join(sorted({m.format for layer in self.layers for m in layer.matrices()}))

    def forward(
        self,
        h: Tensor,
        *,
        num_layers: int,
        cos: Tensor,
        sin: Tensor,
        seq: Tensor,
        slot: Tensor,
        base: Tensor,
        mask: Tensor | None,
        keys: Tensor,
        values: Tensor,
        pos: Tensor | None = None,
        cos_local: Tensor | None = None,
        sin_local: Tensor | None = None,
        first_layer: int = 0,
    ) -> None:
        """Runs the first ``num_layers`` layers over the residual stream h [N, hidden] float32 in place (from
        ``first_layer`` on: the layers before it ran already, a forward in parts).

        cos, sin: [N, head_dim / 2] float32 RoPE at each token's position; seq, slot, base: [N] int32, token i
        writes slot[i] of cache row seq[i] and attends to that row's slots [0, base[i]) and to its new slots
        base[i] + j with mask[i, j] (mask [N, M] bool; None: slots base[i] .. slot[i]); keys [layers, B,
        kv_heads, capacity / 16, head_dim, 16] and values [layers, B, kv_heads, capacity, head_dim], float16,
        contiguous (a tiled :class:`~verispec.models.kv_cache.KVCache`). Sliding-window layers read pos [N]
        int32, each token's position; local-RoPE layers cos_local and sin_local [N, head_dim / 2] float32.
        The caller has checked every index."""
        batch = _Batch(
            h.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            seq.data_ptr(),
            slot.data_ptr(),
            base.data_ptr(),
            None if mask is None else mask.data_ptr(),
            0 if mask is None else mask.shape[1],
            _ptr(pos),
            _ptr(cos_local),
            _ptr(sin_local),
        )
        start = time.perf_counter()
        status = self._lib.vs_forward(
            ctypes.byref(self._model),
            first_layer,
            num_layers,
            ctypes.byref(batch),
            ctypes.byref(_cache(keys, values)),
            h.data_ptr(),
            THREADS.count(),
        )
        if self.measured and first_layer == 0 and num_layers == len(self.layers):  # an early exit's: drafts
            THREADS.record(h.shape[0], time.perf_counter() - start)
        _check_status(status, "forward")

    def draft(
        self,
        head: DraftHead,
        *,
        inputs: Tensor,
        features: Tensor,
        cos: Tensor,
        sin: Tensor,
        seq: Tensor,
        slot: Tensor,
        base: Tensor,
        keys: Tensor,
        values: Tensor,
        picks: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """A learned draft head's forward over N tokens in one call (``vs_draft``): [inputs, features]
        through the head's fc (2·hidden → hidden), every layer (causally, as :meth:`forward` without a
        mask) and its norm → (f̂ [N, hidden], the draft logits [P, head rows] of the rows ``picks`` [P]
        int32, or None without picks): bit for bit the products, layers and norm called one by one. inputs
        [N, hidden] float32: the tokens' embeddings; features [N, hidden] float32; the rest as
        :meth:`forward`'s (the caller has checked every index)."""
        n, inputs, features = inputs.shape[0], inputs.contiguous(), features.contiguous()
        batch = _Batch(n, cos.data_ptr(), sin.data_ptr(), seq.data_ptr(), slot.data_ptr(), base.data_ptr())
        out = features.new_empty(n, self._model.hidden)  # [N, hidden]
        count = 0 if picks is None else picks.shape[0]
        logits = None if picks is None else features.new_empty(count, head.rows.rows)  # [P, head rows]
        status = self._lib.vs_draft(
            *self._draft_head(head),
            inputs.data_ptr(),
            features.data_ptr(),
            ctypes.byref(batch),
            ctypes.byref(_cache(keys, values)),
            out.data_ptr(),
            count,
            _ptr(picks),
            _ptr(logits),
            THREADS.count(),
        )
        _check_status(status, "draft forward")
        return out, logits

    def draft_greedy(
        self,
        head: DraftHead,
        *,
        inputs: Tensor,
        features: Tensor,
        seq: Tensor,
        slot: Tensor,
        steps: Tensor,
        cos: Tensor,
        sin: Tensor,
        keys: Tensor,
        values: Tensor,
    ) -> Tensor:
        """Greedy drafting of N rows in one call (``vs_draft_greedy``): row i reads inputs[i] (its token's
        embedding, [N, hidden] float32) and features[i] [N, hidden] at slot[i] of cache row seq[i] (int32 [N]
        each), then steps[i] − 1 more tokens (steps int32 [N], each ≥ 1), each the argmax of the step before
        (embedded by ``head.vocab_rows``, drafted as its ``head.ids``), with that step's predicted feature at
        the next slot: the drafts [N, S] int64 (S = max steps; row i's first steps[i]). cos, sin: [N, S,
        head_dim / 2] float32, each row's steps' RoPE. Each step as :meth:`draft`."""
        n, most = inputs.shape[0], int(steps.max())
        # held here: a temporary's memory would be freed before the kernels read it
        inputs, features = inputs.contiguous(), features.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        drafts = torch.zeros(n, most, dtype=torch.int64)  # [N, S]
        status = self._lib.vs_draft_greedy(
            *self._draft_head(head),
            head.vocab_rows.data_ptr(),
            head.ids.data_ptr(),
            n,
            inputs.data_ptr(),
            features.data_ptr(),
            seq.data_ptr(),
            slot.data_ptr(),
            steps.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            ctypes.byref(_cache(keys, values)),
            drafts.data_ptr(),
            THREADS.count(),
        )
        _check_status(status, "greedy draft")
        return drafts

    def _draft_head(self, head: DraftHead) -> tuple[object, ...]:
        """The arguments both drafts start with: the stack, the head's fc, norm and rows."""
        return (
            ctypes.byref(self._model),
            ctypes.byref(head.fc.struct),
            head.norm.data_ptr(),
            ctypes.byref(head.rows.struct),
        )


@dataclass(frozen=True)
class DraftHead:
    """What a learned draft head adds to its stack for :meth:`NativeStack.draft`: fc (2·hidden → hidden,
    its bias), the output norm's weight [hidden] float32, the draft vocabulary's head rows [Vd, hidden],
    each draft logit's token id ``ids`` [Vd] int64 and that token's embedding ``vocab_rows`` [Vd, hidden]
    float32 (what a greedy draft's next step reads: the draft vocabulary's rows alone, never the whole
    embedding); all contiguous."""

    fc: PackedMatrix
    norm: Tensor
    rows: PackedMatrix
    ids: Tensor
    vocab_rows: Tensor

    def __post_init__(self) -> None:
        for name, dtype in (("norm", torch.float32), ("ids", torch.int64), ("vocab_rows", torch.float32)):
            t = getattr(self, name)
            if t.dtype != dtype or not t.is_contiguous():
                raise UsageError(f"a draft head's {name} must be contiguous {dtype}, got {t.dtype}")
        if self.vocab_rows.shape != (self.rows.rows, self.rows.cols) or self.ids.shape != (self.rows.rows,):
            raise UsageError("a draft head's ids and vocab_rows must have one entry per head row")


def _cache(keys: Tensor, values: Tensor) -> _Cache:
    """A tiled cache's keys and values as the kernels read them (see :meth:`NativeStack.forward`)."""
    return _Cache(keys.data_ptr(), values.data_ptr(), values.shape[1], values.shape[3])


def _check_status(status: int, what: str) -> None:
    if status == -2:
        raise MemoryError(f"the native {what} ran out of memory")
    if status:
        raise RuntimeError(f"the native {what} rejected its arguments (a bug: please report it)")
