"""Structured output under every drafter of the registry, on stories260K through the library: speculative
greedy == constrained greedy decoding (drafter "none"), token for token, for a regex and a JSON schema, each
drafter alone and in a continuous batch, and each that takes token trees with a 2x3 tree. The learned kinds
draft with random heads (exactness never depends on what a drafter proposes; random heads are rejected
often, so rollback runs)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from test_eagle import fresh_head
from test_eagle3 import published_head
from test_grammar import GREEDY, REGEX, SCHEMA
from test_lookahead import random_lookahead
from test_medusa_exit import random_exit, random_medusa
from toy import single_threaded
from verispec.api import Speculator
from verispec.drafting.registry import DRAFTERS
from verispec.drafting.tree import TreeShape
from verispec.engine import rounds
from verispec.engine.sequence import GenerationStats
from verispec.grammar import Constraint
from verispec.models.registry import load_model
from verispec.options import GenerationOptions, SamplingParams

PROMPT = "Once upon a time"
CONSTRAINTS = (Constraint("regex", REGEX), Constraint("json_schema", json.dumps(SCHEMA)))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


@pytest.fixture(scope="module")
def speculators(shared_model, tmp_path_factory) -> dict[str, Speculator]:
    """A speculator on stories260K for every drafter of the registry (learned ones: random heads), and one
    drafting 2x3 token trees for every drafter that takes them ("NAME tree")."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    loaded = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")
    model, vocab, out = loaded[0], torch.arange(loaded[0].vocab_size), tmp_path_factory.mktemp("heads")
    files = {
        "eagle": fresh_head(model, vocab).save(out / "eagle.safetensors"),
        "medusa": random_medusa(model, vocab).save(out / "medusa.safetensors"),
        "exit": random_exit(model, vocab).save(out / "exit.safetensors"),
        "lookahead": random_lookahead(model, vocab).save(out / "lookahead.safetensors"),
        "eagle3": published_head(model, out / "eagle3", "eagle3"),
        "eagle2": published_head(model, out / "eagle2", "eagle2"),
    }
    made = {}
    for name, kind in DRAFTERS.items():
        draft = "layers:1" if kind.needs_draft_model else None
        path = str(files[kind.head_kind]) if kind.learned else None
        made[name] = Speculator(loaded, draft, name, drafter_path=path, target_label="tiny")
        if kind.takes_trees:
            tree = TreeShape.full(2, 3)
            made[f"{name} tree"] = Speculator(
                loaded, draft, name, tree=tree, drafter_path=path, target_label="tiny"
            )
    return made


def test_every_drafter_is_constrained_greedy_alone_and_in_a_batch(speculators) -> None:
    """Each drafter at K = 3, alone (each constraint) and in a continuous batch of two slots (three
    requests, mixed constraints and one unconstrained): the tokens of constrained greedy decoding; outputs
    match their regex / parse as their schema; drafts were rejected somewhere (rollback ran)."""
    plain = speculators["none"]
    options = [GenerationOptions(k=0, max_new_tokens=60, sampling=GREEDY, constraint=c) for c in CONSTRAINTS]
    reference = [plain.generate(PROMPT, o) for o in options]
    assert json.loads(reference[1].text)["age"] <= 120 and reference[0].text.strip().startswith("O")
    unconstrained = plain.generate(PROMPT, k=0, max_new_tokens=30, sampling=GREEDY)
    for name, speculator in speculators.items():
        mine = [dataclasses.replace(o, k=3) for o in options]
        drafted = rejected = 0
        for own, expected in zip(mine, reference, strict=True):
            stats = GenerationStats(name, "3")
            assert speculator.generate(PROMPT, own, stats=stats).token_ids == expected.token_ids, name
            drafted, rejected = drafted + stats.drafted, rejected + stats.drafted - stats.accepted
        assert drafted > 0 and (rejected > 0 or speculator.kind.name in ("none", "model", "ngram")), name
        free = GenerationOptions(k=3, max_new_tokens=30, sampling=GREEDY)
        batch = speculator.generate_batch([PROMPT] * 3, [mine[0], free, mine[1]], slots=2)
        got = [r.token_ids for r in batch]
        assert got == [reference[0].token_ids, unconstrained.token_ids, reference[1].token_ids], name


def test_masked_q_raises_acceptance(speculators, monkeypatch) -> None:
    """A sampling draft (the model drafter, the target's first layer) on the regex, seeded: with its q
    masked through the hook it accepts a larger share of its drafts than with the hook withheld (the engine
    giving it None: the unmasked q, exact but wasting positions on tokens the grammar forbids)."""
    options = GenerationOptions(
        k=3, max_new_tokens=60, sampling=SamplingParams(temperature=1.0, seed=7), constraint=CONSTRAINTS[0]
    )

    def acceptance() -> float:
        stats = GenerationStats("model", "3")
        speculators["model"].generate(PROMPT, options, stats=stats)
        return stats.accepted / stats.drafted

    masked = acceptance()
    monkeypatch.setattr(rounds, "_after", lambda grammar, forced: None)
    assert masked > acceptance() + 0.05, masked


def test_tree_rounds_draft_the_forced_trunk(speculators) -> None:
    """Each tree speculator under the JSON schema: the grammar's forced runs (the opening brace and keys)
    drafted as the trees' trunks, and still the tokens of constrained greedy decoding."""
    options = GenerationOptions(k=0, max_new_tokens=60, sampling=GREEDY, constraint=CONSTRAINTS[1])
    reference = speculators["none"].generate(PROMPT, options).token_ids
    for name in (name for name in speculators if name.endswith(" tree")):
        stats = GenerationStats(name, "3")
        got = speculators[name].generate(PROMPT, dataclasses.replace(options, k=3), stats=stats)
        assert got.token_ids == reference and stats.forced > 0, name
