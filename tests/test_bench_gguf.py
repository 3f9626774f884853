"""``verispec write-gguf`` and ``verispec bench-gguf`` from the command line: a random-weight file of a given
shape and type written atomically and readable in place; a file requantized by llama.cpp's quantizer (where
`make peers` installed it; else a one-line error); the bench's report of it (its numbers are
measured, not asserted; their presence and consistency are); bad arguments refused in one line before
anything runs."""

from __future__ import annotations

import json
import sys

import gguf
import numpy as np
import pytest
import torch

from verispec import cli
from verispec.bench.peers import llamacpp_extra_buffers
from verispec.kernels.cpu import native_available
from verispec.models.gguf_file import GGUFFile
from verispec.models.gguf_native import load_gguf

pytestmark = pytest.mark.skipif(
    native_available() is not None, reason=f"no native kernels: {native_available()}"
)

SHAPE = "hidden=256,layers=2,heads=4,kv_heads=2,ffn=512,vocab=300,context=512"
IDS = [1, 70, 80, 90, 100, 110]


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


def test_llama_cpp_runs_its_repacked_kernels_but_on_a_cpu_with_amx():
    """llama.cpp's extra buffer types (its repacked Q4_0/Q4_K kernels) are on but where the CPU has AMX,
    whose tiles come with them and crashed its first evaluation on an Intel Xeon (2026-12-07)."""
    assert llamacpp_extra_buffers("flags\t\t: fpu sse avx2 avx512f avx512_vnni")  # AMD EPYC, AVX2-only
    assert not llamacpp_extra_buffers("flags\t\t: fpu avx2 avx512_vnni amx_bf16 amx_tile amx_int8")


def test_bench_gguf_times_llama_cpp_beside_the_kernels(tmp_path, own_cache):
    """Where `make peers` installed llama.cpp, bench-gguf times it on the same file, made as every bench
    makes it (before, bench-gguf made it with its AMX tiles on an Intel Xeon that has them: its first
    evaluation crashed the process, 2026-12-07)."""
    pytest.importorskip("llama_cpp", reason="llama.cpp is not installed (`make peers`)")
    out = tmp_path / "report"
    argv = ["bench-gguf", "--random", f"{SHAPE}:Q8_0", "--context", "16", "--prefill", "8"]
    argv += ["--max-k", "2", "--repetitions", "1", "--threads", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    record = json.loads((out / "results.json").read_text())["files"][0]
    assert record["llamacpp_decode_seconds"] > 0 and record["llamacpp_prefill_tps"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "hidden=64", "--type", "Q4_K"], "shape"),
        (["--shape", SHAPE, "--type", "Q3_K"], "Q3_K"),
        (["--shape", "llama3-9b", "--type", "Q4_K"], "llama3-9b"),
        (["--shape", f"{SHAPE},rope_base=nan", "--type", "Q8_0"], "'rope_base=nan' in"),
        (["--shape", f"{SHAPE},rope_factor=0", "--type", "Q8_0"], "rope_factor must be a finite number > 0"),
        (["--shape", f"{SHAPE},tied=7", "--type", "Q8_0"], "tied must be 0 or 1, got '7'"),
        # before anything is allocated: a vocabulary's tokens are listed; a file larger than the disk's room
        (["--shape", SHAPE.replace("vocab=", "vocab=999999999"), "--type", "Q8_0"], "vocab must be at most"),
        (["--shape", "hidden=65536,layers=2000,heads=2,kv_heads=1,ffn=256000,vocab=4000000",
          "--type", "Q8_0"], "GB does not fit in the"),
    ],
)  # fmt: skip
def test_write_gguf_refuses_bad_arguments_in_one_line(tmp_path, capsys, argv, message):
    out = tmp_path / "x.gguf"
    assert cli.main(["write-gguf", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not out.exists()


def logits(model, ids: list[int]):
    """Logits [len(ids), vocab] of one prefill of ``ids``."""
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache(1, 16))[0]


def test_write_gguf_from_a_file_requantizes_it_with_llama_cpp(tmp_path, capsys):
    """Each file type llama.cpp writes loads in place (every tensor on a native kernel) and scores as the
    source does within its rounding; nothing but the written files is left in the directory."""
    pytest.importorskip("llama_cpp", reason="llama.cpp's quantizer (`make peers`)")
    source = tmp_path / "f16.gguf"
    assert cli.main(["write-gguf", "--shape", SHAPE, "--type", "F16", "--out", str(source)]) == 0
    reference = logits(load_gguf(source), IDS)  # [6, 300]
    for file_type, error in [("Q8_0", 0.05), ("Q4_K_M", 0.35), ("Q6_K", 0.12)]:  # another model: 1.5
        out = tmp_path / f"{file_type}.gguf"
        argv = ["write-gguf", "--from", str(source), "--type", file_type, "--out", str(out)]
        assert cli.main(argv) == 0
        assert f"requantized to {file_type}: {out}" in capsys.readouterr().out
        header = GGUFFile(out)
        matrices = [t for t in header.tensors if len(t.shape) == 2 and t.name.startswith("blk.")]
        types = {t.tensor_type.name for t in matrices}
        assert types <= {"Q8_0", "Q4_K", "Q5_0", "Q6_K"} and (file_type[:2] in "".join(types))
        model = load_gguf(out)  # in place: no conversion
        scored = logits(model, IDS)
        spread = reference.std().item()
        # its rounding, not another model's logits
        assert (scored - reference).abs().max().item() < error * 10 * spread
        assert (scored - reference).pow(2).mean().sqrt().item() < error * spread
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Q4_K_M.gguf", "Q6_K.gguf", "Q8_0.gguf", "f16.gguf"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--type", "Q2_K"], "--type with --from must be one of"),
        (["--type", "Q4_K"], "Q4_K_M"),  # a tensor type, not a file type: the list says which
        (["--type", "Q8_0", "--out", "{dir}/x.bin"], "must end in .gguf"),
        (["--type", "Q8_0", "--out", "{dir}/source.gguf"], "must not be the source"),
        (["--type", "Q8_0", "--out", "{dir}/no/such/dir/x.gguf"], "x.gguf"),
    ],
)
def test_write_gguf_from_refuses_bad_arguments_in_one_line(tmp_path, capsys, argv, message):
    source = tmp_path / "source.gguf"
    assert cli.main(["write-gguf", "--shape", SHAPE, "--type", "Q8_0", "--out", str(source)]) == 0
    capsys.readouterr()
    argv = [a.format(dir=tmp_path) for a in argv]
    argv = argv if "--out" in argv else [*argv, "--out", str(tmp_path / "x.gguf")]
    assert cli.main(["write-gguf", "--from", str(source), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source.gguf"]


def test_the_help_lists_the_file_types_requantizing_takes():
    from verispec.cli.bench import FROM_TYPES
    from verispec.models.gguf_requantize import FILE_TYPES

    assert FROM_TYPES == ", ".join(FILE_TYPES)


def test_write_gguf_from_what_is_not_gguf_or_without_llama_cpp_is_one_line(tmp_path, capsys, monkeypatch):
    """A source that is no GGUF file, --shape and --from together, and llama.cpp missing (as on a machine
    without `make peers`): one line each, nothing written."""
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    out = tmp_path / "x.gguf"
    for argv, message in [
        (["--from", str(text)], "cannot read"),
        (["--from", str(tmp_path / "notes.txt")], "--from takes a .gguf file"),
    ]:
        assert cli.main(["write-gguf", *argv, "--type", "Q8_0", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err
    both = ["write-gguf", "--from", str(text), "--shape", SHAPE, "--type", "Q8_0", "--out", str(out)]
    assert cli.main(both) == 2 and "not allowed with" in capsys.readouterr().err  # argparse: one of them
    source = tmp_path / "source.gguf"
    assert cli.main(["write-gguf", "--shape", SHAPE, "--type", "Q8_0", "--out", str(source)]) == 0
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert cli.main(["write-gguf", "--from", str(source), "--type", "Q8_0", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "make peers" in err and "\n" not in err and not out.exists()


def test_bench_gguf_reports_a_random_file(tmp_path, capsys, own_cache):
    out = tmp_path / "report"
    argv = ["bench-gguf", "--random", f"{SHAPE}:Q8_0", "--no-llamacpp", "--context", "16", "--prefill", "8"]
    argv += ["--max-k", "3", "--repetitions", "1", "--threads", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    record, host = document["files"][0], document["machine"]
    assert host["cores"] >= 1 and host["cpu"] and len(host["load_average_at_end"]) == 3
    assert record["formats"] == "q8_0" and len(record["verify"]) == 3 and record["verify"][0] == 1.0
    assert record["llamacpp_decode_seconds"] is None and record["agreement"] is None  # random weights
    assert 0 < record["weight_bytes"] < record["file_bytes"] and record["decode_seconds"] > 0
    assert record["rss_added"] > 0 and record["load_seconds"] > 0
    assert [p["k"] is not None for p in record["predicted"]] == [True] * 3
    table = (out / "results.md").read_text()
    assert "Q8_0.gguf" in table and "v(3)" in table and "Against llama.cpp" not in table
    assert f"Machine: {host['cpu']}, {host['cores']} cores" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give GGUF files, or --random"),
        (["missing.gguf"], "no such GGUF file"),
        (["--random", "llama3-1b:Q3_K"], "TYPE one of"),
        (["--random", "llama3-1b:Q4_K", "--max-k", "1"], "--max-k must be an integer >= 2, got 1"),
    ],
)
def test_bench_gguf_refuses_bad_arguments_in_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    assert cli.main(["bench-gguf", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "cache").exists()  # refused before any file is written


def test_bench_gguf_checks_its_files_before_measuring_anything(tmp_path, capsys, monkeypatch):
    """Issue 52's D8: ``--max-k 1`` measured everything, then failed with an internal StatisticsError; a
    file that is not GGUF, or that the kernels cannot run, was refused only after a 1 GB buffer had been
    measured (its read rate) and the file loaded in a child process. Every argument and file is checked
    first, in one line each: the bench's first measurement here fails the test."""
    import verispec.bench.gguf as bench

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        bench, "read_bandwidth", lambda *a: pytest.fail("measured before the input was checked")
    )
    source = tmp_path / "tiny.gguf"  # SHAPE's context: 512 positions
    assert cli.main(["write-gguf", "--shape", SHAPE, "--type", "Q8_0", "--out", str(source)]) == 0
    notes = tmp_path / "notes.gguf"
    notes.write_text("not a model, but notes long enough for a header")
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    capsys.readouterr()
    for argv, message in [
        ([str(source), "--max-k", "1"], "error: --max-k must be an integer >= 2, got 1"),
        ([str(notes)], f"error: cannot read {notes} as a GGUF file: no GGUF magic at its start"),
        ([str(tmp_path / "gpt2.gguf")], "gpt2.gguf cannot run in place: architecture 'gpt2'"),
        (
            [str(source), "--context", "500"],
            f"{source} holds 512 positions, and --context 500 with --max-k 8 and --prefill 128 fill 644",
        ),
    ]:
        assert cli.main(["bench-gguf", *argv, "--no-llamacpp"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
