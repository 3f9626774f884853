"""The per-sequence grammar state the engine drives, and the pure steps of a constrained round (the definition
is in :mod:`verispec.grammar`): the masks of a chain's or a tree's positions, the forced run, a proposal with
it first, the masked logits, and the commit after verification.

A state holds the committed tokens and a *tentative* path after them: ``mask_after(path)`` moves the tentative
path to ``path`` (rolling back only what differs) and ``settle(tokens)`` makes ``tokens`` committed, rolled
back to the prefix they share with the tentative path first. Nothing a drafter does reaches it: only the
engine's ``settle`` after verification advances the committed tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from verispec.drafting.base import Proposal, constrain
from verispec.drafting.tree import TreeProposal
from verispec.errors import UsageError

__all__ = [
    "GrammarState",
    "chain_masks",
    "committed_mask",
    "constrain",
    "finish",
    "forced_run",
    "tree_masks",
    "tree_with_forced",
    "with_forced",
]


@runtime_checkable
class GrammarState(Protocol):
    """One sequence's grammar state: committed tokens plus a tentative path after them."""

    vocab_size: int  # the width of its masks (the tokenizer's; a model's logits may be wider)

    def mask_after(self, path: Sequence[int]) -> Tensor | None:
        """[vocab_size] bool: the tokens allowed after the committed ones and ``path``; None when ``path``
        leaves the grammar (a token it does not allow, or anything after the end). Tentative: the committed
        tokens are unchanged."""
        ...

    def settle(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` (allowed ones) after the committed tokens; the tentative path is then empty."""
        ...

    @property
    def finished(self) -> bool:
        """Whether nothing but an end-of-sequence token is allowed after the committed tokens."""
        ...


def committed_mask(state: GrammarState) -> Tensor:
    """[V'] bool, the tokens allowed after the committed ones; UsageError when the grammar allows none (a
    dead end: the request ends with that reason instead of looping)."""
    mask = state.mask_after([])
    if mask is None or not bool(mask.any()):
        raise UsageError("the grammar allows no token here: the output cannot be completed")
    return mask


def _reachable(mask: Tensor | None, width: int) -> Tensor:
    """A position's mask, or every token where it cannot be reached (after a token the grammar does not
    allow, or after the end): verification never gets there (p(x) = 0 rejects that token with certainty),
    and the transform needs a row with a token in it."""
    if mask is None or not bool(mask.any()):
        return torch.ones(width, dtype=torch.bool)  # [V']
    return mask


def forced_run(state: GrammarState, limit: int) -> list[int]:
    """The tokens forced after the committed ones: while exactly one token is allowed, that token, at most
    ``limit`` of them (none after an end-of-sequence token: nothing is allowed there)."""
    run: list[int] = []
    mask: Tensor | None = committed_mask(state)
    while len(run) < limit and mask is not None and int(mask.sum()) == 1:
        run.append(int(mask.nonzero()[0, 0]))
        mask = state.mask_after(run)
    return run


def chain_masks(state: GrammarState, tokens: Sequence[int]) -> Tensor:
    """[len(tokens) + 1, V'] bool: row i the tokens allowed after the committed ones and ``tokens[:i]``, the
    mask of the round's position i (row 0: the committed prefix's)."""
    rows = [committed_mask(state)]
    rows += [_reachable(state.mask_after(tokens[: i + 1]), state.vocab_size) for i in range(len(tokens))]
    return torch.stack(rows)


def tree_masks(state: GrammarState, tokens: Sequence[int], parents: Sequence[int]) -> Tensor:
    """[N, V'] bool: node i's row the tokens allowed after the committed ones and the path from the root
    (node 0, the last committed token, not on the path) to node i, its own token included: the mask of its
    children's position. ``parents`` [N], each node after its parent."""
    paths: list[list[int]] = [[]]
    for node in range(1, len(tokens)):
        paths.append([*paths[parents[node]], tokens[node]])
    rows = [committed_mask(state)]
    rows += [_reachable(state.mask_after(path), state.vocab_size) for path in paths[1:]]
    return torch.stack(rows)


def with_forced(forced: Sequence[int], proposal: Proposal) -> Proposal:
    """``proposal`` (the drafter's, after the forced tokens) with the forced tokens first; when it has q,
    each forced token's row of q is a point mass on it (it was drawn from that)."""
    if not forced:
        return proposal
    head = torch.tensor(list(forced), dtype=torch.long)  # [F]
    tokens = torch.cat([head, proposal.tokens.to(head.device)])  # [F + K']
    if proposal.q is None:
        return Proposal(tokens, None)
    points = proposal.q.new_zeros(len(forced), proposal.q.shape[-1])  # [F, V]
    points[torch.arange(len(forced)), head.to(points.device)] = 1.0
    return Proposal(tokens, torch.cat([points, proposal.q]))  # q: [F + K', V]


def tree_with_forced(root: int, forced: Sequence[int], tree: TreeProposal) -> TreeProposal:
    """The tree a constrained tree round verifies: ``root`` (the last committed token), the ``forced`` run as
    a trunk below it (node i + 1 holds forced[i], the only child of node i), and the drafter's ``tree`` (its
    root: the trunk's end, forced[-1]; drafted from the context that ends with the forced run) hung from the
    trunk's end. With q, each trunk node's row is a point mass on its token (row 0: on the root).

    Why the tree verifiers stay exact (:class:`~verispec.drafting.tree.TreeProposal`'s conditions,
    :mod:`verispec.verify.tree`): each trunk node is its parent's only child, and its token is a function of
    the committed prefix alone (with q: a sample of its point mass; without q: a deterministic guess), so the
    conditions hold for the trunk; the drafter's nodes keep theirs, their paths now beginning with the trunk
    (a function of the committed prefix, so a node's distribution given its path is still what the drafter
    drew it from). The trunk costs nothing in acceptance: its masks come from :func:`tree_masks` along the
    same paths, each trunk node's parent has one allowed token, so the constrained p there is a point mass on
    the trunk's token whatever the sampling settings: accepted with probability 1 by the sampled-siblings
    rule (min(1, 1/1)), the single-guess rule (p(x) = 1), greedy (the argmax) and invariant draws (the only
    token of positive weight); the drafter's tree is then verified at the trunk's end exactly as if the
    forced run had been committed first, which is what constrained sampling without speculation does."""
    if not forced:
        return tree
    size = len(forced)
    rest = tree.num_nodes - 1  # the drafter's nodes below its root
    tokens = torch.cat([torch.tensor([root, *forced], dtype=torch.long), tree.tokens[1:]])  # [1 + F + R]
    parents = torch.cat([torch.arange(-1, size), tree.parents[1:] + size])  # [1 + F + R]
    depth = torch.cat([torch.arange(size + 1), tree.depth[1:] + size])  # [1 + F + R]
    mask = torch.zeros(size + 1 + rest, size + 1 + rest, dtype=torch.bool)  # [N, N]
    mask[: size + 1, : size + 1] = torch.ones(size + 1, size + 1, dtype=torch.bool).tril()  # the trunk
    mask[size + 1 :, : size + 1] = True  # the drafter's nodes see the whole trunk
    mask[size + 1 :, size + 1 :] = tree.mask[1:, 1:]
    q = None
    if tree.q is not None:
        points = tree.q.new_zeros(size + 1, tree.q.shape[-1])  # [1 + F, V]
        points[torch.arange(size + 1), tokens[: size + 1].to(points.device)] = 1.0
        q = torch.cat([points, tree.q[1:]])  # [N, V]
    return TreeProposal(tokens=tokens, parents=parents, depth=depth, mask=mask, q=q)


def finish(state: GrammarState, emitted: list[int], room: int, eos: Collection[int]) -> list[int]:
    """Commit ``emitted`` (a round's tokens, at most ``room``) to ``state``; where the grammar is then
    finished and allows one end-of-sequence token alone, that token is appended (its constrained p is a
    point mass: it needs no forward). Returns the tokens the sequence commits."""
    state.settle(emitted)
    if len(emitted) >= room or (emitted and emitted[-1] in eos) or not state.finished:
        return emitted
    last = forced_run(state, 1)
    return emitted + last if last and last[0] in eos else emitted
