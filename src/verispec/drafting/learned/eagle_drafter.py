"""The learned drafter in the engine: an :class:`~verispec.drafting.learned.eagle.EagleHead` drafting from the
target's hidden states.

The engine hands the drafter the target's final hidden state of every committed position (a
:class:`~verispec.drafting.base.HiddenStateReader`: :meth:`EagleDrafter.observe_hidden`), so that when the
committed context is x_0..x_n the drafter holds f_0..f_{n-1} (x_n, the last committed token, has not been fed
to the target yet). The head's own cache holds one slot t per pair (x_{t+1}, f_t) with a *true* feature;
``propose`` feeds the pairs it has not seen yet — slots up to n − 1, whose output f̂_n gives the draft of
x_{n+1} — then drafts on its own predictions: slot n + i reads (x̂_{n+i+1}, f̂_{n+i}). ``observe`` rolls the
cache back to the true slots by moving its length (the next round overwrites the draft slots with true
features).

A catch-up reads at most :data:`CATCH_UP_WINDOW` of the pairs it has not seen, the last ones
(:attr:`EagleDrafter.catch_up_limit`; :class:`~verispec.drafting.base.BoundedCatchUp`): after a prompt, or a
stretch of rounds ``--k auto`` did not draft, the head's cache takes the last 64 pairs at their own positions,
and those before are never attended to (its slots then run behind the positions; the target's features carry
the context). Reading a 310-token prompt cost a probe 1.5 plain rounds on SmolLM2 (the head's first position
accepted 3 times in 10 there, so each probe must be cheap); greedy acceptance at K = 3 with the window, over 4
prompts of each of the bench's RAG, chat, summarization and math tasks: 0.127 / 0.174 / 0.153 / 0.505 against
0.130 / 0.178 / 0.153 / 0.481 reading everything (a window of 16: 0.127 / 0.178 / 0.140 / 0.384).

Each draft token is sampled with the engine's parameters from q, the distribution that probs_from_logits
gives for the full-vocabulary logits that are −inf outside the draft vocabulary. Every transform (temperature,
top-k, top-p, min-p, in that order, ties broken by token id) treats those −inf entries as impossible tokens,
so q is computed on the draft vocabulary alone, sampled there, and handed to the verifier with zeros
elsewhere: exactly the distribution the token was drawn from (greedy: the draft vocabulary's argmax,
q = None).

:class:`EagleTreeDrafter` branches the same head into a token tree (:mod:`verispec.drafting.base` states the
guarantees): node v at depth d reads the feature its parent's head forward predicted at position n + d − 1,
attending to the true-feature slots and its ancestors' slots — exactly what the chain drafter sees on v's
path — and its children are the head's top tokens (single guesses) or independent samples of its q. With a
dynamic shape (a node budget, :mod:`verispec.drafting.tree`) it grows the tree as EAGLE-2 does: each depth
expands only
the shape-width likeliest nodes of the depth before (by path probability: the product of the head's
probabilities along the path), and the round verifies the budget's likeliest draft nodes, or as many as the
cost model pays for; the children are always top tokens, verified as single guesses (choosing among sampled
children by their values would bias them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from verispec.costs.analytic import CostModel, best_tree_size, tree_rates
from verispec.drafting.base import (
    Allowed,
    DraftRow,
    HiddenStateTreeDrafter,
    Proposal,
    ProposesByRows,
    allowed_logits,
)
from verispec.drafting.learned.eagle import EagleHead
from verispec.drafting.tree import AUTO, TreeProposal, TreeShape, likeliest_nodes
from verispec.errors import UsageError
from verispec.inputs import check_int
from verispec.models.kv_cache import KVCache
from verispec.options import SamplingParams
from verispec.sampling import draft_draw, first_argmax, probs_from_logits

__all__ = ["CATCH_UP_WINDOW", "DEFAULT_TREE", "EagleDrafter", "EagleTreeDrafter"]

CATCH_UP_WINDOW = 64  # the most unread committed positions a catch-up feeds the head (module docstring)

# the tree `verispec generate` and `demo` draft with a learned drafter unless given a K or a tree: the three
# best first tokens, the best after the best; the fastest for the shipped drafter in docs/bench/small-trees.md
DEFAULT_TREE = TreeShape.from_paths([[0], [1], [2], [0, 0]], name="c4")


class EagleDrafter(ProposesByRows):
    """Drafts with a learned head reading the target's hidden states (module docstring). Beside a native
    target in a batch, its cache is a row of one the head holds for the batch (:meth:`EagleHead.cache_row`),
    and the rows' drafts run together (:meth:`propose_rows`)."""

    name = "eagle"

    def __init__(
        self,
        head: EagleHead,
        sampling: SamplingParams,
        cache: KVCache | None = None,
        window: int | None = CATCH_UP_WINDOW,
    ) -> None:
        """head: built for the target (its vocabulary is the target's); sampling: the engine's parameters;
        cache: the head's cache for this drafter (default: one of its own); window: the most unread
        positions a catch-up reads, the last ones (None: all)."""
        if window is not None:
            check_int(window, "window", 1)
        self.head = head
        self.sampling = sampling
        self.catch_up_limit = window
        self.cache = head.new_cache() if cache is None else cache
        capacity, hidden = self.cache.capacity, head.config.hidden_size
        self._features = torch.empty(capacity, hidden, device=head.inv_freq.device)  # [capacity, H]: f_0..
        self._num_features = 0
        self._read = 0  # the committed positions read (or skipped past): the true slots are the last of them
        self._committed = 0  # cache slots fed with true features
        self._next = torch.empty(1, 1, hidden, device=head.inv_freq.device)  # [1, 1, H]: f̂ after them
        self._next_logits: Tensor | None = None  # [Vd]: its draft logits, where computed

    @property
    def rows_key(self) -> object | None:
        """Drafters whose caches are rows of one of the head's propose together (:meth:`propose_rows`)."""
        whole = self.cache.whole
        return None if whole is None else (id(self.head), id(whole[0]))

    def begin(self, prompt: list[int]) -> None:
        self.cache.truncate(0)
        self._num_features = self._read = self._committed = 0
        self._next_logits = None

    def observe_hidden(self, hidden: Tensor) -> None:
        """hidden: [T, H], the target's final hidden states at the next T committed positions (wider beside
        a target that taps layers for another drafter, :meth:`~verispec.models.llama.Llama.tap_layers`: the
        first H columns read)."""
        end = self._num_features + hidden.shape[0]
        self._features[self._num_features : end] = hidden[:, : self._features.shape[1]]
        self._num_features = end

    def _ready(self, context: list[int]) -> bool:
        """Whether the target's states of the context are all in (none to draft from for a one-token one)."""
        n = len(context) - 1  # the last committed token's position
        return n > 0 and self._num_features >= n

    def _backlog(self, context: list[int]) -> tuple[Tensor, Tensor, Tensor] | None:
        """The true-feature pairs the head has not read, up to the last committed token's, the last
        ``catch_up_limit`` of them: (tokens [T], features [T, H], positions [T]); None when it read them all
        (proposing again for the same context)."""
        n, start = len(context) - 1, self._read
        if start >= n:
            return None
        if self.catch_up_limit is not None:
            start = max(start, n - self.catch_up_limit)
        device = self._features.device
        tokens = torch.tensor(context[start + 1 : n + 1], device=device)  # [T]
        return tokens, self._features[start:n], torch.arange(start, n, device=device)

    def _fed(self, context: list[int], predicted: Tensor, logits: Tensor | None = None) -> None:
        """The backlog of ``context`` went through the head, predicting ``predicted`` [T, H] (the last one's
        draft logits [Vd], where computed)."""
        self._next = predicted[-1:].unsqueeze(0)  # [1, 1, H]
        self._next_logits = logits
        self._read, self._committed = len(context) - 1, self.cache.length

    def catch_up(self, context: list[int]) -> Tensor | None:
        """Feeds the true-feature slots the head's cache lacks, up to the last committed token's, and returns
        f̂_n [1, 1, H], the feature the first draft token is read from; None when the context is one token or
        the target's states of the context are not all in."""
        if not self._ready(context):
            return None
        backlog = self._backlog(context)
        if backlog is not None:
            self._fed(context, self.head.forward_rows([(*backlog, self.cache)])[0])
        return self._next

    def _pick(self, logits: Tensor, generator: torch.Generator, position: int, qs: list[Tensor]) -> int:
        """The draft token (a target id) at ``position`` from the draft logits [Vd]: the argmax, or a draw
        from q (appended to ``qs``)."""
        ids = self.head.draft_vocab  # [Vd]: the target's ids
        if self.sampling.greedy:
            return int(ids[first_argmax(logits)])
        q_draft = probs_from_logits(logits, self.sampling)  # [Vd]
        qs.append(q_draft)
        return int(ids[draft_draw(q_draft, generator, self.sampling, position, ids)])

    @classmethod
    @torch.inference_mode()
    def propose_rows(cls, rows: Sequence[DraftRow]) -> list[Proposal]:
        """Every row's proposal, the rows' head forwards run together: the backlogs in one forward
        (:meth:`EagleHead.feed_rows`), then greedy rows without a grammar to the end in one call
        (:meth:`EagleHead.greedy_rows`, on the native kernels) and the others one forward per draft position
        (:meth:`EagleHead.step_rows`): each row's proposal is exactly its own ``propose``'s."""
        drafters = [cast(EagleDrafter, row.drafter) for row in rows]
        head = drafters[0].head
        ns = [len(row.context) - 1 for row in rows]  # each row's last committed position
        ks = [  # draft slots n .. n + k - 2
            min(row.k, d.cache.capacity - n + 1) if row.k > 0 and d._ready(row.context) else 0
            for row, d, n in zip(rows, drafters, ns, strict=True)
        ]
        live = [i for i, k in enumerate(ks) if k > 0]
        fed = [(i, b) for i in live if (b := drafters[i]._backlog(rows[i].context)) is not None]
        if fed:
            last, last_logits = head.feed_rows([(*b, drafters[i].cache) for i, b in fed])  # [F, H], [F, Vd]
            for (i, _), feature, logits_row in zip(fed, last, last_logits, strict=True):
                drafters[i]._fed(rows[i].context, feature[None], logits_row)
        features = {i: drafters[i]._next[0, 0] for i in live}  # [H] each: f̂ the next draft is read from
        logits = {i: drafters[i]._next_logits for i in live}  # [Vd] each: the next draft's logits
        unread = [i for i in live if logits[i] is None]  # caught up without logits (a tree round's catch_up)
        if unread:
            logits.update(zip(unread, head.logits(torch.stack([features[i] for i in unread])), strict=True))
        drafts: dict[int, list[int]] = {i: [] for i in live}  # each row's draft tokens
        qs: dict[int, list[Tensor]] = {i: [] for i in live}  # [Vd] each: q of each draft token
        for step in range(max(ks, default=0)):
            going = []  # the rows drafting a further token after this one
            for i in live:
                row, row_logits = rows[i], logits[i]  # [Vd]
                if step >= ks[i] or len(drafts[i]) != step:  # done (greedily too), or stopped by a grammar
                    continue
                assert row_logits is not None  # read above
                if row.allowed is not None:  # masked after the drafts so far (None: it allows nothing more)
                    row_logits = allowed_logits(row_logits, row.allowed, drafts[i], head.draft_vocab)
                    if row_logits is None:
                        continue
                drafts[i].append(drafters[i]._pick(row_logits, row.generator, ns[i] + 1 + step, qs[i]))
                if step < ks[i] - 1:
                    going.append(i)
            if step == 0:  # greedy rows without a grammar draft the rest in one call
                plain = [i for i in going if rows[i].allowed is None and drafters[i].sampling.greedy]
                if plain and cls._greedy(head, plain, drafts, features, ns, ks, drafters):
                    going = [i for i in going if i not in plain]
            if not going:
                break
            predicted, next_logits = head.step_rows(
                [drafts[i][-1] for i in going],
                torch.stack([features[i] for i in going]),  # [G, H]
                [ns[i] + step for i in going],
                [drafters[i].cache for i in going],
            )
            features.update(zip(going, predicted, strict=True))
            logits.update(zip(going, next_logits, strict=True))
        proposals = []
        for i in range(len(rows)):
            if not drafts.get(i):
                proposals.append(Proposal.empty())
                continue
            q = head.full_q(torch.stack(qs[i])).cpu() if qs[i] else None  # [K', V]
            proposals.append(Proposal(tokens=torch.tensor(drafts[i]), q=q))
        return proposals

    @staticmethod
    def _greedy(
        head: EagleHead,
        plain: list[int],
        drafts: dict[int, list[int]],
        features: dict[int, Tensor],
        ns: list[int],
        ks: list[int],
        drafters: list[EagleDrafter],
    ) -> bool:
        """The ``plain`` rows' further greedy drafts after their first, in one native call, appended to
        ``drafts``; False (nothing drafted) where the head is not on the native kernels."""
        more = head.greedy_rows(
            [drafts[i][-1] for i in plain],
            torch.stack([features[i] for i in plain]),  # [P, H]
            [ns[i] for i in plain],
            [drafters[i].cache for i in plain],
            [ks[i] - 1 for i in plain],
        )
        if more is None:
            return False
        for i, tokens in zip(plain, more, strict=True):
            drafts[i] += tokens
        return True

    def observe(self, num_accepted: int) -> None:
        self.cache.truncate(self._committed)

    def cost_identity(self) -> dict:
        """Its head's size (draft vocabulary and layers; the rest is the target's), fast path and catch-up
        window."""
        identity = self.head.cost_identity(self.name, layers=self.head.num_layers)
        return {**identity, "catch_up_limit": self.catch_up_limit}


class EagleTreeDrafter(HiddenStateTreeDrafter):
    """The learned head's token tree (module docstring): at every node of the shape, its children are the
    head's c most likely next tokens on the draft vocabulary (c = the node's children in the shape;
    deterministic, verified as single guesses), or with ``sampled`` (and a temperature > 0) c independent
    samples of its q, verified with q. Each depth is one head forward over that depth's inner nodes; the
    head's cache is cut back to the true-feature slots after the round."""

    name = "eagle"
    dynamic = True  # takes shapes with a node budget
    drafter: EagleDrafter

    def __init__(
        self, drafter: EagleDrafter, shape: TreeShape, sampled: bool = False, cost: CostModel | None = None
    ) -> None:
        """cost: the calibrated costs of target and head, which a dynamic shape of budget "auto" sizes its
        trees by (and stops expanding where a further head forward would not pay for itself)."""
        if shape.budget is not None and sampled and not drafter.sampling.greedy:
            raise UsageError(
                f"the dynamic tree {shape.name} verifies top-k children as single guesses: "
                "it cannot sample them"
            )
        if shape.budget == AUTO and cost is None:
            raise UsageError(
                f"the dynamic tree {shape.name} is sized by the cost model: give the calibrated costs"
            )
        super().__init__(drafter, shape, sampled)
        self.cost = cost

    @torch.inference_mode()
    def propose_tree(
        self, context: list[int], shape: TreeShape, generator: torch.Generator, allowed: Allowed | None = None
    ) -> TreeProposal:
        drafter, head = self.drafter, self.drafter.head
        root_feature = drafter.catch_up(context)  # [1, 1, H]
        committed = drafter.cache.length
        if root_feature is None or committed >= drafter.cache.capacity:
            return shape.select([0], [context[-1]])
        shape = shape.capped(shape.max_depth, drafter.cache.capacity - committed)  # inner nodes take slots
        children, dynamic = shape.children(), shape.budget is not None
        beam = max(map(len, children))  # the nodes a dynamic tree expands per depth: the shape's width
        tokens, q_rows, scores = {0: context[-1]}, {}, {0: 1.0}  # scores: path probabilities (dynamic)
        features = {0: root_feature[0, 0]}  # node → the feature its children are drafted from [H]
        slots: dict[int, list[int]] = {}  # inner node → its inner ancestors' slots in the cache, then its own
        frontier, forwards = [0], 1  # forwards: the head forwards of the round, the catch-up included
        for depth in range(1, shape.max_depth + 1):
            logits = head.logits(torch.stack([features[node] for node in frontier]))  # [M, Vd]
            probs = self._confidence(logits) if dynamic else None  # [M, Vd]
            for i, node in enumerate(frontier):
                position = len(context) + depth - 1  # the children's
                path = self._path(node, tokens, shape.parent_list)
                node_logits = allowed_logits(logits[i], allowed, path, head.draft_vocab)  # [Vd]
                if node_logits is None:  # the grammar allows nothing after it: a leaf
                    continue
                picked, q = self._pick(
                    node_logits, len(children[node]), generator, position, head.draft_vocab
                )
                q_row = None if q is None else head.full_q(q)  # [V]
                chosen = head.draft_vocab[picked].tolist()
                # fewer children where the draft vocabulary ran out
                for child, token in zip(children[node], chosen, strict=False):
                    tokens[child], q_rows[child] = token, q_row
                if probs is not None:  # dynamic
                    for child, p in zip(children[node], probs[i, picked].tolist(), strict=False):
                        scores[child] = scores[node] * p
            frontier = [c for node in frontier for c in children[node] if c in tokens and children[c]]
            if dynamic:  # only the beam's likeliest are expanded, breadth-first
                frontier = sorted(sorted(frontier, key=lambda c: (-scores[c], c))[:beam])
            if not frontier or (dynamic and not self._worth_expanding(frontier, scores, forwards)):
                break
            out = self._forward(frontier, depth, tokens, features, slots, shape, committed, len(context) - 1)
            features.update(zip(frontier, out, strict=True))
            forwards += 1
        drafter.cache.truncate(committed)
        if dynamic:
            nodes = sorted(tokens)
            ranked = [scores[v] for v in nodes]  # [M]: the root first
            count = shape.budget
            if count == AUTO:
                assert self.cost is not None  # __init__ refuses an "auto" budget without the costs
                count = best_tree_size(sorted(ranked[1:], reverse=True), self.cost, forwards)
            assert isinstance(count, int)  # a dynamic shape's budget: an integer or "auto", sized just above
            tokens = {nodes[i]: tokens[nodes[i]] for i in likeliest_nodes(ranked, count)}
        return self._proposal(shape, context[-1], tokens, q_rows)

    def _worth_expanding(self, frontier: list[int], scores: dict[int, float], forwards: int) -> bool:
        """Whether the ``frontier`` nodes are worth one more head forward: always without the cost model;
        with it, when the children they could add — at most their own path probabilities in expected
        accepted tokens — would pay for the forward at the rate the round reaches without them."""
        if self.cost is None:
            return True
        drafted = sorted((s for node, s in scores.items() if node), reverse=True)
        rate = float(tree_rates(drafted, self.cost, forwards).max())
        return sum(scores[node] for node in frontier) >= rate * self.cost.cost_ratio

    def _confidence(self, logits: Tensor) -> Tensor:
        """The head's probabilities [M, Vd] from its logits [M, Vd]: a single guess's chance of acceptance
        when the head is calibrated (greedy: the softmax; else after the engine's sampling transform)."""
        sampling = self.drafter.sampling
        return logits.softmax(-1) if sampling.greedy else probs_from_logits(logits, sampling)

    def _forward(
        self,
        frontier: list[int],
        depth: int,
        tokens: dict[int, int],
        features: dict[int, Tensor],
        slots: dict[int, list[int]],
        shape: TreeShape,
        committed: int,
        n: int,
    ) -> Tensor:
        """The head's predicted features [M, H] after the ``frontier`` nodes (all of depth ``depth``): node v
        reads its token and its parent's feature at position n + depth − 1, attending to the ``committed``
        true-feature slots, its ancestors' slots and itself; records the slots of each node's lineage."""
        head, cache = self.drafter.head, self.drafter.cache
        device, base, m = head.inv_freq.device, cache.length, len(frontier)
        parents = shape.parent_list
        feed = torch.tensor([[tokens[v] for v in frontier]], device=device)  # [1, M]
        inputs = torch.stack([features[parents[v]] for v in frontier]).unsqueeze(0)  # [1, M, H]
        positions = torch.full((1, m), n + depth - 1, device=device)  # [1, M]
        mask = torch.zeros(m, base + m, dtype=torch.bool, device=device)  # [M, base + M]
        mask[:, :committed] = True
        for i, v in enumerate(frontier):
            slots[v] = [*slots.get(parents[v], ()), base + i]  # its inner ancestors' slots, then its own
            mask[i, slots[v]] = True
        return head(feed, inputs, positions, cache, mask)[0]
