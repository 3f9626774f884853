"""A real model at a bigger model's cost: a GGUF file whose widths are zero-padded (``write-gguf --inflate``).

Zero-padding keeps a model's function. The inflated file has hidden width H ≥ h, feed-forward width F ≥ f and
more query and key/value heads of the same head width; what the source computes sits in the first h (f,
heads) places and every other place holds zeros, so each matrix product gives the source's values followed by
zeros:

- a matrix gets zero rows and zero columns; quantized blocks are copied as they are (a padding of whole
  blocks never mixes real and padded values in a block, which is checked), and zero bytes are a zero block in
  every GGUF format;
- new key/value heads are appended, each with as many new query heads as the source's groups hold, so the
  source's query heads keep their key/value heads (grouped-query attention maps head i to kv head
  i // group); the new heads' queries, keys, values and output columns are zero: they add nothing;
- RMSNorm over the padded width sees a mean square h/H of the source's; with k = sqrt(H/h):
  - Llama-style files (Llama, Mistral, Qwen2) keep the source's residual stream, padded: each norm weight is
    divided by k and ε by k², which gives the source's normalised vector;
  - where ε must stay (Qwen3's and Gemma 3's per-head q/k norms share it) the residual stream is the source's
    times k instead: Gemma 3 multiplies its embeddings by sqrt(hidden), which does it, and Qwen3's embedding
    table is multiplied by k. A pre-norm then sees the source's mean square and returns k times the
    source's output, so its weight is divided by k; the attention's and the MLP's output matrices are
    multiplied by k (their blocks' scales), so what they add (and what Gemma's post norms read) is k times
    the source's; the final norm is divided by k, and by k again where the head is the scaled table (a tied
    Qwen3), so the logits are the source's.
  Per-head q/k norms see heads of the same width and are unchanged, as are RoPE and the attention scale.
  What the file's stream, table and final features are then, times the source's, is its :class:`Scaling`,
  which the learned drafters padded beside it follow (:mod:`verispec.drafting.learned.inflate`).

When H/h is a power of 4, k is a power of 2 and every step above is exact in floating point (scaling by a
power of two rounds nothing; a sum of squares with zeros added is the same sum): the inflated file's logits
are the source's bit for bit. The presets choose such an H; other widths (``hidden=H``) compute the source's
function up to the rounding of the activations (the kernels quantize them to int8, where a last-bit change
moves a value to the next step).

The file reads about as many bytes per token as a model of the asked shape (a preset's feed-forward width is
chosen so that the matrices hold as many weights as the preset model's), so it decodes at that model's speed
with the source's predictions: where users' models live, measured with real acceptance. It is not a better
model: it computes the source's function.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter, ReaderTensor, quants

from verispec.errors import UsageError
from verispec.files import atomic_path, check_writable
from verispec.models.gguf_write import SHAPES, GGUFShape, scale_offsets

__all__ = ["INFLATABLE", "Inflation", "Scaling", "inflate_gguf", "plan_inflation"]

INFLATABLE = ("llama", "mistral", "qwen2", "qwen3", "gemma3")  # phi3 fuses q, k, v: not padded here
_SCALED_STREAM = ("qwen3", "gemma3")  # the residual stream times k (module doc): their q/k norms share ε
_EMBED_SCALED = ("gemma3",)  # embeddings multiplied by sqrt(hidden): the stream scaled already
_PRE_NORMS = ("attn_norm", "ffn_norm")
_POST_NORMS = ("post_attention_norm", "post_ffw_norm")
_OUTPUTS = ("attn_output", "ffn_down")  # what a post norm reads
_UNCHANGED = ("attn_q_norm", "attn_k_norm", "rope_freqs")
_DEFAULT_EPS = 1e-6  # RMSNorm's ε where a file has none (gguf_native's)
_FFN_STEP = 256  # a preset's feed-forward width grows by whole super-blocks
INFLATED_FROM = "verispec.inflated_from"  # the metadata key naming the model an inflated file computes


@dataclass(frozen=True)
class Source:
    """What inflation reads of a GGUF file: its architecture and widths, and for each kind of matrix the
    widest block of its types (columns per block)."""

    arch: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied: bool
    blocks: dict[str, int]


@dataclass(frozen=True)
class Scaling:
    """What an inflated file's values are, relative to its source's (module doc): its residual stream times
    ``stream`` (k where the source's ε stays, else 1), its token embedding table times ``table``, the vector
    its final norm gives (the features its head reads) times ``features`` (1 / table where the head is that
    table, else 1); k = sqrt(H / h)."""

    k: float
    stream: float
    table: float
    features: float

    @classmethod
    def of(cls, source: Source, hidden: int) -> Scaling:
        """The scaling of ``source`` inflated to hidden width ``hidden``."""
        k = math.sqrt(hidden / source.hidden)
        scaled = source.arch in _SCALED_STREAM
        table = k if scaled and source.arch not in _EMBED_SCALED else 1.0
        return cls(k, k if scaled else 1.0, table, 1 / table if source.tied else 1.0)


@dataclass(frozen=True)
class Inflation:
    """The source's widths and the inflated file's (before, after): hidden, feed-forward, query and key/value
    heads; the head width and the layers are the source's; how its values are scaled."""

    hidden: tuple[int, int]
    ffn: tuple[int, int]
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    head_dim: int
    scaling: Scaling

    @property
    def exact(self) -> bool:
        """Whether H/h is a power of 4: the logits are then the source's bit for bit (module doc)."""
        ratio, rest = divmod(self.hidden[1], self.hidden[0])
        return rest == 0 and ratio & (ratio - 1) == 0 and ratio.bit_length() % 2 == 1

    def describe(self) -> str:
        values = (self.hidden, self.ffn, self.heads, self.kv_heads)
        widths = zip(("hidden", "ffn", "heads", "kv heads"), values, strict=True)
        return ", ".join(f"{name} {a}→{b}" for name, (a, b) in widths)


def plan_inflation(source: Source, shape: str) -> Inflation:
    """The widths of ``source`` inflated to ``shape``: a preset's name (:data:`SHAPES`: the hidden width
    h·4^j nearest the preset's, key/value heads as wide as its, the feed-forward width that gives as many
    weights as it has) or ``hidden=H,ffn=F[,kv_heads=K]``. UsageError (one line) for a shape narrower than the
    source or whose padding would split the source's blocks."""
    group = source.heads // source.kv_heads
    if shape in SHAPES:
        preset = SHAPES[shape]
        hidden = source.hidden * 4 ** max(1, round(math.log(preset.hidden / source.hidden, 4)))
        kv = max(source.kv_heads, round(preset.kv_heads * (preset.hidden // preset.heads) / source.head_dim))
        kv = _fitting_kv(source, kv)
        ffn = _matching_ffn(source, preset, hidden, kv)
    else:
        values = _explicit(shape)
        hidden, ffn, kv = values["hidden"], values["ffn"], values.get("kv_heads", source.kv_heads)
    plan = Inflation(
        (source.hidden, hidden),
        (source.ffn, ffn),
        (source.heads, kv * group),
        (source.kv_heads, kv),
        source.head_dim,
        Scaling.of(source, hidden),
    )
    _check(source, plan)
    return plan


def _explicit(shape: str) -> dict[str, int]:
    """``hidden=H,ffn=F[,kv_heads=K]`` as integers; UsageError naming the presets otherwise."""
    values: dict[str, int] = {}
    for item in shape.split(","):
        key, _, value = (part.strip() for part in item.partition("="))
        if (
            key not in ("hidden", "ffn", "kv_heads")
            or key in values
            or not re.fullmatch(r"[0-9]{1,7}", value)
        ):
            raise UsageError(
                f"--inflate takes {', '.join(SHAPES)} or hidden=H,ffn=F[,kv_heads=K], got {shape!r}"
            )
        values[key] = int(value)
    for key in ("hidden", "ffn"):
        if key not in values:
            raise UsageError(f"--inflate {shape!r} lacks {key}=")
    return values


def _fitting_kv(source: Source, kv: int) -> int:
    """The fewest key/value heads ≥ ``kv`` whose new query heads pad the output projection by whole blocks."""
    block = source.blocks.get("attn_output", 1)
    while (kv - source.kv_heads) * (source.heads // source.kv_heads) * source.head_dim % block:
        kv += 1
    return kv


def _matching_ffn(source: Source, preset: GGUFShape, hidden: int, kv: int) -> int:
    """The feed-forward width that gives the source's layers, at ``hidden`` and ``kv`` heads, as many matrix
    weights as ``preset``'s model holds (its layers, embeddings and head); never below the source's."""
    c = preset.config()
    target = (
        c.num_layers
        * c.hidden_size
        * (2 * (c.num_heads + c.num_kv_heads) * c.head_dim + 3 * c.intermediate_size)
    )
    target += c.vocab_size * c.hidden_size * (1 if preset.tied else 2)
    heads = kv * source.heads // source.kv_heads
    attention = hidden * 2 * (heads + kv) * source.head_dim
    table = source.vocab * hidden * (1 if source.tied else 2)
    ffn = (target - table - source.layers * attention) / (3 * hidden * source.layers)
    return source.ffn + max(0, math.ceil((ffn - source.ffn) / _FFN_STEP)) * _FFN_STEP


def _check(source: Source, plan: Inflation) -> None:
    """UsageError (one line) unless no width shrinks and every padding is whole blocks."""
    for name, (old, new) in (("hidden", plan.hidden), ("ffn", plan.ffn), ("kv_heads", plan.kv_heads)):
        if new < old:
            raise UsageError(f"--inflate only widens: {name} {new} is below the source's {old}")
    if plan.hidden[1] > 65536 or plan.ffn[1] > 262144 or plan.kv_heads[1] > 1024:
        raise UsageError(f"--inflate to {plan.describe()}: wider than any model this is for")
    padding = {  # the columns a matrix gains, by kind (others: the hidden width's)
        "ffn_down": plan.ffn[1] - plan.ffn[0],
        "attn_output": (plan.heads[1] - plan.heads[0]) * plan.head_dim,
    }
    for kind, block in source.blocks.items():
        pad = padding.get(kind, plan.hidden[1] - plan.hidden[0])
        if pad % block:
            raise UsageError(
                f"--inflate: {kind} is stored in blocks of {block} columns, which a padding of {pad} columns "
                "would split (choose widths that pad by whole blocks)"
            )


def read_source(reader: GGUFReader) -> Source:
    """The widths of a GGUF file; UsageError (one line) for an architecture or a layout this cannot pad."""
    arch = str(_value(reader, "general.architecture"))
    if arch not in INFLATABLE:
        raise UsageError(f"--inflate reads {', '.join(INFLATABLE)} files; this one is {arch!r}")
    widths = {}
    for key, name in (
        ("embedding_length", "hidden"),
        ("feed_forward_length", "ffn"),
        ("block_count", "layers"),
    ):
        widths[name] = _value(reader, f"{arch}.{key}")
    widths["heads"] = _value(reader, f"{arch}.attention.head_count")
    widths["kv_heads"] = _value(reader, f"{arch}.attention.head_count_kv", widths["heads"])
    if not all(isinstance(v, int) and v > 0 for v in widths.values()):
        raise UsageError(f"--inflate: the source's widths are not one positive integer each: {widths}")
    hidden, heads, kv_heads = int(widths["hidden"]), int(widths["heads"]), int(widths["kv_heads"])
    if heads % kv_heads:
        raise UsageError(f"--inflate: {heads} query heads do not share {kv_heads} key/value heads")
    blocks: dict[str, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) == 2:
            kind = _kind(tensor.name)
            blocks[kind] = max(blocks.get(kind, 1), GGML_QUANT_SIZES[tensor.tensor_type][0])
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise UsageError("--inflate: the source has no token_embd.weight")
    return Source(
        arch=arch,
        hidden=hidden,
        ffn=int(widths["ffn"]),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=int(_value(reader, f"{arch}.attention.key_length", hidden // heads)),
        layers=int(widths["layers"]),
        vocab=int(names["token_embd.weight"].shape[-1]),
        tied="output.weight" not in names,
        blocks=blocks,
    )


def _value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value (``default`` when absent; UsageError when absent without one)."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise UsageError(f"--inflate: the source has no metadata {key!r}")
        return default
    return field.contents()


def _kind(name: str) -> str:
    """``blk.3.attn_q.weight`` → ``attn_q``; ``token_embd.weight`` → ``token_embd``."""
    return name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]


def inflate_gguf(source: str | Path, out: str | Path, shape: str) -> tuple[Path, Inflation]:
    """Write the GGUF file ``source`` inflated to ``shape`` (:func:`plan_inflation`) to ``out``, atomically,
    tensor by tensor (memory: the largest tensor). UsageError (one line) for a source or shape that cannot be
    inflated, before anything is written."""
    source, out = Path(source), Path(out)
    try:
        reader = GGUFReader(source)
    except (ValueError, OSError) as err:
        raise UsageError(f"cannot read {source} as a GGUF file: {err}") from err
    src = read_source(reader)
    plan = plan_inflation(src, shape)
    parts = [(tensor, _place(src, plan, tensor)) for tensor in reader.tensors]  # all checked before writing
    if check_writable(out, ".gguf").resolve() == source.resolve():  # read while it is written
        raise UsageError(f"the output file must not be the source file ({source})")
    with atomic_path(out) as partial:
        writer = GGUFWriter(str(partial), src.arch)
        _copy_metadata(reader, writer, src, plan)
        for tensor, (rows, cols, _) in parts:
            if rows == 0:  # a vector, written as float32
                writer.add_tensor_info(tensor.name, (cols,), np.dtype(np.float32), cols * 4)
            else:
                block, size = GGML_QUANT_SIZES[tensor.tensor_type]
                nbytes = rows * cols // block * size
                writer.add_tensor_info(
                    tensor.name,
                    (rows, nbytes // rows),
                    np.dtype(np.uint8),
                    nbytes,
                    raw_dtype=tensor.tensor_type,
                )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor, (rows, cols, scale) in parts:
            writer.write_tensor_data(
                _matrix(tensor, rows, cols, scale) if rows else _vector(tensor, cols, scale)
            )
        writer.close()
    return out, plan


def _place(src: Source, plan: Inflation, tensor: ReaderTensor) -> tuple[int, int, float]:
    """A source tensor's place in the inflated file: (rows, cols, scale) for a matrix, (0, size, scale) for a
    vector, its values times ``scale`` (module doc). UsageError for a tensor this does not know."""
    kind, hidden, ffn, hd = _kind(tensor.name), plan.hidden[1], plan.ffn[1], plan.head_dim
    q, kv = plan.heads[1] * hd, plan.kv_heads[1] * hd
    scaling = plan.scaling
    matrices = {
        "token_embd": (src.vocab, hidden),
        "output": (src.vocab, hidden),
        "attn_q": (q, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, q),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    vectors = {name: (hidden, 1 / scaling.k) for name in _PRE_NORMS}
    vectors |= {name: (hidden, 1.0) for name in _POST_NORMS}
    vectors["output_norm"] = (hidden, scaling.features / scaling.k)
    vectors |= {"attn_q_norm": (hd, 1.0), "attn_k_norm": (hd, 1.0), "rope_freqs": (hd // 2, 1.0)}
    biases = {"attn_q": q, "attn_k": kv, "attn_v": kv}
    if tensor.name.endswith(".weight") and kind in matrices and len(tensor.shape) == 2:
        factor = scaling.table if kind == "token_embd" else scaling.stream if kind in _OUTPUTS else 1.0
        return (*matrices[kind], factor)
    if tensor.name.endswith(".weight") and kind in vectors and len(tensor.shape) == 1:
        return (0, *vectors[kind])
    if tensor.name.endswith(".bias") and kind in biases and len(tensor.shape) == 1:
        return (0, biases[kind], 1.0)
    raise UsageError(f"--inflate does not know how to pad tensor {tensor.name} of this {src.arch} file")


def _matrix(tensor: ReaderTensor, rows: int, cols: int, scale: float) -> np.ndarray:
    """A matrix's blocks zero-padded to [rows, cols], every weight times ``scale`` (the blocks' float16
    scales multiplied: exact for a power of two): uint8 [rows, bytes per row]."""
    block, size = GGML_QUANT_SIZES[tensor.tensor_type]
    old_cols, old_rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest dimension first
    raw = np.asarray(tensor.data).view(np.uint8).reshape(old_rows, old_cols // block * size)
    if scale != 1.0:
        raw = _scaled_blocks(raw, tensor, scale)
    out = np.zeros((rows, cols // block * size), np.uint8)  # zero bytes: zero in every format
    out[:old_rows, : raw.shape[1]] = raw
    return out


def _scaled_blocks(raw: np.ndarray, tensor: ReaderTensor, scale: float) -> np.ndarray:
    """A copy of the blocks ``raw`` (uint8 [rows, bytes per row]) with every weight times ``scale``."""
    raw, name = raw.copy(), tensor.tensor_type.name
    if name in ("F32", "F16"):
        values = raw.view(np.float32 if name == "F32" else np.float16)
        np.multiply(values, values.dtype.type(scale), out=values)
        return raw
    try:
        fields = [at for at in scale_offsets(name) if at is not None]
    except KeyError:
        raise UsageError(f"--inflate cannot scale {tensor.name}'s {name} blocks") from None
    size = GGML_QUANT_SIZES[tensor.tensor_type][1]
    blocks = raw.reshape(-1, size)  # [blocks, bytes per block]
    for at in fields:
        d = blocks[:, at : at + 2].copy().view(np.float16)  # [blocks, 1]
        scaled = (d.astype(np.float32) * np.float32(scale)).astype(np.float16)
        if not np.isfinite(scaled).all():
            raise UsageError(
                f"--inflate: {tensor.name}'s block scales overflow float16 when multiplied by {scale}"
            )
        blocks[:, at : at + 2] = scaled.view(np.uint8)
    return raw


def _vector(tensor: ReaderTensor, size: int, scale: float) -> np.ndarray:
    """A vector's values times ``scale``, zero-padded to float32 [size]."""
    values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(-1).astype(np.float32)
    out = np.zeros(size, np.float32)
    out[: values.size] = values * np.float32(scale)
    return out


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, src: Source, plan: Inflation) -> None:
    """Every metadata value of the source in its own type, the widths (and an unscaled stream's ε) replaced,
    and where the file comes from (:data:`INFLATED_FROM`)."""
    arch = src.arch
    changed: dict[str, object] = {
        f"{arch}.embedding_length": plan.hidden[1],
        f"{arch}.feed_forward_length": plan.ffn[1],
        f"{arch}.attention.head_count": plan.heads[1],
        f"{arch}.attention.head_count_kv": plan.kv_heads[1],
        f"{arch}.attention.key_length": plan.head_dim,  # no longer hidden / heads
        f"{arch}.attention.value_length": plan.head_dim,
    }
    if plan.scaling.stream == 1.0:  # the stream the source's: ε over k² (module doc)
        eps = f"{arch}.attention.layer_norm_rms_epsilon"
        source_eps = np.float32(_value(reader, eps, _DEFAULT_EPS))
        changed[eps] = float(source_eps * np.float32(plan.hidden[0] / plan.hidden[1]))
    name = str(_value(reader, "general.name", "model"))
    changed["general.name"] = f"{name} inflated ({plan.describe()}: the source's function)"
    for field in reader.fields.values():
        if field.name in ("general.architecture", INFLATED_FROM) or field.name.startswith("GGUF."):
            continue  # the writer's own, or where this file comes from (an inflated source's: written below)
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, changed.pop(field.name, field.contents()), kind, sub_type=sub)
    for key, value in changed.items():  # what the source left to its defaults
        types = {str: GGUFValueType.STRING, float: GGUFValueType.FLOAT32, int: GGUFValueType.UINT32}
        writer.add_key_value(key, value, types[type(value)])
    writer.add_key_value(INFLATED_FROM, name, GGUFValueType.STRING)
