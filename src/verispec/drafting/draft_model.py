"""A draft model: a smaller model with the target's tokenizer (or the target's own first layers) drafting
autoregressively from its own rolled-back cache, as a chain (:class:`ModelDrafter`) or a tree of its top-k
or sampled children (:class:`ModelTreeDrafter`)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from verispec.drafting.base import (
    Allowed,
    BranchedTreeDrafter,
    DraftRow,
    Proposal,
    allowed_logits,
    common_prefix,
)
from verispec.drafting.learned.exit import ExitDraft
from verispec.drafting.tree import TreeProposal, TreeShape
from verispec.errors import UsageError
from verispec.models.base import Cache, LanguageModel, RowInput, TreeLanguageModel
from verispec.models.identity import model_identity
from verispec.models.kv_cache import KVCache, RowsBeside
from verispec.models.llama import NATIVE_CHUNK, Llama
from verispec.options import SamplingParams
from verispec.sampling import draft_draw, first_argmax, probs_from_logits

__all__ = ["ModelDrafter", "ModelTreeDrafter", "draft_cache_row"]


class ModelDrafter:
    """A smaller language model with the target's tokenizer drafts autoregressively from its own cache.

    Its cache holds a prefix of the committed context; ``propose`` first feeds the committed tokens it has not
    seen (the last emitted token, or the last draft token and the bonus token after a fully accepted round),
    then samples k tokens one forward at a time. ``observe`` rolls the cache back to the committed part.

    Beside an engine's slots (``slot``, a row of the target's whole cache) a draft on the native kernels keeps
    its cache in the same row of a whole cache of its own (:func:`draft_cache_row`): the drafters of a batch's
    rows then read and draft together, one forward over all their rows a draft position
    (:meth:`propose_rows`, a :class:`~verispec.drafting.base.RowDrafter`), each row's proposal bit for bit its
    own (a row's outputs never depend on the other rows of a forward).

    An early-exit draft (the target's own first layers, :meth:`verispec.models.llama.Llama.first_layers`)
    may instead share the target's cache (``target_cache``): those layers of it hold every committed token
    but the last (the engine's invariant between rounds), as the draft itself would compute them, so each
    proposal starts from a view of them and feeds only the last token: no cache of its own to fill, not even
    after rounds at K = 0. The slots it writes beyond the committed ones are those that the target's next
    forward overwrites before reading them.
    """

    name = "model"

    def __init__(
        self,
        model: LanguageModel,
        sampling: SamplingParams,
        target_vocab_size: int,
        target_cache: Cache | None = None,
        slot: Cache | None = None,
    ) -> None:
        if model.vocab_size != target_vocab_size:
            raise UsageError(
                f"draft vocabulary ({model.vocab_size} tokens) differs from the target's "
                f"({target_vocab_size}): the draft must use the target's tokenizer"
            )
        self.model = model
        self.sampling = sampling
        self.shared: tuple[KVCache, int] | None = None  # an early exit's: the target's cache, the layers read
        if target_cache is not None:
            if not isinstance(target_cache, KVCache) or not isinstance(model, Llama | ExitDraft):
                raise UsageError(
                    "only a native draft (an early exit, layers:N, or a trained exit) can read the "
                    "target's cache"
                )
            self.shared = (target_cache, model.config.num_layers)
        self.cache = (
            draft_cache_row(model, slot) if self.shared is None else self._shared_layers(*self.shared)
        )
        self._committed = 0  # cache slots that hold committed tokens after the last proposal
        self._drafted = 0  # draft tokens fed to the cache by the last proposal

    @staticmethod
    def _shared_layers(target_cache: KVCache, num_layers: int) -> Cache:
        """A view of the target cache's first ``num_layers`` layers, as long as the target cache now is."""
        return target_cache.first_layers(num_layers)

    @property
    def rows_key(self) -> object | None:
        """Drafters whose caches are rows of one whole cache of one draft's propose together."""
        whole = self.cache.whole if isinstance(self.cache, KVCache) and self.shared is None else None
        return None if whole is None else (id(self.model), id(whole[0]))

    def begin(self, prompt: list[int]) -> None:
        """A new sequence: its cache emptied, or (a row beside the engine's slots) cut back to the start of
        ``prompt`` that the row's last sequence left in it (a conversation's next turn: its earlier turns are
        not read again), all but the prompt's last token."""
        context, drafts = _HELD.get(self.cache, ([], [])) if self.rows_key is not None else ([], [])
        held = [*context, *drafts][: min(self.cache.length, len(prompt) - 1)]
        self.cache.truncate(common_prefix(held, prompt))
        self._committed = self._drafted = 0

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        return self.propose_rows([DraftRow(self, context, k, generator, allowed)])[0]

    @classmethod
    def propose_rows(cls, rows: Sequence[DraftRow]) -> list[Proposal]:
        """Every row's proposal: each row's unread committed tokens read, then one forward a draft position
        over the rows still drafting (all rows' in one forward where they share a :attr:`rows_key`, else a
        single row), k tokens sampled (or the greedy pick) from each row's logits, masked by its grammar."""
        drafters = [cast(ModelDrafter, row.drafter) for row in rows]
        for drafter in drafters:
            if drafter.shared is not None:
                drafter.cache = drafter._shared_layers(*drafter.shared)
        ks = [
            min(row.k, d.model.max_context - len(row.context)) for row, d in zip(rows, drafters, strict=True)
        ]
        live = [i for i, k in enumerate(ks) if k > 0]
        for i, drafter in enumerate(drafters):  # what observe rolls back to: the context, or what is held
            drafter._committed = len(rows[i].context) if i in live else drafter.cache.length
            drafter._holds(rows[i].context, [])  # its cache holds a start of the context from here on
            if i in live and drafter.cache.length >= len(rows[i].context):  # asked again after observe(0)
                drafter.cache.truncate(len(rows[i].context) - 1)  # (a batch's call failed): its last again
        cls._read([drafters[i] for i in live], [rows[i].context for i in live])
        feeds = {i: rows[i].context[drafters[i].cache.length :] for i in live}  # [1] each: the last token
        drafts: dict[int, list[int]] = {i: [] for i in live}
        qs: dict[int, list[Tensor]] = {i: [] for i in live}  # [V] each: q of each draft token
        while feeds:
            going = list(feeds)
            logits = cls._forward([drafters[i] for i in going], [feeds[i] for i in going])  # [V] each
            feeds = {}
            for i, raw in zip(going, logits, strict=True):
                row, drafter = rows[i], drafters[i]
                masked = allowed_logits(raw, row.allowed, drafts[i])  # [V], masked by the grammar
                if masked is None:  # the grammar allows nothing more
                    continue
                drafts[i].append(
                    drafter._pick(masked, row.generator, len(row.context) + len(drafts[i]), qs[i])
                )
                if len(drafts[i]) < ks[i]:
                    feeds[i] = drafts[i][-1:]
        proposals = []
        for i, drafter in enumerate(drafters):
            tokens = drafts.get(i, [])
            drafter._holds(rows[i].context, tokens)  # and of its drafts after it, once fed
            drafter._drafted = len(tokens) - (0 < len(tokens) == ks[i])  # the last of k is never fed
            if not tokens:
                proposals.append(Proposal.empty())
                continue
            q = torch.stack(qs[i]).cpu() if qs[i] else None  # [K', V]
            proposals.append(Proposal(tokens=torch.tensor(tokens), q=q))
        return proposals

    def _holds(self, context: list[int], drafts: list[int]) -> None:
        """A row's cache holds a start of ``context`` and ``drafts`` after it (what :meth:`begin` keeps for
        its next sequence; referenced, not copied: a round's context is a list of its own)."""
        if self.rows_key is not None:
            _HELD[self.cache] = (context, drafts)

    def _pick(self, logits: Tensor, generator: torch.Generator, position: int, qs: list[Tensor]) -> int:
        """The draft token at ``position`` from its logits [V]: the greedy pick, or a draw from q (appended
        to ``qs``)."""
        if self.sampling.greedy:
            return int(first_argmax(logits))
        q = probs_from_logits(logits, self.sampling)  # [V]
        qs.append(q)
        return int(draft_draw(q, generator, self.sampling, position))

    @staticmethod
    def _forward(drafters: Sequence[ModelDrafter], feeds: Sequence[list[int]]) -> list[Tensor]:
        """Each drafter's next logits [V] after its ``feeds`` (one token each), appended to its cache: one
        forward over rows of one whole cache, else one forward."""
        model = drafters[0].model
        if len(drafters) > 1 or drafters[0].rows_key is not None:
            assert isinstance(model, Llama)  # rows of one cache: a native Llama's (draft_cache_row)
            out = model.forward_rows(
                [_row_input(d.cache, feed, logits=True) for d, feed in zip(drafters, feeds, strict=True)]
            )
            return [logits[-1] for logits, _ in out if logits is not None]
        (drafter,), (feed,) = drafters, feeds
        start, device = drafter.cache.length, model.device
        positions = torch.arange(start, start + len(feed), device=device).unsqueeze(0)  # [1, T]
        return [model.forward(torch.tensor([feed], device=device), positions, drafter.cache)[0, -1]]

    @staticmethod
    def _read(drafters: Sequence[ModelDrafter], contexts: Sequence[list[int]]) -> None:
        """Feed each drafter the committed tokens its cache has not read, all but the last (whose logits a
        proposal needs): their keys and values only, no logits over the vocabulary at a prompt's positions;
        rows of one whole cache together, in blocks of at most NATIVE_CHUNK tokens a row."""
        unread = [(d, c[d.cache.length : -1]) for d, c in zip(drafters, contexts, strict=True)]
        unread = [(d, tokens) for d, tokens in unread if tokens]
        if len(unread) == 1 and unread[0][0].rows_key is None:
            ((drafter, tokens),) = unread
            model, start = drafter.model, drafter.cache.length
            positions = torch.arange(start, start + len(tokens), device=model.device).unsqueeze(0)  # [1, U]
            model.prefill(torch.tensor([tokens], device=model.device), positions, drafter.cache)
            return
        for block in range(0, max((len(tokens) for _, tokens in unread), default=0), NATIVE_CHUNK):
            part = [(d, tokens[block : block + NATIVE_CHUNK]) for d, tokens in unread if len(tokens) > block]
            model = part[0][0].model
            assert isinstance(model, Llama)  # rows of one cache: a native Llama's (draft_cache_row)
            model.forward_rows([_row_input(d.cache, tokens, logits=False) for d, tokens in part])

    def read(self, context: list[int]) -> None:
        """Feed the committed tokens its cache has not read, all but the last (:meth:`_read`)."""
        self._read([self], [context])

    def observe(self, num_accepted: int) -> None:
        self.cache.truncate(self._committed + min(num_accepted, self._drafted))

    def cost_identity(self) -> dict:
        identity: dict = {"drafter": self.name, "model": model_identity(self.model)}
        if isinstance(self.model, ExitDraft):  # a trained exit: its draft vocabulary's head
            identity["exit_draft_vocab"] = self.model.adapter.draft_vocab_size
            identity["exit_precision"] = self.model.adapter.cpu_precision
        return identity


def _row_input(cache: Cache, tokens: list[int], logits: bool) -> RowInput:
    """A row of a batched forward: ``tokens`` at the next slots of ``cache``."""
    start = cache.length
    return RowInput(
        cache,
        torch.tensor(tokens),
        torch.arange(start, start + len(tokens)),
        None,
        logits=logits,
        hidden=False,
    )


_HELD: weakref.WeakKeyDictionary[Cache, tuple[list[int], list[int]]] = weakref.WeakKeyDictionary()  # a draft
# row's cache holds a start of its last proposal's context and drafts: what the row's next sequence may keep

_ROWS: weakref.WeakKeyDictionary[LanguageModel, RowsBeside] = weakref.WeakKeyDictionary()  # a draft's rows


def draft_cache_row(model: LanguageModel, slot: Cache | None) -> Cache:
    """The draft's cache for a sequence whose target cache is ``slot``: where that is row r of a whole cache
    of R rows (an engine's slots) and the draft runs on the native kernels, row r of an R-row cache of the
    draft's own (made once per whole target cache: every sequence drafting in that engine has a row of it,
    and their drafts run in one forward, :meth:`ModelDrafter.propose_rows`); else a cache of its own."""
    if not (isinstance(model, Llama) and model.on_native_kernels) or not RowsBeside.fits(slot):
        return model.new_cache()
    assert isinstance(slot, KVCache)  # fits
    return _ROWS.setdefault(model, RowsBeside()).row(slot, model.new_cache_rows)


class ModelTreeDrafter(BranchedTreeDrafter):
    """A draft model's tree: at every node of the shape, its children are the draft's ``c`` most likely next
    tokens (c = the node's children in the shape; deterministic, verified as single guesses), or with
    ``sampled`` (and a sampling temperature > 0) c independent samples of the draft's q, verified with q.

    The draft is a :class:`~verispec.drafting.draft_model.ModelDrafter` (its own cache, or an early exit
    reading the target's). Its cache first takes the committed tokens it has not seen, the root last; then
    each depth's children come from one tree-attention forward over the tree's inner nodes so far, after which
    the cache is cut back to the committed tokens: no draft slot outlives the round."""

    name = "model"
    drafter: ModelDrafter

    def __init__(self, drafter: ModelDrafter, shape: TreeShape, sampled: bool = False) -> None:
        if not isinstance(drafter.model, TreeLanguageModel):
            raise UsageError(
                f"token trees need a draft model that takes a tree mask, not a {type(drafter.model).__name__}"
            )
        super().__init__(drafter, shape, sampled)
        self.tree_model: TreeLanguageModel = drafter.model

    def propose_tree(
        self, context: list[int], shape: TreeShape, generator: torch.Generator, allowed: Allowed | None = None
    ) -> TreeProposal:
        self.drafter.propose(context, 0, generator)  # drafts nothing: brings an early exit's cache view up
        model, cache = self.drafter.model, self.drafter.cache
        committed = len(context)
        if committed >= cache.capacity:  # no room left in the draft's context: the root alone
            return shape.select([0], [context[-1]])
        shape = shape.capped(shape.max_depth, cache.capacity - committed)
        self.drafter.read(context)
        feed = torch.tensor([context[cache.length :]], dtype=torch.long, device=model.device)  # [1, 1]
        positions = torch.arange(cache.length, committed, device=model.device).unsqueeze(0)  # [1, T]
        logits = {0: model.forward(feed, positions, cache)[0, -1]}  # node → the draft's next logits [V]
        children, parents = shape.children(), shape.parent_list
        tokens, q_rows = {0: context[-1]}, {}
        for depth in range(1, shape.max_depth + 1):
            for node, raw in logits.items():
                node_logits = allowed_logits(raw, allowed, self._path(node, tokens, parents))  # [V]
                if node_logits is None:  # the grammar allows nothing after it: a leaf
                    continue
                picked, q = self._pick(node_logits, len(children[node]), generator, committed + depth - 1)
                for child, token in zip(children[node][: len(picked)], picked.tolist(), strict=True):
                    tokens[child], q_rows[child] = token, q
            inner = [n for n in sorted(tokens) if n and children[n]]  # their children come from the draft
            frontier = [n for n in inner if int(shape.depth[n]) == depth]  # the last ones (BFS order)
            if not frontier:
                break
            logits = dict(
                zip(frontier, self._score(shape, inner, tokens, committed)[-len(frontier) :], strict=True)
            )
        return self._proposal(shape, context[-1], tokens, q_rows)

    def _score(self, shape: TreeShape, inner: list[int], tokens: dict[int, int], committed: int) -> Tensor:
        """The draft's logits [len(inner), V] at the inner nodes (ascending, ancestors of one another first),
        from one tree-attention forward after the committed tokens; the cache is cut back after it."""
        model, cache = self.tree_model, self.drafter.cache
        index = torch.tensor(inner, dtype=torch.long)  # [M]
        feed = torch.tensor([[tokens[n] for n in inner]], dtype=torch.long, device=model.device)  # [1, M]
        positions = (committed - 1 + shape.depth[index]).to(model.device).unsqueeze(0)  # [1, M]
        mask = shape.mask[index][:, index].to(model.device)  # [M, M]
        logits = model.forward(feed, positions, cache, tree_mask=mask)[0]  # [M, V]
        cache.truncate(committed)
        return logits
