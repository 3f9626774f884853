"""Constrained sampling through the real engine on real models: a chi-square of the first token the grammar
leaves free (after its forced run, drafted for free) against the target's masked distribution there, for a
JSON schema on stories260K and a regex on SmolLM2-135M. The drafts are sampled (an early
exit of the target's first layers), so rejection sampling runs: its draws are both accepted and rejected
(:func:`first_rounds.first_rounds` checks that, and that a request decoded alone gives the same round)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from first_rounds import first_rounds
from test_grammar import SCHEMA
from toy import single_threaded
from verispec.api import Speculator
from verispec.grammar import Constraint
from verispec.grammar.matcher import start_state
from verispec.grammar.rounds import constrain, forced_run
from verispec.models.registry import load_model
from verispec.options import GenerationOptions, SamplingParams
from verispec.sampling import probs_from_logits

ALPHA = 1e-3 / 3  # Bonferroni over the three tests below
SAMPLING = {"temperature": 1.0, "top_k": 20}
SMOL_REGEX = r"(Paris|Lyon|Nice|Lille|Rome) is (a|the|my) [a-z]+ city\."


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


def assert_first_free_token_follows_the_masked_target(
    speculator: Speculator, prompt: str, constraint: Constraint, runs: int
) -> None:
    """``runs`` seeded constrained requests (K = 3, sampled drafts): each first round commits the grammar's
    forced run, then a token whose counts pass a chi-square against the target's p masked with the grammar
    after the prompt and the forced run (top-k applied after the mask); nothing falls outside it."""
    model, tokenizer = speculator.model, speculator.tokenizer

    def request(seed: int):
        sampling = SamplingParams(seed=seed, **SAMPLING, invariant=False)  # rejection sampling
        options = GenerationOptions(k=3, max_new_tokens=32, sampling=sampling, constraint=constraint)
        return speculator.request(prompt, options)[0]

    ids = request(0).prompt
    state = start_state(constraint, tokenizer)
    forced = forced_run(state, 30)
    context = torch.tensor([ids + forced])  # [1, T]
    logits = model.forward(context, torch.arange(context.shape[1])[None], model.new_cache())[0, -1]  # [V]
    allowed = state.mask_after(forced)
    assert allowed is not None and int(allowed.sum()) > 1  # the first free token: a choice
    p = probs_from_logits(constrain(logits.double(), allowed), SamplingParams(**SAMPLING)).numpy()  # [V]
    rounds = first_rounds(model, request, runs)
    assert all(tokens[: len(forced)] == forced for tokens, _ in rounds)  # the forced run, always accepted
    assert all(stats.forced == len(forced) for _, stats in rounds)
    counts = np.bincount([tokens[len(forced)] for tokens, _ in rounds], minlength=len(p))  # [V]
    assert counts[p == 0].sum() == 0  # nothing outside the grammar and the top-k
    expected = p * runs
    big = expected >= 5  # cells expecting fewer than 5 pooled into one
    assert big.sum() >= 3
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    assert scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA


@pytest.mark.slow
def test_stories_json_schema_first_free_token(stories) -> None:
    """A JSON schema on stories260K: its forced opening (the brace and the first key) drafted for free, then
    the name's first character sampled."""
    speculator = Speculator(stories, draft="layers:1")
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    assert_first_free_token_follows_the_masked_target(speculator, "Once upon a time", constraint, 2000)


@pytest.mark.slow
def test_smollm2_regex_first_free_token(smollm2) -> None:
    """A regex on SmolLM2-135M, its early exit after 8 layers drafting (a JSON schema is checked on
    stories260K, with more runs for the time)."""
    speculator = Speculator(smollm2, draft="layers:8", target_label="smollm2-135m")
    prompt = "Name a city in France and say what it is like."
    assert_first_free_token_follows_the_masked_target(
        speculator, prompt, Constraint("regex", SMOL_REGEX), 150
    )
