"""Drafters: cheap proposers of the next tokens, behind one narrow protocol.

A drafter sees the committed context (prompt + generated tokens), proposes up to ``k`` tokens, optionally with
the distributions q it sampled them from, and is then told how many of them the target accepted. Guarantees:

- ``propose`` returns at most ``k`` tokens (fewer, or none, is always allowed);
- when it returns ``q``, each token was sampled from the matching row of ``q`` (with ``generator``), and ``q``
  is the draft's distribution after :func:`verispec.sampling.probs_from_logits` with the engine's parameters —
  the condition under which rejection sampling is exact; a drafter without probabilities returns ``q = None``
  and is verified as single guesses (still exact); with ``SamplingParams.invariant`` the engine keeps a draft
  token only where it is the target's own draw, so any proposal is exact, and a drafter that samples draws
  with the target's noise at that position (:func:`verispec.sampling.draft_draw`) to propose that draw often;
- ``observe`` is called once after every ``propose`` with the number of accepted tokens, before the next
  ``propose``, so a stateful drafter can roll its cache back to the committed context;
- a drafter that is a :class:`HiddenStateReader` (the eagle and medusa drafters of
  :mod:`verispec.drafting.learned`) also gets ``observe_hidden(hidden)``, hidden: [T, H], the target's final
  hidden states at the next T committed positions, in order (the prompt's but its last token after
  ``begin``, then each round's committed ones, before ``observe``); the engine computes them only for such a
  drafter;
- a drafter that is a :class:`SequenceEnd` (the suffix drafters of :mod:`verispec.drafting.suffix`) is also
  told, with ``finish(ids)``, the committed tokens (prompt, then output) of a sequence the engine retires
  having finished it (an end of sequence, a stop string, the token limit or the context's), once; never for
  a cancelled or failed one.

The tree counterpart: a tree drafter sees the committed context and a tree shape
(:mod:`verispec.drafting.tree`; the drafter's own :attr:`TreeDrafter.shape`, capped by the engine to the
tokens and context left) and returns a tree within that shape, rooted at the last committed token. Guarantees:

- ``propose_tree`` returns a subset of the shape's nodes holding every ancestor of each (fewer nodes, down
  to the root alone, is always allowed);
- with ``q`` None, each draft token is a deterministic function of the context and its path, and siblings
  hold different tokens: the tree is verified as single guesses, exactly;
- with ``q``, the children of a node are independent samples (with replacement) of one distribution, the
  draft's after :func:`verispec.sampling.probs_from_logits` with the engine's parameters, given as each
  child's row of ``q``: the condition under which tree rejection sampling is exact (with invariant draws,
  the first child is the position's own draw instead, as above);
- a shape with a node budget (dynamic) is taken only by drafters that rank their nodes (``dynamic``: the
  learned head's); the others refuse it.

The drafters themselves: :mod:`verispec.drafting.ngram` (prompt lookup), :mod:`verispec.drafting.suffix`
(SuffixDecoding: the request's own text and previous requests' outputs), :mod:`verispec.drafting.draft_model`
(a smaller model, or the target's first layers), :mod:`verispec.drafting.learned` (EAGLE heads, Medusa heads,
a trained exit, lookahead tokens); their names, capabilities and factories are in
:mod:`verispec.drafting.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from verispec.drafting.tree import TreeProposal, TreeShape
from verispec.errors import UsageError
from verispec.sampling import draft_draw, probs_from_logits, sample

__all__ = [
    "BranchedTreeDrafter",
    "Drafter",
    "HiddenStateReader",
    "NoDrafter",
    "Proposal",
    "SequenceEnd",
    "TreeDrafter",
    "check_static",
]


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for the next positions of one sequence."""

    tokens: Tensor  # [K'] int64, K' <= k
    q: Tensor | None  # [K', V] draft distributions the tokens were sampled from, or None (single guesses)

    @classmethod
    def empty(cls) -> Proposal:
        return cls(tokens=torch.zeros(0, dtype=torch.long), q=None)


class Drafter(Protocol):
    """Proposes draft tokens for a context; see the module docstring for the guarantees."""

    name: str

    def begin(self, prompt: list[int]) -> None:
        """Start a new sequence whose context begins with ``prompt``."""
        ...

    def propose(self, context: list[int], k: int, generator: torch.Generator) -> Proposal:
        """Up to ``k`` tokens likely to follow ``context`` (the whole committed sequence)."""
        ...

    def observe(self, num_accepted: int) -> None:
        """The target accepted the first ``num_accepted`` tokens of the last proposal."""
        ...


class NoDrafter:
    """Proposes nothing: plain autoregressive decoding through the same engine, the speed baseline."""

    name = "none"

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose(self, context: list[int], k: int, generator: torch.Generator) -> Proposal:
        return Proposal.empty()

    def observe(self, num_accepted: int) -> None:
        pass


@runtime_checkable
class HiddenStateReader(Protocol):
    """A drafter that reads the target's final hidden states: the engine computes them only for such a
    drafter and hands over those of the committed positions with ``observe_hidden`` (module docstring)."""

    def observe_hidden(self, hidden: Tensor) -> None:
        """hidden: [T, H], the target's final hidden states at the next T committed positions, in order."""
        ...


@runtime_checkable
class SequenceEnd(Protocol):
    """A drafter told when its sequence finishes (module docstring): what learns from whole outputs."""

    def finish(self, ids: list[int]) -> None:
        """The sequence finished with the committed tokens ``ids``: its prompt, then its output."""
        ...


@runtime_checkable
class TreeDrafter(Protocol):
    """Proposes a token tree for a context; see the module docstring for the guarantees."""

    name: str
    shape: TreeShape  # the largest tree it drafts

    def begin(self, prompt: list[int]) -> None:
        """Start a new sequence whose context begins with ``prompt``."""
        ...

    def propose_tree(self, context: list[int], shape: TreeShape, generator: torch.Generator) -> TreeProposal:
        """A tree within ``shape`` (a capped version of :attr:`shape`) rooted at ``context[-1]``."""
        ...


def check_static(shape: TreeShape, drafter: str) -> None:
    """UsageError, one line, when ``shape`` has a node budget: only the eagle drafter takes dynamic trees."""
    if shape.budget is not None:
        raise UsageError(f"dynamic trees ({shape.name}) need the eagle drafter, not {drafter!r}")


class BranchedTreeDrafter:
    """What the tree drafters that branch a chain drafter share: the chain ``drafter`` (its ``sampling``, the
    engine's parameters), the ``shape``, and whether children are sampled (only at a temperature > 0)."""

    dynamic = False  # whether it takes shapes with a node budget

    def __init__(self, drafter, shape: TreeShape, sampled: bool = False) -> None:
        if not self.dynamic:
            check_static(shape, drafter.name)
        self.drafter = drafter
        self.shape = shape
        self.sampled = sampled and not drafter.sampling.greedy

    def begin(self, prompt: list[int]) -> None:
        self.drafter.begin(prompt)

    def _pick(
        self, logits: Tensor, count: int, generator: torch.Generator, position: int, ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``count`` children at ``position`` of a node from its draft logits [W] (over the draft's own
        vocabulary, entry i the target's id ``ids[i]``; None: i): the top ``count`` indices and None, or
        (``sampled``) ``count`` samples and the q [W] they were drawn from: independent ones, or with
        invariant draws the position's own draw (:func:`~verispec.sampling.draft_draw`) first."""
        if not self.sampled:
            return logits.topk(min(count, logits.shape[-1])).indices, None
        sampling = self.drafter.sampling
        q = probs_from_logits(logits, sampling)  # [W]
        if not sampling.invariant:
            return sample(q, generator, count), q
        return torch.cat(
            [draft_draw(q, generator, sampling, position, ids), sample(q, generator, count - 1)]
        ), q

    def _proposal(
        self, shape: TreeShape, root: int, tokens: dict[int, int], q_rows: dict[int, Tensor | None]
    ) -> TreeProposal:
        """The tree of the filled shape nodes ``tokens`` (node → token; node 0 holds ``root``); with sampled
        children, q stacks each node's ``q_rows`` [V] under a point mass on the root (committed, never
        verified)."""
        nodes = sorted(tokens)
        rows = [row for row in (q_rows[n] for n in nodes[1:]) if row is not None]  # [V] each
        q = None
        if self.sampled and rows:
            assert len(rows) == len(nodes) - 1  # sampled children always come with their q
            point = torch.zeros_like(rows[0])  # [V]
            point[root] = 1.0
            q = torch.stack([point, *rows]).cpu()  # [N, V]
        return shape.select(nodes, [tokens[n] for n in nodes], q)
