"""Verifiers: pure functions that decide which drafted tokens the target keeps.

Vocabulary (used everywhere in verispec):

- p is the target's distribution, q the draft's; both are already transformed by
  :func:`verispec.sampling.probs_from_logits` with the same parameters.
- A round drafts K tokens x_1..x_K. The target scores them in one pass, giving p_1..p_{K+1}, where p_t is the
  target's distribution for the t-th position of the round (p_{K+1} follows the whole draft).
- **accepted** tokens: the longest prefix of the draft that the verifier keeps.
- **recovered** token: after the first rejected draft token x_t, one token sampled in its place from the
  verifier's fallback distribution at t (the residual normalize(max(p_t − q_t, 0)) for rejection sampling).
- **bonus** token: when all K draft tokens are accepted, one more token sampled from p_{K+1}.

Every round therefore emits num_accepted + 1 tokens, except when an accepted token is the end-of-sequence
token: nothing after it is kept, and the round emits num_accepted tokens ending with it.

A verifier is split in two, so that its mathematics can be checked exactly and its sampling statistically:

- a *rule* (:func:`rejection_rule`, :func:`single_guess_rule`, :func:`greedy_rule`) computes, in closed form,
  the probability of accepting each draft token given that all before it were accepted, and the fallback
  distribution of the token emitted when the round stops at each position (recovered at t ≤ K, bonus at K+1);
- :func:`sample_verdict` draws the verdict from a rule with an explicit generator.

The convenience functions :func:`rejection_sample`, :func:`single_guess_sample` and :func:`greedy_verify` do
both. All functions are batched over rows; each row may have its own draft length (``draft_lengths``) and ends
with its own number of accepted tokens. No model or cache is touched: tensors in, verdict out.

Vocabulary sizes: when p has Vp entries and q has Vq, both are padded with zeros to max(Vp, Vq). A draft token
the target does not have (id ≥ Vp) has p = 0 and is always rejected; a target token the draft does not have
(id ≥ Vq) has q = 0 and can only be recovered or bonus. Emitted tokens are therefore always < Vp.

Exactness: with rejection_rule, the emitted tokens are distributed exactly as tokens sampled one by one from
p (Leviathan et al. 2023, Chen et al. 2023), whatever q is, provided the draft tokens were sampled from the q
passed here. single_guess_rule is rejection_rule with q a point mass on each guess; greedy_rule is the
temperature-0 case, token-identical to the target's own greedy decoding; :func:`greedy_verify_targets` takes
its input as the target's argmax tokens, for rows whose scores come in lengths of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.errors import UsageError
from verispec.sampling import first_argmax, sample

__all__ = [
    "Rule",
    "Verdict",
    "greedy_rule",
    "greedy_targets",
    "greedy_verify",
    "greedy_verify_targets",
    "rejection_rule",
    "rejection_sample",
    "sample_verdict",
    "single_guess_rule",
    "single_guess_sample",
]

_PAD = -1
EosIds = int | Sequence[int] | None  # end-of-sequence token id(s); None: no end-of-sequence handling


@dataclass(frozen=True)
class Rule:
    """A verifier's decision rule for one round, in closed form."""

    accept_prob: Tensor  # [B, K] P(accept x_t | x_1..x_{t-1} accepted), in [0, 1]; 0 after a row's draft
    fallback: Tensor  # [B, K+1, V] recovered-token distribution at t <= n, bonus-token distribution at n+1
    num_drafted: Tensor  # [B] int64: draft length n of each row, 0..K


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verification round for each of B rows.

    tokens[b, :num_tokens[b]] are the tokens row b emits: its accepted draft tokens, then (unless an accepted
    token was end-of-sequence) one recovered or bonus token. Entries after num_tokens[b] are -1.
    """

    tokens: Tensor  # [B, K+1] int64: emitted tokens, -1 padded
    num_accepted: Tensor  # [B] int64: accepted draft tokens, 0..draft length
    num_tokens: Tensor  # [B] int64: emitted tokens, num_accepted + 1, or num_accepted after an accepted EOS
    num_drafted: Tensor  # [B] int64: draft length of each row

    @property
    def bonus(self) -> Tensor:  # [B] bool: the last emitted token is a bonus token
        return (self.num_accepted == self.num_drafted) & (self.num_tokens > self.num_accepted)

    @property
    def recovered(self) -> Tensor:  # [B] bool: the last emitted token is a recovered token
        return (self.num_accepted < self.num_drafted) & (self.num_tokens > self.num_accepted)

    def row(self, b: int) -> list[int]:
        """The tokens row b emits, as a list."""
        return self.tokens[b, : int(self.num_tokens[b])].tolist()


# ---------------------------------------------------------------------------------------------- validation


def _check_draft(draft_tokens: Tensor) -> tuple[int, int]:
    if draft_tokens.ndim != 2 or draft_tokens.dtype not in (torch.int32, torch.int64):
        raise UsageError(
            f"draft_tokens must be an integer tensor of shape [B, K], got {draft_tokens.dtype} "
            f"{tuple(draft_tokens.shape)}"
        )
    return draft_tokens.shape[0], draft_tokens.shape[1]


@dataclass(frozen=True)
class _Layout:
    """Which positions of a round are in use, per row."""

    lengths: Tensor  # [B] int64: draft length n of each row
    drafted: Tensor  # [B, K] bool: t < n, a draft token is there
    used: Tensor  # [B, K+1] bool: t <= n, the target's distribution there is read
    tokens: Tensor  # [B, K] int64: the draft tokens, 0 where not drafted (padding may hold anything)


def _rows(draft_tokens: Tensor, draft_lengths: Tensor | None) -> tuple[list[list[int]], list[int]]:
    """The draft tokens [B, K] and each row's draft length as Python ints, checked: the lengths in [0, K],
    no negative token within a row's draft."""
    b, k = _check_draft(draft_tokens)
    if draft_lengths is None:
        lengths = [k] * b
    elif draft_lengths.shape != (b,) or draft_lengths.dtype not in (torch.int32, torch.int64):
        raise UsageError(f"draft_lengths must be an integer tensor of shape [{b}]")
    else:
        lengths = draft_lengths.tolist()
        if not all(0 <= n <= k for n in lengths):
            raise UsageError(f"draft_lengths must lie in [0, {k}]")
    drafts = draft_tokens.tolist()
    if any(token < 0 for row, n in zip(drafts, lengths, strict=True) for token in row[:n]):
        raise UsageError("draft_tokens must be >= 0")
    return drafts, lengths


def _layout(draft_tokens: Tensor, draft_lengths: Tensor | None) -> _Layout:
    _, lengths_list = _rows(draft_tokens, draft_lengths)
    k = draft_tokens.shape[1]
    lengths = torch.tensor(lengths_list, dtype=torch.int64, device=draft_tokens.device)
    cols = torch.arange(k + 1, device=draft_tokens.device)
    drafted, used = cols[:k] < lengths.unsqueeze(1), cols <= lengths.unsqueeze(1)
    return _Layout(lengths, drafted, used, torch.where(drafted, draft_tokens.long(), 0))


def _check_probs(name: str, probs: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """probs: [B, P, V]; valid: [B, P] bool, the positions that must hold a distribution. Entries at other
    positions are ignored (returned as zeros)."""
    b, positions = valid.shape
    if probs.ndim != 3 or probs.shape[0] != b or probs.shape[1] != positions or probs.shape[2] == 0:
        raise UsageError(f"{name} must have shape [{b}, {positions}, V], got {tuple(probs.shape)}")
    if not torch.is_floating_point(probs):
        raise UsageError(f"{name} must be a floating-point tensor, got {probs.dtype}")
    tol = 1e-9 if probs.dtype == torch.float64 else 1e-3  # checked in the precision the caller computed
    all_valid = bool(valid.all())
    if probs.shape[2] and all_valid:  # one pass for the common case; the passes below name the problem
        if bool(((probs.sum(-1) - 1).abs() <= tol).all()) and bool((probs.amin(-1) >= 0).all()):
            return probs.to(dtype)
    for problem, bad in (("NaN or Inf", ~torch.isfinite(probs)), ("a negative probability", probs < 0)):
        bad = bad & valid.unsqueeze(-1)
        if bad.any():
            row, pos, _ = bad.nonzero()[0].tolist()
            raise UsageError(f"{name} has {problem} at row {row}, position {pos}")
    off = ((probs.sum(-1) - 1).abs() > tol) & valid
    if off.any():
        row, pos = off.nonzero()[0].tolist()
        raise UsageError(f"{name} does not sum to 1 at row {row}, position {pos}")
    return probs.to(dtype) if all_valid else torch.where(valid.unsqueeze(-1), probs.to(dtype), 0.0)


def _greedy_targets(scores: Tensor, lengths: Sequence[int] | None = None) -> Tensor:
    """scores: [B, P, V] probabilities or logits → their first argmax [B, P] int64 (torch.argmax's
    convention); UsageError at a NaN at a position a row uses (t <= its draft length ``lengths[b]``; None:
    every position). A NaN anywhere in a row makes its maximum NaN (torch.max propagates it), so the maxima
    alone find it. The caller has checked the shape."""
    targets = first_argmax(scores)  # [B, P]
    nan = torch.isnan(scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1))  # [B, P]: a NaN is the maximum
    if bool(nan.any()):
        for row, pos in nan.nonzero().tolist():
            if lengths is None or pos <= lengths[row]:
                raise UsageError(f"p has NaN at row {row}, position {pos}")
    return targets


def _pad_vocab(probs: Tensor, vocab: int) -> Tensor:
    extra = vocab - probs.shape[-1]
    return probs if extra == 0 else torch.nn.functional.pad(probs, (0, extra))


# ---------------------------------------------------------------------------------------------- rules


def rejection_rule(
    draft_tokens: Tensor,
    *,
    p: Tensor,
    q: Tensor,
    draft_lengths: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Rule:
    """Speculative rejection sampling: accept x_t with probability min(1, p_t(x_t) / q_t(x_t)); a rejected
    token is replaced by a sample of normalize(max(p_t − q_t, 0)); the bonus token comes from p_{n+1}.

    draft_tokens: [B, K] int, sampled from q.
    q: [B, K, Vq] draft distributions. p: [B, K+1, Vp] target distributions.
    draft_lengths: [B] int in [0, K], each row's draft length n (default K); later positions are ignored.
    dtype: float32 (default) or float64, the precision of all arithmetic.

    Edge cases: q_t(x_t) = 0 accepts when p_t(x_t) > 0 (the ratio is +inf) and rejects when it is 0 too; a
    residual of total mass 0 (p_t ≤ q_t everywhere: in exact arithmetic only p_t = q_t, where rejection has
    probability 0) falls back to p_t.
    """
    lay = _layout(draft_tokens, draft_lengths)
    b, k = lay.drafted.shape
    q = _check_probs("q", q, lay.drafted, dtype)
    p = _check_probs("p", p, lay.used, dtype)
    if bool((lay.tokens >= q.shape[-1]).any()):
        raise UsageError(f"a draft token id is outside the draft vocabulary of size {q.shape[-1]}")
    vocab = max(p.shape[-1], q.shape[-1])
    p, q = _pad_vocab(p, vocab), _pad_vocab(q, vocab)
    idx = lay.tokens.unsqueeze(-1)  # [B, K, 1]
    p_x = p[:, :k].gather(-1, idx).squeeze(-1)  # [B, K]
    q_x = q.gather(-1, idx).squeeze(-1)  # [B, K]
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(torch.finfo(dtype).tiny), (p_x > 0).to(dtype))
    accept_prob = torch.where(lay.drafted, ratio.clamp(max=1.0), 0.0)
    residual = (p[:, :k] - q).clamp_min(0)  # [B, K, V]
    mass = residual.sum(-1, keepdim=True)  # [B, K, 1]
    fallback = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(dtype).tiny), p[:, :k])
    fallback = torch.cat([fallback, p[:, k:]], dim=1)  # [B, K+1, V]: q is zero after the draft, residual = p
    return Rule(accept_prob=accept_prob, fallback=fallback, num_drafted=lay.lengths)


def single_guess_rule(
    draft_tokens: Tensor,
    *,
    p: Tensor,
    draft_lengths: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Rule:
    """Rejection sampling for drafts that come without probabilities (n-gram / prompt lookup): each guess is
    a point-mass draft q_t = onehot(x_t). Accept x_t with probability p_t(x_t); on rejection sample from p_t
    with x_t removed, renormalized.

    draft_tokens: [B, K] int. p: [B, K+1, V] target distributions. draft_lengths: [B] or None.
    """
    lay = _layout(draft_tokens, draft_lengths)
    b, k = lay.drafted.shape
    if p.ndim != 3:
        raise UsageError(f"p must have shape [{b}, {k + 1}, V], got {tuple(p.shape)}")
    vocab = max(p.shape[-1], int(lay.tokens.max()) + 1 if lay.tokens.numel() else 0)
    q = torch.zeros(b, k, vocab, dtype=dtype, device=draft_tokens.device)  # [B, K, V] point masses
    q.scatter_(-1, lay.tokens.unsqueeze(-1), 1.0)
    return rejection_rule(draft_tokens, q=q, p=p, draft_lengths=draft_lengths, dtype=dtype)


def greedy_rule(draft_tokens: Tensor, *, p: Tensor, draft_lengths: Tensor | None = None) -> Rule:
    """Greedy verification as a rule: accept x_t iff it is the first argmax of p_t; the fallback is a point
    mass on the argmax. p: [B, K+1, V] target distributions or logits (only the argmax is used)."""
    lay = _layout(draft_tokens, draft_lengths)
    k = lay.drafted.shape[1]
    _check_scores(p, draft_tokens.shape[0], k)
    target = _greedy_targets(p, lay.lengths.tolist())  # [B, K+1]
    accept_prob = ((lay.tokens == target[:, :k]) & lay.drafted).to(torch.float64)
    fallback = torch.zeros(p.shape, dtype=torch.float64, device=p.device)
    fallback.scatter_(-1, target.unsqueeze(-1), 1.0)
    return Rule(accept_prob=accept_prob, fallback=fallback, num_drafted=lay.lengths)


# ---------------------------------------------------------------------------------------------- sampling


def _assemble(
    draft_tokens: Tensor, num_accepted: Tensor, final: Tensor, num_drafted: Tensor, eos: EosIds
) -> Verdict:
    """Emitted tokens = accepted draft prefix [B, K], then ``final`` [B]; cut after an accepted EOS."""
    b, k = draft_tokens.shape
    cols = torch.arange(k + 1, device=draft_tokens.device)
    num_tokens = num_accepted + 1
    if eos is not None and k:
        eos_ids = torch.as_tensor(eos, dtype=torch.long, device=draft_tokens.device).reshape(-1)
        is_eos = torch.isin(draft_tokens.long(), eos_ids) & (cols[:k] < num_accepted.unsqueeze(1))  # [B, K]
        has_eos = is_eos.any(dim=1)
        num_accepted = torch.where(has_eos, is_eos.long().argmax(dim=1) + 1, num_accepted)
        num_tokens = torch.where(has_eos, num_accepted, num_tokens)
    tokens = torch.cat([draft_tokens.long(), final.long().view(b, 1)], dim=1)  # [B, K+1]
    tokens.scatter_(1, num_accepted.clamp(max=k).view(b, 1), final.long().view(b, 1))
    tokens = torch.where(cols < num_tokens.unsqueeze(1), tokens, _PAD)
    return Verdict(tokens=tokens, num_accepted=num_accepted, num_tokens=num_tokens, num_drafted=num_drafted)


def _accepted_prefix(accept: Tensor) -> Tensor:
    """accept: [B, K] bool. Returns [B] int64, the length of the all-accepted prefix."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def sample_verdict(
    rule: Rule, draft_tokens: Tensor, generator: torch.Generator, eos_token_id: EosIds = None
) -> Verdict:
    """Draw a verdict from ``rule``: accept x_t with probability accept_prob[:, t] until the first rejection
    (or the end of the row's draft), then sample the emitted token from the fallback at that position.

    draft_tokens: [B, K] int. generator: the only source of randomness (the same seed, the same verdict).
    eos_token_id: an end-of-sequence id (or several); an accepted one ends the row's output.
    """
    b, k = _check_draft(draft_tokens)
    if rule.accept_prob.shape != (b, k) or rule.fallback.shape[:2] != (b, k + 1):
        raise UsageError("rule does not match draft_tokens: need accept_prob [B, K] and fallback [B, K+1, V]")
    u = torch.rand(b, k, generator=generator, dtype=rule.accept_prob.dtype, device=draft_tokens.device)
    num_accepted = _accepted_prefix(u < rule.accept_prob)
    stop_dist = rule.fallback[torch.arange(b, device=draft_tokens.device), num_accepted]  # [B, V]
    final = sample(stop_dist, generator).squeeze(1) if b else num_accepted
    return _assemble(draft_tokens, num_accepted, final, rule.num_drafted, eos_token_id)


def rejection_sample(
    draft_tokens: Tensor,
    *,
    p: Tensor,
    q: Tensor | None,
    generator: torch.Generator,
    draft_lengths: Tensor | None = None,
    eos_token_id: EosIds = None,
    dtype: torch.dtype = torch.float32,
) -> Verdict:
    """Exact speculative sampling: :func:`rejection_rule` drawn with :func:`sample_verdict`; with q None,
    the draft tokens are single guesses (:func:`single_guess_rule`).

    draft_tokens: [B, K] int; q: [B, K, Vq] or None; p: [B, K+1, Vp]; draft_lengths: [B] or None.
    """
    if q is None:
        rule = single_guess_rule(draft_tokens, p=p, draft_lengths=draft_lengths, dtype=dtype)
    else:
        rule = rejection_rule(draft_tokens, q=q, p=p, draft_lengths=draft_lengths, dtype=dtype)
    return sample_verdict(rule, draft_tokens, generator, eos_token_id)


def single_guess_sample(
    draft_tokens: Tensor,
    *,
    p: Tensor,
    generator: torch.Generator,
    draft_lengths: Tensor | None = None,
    eos_token_id: EosIds = None,
    dtype: torch.dtype = torch.float32,
) -> Verdict:
    """Exact verification of guesses without draft probabilities: :func:`rejection_sample` with q None.
    draft_tokens: [B, K] int; p: [B, K+1, V]; the other arguments as for :func:`rejection_sample`."""
    return rejection_sample(
        draft_tokens,
        p=p,
        q=None,
        generator=generator,
        draft_lengths=draft_lengths,
        eos_token_id=eos_token_id,
        dtype=dtype,
    )


def greedy_verify(
    draft_tokens: Tensor, *, p: Tensor, draft_lengths: Tensor | None = None, eos_token_id: EosIds = None
) -> Verdict:
    """Greedy verification, no randomness: accept the longest prefix with x_t = argmax p_t, then emit the
    target's argmax at the first mismatch (or after the whole draft). Token-identical to greedy decoding.

    draft_tokens: [B, K] int; p: [B, K+1, V] target distributions or logits; draft_lengths: [B] or None.
    """
    drafts, lengths = _rows(draft_tokens, draft_lengths)
    _check_scores(p, len(drafts), draft_tokens.shape[1])
    targets = _greedy_targets(p, lengths).tolist()  # [B][K+1]
    return _greedy_verdict(drafts, lengths, targets, draft_tokens.shape[1], eos_token_id, draft_tokens.device)


def _check_scores(p: Tensor, b: int, k: int) -> None:
    """UsageError unless p has the shape [B, K+1, V] of a round's target scores."""
    if p.ndim != 3 or p.shape[:2] != (b, k + 1) or p.shape[2] == 0:
        raise UsageError(f"p must have shape [{b}, {k + 1}, V], got {tuple(p.shape)}")


def greedy_targets(p: Tensor) -> Tensor:
    """p: [P, V] one row's target distributions or logits → its greedy tokens [P] int64, the first argmax at
    every position (what :func:`greedy_verify_targets` takes); UsageError at a NaN."""
    if p.ndim != 2 or p.shape[1] == 0:
        raise UsageError(f"p must have shape [P, V], got {tuple(p.shape)}")
    return _greedy_targets(p.unsqueeze(0))[0]


def greedy_verify_targets(
    draft_tokens: Tensor, *, targets: Tensor, draft_lengths: Tensor | None = None, eos_token_id: EosIds = None
) -> Verdict:
    """:func:`greedy_verify` given the target's greedy tokens instead of p: targets [B, K+1] int, argmax p_t
    at every position a row uses (entries past a row's draft length + 1 are ignored). What a caller whose
    rows come with scores of their own lengths verifies with, without padding them to one [B, K+1, V].

    draft_tokens: [B, K] int; draft_lengths: [B] or None.
    """
    drafts, lengths = _rows(draft_tokens, draft_lengths)
    k = draft_tokens.shape[1]
    if targets.shape != (len(drafts), k + 1) or torch.is_floating_point(targets) or targets.is_complex():
        raise UsageError(f"targets must be an integer tensor of shape {[len(drafts), k + 1]}, got "
                         f"{targets.dtype} {list(targets.shape)}")  # fmt: skip
    return _greedy_verdict(drafts, lengths, targets.tolist(), k, eos_token_id, draft_tokens.device)


def _greedy_verdict(
    drafts: list[list[int]],
    lengths: list[int],
    targets: list[list[int]],
    k: int,
    eos: EosIds,
    device: torch.device,
) -> Verdict:
    """Each row's verdict from its draft, draft length and greedy tokens, in Python ints (a round's rows are
    few and short: cheaper than tensor operations): the longest prefix agreeing with the greedy tokens, then
    the greedy token after it; cut after an accepted end-of-sequence token."""
    ends = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    rows, accepted, emitted = [], [], []
    for draft, n, greedy in zip(drafts, lengths, targets, strict=True):
        a = 0
        while a < n and draft[a] == greedy[a]:
            a += 1
        end = next((i for i in range(a) if draft[i] in ends), None)  # the first accepted end
        out = draft[: end + 1] if end is not None else [*draft[:a], greedy[a]]
        accepted.append(a if end is None else end + 1)
        emitted.append(len(out))
        rows.append(out + [_PAD] * (k + 1 - len(out)))
    return Verdict(
        tokens=torch.tensor(rows, dtype=torch.long, device=device).view(len(rows), k + 1),
        num_accepted=torch.tensor(accepted, dtype=torch.long, device=device),
        num_tokens=torch.tensor(emitted, dtype=torch.long, device=device),
        num_drafted=torch.tensor(lengths, dtype=torch.long, device=device),
    )
