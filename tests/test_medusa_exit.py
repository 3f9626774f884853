"""Medusa heads and the trained early exit: their files, their training, their drafting, and exactness.

Targets are tiny random Llamas (and stories260K from ``../shared/models``) with data sets made as in
:mod:`test_eagle`; the enumeration proof of a Medusa-kind draft (each head's q not conditioned on the draft
tokens before it) is in :mod:`test_enumeration`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fakes import LetterTokenizer
from test_eagle import (
    ALPHA,
    GREEDY,
    TINY_TRAINING,
    VOCAB,
    assert_usage_error,
    first_token_chi_square,
    fresh_head,
    make_dataset,
    one_line_error,
    plain_greedy,
    random_prompts,
    run_cli,
    tiny_target,
    train_whole_and_cut,
)
from test_real_models import STORY_PROMPTS
from verispec.api import Speculator
from verispec.bench.suite import BenchConfig, Method, plan_methods
from verispec.drafting.draft_model import ModelDrafter
from verispec.drafting.learned.exit import ExitAdapter, ExitDraft, exit_features
from verispec.drafting.learned.head import target_fingerprint
from verispec.drafting.learned.kinds import HEADS, load_head, shipped_drafter
from verispec.drafting.learned.medusa import MedusaDrafter, MedusaHeads, MedusaTreeDrafter, medusa_tree
from verispec.drafting.registry import DRAFTERS
from verispec.drafting.tree import TreeShape
from verispec.engine.sequence import GenerationStats
from verispec.models.llama import Llama
from verispec.models.registry import load_model
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits
from verispec.training import config as config_module
from verispec.training.config import TrainConfig
from verispec.training.data import load_split
from verispec.training.medusa import MedusaRecipe
from verispec.training.recipe import Recipe, TrainingData, draft_index
from verispec.training.train import train_drafter

KINDS = ("medusa", "exit")
PROMPTS = ("abc", "hello", "qqqzzz", "the", "mnopqrs", "x")


def metadata(model: Llama, kind: str) -> dict:
    return {"kind": kind, "target": "tiny", "target_fingerprint": target_fingerprint(model)}


def random_medusa(model: Llama, draft_vocab: torch.Tensor, heads: int = 3, seed: int = 0) -> MedusaHeads:
    """Medusa heads with random blocks (scale 0.3) and a made-up accuracy table: drafts that are sometimes
    accepted on a tiny target."""
    g = torch.Generator().manual_seed(seed)
    medusa = MedusaHeads.create(model, draft_vocab, g, metadata(model, "medusa"), heads)
    with torch.no_grad():
        for block in medusa.blocks:
            block.weight.normal_(0, 0.3, generator=g)
    medusa.metadata["training"] = {
        "heldout_top1_per_position": [0.5, 0.4, 0.3][:heads],
        "heldout_rank_accuracy": [[0.5, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05], [0.3, 0.2, 0.1, 0.1]][:heads],
    }
    return medusa


def random_exit(model: Llama, draft_vocab: torch.Tensor, layer: int = 1, seed: int = 0) -> ExitAdapter:
    g = torch.Generator().manual_seed(seed)
    adapter = ExitAdapter.create(model, draft_vocab, g, metadata(model, "exit"), layer)
    with torch.no_grad():
        adapter.down.weight.normal_(0, 0.3, generator=g)
    return adapter


@pytest.fixture(scope="module")
def target() -> Llama:
    return tiny_target()


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory):
    return make_dataset(target, tmp_path_factory.mktemp("data"), random_prompts(24, VOCAB, 1), answer=40)


@pytest.fixture(scope="module")
def files(target, tmp_path_factory) -> dict[str, object]:
    """A random drafter file of each kind (the eagle one too, for kind mismatches)."""
    out = tmp_path_factory.mktemp("files")
    return {
        "medusa": random_medusa(target, torch.arange(VOCAB)).save(out / "medusa.safetensors"),
        "exit": random_exit(target, torch.arange(0, VOCAB, 2)).save(out / "exit.safetensors"),
        "eagle": fresh_head(target, torch.arange(VOCAB)).save(out / "eagle.safetensors"),
    }


TRAINING = {
    "medusa": dataclasses.replace(TINY_TRAINING, kind="medusa", heads=3, lr=1e-2),
    "exit": dataclasses.replace(TINY_TRAINING, kind="exit", exit_layer=1, lr=1e-2),
}


@pytest.fixture(scope="module")
def trained(target, dataset, tmp_path_factory):
    """A drafter of each kind trained for 100 steps on the tiny data set."""
    return {
        kind: train_drafter(target, dataset, tmp_path_factory.mktemp(kind), TRAINING[kind], progress=False)
        for kind in KINDS
    }


# ---------------------------------------------------------------------------------------------- files


@pytest.mark.parametrize("kind", KINDS)
def test_files_round_trip_and_hold_only_the_trained_tensors(target, files, kind):
    loaded = load_head(files[kind], target, "tiny")
    assert loaded.kind == kind and type(loaded) is {"medusa": MedusaHeads, "exit": ExitAdapter}[kind]
    with safe_open(str(files[kind]), framework="pt") as f:
        names, meta = set(f.keys()), f.metadata()
    assert names == {*loaded.state_dict(), "draft_vocab"}
    assert meta["kind"] == kind and ("num_heads" in meta if kind == "medusa" else meta["exit_layer"] == "1")
    fresh = (
        random_medusa(target, torch.arange(VOCAB))
        if kind == "medusa"
        else random_exit(target, loaded.draft_vocab)
    )
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.half().float()), name
    assert (
        "kind" in loaded.metadata
        and "num_heads" not in loaded.metadata
        and "exit_layer" not in loaded.metadata
    )


def test_a_file_of_another_kind_or_shape_is_refused(target, files, tmp_path):
    tokenizer = LetterTokenizer(VOCAB)
    for drafter, path in (("medusa", files["eagle"]), ("exit", files["medusa"]), ("eagle", files["exit"])):
        one_line_error(
            lambda d=drafter, p=path: Speculator((target, tokenizer), drafter=d, drafter_path=str(p)),
            "holds a drafter of kind",
        )
    one_line_error(lambda: MedusaHeads.load(files["exit"], target), "kind 'exit'")
    other = tiny_target(seed=1)
    foreign = random_medusa(other, torch.arange(VOCAB)).save(tmp_path / "foreign.safetensors")
    one_line_error(lambda: load_head(foreign, target, "mine"), "trained for target")
    with safe_open(str(files["medusa"]), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    for key, value, match in (
        ("num_heads", "0", "num_heads '0'"),
        ("num_heads", "2", "holds tensors"),
        ("kind", "bogus", "this verispec reads eagle, eagle3, medusa, exit, lookahead"),
    ):
        bad = tmp_path / f"{key}-{value}.safetensors"
        save_file(tensors, str(bad), metadata={**meta, key: value})
        one_line_error(lambda b=bad: load_head(b, target), match)
    one_line_error(lambda: ExitAdapter(target, torch.arange(4), {}, exit_layer=2), "exit layer")
    one_line_error(lambda: MedusaHeads(target, torch.arange(4), {}, num_heads=9), "1 to 8 heads")
    # auto with a drafter file drafts with the file's kind
    assert Speculator((target, tokenizer), drafter_path=str(files["medusa"])).drafter_name == "medusa"
    # a tree deeper than the file's heads (one per depth): one line, not a tree silently cut to its heads
    medusa = dict(drafter="medusa", drafter_path=str(files["medusa"]))
    deep = Speculator((target, tokenizer), tree=TreeShape.parse("2x4"), **medusa)
    one_line_error(lambda: deep.generate("abc", max_new_tokens=4, sampling=GREEDY), "has 3 heads, one per")
    fits = Speculator((target, tokenizer), tree=TreeShape.parse("2x3"), **medusa)
    assert fits.generate("abc", max_new_tokens=4, sampling=GREEDY).token_ids


# ---------------------------------------------------------------------------------------------- trees


def test_medusa_tree_is_the_likeliest_closed_set_of_nodes():
    """Against brute force: of every set of n nodes holding each node's ancestors and older siblings, the
    tree has the largest total path value (its expected accepted tokens, the heads independent)."""
    table = [[0.6, 0.2], [0.5, 0.3], [0.45, 0.1]]

    def value(path) -> float:
        out = 1.0
        for depth, rank in enumerate(path):
            out *= table[depth][rank]
        return out

    universe = [p for d in (1, 2, 3) for p in itertools.product(range(2), repeat=d)]
    for n in (1, 3, 5, 6):
        shape = medusa_tree(table, n)
        chosen = [p for p in shape.paths if p]
        assert len(chosen) == n
        best = 0.0
        for subset in itertools.combinations(universe, n):
            known = {(), *subset}
            if all(p[:-1] in known and (p[-1] == 0 or (*p[:-1], p[-1] - 1) in known) for p in subset):
                best = max(best, sum(map(value, subset)))
        assert sum(map(value, chosen)) == pytest.approx(best)
    assert max(len(p) for p in medusa_tree(table, 30).paths) == 3  # never deeper than the heads
    one_line_error(lambda: medusa_tree([], 4), "held-out accuracies")


# ---------------------------------------------------------------------------------------------- Medusa


def hidden_of(model: Llama, ids: list[int]) -> torch.Tensor:
    tokens, positions = torch.tensor([ids]), torch.arange(len(ids))[None]
    return model.forward_hidden(tokens, positions, model.new_cache(1, len(ids)))[0]  # [L, H]


@pytest.mark.parametrize("sampling_kw", [{}, {"temperature": 0.7, "top_k": 9}, {"top_p": 0.8}])
def test_medusa_q_rows_are_each_heads_own_distribution(target, files, sampling_kw):
    """Draft token i is drawn from head i's q, read from the last committed position's state alone: the
    same rows whatever the draft tokens before it, zero outside the draft vocabulary, and the tokens drawn
    from them with the generator (same seed, same tokens)."""
    medusa = load_head(files["medusa"], target)
    sampling = SamplingParams(seed=0, **sampling_kw, invariant=False)
    context = [3, 14, 15, 9, 26]
    hidden = hidden_of(target, context)  # [5, H]
    drafter = MedusaDrafter(medusa, sampling)
    drafter.begin(context)
    drafter.observe_hidden(hidden[:-1])
    first = drafter.propose(context, 3, torch.Generator().manual_seed(1))
    again = drafter.propose(context, 3, torch.Generator().manual_seed(1))
    assert torch.equal(first.tokens, again.tokens)
    with torch.no_grad():
        logits = medusa.logits(
            hidden[3] + torch.nn.functional.silu(torch.stack([b(hidden[3]) for b in medusa.blocks]))
        )
    expected = torch.stack([medusa.full_q(probs_from_logits(row, sampling)) for row in logits])  # [3, V]
    assert first.q is not None and torch.allclose(first.q, expected, atol=1e-6)
    assert all(first.q[i, t] > 0 for i, t in enumerate(first.tokens.tolist()))
    torch.testing.assert_close(first.q.sum(-1), torch.ones(3, dtype=first.q.dtype))
    # a context the drafter has not seen every state of drafts nothing
    assert drafter.propose([*context, 7], 3, torch.Generator()).tokens.numel() == 0
    # nor does a one-token prompt's first round, which has no state yet: not the previous request's (a CI
    # failure: a fresh drafter read its uninitialized state there and drew from NaN logits)
    drafter.begin([context[0]])
    assert drafter.propose([context[0]], 3, torch.Generator()).tokens.numel() == 0


def test_medusa_tree_children_are_each_depths_head_top_tokens(target, files):
    medusa = load_head(files["medusa"], target)
    shape = TreeShape.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    context = [5, 6, 7, 8]
    chain = MedusaDrafter(medusa, GREEDY)
    chain.begin(context)
    chain.observe_hidden(hidden_of(target, context)[:-1])
    tree = MedusaTreeDrafter(chain, shape).propose_tree(context, shape, torch.Generator())
    logits = chain.head_logits(context, 3)  # [3, Vd]
    tops = [medusa.draft_vocab[row.topk(2).indices].tolist() for row in logits]
    assert tree.tokens.tolist() == [8, tops[0][0], tops[0][1], tops[1][0], tops[1][1], tops[1][0], tops[2][0]]
    assert chain.propose(context, 3, torch.Generator()).tokens.tolist() == [top[0] for top in tops]


# ---------------------------------------------------------------------------------------------- the exit


def test_exit_draft_is_the_first_layers_then_the_adapter(target, files):
    """The exit's logits: the target's first N layers (its final norm after them), the adapter, the head rows
    of the draft vocabulary, −inf elsewhere; an untrained adapter is the plain early exit there; the training
    features are what the draft reads."""
    adapter = load_head(files["exit"], target)
    draft = ExitDraft(target, adapter)
    ids = [1, 2, 3, 40, 41]
    logits = draft(torch.tensor([ids]), torch.arange(5)[None], draft.new_cache())[0]  # [5, V]
    first = target.first_layers(1)
    hidden = first.forward_hidden(torch.tensor([ids]), torch.arange(5)[None], first.new_cache())[0]  # [5, H]
    vocab = adapter.draft_vocab
    torch.testing.assert_close(logits[:, vocab], adapter.logits(adapter(hidden)))
    assert torch.isneginf(logits[:, [i for i in range(VOCAB) if i % 2]]).all()
    untrained = ExitDraft(target, ExitAdapter.create(target, vocab, torch.Generator(), {}, 1))
    plain = first.forward(torch.tensor([ids]), torch.arange(5)[None], first.new_cache())[0]  # [5, V]
    torch.testing.assert_close(
        untrained(torch.tensor([ids]), torch.arange(5)[None], untrained.new_cache())[0][:, vocab],
        plain[:, vocab],
    )
    offsets = torch.tensor([0, 2, 5])
    reads = exit_features(target, 1, torch.tensor(ids), offsets)  # [5, H]
    by_sequence = torch.cat([hidden_of(first, ids[:2]), hidden_of(first, ids[2:])])
    torch.testing.assert_close(reads.float(), by_sequence, atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------- exactness


def speculator(target, path, kind: str, **options) -> Speculator:
    return Speculator((target, LetterTokenizer(VOCAB)), drafter=kind, drafter_path=str(path), **options)


@pytest.fixture(scope="module")
def greedy(target) -> dict[str, list[int]]:
    """The tiny target's greedy output, 50 tokens after each of PROMPTS, decoded once for every drafter."""
    return plain_greedy(target, LetterTokenizer(VOCAB), PROMPTS, 50)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", [None, "auto", TreeShape.full(2, 2)], ids=["chain", "auto", "2x2"])
def test_greedy_equals_plain_greedy(target, files, trained, greedy, kind, tree):
    """Random and trained drafters of each kind, chains (K 1, 3, additive) and trees: token for token the
    target's greedy output; both accepted and rejected drafts occur."""
    drafted = accepted = 0
    for path in (files[kind], trained[kind]):
        spec = speculator(target, path, kind, tree=tree)
        for prompt, reference in greedy.items():
            for k in (1, 3, "additive") if tree is None else (3,):
                stats = GenerationStats(kind, str(k))
                out = spec.stream(prompt, k=k, max_new_tokens=50, sampling=GREEDY, stats=stats)
                assert [t for chunk in out for t in chunk.token_ids] == reference, (path.name, prompt, k)
                drafted, accepted = drafted + stats.drafted + stats.tree_nodes, accepted + stats.accepted
    assert 0 < accepted < drafted


@pytest.mark.parametrize(
    ("kind", "tree", "sampling_kw"),
    [
        ("medusa", None, {}),
        ("medusa", TreeShape.full(2, 2), {"temperature": 0.8, "top_p": 0.9}),
        ("exit", None, {"temperature": 0.8, "top_p": 0.9}),
    ],
    ids=["medusa-chain", "medusa-2x2", "exit-chain"],
)
def test_first_sampled_token_follows_the_target(target, trained, kind, tree, sampling_kw):
    """A chi-square of the first sampled token (K = 1 chains, sampled children in trees) against the
    target's own distribution after the prompt (the exit's trees are the draft model's, tested there)."""
    spec = speculator(target, trained[kind], kind, tree=tree)
    prompt = "hello"
    assert first_token_chi_square(spec, target, spec.encode_prompt(prompt), prompt, sampling_kw) > ALPHA


def test_the_exit_reads_and_leaves_the_targets_cache(target, files):
    """In the engine the exit drafts on the target's own cache (no cache of its own) and its calibration key
    names its draft vocabulary; the Medusa key its heads."""
    spec = speculator(target, files["exit"], "exit")
    cache = target.new_cache()
    drafter = spec._chain_drafter(GREEDY, cache)
    assert isinstance(drafter, ModelDrafter) and drafter.shared is not None and drafter.shared[0] is cache
    assert drafter.cost_identity()["exit_draft_vocab"] == VOCAB // 2
    medusa = speculator(target, files["medusa"], "medusa")
    assert medusa._chain_drafter(GREEDY).cost_identity() == {
        "drafter": "medusa",
        "draft_vocab": VOCAB,
        "heads": 3,
        "precision": None,
    }


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("kind", KINDS)
def test_training_beats_the_untrained_drafter(target, dataset, trained, kind):
    """100 steps fit the data (Medusa: a lower loss than the untrained heads'; the exit: a held-out top-1
    above the untrained exit's, which the log records beside it); the training record holds what the tree
    and the report need."""
    head = load_head(trained[kind], target)
    training = head.metadata["training"]
    assert training["steps_done"] == 100 and training["kind"] == kind
    log = [json.loads(line) for line in (trained[kind].parent / "log.jsonl").read_text().splitlines()]
    if kind == "medusa":
        table = training["heldout_rank_accuracy"]
        assert len(table) == 3 and all(len(row) == 4 and sum(row) <= 1 + 1e-6 for row in table)
        assert [row[0] for row in table] == pytest.approx(training["heldout_top1_per_position"], abs=1e-4)
        # the tiny target's sampled answers are nearly unpredictable two tokens ahead: the loss it fits
        data = TrainingData.from_split(load_split(dataset, "train"), draft_index(head.draft_vocab, VOCAB))
        untrained = MedusaHeads.create(target, head.draft_vocab, torch.Generator(), {}, 3)
        with torch.no_grad():
            before, after = (
                MedusaRecipe().loss(h, data, TRAINING[kind], 0.0, torch.Generator().manual_seed(3))
                for h in (untrained, head)
            )
        assert after < 0.9 * before
    else:
        assert training["heldout_top1_per_position"][0] > training["heldout_untrained_top1"]
        assert "heldout_untrained_top1" in log[-1]


@pytest.mark.parametrize("kind", KINDS)
def test_resume_continues_exactly(target, dataset, tmp_path, monkeypatch, kind):
    config = dataclasses.replace(
        TRAINING[kind], steps=6, batch_tokens=64, eval_every=2, checkpoint_every=3, eval_tokens=64
    )
    cut = ("sample_positions", 5)
    whole = train_whole_and_cut(target, dataset, tmp_path, monkeypatch, config, TrainingData, *cut)
    resumed = train_drafter(target, dataset, tmp_path / "cut", config, resume=True, progress=False)
    a, b = load_file(str(whole)), load_file(str(resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs = [
        [json.loads(x) for x in (p.parent / "log.jsonl").read_text().splitlines()] for p in (whole, resumed)
    ]
    assert logs[0] == [{**r, "seconds": x["seconds"]} for r, x in zip(logs[1], logs[0], strict=True)]
    other = dataclasses.replace(config, heads=2) if kind == "medusa" else dataclasses.replace(config, lr=5e-3)
    one_line_error(lambda: train_drafter(target, dataset, tmp_path / "cut", other, resume=True), "differ")


def test_each_learned_kind_is_declared_once():
    """Issue 53: a learned kind's registry entry names its head class, its recipe and its shipped files; what
    reads them resolves: the head class of that kind, a Recipe, a shipped file for every target named, and
    the kinds train-drafter takes and those trained through the target."""
    trained = {name: kind.trained for name, kind in DRAFTERS.items() if kind.trained is not None}
    assert set(trained) == set(HEADS) == set(config_module.KINDS)
    assert set(trained) == {"eagle", "eagle3", "medusa", "exit", "lookahead"}
    assert config_module.THROUGH_TARGET == {"lookahead"}
    for name, declared in trained.items():
        assert HEADS[name] is declared.head_class() and HEADS[name].kind == name
        assert Recipe in declared.recipe_class().__mro__
        assert all(shipped_drafter(target, name) for target in (*declared.shipped, *declared.on_request))
        for target in declared.on_request:  # asked for by kind only: auto never loads it
            assert shipped_drafter(target, name, auto=True) is None
    assert all(declared.shipped for name, declared in trained.items() if name != "eagle3")  # none shipped yet


def test_bad_training_settings(target, dataset, tmp_path):
    for kwargs, match in (
        ({"kind": "medusa", "heads": 0}, "heads must be an integer >= 1"),
        ({"kind": "medusa", "heads": 9}, "heads must be at most 8"),
        ({"kind": "exit", "exit_layer": 0}, "exit_layer must be an integer >= 1"),
        ({"kind": "medusa", "init": "x.safetensors"}, "init .* is for eagle heads"),
    ):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**kwargs)
    config = dataclasses.replace(TRAINING["exit"], exit_layer=2)  # the tiny target has 2 layers
    one_line_error(
        lambda: train_drafter(target, dataset, tmp_path / "run", config, progress=False), "exit layer"
    )
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


# ---------------------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def stories(shared_model, tmp_path_factory):
    """stories260K, a data set of its own stories, and a drafter of each kind trained on it for 40 steps."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model, tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")
    prompts = [tokenizer.encode(p) for p in STORY_PROMPTS * 2]
    data = make_dataset(model, tmp_path_factory.mktemp("stories-data"), prompts, answer=80, label="stories")
    paths = {}
    for kind in KINDS:
        config = dataclasses.replace(
            TRAINING[kind], steps=40, batch_tokens=256, draft_vocab=256, eval_every=40, checkpoint_every=40
        )
        paths[kind] = train_drafter(model, data, tmp_path_factory.mktemp(kind), config, progress=False)
    return model, tokenizer, paths, root


@pytest.fixture(scope="module")
def stories_greedy(stories) -> dict[str, list[int]]:
    """stories260K's greedy output, 60 tokens after each of STORY_PROMPTS, decoded once for every drafter."""
    model, tokenizer, _, _ = stories
    return plain_greedy(model, tokenizer, STORY_PROMPTS, 60)


@pytest.mark.parametrize("kind", KINDS)
def test_stories_greedy_equals_plain_greedy(stories, stories_greedy, kind):
    model, tokenizer, paths, _ = stories
    drafted = accepted = 0
    for tree in (None, "auto"):
        spec = Speculator((model, tokenizer), drafter=kind, drafter_path=str(paths[kind]), tree=tree)
        for prompt, reference in stories_greedy.items():
            stats = GenerationStats(kind, "3")
            out = spec.stream(prompt, k=3, max_new_tokens=60, sampling=GREEDY, stats=stats)
            assert [t for chunk in out for t in chunk.token_ids] == reference, (prompt, tree)
            drafted, accepted = drafted + stats.drafted + stats.tree_nodes, accepted + stats.accepted
    assert 0 < accepted < drafted


def test_cli_trains_and_generates_each_kind(stories, tmp_path, capsys):
    model, tokenizer, _, root = stories
    model_args = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    data = make_dataset(model, tmp_path / "data", [tokenizer.encode(p) for p in STORY_PROMPTS], answer=30)
    outputs = {}
    for kind, extra in (("medusa", ["--heads", "3"]), ("exit", ["--exit-layer", "2"])):
        run = ["--data", str(data), "--out", str(tmp_path / kind), "--steps", "3", "--draft-vocab", "100"]
        status, out, err = run_cli(capsys, "train-drafter", *model_args, *run, "--kind", kind, *extra)
        assert status == 0, err
        path = tmp_path / kind / "drafter.safetensors"
        head = load_head(path, model)
        assert head.kind == kind and head.draft_vocab_size == 100
        args = ["--drafter", kind, "--drafter-path", str(path), "--temperature", "0", "--json"]
        status, out, err = run_cli(capsys, "generate", "Once upon a time", *model_args, *args)
        assert status == 0, err
        outputs[kind] = json.loads(out)
        assert outputs[kind]["stats"]["drafter"] == kind
    assert outputs["medusa"]["stats"]["k"].startswith("tree medusa")  # its default tree, from its accuracies
    assert outputs["medusa"]["token_ids"] == outputs["exit"]["token_ids"]  # both are the greedy output
    for argv, message in (
        (
            [
                "train-drafter",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "x"),
                "--kind",
                "medusa",
                "--heads",
                "0",
            ],
            "heads must be an integer >= 1",
        ),
        (
            [
                "train-drafter",
                *model_args,
                "--data",
                str(data),
                "--out",
                str(tmp_path / "y"),
                "--kind",
                "exit",
                "--exit-layer",
                "5",
            ],
            "exit layer must be an integer in [1, 4]",
        ),
        (
            [
                "generate",
                "Once",
                *model_args,
                "--drafter",
                "medusa",
                "--drafter-path",
                str(tmp_path / "exit" / "drafter.safetensors"),
            ],
            "holds a drafter of kind 'exit', not 'medusa'",
        ),
        (["generate", "Once", *model_args, "--drafter", "exit"], "needs a drafter file"),
    ):
        assert_usage_error(run_cli(capsys, *argv), message)
    assert not (tmp_path / "y" / "checkpoint.pt").exists()


def test_bench_lists_each_kind_with_its_file(files):
    with_file = plan_methods(BenchConfig(target="stories.bin", drafter_path=str(files["medusa"])))[0]
    assert Method("medusa", "4") in with_file and not any(m.name in ("eagle", "exit") for m in with_file)
    methods, notes = plan_methods(BenchConfig(target="stories.bin"))
    assert not any(m.name in KINDS for m in methods)
    assert any(n.startswith("medusa: no learned") for n in notes) and any(
        n.startswith("exit: no learned") for n in notes
    )
