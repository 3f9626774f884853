"""The speculative decoding engine: a continuous batch of sequences, each step propose → score → verify →
commit / roll back.

Invariant of every sequence between rounds: ``ids`` is its committed sequence (prompt + generated tokens); its
cache (a row of the target's cache) holds every committed token but the last, which is fed as the first token
of the next round's forward. A chain round drafts x_1..x_k, scores [ids[-1], x_1..x_k] (k + 1 positions,
giving p_1..p_{k+1}), verifies, and truncates the row to the committed tokens: rollback only moves its length
back. A tree round (a :class:`~verispec.drafting.base.TreeDrafter`) proposes a token tree rooted at ids[-1],
scores every node (node i at position len(ids) − 1 + depth[i], attending to the committed context and its
ancestors), verifies the tree (:mod:`verispec.verify.tree`) and compacts the accepted path's entries into
place, dropping the rest; its depth is capped like k and the K policy is not consulted. Under a grammar that
forces a run of tokens after ids[-1], the tree's trunk is that run (point masses, each node its parent's only
child) and the drafter's tree hangs from its end (:func:`~verispec.grammar.rounds.tree_with_forced`).

One step of the engine (:meth:`SpeculativeEngine.step`) does that for every running sequence at once: each
proposes with its own drafter, K policy and generator; the target scores all of them in ONE forward (sequence
i contributes its k_i + 1 positions or its tree; a sequence that joined contributes a chunk of its prompt,
at most ``prefill_chunk`` tokens while others decode, so that they keep streaming; a decoding sequence at most
``round_tokens``, its grammar's forced run included: a 7,000-token ``const`` is forced over many rounds, never
scored in one forward that holds the others up); then each is verified,
committed and rolled back on its own row. A target that scores rows of one cache together
(:class:`~verispec.models.base.RowModel`: verispec's native kernels) computes every row from that row's own
tokens and cache entries alone, bit for bit, so what a request gets never depends on the rest of the batch;
any other target scores the rows one after the other. Batch 1 is just the smallest batch: :meth:`stream`.
With ``SamplingParams.invariant`` a sampled round keeps its draft while it matches each position's own draw
(:func:`~verispec.sampling.position_draws`), so that a sequence's tokens do not depend on its K either.

Stopping is exact, per sequence: at an end-of-sequence token, at a stop string, at exactly
``max_new_tokens`` (k is capped so that no round can overshoot, and surplus tokens are never committed), or at
the target's context limit. A sequence leaves the batch when it stops, freeing its slot for the next request.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import cast

import torch

from verispec.costs.online import ForwardTiming, RoundTiming
from verispec.costs.policies import CostModelK, plan_batch
from verispec.drafting.base import (
    Drafter,
    DraftRow,
    HiddenStateReader,
    RowDrafter,
    SequenceEnd,
    TreeDrafter,
)
from verispec.engine.rounds import (
    Chain,
    Round,
    chain_of,
    chain_round,
    draft,
    tree_round,
    verify_chain,
    verify_greedy_chains,
    verify_tree,
)
from verispec.engine.sequence import DrafterFor, ForwardTotals, Request, Running, token_logprobs
from verispec.engine.slots import Slots
from verispec.errors import UsageError
from verispec.grammar.rounds import constrain, finish
from verispec.inputs import check_int
from verispec.models.base import (
    Cache,
    HiddenStateModel,
    LanguageModel,
    RowInput,
    TreeCache,
    TreeLanguageModel,
)
from verispec.verify.chain import Verdict

__all__ = ["PREFILL_CHUNK", "ROUND_TOKENS", "SpeculativeEngine"]

PREFILL_CHUNK = 128  # prompt tokens a joining sequence adds to a step while other sequences decode
ROUND_TOKENS = 64  # tokens a decoding sequence's round scores at most: its last token, forced run and draft


class SpeculativeEngine:
    """Generates from ``target`` for up to ``slots`` sequences at once; exact w.r.t. each sequence's
    sampling distribution whatever else is in the batch. Its one way in is a :class:`Request`
    (:meth:`submit`), which brings its drafter, K policy and trace; the engine makes the cache: one row per
    slot of a target cache (when its rows can be scored together: :class:`~verispec.models.base.RowModel`),
    else a cache per slot. A tree drafter needs a target that takes a tree mask and a cache that compacts.
    """

    def __init__(
        self,
        target: LanguageModel,
        *,
        slots: int = 1,
        prefill_chunk: int = PREFILL_CHUNK,
        round_tokens: int = ROUND_TOKENS,
    ) -> None:
        sizes = (("slots", slots), ("prefill_chunk", prefill_chunk), ("round_tokens", round_tokens))
        for name, value in sizes:
            check_int(value, name, 1)
        self.target = target
        self.prefill_chunk = prefill_chunk
        self.round_tokens = round_tokens
        self._slots = Slots(target, slots)
        self.caches = self._slots.caches  # one per slot
        self.cache = self.caches[0]  # batch 1's
        self._rows = self._slots.rows  # scores rows together
        # the target as the protocols its forwards need, checked once (a protocol's isinstance is slow)
        self._trees = target if isinstance(target, TreeLanguageModel) else None
        self._states = target if isinstance(target, HiddenStateModel) else None
        self.running: list[Running] = []
        self.forwards = ForwardTotals()
        self._forward_end: float | None = None  # when the last step of draft rounds only had its forward

    @property
    def slots(self) -> int:
        return len(self.caches)

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.running)

    # ------------------------------------------------------------------ requests

    def _check_drafter(self, drafter: Drafter | TreeDrafter, trace: object, cache: Cache) -> None:
        """UsageError for a drafter this target or cache cannot serve."""
        if isinstance(drafter, HiddenStateReader) and self._states is None:
            raise UsageError(f"the {drafter.name} drafter needs a target with hidden states (a native model)")
        if isinstance(drafter, TreeDrafter):
            drafter.shape.check_fits(self.target.max_context)
            if not isinstance(cache, TreeCache) or self._trees is None:
                raise UsageError(f"token trees need a cache that compacts; {type(cache).__name__} does not")
            if trace is not None:
                raise UsageError("token-fate traces record chain rounds only, not token trees")

    def submit(self, request: Request) -> Running:
        """Admit ``request`` into a free slot (UsageError when none is free, or for a prompt that is empty or
        does not fit the context); its prompt is scored by the next steps, then it decodes.

        The slot chosen is the free one whose last sequence shares the longest start with the prompt: the
        keys and values of that shared start are still in its cache and are kept, not scored again (a chat's
        next turn, a common system prompt). Where another row of the batch holds a longer shared start (a
        running sequence, or another free slot's last one), those entries are copied from it instead, when
        the target's rows can be (:meth:`~verispec.models.base.RowModel.copy_prefix`). A drafter that reads
        the target's hidden states is handed the states of the kept positions that the source row's sequence
        was handed (none kept when it was handed none).
        A position's keys, values and hidden state are a function of the tokens up to it alone (in the native
        kernels, bit for bit), so what is kept is what scoring the prompt again would give."""
        prompt = request.prompt
        if not prompt:
            raise UsageError("the prompt is empty: at least one token is needed")
        if len(prompt) >= self.target.max_context:
            raise UsageError(
                f"the prompt has {len(prompt)} tokens; the context holds {self.target.max_context}"
            )
        if not self.free_slots:
            raise UsageError(f"all {self.slots} slots are taken: wait for a sequence to finish")
        slot, shared = self._slots.choose(prompt, {r.slot for r in self.running})
        cache = self.caches[slot]
        given = request.drafter
        drafter = given.make(cache) if isinstance(given, DrafterFor) else given
        self._check_drafter(drafter, request.trace, cache)
        sampling = request.config.sampling
        if request.trace is not None and sampling.invariant and not sampling.greedy:
            raise UsageError(
                "token-fate traces show rejection sampling's odds: not with invariant draws (a seed's "
                "default; invariant=False opts out)"
            )
        kept, states = self._slots.keep(slot, shared, prompt, isinstance(drafter, HiddenStateReader))
        request.stats.prompt_tokens, request.stats.cached_prompt_tokens = len(prompt), kept
        drafter.begin(list(prompt))
        running = Running(
            request=request,
            slot=slot,
            cache=cache,
            drafter=drafter,
            generator=request.config.sampling.generator(self.target.device),
            ids=list(prompt),
            started=time.perf_counter(),
            prefilled=kept,
            hidden_reader=drafter if isinstance(drafter, HiddenStateReader) else None,
            tree=isinstance(drafter, TreeDrafter),
            row_drafter=drafter if isinstance(drafter, RowDrafter) else None,
        )
        if kept and states is not None:
            running.observe_hidden(states[:kept])
        self.running.append(running)
        self._slots.admitted(running)
        self._forward_end = None  # the time until the next forward is no round's (an idle wait, a join)
        return running

    def cancel(self, running: Running) -> None:
        """Stop ``running`` now (its stop reason "cancelled") and free its slot."""
        if running in self.running:
            self.running.remove(running)
        if not running.done:
            running.done = True
            running.request.stats.stop_reason = "cancelled"

    def follow(self, running: Running) -> Iterator[list[int]]:
        """Steps the engine until ``running`` is done, yielding the tokens each step commits for it (the
        others in the batch step along)."""
        while not running.done:
            for done, tokens in self.step():
                if done is running and tokens:
                    yield tokens
        if running.error is not None:
            raise running.error

    # ------------------------------------------------------------------ one step

    def step(self) -> list[tuple[Running, list[int]]]:
        """One step for every running sequence: propose → score all in one target forward → verify →
        commit / roll back. Returns the tokens each committed (an empty list for a prompt chunk); a sequence
        that stopped is ``done`` and has left the batch. A sequence whose own part of the step raises (its
        proposal, verification or commit) fails alone (:meth:`_fail`); what the rows share (the plan, the
        forward) raises."""
        decoding = [r for r in self.running if r.decoding]
        ks = self._plan(decoding)
        out: list[tuple[Running, list[int]]] = []
        rounds = self._propose_all(decoding, ks, out)
        rounds += [self._prompt_chunk(r, others=bool(decoding)) for r in self.running if not r.decoding]
        t0 = time.perf_counter()
        scored = self._score(rounds)
        seconds = time.perf_counter() - t0
        self.forwards.record(seconds, sum(len(r.tokens) for r in rounds if r.chunk))
        forward = self._forward_timing(rounds, seconds, self._overhead(rounds, t0))
        self._forward_end = None if forward is None else t0 + seconds
        masked = [
            logits if logits is None or rnd.allowed is None else constrain(logits, rnd.allowed)  # [T, V]
            for rnd, (logits, _) in zip(rounds, scored, strict=True)
        ]
        verdicts = verify_greedy_chains(rounds, masked)
        for index, (rnd, (logits, hidden)) in enumerate(zip(rounds, scored, strict=True)):
            running = rnd.running
            if rnd.chunk:
                self._prefilled(running, len(rnd.tokens), hidden)
                out.append((running, []))
                continue
            running.request.stats.draft_seconds += rnd.draft_seconds
            running.request.stats.target_seconds += seconds
            score = masked[index]  # the constrained target's logits verify; logprobs read the target's own
            assert logits is not None and score is not None
            try:
                if rnd.tree is not None:
                    emitted, nodes = self._settle_tree(rnd, score, hidden, seconds)
                    rows = logits[nodes]  # [1 + accepted, V]
                else:
                    emitted, rows = self._settle(rnd, score, hidden, verdicts.get(index), forward), logits
                out.append((running, self._commit(running, emitted, rows)))
            except Exception as err:
                out.append((running, self._fail(running, err)))
        return out

    def _overhead(self, rounds: Sequence[Round], start: float) -> float | None:
        """The seconds between the last step's forward and this one's (starting at ``start``) that were not
        its proposals: the rest of a round (verify, commit, the caller's handling of the tokens, the plan);
        None unless both steps scored draft rounds only."""
        if self._forward_end is None:
            return None
        return start - self._forward_end - sum(rnd.draft_seconds for rnd in rounds)

    @staticmethod
    def _forward_timing(
        rounds: Sequence[Round], seconds: float, overhead: float | None
    ) -> ForwardTiming | None:
        """The step's forward for the K policies' cost estimates: when it scored chain rounds only (a prompt
        chunk's or a tree's tokens are not what a round of K draft tokens costs), else None."""
        if not rounds or any(rnd.proposal is None for rnd in rounds):
            return None
        context = round(sum(rnd.start + 1 for rnd in rounds) / len(rounds))
        return ForwardTiming(len(rounds), sum(len(rnd.tokens) for rnd in rounds), seconds, context, overhead)

    def _fail(self, running: Running, error: Exception) -> list[int]:
        """``running`` leaves the batch with ``error`` (stop reason "error"), its slot's cache not reused by
        the next sequence there; returns what it committed in this step: nothing."""
        running.error = error
        self._retire(running, "error")
        self._slots.spoiled(running)
        return []

    def _prompt_chunk(self, running: Running, others: bool) -> Round:
        """The next chunk of a joining sequence's prompt (all but its last token): at most prefill_chunk
        tokens while other sequences decode, else the rest."""
        prompt = running.request.prompt
        end = len(prompt) - 1
        if others:
            end = min(end, running.prefilled + self.prefill_chunk)
        return Round(running, prompt[running.prefilled : end], running.prefilled)

    def _prefilled(self, running: Running, count: int, hidden: torch.Tensor | None) -> None:
        running.prefilled += count
        running.observe_hidden(hidden)
        if running.decoding:
            running.request.stats.prefill_seconds = time.perf_counter() - running.started

    def _room(self, running: Running) -> int:
        """The tokens the sequence may still emit."""
        config = running.request.config
        return min(config.max_new_tokens - running.new, self.target.max_context - len(running.ids))

    def _round_room(self, running: Running) -> int:
        """The tokens the sequence's next round may emit: its room, at most ``round_tokens`` (a round scores
        its last committed token and at most ``round_tokens - 1`` forced and drafted ones)."""
        return min(self._room(running), self.round_tokens)

    def _plan(self, decoding: list[Running]) -> list[int | None]:
        """Each decoding sequence's K for this step: chosen for the whole batch when every one drafts a
        chain with ``--k auto`` (:func:`~verispec.costs.policies.plan_batch`; a batch of one: its own policy's
        choice), else None (each asks its own K policy). Prompt chunks in the same forward are not priced:
        pricing them (an extra token's marginal cost in a forward full of prompt tokens, read off the grid)
        drafted more during joins and measured 11-20 % slower at 4-16 concurrent requests."""
        policies = [r.request.k_policy for r in decoding]
        chains = not any(r.tree for r in decoding)
        if len(decoding) < 2 or not chains or not all(isinstance(p, CostModelK) for p in policies):
            return [None] * len(decoding)
        caps = [self._round_room(r) - 1 for r in decoding]
        planned = plan_batch(cast(list[CostModelK], policies), [len(r.ids) for r in decoding], caps)
        return list(planned)

    def _propose_all(
        self, decoding: list[Running], ks: list[int | None], out: list[tuple[Running, list[int]]]
    ) -> list[Round]:
        """Each decoding sequence's round (:meth:`_propose`), the chains of drafters that propose together
        (a :class:`~verispec.drafting.base.RowDrafter`'s ``rows_key``) in one call per key, each row's
        proposal exactly its own; a sequence whose proposal raises fails alone (into ``out``; a call for
        several rows that raises is made again row by row, so that only the one at fault fails)."""
        rounds: list[Round] = []
        together: dict[tuple[type, object], list[tuple[Running, Chain]]] = {}
        for running, k in zip(decoding, ks, strict=True):
            try:
                drafter, rows = running.drafter, running.row_drafter
                key = rows.rows_key if rows is not None and not running.tree else None
                if key is None:
                    rounds.append(self._propose(running, k))
                else:
                    together.setdefault((type(drafter), key), []).append(
                        (running, chain_of(running, k, self._round_room(running)))
                    )
            except Exception as err:
                out.append((running, self._fail(running, err)))
        for (kind, _), members in together.items():
            t0 = time.perf_counter()
            try:
                asked = [
                    DraftRow(cast(Drafter, r.drafter), c.context, c.k, r.generator, c.within)
                    for r, c in members
                ]
                proposals = cast(type[RowDrafter], kind).propose_rows(asked) if len(members) > 1 else None
            except Exception:
                proposals = None  # made again one by one below, each drafter first told none was kept
                for running, _ in members:
                    with contextlib.suppress(Exception):  # its own proposal below fails it if need be
                        cast(Drafter, running.drafter).observe(0)
            seconds = (time.perf_counter() - t0) / len(members)
            for index, (running, chain) in enumerate(members):
                try:
                    if proposals is None:
                        rounds.append(chain_round(running, chain, draft(running, chain), t0))
                    else:
                        rounds.append(chain_round(running, chain, proposals[index], seconds=seconds))
                except Exception as err:
                    out.append((running, self._fail(running, err)))
        return rounds

    def _propose(self, running: Running, planned: int | None = None) -> Round:
        """A decoding sequence's round (:mod:`verispec.engine.rounds`): its tree, or a chain of ``planned``
        tokens (None: its K policy's choice), capped by its room."""
        room = self._round_room(running)
        if running.tree:  # checked on submission: a tree drafter, a cache that compacts
            return tree_round(running, room)
        t0 = time.perf_counter()
        chain = chain_of(running, planned, room)
        return chain_round(running, chain, draft(running, chain), t0)

    def _score(self, rounds: Sequence[Round]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """(logits [T, V] or None for a prompt chunk, hidden states [T, H] for a drafter that reads them, else
        None) of every round, from one forward of the target when it scores rows together."""
        device = self.target.device
        rows = []
        for rnd in rounds:
            tokens = torch.tensor(rnd.tokens, dtype=torch.long, device=device)  # [T]
            if rnd.tree is not None:
                positions = (rnd.start + rnd.tree.depth).to(device)  # [T]
                mask: torch.Tensor | None = rnd.tree.mask.to(device)  # [T, T]
            else:
                positions, mask = torch.arange(rnd.start, rnd.start + len(rnd.tokens), device=device), None
            rows.append(RowInput(rnd.running.cache, tokens, positions, mask, not rnd.chunk,
                                 rnd.running.hidden_reader is not None))  # fmt: skip
        if len(rows) > 1 and self._rows is not None and self._rows.scores_together(rows):
            return self._rows.forward_rows(rows)
        return [self._score_one(row) for row in rows]

    def _score_one(self, row: RowInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One row through the target's batch-1 forward."""
        tokens, positions = row.tokens.unsqueeze(0), row.positions.unsqueeze(0)  # [1, T] each
        if row.hidden:
            model = self._states
            assert model is not None  # a reader of hidden states is admitted beside such a target alone
            hidden = model.forward_hidden(tokens, positions, row.cache, tree_mask=row.tree_mask)[0]  # [T, H]
            return (model.logits(hidden) if row.logits else None), hidden
        if not row.logits:
            self.target.prefill(tokens, positions, row.cache)
            return None, None
        if row.tree_mask is not None:
            target = self._trees
            assert target is not None  # a tree drafter is admitted beside such a target alone
            return target.forward(tokens, positions, row.cache, tree_mask=row.tree_mask)[0], None
        return self.target.forward(tokens, positions, row.cache)[0], None

    # ------------------------------------------------------------------ verify, commit

    def _settle(
        self,
        rnd: Round,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        verified: tuple[Verdict, int] | None = None,
        forward: ForwardTiming | None = None,
    ) -> list[int]:
        """Verify a chain round (logits [k'+1, V]; ``verified``: its verdict and row, when verified with
        others), roll the row back, tell the drafter and K policy (the verdict, and the round's costs with
        the step's ``forward``, when it scored chain rounds only)."""
        running, proposal = rnd.running, rnd.proposal
        assert proposal is not None
        config, request = running.request.config, running.request
        if verified is None:
            first = len(running.ids)  # the position of the round's first emitted token
            verified = verify_chain(proposal, logits.unsqueeze(0), config, running.generator, first), 0
        verdict, row = verified
        if request.trace is not None:
            request.trace.record(proposal, logits.unsqueeze(0), verdict, config.sampling)
        emitted, accepted, drafted = verdict.row(row), int(verdict.num_accepted[row]), len(proposal.tokens)
        running.cache.truncate(len(running.ids) - 1 + len(emitted))  # the committed tokens but the new last
        running.observe_hidden(None if hidden is None else hidden[: len(emitted)])  # [len(emitted), H]
        own = max(0, accepted - rnd.forced)  # the drafter's own tokens accepted, after the forced ones
        cast(Drafter, running.drafter).observe(own)
        request.k_policy.observe(drafted - rnd.forced, own)
        if forward is not None:
            timing = RoundTiming(forward, drafted - rnd.forced, rnd.draft_seconds, rnd.start + 1)
            request.k_policy.observe_costs(timing)
        request.stats.record_round(drafted, accepted)
        request.stats.forced += rnd.forced
        return emitted

    def _settle_tree(
        self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None, seconds: float
    ) -> tuple[list[int], list[int]]:
        """Verify a tree round (logits [N, V]) and compact its accepted path into place; tell the K policy
        whether it drafted, what it committed and what it cost (the step's forward, ``seconds``, and its
        drafting); returns the tokens it emits and the nodes whose logits are at each one's prefix (the
        root, then each accepted node)."""
        running, tree = rnd.running, rnd.tree
        assert tree is not None
        cache = cast(TreeCache, running.cache)
        verdict = verify_tree(tree, logits, running.request.config, running.generator, len(running.ids))
        kept = verdict.accepted_nodes[: len(verdict.tokens) - 1]  # all but an accepted end-of-sequence token
        root = len(running.ids) - 1
        cache.compact(len(running.ids), [root + node for node in kept])
        running.observe_hidden(None if hidden is None else hidden[[0, *kept]])  # [1 + len(kept), H]: the path
        stats = running.request.stats
        stats.record_round(tree.max_depth, verdict.num_accepted)
        stats.tree_nodes += tree.num_nodes - 1
        stats.forced += rnd.forced
        drafted = tree.num_nodes - 1 > rnd.forced  # nodes beyond the trunk: the drafter's
        running.request.k_policy.observe_tree(drafted, len(verdict.tokens), seconds + rnd.draft_seconds)
        return verdict.tokens, [0, *verdict.accepted_nodes]

    def _commit(self, running: Running, emitted: list[int], logits: torch.Tensor) -> list[int]:
        """Keep what the sequence's stopping rules allow of ``emitted``, with their logprobs when asked for
        (logits: [≥ len(emitted), V], the target's at each emitted token's prefix); retire it when it
        stopped."""
        request, config = running.request, running.request.config
        emitted = emitted[: self._room(running)]
        if request.grammar is not None:  # a finished grammar's end commits without a forward, with no logprob
            room = self._room(running) if config.logprobs is None else len(emitted)
            emitted = finish(request.grammar, emitted, room, config.eos_token_ids)
        stop = next((i for i, t in enumerate(emitted) if t in config.eos_token_ids), None)
        keep = emitted if stop is None else emitted[: stop + 1]
        cut = request.stop_check(running.ids[len(request.prompt) :] + keep) if request.stop_check else None
        if cut is not None:
            keep = keep[: max(0, cut - running.new)]
        running.ids += keep
        running.new += len(keep)
        if config.logprobs is not None:
            running.logprobs += token_logprobs(logits, keep, config.logprobs)
        stats = request.stats
        stats.new_tokens = running.new
        stats.total_seconds = time.perf_counter() - running.started
        if cut is not None or stop is not None:
            self._retire(running, "stop_string" if cut is not None else "eos")
        elif self._room(running) <= 0:
            self._retire(running, "max_new_tokens" if running.new == config.max_new_tokens else "context")
        return keep

    def _retire(self, running: Running, reason: str) -> None:
        """``running`` leaves the batch for ``reason``; its drafter, if a :class:`SequenceEnd`, is told the
        tokens of a sequence that finished (not of a failed one)."""
        running.done = True
        running.request.stats.stop_reason = reason
        self.running.remove(running)
        if reason != "error" and isinstance(running.drafter, SequenceEnd):
            running.drafter.finish(list(running.ids))
