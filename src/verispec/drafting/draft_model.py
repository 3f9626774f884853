"""A draft model: a smaller model with the target's tokenizer (or the target's own first layers) drafting
autoregressively from its own rolled-back cache, as a chain (:class:`ModelDrafter`) or a tree of its top-k
or sampled children (:class:`ModelTreeDrafter`)."""

from __future__ import annotations

import torch
from torch import Tensor

from verispec.drafting.base import Allowed, BranchedTreeDrafter, Proposal, allowed_logits
from verispec.drafting.learned.exit import ExitDraft
from verispec.drafting.tree import TreeProposal, TreeShape
from verispec.errors import UsageError
from verispec.models.base import Cache, LanguageModel, TreeLanguageModel
from verispec.models.identity import model_identity
from verispec.models.llama import KVCache, Llama
from verispec.options import SamplingParams
from verispec.sampling import draft_draw, first_argmax, probs_from_logits

__all__ = ["ModelDrafter", "ModelTreeDrafter"]


class ModelDrafter:
    """A smaller language model with the target's tokenizer drafts autoregressively from its own cache.

    Its cache holds a prefix of the committed context; ``propose`` first feeds the committed tokens it has not
    seen (the last emitted token, or the last draft token and the bonus token after a fully accepted round),
    then samples k tokens one forward at a time. ``observe`` rolls the cache back to the committed part.

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
        self.cache = model.new_cache() if self.shared is None else self._shared_layers(*self.shared)
        self._committed = 0  # cache slots that hold committed tokens after the last proposal
        self._drafted = 0  # draft tokens fed to the cache by the last proposal

    @staticmethod
    def _shared_layers(target_cache: KVCache, num_layers: int) -> Cache:
        """A view of the target cache's first ``num_layers`` layers, as long as the target cache now is."""
        return target_cache.first_layers(num_layers)

    def begin(self, prompt: list[int]) -> None:
        self.cache.truncate(0)
        self._committed = self._drafted = 0

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        if self.shared is not None:
            self.cache = self._shared_layers(*self.shared)
        k = min(k, self.model.max_context - len(context))
        if k <= 0:
            self._committed, self._drafted = self.cache.length, 0
            return Proposal.empty()
        device = self.model.device
        self.read(context)
        feed = torch.tensor([context[self.cache.length :]], dtype=torch.long, device=device)  # [1, 1]
        self._committed = len(context)
        tokens: list[Tensor] = []
        qs = []
        for i in range(k):
            start = self.cache.length
            positions = torch.arange(start, start + feed.shape[1], device=device).unsqueeze(0)  # [1, T]
            raw = self.model.forward(feed, positions, self.cache)[0, -1]  # [V]
            logits = allowed_logits(raw, allowed, [int(t) for t in tokens])  # [V], masked by the grammar
            if logits is None:  # the grammar allows nothing more
                break
            if self.sampling.greedy:
                token = first_argmax(logits).view(1)
            else:
                q = probs_from_logits(logits, self.sampling)  # [V]
                token = draft_draw(q, generator, self.sampling, len(context) + i)
                qs.append(q)
            tokens.append(token)
            feed = token.view(1, 1)
        self._drafted = len(tokens) - 1 if len(tokens) == k else len(tokens)  # the last of k is never fed
        if not tokens:
            return Proposal.empty()
        return Proposal(tokens=torch.cat(tokens).cpu(), q=torch.stack(qs).cpu() if qs else None)

    def read(self, context: list[int]) -> None:
        """Feed the committed tokens its cache has not read, all but the last (whose logits a proposal
        needs): their keys and values only, no logits over the vocabulary at a prompt's positions."""
        unread = context[self.cache.length : -1]
        if unread:
            device, start = self.model.device, self.cache.length
            positions = torch.arange(start, start + len(unread), device=device).unsqueeze(0)  # [1, U]
            self.model.prefill(torch.tensor([unread], dtype=torch.long, device=device), positions, self.cache)

    def observe(self, num_accepted: int) -> None:
        self.cache.truncate(self._committed + min(num_accepted, self._drafted))

    def cost_identity(self) -> dict:
        identity: dict = {"drafter": self.name, "model": model_identity(self.model)}
        if isinstance(self.model, ExitDraft):  # a trained exit: its draft vocabulary's head
            identity["exit_draft_vocab"] = self.model.adapter.draft_vocab_size
            identity["exit_precision"] = self.model.adapter.cpu_precision
        return identity


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
