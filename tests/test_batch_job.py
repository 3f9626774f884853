"""``verispec batch`` (verispec.batch): shards, resuming, seeds per request, Ray Data.

On stories260K with prompt lookup at a fixed K, sampled at temperature 1: the output is the same whatever the
shard size, the batch size, in-process or on Ray workers, and equal to generating each request alone with its
derived seed. With --k auto the K of a round follows this machine's costs and the rest of the batch, so only
the distribution (and greedy output) is independent of how the work is cut, not the sampled tokens with
--no-invariant; by default (invariant draws: every request has a seed) they are too, at any K: each request
is then the target's own sampling with its seed. A hostile line (deep nesting, a 5,000-digit integer, a lone
surrogate, bytes that are not UTF-8) is that line's error record, and the job finishes.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from verispec import batch as batch_module
from verispec import cli
from verispec.batch import LOCAL, BatchJob, prompt_seed, run_job
from verispec.errors import UsageError
from verispec.options import SamplingParams

PROMPTS = ["Once upon a time", "The little dog", "Lily was sad because", "Tom and Sue went"]


@pytest.fixture(scope="module")
def stories(shared_model) -> list[str]:
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return [str(root / "stories260K.bin"), str(root / "tok512.bin")]


@pytest.fixture
def requests_file(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt": PROMPTS[i % len(PROMPTS)]}) for i in range(10)]
    lines.insert(4, json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Hi"}]}))
    lines.append(json.dumps({"id": "long", "prompt": "word " * 900}))
    path.write_text("\n".join(lines) + "\n")
    return path


def job(stories, requests_file: Path, output: str, **changes) -> BatchJob:
    fields = dict(
        input=str(requests_file),
        output=output,
        target=stories[0],
        tokenizer=stories[1],
        drafter="ngram",
        k="3",
        max_new_tokens=16,
        sampling=SamplingParams(temperature=1.0, seed=7),
        progress=False,
    )
    return BatchJob(**{**fields, **changes})


def read(path: str | Path) -> list[tuple]:
    """(id, token ids, error) of each output line: what must not depend on how the work was cut."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [(r["id"], r.get("token_ids"), r.get("error")) for r in lines]


def test_output_is_independent_of_shards_and_batches_and_equals_each_alone(stories, requests_file, tmp_path):
    from verispec.api import Speculator

    one = run_job(job(stories, requests_file, str(tmp_path / "a.jsonl"), shard_size=3, max_batch=2))
    run_job(job(stories, requests_file, str(tmp_path / "b.jsonl"), shard_size=50, max_batch=8))
    a, b = read(tmp_path / "a.jsonl"), read(tmp_path / "b.jsonl")
    ids = [f"p{i}" for i in range(4)] + ["chat"] + [f"p{i}" for i in range(4, 10)] + ["long"]
    assert a == b and [r[0] for r in a] == ids  # input order
    assert one["requests"] == 12 and one["refused"] == 2 and one["shards"] == 4
    errors = {ident: error for ident, _, error in a if error}
    assert "no chat template" in errors["chat"]  # stories260K has none: an error record, the rest ran
    assert errors["long"].startswith("the prompt has")
    sampled = [tuple(tokens) for _, tokens, error in a if not error]
    assert len(set(sampled)) > 4  # the same prompts sampled with different seeds differ
    spec = Speculator(stories[0], drafter="ngram", tokenizer=stories[1])
    for ident, tokens, _ in a[:3]:
        prompt = PROMPTS[int(ident[1:]) % len(PROMPTS)]
        alone = spec.generate(
            prompt, k=3, max_new_tokens=16, sampling=SamplingParams(1.0, seed=prompt_seed(7, ident))
        )
        assert alone.token_ids == tokens
    assert not Path(f"{tmp_path / 'a.jsonl'}.parts").exists()  # the shards are gone once assembled


def test_invariant_sampling_at_k_auto_is_independent_of_batches_and_is_the_target_s_own(
    stories, requests_file, tmp_path, capsys
):
    """``verispec batch --k auto`` (invariant draws by default, or --invariant): whatever --max-batch and
    --shard-size, each request is what the target samples alone with its derived seed, with no drafter at
    all; --no-invariant opts out (recorded in the job's settings)."""
    from verispec.api import Speculator

    model = ["--target", stories[0], "--tokenizer", stories[1], "--drafter", "ngram", "--k", "auto"]
    sampling = ["--temperature", "0.7", "--seed", "7", "--max-new-tokens", "16"]
    for name, cut in (
        ("a", ["--max-batch", "2", "--shard-size", "3"]),
        ("b", ["--max-batch", "8", "--invariant"]),
    ):
        files = ["--input", str(requests_file), "--output", str(tmp_path / f"{name}.jsonl")]
        assert cli.main(["batch", *files, *model, *sampling, *cut]) == 0
    a, b = read(tmp_path / "a.jsonl"), read(tmp_path / "b.jsonl")
    assert a == b
    assert job(stories, requests_file, "x.jsonl").sampling.invariant  # the library's job: the same default
    opted = job(stories, requests_file, "x.jsonl", sampling=SamplingParams(1.0, seed=7, invariant=False))
    assert not opted.sampling.invariant
    spec = Speculator(stories[0], drafter="none", tokenizer=stories[1])
    for ident, tokens, _ in a[:4]:
        own = SamplingParams(0.7, seed=prompt_seed(7, ident), invariant=True)
        prompt = PROMPTS[int(ident[1:]) % len(PROMPTS)]
        assert spec.generate(prompt, k=0, max_new_tokens=16, sampling=own).token_ids == tokens


def test_an_interrupted_run_resumes_where_it_stopped(stories, requests_file, tmp_path, monkeypatch):
    reference = tmp_path / "ref.jsonl"
    run_job(job(stories, requests_file, str(reference), shard_size=3))
    output = str(tmp_path / "out.jsonl")
    real, calls = batch_module._shard_lines, []

    def dies_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the run
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_module, "_shard_lines", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        run_job(job(stories, requests_file, output, shard_size=3))
    parts = Path(f"{output}.parts")
    assert sorted(p.name for p in parts.glob("shard-*.jsonl")) == ["shard-000000.jsonl", "shard-000001.jsonl"]
    assert not Path(output).exists()
    monkeypatch.setattr(batch_module, "_shard_lines", real)
    with pytest.raises(UsageError, match="with other settings: --max-new-tokens was 16, now 8: run it"):
        run_job(job(stories, requests_file, output, shard_size=3, max_new_tokens=8))  # resuming: the same job
    summary = run_job(job(stories, requests_file, output, shard_size=3, max_batch=1))  # batch size is free
    assert summary["resumed"] == 2 and read(output) == read(reference)
    with pytest.raises(UsageError, match="exists"):
        run_job(job(stories, requests_file, output))


@pytest.mark.slow
def test_a_killed_run_resumes(stories, tmp_path):
    """``verispec batch`` killed (SIGKILL) once some shards are written: the shards on disk are whole, and the
    run started again finishes with exactly the lines of an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    requests = tmp_path / "many.jsonl"
    requests.write_text(
        "".join(json.dumps({"id": f"s{i}", "prompt": PROMPTS[i % 4]}) + "\n" for i in range(48))
    )
    output = tmp_path / "out.jsonl"
    flags = ["--drafter", "ngram", "--k", "3", "--temperature", "1", "--seed", "5", "--shard-size", "4"]
    argv = ["batch", "--input", str(requests), "--output", str(output), "--target", stories[0]]
    argv += ["--tokenizer", stories[1], "--max-new-tokens", "64", *flags]
    process = subprocess.Popen([sys.executable, "-m", "verispec", *argv], stderr=subprocess.DEVNULL)
    parts = Path(f"{output}.parts")
    deadline = time.monotonic() + 120
    while (
        len(list(parts.glob("shard-*.jsonl"))) < 2 and process.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = sorted(parts.glob("shard-*.jsonl"))
    assert 2 <= len(written) < 12 and not output.exists(), "the run ended before it could be killed"
    for path in written:
        assert [json.loads(line)["id"] for line in path.read_text().splitlines()]  # whole lines only
    resumed = job(
        stories, requests, str(output), k="3", max_new_tokens=64, sampling=SamplingParams(1.0, seed=5)
    )
    summary = run_job(dataclasses.replace(resumed, shard_size=4))
    assert summary["resumed"] == len(written)
    reference = tmp_path / "ref.jsonl"
    run_job(dataclasses.replace(resumed, output=str(reference), shard_size=48))
    assert read(output) == read(reference)


def test_a_random_seed_is_kept_for_the_resumed_run(stories, requests_file, tmp_path, monkeypatch):
    output = str(tmp_path / "out.jsonl")
    unseeded = SamplingParams(temperature=1.0)
    real = batch_module._shard_lines
    monkeypatch.setattr(
        batch_module, "_shard_lines", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    with pytest.raises(KeyboardInterrupt):
        run_job(job(stories, requests_file, output, sampling=unseeded))
    seed = json.loads(Path(f"{output}.parts/job.json").read_text())["sampling"]["seed"]
    monkeypatch.setattr(batch_module, "_shard_lines", real)
    run_job(job(stories, requests_file, output, sampling=unseeded))
    seeded = str(tmp_path / "seeded.jsonl")
    run_job(job(stories, requests_file, seeded, sampling=SamplingParams(temperature=1.0, seed=seed)))
    assert read(output) == read(seeded)


def interrupted(stories, requests_file, output: str, monkeypatch, shards: int, **changes) -> Path:
    """``OUTPUT.parts`` of a run of ``requests_file`` in shards of 3 stopped by Ctrl-C after ``shards``."""
    real, calls = batch_module._shard_lines, []

    def stops(*args, **kwargs):
        calls.append(1)
        if len(calls) > shards:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(batch_module, "_shard_lines", stops)
        with pytest.raises(KeyboardInterrupt):
            run_job(job(stories, requests_file, output, shard_size=3, **changes))
    return Path(f"{output}.parts")


def test_a_resume_with_another_seed_or_sampling_is_refused_naming_it(
    stories, requests_file, tmp_path, monkeypatch
):
    """Issue 52's D4: a resume with another --seed ran with the first one's, silently. Every setting the
    output depends on is compared, the seed too: one line naming it, its old and new value; the random seed
    a run without --seed kept is the one compared, and a run without --seed resumes with it."""
    output = str(tmp_path / "out.jsonl")
    interrupted(stories, requests_file, output, monkeypatch, 1)
    for changes, message in [
        (dict(sampling=SamplingParams(1.0, seed=8)), "--seed was 7, now 8 (a run without --seed resumes"),
        (dict(sampling=SamplingParams(0.5, seed=7)), "--temperature was 1.0, now 0.5"),
        (dict(sampling=SamplingParams(1.0, seed=7, invariant=False)), "--invariant was true, now false"),
        (dict(drafter="none", k="0"), "--drafter was ngram, now none"),
    ]:
        with pytest.raises(
            UsageError, match=re.escape(f"holds an interrupted run with other settings: {message}")
        ):
            run_job(job(stories, requests_file, output, shard_size=3, **changes))
    changed = tmp_path / "changed.jsonl"
    changed.write_text(requests_file.read_text().replace("little dog", "big dog"))
    with pytest.raises(UsageError, match=r"of other requests \(the lines of --input changed\)"):
        run_job(job(stories, changed, output, shard_size=3))
    unseeded = str(tmp_path / "unseeded.jsonl")
    parts = interrupted(stories, requests_file, unseeded, monkeypatch, 1, sampling=SamplingParams(1.0))
    kept = json.loads((parts / "job.json").read_text())["sampling"]["seed"]
    with pytest.raises(UsageError, match=f"--seed was {kept}, now 7"):
        run_job(job(stories, requests_file, unseeded, shard_size=3))
    run_job(job(stories, requests_file, unseeded, shard_size=3, sampling=SamplingParams(1.0, seed=kept)))
    reference = str(tmp_path / "reference.jsonl")
    run_job(job(stories, requests_file, reference, sampling=SamplingParams(1.0, seed=kept)))
    assert read(unseeded) == read(reference)


def corrupt(parts: Path) -> dict[str, str]:
    """Shards 0, 1, 2 of ``parts`` damaged as a disk, a crash or a hand might: cut in the middle of a line,
    two lines glued together, garbage bytes in place of a line; what each is then reported as."""
    cut, glued, garbage = (parts / f"shard-00000{i}.jsonl" for i in range(3))
    cut.write_bytes(cut.read_bytes()[: len(cut.read_bytes()) // 2])
    glued.write_bytes(glued.read_bytes().replace(b"\n", b"", 1))
    lines = garbage.read_bytes().split(b"\n")
    garbage.write_bytes(b"\n".join([lines[0], b"\xff\x00\x13garbage", *lines[2:]]))
    return {
        cut.name: r"is partial \([01] of 3 lines whole, then one cut short\): computing it again",
        glued.name: r"is corrupt \(line 1 is not JSON\): computing it again",
        garbage.name: r"is corrupt \(line 2 is not JSON\): computing it again",
    }


def test_corrupt_or_partial_shards_are_computed_again_and_no_line_is_lost(
    stories, requests_file, tmp_path, monkeypatch, capsys
):
    """Issue 52's D5: a shard with two lines glued together made a resume write 67 of 71 lines, exit 1 and
    remove OUTPUT.parts. Each shard is checked when a resumed run reads it (every line JSON, the shard's
    ids in order, their count, the last line whole): one that is not is said so on stderr (a line each) and
    computed again; the output is the uninterrupted run's."""
    reference = str(tmp_path / "reference.jsonl")
    run_job(job(stories, requests_file, reference, shard_size=3))
    output = str(tmp_path / "out.jsonl")
    parts = interrupted(stories, requests_file, output, monkeypatch, 3)
    said = corrupt(parts)
    capsys.readouterr()
    summary = run_job(job(stories, requests_file, output, shard_size=3))
    assert summary["resumed"] == 0 and read(output) == read(reference) and not parts.exists()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3
    for line, (name, message) in zip(err, said.items(), strict=True):
        assert line.startswith(f"verispec: {parts / name} ") and re.search(message, line), line


def test_a_shard_spoiled_after_it_was_written_fails_the_run_leaving_its_parts(
    stories, requests_file, tmp_path, monkeypatch
):
    """A shard that is not whole when the output is assembled (spoiled on disk since it was written): the
    run stops in one line, writes no output and keeps OUTPUT.parts; run again, it computes that shard and
    writes every line. Never fewer lines than the input has."""
    reference = str(tmp_path / "reference.jsonl")
    run_job(job(stories, requests_file, reference, shard_size=3))
    output = str(tmp_path / "out.jsonl")
    real = batch_module._shard_lines

    def spoils_the_second(job, speculator, index, *args):
        done = real(job, speculator, index, *args)
        return (index, done[1][: len(done[1]) // 2], *done[2:]) if index == 1 else done

    monkeypatch.setattr(batch_module, "_shard_lines", spoils_the_second)
    with pytest.raises(UsageError, match=r"shard-000001.jsonl is partial .* run the same command again"):
        run_job(job(stories, requests_file, output, shard_size=3))
    parts = Path(f"{output}.parts")
    assert not Path(output).exists() and len(list(parts.glob("shard-*.jsonl"))) == 3
    monkeypatch.setattr(batch_module, "_shard_lines", real)
    assert run_job(job(stories, requests_file, output, shard_size=3))["resumed"] == 3
    assert read(output) == read(reference)


def test_ids_come_back_as_given(stories, tmp_path, capsys):
    """An integer id stays an integer in the output (issue 52: 3 came back "3"), a string stays a string, a
    line without one is named by its line number; 3 and "3" are one id (the same seed): a repeat. The same
    in ``generate --batch --json``."""
    requests = tmp_path / "in.jsonl"
    lines = ['{"id": 3, "prompt": "Once"}', '{"id": "3", "prompt": "x"}', '{"id": "x", "prompt": "The"}']
    lines += ['{"prompt": "Lily"}', '{"id": 12345678901234567890, "prompt": "A"}']
    requests.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"
    run_job(job(stories, requests, str(output)))
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["id"] for r in records] == [3, "line-2", "x", "4", 12345678901234567890]
    assert records[1]["error"].endswith("id '3' repeats line 1's")
    model = ["--target", stories[0], "--tokenizer", stories[1], "--drafter", "ngram"]
    assert cli.main(["generate", "--batch", str(requests), "--json", "--max-new-tokens", "2", *model]) == 0
    printed = [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()]
    assert printed == [r["id"] for r in records]


def test_ctrl_c_says_that_the_same_command_resumes(stories, requests_file, tmp_path, monkeypatch, capsys):
    output = tmp_path / "out.jsonl"
    argv = ["batch", "--input", str(requests_file), "--output", str(output), "--shard-size", "3"]
    argv += ["--target", stories[0], "--tokenizer", stories[1], "--drafter", "ngram", "--max-new-tokens", "4"]
    real, calls = batch_module._shard_lines, []

    def stops_at_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_module, "_shard_lines", stops_at_the_third)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err.splitlines()[-1]  # after the progress bar's
    assert err == (
        f"verispec: interrupted: 2 finished shards are kept in {output}.parts: run the same command again "
        "to resume"
    )
    monkeypatch.setattr(batch_module, "_shard_lines", real)
    assert cli.main(argv) == 0 and len(read(output)) == 12
    assert "2 of 4 shards from before" in capsys.readouterr().err


def test_a_malformed_line_gets_an_error_record_and_the_rest_run(stories, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = ['{"id": "a", "prompt": "Once"}', "{not json", '{"prompt": 3}', '{"id": "a", "prompt": "x"}']
    named = ['{"prompt": "Once"}', '{"id": "6", "prompt": "x"}', '{"id": null, "prompt": "x"}']
    bad.write_text("\n".join([*lines, '{"id": "d", "prompt": "The dog"}', *named]) + "\n")
    output = tmp_path / "out.jsonl"
    summary = run_job(job(stories, bad, str(output)))
    records = [json.loads(line) for line in output.read_text().splitlines()]
    ids = ["a", "line-2", "line-3", "line-4", "d", "line-6", "6", "line-8"]  # line 7 gives 6: line 6's own
    assert [r["id"] for r in records] == ids and summary["refused"] == 4
    assert records[1]["error"].startswith(f"{bad}:2: not JSON")
    assert records[2]["error"] == f'{bad}:3: "prompt" must be a string'
    assert records[3]["error"] == f"{bad}:4: id 'a' repeats line 1's"
    assert records[7]["error"] == f'{bad}:8: "id" must be a string or an integer, got null'
    assert all(records[i]["token_ids"] for i in (0, 4, 5, 6))


@pytest.mark.parametrize(
    "where", ["afile/out.jsonl", "missing/out.jsonl"], ids=["under-a-file", "no-directory"]
)
def test_an_output_that_cannot_be_written_is_refused_before_anything_runs(stories, tmp_path, where):
    (tmp_path / "afile").write_text("x")
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"id": "a", "prompt": "Once"}\n')
    output = tmp_path / where
    with pytest.raises(UsageError, match=r"^cannot write .*out\.jsonl: no directory"):
        run_job(job(stories, requests, str(output)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "in.jsonl"]


def test_hostile_lines_get_error_records_and_the_job_finishes(stories, tmp_path, capsys):
    """Issue 36's lines (each once aborted a job: a lone surrogate after 11 of 12 shards, the others before
    anything was written), one shard each: each is its line's error record, the others run, and
    ``generate --batch`` says the same."""
    hostile = tmp_path / "hostile.jsonl"
    lines = [
        b'{"id": "a", "prompt": "Once"}',
        b'{"id": "deep", "prompt": "x", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"id": "int", "prompt": "x", "n": ' + b"9" * 5000 + b"}",
        rb'{"id": "lone", "prompt": "a\ud800b"}',
        rb'{"id": "chat", "messages": [{"role": "user", "content": "\udc00"}]}',
        b'{"id": "bytes", "prompt": "\xff\xfe"}',
        '{"id": "sep", "prompt": "The dog\u2028ran"}'.encode(),  # a line separator inside a string: one line
        b'{"id": "d", "prompt": "The dog"}',
    ]
    hostile.write_bytes(b"\n".join(lines) + b"\n")
    output = tmp_path / "out.jsonl"
    summary = run_job(job(stories, hostile, str(output), shard_size=1))
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "line-2", "line-3", "lone", "chat", "line-6", "sep", "d"]
    errors = [r.get("error", "") for r in records]
    assert errors[1] == f"{hostile}:2: not JSON (nested too deeply)"
    assert errors[2] == f"{hostile}:3: not JSON (an integer of more than 4300 digits)"
    assert (
        errors[3]
        == f"{hostile}:4: the prompt holds a lone surrogate (U+D800) at character 1: not valid Unicode"
    )
    assert errors[4].startswith(f"{hostile}:5: the prompt holds a lone surrogate (U+DC00)")
    assert errors[5].startswith(f"{hostile}:6: not JSON (not UTF-8")
    assert summary["refused"] == 5 and all(records[i]["token_ids"] for i in (0, 6, 7))
    model = ["--target", stories[0], "--tokenizer", stories[1], "--drafter", "ngram"]
    assert cli.main(["generate", "--batch", str(hostile), "--json", "--max-new-tokens", "4", *model]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("error", "") for r in printed] == errors


def test_bad_jobs_are_refused_before_anything_is_written(stories, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    output = tmp_path / "out.jsonl"
    with pytest.raises(UsageError, match="holds no requests"):
        run_job(job(stories, empty, str(output)))
    assert not output.exists() and not Path(f"{output}.parts").exists()
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{not json\n{"prompt": 3}\n')
    with pytest.raises(UsageError, match=r"malformed.jsonl:1: not JSON .* \(and the 1 other lines\)$"):
        run_job(job(stories, malformed, str(output)))
    assert not output.exists() and not Path(f"{output}.parts").exists()
    with pytest.raises(UsageError, match="--workers N runs N Ray workers"):
        job(stories, empty, str(output), workers=2)
    with pytest.raises(UsageError, match="overwrite the input"):
        job(stories, empty, str(empty))


def test_cli_batch_and_an_unreachable_ray(stories, requests_file, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    model = ["--target", stories[0], "--tokenizer", stories[1]]
    common = [
        "batch",
        "--input",
        str(requests_file),
        "--output",
        str(output),
        *model,
        "--max-new-tokens",
        "8",
    ]
    assert cli.main([*common, "--ray", "127.0.0.1:1"]) == 2  # a closed port: refused at once
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach Ray at 127.0.0.1:1" in err
    assert not output.exists() and not Path(f"{output}.parts").exists()
    assert cli.main([*common, "--drafter", "ngram", "--shard-size", "5"]) == 0
    err = capsys.readouterr().err
    assert "12 requests written" in err and "2 refused" in err
    assert len(read(output)) == 12


@pytest.mark.xdist_group("ray")  # one worker runs the group on one local Ray (local_ray)
def test_ray_workers_give_the_same_output(local_ray, stories, requests_file, tmp_path):
    """Ray Data with two ShardWorker actors: the in-process output, line for line."""
    here = str(tmp_path / "here.jsonl")
    run_job(job(stories, requests_file, here, shard_size=4))
    there = str(tmp_path / "ray.jsonl")
    summary = run_job(job(stories, requests_file, there, shard_size=3, ray=LOCAL, workers=2))
    assert summary["shards"] == 4 and read(there) == read(here)


@pytest.mark.xdist_group("ray")  # one worker runs the group on one local Ray (local_ray)
def test_drafter_data_on_ray(local_ray, tmp_path, capsys):
    """``drafter-data --ray --workers 2`` on a tiny chat Llama: the prompts of a one-machine run, and its
    greedy answers (the even prompts), in one merged data set."""
    from test_eagle_data import save_target
    from verispec.training.data import _sequences, read_data_meta

    target = str(save_target(tmp_path / "target", 1.5))
    common = [
        "drafter-data",
        "--target",
        target,
        "--prompts",
        "6",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "1",
    ]
    assert cli.main([*common, "--out", str(tmp_path / "here")]) == 0
    assert cli.main([*common, "--out", str(tmp_path / "ray"), "--ray", "--workers", "2"]) == 0
    capsys.readouterr()
    assert read_data_meta(tmp_path / "ray")["num_sequences"] == 6
    assert not (tmp_path / "ray.parts").exists()

    def answers(directory):
        seqs = [s for split in ("train", "heldout") for s in _sequences(directory, split)]
        return {tuple(tokens[:n]): tuple(tokens[n:]) for tokens, n, _ in seqs}

    here, there = answers(tmp_path / "here"), answers(tmp_path / "ray")
    assert here.keys() == there.keys()
    assert sum(here[p] == there[p] for p in here) >= 3  # the three greedy answers at least
    assert cli.main([*common, "--out", str(tmp_path / "x"), "--ray", "--merge", "a", "b"]) == 2


@pytest.mark.xdist_group("ray")  # one worker runs the group on one local Ray (local_ray)
def test_ray_workers_merge_their_suffix_caches_into_the_file(local_ray, stories, requests_file, tmp_path):
    """Two Ray workers drafting with suffix, each from the cache file: every request's output merged into it
    (greedy, the in-process output line for line)."""
    from verispec.drafting.suffix_cache import SuffixCache

    greedy = SamplingParams(temperature=0)
    cache = tmp_path / "cache.npz"
    here = str(tmp_path / "here.jsonl")
    run_job(job(stories, requests_file, here, shard_size=4, drafter="none", k="0", sampling=greedy))
    there = str(tmp_path / "ray.jsonl")
    suffix = dict(drafter="suffix", sampling=greedy, suffix_cache_file=str(cache))
    run_job(job(stories, requests_file, there, shard_size=3, ray=LOCAL, workers=2, **suffix))
    assert read(there) == read(here)
    produced = [
        r["token_ids"] for r in map(json.loads, Path(there).read_text().splitlines()) if "token_ids" in r
    ]
    assert sorted(SuffixCache.load(cache).sequences()) == sorted(t for t in produced if t)


def test_a_line_without_an_id_is_never_named_as_another_line_is(tmp_path):
    """A line without an id is named by its number unless a line (before or after it) gives that number as
    its id: then "line-N". Every line of the newcomer's file runs (line 3 was refused as repeating line 1)."""
    requests = tmp_path / "in.jsonl"
    lines = ['{"id": "3", "prompt": "Once"}', '{"id": 1, "prompt": "Lily"}', '{"prompt": "no id on line 3"}']
    requests.write_text("\n".join([*lines, '{"prompt": "four"}', '{"id": "line-3", "prompt": "x"}']) + "\n")
    read = batch_module.read_requests(requests)
    assert [ident for ident, _, _ in read] == ["3", 1, "line-line-3", "4", "line-3"]
    assert not any(isinstance(body, dict) for _, body, _ in read)  # none refused


def test_a_line_of_json_null_is_refused_not_skipped(tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"prompt": "Once"}\nnull\n\n{"prompt": "Lily"}\n')
    read = batch_module.read_requests(requests)
    assert [ident for ident, _, _ in read] == ["1", "line-2", "4"]  # the blank line 3: skipped
    assert read[1][1] == {
        "error": f'{requests}:2: a request is an object with "prompt" or "messages" (one of them)'
    }
