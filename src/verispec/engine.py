"""The speculative decoding engine: prefill, then rounds of propose → score → verify → commit / roll back.

Invariant between rounds: ``ids`` is the committed sequence (prompt + generated tokens); the target's cache
holds every committed token but the last, which is fed as the first token of the next round's forward. A round
drafts x_1..x_k, runs the target once over [ids[-1], x_1..x_k] (k + 1 positions, giving p_1..p_{k+1}),
verifies, and truncates the target's cache to the committed tokens: rollback only moves the cache length back.

Stopping is exact: at an end-of-sequence token, at a stop string, at exactly ``max_new_tokens`` (k is capped
so that no round can overshoot, and surplus tokens are never committed), or at the target's context limit.

With a tree drafter (:mod:`verispec.drafting.base`) each round is a tree round instead: propose a token tree
rooted at ids[-1] → run the target ONCE over all its nodes (node i at position len(ids) − 1 + depth[i],
attending to the committed context and its ancestors) → verify the tree (:mod:`verispec.verify.tree`) →
compact the accepted path's cache entries into place after the committed ones, dropping the rest. The tree's
depth is capped like k, so stopping stays exact; the K policy is not consulted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from verispec.drafting.base import Drafter, HiddenStateReader, Proposal, TreeDrafter
from verispec.drafting.tree import TreeProposal
from verispec.errors import UsageError
from verispec.models.base import Cache, HiddenStateModel, LanguageModel, TreeCache, TreeLanguageModel
from verispec.policies import KPolicy
from verispec.sampling import SamplingParams, probs_from_logits
from verispec.trace import TraceRecorder
from verispec.verify.chain import Verdict, greedy_verify, rejection_sample, single_guess_sample
from verispec.verify.tree import TreeVerdict, tree_greedy_verify, tree_rejection_sample

__all__ = ["EngineConfig", "GenerationStats", "SpeculativeEngine"]


@dataclass(frozen=True)
class EngineConfig:
    """What one generation asks for; validated with UsageError."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise UsageError("stop strings must be non-empty strings")


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
    drafted_per_position: list[int] = field(default_factory=list)  # rounds that drafted a token at position i
    accepted_per_position: list[int] = field(default_factory=list)  # rounds that accepted position i
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

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "tokens_per_target_call": self.tokens_per_target_call,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tree_nodes": self.tree_nodes,
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
    A :class:`~verispec.drafting.base.TreeDrafter` makes every round a tree round (module docstring); its
    target must take a tree mask and its cache compact (:class:`~verispec.models.base.TreeCache`).
    """

    def __init__(
        self,
        target: LanguageModel,
        drafter: Drafter | TreeDrafter,
        k_policy: KPolicy,
        trace: TraceRecorder | None = None,
        cache: Cache | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.k_policy = k_policy
        self.trace = trace
        self.cache = target.new_cache() if cache is None else cache
        self.hidden_reader: HiddenStateReader | None = None  # the drafter, when it reads hidden states
        self.hidden_target: HiddenStateModel | None = None  # the target, then
        if isinstance(drafter, HiddenStateReader):
            if not isinstance(target, HiddenStateModel):
                raise UsageError(
                    f"the {drafter.name} drafter needs a target with hidden states (a native model)"
                )
            self.hidden_reader, self.hidden_target = drafter, target
        self.tree: tuple[TreeDrafter, TreeLanguageModel, TreeCache] | None = None  # tree rounds' parts
        self.chain: Drafter | None = None  # the drafter of chain rounds
        if not isinstance(drafter, TreeDrafter):
            self.chain = drafter
        else:
            drafter.shape.check_fits(target.max_context)
            if not isinstance(self.cache, TreeCache) or not isinstance(target, TreeLanguageModel):
                raise UsageError(
                    f"token trees need a cache that compacts; {type(self.cache).__name__} does not"
                )
            if trace is not None:
                raise UsageError("token-fate traces record chain rounds only, not token trees")
            self.tree = (drafter, target, self.cache)

    def stream(
        self,
        prompt: list[int],
        config: EngineConfig,
        stats: GenerationStats,
        stop_check: Callable[[list[int]], int | None] | None = None,
    ) -> Iterator[list[int]]:
        """Yields the tokens committed by each round; ``stats`` is filled in as it goes."""
        if not prompt:
            raise UsageError("the prompt is empty: at least one token is needed")
        if len(prompt) >= self.target.max_context:
            raise UsageError(
                f"the prompt has {len(prompt)} tokens; the context holds {self.target.max_context}"
            )
        generator = config.sampling.generator(self.target.device)
        start = time.perf_counter()
        ids = list(prompt)
        self.cache.truncate(0)
        hidden = self._prefill(ids[:-1])  # every prompt token but the last
        self.drafter.begin(prompt)
        if hidden is not None and self.hidden_reader is not None:
            self.hidden_reader.observe_hidden(hidden)
        stats.prefill_seconds = time.perf_counter() - start
        new = 0
        while True:
            room = min(config.max_new_tokens - new, self.target.max_context - len(ids))
            if room <= 0:
                stats.stop_reason = "max_new_tokens" if new == config.max_new_tokens else "context"
                break
            if self.tree is not None:
                emitted = self._tree_round(*self.tree, ids, room, config, generator, stats)
            else:
                assert self.chain is not None  # a drafter is a chain drafter or a tree drafter
                k = min(self.k_policy.next_k(len(ids)), room - 1)
                emitted = self._round(self.chain, ids, k, config, generator, stats)
            emitted = emitted[:room]
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
        drafter: Drafter,
        ids: list[int],
        k: int,
        config: EngineConfig,
        generator: torch.Generator,
        stats: GenerationStats,
    ) -> list[int]:
        """One round: propose → score k+1 positions in one target forward → verify → commit / roll back."""
        t0 = time.perf_counter()
        proposal = drafter.propose(ids, k, generator) if k > 0 else Proposal.empty()
        t1 = time.perf_counter()
        logits, hidden = self._forward([ids[-1], *proposal.tokens.tolist()], len(ids) - 1)  # [1, k'+1, V]
        t2 = time.perf_counter()
        verdict = self._verify(proposal, logits, config, generator)
        if self.trace is not None:
            self.trace.record(proposal, logits, verdict, config.sampling)
        emitted, accepted, drafted = verdict.row(0), int(verdict.num_accepted[0]), len(proposal.tokens)
        self.cache.truncate(len(ids) - 1 + len(emitted))  # keep the committed tokens but the new last one
        if hidden is not None and self.hidden_reader is not None:
            self.hidden_reader.observe_hidden(hidden[0, : len(emitted)])  # [len(emitted), H]: committed ones
        drafter.observe(accepted)
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
            return greedy_verify(draft, p=logits, eos_token_id=eos)
        p = probs_from_logits(logits, config.sampling)  # [1, k'+1, V]
        if proposal.q is None:
            return single_guess_sample(draft, p=p, generator=generator, eos_token_id=eos)
        q = proposal.q.to(logits.device).unsqueeze(0)  # [1, k', V]
        return rejection_sample(draft, q=q, p=p, generator=generator, eos_token_id=eos)

    def _tree_round(
        self,
        drafter: TreeDrafter,
        target: TreeLanguageModel,
        cache: TreeCache,
        ids: list[int],
        room: int,
        config: EngineConfig,
        generator: torch.Generator,
        stats: GenerationStats,
    ) -> list[int]:
        """One tree round: propose a tree → score every node in ONE target forward → verify → compact the
        accepted path into place. ``room``: the tokens the round may still emit (the tree's depth < room)."""
        root = len(ids) - 1  # the root's slot: the last committed token, fed first
        shape = drafter.shape.capped(room - 1, cache.capacity - root)
        t0 = time.perf_counter()
        tree = drafter.propose_tree(ids, shape, generator)
        t1 = time.perf_counter()
        logits, hidden = self._forward_tree(target, cache, tree, root)  # [N, V], [N, H] or None
        t2 = time.perf_counter()
        verdict = self._verify_tree(tree, logits, config, generator)
        kept = verdict.accepted_nodes[: len(verdict.tokens) - 1]  # all but an accepted end-of-sequence token
        cache.compact(len(ids), [root + node for node in kept])
        if hidden is not None and self.hidden_reader is not None:
            self.hidden_reader.observe_hidden(hidden[[0, *kept]])  # [1 + len(kept), H]: the committed path
        stats.record_round(tree.max_depth, verdict.num_accepted)
        stats.tree_nodes += tree.num_nodes - 1
        stats.draft_seconds += t1 - t0
        stats.target_seconds += t2 - t1
        return verdict.tokens

    def _verify_tree(
        self, tree: TreeProposal, logits: torch.Tensor, config: EngineConfig, generator: torch.Generator
    ) -> TreeVerdict:
        """logits: [N, V] target logits at the tree's nodes."""
        tokens, parents = tree.tokens.to(logits.device), tree.parents.to(logits.device)  # [N], [N]
        eos = sorted(config.eos_token_ids) or None
        if config.sampling.greedy:
            return tree_greedy_verify(tokens, parents, p=logits, eos_token_id=eos)
        p = probs_from_logits(logits, config.sampling)  # [N, V]
        q = None if tree.q is None else tree.q.to(logits.device)  # [N, V]
        return tree_rejection_sample(tokens, parents, p=p, q=q, generator=generator, eos_token_id=eos)

    def _forward_tree(
        self, target: TreeLanguageModel, cache: TreeCache, tree: TreeProposal, start: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feeds the tree's nodes into the target's cache from slot ``start``, node i at position start +
        depth[i], attending to its ancestors; returns logits [N, V] and, for a drafter that reads them, the
        final hidden states [N, H], else None."""
        device = target.device
        tokens = tree.tokens.to(device).unsqueeze(0)  # [1, N]
        positions = (start + tree.depth).to(device).unsqueeze(0)  # [1, N]
        mask = tree.mask.to(device)  # [N, N]
        if self.hidden_target is None:
            return target.forward(tokens, positions, cache, tree_mask=mask)[0], None
        hidden = self.hidden_target.forward_hidden(tokens, positions, cache, tree_mask=mask)[0]  # [N, H]
        return self.hidden_target.logits(hidden), hidden

    def _prefill(self, tokens: list[int]) -> torch.Tensor | None:
        """Feeds ``tokens`` into the empty cache without computing logits; returns the target's final hidden
        states [T, H] for a drafter that reads them, else None."""
        if not tokens:
            return None
        batch, positions = self._inputs(tokens, 0)
        if self.hidden_target is not None:
            return self.hidden_target.forward_hidden(batch, positions, self.cache)[0]
        self.target.prefill(batch, positions, self.cache)
        return None

    def _forward(self, tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feeds ``tokens`` (at least one) at positions start.. into the target's cache; returns logits
        [1, T, V] and, for a drafter that reads them, the final hidden states [1, T, H], else None."""
        batch, positions = self._inputs(tokens, start)
        if self.hidden_target is None:
            return self.target.forward(batch, positions, self.cache), None
        hidden = self.hidden_target.forward_hidden(batch, positions, self.cache)  # [1, T, H]
        return self.hidden_target.logits(hidden), hidden

    def _inputs(self, tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch [1, T] of ``tokens`` and their positions [1, T] from ``start``, on the target device."""
        device = self.target.device
        batch = torch.tensor([tokens], dtype=torch.long, device=device)  # [1, T]
        positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)  # [1, T]
        return batch, positions

    @staticmethod
    def _stop_index(tokens: list[int], eos: frozenset[int]) -> int | None:
        """Index of the first end-of-sequence token in ``tokens``, or None."""
        return next((i for i, t in enumerate(tokens) if t in eos), None)
