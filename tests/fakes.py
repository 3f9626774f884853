"""Small in-memory implementations of the model and tokenizer protocols, for engine tests.

``TableLM`` is a real (if tiny) language model: its next-token logits are a seeded random table indexed by the
last two tokens. Its cache records the tokens it was fed, so tests can check what the engine kept in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from verispec.costs.policies import ConstantK


class TokenCache:
    """Preallocated slots holding the fed token ids; truncate moves the length back."""

    def __init__(self, capacity: int) -> None:
        self.slots = torch.full((capacity,), -1, dtype=torch.long)  # [capacity]
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self.slots.shape[0]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {length}")
        self._length = length

    def tokens(self) -> list[int]:
        return self.slots[: self._length].tolist()


class TableLM:
    """Next-token logits = table[second-last token, last token] (id ``vocab_size`` stands for "none")."""

    def __init__(self, vocab_size: int, seed: int, max_context: int = 256, sharpness: float = 3.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.table = sharpness * torch.randn(vocab_size + 1, vocab_size + 1, vocab_size, generator=g)
        self.calls: list[int] = []  # tokens fed per forward call

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> TokenCache:
        return TokenCache(capacity or self.max_context)

    def forward(self, tokens: Tensor, positions: Tensor, cache: TokenCache) -> Tensor:
        """tokens, positions: [1, T]. Returns logits [1, T, V]."""
        t = tokens.shape[1]
        start = cache.length
        if start + t > cache.capacity:
            raise ValueError("cache capacity exceeded")
        if not torch.equal(positions[0], torch.arange(start, start + t)):
            raise ValueError(f"positions {positions[0].tolist()} do not follow the cache length {start}")
        cache.slots[start : start + t] = tokens[0]
        cache._length = start + t
        self.calls.append(t)
        none = self.vocab_size
        seq = [none, none, *cache.slots[: start + t].tolist()]  # context, padded on the left
        rows = [self.table[seq[start + j], seq[start + j + 1]] for j in range(1, t + 1)]
        return torch.stack(rows).unsqueeze(0)

    def prefill(self, tokens: Tensor, positions: Tensor, cache: TokenCache) -> None:
        self.forward(tokens, positions, cache)

    def greedy(self, prompt: list[int], n: int, eos: frozenset[int] = frozenset()) -> list[int]:
        """Reference greedy decoding without any cache: argmax of the table, token by token."""
        ids = list(prompt)
        none = self.vocab_size
        out: list[int] = []
        while len(out) < n:
            seq = [none, none, *ids]
            nxt = int(self.table[seq[-2], seq[-1]].argmax())
            ids.append(nxt)
            out.append(nxt)
            if nxt in eos:
                break
        return out

    def next_probs(self, context: Sequence[int]) -> Tensor:
        """softmax of the next-token logits after ``context``: [V]."""
        seq = [self.vocab_size, self.vocab_size, *context]
        return self.table[seq[-2], seq[-1]].softmax(-1)


class LetterTokenizer:
    """One token per lowercase letter: id i is chr(ord('a') + i)."""

    def __init__(self, vocab_size: int, eos: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = None
        self.eos_token_ids = frozenset(eos)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids if i not in self.eos_token_ids)

    def chat_prompt(self, user_message: str) -> str:
        raise ValueError("this tokenizer has no chat template")


class Alternating(ConstantK):
    """A token tree's K policy that asks for tree rounds and plain ones in turn, the first a tree round or
    not (``first``): what TreeGate's choices may be, whatever they are; ``drafted`` records what each round
    was told it did."""

    def __init__(self, first: bool) -> None:
        super().__init__(0)
        self.next, self.drafted = first, list[bool]()

    def tree_round(self, context: int = 0) -> bool:
        return self.next

    def observe_tree(self, drafted: bool, tokens: int, seconds: float) -> None:
        self.drafted.append(drafted)
        self.next = not self.next
