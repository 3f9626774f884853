"""GGUF files read in place: a native :class:`~verispec.models.llama.Llama` straight from the file's blocks.

The file is memory-mapped (:class:`~verispec.models.gguf_file.GGUFFile`); the config comes from its
metadata, and every weight matrix goes to the native kernels from its raw bytes
(:meth:`PackedMatrix.from_gguf`) — no float32 copy of any of them. llama.cpp stores the rows of q and k of a
``llama`` file permuted (its rotary layout); whole rows of blocks are put back in place, which needs no
dequantization. q, k, v are stacked into one matrix, gate and up into another, from their raw rows, where
they share a type; otherwise (Q4_K_M files mix Q4_K and Q6_K) they stay apart, each in its own format, and
the kernels run them side by side. Token
embeddings stay in the file's blocks (:class:`GGUFEmbedding`, rows dequantized as they are looked up); a tied
head multiplies ``token_embd``'s blocks, an untied one ``output.weight``'s. Once loaded, nothing refers to the
mapping any more.

Architectures (:data:`ARCHITECTURES`): llama and mistral (Llama 3's rope scaling from ``rope_freqs``), qwen2
(q/k/v biases), qwen3 (per-head q/k RMSNorm), phi3 (q, k, v fused in one matrix, gate and up in another),
gemma3 (embeddings scaled by sqrt(hidden), GELU-tanh, norms
before and after attention and MLP, q/k norms, sliding-window layers with their own RoPE base). llama.cpp's
converter stores Gemma's norms as 1 + w, the weight its RMSNorm multiplies by: the file's values are used
as they are.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from torch import Tensor, nn

from verispec.errors import UsageError
from verispec.kernels.cpu import GGUF_TYPES, NativeLayer, PackedMatrix, Projection
from verispec.models.gguf import first_line
from verispec.models.gguf_file import GGUFFile, GGUFTensor, read_gguf
from verispec.models.llama import FORMATS, Llama, _DecoderLayer
from verispec.models.llama_config import LlamaConfig, RopeScaling

__all__ = ["ARCHITECTURES", "GGUFEmbedding", "in_place_problem", "load_gguf", "read_gguf"]


@dataclass(frozen=True)
class _Architecture:
    """How a ``general.architecture``'s file is laid out and what its model adds to Llama's."""

    permuted: bool = False  # llama.cpp permuted the rows of q and k (its rotary layout)
    bias: bool = False  # q, k, v have biases
    qk_norm: bool = False  # per-head RMSNorm of q and k (attn_q_norm, attn_k_norm)
    gemma: bool = False  # Gemma 3's: scaled embeddings, GELU-tanh, post norms, sliding-window layers
    fused: bool = False  # q, k, v in one matrix (attn_qkv), gate and up in one (ffn_up, gate rows first)


ARCHITECTURES = {  # Mistral files are mostly "llama" ones
    "llama": _Architecture(permuted=True),
    "mistral": _Architecture(permuted=True),
    "qwen2": _Architecture(bias=True),
    "qwen3": _Architecture(qk_norm=True),
    "gemma3": _Architecture(qk_norm=True, gemma=True),
    "phi3": _Architecture(fused=True),
}
_GEMMA_SWA_PATTERN = 6  # Gemma 3: every 6th layer attends to all positions, the others to a window
_GEMMA_LOCAL_ROPE_BASE = 10000.0  # Gemma 3's sliding layers' RoPE base (llama.cpp's default too)


class GGUFEmbedding(nn.Module):
    """Token embeddings [vocab, hidden] read in place: a mapping of the file's ``token_embd`` bytes alone, of
    which a lookup reads (and dequantizes) only its rows — memory holds the pages of the rows looked up."""

    def __init__(self, path: Path, tensor: GGUFTensor, hidden: int) -> None:
        super().__init__()
        self.qtype, self.hidden = tensor.tensor_type, hidden
        start = int(tensor.data_offset)
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        with path.open("rb") as file:  # the mapping outlives the descriptor
            self._map = mmap.mmap(
                file.fileno(), start - aligned + tensor.n_bytes, access=mmap.ACCESS_READ, offset=aligned
            )
        vocab = int(tensor.shape[-1])
        # uint8 [vocab, bytes per row], read-only
        self.rows = np.frombuffer(self._map, np.uint8, int(tensor.n_bytes), start - aligned).reshape(
            vocab, -1
        )

    def forward(self, ids: Tensor) -> Tensor:
        """ids [...] int64 → float32 [..., hidden]."""
        rows = self.rows[ids.reshape(-1).cpu().numpy()]  # uint8 [n, bytes per row], a copy
        values = quants.dequantize(rows, self.qtype).astype(np.float32, copy=False)  # [n, hidden]
        return torch.from_numpy(values).reshape(*ids.shape, self.hidden).to(ids.device)

    @property
    def weight(self) -> Tensor:
        """The whole table in float32 [vocab, hidden] (vocab × hidden × 4 bytes, made at each call): for the
        drafters that read it all (EAGLE's input embeddings, lookahead tokens' start)."""
        return self(torch.arange(self.rows.shape[0]))


def in_place_problem(reader: GGUFFile) -> str | None:
    """Why the native kernels cannot run this file as it is (an architecture or a tensor type they lack),
    None when they can."""
    arch = _field(reader, "general.architecture", "?")
    if arch not in ARCHITECTURES:
        return f"architecture {arch!r} (native: {', '.join(ARCHITECTURES)})"
    if any(t.name == "rope_factors_long.weight" for t in reader.tensors):
        return "LongRoPE (rope_factors_long, Phi-3's long-context files) is not native"
    tied = all(t.name != "output.weight" for t in reader.tensors)
    for t in reader.tensors:
        matrix = t.name.startswith("blk.") and len(t.shape) == 2 or t.name == "output.weight"
        if (matrix or tied and t.name == "token_embd.weight") and t.tensor_type.name not in GGUF_TYPES:
            return (
                f"tensor {t.name} is {t.tensor_type.name}, which has no native kernel "
                f"(native: {', '.join(GGUF_TYPES)})"
            )
    return None


def load_gguf(path: str | Path, precision: str = "auto", reader: GGUFFile | None = None) -> Llama:
    """The model in the GGUF file ``path`` on the native kernels, each matrix in its own format ("auto") or
    requantized into ``precision`` (fp16, q8_0, q4_1; the head in q8_0 for q4_1, as
    :meth:`Llama.optimize_for_cpu` packs it). UsageError (one line, naming the file) for an unreadable file,
    an architecture or a tensor type the kernels lack, a missing tensor or one of the wrong shape, a context
    too long for this machine to allocate a sequence's cache of (:func:`_check_context`). ``reader``: the file
    already read (:func:`~verispec.models.gguf_file.read_gguf`), else it is read here."""
    path = Path(path)
    if precision not in ("auto", *FORMATS):
        raise UsageError(
            f"a GGUF file runs in place in precision auto, {', '.join(FORMATS)}; got {precision!r}"
        )
    reader = read_gguf(path) if reader is None else reader
    problem = in_place_problem(reader)
    if problem is not None:
        raise UsageError(f"{path} cannot run in place: {problem}")
    try:
        model = _assemble(path, reader, precision)
        _check_context(model)
    except UsageError as err:
        raise UsageError(f"{path}: {err}") from err
    del reader  # the mapping of the whole file goes with it
    _trim_heap()
    return model


def _check_context(model: Llama) -> None:
    """UsageError when a cache of one sequence at the model's context, what the engine allocates for each of
    its slots (untouched until used), cannot be allocated here: a file claiming a context no machine holds is
    refused as it loads, before its tokenizer is extracted, not at the first generation."""
    try:
        model.new_cache(1)
    except (MemoryError, RuntimeError) as err:  # torch's allocator: all the call does is allocate
        raise UsageError(
            f"a cache of its context, {model.max_context} positions, cannot be allocated here "
            f"({first_line(err)})"
        ) from None


def _trim_heap() -> None:
    """Hand the pages that loading's temporaries freed back to the system (glibc keeps them otherwise: a
    third of the file's size more memory, measured on a 1 B model). Nothing to do elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _assemble(path: Path, reader: GGUFFile, precision: str) -> Llama:
    """The model of ``reader``'s file (see :func:`load_gguf`); every array read from the mapping is copied."""
    arch = str(_field(reader, "general.architecture"))
    tensors = {t.name: t for t in reader.tensors}
    c, layout = _config(reader, arch, tensors), ARCHITECTURES[arch]
    inv_freq = c.rope_inv_freq()  # [head_dim / 2]
    factors = tensors.get("rope_freqs.weight")
    if factors is not None:  # Llama 3.1+: llama.cpp divides the frequencies by these factors
        inv_freq = inv_freq / torch.from_numpy(_vector(factors, c.head_dim // 2, "rope_freqs"))
        factor = float((c.rope_inv_freq() / inv_freq).max())
        llama3 = dataclasses.replace(c, rope_scaling=RopeScaling("llama3", factor, 1.0, 4.0, 8192))
        if torch.allclose(llama3.rope_inv_freq(), inv_freq, rtol=1e-5, atol=0):
            c, inv_freq = llama3, llama3.rope_inv_freq()  # Llama 3.1-3.3's parameters: the config says so
    model = Llama(c, device="meta")  # allocates nothing; the parts below replace what runs
    model.inv_freq = nn.Buffer(inv_freq, persistent=False)
    model.inv_freq_local = nn.Buffer(c.rope_inv_freq(local=True), persistent=False)  # [head_dim / 2]
    embed = _tensor(tensors, "token_embd.weight", (c.vocab_size, c.hidden_size))
    model.model.register_module("embed_tokens", GGUFEmbedding(path, embed, c.hidden_size))
    model.model.norm.weight = _norm(tensors, "output_norm.weight", c.hidden_size)
    heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}
    rows = {"attn_q": c.num_heads * c.head_dim, "attn_k": c.num_kv_heads * c.head_dim}
    rows |= {"attn_v": rows["attn_k"], "attn_output": c.hidden_size, "ffn_down": c.hidden_size}
    rows |= {"ffn_gate": c.intermediate_size, "ffn_up": c.intermediate_size * (2 if layout.fused else 1)}
    rows |= {"attn_qkv": rows["attn_q"] + 2 * rows["attn_k"]}
    cols = {"attn_output": rows["attn_q"], "ffn_down": c.intermediate_size}
    stacks = (
        (("attn_qkv",), ("ffn_up",))
        if layout.fused
        else (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
    )

    def part(i: int, name: str) -> tuple[str, np.ndarray, Tensor | None]:
        shape = (rows[name], cols.get(name, c.hidden_size))
        tensor, bias = _tensor(tensors, f"blk.{i}.{name}.weight", shape), None
        if c.attention_bias and name in ("attn_q", "attn_k", "attn_v"):
            key = f"blk.{i}.{name}.bias"
            bias = torch.from_numpy(_vector(tensors.get(key), shape[0], key))
        return _rows(tensor, bias, heads.get(name) if layout.permuted else None)

    def vector(i: int, name: str, size: int) -> Tensor:  # [size]
        return _norm(tensors, f"blk.{i}.{name}.weight", size).data

    extras: dict[str, Any] = {}

    native = []
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, _DecoderLayer)
        qkv, gate_up = (_projection([part(i, n) for n in names], precision) for names in stacks)
        o, down = (_matrix(*part(i, n), precision) for n in ("attn_output", "ffn_down"))
        norms = [_norm(tensors, f"blk.{i}.{n}.weight", c.hidden_size) for n in ("attn_norm", "ffn_norm")]
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight = norms
        if layout.qk_norm:
            extras |= {
                "q_norm": vector(i, "attn_q_norm", c.head_dim),
                "k_norm": vector(i, "attn_k_norm", c.head_dim),
            }
        if c.layer_windows:
            extras["window"] = c.layer_windows[i]
        if layout.gemma:  # its sliding layers have a RoPE base of their own
            extras |= {
                "post_attn_norm": vector(i, "post_attention_norm", c.hidden_size),
                "post_mlp_norm": vector(i, "post_ffw_norm", c.hidden_size),
                "local_rope": c.layer_windows[i] > 0,
            }
        native.append(NativeLayer(norms[0].data, norms[1].data, qkv, o, gate_up, down, **extras))
    model._native = c.stack(native, attn_scale=c.attn_scale, activation=c.activation)
    head = (
        embed if c.tie_word_embeddings else _tensor(tensors, "output.weight", (c.vocab_size, c.hidden_size))
    )
    head_format = "auto" if precision == "auto" else "q8_0" if precision == "q4_1" else precision
    model._native_head = _matrix(head.tensor_type.name, _raw(head, c.vocab_size), None, head_format)
    return model


def _config(reader: GGUFFile, arch: str, tensors: dict[str, GGUFTensor]) -> LlamaConfig:
    """The model's shape from the file's metadata, as transformers' conversion reads it."""
    hidden, heads = (
        int(_field(reader, f"{arch}.embedding_length")),
        int(_field(reader, f"{arch}.attention.head_count")),
    )
    head_dim = _field(reader, f"{arch}.attention.key_length", None)
    if head_dim is None and arch != "qwen2":
        head_dim = _field(reader, f"{arch}.rope.dimension_count", None)
    scaling = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise UsageError(
            f"unsupported rope scaling {scaling!r} (supported: none, linear, Llama-3's rope_freqs)"
        )
    positions = int(_field(reader, f"{arch}.context_length", 2048))
    rope = (
        {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
        if scaling == "linear"
        else {}
    )
    embed = tensors.get("token_embd.weight")
    vocab = _field(reader, f"{arch}.vocab_size", None) or (embed.shape[-1] if embed is not None else 0)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None)
    layers, layout = int(_field(reader, f"{arch}.block_count")), ARCHITECTURES[arch]
    fields: dict[str, Any] = {}  # Gemma 3's own fields, Phi-3's windows
    if layout.gemma:
        window = int(_field(reader, f"{arch}.attention.sliding_window"))
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA_SWA_PATTERN)
        sliding = (
            [bool(x) for x in pattern]
            if isinstance(pattern, np.ndarray)
            else [(i + 1) % int(pattern) != 0 for i in range(layers)]
        )
        if len(sliding) != layers:
            raise UsageError(f"sliding_window_pattern has {len(sliding)} layers, the model {layers}")
        fields = {
            "post_norms": True,
            "activation": "gelu_tanh",
            "embed_scale": math.sqrt(hidden),
            "layer_windows": tuple(window if s else 0 for s in sliding),
            "local_rope_theta": float(_field(reader, f"{arch}.rope.freq_base_swa", _GEMMA_LOCAL_ROPE_BASE)),
        }
    elif layout.fused and _field(reader, f"{arch}.attention.sliding_window", None):  # Phi-3: every layer's
        fields = {"layer_windows": (int(_field(reader, f"{arch}.attention.sliding_window")),) * layers}
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim or 0),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=RopeScaling.from_hf(rope, positions),
        max_position_embeddings=positions,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=layout.bias,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (int(eos),),
        qk_norm=layout.qk_norm,
        **fields,
    )


_MISSING: Any = object()


def _field(reader: GGUFFile, key: str, default: Any = _MISSING) -> Any:
    """A metadata value; ``default`` when absent (UsageError without one)."""
    if key not in reader.fields:
        if default is _MISSING:
            raise UsageError(f"no metadata {key!r}")
        return default
    return reader.fields[key]


def _tensor(tensors: dict[str, GGUFTensor], name: str, shape: tuple[int, int]) -> GGUFTensor:
    """The 2-D tensor ``name`` of [rows, cols] ``shape``; UsageError when missing or shaped otherwise."""
    tensor = tensors.get(name)
    if tensor is None:
        raise UsageError(f"no tensor {name}")
    found = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    if found != shape:
        raise UsageError(f"tensor {name} is {list(found)}, expected {list(shape)}")
    return tensor


def _raw(tensor: GGUFTensor, rows: int) -> np.ndarray:
    """The tensor's bytes as they lie in the mapping, row by row: uint8 [rows, bytes per row] (a view)."""
    return np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)


def _vector(tensor: GGUFTensor | None, size: int, what: str = "") -> np.ndarray:
    """A 1-D tensor's values as a float32 copy [size]; UsageError when missing or of another size."""
    if tensor is None:
        raise UsageError(f"no tensor {what}")
    if tuple(tensor.shape) != (size,):
        raise UsageError(f"tensor {tensor.name} is {list(tensor.shape)}, expected [{size}]")
    return quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32).reshape(size)


def _norm(tensors: dict[str, GGUFTensor], name: str, size: int) -> nn.Parameter:
    """An RMSNorm weight [size] float32 (a copy)."""
    tensor = tensors.get(name)
    if tensor is None:
        raise UsageError(f"no tensor {name}")
    return nn.Parameter(torch.from_numpy(_vector(tensor, size)), requires_grad=False)


def _rows(
    tensor: GGUFTensor, bias: Tensor | None, heads: int | None
) -> tuple[str, np.ndarray, Tensor | None]:
    """A matrix's type, its raw rows uint8 [rows, bytes per row] (a view of the mapping unless moved) and its
    bias [rows] (or None), with llama.cpp's permutation of ``heads`` heads (or None) undone: its rows (head,
    half, pair) back to (head, pair, half), whole rows of blocks."""
    rows = int(tensor.shape[-1])
    raw = _raw(tensor, rows)
    if heads is not None:
        raw = raw.reshape(heads, -1, 2, raw.shape[1]).swapaxes(1, 2).reshape(rows, -1)
        bias = None if bias is None else bias.reshape(heads, -1, 2).transpose(1, 2).reshape(rows)
    return tensor.tensor_type.name, raw, bias


def _projection(parts: list[tuple[str, np.ndarray, Tensor | None]], precision: str) -> Projection:
    """Matrices of one input (:func:`_rows`' triples): one matrix of their rows stacked where they share a
    type, else each apart in its own (a Q4_K_M file's Q4_K q beside its Q6_K v)."""
    if len({type_name for type_name, _, _ in parts}) > 1:
        return tuple(_matrix(*part, precision) for part in parts)
    bias = None if parts[0][2] is None else torch.cat([b for _, _, b in parts if b is not None])  # [rows]
    raw = np.concatenate([r for _, r, _ in parts])  # uint8 [rows, bytes per row]
    return _matrix(parts[0][0], raw, bias, precision)


def _matrix(type_name: str, raw: np.ndarray, bias: Tensor | None, precision: str) -> PackedMatrix:
    """A matrix from its raw rows uint8 [rows, bytes per row] of ``type_name`` and bias [rows] (or None), in
    its own format ("auto") or requantized into ``precision``."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    packed = PackedMatrix.from_gguf(type_name, raw.shape[0], raw.shape[1] // size * block, raw, bias)
    if precision in ("auto", packed.format):
        return packed
    return PackedMatrix.pack(packed.dequantized(), bias, precision)
