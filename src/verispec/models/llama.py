"""A native Llama-family causal language model in plain PyTorch, on a preallocated KV cache rolled back by
moving its length (:mod:`verispec.models.kv_cache`).

Covers the decoder-only models built from RMSNorm, rotary position embeddings (the transformers "rotate_half"
layout), grouped-query attention and a SwiGLU MLP: Llama 1–3, SmolLM, TinyLlama, Mistral (within its sliding
window), Qwen2 (q/k/v biases) and llama2.c checkpoints (see :mod:`verispec.models.llama2c`).

Parameter names follow the transformers Llama layout (``model.layers.{i}.self_attn.q_proj.weight``, ...), so a
transformers checkpoint directory loads directly with :meth:`Llama.from_pretrained`.

On CPU, :meth:`Llama.optimize_for_cpu` moves the model onto a fast path so that a forward over a few new
tokens, the verification of a speculative block, costs little more than a forward over one: in float32
(``precision="fp32"``: oneDNN, every large projection pre-packed in place), or on verispec's native kernels
(:mod:`verispec.kernels`), the whole decoder stack in one call with the weights in float16, Q8_0 or Q4_1
blocks (``"fp16"``, ``"q8_0"``, ``"q4_1"``: 2, 1.06 or 0.63 bytes per weight to read per token). Every path
computes each row of a forward from that row alone (the native kernels bit for bit), so the target stays a
function of the prefix; the precision is part of the target's identity: exactness is with respect to the
target as configured.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.errors import UsageError
from verispec.inputs import check_int, is_int
from verispec.kernels.cpu import (
    FORMATS,
    NativeLayer,
    NativeStack,
    PackedMatrix,
    native_available,
    rmsnorm,
    stacked,
)
from verispec.models.base import Cache, RowInput
from verispec.models.kv_cache import KVCache, advance_rows, native_rows, rows_of_one_cache
from verispec.models.llama_config import LlamaConfig

__all__ = [
    "PRECISIONS",
    "PRECISION_CHOICES",
    "Llama",
    "available_precisions",
    "check_precision",
    "resolve_precision",
]

PRECISIONS = ("fp32", *FORMATS)  # the weight formats of the CPU fast path, most exact first
PRECISION_CHOICES = (*PRECISIONS, "auto")  # what a caller may ask for (see resolve_precision)
NATIVE_CHUNK = 64  # a longer prompt runs through the native kernels in blocks of this many tokens

# checkpoint entries that hold no weights (precomputed RoPE frequencies of older transformers versions)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class _Linear(nn.Module):
    """y = x Wᵀ (+ b), W [out, in]; after :meth:`pack`, W is held only in oneDNN's pre-packed layout."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, device: Any, dtype: torch.dtype
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        # weight: [out, in]; bias: [out] or None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, **kw), requires_grad=False) if bias else None
        self.packed = False  # whether the weight is in oneDNN's layout (else plain F.linear)
        self.native: PackedMatrix | None = None  # the weight on the native kernels (pack_native)

    def pack(self, batch_size: int) -> None:
        """Replace the weight by oneDNN's pre-packed float32 layout tuned for ``batch_size`` rows per call."""
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_size)  # [out, in] packed
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def release(self) -> None:
        """Drop the float32 weight (and bias): the native kernels hold their own form of it."""
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        self.bias = None if self.bias is None else nn.Parameter(self.bias.new_empty(0), requires_grad=False)

    def pack_native(self, format: str) -> None:
        """Hold the weight (and bias) only on the native kernels, in ``format`` where its width fits it
        (:func:`pack_fitting`); x is then float32 on the CPU."""
        self.native = pack_fitting(self.weight.detach().float(), self.bias, format)
        self.release()

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., in] → [..., out]."""
        if self.native is not None:
            flat = x.reshape(-1, self.native.cols).float()  # [N, in]
            return self.native(flat).view(*x.shape[:-1], self.native.rows)  # [..., out]
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _stacked(*parts: _Linear | None) -> _Linear:
    """One plain linear layer whose output is the outputs of ``parts`` side by side (their weight rows and
    biases stacked), on their device and dtype."""
    linears = [p for p in parts if p is not None]
    assert len(linears) == len(parts) and not any(p.packed for p in linears), "fuse once, before packing"
    weight = torch.cat([p.weight for p in linears])  # [sum of outs, in]
    first = linears[0]
    fused = _Linear(weight.shape[1], weight.shape[0], first.bias is not None, weight.device, weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in linears if p.bias is not None]))
    return fused


class _RMSNorm(nn.Module):
    """x / rms(x) · weight, normalising in float32 as transformers does."""

    def __init__(self, size: int, eps: float, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        weight = torch.empty(size, device=device, dtype=dtype)  # [size]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., size] → [..., size]."""
        h = x.float()  # [..., size]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., size]
        return self.weight * h.to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the rotate_half layout. x: [B, heads, T, head_dim]; cos, sin: [B, 1, T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [B, heads, T, head_dim]
    return x * cos + rotated * sin


class _Attention(nn.Module):
    """Grouped-query self-attention over the cached slots and the new tokens."""

    def __init__(self, config: LlamaConfig, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        kv, bias = config.num_kv_heads * d, config.attention_bias
        self.q_proj: _Linear | None = _Linear(h, config.num_heads * d, bias, device, dtype)
        self.k_proj: _Linear | None = _Linear(h, kv, bias, device, dtype)
        self.v_proj: _Linear | None = _Linear(h, kv, bias, device, dtype)
        self.o_proj = _Linear(config.num_heads * d, h, config.attention_out_bias, device, dtype)
        self.qkv_proj: _Linear | None = None  # q, k and v in one projection, after fuse()
        self.qkv_sizes = (config.num_heads * d, kv, kv)

    def fuse(self) -> None:
        """Compute q, k and v in one projection (their weights stacked): one kernel call instead of three,
        each output the same dot product of the same input. Irreversible."""
        self.qkv_proj = _stacked(self.q_proj, self.k_proj, self.v_proj)
        self.q_proj = self.k_proj = self.v_proj = None

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [B, T, hidden] → q [B, T, heads·head_dim], k and v [B, T, kv_heads·head_dim]."""
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
            return q, k, v
        assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        keys: Tensor,
        values: Tensor,
        start: int,
        mask: Tensor | None,
    ) -> Tensor:
        """x: [B, T, hidden]; cos, sin: [B, 1, T, head_dim]; keys, values: this layer's cache
        [B, kv_heads, capacity, head_dim], written at slots start .. start + T - 1; mask: [T, start + T] bool
        (True = attend), None when every new token may see every slot. Returns [B, T, hidden]."""
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, -1, self.head_dim).transpose(1, 2) for y in self._qkv(x))
        # q: [B, heads, T, head_dim]; k, v: [B, kv_heads, T, head_dim]
        end = start + t
        keys[:, :, start:end] = _rotate(k, cos, sin)
        values[:, :, start:end] = v
        # [B, heads, T, head_dim] attending to [B, kv_heads, end, head_dim]
        out = F.scaled_dot_product_attention(
            _rotate(q, cos, sin),
            keys[:, :, :end],
            values[:, :, :end],
            attn_mask=mask,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class _MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, config: LlamaConfig, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj: _Linear | None = _Linear(h, i, bias, device, dtype)
        self.up_proj: _Linear | None = _Linear(h, i, bias, device, dtype)
        self.down_proj = _Linear(i, h, bias, device, dtype)
        self.gate_up_proj: _Linear | None = None  # gate and up in one projection, after fuse()

    def fuse(self) -> None:
        """Compute gate and up in one projection (their weights stacked), as :meth:`_Attention.fuse`."""
        self.gate_up_proj = _stacked(self.gate_proj, self.up_proj)
        self.gate_proj = self.up_proj = None

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, T, hidden] → [B, T, hidden]."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B, T, intermediate] each
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class _DecoderLayer(nn.Module):
    """One pre-norm transformer block: attention then MLP, each added to the residual stream."""

    def __init__(self, config: LlamaConfig, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = _Attention(config, device, dtype)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = _MLP(config, device, dtype)


def attention_inputs(
    h: Tensor, positions: Tensor, cache: KVCache, inv_freq: Tensor, mask: Tensor | None
) -> tuple[int, int, Tensor, Tensor, Tensor | None]:
    """What a forward of the T tokens of h [B, T, ...] at ``positions`` [B, T] attends with: the slots it
    takes in ``cache`` (start, end; reserved), RoPE's cos and sin [B, 1, T, head_dim] in h's dtype (angles in
    float32, as transformers computes them) and its mask (``mask``, else causal: [T, end] bool, None for one
    token)."""
    t = h.shape[1]
    start, end = cache._reserve(t)
    freqs = positions[..., None].float() * inv_freq  # [B, T, head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, head_dim]
    cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)  # [B, 1, T, head_dim]
    if mask is None and t > 1:
        mask = torch.ones(t, end, dtype=torch.bool, device=h.device).tril(diagonal=start)  # [T, end]
    return start, end, cos, sin, mask


def run_layers(
    layers: Sequence[_DecoderLayer],
    h: Tensor,
    positions: Tensor,
    cache: KVCache,
    inv_freq: Tensor,
    mask: Tensor | None = None,
    taps: Sequence[int] = (),
    tapped: list[Tensor] | None = None,
) -> Tensor:
    """Run the residual stream h [B, T, hidden] through ``layers`` (layer i on the cache's layer i) at RoPE
    ``positions`` [B, T] int64, appending T slots to ``cache``; returns [B, T, hidden] before any final norm.

    inv_freq: [head_dim // 2] float32 RoPE inverse frequencies. mask: [T, cache.length + T] bool (True =
    attend); None: causal, new token i sees every committed slot and new tokens 0..i. taps: layers whose
    input (the residual stream entering them) is appended to ``tapped``, in order. Shared by
    :class:`Llama` and the learned drafters of :mod:`verispec.drafting.learned`."""
    start, end, cos, sin, mask = attention_inputs(h, positions, cache, inv_freq, mask)
    for i, layer in enumerate(layers):
        if i in taps and tapped is not None:
            tapped.append(h)
        x = layer.input_layernorm(h)  # [B, T, hidden]
        h = h + layer.self_attn(x, cos, sin, cache.keys[i], cache.values[i], start, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    cache._length = end
    return h


class _Body(nn.Module):
    """The transformer without its head; named ``model`` in :class:`Llama` to match transformers' names."""

    def __init__(self, config: LlamaConfig, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        weight = torch.empty(
            config.vocab_size, config.hidden_size, device=device, dtype=dtype
        )  # [vocab, hidden]
        # given its weight, nn.Embedding skips its random initialisation (a second of normal draws over a
        # large vocabulary, and torch._dynamo's import): every weight is loaded after construction
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(_DecoderLayer(config, device, dtype) for _ in range(config.num_layers))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)


def _checked_tree_mask(tree_mask: Tensor, t: int) -> Tensor:
    """tree_mask: [T, T] bool, each new token attending to itself; UsageError otherwise."""
    if tree_mask.shape != (t, t) or tree_mask.dtype != torch.bool:
        raise UsageError(
            f"tree_mask must be a [{t}, {t}] bool tensor, got {tree_mask.dtype} {list(tree_mask.shape)}"
        )
    if not bool(tree_mask.diagonal().all()):
        raise UsageError("tree_mask must let every new token attend to itself")
    return tree_mask


def pack_fitting(weight: Tensor, bias: Tensor | None, format: str) -> PackedMatrix:
    """W [rows, cols] float32 (and its bias [rows] or None) packed for the native kernels in ``format``, or in
    float16 where ``cols`` does not fit the format's blocks."""
    return PackedMatrix.pack(weight, bias, format if PackedMatrix.fits(format, weight.shape[1]) else "fp16")


def native_stack(
    config: LlamaConfig, layers: Sequence[_DecoderLayer], format: str, measured: bool = True
) -> NativeStack:
    """The decoder ``layers`` (of ``config``'s shape) on the native kernels, their projections in ``format``
    (:func:`pack_fitting`): q, k, v and gate, up fused, the float32 weights released. Irreversible.
    measured: see :class:`~verispec.kernels.cpu.NativeStack`."""
    packed = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.fuse()
        mlp.fuse()
        assert attn.qkv_proj is not None and mlp.gate_up_proj is not None
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        qkv, o, gate_up, down = (pack_fitting(p.weight, p.bias, format) for p in projections)
        for p in projections:
            p.release()
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        packed.append(NativeLayer(*norms, qkv, o, gate_up, down))
    return config.stack(packed, measured=measured)


def rope_tables(positions: Tensor, inv_freq: Tensor) -> dict[str, Tensor]:
    """The native forward's RoPE at ``positions`` [...] (flattened to N) for ``inv_freq`` [head_dim // 2]:
    cos and sin [N, head_dim // 2] float32, as transformers computes them."""
    freqs = positions.reshape(-1, 1).float() * inv_freq  # [N, head_dim // 2]
    return {"cos": freqs.cos(), "sin": freqs.sin()}


def run_native(
    stack: NativeStack,
    inputs: Tensor,
    cache: KVCache,
    num_layers: int,
    rope: dict[str, Tensor],
    norm: tuple[Tensor, float],
    base: int | None = None,
    mask: Tensor | None = None,
    taps: Sequence[int] = (),
) -> Tensor:
    """``num_layers`` layers of ``stack`` over inputs [B, T, H] float32 (RoPE tables ``rope`` at each
    token, :func:`rope_tables`), then the RMSNorm ``norm`` (its weight [H] and epsilon): [B, T, H]. Row b of
    the batch is row b of ``cache`` (a tiled one; of the whole cache for a row view), its T tokens at the next
    T slots; every token sees the slots before ``base`` (default: every committed one) and those from
    ``base`` on where ``mask`` [B·T, slots from base] says so (None: causally). With ``taps``, the inputs of
    those layers follow the output: [B, T, H·(1 + len(taps))] (:func:`forward_tapped`)."""
    b, t, _ = inputs.shape
    assert isinstance(cache.keys, Tensor) and isinstance(cache.values, Tensor)  # tiled: one tensor
    start, end = cache._reserve(t)
    h = inputs.reshape(b * t, -1).clone()  # [B·T, H] float32, a copy: the kernels write into it
    first = 0 if cache.row is None else cache.row  # a row view is row `row` of the whole cache
    keys, values = (cache.keys, cache.values) if cache.whole is None else cache.whole
    tapped = forward_tapped(
        stack,
        h,
        num_layers,
        taps,
        **rope,
        seq=(first + torch.arange(b, dtype=torch.int32)).repeat_interleave(t),  # [B·T]: each token's row
        slot=(start + torch.arange(t, dtype=torch.int32)).repeat(b),  # [B·T]
        base=torch.full((b * t,), start if base is None else base, dtype=torch.int32),  # [B·T]
        mask=mask,
        keys=keys,
        values=values,
    )
    cache._length = end
    return _with_tapped(rmsnorm(h, *norm), tapped).view(b, t, -1)  # [B, T, H·(1 + taps)]


def forward_tapped(
    stack: NativeStack, h: Tensor, num_layers: int, taps: Sequence[int], **inputs: Any
) -> list[Tensor]:
    """:meth:`NativeStack.forward` of the first ``num_layers`` layers over h [N, H] (in place, ``inputs`` the
    rest of its arguments), in parts split at the layers ``taps`` (ascending): the residual stream entering
    each of them [N, H] each, copied (none without taps: one call)."""
    tapped, first = [], 0
    for layer in taps:
        stack.forward(h, num_layers=layer, first_layer=first, **inputs)
        tapped.append(h.clone())
        first = layer
    stack.forward(h, num_layers=num_layers, first_layer=first, **inputs)
    return tapped


def _with_tapped(out: Tensor, tapped: Sequence[Tensor]) -> Tensor:
    """The output [..., H] and the tapped layers' inputs [..., H] each side by side: [..., H·(1 + taps)]."""
    return torch.cat([out, *tapped], -1) if tapped else out


def run_native_rows(
    stack: NativeStack,
    h: Tensor,
    caches: Sequence[KVCache],
    counts: Sequence[int],
    num_layers: int,
    rope: dict[str, Any],
    norm: tuple[Tensor, float],
    mask: Tensor | None = None,
    taps: Sequence[int] = (),
) -> Tensor:
    """``num_layers`` layers of ``stack`` over the new tokens of several sequences at once, h [N, H] float32
    contiguous (N = Σ counts; RoPE tables ``rope`` at each token; overwritten), then the RMSNorm ``norm``:
    [N, H]. Sequence i's ``counts[i]`` tokens go to the next slots of ``caches[i]``, a row of one whole tiled
    cache (each its own, :func:`rows_of_one_cache`), and attend to its committed slots and, causally or where
    ``mask`` [N, widest] says, to its own new ones. A row's outputs are bit-identical to running it alone
    (:func:`run_native` differs only in taking B rows of T tokens each after one shared start). With
    ``taps``, the inputs of those layers follow the output: [N, H·(1 + len(taps))]."""
    tapped = forward_tapped(stack, h, num_layers, taps, **rope, **native_rows(caches, counts), mask=mask)
    advance_rows(caches, counts)
    return _with_tapped(rmsnorm(h, *norm), tapped)  # [N, H·(1 + taps)]


def pack_linears(module: nn.Module, batch_size_hint: int, min_weight_elements: int) -> None:
    """Pack every :class:`_Linear` of ``module`` with at least ``min_weight_elements`` weights for oneDNN,
    tuned for ``batch_size_hint`` rows per call (see :meth:`Llama.optimize_for_cpu`; the caller has checked
    that the kernel works)."""
    for m in module.modules():
        if isinstance(m, _Linear) and not m.packed and m.weight.numel() >= min_weight_elements:
            m.pack(batch_size_hint)


def check_precision(precision: object) -> None:
    """UsageError unless ``precision`` is one of :data:`PRECISION_CHOICES` (whatever this machine runs)."""
    if precision not in PRECISION_CHOICES:
        raise UsageError(f"precision must be one of {', '.join(PRECISION_CHOICES)}, got {precision!r}")


def available_precisions() -> tuple[str, ...]:
    """The precisions of :data:`PRECISIONS` this machine runs on its CPU fast path ("fp32" always: without
    oneDNN it is the plain path; the others need verispec's native kernels, built on first use)."""
    return PRECISIONS if native_available() is None else ("fp32",)


def resolve_precision(precision: str, stored: str | None = None) -> str:
    """``precision`` checked against this machine; UsageError naming what is available otherwise.

    "auto" is the checkpoint's own format where the native kernels run it (``stored``: a GGUF file's Q8_0 or
    Q4_1 blocks, recovered block for block), else float16 on the native kernels, else float32."""
    available = available_precisions()
    if precision == "auto":
        if stored in available:
            return stored
        return "fp16" if "fp16" in available else "fp32"
    if precision not in available:
        why = native_available()
        raise UsageError(
            f"precision {precision!r} is not available on this machine ({why}); available: "
            f"{', '.join((*available, 'auto'))}"
        )
    return precision


def _onednn_linear_works() -> bool:
    """Whether this torch build runs oneDNN pre-packed float32 linears on CPU, and gets them right."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.linspace(-1, 1, 24).reshape(6, 4)  # [6, 4]
        x = torch.linspace(-2, 2, 8).reshape(2, 4)  # [2, 4]
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)  # [6, 4] packed
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # [2, 6]
        dense = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # [2, 6]
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    expected = F.linear(x, w)  # [2, 6]
    return torch.allclose(y, expected, atol=1e-5) and torch.allclose(dense, expected, atol=1e-5)


class Llama(nn.Module):
    """A Llama-family causal language model implementing :class:`verispec.models.base.LanguageModel`.

    ``Llama(config)`` allocates uninitialised weights; load them with :meth:`from_pretrained`,
    :func:`verispec.models.llama2c.load_llama2c` or :meth:`load_weights`. Parameters never require grad: this
    is an inference model.
    """

    def __init__(
        self, config: LlamaConfig, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise UsageError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_context = config.max_context
        self.model = _Body(config, device, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _Linear(config.hidden_size, config.vocab_size, False, device, dtype)
        )
        inv_freq = config.rope_inv_freq().to(device)  # [head_dim // 2] float32
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        local = config.rope_inv_freq(local=True).to(device)  # [head_dim // 2]: the sliding layers'
        self.inv_freq_local = nn.Buffer(local, persistent=False)
        self._onednn_head = False  # the tied head runs on oneDNN (see optimize_for_cpu)
        self._native: NativeStack | None = None  # the decoder stack on the native kernels (optimize_for_cpu)
        self._native_head: PackedMatrix | None = None  # the output head on the native kernels
        self.taps: tuple[int, ...] = ()  # the layers whose inputs forward_hidden returns too (tap_layers)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device  # not the embeddings': a GGUF file's stay quantized

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def optimized_for_cpu(self) -> bool:
        """Whether :meth:`optimize_for_cpu` packed any linear layer."""
        return self.cpu_precision is not None

    @property
    def on_native_kernels(self) -> bool:
        """Whether the decoder stack runs on verispec's native kernels (a precision other than fp32)."""
        return self._native is not None

    @property
    def cpu_precision(self) -> str | None:
        """The precision of the CPU fast path (:data:`PRECISIONS`), None when the model is not on it."""
        if self._native is not None:
            return self._native.precision
        packed = any(isinstance(m, _Linear) and m.packed for m in self.modules())
        return "fp32" if packed or self._onednn_head else None

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        fast: bool = False,
        precision: str = "fp32",
    ) -> Llama:
        """Load a transformers-format directory: ``config.json`` and ``model.safetensors`` or shards listed in
        ``model.safetensors.index.json``. ``fast``: call :meth:`optimize_for_cpu` after loading, in
        ``precision`` ("auto" takes the format of the GGUF file the directory was converted from, where it
        has one: :func:`verispec.models.gguf.stored_format`). UsageError for a missing file, an unsupported
        architecture or weights that do not fit the config."""
        from safetensors import safe_open

        from verispec.models.gguf import stored_format

        root = Path(path)
        config_path = root / "config.json"
        if not config_path.is_file():
            raise UsageError(f"no config.json in {root}")
        config = LlamaConfig.from_hf_config(json.loads(config_path.read_text()))
        index_path = root / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map", {})
            files = [root / name for name in dict.fromkeys(weight_map.values())]
        else:
            files = [root / "model.safetensors"]
        for file in files:
            if not file.is_file():
                raise UsageError(f"missing weights file {file}")

        def tensors() -> Iterable[tuple[str, Tensor]]:
            for file in files:
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        model = cls(config, device=device, dtype=dtype)
        model.load_weights(tensors())
        if fast:
            model.optimize_for_cpu(precision=precision, stored=stored_format(root))
        return model

    def load_weights(self, tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy (name, tensor) pairs in transformers naming into the parameters, converting dtype and device.

        Every parameter must be given once; ``lm_head.weight`` of a tied model and precomputed RoPE
        frequencies are ignored. UsageError for an unknown name, a wrong shape or a missing parameter."""
        if self.optimized_for_cpu:
            raise UsageError("cannot load weights into a model optimized for CPU; load first, then optimize")
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in tensors:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name not in params:
                raise UsageError(f"unexpected weight {name!r} for this config")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise UsageError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise UsageError(f"{len(missing)} weights missing, e.g. {sorted(missing)[0]!r}")

    # ---------------------------------------------------------------- CPU fast path

    def optimize_for_cpu(
        self,
        batch_size_hint: int = 4,
        min_weight_elements: int = 2**17,
        precision: str = "fp32",
        stored: str | None = None,
    ) -> bool:
        """Move the model onto a CPU fast path in ``precision`` (see :func:`resolve_precision`; ``stored``:
        the checkpoint's own block format, what "auto" takes where it runs).

        "fp32": the large linear layers run on oneDNN with their float32 weights pre-packed in place; a tied
        output head on oneDNN with the embedding's plain weight. Weights of fewer than ``min_weight_elements``
        elements stay on ``F.linear`` (a packed call's fixed cost, 10–25 µs, exceeds what it saves on them).
        ``batch_size_hint``: the rows (batch × new tokens) per call oneDNN's packing is tuned for.

        "fp16", "q8_0", "q4_1": the whole decoder stack runs in one call on verispec's native kernels
        (:mod:`verispec.kernels`), every projection in that format (q, k, v and gate, up stacked), the output
        head too (in Q8_0 for "q4_1", as GGUF files keep it), activations quantized row by row for the block
        formats; token embeddings are still looked up in float32. The model computes with those weights from
        then on: another target. The float32 projection weights are released.

        Makes a forward over a few new tokens (a speculative block) cost little more than one over a single
        token; each row still depends on its own inputs alone. "auto" leaves a model with nothing of
        ``min_weight_elements`` as it is. Irreversible; afterwards ``load_weights`` refuses and ``state_dict``
        holds fused, packed or emptied tensors. Only float32 models on a CPU; elsewhere (CUDA, half types)
        the model keeps the plain path, and a native precision is refused. UsageError for a precision this
        machine or model cannot run, naming those it can. Returns whether the model is now on a fast path."""
        check_int(batch_size_hint, "batch_size_hint", 1)
        check_int(min_weight_elements, "min_weight_elements", 0)
        check_precision(precision)
        on_cpu = self.device.type == "cpu" and self.dtype == torch.float32
        if not on_cpu and precision in FORMATS:
            where = f"{self.dtype} on {self.device}"
            raise UsageError(f"precision {precision} runs float32 models on a CPU, not {where}")
        if not on_cpu or self.optimized_for_cpu:
            return self.optimized_for_cpu
        asked = precision
        fits = [f for f in FORMATS if all(PackedMatrix.fits(f, cols) for cols in self._projection_columns())]
        precision = resolve_precision(precision, stored if stored in fits else None)
        if precision not in ("fp32", *fits):
            raise UsageError(
                f"precision {precision} needs every projection's input width to be a multiple of 32, and "
                f"this model's are {sorted(set(self._projection_columns()))}; available: "
                f"{', '.join(('fp32', *fits, 'auto'))}"
            )
        embed = self.model.embed_tokens.weight  # [vocab, hidden]
        weights: list[Tensor] = [m.weight for m in self.modules() if isinstance(m, _Linear)]
        if (precision == "fp32" or asked == "auto") and all(
            w.numel() < min_weight_elements for w in [*weights, embed]
        ):
            return False  # nothing worth packing: the model stays as it is (auto: not even rounded)
        if precision != "fp32":
            self._pack_native(precision)
            return True
        if not _onednn_linear_works():
            return False
        for m in self.modules():  # fewer, larger kernel calls: 4 projections per layer, not 7
            if isinstance(m, (_Attention, _MLP)):
                m.fuse()
        pack_linears(self, batch_size_hint, min_weight_elements)
        if self.lm_head is None and embed.numel() >= min_weight_elements:
            self._onednn_head = True
        return self.optimized_for_cpu

    def _projection_columns(self) -> list[int]:
        """The input widths of the projections (and of the output head)."""
        c = self.config
        return [c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size]

    def _pack_native(self, precision: str) -> None:
        """Every projection and the head packed for the native kernels in ``precision``; the float32
        projection weights released (see :meth:`optimize_for_cpu`)."""
        # run_layers takes the _DecoderLayers of the ModuleList, whose items torch types as plain Modules
        self._native = native_stack(self.config, self.model.layers, precision)  # type: ignore[arg-type]
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        self._native_head = PackedMatrix.pack(head.weight, None, "q8_0" if precision == "q4_1" else precision)
        if self.lm_head is not None:
            self.lm_head.release()

    def first_layers(self, num_layers: int) -> Llama:
        """A draft sharing this model's weights that runs only its first ``num_layers`` decoder layers, then
        the final norm and the head (self-speculation by early exit). Nothing is copied: the draft costs no
        memory but its own cache, and follows this model's fast path."""
        check_int(num_layers, "num_layers", 1, self.config.num_layers - 1)
        config = self.config.first_layers(num_layers)
        draft = Llama(config, device="meta", dtype=self.dtype)  # allocates nothing; every module is replaced
        draft.model.embed_tokens = self.model.embed_tokens
        draft.model.layers = nn.ModuleList(self.model.layers[:num_layers])
        draft.model.norm = self.model.norm
        draft.lm_head = self.lm_head
        draft.inv_freq, draft.inv_freq_local = self.inv_freq, self.inv_freq_local
        draft._onednn_head = self._onednn_head
        draft._native, draft._native_head = self._native, self._native_head  # run for num_layers layers
        return draft

    def requantized(self, precision: str, num_layers: int | None = None) -> Llama:
        """A draft of this model on the native kernels: its own weights, as the kernels hold them, packed
        again in ``precision`` (``q8_0`` or ``q4_1``: fewer bytes per weight, a cheaper forward whose
        distribution stays close to the target's), the first ``num_layers`` layers (default all) with a
        cache of its own; token embeddings and norms shared. Low-precision self-speculation: the draft
        reports its own q, so verification stays exact whatever the rounding. UsageError for a target off
        the native kernels or a precision it cannot hold."""
        if self._native is None or self._native_head is None:
            raise UsageError(
                "a self-draft in another precision needs a target on the native kernels (precision fp16, "
                f"q8_0 or q4_1), not {self.cpu_precision or 'the plain path'}"
            )
        if precision not in ("q8_0", "q4_1") or not all(
            PackedMatrix.fits(precision, cols) for cols in self._projection_columns()
        ):
            raise UsageError(f"a self-draft is packed in q8_0 or q4_1 (with widths of 32), got {precision!r}")
        n = self.config.num_layers if num_layers is None else num_layers
        check_int(n, "num_layers", 1, self.config.num_layers)
        draft = Llama(self.config.first_layers(n), device="meta", dtype=self.dtype)
        draft.model.embed_tokens, draft.model.norm = self.model.embed_tokens, self.model.norm
        draft.model.layers = nn.ModuleList(self.model.layers[:n])  # their released weights: for names only
        draft.lm_head, draft.inv_freq, draft.inv_freq_local = self.lm_head, self.inv_freq, self.inv_freq_local

        def repacked(m: PackedMatrix, fmt: str = precision) -> PackedMatrix:
            return PackedMatrix.pack(m.dequantized(), m.bias, fmt)

        layers = [
            dataclasses.replace(
                own,
                qkv=tuple(repacked(m) for m in stacked(own.qkv)),
                o=repacked(own.o),
                gate_up=tuple(repacked(m) for m in stacked(own.gate_up)),
                down=repacked(own.down),
            )
            for own in self._native.layers[:n]
        ]
        draft._native = self._native.replaced(layers)
        draft._native_head = repacked(self._native_head, "q8_0")
        return draft

    # ---------------------------------------------------------------- inference

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> KVCache:
        """An empty cache for ``batch_size`` sequences of at most ``capacity`` (default max_context) slots."""
        capacity = self.max_context if capacity is None else capacity
        check_int(capacity, "cache capacity", 1, self.max_context)
        c, (dtype, tiled) = self.config, self._cache_layout()
        return KVCache(
            c.num_layers,
            batch_size,
            c.num_kv_heads,
            capacity,
            c.head_dim,
            dtype=dtype,
            device=self.device,
            tiled=tiled,
        )

    def _cache_layout(self) -> tuple[torch.dtype, bool]:
        """The dtype and tiling of this model's caches: the native kernels keep float16 key tiles and values
        (part of the target as configured, as in llama.cpp); otherwise the model's dtype, untiled."""
        return (torch.float16, True) if self._native is not None else (self.dtype, False)

    def tap_layers(self, layers: Sequence[int]) -> None:
        """From now on :meth:`forward_hidden` (and :meth:`forward_rows`' hidden states) returns after the
        final hidden state the inputs of ``layers`` (the residual stream entering each: layer 0's is the
        embedding), ascending, side by side: [..., H·(1 + len(layers))], for a drafter that reads several
        layers (EAGLE-3). The logits, keys and values are those of the plain forward; :meth:`logits` reads
        the first H columns. UsageError for layers out of [0, num_layers), repeated, or other than taps
        already set."""
        wanted = tuple(sorted(layers))
        count = self.config.num_layers
        if any(not is_int(i) or not 0 <= i < count for i in wanted) or len(set(wanted)) != len(wanted):
            raise UsageError(f"the layers read must be distinct integers in [0, {count}), got {list(layers)}")
        if self.taps and self.taps != wanted:
            raise UsageError(
                f"this target already returns the inputs of layers {list(self.taps)}, not {wanted}"
            )
        self.taps = wanted

    def forward_hidden(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: Cache,
        tree_mask: Tensor | None = None,
        embeddings: Tensor | None = None,
    ) -> Tensor:
        """The final hidden states (after the last norm, transformers' ``last_hidden_state``), for learned
        drafters. tokens: [B, T] int64; positions: [B, T] int64; tree_mask: [T, T] bool or None (see
        :meth:`forward`); embeddings: [B, T, hidden] float32, the input vectors to run instead of the tokens'
        embeddings (a lookahead drafter's trained tokens among them), or None. Returns [B, T, hidden] in the
        model's dtype (then the tapped layers' inputs, :meth:`tap_layers`). Appends T slots to ``cache``."""
        cache = self._check_inputs(tokens, positions, cache)
        if tree_mask is not None:
            _checked_tree_mask(tree_mask, tokens.shape[1])
        if embeddings is not None and embeddings.shape != (*tokens.shape, self.config.hidden_size):
            raise UsageError(f"embeddings must be shaped [B, T, hidden], got {list(embeddings.shape)}")
        h = self.embed(tokens) if embeddings is None else embeddings  # [B, T, hidden]
        if self._native is not None:
            return self._native_hidden(self._native, h.float(), positions, cache, tree_mask)
        if self.config.native_only:
            raise UsageError("this architecture runs on the native kernels only (precision auto or a format)")
        mask = None
        if tree_mask is not None:  # a token tree: the committed slots, then the masked new tokens
            t = tokens.shape[1]
            mask = torch.cat([tree_mask.new_ones(t, cache.length), tree_mask], 1)
        h, tapped = h.to(self.dtype), list[Tensor]()
        layers = self.model.layers  # _DecoderLayers, which torch types as plain Modules
        h = run_layers(layers, h, positions, cache, self.inv_freq, mask, self.taps, tapped)  # type: ignore[arg-type]
        return _with_tapped(self.model.norm(h), tapped)

    def embed(self, tokens: Tensor) -> Tensor:
        """The input vectors of ``tokens`` [...]: their embeddings [..., hidden] times the embedding scale."""
        h = self.model.embed_tokens(tokens)  # [..., hidden]
        scale = self.config.embed_scale
        return h if scale == 1.0 else h * torch.tensor(scale, dtype=h.dtype)

    def _rope(self, positions: Tensor) -> dict[str, Any]:
        """The native forward's RoPE inputs for tokens at ``positions`` [N]: cos, sin [N, head_dim // 2] as
        transformers computes them; the positions (int32) and the local tables for sliding-window layers."""
        local = None
        if self.config.local_rope_theta is not None:
            local = rope_tables(positions, self.inv_freq_local)
        return {
            **rope_tables(positions, self.inv_freq),
            "pos": positions.reshape(-1).to(torch.int32).contiguous() if self.config.layer_windows else None,
            "cos_local": None if local is None else local["cos"],
            "sin_local": None if local is None else local["sin"],
        }

    def _native_hidden(
        self, native: NativeStack, inputs: Tensor, positions: Tensor, cache: KVCache, tree_mask: Tensor | None
    ) -> Tensor:
        """:meth:`forward_hidden` on the native kernels of the input vectors [B, T, hidden] float32: every row
        of the batch is one sequence of the cache, its T tokens at slots cache.length.. (a long prompt in
        blocks of NATIVE_CHUNK tokens)."""
        b, t, _ = inputs.shape
        if tree_mask is None and t > NATIVE_CHUNK:
            blocks = [slice(i, i + NATIVE_CHUNK) for i in range(0, t, NATIVE_CHUNK)]
            parts = [self._native_hidden(native, inputs[:, b], positions[:, b], cache, None) for b in blocks]
            return torch.cat(parts, 1)  # [B, T, hidden]
        rope = self._rope(positions.reshape(-1))
        mask = None if tree_mask is None else tree_mask.repeat(b, 1).contiguous()  # [B·T, T] bool
        norm = (self.model.norm.weight, self.config.rms_norm_eps)
        return run_native(
            native, inputs, cache, self.config.num_layers, rope, norm, mask=mask, taps=self.taps
        )

    # ---------------------------------------------------------------- rows of a batch (RowModel)

    def new_cache_rows(self, rows: int) -> list[Cache]:
        """The rows of one cache of ``rows`` sequences (:meth:`KVCache.rows`)."""
        return list(self.new_cache(rows).rows())

    def copy_prefix(self, source: Cache, dest: Cache, length: int) -> None:
        """``dest`` (a row of the cache ``source`` is a row of) holds ``source``'s first ``length`` slots."""
        if not isinstance(source, KVCache) or not isinstance(dest, KVCache):
            raise UsageError("copy_prefix takes rows of one cache from new_cache_rows")
        dest.copy_from(source, length)

    def scores_together(self, rows: Sequence[RowInput]) -> bool:
        """On the native kernels, rows of one cache, each its own, are scored in one forward."""
        return self._native is not None and rows_of_one_cache([row.cache for row in rows])

    def forward_rows(self, rows: Sequence[RowInput]) -> list[tuple[Tensor | None, Tensor | None]]:
        """Every row in ONE native forward (rows that :meth:`scores_together` accepts; else one by one):
        row i's tokens at its cache row's next slots, attending to that row's committed slots and its own new
        tokens (causally, or by its tree mask). Each row's outputs are bit-identical to scoring it alone."""
        if not self.scores_together(rows):
            raise UsageError("forward_rows takes rows of one native cache, each its own")
        assert self._native is not None
        caches = [row.cache for row in rows if isinstance(row.cache, KVCache)]  # all of them (checked)
        widest = max(len(row.tokens) for row in rows)
        trees = any(row.tree_mask is not None for row in rows)  # else no mask: each row's block is causal
        masks = []
        for row, cache in zip(rows, caches, strict=True):
            t = len(row.tokens)
            self._check_inputs(row.tokens.unsqueeze(0), row.positions.unsqueeze(0), cache)
            if trees:
                mask = torch.ones(t, t, dtype=torch.bool).tril() if row.tree_mask is None else row.tree_mask
                if row.tree_mask is not None:
                    _checked_tree_mask(row.tree_mask, t)
                masks.append(F.pad(mask.cpu(), (0, widest - t)))  # [T, widest]: its own new slots only
        h = self.embed(torch.cat([row.tokens for row in rows])).float().contiguous()  # [N, hidden]
        positions = torch.cat([row.positions for row in rows])  # [N]
        hidden = run_native_rows(
            self._native,
            h,
            caches,
            [len(row.tokens) for row in rows],
            self.config.num_layers,
            self._rope(positions),
            (self.model.norm.weight, self.config.rms_norm_eps),
            torch.cat(masks).contiguous() if trees else None,  # [N, widest] bool
            self.taps,
        )  # [N, hidden · (1 + taps)]
        parts = list(hidden.split([len(row.tokens) for row in rows]))
        wanted = [p for p, row in zip(parts, rows, strict=True) if row.logits]
        logits = list(self.logits(torch.cat(wanted)).split([len(p) for p in wanted])) if wanted else []
        out: list[tuple[Tensor | None, Tensor | None]] = []
        for part, row in zip(parts, rows, strict=True):
            out.append((logits.pop(0) if row.logits else None, part if row.hidden else None))
        return out

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [B, T, hidden] from :meth:`forward_hidden` → logits [B, T, vocab_size] float32."""
        hidden = hidden[..., : self.config.hidden_size]  # the final state, before any tapped layers' inputs
        if self._native_head is not None:
            flat = hidden.reshape(-1, hidden.shape[-1]).float()  # [B·T, hidden]
            return self._native_head(flat).view(*hidden.shape[:-1], -1)  # [B, T, vocab]
        if self.lm_head is not None:
            out = self.lm_head(hidden)  # [B, T, vocab]
        elif self._onednn_head:
            weight = self.model.embed_tokens.weight  # [vocab, hidden], plain layout
            out = torch.ops.mkldnn._linear_pointwise(hidden, weight, None, "none", [], "")
        else:
            out = F.linear(hidden, self.model.embed_tokens.weight)  # [B, T, vocab]
        return out.float()

    def logits_of(self, ids: Tensor) -> Callable[[Tensor], Tensor]:
        """The logits of the tokens ``ids`` [V'] alone, as a function of final states [n, hidden] → [n, V']
        float32: :meth:`logits`' columns ``ids``, bit for bit; on the native kernels the head's rows ``ids``
        alone (:meth:`PackedMatrix.select`: V' / vocab of its cost; the 8,192 rows of a draft vocabulary of
        Gemma 3's 262,144 tokens in 0.05 s, against 0.59 s through the whole head)."""
        if self._native_head is not None:
            rows = self._native_head.select(ids)
            return lambda hidden: rows(hidden[:, : self.config.hidden_size].float())
        return lambda hidden: self.logits(hidden[None])[0][:, ids]

    def forward(
        self, tokens: Tensor, positions: Tensor, cache: Cache, tree_mask: Tensor | None = None
    ) -> Tensor:
        """tokens: [B, T] int64; positions: [B, T] int64 (RoPE positions, normally cache.length + arange(T)).

        Returns logits: [B, T, vocab_size] float32. Appends T slots to ``cache``; token j attends to every
        committed slot and to new tokens 0..j, or, given ``tree_mask`` [T, T] bool (a token tree, positions
        = committed length + depth), to the new tokens i with tree_mask[j, i]."""
        return self.logits(self.forward_hidden(tokens, positions, cache, tree_mask))

    def prefill(self, tokens: Tensor, positions: Tensor, cache: Cache) -> None:
        """Appends T slots to ``cache`` as :meth:`forward` does, without the output head."""
        self.forward_hidden(tokens, positions, cache)

    def _check_inputs(self, tokens: Tensor, positions: Tensor, cache: Cache) -> KVCache:
        """``cache``, after checking that it is a cache of this model's (:meth:`new_cache`) that tokens [B, T]
        and positions [B, T] (int64, on the model's device) fit; UsageError otherwise."""
        if not isinstance(cache, KVCache):
            raise UsageError(f"cache must be a KVCache from new_cache(), got {type(cache).__name__}")
        c, (dtype, tiled) = self.config, self._cache_layout()
        values = cache.values  # [layers, B, kv_heads, slots, head_dim] in one tensor, unless separate layers
        if (
            not isinstance(values, Tensor)
            or values.shape[:3] != (c.num_layers, cache.batch_size, c.num_kv_heads)
            or values.shape[4] != c.head_dim
            or values.dtype != dtype
            or cache.tiled != tiled
            or values.device != self.device
        ):
            raise UsageError("cache was not made by this model's new_cache()")
        if tokens.ndim != 2 or tokens.shape[1] == 0 or tokens.dtype != torch.int64:
            raise UsageError(
                f"tokens must be a [B, T] int64 tensor with T >= 1, got {tokens.dtype} {list(tokens.shape)}"
            )
        if positions.shape != tokens.shape or positions.dtype != torch.int64:
            raise UsageError(
                f"positions must be int64 shaped like tokens {list(tokens.shape)}, got "
                f"{positions.dtype} {list(positions.shape)}"
            )
        if tokens.device != self.device or positions.device != self.device:
            raise UsageError(f"tokens and positions must be on the model's device {self.device}")
        if tokens.shape[0] != cache.batch_size:
            raise UsageError(f"batch of {tokens.shape[0]} sequences for a cache of {cache.batch_size}")
        lo, hi = torch.aminmax(positions)
        if lo < 0 or hi >= self.max_context:
            raise UsageError(f"positions must lie in [0, {self.max_context}), got [{int(lo)}, {int(hi)}]")
        return cache
