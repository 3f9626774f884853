"""Training EAGLE-3 heads (issue 54 items 1 and 2): ``train-drafter --kind eagle3``
(:mod:`verispec.training.eagle3`) and the data sets of offline text (:mod:`verispec.training.text`), on tiny
random Llamas: the unrolled training steps against the head drafting one step at a time on its own cache,
the loss against the distilled cross-entropy written out here, the written head read back by
``Eagle3Head.load`` (the published layout) with identical logits, greedy speculation with it, an interrupted
run resumed, the text builder resumed and its bad input refused in one line."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from fakes import LetterTokenizer
from test_eagle import assert_usage_error, fresh_head, make_dataset, one_line_error, random_prompts, run_cli
from test_eagle3 import GREEDY, PROMPTS, VOCAB, reference_states, tiny_target
from test_hf_adapter import save_tokenizer
from verispec.api import Speculator
from verispec.drafting.learned.eagle3 import Eagle3Config, Eagle3Head, aux_layers
from verispec.drafting.learned.kinds import load_head
from verispec.models.registry import load_model
from verispec.training import text as text_module
from verispec.training.config import TrainConfig
from verispec.training.data import load_split
from verispec.training.eagle import Batch, unrolled_features
from verispec.training.eagle3 import STEP_DECAY, Eagle3Recipe, step_loss, target_windows
from verispec.training.recipe import TrainingData, draft_index
from verispec.training.text import TextConfig, TextSource, build_text_dataset
from verispec.training.train import train_drafter

TRAINING = TrainConfig(
    kind="eagle3",
    steps=40,
    batch_tokens=128,
    window=32,
    draft_vocab=48,
    lr=3e-3,
    warmup=4,
    unroll=2,
    eval_every=20,
    eval_tokens=128,
    checkpoint_every=20,
)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory) -> Path:
    return make_dataset(target, tmp_path_factory.mktemp("data"), random_prompts(16, VOCAB, 1), answer=30)


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory) -> Path:
    """A head trained for 40 steps on the tiny data set (a second or two)."""
    return train_drafter(tiny_target(), dataset, tmp_path_factory.mktemp("run"), TRAINING, progress=False)


def fresh(target, seed: int = 0, draft: int = 48) -> Eagle3Head:
    """A fresh head beside ``target`` with random norms too (so that no weight is trivially one)."""
    head = Eagle3Head.create(target, torch.arange(draft), torch.Generator().manual_seed(seed), {})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=g))
    return head


def windows_of(target, data: TrainingData, width: int):
    """Every sequence's first window, the target run over it."""
    seqs = torch.arange(data.starts.shape[0])
    return target_windows(target, data, seqs, torch.zeros_like(seqs), width)


def training_data(dataset: Path, split: str, vocab: torch.Tensor) -> TrainingData:
    return TrainingData.from_split(load_split(dataset, split, hidden=False), draft_index(vocab, VOCAB))


# ---------------------------------------------------------------------------------------------- the steps


def test_the_targets_states_are_its_layers_inputs(target, dataset):
    """A batch's windows hold, at slot t, the token x_{t+1}, the inputs of the layers read at t (computed
    here one layer at a time) and the target's final state at t + 1; slots past a sequence's end or before
    its answer do not count."""
    head = fresh(target)
    data = training_data(dataset, "train", head.draft_vocab)
    windows = windows_of(target, data, 16)
    h = target.config.hidden_size
    for row in range(3):
        a, n = int(data.starts[row]), int(data.lengths[row])
        ids = data.tokens[a : a + n].tolist()
        states = reference_states(target, ids, head.aux_layers)  # [n, 3H]
        width = min(16, n - 1)
        torch.testing.assert_close(windows.hidden[row, :width, h:], states[:width], atol=1e-4, rtol=1e-4)
        assert windows.tokens[row, :width].tolist() == ids[1 : width + 1]
        final = target.forward_hidden(torch.tensor([ids]), torch.arange(n)[None], target.new_cache(1, n))[0]
        torch.testing.assert_close(windows.target[row, :width], final[1 : width + 1, :h])
        prompt = int(data.prompt_lengths[row])
        assert windows.mask[row].tolist() == [prompt <= t + 2 < n + 1 and t < n - 1 for t in range(16)]


def test_unrolled_steps_equal_drafting_step_by_step(target, dataset):
    """Training step j at slot t equals the head drafting as the drafter does at run time: its own cache fed
    the fused states of the true context up to t − j (the taps recomputed here), then j steps each reading
    the token and the head's own output of the step before (that reference sees nothing later) — within float
    rounding, for every draft start."""
    head = fresh(target, seed=3)
    data = training_data(dataset, "train", head.draft_vocab)
    row, width, steps = 1, 14, 3
    windows = windows_of(target, data, width)
    a, n = int(data.starts[row]), int(data.lengths[row])
    ids = data.tokens[a : a + n].tolist()
    assert n > width + 1
    fused = head.fuse(reference_states(target, ids, head.aux_layers))[None]  # [1, n, H]
    features = head.fuse(windows.hidden[..., head.hidden_size :])
    batch = Batch(windows.tokens, features, windows.tokens, windows.mask, windows.positions)
    with torch.no_grad():
        outs = unrolled_features(head, batch, steps, 0.0, torch.Generator())
        for begin in range(1, width - steps + 1):  # the draft begins after the true slot begin − 1
            cache = head.new_cache(1, n)
            tokens = torch.tensor([ids[1 : begin + 1]])
            out = head(tokens, fused[:, :begin], torch.arange(begin)[None], cache)[:, -1:]  # [1, 1, H]
            torch.testing.assert_close(out[0, 0], outs[0][row, begin - 1], atol=1e-5, rtol=1e-5)
            for j in range(1, steps + 1):
                slot = begin - 1 + j
                out = head(torch.tensor([[ids[slot + 1]]]), out, torch.tensor([[slot]]), cache)
                torch.testing.assert_close(out[0, 0], outs[j][row, slot], atol=1e-5, rtol=1e-5)


def test_the_loss_is_the_distilled_cross_entropy(target, dataset):
    """The loss over the unrolled steps is Σ_j 0.8^j CE_j / Σ_j 0.8^j, CE_j the cross-entropy of step j's
    draft logits against the target's own softmax on the draft vocabulary (its full logits computed here),
    averaged over the answer slots t >= j; no feature term."""
    recipe = Eagle3Recipe.of(target, TRAINING, None)
    vocab = torch.arange(5, 53)
    head = recipe.new_head(target, TRAINING, vocab, {}, torch.Generator().manual_seed(0))
    data = training_data(dataset, "train", vocab)
    windows = windows_of(target, data, 12)
    features = head.fuse(windows.hidden[..., head.hidden_size :])
    batch = Batch(windows.tokens, features, windows.tokens, windows.mask, windows.positions)
    outs = unrolled_features(head, batch, 2, 0.0, torch.Generator())
    got = step_loss(head, recipe.target_logits(windows), windows, outs)
    terms = []
    for j, out in enumerate(outs):
        ces = []
        for row in range(windows.tokens.shape[0]):
            a, n = int(data.starts[row]), int(data.lengths[row])
            ids = torch.tensor([data.tokens[a : a + n].tolist()])
            logits = target.forward(ids, torch.arange(n)[None], target.new_cache(1, n))[0]  # [n, V]
            for t in range(12):
                if windows.mask[row, t] and t >= j:
                    p = logits[t + 1, vocab].softmax(-1)
                    ces.append(-(p * head.logits(out[row, t]).log_softmax(-1)).sum())
        terms.append(torch.stack(ces).mean())
    weights = [STEP_DECAY**j for j in range(3)]
    want = sum(w * ce for w, ce in zip(weights, terms, strict=True)) / sum(weights)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- the head


def test_the_written_head_is_the_published_layout_and_loads_back(target, trained):
    """The run writes model.safetensors (float16, the published tensors, d2t/t2d of the draft vocabulary:
    the most frequent answer tokens) and config.json; Eagle3Head.load reads it back with logits identical
    to the trained head's rounded to float16, bit for bit; the training record rides in the metadata."""
    directory = trained.parent
    assert trained.name == "model.safetensors" and (directory / "config.json").is_file()
    tensors = load_file(str(trained))
    assert {t.dtype for name, t in tensors.items() if name not in ("d2t", "t2d")} == {torch.float16}
    assert "embed_tokens.weight" not in tensors and tensors["fc.weight"].shape == (32, 96)
    config = json.loads((directory / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == list(aux_layers(8)) == [2, 4, 5]
    assert Eagle3Config.of(config, tiny_target(), trained).draft_vocab_size == 48
    ids = torch.arange(48) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], ids)
    with safe_open(str(trained), framework="pt") as f:
        record = json.loads(f.metadata()["verispec"])
    assert record["kind"] == "eagle3" and record["training"]["steps_done"] == 40
    assert len(record["training"]["heldout_top1_per_position"]) == 4
    state = torch.load(directory / "checkpoint.pt", weights_only=True)
    model = tiny_target()
    ours = Eagle3Head.create(model, ids, torch.Generator(), {})
    ours.load_state_dict({k: v.half().float() for k, v in state["head"].items()})
    loaded = Eagle3Head.load(directory, model)
    g = torch.Generator().manual_seed(1)
    tokens, states = torch.randint(0, VOCAB, (1, 9), generator=g), torch.randn(1, 9, 96, generator=g)
    with torch.no_grad():
        outs = [
            h.logits(h(tokens, h.fuse(states), torch.arange(9)[None], h.new_cache(1, 9)))
            for h in (ours, loaded)
        ]
    assert torch.equal(*outs)


@pytest.mark.parametrize("native", [False, True])
def test_greedy_speculation_with_the_trained_head(trained, native):
    """Speculative greedy with the trained head == plain greedy (chains and a tree), float and native."""
    tokenizer = LetterTokenizer(VOCAB)
    plain = Speculator((tiny_target(native), tokenizer), drafter="none")
    spec = Speculator((tiny_target(native), tokenizer), drafter="eagle3", drafter_path=str(trained.parent))
    for prompt in PROMPTS[:3]:
        want = plain.generate(prompt, k=0, max_new_tokens=24, sampling=GREEDY).token_ids
        for k in (1, 3):
            assert spec.generate(prompt, k=k, max_new_tokens=24, sampling=GREEDY).token_ids == want


def test_a_native_target_trains_a_head(dataset, tmp_path):
    """Beside a target on the native kernels (its forward computes no gradients; the head trains in float32
    torch on its states), a few steps give a head that loads beside it and drafts exactly."""
    config = dataclasses.replace(TRAINING, steps=3, eval_every=3, checkpoint_every=3, eval_tokens=32)
    path = train_drafter(tiny_target(native=True), dataset, tmp_path / "run", config, progress=False)
    tokenizer = LetterTokenizer(VOCAB)
    plain = Speculator((tiny_target(native=True), tokenizer), drafter="none")
    spec = Speculator((tiny_target(native=True), tokenizer), drafter="eagle3", drafter_path=str(path.parent))
    want = plain.generate(PROMPTS[0], k=0, max_new_tokens=16, sampling=GREEDY).token_ids
    assert spec.generate(PROMPTS[0], k=3, max_new_tokens=16, sampling=GREEDY).token_ids == want


def test_training_learns(trained, dataset):
    """40 steps raise the held-out agreement at the first draft position above a fresh head's."""
    log = [json.loads(line) for line in (trained.parent / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [20, 40] and log[-1]["loss"] < log[0]["loss"]
    model = tiny_target()
    state = torch.load(trained.parent / "checkpoint.pt", weights_only=True)
    recipe = Eagle3Recipe.of(model, TRAINING, None)
    head = recipe.new_head(model, TRAINING, state["draft_vocab"], {}, torch.Generator().manual_seed(0))
    data = training_data(dataset, "heldout", state["draft_vocab"])
    fresh_top1 = recipe.evaluate(head, data, TRAINING)[0]
    assert log[-1]["heldout_top1"][0] > fresh_top1[0]


def test_resume_equals_the_uninterrupted_run(dataset, tmp_path, monkeypatch):
    """Interrupted after the checkpoint of step 3 (in step 5), resumed: the same head file, optimizer state
    and logged evaluations as an uninterrupted run of 6 steps; other settings refused in one line."""
    config = dataclasses.replace(TRAINING, steps=6, eval_every=2, checkpoint_every=3, eval_tokens=64)
    whole = train_drafter(tiny_target(), dataset, tmp_path / "whole", config, progress=False)
    calls = []
    original = Eagle3Recipe.sample

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(Eagle3Recipe, "sample", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(tiny_target(), dataset, tmp_path / "cut", config, progress=False)
    monkeypatch.undo()
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["step"] == 3
    changed = dataclasses.replace(config, unroll=1)
    one_line_error(
        lambda: train_drafter(tiny_target(), dataset, tmp_path / "cut", changed, resume=True),
        re.escape("its settings differ (unroll 2 there, 1 now)"),
    )
    resumed = train_drafter(tiny_target(), dataset, tmp_path / "cut", config, resume=True, progress=False)
    a, b = load_file(str(whole)), load_file(str(resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs = [
        [json.loads(x) for x in (p.parent / "log.jsonl").read_text().splitlines()] for p in (whole, resumed)
    ]
    assert [(r["step"], r["loss"], r["heldout_top1"]) for r in logs[0]] == [
        (r["step"], r["loss"], r["heldout_top1"]) for r in logs[1]
    ]


def test_bad_settings_in_one_line(target, dataset, tmp_path):
    one_line_error(
        lambda: train_drafter(target, dataset, tmp_path / "a", dataclasses.replace(TRAINING, layers=2)),
        "one decoder layer",
    )
    noisy = dataclasses.replace(TRAINING, noise=0.1)
    one_line_error(
        lambda: train_drafter(target, dataset, tmp_path / "a", noisy), "eagle3 recipe has no noise"
    )
    one_line_error(lambda: aux_layers(2), "reads three of the target's layers: this target has 2")
    eagle = fresh_head(target, torch.arange(VOCAB)).save(tmp_path / "eagle.safetensors")
    with safe_open(str(eagle), framework="pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, str(tmp_path / "e3.safetensors"), metadata={**metadata, "kind": "eagle3"})
    one_line_error(lambda: load_head(tmp_path / "e3.safetensors", target), "read in the published layout")
    assert aux_layers(5) == (0, 2, 4) and aux_layers(30) == (2, 15, 27)
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------------------------------------- text


def save_hf_target(directory: Path, layers: int = 4, context: int = 256) -> Path:
    """A transformers-format random Llama of ``layers`` layers and a context of ``context`` over
    save_tokenizer's byte vocabulary (with its chat template)."""
    torch.manual_seed(0)
    config = HFLlamaConfig(
        vocab_size=260,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return save_tokenizer(directory, add_bos=True)


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory) -> Path:
    return save_hf_target(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    """Eight documents: three Markdown files and a module of five docstrings."""
    root = tmp_path_factory.mktemp("texts")
    for i in range(3):
        (root / f"page{i}.md").write_text(f"# Page {i}\n\n" + "Some words of text here. " * (10 + i))
    (root / "mod.py").write_text(
        '"""The module."""\n\nclass A:\n    """A class."""\n\n    def f(self):\n        """A method that does'
        ' a thing."""\n\n\ndef g():\n    """A function."""\n\n\nasync def h():\n    """A coroutine."""\n'
    )
    (root / "skipped.bin").write_bytes(b"\x00\x01")
    return root


def test_text_sources_read_their_documents(texts):
    source = TextSource.parse(f"{texts}:MIT")
    assert source.licence == "MIT" and [p.name for p in source.files()] == [
        "mod.py",
        "page0.md",
        "page1.md",
        "page2.md",
    ]
    documents = list(source.documents())
    assert documents[:5] == [
        "The module.",
        "A class.",
        "A function.",
        "A coroutine.",
        "A method that does a thing.",
    ]
    assert len(documents) == 8 and documents[5].startswith("# Page 0")
    stdlib = TextSource.parse("stdlib")
    assert stdlib.licence == "PSF-2.0" and stdlib.files()[0].suffix == ".py"


def test_text_data_set_resumes_and_records_its_sources(hf_target, texts, tmp_path, monkeypatch):
    """Windows of the documents' tokens (each ended by the end token), in shards written atomically: a run
    interrupted after its first shard, run again, writes only the others and ends with the same data set as
    an uninterrupted run; meta.json records each source and its licence; other settings are refused."""
    monkeypatch.setattr(text_module, "SHARD_DOCUMENTS", 3)
    config = TextConfig((f"{texts}:MIT",), window=32, heldout_fraction=0.25, progress=False)
    whole = build_text_dataset(str(hf_target), tmp_path / "whole", config)
    writes = []
    original = text_module._write_shard

    def counted(*args):
        writes.append(1)
        if len(writes) == 2:
            raise KeyboardInterrupt
        original(*args)

    monkeypatch.setattr(text_module, "_write_shard", counted)
    with pytest.raises(KeyboardInterrupt):
        build_text_dataset(str(hf_target), tmp_path / "cut", config)
    assert sorted(p.name for p in (tmp_path / "cut" / "shards").iterdir()) == [
        "00-00000.safetensors",
        "settings.json",
    ]
    monkeypatch.setattr(text_module, "_write_shard", lambda *args: (writes.append(1), original(*args)))
    writes.clear()
    resumed = build_text_dataset(str(hf_target), tmp_path / "cut", config)
    assert len(writes) == 2  # shards 1 and 2 of 0..2
    assert {k: v for k, v in resumed.items() if k != "seconds"} == {
        k: v for k, v in whole.items() if k != "seconds"
    }
    for split in ("train", "heldout"):
        a, b = (
            load_split(tmp_path / "whole", split, hidden=False),
            load_split(tmp_path / "cut", split, hidden=False),
        )
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert int(a["prompt_lengths"].sum()) == 0
    (source,) = whole["text"]["sources"]
    assert (source["licence"], source["documents"], source["shards"]) == ("MIT", 8, 3)
    _, tokenizer = load_model(str(hf_target))
    train = load_split(tmp_path / "whole", "train", hidden=False)
    documents = list(TextSource.parse(f"{texts}:MIT").documents())
    streams = [
        sum(len(tokenizer.encode(d, add_bos=False)) + 1 for d in documents[i : i + 3]) for i in range(0, 8, 3)
    ]
    kept = sum(n - (n % 32 if n % 32 < 2 else 0) for n in streams)  # a last window of one token dropped
    assert whole["num_tokens"] == source["tokens"] == kept
    assert int(train["offsets"].diff().max()) <= 32
    one_line_error(
        lambda: build_text_dataset(str(hf_target), tmp_path / "cut", dataclasses.replace(config, window=16)),
        "holds shards made with window 32, not 16",
    )
    one_line_error(lambda: load_split(tmp_path / "whole", "train"), "token ids alone")


def test_text_met_before_is_skipped_and_counted(hf_target, texts, tmp_path):
    """A document whose text an earlier source or the same one already gave is not tokenized again: packages
    copy docstrings from model to model, and a copy would be trained on twice or held out and trained on."""
    copies = tmp_path / "copies"
    copies.mkdir()
    (copies / "a.md").write_text((texts / "page1.md").read_text())  # a page of the first source
    (copies / "b.py").write_text('def f():\n    """New words."""\n\n\ndef g():\n    """New words."""\n')
    (copies / "c.md").write_text("Other new words.")
    config = TextConfig((f"{texts}:MIT", f"{copies}:MIT"), window=32, progress=False)
    meta = build_text_dataset(str(hf_target), tmp_path / "out", config)
    first, second = meta["text"]["sources"]
    assert (first["documents"], first["repeated"]) == (8, 0)
    assert (second["documents"], second["repeated"]) == (2, 2)  # page1 and the second "New words."
    _, tokenizer = load_model(str(hf_target))
    expected = sum(len(tokenizer.encode(d, add_bos=False)) + 1 for d in ("New words.", "Other new words."))
    assert second["tokens"] == expected


def test_eagle3_trains_on_text_and_answers_together(hf_target, texts, tmp_path):
    """One run over a text data set and the target's answers; another kind refuses the text set in one
    line."""
    config = TextConfig((f"{texts}:MIT",), window=24, heldout_fraction=0.25, progress=False)
    build_text_dataset(str(hf_target), tmp_path / "text", config)
    model, _ = load_model(str(hf_target))
    answers = make_dataset(
        model, tmp_path / "answers", random_prompts(8, 260, 2), answer=20, label=str(hf_target)
    )
    settings = dataclasses.replace(TRAINING, steps=4, eval_every=4, checkpoint_every=4, draft_vocab=64)
    path = train_drafter(model, [tmp_path / "text", answers], tmp_path / "run", settings, progress=False)
    with safe_open(str(path), framework="pt") as f:
        training = json.loads(f.metadata()["verispec"])["training"]
    assert [d.get("text") is not None for d in training["data"]] == [True, False]
    assert Eagle3Head.load(path.parent, load_model(str(hf_target))[0]).draft_vocab_size == 64
    eagle = dataclasses.replace(settings, kind="eagle")
    one_line_error(lambda: train_drafter(model, tmp_path / "text", tmp_path / "e", eagle), "token ids alone")


def test_a_gemma3_gguf_target_gets_text_data_and_an_eagle3_head(texts, tmp_path, monkeypatch):
    """A Gemma 3 GGUF file (which the transformers backend would load at fp32) gives a text data set
    recording its model's widths (the text path once loaded it as generate does not and refused it), an
    EAGLE-3 head trains on it, and greedy drafting with the head is the target's greedy decoding."""
    from test_gguf import write_tiny_gguf
    from test_gguf_native import tiny_gemma3

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    source = str(write_tiny_gguf(tmp_path / "g.gguf", tiny_gemma3(), "Q8_0", arch="gemma3"))
    target, tokenizer = load_model(source, precision="auto")
    config = TextConfig((f"{texts}:MIT",), window=24, heldout_fraction=0.25, progress=False)
    meta = build_text_dataset(source, tmp_path / "text", config)
    assert (meta["hidden_size"], meta["vocab_size"]) == (target.config.hidden_size, target.vocab_size)
    settings = dataclasses.replace(TRAINING, steps=4, eval_every=4, checkpoint_every=4, draft_vocab=64)
    path = train_drafter(target, tmp_path / "text", tmp_path / "run", settings, progress=False)
    plain = Speculator((target, tokenizer), drafter="none")
    eagle3 = Speculator((target, tokenizer), drafter="eagle3", drafter_path=str(path.parent))
    for prompt in ("hello", "ab ab ab"):
        reference = plain.generate(prompt, k=0, max_new_tokens=16, sampling=GREEDY).token_ids
        assert eagle3.generate(prompt, k=3, max_new_tokens=16, sampling=GREEDY).token_ids == reference


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--text", "docs"], "give stdlib or PATH:LICENCE"),
        (["--text", "MISSING:MIT"], "no such file or directory"),
        (["--text", "stdlib", "stdlib"], "given twice"),
        (["--text", "stdlib", "--window", "1"], "window must be"),
        (["--text", "stdlib", "--merge", "a", "b"], "not with --merge"),
    ],
)
def test_cli_text_bad_input(tmp_path, capsys, extra, message):
    argv = [str(tmp_path / "absent:MIT") if x == "MISSING:MIT" else x for x in extra]
    result = run_cli(capsys, "drafter-data", *argv, "--out", str(tmp_path / "x"))
    assert_usage_error(result, message)
    assert "Traceback" not in result[2] and not (tmp_path / "x").exists()


def test_cli_trains_eagle3(hf_target, texts, tmp_path, capsys):
    """``drafter-data --text`` then ``train-drafter --kind eagle3``: the head written where ``--drafter
    eagle3 --drafter-path`` finds it."""
    status, out, _ = run_cli(
        capsys,
        "drafter-data",
        "--target",
        str(hf_target),
        "--text",
        f"{texts}:MIT",
        "--window",
        "24",
        "--heldout",
        "0.25",
        "--out",
        str(tmp_path / "text"),
    )
    assert status == 0 and "0 answer tokens" not in out, out
    status, out, err = run_cli(
        capsys,
        "train-drafter",
        "--kind",
        "eagle3",
        "--target",
        str(hf_target),
        "--data",
        str(tmp_path / "text"),
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "2",
        "--batch-tokens",
        "48",
        "--window",
        "24",
        "--draft-vocab",
        "32",
        "--eval-every",
        "2",
        "--threads",
        "1",
    )
    assert status == 0 and out.strip() == f"drafter written to {tmp_path / 'run' / 'model.safetensors'}", err
    tokenizer = load_model(str(hf_target))[1]
    spec = Speculator(str(hf_target), drafter="eagle3", drafter_path=str(tmp_path / "run"))
    plain = Speculator(str(hf_target), drafter="none")
    want = plain.generate("hello", k=0, max_new_tokens=12, sampling=GREEDY).token_ids
    assert spec.generate("hello", k=2, max_new_tokens=12, sampling=GREEDY).token_ids == want
    assert tokenizer.vocab_size == 260
