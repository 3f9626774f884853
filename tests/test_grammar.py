"""Structured output through llguidance and the real engine on stories260K: constraints and their bad input,
the matcher's tentative paths and rollback against a fresh matcher, outputs that match their regex or parse
against their schema, speculative greedy == constrained greedy decoding (n-gram, a model draft, a token tree,
alone and in a continuous batch), and a chi-square of the first constrained sampled token."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from scipy import stats as scipy_stats

from fakes import Alternating
from toy import single_threaded
from verispec.costs.policies import ConstantK, KPolicy
from verispec.drafting.base import NoDrafter
from verispec.drafting.draft_model import ModelDrafter, ModelTreeDrafter
from verispec.drafting.ngram import NGramDrafter, NGramTreeDrafter
from verispec.drafting.tree import TreeShape
from verispec.engine.engine import SpeculativeEngine
from verispec.engine.sequence import EngineConfig, GenerationStats, Request
from verispec.errors import UsageError
from verispec.grammar import Constraint
from verispec.grammar.matcher import start_state
from verispec.grammar.rounds import constrain, forced_run
from verispec.models.registry import load_model
from verispec.sampling import SamplingParams, probs_from_logits

GREEDY = SamplingParams(temperature=0)
REGEX = r"(Once|One day), [a-z ]{5,30}\. (The|She) [a-z]+ [0-9]{2}!"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():  # a busy machine's competing threads made these forwards 80x slower
        yield


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


def generate(stories, requests, slots: int = 1) -> list[tuple[list[int], GenerationStats]]:
    """Each (drafter, constraint, sampling, k) request's tokens and stats, decoded together in one batch."""
    model, tokenizer = stories
    engine = SpeculativeEngine(model, slots=slots)
    prompt = tokenizer.encode("Once upon a time")
    runs = []
    for drafter, constraint, sampling, k in requests:
        while not engine.free_slots:  # a request joins when a slot frees
            engine.step()
        config = EngineConfig(max_new_tokens=60, sampling=sampling, eos_token_ids=tokenizer.eos_token_ids)
        stats = GenerationStats(drafter.name, str(k))
        grammar = start_state(constraint, tokenizer)
        policy = k if isinstance(k, KPolicy) else ConstantK(k)  # a tree's gate, or a chain's K
        runs.append((engine.submit(Request(prompt, config, drafter, policy, stats, grammar=grammar)), stats))
    while engine.running:
        engine.step()
    for running, _ in runs:
        assert running.error is None, running.error
    return [(running.ids[len(prompt) :], stats) for running, stats in runs]


def output_text(stories, ids: list[int]) -> str:
    return stories[1].decode(ids).strip()


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("regex", "[0-9", "regex parse error: unclosed character class"),
        ("json_schema", "{", "invalid JSON schema: not JSON"),
        ("json_schema", "[1]", "invalid JSON schema: not a JSON object"),
        ("json_schema", '{"type": "objectx"}', "invalid JSON schema"),
        ("json_schema", '{"properties": {"a": {"maxLength": 1e12}}}',
         "invalid JSON schema: maxLength 1000000000000 is more than a grammar counts (at most 4294967295)"),
        ("json_schema", '{"items": [{"minLength": 4294967296}]}', "minLength 4294967296 is more than"),
        ("grammar", "start: foo", "invalid grammar"),
        ("json_object", "{}", "takes no text"),
        ("regex", "", "takes its text"),
        ("xml", "<a/>", "unknown constraint 'xml'"),
    ],
)  # fmt: skip
def test_bad_constraints_are_one_line(kind: str, text: str, message: str) -> None:
    with pytest.raises(UsageError) as err:
        Constraint(kind, text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_tentative_paths_and_rollback_equal_a_fresh_matcher(stories) -> None:
    """Random drafts masked, then rolled back to a random accepted prefix: every mask equals a fresh
    matcher's that consumed the same committed tokens, and the drafts never moved the committed state."""
    _, tokenizer = stories
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    state, rng = start_state(constraint, tokenizer), random.Random(5)
    committed: list[int] = []
    for _ in range(12):
        path: list[int] = []
        for _ in range(rng.randint(0, 4)):  # a tentative path of allowed tokens
            mask = state.mask_after(path)
            assert mask is not None
            if not mask.any():
                break
            path.append(rng.choice(mask.nonzero().flatten().tolist()))
        fresh = start_state(constraint, tokenizer)
        fresh.settle(committed)
        assert torch.equal(state.mask_after([]), fresh.mask_after([]))  # drafting left the committed state
        keep = path[: rng.randint(0, len(path))]
        mask = state.mask_after(keep)
        assert mask is not None and mask.any()
        keep.append(rng.choice(mask.nonzero().flatten().tolist()))  # a recovered or bonus token
        state.settle(keep)
        committed += keep
        fresh = start_state(constraint, tokenizer)
        fresh.settle(committed)
        assert torch.equal(state.mask_after([]), fresh.mask_after([]))
        if state.finished:
            break
    assert state.mask_after([tokenizer.vocab_size - 1] * 40) is None  # a path that leaves the grammar


def test_nothing_follows_the_end_and_rolling_back_over_it_restores_the_masks(stories) -> None:
    """Once the grammar is complete, the end-of-sequence token alone is forced, once (llguidance's mask after
    it allows it again: consuming it twice broke the rollback count, a draft past the end then putting the
    matcher back inside the text — found by SmolLM2 answering a JSON schema); rolled back over the end, every
    mask is as before."""
    _, tokenizer = stories
    state = start_state(Constraint("regex", "ab"), tokenizer)
    ends = tokenizer.eos_token_ids
    text = forced_run(state, 10)  # "a", "b" (however the tokenizer spells them), then the end if it is one
    if text[-1] not in ends:  # two end tokens here: the end is then allowed, not forced
        assert set(state.mask_after(text).nonzero().flatten().tolist()) == ends
        text.append(min(ends))
    assert not ends & set(text[:-1])
    before = [state.mask_after(text[:i]) for i in range(len(text))]
    after_end = state.mask_after(text)
    assert after_end is not None and not after_end.any()  # nothing after the end
    assert state.mask_after([*text, text[-1]]) is None  # and the matcher does not consume it
    for i in range(len(text)):
        assert torch.equal(state.mask_after(text[:i]), before[i])
    state.settle(text)
    assert state.finished and not state.mask_after([]).any()


def test_forced_tokens_and_masked_logits(stories) -> None:
    """The regex's fixed text comes as a forced run, each token the one allowed; masked logits keep exactly
    the allowed tokens (the model's wider vocabulary never allowed)."""
    _, tokenizer = stories
    state = start_state(Constraint("regex", r"[0-9]-abc"), tokenizer)
    spelled = tokenizer.token_bytes()
    state.settle([spelled.index(b"7")])
    forced = forced_run(state, 10)
    assert b"".join(spelled[t] for t in forced) == b"-abc"
    mask = state.mask_after([])
    logits = constrain(torch.zeros(2, tokenizer.vocab_size + 3), mask.expand(2, -1))  # [2, V + 3]
    assert torch.equal(torch.isfinite(logits[0, : tokenizer.vocab_size]), mask)
    assert not torch.isfinite(logits[:, tokenizer.vocab_size :]).any()


def test_outputs_match_their_regex_and_schema(stories) -> None:
    """Greedy and sampled outputs, speculative, in a batch: each matches its regex or parses as its
    schema, and the forced runs were drafted."""
    model = stories[0]
    regex, schema = Constraint("regex", REGEX), Constraint("json_schema", json.dumps(SCHEMA))
    sampled = SamplingParams(temperature=1.0, seed=3, invariant=False)
    requests = [
        (NGramDrafter(), regex, GREEDY, 4),
        (NGramDrafter(), schema, GREEDY, 4),
        (ModelDrafter(model.first_layers(1), sampled, model.vocab_size), regex, sampled, 3),
        (ModelDrafter(model.first_layers(1), sampled, model.vocab_size), schema, sampled, 3),
    ]
    results = generate(stories, requests, slots=4)
    for (_, constraint, _, _), (ids, stats) in zip(requests, results, strict=True):
        text = output_text(stories, ids)
        assert stats.stop_reason == "eos" and stats.forced > 0, (text, stats.stop_reason)
        if constraint is regex:
            assert re.fullmatch(REGEX, text), text
        else:
            value = json.loads(text)
            assert set(value) == {"name", "age"} and isinstance(value["age"], int), text


def test_speculative_greedy_equals_constrained_greedy(stories) -> None:
    """n-gram, a model draft and an n-gram tree == constrained greedy decoding without drafts, alone and in
    a continuous batch (rejections happened: rollback was exercised)."""
    model = stories[0]
    constraints = [Constraint("regex", REGEX), Constraint("json_schema", json.dumps(SCHEMA))]
    reference = [ids for ids, _ in generate(stories, [(NoDrafter(), c, GREEDY, 0) for c in constraints])]
    for constraint, expected in zip(constraints, reference, strict=True):
        drafters = [NGramDrafter(), ModelDrafter(model.first_layers(1), GREEDY, model.vocab_size)]
        drafters += [NGramTreeDrafter(TreeShape.full(2, 3))]  # type: ignore[list-item]
        rejected = 0
        for drafter in drafters:
            [(ids, stats)] = generate(stories, [(drafter, constraint, GREEDY, 4)])
            assert ids == expected, drafter.name
            rejected += stats.drafted - stats.accepted
        assert rejected > 0
        gated = Alternating(True)  # tree rounds and plain ones in turn, hung from the forced runs
        draft = ModelDrafter(model.first_layers(1), GREEDY, model.vocab_size)
        [(ids, _)] = generate(
            stories, [(ModelTreeDrafter(draft, TreeShape.full(2, 2)), constraint, GREEDY, gated)]
        )
        assert ids == expected and True in gated.drafted and False in gated.drafted
    batch = [(NGramDrafter(), constraints[0], GREEDY, 4), (NoDrafter(), constraints[1], GREEDY, 0)]
    batch += [(ModelDrafter(model.first_layers(1), GREEDY, model.vocab_size), constraints[0], GREEDY, 3)]
    got = [ids for ids, _ in generate(stories, batch, slots=2)]  # the third joins when a slot frees
    assert got == [reference[0], reference[1], reference[0]]


def test_first_sampled_token_chi_square(stories) -> None:
    """The first constrained token, sampled with a model draft (K = 3) through the engine, is distributed as
    the constrained p at the prompt's end (top-k and top-p applied after the mask)."""
    model, tokenizer = stories
    sampling = SamplingParams(temperature=1.0, top_k=12, top_p=0.95)  # each run's, with its own seed
    constraint = Constraint("regex", r"(a|an|the|he|she|it|one|two|they)[a-z]* [a-z]+")
    prompt = tokenizer.encode("Once upon a time")
    logits = model.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], model.new_cache())[0, -1]
    p = probs_from_logits(
        constrain(logits, start_state(constraint, tokenizer).mask_after([])), sampling
    )  # [V]
    runs = 300
    engine = SpeculativeEngine(model, slots=8)
    counts = torch.zeros(model.vocab_size)  # [V]
    generator = torch.Generator().manual_seed(11)
    pending = list(range(runs))
    while pending or engine.running:
        while pending and engine.free_slots:
            pending.pop()
            seed = int(torch.randint(2**62, (1,), generator=generator))
            seeded = SamplingParams(1.0, top_k=12, top_p=0.95, seed=seed, invariant=False)  # rejection
            config = EngineConfig(max_new_tokens=4, sampling=seeded, eos_token_ids=tokenizer.eos_token_ids)
            drafter = ModelDrafter(model.first_layers(1), seeded, model.vocab_size)
            stats = GenerationStats("model", "3")
            request = Request(
                prompt, config, drafter, ConstantK(3), stats, grammar=start_state(constraint, tokenizer)
            )
            engine.submit(request)
        for running, _ in engine.step():
            if running.done:
                assert running.error is None
                counts[running.ids[len(prompt)]] += 1
    support = p > 0
    assert counts[~support].sum() == 0  # nothing outside the grammar and the nucleus
    big = support & (p * runs >= 5)  # cells expecting fewer than 5 pooled into one (where there are any)
    small = support & ~big
    observed = torch.cat([counts[big], counts[small].sum(0, keepdim=True)[: int(small.any())]]).double()
    expected = torch.cat([p[big], p[small].sum(0, keepdim=True)[: int(small.any())]]).double()
    expected *= observed.sum().double() / expected.sum()  # the float32 p's round-off off the total
    assert big.sum() >= 3
    assert scipy_stats.chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
