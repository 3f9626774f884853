"""Tree verifiers: exact verification of a token tree of drafts, scored by the target in one pass.

The tree of a round has N nodes. Node 0 is the root, the last committed token (it is not verified); nodes
1..N-1 are draft tokens, each after its parent: ``parents[0] = -1`` and ``0 <= parents[i] < i``. The children
of a node are its *siblings*, alternative next tokens after the node's path. The target scored every node:
p[i] is its (transformed, :func:`verispec.sampling.probs_from_logits`) distribution of the token that follows
the path root..i. q[i], for i ≥ 1, is the distribution node i's token was sampled from (at its parent's path).

Vocabulary, as in :mod:`verispec.verify.chain`:

- **accepted** tokens: the draft tokens on the path the verifier walks from the root, one node per level;
- **recovered** token: when the walk stops at a node whose children are all rejected, one token sampled from
  the last residual there;
- **bonus** token: when the walk reaches a leaf (every draft token on its path accepted), one token sampled
  from p[leaf].

A round emits its accepted tokens and one recovered or bonus token, except after an accepted end-of-sequence
token: nothing after it is kept. The verdict also names the accepted nodes (their cache entries are kept).

Multi-proposal verification (iterative speculative sampling, SpecInfer). At the current node u, with
r_0 = p[u], the children c_1..c_m are tried one after the other in a uniformly random order (drawn from the
generator): child c_k, with token x_k, is accepted with probability min(1, r_{k-1}(x_k) / q_{c_k}(x_k)); if it
is rejected, r_k = normalize(max(r_{k-1} − q_{c_k}, 0)) and the next child is tried. An acceptance moves the
walk to c_k, where it starts again with r_0 = p[c_k]; if every child is rejected, the recovered token is
sampled from r_m; at a leaf (m = 0) the bonus token is sampled from r_0 = p[leaf]. Without draft
probabilities (q = None) each child is a single guess, q_{c_k} = a point mass on x_k: x_k is accepted with
probability r_{k-1}(x_k), and r_k is r_{k-1} with x_k removed, renormalized.

As in verify.py the verifier is split in two, so that its mathematics can be proved exactly and its sampling
checked statistically:

- a *sibling rule* (:func:`sibling_rule`, :func:`greedy_sibling_rule`) computes in closed form, for one node
  and its children in a GIVEN trial order, the probability of accepting each child given that the children
  tried before it were rejected, and the residuals r_0..r_m;
- :func:`sample_tree_verdict` walks the tree, drawing the trial orders, the acceptances and the emitted token
  from a sibling rule with an explicit generator.

:func:`tree_rejection_sample` and :func:`tree_greedy_verify` do both. A chain (``parents = [-1, 0, 1, ...]``)
gives exactly the verdicts of :func:`verispec.verify.chain.rejection_sample` (q given or None) and
:func:`verispec.verify.chain.greedy_verify`, and for the same generator state the very same tokens.

Exactness (the emitted tokens are distributed exactly as tokens sampled one by one from p) holds when the
drafts are what the verifier is told:

- with q: the children of every node are conditionally independent given the node's path, each sampled from
  its own q (one draft model, or several different ones), and a child's subtree depends on nothing but its
  own path. Equal tokens among siblings are then separate, legal proposals: keep them as separate nodes.
  Merging equal sampled siblings into one node (a prefix tree) is NOT exact with q.
- with q = None: the guesses may come from any process that does not look at the verifier's random draws —
  deterministic functions of the path (n-gram matches, several drafters' greedy guesses, top-k children of a
  draft model) or random ones; equal guesses among siblings are harmless.
- WARNING: the top-k children of a draft model (taken without replacement) are NOT independent samples of the
  draft's q; verified with that q they are not exact. Verify them as single guesses (q = None).
- The trial order is uniformly random, as in SpecInfer; any order that does not depend on the drafted tokens
  (for instance index order) is equally exact. An order chosen by looking at the tokens (by token id, say)
  is not.

The proof is tests/test_tree_enumeration.py: exact enumeration of every draft tree, trial order, acceptance
and emitted token, against the target's own joint distribution.

Edge cases, the conventions of verify.py: q_c(x_c) = 0 accepts when r(x_c) > 0 (the ratio is +inf) and rejects
when it is 0 too. A residual of total mass 0 (max(r_{k-1} − q_{c_k}, 0) = 0 everywhere: in exact arithmetic
r_{k-1} = q_{c_k}, where a token sampled from q_{c_k} is accepted with probability 1) keeps r_k = r_{k-1}; the
convention only ever applies on an event of probability 0, so it cannot bias the output. Vocabulary sizes:
p [N, Vp] and q [N, Vq] are padded with zeros to max(Vp, Vq); a draft token the target does not have is always
rejected, and emitted tokens are always < Vp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.errors import UsageError
from verispec.sampling import first_argmax, sample
from verispec.verify.chain import EosIds, _pad_vocab

__all__ = [
    "SiblingRule",
    "TreeRule",
    "TreeVerdict",
    "greedy_sibling_rule",
    "sample_tree_verdict",
    "sibling_rule",
    "tree_greedy_verify",
    "tree_rejection_sample",
]


@dataclass(frozen=True)
class SiblingRule:
    """The verifier's rule at one node for its m children in a given trial order, in closed form. Leading
    batch dimensions [...] are allowed (the walk uses none; the exactness proof batches drafts)."""

    accept_prob: Tensor  # [..., m] P(accept the k-th child tried | the k − 1 tried before it were rejected)
    residuals: Tensor  # [..., m+1, V] r_0 = p (renormalized) .. r_m; r_k: the distribution after k rejections


#: (node u, u's children in trial order [m] int64) -> the sibling rule at u for that order
TreeRule = Callable[[int, Tensor], SiblingRule]


@dataclass(frozen=True)
class TreeVerdict:
    """The outcome of verifying one token tree.

    tokens: the accepted draft tokens, root to leaf, then one recovered or bonus token, unless the last
    accepted token is end-of-sequence (nothing follows it).
    """

    tokens: list[int]
    accepted_nodes: list[int]  # the accepted draft nodes (each ≥ 1, a child of the one before), root to leaf
    ended_at_leaf: bool  # the walk stopped at a node without children: its emitted token, if any, is a bonus

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def bonus(self) -> bool:  # the last emitted token is a bonus token
        return self.ended_at_leaf and len(self.tokens) > self.num_accepted

    @property
    def recovered(self) -> bool:  # the last emitted token is a recovered token
        return not self.ended_at_leaf and len(self.tokens) > self.num_accepted


# ---------------------------------------------------------------------------------------------- validation


def _check_ids(name: str, ids: Tensor) -> None:
    if ids.dtype not in (torch.int32, torch.int64):
        raise UsageError(f"{name} must be an integer tensor, got {ids.dtype}")
    if bool((ids < 0).any()):
        raise UsageError(f"{name} must be >= 0")


def _tree_children(tokens: Tensor, parents: Tensor) -> list[list[int]]:
    """Validates the tree; returns the children of every node in index order."""
    if tokens.ndim != 1 or tokens.numel() == 0:
        raise UsageError(
            f"tokens must have shape [N] with N >= 1 (node 0 is the root), got {tuple(tokens.shape)}"
        )
    _check_ids("tokens", tokens)
    n = tokens.shape[0]
    if parents.shape != (n,) or parents.dtype not in (torch.int32, torch.int64):
        raise UsageError(
            f"parents must be an integer tensor of shape [{n}], got {parents.dtype} {tuple(parents.shape)}"
        )
    up = parents.tolist()
    if up[0] != -1:
        raise UsageError(f"parents[0] must be -1 (node 0 is the root), got {up[0]}")
    children: list[list[int]] = [[] for _ in range(n)]
    for i, parent in enumerate(up[1:], start=1):
        if not 0 <= parent < i:
            raise UsageError(
                f"parents[{i}] = {parent}: every node's parent must be an earlier node, in [0, {i})"
            )
        children[parent].append(i)
    return children


def _check_dists(name: str, probs: Tensor, dtype: torch.dtype, first: int = 0, where: str = "node") -> Tensor:
    """probs: [R, V] one distribution per row (a node, or a batch row); rows before ``first`` are not read.
    Returns probs in ``dtype``."""
    if not torch.is_floating_point(probs):
        raise UsageError(f"{name} must be a floating-point tensor, got {probs.dtype}")
    used = probs[first:]
    tol = 1e-9 if probs.dtype == torch.float64 else 1e-3  # checked in the precision the caller computed
    # one test, for the usual case: rows each summing to within tol of 1 hold no NaN or Inf
    if bool(((used.sum(-1) - 1).abs() <= tol).all() & (used >= 0).all()):
        return probs.to(dtype)
    for problem, bad in (("NaN or Inf", ~torch.isfinite(used)), ("a negative probability", used < 0)):
        if bad.any():
            raise UsageError(f"{name} has {problem} at {where} {first + int(bad.any(-1).nonzero()[0])}")
    off = (used.sum(-1) - 1).abs() > tol
    if off.any():
        raise UsageError(f"{name} does not sum to 1 at {where} {first + int(off.nonzero()[0])}")
    return probs.to(dtype)


def _check_node_rows(name: str, rows: Tensor, n: int) -> None:
    if rows.ndim != 2 or rows.shape[0] != n or rows.shape[1] == 0:
        raise UsageError(f"{name} must have shape [{n}, V] (one row per node), got {tuple(rows.shape)}")


def _eos_set(eos_token_id: EosIds) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    return frozenset(torch.as_tensor(eos_token_id, dtype=torch.long).reshape(-1).tolist())


# ---------------------------------------------------------------------------------------------- rules


def _residual(r: Tensor, q: Tensor) -> Tensor:
    """normalize(max(r − q, 0)) over the last dimension, or r where that is all 0. r, q: [..., V]."""
    diff = (r - q).clamp_min(0)
    mass = diff.sum(-1, keepdim=True)
    return torch.where(mass > 0, diff / mass.clamp_min(torch.finfo(r.dtype).tiny), r)


def _sibling_rule(
    p_u: Tensor, child_tokens: Tensor, q_children: Tensor | None, dtype: torch.dtype
) -> SiblingRule:
    """:func:`sibling_rule` on validated inputs."""
    if q_children is None:  # single guesses: point masses, over a vocabulary that holds every guess
        vocab = max(p_u.shape[-1], int(child_tokens.max()) + 1 if child_tokens.numel() else 0)
        q_children = torch.nn.functional.one_hot(child_tokens.long(), vocab).to(dtype)
    vocab = max(p_u.shape[-1], q_children.shape[-1])
    p_u, q_children = _pad_vocab(p_u.to(dtype), vocab), _pad_vocab(q_children.to(dtype), vocab)
    idx = child_tokens.long().unsqueeze(-1)  # [..., m, 1]
    q_x = q_children.gather(-1, idx).squeeze(-1)  # [..., m]
    tiny = torch.finfo(dtype).tiny
    r = p_u  # [..., V]
    tried, residuals = [], [_residual(p_u, torch.zeros_like(p_u))]
    for k in range(child_tokens.shape[-1]):
        tried.append(r.gather(-1, idx[..., k, :]))  # [..., 1]: r_{k-1}(x_k)
        r = _residual(r, q_children[..., k, :])
        residuals.append(r)
    if not tried:
        return SiblingRule(accept_prob=q_x, residuals=torch.stack(residuals, -2))
    r_x = torch.cat(tried, -1)  # [..., m]; every child's ratio at once, each as it would be alone
    ratio = torch.where(q_x > 0, r_x / q_x.clamp_min(tiny), (r_x > 0).to(dtype))
    return SiblingRule(accept_prob=ratio.clamp(max=1.0), residuals=torch.stack(residuals, -2))


def sibling_rule(
    child_tokens: Tensor, *, p_u: Tensor, q_children: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> SiblingRule:
    """The multi-proposal rule at one node u, for its children tried in the given order.

    p_u: [..., Vp] the target's distribution after u's path. child_tokens: [..., m] int, the children's
    tokens in trial order. q_children: [..., m, Vq], the distribution each child's token was sampled from, or
    None for single guesses (point masses). dtype: float32 (default) or float64, the precision of all
    arithmetic.

    Returns accept_prob [..., m]: min(1, r_{k-1}(x_k) / q_k(x_k)), the probability of accepting the k-th child
    given that the children before it were rejected; residuals [..., m+1, max(Vp, Vq)]: r_0 = p_u, then
    r_k = normalize(max(r_{k-1} − q_k, 0)) (r_{k-1} where that has mass 0). residuals[..., m, :] is the
    recovered-token distribution (the bonus distribution when m = 0).
    """
    if p_u.ndim < 1 or p_u.shape[-1] == 0:
        raise UsageError(f"p_u must have shape [..., V] with V >= 1, got {tuple(p_u.shape)}")
    if child_tokens.shape[:-1] != p_u.shape[:-1] or child_tokens.ndim != p_u.ndim:
        raise UsageError(
            f"child_tokens must have shape {[*p_u.shape[:-1], 'm']}, got {tuple(child_tokens.shape)}"
        )
    _check_ids("child_tokens", child_tokens)
    _check_dists("p_u", p_u.reshape(-1, p_u.shape[-1]), dtype, where="row")
    if q_children is not None:
        if q_children.shape[:-1] != child_tokens.shape or q_children.shape[-1] == 0:
            raise UsageError(
                f"q_children must have shape {[*child_tokens.shape, 'V']}, got {tuple(q_children.shape)}"
            )
        _check_dists("q_children", q_children.reshape(-1, q_children.shape[-1]), dtype, where="row")
        if bool((child_tokens >= q_children.shape[-1]).any()):
            raise UsageError(
                f"a child token id is outside the draft vocabulary of size {q_children.shape[-1]}"
            )
    return _sibling_rule(p_u, child_tokens, q_children, dtype)


def greedy_sibling_rule(scores_u: Tensor, child_tokens: Tensor) -> SiblingRule:
    """Greedy verification at one node as a rule: accept a child iff its token is the first argmax of
    scores_u (torch.argmax's convention, as :func:`verispec.verify.chain.greedy_verify`); every residual is a
    point mass on that argmax.

    scores_u: [..., V] target distribution or logits (only the argmax is used). child_tokens: [..., m] int.
    Returns float64 accept_prob [..., m] (0 or 1) and residuals [..., m+1, V].
    """
    if scores_u.ndim < 1 or scores_u.shape[-1] == 0 or child_tokens.shape[:-1] != scores_u.shape[:-1]:
        raise UsageError(
            f"need scores_u [..., V] and child_tokens [..., m], got {tuple(scores_u.shape)} and "
            f"{tuple(child_tokens.shape)}"
        )
    if bool(torch.isnan(scores_u).any()):
        raise UsageError("scores_u has NaN")
    target = first_argmax(scores_u).unsqueeze(-1)  # [..., 1]
    accept_prob = (child_tokens.long() == target).to(torch.float64)  # [..., m]
    point = torch.nn.functional.one_hot(target, scores_u.shape[-1]).to(torch.float64)  # [..., 1, V]
    residuals = point.expand(*child_tokens.shape, -1)  # [..., m, V]
    return SiblingRule(accept_prob=accept_prob, residuals=torch.cat([point, residuals], -2))


# ---------------------------------------------------------------------------------------------- the walk


def _walk(
    tokens: list[int],
    children: list[list[int]],
    rule: TreeRule,
    uniforms: list[float],
    draw: Callable[[Tensor], int],
    eos: frozenset[int],
    device: torch.device,
) -> TreeVerdict:
    """Walks the tree from the root: at node u, the k-th child tried is accepted iff its uniform is below the
    rule's accept_prob[k] (the first such child in trial order); with none, ``draw`` picks the emitted token
    from the last residual. uniforms: N values, uniforms[c] for child c (entry 0 unused); the children's
    indices handed to ``rule`` on ``device``."""
    rules: dict[int, SiblingRule] = {}  # node → its rule, as the walk reaches it

    def accepted_child(node: int) -> int | None:
        kids = torch.tensor(children[node], dtype=torch.long, device=device)  # [m] in trial order
        at = rule(node, kids)
        if at.accept_prob.shape != kids.shape or at.residuals.shape[:1] != (len(kids) + 1,):
            raise UsageError(
                f"the rule at node {node} must give accept_prob [m] and residuals [m+1, V], m = {len(kids)}"
            )
        rules[node] = at
        # compared as Python floats, which hold both tensors' values exactly: the comparison torch makes
        tried = zip(children[node], at.accept_prob.tolist(), strict=True)
        return next((c for c, accept in tried if uniforms[c] < accept), None)

    return _walk_by(tokens, children, eos, accepted_child, lambda node: draw(rules[node].residuals[-1]))


def _walk_by(
    tokens: list[int],
    children: list[list[int]],
    eos: frozenset[int],
    accepted_child: Callable[[int], int | None],
    emitted_at: Callable[[int], int],
) -> TreeVerdict:
    """The walk from the root: at each node, the child ``accepted_child`` names (None: none), down to a node
    where none is, whose token ``emitted_at`` gives, or to an accepted end-of-sequence token."""
    node, accepted = 0, list[int]()
    while True:
        hit = accepted_child(node)
        if hit is None:
            emitted = [tokens[c] for c in accepted] + [emitted_at(node)]
            return TreeVerdict(tokens=emitted, accepted_nodes=accepted, ended_at_leaf=not children[node])
        node = hit
        accepted.append(node)
        if tokens[node] in eos:
            emitted = [tokens[c] for c in accepted]
            return TreeVerdict(tokens=emitted, accepted_nodes=accepted, ended_at_leaf=not children[node])


def _sample(
    tokens: Tensor,
    children: list[list[int]],
    rule: TreeRule,
    generator: torch.Generator,
    eos_token_id: EosIds,
    dtype: torch.dtype,
) -> TreeVerdict:
    """:func:`sample_tree_verdict` on a validated tree (``children``: each node's children in index order)."""
    n, device = tokens.shape[0], tokens.device
    uniforms = torch.rand(n - 1, generator=generator, dtype=dtype, device=device)  # [N-1], one per draft node
    if any(len(kids) > 1 for kids in children):
        keys = torch.rand(n, generator=generator, dtype=torch.float64, device=device).tolist()  # [N]
        children = [sorted(kids, key=keys.__getitem__) for kids in children]

    def draw(dist: Tensor) -> int:
        return int(sample(dist, generator))

    indexed = [0.0, *uniforms.tolist()]  # by node
    return _walk(tokens.tolist(), children, rule, indexed, draw, _eos_set(eos_token_id), device)


def sample_tree_verdict(
    tokens: Tensor,
    parents: Tensor,
    rule: TreeRule,
    generator: torch.Generator,
    eos_token_id: EosIds = None,
    dtype: torch.dtype = torch.float32,
) -> TreeVerdict:
    """Draw a tree verdict from ``rule``: one uniform per draft node (in ``dtype``) decides its acceptance
    when it is tried; siblings are tried in a uniformly random order (random keys, drawn only when some node
    has two children or more); the emitted token is sampled from the last residual. The same generator state
    gives the same verdict; on a chain the draws are those of :func:`verispec.verify.chain.sample_verdict`.

    tokens: [N] int; parents: [N] int (see the module docstring). rule: (node, children in trial order) ->
    :class:`SiblingRule`. eos_token_id: an end-of-sequence id (or several); an accepted one ends the output.
    """
    return _sample(tokens, _tree_children(tokens, parents), rule, generator, eos_token_id, dtype)


def tree_rejection_sample(
    tokens: Tensor,
    parents: Tensor,
    *,
    p: Tensor,
    q: Tensor | None,
    generator: torch.Generator,
    eos_token_id: EosIds = None,
    dtype: torch.dtype = torch.float32,
) -> TreeVerdict:
    """Exact multi-proposal verification of a token tree: :func:`sibling_rule` at every node of the walk,
    drawn with :func:`sample_tree_verdict`. With q None, the draft tokens are single guesses.

    tokens: [N] int (node 0: the last committed token); parents: [N] int; p: [N, Vp] target distributions
    (p[i]: after node i); q: [N, Vq] (q[i]: node i's token was sampled from it; q[0] is not read) or None.
    dtype: float32 (default) or float64, the precision of all arithmetic.
    """
    children = _tree_children(tokens, parents)
    n = tokens.shape[0]
    _check_node_rows("p", p, n)
    p = _check_dists("p", p, dtype)
    if q is not None:
        _check_node_rows("q", q, n)
        q = _check_dists("q", q, dtype, first=1)
        if bool((tokens[1:] >= q.shape[-1]).any()):
            raise UsageError(f"a draft token id is outside the draft vocabulary of size {q.shape[-1]}")
    elif n > 1:  # one vocabulary for every node, holding every guess (ids the target lacks have p = 0)
        p = _pad_vocab(p, max(p.shape[-1], int(tokens[1:].max()) + 1))
    ids = tokens.long()

    def rule(u: int, kids: Tensor) -> SiblingRule:
        return _sibling_rule(p[u], ids[kids], None if q is None else q[kids], dtype)

    return _sample(tokens, children, rule, generator, eos_token_id, dtype)


def tree_greedy_verify(
    tokens: Tensor, parents: Tensor, *, p: Tensor, eos_token_id: EosIds = None
) -> TreeVerdict:
    """Greedy tree verification, no randomness: from the root, follow the first child (in index order) whose
    token is the target's argmax at the current node; then emit the target's argmax there. Token-identical to
    the target's greedy decoding, and to :func:`verispec.verify.chain.greedy_verify` on a chain.

    tokens: [N] int; parents: [N] int; p: [N, V] target distributions, or logits (only the argmax is used).
    """
    children = _tree_children(tokens, parents)
    _check_node_rows("p", p, tokens.shape[0])
    argmax = first_argmax(p)  # [N]: a NaN counts as the maximum, so a row holds one iff its argmax is one
    nan = torch.isnan(p[torch.arange(argmax.shape[0]), argmax])  # [N]
    if nan.any():
        raise UsageError(f"p has NaN at node {int(nan.nonzero()[0])}")
    # the walk of :func:`_walk` under :func:`greedy_sibling_rule` (a child accepted iff its token is the
    # node's first argmax, the emitted token that argmax), in Python ints: every node's argmax at once
    best, ids = argmax.tolist(), tokens.tolist()  # best: [N]

    def accepted_child(node: int) -> int | None:
        return next((c for c in children[node] if ids[c] == best[node]), None)

    return _walk_by(ids, children, _eos_set(eos_token_id), accepted_child, best.__getitem__)
