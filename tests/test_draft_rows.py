"""A draft model beside an engine's slots drafts the batch's rows together: its cache is the same row of a
whole cache of its own (``draft_cache_row``), every row's reading and each draft position one forward over
the rows, and each row's proposal (tokens and q) bit for bit what a drafter of its own proposes alone. The
models: test_eagle's tiny random Llama in float16 on the native kernels, and a copy of it a little off."""

from __future__ import annotations

import pytest
import torch

from fakes import LetterTokenizer
from test_eagle import GREEDY, VOCAB, plain_greedy, tiny_target
from test_learned_native import PROMPTS, batch_and_alone, native_tiny_target, rows_as_alone
from test_lookahead import needs_native
from verispec.api import Speculator
from verispec.drafting.base import Allowed
from verispec.drafting.draft_model import ModelDrafter, draft_cache_row
from verispec.engine.scheduler import Scheduler
from verispec.models.llama import Llama
from verispec.options import GenerationOptions, SamplingParams

pytestmark = needs_native
SAMPLINGS = [GREEDY, SamplingParams(temperature=0.8, seed=5)]


@pytest.fixture(scope="module")
def target() -> Llama:
    return native_tiny_target()


@pytest.fixture(scope="module")
def draft() -> Llama:
    """The target's weights a little off, on the native kernels: most drafts accepted, some not."""
    model, noise = tiny_target(seed=4), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(0.05 * torch.randn(weight.shape, generator=noise))
    assert model.optimize_for_cpu(precision="fp16", min_weight_elements=0) and model.on_native_kernels
    return model


def counted_rows(model: Llama, monkeypatch) -> list[int]:
    """The rows of each of ``model``'s batched forwards from now on."""
    calls: list[int] = []
    original = model.forward_rows
    monkeypatch.setattr(model, "forward_rows", lambda rows: (calls.append(len(rows)), original(rows))[1])
    return calls


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_rows_of_a_batch_draft_together_each_as_alone(target, draft, sampling, monkeypatch):
    """Drafters whose caches are rows of the draft's cache for one batch (its rows beside the target's rows,
    in any order) propose together, and each row's proposal is bit for bit what a drafter with a cache of its
    own proposes for it alone, whatever the rows' contexts (read in blocks), K (0 and a grammar's end among
    them); a second round after a rollback too."""
    slots = target.new_cache_rows(4)
    together = [ModelDrafter(draft, sampling, VOCAB, slot=slots[i]) for i in (2, 0, 3, 1)]
    assert len({d.rows_key for d in together}) == 1 and together[0].rows_key is not None
    alone = [ModelDrafter(draft, sampling, VOCAB) for _ in together]
    assert all(d.rows_key is None for d in alone)
    rng = torch.Generator().manual_seed(7)
    contexts = [torch.randint(0, VOCAB, (n,), generator=rng).tolist() for n in (9, 150, 14, 7)]  # 150: blocks
    ks = [3, 4, 0, 2]

    def stop_early(path: list[int]) -> torch.Tensor | None:  # a grammar that ends after one token
        return None if len(path) >= 1 else torch.ones(VOCAB, dtype=torch.bool)

    alloweds: list[Allowed | None] = [None, None, None, stop_early]
    for d, context in zip([*together, *alone], contexts * 2, strict=True):
        d.begin(context)
    calls = counted_rows(draft, monkeypatch)
    for _ in range(2):
        proposals = rows_as_alone(ModelDrafter, together, alone, contexts, ks, alloweds, sampling, calls)
        assert [len(p.tokens) for p in proposals] == [3, 4, 0, 1]
        for d, other, p in zip(together, alone, proposals, strict=True):  # the first accepted, then a token
            d.observe(min(1, len(p.tokens)))
            other.observe(min(1, len(p.tokens)))
        contexts = [[*c, *p.tokens[:1].tolist(), 1] for c, p in zip(contexts, proposals, strict=True)]
    held = [d.cache.length for d in together]
    assert held == [d.cache.length for d in alone] and held[2] < len(contexts[2]) - 2  # K = 0 read nothing


@pytest.mark.parametrize("broken", [False, True], ids=["together", "call-raises"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_a_continuous_batch_drafts_its_rows_together(target, draft, sampling, broken, monkeypatch):
    """Through the engine: a continuous batch of requests drafting with a model proposes its rows together
    (one call for several rows), and each output is the one the request gets alone (greedy: the target's
    own; sampled with a seed: the same tokens); when a call for several rows raises after drafting them all,
    each row's drafter is rolled back and asked alone: the outputs are the same."""
    tokenizer = LetterTokenizer(VOCAB)
    spec = Speculator((target, tokenizer), draft=(draft, tokenizer), drafter="model")

    def fault(rows, proposals):
        if broken and len(rows) > 1:
            raise RuntimeError("a fault after drafting")

    calls = counted_rows(draft, monkeypatch)
    batch = batch_and_alone(spec, ModelDrafter, sampling, monkeypatch, after=fault)
    assert max(calls) >= 2
    if sampling.greedy:
        reference = plain_greedy(target, tokenizer, PROMPTS, 40)
        assert all(result.token_ids == reference[p] for p, result in zip(PROMPTS, batch, strict=True))
    assert sum(result.stats["accepted"] for result in batch) > 0


@pytest.mark.parametrize("door", ["scheduler", "stream"])
def test_a_next_turn_keeps_the_start_its_row_holds(target, draft, door, monkeypatch):
    """On an engine's slots — a scheduler's (a server's) or the one slot a speculator's streams run on (the
    library's and the CLI's) — a sequence whose prompt begins with what its row's last sequence committed
    (a conversation's next turn) reads only the rest of its prompt into the draft's row; its output is the
    one a fresh speculator gives (greedy: the target's own); a prompt that shares nothing with it reads all
    of it."""
    tokenizer = LetterTokenizer(VOCAB)
    spec = Speculator((target, tokenizer), draft=(draft, tokenizer), drafter="model")
    read: list[int] = []  # the prompt tokens each of the draft's forwards reads (keys and values only)
    original = draft.forward_rows

    def counted(rows):
        read.append(sum(len(row.tokens) for row in rows if not row.logits))
        return original(rows)

    monkeypatch.setattr(draft, "forward_rows", counted)
    options = GenerationOptions(k=3, max_new_tokens=20, sampling=GREEDY)
    with Scheduler(spec, slots=2) as scheduler:

        def run(prompt: list[int]) -> list[int]:
            if door == "stream":
                return spec.generate(prompt, options).token_ids
            handle = scheduler.submit(prompt, options)
            return [t for chunk in handle for t in chunk.token_ids]

        first_prompt = tokenizer.encode("abcabc")
        first = run(first_prompt)
        prompt = first_prompt + first + tokenizer.encode("xyz", add_bos=False)
        read.clear()
        second = run(prompt)
        assert 0 < sum(read) <= len(prompt) - len(first_prompt) - len(first) + 3, (read, len(prompt))
        other = tokenizer.encode("mnopqrs")
        read.clear()
        run(other)
        assert sum(read) >= len(other) - 2  # nothing shared but a BOS: all of it read
    fresh = Speculator((target, tokenizer), draft=(draft, tokenizer), drafter="model")
    assert (
        second == fresh.generate(prompt, options).token_ids == plain_greedy_ids(target, tokenizer, prompt, 20)
    )


def plain_greedy_ids(target: Llama, tokenizer, prompt: list[int], n: int) -> list[int]:
    plain = Speculator((target, tokenizer), drafter="none")
    return plain.generate(prompt, k=0, max_new_tokens=n, sampling=GREEDY).token_ids


def test_a_draft_off_the_native_kernels_or_without_a_slot_row_keeps_its_own_cache(target, draft):
    """A cache of its own (nothing proposes with it) where the draft is not on the native kernels, where the
    target's cache is not a row of an engine's slots, or for an early exit reading the target's cache; the
    rows of one draft beside one whole target cache are made once."""
    slots = target.new_cache_rows(2)
    own = [
        ModelDrafter(tiny_target(seed=4), GREEDY, VOCAB, slot=slots[0]),  # float32, off the kernels
        ModelDrafter(draft, GREEDY, VOCAB, slot=target.new_cache(1)),
        ModelDrafter(draft, GREEDY, VOCAB),
        ModelDrafter(target.first_layers(1), GREEDY, VOCAB, target_cache=slots[0], slot=slots[0]),
    ]
    assert all(d.rows_key is None for d in own)
    assert draft_cache_row(draft, slots[1]) is draft_cache_row(draft, slots[1])
    assert draft_cache_row(draft, slots[0]).whole[0] is draft_cache_row(draft, slots[1]).whole[0]
    keys = [ModelDrafter(draft, GREEDY, VOCAB, slot=s).rows_key for s in slots]
    assert keys[0] == keys[1] is not None
