"""``verispec bench``: the task files, prompt files, method planning, the predicted speedup, the transformers
peers' weights, bad input, a seconds-long smoke run on stories260K and an interrupted run.

Speed is what the bench reports; nothing here asserts it."""

import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib import image

from verispec.bench import metrics as bench_metrics
from verispec.bench import suite as bench
from verispec.bench.goals import load_goals
from verispec.bench.metrics import predicted_speedup
from verispec.bench.peers import to_transformers
from verispec.bench.prompts import builtin_tasks, load_prompts
from verispec.bench.report import CHARTS, goals
from verispec.bench.suite import METHODS, TASKS, BenchConfig, Method, plan_methods, select_tasks
from verispec.cli import main
from verispec.costs.analytic import CostModel, expected_speedup
from verispec.errors import UsageError
from verispec.models.llama2c import load_llama2c

GOALS = Path(__file__).parents[1] / "docs" / "bench" / "goals.toml"
STORY_PROMPTS = [
    {"id": "lily", "prompt": "Once upon a time, there was a little girl named Lily.", "task": "stories"},
    {"id": "tom", "prompt": "Tom had a red ball. He", "task": "stories"},
    {"id": "park", "prompt": "Lily and Tom went to the park", "task": "more-stories"},
]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Its own calibration cache, and torch's thread count restored after the bench changes it."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def stories_args(shared_model, tmp_path) -> list[str]:
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    prompts = tmp_path / "stories.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in STORY_PROMPTS) + "\n")
    return [
        "bench",
        *("--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")),
        *("--prompts", str(prompts), "--threads", "1", "--max-new-tokens", "16"),
    ]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# ---------------------------------------------------------------------------------------------- prompts


def test_the_task_files():
    tasks = builtin_tasks()
    assert set(tasks) == set(TASKS) and len(TASKS) >= 6
    assert {"chat", "summarization", "rag", "math", "code_completion", "code_editing", "translation"} <= set(
        tasks
    )
    for name, prompts in tasks.items():
        requests = sum(len(p.follow_ups) + 1 for p in prompts)  # a sequence is several requests
        assert len(prompts) >= 4 and requests >= 6, name
        assert len({p.id for p in prompts}) == len(prompts)
        assert all(p.task == name and p.messages[-1][0] == "user" for p in prompts)
    assert all(len(p.messages) >= 3 for p in tasks["chat"])  # multi-turn
    passage = min(len(p.messages[0][1]) for p in tasks["summarization"] + tasks["rag"])
    assert passage > 500  # a passage to summarize or answer from


@pytest.mark.parametrize(
    "lines, message",
    [
        (["{not json"], "not valid JSON"),
        (['{"text": "hi"}'], "either"),
        (['{"prompt": "hi", "messages": []}'], "either"),
        (['{"messages": []}'], "non-empty list"),
        (['{"messages": [{"role": "robot", "content": "hi"}]}'], "role"),
        (['{"messages": [{"role": "user", "content": "  "}]}'], "content"),
        (['{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}'], "last"),
        (['{"prompt": "a", "id": "x"}', '{"prompt": "b", "id": "x"}'], "repeat"),
        (['{"prompt": "a", "task": "no spaces allowed"}'], "task"),
        (['{"prompt": "a", "schema": "{}"}'], "must be a JSON schema"),
        (['{"prompt": "a", "schema": {"type": "nope"}}'], "mine.jsonl:1: invalid JSON schema"),
        ([""], "no prompts"),
    ],
)
def test_bad_prompt_files(tmp_path, lines, message):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=message):
        load_prompts(path)


def test_prompt_files_add_tasks(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}], "task": "other"}\n')
    tasks = select_tasks(BenchConfig(tasks=("math",), prompts_file=str(path), prompts_per_task=2))
    assert list(tasks) == ["math", "mine", "other"] and len(tasks["math"]) == 2
    assert tasks["mine"][0].id == "mine-1" and tasks["mine"][0].for_model(chat=False) == "a"
    assert tasks["other"][0].for_model(chat=True) == [{"role": "user", "content": "b"}]


# ---------------------------------------------------------------------------------------------- planning


def test_plan_methods(monkeypatch):
    monkeypatch.setattr(bench, "llamacpp_missing", lambda: "llama.cpp is not installed")
    labels = [m.label for m in plan_methods(BenchConfig())[0]]
    assert labels == [
        "none",
        "ngram k=4",
        "ngram k=auto",
        "suffix k=4",
        "suffix k=auto",
        "eagle k=4",  # the drafter shipped for the default target
        "eagle k=auto",
        "ngram+eagle k=4",  # prompt lookup first, the shipped eagle head elsewhere
        "ngram+eagle k=auto",
        "medusa k=4",  # the Medusa heads, the trained exit and the lookahead tokens shipped for it
        "medusa k=auto",
        "exit k=4",
        "exit k=auto",
        "lookahead k=4",
        "lookahead k=auto",
        "none-json",  # constrained to each prompt's schema, on the tasks that bring one (json)
        "ngram-json k=4",
        "ngram-json k=auto",
        "suffix-json k=4",
        "suffix-json k=auto",
        "eagle-json k=4",
        "eagle-json k=auto",
        "none-unconstrained",  # tool_choice none on the tool task's conversations (agent_calls)
        "suffix-warm k=4",  # the suffix cache after the workload's first pass
        "suffix-warm k=auto",
        "transformers",
        "transformers-lookup k=4",
    ]
    notes = plan_methods(BenchConfig())[1]
    assert any("model" in n and "--draft" in n for n in notes)
    assert "llamacpp: llama.cpp is not installed" in notes
    assert "llamacpp-json: llama.cpp is not installed" in notes
    with_draft = plan_methods(BenchConfig(draft="layers:3", ks=("2", "auto")))[0]
    assert Method("model", "auto") in with_draft and Method("transformers-assisted", "2") in with_draft
    assert Method("transformers-assisted", "auto") not in with_draft  # transformers takes a number
    only_auto, notes = plan_methods(BenchConfig(ks=("auto",), methods=("none", "transformers-lookup")))
    assert only_auto == [Method("none")] and "numeric K" in notes[0]
    with pytest.raises(ValueError, match="needs a draft"):
        plan_methods(BenchConfig(methods=("model",)))
    assert set(METHODS) >= {"none", "ngram", "model", "transformers", "transformers-assisted"}


def test_llama_cpp_peers_are_planned_on_a_gguf_target(monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(bench, "llamacpp_missing", lambda: None)
    methods = ("none", "llamacpp", "llamacpp-lookup", "llamacpp-json")
    config = BenchConfig(target=str(gguf), ks=("3", "auto"), methods=methods)
    planned = [Method("none"), Method("llamacpp"), Method("llamacpp-lookup", "3"), Method("llamacpp-json")]
    assert plan_methods(config)[0] == planned
    assert bench.llamacpp_gguf(config) == gguf
    stories = BenchConfig(target="stories260K.bin", methods=("llamacpp",))
    with pytest.raises(ValueError, match="method 'llamacpp' cannot run: the target is not from a GGUF"):
        plan_methods(stories)
    monkeypatch.setattr(bench, "llamacpp_missing", lambda: "llama.cpp is not installed (`make peers` ...)")
    with pytest.raises(ValueError, match=r"method 'llamacpp' cannot run: llama.cpp is not installed"):
        plan_methods(config)


def test_command_line_reproduces_the_configuration():
    config = BenchConfig(tasks=("rag",), ks=("2", "auto"), temperatures=(0.0, 0.7), repetitions=5)
    assert config.command_line() == (
        "verispec bench --tasks rag --k 2,auto --max-new-tokens 64 --temperature 0,0.7 --repetitions 5"
    )


# ---------------------------------------------------------------------------------------------- metrics


def test_predicted_speedup_is_the_analytic_model():
    cost = CostModel(0.1, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    # 1000 rounds of K = 3 with α = 0.8 at every position: counts as GenerationStats keeps them
    rounds, alpha = 1000, 0.8
    accepted = [round(rounds * alpha ** (i + 1)) for i in range(3)]
    assert predicted_speedup(rounds, [rounds] * 3, accepted, cost) == pytest.approx(
        expected_speedup(alpha, 3, 0.1, cost.verify_cost), rel=1e-3
    )
    # half the rounds draft nothing (no n-gram match): they cost one step and yield one token
    mixed = predicted_speedup(2 * rounds, [rounds] * 3, accepted, cost)
    tokens = rounds * (1 + 0.8 + 0.64 + 0.512) + rounds
    assert mixed == pytest.approx(tokens / (rounds * cost.round_cost(3) + rounds), rel=1e-3)
    assert predicted_speedup(10, [], [], cost) == 1.0  # plain decoding
    assert predicted_speedup(10, [10] * 6, [0] * 6, cost) is None  # K = 6 is beyond the curve


def test_transformers_early_exit_is_verispecs():
    """The transformers assistant for ``layers:N`` computes what ``Llama.first_layers(N)`` computes."""
    from conftest import SHARED_MODELS

    path = SHARED_MODELS / "stories260K" / "stories260K.bin"
    if not path.is_file():
        pytest.skip(f"shared model absent: {path}")
    model = load_llama2c(path)
    ids = torch.tensor([[1, 403, 407, 261, 378, 30, 60]])  # [1, 7]
    for layers in (2, None):
        native = model.first_layers(layers) if layers else model
        expected = native.forward(ids, torch.arange(7)[None], native.new_cache())  # [1, 7, V]
        with torch.no_grad():
            logits = to_transformers(model, layers)(ids).logits  # [1, 7, V]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "poetry"], "unknown task 'poetry'"),
        (["--methods", "none,magic"], "unknown method 'magic'"),
        (["--methods", "model"], "needs a draft"),
        (["--k", "x"], "k must be"),
        (["--temperature", "-1"], "temperatures"),
        (["--repetitions", "0"], "repetitions"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_bad_input_is_one_line_and_status_2(capsys, args, message):
    status, _, err = run(capsys, "bench", *args)
    assert status == 2 and err.count("\n") == 1 and message in err


def test_bad_prompt_file_is_one_line_and_status_2(capsys, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": \n')
    status, _, err = run(capsys, "bench", "--prompts", str(path))
    assert status == 2 and err.count("\n") == 1 and "broken.jsonl:2: not valid JSON" in err


def test_incompatible_draft_and_overlong_prompts(capsys, tmp_path, stories_args):
    from test_hf_adapter import tiny_model  # a random llama with a 97-token vocabulary

    draft = tmp_path / "other-vocabulary"
    tiny_model("llama").save_pretrained(draft)
    status, _, err = run(capsys, *stories_args, "--draft", str(draft), "--out", str(tmp_path / "a"))
    assert status == 2 and err.strip().splitlines()[-1].startswith("verispec: error:") and "vocabulary" in err
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 600}) + "\n")
    status, _, err = run(capsys, *stories_args[:5], "--prompts", str(long), "--tasks", "long")
    assert status == 2 and "overflows the target's context" in err


# ---------------------------------------------------------------------------------------------- runs


def test_smoke_bench_on_stories260k(capsys, tmp_path, stories_args):
    out = tmp_path / "out"
    status, stdout, _ = run(
        capsys,
        *stories_args,
        "--tasks",
        "stories",
        "--draft",
        "layers:2",
        "--repetitions",
        "2",
        "--goals",
        str(GOALS),
        "--out",
        str(out),
    )
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and not results["interrupted"]
    assert results["config"]["tasks"] == ["stories", "more-stories"] and results["goals"] == load_goals(GOALS)
    labels = {c["label"] for c in results["cells"]}
    assert labels == {
        "none",
        "ngram k=4",
        "ngram k=auto",
        "suffix k=4",
        "suffix k=auto",
        "suffix-warm k=4",
        "suffix-warm k=auto",
        "model k=4",
        "model k=auto",
        "transformers",
        "transformers-assisted k=4",
        "transformers-lookup k=4",
    }
    for cell in results["cells"]:
        m = cell["metrics"]
        assert cell["complete"] and len(cell["samples"]) == 2
        assert m["tokens_per_second"]["median"] > 0 and m["speedup_vs_transformers"] > 0
        assert m["speedup_vs_none"] > 0 and m["tokens_per_target_call"] >= 1
        assert sum(m["time_split"].values()) == pytest.approx(1.0) and m["peak_rss_mib"] > 0
        assert cell["greedy_identity"]["compared"] > 0
        if not cell["method"].startswith("transformers"):  # verispec: exact, predicted, calibrated
            assert cell["greedy_identity"]["differ"] == [], cell["label"]
            # every sample scored its prompts whole (a cell after another on the same prompt included)
            assert [s["cached_prompt_tokens"] for s in cell["samples"]] == [0, 0], cell["label"]
            assert m["predicted_speedup"] > 0 and m["efficiency"] > 0
    ngram = next(c for c in results["cells"] if c["label"] == "ngram k=4")["metrics"]
    assert 0 < ngram["acceptance_rate"] <= 1 and ngram["acceptance_per_position"]
    assert set(results["calibration"]) == {"none", "ngram", "suffix", "suffix-warm", "model"}
    assert results["machine"]["threads"] == 1 and results["machine"]["cpu"]
    table = (out / "results.md").read_text()
    assert (
        "## stories — greedy" in table
        and "## more-stories — greedy" in table
        and stdout.strip() == table.strip()
    )
    for header in ("tok/s", "× transformers", "× none", "τ", "accept by position", "predicted", "efficiency"):
        assert header in table
    assert "## Summary — greedy" in table and "✓ " in table and " differ: " not in table
    assert "## Goals — greedy" in table and "| none ≥ 1.1× transformers | stories |" in table
    assert table.count("| transformers-assisted k=4 |") == 3  # a row in the summary and in each task
    for chart in CHARTS:
        path = out / f"{chart}.png"
        assert path.stat().st_size > 10_000
        pixels = image.imread(path)
        assert pixels.std() > 0.05  # not a blank canvas


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_an_interrupted_bench_keeps_its_finished_cells(
    capsys, tmp_path, stories_args, monkeypatch, signal_name
):
    samples = 0
    sample = bench.Bench._sample

    def interrupted_on_the_sixth(self, *args):
        nonlocal samples
        samples += 1
        if samples == 6:
            os.kill(os.getpid(), getattr(signal, signal_name))  # Ctrl-C, or a polite kill
        sample(self, *args)

    monkeypatch.setattr(bench.Bench, "_sample", interrupted_on_the_sixth)
    out = tmp_path / "out"
    # Python's own Ctrl-C handler, also where SIGINT was ignored at startup (a background job under `&`)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # two tasks × 2 methods × 2 repetitions: the first task's 4 samples finish, the second gets one
        status, _, err = run(
            capsys, *stories_args, "--tasks", "stories", "--methods", "none,ngram", "--k", "4",
            "--repetitions", "2", "--out", str(out),
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status == 130 and err.strip().endswith("verispec: interrupted")
    results = json.loads((out / "results.json").read_text())
    assert results["interrupted"] and not results["complete"]
    finished = {c["label"]: c for c in results["cells"] if c["task"] == "stories"}
    assert all(c["complete"] and len(c["samples"]) == 2 for c in finished.values())
    assert finished["ngram k=4"]["metrics"]["speedup_vs_none"] > 0
    later = [c for c in results["cells"] if c["task"] == "more-stories"]
    assert [len(c["samples"]) for c in later] == [1, 0] and not any(c["complete"] for c in later)
    table = (out / "results.md").read_text()
    assert "interrupted" in table and "## stories — greedy" in table and "†" in table
    assert (out / "tokens_per_second.png").is_file()


def test_ratio_of_medians_handles_missing_baselines():
    cell = {"samples": [], "label": "x"}
    assert bench_metrics.cell_metrics(cell, None, None, None, None) is None
    spread = {"median": 3.0, "min": 3.0, "max": 3.0, "n": 1}
    other = {"metrics": {"tokens_per_second": {"median": 2.0}, "decode_tokens_per_second": {"median": 1.0}}}
    assert np.isclose(bench_metrics._ratio(spread, other), 1.5) and np.isclose(
        bench_metrics._ratio(spread, other, decode=True), 3
    )
    assert (
        bench_metrics._ratio(spread, None) is None and bench_metrics._ratio(spread, {"metrics": None}) is None
    )


def _cell(task: str, method: str, k: str, tps: float, efficiency: float | None = None) -> dict:
    label = method if not k else f"{method} k={k}"
    metrics = {
        "tokens_per_second": {"median": tps},
        "decode_tokens_per_second": {"median": 1.5 * tps},  # the prefill takes a third of the time
        "efficiency": efficiency,
    }
    return {"task": task, "temperature": 0.0, "method": method, "k": k, "label": label, "samples": [1],
            "metrics": metrics}  # fmt: skip


def test_goals_are_judged_from_the_medians():
    cells = [
        _cell("summarization", "none", "", 40.0),
        _cell("summarization", "transformers", "", 20.0),
        _cell("summarization", "transformers-lookup", "4", 30.0),
        _cell("summarization", "ngram", "4", 52.0, 0.97),
        _cell("summarization", "ngram", "auto", 48.0, 0.90),
        _cell("chat", "none", "", 21.0),
        _cell("chat", "transformers", "", 20.0),
        _cell("chat", "model", "2", 30.0, 1.0),
        _cell("chat", "transformers-assisted", "2", 10.0),
        _cell("chat", "eagle", "4", 42.0, 0.96),
        _cell("summarization", "llamacpp", "", 30.0),
        _cell("summarization", "llamacpp-lookup", "2", 25.0),
        _cell("chat", "llamacpp", "", 30.0),
    ]
    cells[-3]["metrics"]["decode_tokens_per_second"] = {"median": 65.0}  # a fast decoder, slow prefill
    next(c for c in cells if c["method"] == "eagle")["metrics"]["tokens_per_target_call"] = 2.4
    results = {
        "config": {"tasks": ["summarization", "chat"], "temperatures": [0.0]},
        "cells": cells,
        "calibration": {"eagle": {"cost_ratio": 0.08}},
        "goals": load_goals(GOALS),  # the project's own goals file
    }
    judged = [line.split(" | ") for line in goals(results) if line.endswith(("✓ |", "missed |"))]
    rows = {f"{goal.lstrip('| ')} @ {task}": " | ".join(rest) for goal, task, *rest in judged}
    assert rows["none ≥ 1.1× transformers @ summarization"].endswith("2.000 | ✓ |")
    assert rows["none ≥ 1.1× transformers @ chat"].endswith("1.050 | ✗ missed |")
    assert rows["ngram ≥ 2.5× transformers (ngram k=4) @ summarization"].endswith("2.600 | ✓ |")
    assert rows["ngram ≥ 1.5× transformers lookup (transformers-lookup k=4) @ summarization"].endswith(
        "1.733 | ✓ |"
    )
    assert rows["ngram k=auto efficiency ≥ 0.95 @ summarization"].endswith("0.900 | ✗ missed |")
    assert rows["ngram k=auto ≥ 0.95× ngram k=4 (best fixed) @ summarization"].endswith("0.923 | ✗ missed |")
    assert rows["ngram k=auto ≥ 0.95× none @ summarization"].endswith("1.200 | ✓ |")
    assert rows["model k=2 ≥ 2× transformers-assisted @ chat"].endswith("3.000 | ✓ |")
    assert rows["eagle k=4 ≥ 1.8× none @ chat"].endswith("2.000 | ✓ |")
    assert rows["eagle k=4 τ ≥ 2.5 @ chat"].endswith("2.400 | ✗ missed |")
    assert rows["eagle: target step / draft step ≥ 10 @ calibration"].endswith("12.500 | ✓ |")
    assert rows["none per-token time ≤ 1.5× llama.cpp's @ summarization"].endswith("0.923 | ✓ |")  # 60 / 65
    assert rows["best speculative (ngram k=4) ≥ 1× llama.cpp @ summarization"].endswith("1.200 | ✓ |")
    assert rows["best speculative (ngram k=4) ≥ 1.5× llama.cpp on grounded tasks @ summarization"].endswith(
        "1.200 | ✗ missed |"
    )
    assert rows["best speculative (ngram k=4) ≥ 1.5× llama.cpp lookup (llamacpp-lookup k=2) @ summarization"
                ].endswith("2.080 | ✓ |")  # fmt: skip
    assert rows["best speculative (eagle k=4) ≥ 1× llama.cpp @ chat"].endswith("1.400 | ✓ |")
    assert "best speculative (eagle k=4) ≥ 1.5× llama.cpp on grounded tasks @ chat" not in rows
    assert not any("ngram" in key and "chat" in key for key in rows)  # chat is not a copy task
    assert (
        goals({"config": {"tasks": ["chat"], "temperatures": [0.0]}, "cells": [], "goals": load_goals(GOALS)})
        == []
    )
    assert goals({**results, "goals": []}) == []  # a run without --goals judges none


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[goal]]\nname = 'x'\ncells = 'none'\n", "missing field 'at_least'"),
        ("[[goal]]\nname = 'x'\ncells = 'none'\nat_least = 1\nspeed = 2\n", "unknown field 'speed'"),
        ("[[goal]]\nname = 'x'\ncells = 'none'\nat_least = '1'\n", "at_least must be a number"),
        ("[[goal]]\nname = 'x'\ncells = 'every one'\nat_least = 1\n", "cells = 'every one': expected"),
        ("[[goal]]\nname = 'x'\ncells = 'none'\nover = 'each ngram'\nat_least = 1\n", "over = 'each ngram'"),
        ("[[goal]]\nname = 'x'\ncells = 'none'\nk = '4'\nat_least = 1\n", "k filters 'each'"),
        ("[[goals]]\nname = 'x'\n", "unknown table 'goals'"),
        ("[[goal]\n", "not valid TOML"),
        ("# nothing\n", "declares no goals"),
    ],
)
def test_bad_goal_files_are_one_line_and_status_2(capsys, tmp_path, text, message):
    path = tmp_path / "goals.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=re.escape(message)):
        load_goals(path)
    status, _, err = run(capsys, "bench", "--goals", str(path))
    assert status == 2 and err.count("\n") == 1 and message in err
    status, _, err = run(capsys, "bench", "--goals", str(tmp_path / "absent.toml"))
    assert status == 2 and "cannot read the goals file" in err


def test_llama_cpp_peer_generates_from_a_gguf_file(tmp_path):
    """The peer itself, where llama-cpp-python is installed (`make peers`); CI's machines have none."""
    if bench.llamacpp_missing() is not None:
        pytest.skip(bench.llamacpp_missing())
    from test_gguf import tiny_llama, write_tiny_gguf
    from verispec.bench.peers import LlamaCppPeer, PeerRequest, PeerRun

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q8_0")
    peer = LlamaCppPeer(gguf, threads=1, context=64)

    def generate(method: str, eos: frozenset[int] = frozenset(), seed: int = 1) -> PeerRun:
        prompt = [0, 5, 77, 200, 13, 9, 77, 200]
        return peer.generate(PeerRequest(prompt, method, 2, 6, eos, temperature=0.0, seed=seed))

    runs = {method: generate(method) for method in ("llamacpp", "llamacpp-lookup")}
    for run in runs.values():
        assert len(run.token_ids) == 6 and 0 < run.prefill_seconds <= run.total_seconds
    plain = runs["llamacpp"].token_ids
    assert generate("llamacpp", seed=2).token_ids == plain  # greedy, from an empty context each time
    stop = plain[2]
    assert generate("llamacpp", eos=frozenset({stop})).token_ids == plain[: plain.index(stop) + 1]
    with pytest.raises(ValueError, match="unknown llama.cpp method 'llamacpp-draft'"):
        generate("llamacpp-draft")
    with pytest.raises(ValueError, match="llamacpp-json needs a JSON schema"):
        generate("llamacpp-json")
    # held to a schema by llama.cpp's grammar: random weights, valid JSON all the same
    from verispec.bench.schemas import valid_json

    # (llama-cpp-python's conversion to GBNF drops an integer's minimum and maximum: none here)
    properties = {"pet": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}}
    schema = json.dumps({"type": "object", "properties": properties, "required": ["pet", "ok"]})
    peer = LlamaCppPeer(gguf, threads=1, context=128)
    for seed in (1, 2):
        request = PeerRequest([0, 5, 77], "llamacpp-json", 0, 100, frozenset({1}), 1.0, seed, schema)
        ids = peer.generate(request).token_ids
        assert ids[-1] == 1 and valid_json(peer._model(0).detokenize(ids[:-1]).decode(), schema)


@pytest.mark.slow
def test_the_json_task_runs_constrained_and_every_constrained_output_validates(
    capsys, tmp_path, stories_args
):
    """The json task on stories260K, stub-free: the constrained methods' outputs parse and validate against
    their prompts' schemas (checked by jsonschema, not by the grammar engine), equal none-json's greedy
    output, count their forced tokens; the unconstrained ones are checked too (stories260K writes no JSON)."""
    out = tmp_path / "out"
    argv = [*stories_args[:5], "--threads", "1", "--max-new-tokens", "200", "--tasks", "json"]
    argv += ["--methods", "none,none-json,ngram-json", "--k", "4", "--prompts-per-task", "2"]
    status, _, _ = run(capsys, *argv, "--repetitions", "1", "--out", str(out))
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    cells = {c["label"]: c for c in results["cells"]}
    assert set(cells) == {"none", "none-json", "ngram-json k=4"}
    for label in ("none-json", "ngram-json k=4"):
        cell = cells[label]
        assert cell["schema_valid"] == {"checked": 2, "valid": 2, "invalid": []}, label
        assert cell["greedy_identity"] == {"compared": 2, "differ": []}, label
        assert 0 < cell["metrics"]["forced_share"] < 1 and cell["samples"][0]["forced"] > 0
    assert cells["none"]["schema_valid"]["checked"] == 2 and cells["none"]["metrics"]["forced_share"] is None
    table = (out / "results.md").read_text()
    assert "| valid |" in table and "✓ 2/2" in table and "| forced |" in table
    # the same task without a constrained method: nothing constrained to leave out; without the json task:
    # the constrained methods are left out, and why
    argv[argv.index("json")] = "math"
    status, _, _ = run(capsys, *argv, "--max-new-tokens", "4", "--out", str(tmp_path / "math"))
    results = json.loads((tmp_path / "math" / "results.json").read_text())
    assert status == 0 and {c["label"] for c in results["cells"]} == {"none"}
    assert "none-json: no task with schemas (json)" in results["notes"]


def test_outputs_are_checked_against_their_schema():
    from verispec.bench.schemas import valid_json

    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    assert valid_json('{"n": 3}', schema) and valid_json(' {"n":3}\n', schema)
    assert not valid_json('{"n": "3"}', schema) and not valid_json('{"n": 3', schema)
    assert not valid_json("{}", schema) and not valid_json('{"n": 3} and more', schema)
