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
- ``propose`` takes ``allowed`` (an :data:`Allowed`, None without a grammar): under structured output
  (:mod:`verispec.grammar`), the grammar's mask at each draft position, ``allowed(path)`` [V'] bool the tokens
  allowed after the context and the draft tokens ``path`` proposed before that position (None: the path left
  the grammar). It only looks: the committed grammar state never moves. A drafter that samples from q masks
  its logits with it BEFORE the one transform (:func:`allowed_logits`), samples from that masked q and
  reports it — the condition above, so still exact, and no draft position is spent on a token whose
  constrained p is 0; with invariant draws it draws from the masked q with the same noise. A drafter of
  single guesses stops its chain at the first guess the grammar forbids (:func:`allowed_guesses`). Not
  masking stays exact too (the constrained p of a forbidden token is 0: it is rejected with certainty) but
  wastes the position;
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
  a cancelled or failed one;
- a drafter that is a :class:`RowDrafter` (the eagle and medusa chain drafters beside a native target, a
  draft model on the native kernels beside an engine's slots) may be asked, with the other sequences of a
  batch whose drafters share its :attr:`RowDrafter.rows_key`, for all their proposals at once
  (``propose_rows``): each row's is exactly what its own ``propose`` returns.

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
- with ``allowed`` (as above; ``path`` the tokens from the root, excluded, to the node whose children are
  drafted), sampled children come from the masked q, and single-guess trees hold only allowed tokens
  (top-c of the masked logits, or :func:`allowed_tree`: forbidden nodes dropped with their subtrees);
- a shape with a node budget (dynamic) is taken only by drafters that rank their nodes (``dynamic``: the
  learned head's); the others refuse it.

The drafters themselves: :mod:`verispec.drafting.ngram` (prompt lookup), :mod:`verispec.drafting.suffix`
(SuffixDecoding: the request's own text and previous requests' outputs), :mod:`verispec.drafting.draft_model`
(a smaller model, or the target's first layers), :mod:`verispec.drafting.learned` (EAGLE heads, Medusa heads,
a trained exit, lookahead tokens); their names, capabilities and factories are in
:mod:`verispec.drafting.registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

import torch
from torch import Tensor

from verispec.drafting.tree import TreeProposal, TreeShape
from verispec.errors import UsageError
from verispec.sampling import draft_draw, probs_from_logits, sample

__all__ = [
    "Allowed",
    "BoundedCatchUp",
    "BranchedTreeDrafter",
    "DraftRow",
    "Drafter",
    "HiddenStateReader",
    "NoDrafter",
    "Proposal",
    "RowDrafter",
    "SequenceEnd",
    "TreeDrafter",
    "allowed_guesses",
    "allowed_logits",
    "allowed_tree",
    "check_static",
    "common_prefix",
    "constrain",
]

Allowed = Callable[[Sequence[int]], Tensor | None]
"""The grammar's mask at a draft position, for one proposal: ``allowed(path)`` → [V'] bool, the tokens the
grammar allows after the context and the draft tokens ``path`` before that position, or None where ``path``
leaves the grammar (V' ≤ V: ids ≥ V' are never allowed). Tentative: it never advances the committed state."""


def common_prefix(held: Sequence[int], tokens: Sequence[int]) -> int:
    """How many first tokens ``held`` and ``tokens`` share: what a cache holding ``held`` keeps of a prompt
    ``tokens`` (the keys and values of a position depend on the tokens up to it alone)."""
    n = min(len(held), len(tokens))
    return next((i for i in range(n) if held[i] != tokens[i]), n)


def constrain(logits: Tensor, allowed: Tensor) -> Tensor:
    """logits [..., V] with −inf at every token ``allowed`` [..., V'] (bool, V' ≤ V; ids ≥ V' are never
    allowed) does not hold: what the one transform then turns into the constrained p (or masked q)."""
    width = allowed.shape[-1]
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)  # [..., V]
    keep[..., :width] = allowed.to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))


def allowed_logits(
    logits: Tensor, allowed: Allowed | None, path: Sequence[int], ids: Tensor | None = None
) -> Tensor | None:
    """A draft's logits [W] (entry i the target's id ``ids[i]``, −1 for none; None: i) masked to the tokens
    ``allowed`` after ``path`` (−inf elsewhere, then through the one transform: the q a drafter samples from
    and reports is the masked one); unchanged without a grammar; None where the grammar allows none of them
    there (the path left it, or ended): the draft stops. The one place a drafter's logits are masked."""
    if allowed is None:
        return logits
    mask = allowed(path)  # [V'] bool
    if mask is None:
        return None
    if ids is not None:
        ids = ids.to(mask.device)
        inside = (ids >= 0) & (ids < mask.shape[0])  # [W]
        mask = inside & mask[ids.clamp(0, mask.shape[0] - 1)]  # [W]
    masked = constrain(logits, mask)  # [W]
    return masked if bool(torch.isfinite(masked).any()) else None


def allowed_guesses(tokens: Sequence[int], allowed: Allowed | None) -> list[int]:
    """The single guesses ``tokens`` up to the first one the grammar forbids after those before it (all of
    them without a grammar). Exact: a single guess x is accepted with probability p(x), and the constrained
    p(x) of a forbidden x is 0, so it would be rejected with certainty, the token then drawn from the
    residual — p itself, as p(x) = 0 — exactly what the target draws when the chain stops before x; the
    guesses after it are never reached. Cutting the chain there changes no output, only spares positions."""
    kept: list[int] = []
    for token in tokens:
        mask = None if allowed is None else allowed(kept)  # [V'] bool
        if allowed is not None and (mask is None or token >= mask.shape[0] or not bool(mask[token])):
            break
        kept.append(int(token))
    return kept


def allowed_tree(tree: TreeProposal, allowed: Allowed | None) -> TreeProposal:
    """A single-guess tree (q None) without the nodes the grammar forbids after their path, each dropped
    with its subtree (unchanged without a grammar). Exact as :func:`allowed_guesses`: at a node, the
    children are tried as single guesses, a forbidden one (constrained p = 0) is rejected with certainty
    and leaves the residual unchanged, so the verification goes on as if it were not there."""
    if allowed is None:
        return tree
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths: dict[int, list[int]] = {0: []}  # kept node → its tokens from the root (excluded)
    for node in range(1, len(tokens)):
        if parents[node] in paths:
            mask = allowed(paths[parents[node]])  # [V'] bool
            if mask is not None and tokens[node] < mask.shape[0] and bool(mask[tokens[node]]):
                paths[node] = [*paths[parents[node]], tokens[node]]
    kept = sorted(paths)
    if len(kept) == len(tokens):
        return tree
    index = torch.tensor(kept, dtype=torch.long)  # [M]
    position = {node: i for i, node in enumerate(kept)}
    return TreeProposal(
        tokens=tree.tokens[index],  # [M]
        parents=torch.tensor([-1] + [position[parents[n]] for n in kept[1:]], dtype=torch.long),  # [M]
        depth=tree.depth[index],  # [M]
        mask=tree.mask[index][:, index],  # [M, M]
        q=None,
    )


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

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        """Up to ``k`` tokens likely to follow ``context`` (the whole committed sequence), within
        ``allowed`` (the grammar's mask at each draft position; None: no grammar)."""
        ...

    def observe(self, num_accepted: int) -> None:
        """The target accepted the first ``num_accepted`` tokens of the last proposal."""
        ...

    def cost_identity(self) -> dict:
        """What this drafter's cost per proposal depends on besides the target, as JSON-able values: its name
        and every setting, model or head that changes the time a proposal takes. Calibrated costs are cached
        under it (:func:`verispec.costs.calibrate.calibrate`): two drafters with the same identity share a
        cost, so each drafter says its own (no list elsewhere to keep up to date)."""
        ...


class NoDrafter:
    """Proposes nothing: plain autoregressive decoding through the same engine, the speed baseline."""

    name = "none"

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        return Proposal.empty()

    def observe(self, num_accepted: int) -> None:
        pass

    def cost_identity(self) -> dict:
        return {"drafter": self.name}


@dataclass(frozen=True)
class DraftRow:
    """One sequence's part of proposals made together (:class:`RowDrafter`): what its :meth:`Drafter.propose`
    would take."""

    drafter: Drafter
    context: list[int]
    k: int
    generator: torch.Generator
    allowed: Allowed | None = None


@runtime_checkable
class RowDrafter(Protocol):
    """A chain drafter whose proposals for several sequences run together: drafters with the same
    :attr:`rows_key` (not None) are handed to :meth:`propose_rows` at once (a learned head's forwards over the
    rows of a batch), which gives each row exactly the proposal its own :meth:`Drafter.propose` would."""

    @property
    def rows_key(self) -> object | None:
        """Drafters with the same key propose together; None: this one alone."""
        ...

    @classmethod
    def propose_rows(cls, rows: Sequence[DraftRow]) -> list[Proposal]:
        """Every row's proposal (its drafter's, all with one :attr:`rows_key`), in order."""
        ...


class ProposesByRows(ABC):
    """A :class:`RowDrafter` whose own :meth:`Drafter.propose` is its row alone through
    :meth:`propose_rows`, so that a row's proposal is the same alone or among others by construction."""

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        return self.propose_rows([DraftRow(cast(Drafter, self), context, k, generator, allowed)])[0]

    @classmethod
    @abstractmethod
    def propose_rows(cls, rows: Sequence[DraftRow]) -> list[Proposal]:
        """Every row's proposal (:meth:`RowDrafter.propose_rows`)."""


@runtime_checkable
class HiddenStateReader(Protocol):
    """A drafter that reads the target's final hidden states: the engine computes them only for such a
    drafter and hands over those of the committed positions with ``observe_hidden`` (module docstring)."""

    def observe_hidden(self, hidden: Tensor) -> None:
        """hidden: [T, H], the target's final hidden states at the next T committed positions, in order."""
        ...


@runtime_checkable
class BoundedCatchUp(Protocol):
    """A drafter whose catch-up reads at most ``catch_up_limit`` of the committed positions it has not read,
    the last ones (None: all of them): what a round that drafts after a long stretch pays
    (:attr:`~verispec.costs.analytic.CostModel.catch_up_limit`)."""

    catch_up_limit: int | None


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

    def propose_tree(
        self, context: list[int], shape: TreeShape, generator: torch.Generator, allowed: Allowed | None = None
    ) -> TreeProposal:
        """A tree within ``shape`` (a capped version of :attr:`shape`) rooted at ``context[-1]``, within
        ``allowed`` (the grammar's mask after each node's path; None: no grammar)."""
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
        """``count`` children at ``position`` of a node from its draft logits [W] (masked by the grammar
        with :func:`allowed_logits`, or not; over the draft's own
        vocabulary, entry i the target's id ``ids[i]``; None: i): the top ``count`` indices and None, or
        (``sampled``) ``count`` samples and the q [W] they were drawn from: independent ones, or with
        invariant draws the position's own draw (:func:`~verispec.sampling.draft_draw`) first."""
        if not self.sampled:  # top-c of the tokens not masked out
            return logits.topk(min(count, int(torch.isfinite(logits).sum()))).indices, None
        sampling = self.drafter.sampling
        q = probs_from_logits(logits, sampling)  # [W]
        if not sampling.invariant:
            return sample(q, generator, count), q
        return torch.cat(
            [draft_draw(q, generator, sampling, position, ids), sample(q, generator, count - 1)]
        ), q

    @staticmethod
    def _path(node: int, tokens: dict[int, int], parents: list[int]) -> list[int]:
        """The tokens from the root (excluded) to ``node`` (included): the path of its children's mask."""
        path: list[int] = []
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        return path[::-1]

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


class HiddenStateTreeDrafter(BranchedTreeDrafter):
    """A branched tree drafter of a chain drafter that reads the target's hidden states (a
    :class:`HiddenStateReader`, so this one too): the states go to the chain drafter."""

    def observe_hidden(self, hidden: Tensor) -> None:
        """hidden: [T, H], the target's final hidden states at the next T committed positions."""
        self.drafter.observe_hidden(hidden)
