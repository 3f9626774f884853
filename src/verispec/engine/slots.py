"""The engine's slots: one cache each (the rows of one target cache where the target scores rows together,
:class:`~verispec.models.base.RowModel`), and the sequence last admitted to each, whose keys and values a
next prompt that begins like it keeps instead of scoring them again (a chat's next turn, a common system
prompt), from its own slot or copied from another row's.

A position's keys, values and hidden state are a function of the tokens up to it alone (in the native
kernels, bit for bit), so what is kept is what scoring the prompt again would give."""

from __future__ import annotations

import torch

from verispec.drafting.base import common_prefix
from verispec.engine.sequence import Running
from verispec.models.base import Cache, LanguageModel, RowModel

__all__ = ["Slots"]


class Slots:
    """``count`` slots of ``target``: :attr:`caches` (one per slot), :attr:`rows` (the target where its rows
    are scored together and copied from one another, else None) and the sequence last admitted to each."""

    def __init__(self, target: LanguageModel, count: int) -> None:
        self.rows = target if isinstance(target, RowModel) else None
        self.caches: list[Cache]  # rows of one cache, a drafter's rows beside them (one slot too)
        if self.rows is not None:
            self.caches = self.rows.new_cache_rows(count)
        else:
            self.caches = [target.new_cache() for _ in range(count)]
        self._last: dict[int, Running] = {}  # slot → the last sequence admitted there

    def __len__(self) -> int:
        return len(self.caches)

    def choose(self, prompt: list[int], taken: set[int]) -> tuple[int, dict[int, int]]:
        """The free slot (not in ``taken``) that ``prompt`` joins, and the start each slot's last sequence
        shares with it. Where rows cannot copy from one another, the one sharing the longest start (the first
        on ties): only a slot's own start can be kept. Where they can (a start is kept from whichever row
        holds it), a slot whose last sequence the prompt replaces — none, or one whose whole prompt it begins
        with (a conversation's next turn: its last output's tail, where the template renders it otherwise,
        is never needed again) — the longest shared first; else the least recently admitted. So a
        conversation keeps its keys and values while others come and go between its turns, even ones that
        share its start (the same system prompt and tools): they copy that start into a slot of their own."""
        shared = {i: self._held(i, prompt) for i in range(len(self))}
        free = [i for i in range(len(self)) if i not in taken]
        if self.rows is None:
            return max(free, key=lambda i: shared[i]), shared  # the first on ties

        def rank(slot: int) -> tuple[bool, int, float]:
            last = self._last.get(slot)
            if last is None or shared[slot] >= len(last.request.prompt):
                return False, -shared[slot], 0.0
            return True, 0, last.started

        return min(free, key=rank), shared

    def keep(
        self, slot: int, shared: dict[int, int], prompt: list[int], reads_hidden: bool
    ) -> tuple[int, torch.Tensor | None]:
        """Keep in ``slot``'s cache the longest start of ``prompt`` that a row holds (``shared``: each slot's
        shared start), its own or copied from another row's: how many positions are kept, and the hidden
        states [T, H] the source row's sequence was handed (None: none, or a drafter that reads none,
        ``reads_hidden`` false)."""
        donors = [slot] + ([i for i in shared if i != slot] if self.rows is not None else [])
        keepable = {i: self._keepable(i, shared[i], prompt, reads_hidden) for i in donors}
        source = max(donors, key=lambda i: keepable[i])  # the slot's own on ties: nothing copied
        kept, last = keepable[source], self._last.get(source)
        handed = last.hidden if last is not None and reads_hidden else []
        if source == slot:
            self.caches[slot].truncate(kept)
        else:
            assert self.rows is not None  # donors other than the slot only then
            self.rows.copy_prefix(self.caches[source], self.caches[slot], kept)
        return kept, torch.cat(handed) if handed else None

    def admitted(self, running: Running) -> None:
        """``running`` is its slot's last sequence (what the next prompt there may keep)."""
        self._last[running.slot] = running

    def spoiled(self, running: Running) -> None:
        """``running`` failed: its slot's cache is not kept for the next sequence there."""
        if self._last.get(running.slot) is running:
            del self._last[running.slot]

    def _keepable(self, slot: int, shared: int, prompt: list[int], reads_hidden: bool) -> int:
        """How many positions of ``prompt`` a sequence can keep from ``slot``'s cache, which holds the
        ``shared`` first tokens of it: all but the last, and for a drafter that reads hidden states
        (``reads_hidden``) no more than the slot's last sequence was handed."""
        kept = min(shared, len(prompt) - 1)
        if reads_hidden:
            last = self._last.get(slot)
            kept = min(kept, 0 if last is None else sum(len(h) for h in last.hidden))
        return kept

    def _held(self, slot: int, prompt: list[int]) -> int:
        """How many first tokens of ``prompt`` ``slot``'s cache holds the keys and values of: those its last
        (or running) sequence shares with it, among the ones it had written (rolled-back drafts are not)."""
        last = self._last.get(slot)
        if last is None:
            return 0
        return common_prefix(last.ids[: last.cache.length], prompt)
