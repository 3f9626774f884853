"""Exact enumeration of constrained tree rounds: the output is distributed exactly as constrained sampling
without speculation (TV ≤ 1e-12) for the tree verifiers — sampled siblings, single-guess siblings, greedy —
with the grammar's forced run as the tree's trunk, and broken variants are caught.

The toy grammars, the toy models and the reference (constrained ancestral sampling) are those of
:mod:`test_grammar_enumeration`. A round runs the engine's own tree steps (:mod:`verispec.grammar.rounds`:
the forced run, :func:`tree_with_forced` hanging the drafter's tree from the trunk's end, :func:`tree_masks`,
the masked logits, the commit with a finished grammar's end) with the real sibling rules of
:mod:`verispec.verify.tree` in float64: every drafted tree, every trial order of every node's children, every
accept/reject branch and every recovered or bonus token enumerated.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from test_grammar_enumeration import (
    BROKEN_TV,
    DEAD,
    EOS,
    EXACT_TV,
    GRAMMARS,
    PAIR,
    Grammar,
    N,
    ToyGrammar,
    V,
    _logits,
    forcing,
    reference,
    tv,
)
from toy import SETTINGS, single_threaded
from verispec.drafting.tree import TreeProposal
from verispec.errors import UsageError
from verispec.grammar.rounds import constrain, finish, forced_run, tree_masks, tree_with_forced
from verispec.sampling import probs_from_logits
from verispec.verify.tree import SiblingRule, greedy_sibling_rule, sibling_rule

#: The drafter's tree shapes as parents lists (node 0: its root, the trunk's end).
SHAPES: dict[str, tuple[int, ...]] = {"w2d1": (-1, 0, 0), "fork": (-1, 0, 0, 1)}
#: verifier → (children sampled i.i.d. from q, else q's top m; q told to the verifier; random trial orders)
VERIFIERS = {"sampled": (True, True, True), "guess": (False, False, True), "greedy": (True, True, False)}
CASES = [("sampled", "t1"), ("sampled", "combo"), ("guess", "t0.7"), ("greedy", "greedy")]

Streams = dict[tuple[int, ...], float]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


def ancestors(parents: Sequence[int]) -> Tensor:
    """[N, N] bool: node j is node i or one of its ancestors."""
    mask = torch.eye(len(parents), dtype=torch.bool)  # [N, N]
    for node in range(1, len(parents)):
        mask[node] |= mask[parents[node]]
    return mask


def drafter_tree(root: int, tokens: Sequence[int], parents: Sequence[int], q: Tensor | None) -> TreeProposal:
    """The drafter's tree: ``tokens`` below ``root``; q [N, V] (row 0 a point mass on the root) or None."""
    depth = [0] * len(parents)
    for node in range(1, len(parents)):
        depth[node] = depth[parents[node]] + 1
    return TreeProposal(
        tokens=torch.tensor([root, *tokens], dtype=torch.long),  # [N]
        parents=torch.tensor(parents, dtype=torch.long),  # [N]
        depth=torch.tensor(depth, dtype=torch.long),  # [N]
        mask=ancestors(parents),  # [N, N]
        q=q,
    )


def verify_streams(tree: TreeProposal, p: Tensor, sampled_order: bool, greedy: bool) -> Streams:
    """Every token stream tree verification emits from ``tree`` (p [N, V], the constrained target at each
    node), with its probability: children tried in every order (uniformly) or in index order."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children = [[c for c in range(len(tokens)) if parents[c] == u] for u in range(len(tokens))]

    def walk(u: int) -> Streams:
        out: Streams = {}
        orders = list(itertools.permutations(children[u])) if sampled_order else [tuple(children[u])]
        for order in orders:
            x = torch.tensor([[tokens[c] for c in order]], dtype=torch.long)  # [1, m]
            rule: SiblingRule
            if greedy:
                rule = greedy_sibling_rule(p[u][None], x)
            else:
                q = None if tree.q is None else tree.q[list(order)][None]  # [1, m, V]
                rule = sibling_rule(x, p_u=p[u][None], q_children=q, dtype=torch.float64)
            accept, residual = rule.accept_prob[0].double(), rule.residuals[0, -1].double()  # [m], [V]
            reach = 1.0 / len(orders)
            for j, child in enumerate(order):
                taken = reach * float(accept[j])
                below = {(): 1.0} if tokens[child] == EOS else walk(child)
                for stream, pr in below.items():
                    key = (tokens[child], *stream)
                    out[key] = out.get(key, 0.0) + taken * pr
                reach *= 1 - float(accept[j])
            for y in range(V):
                out[(y,)] = out.get((y,), 0.0) + reach * float(residual[y])
        return {key: pr for key, pr in out.items() if pr > 0}

    return walk(0)


def speculative_tree(
    grammar: Grammar, setting: str, verifier: str, shape: str, mask_q: bool = False, broken: str = ""
) -> dict[tuple[int, ...], float]:
    """The exact output distribution of constrained tree speculation with the engine's round steps.

    ``mask_q``: each child drawn from q masked with the grammar after its parent's path (else unmasked).
    ``broken``: "parent_state" (each draft node's p masked with its parent's state instead of its own),
    "trunk_unconstrained" (the trunk's point masses verified against the unconstrained p)."""
    params = SETTINGS[setting]
    sampled, told_q, random_order = VERIFIERS[verifier]
    out: dict[tuple[int, ...], float] = {}

    @functools.cache
    def outcomes(prefix: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], float], ...]:
        """The tokens a round commits from the output ``prefix`` → probability."""
        room = N - len(prefix)
        state = ToyGrammar(grammar, prefix)
        trunk = forced_run(state, room - 1)
        parents = SHAPES[shape]
        depth = [0] * len(parents)
        for node in range(1, len(parents)):
            depth[node] = depth[parents[node]] + 1
        parents = parents[: sum(d <= room - 1 - len(trunk) for d in depth)]  # capped like the engine's
        paths: list[tuple[int, ...]] = []  # each drafter node's tokens after the committed ones

        def q_at(node: int) -> Tensor:
            """[V] the draft's q for the children of the drafter's ``node`` (its path in ``paths``)."""
            context = (*prefix, *paths[node])
            logits = _logits(PAIR.draft.logits, context)  # [V]
            allowed = state.mask_after(paths[node]) if mask_q else None
            if allowed is not None and bool(allowed.any()):
                logits = constrain(logits, allowed)
            return probs_from_logits(logits, params)

        result: dict[tuple[int, ...], float] = {}
        drafts = itertools.product(range(V), repeat=len(parents) - 1) if sampled else [None]
        for draft in drafts:
            paths[:] = [tuple(trunk)]
            tokens, rows, weight = [], [], 1.0
            for node in range(1, len(parents)):
                q = q_at(parents[node])  # [V]
                if draft is None:  # the top-m of q: this child's rank among its siblings
                    rank = sum(1 for s in range(1, node) if parents[s] == parents[node])
                    token = int(q.argsort(descending=True, stable=True)[rank])
                else:
                    token, weight = draft[node - 1], weight * float(q[draft[node - 1]])
                tokens.append(token)
                rows.append(q)
                paths.append((*paths[parents[node]], token))
            if weight == 0:
                continue
            root = trunk[-1] if trunk else (prefix[-1] if prefix else 0)  # the root's token is never read
            point = torch.zeros(1, V, dtype=torch.float64)
            point[0, root] = 1.0
            q_rows = torch.cat([point, *[r[None] for r in rows]]) if told_q else None  # [D, V]
            tree = tree_with_forced(
                prefix[-1] if prefix else 0, trunk, drafter_tree(root, tokens, parents, q_rows)
            )
            nodes, tree_parents = tree.tokens.tolist(), tree.parents.tolist()
            masks = tree_masks(state, nodes, tree_parents)  # [T, V]
            node_paths: list[tuple[int, ...]] = [()]
            for node in range(1, len(nodes)):
                node_paths.append((*node_paths[tree_parents[node]], nodes[node]))
            logits = torch.stack(
                [_logits(PAIR.target.logits, prefix + path) for path in node_paths]
            )  # [T, V]
            if broken == "parent_state":
                masks = masks[[0, *[tree_parents[node] for node in range(1, len(nodes))]]]
            p = probs_from_logits(constrain(logits, masks), params)  # [T, V]
            if broken == "trunk_unconstrained":
                p[: len(trunk)] = probs_from_logits(logits[: len(trunk)], params)
            for stream, pr in verify_streams(tree, p, random_order, verifier == "greedy").items():
                settled = ToyGrammar(grammar, prefix)
                emitted = tuple(finish(settled, list(stream[:room]), room, {EOS}))
                result[emitted] = result.get(emitted, 0.0) + weight * pr
        return tuple(result.items())

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) >= N or EOS in prefix:
            out[prefix[:N]] = out.get(prefix[:N], 0.0) + prob
            return
        try:
            rounds = outcomes(prefix)
        except UsageError:  # a broken round's dead end: its mass lands on no output
            out[DEAD] = out.get(DEAD, 0.0) + prob
            return
        for emitted, pr in rounds:
            walk(prefix + emitted, prob * pr)

    walk((), 1.0)
    return out


def test_the_forced_trunk_roots_the_drafters_tree() -> None:
    """After (2, 0) the forcing grammar forces 1 then 2: the round's tree is the root, that trunk, and the
    drafter's tree below the trunk's end, each node seeing its ancestors; q's trunk rows are point masses."""
    state = ToyGrammar(forcing, (2, 0))
    trunk = forced_run(state, 5)
    assert trunk == [1, 2]
    q = torch.full((4, V), 1.0 / V, dtype=torch.float64)  # [4, V]
    tree = tree_with_forced(0, trunk, drafter_tree(2, [3, 0, 1], (-1, 0, 0, 1), q))
    assert tree.tokens.tolist() == [0, 1, 2, 3, 0, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 3]
    assert tree.depth.tolist() == [0, 1, 2, 3, 3, 4]
    assert torch.equal(tree.mask, ancestors(tree.parents.tolist()))
    assert tree.q is not None and torch.equal(tree.q[3:], q[1:])
    assert torch.equal(tree.q[:3], torch.eye(V, dtype=torch.float64)[[0, 1, 2]])
    masks = tree_masks(state, tree.tokens.tolist(), tree.parents.tolist())  # [6, V]
    assert masks[:2].sum(1).tolist() == [1, 1]  # the trunk's parents allow its token alone


@pytest.mark.parametrize("grammar", GRAMMARS)
@pytest.mark.parametrize(("verifier", "setting"), CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_constrained_tree_speculation_is_exact(grammar: str, verifier: str, setting: str, shape: str) -> None:
    """TV ≤ 1e-12 against constrained sampling without speculation, with q unmasked and masked (sampled)."""
    expected = reference(GRAMMARS[grammar], setting)
    for mask_q in (False, True) if verifier == "sampled" else (False,):
        got = speculative_tree(GRAMMARS[grammar], setting, verifier, shape, mask_q=mask_q)
        assert tv(got, expected) <= EXACT_TV, (mask_q, tv(got, expected))


@pytest.mark.parametrize("broken", ["parent_state", "trunk_unconstrained"])
def test_broken_tree_variants_are_caught(broken: str) -> None:
    """A node masked with its parent's state, and the forced trunk verified against the unconstrained p, are
    each off by far more than round-off under the forcing grammar."""
    got = speculative_tree(forcing, "t1", "sampled", "fork", broken=broken)
    assert tv(got, reference(forcing, "t1")) > BROKEN_TV
