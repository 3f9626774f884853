"""Prompt lookup first, a learned head elsewhere: :class:`LookupFirstDrafter`.

Copying and predicting fail in different places. Where the context's suffix occurred before (an edit
returning the code it was given, a summary quoting its passage), what followed it is a long run of guesses
the target accepts and costs nothing to find; where it did not (a chat's new sentence), the lookup has
nothing to say and a learned head, which reads the target's hidden states, drafts instead. Each round asks
the lookup first and the head only when the lookup proposes nothing.

Exact as each of its parts: a round's proposal is one drafter's whole proposal, made from the committed
context alone (which one drafts depends on nothing the verifier draws), with that drafter's own q — the
lookup's single guesses (q None) or the head's sampled q. The head reads every committed position's hidden
state whichever drafted (it catches up on the positions of the rounds it sat out, in its next forward), and
its cache is rolled back after every round, as when it drafts every round.

With ``--k auto`` each part drafts at its own K (:class:`~verispec.costs.policies.PartsK`: a policy per part,
from its own calibrated costs and its own acceptance), asked once the round knows which part drafts: a
lookup's guesses are free and often long, the head's drafts cost a share of a target step and are right less
often, so where the head does not pay its rounds are plain ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from torch import Tensor

from verispec.costs.policies import PartsK
from verispec.drafting.base import Drafter, DraftRow, Proposal, ProposesByRows, RowDrafter
from verispec.drafting.ngram import NGramDrafter

__all__ = ["LookupFirstDrafter"]


class LookupFirstDrafter(ProposesByRows):
    """The lookup's proposal where it has one, else the head's (module docstring). ``head``: a chain drafter
    reading the target's hidden states (eagle, medusa); where it is a :class:`RowDrafter`, the rows of a batch
    whose lookup found nothing draft together."""

    def __init__(self, lookup: NGramDrafter, head: Drafter, name: str) -> None:
        self.lookup = lookup
        self.head = head
        self.name = name
        self.policy: PartsK | None = None  # each part's K with --k auto (the request's policy)

    @property
    def rows_key(self) -> object | None:
        """The head's: the rows whose heads share a batch's cache propose together."""
        return self.head.rows_key if isinstance(self.head, RowDrafter) else None

    def begin(self, prompt: list[int]) -> None:
        self.lookup.begin(prompt)
        self.head.begin(prompt)

    def observe_hidden(self, hidden: Tensor) -> None:
        """hidden: [T, H], the target's final hidden states at the next T committed positions."""
        self.head.observe_hidden(hidden)  # type: ignore[attr-defined]  # a HiddenStateReader (registry)

    def _k(self, part: str, row: DraftRow) -> int:
        """The round's K for ``part``: its own policy's with ``--k auto`` (:class:`PartsK`), within the
        engine's ``row.k`` (the room left); else ``row.k``."""
        if self.policy is None:
            return row.k
        return min(row.k, self.policy.part_k(part, len(row.context)))

    @classmethod
    def propose_rows(cls, rows: Sequence[DraftRow]) -> list[Proposal]:
        """Each row's lookup, then the heads of the rows it left empty, together where the head is a
        :class:`RowDrafter` (each row's proposal exactly its own :meth:`propose`'s)."""
        drafters = [cast(LookupFirstDrafter, row.drafter) for row in rows]  # rows share one rows_key
        proposals, heads, left = [], [], []
        for i, (d, row) in enumerate(zip(drafters, rows, strict=True)):
            if row.k <= 0:  # no room: no part drafts, none is asked
                proposals.append(Proposal.empty())
                continue
            found = d.lookup.propose(row.context, row.k, row.generator, row.allowed)
            if found.tokens.numel() > 0:
                proposals.append(Proposal(found.tokens[: d._k("lookup", row)], None))
                continue
            proposals.append(found)
            k = d._k("head", row)
            if k > 0:
                heads.append(DraftRow(d.head, row.context, k, row.generator, row.allowed))
                left.append(i)
        if not heads:
            return proposals
        head = heads[0].drafter
        drafted = (
            type(head).propose_rows(heads)
            if isinstance(head, RowDrafter) and len(heads) > 1
            else [row.drafter.propose(row.context, row.k, row.generator, row.allowed) for row in heads]
        )
        for i, proposal in zip(left, drafted, strict=True):
            proposals[i] = proposal
        return proposals

    def observe(self, num_accepted: int) -> None:
        self.lookup.observe(num_accepted)
        self.head.observe(num_accepted)

    def cost_identity(self) -> dict:
        lookup, head = self.lookup.cost_identity(), self.head.cost_identity()
        return {"drafter": self.name, "lookup": lookup, "head": head}
