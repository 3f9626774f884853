"""llama2.c checkpoints and tokenizers (karpathy/llama2.c), e.g. the tiny ``stories260K`` test model.

:func:`load_llama2c` reads a "version 0" checkpoint into a native :class:`~verispec.models.llama.Llama`;
:class:`Llama2cTokenizer` reads a ``tokenizer.bin`` / ``tok512.bin`` and encodes and decodes exactly as
llama2.c's ``run.c`` does.
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from verispec.errors import UsageError
from verispec.models.llama import Llama
from verispec.models.llama_config import LlamaConfig

if TYPE_CHECKING:
    from verispec.grammar.tools import Tools

__all__ = ["Llama2cTokenizer", "load_llama2c"]

_HEADER = struct.Struct("<7i")  # dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
_VERSIONED_MAGIC = 0x616B3432  # "ak42": the first int32 of the version 1+ export formats
_RMS_NORM_EPS = 1e-5  # run.c's rmsnorm epsilon
_ROPE_THETA = 10000.0  # run.c's RoPE base
_BOS, _EOS = 1, 2
_BYTE_PIECE = re.compile(rb"<0x([0-9A-F]{2})>")


def _rotate_half_order(w: Tensor, num_heads: int) -> Tensor:
    """Reorder the output rows of a q or k projection from interleaved RoPE pairs (x[2i], x[2i+1]) to the
    rotate_half pairs (x[i], x[i + head_dim/2]) of transformers, as its convert_llama_weights_to_hf does.

    w: [num_heads * head_dim, in] → [num_heads * head_dim, in]."""
    rows, cols = w.shape
    return w.view(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def load_llama2c(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    fast: bool = False,
    precision: str = "fp32",
) -> Llama:
    """Load a llama2.c "version 0" checkpoint (header of 7 int32, then float32 weights) as a :class:`Llama`.

    A negative vocab_size in the header means a separate output matrix follows the weights; otherwise the
    output head is tied to the token embedding. UsageError for a missing, versioned or truncated file.
    ``fast``: call :meth:`Llama.optimize_for_cpu` after loading, in ``precision``."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no llama2.c checkpoint at {path}")
    with path.open("rb") as f:
        header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise UsageError(f"{path} is too short for a llama2.c header")
    if struct.unpack_from("<I", header)[0] == _VERSIONED_MAGIC:
        raise UsageError(f"{path} is a versioned (v1+) llama2.c export; only version 0 is supported")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = _HEADER.unpack(header)
    tied = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, layers, heads, kv_heads, vocab, seq_len) <= 0 or dim % heads or heads % kv_heads:
        raise UsageError(f"{path} has an invalid llama2.c header {_HEADER.unpack(header)}")
    head_dim = dim // heads
    kv_dim = kv_heads * head_dim
    shapes = [
        ("model.embed_tokens.weight", (vocab, dim)),
        ("input_layernorm", (layers, dim)),
        ("q_proj", (layers, dim, dim)),
        ("k_proj", (layers, kv_dim, dim)),
        ("v_proj", (layers, kv_dim, dim)),
        ("o_proj", (layers, dim, dim)),
        ("post_attention_layernorm", (layers, dim)),
        ("gate_proj", (layers, hidden, dim)),  # w1
        ("down_proj", (layers, dim, hidden)),  # w2
        ("up_proj", (layers, hidden, dim)),  # w3
        ("model.norm.weight", (dim,)),
        ("legacy RoPE tables", (2, seq_len, head_dim // 2)),
    ]
    if not tied:
        shapes.append(("lm_head.weight", (vocab, dim)))
    expected = sum(int(np.prod(shape)) for _, shape in shapes)
    data = np.fromfile(path, dtype="<f4", offset=_HEADER.size)  # [expected]
    if data.size != expected:
        raise UsageError(f"{path} holds {data.size} floats after its header, expected {expected}")

    arrays: dict[str, Tensor] = {}
    offset = 0
    for name, shape in shapes:
        size = int(np.prod(shape))
        arrays[name] = torch.from_numpy(data[offset : offset + size]).view(shape)
        offset += size

    def tensors() -> Iterator[tuple[str, Tensor]]:
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            if name in arrays:
                yield name, arrays[name]
        for i in range(layers):
            prefix = f"model.layers.{i}"
            yield f"{prefix}.input_layernorm.weight", arrays["input_layernorm"][i]
            yield f"{prefix}.post_attention_layernorm.weight", arrays["post_attention_layernorm"][i]
            yield f"{prefix}.self_attn.q_proj.weight", _rotate_half_order(arrays["q_proj"][i], heads)
            yield f"{prefix}.self_attn.k_proj.weight", _rotate_half_order(arrays["k_proj"][i], kv_heads)
            for attn in ("v_proj", "o_proj"):
                yield f"{prefix}.self_attn.{attn}.weight", arrays[attn][i]
            for mlp in ("gate_proj", "up_proj", "down_proj"):
                yield f"{prefix}.mlp.{mlp}.weight", arrays[mlp][i]

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        rms_norm_eps=_RMS_NORM_EPS,
        rope_theta=_ROPE_THETA,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tied,
        bos_token_id=_BOS,
        eos_token_ids=(_EOS,),
    )
    model = Llama(config, device=device, dtype=dtype)
    model.load_weights(tensors())
    if fast:
        model.optimize_for_cpu(precision=precision)
    return model


class Llama2cTokenizer:
    """The SentencePiece-BPE tokenizer of llama2.c, read from its binary ``tokenizer.bin`` format.

    Encoding (as run.c): a dummy-prefix space token, one token per UTF-8 character (byte-fallback tokens
    ``<0xNN>`` for characters outside the vocabulary), then repeatedly merge the adjacent pair whose
    concatenation is a token with the highest score (the leftmost pair on ties); BOS (id 1) is prepended.
    Decoding drops the leading space of the first piece after BOS and turns ``<0xNN>`` into its byte.

    eos_token_ids is {1, 2}: llama2.c generation stops at BOS as well as at EOS. There is no chat template.
    """

    unk_token_id = 0
    bos_token_id: int | None = _BOS
    eos_token_ids: frozenset[int] = frozenset({_BOS, _EOS})

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"no llama2.c tokenizer at {path}")
        data = path.read_bytes()
        pieces: list[bytes] = []  # each token's stored string ("▁" stored as a plain space)
        scores: list[float] = []  # each token's merge priority
        offset = 4  # after max_token_length
        while offset < len(data):
            if offset + 8 > len(data):
                raise UsageError(f"{path} is truncated at byte {offset}")
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            if length < 0 or offset + length > len(data):
                raise UsageError(f"{path} is truncated at byte {offset}")
            pieces.append(data[offset : offset + length])
            scores.append(score)
            offset += length
        if len(pieces) <= _EOS:
            raise UsageError(
                f"{path} holds {len(pieces)} tokens; a llama2.c tokenizer has unk, bos, eos first"
            )
        self.vocab_size = len(pieces)
        self._pieces = pieces
        self._scores = scores
        self._ids = {piece: i for i, piece in reversed(list(enumerate(pieces)))}  # first id of each piece
        # the bytes each token decodes to: <0xNN> pieces are one raw byte
        self._bytes = [bytes([int(m[1], 16)]) if (m := _BYTE_PIECE.fullmatch(p)) else p for p in pieces]
        self._byte_ids: dict[int, int] = {}  # byte value → its byte-fallback token
        for i, p in enumerate(pieces):
            if (m := _BYTE_PIECE.fullmatch(p)) and i > _EOS:
                self._byte_ids.setdefault(int(m[1], 16), i)
        if len(self._byte_ids) != 256:
            raise UsageError(f"{path} lacks byte-fallback tokens for {256 - len(self._byte_ids)} byte values")
        if b" " not in self._ids:
            raise UsageError(f"{path} has no single-space token for the dummy prefix")

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for (:class:`~verispec.models.base.SpelledTokenizer`): ``<0xNN>`` pieces
        one byte, "▁" a space; unknown, BOS and EOS b""."""
        return [b"" if i <= _EOS else piece for i, piece in enumerate(self._bytes)]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``, BOS first when ``add_bos``; the empty text is [] or [BOS]."""
        ids: list[int] = []
        if text:
            ids.append(self._ids[b" "])  # dummy prefix
            for ch in text:
                piece = ch.encode("utf-8")
                token = self._ids.get(piece)
                if token is not None:
                    ids.append(token)
                else:
                    ids.extend(self._byte_ids[b] for b in piece)
        ids = self._merge(ids)
        return [_BOS, *ids] if add_bos else ids

    def _merge(self, ids: list[int]) -> list[int]:
        """Greedy BPE: merge the best-scoring adjacent pair (leftmost on ties) until no pair is a token.

        A heap of candidate pairs keyed by (-score, position of the left token) gives run.c's choices in
        O(n log n); entries made stale by earlier merges are skipped when popped."""
        n = len(ids)
        tokens = list(ids)  # token at each original position; valid where alive
        alive = [True] * n
        nxt = [*range(1, n), -1]  # next alive position, -1 at the end
        prv = list(range(-1, n - 1))  # previous alive position, -1 at the start
        heap: list[tuple[float, int, int, int, int]] = []  # (-score, left, left token, right token, merged)

        def push(left: int) -> None:
            right = nxt[left]
            if right >= 0:
                merged = self._ids.get(self._pieces[tokens[left]] + self._pieces[tokens[right]])
                if merged is not None:
                    heapq.heappush(heap, (-self._scores[merged], left, tokens[left], tokens[right], merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, left_token, right_token, merged = heapq.heappop(heap)
            right = nxt[left]
            if not alive[left] or tokens[left] != left_token or right < 0 or tokens[right] != right_token:
                continue  # stale: one of the two tokens has merged since
            tokens[left] = merged
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            if prv[left] >= 0:
                push(prv[left])
            push(left)
        return [t for t, a in zip(tokens, alive, strict=True) if a]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``: special tokens (unk, BOS, EOS) skipped, the leading space of the piece right after
        a BOS dropped, ``<0xNN>`` turned into raw bytes; invalid UTF-8 becomes U+FFFD."""
        out = bytearray()
        prev = None
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise UsageError(f"token id {token} outside the vocabulary of {self.vocab_size}")
            if token > _EOS:
                piece = self._bytes[token]
                out += piece[1:] if prev == _BOS and piece.startswith(b" ") else piece
            prev = token
        return out.decode("utf-8", errors="replace")

    def chat_prompt(self, user_message: str | Sequence[Mapping[str, Any]], tools: Tools | None = None) -> str:
        """llama2.c models have no chat template: always UsageError."""
        raise UsageError("llama2.c tokenizers have no chat template; give a plain prompt")
