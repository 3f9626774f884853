"""SuffixDecoding (Oliaro et al., NeurIPS 2025): draft what followed the context's longest matching suffix,
in the request's own prompt and output or in the outputs of previous requests, as a chain
(:class:`SuffixDrafter`) or a token tree (:class:`SuffixTreeDrafter`).

Each request keeps its own :class:`~verispec.drafting.suffix_index.TokenIndex` over its prompt and output,
extended by the tokens committed since the last proposal; the speculator's
:class:`~verispec.drafting.suffix_cache.SuffixCache` holds previous requests' outputs. Both are asked for the
longest match of the context's suffix (at most ``max_depth`` tokens) and the continuation (or tree) that the
match's occurrences make likeliest; the one of higher score (the sum of the nodes' empirical path
probabilities: the tokens it expects accepted) is proposed. As in the paper, the draft is as long as the match
makes it worth: at most ⌊alpha · match length⌋ tokens (capped by K, or by the tree's shape), each node kept
while its path's probability is at least ``min_prob``.

When a request's output enters the shared cache: when the engine retires it having finished (an end of
sequence, a stop string, its token limit or the context's; :meth:`SuffixDrafter.finish`, the
:class:`~verispec.drafting.base.SequenceEnd` protocol), whole, as one sequence. A cancelled or failed
request's output never enters, nor does anything a calibration drafts over (it finishes no sequence), and a
running request does not read its neighbours' unfinished outputs (its own are in its own index).

Exactness: the guesses are single guesses (q None), deterministic in the context and the cache's contents,
siblings distinct: the single-guess rules keep the output distributed as the target's whatever the cache
holds.
"""

from __future__ import annotations

import dataclasses

import torch

from verispec.drafting.base import Allowed, Proposal, allowed_guesses, allowed_tree, check_static
from verispec.drafting.suffix_cache import SuffixCache
from verispec.drafting.suffix_index import SuffixConfig, TokenIndex
from verispec.drafting.tree import TreeProposal, TreeShape

__all__ = ["SuffixConfig", "SuffixDrafter", "SuffixTreeDrafter"]


class SuffixDrafter:
    """The chain drafter: the likelier of the request's own continuation and the shared cache's (module
    docstring). cache: the speculator's shared cache; None, a private one (cold, this request's alone)."""

    name = "suffix"

    def __init__(self, cache: SuffixCache | None = None, config: SuffixConfig | None = None) -> None:
        self.cache = SuffixCache() if cache is None else cache
        self.config = SuffixConfig() if config is None else config
        self.local = TokenIndex()  # the prompt and the committed output, one open sequence
        self._prompt = 0  # the prompt's length

    def begin(self, prompt: list[int]) -> None:
        self.local, self._prompt = TokenIndex(), len(prompt)

    def read(self, context: list[int]) -> list[int]:
        """Extend the request's index by the tokens committed since it last read (afresh for a context
        shorter than what it read); the context's last ``max_depth`` tokens, what a lookup matches."""
        if len(context) < self.local.size:
            self.local = TokenIndex()
        self.local.extend(context[self.local.size :])
        return context[-self.config.max_depth :]

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        if k <= 0 or not context:
            return Proposal.empty()
        tail = self.read(context)
        own, own_score = self.local.draft_chain(tail, self.config, k)
        shared, shared_score = self.cache.chain(tail, self.config, k)
        tokens = shared if shared_score > own_score else own
        guesses = allowed_guesses(tokens, allowed)
        return Proposal(tokens=torch.tensor(guesses, dtype=torch.long), q=None)  # [K'] single guesses

    def observe(self, num_accepted: int) -> None:
        pass

    def cost_identity(self) -> dict:
        """A lookup like the n-gram's: its settings, not its cache's content."""
        return {"drafter": self.name, **dataclasses.asdict(self.config)}

    def finish(self, ids: list[int]) -> None:
        """The request finished with ``ids`` (its prompt, then its output): the output enters the shared cache
        (module docstring)."""
        self.cache.add(ids[: self._prompt], ids[self._prompt :])


class SuffixTreeDrafter:
    """The tree drafter: the likelier of the request's own continuations and the shared cache's, each a
    tree in the shape (a node's children the tokens that followed its occurrences, by count; single
    guesses, siblings distinct), sharing its chain drafter's index and cache."""

    name = "suffix"

    def __init__(self, shape: TreeShape, drafter: SuffixDrafter | None = None) -> None:
        check_static(shape, "suffix")
        self.shape = shape
        self.drafter = SuffixDrafter() if drafter is None else drafter

    def begin(self, prompt: list[int]) -> None:
        self.drafter.begin(prompt)

    def propose_tree(
        self, context: list[int], shape: TreeShape, generator: torch.Generator, allowed: Allowed | None = None
    ) -> TreeProposal:
        drafter = self.drafter
        tail = drafter.read(context)
        own = drafter.local.draft_tree(tail, shape, drafter.config)
        shared = drafter.cache.tree(tail, shape, drafter.config)
        nodes, tokens, _ = shared if shared[2] > own[2] else own
        return allowed_tree(shape.select(nodes, tokens), allowed)

    def finish(self, ids: list[int]) -> None:
        self.drafter.finish(ids)
