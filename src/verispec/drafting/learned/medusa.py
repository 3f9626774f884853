"""Medusa heads (Cai et al. 2024; blockwise parallel decoding, Stern et al. 2018): K heads on the target's
final hidden state, head i predicting the token i + 1 positions after the state's own next token.

At position t the target's final hidden state f_t gives (through its own head) the logits of x_{t+1}; head
i = 1..K reads the same f_t and gives the logits of x_{t+1+i}, over the draft vocabulary, through the target's
frozen head rows::

    f_t → f_t + SiLU(W_i f_t + b_i) → target head rows → logits of x_{t+1+i}

(Medusa-1's residual block; W_i starts at zero, so an untrained head repeats the target's own next token.) The
file holds the K blocks in float16 and the heads' measured held-out top-r accuracies, from which the token
tree is shaped (:func:`medusa_tree`).

Drafting: when the committed context is x_0..x_n, the drafter holds f_{n-1} (the state that predicted x_n),
and draft token i (for x_{n+i}) comes from head i alone: one forward of all heads per round, no draft cache,
nothing to roll back.

**Which q, and why rejection sampling stays exact.** Draft token i is sampled from q_i, head i's distribution
(after the engine's sampling transform, zeros outside the draft vocabulary), which does *not* condition on the
draft tokens 1..i−1 before it. The verifier needs, for token i, the distribution it was actually drawn from
given the context and the draft tokens before it; the heads are sampled independently, so that conditional
distribution is q_i itself. Rejection sampling with q_i then accepts x with min(1, p/q_i) and otherwise
samples the residual of p against q_i — the standard argument, which never assumes that q_i is a good model
of p, only that it is the distribution x came from. A Medusa q is a poor guess at p after an earlier draft
token it did not see, but never a wrong one. The enumeration suite proves it with a toy drafter of this kind.

Trees: node v at depth d draws its children from head d — its top tokens (single guesses, the same for every
node of the depth) or independent samples of q_d (one draw per child, the tree guarantee of
:mod:`verispec.drafting.base`). The shape is Medusa's sparse tree: the nodes whose paths are likeliest by the
heads' held-out top-r accuracies (:func:`medusa_tree`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.drafting.base import (
    Allowed,
    DraftRow,
    HiddenStateTreeDrafter,
    Proposal,
    ProposesByRows,
    allowed_logits,
)
from verispec.drafting.learned.head import LearnedHead, shape_count
from verispec.drafting.tree import TreeProposal, TreeShape
from verispec.errors import UsageError
from verispec.inputs import is_int
from verispec.models.base import LanguageModel
from verispec.models.llama import Llama, _Linear
from verispec.options import SamplingParams
from verispec.sampling import draft_draw, first_argmax, probs_from_logits

__all__ = ["DEFAULT_NODES", "MAX_HEADS", "MedusaDrafter", "MedusaHeads", "MedusaTreeDrafter", "medusa_tree"]

MAX_HEADS = 8  # the most heads a file may hold
TOP_RANKS = 4  # the ranks whose held-out accuracy a file records per head
DEFAULT_NODES = 8  # draft nodes of the default tree (the root not counted)


class MedusaHeads(LearnedHead):
    """K Medusa heads of a target (module docstring). Trainable: ``blocks``."""

    kind = "medusa"

    def __init__(
        self, target: LanguageModel, draft_vocab: Tensor, metadata: dict[str, Any], num_heads: int = 4
    ) -> None:
        super().__init__(target, draft_vocab, metadata)
        if not is_int(num_heads) or not 1 <= num_heads <= MAX_HEADS:
            raise UsageError(f"Medusa has 1 to {MAX_HEADS} heads, got {num_heads!r}")
        h = self.hidden_size
        self.blocks = nn.ModuleList(
            [_Linear(h, h, True, self.device, torch.float32) for _ in range(num_heads)]
        )

    def fresh_start(self, target: Llama) -> None:
        """Zero blocks: each head starts as the target's own next-token head."""
        for block in self.blocks:
            assert isinstance(block, _Linear)  # what __init__ fills the ModuleList with
            block.weight.zero_()

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, features: Tensor, heads: int | None = None) -> Tensor:
        """features: [M, H], f_t → the first ``heads`` (default all) heads' features [M, heads, H] float32."""
        f = features.float()  # [M, H]
        count = self.num_heads if heads is None else heads
        return torch.stack([f + F.silu(block(f)) for block in self.blocks[:count]], dim=1)

    def shape_metadata(self) -> dict[str, str]:
        return {"num_heads": str(self.num_heads)}

    @classmethod
    def from_shape(
        cls, target: Llama, draft_vocab: Tensor, info: dict[str, Any], shape: dict[str, str], path: Path
    ) -> MedusaHeads:
        return cls(target, draft_vocab, info, shape_count(shape, "num_heads", 1, MAX_HEADS, "", path))

    @property
    def rank_accuracy(self) -> list[list[float]]:
        """Held-out accuracy of each head's rank-r token (r = 0..TOP_RANKS-1): [heads][ranks], from the
        training record ([]: none recorded)."""
        table = self.training_record.get("heldout_rank_accuracy")
        return [[float(a) for a in row] for row in table] if isinstance(table, list) else []


def medusa_tree(rank_accuracy: list[list[float]], nodes: int = DEFAULT_NODES) -> TreeShape:
    """Medusa's sparse tree: the ``nodes`` likeliest draft nodes, a node at depth d of child rank r being
    worth its parent's value × rank_accuracy[d − 1][r] (the root 1), grown best-first, so every node's
    ancestors and older siblings come before it. UsageError without accuracies or nodes."""
    if not rank_accuracy or not all(rank_accuracy) or nodes < 1:
        raise UsageError("a Medusa tree needs the heads' held-out accuracies and at least one node")
    paths: list[list[int]] = []
    frontier = [(-rank_accuracy[0][0], [0], 1.0)]  # (−value, path of child ranks, the parent's value)
    while frontier and len(paths) < nodes:
        value, path, parent = heapq.heappop(frontier)
        paths.append(path)
        depth, rank = len(path), path[-1]
        if rank + 1 < len(rank_accuracy[depth - 1]):  # its next sibling
            worth = parent * rank_accuracy[depth - 1][rank + 1]
            heapq.heappush(frontier, (-worth, [*path[:-1], rank + 1], parent))
        if depth < len(rank_accuracy):  # its first child
            heapq.heappush(frontier, (value * rank_accuracy[depth][0], [*path, 0], -value))
    return TreeShape.from_paths(paths, name=f"medusa{len(paths)}")


class MedusaDrafter(ProposesByRows):
    """Drafts with Medusa heads (module docstring): a :class:`~verispec.drafting.base.HiddenStateReader`
    keeping the last committed position's hidden state; a :class:`~verispec.drafting.base.RowDrafter` on the
    native kernels (the rows of a batch through the heads in one call)."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, sampling: SamplingParams) -> None:
        """heads: built for the target; sampling: the engine's parameters."""
        self.heads = heads
        self.sampling = sampling
        self._last = torch.zeros(1, heads.hidden_size, device=heads.device)  # [1, H]: the latest state
        self._num_features = 0  # the states this request has handed over; _last is stale while 0

    def begin(self, prompt: list[int]) -> None:
        self._num_features = 0

    def observe_hidden(self, hidden: Tensor) -> None:
        """hidden: [T, H], the target's final hidden states at the next T committed positions (wider beside
        a target that taps layers for another drafter: the first H columns read)."""
        if hidden.shape[0]:
            self._last = hidden[-1:, : self.heads.hidden_size].float()
            self._num_features += hidden.shape[0]

    @property
    def rows_key(self) -> object | None:
        """Drafters of one set of heads on the native kernels (each row computed alone) propose together
        (:meth:`propose_rows`)."""
        return id(self.heads) if self.heads.rows_alone else None

    def _ready(self, context: list[int]) -> bool:
        """Whether the target's state of the last committed position but one is in (the drafter has seen the
        whole context: a one-token prompt, whose first round has no state to read, must not read the
        previous request's)."""
        return self._num_features != 0 and self._num_features == len(context) - 1

    def head_logits(self, context: list[int], heads: int) -> Tensor | None:
        """The first ``heads`` heads' logits [heads, Vd] after ``context``, read from f_{n-1}; None when the
        target's state of that position is not in (:meth:`_ready`)."""
        if heads < 1 or not self._ready(context):
            return None
        return self.heads.logits(self.heads(self._last, heads)[0])

    @classmethod
    @torch.inference_mode()
    def propose_rows(cls, rows: Sequence[DraftRow]) -> list[Proposal]:
        """Every row's proposal, the rows' heads run in one call over their states: each row's exactly its
        own ``propose``'s."""
        drafters = [cast(MedusaDrafter, row.drafter) for row in rows]
        heads = drafters[0].heads
        counts = [
            min(row.k, heads.num_heads) if d._ready(row.context) else 0
            for row, d in zip(rows, drafters, strict=True)
        ]
        live = [i for i, count in enumerate(counts) if count > 0]
        logits: dict[int, Tensor] = {}  # [count, Vd] each
        if live:
            states = torch.cat([drafters[i]._last for i in live])  # [L, H]
            every = heads.logits(heads(states, max(counts[i] for i in live)))  # [L, most, Vd]
            logits = {i: every[j, : counts[i]] for j, i in enumerate(live)}
        return [d._draft(logits.get(i), row) for i, (d, row) in enumerate(zip(drafters, rows, strict=True))]

    def _draft(self, logits: Tensor | None, row: DraftRow) -> Proposal:
        """The proposal from its heads' logits [K', Vd] (None: nothing to draft from)."""
        if logits is None:
            return Proposal.empty()
        ids, n = self.heads.draft_vocab, len(row.context)  # the first draft token's position: n
        drafts: list[int] = []
        qs = []  # [Vd] each: each head's own distribution, masked after the drafts before it
        for j, raw in enumerate(logits):
            masked = allowed_logits(raw, row.allowed, drafts, ids)  # [Vd]
            if masked is None:  # the grammar allows nothing more
                break
            if self.sampling.greedy:
                drafts.append(int(ids[first_argmax(masked)]))
                continue
            q_draft = probs_from_logits(masked, self.sampling)  # [Vd]
            drafts.append(int(ids[draft_draw(q_draft, row.generator, self.sampling, n + j, ids)]))
            qs.append(q_draft)
        q = self.heads.full_q(torch.stack(qs)).cpu() if qs else None  # [K', V]
        return Proposal(tokens=torch.tensor(drafts, dtype=torch.long), q=q)

    def observe(self, num_accepted: int) -> None:
        pass

    def cost_identity(self) -> dict:
        return self.heads.cost_identity(self.name, heads=self.heads.num_heads)


class MedusaTreeDrafter(HiddenStateTreeDrafter):
    """Medusa's token tree: the children of a node at depth d come from head d + 1 — its top tokens (single
    guesses) or, ``sampled`` at a temperature > 0, independent samples of its q. One head forward a round."""

    name = "medusa"
    drafter: MedusaDrafter

    @torch.inference_mode()
    def propose_tree(
        self, context: list[int], shape: TreeShape, generator: torch.Generator, allowed: Allowed | None = None
    ) -> TreeProposal:
        heads = self.drafter.heads
        shape = shape.capped(heads.num_heads, shape.num_nodes)
        logits = self.drafter.head_logits(context, shape.max_depth)  # [D, Vd]
        if logits is None:
            return shape.select([0], [context[-1]])
        children = shape.children()
        tokens, q_rows = {0: context[-1]}, {}
        for node in range(shape.num_nodes):  # breadth-first: a parent before its children
            if node not in tokens or not children[node]:
                continue
            depth = int(shape.depth[node])
            position = len(context) + depth  # the children's
            path = self._path(node, tokens, shape.parent_list)
            node_logits = allowed_logits(logits[depth], allowed, path, heads.draft_vocab)  # [Vd]
            if node_logits is None:  # the grammar allows nothing after it: a leaf
                continue
            picked, q = self._pick(node_logits, len(children[node]), generator, position, heads.draft_vocab)
            q_row = None if q is None else heads.full_q(q)  # [V]
            for child, token in zip(children[node], heads.draft_vocab[picked].tolist(), strict=False):
                tokens[child], q_rows[child] = token, q_row
        return self._proposal(shape, context[-1], tokens, q_rows)
