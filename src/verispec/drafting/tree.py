"""Token trees: a tree shape given as data, compiled once, and the concrete trees each round drafts into it.

A *shape* says which draft nodes a round may fill. Each node is named by its *path* from the root: the ranks
of the children taken at each depth, e.g. ``(0,)`` "the best first token", ``(1,)`` "the second-best first
token", ``(0, 1)`` "after the best first token, the second-best next one". Node 0 is the root, the last
committed token; the N − 1 draft nodes follow in breadth-first order (depth, then path), so that every
node's parent comes before it. :class:`TreeShape` compiles the paths once into the buffers a round reads:
parents, depth, rank and the ancestor mask (each node sees its ancestors and itself).

A *tree* (:class:`TreeProposal`) is what one round drafts: a subset of the shape's nodes that contains every
ancestor of its nodes (fewer nodes is always allowed: an n-gram lookup may find fewer continuations), with a
token at each. :meth:`TreeShape.merge` builds one from several candidate continuations by merging their
common prefixes; :meth:`TreeShape.select` makes one from chosen nodes.

A shape with a *budget* is dynamic (EAGLE-2, Li et al. 2024): its nodes are the candidates, and each round the
drafter expands its likeliest nodes depth by depth and verifies only the ``budget`` draft nodes of highest
path probability (the product of the draft's probabilities along the path), or, with budget ``"auto"``, as
many of them as the calibrated costs pay for (:func:`verispec.costs.analytic.best_tree_size`). Written
``SPEC:N`` or ``SPEC:auto``, e.g. ``3x4:6``.

The target scores a whole tree in one forward: node i sits at position (committed length − 1 + depth[i]) and
attends to the committed context and to its ancestors, itself included (``TreeProposal.mask``).

Malformed shapes — gaps in depth (a path whose prefix is missing) or in rank (a child of rank r without its
sibling of rank r − 1), duplicate or negative ranks, cycles in a parents list, more nodes than allowed — are
refused with a one-line UsageError.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from verispec.errors import UsageError
from verispec.inputs import check_int, is_int

if TYPE_CHECKING:  # torch is imported where tensors are made: the command line checks shapes without it
    from torch import Tensor

__all__ = ["AUTO", "MAX_NODES", "TreeProposal", "TreeShape", "likeliest_nodes", "parse_budget"]

MAX_NODES = 1024  # the most nodes (root included) a shape may have, whatever the context
AUTO = "auto"  # the budget of a dynamic tree sized by the cost model each round


@dataclass(frozen=True)
class TreeProposal:
    """A concrete token tree for one round: the root (last committed token) and the draft tokens below it.

    Exactness needs (:mod:`verispec.verify.tree`): with ``q``, the children of a node are independent samples,
    child c's from q[c] (equal sampled siblings stay separate nodes); with ``q`` None, each draft token is a
    deterministic function of its path (top-k children of a draft model, n-gram matches), verified as single
    guesses.
    """

    tokens: Tensor  # [N] int64: node 0 = root = the last committed token, then the draft tokens
    parents: Tensor  # [N] int64: parents[0] = -1, parents[i] < i
    depth: Tensor  # [N] int64: depth[0] = 0, depth[i] = depth[parents[i]] + 1
    mask: Tensor  # [N, N] bool: mask[i, j] iff node j is node i or one of its ancestors
    q: Tensor | None  # [N, V] q[i]: the draft distribution node i's token was sampled from (row 0: a point
    # mass on the root), or None: single guesses

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())


@dataclass(frozen=True, eq=False)
class TreeShape:
    """The nodes a round may draft, compiled once. Build with :meth:`from_paths`, :meth:`full`, :meth:`chain`,
    :meth:`from_parents`, :meth:`load` or :meth:`parse`; ``name`` labels it in stats and tables;
    :meth:`with_budget` makes it dynamic (module docstring)."""

    name: str
    paths: tuple[tuple[int, ...], ...]  # [N]: every node's path of child ranks, () for the root, BFS order
    parents: Tensor  # [N] int64: parents[0] = -1, parents[i] < i
    depth: Tensor  # [N] int64: len(paths[i])
    rank: Tensor  # [N] int64: the last entry of paths[i] (0 for the root)
    mask: Tensor  # [N, N] bool: mask[i, j] iff node j is node i or one of its ancestors
    budget: int | str | None = None  # None: static; draft nodes a dynamic round verifies, or AUTO

    @property
    def num_nodes(self) -> int:
        """Nodes in all, the root included: the size of the target's forward over a full tree."""
        return len(self.paths)

    @property
    def max_forward(self) -> int:
        """The most nodes (root included) one round feeds the target: every node of a static shape, at most
        budget + 1 of a dynamic one (AUTO: bounded by the shape alone)."""
        if isinstance(self.budget, int):
            return min(self.budget + 1, self.num_nodes)
        return self.num_nodes

    def with_budget(self, budget: int | str | None) -> TreeShape:
        """This shape made dynamic: each round verifies its ``budget`` likeliest draft nodes (an integer
        >= 1), or as many as the costs pay for (AUTO); None: static again."""
        valid = budget is None or budget == AUTO
        valid |= is_int(budget) and budget >= 1
        if not valid:
            raise UsageError(f"a tree's node budget is an integer >= 1 or {AUTO!r}, got {budget!r}")
        base = self.name.rsplit(":", 1)[0] if self.budget is not None else self.name
        name = base if budget is None else f"{base}:{budget}"
        return dataclasses.replace(self, name=name, budget=budget)

    @property
    def max_depth(self) -> int:
        return len(self.paths[-1])

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_paths(
        cls, paths: Iterable[Sequence[int]], name: str | None = None, max_nodes: int = MAX_NODES
    ) -> TreeShape:
        """The shape whose draft nodes are ``paths`` (any order; the root's empty path may be left out)."""
        try:
            given = [tuple(path) for path in paths]
        except TypeError:
            raise UsageError("a tree shape is a list of paths, each a list of child ranks") from None
        for path in given:
            if not all(is_int(r) for r in path):
                raise UsageError(f"path {list(path)} must hold integer child ranks")
            if any(r < 0 for r in path):
                raise UsageError(f"path {list(path)} has a negative rank")
        drafts = [path for path in given if path]
        if len(set(drafts)) != len(drafts):
            duplicate = next(p for p in drafts if drafts.count(p) > 1)
            raise UsageError(f"path {list(duplicate)} appears twice")
        if not drafts:
            raise UsageError("a tree shape needs at least one draft node")
        if len(drafts) + 1 > max_nodes:
            raise UsageError(f"a tree of {len(drafts) + 1} nodes exceeds the limit of {max_nodes}")
        known = set(drafts) | {()}
        for path in drafts:
            if path[:-1] not in known:
                raise UsageError(f"gap in depth: path {list(path)} has no parent {list(path[:-1])}")
            if path[-1] > 0 and (*path[:-1], path[-1] - 1) not in known:
                raise UsageError(f"gap in rank: path {list(path)} has no sibling of rank {path[-1] - 1}")
        ordered = ((), *sorted(drafts, key=lambda p: (len(p), p)))
        index = {path: i for i, path in enumerate(ordered)}
        n = len(ordered)
        import torch

        parents = torch.tensor([-1] + [index[p[:-1]] for p in ordered[1:]], dtype=torch.int64)  # [N]
        mask = torch.eye(n, dtype=torch.bool)  # [N, N]
        for i in range(1, n):
            mask[i] |= mask[parents[i]]  # parents come first: their rows are complete
        return cls(
            name=name or f"{n - 1}-node",
            paths=ordered,
            parents=parents,
            depth=torch.tensor([len(p) for p in ordered], dtype=torch.int64),  # [N]
            rank=torch.tensor([p[-1] if p else 0 for p in ordered], dtype=torch.int64),  # [N]
            mask=mask,
        )

    @classmethod
    def full(cls, width: int, depth: int, max_nodes: int = MAX_NODES) -> TreeShape:
        """Every node has ``width`` children, down to ``depth``: (width^(depth+1) − 1) / (width − 1) nodes."""
        for label, value in (("width", width), ("depth", depth)):
            check_int(value, f"tree {label}", 1)
        nodes, level = 1, 1
        for _ in range(depth):  # counted until past the limit: a 1000x1000 tree's count has 3,000 digits
            level *= width
            nodes += level
            if nodes > max_nodes:
                raise UsageError(f"a {width}x{depth} tree has more than the limit of {max_nodes} nodes")
        paths = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
        return cls.from_paths(paths, name=f"{width}x{depth}", max_nodes=max_nodes)

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        """A single path of ``k`` draft nodes: the chain round's draft, as a tree."""
        check_int(k, "chain length", 1)
        return cls.from_paths([(0,) * d for d in range(1, k + 1)], name=f"chain{k}")

    @classmethod
    def from_parents(cls, parents: Sequence[int], name: str | None = None) -> TreeShape:
        """The shape of a parents list: parents[0] = -1 (the root), each other entry a node index; siblings
        are ranked in index order."""
        n = len(parents)
        if n < 2 or parents[0] != -1:
            raise UsageError("a parents list starts with -1 (the root) and has at least one more node")
        for i, parent in enumerate(parents[1:], 1):
            if not is_int(parent) or not 0 <= parent < n:
                raise UsageError(f"node {i} has parent {parent!r}, not a node index in [0, {n})")
        paths: dict[int, tuple[int, ...]] = {0: ()}
        children: dict[int, list[int]] = {}
        for i in range(1, n):
            children.setdefault(parents[i], []).append(i)
        stack = [0]
        while stack:
            node = stack.pop()
            for rank, child in enumerate(children.get(node, [])):
                paths[child] = (*paths[node], rank)
                stack.append(child)
        if len(paths) < n:
            cut = min(set(range(n)) - set(paths))
            raise UsageError(f"cycle in the parents list: node {cut} never reaches the root")
        return cls.from_paths([paths[i] for i in range(1, n)], name=name)

    @classmethod
    def load(cls, path: str | Path) -> TreeShape:
        """A JSON shape file: a list of paths, each a list of child ranks, e.g. [[0], [1], [0, 0]]; named by
        the file's stem, or by its node count for a pipe's descriptor (/dev/fd/63: no name of its own)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise UsageError(f"cannot read the tree shape file {path}: {err.strerror or err}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UsageError(f"the tree shape file {path} is not valid JSON: {err}") from None
        if not isinstance(data, list) or not all(isinstance(p, list) for p in data):
            raise UsageError(f"the tree shape file {path} must hold a list of paths (lists of child ranks)")
        try:
            return cls.from_paths(data, name=None if path.parent.name == "fd" else path.stem)
        except ValueError as err:
            raise UsageError(f"tree shape file {path}: {err}") from None

    @classmethod
    def parse(cls, spec: str) -> TreeShape:
        """``WxD`` (a full tree of width W and depth D) or the name of a JSON shape file, either followed by
        ``:N`` or ``:auto`` for a dynamic tree of that node budget (module docstring)."""
        base, sep, suffix = spec.rpartition(":")
        budget = parse_budget(suffix) if sep else None
        if budget is not None:
            return cls.parse(base).with_budget(budget)
        width, sep, depth = spec.partition("x")
        if sep and width.isdigit() and depth.isdigit():
            return cls.full(int(width), int(depth))
        return cls.load(spec)

    # ------------------------------------------------------------------ use

    def check_fits(self, max_context: int) -> None:
        """UsageError unless a round over a full tree fits a context of ``max_context`` positions next to at
        least one committed token."""
        if self.num_nodes >= max_context:
            raise UsageError(
                f"the tree {self.name} has {self.num_nodes} nodes: more than the context of {max_context} "
                "positions allows"
            )

    def capped(self, max_depth: int, max_nodes: int) -> TreeShape:
        """The first nodes (breadth-first) of depth ≤ ``max_depth``, at most ``max_nodes`` of them (≥ 1: the
        root): the shape that still fits the tokens and the context left. Self when nothing is cut."""
        depth_limit = int((self.depth <= max_depth).sum())  # nodes are ordered by depth: a prefix
        n = max(1, min(depth_limit, max_nodes))
        if n == self.num_nodes:
            return self
        return TreeShape(
            name=self.name,
            paths=self.paths[:n],
            parents=self.parents[:n],
            depth=self.depth[:n],
            rank=self.rank[:n],
            mask=self.mask[:n, :n],
            budget=self.budget,
        )

    def children(self) -> list[list[int]]:
        """children()[i]: node i's children, in rank order (computed once per shape: read, do not change)."""
        return self._children

    @functools.cached_property
    def _children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.paths]
        for i, parent in enumerate(self.parent_list[1:], 1):
            out[parent].append(i)
        return out

    @functools.cached_property
    def parent_list(self) -> list[int]:
        """``parents`` as a list of ints (computed once per shape)."""
        return self.parents.tolist()

    def select(self, nodes: Sequence[int], tokens: Sequence[int], q: Tensor | None = None) -> TreeProposal:
        """The tree of the given shape ``nodes`` (ascending, starting with the root 0, holding every ancestor
        of each) with ``tokens`` at them; q: [len(nodes), V] or None (see :class:`TreeProposal`)."""
        import torch

        index = torch.tensor(nodes, dtype=torch.int64)  # [M]
        position = {node: i for i, node in enumerate(nodes)}
        parents = [-1] + [position[int(self.parents[node])] for node in nodes[1:]]
        return TreeProposal(
            tokens=torch.tensor(tokens, dtype=torch.int64),  # [M]
            parents=torch.tensor(parents, dtype=torch.int64),  # [M]
            depth=self.depth[index],  # [M]
            mask=self.mask[index][:, index],  # [M, M]
            q=q,
        )

    def merge(self, root: int, continuations: Iterable[Sequence[int] | np.ndarray]) -> TreeProposal:
        """The prefix tree of ``continuations`` (token sequences following the root, best first) within this
        shape: each one follows the children already made for its tokens and adds a child (of the next
        free rank) for each new token, until a child the shape does not have; it stops once the tree is full.
        Siblings therefore carry different tokens; q is None (single guesses)."""
        index = {path: i for i, path in enumerate(self.paths)}
        chosen = {0: root}  # shape node → token
        children: dict[int, dict[int, int]] = {}  # shape node → {token: child shape node}
        for sequence in continuations:
            node = 0
            for token in sequence:
                made = children.setdefault(node, {})
                if token in made:
                    node = made[token]
                    continue
                child = index.get((*self.paths[node], len(made)))
                if child is None:
                    break
                made[token], chosen[child], node = child, int(token), child
            if len(chosen) == self.num_nodes:
                break
        nodes = sorted(chosen)
        return self.select(nodes, [chosen[n] for n in nodes])


def parse_budget(text: str) -> int | str | None:
    """A node budget written as text — digits or ``auto`` — or None when the text is not one."""
    return AUTO if text == AUTO else int(text) if text.isdigit() else None


def likeliest_nodes(scores: Sequence[float], count: int) -> list[int]:
    """The root and the ``count`` draft nodes of highest score, ascending: ``scores`` [N] holds each node's
    path probability (scores[0], the root's, is not ranked), so no node outscores its parent; ties go to the
    earlier node and parents come first, so the chosen nodes hold every ancestor of each."""
    ranked = sorted(range(1, len(scores)), key=lambda i: (-scores[i], i))
    return [0, *sorted(ranked[: max(0, count)])]
