"""Exact enumeration of constrained speculative decoding: the output is distributed exactly as constrained
sampling without speculation (TV ≤ 1e-12), for every verifier, K and sampling setting, and broken variants are
caught.

Toy grammars over the toy vocabulary of :func:`toy.make_pair` ("eos": V = 4, token 3 the end of sequence),
each a pure function from the prefix to the allowed set (:class:`ToyGrammar`, a
:class:`~verispec.grammar.rounds.GrammarState`): one that forces tokens (and the end), one that allows the end
only after an even number of tokens, one whose allowed set depends on the whole prefix. A round runs the
engine's own steps (:mod:`verispec.grammar.rounds`: the forced run, the draft's masks, the proposal with the
forced tokens first, the masked logits, the commit with a finished grammar's end) with the real rules of
:mod:`verispec.verify.chain` in float64, every draft and every accept/reject branch enumerated. The reference
walks constrained ancestral sampling: each token from ``probs_from_logits`` of the logits with −inf outside
the allowed set, masked here in numpy apart from the code under test.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from torch import Tensor

from toy import SETTINGS, make_pair, single_threaded
from verispec.drafting.base import Proposal, allowed_guesses, allowed_logits
from verispec.errors import UsageError
from verispec.grammar.rounds import GrammarState, chain_masks, constrain, finish, forced_run, with_forced
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits
from verispec.verify.chain import greedy_rule, rejection_rule, single_guess_rule

EXACT_TV = 1e-12
BROKEN_TV = 1e-3
N = 4  # tokens of output enumerated
PAIR = make_pair("eos")
V, EOS = PAIR.vocab, 3
ALL = frozenset(range(V))
DEAD = (-1,)  # where a broken variant's grammar state allows no token

Grammar = Callable[[tuple[int, ...]], frozenset[int]]
Emitted = tuple[tuple[int, ...], tuple[int, ...]]  # a round's committed tokens, the grammar's after it


def forcing(prefix: tuple[int, ...]) -> frozenset[int]:
    """0 forces 1, then 1 forces 2; the end forced after three tokens."""
    if prefix[-1:] == (0,):
        return frozenset({1})
    if prefix[-2:] == (0, 1):
        return frozenset({2})
    return frozenset({EOS}) if len(prefix) == 3 else ALL


def even_end(prefix: tuple[int, ...]) -> frozenset[int]:
    """The end only after an even number of tokens."""
    return ALL if len(prefix) % 2 == 0 else ALL - {EOS}


def by_prefix(prefix: tuple[int, ...]) -> frozenset[int]:
    """An allowed set that depends on the sum of the whole prefix."""
    return (frozenset({0, 1, EOS}), frozenset({1, 2}), frozenset({0, 2, EOS}))[sum(prefix) % 3]


GRAMMARS: dict[str, Grammar] = {"forcing": forcing, "even_end": even_end, "by_prefix": by_prefix}


class ToyGrammar:
    """A :class:`GrammarState` over ``grammar``; ``off_by_one`` (BROKEN): ``settle`` keeps the tentative
    path's tokens instead of the committed ones (a rollback one token short: a rejected draft token kept
    in place of the recovered one)."""

    def __init__(self, grammar: Grammar, committed: tuple[int, ...], off_by_one: bool = False) -> None:
        self.grammar, self.committed, self.off_by_one = grammar, committed, off_by_one
        self.vocab_size = V
        self.tentative: tuple[int, ...] = ()

    def mask_after(self, path: Sequence[int]) -> Tensor | None:
        prefix = self.committed
        for token in path:
            if EOS in prefix or token not in self.grammar(prefix):
                return None
            prefix += (token,)
        self.tentative = tuple(path)
        allowed = frozenset() if EOS in prefix else self.grammar(prefix)
        return torch.tensor([t in allowed for t in range(V)])  # [V]

    def settle(self, tokens: Sequence[int]) -> None:
        kept = (
            self.tentative[: len(tokens)]
            if self.off_by_one and len(self.tentative) >= len(tokens)
            else tokens
        )
        self.committed += tuple(kept)
        self.tentative = ()

    @property
    def finished(self) -> bool:
        return self.grammar(self.committed) == {EOS}


assert isinstance(ToyGrammar(forcing, ()), GrammarState)

RULES = {
    "rejection": lambda x, q, p: rejection_rule(x, q=q, p=p, dtype=torch.float64),
    "single_guess": lambda x, q, p: single_guess_rule(x, p=p, dtype=torch.float64),
    "greedy": lambda x, q, p: greedy_rule(x, p=p),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


def _logits(table: np.ndarray, prefix: Sequence[int]) -> Tensor:
    """[V] float64: an order-2 toy model's logits after ``prefix`` (V stands for before the start)."""
    a = prefix[-2] if len(prefix) >= 2 else V
    b = prefix[-1] if len(prefix) >= 1 else V
    return torch.from_numpy(table[a, b])


def reference(grammar: Grammar, setting: str) -> dict[tuple[int, ...], float]:
    """Constrained sampling without speculation: the probability of each output of N tokens (cut after the
    end of sequence)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == N or EOS in prefix:
            out[prefix] = out.get(prefix, 0.0) + prob
            return
        logits = PAIR.target.logits[prefix[-2] if len(prefix) > 1 else V, prefix[-1] if prefix else V].copy()
        logits[[t not in grammar(prefix) for t in range(V)]] = -np.inf
        p = probs_from_logits(torch.from_numpy(logits), SETTINGS[setting]).numpy()
        for token in range(V):
            if p[token] > 0:
                walk(prefix + (token,), prob * p[token])

    walk((), 1.0)
    return out


def toy_draft(
    state: ToyGrammar,
    forced: list[int],
    prefix: tuple[int, ...],
    draft: tuple[int, ...],
    params: SamplingParams,
    mask_q: bool,
    cut: bool,
    broken: str,
) -> tuple[Proposal, float]:
    """A toy drafter's proposal after the ``forced`` tokens, and its probability, for the draws ``draft``
    [kd], given the grammar's mask at each draft position through the drafters' hook as the engine gives it
    (:data:`~verispec.drafting.base.Allowed`: ``state.mask_after(forced + path)``).

    ``mask_q``: a sampling drafter masking through the hook (:func:`allowed_logits`), which stops where
    the grammar allows nothing (one canonical draw, all 0, for the positions after); else unmasked. ``cut``:
    the draws as single guesses cut at the first the grammar forbids (:func:`allowed_guesses`). ``broken``:
    "q_state" (q told masked with the committed state at every position), "told_unmasked" (drawn from the
    masked q, the unmasked one told), "drawn_one_off" (drawn from q masked with the state one token behind,
    the right one told)."""

    def allowed(path: Sequence[int]) -> Tensor | None:
        return state.mask_after([*forced, *path])

    def behind(path: Sequence[int]) -> Tensor | None:
        return state.mask_after([*forced, *path][:-1])

    told: list[Tensor] = []  # [V] each
    weight, kept = 1.0, len(draft)
    for j, token in enumerate(draft):
        raw = _logits(PAIR.draft.logits, prefix + tuple(forced) + draft[:j])  # [V]
        masked = allowed_logits(raw, allowed, draft[:j]) if mask_q else raw
        if masked is None:  # the drafter stops here
            kept, weight = j, weight * all(t == 0 for t in draft[j:])
            break
        drawn = allowed_logits(raw, behind, draft[:j]) if broken == "drawn_one_off" else masked
        tell = {"q_state": constrain(raw, state.mask_after([])), "told_unmasked": raw}.get(broken, masked)
        weight *= 0.0 if drawn is None else float(probs_from_logits(drawn, params)[token])
        told.append(probs_from_logits(tell, params))
    if cut:
        return Proposal(torch.tensor(allowed_guesses(draft, allowed), dtype=torch.long), None), weight
    q = torch.stack(told[:kept]) if kept else None  # [kept, V]
    return Proposal(torch.tensor(draft[:kept], dtype=torch.long), q), weight


def speculative(
    grammar: Grammar,
    setting: str,
    verifier: str,
    k: int,
    mask_q: bool = False,
    broken: str = "",
    cut: bool = False,
) -> dict[tuple[int, ...], float]:
    """The exact output distribution of constrained speculative decoding with the engine's round steps.

    ``mask_q``, ``cut``: the toy drafter's (:func:`toy_draft`). ``broken``: the drafter's (:func:`toy_draft`),
    or "after_transform" (the mask applied to p after top-p and the rest, renormalised), "off_by_one"
    (rollback), "bonus" (the bonus token from the unconstrained p)."""
    params = SETTINGS[setting]
    out: dict[tuple[int, ...], float] = {}

    @functools.cache
    def outcomes(prefix: tuple[int, ...], committed: tuple[int, ...]) -> tuple[tuple[Emitted, float], ...]:
        """(tokens the round commits, the grammar's committed tokens after it) → probability, from the
        output ``prefix`` and the grammar's ``committed`` tokens (the same unless broken)."""
        room = N - len(prefix)
        state = ToyGrammar(grammar, committed)
        forced = forced_run(state, room - 1)
        kd = min(k, room - 1 - len(forced))
        result: dict[Emitted, float] = {}
        for draft in itertools.product(range(V), repeat=kd):
            proposal, weight = with_forced(forced, Proposal.empty()), 1.0
            if kd:
                own, weight = toy_draft(state, forced, prefix, draft, params, mask_q, cut, broken)
                proposal = with_forced(forced, own)
            if weight == 0:
                continue
            tokens = proposal.tokens.tolist()
            masks = chain_masks(state, tokens)  # [T + 1, V]
            contexts = [prefix + tuple(tokens[:i]) for i in range(len(tokens) + 1)]
            logits = torch.stack([_logits(PAIR.target.logits, c) for c in contexts])  # [T + 1, V]
            if broken == "after_transform":
                p = probs_from_logits(logits, params) * masks
                p = torch.where(p.sum(-1, keepdim=True) > 0, p, masks.double())
                p = p / p.sum(-1, keepdim=True)
            else:
                p = probs_from_logits(constrain(logits, masks), params)  # [T + 1, V]
            x = proposal.tokens.unsqueeze(0)  # [1, T]
            q = None if proposal.q is None else proposal.q.unsqueeze(0)  # [1, T, V]
            rule = RULES[verifier if q is not None or verifier == "greedy" else "single_guess"](x, q, p[None])
            accept = rule.accept_prob[0].double()  # [T]
            fallback = rule.fallback[0].double().clone()  # [T + 1, V]
            if broken == "bonus":
                fallback[-1] = probs_from_logits(logits[-1], params)
            reach = torch.cat([torch.ones(1, dtype=torch.float64), accept.cumprod(0)])  # [T + 1]
            stop = torch.cat([1 - accept, torch.ones(1, dtype=torch.float64)])  # [T + 1]
            for s in range(len(tokens) + 1):
                for y in range(V):
                    pr = weight * float(reach[s] * stop[s] * fallback[s, y])
                    if pr == 0:
                        continue
                    stream = [*tokens[:s], y]
                    if EOS in stream:
                        stream = stream[: stream.index(EOS) + 1]
                    settled = ToyGrammar(grammar, committed, off_by_one=broken == "off_by_one")
                    chain_masks(settled, tokens)  # the tentative path the round left
                    emitted = tuple(finish(settled, stream[:room], room, {EOS}))
                    key = (emitted, settled.committed)
                    result[key] = result.get(key, 0.0) + pr
        return tuple(result.items())

    def walk(prefix: tuple[int, ...], committed: tuple[int, ...], prob: float) -> None:
        if len(prefix) >= N or EOS in prefix:
            out[prefix[:N]] = out.get(prefix[:N], 0.0) + prob
            return
        try:
            rounds = outcomes(prefix, committed)
        except UsageError:  # a broken state's dead end: its mass lands on no output
            out[DEAD] = out.get(DEAD, 0.0) + prob
            return
        for (emitted, after), pr in rounds:
            walk(prefix + emitted, after, prob * pr)

    walk((), (), 1.0)
    return out


def tv(a: dict[tuple[int, ...], float], b: dict[tuple[int, ...], float]) -> float:
    return 0.5 * sum(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


CASES = [("rejection", s) for s in ("t1", "topp0.8", "combo")] + [
    ("single_guess", "t0.7"),
    ("greedy", "greedy"),
]


@pytest.mark.parametrize("grammar", GRAMMARS)
@pytest.mark.parametrize(("verifier", "setting"), CASES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_constrained_speculation_is_exact(grammar: str, verifier: str, setting: str, k: int) -> None:
    """TV ≤ 1e-12 against constrained sampling without speculation, with q unmasked and masked."""
    expected = reference(GRAMMARS[grammar], setting)
    assert abs(sum(expected.values()) - 1) < 1e-12
    for mask_q in (False, True):
        got = speculative(GRAMMARS[grammar], setting, verifier, k, mask_q=mask_q)
        assert tv(got, expected) <= EXACT_TV, (mask_q, tv(got, expected))


def test_grammars_do_what_they_say() -> None:
    """The reference respects each grammar (no output leaves it), the forcing grammar's forced runs are
    drafted, and its end comes without a round."""
    for name, grammar in GRAMMARS.items():
        for output in reference(grammar, "t1"):
            assert all(t in grammar(output[:i]) for i, t in enumerate(output)), (name, output)
    state = ToyGrammar(forcing, (2, 0))
    assert forced_run(state, 5) == [1, 2]  # 0 forces 1, which forces 2 (then three tokens: the end is)
    state = ToyGrammar(forcing, (2, 2, 2))
    assert forced_run(state, 5) == [EOS] and finish(state, [], 2, {EOS}) == [EOS]


@pytest.mark.parametrize(
    ("broken", "verifier", "setting", "mask_q"),
    [
        ("q_state", "rejection", "t1", True),
        ("after_transform", "rejection", "topp0.8", False),
        ("after_transform", "single_guess", "combo", False),
        ("off_by_one", "rejection", "t1", False),
        ("bonus", "rejection", "t1", False),
    ],
)
def test_broken_variants_are_caught(broken: str, verifier: str, setting: str, mask_q: bool) -> None:
    """Each broken variant is off by far more than round-off under at least one grammar."""
    worst = max(
        tv(speculative(g, setting, verifier, 2, mask_q=mask_q, broken=broken), reference(g, setting))
        for g in GRAMMARS.values()
    )
    assert worst > BROKEN_TV, worst


@pytest.mark.parametrize("grammar", GRAMMARS)
@pytest.mark.parametrize("k", [1, 3])
def test_drafters_masking_through_the_hook_are_exact(grammar: str, k: int) -> None:
    """A drafter of single guesses cut at the first the grammar forbids (through the hook): TV ≤ 1e-12
    (a sampling drafter masking through the hook: test_constrained_speculation_is_exact, mask_q)."""
    expected = reference(GRAMMARS[grammar], "t0.7")
    got = speculative(GRAMMARS[grammar], "t0.7", "single_guess", k, cut=True)
    assert tv(got, expected) <= EXACT_TV, tv(got, expected)


@pytest.mark.parametrize("broken", ["told_unmasked", "drawn_one_off"])
def test_broken_hook_drafters_are_caught(broken: str) -> None:
    """A drafter that samples from the masked q but tells the unmasked one, or draws from q masked with the
    state one token behind: off by far more than round-off under at least one grammar."""
    worst = max(
        tv(speculative(g, "t1", "rejection", 2, mask_q=True, broken=broken), reference(g, "t1"))
        for g in GRAMMARS.values()
    )
    assert worst > BROKEN_TV, worst
