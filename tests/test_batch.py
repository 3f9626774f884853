"""The continuous batch: what a request gets never depends on what else is in the batch.

Greedy outputs equal decoding each request alone, whatever joins or leaves; sampled outputs are the same
tokens for the same seed alone or batched; on the native kernels the rows are scored in one forward and a
row's logits equal a fresh batch-1 forward after any accept/reject pattern in the other rows; a chi-square
through a mixed batch (rows with different drafters and sampling settings) against each row's exact
distribution; bad requests are refused one by one; ``generate --batch``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from fakes import LetterTokenizer, TableLM
from test_engine import noisy_copy
from test_kernels import CONFIG, random_llama
from verispec import cli
from verispec.api import Speculator
from verispec.batch import read_requests
from verispec.bench.load import LoadConfig, auto_against_best, rotated
from verispec.costs.policies import ConstantK
from verispec.drafting.base import NoDrafter
from verispec.drafting.draft_model import ModelDrafter
from verispec.drafting.learned.eagle import EagleHead
from verispec.drafting.learned.head import target_fingerprint
from verispec.drafting.learned.lookahead import LookaheadTokens
from verispec.drafting.learned.medusa import MedusaHeads
from verispec.drafting.ngram import NGramDrafter
from verispec.drafting.tree import TreeShape
from verispec.engine.engine import SpeculativeEngine
from verispec.engine.scheduler import QueueFull, Scheduler
from verispec.engine.sequence import EngineConfig, GenerationStats, Request
from verispec.kernels.cpu import native_available
from verispec.models.base import RowInput
from verispec.options import GenerationOptions, SamplingParams
from verispec.sampling import position_draws, probs_from_logits

GREEDY = SamplingParams(temperature=0)
VOCAB = CONFIG.vocab_size
PROMPTS = ["abcabcab", "hello", "zyxw", "aaaa", "thecatsatonthecat", "q", "bananabanana"]
needs_native = pytest.mark.skipif(
    native_available() is not None, reason=f"no native kernels: {native_available()}"
)


@pytest.fixture(scope="module")
def native_target():
    """A tiny random Llama on the native kernels whose greedy text varies (an untied head: a tied one
    repeats the last token)."""
    model = random_llama(dataclasses.replace(CONFIG, tie_word_embeddings=False))
    assert model.optimize_for_cpu(precision="q4_1")
    return model


def speculator(model, drafter: str = "ngram", draft: str | None = None) -> Speculator:
    return Speculator((model, LetterTokenizer(VOCAB)), draft=draft, drafter=drafter)


def eagle_file(target, folder, kind: str = "eagle", draft_vocab: torch.Tensor | None = None) -> str:
    """An untrained learned drafter of ``target`` (EAGLE, or Medusa's heads, or lookahead tokens) on
    ``draft_vocab`` (None: every token), saved in ``folder``."""
    metadata = {"kind": kind, "target": "tiny", "target_fingerprint": target_fingerprint(target)}
    vocab, g = torch.arange(VOCAB) if draft_vocab is None else draft_vocab, torch.Generator().manual_seed(0)
    if kind == "eagle":
        head = EagleHead.create(target, vocab, g, metadata)
    elif kind == "medusa":
        head = MedusaHeads.create(target, vocab, g, metadata, 3)
    else:
        head = LookaheadTokens.create(target, vocab, g, metadata, 3)
    return str(head.save(folder / f"{kind}.safetensors"))


def count_batched_forwards(model, monkeypatch) -> list[int]:
    """The row counts of the model's batched forwards, as they happen."""
    sizes: list[int] = []
    original = model.forward_rows

    def counted(rows):
        sizes.append(len(rows))
        return original(rows)

    monkeypatch.setattr(model, "forward_rows", counted)
    return sizes


@needs_native
@pytest.mark.parametrize(
    ("drafter", "draft", "k"),
    [("none", None, 0), ("ngram", None, 3), ("model", "layers:1", 2), ("model", "self:q8_0", "auto")],
)
def test_greedy_in_a_batch_equals_decoding_alone(native_target, monkeypatch, drafter, draft, k):
    spec = speculator(native_target, drafter, draft)
    options = dict(k=k, max_new_tokens=24, sampling=GREEDY)
    alone = [spec.generate(p, **options).token_ids for p in PROMPTS]
    sizes = count_batched_forwards(native_target, monkeypatch)
    batched = spec.generate_batch(PROMPTS, slots=3, **options)  # 7 requests, 3 at a time: joins and leaves
    assert [r.token_ids for r in batched] == alone
    assert max(sizes) == 3  # scored together
    assert all(r.stats["new_tokens"] == len(r.token_ids) > 0 for r in batched)


@needs_native
def test_same_seed_same_tokens_alone_or_batched(native_target):
    spec = speculator(native_target, "ngram")
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=7, invariant=False)
    options = dict(k=2, max_new_tokens=20, sampling=sampling)
    alone = [spec.generate(p, **options).token_ids for p in PROMPTS[:4]]
    assert [r.token_ids for r in spec.generate_batch(PROMPTS[:4], slots=4, **options)] == alone
    other_seed = SamplingParams(temperature=1.0, top_k=20, seed=8, invariant=False)
    assert spec.generate(PROMPTS[0], **dict(options, sampling=other_seed)).token_ids != alone[0]


INVARIANT = SamplingParams(temperature=0.25, top_p=0.95, seed=11, invariant=True)


def own_sampling(model, prompt: str, sampling: SamplingParams, count: int) -> list[int]:
    """The target's own sampling with ``sampling.invariant``, no engine: each token its position's draw from
    the distribution of a fresh forward over the whole sequence before it."""
    ids = LetterTokenizer(VOCAB).encode(prompt)
    start = len(ids)
    for _ in range(count):
        tokens, positions = torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0)  # [1, T] each
        p = probs_from_logits(model.forward(tokens, positions, model.new_cache())[0, -1], sampling)  # [V]
        ids.append(int(position_draws(p[None], sampling.seed, [len(ids)])[0]))
    return ids[start:]


@needs_native
@pytest.mark.parametrize(
    ("drafter", "draft", "k", "tree"),
    [
        ("none", None, 0, None),
        ("ngram", None, 3, None),
        ("ngram", None, "auto", None),
        ("model", "layers:1", 2, None),
        ("model", "self:q8_0", 3, None),
        ("model", "layers:1", 0, TreeShape.full(2, 2)),
        ("eagle", None, 3, None),
        ("eagle", None, 0, TreeShape.full(2, 2)),
        ("medusa", None, 3, None),
        ("medusa", None, 0, TreeShape.full(2, 2)),
        ("lookahead", None, 3, None),
    ],
)
def test_invariant_sampling_is_the_target_s_own_whatever_the_drafter_k_tree_or_batch(
    native_target, tmp_path, drafter, draft, k, tree
):
    """With ``invariant``, a sampled request is the target's own sampling with its seed, token for token:
    alone, or three at a time with others joining and leaving, for every drafter (the learned ones on a draft
    vocabulary of every other token), K (``auto`` included, whose K follows the batch) and token trees; and
    the drafts are still accepted."""
    learned = drafter in ("eagle", "medusa", "lookahead")
    path = eagle_file(native_target, tmp_path, drafter, torch.arange(0, VOCAB, 2)) if learned else None
    spec = Speculator(
        (native_target, LetterTokenizer(VOCAB)), draft=draft, drafter=drafter, tree=tree, drafter_path=path
    )
    options = dict(k=k, max_new_tokens=16, sampling=INVARIANT)
    own = [own_sampling(native_target, p, INVARIANT, 16) for p in PROMPTS]
    alone = [spec.generate(p, **options) for p in PROMPTS]
    assert [r.token_ids for r in alone] == own
    batched = spec.generate_batch(PROMPTS, slots=3, **options)
    assert [r.token_ids for r in batched] == own
    if not learned and drafter != "none":  # (untrained heads guess at random)
        assert sum(r.stats["accepted"] for r in alone + batched) > 0
    if drafter == "lookahead":  # its first draft token is drawn from the target's own p: always the draw
        assert all(
            r.stats["acceptance_per_position"][0] == 1.0 for r in alone + batched if r.stats["drafted"]
        )
    plain = dataclasses.replace(INVARIANT, invariant=False)  # the generator's stream: other tokens
    assert [spec.generate(p, **dict(options, sampling=plain)).token_ids for p in PROMPTS] != own


def test_an_invariant_draft_from_the_target_s_own_distribution_is_always_accepted():
    """Coupling: a draft that is the target itself draws, at each position, with the noise the target's draw
    uses, so every drafted token is kept (drawn independently, each would be kept with probability Σ p²)."""
    target = TableLM(6, seed=5, sharpness=0.7)  # spread distributions: Σ p² far below 1
    engine = SpeculativeEngine(target, slots=2)
    stats = [GenerationStats("model", "3") for _ in range(8)]
    for seed, row in enumerate(stats):
        sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, invariant=True)
        request = Request(
            [seed % 6], EngineConfig(16, sampling), ModelDrafter(target, sampling, 6), ConstantK(3), row
        )
        engine.submit(request)
        while len(engine.running) == engine.slots or (seed == len(stats) - 1 and engine.running):
            engine.step()
    assert all(row.new_tokens == 16 and row.accepted == row.drafted > 0 for row in stats)


SHARED_STARTS = ["thecatsatonthemat", "thecatsatonthemat", "thecatsatonthehat", "thecat", "thedogran", "q"]


def shared_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@needs_native
@pytest.mark.parametrize(
    ("drafter", "draft", "k"), [("none", None, 0), ("ngram", None, 3), ("model", "layers:1", 2)]
)
def test_a_slot_keeps_the_prompt_start_it_shares_and_that_changes_nothing(native_target, drafter, draft, k):
    """A request admitted to a slot whose last sequence began as it does keeps those positions' keys and
    values (cached_prompt_tokens) instead of scoring them again, and generates what it generates alone:
    greedy, and sampled with a seed, token for token (an early exit reads the kept slots too)."""
    spec = speculator(native_target, drafter, draft)
    ids = [LetterTokenizer(VOCAB).encode(p) for p in SHARED_STARTS]
    for sampling in (GREEDY, SamplingParams(temperature=1.0, top_k=20, seed=5, invariant=False)):
        options = dict(k=k, max_new_tokens=12, sampling=sampling)
        alone = [speculator(native_target, drafter, draft).generate(p, **options) for p in SHARED_STARTS]
        assert all(r.stats["cached_prompt_tokens"] == 0 for r in alone)  # a fresh engine each: nothing held
        streamed = [spec.generate(p, **options) for p in SHARED_STARTS]  # one speculator's engine, kept
        assert [r.token_ids for r in streamed] == [r.token_ids for r in alone]
        assert [r.stats["cached_prompt_tokens"] for r in streamed][1:4] == [16, 14, 5]
        one_slot = spec.generate_batch(SHARED_STARTS, slots=1, **options)
        assert [r.token_ids for r in one_slot] == [r.token_ids for r in alone]
        for i in range(1, len(ids)):  # the slot holds what the request before wrote: all its ids but the last
            held = (ids[i - 1] + alone[i - 1].token_ids)[:-1]
            expected = min(shared_start(held, ids[i]), len(ids[i]) - 1)
            assert one_slot[i].stats["cached_prompt_tokens"] == expected
        assert [r.stats["cached_prompt_tokens"] for r in one_slot][1:4] == [16, 14, 5]  # the same prompt: all
        three = spec.generate_batch(SHARED_STARTS, slots=3, **options)  # joins pick the slot sharing most
        assert [r.token_ids for r in three] == [r.token_ids for r in alone]


@needs_native
def test_a_drafter_that_reads_hidden_states_is_handed_the_kept_positions_states(native_target):
    """A drafter that reads the target's hidden states keeps a shared prompt start only where the slot's last
    sequence had them too, and is then handed exactly the states scoring the prompt would give."""

    class Reader(NoDrafter):  # a HiddenStateReader: it needs the target's states of every prompt position
        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def observe_hidden(self, hidden: torch.Tensor) -> None:
            self.seen.append(hidden.clone())

    engine = SpeculativeEngine(native_target, slots=1)
    prompt = LetterTokenizer(VOCAB).encode("thecatsatonthemat")
    cached, readers = [], []
    for drafter in (NoDrafter(), Reader(), Reader(), NoDrafter()):  # a reader after a sequence without states
        stats = GenerationStats(drafter.name, "0")
        config = EngineConfig(max_new_tokens=2, sampling=GREEDY)
        running = engine.submit(Request(prompt, config, drafter, ConstantK(0), stats))
        while not running.done:
            engine.step()
        cached.append(stats.cached_prompt_tokens)
        if isinstance(drafter, Reader):
            readers.append(torch.cat(drafter.seen))  # [T, H]: every position's state, in order
    assert cached == [0, 0, len(prompt) - 1, len(prompt) - 1]
    assert readers[0].shape[0] >= len(prompt) and torch.equal(readers[1], readers[0])


@needs_native
def test_an_eagle_row_keeping_a_prompt_start_samples_what_it_samples_alone(native_target, tmp_path):
    """EAGLE's drafts depend on the target's hidden states: with a seed and a fixed K, a request that keeps
    its slot's shared prompt start (and its states) draws the same tokens as alone."""
    spec = Speculator(
        (native_target, LetterTokenizer(VOCAB)),
        drafter="eagle",
        drafter_path=eagle_file(native_target, tmp_path),
    )
    options = dict(k=2, max_new_tokens=12, sampling=SamplingParams(temperature=1.0, seed=3, invariant=False))
    alone = [spec.generate(p, **options).token_ids for p in SHARED_STARTS]
    one_slot = spec.generate_batch(SHARED_STARTS, slots=1, **options)
    assert [r.token_ids for r in one_slot] == alone
    assert [r.stats["cached_prompt_tokens"] for r in one_slot][1:4] == [16, 14, 5]


@needs_native
@pytest.mark.parametrize(
    ("drafter", "draft", "k"),
    [("none", None, 0), ("ngram", None, 3), ("model", "layers:1", 2), ("eagle", None, 2)],
)
def test_a_joining_request_copies_the_start_a_running_row_holds(native_target, tmp_path, drafter, draft, k):
    """A request joining an empty slot while another row holds a longer shared start (here a running
    sequence) copies those keys and values (and, for EAGLE, hidden states) instead of scoring them again,
    and generates what it generates alone: greedy, and sampled with a seed, token for token (an early exit
    reads the copied slots too)."""
    path = eagle_file(native_target, tmp_path) if drafter == "eagle" else None
    spec = Speculator(
        (native_target, LetterTokenizer(VOCAB)), draft=draft, drafter=drafter, drafter_path=path
    )
    first, second = "thecatsatonthemat", "thecatsatonthehat"
    for sampling in (GREEDY, SamplingParams(temperature=1.0, top_k=20, seed=5, invariant=False)):
        options = GenerationOptions(k=k, max_new_tokens=12, sampling=sampling)
        alone = [spec.generate(p, options).token_ids for p in (first, second)]
        engine = SpeculativeEngine(native_target, slots=2)
        got: dict[int, list[int]] = {}
        running = engine.submit(spec.request(first, options)[0])
        for handle, tokens in engine.step():  # its prompt in one chunk, and a first token
            got.setdefault(id(handle), []).extend(tokens)
        joining = engine.submit(spec.request(second, options)[0])
        assert joining.slot != running.slot
        assert joining.request.stats.cached_prompt_tokens == len("thecatsatonthe")  # what the two share
        while engine.running:
            for handle, tokens in engine.step():
                got.setdefault(id(handle), []).extend(tokens)
        assert [got[id(running)], got[id(joining)]] == alone


@needs_native
def test_a_row_never_sees_the_others(native_target):
    """After random accept/reject patterns in every row, each row's logits from one batched forward equal a
    fresh batch-1 forward over that row's committed tokens, bit for bit."""
    g = torch.Generator().manual_seed(3)
    rows = native_target.new_cache_rows(3)
    committed: list[list[int]] = [[] for _ in rows]
    for _ in range(6):  # each step: every row gets a block, then is rolled back to a random length
        inputs = []
        for cache in rows:
            block = torch.randint(0, VOCAB, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
            start = cache.length
            inputs.append(RowInput(cache, block, torch.arange(start, start + len(block)), None, True, False))
        outputs = native_target.forward_rows(inputs)
        for row, (cache, ids, (logits, _)) in enumerate(zip(rows, committed, outputs, strict=True)):
            block = inputs[row].tokens.tolist()
            fresh = native_target(
                torch.tensor([ids + block]),
                torch.arange(len(ids) + len(block))[None],
                native_target.new_cache(),
            )[0, -len(block) :]
            assert torch.equal(logits, fresh)
            keep = int(torch.randint(0, len(block) + 1, (1,), generator=g))
            ids += block[:keep]
            cache.truncate(len(ids))


@needs_native
def test_a_copied_row_continues_as_the_row_it_copies(native_target):
    """copy_from gives another row a prefix's entries (and length): its next logits equal those of the row
    that computed them, bit for bit, for a prefix that ends mid-tile (19 slots of tiles of 16) and after a
    rollback of the copy; a cache of another layout or too small is refused."""
    rows = native_target.new_cache_rows(3)
    prefix = torch.arange(19) % VOCAB
    native_target.forward_rows([RowInput(rows[0], prefix, torch.arange(19), None, False, False)])
    rows[2].copy_from(rows[0])
    assert rows[2].length == 19
    rows[2].truncate(11)
    rows[1].copy_from(rows[2])  # a copy of a rolled-back copy: 11 slots
    rows[0].truncate(11)
    block = torch.tensor([5, 6, 7])
    outputs = native_target.forward_rows(
        [RowInput(c, block, torch.arange(11, 14), None, True, False) for c in rows]
    )
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][0], outputs[2][0])
    rows[1].copy_from(rows[0], 5)
    assert rows[1].length == 5
    with pytest.raises(ValueError, match="cannot copy 15 slots of a cache of length 14"):
        rows[1].copy_from(rows[0], 15)
    with pytest.raises(ValueError, match="another layout or shape, or past capacity"):
        native_target.new_cache(capacity=8).copy_from(rows[0])
    with pytest.raises(ValueError, match="another layout or shape"):
        native_target.new_cache(2).copy_from(rows[0])  # two sequences, not one


@needs_native
def test_forward_rows_refuses_what_it_cannot_take_together(native_target):
    rows = native_target.new_cache_rows(2)
    single = native_target.new_cache()
    inputs = [
        RowInput(c, torch.tensor([1, 2]), torch.arange(2), None, True, False) for c in (rows[0], single)
    ]
    assert not native_target.scores_together(inputs)
    assert not native_target.scores_together([inputs[0], inputs[0]])  # a row twice
    with pytest.raises(ValueError, match="rows of one native cache"):
        native_target.forward_rows(inputs)


def test_bad_requests_are_refused_one_by_one():
    target = TableLM(8, seed=1, max_context=12)
    spec = Speculator((target, LetterTokenizer(8)), drafter="ngram")
    options = dict(k=2, max_new_tokens=4, sampling=GREEDY)
    results = spec.generate_batch(["abc", "", "abcdefghabcdefgh", "bcd"], slots=2, **options)
    assert [bool(r.error) for r in results] == [False, True, True, False]
    assert "the prompt is empty" in results[1].error and "the context holds 12" in results[2].error
    assert results[0].token_ids == spec.generate("abc", **options).token_ids
    with pytest.raises(ValueError, match="slots must be an integer >= 1"):
        spec.generate_batch(["abc"], slots=0)
    engine = SpeculativeEngine(target, slots=1)
    request = Request(
        [1, 2], EngineConfig(3, GREEDY), NoDrafter(), ConstantK(0), GenerationStats("none", "0")
    )
    engine.submit(request)
    with pytest.raises(ValueError, match="all 1 slots are taken"):
        engine.submit(request)


def test_token_id_prompts_are_taken_as_they_are():
    """A prompt of token ids is the same request as the text they encode; ids outside the vocabulary, an
    empty list, ids with chat=True and a prompt that is none of text, ids or messages are refused one by one
    (the others run)."""
    target = TableLM(8, seed=1, max_context=12)
    spec = Speculator((target, LetterTokenizer(8)), drafter="ngram")
    options = dict(k=2, max_new_tokens=4, sampling=GREEDY)
    ids = spec.encode_prompt("abc")
    assert spec.encode_prompt(ids) == ids and spec.encode_prompt(tuple(np.array(ids))) == ids
    results = spec.generate_batch([ids, [], [0, 8], ["a", 1], "abc", [1.5, 2], 5, None], slots=2, **options)
    assert [bool(r.error) for r in results] == [False, True, True, True, False, True, True, True]
    assert results[6].error.endswith("a list of messages, not int") and results[7].error.endswith("NoneType")
    assert results[0].token_ids == results[4].token_ids == spec.generate("abc", **options).token_ids
    assert "[0, 8)" in results[2].error and "conversation" in results[1].error
    assert results[5].error.endswith("token ids must be integers, got 1.5")
    with pytest.raises(ValueError, match="no chat template"):
        spec.generate(ids, chat=True, **options)


def test_a_request_that_fails_in_a_step_fails_alone(monkeypatch):
    """A failure in one request's own part of a step (injected: its drafter raises, or its text does) ends
    that request alone, with an internal error naming it; the others in the batch generate what they
    generate alone, and a batch of one (``generate``) raises it. A prompt that is not valid Unicode is a
    caller's mistake."""
    target = TableLM(8, seed=1, max_context=40)
    spec = Speculator((target, LetterTokenizer(8)), drafter="ngram")
    options = dict(k=2, max_new_tokens=6, sampling=SamplingParams(temperature=1.0, seed=2))
    alone = {p: spec.generate(p, **options).token_ids for p in ("abcab", "bcdbc")}
    real = NGramDrafter.propose

    def propose(self, ids, k, generator, allowed=None):
        if ids[:3] == [7, 7, 7]:  # "hhh..."
            raise RuntimeError("injected")
        return real(self, ids, k, generator, allowed)

    monkeypatch.setattr(NGramDrafter, "propose", propose)
    prompts = ["abcab", "hhhh", "bcdbc", "a\ud800"]
    results = spec.generate_batch(prompts, slots=3, **options)
    assert results[1].error == "internal error: RuntimeError: injected"
    assert "lone surrogate (U+D800)" in results[3].error
    assert [results[0].token_ids, results[2].token_ids] == [alone["abcab"], alone["bcdbc"]]
    with pytest.raises(RuntimeError, match="injected"):
        spec.generate("hhhh", **options)


def test_a_cancelled_request_frees_its_slot_at_once():
    target = TableLM(8, seed=1)
    engine = SpeculativeEngine(target, slots=1)
    stats = GenerationStats("none", "0")
    running = engine.submit(Request([1, 2], EngineConfig(50, GREEDY), NoDrafter(), ConstantK(0), stats))
    engine.step()
    engine.cancel(running)
    assert running.done and stats.stop_reason == "cancelled" and engine.free_slots == 1
    assert engine.step() == []


def test_the_engine_sums_its_forwards_and_those_that_score_prompts():
    target = TableLM(8, seed=1)
    engine = SpeculativeEngine(target, slots=2, prefill_chunk=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [4, 5], [6, 7, 1, 2, 3, 4, 5]]  # 9, 1 and 6 tokens to score
    steps = 0
    for prompt in [*prompts, None]:
        while engine.running and (prompt is None or not engine.free_slots):
            engine.step()  # every step scores something: one forward
            steps += 1
        if prompt is not None:
            stats = GenerationStats("none", "0")
            engine.submit(Request(prompt, EngineConfig(5, GREEDY), NoDrafter(), ConstantK(0), stats))
    totals = engine.forwards
    assert totals.prompt_tokens == 9 + 1 + 6 and totals.forwards == steps
    assert 0 < totals.prompt_forwards < totals.forwards and 0 < totals.prompt_seconds < totals.seconds


# Chi-square through a mixed batch: three requests per batch, each seeded: a model drafter at temperature 1,
# prompt lookup at temperature 0.8 with top-p 0.9, and a model drafter at temperature 0.9 with top-k 3 drawing
# invariantly (each position's token at its own uniform); the first two tokens of each against its exact
# distribution. N batches, 3 tests, α = 1e-4 / 3 (Bonferroni).
N_BATCHES = 3000
ALPHA = 1e-4 / 3


def expected_first_two(target: TableLM, prompt_token: int, params: SamplingParams) -> torch.Tensor:
    v = target.vocab_size
    first = probs_from_logits(target.table[v, prompt_token].double(), params)  # after a one-token prompt
    return torch.stack([first[a] * probs_from_logits(target.table[prompt_token, a].double(), params)
                        for a in range(v)])  # fmt: skip


def p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    counts, expected = counts.flatten(), expected.flatten() * counts.sum()
    keep = expected >= 5  # cells too rare for the approximation are merged
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return scipy_stats.chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.slow
@torch.inference_mode()  # as tests/first_rounds.py: no value changes, each batch cheaper
def test_chi_square_through_a_mixed_batch():
    target = TableLM(4, seed=21, sharpness=1.2)
    draft = noisy_copy(target, 22, 1.5)
    settings = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.9, top_k=3, invariant=True),
    ]
    rows = len(settings)
    counts = torch.zeros(rows, 4, 4, dtype=torch.float64)
    engine = SpeculativeEngine(target, slots=rows)
    for seed in range(N_BATCHES):
        handles = []
        for row, params in enumerate(settings):
            sampling = dataclasses.replace(params, seed=rows * seed + row)
            drafter = NGramDrafter(2, 1) if row == 1 else ModelDrafter(draft, sampling, 4)
            stats = GenerationStats(drafter.name, "3")
            handles.append(
                engine.submit(Request([1 + row], EngineConfig(2, sampling), drafter, ConstantK(3), stats))
            )
        outputs: dict[int, list[int]] = {row: [] for row in range(rows)}
        while engine.running:
            for running, tokens in engine.step():
                outputs[handles.index(running)] += tokens
        for row in range(rows):
            first, second = outputs[row]
            counts[row, first, second] += 1
    for row, params in enumerate(settings):
        assert p_value(counts[row], expected_first_two(target, 1 + row, params)) > ALPHA


def test_generate_batch_from_a_jsonl_file(tmp_path, capsys, shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    requests = tmp_path / "requests.jsonl"
    lines = [{"id": "a", "prompt": "Once upon a time"}, {"id": "b", "prompt": "Tom had a red ball."},
             {"prompt": "The sun was hot"}]  # fmt: skip
    requests.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    argv = [
        "generate",
        "--batch",
        str(requests),
        "--json",
        "--max-new-tokens",
        "12",
        "--max-batch",
        "2",
        *model,
    ]
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in records] == ["a", "b", "3"]  # a line without an id: its line number
    for record, line in zip(records, lines, strict=True):
        assert cli.main(["generate", line["prompt"], "--json", "--max-new-tokens", "12", *model]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == record["token_ids"]


def test_a_malformed_line_gets_an_error_record_and_the_others_run_untouched(tmp_path, capsys, shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    good = ['{"id": "a", "prompt": "Once upon a time"}', '{"id": "d", "prompt": "The dog"}']
    mixed, clean = tmp_path / "mixed.jsonl", tmp_path / "clean.jsonl"
    mixed.write_text("\n".join([good[0], "{not json", '{"id": "a", "prompt": "x"}', good[1]]) + "\n")
    clean.write_text("\n".join(good) + "\n")
    options = ["--json", "--max-new-tokens", "12", "--max-batch", "2", *model]
    assert cli.main(["generate", "--batch", str(mixed), *options]) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in records] == ["a", "line-2", "line-3", "d"] and "2 refused" in err
    assert records[1]["error"].startswith(f"{mixed}:2: not JSON")
    assert records[2]["error"] == f"{mixed}:3: id 'a' repeats line 1's"
    assert cli.main(["generate", "--batch", str(clean), *options]) == 0
    alone = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    def kept(record: dict) -> tuple:
        return record["id"], record["text"], record["token_ids"]

    assert [kept(records[0]), kept(records[3])] == [kept(r) for r in alone]
    assert all(r["token_ids"] for r in alone)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", r"requests.jsonl:1: not JSON"),
        ("not json\n[]\n", r"requests.jsonl:1: not JSON .* \(and the 1 other lines\)"),
        ('{"id": "a"}\n', r'requests.jsonl:1: a request is an object with "prompt" or "messages"'),
        ('{"prompt": 3}\n', r'requests.jsonl:1: "prompt" must be a string'),
        ('{"messages": []}\n', r'requests.jsonl:1: "messages" must be a non-empty list'),
        ('{"prompt": "x", "k": 3}\n', r"requests.jsonl:1: 'k' is the whole job's setting \(its flag\)"),
        ('{"prompt": "x", "max_tokens": 8}\n', r"requests.jsonl:1: 'max_tokens' is the whole job's setting"),
        ("\n\n", r"holds no requests"),
    ],
)
def test_malformed_batch_files_are_one_line_errors(tmp_path, capsys, content, message):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(content)
    assert cli.main(["generate", "--batch", str(requests)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err)


def test_a_lines_own_keys_are_kept_out_and_a_setting_fails_that_line_alone(tmp_path):
    """A line may carry keys of its own (a dataset's columns: ignored); a generation setting on a line (it
    would be silently the job's) fails that line alone, in one line naming it, and the others are requests."""
    requests = tmp_path / "requests.jsonl"
    lines = ['{"id": "a", "prompt": "x", "source": "wiki"}', '{"id": "b", "prompt": "y", "temperature": 0.7}']
    requests.write_text("\n".join(lines) + "\n")
    (first, body, _), (second, refused, _) = read_requests(requests)
    assert (first, body) == ("a", "x") and second == "b"  # a refused line named by its id where it has one
    assert isinstance(refused, dict) and refused["error"].startswith(
        f"{requests}:2: 'temperature' is the whole"
    )


@pytest.mark.parametrize("key", ["tools", "tool_choice", "parallel_tool_calls"])
def test_a_line_making_tool_calls_fails_alone(tmp_path, key):
    """A batch job makes no tool calls: a line asking for them fails alone, saying so (not pointing to a
    flag the job does not have)."""
    requests = tmp_path / "requests.jsonl"
    lines = [{"id": 1, "prompt": "x", key: "required" if key == "tool_choice" else []}, {"prompt": "y"}]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (first, refused, _), (second, body, _) = read_requests(requests)
    assert first == 1 and (second, body) == ("2", "y")
    assert isinstance(refused, dict)
    assert refused["error"] == (
        f'{requests}:1: a batch job makes no tool calls ({key!r}): a line holds "id", "prompt" or '
        '"messages", and "json_schema", "regex" or "grammar"'
    )


def test_batch_bad_combinations(tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "x"}\n')
    for extra, message in [(["hello"], "PROMPT or --batch"), (["--show-trace"], "no traces"),
                           (["--max-batch", "0"], "--max-batch must be >= 1")]:  # fmt: skip
        assert cli.main(["generate", "--batch", str(requests), *extra]) == 2
        assert message in capsys.readouterr().err
    assert cli.main(["generate", "hello", "--max-batch", "4"]) == 2  # a setting of --batch alone
    assert "give --batch too" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- scheduler


@needs_native
def test_scheduler_serves_many_threads_each_as_alone(native_target):
    spec = speculator(native_target, "ngram")
    options = GenerationOptions(k=2, max_new_tokens=16, sampling=GREEDY)
    alone = {p: spec.generate(p, options) for p in PROMPTS}
    got: dict[str, list[int]] = {}
    texts: dict[str, str] = {}

    def client(prompt: str) -> None:
        handle = scheduler.submit(prompt, options)
        chunks = list(handle)
        got[prompt] = [t for c in chunks for t in c.token_ids]
        texts[prompt] = "".join(c.text for c in chunks)

    with Scheduler(spec, slots=3, max_queue=len(PROMPTS)) as scheduler:
        threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert got == {p: r.token_ids for p, r in alone.items()}
    assert texts == {p: r.text for p, r in alone.items()}


def test_scheduler_cancel_frees_the_slot_and_a_full_queue_refuses():
    target = TableLM(8, seed=1)
    spec = Speculator((target, LetterTokenizer(8)), drafter="none")
    options = GenerationOptions(k=0, max_new_tokens=200, sampling=GREEDY)
    with Scheduler(spec, slots=1, max_queue=1) as scheduler:
        first = scheduler.submit("abc", options)
        second = scheduler.submit("bcd", dataclasses.replace(options, max_new_tokens=3))
        with pytest.raises(QueueFull, match="1 requests running and 1 waiting"):
            scheduler.submit("cde", options)
        next(iter(first))  # it runs
        first.cancel()
        assert len([t for c in second for t in c.token_ids]) == 3  # the slot went to the waiting one
        assert first.finished.wait(10) and first.stats.stop_reason == "cancelled"
        with pytest.raises(ValueError, match="the prompt is empty"):
            scheduler.submit("", options)
    with pytest.raises(ValueError, match="the scheduler is closed"):
        scheduler.submit("abc", options)


def test_auto_is_compared_with_the_best_rival_of_its_own_turn():
    """A machine that drifts between turns: auto against max(none, the method's fixed Ks) of the same turn
    (not against the rivals' medians, which would mix the fast turn with the slow), at its own concurrency."""

    def cell(method, k, c, turns):
        return {"method": method, "k": k, "concurrency": c, "tokens_per_second_turns": turns}

    cells = [cell("none", "", 1, [100.0, 200.0, 300.0]), cell("ngram", "4", 1, [120.0, 150.0, 310.0]),
             cell("ngram", "auto", 1, [114.0, 190.0, 155.0]), cell("eagle", "8", 1, [1000.0, 1000.0, 1000.0]),
             cell("none", "", 2, [50.0, 50.0]), cell("ngram", "auto", 2, [50.0, 25.0]),
             cell("ngram", "auto", 4, [1.0])]  # fmt: skip
    auto_against_best(cells)
    assert cells[2]["auto_vs_best_turns"] == [114 / 120, 190 / 200, 155 / 310]  # not eagle's
    assert cells[2]["auto_vs_best"] == 114 / 120  # the median
    assert (
        cells[5]["auto_vs_best_turns"] == [1.0, 0.5] and cells[5]["auto_vs_best"] == 0.5
    )  # the lower middle
    assert "auto_vs_best" not in cells[6]  # no none at C = 4
    assert all("auto_vs_best" not in cells[i] for i in (0, 1, 3, 4))


def test_every_cell_takes_every_place_in_a_turn():
    """Over as many turns as cells, each cell runs first, second, ... last once; each turn runs them all."""
    for count in (1, 2, 5):
        orders = [rotated(count, turn) for turn in range(count)]
        assert all(sorted(order) == list(range(count)) for order in orders)
        assert all(sorted(order[place] for order in orders) == list(range(count)) for place in range(count))
    assert rotated(3, 4) == [1, 2, 0]


def test_bench_load_runs_and_reports(tmp_path, capsys, shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    out = tmp_path / "load"
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    argv = ["bench-load", *model, "--methods", "none,ngram", "--concurrency", "1,2", "--requests", "3",
            "--repetitions", "2", "--max-new-tokens", "4", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    cells = {(c["method"], c["concurrency"]): c for c in results["cells"]}
    assert set(cells) == {("none", 1), ("none", 2), ("ngram", 1), ("ngram", 2)}
    for cell in cells.values():
        assert cell["requests"] == 3 and cell["tokens"] + cell["failures"] > 0
        assert cell["tokens_per_second"] > 0 and cell["ttft_p50"] <= cell["ttft_p99"]
        runs = cell["tokens_per_second_runs"]  # the repetitions' speeds, sorted; the cell's is the median run
        assert len(runs) == 2 and sorted(runs) == runs and cell["tokens_per_second"] == runs[0]
        assert sorted(cell["tokens_per_second_turns"]) == runs
        prompt, decode = cell["prompt_forward_share"], cell["decode_forward_share"]  # of the runs' time
        assert 0 < prompt and 0 < decode and prompt + decode < 1
    for c in (1, 2):  # auto against the best of none and fixed K, turn by turn (here none is the only rival)
        auto, plain = cells[("ngram", c)], cells[("none", c)]["tokens_per_second_turns"]
        ratios = [a / p for a, p in zip(auto["tokens_per_second_turns"], plain, strict=True)]
        assert auto["auto_vs_best_turns"] == ratios and auto["auto_vs_best"] == min(ratios)
        assert "auto_vs_best" not in cells[("none", c)]
    for method in ("none", "ngram"):  # the same greedy requests at every concurrency: the same tokens
        assert cells[(method, 1)]["tokens"] == cells[(method, 2)]["tokens"] == cells[("none", 1)]["tokens"]
    assert LoadConfig(concurrency=(1, 2)).request_count == 8
    assert LoadConfig(concurrency=(4, 16, 8)).request_count == 64
    assert (out / "results.md").is_file() and (out / "tokens_per_second.png").is_file()
    paired = f"| ngram k=auto | 2 | {cells[('ngram', 2)]['auto_vs_best']:.2f}× |"
    assert "paired by turn" in (out / "results.md").read_text() and paired in (out / "results.md").read_text()
    assert "| ngram k=auto | 2 |" in capsys.readouterr().out
    for bad, message in [(["--methods", "medusa"], "unknown method 'medusa'"),
                         (["--concurrency", "0"], "concurrency levels must be integers >= 1"),
                         (["--repetitions", "0"], "repetitions must be an integer >= 1")]:  # fmt: skip
        assert cli.main(["bench-load", *model, *bad, "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err


def test_bench_load_runs_a_draft_model(tmp_path, shared_model):
    """``model`` drafts with ``--draft`` (here the target itself: every draft accepted); greedy: the same
    tokens as ``none``, more than one a target call, at every concurrency."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    out = tmp_path / "load"
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    argv = ["bench-load", *model, "--draft", str(root / "stories260K.bin"), "--methods", "none,model",
            "--concurrency", "1,3", "--k", "3", "--requests", "3", "--max-new-tokens", "12", "--threads", "1",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    cells = {(c["method"], c["concurrency"]): c for c in results["cells"]}
    assert set(cells) == {("none", 1), ("none", 3), ("model", 1), ("model", 3)}
    assert results["config"]["draft"] == str(root / "stories260K.bin")
    for c in (1, 3):
        assert (
            cells[("model", c)]["tokens"] == cells[("none", c)]["tokens"]
            and cells[("model", c)]["failures"] == 0
        )
        assert cells[("model", c)]["tokens_per_target_call"] > 1.5


def test_bench_load_runs_the_suffix_drafter_cold_and_warm(tmp_path, shared_model):
    """``suffix`` and ``suffix-warm`` are rows of their own; greedy: the same tokens as ``none``; warm (every
    prompt once through the speculator first) accepts more per target call than cold."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    out = tmp_path / "load"
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    argv = ["bench-load", *model, "--methods", "none,suffix,suffix-warm", "--concurrency", "2", "--k", "4",
            "--requests", "4", "--max-new-tokens", "12", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    cells = {c["method"]: c for c in json.loads((out / "results.json").read_text())["cells"]}
    assert set(cells) == {"none", "suffix", "suffix-warm"}
    assert cells["suffix"]["tokens"] == cells["suffix-warm"]["tokens"] == cells["none"]["tokens"]
    assert cells["suffix-warm"]["tokens_per_target_call"] > cells["suffix"]["tokens_per_target_call"]
    assert "| suffix-warm k=4 | 2 |" in (out / "results.md").read_text()
