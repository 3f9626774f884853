"""Calibration: what is measured, how it is keyed and cached, reuse, recovery from a corrupt cache, and
``--k auto`` built on it (stories260K: a calibration takes milliseconds)."""

import json
from pathlib import Path

import pytest
import torch

from verispec import calibrate as calibration_module
from verispec.api import Speculator
from verispec.calibrate import (
    K_MAX,
    Calibration,
    DraftCosts,
    TargetCosts,
    calibrate,
    calibration_dir,
    drafter_identity,
    model_identity,
)
from verispec.cli import main
from verispec.drafting.ngram import NGramDrafter
from verispec.models.registry import load_model
from verispec.policies import ConstantK, CostModelK
from verispec.sampling import SamplingParams


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Each test gets its own cache, and one torch thread (tiny tensors; steadier timings)."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


@pytest.fixture
def measured(monkeypatch):
    """Counts the target and drafter measurements: {"target": n, "draft": n}."""
    counts = {"target": 0, "draft": 0}
    for kind, name in (("target", "_measure_target"), ("draft", "_measure_drafter")):
        original = getattr(calibration_module, name)

        def counted(*args, _original=original, _kind=kind):
            counts[_kind] += 1
            return _original(*args)

        monkeypatch.setattr(calibration_module, name, counted)
    return counts


def test_measures_a_curve_and_a_cost_ratio(stories):
    model, tokenizer = stories
    calibration = calibrate(model, NGramDrafter(), target_label="stories", repetitions=3)
    v = calibration.target.verify_cost
    assert len(v) == K_MAX and v[0] == 1.0 and all(x > 0 for x in v)
    assert calibration.cost_ratio > 0 and calibration.draft.label == "ngram"
    cost = calibration.cost_model
    assert cost.max_k == K_MAX - 1 and cost.cost_ratio == calibration.cost_ratio
    assert calibration.path.parent == calibration_dir() and calibration.path.is_file()


def test_costs_at_a_context_interpolate_the_two_measured_contexts():
    short = (0.010, 0.012, 0.015)  # T(k) for k = 1..3 after 256 positions
    long = (0.014, 0.018, 0.025)  # after 1024
    costs = TargetCosts("t", short, 3, "now", context=256, long_seconds=long, long_context=1024)
    assert costs.seconds_at(256) == short and costs.seconds_at(1024) == pytest.approx(long)
    assert costs.seconds_at(640) == pytest.approx((0.012, 0.015, 0.020))  # halfway
    assert costs.seconds_at(1792) == pytest.approx((0.018, 0.024, 0.035))  # linear beyond the long one
    assert costs.seconds_at(0)[0] == pytest.approx(0.010 - 256 / 768 * 0.004)
    calibration = Calibration(costs, DraftCosts("d", 0.2, 0.002, 3, "now"), Path("x"))
    at = calibration.cost_model_at(1024)  # the draft's seconds as measured, over a dearer target step
    assert at.cost_ratio == pytest.approx(0.002 / 0.014) and at.verify(3) == pytest.approx(0.025 / 0.014)
    assert calibration.cost_model.cost_ratio == 0.2  # the short context's, as measured in pairs
    unmeasured = TargetCosts("t", short, 3, "now")  # a model whose context has no room for the long one
    assert unmeasured.seconds_at(4000) == short
    with pytest.raises(ValueError, match="long-context timings need as many values, at a longer context"):
        TargetCosts("t", short, 3, "now", context=256, long_seconds=long[:2], long_context=1024)


def test_cached_per_identity_and_reused(stories, measured):
    model, _ = stories
    first = calibrate(model, NGramDrafter(), repetitions=2)
    again = calibrate(model, NGramDrafter(), repetitions=2)
    assert measured == {"target": 1, "draft": 1} and again == first  # read back, not measured again
    early_exit = calibrate(model, _model_drafter(model, 2), repetitions=2)
    assert measured == {"target": 1, "draft": 2} and early_exit.path == first.path  # one file per target
    assert early_exit.cost_ratio != first.cost_ratio
    entry = json.loads(first.path.read_text())
    assert len(entry["drafts"]) == 2 and entry["identity"]["model"] == json.loads(
        json.dumps(model_identity(model))
    )
    torch.set_num_threads(2)  # the thread count is part of the machine's identity: another file
    other = calibrate(model, NGramDrafter(), repetitions=2)
    assert other.path != first.path and measured["target"] == 2
    assert drafter_identity(NGramDrafter(2)) != drafter_identity(NGramDrafter(3))


def test_force_measures_again_and_drops_other_drafters(stories, measured):
    model, _ = stories
    calibrate(model, NGramDrafter(), repetitions=2)
    calibrate(model, _model_drafter(model, 2), repetitions=2)
    calibrate(model, NGramDrafter(), repetitions=2, force=True)
    assert measured == {"target": 2, "draft": 3}
    path = next(calibration_dir().glob("*.json"))
    assert len(json.loads(path.read_text())["drafts"]) == 1  # the early exit is measured again when needed
    calibrate(model, _model_drafter(model, 2), repetitions=2)
    assert measured == {"target": 2, "draft": 4}


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: "{ not json",
        lambda text: text.replace('"seconds"', '"secs"'),
        lambda text: json.dumps({**json.loads(text), "version": 99}),
        lambda text: json.dumps(
            {**json.loads(text), "target": {**json.loads(text)["target"], "seconds": [1.0]}}
        ),
    ],
    ids=["not-json", "missing-field", "other-version", "too-short"],
)
def test_a_corrupt_cache_is_measured_again(stories, measured, capsys, damage):
    model, _ = stories
    path = calibrate(model, NGramDrafter(), repetitions=2).path
    path.write_text(damage(path.read_text()))
    capsys.readouterr()
    calibration = calibrate(model, NGramDrafter(), repetitions=2)
    assert measured["target"] == 2 and "unusable calibration file" in capsys.readouterr().err
    assert json.loads(path.read_text())["target"]["seconds"] == list(calibration.target.seconds)


def test_auto_is_the_default_and_builds_the_cost_model_policy(stories):
    model, tokenizer = stories
    greedy = SamplingParams(temperature=0)
    ngram = Speculator((model, tokenizer), drafter="ngram")
    assert isinstance(ngram.k_policy("auto"), CostModelK)
    assert isinstance(Speculator((model, tokenizer), drafter="none").k_policy("auto"), ConstantK)
    result = ngram.generate("Once upon a time", max_new_tokens=40, sampling=greedy)
    plain = Speculator((model, tokenizer), drafter="none").generate(
        "Once upon a time", k=0, max_new_tokens=40, sampling=greedy
    )
    assert result.stats["k"] == "auto" and result.token_ids == plain.token_ids
    assert calibration_dir().is_dir()


def test_cli_calibrate(shared_model, capsys):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model_args = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    assert (
        main(["calibrate", *model_args, "--repetitions", "2", "--threads", "1", "--draft", "layers:2"]) == 0
    )
    out, err = capsys.readouterr()
    assert "model drafter: c = " in out and "v(k)" in out and "best K" in out and "cached in" in err
    assert main(["calibrate", *model_args, "--repetitions", "2", "--threads", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["draft"]["label"] == "ngram" and len(data["verify_cost"]) == K_MAX
    assert main(["calibrate", *model_args, "--repetitions", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["calibrate", *model_args, "--drafter", "eagle"]) == 2  # no learned drafter for stories
    assert "needs a drafter file" in capsys.readouterr().err


def _model_drafter(model, layers: int):
    from verispec.drafting.draft_model import ModelDrafter

    return ModelDrafter(model.first_layers(layers), SamplingParams(temperature=0), model.vocab_size)
