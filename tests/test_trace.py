"""Token-fate traces recorded by the engine: exact probabilities, fates that add up to the stats, texts of
byte-fallback tokens, and tracing that changes nothing about the generation."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from fakes import LetterTokenizer, TableLM
from one_sequence import OneSequence
from verispec.costs.policies import ConstantK
from verispec.drafting.base import NoDrafter
from verispec.drafting.draft_model import ModelDrafter
from verispec.drafting.ngram import NGramDrafter
from verispec.engine.sequence import EngineConfig, GenerationStats
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits
from verispec.trace import TokenFate, TokenProbs, Trace, TraceRecorder, token_texts

V = 6
PROMPT = [1, 2, 3, 1, 2]
SAMPLINGS = {  # rejection sampling's draws, whose odds a trace shows (a seed's default is invariant draws)
    "greedy": SamplingParams(temperature=0),
    "t1": SamplingParams(seed=5, invariant=False),
    "t0.7-topk4": SamplingParams(temperature=0.7, top_k=4, seed=6, invariant=False),
}


def noisy_copy(model: TableLM, seed: int, noise: float) -> TableLM:
    draft = TableLM(model.vocab_size, seed=seed, max_context=model.max_context)
    draft.table = model.table + noise * draft.table
    return draft


def make_drafter(kind: str, target: TableLM, sampling: SamplingParams):
    if kind == "model":
        return ModelDrafter(noisy_copy(target, 11, 1.0), sampling, V)
    return NGramDrafter() if kind == "ngram" else NoDrafter()


def traced_run(kind: str, sampling: SamplingParams, n: int = 40, trace: bool = True, stop_check=None):
    """(target, draft model or None, generated ids, stats, recorder or None)."""
    target = TableLM(V, seed=4)
    drafter = make_drafter(kind, target, sampling)
    recorder = TraceRecorder() if trace else None
    engine = OneSequence(target, drafter, ConstantK(3), trace=recorder)
    stats = GenerationStats(drafter.name, "3")
    config = EngineConfig(max_new_tokens=n, sampling=sampling)
    out = [t for tokens in engine.stream(PROMPT, config, stats, stop_check) for t in tokens]
    draft = drafter.model if kind == "model" else None
    return target, draft, out, stats, recorder


def probs_at(model: TableLM, context: Sequence[int], sampling: SamplingParams) -> torch.Tensor:
    """The model's transformed next-token distribution after ``context``: [V]."""
    seq = [model.vocab_size, model.vocab_size, *context]
    return probs_from_logits(model.table[seq[-2], seq[-1]], sampling)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("kind", ["model", "ngram", "none"])
def test_tracing_changes_nothing(kind, sampling):
    """The same tokens and counters with and without a recorder: tracing draws no random numbers."""
    _, _, plain, plain_stats, _ = traced_run(kind, sampling, trace=False)
    _, _, traced, traced_stats, recorder = traced_run(kind, sampling)
    assert traced == plain
    assert (traced_stats.target_calls, traced_stats.accepted) == (
        plain_stats.target_calls,
        plain_stats.accepted,
    )
    assert [t.token.token_id for t in recorder.tokens] == plain


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("kind", ["model", "ngram", "none"])
def test_fates_and_probabilities_are_exact(kind, sampling):
    """Every recorded number equals the one computed from the models' tables at the token's context; the
    fates add up to the stats."""
    target, draft, out, stats, recorder = traced_run(kind, sampling)
    trace = recorder.finish(LetterTokenizer(V), stats.as_dict(), "prompt")
    assert len(trace.tokens) == stats.new_tokens == len(out)
    assert trace.count("accepted") == stats.accepted
    assert trace.count("recovered") + trace.count("bonus") == stats.target_calls  # no end-of-sequence here
    assert [tokens[0].round for tokens in trace.rounds] == list(range(stats.target_calls))
    for i, t in enumerate(trace.tokens):
        context = PROMPT + out[:i]
        p = probs_at(target, context, sampling)
        assert t.token.p == pytest.approx(float(p[t.token.token_id]), abs=1e-6)
        if sampling.greedy:
            softmax = probs_at(target, context, SamplingParams())
            assert t.token.p == 1.0
            assert t.token.p_softmax == pytest.approx(float(softmax[t.token.token_id]), abs=1e-6)
        else:
            assert t.token.p_softmax is None
        if t.fate == "bonus":
            assert t.accept_prob is None and t.token.q is None and t.rejected is None
            continue
        drafted = t.token.token_id if t.fate == "accepted" else t.rejected.token_id
        if draft is None or sampling.greedy:  # a point mass on the guess
            q = torch.nn.functional.one_hot(torch.tensor(drafted), V).float()
        else:
            q = probs_at(draft, context, sampling)
        assert t.token.q == pytest.approx(float(q[t.token.token_id]), abs=1e-6)
        ratio = float(p[drafted] / q[drafted]) if q[drafted] > 0 else float(p[drafted] > 0)
        assert t.accept_prob == pytest.approx(min(1.0, ratio), abs=1e-5)
        if t.fate == "recovered":
            assert t.rejected.p == pytest.approx(float(p[drafted]), abs=1e-6)
            assert t.rejected.q == pytest.approx(float(q[drafted]), abs=1e-6)
    assert "".join(t.token.text for t in trace.tokens) == LetterTokenizer(V).decode(out)


def test_all_three_fates_occur_and_a_recorder_serves_one_generation():
    _, _, _, stats, recorder = traced_run("model", SAMPLINGS["t1"], n=60)
    fates = {t.fate for t in recorder.tokens}
    assert fates == {"accepted", "recovered", "bonus"}
    recorder.num_rounds += 1  # as if it had recorded a round of another generation
    with pytest.raises(ValueError, match="one TraceRecorder per generation"):
        recorder.finish(LetterTokenizer(V), stats.as_dict(), "prompt")


def test_a_stop_string_cut_keeps_only_committed_tokens():
    """The recorder saw the whole last round; the trace holds only what was committed."""
    _, _, out, stats, recorder = traced_run(
        "ngram", SAMPLINGS["t1"], stop_check=lambda ids: 7 if len(ids) > 7 else None
    )
    trace = recorder.finish(LetterTokenizer(V), stats.as_dict(), "p")
    assert stats.stop_reason == "stop_string" and len(out) == 7
    assert [t.token.token_id for t in trace.tokens] == out


class ByteTokenizer:
    """One token per byte; decoding is UTF-8 with replacement characters, as byte-fallback tokenizers."""

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    ("text", "context", "expected"),
    [
        ("ab", "", ["a", "b"]),
        ("é!", "", ["", "é", "!"]),  # é is two bytes: the second completes it
        ("x€", "", ["x", "", "", "€"]),
        ("é", "abc", ["", "é"]),
    ],
)
def test_token_texts_attribute_a_character_to_the_token_that_completes_it(text, context, expected):
    ids, before = list(text.encode()), list(context.encode())
    assert token_texts(ByteTokenizer(), ids, context=before) == expected


def test_token_texts_keep_an_unfinished_character_at_the_end():
    assert token_texts(ByteTokenizer(), list("é".encode())[:1]) == ["\ufffd"]


def test_trace_dataclasses_are_validated():
    probs = TokenProbs(token_id=1, p=0.5, q=0.25)
    with pytest.raises(ValueError, match="fate"):
        TokenFate(token=probs, fate="lost", round=0, accept_prob=0.5)
    with pytest.raises(ValueError, match="p must be a probability"):
        TokenProbs(token_id=1, p=1.5, q=None)
    with pytest.raises(ValueError, match="token_id"):
        TokenProbs(token_id=-1, p=0.5, q=None)
    with pytest.raises(ValueError, match="rejected"):
        TokenFate(token=probs, fate="recovered", round=0, accept_prob=0.5)
    with pytest.raises(ValueError, match="accept_prob"):
        TokenFate(token=probs, fate="accepted", round=0, accept_prob=None)
    late = TokenFate(token=probs, fate="bonus", round=3, accept_prob=None)
    early = TokenFate(token=probs, fate="bonus", round=1, accept_prob=None)
    with pytest.raises(ValueError, match="round order"):
        Trace(tokens=(late, early), stats={}, prompt="")


def test_a_trace_of_invariant_draws_is_refused():
    """A trace shows rejection sampling's odds of each fate, which invariant draws do not follow: refused, a
    seed's default included (greedy decoding, where the flag changes nothing, is traced)."""
    for invariant in (SamplingParams(temperature=0.8, seed=1, invariant=True), SamplingParams(seed=1)):
        with pytest.raises(ValueError, match="not with invariant draws .* invariant=False opts out"):
            traced_run("ngram", invariant)
    assert traced_run("ngram", SamplingParams(temperature=0, invariant=True))[4].tokens
