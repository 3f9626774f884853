"""Any transformers causal language model and tokenizer behind verispec's model and tokenizer protocols.

``HFModel`` drives an ``AutoModelForCausalLM`` through a transformers ``DynamicCache`` that it rolls back with
``crop``. Only models whose cache layers can be rolled back exactly are accepted: full attention, layers that
share another layer's cache, and sliding-window attention (whose context is then capped one short of the
window, where it is still exact full attention). Recurrent and linear-attention layers keep state that
cannot be cut back to an earlier length, and are refused with a UsageError.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import AutoTokenizer
from transformers.cache_utils import DummyLayer, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from verispec.errors import UsageError
from verispec.grammar.tools import Tools, template_messages
from verispec.inputs import check_int
from verispec.models.base import Cache, check_compact, check_truncate

if TYPE_CHECKING:  # transformers' modeling code takes seconds to import: loaded where a model is
    from transformers import PretrainedConfig, PreTrainedModel

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces

__all__ = ["HFCache", "HFModel", "HFTokenizer"]

_MASKABLE = ("eager", "sdpa")  # attention implementations that apply a custom 4-D mask as given


class HFCache:
    """A transformers ``DynamicCache`` for ``batch_size`` sequences of at most ``capacity`` tokens."""

    def __init__(self, config: PretrainedConfig, batch_size: int, capacity: int) -> None:
        self.inner = DynamicCache(config=config)
        self.batch_size = batch_size
        self._capacity = capacity
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    def truncate(self, length: int) -> None:
        """Drop every slot from ``length`` on (0 ≤ length ≤ self.length; UsageError otherwise)."""
        check_truncate(self._length, length)
        if length < self._length:
            self.inner.crop(length - self._length)  # a negative count removes that many trailing tokens
            self._length = length

    def compact(self, start: int, keep: Sequence[int]) -> None:
        """Move the entries of slots ``keep`` (ascending, each in [start, length)) to slots start, start + 1,
        …, and drop every slot after them (each layer's keys and values gathered along the sequence)."""
        keep = check_compact(self._length, start, keep)
        index = torch.tensor([*range(start), *keep], dtype=torch.int64)  # [start + len(keep)]
        for layer in self.inner.layers:  # each a DynamicLayer or a DummyLayer (see _rollback_limit)
            if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
                continue  # another layer's cache (a DummyLayer), or nothing stored yet
            # keys, values: [B, kv_heads, length, head_dim]
            layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, index.to(layer.values.device))
            if hasattr(layer, "cumulative_length"):  # a sliding-window layer, below its window
                layer.cumulative_length = layer.keys.shape[-2]
        self._length = start + len(keep)

    def _append(self, count: int) -> None:
        """Record that a forward pass appended ``count`` slots."""
        self._length += count


class HFModel:
    """A transformers causal language model implementing :class:`~verispec.models.base.LanguageModel`."""

    def __init__(self, model: PreTrainedModel) -> None:
        """Wrap ``model`` (put in eval mode); UsageError when its cache cannot be rolled back exactly."""
        if model.config.is_encoder_decoder:
            raise UsageError(f"{type(model).__name__} is an encoder-decoder model, not a causal LM")
        self._model = model.eval()
        self._config = model.config.get_text_config(decoder=True)
        self.vocab_size = int(self._config.vocab_size)
        limit = _rollback_limit(self._config)
        positions = getattr(self._config, "max_position_embeddings", None)
        if not isinstance(positions, int) or positions < 1:
            raise UsageError(f"{type(model).__name__}'s config gives no max_position_embeddings")
        self.max_context = min(positions, limit)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> HFModel:
        """Load a transformers-format directory (or a hub id) with ``AutoModelForCausalLM``."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return cls(model.to(device))  # type: ignore[arg-type]  # transformers types .to as unbound

    @property
    def device(self) -> torch.device:
        return self._model.device

    @property
    def config(self) -> PretrainedConfig:
        """The transformers config of the (text) decoder: its architecture, as calibration keys use it."""
        return self._config

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> HFCache:
        """An empty cache for ``batch_size`` sequences of at most ``capacity`` (default max_context) slots."""
        capacity = self.max_context if capacity is None else capacity
        check_int(batch_size, "batch_size", 1)
        check_int(capacity, "capacity", 1, self.max_context)
        return HFCache(self._config, batch_size, capacity)

    def forward(
        self, tokens: Tensor, positions: Tensor, cache: Cache, tree_mask: Tensor | None = None
    ) -> Tensor:
        """tokens: [B, T] int64; positions: [B, T] int64. Returns logits [B, T, vocab_size] float32.

        Appends T slots to ``cache``. tree_mask: [T, T] bool (a token tree: new token j attends to the
        committed slots and to the new tokens i with tree_mask[j, i]), passed to the model as a custom 4-D
        mask; UsageError for a model that does not take one."""
        cache = self._check_step(tokens, positions, cache)
        mask = None if tree_mask is None else self._tree_attention_mask(tree_mask, cache.length)
        return self._run(tokens, positions, cache, attention_mask=mask).logits.float()  # [B, T, V]

    def _check_step(self, tokens: Tensor, positions: Tensor, cache: Cache) -> HFCache:
        """``cache``, after checking that it is one of ours that tokens [B, T] and positions [B, T] (int64)
        fit; UsageError otherwise."""
        if not isinstance(cache, HFCache):
            raise UsageError(f"HFModel needs a cache from its own new_cache(), got {type(cache).__name__}")
        if tokens.dim() != 2 or tokens.shape[0] != cache.batch_size or tokens.shape[1] < 1:
            raise UsageError(f"tokens must have shape [{cache.batch_size}, T >= 1], got {list(tokens.shape)}")
        if positions.shape != tokens.shape:
            raise UsageError(f"positions {list(positions.shape)} must match tokens {list(tokens.shape)}")
        if tokens.dtype != torch.int64 or positions.dtype != torch.int64:
            raise UsageError(f"tokens and positions must be int64, got {tokens.dtype} and {positions.dtype}")
        count = tokens.shape[1]
        if cache.length + count > cache.capacity:
            raise UsageError(
                f"{count} more tokens overflow the cache ({cache.length} of {cache.capacity} slots used)"
            )
        return cache

    def prefill(self, tokens: Tensor, positions: Tensor, cache: Cache) -> None:
        """Appends T slots to ``cache`` as :meth:`forward` does; the output head runs on the last position
        only where the model takes ``logits_to_keep``."""
        cache = self._check_step(tokens, positions, cache)
        keep = {"logits_to_keep": 1} if self._keeps_logits else {}
        self._run(tokens, positions, cache, **keep)

    def _run(self, tokens: Tensor, positions: Tensor, cache: HFCache, **options):
        """One forward of the wrapped model that appends T slots to ``cache``; returns its output."""
        with torch.inference_mode():
            out = self._model(
                input_ids=tokens,
                position_ids=positions,
                past_key_values=cache.inner,
                use_cache=True,
                **options,
            )
        cache._append(tokens.shape[1])
        return out

    def _tree_attention_mask(self, tree_mask: Tensor, start: int) -> Tensor:
        """The custom 4-D additive mask [1, 1, T, start + T] of a tree_mask [T, T] bool: 0 where attended,
        the dtype's minimum elsewhere. UsageError when the model would not apply it as given."""
        implementation = getattr(self._config, "_attn_implementation", None)
        if not getattr(self._model, "_supports_attention_backend", False) or implementation not in _MASKABLE:
            raise UsageError(
                f"{type(self._model).__name__} with {implementation} attention does not take a custom 4-D "
                "attention mask: token trees need eager or sdpa attention in a model built on transformers' "
                "attention interface"
            )
        t = tree_mask.shape[0]
        if tree_mask.shape != (t, t) or tree_mask.dtype != torch.bool or not bool(tree_mask.diagonal().all()):
            raise UsageError("tree_mask must be a [T, T] bool tensor letting every token attend to itself")
        visible = torch.cat([tree_mask.new_ones(t, start), tree_mask], dim=1).to(self.device)  # [T, start+T]
        dtype = self._model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)  # [T, start + T]
        return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]  # [1, 1, T, start + T]


def _rollback_limit(config: PretrainedConfig) -> int:
    """The most tokens a cache of this model can hold and still be cropped exactly (a huge number when
    unlimited); UsageError when some layer keeps state that cannot be rolled back."""
    limit = 2**62
    for layer in DynamicCache(config=config).layers:
        if type(layer) is DynamicSlidingWindowLayer:
            # Below its window (or chunk), such a layer keeps every token, attends to all, and crops exactly.
            limit = min(limit, layer.sliding_window - 1)
        elif type(layer) not in (DynamicLayer, DummyLayer):
            raise UsageError(
                f"{config.model_type} models are not supported: their {type(layer).__name__} cache layers "
                "cannot be rolled back exactly"
            )
    return limit


class HFTokenizer:
    """A transformers tokenizer implementing :class:`~verispec.models.base.Tokenizer`.

    ``bos_token_id`` is set only when the tokenizer itself adds a BOS token for this model; ``eos_token_ids``
    is the tokenizer's EOS token together with ``extra_eos_token_ids`` (those of the model's configs).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Iterable[int] = ()) -> None:
        # An empty vocabulary is what transformers loads from a directory without tokenizer files.
        if not tokenizer.encode("a", add_special_tokens=False):
            raise UsageError(f"the tokenizer {type(tokenizer).__name__} has no vocabulary")
        self._tokenizer = tokenizer
        self._spelled: list[bytes] | None = None
        self.vocab_size = len(tokenizer)
        bos = tokenizer.bos_token_id
        adds_bos = bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]
        self.bos_token_id: int | None = bos if adds_bos else None
        eos = set(extra_eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def from_pretrained(cls, path: str | Path, loaded: PreTrainedTokenizerBase | None = None) -> HFTokenizer:
        """The tokenizer of a transformers-format directory (``loaded``: the directory's tokenizer, already in
        memory); EOS ids also from its config and generation config."""
        tokenizer = loaded if loaded is not None else AutoTokenizer.from_pretrained(str(path))
        return cls(tokenizer, _config_eos_token_ids(Path(path)))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped, spaces left as they are (so decoding is prefix-stable)."""
        text = self._tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)  # one sequence of ids decodes to one text
        return text

    def special_token_ids(self) -> frozenset[int]:
        """The ids of its special tokens (those decoding skips): never text to a grammar."""
        return frozenset(i for i, t in self._tokenizer.added_tokens_decoder.items() if t.special)

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for (:class:`~verispec.models.base.SpelledTokenizer`): byte-level pieces
        ("Ġ") through GPT-2's byte alphabet, SentencePiece pieces with "▁" as a space and ``<0xNN>`` as a
        byte; added tokens as their text; the unknown token b"". Computed once."""
        if self._spelled is None:
            tok = self._tokenizer
            added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
            backend = getattr(tok, "backend_tokenizer", None)
            byte_level = backend is not None and '"ByteLevel"' in json.dumps(
                json.loads(backend.to_str())["decoder"]
            )
            alphabet = {c: b for b, c in bytes_to_unicode().items()}
            silent = {tok.unk_token_id} - {None}
            spelled = []
            for i, piece in enumerate(tok.convert_ids_to_tokens(list(range(self.vocab_size)))):
                if i in silent or piece is None:
                    spelled.append(b"")
                elif i in added:
                    spelled.append(added[i].encode())
                elif byte_level and all(c in alphabet for c in piece):
                    spelled.append(bytes(alphabet[c] for c in piece))
                elif match := _BYTE_PIECE.fullmatch(piece):
                    spelled.append(bytes([int(match[1], 16)]))
                else:
                    spelled.append(piece.replace("\u2581", " ").encode())
            self._spelled = spelled
        return self._spelled

    def chat_prompt(self, user_message: str | Sequence[Mapping[str, Any]], tools: Tools | None = None) -> str:
        """``user_message`` (or a conversation: {"role", "content"} messages, an assistant's ``tool_calls``
        and ``tool`` results among them) in the model's chat template, ready for the assistant's reply, with
        the functions it may call (``tools``): rendered by the template where it references ``tools``, else
        by verispec's fallback (:func:`~verispec.grammar.tools.template_messages`); a BOS token the template
        writes is left to ``encode``. UsageError when the tokenizer has no chat template."""
        template = self._tokenizer.chat_template
        if not template:
            raise UsageError("this model's tokenizer has no chat template")
        conversation = (
            [{"role": "user", "content": user_message}] if isinstance(user_message, str) else user_message
        )
        native = re.search(r"\btools\b", str(template)) is not None  # the template renders tools itself
        messages = template_messages(conversation, tools, native)
        definitions: list[Any] | None = None  # transformers takes dicts or functions
        if native and tools is not None:
            definitions = list(tools.definitions)
        text = self._tokenizer.apply_chat_template(
            messages, tools=definitions, add_generation_prompt=True, tokenize=False
        )
        assert isinstance(text, str)  # one conversation, not tokenized: its text
        bos_text = self._tokenizer.bos_token
        if self.bos_token_id is not None and bos_text and text.startswith(bos_text):
            text = text[len(bos_text) :]
        return text


def _config_eos_token_ids(directory: Path) -> set[int]:
    """The EOS token ids named by ``config.json`` and ``generation_config.json`` in ``directory``."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = directory / name
        if not file.is_file():
            continue
        eos = json.loads(file.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids
