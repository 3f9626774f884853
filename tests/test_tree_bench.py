"""``verispec bench`` with token trees: planning (each tree beside its chain at the same forward size), bad
input, the chain-vs-tree table, and a seconds-long run on stories260K. Nothing here asserts speed."""

from __future__ import annotations

import json

import pytest

from test_bench import isolated  # noqa: F401 (autouse: its own calibration cache, torch's threads restored)
from verispec.bench.report import tree_comparison
from verispec.bench.suite import TREE_METHODS, BenchConfig, Method, plan_methods
from verispec.cli import main
from verispec.drafting.learned.kinds import shipped_drafter


def test_each_tree_runs_beside_its_chain_at_the_same_forward_size(tmp_path):
    config = BenchConfig(methods=("none", "ngram", "ngram-tree"), ks=("4",), trees=("2x2", "3x1"))
    labels = [m.label for m in plan_methods(config)[0]]
    # 2x2: 7 nodes → ngram k=6; 3x1: 4 nodes → ngram k=3
    assert labels == ["none", "ngram k=4", "ngram-tree k=2x2", "ngram k=6", "ngram-tree k=3x1", "ngram k=3"]
    with_draft = plan_methods(BenchConfig(draft="layers:2", ks=("3",), trees=("3x1",)))[0]
    assert Method("model-tree", "3x1") in with_draft and with_draft.count(Method("model", "3")) == 1
    assert not any(m.name in TREE_METHODS for m in plan_methods(BenchConfig())[0])  # only with --trees
    _, notes = plan_methods(BenchConfig(trees=("2x2",)))
    assert any(n.startswith("model-tree: no --draft") for n in notes)
    shape = tmp_path / "shape.json"
    shape.write_text("[[0], [1], [0, 0]]")
    assert f"--trees 2x2,{shape}" in BenchConfig(trees=("2x2", str(shape))).command_line()
    assert Method("ngram", "3") in plan_methods(BenchConfig(trees=(str(shape),)))[0]  # 4 nodes


def test_dynamic_trees_run_beside_the_chain_of_their_budget():
    """A dynamic tree of budget N feeds at most N + 1 positions: its chain is K = N; budget auto runs beside
    K auto; the ngram and model trees cannot take a budget (a note says so)."""
    config = BenchConfig(
        methods=("ngram-tree", "eagle-tree"),
        drafter_path=str(shipped_drafter("smollm2-135m")),
        trees=("3x4:5", "2x3:auto", "2x2"),
    )
    methods, notes = plan_methods(config)
    assert [m.label for m in methods] == [
        "ngram-tree k=2x2",
        "ngram k=6",
        "eagle-tree k=3x4:5",
        "eagle k=5",
        "eagle-tree k=2x3:auto",
        "eagle k=auto",
        "eagle-tree k=2x2",
        "eagle k=6",
    ]
    assert "ngram-tree 3x4:5: dynamic trees need the eagle drafter" in notes


@pytest.mark.parametrize(
    "args,message",
    [
        (["--methods", "ngram-tree"], "needs tree shapes"),
        (["--trees", "0x2"], "width must be"),
        (["--trees", "missing.json"], "cannot read the tree shape file"),
        (["--methods", "model-tree", "--trees", "2x2"], "needs a draft"),
    ],
)
def test_bad_tree_input_is_one_line_and_status_2(capsys, args, message):
    status = main(["bench", *args])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and message in err


def test_tree_comparison_table_pairs_tree_and_chain():
    def cell(label, method, k, tps, tau, size, nodes=None):
        metrics = {"tokens_per_second": {"median": tps}, "tokens_per_target_call": tau, "forward_size": size}
        sample = {"tokens": 1}
        return dict(task="t", temperature=0.0, label=label, method=method, k=k, samples=[sample],
                    metrics=metrics, tree_nodes=nodes)  # fmt: skip

    results = {
        "config": {"tasks": ["t"], "temperatures": [0.0]},
        "cells": [
            cell("ngram-tree k=2x2", "ngram-tree", "2x2", 30.0, 2.5, 6.5, nodes=7),
            cell("ngram k=6", "ngram", "6", 20.0, 2.0, 7.0),
            cell("model-tree k=3x1", "model-tree", "3x1", 10.0, 1.5, 4.0, nodes=4),  # its chain did not run
            {**cell("eagle-tree k=2x3:auto", "eagle-tree", "2x3:auto", 12.0, 1.8, 3.1), "chain_k": "auto"},
            cell("eagle k=auto", "eagle", "auto", 10.0, 1.6, 2.5),
        ],
    }
    lines = tree_comparison(results)
    assert "## Chain vs tree at equal forward sizes — greedy" in lines
    assert (
        "| t | ngram-tree k=2x2 | ngram k=6 | 7 | 6.50 / 7.00 | 2.50 / 2.00 | 30.0 / 20.0 | 1.50× |" in lines
    )
    assert (
        "| t | eagle-tree k=2x3:auto | eagle k=auto | auto | 3.10 / 2.50 | 1.80 / 1.60 | 12.0 / 10.0 "
        "| 1.20× |" in lines
    )
    assert not any("model-tree" in line for line in lines)
    assert tree_comparison({**results, "cells": results["cells"][1:3]}) == []


def test_tree_bench_on_stories260k(capsys, tmp_path, shared_model):
    """The tree methods beside their chains: greedy-identical to none, with the comparison in results.md."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    prompts = tmp_path / "stories.jsonl"
    story = "Once upon a time, there was a little girl named Lily. She loved to play. Once upon a time,"
    prompts.write_text(json.dumps({"id": "lily", "prompt": story}))  # the n-gram tree finds matches
    out = tmp_path / "out"
    status = main(
        [
            "bench",
            *("--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")),
            *("--prompts", str(prompts), "--tasks", "stories", "--threads", "1", "--max-new-tokens", "24"),
            *("--methods", "none,ngram,model,ngram-tree,model-tree", "--draft", "layers:2", "--k", "2"),
            *("--trees", "2x2", "--repetitions", "1", "--out", str(out)),
        ]
    )
    assert status == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    labels = {c["label"] for c in results["cells"]}
    assert labels == {
        "none",
        "ngram k=2",
        "ngram-tree k=2x2",
        "ngram k=6",
        "model k=2",
        "model-tree k=2x2",
        "model k=6",
    }
    for cell in results["cells"]:
        assert cell["greedy_identity"]["differ"] == [], cell["label"]
        if cell["method"] in TREE_METHODS:
            assert cell["tree_nodes"] == 7 and 1 < cell["metrics"]["forward_size"] <= 7
            assert cell["metrics"]["predicted_speedup"] is None  # the analytic model is the chain's
    table = (out / "results.md").read_text()
    assert "## Chain vs tree at equal forward sizes — greedy" in table
    assert "| stories | model-tree k=2x2 | model k=6 | 7 |" in table
