"""The learned (EAGLE-style) drafter: its file, its training, and exactness in the engine.

Targets are tiny random Llamas (and stories260K from ``../shared/models`` where present); their training data
sets are made here, in the format of :mod:`verispec.training.data`, by the target itself: its sampled
answers to random prompts, with ``forward_hidden`` at every position.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from scipy import stats as scipy_stats

from fakes import LetterTokenizer, TableLM
from first_rounds import first_token_counts
from one_sequence import OneSequence
from test_real_models import STORY_PROMPTS
from verispec import cli
from verispec import resolve as resolve_module
from verispec.api import Speculator
from verispec.bench.suite import BenchConfig, Method, plan_methods
from verispec.costs.analytic import CostModel, best_tree_size, speedup_by_k
from verispec.costs.calibrate import DRAFT_K, FILLS, TreeRound, calibrate
from verispec.costs.policies import ConstantK
from verispec.drafting.base import Allowed, BoundedCatchUp, Proposal
from verispec.drafting.learned.eagle import EagleHead
from verispec.drafting.learned.eagle_drafter import (
    CATCH_UP_WINDOW,
    DEFAULT_TREE,
    EagleDrafter,
    EagleTreeDrafter,
)
from verispec.drafting.learned.head import native_target, target_fingerprint, target_head_rows
from verispec.drafting.ngram import NGramTreeDrafter
from verispec.drafting.registry import LOOKUP_FIRST
from verispec.drafting.tree import TreeShape
from verispec.engine.sequence import EngineConfig, GenerationStats, Request
from verispec.models.gguf_native import GGUFEmbedding
from verispec.models.llama import Llama
from verispec.models.llama_config import LlamaConfig
from verispec.models.registry import load_model
from verispec.options import GenerationOptions, SamplingParams
from verispec.sampling import probs_from_logits
from verispec.training import eagle as eagle_recipe
from verispec.training.config import TrainConfig
from verispec.training.data import load_split
from verispec.training.eagle import Batch, EagleRecipe, batch_loss, sample_batch, unrolled_features
from verispec.training.recipe import TrainingData, draft_index
from verispec.training.train import train_drafter

VOCAB = 64
GREEDY = SamplingParams(temperature=0)
TINY_TRAINING = TrainConfig(
    steps=100,
    batch_tokens=128,
    window=32,
    draft_vocab=48,
    lr=3e-3,
    warmup=4,
    eval_every=100,
    eval_tokens=256,
    checkpoint_every=100,
)


def tiny_target(seed: int = 0, vocab: int = VOCAB, layers: int = 2) -> Llama:
    """A random Llama of 2 layers (or ``layers``) whose next-token distributions are peaked (weights of scale
    0.3)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = Llama(config)
    g = torch.Generator().manual_seed(seed)
    model.load_weights(
        (
            name,
            torch.ones(p.shape) if name.endswith("norm.weight") else 0.3 * torch.randn(p.shape, generator=g),
        )
        for name, p in model.named_parameters()
    )
    return model


def hidden_states(model: Llama, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states at every position of ``ids``: [len(ids), H]."""
    tokens, positions = torch.tensor([ids]), torch.arange(len(ids))[None]  # [1, L]
    return model.forward_hidden(tokens, positions, model.new_cache(1, len(ids)))[0]


def make_dataset(
    model: Llama, directory: Path, prompts: list[list[int]], answer: int, seed: int = 0, label: str = "tiny"
) -> Path:
    """A data set in verispec.training.data's format: the model's sampled answers (every fourth held
    out)."""
    g = torch.Generator().manual_seed(seed)
    splits: dict[str, list] = {"train": [], "heldout": []}
    for i, prompt in enumerate(prompts):
        ids, cache = list(prompt), model.new_cache()
        logits = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0, -1]  # [V]
        for _ in range(answer):
            ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=g)))
            logits = model.forward(torch.tensor([ids[-1:]]), torch.tensor([[cache.length]]), cache)[0, -1]
        ids = ids[:-1]  # the last token has no hidden state
        split = "heldout" if i % 4 == 0 else "train"
        splits[split].append((ids, len(prompt), hidden_states(model, ids).half()))
    directory.mkdir(parents=True, exist_ok=True)
    for name, seqs in splits.items():
        lengths = torch.tensor([len(ids) for ids, _, _ in seqs])
        tensors = {
            "tokens": torch.tensor([t for ids, _, _ in seqs for t in ids], dtype=torch.int32),
            "hidden": torch.cat([h for _, _, h in seqs]),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "prompt_lengths": torch.tensor([n for _, n, _ in seqs]),
        }
        save_file(tensors, str(directory / f"{name}.safetensors"))
    meta = {
        "target": label,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.vocab_size,
        "num_sequences": len(prompts),
        "num_tokens": sum(len(ids) for seqs in splits.values() for ids, _, _ in seqs),
        "splits": {name: len(seqs) for name, seqs in splits.items()},
    }
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


def fresh_head(model: Llama, draft_vocab: torch.Tensor, seed: int = 0) -> EagleHead:
    metadata = {"kind": "eagle", "target": "tiny", "target_fingerprint": target_fingerprint(model)}
    return EagleHead.create(model, draft_vocab, torch.Generator().manual_seed(seed), metadata)


@pytest.fixture(scope="module")
def target() -> Llama:
    return tiny_target()


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory) -> Path:
    return make_dataset(target, tmp_path_factory.mktemp("data"), random_prompts(24, VOCAB, 1), answer=40)


@pytest.fixture(scope="module")
def trained(target, dataset, tmp_path_factory) -> Path:
    """A drafter trained for 100 steps on the tiny data set (about a second)."""
    return train_drafter(target, dataset, tmp_path_factory.mktemp("run"), TINY_TRAINING, progress=False)


# ---------------------------------------------------------------------------------------------- files


def test_save_load_round_trip(target, tmp_path):
    """The file holds the trained tensors (float16) and the draft vocabulary, never the target's embeddings;
    loading gives back the same head: weights, vocabulary, metadata, outputs."""
    head = fresh_head(target, torch.arange(0, VOCAB, 3))
    head.metadata["training"] = {"steps": 3}
    path = head.save(tmp_path / "drafter.safetensors")
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
    assert names == {*head.state_dict(), "draft_vocab"}
    assert not any("embed" in name or "head_weight" in name for name in names)
    loaded = EagleHead.load(path, target, "tiny")
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.half().float()), name
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    assert loaded.metadata["training"] == {"steps": 3} and loaded.metadata["target"] == "tiny"
    assert torch.equal(loaded.head_weight, target.model.embed_tokens.weight[head.draft_vocab])  # tied head
    tokens, features = torch.tensor([[5, 9, 2]]), torch.randn(1, 3, 32)  # [1, 3], [1, 3, H]
    positions = torch.arange(3)[None]  # [1, 3]
    with torch.no_grad():
        for tensor in head.state_dict().values():
            tensor.copy_(tensor.half().float())  # the float16 storage is the only difference
        expected = head(tokens, features, positions, head.new_cache(1, 3))
        torch.testing.assert_close(loaded(tokens, features, positions, loaded.new_cache(1, 3)), expected)


def test_fingerprint_names_the_weights(target):
    same = tiny_target(0)
    assert target_fingerprint(same) == target_fingerprint(target)
    half = Llama(target.config, dtype=torch.bfloat16)
    half.load_weights(target.state_dict().items())
    assert target_fingerprint(half) == target_fingerprint(target)  # a half-precision copy is the same target
    assert target_fingerprint(tiny_target(1)) != target_fingerprint(target)
    with torch.no_grad():
        same.model.layers[1].post_attention_layernorm.weight[3] += 0.25
    assert target_fingerprint(same) != target_fingerprint(target)


def one_line_error(call, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_corrupt_and_foreign_files_are_refused(target, tmp_path):
    good = fresh_head(target, torch.arange(VOCAB)).save(tmp_path / "good.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json" + bytes(100))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:200])
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    medusa = tmp_path / "medusa.safetensors"
    with safe_open(str(good), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, str(medusa), metadata={**metadata, "kind": "medusa"})
    for path, match in (
        (garbage, "not a readable drafter file"),
        (truncated, "not a readable drafter file"),
        (plain, "not a verispec drafter file"),
        (medusa, "kind 'medusa'"),
        (tmp_path / "absent.safetensors", "no such drafter file"),
    ):
        one_line_error(lambda p=path: EagleHead.load(p, target, "tiny"), match)


def test_a_drafter_for_another_target_is_refused(target, tmp_path):
    other = tiny_target(seed=1)
    path = fresh_head(other, torch.arange(VOCAB)).save(tmp_path / "other.safetensors")
    message = one_line_error(lambda: EagleHead.load(path, target, "mine"), "trained for target")
    assert (
        target_fingerprint(other) in message and target_fingerprint(target) in message and "'mine'" in message
    )
    tokenizer = LetterTokenizer(VOCAB)
    one_line_error(
        lambda: Speculator((target, tokenizer), drafter="eagle", drafter_path=str(path)), "trained for target"
    )


def test_a_loaded_target_is_named_by_its_label(target, trained, tmp_path, monkeypatch):
    """``target_label`` names a loaded target: the shipped drafter is looked up under it; errors say it."""
    tokenizer = LetterTokenizer(VOCAB)
    monkeypatch.setattr(
        resolve_module, "_learned_pays", lambda model, head, label: True
    )  # the costs: another test
    asked = []
    monkeypatch.setattr(
        resolve_module,
        "shipped_drafter",
        lambda label, kind="eagle", auto=False: asked.append(label) or trained,
    )
    assert Speculator((target, tokenizer), target_label="tiny-0").drafter_name == LOOKUP_FIRST
    assert asked == ["tiny-0"]
    foreign = fresh_head(tiny_target(seed=1), torch.arange(VOCAB)).save(tmp_path / "foreign.safetensors")
    message = one_line_error(
        lambda: Speculator((target, tokenizer), drafter_path=str(foreign), target_label="tiny-0"),
        "trained for target",
    )
    assert "'tiny-0'" in message


def test_unsupported_targets_are_refused(dataset, tmp_path):
    table = TableLM(VOCAB, seed=0)
    one_line_error(lambda: native_target(table), "native Llama-family")
    one_line_error(
        lambda: train_drafter(table, dataset, tmp_path / "run", TINY_TRAINING), "native Llama-family"
    )
    with pytest.raises(ValueError, match="unknown drafter kind"):
        TrainConfig(kind="bogus")


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("ce_target", ["token", "distribution"])
def test_training_lowers_the_loss(target, dataset, trained, ce_target, tmp_path):
    """The held-out loss of a fixed batch, before (the same seeded initialisation) and after 100 steps, the
    cross-entropy fitting the target's next tokens or its distributions."""
    config = dataclasses.replace(TINY_TRAINING, ce_target=ce_target)
    path = (
        trained if ce_target == "token" else train_drafter(target, dataset, tmp_path, config, progress=False)
    )
    head = EagleHead.load(path, target)
    data = TrainingData.from_split(load_split(dataset, "heldout"), draft_index(head.draft_vocab, VOCAB))
    batch = sample_batch(data, 8, 32, torch.Generator().manual_seed(5))
    untrained = fresh_head(target, head.draft_vocab, seed=config.seed)
    with torch.no_grad():
        before = batch_loss(untrained, batch, config, 0.0, torch.Generator())
        after = batch_loss(head, batch, config, 0.0, torch.Generator())
    assert after < 0.8 * before
    log = [json.loads(line) for line in (path.parent / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 100 and len(log[-1]["heldout_top1"]) == 4
    assert len(log[-1]["train_top1"]) == 4 and all(0 < a <= 1 for a in log[-1]["train_top1"])
    assert head.metadata["training"]["steps_done"] == 100
    assert head.metadata["training"]["ce_target"] == ce_target


def test_unrolled_steps_see_what_drafting_sees(target):
    """Unrolled training step s at slot t equals the head run as the drafter runs it: the true-feature slots
    up to t − s, then s steps on its own predicted features (with the window's tokens as the drafts)."""
    head = fresh_head(target, torch.arange(VOCAB), seed=4)
    g = torch.Generator().manual_seed(0)
    width = 12
    tokens = torch.randint(0, VOCAB, (1, width), generator=g)  # [1, W]
    features = torch.randn(1, width + 1, 32, generator=g)  # [1, W+1, H]
    positions = torch.arange(width)[None]  # [1, W]
    batch = Batch(
        tokens,
        features,
        torch.zeros(1, width, dtype=torch.long),
        torch.ones(1, width, dtype=torch.bool),
        positions,
    )
    with torch.no_grad():
        steps = unrolled_features(head, batch, 3, 0.0, g)
        for begin in (1, 5, 8):  # the draft begins after slot begin − 1
            cache = head.new_cache(1, width)
            out = head(tokens[:, :begin], features[:, :begin], positions[:, :begin], cache)[
                :, -1:
            ]  # [1, 1, H]
            torch.testing.assert_close(out[0, 0], steps[0][0, begin - 1])
            for s in range(1, 4):
                slot = begin - 1 + s
                out = head(tokens[:, slot : slot + 1], out, positions[:, slot : slot + 1], cache)
                torch.testing.assert_close(out[0, 0], steps[s][0, slot], atol=1e-5, rtol=1e-5)


def train_whole_and_cut(target, dataset, tmp_path, monkeypatch, config, owner, name: str, at: int):
    """Trains ``config`` into tmp_path / "whole", then into tmp_path / "cut" interrupted (KeyboardInterrupt)
    at the ``at``-th call of ``owner.name``; the whole run's file."""
    whole = train_drafter(target, dataset, tmp_path / "whole", config, progress=False)
    calls = []
    original = getattr(owner, name)

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(target, dataset, tmp_path / "cut", config, progress=False)
    monkeypatch.undo()
    return whole


def test_resume_continues_exactly(target, dataset, tmp_path, monkeypatch):
    """Interrupted after the checkpoint of step 3 (in step 5, after an evaluation at step 4), resumed: the
    same weights, optimizer state and logged evaluations as an uninterrupted run of 6 steps."""
    config = TrainConfig(
        steps=6, batch_tokens=64, window=32, draft_vocab=48, eval_every=2, checkpoint_every=3, eval_tokens=64
    )
    whole = train_whole_and_cut(
        target, dataset, tmp_path, monkeypatch, config, eagle_recipe, "sample_batch", 5
    )
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["step"] == 3
    one_line_error(lambda: train_drafter(target, dataset, tmp_path / "cut", config), "already holds")
    changed = TrainConfig(**{**config.__dict__, "lr": 5e-3})
    one_line_error(
        lambda: train_drafter(target, dataset, tmp_path / "cut", changed, resume=True),
        re.escape(f"its settings differ (lr {config.lr!r} there, 0.005 now)"),
    )
    resumed = train_drafter(target, dataset, tmp_path / "cut", config, resume=True, progress=False)
    a, b = load_file(str(whole)), load_file(str(resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state_a = torch.load(whole.parent / "checkpoint.pt", weights_only=True)
    state_b = torch.load(resumed.parent / "checkpoint.pt", weights_only=True)
    for key, value in state_a["optimizer"]["state"].items():
        assert torch.equal(value["exp_avg"], state_b["optimizer"]["state"][key]["exp_avg"])
    logs = [
        [json.loads(line) for line in (p.parent / "log.jsonl").read_text().splitlines()]
        for p in (whole, resumed)
    ]
    assert [record["step"] for record in logs[0]] == [2, 4, 6]
    assert [(r["loss"], r["heldout_top1"]) for r in logs[0]] == [
        (r["loss"], r["heldout_top1"]) for r in logs[1]
    ]


def test_init_starts_from_a_trained_drafter(target, dataset, trained, tmp_path):
    """``init`` loads a trained drafter's weights and draft vocabulary: one step at a vanishing learning rate
    leaves its file as it was (float16), where a run without it starts from the seeded random head."""
    head = EagleHead.load(trained, target)
    config = dataclasses.replace(
        TINY_TRAINING, steps=1, lr=1e-12, warmup=0, draft_vocab=head.draft_vocab_size, init=str(trained)
    )
    tuned = train_drafter(target, dataset, tmp_path / "tuned", config, progress=False)
    a, b = load_file(str(trained)), load_file(str(tuned))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert EagleHead.load(tuned, target).metadata["training"]["init"] == str(trained)
    start, end = [json.loads(x) for x in (tmp_path / "tuned" / "log.jsonl").read_text().splitlines()]
    assert (start["step"], start["loss"], end["step"]) == (0, None, 1)  # the drafter's own accuracy first
    tiny = dataclasses.replace(TINY_TRAINING, draft_vocab=head.draft_vocab_size)
    heldout = TrainingData.from_split(load_split(dataset, "heldout"), draft_index(head.draft_vocab, VOCAB))
    assert start["heldout_top1"] == EagleRecipe().evaluate(head, heldout, tiny)[0]
    fresh = train_drafter(
        target, dataset, tmp_path / "fresh", dataclasses.replace(config, init=""), progress=False
    )
    assert not torch.equal(load_file(str(fresh))["fc.weight"], a["fc.weight"])
    other = tiny_target(seed=3)
    foreign = train_drafter(
        other,
        make_dataset(other, tmp_path / "d3", random_prompts(4, VOCAB, 2), answer=8),
        tmp_path / "f",
        dataclasses.replace(TINY_TRAINING, steps=1),
        progress=False,
    )
    for init, vocab, message in (
        (foreign, head.draft_vocab_size, "trained for target"),
        (tmp_path / "absent.safetensors", head.draft_vocab_size, "no such drafter file"),
        (trained, head.draft_vocab_size - 1, "draft vocabulary of"),
    ):
        changed = dataclasses.replace(config, init=str(init), draft_vocab=vocab)
        one_line_error(lambda c=changed: train_drafter(target, dataset, tmp_path / "bad", c), message)
        assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="init must be"):
        TrainConfig(init=None)  # type: ignore[arg-type]


def test_bad_training_input(target, dataset, tmp_path):
    one_line_error(lambda: train_drafter(target, tmp_path / "none", tmp_path / "run"), "no drafter data set")
    one_line_error(
        lambda: train_drafter(tiny_target(seed=3), dataset, tmp_path / "run"),
        "hidden states differ .* answered in precision fp32: train in that precision",
    )
    one_line_error(lambda: train_drafter(target, dataset, tmp_path / "run", resume=True), "nothing to resume")
    for bad in ({"steps": 0}, {"lr": 0.0}, {"window": 64, "batch_tokens": 32}, {"noise": -1.0}):
        with pytest.raises(ValueError):
            TrainConfig(**bad)


def test_a_native_target_trains_on_data_it_answered(tmp_path):
    """The target as generate runs it on the native kernels (fp16 here) trains a drafter on a data set it
    answered; lookahead tokens, trained through the float32 layers, refuse a native target in one line."""
    native = tiny_target()
    assert native.optimize_for_cpu(precision="fp16") and native.on_native_kernels
    answered = make_dataset(native, tmp_path / "data", random_prompts(8, VOCAB, 1), answer=20)
    config = dataclasses.replace(TINY_TRAINING, steps=4, eval_every=4, checkpoint_every=4)
    path = train_drafter(native, answered, tmp_path / "run", config, progress=False)
    assert EagleHead.load(path, native).training_record["steps_done"] == 4
    lookahead = dataclasses.replace(config, kind="lookahead", lookahead=2, batch_tokens=32)
    one_line_error(lambda: train_drafter(native, answered, tmp_path / "look", lookahead), "float32 layers")


# ---------------------------------------------------------------------------------------------- drafting


def plain_greedy(model: Llama, tokenizer, prompts, max_new_tokens: int) -> dict[str, list[int]]:
    """prompt → the model's own greedy output after it (no drafter)."""
    plain = Speculator((model, tokenizer), drafter="none")
    return {
        p: plain.generate(p, k=0, max_new_tokens=max_new_tokens, sampling=GREEDY).token_ids for p in prompts
    }


def plain_and_eagle(target, path: Path):
    tokenizer = LetterTokenizer(VOCAB)
    plain = Speculator((target, tokenizer), drafter="none")
    eagle = Speculator((target, tokenizer), drafter="eagle", drafter_path=str(path))
    return plain, eagle


def test_greedy_equals_plain_greedy_tiny(target, trained, tmp_path):
    """Trained and random drafters, 6 prompts × K ∈ {1, 3, additive}: token for token the target's greedy
    output; both accepted and rejected drafts occur."""
    random_path = fresh_head(target, torch.arange(0, VOCAB, 2), seed=9).save(tmp_path / "random.safetensors")
    drafted = accepted = 0
    for path in (trained, random_path):
        plain, eagle = plain_and_eagle(target, path)
        assert eagle.drafter_name == "eagle"
        for prompt in ("abc", "hello", "qqqzzz", "the", "mnopqrs", "x"):
            reference = plain.generate(prompt, k=0, max_new_tokens=60, sampling=GREEDY).token_ids
            for k in (1, 3, "additive"):
                stats = GenerationStats("eagle", str(k))
                out = eagle.stream(prompt, k=k, max_new_tokens=60, sampling=GREEDY, stats=stats)
                assert [t for chunk in out for t in chunk.token_ids] == reference, (path.name, prompt, k)
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted


def test_auto_takes_the_shipped_drafter_only_when_it_matches(target, trained, tmp_path, monkeypatch):
    tokenizer = LetterTokenizer(VOCAB)
    foreign = fresh_head(tiny_target(seed=1), torch.arange(VOCAB)).save(tmp_path / "foreign.safetensors")
    monkeypatch.setattr(resolve_module, "shipped_drafter", lambda label, kind="eagle", auto=False: trained)
    monkeypatch.setattr(
        resolve_module, "_learned_pays", lambda model, head, label: True
    )  # the costs: the next test
    assert Speculator((target, tokenizer)).drafter_name == LOOKUP_FIRST  # the head behind prompt lookup
    assert Speculator((target, tokenizer), draft=(target, tokenizer)).drafter_name == "model"
    assert Speculator((target, tokenizer), tree=TreeShape.full(2, 2)).drafter_name == "eagle"  # a tree
    monkeypatch.setattr(resolve_module, "shipped_drafter", lambda label, kind="eagle", auto=False: foreign)
    assert Speculator((target, tokenizer)).drafter_name == "ngram"
    one_line_error(lambda: Speculator((target, tokenizer), drafter="eagle"), "trained for target")
    monkeypatch.setattr(resolve_module, "shipped_drafter", lambda label, kind="eagle", auto=False: None)
    assert Speculator((target, tokenizer)).drafter_name == "ngram"
    one_line_error(lambda: Speculator((target, tokenizer), drafter="eagle"), "needs a drafter file")
    one_line_error(
        lambda: Speculator((target, tokenizer), draft=(target, tokenizer), drafter_path=str(trained)),
        "not both",
    )


@pytest.mark.parametrize(("cost_ratio", "verify", "pays"), [(0.05, 1.05, True), (0.3, 1.3, False)])
def test_auto_takes_the_shipped_drafter_only_where_the_costs_say_it_pays(
    target, trained, monkeypatch, cost_ratio, verify, pays
):
    """At the held-out agreement its file records, the cost model must predict the shipped drafter
    LEARNED_MARGIN times faster than plain decoding; a drafter named by its path is always taken."""
    tokenizer = LetterTokenizer(VOCAB)
    monkeypatch.setattr(resolve_module, "shipped_drafter", lambda label, kind="eagle", auto=False: trained)
    heldout = [0.9, 0.85, 0.8]
    real_from_file = EagleHead.from_file

    def from_file(*args, **kwargs):  # the trained tiny head, recording that agreement
        head = real_from_file(*args, **kwargs)
        head.metadata["training"] = json.dumps({"heldout_top1_per_position": heldout})
        return head

    monkeypatch.setattr(EagleHead, "from_file", staticmethod(from_file))
    costs = CostModel(cost_ratio, [1.0] + [verify + 0.1 * i for i in range(15)])
    calibration = SimpleNamespace(cost_model=costs)
    monkeypatch.setattr(resolve_module, "calibrate", lambda *args, **kwargs: calibration)
    predicted = speedup_by_k(heldout + [heldout[-1]] * 12, costs.round_costs(15)).max()
    assert (predicted >= resolve_module.LEARNED_MARGIN) == pays  # the two settings straddle the margin
    assert Speculator((target, tokenizer)).drafter_name == (LOOKUP_FIRST if pays else "ngram")
    assert Speculator((target, tokenizer), drafter_path=str(trained)).drafter_name == LOOKUP_FIRST


def drafter_with_context(target, head, context: list[int], sampling: SamplingParams) -> EagleDrafter:
    drafter = EagleDrafter(head, sampling)
    drafter.begin(context)
    drafter.observe_hidden(hidden_states(target, context)[:-1])
    return drafter


@pytest.mark.parametrize("sampling_kw", [{}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.5}])
def test_q_is_a_distribution_on_the_draft_vocabulary(target, trained, sampling_kw):
    """q sums to 1, is zero outside the draft vocabulary, and is what probs_from_logits gives for the
    full-vocabulary logits that are −inf outside it."""
    head = EagleHead.load(trained, target)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[head.draft_vocab] = False
    context = [3, 14, 15, 9, 2, 6]
    sampling = SamplingParams(**sampling_kw)
    drafter = drafter_with_context(target, head, context, sampling)
    proposal = drafter.propose(context, 4, torch.Generator().manual_seed(0))
    q = proposal.q  # [4, V]
    assert q.shape == (4, VOCAB) and proposal.tokens.shape == (4,)
    assert (q >= 0).all() and (q[:, outside] == 0).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(4, dtype=q.dtype))
    assert (q[torch.arange(4), proposal.tokens] > 0).all()
    n = len(context) - 1
    with torch.no_grad():
        tokens, positions = torch.tensor([context[1:]]), torch.arange(n)[None]  # [1, n]
        feature = head(tokens, hidden_states(target, context)[None, :n], positions, head.new_cache(1, n))
    full = torch.full((VOCAB,), float("-inf"))  # [V]
    full[head.draft_vocab] = head.logits(feature[0, -1:])[0]
    torch.testing.assert_close(q[0], probs_from_logits(full, sampling))
    greedy = drafter_with_context(target, head, context, GREEDY).propose(context, 4, torch.Generator())
    assert greedy.q is None and not outside[greedy.tokens].any()


@pytest.mark.parametrize("window", [3, None])
def test_a_catch_up_reads_the_last_pairs_at_their_own_positions(target, trained, window):
    """With a window, a catch-up feeds the head the last ``window`` pairs it has not read, at their own
    positions: the first draft's q is the head's over those pairs alone (the head on a fresh cache: the
    oracle), its cache then holds that many true slots, and the next round reads only the pairs committed
    since. Without one, every pair."""
    head = EagleHead.load(trained, target)
    context, sampling = [3, 14, 15, 9, 2, 6, 33, 1, 7, 12], SamplingParams(temperature=0.8)
    hidden = hidden_states(target, context + [5, 8])  # [L + 2, H]: the states of the next round's too
    drafter = EagleDrafter(head, sampling, window=window)
    assert drafter.catch_up_limit == window and isinstance(drafter, BoundedCatchUp)
    drafter.begin(context)
    drafter.observe_hidden(hidden[: len(context) - 1])
    proposal = drafter.propose(context, 2, torch.Generator().manual_seed(0))
    n = len(context) - 1
    first = 0 if window is None else n - window  # the first pair read
    with torch.no_grad():
        tokens, positions = torch.tensor([context[first + 1 :]]), torch.arange(first, n)[None]  # [1, T]
        feature = head(tokens, hidden[None, first:n], positions, head.new_cache(1, n))
    full = torch.full((VOCAB,), float("-inf"))  # [V]
    full[head.draft_vocab] = head.logits(feature[0, -1:])[0]
    assert proposal.q is not None
    torch.testing.assert_close(proposal.q[0], probs_from_logits(full, sampling))
    drafter.observe(0)
    assert drafter.cache.length == n - first
    later = context + [5, 8]  # two more committed: read alone
    drafter.observe_hidden(hidden[n : len(later) - 1])
    drafter.propose(later, 1, torch.Generator())
    drafter.observe(0)
    assert drafter.cache.length == n - first + 2
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        EagleDrafter(head, sampling, window=0)


def test_cpu_fast_path_drafts_the_same(target, trained, tmp_path):
    plain, fast = EagleHead.load(trained, target), EagleHead.load(trained, target)
    if not fast.optimize_for_cpu(min_weight_elements=0):
        pytest.skip("this torch has no working oneDNN linears")
    context = [3, 14, 15, 9, 2, 6, 33, 1]
    for sampling in (GREEDY, SamplingParams(temperature=0.9)):
        a = drafter_with_context(target, plain, context, sampling).propose(context, 5, torch.Generator())
        b = drafter_with_context(target, fast, context, sampling).propose(context, 5, torch.Generator())
        assert torch.equal(a.tokens, b.tokens)
        if a.q is not None:
            torch.testing.assert_close(a.q, b.q)
    one_line_error(lambda: fast.save(tmp_path / "packed.safetensors"), "optimized for CPU")


def test_rollback_leaves_the_state_of_a_fresh_drafter(target, trained):
    """Rounds of propose → commit some drafts and one more token → observe: after each, the drafter's cache
    holds exactly the true-feature slots, and its next proposal (tokens and q) is that of a new drafter given
    the whole committed context at once; a proposal rolled back entirely can be made again, identically."""
    head = EagleHead.load(trained, target)
    sampling = SamplingParams(temperature=0.8)
    g = torch.Generator().manual_seed(2)
    context = [7, 1, 30, 22]
    drafter = drafter_with_context(target, head, context, sampling)
    for k, accepted in ((4, 0), (3, 3), (2, 1), (5, 5), (1, 0), (4, 2)):
        first = drafter.propose(context, k, torch.Generator().manual_seed(len(context)))
        drafter.observe(0)  # proposing again for the same context drafts the same
        proposal = drafter.propose(context, k, torch.Generator().manual_seed(len(context)))
        assert torch.equal(first.tokens, proposal.tokens) and torch.equal(first.q, proposal.q)
        fresh = drafter_with_context(target, head, context, sampling)
        again = fresh.propose(context, k, torch.Generator().manual_seed(len(context)))
        assert torch.equal(proposal.tokens, again.tokens)
        torch.testing.assert_close(proposal.q, again.q)
        committed = len(context)
        context = (
            context + proposal.tokens[:accepted].tolist() + [int(torch.randint(0, VOCAB, (1,), generator=g))]
        )
        drafter.observe_hidden(hidden_states(target, context)[committed - 1 : len(context) - 1])
        drafter.observe(accepted)
        assert drafter.cache.length == committed - 1  # the slots fed with true features


def test_k_auto_calibrates_real_proposals(target, trained, tmp_path, monkeypatch):
    """--k auto: the calibration hands the drafter the target's hidden states, so every proposal it times
    drafts what it was asked (DRAFT_K tokens after begin, then 1 and DRAFT_K in turn); generation at K auto
    stays the target's greedy output."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    lengths = []
    propose = EagleDrafter.propose

    def counted(self, context, k, generator, allowed=None):
        proposal = propose(self, context, k, generator, allowed)
        lengths.append(len(proposal.tokens))
        return proposal

    monkeypatch.setattr(EagleDrafter, "propose", counted)
    plain, eagle = plain_and_eagle(target, trained)
    calibration = eagle.calibration(repetitions=3)
    assert lengths == [DRAFT_K] * FILLS + [1, DRAFT_K] * 3 and calibration.cost_ratio > 0
    for prompt in ("abc", "mnopqrs"):
        reference = plain.generate(prompt, k=0, max_new_tokens=40, sampling=GREEDY).token_ids
        assert eagle.generate(prompt, k="auto", max_new_tokens=40, sampling=GREEDY).token_ids == reference


def test_a_tree_round_is_calibrated_as_its_whole_tree(target, trained, tmp_path, monkeypatch):
    """tree="auto" prices a tree round's drafting by its own calibration (TreeRound): every proposal timed
    drafts the whole default tree from the target's hidden states (its 4 draft nodes), and its costs are kept
    in the cache apart from the chain's (another identity)."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    drafted = []
    propose_tree = EagleTreeDrafter.propose_tree

    def counted(self, context, shape, generator, allowed=None):
        tree = propose_tree(self, context, shape, generator, allowed)
        drafted.append(tree.num_nodes - 1)
        return tree

    monkeypatch.setattr(EagleTreeDrafter, "propose_tree", counted)
    head = EagleHead.load(trained, target)
    chain = EagleDrafter(head, GREEDY)
    tree_round = TreeRound(EagleTreeDrafter(chain, DEFAULT_TREE))
    costs = calibrate(target, tree_round, repetitions=3).draft
    assert costs is not None and costs.cost_ratio > 0
    assert drafted == [DEFAULT_TREE.num_nodes - 1] * (FILLS + 2 * 3)
    assert tree_round.cost_identity() != chain.cost_identity()
    assert calibrate(target, chain, repetitions=3).draft is not None
    cached = json.loads(next((tmp_path / "cache" / "calibration").glob("*.json")).read_text())
    assert len(cached["drafts"]) == 2


class RecordingDrafter:
    """Reads the target's hidden states and records them; drafts the target's greedy next token, then the
    last token again (single guesses: some accepted, some rejected)."""

    name = "recording"

    def __init__(self, model: Llama) -> None:
        self.model = model
        self.hidden: list[torch.Tensor] = []

    def begin(self, prompt: list[int]) -> None:
        self.hidden = []

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden.append(hidden.clone())

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        best = int(self.model.logits(hidden_states(self.model, context)[-1:])[0].argmax())
        return Proposal(tokens=torch.tensor([best] + context[-1:] * (k - 1)), q=None)

    def observe(self, num_accepted: int) -> None:
        pass


@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(seed=4, invariant=False)], ids=["greedy", "sampled"]
)
def test_engine_hands_over_the_committed_hidden_states(target, sampling):
    """The drafter receives f_0..f_{n-1} of the final sequence x_0..x_n, in order, nothing else."""
    drafter = RecordingDrafter(target)
    engine = OneSequence(target, drafter, ConstantK(3))
    prompt = [5, 17, 40, 2]
    stats = GenerationStats("recording", "3")
    new = [t for chunk in engine.stream(prompt, EngineConfig(30, sampling), stats) for t in chunk]
    assert stats.accepted > 0 and stats.drafted > stats.accepted
    received = torch.cat(drafter.hidden)  # [n, H]
    torch.testing.assert_close(received, hidden_states(target, prompt + new[:-1]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="hidden states"):
        OneSequence(TableLM(VOCAB, seed=0), drafter, ConstantK(3))


# Chi-square through the engine: the first sampled token of N seeded generations with the learned drafter
# (k = 1) against the target's own next-token distribution; cells with expected count < 5 are merged.
N = 3000
ALPHA = 1e-3


def first_token_chi_square(speculator: Speculator, model: Llama, prompt_ids: list[int], prompt, sampling_kw):
    def request(sampling: SamplingParams) -> Request:
        return speculator.request(prompt, GenerationOptions(k=1, max_new_tokens=2, sampling=sampling))[0]

    return chi_square_of_first_tokens(request, model, prompt_ids, sampling_kw)


def chi_square_of_first_tokens(request, model: Llama, prompt_ids: list[int], sampling_kw) -> float:
    """The p-value of the first tokens that the requests ``request(sampling)`` for seeds 0..N-1 sample (their
    first rounds, :func:`first_rounds.first_rounds`) against the target's own next-token distribution after
    ``prompt_ids``."""
    counts = first_token_counts(
        model, lambda seed: request(SamplingParams(seed=seed, **sampling_kw, invariant=False)), N
    )
    logits = model.forward(torch.tensor([prompt_ids]), torch.arange(len(prompt_ids))[None], model.new_cache())
    expected = probs_from_logits(logits[0, -1].double(), SamplingParams(**sampling_kw)).numpy() * N
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    return scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.slow
def test_first_sampled_token_follows_the_target_tiny(target, trained):
    _, eagle = plain_and_eagle(target, trained)
    prompt = "hello"
    assert first_token_chi_square(eagle, target, eagle.encode_prompt(prompt), prompt, {}) > ALPHA


# ---------------------------------------------------------------------------------------------- token trees

TREE_SHAPES = [
    TreeShape.full(2, 3),
    TreeShape.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]),
    TreeShape.chain(4),
]


def path_feature(head: EagleHead, drafter: EagleDrafter, context: list[int], path: list[int]) -> torch.Tensor:
    """The oracle: the feature [H] the head predicts after drafting ``path`` one token at a time on a fresh
    cache, as the chain drafter does (each token read with the feature the previous step predicted)."""
    cache, n = head.new_cache(), len(context) - 1
    features = drafter._features[:n].unsqueeze(0)  # [1, n, H]
    feature = head(torch.tensor([context[1:]]), features, torch.arange(n)[None], cache)[:, -1:]  # [1, 1, H]
    for i, token in enumerate(path):
        feature = head(torch.tensor([[token]]), feature, torch.tensor([[n + i]]), cache)
    return feature[0, 0]


@pytest.mark.parametrize("shape", TREE_SHAPES, ids=lambda s: s.name)
def test_tree_nodes_are_the_heads_top_tokens_on_their_paths(target, trained, shape):
    """Every inner node's children are drafted from the feature the head predicts after that node's path
    (the oracle drafts the path as a chain) and are its top tokens; siblings differ, the leftmost path is
    the chain drafter's own proposal, the same context gives the same tree, and the head's cache is back at
    the committed slots after each round."""
    head = EagleHead.load(trained, target)
    read: list[torch.Tensor] = []  # the features the tree drafter drafts children from, in order (rows)
    logits = head.logits
    head.logits = lambda features: (read.extend(features.reshape(-1, features.shape[-1])), logits(features))[
        1
    ]  # type: ignore
    g = torch.Generator().manual_seed(3)
    for length in (2, 7, 19):
        context = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        chain = drafter_with_context(target, head, context, GREEDY)
        tree_drafter = EagleTreeDrafter(drafter_with_context(target, head, context, GREEDY), shape)
        read.clear()
        tree = tree_drafter.propose_tree(context, shape, g)
        assert tree_drafter.drafter.cache.length == length - 1
        again = tree_drafter.propose_tree(context, shape, g)
        assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)
        assert tree.num_nodes == shape.num_nodes and tree.q is None and int(tree.tokens[0]) == context[-1]
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        kids: dict[int, list[int]] = {}
        for node in range(1, len(tokens)):
            kids.setdefault(parents[node], []).append(node)
        assert len(read) == 2 * len(kids)  # one read per inner node (ascending: breadth-first), twice
        for node, feature in zip(sorted(kids), read, strict=False):
            path, walk = [], node
            while walk > 0:
                path.insert(0, tokens[walk])
                walk = parents[walk]
            expected = path_feature(head, chain, context, path)
            torch.testing.assert_close(feature, expected, atol=1e-5, rtol=1e-5)
            top = head.draft_vocab[logits(expected).topk(len(kids[node])).indices].tolist()
            assert [tokens[c] for c in kids[node]] == top, (length, node)
        leftmost, node = [], 0
        while node in kids:
            node = kids[node][0]
            leftmost.append(tokens[node])
        assert leftmost == chain.propose(context, shape.max_depth, g).tokens.tolist()


@pytest.mark.parametrize("shape", TREE_SHAPES[:2], ids=lambda s: s.name)
def test_tree_greedy_equals_plain_greedy(target, trained, shape, tmp_path):
    """Trained and random heads drafting trees: token for token the target's greedy output; some nodes are
    accepted, some rejected."""
    random_path = fresh_head(target, torch.arange(0, VOCAB, 2), seed=9).save(tmp_path / "random.safetensors")
    tokenizer = LetterTokenizer(VOCAB)
    plain = Speculator((target, tokenizer), drafter="none")
    accepted = nodes = 0
    for path in (trained, random_path):
        tree = Speculator((target, tokenizer), drafter="eagle", drafter_path=str(path), tree=shape)
        sampled = tree._drafter(SamplingParams(temperature=1.0))  # sampled children above temperature 0
        assert isinstance(sampled, EagleTreeDrafter) and sampled.sampled and not tree._drafter(GREEDY).sampled
        for prompt in ("abc", "hello", "qqqzzz", "x"):
            reference = plain.generate(prompt, k=0, max_new_tokens=50, sampling=GREEDY).token_ids
            stats = GenerationStats("eagle", "tree")
            out = tree.stream(prompt, max_new_tokens=50, sampling=GREEDY, stats=stats)
            assert [t for chunk in out for t in chunk.token_ids] == reference, (path.name, prompt)
            accepted, nodes = accepted + stats.accepted, nodes + stats.tree_nodes
    assert 0 < accepted < nodes


@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(seed=4, invariant=False)], ids=["greedy", "sampled"]
)
def test_tree_rounds_hand_over_the_committed_path(target, trained, sampling):
    """After a generation with tree rounds, the head holds the target's hidden states f_0..f_{n-1} of the
    final sequence: the accepted path's, in order, none of a rejected node."""
    drafter = EagleTreeDrafter(EagleDrafter(EagleHead.load(trained, target), sampling), TreeShape.full(2, 2))
    engine = OneSequence(target, drafter, ConstantK(0))
    prompt = [5, 17, 40, 2]
    stats = GenerationStats("eagle", "tree")
    new = [t for chunk in engine.stream(prompt, EngineConfig(30, sampling), stats) for t in chunk]
    assert 0 < stats.accepted < stats.tree_nodes
    held = drafter.drafter._features[: drafter.drafter._num_features]  # [n, H]
    torch.testing.assert_close(held, hidden_states(target, prompt + new[:-1]), atol=1e-5, rtol=1e-5)


def tree_first_token_chi_square(
    target: Llama, trained: Path, shape: TreeShape, sampled: bool = False
) -> float:
    """:func:`chi_square_of_first_tokens` after "hello", drafted by eagle trees of ``shape``: the head's top-k
    children verified as single guesses, or (``sampled``) sampled children verified with their q."""
    head = EagleHead.load(trained, target)
    prompt_ids = LetterTokenizer(VOCAB).encode("hello")

    def request(sampling: SamplingParams) -> Request:
        drafter = EagleTreeDrafter(EagleDrafter(head, sampling), shape, sampled=sampled)
        stats = GenerationStats("eagle", f"tree {shape.name}")
        return Request(prompt_ids, EngineConfig(2, sampling), drafter, ConstantK(0), stats)

    return chi_square_of_first_tokens(request, target, prompt_ids, {})


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["top-k", "sampled"])
def test_tree_first_sampled_token_follows_the_target(target, trained, sampled):
    """Chi-square of the first sampled token with eagle trees: top-k children verified as single guesses,
    and sampled children verified with their q."""
    assert tree_first_token_chi_square(target, trained, TreeShape.full(2, 2), sampled) > ALPHA


# ---------------------------------------------------------------------------------------------- dynamic trees


def path_probability(head: EagleHead, chain: EagleDrafter, context: list[int], path: list[int]) -> float:
    """The oracle: the product of the head's probabilities (softmax) of the path's tokens, each read from the
    feature the head predicts after the tokens before it, drafted as a chain on a fresh cache."""
    probability = 1.0
    for i, token in enumerate(path):
        probs = head.logits(path_feature(head, chain, context, path[:i])).softmax(-1)  # [Vd]
        probability *= float(probs[int((head.draft_vocab == token).nonzero())])
    return probability


def node_paths(tree) -> list[tuple[int, ...]]:
    """Each node's path of tokens below the root: [N] tuples."""
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, tree.num_nodes):
        paths.append((*paths[int(tree.parents[node])], int(tree.tokens[node])))
    return paths


@pytest.mark.parametrize("budget", [1, 3, 5])
def test_dynamic_tree_verifies_the_likeliest_paths(target, trained, budget):
    """A 2x2 shape of budget N: both depth-1 nodes are expanded (the beam is the shape's width), so the tree
    verifies, of the static tree's six draft nodes, the N whose path probability (the oracle drafts each
    path as a chain) is highest; single guesses, every ancestor kept, the head's cache back at the committed
    slots."""
    head = EagleHead.load(trained, target)
    shape, g = TreeShape.full(2, 2), torch.Generator().manual_seed(5)
    dynamic = shape.with_budget(budget)
    for length in (2, 7, 19):
        context = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        chain = drafter_with_context(target, head, context, GREEDY)
        static = EagleTreeDrafter(drafter_with_context(target, head, context, GREEDY), shape)
        candidates = node_paths(static.propose_tree(context, shape, g))[1:]
        probability = {path: path_probability(head, chain, context, list(path)) for path in candidates}
        drafter = EagleTreeDrafter(drafter_with_context(target, head, context, GREEDY), dynamic)
        tree = drafter.propose_tree(context, dynamic, g)
        assert tree.num_nodes == budget + 1 and tree.q is None and drafter.drafter.cache.length == length - 1
        chosen = node_paths(tree)[1:]
        assert all(path[:-1] in {(), *chosen} for path in chosen)  # every ancestor is in the tree
        best = sorted(candidates, key=probability.get, reverse=True)[:budget]
        assert sorted(chosen) == sorted(best), (length, probability)


def test_dynamic_tree_expands_only_the_likeliest_nodes_of_each_depth(target, trained):
    """A 3x3 shape whose budget covers every candidate: each depth expands the 3 likeliest nodes of the depth
    before (3 + 9 + 9 draft nodes, not the shape's 39), and the expanded depth-2 nodes are the 3 of highest
    path probability."""
    head = EagleHead.load(trained, target)
    shape = TreeShape.full(3, 3).with_budget(39)
    context = [3, 9, 27, 17, 51, 26]
    chain = drafter_with_context(target, head, context, GREEDY)
    tree = EagleTreeDrafter(drafter_with_context(target, head, context, GREEDY), shape).propose_tree(
        context, shape, torch.Generator()
    )
    paths = node_paths(tree)
    assert [int((tree.depth == d).sum()) for d in (1, 2, 3)] == [3, 9, 9]
    second = [p for p in paths if len(p) == 2]
    expanded = {p[:2] for p in paths if len(p) == 3}
    probability = {p: path_probability(head, chain, context, list(p)) for p in second}
    assert expanded == set(sorted(second, key=probability.get, reverse=True)[:3])


def test_auto_budget_sizes_trees_by_the_costs(target, trained):
    """Budget auto: a verification that costs more than any tree can pay for gives the root alone (a plain
    step); free verification and drafting give every drafted node; a head forward dearer than what a depth
    could bring stops the expansion at depth 1; in between, the size best_tree_size picks from the drafted
    nodes' path probabilities."""
    head = EagleHead.load(trained, target)
    shape = TreeShape.full(2, 3).with_budget("auto")
    context = [3, 9, 27, 17, 51, 26]

    def tree(cost: CostModel):
        drafter = EagleTreeDrafter(drafter_with_context(target, head, context, GREEDY), shape, cost=cost)
        return drafter.propose_tree(context, shape, torch.Generator())

    assert tree(CostModel(0.0, [1.0] + [50.0] * 15)).num_nodes == 1
    everything = tree(CostModel(0.0, None))
    assert everything.num_nodes == 1 + 2 + 4 + 4  # the beam of 2 expands two nodes at depths 1 and 2
    shallow = tree(CostModel(10.0, None))  # a head forward costs more than any children could bring
    assert shallow.num_nodes == 1 + 2 and shallow.max_depth == 1
    chain = drafter_with_context(target, head, context, GREEDY)
    scores = sorted(
        (path_probability(head, chain, context, list(p)) for p in node_paths(everything)[1:]), reverse=True
    )
    middle = CostModel(0.05, [1.0, 1.3, 1.4, 1.5, 1.6, 1.9, 2.2, 2.6, 3.0, 3.5, 4.0, 4.5])
    assert tree(middle).num_nodes == 1 + best_tree_size(scores, middle, 3)
    with pytest.raises(ValueError, match="calibrated costs"):
        EagleTreeDrafter(drafter_with_context(target, head, context, GREEDY), shape)


@pytest.mark.parametrize("spec", ["2x3:2", "3x3:5", "2x3:auto"])
def test_dynamic_tree_greedy_equals_plain_greedy(target, trained, spec, tmp_path):
    """Trained and random heads drafting dynamic trees (auto: sized by a cost model): token for token the
    target's greedy output; some nodes accepted, some rejected."""
    random_head = fresh_head(target, torch.arange(0, VOCAB, 2), seed=9)
    cost = CostModel(0.05, [1.0, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.6])
    plain = Speculator((target, LetterTokenizer(VOCAB)), drafter="none")
    accepted = nodes = 0
    for head in (EagleHead.load(trained, target), random_head):
        for prompt in ("abc", "hello", "qqqzzz", "x"):
            ids = plain.encode_prompt(prompt)
            reference = plain.generate(prompt, k=0, max_new_tokens=50, sampling=GREEDY).token_ids
            shape = TreeShape.parse(spec)
            drafter = EagleTreeDrafter(EagleDrafter(head, GREEDY), shape, cost=cost)
            stats = GenerationStats("eagle", spec)
            engine = OneSequence(target, drafter, ConstantK(0))
            out = [t for chunk in engine.stream(ids, EngineConfig(50, GREEDY), stats) for t in chunk]
            assert out == reference, (spec, prompt)
            accepted, nodes = accepted + stats.accepted, nodes + stats.tree_nodes
    assert 0 < accepted < nodes


@pytest.mark.slow
def test_dynamic_tree_first_sampled_token_follows_the_target(target, trained):
    """Chi-square of the first sampled token with a dynamic tree: its top-k children, chosen by the head's
    probabilities, are verified as single guesses."""
    assert tree_first_token_chi_square(target, trained, TreeShape.full(3, 2).with_budget(3)) > ALPHA


FLAT = CostModel(0.3, (1.0,) * 16)  # every forward costs one step: a tree's further nodes are free
STEEP = CostModel(0.05, tuple(1 + 0.5 * k for k in range(16)))  # each token half a step more
# a CPU whose extra tokens cost ~0.17 of a step each, a head's proposal 0.096 + 0.093 a token (measured here)
RISKY = CostModel(
    0.093, (1.0, 1.37, 1.53, 1.70, 1.89, *(1.89 + 0.2 * k for k in range(1, 12))), fixed_cost=0.096
)


@pytest.mark.parametrize(
    "cost, drafting, tree",
    [(FLAT, 0.6, DEFAULT_TREE), (FLAT, 1.0, None), (STEEP, 0.1, None), (RISKY, 0.28, None)],
    ids=["flat", "flat-dear-tree", "steep", "risky"],
)
def test_tree_auto_is_the_learned_drafters_default_tree_where_it_may_pay(
    target, trained, monkeypatch, cost, drafting, tree
):
    """tree="auto" drafts eagle's default tree where this machine's costs say it may beat a chain and cannot
    lose to plain decoding (held-out agreement 0.5 at each position: the tree's 2.25 tokens at most and 1.75
    at least for 1.6 steps, against the chain's best 1.15); chain rounds where the tree's own drafting, as
    calibrated, is dear (1.0 step: 1.75 tokens at least for 2.0 steps), where even perfect sibling guesses
    could not pay for its larger forward (2.25 tokens for 3.1 steps against the chain's 1.5 for 1.55), and
    where they could beat a chain that does not pay (2.25 for 2.17 steps: 1.04 against K = 0's 1.0) but its
    first-ranked path alone would lose (1.75 tokens for 2.17 steps)."""
    monkeypatch.setattr(
        type(EagleHead.load(trained, target)), "heldout_accuracy", property(lambda h: [0.5] * 4)
    )

    def calibrate(model, drafter, **kwargs):  # a tree round's drafting costs `drafting` steps
        tree_round = CostModel(0.0, cost.verify_cost, fixed_cost=drafting)
        return SimpleNamespace(cost_model=tree_round if isinstance(drafter, TreeRound) else cost)

    monkeypatch.setattr(resolve_module, "calibrate", calibrate)
    tokenizer = LetterTokenizer(VOCAB)
    eagle = Speculator((target, tokenizer), drafter="eagle", drafter_path=str(trained), tree="auto")
    assert eagle.tree is tree
    assert eagle.k_label("auto") == ("tree c4" if tree else "auto")


def test_tree_auto_is_no_tree_beside_other_drafters(target):
    tokenizer = LetterTokenizer(VOCAB)
    assert Speculator((target, tokenizer), drafter="ngram", tree="auto").tree is None
    one_line_error(
        lambda: Speculator((target, tokenizer), drafter="ngram", tree="3x3"), "must be a TreeShape"
    )


def test_dynamic_trees_need_the_eagle_drafter_and_single_guesses(target, trained):
    tokenizer = LetterTokenizer(VOCAB)
    dynamic = TreeShape.parse("2x2:3")
    for drafter in ("ngram", "model"):
        draft = (target, tokenizer) if drafter == "model" else None
        one_line_error(
            lambda d=drafter, m=draft: Speculator((target, tokenizer), m, drafter=d, tree=dynamic),
            rf"dynamic trees \(2x2:3\) need the eagle drafter, not '{drafter}'",
        )
    one_line_error(lambda: NGramTreeDrafter(dynamic), "need the eagle drafter")
    head = EagleHead.load(trained, target)
    one_line_error(
        lambda: EagleTreeDrafter(EagleDrafter(head, SamplingParams()), dynamic, sampled=True),
        "cannot sample them",
    )
    eagle = Speculator((target, tokenizer), drafter="eagle", drafter_path=str(trained), tree=dynamic)
    assert not eagle._drafter(SamplingParams()).sampled  # top-k above temperature 0 too


# ---------------------------------------------------------------------------------------------- layers


def test_a_grown_head_computes_what_it_grew_from(target, trained, tmp_path):
    """adopt: a 3-layer head holding a 1-layer head's weights predicts the same features (its new layers
    start as no-ops) and drafts the same tokens; its file keeps its layer count; a head cannot shrink."""
    small = EagleHead.load(trained, target)
    big = EagleHead.create(target, small.draft_vocab, torch.Generator().manual_seed(1), small.metadata, 3)
    tokens, features = torch.randint(0, VOCAB, (2, 9)), torch.randn(2, 9, 32)
    positions = torch.arange(9).expand(2, 9)
    before = big(tokens, features, positions, big.new_cache(2, 16))
    big.adopt(small)
    after = big(tokens, features, positions, big.new_cache(2, 16))
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, small(tokens, features, positions, small.new_cache(2, 16)))
    loaded = EagleHead.load(big.save(tmp_path / "big.safetensors"), target)
    assert loaded.num_layers == 3 and loaded.new_cache().keys.shape[0] == 3
    context = [5, 17, 40, 2, 9]
    assert torch.equal(
        drafter_with_context(target, loaded, context, GREEDY).propose(context, 4, torch.Generator()).tokens,
        drafter_with_context(target, small, context, GREEDY).propose(context, 4, torch.Generator()).tokens,
    )
    one_line_error(lambda: small.adopt(loaded), "cannot start a 1-layer head from a 3-layer one")
    # the calibration cache keeps the costs of heads of different sizes apart
    identities = [EagleDrafter(h, GREEDY).cost_identity() for h in (small, loaded)]
    assert identities[0] != identities[1]
    for bad in (0, 9, True):
        one_line_error(
            lambda b=bad: EagleHead(target, small.draft_vocab, small.metadata, b), "decoder layers"
        )


def test_a_drafter_file_with_a_bad_layer_count_is_refused(target, trained, tmp_path):
    tensors = load_file(str(trained))
    with safe_open(str(trained), framework="pt") as f:
        metadata = f.metadata()
    for bad in ("0", "two", "99"):
        path = tmp_path / f"layers-{bad}.safetensors"
        save_file(tensors, str(path), metadata={**metadata, "num_layers": bad})
        one_line_error(lambda p=path: EagleHead.load(p, target), "num_layers")


def test_training_grows_a_drafter_by_a_layer(target, dataset, trained, tmp_path):
    """layers = 2 from a 1-layer drafter: training runs through both layers (each layer's cache its own
    tensor, so backward finds what it saved), lowers the loss from the grown head's, and writes a 2-layer
    drafter; more layers in init than asked is refused."""
    small = EagleHead.load(trained, target)
    config = dataclasses.replace(
        TINY_TRAINING, steps=30, draft_vocab=small.draft_vocab_size, init=str(trained), layers=2, unroll=1
    )
    grown = EagleHead.create(target, small.draft_vocab, torch.Generator(), small.metadata, 2)
    grown.adopt(small)
    data = TrainingData.from_split(load_split(dataset, "train"), draft_index(small.draft_vocab, VOCAB))
    batch = sample_batch(data, 8, 32, torch.Generator().manual_seed(0))

    def loss(head: EagleHead) -> float:
        with torch.no_grad():
            return float(batch_loss(head, batch, config, 0.0, torch.Generator()))

    path = train_drafter(target, dataset, tmp_path / "grown", config, progress=False)
    trained_big = EagleHead.load(path, target)
    assert trained_big.num_layers == 2 and loss(trained_big) < loss(grown)
    assert loss(grown) == pytest.approx(loss(small), rel=1e-5)
    one_line_error(
        lambda: train_drafter(
            target, dataset, tmp_path / "shrink", dataclasses.replace(config, init=str(path), layers=1)
        ),
        "cannot start a 1-layer head from a 2-layer one",
    )
    for bad in (0, 9):
        with pytest.raises(ValueError, match="layers"):
            TrainConfig(layers=bad)


# ---------------------------------------------------------------------------------------------- stories260K


@pytest.fixture(scope="module")
def stories(shared_model, tmp_path_factory):
    """stories260K, a small data set of its own stories and a drafter trained on it for 60 steps."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model, tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")
    prompts = [tokenizer.encode(p) for p in STORY_PROMPTS * 2]
    data = make_dataset(model, tmp_path_factory.mktemp("stories-data"), prompts, answer=80, label="stories")
    config = dataclasses.replace(
        TINY_TRAINING,
        steps=60,
        batch_tokens=256,
        window=64,
        draft_vocab=256,
        eval_every=60,
        checkpoint_every=60,
    )
    out = tmp_path_factory.mktemp("stories-run")
    path = train_drafter(model, data, out, config, target_label="stories260K", progress=False)
    return model, tokenizer, path, root


def test_stories_greedy_equals_plain_greedy(stories):
    model, tokenizer, path, _ = stories
    plain = Speculator((model, tokenizer), drafter="none")
    eagle = Speculator((model, tokenizer), drafter="eagle", drafter_path=str(path))
    drafted = accepted = 0
    for prompt in STORY_PROMPTS:
        reference = plain.generate(prompt, k=0, max_new_tokens=80, sampling=GREEDY).token_ids
        for k in (2, 4):
            stats = GenerationStats("eagle", str(k))
            out = eagle.stream(prompt, k=k, max_new_tokens=80, sampling=GREEDY, stats=stats)
            assert [t for chunk in out for t in chunk.token_ids] == reference, (prompt, k)
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted


def test_stories_first_sampled_token_follows_the_target(stories):
    model, tokenizer, path, _ = stories
    eagle = Speculator((model, tokenizer), drafter="eagle", drafter_path=str(path))
    prompt = "Once upon a time, there was a"
    assert first_token_chi_square(eagle, model, tokenizer.encode(prompt), prompt, {}) > ALPHA


# ---------------------------------------------------------------------------------------------- command line


def test_bench_lists_eagle_when_a_drafter_applies(trained):
    with_file = plan_methods(BenchConfig(target="stories.bin", drafter_path=str(trained)))[0]
    assert Method("eagle", "4") in with_file and Method("eagle", "auto") in with_file
    methods, notes = plan_methods(BenchConfig(target="stories.bin"))
    assert not any(m.name == "eagle" for m in methods) and any(
        n.startswith("eagle: no learned") for n in notes
    )
    with pytest.raises(ValueError, match="learned drafter"):
        plan_methods(BenchConfig(target="stories.bin", methods=("eagle",)))
    assert "--drafter-path" in BenchConfig(drafter_path="d.safetensors").command_line()
    trees = BenchConfig(
        target="stories.bin", drafter_path=str(trained), trees=("2x2",), methods=("eagle-tree",)
    )
    assert plan_methods(trees)[0] == [
        Method("eagle-tree", "2x2"),
        Method("eagle", "6"),
    ]  # the tree, its chain
    methods, notes = plan_methods(dataclasses.replace(trees, drafter_path=None, methods=None))
    assert not any(m.name.startswith("eagle") for m in methods)
    assert any(n.startswith("eagle-tree: no learned") for n in notes)
    with pytest.raises(ValueError, match="'eagle-tree' needs a learned drafter"):
        plan_methods(dataclasses.replace(trees, drafter_path=None))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) in-process: (status, stdout, stderr)."""
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_usage_error(result: tuple[int, str, str], message: str) -> None:
    status, _, err = result
    assert status == 2 and err.count("\n") == 1 and message in err, err


def test_cli_calibrate_says_a_heads_catch_up_reads_its_last_positions(stories, tmp_path, monkeypatch, capsys):
    _, _, path, root = stories
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    status, out, _ = run_cli(
        capsys, "calibrate", *model, "--drafter", "eagle", "--drafter-path", str(path), "--repetitions", "2"
    )
    assert status == 0 and f"a position (the last {CATCH_UP_WINDOW} at most);" in out, out


def test_cli_train_drafter_bad_input(dataset, tmp_path, capsys):
    assert_usage_error(
        run_cli(capsys, "train-drafter", "--data", str(dataset), "--out", str(tmp_path), "--kind", "bogus"),
        "invalid choice: 'bogus'",
    )
    assert_usage_error(
        run_cli(capsys, "train-drafter", "--data", str(tmp_path / "absent"), "--out", str(tmp_path)),
        "no drafter data set",
    )
    assert_usage_error(
        run_cli(
            capsys, "train-drafter", "--data", str(dataset), "--out", str(tmp_path), "--init", "absent.st"
        ),
        "no such drafter file: absent.st",
    )


def test_cli_train_then_generate(stories, trained, tmp_path, capsys, monkeypatch):
    """train-drafter on stories260K's data set, then generate with it; a drafter for another target, a
    corrupt file and a file without the eagle drafter are one-line errors."""
    model, tokenizer, path, root = stories
    model_args = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    data = make_dataset(model, tmp_path / "data", [tokenizer.encode(p) for p in STORY_PROMPTS], answer=30)
    run = ["--data", str(data), "--out", str(tmp_path / "run"), "--steps", "3", "--draft-vocab", "100"]
    status, out, err = run_cli(
        capsys, "train-drafter", *model_args, *run, "--batch-tokens", "64", "--window", "32"
    )
    assert status == 0, err
    drafter = tmp_path / "run" / "drafter.safetensors"
    assert f"drafter written to {drafter}" in out
    assert EagleHead.load(drafter, model).draft_vocab_size == 100
    eagle = ["--drafter", "eagle", "--drafter-path", str(drafter), "--k", "3", "--temperature", "0"]
    status, out, err = run_cli(capsys, "generate", "Once upon a time", *model_args, *eagle, "--json")
    assert status == 0, err
    chain = json.loads(out)
    assert chain["stats"]["drafter"] == "eagle" and chain["stats"]["k"] == "3"
    # without --k the learned drafter drafts its default tree where the costs say it may pay (here, whatever
    # they say: the rule's own test is above); the same greedy tokens
    monkeypatch.setattr(resolve_module, "_tree_may_pay", lambda *args: True)
    default = [a for a in eagle if a not in ("--k", "3")]
    status, out, err = run_cli(capsys, "generate", "Once upon a time", *model_args, *default, "--json")
    assert status == 0, err
    tree = json.loads(out)
    assert tree["stats"]["k"] == "tree c4" and tree["token_ids"] == chain["token_ids"]
    status, out, err = run_cli(
        capsys, "generate", "Once upon a time", *model_args, "--drafter", "ngram", "--json"
    )
    assert status == 0 and json.loads(out)["stats"]["k"] == "auto", err  # no tree for the other drafters
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"not a safetensors file")
    for extra, message in (
        (["--drafter", "eagle", "--drafter-path", str(trained)], "trained for target"),
        (["--drafter", "eagle", "--drafter-path", str(corrupt)], "not a readable drafter file"),
        (["--drafter", "ngram", "--drafter-path", str(drafter)], "drafter file was given"),
        (["--drafter", "eagle"], "needs a drafter file"),
    ):
        assert_usage_error(run_cli(capsys, "generate", "Once", *model_args, *extra), message)


def test_a_heads_token_rows_are_the_targets_rows(target):
    """The draft vocabulary's rows kept in float32, the others looked up: every id gives the target's own
    embedding row, bit for bit, in any shape (a 0-d id too)."""
    head = fresh_head(target, torch.arange(0, target.vocab_size, 3))
    assert head.embed.kept.shape == (head.draft_vocab_size, target.config.hidden_size)
    ids = torch.tensor([[0, 1, 2, 3], [5, 6, 9, 10]])  # kept (multiples of 3) and not, mixed
    assert torch.equal(head.embed(ids), target.model.embed_tokens(ids).float())
    for one in (torch.tensor(3), torch.tensor(4)):
        assert torch.equal(head.embed(one), target.model.embed_tokens(one).float())


def test_a_heads_output_rows_are_the_targets_head_rows(tmp_path):
    """The draft vocabulary's output rows, read from those rows of the target's native head alone
    (`Llama.logits_of`), are the rows the whole head's logits give on unit vectors, bit for bit (a Gemma 3
    GGUF's tied head of 262,144 rows took 0.59 s that way, 0.05 s from its rows)."""
    from test_gguf import write_tiny_gguf
    from test_gguf_native import tiny_gemma3

    source = write_tiny_gguf(tmp_path / "g.gguf", tiny_gemma3(), "Q8_0", arch="gemma3")
    target = load_model(str(source), precision="auto")[0]
    assert target.on_native_kernels
    ids = torch.arange(1, target.vocab_size, 7)
    eye = torch.eye(target.config.hidden_size)  # [hidden, hidden]
    whole = target.logits(eye[None])[0][:, ids].T  # [Vd, hidden]: the whole head's columns
    assert torch.equal(target_head_rows(target, ids), whole)
    assert torch.equal(target_head_rows(target, ids, chunk=5), whole)


def test_a_gemma3_target_gets_a_head_of_plain_llama_layers(tmp_path, monkeypatch):
    """A Gemma 3 target (sliding-window layers, q/k norms, post norms, GELU) trains and drafts with an EAGLE
    head of plain Llama layers of its widths (its windows once made every such head fail to build), and
    greedy drafting with it — trained or not — is the target's greedy decoding token for token. Neither
    training nor drafting copies the target's whole embedding table (Gemma 3's is 671 MB in float32): the
    head looks up the rows it reads in the file."""
    from test_gguf import write_tiny_gguf
    from test_gguf_native import tiny_gemma3

    def whole_table(self):
        raise AssertionError("a head copied the target's whole embedding table")

    monkeypatch.setattr(GGUFEmbedding, "weight", property(whole_table))
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    source = write_tiny_gguf(tmp_path / "g.gguf", tiny_gemma3(), "Q8_0", arch="gemma3")
    target, tokenizer = load_model(str(source), precision="auto")[:2]
    assert target.config.layer_windows and target.on_native_kernels
    vocab = target.vocab_size
    head = fresh_head(target, torch.arange(0, vocab, 3))
    assert head.config.layer_windows == () and not head.config.native_only
    assert (head.config.hidden_size, head.config.head_dim) == (
        target.config.hidden_size,
        target.config.head_dim,
    )
    data = make_dataset(target, tmp_path / "data", random_prompts(8, vocab, 2), answer=24)
    config = dataclasses.replace(TINY_TRAINING, steps=6, eval_every=6, checkpoint_every=6, draft_vocab=64)
    trained = train_drafter(target, data, tmp_path / "run", config, progress=False)
    plain = Speculator((target, tokenizer), drafter="none")
    drafted = 0
    for path in (trained, head.save(tmp_path / "random.safetensors")):
        eagle = Speculator((target, tokenizer), drafter="eagle", drafter_path=str(path))
        for prompt in ("hello", "ab ab ab"):
            reference = plain.generate(prompt, k=0, max_new_tokens=24, sampling=GREEDY).token_ids
            stats = GenerationStats("eagle", "3")
            out = eagle.stream(prompt, k=3, max_new_tokens=24, sampling=GREEDY, stats=stats)
            assert [t for chunk in out for t in chunk.token_ids] == reference, (path.name, prompt)
            drafted += stats.drafted
    assert drafted > 0
