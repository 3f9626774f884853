"""Exact enumeration: tree verification's output distribution equals the target's, to 1e-12.

For a (target, draft) pair of toy models, a tree shape, a way of drafting the children of a node and a
verifier, :func:`loop_joint` computes *analytically* the joint distribution of the first N tokens that the
full tree speculative loop emits from an empty prompt: draft a tree, verify it, commit the emitted tokens,
repeat until N tokens or EOS. Everything random is enumerated: the drafted tokens of every node (with their
exact probability), the trial order of every node's children (all m! orders, uniformly — or the one order a
variant uses), every accept/reject outcome and the recovered or bonus token. Accept probabilities and
residuals come from the REAL rule functions of :mod:`verispec.verify.tree` in float64, batched over all the
drafts of a node.

The enumeration of one round is a recursion over the tree: the children of a node are drafted independently of
everything but their path, so what a round emits from an accepted node depends only on that node's subtree
shape and context (the toy models are order 2). The result is compared with the target's own ancestral joint
distribution (:func:`toy.target_joint`) in total variation. Deliberately broken variants are shown far from
exact. Last, a chi-square test runs the torch sampler itself (:func:`tree_rejection_sample`) on drafted trees
and compares what one round emits with the enumerated distribution of a round.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import Tensor

from test_chisquare import chisquare_pvalue
from test_enumeration import total_variation
from toy import GREEDY, SETTINGS, make_pair, reachable_contexts, single_threaded, target_joint
from verispec.verify.tree import (
    SiblingRule,
    TreeVerdict,
    greedy_sibling_rule,
    sample_tree_verdict,
    sibling_rule,
    tree_rejection_sample,
)

EXACT_TV = 1e-12  # float64 round-off over a few thousand terms is far below this
BROKEN_TV = 1e-3  # every broken variant below is off by at least this much

#: Tree shapes as parents lists (node 0 is the root); width ≤ 3, depth ≤ 3.
SHAPES: dict[str, tuple[int, ...]] = {
    "w2d2": (-1, 0, 0, 1, 1, 2, 2),
    "w3d1": (-1, 0, 0, 0),
    "irregular": (-1, 0, 0, 0, 1, 1, 4),  # 3 children at the root, 2 under the first, a depth-3 branch
    "w2d3": (-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6),
    "chain3": (-1, 0, 1, 2),
}
#: A second draft of the same vocabulary for each family: siblings alternate between the two drafts.
OTHER_DRAFT = {"generic": "eos", "eos": "generic", "onehot": "generic", "equal": "tiny", "tiny": "equal"}
FAMILIES = tuple(OTHER_DRAFT)  # the families with V = 3 or 4

Ctx = tuple[int, int]  # (second-last, last) token; BOS = V
Nested = tuple["Nested", ...]  # a node is the tuple of its children
#: (p [R, V], child tokens in trial order [R, m], their q [R, m, V] or None) -> the rule, float64
RuleFn = Callable[[Tensor, Tensor, Tensor | None], SiblingRule]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


# ---------------------------------------------------------------------------------------------- drafting


def nested(parents: tuple[int, ...], node: int = 0) -> Nested:
    """The shape below ``node`` as nested tuples, children in index order."""
    return tuple(nested(parents, c) for c in range(node + 1, len(parents)) if parents[c] == node)


def all_tuples(vocab: int, m: int) -> np.ndarray:
    """[V^m, m] int64: every m-tuple of tokens (one empty tuple when m = 0)."""
    return np.array(list(itertools.product(range(vocab), repeat=m)), dtype=np.int64).reshape(vocab**m, m)


@dataclass(frozen=True)
class Drafting:
    """How the m children of a node are drafted from a context, and which q the verifier is told.

    slots: one [V+1, V+1, V] table per sibling position (child k is drafted from slots[k % len(slots)]).
    kind: "iid" (each child sampled independently from its slot's table), "topk" (the m most likely tokens
    of slots[0], deterministically) or "without_replacement" (m distinct tokens sampled in sequence from
    slots[0] renormalized over the unused ones).
    told_q: give the verifier the slot tables as q (sampled-proposal rule), else None (single guesses).
    """

    slots: tuple[np.ndarray, ...]
    kind: str = "iid"
    told_q: bool = True

    def draw(self, ctx: Ctx, m: int) -> tuple[np.ndarray, np.ndarray]:
        """(X [R, m] int64, w [R] float64): every possible children tuple and its probability."""
        vocab = self.slots[0].shape[-1]
        if self.kind == "topk":
            top = np.argsort(-self.slots[0][ctx], kind="stable")[:m]
            return top[None].astype(np.int64), np.ones(1)
        x = all_tuples(vocab, m)
        if self.kind == "iid":
            w = np.ones(len(x))
            for k in range(m):
                w *= self.slots[k % len(self.slots)][ctx][x[:, k]]
            return x, w
        assert self.kind == "without_replacement"
        q = self.slots[0][ctx]
        w = np.ones(len(x))
        unused = np.ones((len(x), vocab), dtype=bool)  # [R, V]
        for k in range(m):
            rows, tok = np.arange(len(x)), x[:, k]
            rest = np.where(unused, q, 0.0).sum(axis=1)  # [R]: the mass left (uniform once it is 0)
            step = np.where(rest > 0, q[tok] / np.where(rest > 0, rest, 1.0), 1.0 / (vocab - k))
            w *= np.where(unused[rows, tok], step, 0.0)
            unused[rows, tok] = False
        return x, w

    def told(self, ctx: Ctx, m: int) -> np.ndarray | None:
        """[m, V] the q each child is verified with (its slot's distribution), or None."""
        if not self.told_q:
            return None
        vocab = self.slots[0].shape[-1]
        return np.array([self.slots[k % len(self.slots)][ctx] for k in range(m)]).reshape(m, vocab)


# ---------------------------------------------------------------------------------------------- orders

#: (X [R, m]) -> trial orders, each [R, m] (a permutation of 0..m-1 per row), all equally likely
Orders = Callable[[np.ndarray], list[np.ndarray]]


def random_orders(x: np.ndarray) -> list[np.ndarray]:
    """Every permutation, uniformly: what :func:`sample_tree_verdict` draws."""
    r, m = x.shape
    return [np.tile(np.array(perm, dtype=np.int64), (r, 1)) for perm in itertools.permutations(range(m))]


def index_order(x: np.ndarray) -> list[np.ndarray]:
    """Children in index order only (greedy verification's order; a fixed order for the proof)."""
    return [np.tile(np.arange(x.shape[1]), (x.shape[0], 1))]


def sorted_by_token(x: np.ndarray) -> list[np.ndarray]:
    """BROKEN: an order that looks at the drafted tokens (smallest token id first)."""
    return [np.argsort(x, axis=1, kind="stable")]


# ---------------------------------------------------------------------------------------------- rules


def sampled_rule(p: Tensor, x: Tensor, q: Tensor | None) -> SiblingRule:
    return sibling_rule(x, p_u=p, q_children=q, dtype=torch.float64)


def greedy_rule(p: Tensor, x: Tensor, q: Tensor | None) -> SiblingRule:
    return greedy_sibling_rule(p, x)


def reuse_p_for_every_child(p: Tensor, x: Tensor, q: Tensor | None) -> SiblingRule:
    """BROKEN: every child is verified against p itself (no residual between siblings); the recovered token
    comes from the last child's residual normalize(max(p − q_m, 0))."""
    m = x.shape[-1]
    if m == 0:
        return sampled_rule(p, x, q)
    singles = [sampled_rule(p, x[:, k : k + 1], None if q is None else q[:, k : k + 1]) for k in range(m)]
    accept = torch.cat([s.accept_prob for s in singles], dim=-1)  # [R, m]
    residuals = torch.stack([singles[0].residuals[:, 0]] + [s.residuals[:, 1] for s in singles], dim=1)
    return SiblingRule(accept_prob=accept, residuals=residuals)


def recovered_from_p(p: Tensor, x: Tensor, q: Tensor | None) -> SiblingRule:
    """BROKEN: the recovered token is sampled from p instead of the last residual."""
    rule = sampled_rule(p, x, q)
    residuals = rule.residuals.clone()  # [R, m+1, V]
    residuals[:, -1] = residuals[:, 0]
    return SiblingRule(accept_prob=rule.accept_prob, residuals=residuals)


def merge_equal_siblings(p: Tensor, x: Tensor, q: Tensor | None) -> SiblingRule:
    """BROKEN (a prefix tree of sampled proposals): a child equal to an earlier one is merged into it, so it
    is never tried and does not move the residual. For depth-1 trees (no subtrees to merge)."""
    r, m = x.shape
    if m < 2 or q is None:
        return sampled_rule(p, x, q)
    repeat = torch.zeros(r, m, dtype=torch.bool)  # [R, m]: the child repeats an earlier sibling
    for k in range(1, m):
        repeat[:, k] = (x[:, :k] == x[:, k : k + 1]).any(dim=1)
    accept = torch.zeros(r, m, dtype=torch.float64)  # [R, m]
    residuals = torch.zeros(r, m + 1, p.shape[-1], dtype=torch.float64)  # [R, m+1, V]
    for pattern in torch.unique(repeat, dim=0):  # rows with the same repeated positions
        rows = (repeat == pattern).all(dim=1).nonzero().squeeze(1)  # [R']
        keep = (~pattern).nonzero().squeeze(1)  # [m'] the distinct children, in order
        rule = sampled_rule(p[rows], x[rows][:, keep], q[rows][:, keep])
        accept[rows.unsqueeze(1), keep] = rule.accept_prob
        tried = torch.cat([torch.zeros(1, dtype=torch.long), (~pattern).long().cumsum(0)])  # [m+1]
        residuals[rows] = rule.residuals[:, tried]
    return SiblingRule(accept_prob=accept, residuals=residuals)


# ---------------------------------------------------------------------------------------------- one round


Streams = dict[int, np.ndarray]  # L -> [V] * L: probability that a round emits exactly these L tokens


def round_enumerator(
    ptab: np.ndarray, drafting: Drafting, rule: RuleFn, orders: Orders, eos: int | None
) -> Callable[[Nested, Ctx], Streams]:
    """streams(shape, ctx): the exact distribution of the tokens a round emits from an accepted node with
    subtree ``shape`` and context ``ctx`` (for the root: the round's context). An accepted EOS ends a
    stream."""
    vocab = ptab.shape[-1]

    @functools.cache
    def streams(shape: Nested, ctx: Ctx) -> Streams:
        m = len(shape)
        x, w = drafting.draw(ctx, m)  # [R, m], [R]
        told = drafting.told(ctx, m)  # [m, V] or None
        p = torch.from_numpy(np.broadcast_to(ptab[ctx], (len(x), vocab)).copy())  # [R, V]
        accepted = np.zeros((m, vocab))  # [m, V]: P(child c is accepted with token y)
        out: Streams = {1: np.zeros(vocab)}
        perms = orders(x)
        for perm in perms:  # [R, m]
            xs = np.take_along_axis(x, perm, axis=1)  # [R, m] tokens in trial order
            qs = None if told is None else torch.from_numpy(told[perm])  # [R, m, V]
            at = rule(p, torch.from_numpy(xs), qs)
            a, res = at.accept_prob.numpy(), at.residuals.numpy()  # [R, m], [R, m+1, V]
            reach = np.concatenate([np.ones((len(x), 1)), np.cumprod(1 - a, axis=1)], axis=1)  # [R, m+1]
            for j in range(m):
                wj = w * reach[:, j] * a[:, j] / len(perms)  # [R]
                np.add.at(accepted, (perm[:, j], xs[:, j]), wj)
            out[1] += (w * reach[:, m] / len(perms)) @ res[:, m, :vocab]
        for c, y in zip(*np.nonzero(accepted), strict=True):
            if y == eos:
                out[1][y] += accepted[c, y]
                continue
            for length, t in streams(shape[c], (ctx[1], int(y))).items():
                out.setdefault(length + 1, np.zeros((vocab,) * (length + 1)))[y] += accepted[c, y] * t
        return out

    return streams


def loop_joint(streams: Callable[[Ctx], Streams], vocab: int, n: int, eos: int | None) -> np.ndarray:
    """The exact joint distribution of the first n tokens of the loop from an empty prompt: [V+1] * n, END = V
    after EOS. dist[m][a, b] is the distribution of the next m tokens from context (a, b); a round's EOS can
    only be its last token (nothing follows an accepted EOS; a recovered or bonus token is last)."""
    end, tok = vocab, slice(0, vocab)
    contexts = reachable_contexts(vocab)
    dist = [np.ones((vocab + 1, vocab + 1))]
    for m in range(1, n + 1):
        dm = np.zeros((vocab + 1, vocab + 1) + (vocab + 1,) * m)
        for c in contexts:
            out = dm[c]  # [V+1] * m, a view
            for length, t in streams(c).items():
                if length >= m:  # the round alone fixes the next m tokens
                    out[(tok,) * m] += t.sum(axis=tuple(range(m, length)))
                    continue
                rest = m - length
                if eos is not None:
                    out[(tok,) * (length - 1) + (eos,) + (end,) * rest] += t[..., eos]
                    t = t.copy()
                    t[..., eos] = 0.0
                nxt = dist[rest][c[1], :vocab] if length == 1 else dist[rest][:vocab, :vocab]
                out[(tok,) * length] += t.reshape(t.shape + (1,) * rest) * nxt
        dist.append(dm)
    return dist[n][vocab, vocab]


# ---------------------------------------------------------------------------------------------- cases


@functools.cache
def tables(family: str, setting: str) -> dict[str, np.ndarray]:
    """float64 [V+1, V+1, V] tables under ``setting``: target p, draft q, the other family's draft q2, and
    the target at temperature 0 (the greedy reference)."""
    params = SETTINGS[setting]
    pair, other = make_pair(family), make_pair(OTHER_DRAFT[family])
    return {
        "p": pair.target.probs(params).numpy(),
        "q": pair.draft.probs(params).numpy(),
        "q2": other.draft.probs(params).numpy(),
        "p_greedy": pair.target.probs(GREEDY).numpy(),
    }


@dataclass(frozen=True)
class Verifier:
    """A drafting scheme with the rule and trial orders it is verified with."""

    drafting: Callable[[dict[str, np.ndarray]], Drafting]
    rule: RuleFn = sampled_rule
    orders: Orders = random_orders
    greedy: bool = False  # compare with the target's greedy decoding


VERIFIERS: dict[str, Verifier] = {
    # (a) siblings sampled i.i.d. from one draft, verified with its q
    "iid": Verifier(lambda t: Drafting((t["q"],))),
    # (b) siblings from two different drafts (alternating by sibling position), each verified with its own q
    "mixed": Verifier(lambda t: Drafting((t["q"], t["q2"]))),
    # (c) single guesses: the deterministic top-m of the draft, verified without q
    "topk_guess": Verifier(lambda t: Drafting((t["q"],), kind="topk", told_q=False)),
    # greedy verification of i.i.d. drafts
    "greedy": Verifier(lambda t: Drafting((t["q"],)), rule=greedy_rule, orders=index_order, greedy=True),
}
#: exact too, beyond what the engine needs: a fixed order, and random guesses verified as single guesses
EXACT_EXTRAS: dict[str, Verifier] = {
    "iid_index_order": Verifier(lambda t: Drafting((t["q"],)), orders=index_order),
    "mixed_index_order": Verifier(lambda t: Drafting((t["q"], t["q2"])), orders=index_order),
    "iid_guess": Verifier(lambda t: Drafting((t["q"],), told_q=False)),
    "without_replacement_guess": Verifier(lambda t: Drafting((t["q"],), "without_replacement", told_q=False)),
}
BROKEN: dict[str, Verifier] = {
    "reuse_p_iid": Verifier(lambda t: Drafting((t["q"],)), rule=reuse_p_for_every_child),
    "reuse_p_mixed": Verifier(lambda t: Drafting((t["q"], t["q2"])), rule=reuse_p_for_every_child),
    "recovered_from_p": Verifier(lambda t: Drafting((t["q"], t["q2"])), rule=recovered_from_p),
    "topk_with_q": Verifier(lambda t: Drafting((t["q"],), kind="topk")),
    "sorted_order": Verifier(lambda t: Drafting((t["q"],)), orders=sorted_by_token),
    "merged_equal_siblings": Verifier(
        lambda t: Drafting((t["q"],)), rule=merge_equal_siblings, orders=index_order
    ),
}


def tree_tv(family: str, setting: str, shape: str, verifier: Verifier) -> float:
    """TV between the enumerated tree speculative loop and the target (its greedy decoding for greedy)."""
    pair, t = make_pair(family), tables(family, setting)
    streams = round_enumerator(
        t["p"], verifier.drafting(t), verifier.rule, verifier.orders, pair.eos_token_id
    )
    root = nested(SHAPES[shape])
    spec = loop_joint(lambda c: streams(root, c), pair.vocab, pair.num_tokens, pair.eos_token_id)
    assert abs(spec.sum() - 1) < 1e-12
    ref = target_joint(t["p_greedy" if verifier.greedy else "p"], pair.num_tokens, pair.eos_token_id)
    return total_variation(spec, ref)


# ---------------------------------------------------------------------------------------------- exactness


def test_shapes_are_within_width_three_and_depth_three():
    """The shapes swept below: width ≤ 3, depth ≤ 3, and together they hold widths 1, 2, 3 and depths 1..3."""
    widths, depths = set(), set()
    for parents in SHAPES.values():
        depth = [0] * len(parents)
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        counts = np.bincount(np.array(parents[1:]), minlength=len(parents))
        widths.add(int(counts.max()))
        depths.add(max(depth))
    assert widths == {1, 2, 3} and depths == {1, 2, 3}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("verifier", list(VERIFIERS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_loop_is_exact(shape: str, verifier: str, setting: str):
    """For every tree shape, drafting scheme and sampling setting, and every family (the pair of toy models),
    the first N tokens of the tree speculative loop are distributed exactly as the target's (for greedy: as
    the target's greedy decoding): TV ≤ 1e-12."""
    for family in FAMILIES:
        tv = tree_tv(family, setting, shape, VERIFIERS[verifier])
        assert tv <= EXACT_TV, f"{family}: TV {tv:.3e}"


@pytest.mark.parametrize("verifier", list(EXACT_EXTRAS))
@pytest.mark.parametrize("shape", ["w3d1", "irregular"])
def test_fixed_order_and_random_guesses_are_exact(shape: str, verifier: str):
    """A random trial order is not needed: children tried in index order are exact too (the siblings are
    independent, so each step is plain speculative sampling of the current residual). And single-guess
    verification is exact for guesses drawn at random, with or without replacement: conditioned on the
    drafted tree, each node emits a sample of p whatever its guesses."""
    for family, setting in itertools.product(FAMILIES, ["t1", "combo"]):
        tv = tree_tv(family, setting, shape, EXACT_EXTRAS[verifier])
        assert tv <= EXACT_TV, f"{family}/{setting}: TV {tv:.3e}"


def test_enumeration_reaches_every_depth():
    """The enumeration is not blind below the first level: with p = q every draft is accepted, so the depth-3
    bonus token is emitted; drawing it from the wrong node's p is caught."""

    def uniform_bonus(p: Tensor, x: Tensor, q: Tensor | None) -> SiblingRule:
        rule = sampled_rule(p, x, q)
        if x.shape[-1]:
            return rule
        return SiblingRule(rule.accept_prob, torch.full_like(rule.residuals, 1.0 / p.shape[-1]))

    t = tables("equal", "t1")
    streams = round_enumerator(t["p"], Drafting((t["p"],)), uniform_bonus, random_orders, None)
    root = nested(SHAPES["w2d3"])
    lengths = {length for length, t in streams(root, (3, 3)).items() if t.sum() > 0}
    assert lengths == {4}  # every round emits 4 tokens: 3 accepted, 1 bonus
    spec = loop_joint(lambda c: streams(root, c), 3, 5, None)
    assert total_variation(spec, target_joint(t["p"], 5)) > BROKEN_TV


# ---------------------------------------------------------------------------------------------- broken


@pytest.mark.parametrize("broken", [b for b in BROKEN if b != "merged_equal_siblings"])
def test_broken_variants_are_caught(broken: str):
    """Each broken variant is far from exact (TV > 1e-3) on the irregular tree, for some family:
    reusing p for every child (no residual between siblings), the recovered token sampled from p instead of
    the residual, top-k (without replacement) children verified with the sampled-proposal rule as if they
    were samples of q, and a trial order chosen by looking at the tokens."""
    worst = max(tree_tv(family, "t1", "irregular", BROKEN[broken]) for family in FAMILIES)
    assert worst > BROKEN_TV, f"TV {worst:.3e}"


def test_merging_equal_sampled_siblings_is_caught():
    """A prefix tree that merges equal sampled siblings into one node is NOT exact with the sampled-proposal
    rule: a repeated proposal, although it is then accepted with probability 0, still moves the residual
    (r_k = normalize(max(r_{k−1} − q, 0))), and that is part of the exact rule. Keep equal siblings apart."""
    worst = max(tree_tv(family, "t1", "w3d1", BROKEN["merged_equal_siblings"]) for family in FAMILIES)
    assert worst > BROKEN_TV, f"TV {worst:.3e}"


# ---------------------------------------------------------------------------------------------- chi-square

DRAWS = 50_000  # trees drafted and verified by the torch sampler
ALPHA = 1e-4
CHI_FAMILY, CHI_SHAPE = "eos", "irregular"


@functools.cache
def tables32(family: str) -> dict[str, Tensor]:
    """float32 [V+1, V+1, V] tables (temperature 1) by the real transform: target, draft, other draft."""
    params = SETTINGS["t1"]
    pair, other = make_pair(family), make_pair(OTHER_DRAFT[family])
    return {
        "p": pair.target.probs(params, torch.float32),
        "q": pair.draft.probs(params, torch.float32),
        "q2": other.draft.probs(params, torch.float32),
    }


def draft_trees(
    parents: tuple[int, ...], t: dict[str, Tensor], rows: int, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """Drafts ``rows`` trees of shape ``parents`` from BOS, each child from the draft of its sibling position
    (q, q2 alternating). Returns tokens [rows, N] (the root is BOS's stand-in 0, never read), p [rows, N, V]
    (after each node) and q [rows, N, V] (each node's sampling distribution; zeros at the root)."""
    vocab = t["p"].shape[-1]
    n = len(parents)
    second = torch.full((rows, n), vocab, dtype=torch.long)  # [rows, N]: the second-last token at each node
    last = torch.full((rows, n), vocab, dtype=torch.long)  # [rows, N]: the node's own token (BOS at the root)
    q = torch.zeros(rows, n, vocab)  # [rows, N, V]
    rank = [sum(1 for j in range(1, i) if parents[j] == parents[i]) for i in range(n)]
    for i in range(1, n):
        u = parents[i]
        q[:, i] = t["q2" if rank[i] % 2 else "q"][second[:, u], last[:, u]]
        last[:, i] = torch.multinomial(q[:, i], 1, generator=generator).squeeze(1)
        second[:, i] = last[:, u]
    p = t["p"][second, last]  # [rows, N, V]
    tokens = torch.where(last == vocab, 0, last)  # the root's BOS is not a token; any id stands for it
    return tokens, p, q


def round_histogram(verdicts: list[TreeVerdict], cells: dict[tuple[int, ...], int]) -> np.ndarray:
    counts = np.zeros(len(cells))
    for v in verdicts:
        counts[cells[tuple(v.tokens)]] += 1  # a KeyError is a stream the enumeration says is impossible
    return counts


def exact_round(t: dict[str, Tensor], eos: int) -> tuple[dict[tuple[int, ...], int], np.ndarray]:
    """Every stream one round from BOS can emit → cell index, and the exact cell probabilities, enumerated
    for the float32 tables actually sampled from (renormalized in float64)."""
    t64 = {k: v.double().numpy() / v.double().numpy().sum(-1, keepdims=True) for k, v in t.items()}
    vocab = t64["p"].shape[-1]
    streams = round_enumerator(t64["p"], Drafting((t64["q"], t64["q2"])), sampled_rule, random_orders, eos)
    cells, probs = {}, []
    for length, arr in streams(nested(SHAPES[CHI_SHAPE]), (vocab, vocab)).items():
        for seq in itertools.product(range(vocab), repeat=length):
            cells[seq] = len(probs)
            probs.append(arr[seq])
    return cells, np.array(probs)


@pytest.mark.slow
def test_torch_sampler_matches_the_enumerated_round_and_broken_is_caught():
    """The torch sampler itself — random trial orders, uniforms, the walk, multinomial draws, float32 — on
    DRAWS drafted trees (irregular shape, siblings from two different drafts, EOS family): the histogram of
    the emitted token sequences passes a chi-square test (α = 1e-4) against the round's enumerated
    distribution, which the tests above prove exact. The same sampler with a broken rule (p reused for every
    child) fails it outright (p-value < α)."""
    pair, t = make_pair(CHI_FAMILY), tables32(CHI_FAMILY)
    cells, probs = exact_round(t, pair.eos_token_id)
    tokens, p, q = draft_trees(SHAPES[CHI_SHAPE], t, DRAWS, torch.Generator().manual_seed(0))
    parents = torch.tensor(SHAPES[CHI_SHAPE])
    g = torch.Generator().manual_seed(1)
    good = [
        tree_rejection_sample(tokens[r], parents, p=p[r], q=q[r], generator=g, eos_token_id=pair.eos_token_id)
        for r in range(DRAWS)
    ]
    pvalue = chisquare_pvalue(round_histogram(good, cells), probs)
    assert pvalue >= ALPHA, f"p-value {pvalue:.3g}"

    def broken(r: int) -> TreeVerdict:
        def rule(u: int, kids: Tensor) -> SiblingRule:
            p_u, x_u, q_u = p[r, u][None], tokens[r, kids][None], q[r, kids][None]
            at = reuse_p_for_every_child(p_u, x_u, q_u)  # float64 arithmetic on float32 inputs
            return SiblingRule(at.accept_prob[0].float(), at.residuals[0].float())

        return sample_tree_verdict(tokens[r], parents, rule, g, pair.eos_token_id)

    rows = DRAWS // 100  # far from exact: its p-value underflows to 0 from these 500 draws (as from 5,000)
    bad = round_histogram([broken(r) for r in range(rows)], cells)
    assert chisquare_pvalue(bad, probs) < ALPHA
