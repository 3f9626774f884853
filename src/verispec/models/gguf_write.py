"""Random-weight GGUF files of a given shape and tensor type, written quickly: for measuring speed where real
users' models live (1 B, 3 B Llama-3 shapes) without downloading them. Speed does not depend on the weights'
values; the outputs of such a model are meaningless.

Every block is random bytes with its scale fields (float16 d, and the minimum where the type has one) set so
that the weights come out finite, of about 1 / √cols — not run through a quantizer. Tensors are generated and
written one at a time (memory: the largest tensor's bytes), into a partial file renamed into place at the
end. The metadata holds a minimal byte-level BPE tokenizer (the 256 byte tokens, one merge, a few special
tokens, filler tokens up to the vocabulary) and a chat template, so the file loads with its own tokenizer.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

from verispec.errors import UsageError
from verispec.files import atomic_path, check_writable
from verispec.inputs import check_seed
from verispec.models.llama_config import LlamaConfig

__all__ = [
    "RANDOM_NAME",
    "SHAPES",
    "TYPES",
    "GGUFShape",
    "parse_shape",
    "random_blocks",
    "scale_offsets",
    "write_random_gguf",
]
RANDOM_NAME = "random-weight"  # how general.name of a file written here starts


@dataclass(frozen=True)
class GGUFShape:
    """A Llama-3-style model's shape: widths, layers, heads, vocabulary; a tied head; RoPE base and Llama 3's
    rope scaling factor (None: none); the context length the file declares (the KV cache it asks for)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = True
    rope_base: float = 500000.0
    rope_factor: float | None = 32.0
    context: int = 8192

    def config(self) -> LlamaConfig:
        """Validated as a model config (UsageError for heads that do not divide, sizes ≤ 0, …)."""
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_layers=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            rope_theta=self.rope_base,
            max_position_embeddings=self.context,
        )


SHAPES = {
    "llama3-1b": GGUFShape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    "llama3-3b": GGUFShape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256),
    "llama3-8b": GGUFShape(
        hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False, rope_base=500000.0
    ),
}
MAX_VOCAB = 1 << 22  # a random file's vocabulary at most (Gemma 3's is 262,144)
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16")
# type → (byte offset of d, the typical |integer| d multiplies, byte offset of the minimum or None, the
# minimum in units of d): ggml's block layouts (Q6_K keeps d last, int8 sub-block scales before it)
_SCALES = {
    "Q4_0": (0, 4.6, None, 0.0),
    "Q4_1": (0, 4.6, 2, -8.0),
    "Q5_0": (0, 9.2, None, 0.0),
    "Q5_1": (0, 9.2, 2, -16.0),
    "Q8_0": (0, 74.0, None, 0.0),
    "Q4_K": (0, 250.0, 2, 7.5),
    "Q5_K": (0, 500.0, 2, 15.5),
    "Q6_K": (208, 1400.0, None, 0.0),
}
_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def scale_offsets(type_name: str) -> tuple[int, int | None]:
    """Where a block of ``type_name`` keeps its float16 scale d and its minimum (None: none), in bytes: the
    fields that scale every weight of the block."""
    d_at, _, min_at, _ = _SCALES[type_name]
    return d_at, min_at


def parse_shape(text: str) -> GGUFShape:
    """A preset's name (:data:`SHAPES`) or explicit dims
    ``hidden=H,layers=L,heads=N,kv_heads=K,ffn=F,vocab=V`` (optionally ``tied=0``, ``rope_base=B``,
    ``rope_factor=X`` or ``none``, ``context=C``); UsageError else."""
    if text in SHAPES:
        return SHAPES[text]
    known = {f.name: f for f in fields(GGUFShape)}
    values: dict[str, object] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in known or not re.fullmatch(r"[0-9.e+]+|none", value.strip()) or key in values:
            raise UsageError(
                f"shape must be one of {', '.join(SHAPES)} or hidden=H,layers=L,heads=N,kv_heads=K,ffn=F,"
                f"vocab=V[,tied=0|1][,rope_base=B][,rope_factor=X|none][,context=C]: {item.strip()!r} in "
                f"{text!r}"
            )
        value = value.strip()
        if key in ("rope_factor", "rope_base"):
            number = None if value == "none" and key == "rope_factor" else _float(value)
            low = 1 if key == "rope_base" else 0
            if number is not None and not (math.isfinite(number) and number > low):
                raise UsageError(f"shape's {key} must be a finite number > {low}, got {value!r}")
            values[key] = number
        elif key == "tied":
            if value not in ("0", "1"):
                raise UsageError(f"shape's tied must be 0 or 1, got {value!r}")
            values[key] = value == "1"
        else:
            values[key] = int(value) if value.isdigit() else value
    missing = [name for name, f in known.items() if f.default is MISSING and name not in values]
    if missing:
        raise UsageError(f"shape {text!r} lacks {', '.join(missing)}")
    vocab = values["vocab"]
    if isinstance(vocab, int) and vocab > MAX_VOCAB:  # its tokens are listed in the file, one string each
        raise UsageError(f"shape's vocab must be at most {MAX_VOCAB}, got {vocab}")
    return GGUFShape(**values)  # type: ignore[arg-type]  # each value checked by config()


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # refused by the caller, naming its key


def random_blocks(rng: np.random.Generator, type_name: str, rows: int, cols: int) -> np.ndarray:
    """A random matrix [rows, cols] as a GGUF file stores it in ``type_name``: uint8 [rows, bytes per row]."""
    sigma = 1 / math.sqrt(cols)
    if type_name == "F16":
        values = np.empty((rows, cols), np.float16)
        for start in range(0, rows, 4096):  # float32 draws a block of rows at a time
            chunk = values[start : start + 4096]
            chunk[:] = rng.standard_normal(chunk.shape, np.float32) * np.float32(sigma)
        return values.view(np.uint8)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    n = rows * cols // block
    raw = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()  # [blocks, bytes per block]
    d_at, typical, min_at, min_units = _SCALES[type_name]
    d = (sigma / typical * rng.uniform(0.5, 1.5, n)).astype(np.float16)  # [blocks]
    raw[:, d_at : d_at + 2] = d.view(np.uint8).reshape(n, 2)
    if min_at is not None:
        raw[:, min_at : min_at + 2] = (d * np.float16(min_units)).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def write_random_gguf(path: str | Path, shape: GGUFShape, type_name: str, seed: int = 0) -> Path:
    """Write a random-weight Llama GGUF file of ``shape`` with every matrix in ``type_name`` (:data:`TYPES`;
    norms float32) to ``path``, atomically. UsageError (one line) for a bad argument, before writing."""
    path = Path(path)
    check_seed(seed)
    if type_name not in TYPES:
        raise UsageError(f"tensor type must be one of {', '.join(TYPES)}, got {type_name!r}")
    c = shape.config()
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    widths = sorted({c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size})
    if any(w % block for w in widths):
        raise UsageError(f"{type_name} needs widths that are multiples of {block}, and these are {widths}")
    free = shutil.disk_usage(check_writable(path, ".gguf").parent).free
    size = _file_bytes(c, type_name, shape.tied)
    if size > free:
        raise UsageError(
            f"a file of about {size / 1e9:.1f} GB does not fit in the {free / 1e9:.1f} GB free there"
        )
    with atomic_path(path) as partial:
        _write(partial, shape, c, type_name, np.random.default_rng(seed))
    return path


def _file_bytes(c: LlamaConfig, type_name: str, tied: bool) -> int:
    """About how many bytes the file's matrices take in ``type_name`` (norms and metadata aside)."""
    block, size = (1, 2) if type_name == "F16" else GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    kv = c.num_kv_heads * c.head_dim
    layer = c.hidden_size * (2 * c.num_heads * c.head_dim + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    weights = c.num_layers * layer + (1 if tied else 2) * c.vocab_size * c.hidden_size
    return weights * size // block


def _write(path: Path, shape: GGUFShape, c: LlamaConfig, type_name: str, rng: np.random.Generator) -> None:
    """The file's metadata, then each tensor generated and written in turn."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"{RANDOM_NAME} {type_name} llama (meaningless weights)")
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_vocab_size(c.vocab_size)
    byte_tokens = [chr(b) for b in _byte_alphabet()]
    tokens = _SPECIALS + byte_tokens + ["Ġt"]
    tokens += [f"<|filler_{i}|>" for i in range(c.vocab_size - len(tokens))]
    if len(tokens) != c.vocab_size:
        raise UsageError(f"a vocabulary of {c.vocab_size} has no room for the {len(tokens)} tokens it needs")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL] * len(_SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(_SPECIALS))
    )
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(4)
    writer.add_add_bos_token(True)
    writer.add_chat_template(_CHAT_TEMPLATE)
    qtype = GGMLQuantizationType[type_name]
    kv, q = c.num_kv_heads * c.head_dim, c.num_heads * c.head_dim
    matrices = [("token_embd.weight", c.vocab_size, c.hidden_size)]
    for i in range(c.num_layers):
        for name, rows, cols in (
            ("attn_q", q, c.hidden_size),
            ("attn_k", kv, c.hidden_size),
            ("attn_v", kv, c.hidden_size),
            ("attn_output", c.hidden_size, q),
            ("ffn_gate", c.intermediate_size, c.hidden_size),
            ("ffn_up", c.intermediate_size, c.hidden_size),
            ("ffn_down", c.hidden_size, c.intermediate_size),
        ):
            matrices.append((f"blk.{i}.{name}.weight", rows, cols))
    if not shape.tied:
        matrices.append(("output.weight", c.vocab_size, c.hidden_size))
    vectors = {
        f"blk.{i}.{n}.weight": np.ones(c.hidden_size, np.float32)
        for i in range(c.num_layers)
        for n in ("attn_norm", "ffn_norm")
    }
    vectors["output_norm.weight"] = np.ones(c.hidden_size, np.float32)
    if shape.rope_factor is not None:
        vectors["rope_freqs.weight"] = _llama3_factors(c, shape.rope_factor)
    for name, rows, cols in matrices:
        nbytes = rows * cols // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
        writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    for name, vector in vectors.items():
        writer.add_tensor_info(name, vector.shape, vector.dtype, vector.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, rows, cols in matrices:
        writer.write_tensor_data(random_blocks(rng, type_name, rows, cols))
    for vector in vectors.values():
        writer.write_tensor_data(vector)
    writer.close()


def _llama3_factors(c: LlamaConfig, factor: float) -> np.ndarray:
    """llama.cpp's ``rope_freqs``: what Llama 3's rope scaling (low 1, high 4, original context 8192) divides
    each frequency by, float32 [head_dim / 2]."""
    inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim))
    wavelen = 2 * math.pi / inv_freq
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < 8192 / 4.0, 1.0, np.where(wavelen > 8192, factor, medium)).astype(np.float32)


def _byte_alphabet() -> list[int]:
    """GPT-2's printable stand-ins for the 256 bytes (code points), in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [b if b in printable else next(extra) for b in range(256)]
