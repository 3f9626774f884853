"""Lookahead tokens (PaSS, parallel speculative sampling, Monea et al. 2023): m trained input embeddings that,
appended after the context, make one forward of the frozen target propose several tokens at once.

The target's cache holds the committed context x_0..x_{n-1}; x_n, the last committed token, is pending. The
drafter runs the whole target once over [x_n, L_1, .., L_m] — x_n embedded as usual, L_j the j-th trained
vector in place of a token embedding, at positions n + j, each seeing the context and the L before it — on a
view of the target's own cache (the slots it writes are those the target's next forward overwrites):

- the output at x_n is the target's own next-token distribution p(x_{n+1} | x_0..x_n): draft token 1 is
  sampled from it (taken as its argmax at temperature 0), so it is accepted (up to the rounding of the other
  forward: on the native kernels the two rows are bit-identical, so always);
- the output at L_j, through the target's frozen head rows of the draft vocabulary, gives q_{j+1}, the
  distribution of draft token j + 1 (for x_{n+1+j}); nothing else is trained.

A round therefore costs two target forwards (the draft's of 1 + m tokens and the verification's), and commits
at least two tokens whenever draft token 1 is accepted: lookahead speculation pays where a forward of a few
tokens costs about one of a single token and the lookahead tokens are accepted often enough to cover the
second forward's overhead.

**Which q, and why rejection sampling stays exact.** Draft token 1's q is the target's distribution from the
draft forward, after the engine's sampling transform. Draft token j + 1 is sampled from q_{j+1}, the
distribution at L_j (zeros outside the draft vocabulary), which does *not* condition on draft tokens 1..j:
L_j never sees them. As for Medusa's heads (:mod:`verispec.drafting.learned.medusa`), the draws are
independent given the context, so q_{j+1} is exactly the distribution token j + 1 was drawn from given the
context and the draft tokens before it, which is all that rejection sampling needs; it is a poor guess at p
after a draft token it did not see, never a wrong one. The enumeration suite proves it with a toy drafter of
this kind (first token from p, the rest from context-only distributions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from verispec.drafting.base import Allowed, Proposal, allowed_logits
from verispec.drafting.learned.head import LearnedHead, native_target, shape_count
from verispec.errors import UsageError
from verispec.inputs import is_int
from verispec.models.base import Cache, LanguageModel
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Llama
from verispec.options import SamplingParams
from verispec.sampling import draft_draw, first_argmax, probs_from_logits

__all__ = ["MAX_LOOKAHEAD", "LookaheadDrafter", "LookaheadTokens", "lookahead_mask"]

MAX_LOOKAHEAD = 8  # the most lookahead tokens a file may hold


class LookaheadTokens(LearnedHead):
    """m lookahead token embeddings of a target (module docstring). Trainable: ``embeddings`` [m, H]."""

    kind = "lookahead"

    def __init__(
        self, target: LanguageModel, draft_vocab: Tensor, metadata: dict[str, Any], num_tokens: int = 3
    ) -> None:
        super().__init__(target, draft_vocab, metadata)
        if not is_int(num_tokens) or not 1 <= num_tokens <= MAX_LOOKAHEAD:
            raise UsageError(
                f"lookahead drafting has 1 to {MAX_LOOKAHEAD} lookahead tokens, got {num_tokens!r}"
            )
        self.embeddings = nn.Parameter(
            torch.zeros(num_tokens, self.hidden_size, device=self.device)
        )  # [m, H]

    def fresh_start(self, target: Llama) -> None:
        """Each lookahead token starts as the mean of the target's token embeddings plus the random draw."""
        self.embeddings.add_(target.model.embed_tokens.weight.float().mean(0))

    @property
    def num_tokens(self) -> int:
        return self.embeddings.shape[0]

    def shape_metadata(self) -> dict[str, str]:
        return {"lookahead_tokens": str(self.num_tokens)}

    @classmethod
    def from_shape(
        cls, target: Llama, draft_vocab: Tensor, info: dict[str, Any], shape: dict[str, str], path: Path
    ) -> LookaheadTokens:
        return cls(
            target, draft_vocab, info, shape_count(shape, "lookahead_tokens", 1, MAX_LOOKAHEAD, "", path)
        )


def lookahead_mask(anchors: Tensor, length: int, count: int) -> Tensor:
    """Attention of lookahead tokens appended after a sequence already in a cache, for training: anchor a
    [A] (ascending slots of the sequence, each the pending token x_t) gets ``count`` lookahead slots, which
    see the sequence's slots ≤ a and the lookahead slots of the same anchor up to their own, exactly what
    drafting after x_a sees. Returns [A·count, length + A·count] bool (True = attend)."""
    a = anchors.shape[0]
    seen = torch.arange(length)[None, :] <= anchors[:, None]  # [A, length]
    own = torch.ones(count, count, dtype=torch.bool).tril()  # [count, count]
    block = torch.block_diag(*[own] * a) if a else torch.zeros(0, 0, dtype=torch.bool)  # [A·count, A·count]
    return torch.cat([seen.repeat_interleave(count, 0), block], 1)


class LookaheadDrafter:
    """Drafts with lookahead tokens (module docstring): one target forward, draft token 1 from the target's
    own distribution, tokens 2..m + 1 from the lookahead tokens.

    On the engine's cache (``target_cache``: it holds every committed token but the last) each proposal works
    on a view of it, feeds the last token and the lookahead tokens, and leaves the slots it wrote to the
    target's next forward. Without one (a calibration), it keeps a cache of its own: each proposal first feeds
    the committed tokens that cache lacks, which it then keeps."""

    name = "lookahead"

    def __init__(
        self,
        tokens: LookaheadTokens,
        target: LanguageModel,
        sampling: SamplingParams,
        target_cache: Cache | None = None,
    ) -> None:
        """tokens: trained for ``target``; sampling: the engine's parameters; target_cache: the cache of the
        sequence the engine decodes, or None."""
        if target_cache is not None and not isinstance(target_cache, KVCache):
            raise UsageError("the lookahead drafter drafts on a native target's cache (a KVCache)")
        self.tokens = tokens
        self.target = native_target(target)
        self.sampling = sampling
        self.target_cache = target_cache
        self.cache = self.target.new_cache() if target_cache is None else target_cache

    def begin(self, prompt: list[int]) -> None:
        if self.target_cache is None:
            self.cache.truncate(0)

    def _view(self) -> KVCache:
        """The cache this proposal runs on: a view of the engine's (its length moving on its own), or its
        own."""
        if self.target_cache is None:
            assert isinstance(self.cache, KVCache)  # new_cache() of a native target
            return self.cache
        assert isinstance(self.target_cache, KVCache)  # checked in the constructor
        return self.target_cache.first_layers(self.target.config.num_layers)

    @torch.inference_mode()
    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        target, cache = self.target, self._view()
        k = min(k, target.max_context - len(context), self.tokens.num_tokens + 1)
        if k <= 0 or len(context) <= cache.length:
            return Proposal.empty()
        m = k - 1  # lookahead tokens fed
        fed = torch.tensor([context[cache.length :]], dtype=torch.long, device=target.device)  # [1, F]
        f = fed.shape[1]
        tokens = torch.cat([fed, fed.new_zeros(1, m)], 1)  # [1, F + m]: the ids where the L_j go are unused
        inputs = torch.cat([target.embed(fed).float(), self.tokens.embeddings[None, :m]], 1)  # [1, F + m, H]
        positions = torch.arange(cache.length, cache.length + f + m, device=target.device)[None]  # [1, F + m]
        hidden = target.forward_hidden(tokens, positions, cache, embeddings=inputs)[0, f - 1 :]  # [1 + m, H]
        hidden = hidden[:, : target.config.hidden_size]  # the final state (after any tapped layers' inputs)
        cache.truncate(len(context))  # its own cache keeps the committed tokens; a view is let go
        first = target.logits(hidden[None, :1])[0, 0]  # [V]: the target's own distribution of x_{n+1}
        later = self.tokens.logits(hidden[1:].float())  # [m, Vd]
        vocab, n = self.tokens.draft_vocab, len(context)  # the first draft token's position: n
        drafts: list[int] = []
        qs = []  # [V] each, masked after the drafts before it
        for j, (raw, ids) in enumerate([(first, None), *((row, vocab) for row in later)]):
            row = allowed_logits(raw, allowed, drafts, ids)  # [V] or [Vd]
            if row is None:  # the grammar allows nothing more
                break
            if self.sampling.greedy:
                index = int(first_argmax(row))
            else:
                q_row = probs_from_logits(row, self.sampling)  # [V] or [Vd]
                index = int(draft_draw(q_row, generator, self.sampling, n + j, ids))
                qs.append(q_row if ids is None else self.tokens.full_q(q_row))
            drafts.append(index if ids is None else int(ids[index]))
        q = torch.stack(qs).cpu() if qs else None  # [K', V]
        return Proposal(tokens=torch.tensor(drafts, dtype=torch.long), q=q)

    def observe(self, num_accepted: int) -> None:
        pass

    def cost_identity(self) -> dict:
        """The target's own forward, and its draft vocabulary's head."""
        return self.tokens.cost_identity(self.name, lookahead_tokens=self.tokens.num_tokens)
