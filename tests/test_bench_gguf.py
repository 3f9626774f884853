"""``verispec write-gguf`` and ``verispec bench-gguf`` from the command line: a random-weight file of a given
shape and type written atomically and readable in place; the bench's report of it (its numbers are
measured, not asserted; their presence and consistency are); bad arguments refused in one line before
anything runs."""

from __future__ import annotations

import json

import pytest

from verispec import cli
from verispec.kernels.cpu import native_available
from verispec.models.gguf_file import GGUFFile
from verispec.models.gguf_native import load_gguf

pytestmark = pytest.mark.skipif(
    native_available() is not None, reason=f"no native kernels: {native_available()}"
)

SHAPE = "hidden=256,layers=2,heads=4,kv_heads=2,ffn=512,vocab=300,context=512"


def test_write_gguf_writes_a_file_that_loads_in_place(tmp_path, capsys):
    out = tmp_path / "tiny.gguf"
    assert cli.main(["write-gguf", "--shape", SHAPE, "--type", "Q4_K", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    header = GGUFFile(out)
    assert str(header.fields["general.name"]).startswith("random-weight")
    types = {t.tensor_type.name for t in header.tensors if len(t.shape) == 2 and t.name.startswith("blk.")}
    assert types == {"Q4_K"}
    model = load_gguf(out)
    assert model.config.hidden_size == 256 and model.config.num_layers == 2 and model.cpu_precision == "q4_k"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]  # nothing else left beside it


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "hidden=64", "--type", "Q4_K"], "shape"),
        (["--shape", SHAPE, "--type", "Q3_K"], "Q3_K"),
        (["--shape", "llama3-9b", "--type", "Q4_K"], "llama3-9b"),
    ],
)
def test_write_gguf_refuses_bad_arguments_in_one_line(tmp_path, capsys, argv, message):
    out = tmp_path / "x.gguf"
    assert cli.main(["write-gguf", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not out.exists()


def test_bench_gguf_reports_a_random_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "report"
    argv = ["bench-gguf", "--random", f"{SHAPE}:Q8_0", "--no-llamacpp", "--context", "16", "--prefill", "8"]
    argv += ["--max-k", "3", "--repetitions", "1", "--threads", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    record = json.loads((out / "results.json").read_text())["files"][0]
    assert record["formats"] == "q8_0" and len(record["verify"]) == 3 and record["verify"][0] == 1.0
    assert record["llamacpp_decode_seconds"] is None and record["agreement"] is None  # random weights
    assert 0 < record["weight_bytes"] < record["file_bytes"] and record["decode_seconds"] > 0
    assert record["rss_added"] > 0 and record["load_seconds"] > 0
    assert [p["k"] is not None for p in record["predicted"]] == [True] * 3
    table = (out / "results.md").read_text()
    assert "Q8_0.gguf" in table and "v(3)" in table and "Against llama.cpp" not in table


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give GGUF files, or --random"),
        (["missing.gguf"], "no such GGUF file"),
        (["--random", "llama3-1b:Q3_K"], "TYPE one of"),
        (["--random", "llama3-1b:Q4_K", "--max-k", "0"], "--max-k must be an integer >= 1"),
    ],
)
def test_bench_gguf_refuses_bad_arguments_in_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    assert cli.main(["bench-gguf", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "cache").exists()  # refused before any file is written
