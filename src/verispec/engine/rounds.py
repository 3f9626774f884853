"""A step's rounds, one per sequence: what it scores (:class:`Round`: a chunk of a joining sequence's prompt,
a chain proposal or a token tree), how a decoding sequence's round is drafted within the room it has left and
its grammar (:func:`chain_of`, :func:`draft`, :func:`chain_round`, :func:`tree_round`), and how a scored round
is verified by its sequence's sampling settings (:func:`verify_chain`, :func:`verify_tree`; a step's greedy
chains together: :func:`verify_greedy_chains`): logits in, verdict out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import torch

from verispec.drafting.base import Allowed, Drafter, Proposal, TreeDrafter
from verispec.drafting.tree import TreeProposal
from verispec.engine.sequence import EngineConfig, Running
from verispec.grammar.rounds import (
    GrammarState,
    chain_masks,
    forced_run,
    tree_masks,
    tree_with_forced,
    with_forced,
)
from verispec.models.base import TreeCache
from verispec.sampling import position_draws, probs_from_logits
from verispec.verify.chain import (
    Verdict,
    greedy_targets,
    greedy_verify,
    greedy_verify_targets,
    rejection_sample,
    single_guess_sample,
)
from verispec.verify.tree import TreeVerdict, tree_greedy_verify, tree_rejection_sample

__all__ = [
    "Chain",
    "Round",
    "chain_of",
    "chain_round",
    "draft",
    "tree_round",
    "verify_chain",
    "verify_greedy_chains",
    "verify_tree",
]

V_co = TypeVar("V_co", covariant=True)  # a verdict: a chain's or a tree's


def _after(grammar: GrammarState, forced: list[int]) -> Allowed:
    """The grammar's mask at each position of a chain drafted after the ``forced`` tokens, for the drafter
    (tentative: the committed state never moves)."""
    return lambda path: grammar.mask_after([*forced, *path])


@dataclass(frozen=True)
class Chain:
    """What a chain round asks of its drafter: ``k`` tokens after ``context`` (the committed ids and the
    grammar's ``forced`` run), within the grammar's masks ``within`` (None: no grammar)."""

    context: list[int]
    k: int
    forced: list[int]
    within: Allowed | None


@dataclass
class Round:
    """What a sequence scores in this step: a prompt chunk, a chain proposal or a tree."""

    running: Running
    tokens: list[int]
    start: int  # the position of the first token (its cache slot)
    proposal: Proposal | None = None  # a chain round's
    tree: TreeProposal | None = None  # a tree round's
    draft_seconds: float = 0.0
    allowed: torch.Tensor | None = None  # [T, V'] bool: each scored position's grammar mask (constrained)
    forced: int = 0  # the grammar's forced tokens that begin the chain's draft or make the tree's trunk

    @property
    def chunk(self) -> bool:
        """Whether it is a chunk of a joining sequence's prompt."""
        return self.proposal is None and self.tree is None


# ---------------------------------------------------------------------- drafting a round


def tree_round(running: Running, room: int) -> Round:
    """A tree drafter's round for a sequence that may still emit ``room`` tokens: its tree, hung from the
    grammar's forced run (if any); the root alone (nothing drafted) where its K policy asks for a plain
    round (:meth:`~verispec.costs.policies.KPolicy.tree_round`)."""
    ids, grammar = running.ids, running.request.grammar
    t0 = time.perf_counter()
    drafter, cache = (
        cast(TreeDrafter, running.drafter),
        cast(TreeCache, running.cache),
    )  # checked on submission
    space = cache.capacity - (len(ids) - 1)  # the nodes a forward may add
    trunk = [] if grammar is None else forced_run(grammar, min(room, space) - 1)  # certain: free
    if running.request.k_policy.tree_round(len(ids)):
        shape = drafter.shape.capped(room - 1 - len(trunk), space - len(trunk))
        masks = None if grammar is None else _after(grammar, trunk)
        tree = drafter.propose_tree(ids + trunk, shape, running.generator, masks)
    else:  # a plain round: the root alone
        tree = drafter.shape.capped(0, 1).select([0], [(ids + trunk)[-1]])
    tree = tree_with_forced(ids[-1], trunk, tree)  # the drafter's tree hung from the trunk's end
    nodes = tree.tokens.tolist()
    allowed = None if grammar is None else tree_masks(grammar, nodes, tree.parents.tolist())  # [N, V']
    return Round(running, nodes, len(ids) - 1, tree=tree, allowed=allowed, forced=len(trunk),
                 draft_seconds=time.perf_counter() - t0)  # fmt: skip


def chain_of(running: Running, planned: int | None, room: int) -> Chain:
    """What a chain round asks its drafter for: ``planned`` tokens (None: its K policy's choice) after the
    grammar's forced ones, capped by the ``room`` the sequence has left."""
    grammar = running.request.grammar
    forced = [] if grammar is None else forced_run(grammar, room - 1)  # certain: drafted for free
    k = running.request.k_policy.next_k(len(running.ids)) if planned is None else planned
    within = None if grammar is None else _after(grammar, forced)  # each draft position's mask
    return Chain(running.ids + forced, min(k, room - 1 - len(forced)), forced, within)


def draft(running: Running, chain: Chain) -> Proposal:
    """The sequence's own drafter's proposal for ``chain``."""
    if chain.k <= 0:
        return Proposal.empty()
    return cast(Drafter, running.drafter).propose(chain.context, chain.k, running.generator, chain.within)


def chain_round(
    running: Running, chain: Chain, proposal: Proposal, t0: float = 0.0, seconds: float | None = None
) -> Round:
    """The round of ``chain`` drafted as ``proposal`` (since ``t0``, or in ``seconds``)."""
    proposal = with_forced(chain.forced, proposal)
    tokens = proposal.tokens.tolist()
    grammar = running.request.grammar
    allowed = None if grammar is None else chain_masks(grammar, tokens)  # [1 + len(tokens), V']
    spent = time.perf_counter() - t0 if seconds is None else seconds
    return Round(running, [running.ids[-1], *tokens], len(running.ids) - 1, proposal=proposal,
                 allowed=allowed, forced=len(chain.forced), draft_seconds=spent)  # fmt: skip


# ---------------------------------------------------------------------- verifying it


def verify_greedy_chains(
    rounds: Sequence[Round], logits: Sequence[torch.Tensor | None]
) -> dict[int, tuple[Verdict, int]]:
    """The greedy chain rounds of a step (untraced), verified together: one ``greedy_verify`` over
    their padded drafts and each row's greedy tokens per set of end-of-sequence tokens (rows of their own
    lengths; greedy verification draws nothing, so rows share it freely). Round index → (verdict, its
    row)."""
    groups: dict[frozenset[int], list[int]] = {}
    for index, rnd in enumerate(rounds):
        config = rnd.running.request.config
        if rnd.proposal is not None and config.sampling.greedy and rnd.running.request.trace is None:
            groups.setdefault(config.eos_token_ids, []).append(index)
    out: dict[int, tuple[Verdict, int]] = {}
    for eos, members in groups.items():
        if len(members) < 2:
            continue
        proposals = [rounds[i].proposal for i in members]
        width = max(len(p.tokens) for p in proposals if p is not None)
        drafted = torch.zeros(len(members), width, dtype=torch.long)  # [B, K]
        targets = torch.zeros(len(members), width + 1, dtype=torch.long)  # [B, K+1]: rows padded
        for row, index in enumerate(members):
            proposal, score = rounds[index].proposal, logits[index]
            assert proposal is not None and score is not None
            n = len(proposal.tokens)
            drafted[row, :n] = proposal.tokens
            targets[row, : n + 1] = greedy_targets(score)  # [n + 1]
        lengths = torch.tensor([len(q.tokens) for q in proposals if q is not None])  # [B]
        verdict = greedy_verify_targets(
            drafted, targets=targets, draft_lengths=lengths, eos_token_id=sorted(eos) or None
        )
        out.update((index, (verdict, row)) for row, index in enumerate(members))
    return out


class _Rules(Protocol[V_co]):
    """A round's verifiers, one per rule; :func:`_verify` picks which one a sequence's sampling settings
    call for. ``eos``: the end-of-sequence tokens, or None."""

    def greedy(self, logits: torch.Tensor, eos: list[int] | None) -> V_co:
        """The target's greedy tokens against the draft, from its raw logits."""
        ...

    def invariant(self, p: torch.Tensor, eos: list[int] | None) -> V_co:
        """Each position's own draw from p (invariant draws), accepted while the draft matches it."""
        ...

    def sampled(self, p: torch.Tensor, eos: list[int] | None) -> V_co:
        """Sampling from p: rejection sampling against the draft's q, single guesses where it has none."""
        ...


def _verify(rules: _Rules[V_co], logits: torch.Tensor, config: EngineConfig) -> V_co:
    """The one choice of verification rule by a sequence's sampling settings, chains and trees alike:
    greedy on the logits; else p by the one transform, then invariant draws or sampling."""
    eos = sorted(config.eos_token_ids) or None
    if config.sampling.greedy:
        return rules.greedy(logits, eos)
    p = probs_from_logits(logits, config.sampling)
    return (rules.invariant if config.sampling.invariant else rules.sampled)(p, eos)


@dataclass(frozen=True)
class _ChainRules:
    """A chain's verifiers: ``drafted`` [1, k'], the first emitted token at position ``first``."""

    proposal: Proposal
    drafted: torch.Tensor
    generator: torch.Generator
    first: int

    def greedy(self, logits: torch.Tensor, eos: list[int] | None) -> Verdict:
        return greedy_verify(self.drafted, p=logits, eos_token_id=eos)

    def invariant(self, p: torch.Tensor, eos: list[int] | None) -> Verdict:
        positions = range(self.first, self.first + p.shape[1])
        targets = position_draws(p[0], self.generator.initial_seed(), positions).unsqueeze(0)  # [1, k'+1]
        return greedy_verify_targets(self.drafted, targets=targets, eos_token_id=eos)

    def sampled(self, p: torch.Tensor, eos: list[int] | None) -> Verdict:
        if self.proposal.q is None:
            return single_guess_sample(self.drafted, p=p, generator=self.generator, eos_token_id=eos)
        q = self.proposal.q.to(p.device).unsqueeze(0)  # [1, k', V]
        return rejection_sample(self.drafted, q=q, p=p, generator=self.generator, eos_token_id=eos)


@dataclass(frozen=True)
class _TreeRules:
    """A tree's verifiers: its ``tokens`` and ``parents`` [N], the root's child at position ``first``."""

    tree: TreeProposal
    tokens: torch.Tensor
    parents: torch.Tensor
    generator: torch.Generator
    first: int

    def greedy(self, logits: torch.Tensor, eos: list[int] | None) -> TreeVerdict:
        return tree_greedy_verify(self.tokens, self.parents, p=logits, eos_token_id=eos)

    def invariant(self, p: torch.Tensor, eos: list[int] | None) -> TreeVerdict:
        # each node's draw at its child's position, as scores that argmax to it
        positions = [self.first + d for d in self.tree.depth.tolist()]
        drawn = position_draws(p, self.generator.initial_seed(), positions)  # [N]
        scores = torch.zeros_like(p).scatter_(1, drawn.unsqueeze(1), 1.0)  # [N, V]
        return tree_greedy_verify(self.tokens, self.parents, p=scores, eos_token_id=eos)

    def sampled(self, p: torch.Tensor, eos: list[int] | None) -> TreeVerdict:
        q = None if self.tree.q is None else self.tree.q.to(p.device)  # [N, V]
        return tree_rejection_sample(
            self.tokens, self.parents, p=p, q=q, generator=self.generator, eos_token_id=eos
        )


def verify_chain(
    proposal: Proposal, logits: torch.Tensor, config: EngineConfig, generator: torch.Generator, first: int
) -> Verdict:
    """logits: [1, k'+1, V] target logits for the round, whose first emitted token is at position
    ``first``."""
    drafted = proposal.tokens.to(logits.device).unsqueeze(0)  # [1, k']
    return _verify(_ChainRules(proposal, drafted, generator, first), logits, config)


def verify_tree(
    tree: TreeProposal, logits: torch.Tensor, config: EngineConfig, generator: torch.Generator, first: int
) -> TreeVerdict:
    """logits: [N, V] target logits at the tree's nodes; the root's child is at position ``first``."""
    tokens, parents = tree.tokens.to(logits.device), tree.parents.to(logits.device)  # [N], [N]
    return _verify(_TreeRules(tree, tokens, parents, generator, first), logits, config)
