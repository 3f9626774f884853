"""Prompt lookup first, the eagle head elsewhere (``ngram+eagle``, :mod:`verispec.drafting.hybrid`): each
round the lookup's proposal where the context's suffix occurred before, else the head's, bit for bit what
each drafter proposes alone; the head caught up on the rounds it sat out; the target's greedy output, alone
and in a continuous batch whose rows draft together; the first sampled token distributed as the target's,
whichever part drafted it. The target: test_learned_native's tiny random Llama on the native kernels."""

from __future__ import annotations

import pytest
import torch

from fakes import LetterTokenizer
from test_eagle import ALPHA, GREEDY, VOCAB, drafter_with_context, first_token_chi_square, hidden_states
from test_learned_native import batch_and_alone, native_copy, native_tiny_target, random_head
from test_lookahead import needs_native
from verispec.api import Speculator
from verispec.cli import main
from verispec.costs.policies import CostModelK, PartsK
from verispec.drafting.hybrid import LookupFirstDrafter
from verispec.drafting.learned.eagle import EagleHead
from verispec.drafting.learned.eagle_drafter import EagleDrafter
from verispec.drafting.ngram import NGramDrafter
from verispec.drafting.registry import DRAFTERS, drafter_names
from verispec.engine.sequence import GenerationStats
from verispec.errors import UsageError
from verispec.models.llama import Llama
from verispec.options import GenerationOptions, SamplingParams
from verispec.training.config import TrainConfig

pytestmark = needs_native
MATCHED = [5, 9, 12, 7, 5, 9]  # its last two tokens occurred before: the lookup proposes 12, 7, 5...
UNMATCHED = [3, 14, 15, 9, 2, 6]  # nothing repeats: the head drafts
PROMPTS = ("abcabcab", "hello", "qqqzzz", "xyzxy", "the", "mnopqrs")


@pytest.fixture(scope="module")
def target() -> Llama:
    return native_tiny_target()


@pytest.fixture(scope="module")
def head(target) -> EagleHead:
    native = native_copy(random_head(target, "eagle"))
    assert isinstance(native, EagleHead)
    return native


def hybrid(target, head: EagleHead, context: list[int], sampling: SamplingParams) -> LookupFirstDrafter:
    """The hybrid drafter after ``begin(context)``, handed the context's hidden states as the engine does."""
    drafter = LookupFirstDrafter(NGramDrafter(), EagleDrafter(head, sampling), "ngram+eagle")
    drafter.begin(context)
    drafter.observe_hidden(hidden_states(target, context)[:-1])
    return drafter


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_round_is_the_lookups_where_it_matches_else_the_heads(target, head, sampling):
    """Where the context's suffix occurred before, the proposal is the lookup's (single guesses, q None);
    elsewhere the head's, tokens and q bit for bit (the same generator state)."""
    matched = hybrid(target, head, MATCHED, sampling).propose(MATCHED, 3, torch.Generator().manual_seed(0))
    lookup = NGramDrafter().propose(MATCHED, 3, torch.Generator())
    assert matched.tokens.tolist() == lookup.tokens.tolist() == [12, 7, 5] and matched.q is None
    drafted = hybrid(target, head, UNMATCHED, sampling).propose(
        UNMATCHED, 3, torch.Generator().manual_seed(1)
    )
    alone = drafter_with_context(target, head, UNMATCHED, sampling)
    own = alone.propose(UNMATCHED, 3, torch.Generator().manual_seed(1))
    assert torch.equal(drafted.tokens, own.tokens) and len(own.tokens) == 3
    assert (drafted.q is None) == sampling.greedy and (drafted.q is None or torch.equal(drafted.q, own.q))


def test_the_head_catches_up_on_the_rounds_it_sat_out(target, head):
    """A round the head drafts, rolled back; a round the lookup drafts, whose positions the head still gets;
    then the head again: it proposes exactly what a head fed the whole context at once proposes."""
    drafter, g = hybrid(target, head, UNMATCHED, GREEDY), torch.Generator()
    first = drafter.propose(UNMATCHED, 3, g)
    assert len(first.tokens) == 3
    drafter.observe(1)
    looked_up = [*UNMATCHED, int(first.tokens[0]), 3, 14]  # "3 14" occurred: the lookup proposes 15, 9, 2
    drafter.observe_hidden(hidden_states(target, looked_up)[len(UNMATCHED) - 1 : -1])
    assert drafter.propose(looked_up, 3, g).tokens.tolist() == [15, 9, 2]
    drafter.observe(0)
    context = [*looked_up, 40, 41]  # nothing repeats at its end
    drafter.observe_hidden(hidden_states(target, context)[len(looked_up) - 1 : -1])
    assert drafter.lookup.propose(context, 3, g).tokens.numel() == 0
    fresh = drafter_with_context(target, head, context, GREEDY)
    assert isinstance(drafter.head, EagleDrafter)
    assert torch.equal(drafter.head.catch_up(context), fresh.catch_up(context))  # the feature it drafts from
    proposal, own = drafter.propose(context, 3, g), fresh.propose(context, 3, g)
    assert proposal.tokens.tolist() == own.tokens.tolist() and len(own.tokens) == 3


@pytest.fixture(scope="module")
def eagle_file(target, tmp_path_factory) -> str:
    return str(random_head(target, "eagle").save(tmp_path_factory.mktemp("hybrid") / "eagle.safetensors"))


@pytest.fixture(scope="module")
def speculator(target, eagle_file) -> Speculator:
    spec = Speculator((target, LetterTokenizer(VOCAB)), drafter="ngram+eagle", drafter_path=eagle_file)
    assert spec.head is not None and spec.head.cpu_precision == "q8_0"
    return spec


def test_greedy_equals_plain_greedy_with_both_parts_drafting(target, speculator, monkeypatch):
    """Token for token the target's greedy output, over prompts where the lookup drafts some rounds and the
    head others; drafts both accepted and rejected."""
    plain = Speculator((target, LetterTokenizer(VOCAB)), drafter="none")
    lookups, heads = [], []
    original_lookup, original_head = NGramDrafter.propose, EagleDrafter.propose_rows.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        NGramDrafter,
        "propose",
        lambda self, *a, **kw: (p := original_lookup(self, *a, **kw), lookups.append(p.tokens.numel()))[0],
    )
    monkeypatch.setattr(
        EagleDrafter,
        "propose_rows",
        classmethod(lambda cls, rows: (heads.append(len(rows)), original_head(cls, rows))[1]),
    )
    drafted = accepted = 0
    for prompt in PROMPTS:
        stats = GenerationStats("ngram+eagle", "3")
        out = speculator.generate(prompt, k=3, max_new_tokens=40, sampling=GREEDY, stats=stats)
        assert out.token_ids == plain.generate(prompt, k=0, max_new_tokens=40, sampling=GREEDY).token_ids
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert any(lookups) and heads and 0 < accepted < drafted


def test_k_auto_gives_each_part_its_own_k(target, eagle_file, tmp_path, monkeypatch):
    """--k auto: a policy per part (each from its own calibration), the drafter asking the part that drafts
    each round for its K; both parts asked over these prompts; still the target's greedy output."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    spec = Speculator((target, LetterTokenizer(VOCAB)), drafter="ngram+eagle", drafter_path=eagle_file)
    plain = Speculator((target, LetterTokenizer(VOCAB)), drafter="none")
    policy = spec.k_policy("auto", GenerationOptions(k="auto", sampling=GREEDY))
    assert isinstance(policy, PartsK) and set(policy.parts) == {"lookup", "head"}
    assert all(isinstance(p, CostModelK) for p in policy.parts.values())
    assert policy.parts["lookup"].shared is not policy.parts["head"].shared  # each part's own evidence
    asked: list[str] = []
    original = PartsK.part_k
    monkeypatch.setattr(
        PartsK, "part_k", lambda self, part, context: (asked.append(part), original(self, part, context))[1]
    )
    for prompt in PROMPTS:
        out = spec.generate(prompt, k="auto", max_new_tokens=40, sampling=GREEDY)
        assert out.token_ids == plain.generate(prompt, k=0, max_new_tokens=40, sampling=GREEDY).token_ids
    assert {"lookup", "head"} <= set(asked)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8)], ids=["greedy", "seeded"])
def test_a_continuous_batch_equals_each_request_alone(speculator, sampling, monkeypatch):
    """Through the engine, the rows of a batch propose together (their heads in one call where the lookups
    left several rows to them), and each output is the one the request gets alone with its seed."""
    batch_and_alone(speculator, LookupFirstDrafter, sampling, monkeypatch, PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["abcab", "hello"], ids=["lookup-drafts", "head-drafts"])
def test_first_sampled_token_follows_the_target(target, speculator, prompt):
    """A chi-square of the first token sampled through the engine against the target's own distribution,
    where the first round is the lookup's single guess and where it is the head's sampled draft."""
    ids = speculator.encode_prompt(prompt)
    assert (NGramDrafter().propose(ids, 1, torch.Generator()).tokens.numel() == 1) == (prompt == "abcab")
    assert first_token_chi_square(speculator, target, ids, prompt, {"temperature": 0.8}) > ALPHA


def test_the_registry_names_it_and_it_needs_an_eagle_file(capsys, shared_model):
    """Listed with the drafters, read from an eagle file (shipped or --drafter-path), never trained as a
    kind of its own; without an eagle file for the target, one line and exit code 2."""
    kind = DRAFTERS["ngram+eagle"]
    assert kind.learned and kind.head_kind == "eagle" and kind.reads_target_hidden and not kind.takes_trees
    assert "ngram+eagle" in drafter_names()
    with pytest.raises(UsageError, match="unknown drafter kind"):
        TrainConfig(kind="ngram+eagle")
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    code = main(["generate", *model, "--drafter", "ngram+eagle", "once"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs a drafter file" in err[0] and "--kind eagle" in err[0]
