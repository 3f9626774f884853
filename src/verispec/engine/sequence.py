"""A sequence as the engine runs it: the :class:`Request` a caller submits (prompt, what it asks for —
:class:`EngineConfig` — and the parts it decodes with: its drafter, K policy, stop check, grammar), the
:class:`Running` state of an admitted one in its slot (committed ids, cache row, what its drafter has read),
and what a generation reports: :class:`GenerationStats`, each committed token's :class:`TokenLogprob`
(:func:`token_logprobs`), and the engine's :class:`ForwardTotals`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from verispec.costs.policies import KPolicy
from verispec.drafting.base import Drafter, HiddenStateReader, RowDrafter, TreeDrafter
from verispec.grammar.rounds import GrammarState
from verispec.models.base import Cache
from verispec.options import Decoding
from verispec.trace import TraceRecorder

__all__ = [
    "DrafterFor",
    "EngineConfig",
    "ForwardTotals",
    "GenerationStats",
    "Request",
    "Running",
    "TokenLogprob",
    "token_logprobs",
]


@dataclass(frozen=True)
class EngineConfig(Decoding):
    """What one generation asks of the engine, validated with UsageError: the fields of
    :class:`~verispec.options.Decoding` (the length, the sampling, the stop strings, ``logprobs``: N, each
    token's log-probability and its N likeliest, :class:`TokenLogprob`) and the tokens that end it,
    ``eos_token_ids``; :meth:`of`, a caller's options' with them."""

    eos_token_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, options: Decoding, eos_token_ids: frozenset[int]) -> EngineConfig:
        """The engine's config of ``options`` (:class:`~verispec.options.GenerationOptions` among them)."""
        shared = {f.name: getattr(options, f.name) for f in fields(Decoding)}
        return cls(**shared, eos_token_ids=eos_token_ids)


@dataclass
class GenerationStats:
    """Counters of one generation; the derived rates are properties."""

    drafter: str
    k: str
    new_tokens: int = 0
    target_calls: int = 0  # verification rounds (the prompt's prefill is not one)
    drafted: int = 0
    accepted: int = 0
    tree_nodes: int = 0  # draft nodes the target scored in tree rounds (there, drafted adds up tree depths)
    forced: int = 0  # drafted tokens that were the grammar's forced ones (in drafted and accepted too)
    drafted_per_position: list[int] = field(default_factory=list)  # rounds that drafted a token at position i
    accepted_per_position: list[int] = field(default_factory=list)  # rounds that accepted position i
    prompt_tokens: int = 0  # its prompt's tokens: those scored, and those cached
    cached_prompt_tokens: int = 0  # prompt tokens whose keys and values its slot still held: not scored again
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0  # the target forwards of its rounds (a batch's forward: all of it)
    total_seconds: float = 0.0  # from its admission to its last token: the prefill in it
    stop_reason: str = ""
    grammar_seconds: float = 0.0  # its constraint's setup, before it was admitted (in no other time)

    @property
    def tokens_per_target_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of rounds that drafted position i in which position i was accepted."""
        return [a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

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
            self.accepted_per_position += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted

    def as_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "tokens_per_target_call": self.tokens_per_target_call,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tree_nodes": self.tree_nodes,
            "forced": self.forced,
            "tokens_per_second": self.tokens_per_second,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "total_seconds": self.total_seconds,
            "stop_reason": self.stop_reason,
            "grammar_seconds": self.grammar_seconds,
            "drafter": self.drafter,
            "k": self.k,
        }


@dataclass
class ForwardTotals:
    """The engine's target forwards since it was made, summed (what a load report splits its time by)."""

    forwards: int = 0
    seconds: float = 0.0
    prompt_forwards: int = 0  # forwards that scored prompt tokens, alone or beside decoding rows
    prompt_seconds: float = 0.0
    prompt_tokens: int = 0  # prompt tokens scored (not those kept from a slot)

    def record(self, seconds: float, prompt_tokens: int) -> None:
        self.forwards += 1
        self.seconds += seconds
        if prompt_tokens:
            self.prompt_forwards += 1
            self.prompt_seconds += seconds
            self.prompt_tokens += prompt_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target's own distribution at its prefix: the log-softmax
    of the target's logits there, before the sampling transform (temperature, top-k, top-p, min-p; vLLM's
    default, OpenAI's), so that a greedy answer's values are the model's and no value is −inf. Exact by
    construction: every committed token — accepted, recovered or bonus — was verified against the target's
    logits at its own prefix, scored in that round's forward, and these are read from them (no forward
    of their own). ``top``: the likeliest (token, logprob) pairs there, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits: [≥ len(tokens), V], the target's at each token's prefix (row i: the prefix of tokens[i]) → each
    token's :class:`TokenLogprob` with its ``top`` likeliest alternatives."""
    n = len(tokens)
    # in float64, rounded to float32: a value as exact as the logits allow, whatever order a reduction over
    # the vocabulary takes (float64's error is far below float32's step)
    logprobs = torch.log_softmax(logits[:n].double(), dim=-1).float()  # [n, V]
    ids = torch.tensor(tokens, dtype=torch.long, device=logprobs.device)  # [n]
    chosen = logprobs.gather(1, ids.unsqueeze(1))[:, 0]  # [n]
    best = torch.topk(logprobs, min(top, logprobs.shape[1]), dim=-1)  # values, indices: [n, top] each
    return [
        TokenLogprob(token, value, tuple(zip(top_ids, top_values, strict=True)))
        for token, value, top_ids, top_values in zip(
            tokens, chosen.tolist(), best.indices.tolist(), best.values.tolist(), strict=True
        )
    ]


@dataclass(frozen=True)
class DrafterFor:
    """A request's drafter made for the cache row the request gets (an early exit reads that row): the engine
    calls ``make`` with that row's cache when it admits the request."""

    make: Callable[[Cache], Drafter | TreeDrafter]


@dataclass(eq=False)
class Request:
    """One generation for the engine: its prompt ids, what it asks for, and the parts it decodes with — its
    own drafter (or a function making one for the cache row it is given: an early exit reads that row), its
    own K policy, and ``stats`` filled in as it runs. ``stop_check(new_ids) -> int | None`` (optional) returns
    how many generated tokens to keep when a stop string has appeared in them; ``trace`` (optional, chain
    rounds only) records every round; ``grammar`` (optional) constrains the output
    (:mod:`verispec.grammar`: this request's own state, e.g. :func:`~verispec.grammar.matcher.start_state`'s,
    at the prompt's end): the target's logits masked at every verified position, the forced tokens drafted
    first."""

    prompt: list[int]
    config: EngineConfig
    drafter: Drafter | TreeDrafter | DrafterFor
    k_policy: KPolicy
    stats: GenerationStats
    stop_check: Callable[[list[int]], int | None] | None = None
    trace: TraceRecorder | None = None
    grammar: GrammarState | None = None


@dataclass(eq=False)
class Running:
    """A request in its slot: the committed ids, the cache row, where it stands. ``done`` once it stopped
    (``request.stats.stop_reason`` says why); its slot is then free. ``error``: what failed it alone (its
    drafter, verification or stop check raised; stop reason "error"), the rest of the batch going on.
    ``logprobs``: each committed token's :class:`TokenLogprob`, when its config asks for them."""

    request: Request
    slot: int
    cache: Cache
    drafter: Drafter | TreeDrafter
    generator: torch.Generator
    ids: list[int]
    started: float
    prefilled: int = 0  # prompt tokens (all but the last) already in the cache
    new: int = 0  # tokens committed after the prompt
    done: bool = False
    hidden_reader: HiddenStateReader | None = None
    tree: bool = False  # its drafter proposes token trees
    row_drafter: RowDrafter | None = None  # its drafter, where it proposes with others of its rows_key
    hidden: list[torch.Tensor] = field(default_factory=list)  # what observe_hidden handed over, in order
    error: Exception | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def last_logprobs(self, count: int) -> tuple[TokenLogprob, ...]:
        """The logprobs of its last ``count`` committed tokens (none unless its config asks for them)."""
        return tuple(self.logprobs[len(self.logprobs) - count :]) if count else ()

    @property
    def decoding(self) -> bool:
        return not self.done and self.prefilled >= len(self.request.prompt) - 1

    def observe_hidden(self, hidden: torch.Tensor | None) -> None:
        """hidden: [T, H], the target's final hidden states at the next T committed positions, for a drafter
        that reads them; kept too, for the slot's next sequence (:meth:`SpeculativeEngine.submit`)."""
        if hidden is not None and self.hidden_reader is not None:
            self.hidden.append(hidden.clone())  # its own rows only, not a view of the step's whole output
            self.hidden_reader.observe_hidden(hidden)
