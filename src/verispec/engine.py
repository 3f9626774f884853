"""The speculative decoding engine: prefill, then rounds of propose → score → verify → commit / roll back.

Invariant between rounds: ``ids`` is the committed sequence (prompt + generated tokens); the target's cache
holds every committed token but the last, which is fed as the first token of the next round's forward. A round
drafts x_1..x_k, runs the target once over [ids[-1], x_1..x_k] (k + 1 positions, giving p_1..p_{k+1}),
verifies, and truncates the target's cache to the committed tokens: rollback only moves the cache length back.

Stopping is exact: at an end-of-sequence token, at a stop string, at exactly ``max_new_tokens`` (k is capped
so that no round can overshoot, and surplus tokens are never committed), or at the target's context limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from verispec.drafters import Drafter, Proposal
from verispec.models.base import Cache, LanguageModel
from verispec.policies import KPolicy
from verispec.sampling import SamplingParams, probs_from_logits
from verispec.trace import TraceRecorder
from verispec.verify import Verdict, greedy_verify, rejection_sample, single_guess_sample

__all__ = ["EngineConfig", "GenerationStats", "SpeculativeEngine"]


@dataclass(frozen=True)
class EngineConfig:
    """What one generation asks for; validated with ValueError."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty strings")


@dataclass
class GenerationStats:
    """Counters of one generation; the derived rates are properties."""

    drafter: str
    k: str
    new_tokens: int = 0
    target_calls: int = 0  # verification rounds (the prompt's prefill is not one)
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # rounds that drafted a token at position i
    accepted_per_position_counts: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    total_seconds: float = 0.0
    stop_reason: str = ""

    @property
    def tokens_per_target_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_position(self) -> list[float]:
        """Fraction of rounds that drafted position i in which position i was accepted."""
        return [
            a / d for a, d in zip(self.accepted_per_position_counts, self.drafted_per_position, strict=True)
        ]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    def record_round(self, drafted: int, accepted: int) -> None:
        self.target_calls += 1
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position_counts += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position_counts[i] += i < accepted

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "tokens_per_target_call": self.tokens_per_target_call,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_position": self.accepted_per_position,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens_per_second": self.tokens_per_second,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "total_seconds": self.total_seconds,
            "stop_reason": self.stop_reason,
            "drafter": self.drafter,
            "k": self.k,
        }


class SpeculativeEngine:
    """Generates from ``target`` with ``drafter`` proposals; exact w.r.t. the target's sampling distribution.

    ``stop_check(new_ids) -> int | None`` (optional) returns how many of the generated tokens to keep when a
    stop string has appeared in them, else None; the tokenizer-aware check lives with the caller.
    ``trace`` (optional) records every round for :mod:`verispec.trace`; without it nothing extra is computed.
    ``cache`` (optional) is the target's cache, made by ``target.new_cache()`` (default: a new one), for a
    drafter that reads it.
    """

    def __init__(
        self,
        target: LanguageModel,
        drafter: Drafter,
        k_policy: KPolicy,
        trace: TraceRecorder | None = None,
        cache: Cache | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.k_policy = k_policy
        self.trace = trace
        self.cache = target.new_cache() if cache is None else cache

    def stream(
        self,
        prompt: list[int],
        config: EngineConfig,
        stats: GenerationStats,
        stop_check: Callable[[list[int]], int | None] | None = None,
    ) -> Iterator[list[int]]:
        """Yields the tokens committed by each round; ``stats`` is filled in as it goes."""
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt) >= self.target.max_context:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; the context holds {self.target.max_context}"
            )
        generator = config.sampling.generator(self.target.device)
        start = time.perf_counter()
        ids = list(prompt)
        self.cache.truncate(0)
        self._forward(ids[:-1], 0)  # prefill: every prompt token but the last
        self.drafter.begin(prompt)
        stats.prefill_seconds = time.perf_counter() - start
        new = 0
        while True:
            room = min(config.max_new_tokens - new, self.target.max_context - len(ids))
            if room <= 0:
                stats.stop_reason = "max_new_tokens" if new == config.max_new_tokens else "context"
                break
            emitted = self._round(ids, min(self.k_policy.next_k(), room - 1), config, generator, stats)[:room]
            stop = self._stop_index(emitted, config.eos_token_ids)
            keep = emitted if stop is None else emitted[: stop + 1]
            cut = stop_check(ids[len(prompt) :] + keep) if stop_check else None
            if cut is not None:
                keep = keep[: max(0, cut - new)]
            ids += keep
            new += len(keep)
            stats.new_tokens = new
            stats.total_seconds = time.perf_counter() - start
            if keep:
                yield keep
            if cut is not None or stop is not None:
                stats.stop_reason = "stop_string" if cut is not None else "eos"
                break
        stats.total_seconds = time.perf_counter() - start

    def _round(
        self,
        ids: list[int],
        k: int,
        config: EngineConfig,
        generator: torch.Generator,
        stats: GenerationStats,
    ) -> list[int]:
        """One round: propose → score k+1 positions in one target forward → verify → commit / roll back."""
        t0 = time.perf_counter()
        proposal = self.drafter.propose(ids, k, generator) if k > 0 else Proposal.empty()
        t1 = time.perf_counter()
        logits = self._forward([ids[-1], *proposal.tokens.tolist()], len(ids) - 1)  # [1, k'+1, V]
        t2 = time.perf_counter()
        verdict = self._verify(proposal, logits, config, generator)
        if self.trace is not None:
            self.trace.record(proposal, logits, verdict, config.sampling)
        emitted, accepted, drafted = verdict.row(0), int(verdict.num_accepted[0]), len(proposal.tokens)
        self.cache.truncate(len(ids) - 1 + len(emitted))  # keep the committed tokens but the new last one
        self.drafter.observe(accepted)
        self.k_policy.observe(drafted, accepted)
        stats.record_round(drafted, accepted)
        stats.draft_seconds += t1 - t0
        stats.target_seconds += t2 - t1
        return emitted

    def _verify(
        self, proposal: Proposal, logits: torch.Tensor, config: EngineConfig, generator: torch.Generator
    ) -> Verdict:
        """logits: [1, k'+1, V] target logits for the round."""
        draft = proposal.tokens.to(logits.device).unsqueeze(0)  # [1, k']
        eos = sorted(config.eos_token_ids) or None
        if config.sampling.greedy:
            return greedy_verify(draft, logits, eos_token_id=eos)
        p = probs_from_logits(logits, config.sampling)  # [1, k'+1, V]
        if proposal.q is None:
            return single_guess_sample(draft, p, generator, eos_token_id=eos)
        q = proposal.q.to(logits.device).unsqueeze(0)  # [1, k', V]
        return rejection_sample(draft, q, p, generator, eos_token_id=eos)

    def _forward(self, tokens: list[int], start: int) -> torch.Tensor:
        """Feeds ``tokens`` at positions start.. into the target's cache; returns logits [1, T, V]."""
        device = self.target.device
        if not tokens:
            return torch.empty(1, 0, self.target.vocab_size, device=device)
        batch = torch.tensor([tokens], dtype=torch.long, device=device)  # [1, T]
        positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)  # [1, T]
        return self.target.forward(batch, positions, self.cache)

    @staticmethod
    def _stop_index(tokens: list[int], eos: frozenset[int]) -> int | None:
        """Index of the first end-of-sequence token in ``tokens``, or None."""
        return next((i for i, t in enumerate(tokens) if t in eos), None)
