"""Lookahead tokens (PaSS): their file, their drafting through the target, their training, and exactness.

Targets are tiny random Llamas (plain, and on the native kernels for the continuous batch) and stories260K
from ``../shared/models``; the enumeration proof of a lookahead-kind draft (token 1 from the target's p, the
others from context-only q's) is in :mod:`test_enumeration`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from scipy import stats as scipy_stats

from fakes import LetterTokenizer
from test_eagle import (
    ALPHA,
    GREEDY,
    TINY_TRAINING,
    VOCAB,
    assert_usage_error,
    make_dataset,
    one_line_error,
    plain_greedy,
    random_prompts,
    run_cli,
    tiny_target,
    train_whole_and_cut,
)
from test_kernels import CONFIG, random_llama
from test_real_models import STORY_PROMPTS
from verispec.api import Speculator
from verispec.bench.suite import BenchConfig, Method, plan_methods
from verispec.drafting.learned.head import target_fingerprint
from verispec.drafting.learned.kinds import load_head
from verispec.drafting.learned.lookahead import LookaheadDrafter, LookaheadTokens, lookahead_mask
from verispec.engine.sequence import GenerationStats
from verispec.kernels.cpu import native_available
from verispec.models.llama import Llama
from verispec.models.registry import load_model
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits
from verispec.training import train as train_module
from verispec.training.config import TrainConfig
from verispec.training.data import load_split
from verispec.training.lookahead import LookaheadRecipe
from verispec.training.recipe import TrainingData, draft_index
from verispec.training.train import train_drafter

PROMPTS = ("abc", "hello", "qqqzzz", "the", "mnopqrs", "x")
TRAINING = dataclasses.replace(
    TINY_TRAINING, kind="lookahead", lookahead=3, lr=1e-1, steps=60, batch_tokens=64, window=32
)
needs_native = pytest.mark.skipif(
    native_available() is not None, reason=f"no native kernels: {native_available()}"
)


def random_lookahead(
    model: Llama, draft_vocab: torch.Tensor, count: int = 3, seed: int = 0
) -> LookaheadTokens:
    """Lookahead tokens with random embeddings of the scale of the target's own: drafts that are sometimes
    accepted on a tiny target."""
    g = torch.Generator().manual_seed(seed)
    metadata = {"kind": "lookahead", "target": "tiny", "target_fingerprint": target_fingerprint(model)}
    tokens = LookaheadTokens.create(model, draft_vocab, g, metadata, count)
    with torch.no_grad():
        scale = model.model.embed_tokens.weight.std()
        tokens.embeddings.normal_(0, float(scale), generator=g)
    return tokens


@pytest.fixture(scope="module")
def target() -> Llama:
    return tiny_target()


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory):
    return make_dataset(target, tmp_path_factory.mktemp("data"), random_prompts(24, VOCAB, 1), answer=40)


@pytest.fixture(scope="module")
def files(target, dataset, tmp_path_factory) -> dict[str, object]:
    """Random lookahead tokens, and tokens trained for 60 steps on the tiny data set."""
    out = tmp_path_factory.mktemp("files")
    return {
        "random": random_lookahead(target, torch.arange(0, VOCAB, 2)).save(out / "lookahead.safetensors"),
        "trained": train_drafter(target, dataset, out / "run", TRAINING, progress=False),
    }


def prefilled(model: Llama, context: list[int]):
    """The model's cache holding every token of ``context`` but the last (the engine's invariant)."""
    cache = model.new_cache()
    if len(context) > 1:
        model.prefill(torch.tensor([context[:-1]]), torch.arange(len(context) - 1)[None], cache)
    return cache


# ---------------------------------------------------------------------------------------------- files


def test_file_round_trip_and_refusals(target, files, tmp_path):
    loaded = load_head(files["random"], target, "tiny")
    assert isinstance(loaded, LookaheadTokens) and loaded.num_tokens == 3
    with safe_open(str(files["random"]), framework="pt") as f:
        names, meta = set(f.keys()), f.metadata()
    assert names == {"embeddings", "draft_vocab"} and meta["lookahead_tokens"] == "3"
    fresh = random_lookahead(target, torch.arange(0, VOCAB, 2))
    assert torch.equal(loaded.embeddings, fresh.embeddings.half().float())
    assert "lookahead_tokens" not in loaded.metadata
    with safe_open(str(files["random"]), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key, value, match in (
        ("lookahead_tokens", "0", "lookahead_tokens '0'"),
        ("lookahead_tokens", "9", "lookahead_tokens '9'"),
        ("lookahead_tokens", "2", "has shape"),
    ):
        bad = tmp_path / f"{key}-{value}.safetensors"
        save_file(tensors, str(bad), metadata={**meta, key: value})
        one_line_error(lambda b=bad: load_head(b, target), match)
    one_line_error(lambda: load_head(files["random"], tiny_target(seed=1), "other"), "trained for target")
    one_line_error(lambda: LookaheadTokens(target, torch.arange(4), {}, num_tokens=9), "1 to 8 lookahead")
    tokenizer = LetterTokenizer(VOCAB)
    one_line_error(
        lambda: Speculator((target, tokenizer), drafter="medusa", drafter_path=str(files["random"])),
        "holds a drafter of kind 'lookahead', not 'medusa'",
    )
    assert Speculator((target, tokenizer), drafter_path=str(files["random"])).drafter_name == "lookahead"


# ---------------------------------------------------------------------------------------------- drafting


def expected_rows(
    model: Llama, tokens: LookaheadTokens, context: list[int], m: int, sampling
) -> torch.Tensor:
    """q of a proposal after ``context``, from one plain forward over the context then m lookahead tokens:
    the target's own distribution of the next token, then each lookahead's on the draft vocabulary."""
    ids = torch.tensor([context + [0] * m])
    inputs = torch.cat([model.embed(torch.tensor([context])), tokens.embeddings[None, :m]], 1)
    with torch.no_grad():
        hidden = model.forward_hidden(
            ids, torch.arange(ids.shape[1])[None], model.new_cache(), embeddings=inputs
        )
    rows = hidden[0, len(context) - 1 :]  # [1 + m, H]
    first = probs_from_logits(model.logits(rows[None, :1])[0, 0], sampling)  # [V]
    later = [tokens.full_q(probs_from_logits(tokens.logits(r), sampling)) for r in rows[1:]]
    return torch.stack([first, *later])  # [1 + m, V]


@pytest.mark.parametrize("sampling_kw", [{}, {"temperature": 0.7, "top_k": 9}, {"top_p": 0.8}])
def test_proposal_is_one_target_forward_with_the_lookahead_tokens(target, files, sampling_kw):
    """Draft token 1 from the target's own distribution, token j + 1 from lookahead j on the draft vocabulary,
    all from one forward on the target's cache, which keeps its length; the q rows do not depend on the
    tokens drawn (other seeds draw other tokens from the same rows); the same seed draws the same tokens."""
    tokens = load_head(files["random"], target)
    sampling = SamplingParams(seed=0, **sampling_kw, invariant=False)
    context = [3, 14, 15, 9, 26]
    cache = prefilled(target, context)
    drafter = LookaheadDrafter(tokens, target, sampling, cache)
    proposals = [drafter.propose(context, 4, torch.Generator().manual_seed(s)) for s in (1, 1, 2, 3, 4)]
    assert cache.length == len(context) - 1
    assert torch.equal(proposals[0].tokens, proposals[1].tokens)
    assert len({tuple(p.tokens.tolist()) for p in proposals}) > 1
    expected = expected_rows(target, tokens, context, 3, sampling)
    for proposal in proposals:
        assert proposal.q is not None and proposal.tokens.shape == (4,)
        torch.testing.assert_close(proposal.q, expected, atol=1e-5, rtol=1e-5)
        assert all(proposal.q[i, t] > 0 for i, t in enumerate(proposal.tokens.tolist()))
    assert (proposals[0].q[1:, 1::2] == 0).all()  # outside the draft vocabulary
    greedy = LookaheadDrafter(tokens, target, GREEDY, cache).propose(context, 9, torch.Generator())
    assert greedy.q is None and greedy.tokens.shape == (4,)  # at most m + 1 tokens
    assert greedy.tokens.tolist() == expected_rows(target, tokens, context, 3, GREEDY).argmax(-1).tolist()
    assert (
        LookaheadDrafter(tokens, target, GREEDY, cache).propose(context, 0, torch.Generator()).tokens.numel()
        == 0
    )


def test_beside_gemma3_the_first_draft_is_the_targets_own_distribution(tmp_path, monkeypatch):
    """The context's tokens go in as the target embeds them (Gemma 3 multiplies its embeddings by
    sqrt(hidden): fed unscaled, the drafter's first token was not the target's own distribution)."""
    from test_gguf import write_tiny_gguf
    from test_gguf_native import tiny_gemma3

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    source = write_tiny_gguf(tmp_path / "g.gguf", tiny_gemma3(), "Q8_0", arch="gemma3")
    model = load_model(str(source), precision="auto")[0]
    assert isinstance(model, Llama) and model.config.embed_scale != 1.0
    metadata = {"kind": "lookahead", "target": "tiny", "target_fingerprint": target_fingerprint(model)}
    tokens = LookaheadTokens.create(model, torch.arange(model.vocab_size), torch.Generator(), metadata, 2)
    sampling = SamplingParams(temperature=1.0, seed=0, invariant=False)
    context = [3, 14, 15, 9, 26]
    proposal = LookaheadDrafter(tokens, model, sampling).propose(context, 3, torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(torch.tensor([context]), torch.arange(len(context))[None], model.new_cache(1, 16))
    assert proposal.q is not None
    torch.testing.assert_close(proposal.q[0], probs_from_logits(logits[0, -1], sampling))


def test_own_cache_drafts_as_the_engines(target, files):
    """Without the engine's cache (a calibration) the drafter fills a cache of its own and drafts the same."""
    tokens = load_head(files["random"], target)
    context = [7, 1, 30, 2, 2, 40]
    own = LookaheadDrafter(tokens, target, GREEDY)
    own.begin(context[:2])
    for n in (2, 3, 6):
        shared = LookaheadDrafter(tokens, target, GREEDY, prefilled(target, context[:n]))
        a = own.propose(context[:n], 3, torch.Generator())
        b = shared.propose(context[:n], 3, torch.Generator())
        assert a.tokens.tolist() == b.tokens.tolist()
        assert own.cache.length == n
    assert own.cost_identity() == {
        "drafter": "lookahead",
        "draft_vocab": VOCAB // 2,
        "lookahead_tokens": 3,
        "precision": None,
    }


def test_training_reads_what_drafting_reads(target, files):
    """The training forward (the sequence in the cache, lookahead groups after several anchors under
    ``lookahead_mask``) gives, for each anchor, the states drafting computes after the context up to it."""
    tokens = load_head(files["random"], target)
    seq = [5, 9, 2, 33, 8, 61, 4, 4, 17, 20]
    split = {
        "tokens": torch.tensor(seq),
        "hidden": torch.zeros(len(seq), target.config.hidden_size, dtype=torch.float16),
        "offsets": torch.tensor([0, len(seq)]),
        "prompt_lengths": torch.tensor([2]),
    }
    data = TrainingData.from_split(split, draft_index(tokens.draft_vocab, VOCAB))
    anchors = torch.tensor([1, 4, 5, 8])
    with torch.no_grad():
        hidden = LookaheadRecipe(target, 3).hidden(tokens, data, 0, anchors)  # [A, 3, H]
    for a, states in zip(anchors.tolist(), hidden, strict=True):
        context = seq[: a + 1]
        ids = torch.tensor([context + [0] * 3])
        inputs = torch.cat([target.model.embed_tokens(torch.tensor([context])), tokens.embeddings[None]], 1)
        with torch.no_grad():
            alone = target.forward_hidden(
                ids, torch.arange(a + 4)[None], target.new_cache(), embeddings=inputs
            )
        torch.testing.assert_close(states, alone[0, -3:], atol=1e-5, rtol=1e-5)
    mask = lookahead_mask(torch.tensor([0, 2]), 3, 2)  # [4, 3 + 4]
    assert mask.int().tolist() == [
        [1, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 1],
    ]


# ---------------------------------------------------------------------------------------------- exactness


def speculators(target, path, **options):
    tokenizer = LetterTokenizer(VOCAB)
    plain = Speculator((target, tokenizer), drafter="none")
    return plain, Speculator((target, tokenizer), drafter="lookahead", drafter_path=str(path), **options)


def test_greedy_equals_plain_greedy(target, files):
    """Random and trained lookahead tokens, K 1, 2, 4 and additive: token for token the target's greedy
    output; lookahead drafts are both accepted and rejected."""
    drafted = accepted = 0
    for path in (files["random"], files["trained"]):
        plain, spec = speculators(target, path)
        for prompt in PROMPTS:
            reference = plain.generate(prompt, k=0, max_new_tokens=50, sampling=GREEDY).token_ids
            for k in (1, 2, 4, "additive"):
                stats = GenerationStats("lookahead", str(k))
                out = spec.stream(prompt, k=k, max_new_tokens=50, sampling=GREEDY, stats=stats)
                assert [t for chunk in out for t in chunk.token_ids] == reference, (path.name, prompt, k)
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted


@pytest.fixture(scope="module")
def native_target():
    model = random_llama(dataclasses.replace(CONFIG, tie_word_embeddings=False))
    assert model.optimize_for_cpu(precision="q8_0")
    return model


@needs_native
def test_native_batch_equals_alone_and_plain_greedy(native_target, tmp_path):
    """On the native kernels, in a continuous batch (rows joining and leaving), every request's greedy output
    equals decoding it alone and plain decoding; draft token 1 is always accepted (its row of the draft
    forward is bit-identical to the verification's)."""
    path = random_lookahead(native_target, torch.arange(CONFIG.vocab_size)).save(tmp_path / "l.safetensors")
    vocab = CONFIG.vocab_size
    plain = Speculator((native_target, LetterTokenizer(vocab)), drafter="none")
    spec = Speculator((native_target, LetterTokenizer(vocab)), drafter="lookahead", drafter_path=str(path))
    prompts = [*PROMPTS, "abcabcab"]
    options = dict(k=3, max_new_tokens=24, sampling=GREEDY)
    reference = [plain.generate(p, **dict(options, k=0)).token_ids for p in prompts]
    alone = []
    for prompt in prompts:
        stats = GenerationStats("lookahead", "3")
        alone.append([t for c in spec.stream(prompt, stats=stats, **options) for t in c.token_ids])
        assert stats.accepted_per_position[0] == stats.drafted_per_position[0] > 0
    assert alone == reference
    assert [r.token_ids for r in spec.generate_batch(prompts, slots=3, **options)] == reference


N = 3000


@torch.inference_mode()  # as tests/first_rounds.py: no value changes, each sample cheaper
def pair_chi_square(spec: Speculator, model: Llama, prompt: str, sampling_kw: dict, k: int) -> float:
    """The p-value of the first two tokens sampled with seeds 0..N-1 (K = ``k``: token 2 is a lookahead's
    draft) against the target's own joint distribution p(x1) p(x2 | x1) after the prompt."""
    ids = spec.encode_prompt(prompt)
    params = SamplingParams(**sampling_kw)
    counts = np.zeros((VOCAB, VOCAB))
    drafted = accepted = 0
    # 16 at a time: at a fixed K each request samples what it samples alone, with its own seed
    outs = spec.generate_batch([prompt] * N, slots=16, seeds=range(N), k=k, max_new_tokens=3, sampling=params)
    for out in outs:
        counts[out.token_ids[0], out.token_ids[1]] += 1
        drafted += out.stats["drafted"]
        accepted += out.stats["accepted"]
    assert 0 < accepted < drafted
    with torch.no_grad():
        first = probs_from_logits(
            model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache())[0, -1].double(),
            params,
        )
        rows = torch.tensor([[*ids, x] for x in range(VOCAB)])  # [V, L + 1]
        later = model(rows, torch.arange(len(ids) + 1).expand(VOCAB, -1), model.new_cache(VOCAB))[
            :, -1
        ].double()
        second = torch.stack([probs_from_logits(row, params) for row in later])  # [V, V]
    expected = (first[:, None] * second).numpy() * N  # [V, V]
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_first_two_sampled_tokens_follow_the_target(target, files):
    """A chi-square of the first two sampled tokens at K = 2 (token 1 the target's own draw, token 2 a
    lookahead's, accepted or replaced by the residual) against the target's joint distribution, at
    temperature 0.8 and top-p 0.9 (the proposal test checks q under other transforms)."""
    _, spec = speculators(target, files["random"])
    assert pair_chi_square(spec, target, "hello", {"temperature": 0.8, "top_p": 0.9}, 2) > ALPHA


# ---------------------------------------------------------------------------------------------- training


def test_training_fits_the_data_through_the_frozen_target(target, dataset, files):
    """60 steps through the frozen target lower the loss on the same batches by over 5 % (only the
    embeddings move: the target gets no gradient); the log and the training record hold the held-out top-1
    per lookahead token. (A tiny random target's sampled answers are nearly unpredictable two tokens ahead,
    so its held-out accuracy is no test; the shipped SmolLM2 tokens' is reported by the bench.)"""
    head = load_head(files["trained"], target)
    training = head.metadata["training"]
    assert training["steps_done"] == 60 and training["kind"] == "lookahead" and training["lookahead"] == 3
    assert len(training["heldout_top1_per_position"]) == 3
    train = TrainingData.from_split(load_split(dataset, "train"), draft_index(head.draft_vocab, VOCAB))
    recipe = LookaheadRecipe(target, 3)
    fresh = LookaheadTokens.create(target, head.draft_vocab, torch.Generator().manual_seed(0), {}, 3)
    with torch.no_grad():
        before, after = (
            recipe.loss(h, train, TRAINING, 0.0, torch.Generator().manual_seed(3)) for h in (fresh, head)
        )
    assert after < 0.95 * before
    log = [json.loads(line) for line in (files["trained"].parent / "log.jsonl").read_text().splitlines()]
    assert log[-1]["heldout_top1"] == pytest.approx(training["heldout_top1_per_position"], abs=1e-4)
    assert not any(p.requires_grad for p in target.parameters())  # frozen, never trained


def test_resume_continues_exactly(target, dataset, tmp_path, monkeypatch):
    config = dataclasses.replace(
        TRAINING, steps=6, batch_tokens=32, eval_every=2, checkpoint_every=3, eval_tokens=32
    )
    whole = train_whole_and_cut(target, dataset, tmp_path, monkeypatch, config, LookaheadRecipe, "hidden", 7)
    resumed = train_drafter(target, dataset, tmp_path / "cut", config, resume=True, progress=False)
    a, b = load_file(str(whole)), load_file(str(resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = dataclasses.replace(config, lookahead=2)
    one_line_error(lambda: train_drafter(target, dataset, tmp_path / "cut", other, resume=True), "differ")
    assert train_module.CHECKPOINT in {p.name for p in (tmp_path / "cut").iterdir()}


def test_bad_training_settings():
    for value, match in ((0, "lookahead must be an integer >= 1"), (9, "lookahead must be at most 8")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(kind="lookahead", lookahead=value)


# ---------------------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def stories(shared_model, tmp_path_factory):
    """stories260K, a data set of its own stories, and lookahead tokens trained on it for 30 steps."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model, tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")
    prompts = [tokenizer.encode(p) for p in STORY_PROMPTS * 2]
    data = make_dataset(model, tmp_path_factory.mktemp("stories-data"), prompts, answer=80, label="stories")
    config = dataclasses.replace(TRAINING, steps=30, draft_vocab=256, eval_every=30, checkpoint_every=30)
    path = train_drafter(model, data, tmp_path_factory.mktemp("lookahead"), config, progress=False)
    return model, tokenizer, path, root, data


def test_stories_greedy_equals_plain_greedy(stories):
    model, tokenizer, path, _, _ = stories
    spec = Speculator((model, tokenizer), drafter="lookahead", drafter_path=str(path))
    references = plain_greedy(model, tokenizer, STORY_PROMPTS, 60)
    drafted = accepted = 0
    for prompt, k in itertools.product(STORY_PROMPTS, (2, 4)):
        stats = GenerationStats("lookahead", str(k))
        out = spec.stream(prompt, k=k, max_new_tokens=60, sampling=GREEDY, stats=stats)
        assert [t for chunk in out for t in chunk.token_ids] == references[prompt], (prompt, k)
        drafted += sum(stats.drafted_per_position[1:])
        accepted += sum(stats.accepted_per_position[1:])
    assert 0 < accepted < drafted  # the lookahead tokens' drafts, beyond the target's own first


def test_cli_trains_and_generates(stories, tmp_path, capsys):
    model, tokenizer, _, root, data = stories
    model_args = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    run = ["--data", str(data), "--out", str(tmp_path / "run"), "--steps", "2", "--draft-vocab", "100"]
    status, out, err = run_cli(
        capsys,
        "train-drafter",
        *model_args,
        *run,
        "--kind",
        "lookahead",
        "--lookahead",
        "2",
        "--window",
        "8",
        "--batch-tokens",
        "16",
    )
    assert status == 0, err
    path = tmp_path / "run" / "drafter.safetensors"
    head = load_head(path, model)
    assert isinstance(head, LookaheadTokens) and head.num_tokens == 2 and head.draft_vocab_size == 100
    args = ["--drafter", "lookahead", "--drafter-path", str(path), "--temperature", "0", "--json"]
    status, out, err = run_cli(capsys, "generate", "Once upon a time", *model_args, *args)
    assert status == 0, err
    result = json.loads(out)
    assert result["stats"]["drafter"] == "lookahead"
    status, out, err = run_cli(
        capsys,
        "generate",
        "Once upon a time",
        *model_args,
        "--drafter",
        "none",
        "--temperature",
        "0",
        "--json",
    )
    assert json.loads(out)["token_ids"] == result["token_ids"]
    for argv, message in (
        (
            [
                "train-drafter",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "x"),
                "--kind",
                "lookahead",
                "--lookahead",
                "0",
            ],
            "lookahead must be an integer >= 1",
        ),
        (["generate", "Once", *model_args, "--drafter", "lookahead"], "needs a drafter file"),
        (
            [
                "generate",
                "Once",
                *model_args,
                "--drafter",
                "lookahead",
                "--drafter-path",
                str(tmp_path / "none.safetensors"),
            ],
            "no such drafter file",
        ),
    ):
        assert_usage_error(run_cli(capsys, *argv), message)
    assert not (tmp_path / "x").exists()


def test_bench_lists_lookahead_with_its_file(files):
    with_file = plan_methods(BenchConfig(target="stories.bin", drafter_path=str(files["random"])))[0]
    assert Method("lookahead", "4") in with_file
    methods, notes = plan_methods(BenchConfig(target="stories.bin"))
    assert not any(m.name == "lookahead" for m in methods)
    assert any(n.startswith("lookahead: no learned") for n in notes)
