"""Unit tests for :mod:`verispec.verify.tree`.

What is checked here: the closed-form values of the sibling rules on hand-computed examples and against a
plain-Python reference, the edge cases named in the module's docstring (zero residual, q(x) = 0, repeated
siblings, leaves, vocabulary sizes), the walk (random trial order, greedy's first matching child, end of
sequence), identity with the chain verifiers of :mod:`verispec.verify.chain` for the same generator state,
input
validation, and the invariants every tree verdict must hold (hypothesis). Distribution-level exactness is
proved in test_tree_enumeration.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from test_verify import gen, ids, random_probs, t64
from verispec.verify.chain import greedy_verify, rejection_sample, single_guess_sample
from verispec.verify.tree import (
    SiblingRule,
    TreeVerdict,
    _eos_set,
    _tree_children,
    _walk,
    greedy_sibling_rule,
    sample_tree_verdict,
    sibling_rule,
    tree_greedy_verify,
    tree_rejection_sample,
)

F64 = torch.float64
NAN = float("nan")


# ---------------------------------------------------------------------------------------------- helpers


def random_tree(g: torch.Generator, n: int) -> Tensor:
    """parents [N] of a random tree: each node's parent is uniform among the earlier nodes."""
    return ids([-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)])


def draft_tree(g: torch.Generator, parents: Tensor, q: Tensor) -> Tensor:
    """tokens [N]: the root 0, then node i's token sampled from q[i] [N, V]."""
    n = parents.shape[0]
    drawn = torch.multinomial(q[1:].double(), 1, generator=g).squeeze(1) if n > 1 else ids([])
    return torch.cat([ids([0]), drawn])


def reference_sibling(
    p: list[float], xs: list[int], qs: list[list[float]] | None, vq: int
) -> tuple[list, list]:
    """Plain-Python closed form of the multi-proposal rule: (accept probabilities, residuals r_0..r_m), over
    max(Vp, Vq) tokens (Vq: the draft's, or one past the largest guess)."""
    if qs is None:
        qs = [[1.0 if i == x else 0.0 for i in range(vq)] for x in xs]
    v = max(len(p), vq)
    r = [p[i] if i < len(p) else 0.0 for i in range(v)]
    accept, residuals = [], [[a / sum(r) for a in r]]
    for x, q in zip(xs, qs, strict=True):
        q = [q[i] if i < len(q) else 0.0 for i in range(v)]
        if q[x] == 0:  # ratio +inf when r > 0, and 0/0 rejects
            accept.append(1.0 if r[x] > 0 else 0.0)
        else:
            accept.append(min(1.0, r[x] / q[x]))
        diff = [max(a - b, 0.0) for a, b in zip(r, q, strict=True)]
        mass = sum(diff)
        r = [a / mass for a in diff] if mass > 0 else r
        residuals.append(r)
    return accept, residuals


def check_tree_verdict(v: TreeVerdict, tokens: Tensor, parents: Tensor, vocab: int, eos: set[int]) -> None:
    """The invariants every tree verdict holds (see the TreeVerdict docstring)."""
    up, tok = parents.tolist(), tokens.tolist()
    path = v.accepted_nodes
    assert all(up[c] == prev for prev, c in zip([0, *path], path, strict=False))  # a path from the root
    assert v.tokens[: v.num_accepted] == [tok[c] for c in path]
    last = path[-1] if path else 0
    assert v.ended_at_leaf == (last not in up)
    eos_at = [i for i, c in enumerate(path) if tok[c] in eos]
    if eos_at:  # an accepted EOS is the last emitted token
        assert eos_at == [len(path) - 1] and len(v.tokens) == v.num_accepted
        assert not v.bonus and not v.recovered
    else:
        assert len(v.tokens) == v.num_accepted + 1 and 0 <= v.tokens[-1] < vocab
        assert v.bonus == v.ended_at_leaf and v.recovered == (not v.ended_at_leaf)


CHAIN = ids([-1, 0, 1, 2])  # parents of a chain of 3 draft tokens


# ---------------------------------------------------------------------------------------------- closed form


def test_sibling_rule_hand_example():
    """p = [.5, .3, .2]; child 0 (token 0, q = [.7, .2, .1]) then child 1 (token 1, q = [.1, .8, .1]):
    accept 5/7; r_1 = normalize([0, .1, .1]) = [0, .5, .5]; accept .5/.8; r_2 = normalize([0, 0, .4])."""
    rule = sibling_rule(
        ids([0, 1]), p_u=t64([0.5, 0.3, 0.2]), q_children=t64([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]]), dtype=F64
    )
    torch.testing.assert_close(rule.accept_prob, t64([5 / 7, 0.625]))
    torch.testing.assert_close(rule.residuals, t64([[0.5, 0.3, 0.2], [0, 0.5, 0.5], [0, 0, 1]]))


def test_single_guess_rule_hand_example():
    """Guesses 0, 0, 1 against p = [.5, .3, .2]: accept .5; the repeated 0 now has r = 0 (accept 0, residual
    unchanged); accept .3/.5 = .6; the last residual is the point mass on 2."""
    rule = sibling_rule(ids([0, 0, 1]), p_u=t64([0.5, 0.3, 0.2]), q_children=None, dtype=F64)
    torch.testing.assert_close(rule.accept_prob, t64([0.5, 0.0, 0.6]))
    torch.testing.assert_close(
        rule.residuals, t64([[0.5, 0.3, 0.2], [0, 0.6, 0.4], [0, 0.6, 0.4], [0, 0, 1]])
    )


def test_repeated_sampled_sibling_moves_the_residual():
    """Two i.i.d. samples of the same token from q: the second is accepted with probability 0 (r_1 has no mass
    there) but the residual still moves, r_2 = normalize(max(r_1 − q, 0)) ≠ r_1: a repeated proposal is a
    proposal of its own."""
    p, q = t64([0.2, 0.3, 0.5]), t64([0.6, 0.3, 0.1])
    rule = sibling_rule(ids([0, 0]), p_u=p, q_children=torch.stack([q, q]), dtype=F64)
    torch.testing.assert_close(rule.accept_prob, t64([1 / 3, 0.0]))
    torch.testing.assert_close(rule.residuals[1], t64([0, 0, 1]))  # max(p − q, 0) = [0, 0, .4]
    torch.testing.assert_close(rule.residuals[2], t64([0, 0, 1]))  # max([0, 0, 1] − q, 0) = [0, 0, .9]
    rule = sibling_rule(ids([0, 0]), p_u=t64([0.1, 0.5, 0.4]), q_children=torch.stack([q, q]), dtype=F64)
    torch.testing.assert_close(rule.residuals[1], t64([0, 0.4, 0.6]))  # [0, .2, .3]
    torch.testing.assert_close(rule.residuals[2], t64([0, 0.1 / 0.6, 0.5 / 0.6]))  # [0, .1, .5]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    m=st.integers(0, 4),
    vp=st.integers(1, 6),
    dv=st.integers(-2, 2),
    zero_frac=st.sampled_from([0.0, 0.5, 0.9]),
    guesses=st.booleans(),
)
def test_sibling_rule_matches_plain_python_reference(seed, m, vp, dv, zero_frac, guesses):
    """Random p, q (sparse, different vocabularies) and children (sampled, or any guesses): sibling_rule
    equals the plain-Python closed form, for both the sampled-proposal and the single-guess form."""
    g = gen(seed)
    vq = max(1, vp + dv)
    p = random_probs(g, (vp,), zero_frac)  # [Vp]
    if guesses:
        q, xs = None, torch.randint(vp + 2, (m,), generator=g)  # [m] guesses, some beyond the target's vocab
    else:
        q = random_probs(g, (m, vq), zero_frac)  # [m, Vq]
        xs = torch.multinomial(q, 1, generator=g).squeeze(1) if m else ids([])
    rule = sibling_rule(xs, p_u=p, q_children=q, dtype=F64)
    vocab = int(xs.max()) + 1 if q is None and m else vq if q is not None else 0
    accept, residuals = reference_sibling(p.tolist(), xs.tolist(), None if q is None else q.tolist(), vocab)
    torch.testing.assert_close(rule.accept_prob, t64(accept).reshape(m))
    torch.testing.assert_close(rule.residuals, t64(residuals))


def test_sibling_rule_batched_equals_row_by_row():
    """Leading batch dimensions: the rule of a [2, 3] batch equals the rules of its rows."""
    g = gen(1)
    p = random_probs(g, (2, 3, 5), 0.3)  # [2, 3, 5]
    q = random_probs(g, (2, 3, 2, 5), 0.3)  # [2, 3, 2, 5]
    xs = torch.randint(5, (2, 3, 2), generator=g)  # [2, 3, 2]
    for qq in (q, None):
        batch = sibling_rule(xs, p_u=p, q_children=qq, dtype=F64)
        assert batch.accept_prob.shape == (2, 3, 2) and batch.residuals.shape == (2, 3, 3, 5)
        for i in range(2):
            for j in range(3):
                row = sibling_rule(
                    xs[i, j], p_u=p[i, j], q_children=None if qq is None else qq[i, j], dtype=F64
                )
                torch.testing.assert_close(batch.accept_prob[i, j], row.accept_prob)
                torch.testing.assert_close(batch.residuals[i, j], row.residuals)


def test_leaf_rule_is_the_bonus_distribution():
    """m = 0 (a leaf): no acceptance, and the one residual is p itself: the bonus distribution."""
    p = t64([0.25, 0.0, 0.75])
    for rule in (
        sibling_rule(ids([]), p_u=p, q_children=torch.zeros(0, 3, dtype=F64), dtype=F64),
        sibling_rule(ids([]), p_u=p),
    ):
        assert rule.accept_prob.shape == (0,)
        torch.testing.assert_close(rule.residuals, p.reshape(1, 3).to(rule.residuals.dtype))


# ---------------------------------------------------------------------------------------------- edge cases


def test_zero_residual_keeps_the_previous_residual():
    """q_1 = r_0 (here p): the first child is accepted with probability 1 and max(p − q_1, 0) has mass 0, so
    r_1 = r_0 by convention; the next child is then judged against p again."""
    p = t64([0.5, 0.25, 0.25])
    q = t64([[0.5, 0.25, 0.25], [0.0, 0.0, 1.0]])
    rule = sibling_rule(ids([1, 2]), p_u=p, q_children=q, dtype=F64)
    torch.testing.assert_close(rule.accept_prob, t64([1.0, 0.25]))
    torch.testing.assert_close(rule.residuals[1], p)
    torch.testing.assert_close(rule.residuals[2], t64([2 / 3, 1 / 3, 0.0]))


def test_q_zero_at_child_token():
    """q_c(x_c) = 0: accepted with probability 1 when r(x_c) > 0 (ratio +inf), 0 when r(x_c) = 0 too."""
    rule = sibling_rule(
        ids([0, 2]), p_u=t64([0.5, 0.5, 0.0]), q_children=t64([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]), dtype=F64
    )
    assert rule.accept_prob.tolist() == [1.0, 0.0]


def test_child_token_beyond_target_vocab_is_always_rejected():
    """Vq > Vp: a child token the target does not have has p = 0: rejected; nothing ≥ Vp is emitted."""
    p = t64([[0.5, 0.5]] * 3)  # [3, 2]
    q = t64([[0, 0, 1.0]] * 3)  # [3, 3]
    tokens, parents = ids([0, 2, 2]), ids([-1, 0, 0])
    for seed in range(20):
        for qq in (q, None):
            v = tree_rejection_sample(tokens, parents, p=p, q=qq, generator=gen(seed))
            assert v.num_accepted == 0 and v.recovered and v.tokens[0] in (0, 1)


def test_one_hot_p_gives_the_greedy_tokens():
    """With point-mass p (temperature 0) every tree verifier emits greedy tokens, whatever the seed and the
    trial order. Nodes 2 and 3 both hold token 1 (the root's argmax): tree_greedy_verify takes the first in
    index order and goes on below it; a sampled walk takes either, in random order."""
    p = torch.nn.functional.one_hot(ids([1, 2, 2, 2, 1, 1]), 3).to(F64)  # [6, 3]; p[2] = p[3]: same path
    tokens, parents = ids([0, 0, 1, 1, 2, 0]), ids([-1, 0, 0, 0, 2, 4])
    greedy = tree_greedy_verify(tokens, parents, p=p)
    assert greedy.tokens == [1, 2, 1] and greedy.accepted_nodes == [2, 4] and greedy.recovered
    q = random_probs(gen(2), (6, 3))
    seen = set()
    for seed in range(30):
        for qq in (q, None):
            v = tree_rejection_sample(tokens, parents, p=p, q=qq, generator=gen(seed), dtype=F64)
            assert v.tokens == greedy.tokens[: len(v.tokens)]
            seen.add(tuple(v.accepted_nodes))
    assert seen == {(2, 4), (3,)}


def test_children_are_tried_in_a_uniformly_random_order():
    """Two children with the same token, both always accepted (p is a point mass on it): which one the walk
    takes is the first in a random order, each about half the time over 400 seeds (binomial sd 10)."""
    p = t64([[0.0, 1.0]] * 3)
    q = t64([[0.5, 0.5]] * 3)
    tokens, parents = ids([0, 1, 1]), ids([-1, 0, 0])
    first = sum(
        tree_rejection_sample(tokens, parents, p=p, q=q, generator=gen(s)).accepted_nodes == [1]
        for s in range(400)
    )
    assert 150 < first < 250
    assert tree_greedy_verify(tokens, parents, p=p).accepted_nodes == [1]


def test_single_node_tree_samples_the_bonus_from_p():
    """N = 1 (no draft): one bonus token from p[0], with or without q."""
    p = t64([[0.5, 0.0, 0.5]])
    seen = set()
    for seed in range(40):
        for q in (t64([[1.0, 0.0, 0.0]]), None):
            v = tree_rejection_sample(ids([2]), ids([-1]), p=p, q=q, generator=gen(seed))
            assert v.bonus and v.num_accepted == 0 and v.ended_at_leaf
            seen.add(v.tokens[0])
    assert seen == {0, 2}
    assert tree_greedy_verify(ids([2]), ids([-1]), p=t64([[0.1, 3.0, 3.0]])).tokens == [1]


# ---------------------------------------------------------------------------------------------- greedy


def test_greedy_sibling_rule_hand_example_and_first_argmax():
    """Accept exactly the children equal to the first argmax (ties: the lower index); residuals are the point
    mass on it."""
    rule = greedy_sibling_rule(t64([0.0, 3.0, 3.0, 1.0]), ids([2, 1, 1, 7]))
    assert rule.accept_prob.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert rule.residuals.shape == (5, 4) and (rule.residuals.argmax(-1) == 1).all()
    assert (rule.residuals.sum(-1) == 1).all()


def test_greedy_tree_hand_example():
    """Root argmax 1: node 1 (token 0) mismatches, node 2 (token 1) matches; below node 2, argmax 3: node 4
    (token 3) matches, a leaf: bonus = argmax at node 4. Logits with -inf are fine."""
    inf = float("inf")
    logits = t64([[0, 5, 1, -inf], [9, 0, 0, 0], [0, 0, 0, 4], [1, 0, 0, 0], [0, 0, 2, 0]])  # [5, 4]
    tokens, parents = ids([0, 0, 1, 2, 3]), ids([-1, 0, 0, 2, 2])
    v = tree_greedy_verify(tokens, parents, p=logits)
    assert v.tokens == [1, 3, 2] and v.accepted_nodes == [2, 4] and v.bonus
    v = tree_greedy_verify(tokens, parents, p=logits.softmax(-1))
    assert v.tokens == [1, 3, 2]


# ------------------------------------------------------------------------------------------- end of sequence


def _eos_tree() -> tuple[Tensor, Tensor, Tensor]:
    """Root → node 1 (token 3) → node 2 (token 0); root → node 3 (token 1). p makes every path token certain
    at its node: argmax/point mass 3 at the root, 0 at node 1."""
    p = torch.nn.functional.one_hot(ids([3, 0, 2, 2]), 4).to(F64)  # [4, 4]
    return ids([5, 3, 0, 1]), ids([-1, 0, 1, 0]), p


@pytest.mark.parametrize("eos", [3, [7, 3]])
def test_accepted_eos_ends_output(eos):
    """An accepted EOS (node 1) is the last token: node 2 below it is not walked, nothing is sampled after."""
    tokens, parents, p = _eos_tree()
    for v in (
        tree_greedy_verify(tokens, parents, p=p, eos_token_id=eos),
        tree_rejection_sample(tokens, parents, p=p, q=None, generator=gen(), eos_token_id=eos),
    ):
        assert v.tokens == [3] and v.accepted_nodes == [1]
        assert not v.bonus and not v.recovered and not v.ended_at_leaf
    without = tree_greedy_verify(tokens, parents, p=p)
    assert without.tokens == [3, 0, 2] and without.bonus


def test_eos_as_recovered_or_bonus_token_is_emitted():
    """EOS emitted as the recovered or the bonus token is kept (it is the last token anyway)."""
    p = torch.nn.functional.one_hot(ids([3, 3]), 4).to(F64)  # [2, 4]
    recovered = tree_greedy_verify(ids([0, 1]), ids([-1, 0]), p=p, eos_token_id=3)
    assert recovered.tokens == [3] and recovered.recovered
    p = torch.nn.functional.one_hot(ids([3, 2]), 4).to(F64)  # [2, 4]
    bonus = tree_greedy_verify(ids([0, 3]), ids([-1, 0]), p=p, eos_token_id=2)
    assert bonus.tokens == [3, 2] and bonus.bonus


def test_rejected_eos_does_not_end_output():
    """An EOS on a rejected branch is not emitted and does not stop the walk down another branch."""
    p = torch.nn.functional.one_hot(ids([1, 2, 0]), 4).to(F64)  # [3, 4]
    v = tree_greedy_verify(ids([0, 3, 1]), ids([-1, 0, 0]), p=p, eos_token_id=3)
    assert v.tokens == [1, 0] and v.accepted_nodes == [2] and v.bonus


def test_verdict_properties():
    """num_accepted, bonus and recovered on hand-built verdicts."""
    assert TreeVerdict([4, 5, 6], [1, 3], ended_at_leaf=True).bonus
    v = TreeVerdict([4, 6], [1], ended_at_leaf=False)
    assert v.recovered and not v.bonus and v.num_accepted == 1
    eos = TreeVerdict([4, 2], [1, 2], ended_at_leaf=True)
    assert not eos.bonus and not eos.recovered and eos.num_accepted == 2


# ---------------------------------------------------------------------------------------------- chains


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    k=st.integers(0, 5),
    vp=st.integers(1, 6),
    dv=st.integers(-2, 2),
    zero_frac=st.sampled_from([0.0, 0.5]),
    eos=st.none() | st.integers(0, 5),
    dtype=st.sampled_from([torch.float32, F64]),
)
def test_chain_is_the_chain_verifier_for_the_same_generator(seed, k, vp, dv, zero_frac, eos, dtype):
    """On a chain, tree_rejection_sample gives the very verdict of verify.rejection_sample (q given) and of
    verify.single_guess_sample (q None) for the same seed, and tree_greedy_verify that of greedy_verify."""
    g = gen(seed)
    vq = max(1, vp + dv)
    q = random_probs(g, (k, vq), zero_frac, dtype=dtype)  # [K, Vq]
    p = random_probs(g, (k + 1, vp), zero_frac, dtype=dtype)  # [K+1, Vp]
    draft = torch.multinomial(q.double(), 1, generator=g).squeeze(1) if k else ids([])  # [K]
    tokens, parents = torch.cat([ids([1]), draft]), torch.arange(-1, k)
    q_nodes = torch.cat([torch.zeros(1, vq, dtype=dtype), q])  # [K+1, Vq], row 0 not read
    cases = [
        (
            rejection_sample(
                draft[None], q=q[None], p=p[None], generator=gen(seed), eos_token_id=eos, dtype=dtype
            ),
            q_nodes,
        ),
        (
            single_guess_sample(draft[None], p=p[None], generator=gen(seed), eos_token_id=eos, dtype=dtype),
            None,
        ),
    ]
    for want, qq in cases:
        got = tree_rejection_sample(
            tokens, parents, p=p, q=qq, generator=gen(seed), eos_token_id=eos, dtype=dtype
        )
        assert got.tokens == want.row(0) and got.num_accepted == int(want.num_accepted[0])
        assert got.accepted_nodes == list(range(1, got.num_accepted + 1))
        assert got.bonus == bool(want.bonus[0]) and got.recovered == bool(want.recovered[0])
    logits = torch.randint(-2, 3, (k + 1, vp), generator=g).double()  # [K+1, V], many ties
    guess = torch.where(torch.rand(k, generator=g) < 0.6, logits[:k].argmax(-1), draft % vp)  # often right
    want = greedy_verify(guess[None], p=logits[None], eos_token_id=eos)
    got = tree_greedy_verify(torch.cat([ids([1]), guess]), parents, p=logits, eos_token_id=eos)
    assert got.tokens == want.row(0) and got.num_accepted == int(want.num_accepted[0])


# ---------------------------------------------------------------------------------------------- validation


def _valid(n: int = 4, v: int = 3) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = gen(5)
    parents = ids([-1, 0, 0, 1][:n])
    q = random_probs(g, (n, v), dtype=torch.float32)  # [N, V]
    p = random_probs(g, (n, v), dtype=torch.float32)  # [N, V]
    return draft_tree(g, parents, q), parents, p, q


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        (ids([[0, 1]]), ids([-1, 0]), "tokens must have shape [N]"),
        (ids([]), ids([]), "tokens must have shape [N] with N >= 1"),
        (torch.tensor([0.0, 1.0]), ids([-1, 0]), "tokens must be an integer tensor"),
        (ids([0, -2]), ids([-1, 0]), "tokens must be >= 0"),
        (ids([0, 1]), ids([-1, 0, 0]), "parents must be an integer tensor of shape [2]"),
        (ids([0, 1]), torch.tensor([-1.0, 0.0]), "parents must be an integer tensor of shape [2]"),
        (ids([0, 1]), ids([0, 0]), "parents[0] must be -1"),
        (ids([0, 1, 1]), ids([-1, 0, 2]), "parents[2] = 2: every node's parent must be an earlier node"),
        (ids([0, 1, 1]), ids([-1, 2, 0]), "parents[1] = 2"),
        (ids([0, 1, 1]), ids([-1, 0, -1]), "parents[2] = -1"),
    ],
)
def test_malformed_trees_raise_one_line_errors(tokens, parents, message):
    """Malformed trees (shapes, dtypes, a node before its parent, a second root, negative ids) raise one-line
    ValueErrors, from every tree verifier."""
    v = 2
    n = max(tokens.shape[0], 1)
    p = torch.full((n, v), 1 / v)
    calls = [
        lambda: tree_rejection_sample(tokens, parents, p=p, q=p, generator=gen()),
        lambda: tree_rejection_sample(tokens, parents, p=p, q=None, generator=gen()),
        lambda: tree_greedy_verify(tokens, parents, p=p),
        lambda: sample_tree_verdict(
            tokens, parents, lambda u, kids: sibling_rule(tokens[kids], p_u=p[u]), gen()
        ),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            call()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "which, value, message",
    [
        ("p", NAN, "p has NaN or Inf at node 2"),
        ("p", float("inf"), "p has NaN or Inf at node 2"),
        ("p", -0.25, "p has a negative probability at node 2"),
        ("p", 0.9, "p does not sum to 1 at node 2"),
        ("q", NAN, "q has NaN or Inf at node 2"),
        ("q", -0.25, "q has a negative probability at node 2"),
        ("q", 0.9, "q does not sum to 1 at node 2"),
    ],
)
def test_bad_probabilities_name_the_node(which, value, message):
    """NaN, ±Inf, negative entries and rows not summing to 1 raise ValueError naming the tensor and node."""
    tokens, parents, p, q = _valid()
    (q if which == "q" else p)[2, 1] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        tree_rejection_sample(tokens, parents, p=p, q=q, generator=gen())


def test_q_root_row_is_not_read():
    """q[0] (the root's row) is never used: anything there is accepted."""
    tokens, parents, p, q = _valid()
    q[0] = NAN
    check_tree_verdict(
        tree_rejection_sample(tokens, parents, p=p, q=q, generator=gen()), tokens, parents, 3, set()
    )


@pytest.mark.parametrize(
    "p, q, message",
    [
        (torch.full((3, 3), 1 / 3), None, "p must have shape [4, V]"),
        (torch.full((4,), 1 / 4), None, "p must have shape [4, V]"),
        (torch.zeros(4, 0), None, "p must have shape [4, V]"),
        (torch.ones(4, 3, dtype=torch.long), None, "p must be a floating-point tensor"),
        (None, torch.full((5, 3), 1 / 3), "q must have shape [4, V]"),
        (None, torch.ones(4, 3, dtype=torch.long), "q must be a floating-point tensor"),
        (None, torch.full((4, 1), 1.0), "a draft token id is outside the draft vocabulary of size 1"),
    ],
)
def test_bad_shapes_raise_value_error(p, q, message):
    """Wrong shapes, integer distributions and draft ids outside q's vocabulary raise ValueError."""
    tokens, parents, p0, q0 = _valid()
    tokens = torch.where(torch.arange(4) > 0, 2, tokens)  # draft ids 2: outside a 1-token draft vocabulary
    with pytest.raises(ValueError, match=re.escape(message)):
        tree_rejection_sample(
            tokens, parents, p=p0 if p is None else p, q=q0 if q is None else q, generator=gen()
        )


def test_greedy_validation():
    """Greedy: NaN is named by node, a wrong number of rows is refused; ±inf logits are valid."""
    tokens, parents, p, _ = _valid()
    for column in (0, -1):  # before and after the row's maximum: found either way, the first node named
        bad = p.clone()
        bad[3, column] = NAN
        with pytest.raises(ValueError, match=re.escape("p has NaN at node 3")):
            tree_greedy_verify(tokens, parents, p=bad)
        bad[1, column] = NAN
        with pytest.raises(ValueError, match=re.escape("p has NaN at node 1")):
            tree_greedy_verify(tokens, parents, p=bad.float())
    with pytest.raises(ValueError, match=re.escape("p must have shape [4, V]")):
        tree_greedy_verify(tokens, parents, p=p[:3])
    logits = t64([[float("-inf"), 1.0, float("inf")]] * 4)
    assert tree_greedy_verify(ids([0, 2, 0, 0]), parents, p=logits).tokens[:2] == [2, 2]


@pytest.mark.parametrize(
    "p_u, xs, q, message",
    [
        (t64([0.5, 0.5]), ids([[0]]), None, "child_tokens must have shape"),
        (t64([[0.5, 0.5]]), ids([0]), None, "child_tokens must have shape"),
        (t64([]), ids([]), None, "p_u must have shape [..., V] with V >= 1"),
        (t64([0.5, 0.5]), ids([-1]), None, "child_tokens must be >= 0"),
        (t64([0.5, 0.5]), torch.tensor([0.0]), None, "child_tokens must be an integer tensor"),
        (t64([0.5, NAN]), ids([0]), None, "p_u has NaN or Inf at row 0"),
        (t64([0.5, 0.5]), ids([0, 1]), t64([[0.5, 0.5]]), "q_children must have shape"),
        (t64([0.5, 0.5]), ids([1]), t64([[1.0]]), "outside the draft vocabulary of size 1"),
        (t64([0.5, 0.5]), ids([0]), t64([[0.5, 0.4]]), "q_children does not sum to 1 at row 0"),
    ],
)
def test_sibling_rule_validation(p_u, xs, q, message):
    """sibling_rule refuses inconsistent shapes, bad ids and bad distributions with one-line messages."""
    with pytest.raises(ValueError, match=re.escape(message)):
        sibling_rule(xs, p_u=p_u, q_children=q)


def test_greedy_sibling_rule_validation():
    with pytest.raises(ValueError, match="need scores_u"):
        greedy_sibling_rule(t64([1.0, 2.0]), ids([[0]]))
    with pytest.raises(ValueError, match="scores_u has NaN"):
        greedy_sibling_rule(t64([1.0, NAN]), ids([0]))


# ---------------------------------------------------------------------------------------- dtype, determinism


def test_dtype_float32_default_and_float64_on_request():
    """The rule's arithmetic is float32 by default and float64 when asked, on float32 inputs too."""
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([[0.25, 0.75]])
    assert sibling_rule(ids([0]), p_u=p, q_children=q).accept_prob.dtype == torch.float32
    rule = sibling_rule(ids([0]), p_u=p, q_children=q, dtype=F64)
    assert rule.accept_prob.dtype == F64 and rule.residuals.dtype == F64
    assert greedy_sibling_rule(p, ids([0])).accept_prob.dtype == F64


def test_same_seed_same_verdict_different_seeds_differ():
    """The generator is the only randomness: equal seeds give equal verdicts whatever the global generator
    does; different seeds differ on some of 50 trees."""
    g = gen(13)
    trees = []
    for _ in range(50):
        parents = random_tree(g, 7)
        q, p = random_probs(g, (7, 5)), random_probs(g, (7, 5))
        trees.append((draft_tree(g, parents, q), parents, p, q))

    def run(seed: int) -> list[TreeVerdict]:
        torch.manual_seed(seed + 1000)  # perturb the global generator: it must not matter
        out = []
        generator = gen(seed)
        for tokens, parents, p, q in trees:
            out.append(tree_rejection_sample(tokens, parents, p=p, q=q, generator=generator))
        return out

    assert run(1) == run(1)
    assert run(1) != run(2)


# ---------------------------------------------------------------------------------------------- properties


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 10),
    vp=st.integers(1, 6),
    dv=st.integers(-2, 2),
    zero_frac=st.sampled_from([0.0, 0.5, 0.8]),
    eos=st.none() | st.integers(0, 5),
    dtype=st.sampled_from([torch.float32, F64]),
    guesses=st.booleans(),
)
def test_tree_verdict_invariants(seed, n, vp, dv, zero_frac, eos, dtype, guesses):
    """Random trees, distributions and drafts (sampled from q, or any guesses): every verdict walks a path
    from the root, emits that path's tokens and then (unless it accepted EOS) one token the target can emit
    there — in the last residual's support, which lies in p's — and the same seed repeats it. Greedy
    verdicts hold the same invariants, and their emitted tokens are the argmax along the path."""
    g = gen(seed)
    parents = random_tree(g, n)
    vq = max(1, vp + dv)
    p = random_probs(g, (n, vp), zero_frac, dtype=dtype)  # [N, Vp]
    q = random_probs(g, (n, vq), zero_frac, dtype=dtype)  # [N, Vq]
    tokens = torch.randint(vp + 2, (n,), generator=g) if guesses else draft_tree(g, parents, q)
    qq = None if guesses else q
    eos_set = set() if eos is None else {eos}
    v = tree_rejection_sample(
        tokens, parents, p=p, q=qq, generator=gen(seed + 1), eos_token_id=eos, dtype=dtype
    )
    check_tree_verdict(v, tokens, parents, vp, eos_set)
    if len(v.tokens) > v.num_accepted:  # the last token was sampled at the node where the walk stopped
        stop = v.accepted_nodes[-1] if v.accepted_nodes else 0
        assert p[stop, v.tokens[-1]] > 0
    assert (
        tree_rejection_sample(
            tokens, parents, p=p, q=qq, generator=gen(seed + 1), eos_token_id=eos, dtype=dtype
        )
        == v
    )
    greedy = tree_greedy_verify(tokens, parents, p=p, eos_token_id=eos)
    check_tree_verdict(greedy, tokens, parents, vp, eos_set)
    path = [0, *greedy.accepted_nodes]
    assert greedy.tokens == [int(p[u].argmax()) for u in path][: len(greedy.tokens)]


def test_sample_tree_verdict_uses_the_given_rule():
    """sample_tree_verdict draws from whatever rule it is given: a rule that accepts every child walks down
    the first child in trial order to a leaf and emits the point mass of its residual."""

    def accept_all(u: int, kids: Tensor) -> SiblingRule:
        return SiblingRule(torch.ones(len(kids)), torch.eye(4)[[3] * (len(kids) + 1)])

    v = sample_tree_verdict(ids([0, 1, 2, 1]), ids([-1, 0, 1, 2]), accept_all, gen())
    assert v.accepted_nodes == [1, 2, 3] and v.tokens == [1, 2, 1, 3] and v.bonus


def test_sample_tree_verdict_rejects_a_rule_of_the_wrong_shape():
    """A rule that does not give one acceptance per child and one residual more is refused."""

    def wrong(u: int, kids: Tensor) -> SiblingRule:
        return SiblingRule(torch.ones(len(kids) + 1), torch.eye(4)[[3] * (len(kids) + 1)])

    with pytest.raises(ValueError, match=re.escape("the rule at node 0 must give accept_prob [m]")):
        sample_tree_verdict(ids([0, 1]), ids([-1, 0]), wrong, gen())


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 9), st.integers(2, 5), st.integers(0, 2**31 - 1), st.sampled_from([None, 0, [1, 2]]))
def test_greedy_verdict_is_the_greedy_rule_s_walk(n, vocab, seed, eos):
    """tree_greedy_verify walks in Python ints (every node's first argmax at once); its verdict is the walk
    of greedy_sibling_rule, the rule the enumeration proves, node by node (ties in p: the first argmax)."""
    g = gen(seed)
    parents = random_tree(g, n)
    tokens = torch.randint(0, vocab, (n,), generator=g)  # [N]: siblings may repeat tokens
    p = torch.randint(0, 3, (n, vocab), generator=g).to(F64)  # [N, V]: many ties
    ids_ = tokens.long()

    def rule(u: int, kids: Tensor) -> SiblingRule:
        return greedy_sibling_rule(p[u], ids_[kids])

    children = _tree_children(tokens, parents)
    walked = _walk(tokens.tolist(), children, rule, [0.0] * n, lambda point: int(point.argmax()),
                   _eos_set(eos), tokens.device)  # fmt: skip
    assert tree_greedy_verify(tokens, parents, p=p, eos_token_id=eos) == walked
