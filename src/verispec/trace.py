"""Token-fate traces: what happened to every generated token, recorded by the engine only when asked.

Pass a :class:`TraceRecorder` with a request (``Request(..., trace=recorder)``, or
``Speculator.stream(..., trace=recorder)``); without one the engine computes nothing extra. After each round
the recorder receives the proposal, the target's logits and the verdict, and keeps one :class:`TokenFate` per
emitted token: its fate (*accepted* draft token, *recovered* token, *bonus* token — the vocabulary of
:mod:`verispec.verify.chain`), its round, and at its position t of the round:

- ``p``: p_t(x), the probability of the token under the distribution the verifier used — the target's
  logits through :func:`verispec.sampling.probs_from_logits`. At temperature 0 that distribution is the point
  mass on the argmax, so p(x) is 1 for every emitted token (and 0 for a rejected draft token); greedy traces
  therefore also keep ``p_softmax``, the target's plain softmax at temperature 1, to show its confidence;
- ``q``: q_t(x), the draft's probability of the token; a drafter without probabilities (n-gram guesses,
  greedy model drafts) is a point mass on its guess, q(x) = 1 for the guess and 0 for any other token; None
  at a bonus position, where nothing was drafted;
- ``accept_prob``: min(1, p_t(x_t) / q_t(x_t)), the probability that the verifier accepted the draft token
  x_t at this position (the token itself when accepted, the draft token it replaced when recovered), computed
  by the library's own :func:`verispec.verify.chain.rejection_rule`; None for a bonus token;
- ``rejected``: for a recovered token, the draft token that was rejected there, with its p and q.

:meth:`TraceRecorder.finish` turns the records into a :class:`Trace` with each token's text and the run's
stats. Its tokens are exactly the committed ones: a stop string may cut the last round short, and then the
stats' ``accepted`` counts the cut tokens too. Without a stop string, the number of accepted tokens equals
``stats.accepted``, and the number of recovered plus bonus tokens equals ``stats.target_calls`` minus the
rounds that ended on an accepted end-of-sequence token (which emit no token after it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from verispec.drafting.base import Proposal
from verispec.errors import UsageError
from verispec.inputs import check_int
from verispec.models.base import Tokenizer
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits
from verispec.verify.chain import Verdict, rejection_rule

__all__ = ["FATES", "TokenFate", "TokenProbs", "Trace", "TraceRecorder", "token_texts"]

FATES = ("accepted", "recovered", "bonus")

_TEXT_WINDOW = 8  # tokens of left context decoded with each token: enough to complete any UTF-8 character


def _check_prob(name: str, value: float | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, float) or not 0.0 <= value <= 1.0:
        raise UsageError(f"{name} must be a probability in [0, 1], got {value!r}")


@dataclass(frozen=True)
class TokenProbs:
    """A token at one position of a round, with the target's and the draft's probabilities of it there."""

    token_id: int
    p: float  # p_t(token) under the verifier's distribution
    q: float | None  # q_t(token); None where nothing was drafted
    p_softmax: float | None = None  # greedy runs only: the target's softmax at temperature 1
    text: str = ""  # what the token adds to the decoded text (filled in by TraceRecorder.finish)

    def __post_init__(self) -> None:
        check_int(self.token_id, "token_id", 0)
        _check_prob("p", self.p)
        _check_prob("q", self.q, optional=True)
        _check_prob("p_softmax", self.p_softmax, optional=True)


@dataclass(frozen=True)
class TokenFate:
    """One generated token and what the verifier did at its position (see the module doc)."""

    token: TokenProbs
    fate: str  # one of FATES
    round: int  # 0-based index of the round (target call) that emitted it
    accept_prob: float | None  # of the draft token at this position; None for a bonus token
    rejected: TokenProbs | None = None  # recovered tokens only: the rejected draft token

    def __post_init__(self) -> None:
        if self.fate not in FATES:
            raise UsageError(f"fate must be one of {FATES}, got {self.fate!r}")
        check_int(self.round, "round", 0)
        _check_prob("accept_prob", self.accept_prob, optional=self.fate == "bonus")
        if (self.rejected is not None) != (self.fate == "recovered"):
            raise UsageError("exactly the recovered tokens carry the rejected draft token")


@dataclass(frozen=True)
class Trace:
    """A whole traced generation: its tokens in order, the run's stats and settings, for the renderers."""

    tokens: tuple[TokenFate, ...]
    stats: dict  # GenerationStats.as_dict()
    prompt: str
    settings: tuple[tuple[str, str], ...] = ()  # extra header items, e.g. (("target", "stories260K"),)

    def __post_init__(self) -> None:
        rounds = [t.round for t in self.tokens]
        if rounds != sorted(rounds):
            raise UsageError("trace tokens must be in round order")

    def count(self, fate: str) -> int:
        """How many tokens have ``fate``."""
        return sum(t.fate == fate for t in self.tokens)

    @property
    def rounds(self) -> list[list[TokenFate]]:
        """The tokens grouped by round, in order (rounds that committed nothing are absent)."""
        groups: list[list[TokenFate]] = []
        for t in self.tokens:
            if not groups or groups[-1][0].round != t.round:
                groups.append([])
            groups[-1].append(t)
        return groups


def token_texts(tokenizer: Tokenizer, ids: Sequence[int], context: Sequence[int] = ()) -> list[str]:
    """What each of ``ids`` adds to the decoded text of ``context + ids``.

    A character is attributed to the token that completes it: the bytes of a UTF-8 character split over
    byte-fallback tokens give "" for all but the last of them; special tokens (decoded as nothing) give "".
    Each token is decoded with up to 8 tokens of left context, so the cost is linear in the length.
    """
    every = [*context, *ids]
    texts = []
    for i in range(len(context), len(every)):
        start = max(0, i - _TEXT_WINDOW)
        before = tokenizer.decode(every[start:i]).rstrip("\ufffd")
        after = tokenizer.decode(every[start : i + 1])
        if i < len(every) - 1:  # an incomplete character may still be completed by the next token
            after = after.rstrip("\ufffd")
        texts.append(after[len(os.path.commonprefix([before, after])) :])
    return texts


class TraceRecorder:
    """Receives every round from the engine (:meth:`record`); builds the :class:`Trace` (:meth:`finish`)."""

    def __init__(self) -> None:
        self.tokens: list[TokenFate] = []
        self.num_rounds = 0

    def record(self, proposal: Proposal, logits: Tensor, verdict: Verdict, sampling: SamplingParams) -> None:
        """One round: the proposal, the target's logits [1, k'+1, V] over it, and the verdict drawn."""
        logits = logits[0].float()  # [k'+1, V]
        p = probs_from_logits(logits, sampling)  # [k'+1, V]
        soft = logits.softmax(dim=-1) if sampling.greedy else None  # [k'+1, V]
        draft = proposal.tokens.to(p.device)  # [k']
        if proposal.q is None:  # single guesses: point masses
            vocab = max(p.shape[-1], int(draft.max()) + 1 if len(draft) else 0)
            q = torch.nn.functional.one_hot(draft, vocab).to(p.dtype)  # [k', Vq]
        else:
            q = proposal.q.to(p.device, p.dtype)  # [k', Vq]
        accept = rejection_rule(draft.unsqueeze(0), q=q.unsqueeze(0), p=p.unsqueeze(0)).accept_prob[0]  # [k']

        def probs(t: int, token: int) -> TokenProbs:
            def at(dist: Tensor) -> float:  # dist: [V], zero beyond its vocabulary
                return float(dist[token]) if token < dist.shape[-1] else 0.0

            return TokenProbs(
                token_id=token,
                p=at(p[t]),
                q=at(q[t]) if t < len(draft) else None,
                p_softmax=at(soft[t]) if soft is not None else None,
            )

        emitted, accepted = verdict.row(0), int(verdict.num_accepted[0])
        for t, token in enumerate(emitted):
            fate = "accepted" if t < accepted else "recovered" if bool(verdict.recovered[0]) else "bonus"
            self.tokens.append(
                TokenFate(
                    token=probs(t, token),
                    fate=fate,
                    round=self.num_rounds,
                    accept_prob=float(accept[t]) if t < len(draft) else None,
                    rejected=probs(t, int(draft[t])) if fate == "recovered" else None,
                )
            )
        self.num_rounds += 1

    def finish(
        self, tokenizer: Tokenizer, stats: dict, prompt: str, settings: tuple[tuple[str, str], ...] = ()
    ) -> Trace:
        """The trace of the committed tokens, with their texts. stats: the run's ``GenerationStats.as_dict()``
        (the committed tokens are the first ``stats["new_tokens"]`` recorded). A recorder records one
        generation: UsageError when the stats count another number of rounds."""
        if stats["target_calls"] != self.num_rounds:
            raise UsageError(
                f"the recorder saw {self.num_rounds} rounds, the stats count {stats['target_calls']}: "
                "use one TraceRecorder per generation"
            )
        committed = self.tokens[: stats["new_tokens"]]
        ids = [t.token.token_id for t in committed]
        tokens = []
        for i, (fate, text) in enumerate(zip(committed, token_texts(tokenizer, ids), strict=True)):
            rejected = fate.rejected
            if rejected is not None:
                (rejected_text,) = token_texts(tokenizer, [rejected.token_id], context=ids[:i])
                rejected = replace(rejected, text=rejected_text)
            tokens.append(replace(fate, token=replace(fate.token, text=text), rejected=rejected))
        return Trace(tokens=tuple(tokens), stats=stats, prompt=prompt, settings=settings)
