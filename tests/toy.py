"""Toy language models and a batched speculative loop, shared by the losslessness tests.

Nothing in this module is a test. It provides:

- :class:`ToyLM`: an order-2 table-driven language model. Its logits are a float64 table of shape
  [V+1, V+1, V] indexed by (second-last token, last token), where the index V stands for "before the start"
  (BOS). Every context row can be gathered at once, so a batch of rows with different contexts needs no
  Python loop.
- :func:`make_pair`: families of (target, draft) pairs built from seeded numpy generators, chosen to hit the
  corners of the verifiers: generic, disjoint supports, p = q, point-mass q, tiny probabilities, EOS.
- :data:`SETTINGS`: the sampling settings the tests sweep. Distributions are always made with the real
  :func:`verispec.sampling.probs_from_logits`, applied identically to target and draft.
- :func:`target_joint`: the reference, the target's own joint distribution of its first n tokens, computed by
  walking the target's ancestral sampling tree (independently of any speculative code).
- :func:`speculative_loop` / :func:`draft_round`: the real speculative loop in torch, for statistical tests.
- Deliberately broken verifier variants, which the tests must catch.

Output sequences of n tokens use the marker END = V for "the sequence already ended with EOS".
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits
from verispec.verify.chain import (
    Rule,
    Verdict,
    greedy_verify,
    rejection_rule,
    rejection_sample,
    sample_verdict,
    single_guess_sample,
)

NEG_INF = float("-inf")

#: The sampling settings every exactness check sweeps (ids are used in test names).
SETTINGS: dict[str, SamplingParams] = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "topk2": SamplingParams(top_k=2),
    "topp0.8": SamplingParams(top_p=0.8),
    "minp0.2": SamplingParams(min_p=0.2),
    "combo": SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05),
    "greedy": SamplingParams(temperature=0.0),
}
GREEDY = SETTINGS["greedy"]


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Runs torch on one intra-op thread, restoring the setting after. The toy tensors are small and the test
    machines are shared: with two or more OpenMP threads, the loops below ran 10-20x slower under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ToyLM:
    """An order-2 table-driven language model over V tokens; context index V means BOS."""

    logits: np.ndarray  # [V+1, V+1, V] float64, logits[second-last or BOS, last or BOS]

    @property
    def vocab(self) -> int:
        return self.logits.shape[-1]

    def probs(self, params: SamplingParams, dtype: torch.dtype = torch.float64) -> Tensor:
        """[V+1, V+1, V]: the real sampling transform applied to every context row, in ``dtype``."""
        return probs_from_logits(torch.tensor(self.logits, dtype=dtype), params)


@dataclass(frozen=True)
class ToyPair:
    """A target and a draft over the same vocabulary; ``num_tokens`` is the N the enumeration checks."""

    name: str
    target: ToyLM
    draft: ToyLM
    num_tokens: int
    eos_token_id: int | None = None

    @property
    def vocab(self) -> int:
        return self.target.vocab


def reachable_contexts(vocab: int) -> list[tuple[int, int]]:
    """Every (second-last, last) context a generation from an empty prompt can reach; BOS = vocab."""
    bos = vocab
    return [(bos, bos)] + [(bos, a) for a in range(vocab)] + list(itertools.product(range(vocab), repeat=2))


def _generic(vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A target with strongly context-dependent logits and a draft correlated with it but different."""
    rng = np.random.default_rng(seed)
    shape = (vocab + 1, vocab + 1, vocab)
    target = rng.normal(0.0, 1.2, size=shape)
    draft = 0.6 * target + rng.normal(0.0, 1.0, size=shape)
    return target, draft


def make_pair(family: str) -> ToyPair:
    """The (target, draft) pair of one family; every family is fixed by its own seed."""
    if family == "generic":
        target, draft = _generic(4, seed=11)
        return ToyPair(family, ToyLM(target), ToyLM(draft), num_tokens=4)
    if family == "disjoint":
        # In every context with (a + b) even, the target's support is {0, 1, 2} and the draft's {3, 4, 5}:
        # every draft token there is rejected and every emitted token there is recovered.
        vocab = 6
        target, draft = _generic(vocab, seed=12)
        for a, b in itertools.product(range(vocab + 1), repeat=2):
            if (a + b) % 2 == 0:
                target[a, b, 3:] = NEG_INF
                draft[a, b, :3] = NEG_INF
        return ToyPair(family, ToyLM(target), ToyLM(draft), num_tokens=3)
    if family == "equal":
        target, _ = _generic(3, seed=13)
        return ToyPair(family, ToyLM(target), ToyLM(target.copy()), num_tokens=5)
    if family == "onehot":
        # q is a point mass in every context (all logits -inf but one); p also forbids some tokens, so that
        # the guess sometimes has p = 0.
        vocab = 4
        rng = np.random.default_rng(14)
        target, draft = _generic(vocab, seed=14)
        guess = rng.integers(0, vocab, size=(vocab + 1, vocab + 1))
        mask = np.arange(vocab) != guess[..., None]  # [V+1, V+1, V]
        draft[mask] = NEG_INF
        forbid = rng.random(target.shape) < 0.25
        forbid[..., 0] = False  # keep every target row non-empty
        target[forbid] = NEG_INF
        return ToyPair(family, ToyLM(target), ToyLM(draft), num_tokens=4)
    if family == "tiny":
        # Entries of probability ~1e-12 .. 1e-30 in p, in q, or in both (at temperature 1).
        vocab = 3
        rng = np.random.default_rng(15)
        target, draft = _generic(vocab, seed=15)
        for a, b in itertools.product(range(vocab + 1), repeat=2):
            where = rng.integers(0, 3)  # 0: p only, 1: q only, 2: both (same token)
            tok_p, tok_q = rng.integers(0, vocab, size=2)
            if where == 2:
                tok_q = tok_p
            if where in (0, 2):
                target[a, b, tok_p] = target[a, b].max() - rng.uniform(27.6, 69.0)
            if where in (1, 2):
                draft[a, b, tok_q] = draft[a, b].max() - rng.uniform(27.6, 69.0)
        return ToyPair(family, ToyLM(target), ToyLM(draft), num_tokens=5)
    if family == "eos":
        # Token 3 is EOS, likely in both models, so that accepted, recovered and bonus EOS all happen.
        target, draft = _generic(4, seed=16)
        target[..., 3] += 1.0
        draft[..., 3] += 1.5
        return ToyPair(family, ToyLM(target), ToyLM(draft), num_tokens=4, eos_token_id=3)
    raise ValueError(f"unknown family {family!r}")


FAMILIES = ("generic", "disjoint", "equal", "onehot", "tiny", "eos")


# ---------------------------------------------------------------------------------------------- reference


def target_joint(ptab: np.ndarray, n: int, eos: int | None = None) -> np.ndarray:
    """The target's own joint distribution of its first n tokens from an empty prompt.

    ptab: [V+1, V+1, V] float64 next-token distributions per (second-last, last) context, BOS = V.
    Returns [V+1] * n (as an n-dimensional array): index V (END) pads a sequence after its EOS.
    Computed by walking the ancestral sampling tree token by token: no speculative code is involved.
    """
    vocab = ptab.shape[-1]
    out = np.zeros((vocab + 1,) * n)

    def walk(prefix: tuple[int, ...], ctx: tuple[int, int], prob: float) -> None:
        if len(prefix) == n:
            out[prefix] += prob
            return
        for tok in range(vocab):
            pr = prob * ptab[ctx][tok]
            if pr == 0:
                continue
            if tok == eos:
                out[prefix + (tok,) + (vocab,) * (n - len(prefix) - 1)] += pr
            else:
                walk(prefix + (tok,), (ctx[1], tok), pr)

    walk((), (vocab, vocab), 1.0)
    return out


def accepted_prefix_probs(
    ctx: tuple[int, int], k: int, qtab: np.ndarray, ptab: np.ndarray, verifier: str
) -> list[float]:
    """[A_1, .., A_K]: A_j = P(the first j draft tokens of a round from ``ctx`` are all accepted), from the
    closed forms, without the rule functions. The probability of drafting x and accepting it given an
    accepted prefix is min(p(x), q(x)) for rejection sampling, q(x) p(x) for single guesses drawn from q and
    q(x) [x = argmax p] for greedy; A_j sums the products of those weights over all prefixes x_1..x_j.

    qtab, ptab: [V+1, V+1, V] float64 draft and target tables (BOS = V).
    """
    vocab = ptab.shape[-1]
    if verifier == "rejection":
        weight = np.minimum(ptab, qtab)  # [V+1, V+1, V]
    elif verifier == "single_guess":
        weight = ptab * qtab
    elif verifier == "greedy":
        weight = qtab * (np.arange(vocab) == ptab.argmax(axis=-1)[..., None])
    else:
        raise ValueError(verifier)
    frontier = np.zeros((vocab + 1, vocab + 1))  # [V+1, V+1]: mass of the accepted prefixes by context
    frontier[ctx] = 1.0
    out = []
    for _ in range(k):
        nxt = np.zeros_like(frontier)
        nxt[:, :vocab] = np.einsum("ab,abx->bx", frontier, weight)  # context (a, b) → (b, x)
        out.append(float(nxt.sum()))
        frontier = nxt
    return out


# ---------------------------------------------------------------------------------------------- torch loop

#: (draft_tokens [B, K], q [B, K, V], p [B, K+1, V], generator, eos_token_id) -> Verdict
Verifier = Callable[[Tensor, Tensor, Tensor, torch.Generator, "int | None"], Verdict]


def rejection_verifier(x: Tensor, q: Tensor, p: Tensor, g: torch.Generator, eos: int | None) -> Verdict:
    return rejection_sample(x, q=q, p=p, generator=g, eos_token_id=eos)


def single_guess_verifier(x: Tensor, q: Tensor, p: Tensor, g: torch.Generator, eos: int | None) -> Verdict:
    # the guesses' probabilities are not used
    return single_guess_sample(x, p=p, generator=g, eos_token_id=eos)


def greedy_verifier(x: Tensor, q: Tensor, p: Tensor, g: torch.Generator, eos: int | None) -> Verdict:
    return greedy_verify(x, p=p, eos_token_id=eos)


VERIFIERS: dict[str, Verifier] = {
    "rejection": rejection_verifier,
    "single_guess": single_guess_verifier,
    "greedy": greedy_verifier,
}


def draft_round(
    ctx: Tensor, k: int, qdraw: Tensor, qtold: Tensor, ptab: Tensor, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """Drafts k tokens per row autoregressively from ``qdraw`` and gathers what the verifier is given.

    ctx: [B, 2] int64 (second-last, last) per row. qdraw, qtold, ptab: [V+1, V+1, V] tables: the draft's
    sampling distribution, the draft distribution reported to the verifier (equal unless testing a bug), and
    the target's distribution.
    Returns draft_tokens [B, K], q [B, K, V] (from qtold), p [B, K+1, V].
    """
    c2, c1 = ctx[:, 0], ctx[:, 1]
    tokens, qs, ps = [], [], []
    for _ in range(k):
        x = torch.multinomial(qdraw[c2, c1], 1, generator=generator).squeeze(1)  # [B]
        tokens.append(x)
        qs.append(qtold[c2, c1])
        ps.append(ptab[c2, c1])
        c2, c1 = c1, x
    ps.append(ptab[c2, c1])
    b, vocab = ctx.shape[0], ptab.shape[-1]
    draft = torch.stack(tokens, dim=1) if k else torch.zeros(b, 0, dtype=torch.int64)
    q = torch.stack(qs, dim=1) if k else ptab.new_zeros(b, 0, vocab)
    return draft, q, torch.stack(ps, dim=1)


def speculative_loop(
    qdraw: Tensor,
    qtold: Tensor,
    ptab: Tensor,
    k: int,
    n_tokens: int,
    rows: int,
    verify: Verifier,
    generator: torch.Generator,
    eos: int | None = None,
) -> Tensor:
    """Runs ``rows`` independent generations from an empty prompt with the speculative loop (draft k tokens,
    verify, commit the emitted tokens, repeat) until each row has ``n_tokens`` tokens or has emitted EOS.

    Returns [rows, n_tokens] int64: the first n_tokens emitted tokens of each row, END (= V) after an EOS.
    """
    vocab = ptab.shape[-1]
    out = torch.full((rows, n_tokens), vocab, dtype=torch.int64)  # [B, n]
    filled = torch.zeros(rows, dtype=torch.int64)  # [B]
    done = torch.zeros(rows, dtype=torch.bool)  # [B]
    ctx = torch.full((rows, 2), vocab, dtype=torch.int64)  # [B, 2] (second-last, last), BOS = V
    for _ in range(n_tokens + 1):  # every round emits at least one token
        active = (~done).nonzero().squeeze(1)  # [A]
        if active.numel() == 0:
            return out
        draft, q, p = draft_round(ctx[active], k, qdraw, qtold, ptab, generator)
        verdict = verify(draft, q, p, generator, eos)
        tokens, count = verdict.tokens, verdict.num_tokens  # [A, K+1], [A]
        assert bool((count >= 1).all()), "a round emitted no token"
        for i in range(tokens.shape[1]):
            pos = filled[active] + i
            keep = (i < count) & (pos < n_tokens)
            out[active[keep], pos[keep]] = tokens[keep, i]
        ended = (tokens == eos).any(dim=1) if eos is not None else torch.zeros(len(active), dtype=torch.bool)
        filled[active] += count
        done[active] = ended | (filled[active] >= n_tokens)
        full = torch.cat([ctx[active], tokens], dim=1)  # [A, K+3]: the context, then the emitted tokens
        last_two = torch.stack([count, count + 1], dim=1)  # [A, 2]: positions of the last two tokens in full
        ctx[active] = full.gather(1, last_two)
    raise AssertionError("the speculative loop did not finish")


# ---------------------------------------------------------------------------------------------- broken


def recovered_from_p(rule: Rule, p: Tensor) -> Rule:
    """BROKEN (a): the recovered token is resampled from p_t instead of the residual max(p_t − q_t, 0)."""
    k = rule.accept_prob.shape[1]
    fallback = rule.fallback.clone()  # [B, K+1, V]
    fallback[:, :k] = p[:, :k].to(fallback.dtype)
    return dataclasses.replace(rule, fallback=fallback)


def bonus_from_last_position(rule: Rule, p: Tensor) -> Rule:
    """BROKEN (b): the bonus token is sampled from p_K (the last draft position) instead of p_{K+1}."""
    k = rule.accept_prob.shape[1]
    fallback = rule.fallback.clone()  # [B, K+1, V]
    fallback[:, k] = p[:, k - 1].to(fallback.dtype)
    return dataclasses.replace(rule, fallback=fallback)


def broken_rejection(breakage: Callable[[Rule, Tensor], Rule]) -> Verifier:
    """A rejection-sampling verifier whose rule is altered by ``breakage`` before sampling the verdict."""

    def verify(x: Tensor, q: Tensor, p: Tensor, g: torch.Generator, eos: int | None) -> Verdict:
        return sample_verdict(breakage(rejection_rule(x, q=q, p=p), p), x, g, eos_token_id=eos)

    return verify


def without_bonus(verify: Verifier) -> Verifier:
    """BROKEN (c): when every draft token is accepted, the round emits nothing after them (no bonus token)."""

    def broken(x: Tensor, q: Tensor, p: Tensor, g: torch.Generator, eos: int | None) -> Verdict:
        verdict = verify(x, q, p, g, eos)
        num_tokens = verdict.num_tokens - verdict.bonus.long()  # [B]
        cols = torch.arange(verdict.tokens.shape[1])
        tokens = torch.where(cols < num_tokens.unsqueeze(1), verdict.tokens, -1)  # [B, K+1]
        return dataclasses.replace(verdict, tokens=tokens, num_tokens=num_tokens)

    return broken
