"""Drafts from a model with another tokenizer, exactly: token-level intersection and string-level exact match.

The draft and the target share text, not token ids. Both tokenizers are spelled out in bytes
(:meth:`~verispec.models.base.SpelledTokenizer.token_bytes`: GPT-2's byte-level "Ġ", SentencePiece's "▁" and
its byte-fallback pieces ``<0xNN>`` all become the bytes they stand for), and :class:`VocabularyPair` pairs
the tokens whose bytes are equal. The draft reads the committed text in its own tokens (:class:`DraftText`):
each committed target token is spelled in bytes and the bytes re-spelled with the draft's pieces, longest
first; after a round, the draft keeps those of its own drafted tokens that spell a prefix of the text the
target accepted — it rolls back to the accepted *text*, not to a token count — and spells the rest.

Two algorithms turn the draft's tokens into target proposals, after Timor et al., "Accelerating LLM Inference
with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies" (ICML 2025):

- :class:`TokenIntersectionDrafter` (TLI): the draft's distribution restricted to the tokens both
  vocabularies share, renormalised and mapped to target ids, is the q of ordinary rejection sampling.
- :class:`StringMatchDrafter` (string-level exact match): the draft's greedy continuation, decoded to bytes
  and re-encoded with the target's tokenizer, verified as single guesses.

:class:`CrossTokenizerDrafter` runs either, or (``auto``) picks one per round from what each has delivered so
far. Why each is exact is in its docstring; the enumeration suite (``tests/test_cross_tokenizer.py``) proves
it to 1e-12 on toy pairs whose tokenizers merge, split and lack each other's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verispec.drafting.base import Allowed, Proposal, allowed_guesses, allowed_logits
from verispec.drafting.specs import CROSS_TOKENIZER, check_algorithm
from verispec.errors import UsageError
from verispec.models.base import LanguageModel, SpelledTokenizer, Tokenizer
from verispec.models.identity import model_identity
from verispec.options import SamplingParams
from verispec.sampling import first_argmax, probs_from_logits, sample

__all__ = [
    "ALGORITHMS",
    "MIN_SHARED",
    "CrossTokenizerDrafter",
    "DraftText",
    "StringMatchDrafter",
    "TokenIntersectionDrafter",
    "VocabularyPair",
    "intersect",
    "same_vocabulary",
]

ALGORITHMS = CROSS_TOKENIZER  # what --cross-tokenizer accepts
MIN_SHARED = 0.1  # the least share of the draft's tokens that must exist in the target's vocabulary
_MAX_PIECE = 64  # bytes: longer pieces are never used to spell text


def _spelling(tokenizer: Tokenizer, role: str) -> list[bytes]:
    if not isinstance(tokenizer, SpelledTokenizer):
        raise UsageError(
            f"the {role}'s tokenizer ({type(tokenizer).__name__}) cannot spell its tokens in bytes: "
            "drafting across tokenizers needs both vocabularies spelled out"
        )
    return tokenizer.token_bytes()


def _adds_prefix_space(tokenizer: Tokenizer, spelled: Sequence[bytes]) -> bool:
    """Whether ``tokenizer`` writes a space before the first word of a text (SentencePiece's dummy prefix)."""
    return b"".join(spelled[i] for i in tokenizer.encode("a", add_bos=False)) == b" a"


def _roles(tokenizer: Tokenizer) -> frozenset[int]:
    """BOS and EOS: roles, not text."""
    bos = () if tokenizer.bos_token_id is None else (tokenizer.bos_token_id,)
    return frozenset(tokenizer.eos_token_ids).union(bos)


def same_vocabulary(target: Tokenizer, draft: Tokenizer) -> bool:
    """Whether the two tokenizers have one vocabulary (same size and, where spelled, the same bytes per id):
    then the draft's ids are the target's and no translation is needed."""
    if target.vocab_size != draft.vocab_size:
        return False
    if isinstance(target, SpelledTokenizer) and isinstance(draft, SpelledTokenizer):
        return target.token_bytes() == draft.token_bytes()
    return True


class _Speller:
    """Bytes → token ids, the longest piece first (a piece that spells nothing, or a special role, never)."""

    def __init__(self, spelled: Sequence[bytes], exclude: frozenset[int]) -> None:
        self.ids: dict[bytes, int] = {}
        for i, piece in enumerate(spelled):
            if piece and i not in exclude and len(piece) <= _MAX_PIECE:
                self.ids.setdefault(piece, i)
        self.longest = max((len(p) for p in self.ids), default=1)

    def spell(self, text: bytes) -> list[tuple[int, int]]:
        """(token, end offset in ``text``) per token, longest match first; a byte no piece starts with is
        skipped (it joins the next token's span)."""
        out, i = [], 0
        while i < len(text):
            for n in range(min(self.longest, len(text) - i), 0, -1):
                token = self.ids.get(text[i : i + n])
                if token is not None:
                    out.append((token, i + n))
                    i += n
                    break
            else:
                i += 1
        return out


@dataclass(frozen=True, eq=False)
class VocabularyPair:
    """A target and a draft tokenizer spelled out in bytes, and the tokens they share.

    ``shared`` [V_d] bool marks the draft tokens whose bytes some target token spells; ``to_target`` [V_d]
    int64 is that target token (the first such id; -1 elsewhere). Several draft ids may map to one target id
    (duplicate pieces), which :func:`intersect` sums. A draft EOS maps to the target's EOS: ending the text
    is something both can propose. BOS and EOS are roles, not text: they are never spelled."""

    target: Tokenizer
    draft: Tokenizer
    target_bytes: list[bytes]  # [V_t] the bytes each target token stands for
    draft_bytes: list[bytes]  # [V_d]
    shared: Tensor  # [V_d] bool
    to_target: Tensor  # [V_d] int64
    target_eos: int | None  # the target token a draft EOS becomes
    draft_prefix_space: bool  # the draft's text starts with a space (SentencePiece's dummy prefix)
    target_prefix_space: bool
    target_speller: _Speller = field(repr=False)
    draft_speller: _Speller = field(repr=False)

    @classmethod
    def build(
        cls, target: Tokenizer, draft: Tokenizer, draft_vocab_size: int | None = None
    ) -> VocabularyPair:
        """The pair of ``target`` and ``draft`` (a draft model's logits over ``draft_vocab_size`` ids, its
        tokenizer's size by default); UsageError when they share fewer than :data:`MIN_SHARED` of the
        draft's tokens, or when either cannot spell its tokens."""
        target_bytes, draft_bytes = _spelling(target, "target"), _spelling(draft, "draft")
        size = draft.vocab_size if draft_vocab_size is None else draft_vocab_size
        draft_bytes = (draft_bytes + [b""] * size)[:size]
        target_roles, draft_roles = _roles(target), _roles(draft)
        target_speller, draft_speller = (
            _Speller(target_bytes, target_roles),
            _Speller(draft_bytes, draft_roles),
        )
        target_eos = min(target.eos_token_ids) if target.eos_token_ids else None
        to_target = torch.full((size,), -1, dtype=torch.long)  # [V_d]
        for i, piece in enumerate(draft_bytes):
            if i in draft.eos_token_ids and target_eos is not None:
                to_target[i] = target_eos
            elif i not in draft_roles and (t := target_speller.ids.get(piece)) is not None:
                to_target[i] = t
        shared = to_target >= 0  # [V_d]
        text_tokens = sum(1 for i, p in enumerate(draft_bytes) if p and i not in draft_roles)
        common = int(shared.sum()) - sum(1 for i in draft.eos_token_ids if i < size and bool(shared[i]))
        if text_tokens == 0 or common < MIN_SHARED * text_tokens:
            raise UsageError(
                f"the draft's tokenizer shares {common} of its {text_tokens} tokens "
                f"({common / max(text_tokens, 1):.1%}) with the target's: too few to draft across tokenizers "
                f"(at least {MIN_SHARED:.0%})"
            )
        return cls(
            target,
            draft,
            target_bytes,
            draft_bytes,
            shared,
            to_target,
            target_eos,
            _adds_prefix_space(draft, draft_bytes),
            _adds_prefix_space(target, target_bytes),
            target_speller,
            draft_speller,
        )

    @property
    def overlap(self) -> float:
        """The share of the draft's vocabulary that the target also has."""
        return float(self.shared.float().mean())

    def target_tokens(self, text: bytes) -> list[int]:
        """Target ids spelling ``text`` (bytes that continue the committed text): the target tokenizer's own
        encoding where it spells exactly these bytes, else its pieces longest first. A trailing incomplete
        UTF-8 character is left out."""
        for cut in range(len(text), max(len(text) - 4, -1), -1):
            try:
                string = text[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            text = text[:cut]
            break
        else:
            return [t for t, _ in self.target_speller.spell(text)]
        if self.target_prefix_space:  # its encoder writes the space a word starts with itself
            if not string.startswith(" "):
                return [t for t, _ in self.target_speller.spell(text)]
            string = string[1:]
        ids = self.target.encode(string, add_bos=False)
        if b"".join(self.target_bytes[i] for i in ids) == text:
            return ids
        return [t for t, _ in self.target_speller.spell(text)]


def intersect(q: Tensor, pair: VocabularyPair) -> tuple[Tensor, Tensor] | None:
    """The draft's distribution restricted to the shared tokens, renormalised: (over draft ids [V_d], the
    same mapped to target ids [V_t]); None when the draft puts no mass on a shared token.

    q: [V_d] the draft's distribution (after the sampling transform)."""
    restricted = torch.where(pair.shared, q, torch.zeros_like(q))  # [V_d]
    mass = restricted.sum()
    if not bool(mass > 0):
        return None
    restricted = restricted / mass  # [V_d]
    mapped = torch.zeros(pair.target.vocab_size, dtype=q.dtype)  # [V_t]
    mapped.index_add_(0, pair.to_target[pair.shared], restricted[pair.shared])
    return restricted, mapped


class DraftText:
    """The draft's tokens for the committed text, kept in step with the target's tokens.

    ``ids`` spell the committed text (after the draft's BOS when it has one), followed by
    whatever the last proposal drafted; ``ends`` is the byte offset each ends at. :meth:`sync` takes in the
    target tokens committed since, keeps the drafted tokens that spell a prefix of the new text and spells
    the rest with the draft's pieces."""

    def __init__(self, pair: VocabularyPair) -> None:
        self.pair = pair
        self.begin()

    def begin(self) -> None:
        self.text = b""  # the committed text as the draft reads it
        self.ids: list[int] = []
        self.ends: list[int] = []
        self.synced = 0  # target tokens of the context taken in
        self.solid = 0  # ids known to spell committed text

    def sync(self, context: Sequence[int]) -> int:
        """Take in ``context`` (the whole committed target sequence); returns how many of the ids from before
        still stand (the draft's cache is valid up to there)."""
        pair = self.pair
        new = context[self.synced :]
        if self.synced == 0 and new:  # the draft reads its own BOS first, whether the target has one or not
            if new[0] == pair.target.bos_token_id:
                new = new[1:]
            if pair.draft.bos_token_id is not None:
                self.ids, self.ends, self.solid = [pair.draft.bos_token_id], [0], 1
        added = b"".join(pair.target_bytes[t] for t in new)
        if not self.text and added:  # where the text starts: one writes a space before it, the other not
            if pair.draft_prefix_space and not pair.target_prefix_space:
                added = b" " + added
            elif pair.target_prefix_space and not pair.draft_prefix_space and added.startswith(b" "):
                added = added[1:]
        self.text += added
        self.synced = len(context)
        kept = self.solid
        start = self.ends[kept - 1] if kept else 0
        while kept < len(self.ids):  # drafted tokens that spell what the target accepted
            end = self.ends[kept]
            if end > len(self.text) or self.text[start:end] != pair.draft_bytes[self.ids[kept]]:
                break
            start = end
            kept += 1
        del self.ids[kept:], self.ends[kept:]
        for token, end in pair.draft_speller.spell(self.text[start:]):
            self.ids.append(token)
            self.ends.append(start + end)
        self.solid = len(self.ids)
        return kept

    def push(self, token: int) -> None:
        """A drafted token, after the text."""
        self.ids.append(token)
        self.ends.append((self.ends[-1] if self.ends else 0) + len(self.pair.draft_bytes[token]))


class _CrossDraft:
    """A draft model reading the committed text in its own tokens (:class:`DraftText`), with its cache."""

    name = "model"

    def __init__(self, model: LanguageModel, pair: VocabularyPair, sampling: SamplingParams) -> None:
        self.model = model
        self.pair = pair
        self.sampling = sampling
        self.cache = model.new_cache()
        self.text = DraftText(pair)
        self.forwards = 0  # draft forwards of the last proposal

    def begin(self, prompt: list[int]) -> None:
        self.cache.truncate(0)
        self.text.begin()

    def start(self, context: list[int]) -> Tensor | None:
        """Logits [V_d] after the committed text (fed from where the cache still holds it), or None when the
        draft has no room or no text."""
        self.forwards = 0
        kept = self.text.sync(context)
        ids = self.text.ids
        self.cache.truncate(min(self.cache.length, kept, max(len(ids) - 1, 0)))  # feed at least one
        if not ids or len(ids) >= self.model.max_context:
            return None
        return self._feed(ids[self.cache.length :])

    def step(self, token: int) -> Tensor | None:
        """Push a drafted token; the logits [V_d] after it, or None when the draft's context is full."""
        self.text.push(token)
        if len(self.text.ids) >= self.model.max_context:
            return None
        return self._feed([token])

    def _feed(self, tokens: list[int]) -> Tensor:
        device = self.model.device
        start = self.cache.length
        feed = torch.tensor([tokens], dtype=torch.long, device=device)  # [1, T]
        positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)  # [1, T]
        self.forwards += 1
        return self.model.forward(feed, positions, self.cache)[0, -1].cpu()  # [V_d]

    def observe(self, num_accepted: int) -> None:
        """Nothing to do now: the next :meth:`start` rolls the draft back to the accepted text."""

    def cost_identity(self) -> dict:
        """The draft model's, across tokenizers (spelling the text in its tokens is part of each proposal)."""
        return {"drafter": self.name, "model": model_identity(self.model), "across": type(self).__name__}


class TokenIntersectionDrafter(_CrossDraft):
    """Token-level intersection (TLI): the draft samples only tokens that the target's vocabulary also has.

    Each position's q is the draft's distribution (after the engine's sampling transform) restricted to the
    shared tokens and renormalised, mapped to target ids (:func:`intersect`); the token is sampled from it.
    Why it is exact: rejection sampling outputs p whatever q it is given, provided each draft token was
    sampled from the q reported for it — and it was, from exactly that renormalised, mapped distribution
    (draft ids mapping to one target id add up). Tokens outside the intersection have q = 0, so the
    residual max(p − q, 0) gives them all of their p. Renormalising is what makes it exact: the
    unrenormalised restriction is not the distribution the token was drawn from. At temperature 0, the
    draft's most likely shared token, verified greedily.
    """

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        logits = self.start(context) if k > 0 else None
        tokens: list[int] = []
        qs: list[Tensor] = []  # [V_t] each
        while logits is not None and len(tokens) < k:
            within = allowed_logits(logits, allowed, tokens, self.pair.to_target)  # [V_d], grammar's
            if within is None:  # the grammar allows nothing more
                break
            if self.sampling.greedy:
                masked = torch.where(self.pair.shared, within, torch.tensor(-math.inf))  # [V_d]
                draft_token = int(first_argmax(masked))
            else:
                restricted = intersect(probs_from_logits(within, self.sampling), self.pair)
                if restricted is None:
                    break
                draft_token = int(sample(restricted[0], generator))
                qs.append(restricted[1])
            tokens.append(int(self.pair.to_target[draft_token]))
            if int(self.pair.to_target[draft_token]) == self.pair.target_eos:
                break  # nothing follows an end of text
            logits = self.step(draft_token) if len(tokens) < k else None
        q = torch.stack(qs) if qs else None  # [K', V_t]
        return Proposal(torch.tensor(tokens, dtype=torch.long), q)


class StringMatchDrafter(_CrossDraft):
    """String-level exact match: the draft's greedy text, re-encoded with the target's tokenizer, guessed.

    The draft continues the text greedily in its own tokens until the continuation re-encodes (with the
    target's tokenizer, :meth:`VocabularyPair.target_tokens`) to more than k target tokens, or it ends the
    text; those target tokens are the guesses. Why it is exact: guesses verified with no q (single guesses:
    accepted with probability p(x), the residual p without x on rejection) leave the output distributed as p
    whatever the guesses are, as long as they do not depend on the verification's own randomness — and they
    depend only on the committed text. So it is exact for every sampling setting; the draft's probabilities
    are not used (reporting them as q would be wrong: the guesses were not sampled from them).

    The boundary: the last re-encoded token may be the prefix of a longer target token that the next draft
    bytes would complete ("Ġsun" of "Ġsunshine"), so it is left out unless the text ended there (EOS);
    keeping it stays exact, it is just a poor guess.
    """

    def __init__(
        self,
        model: LanguageModel,
        pair: VocabularyPair,
        sampling: SamplingParams,
        keep_boundary: bool = False,
    ) -> None:
        super().__init__(model, pair, sampling)
        self.keep_boundary = keep_boundary

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        logits = self.start(context) if k > 0 else None
        draft_tokens: list[int] = []
        ended = False
        guesses: list[int] = []
        budget = 4 * k + 4  # draft tokens: several short pieces may make one target token
        while logits is not None and len(draft_tokens) < budget:
            token = int(first_argmax(logits))
            if token in self.pair.draft.eos_token_ids:
                ended = self.pair.target_eos is not None
                break
            if not self.pair.draft_bytes[token] or token == self.pair.draft.bos_token_id:
                break
            draft_tokens.append(token)
            guesses = self.pair.target_tokens(b"".join(self.pair.draft_bytes[t] for t in draft_tokens))
            if len(guesses) > k:
                break
            logits = self.step(token)
        if ended:
            guesses = [*guesses, self.pair.target_eos]  # type: ignore[list-item]
        elif not self.keep_boundary or len(guesses) > k:
            guesses = guesses[:-1]
        return Proposal(torch.tensor(allowed_guesses(guesses[:k], allowed), dtype=torch.long), None)


class CrossTokenizerDrafter:
    """A draft model with another tokenizer, through ``algorithm``: "tli" (:class:`TokenIntersectionDrafter`),
    "string" (:class:`StringMatchDrafter`) or "auto".

    ``auto`` runs both on one draft model and cache and picks, each round, the one that has committed more
    target tokens per unit of cost, counted in target steps: 1 + ``cost_ratio`` per draft forward (the
    calibrated draft cost c). Each is tried ``PROBES`` times first; its tallies then decay by ``DECAY`` per
    round, so the choice follows the text. The choice depends only on past rounds' counts, never on timing
    or on the verification to come: the output stays exactly the target's, and the same seed gives the
    same tokens. At temperature 0 both are greedy; above it TLI can use the draft's probabilities."""

    name = "model"
    PROBES = 4
    DECAY = 0.9

    def __init__(
        self,
        model: LanguageModel,
        pair: VocabularyPair,
        sampling: SamplingParams,
        algorithm: str = "auto",
        cost_ratio: float = 0.1,
    ) -> None:
        check_algorithm(algorithm)
        self.algorithm = algorithm
        self.pair = pair
        self.sampling = sampling
        self.cost_ratio = cost_ratio
        tli = TokenIntersectionDrafter(model, pair, sampling)
        string = StringMatchDrafter(model, pair, sampling)
        string.cache, string.text = tli.cache, tli.text  # one draft model state, whichever drafts
        self._drafters: dict[str, TokenIntersectionDrafter | StringMatchDrafter] = {
            "tli": tli,
            "string": string,
        }
        self.begin([])

    def begin(self, prompt: list[int]) -> None:
        self._drafters["tli"].begin(prompt)
        self.tally = {name: [0.0, 0.0, 0] for name in self._drafters}  # committed, cost, rounds
        self.used = {name: 0 for name in self._drafters}  # rounds drafted by each
        self._last = "tli"

    def choose(self) -> str:
        """The algorithm of the next round."""
        if self.algorithm != "auto":
            return self.algorithm
        for name in self._drafters:
            if self.tally[name][2] < self.PROBES:
                return name
        return max(self._drafters, key=lambda n: self.tally[n][0] / max(self.tally[n][1], 1e-9))

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        self._last = self.choose()
        self.used[self._last] += 1
        return self._drafters[self._last].propose(context, k, generator, allowed)

    def cost_identity(self) -> dict:
        """The draft model's, and which algorithms it runs (auto: both, each round's choice)."""
        model = self._drafters["tli"].model
        return {"drafter": self.name, "model": model_identity(model), "algorithm": self.algorithm}

    def observe(self, num_accepted: int) -> None:
        drafter = self._drafters[self._last]
        drafter.observe(num_accepted)
        tally = self.tally[self._last]
        tally[0] = self.DECAY * tally[0] + num_accepted + 1
        tally[1] = self.DECAY * tally[1] + 1 + self.cost_ratio * drafter.forwards
        tally[2] += 1
