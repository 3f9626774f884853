"""Tree drafters: proposers of a token tree (:mod:`verispec.tree`) for each round, behind one narrow protocol.

A tree drafter sees the committed context and a tree shape (the drafter's own :attr:`TreeDrafter.shape`,
capped by the engine to the tokens and context left) and returns a tree within that shape, rooted at the last
committed token. Guarantees, the tree counterparts of :mod:`verispec.drafters`':

- ``propose_tree`` returns a subset of the shape's nodes holding every ancestor of each (fewer nodes, down
  to the root alone, is always allowed);
- with ``q`` None, each draft token is a deterministic function of the context and its path, and siblings
  hold different tokens: the tree is verified as single guesses, exactly;
- with ``q``, the children of a node are independent samples (with replacement) of one distribution, the
  draft's after :func:`verispec.sampling.probs_from_logits` with the engine's parameters, given as each
  child's row of ``q``: the condition under which tree rejection sampling is exact;
- a shape with a node budget (dynamic, :mod:`verispec.tree`) is taken only by drafters that rank their nodes
  (``dynamic``: the learned head's); the others refuse it with a ValueError.

Two drafters: :class:`NGramTreeDrafter` merges several prompt-lookup matches into a prefix tree;
:class:`ModelTreeDrafter` branches a draft model into its top-k (or sampled) children at every node, scoring
each depth of the tree in one tree-attention forward of the draft.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from verispec.drafters import ModelDrafter, NGramDrafter
from verispec.sampling import probs_from_logits
from verispec.tree import TreeProposal, TreeShape

__all__ = ["BranchedTreeDrafter", "ModelTreeDrafter", "NGramTreeDrafter", "TreeDrafter", "check_static"]


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
    """ValueError, one line, when ``shape`` has a node budget: only the eagle drafter takes dynamic trees."""
    if shape.budget is not None:
        raise ValueError(f"dynamic trees ({shape.name}) need the eagle drafter, not {drafter!r}")


class NGramTreeDrafter:
    """Prompt lookup, branched: the continuations of several earlier occurrences of the context's suffix —
    the longest n-gram first, then the latest occurrence — merged into a prefix tree (single guesses).

    Where a chain proposes only the latest match, the tree also keeps the other continuations that earlier
    occurrences (or shorter suffixes) suggest, each as a sibling branch where it first differs."""

    name = "ngram"

    def __init__(self, shape: TreeShape, lookup: NGramDrafter | None = None) -> None:
        check_static(shape, "ngram")
        self.shape = shape
        self.lookup = NGramDrafter() if lookup is None else lookup  # its n-gram lengths

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose_tree(self, context: list[int], shape: TreeShape, generator: torch.Generator) -> TreeProposal:
        return shape.merge(context[-1], self.lookup.continuations(context, shape.max_depth))


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

    def _pick(self, logits: Tensor, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor | None]:
        """``count`` children of a node from its draft logits [W] (over the draft's own vocabulary): the top
        ``count`` indices and None, or (``sampled``) ``count`` independent samples and the q [W] they were
        drawn from."""
        if not self.sampled:
            return logits.topk(min(count, logits.shape[-1])).indices, None
        q = probs_from_logits(logits, self.drafter.sampling)  # [W]
        return torch.multinomial(q, count, replacement=True, generator=generator), q

    def _proposal(
        self, shape: TreeShape, root: int, tokens: dict[int, int], q_rows: dict[int, Tensor | None]
    ) -> TreeProposal:
        """The tree of the filled shape nodes ``tokens`` (node → token; node 0 holds ``root``); with sampled
        children, q stacks each node's ``q_rows`` [V] under a point mass on the root (committed, never
        verified)."""
        nodes = sorted(tokens)
        q = None
        if self.sampled and len(nodes) > 1:
            point = torch.zeros_like(q_rows[nodes[1]])  # [V]
            point[root] = 1.0
            q = torch.stack([point, *(q_rows[n] for n in nodes[1:])]).cpu()  # [N, V]
        return shape.select(nodes, [tokens[n] for n in nodes], q)


class ModelTreeDrafter(BranchedTreeDrafter):
    """A draft model's tree: at every node of the shape, its children are the draft's ``c`` most likely next
    tokens (c = the node's children in the shape; deterministic, verified as single guesses), or with
    ``sampled`` (and a sampling temperature > 0) c independent samples of the draft's q, verified with q.

    The draft is a :class:`~verispec.drafters.ModelDrafter` (its own cache, or an early exit reading the
    target's). Its cache first takes the committed tokens it has not seen, the root last; then each depth's
    children come from one tree-attention forward over the tree's inner nodes so far, after which the cache
    is cut back to the committed tokens: no draft slot outlives the round."""

    name = "model"
    drafter: ModelDrafter

    def propose_tree(self, context: list[int], shape: TreeShape, generator: torch.Generator) -> TreeProposal:
        self.drafter.propose(context, 0, generator)  # drafts nothing: brings an early exit's cache view up
        model, cache = self.drafter.model, self.drafter.cache
        committed = len(context)
        if committed >= cache.capacity:  # no room left in the draft's context: the root alone
            return shape.select([0], [context[-1]])
        shape = shape.capped(shape.max_depth, cache.capacity - committed)
        feed = torch.tensor([context[cache.length :]], dtype=torch.long, device=model.device)  # [1, T]
        positions = torch.arange(cache.length, committed, device=model.device).unsqueeze(0)  # [1, T]
        logits = {0: model.forward(feed, positions, cache)[0, -1]}  # node → the draft's next logits [V]
        children = shape.children()
        tokens, q_rows = {0: context[-1]}, {}
        for depth in range(1, shape.max_depth + 1):
            for node, node_logits in logits.items():
                picked, q = self._pick(node_logits, len(children[node]), generator)
                for child, token in zip(children[node][: len(picked)], picked.tolist(), strict=True):
                    tokens[child], q_rows[child] = token, q
            inner = [n for n in sorted(tokens) if n and children[n]]  # their children come from the draft
            frontier = [n for n in inner if int(shape.depth[n]) == depth]  # the last ones (BFS order)
            if not frontier:
                break
            logits = dict(
                zip(frontier, self._score(shape, inner, tokens, committed)[-len(frontier) :], strict=True)
            )
        return self._proposal(shape, context[-1], tokens, q_rows)

    def _score(self, shape: TreeShape, inner: list[int], tokens: dict[int, int], committed: int) -> Tensor:
        """The draft's logits [len(inner), V] at the inner nodes (ascending, ancestors of one another first),
        from one tree-attention forward after the committed tokens; the cache is cut back after it."""
        model, cache = self.drafter.model, self.drafter.cache
        index = torch.tensor(inner, dtype=torch.long)  # [M]
        feed = torch.tensor([[tokens[n] for n in inner]], dtype=torch.long, device=model.device)  # [1, M]
        positions = (committed - 1 + shape.depth[index]).to(model.device).unsqueeze(0)  # [1, M]
        mask = shape.mask[index][:, index].to(model.device)  # [M, M]
        logits = model.forward(feed, positions, cache, tree_mask=mask)[0]  # [M, V]
        cache.truncate(committed)
        return logits
