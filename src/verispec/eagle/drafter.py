"""The learned drafter in the engine: an :class:`~verispec.eagle.model.EagleHead` drafting from the target's
hidden states.

The engine hands the drafter the target's final hidden state of every committed position
(``reads_target_hidden``; :meth:`EagleDrafter.observe_hidden`), so that when the committed context is
x_0..x_n the drafter holds f_0..f_{n-1} (x_n, the last committed token, has not been fed to the target yet).
The head's own cache holds one slot t per pair (x_{t+1}, f_t) with a *true* feature; ``propose`` feeds the
pairs it has not seen yet — slots up to n − 1, whose output f̂_n gives the draft of x_{n+1} — then drafts on
its own predictions: slot n + i reads (x̂_{n+i+1}, f̂_{n+i}). ``observe`` rolls the cache back to the true
slots by moving its length (the next round overwrites the draft slots with true features).

Each draft token is sampled with the engine's parameters from q, the distribution that probs_from_logits
gives for the full-vocabulary logits that are −inf outside the draft vocabulary. Every transform (temperature,
top-k, top-p, min-p, in that order, ties broken by token id) treats those −inf entries as impossible tokens,
so q is computed on the draft vocabulary alone, sampled there, and handed to the verifier with zeros
elsewhere: exactly the distribution the token was drawn from (greedy: the draft vocabulary's argmax,
q = None).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from verispec.drafters import Proposal
from verispec.eagle.model import EagleHead
from verispec.sampling import SamplingParams, probs_from_logits

__all__ = ["SHIPPED", "EagleDrafter", "shipped_drafter"]

SHIPPED = {"smollm2-135m": "smollm2-135m-eagle.safetensors"}  # target short name → file in data/drafters


class EagleDrafter:
    """Drafts with a learned head reading the target's hidden states (module docstring)."""

    name = "eagle"
    reads_target_hidden = True  # the engine calls observe_hidden with the committed positions' states

    def __init__(self, head: EagleHead, sampling: SamplingParams) -> None:
        """head: built for the target (its vocabulary is the target's); sampling: the engine's parameters."""
        self.head = head
        self.sampling = sampling
        self.cache = head.new_cache()
        capacity, hidden = self.cache.capacity, head.config.hidden_size
        self._features = torch.empty(capacity, hidden, device=head.inv_freq.device)  # [capacity, H]: f_0..
        self._num_features = 0
        self._committed = 0  # cache slots fed with true features
        self._next = torch.empty(1, 1, hidden, device=head.inv_freq.device)  # [1, 1, H]: f̂ after them

    def begin(self, prompt: list[int]) -> None:
        self.cache.truncate(0)
        self._num_features = self._committed = 0

    def observe_hidden(self, hidden: Tensor) -> None:
        """hidden: [T, H], the target's final hidden states at the next T committed positions."""
        end = self._num_features + hidden.shape[0]
        self._features[self._num_features : end] = hidden
        self._num_features = end

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, generator: torch.Generator) -> Proposal:
        n = len(context) - 1  # the last committed token's position
        k = min(k, self.cache.capacity - n + 1)  # draft slots n .. n + k - 2
        if k <= 0 or n == 0 or self._num_features < n:
            return Proposal.empty()
        device = self._features.device
        start = self.cache.length
        if start < n:  # true-feature slots to feed (none when proposing again for the same context)
            tokens = torch.tensor([context[start + 1 : n + 1]], device=device)  # [1, n - start]
            positions = torch.arange(start, n, device=device).unsqueeze(0)  # [1, n - start]
            features = self._features[start:n].unsqueeze(0)  # [1, n - start, H]
            self._next = self.head(tokens, features, positions, self.cache)[:, -1:]
            self._committed = n
        feature = self._next  # [1, 1, H]
        drafts, qs = [], []
        for i in range(k):
            logits = self.head.logits(feature[0])[0]  # [Vd]
            if self.sampling.greedy:
                token = self.head.draft_vocab[logits.argmax()].view(1)
            else:
                q_draft = probs_from_logits(logits, self.sampling)  # [Vd]
                token = self.head.draft_vocab[torch.multinomial(q_draft, 1, generator=generator)]
                q = q_draft.new_zeros(self.head.vocab_size)  # [V]
                qs.append(q.index_copy_(0, self.head.draft_vocab, q_draft))
            drafts.append(token)
            if i < k - 1:
                position = torch.tensor([[n + i]], device=device)  # [1, 1]
                feature = self.head(token.view(1, 1), feature, position, self.cache)  # [1, 1, H]
        return Proposal(tokens=torch.cat(drafts).cpu(), q=torch.stack(qs).cpu() if qs else None)

    def observe(self, num_accepted: int) -> None:
        self.cache.truncate(self._committed)


def shipped_drafter(target_label: str) -> Path | None:
    """The drafter file verispec ships for the target named ``target_label`` (a short model name), when there
    is one (``verispec/data/drafters``)."""
    name = SHIPPED.get(target_label)
    if name is None:
        return None
    path = Path(str(resources.files("verispec") / "data" / "drafters" / name))
    return path if path.is_file() else None
