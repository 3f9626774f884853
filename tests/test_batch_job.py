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
    with pytest.raises(UsageError, match="other settings or requests"):  # resuming asks for the same job
        run_job(job(stories, requests_file, output, shard_size=3, max_new_tokens=8))
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


def test_a_malformed_line_gets_an_error_record_and_the_rest_run(stories, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = ['{"id": "a", "prompt": "Once"}', "{not json", '{"prompt": 3}', '{"id": "a", "prompt": "x"}']
    named = ['{"prompt": "Once"}', '{"id": "6", "prompt": "x"}', '{"id": null, "prompt": "x"}']
    bad.write_text("\n".join([*lines, '{"id": "d", "prompt": "The dog"}', *named]) + "\n")
    output = tmp_path / "out.jsonl"
    summary = run_job(job(stories, bad, str(output)))
    records = [json.loads(line) for line in output.read_text().splitlines()]
    ids = ["a", "line-2", "line-3", "line-4", "d", "6", "line-7", "line-8"]
    assert [r["id"] for r in records] == ids and summary["refused"] == 5
    assert records[1]["error"].startswith(f"{bad}:2: not JSON")
    assert records[2]["error"] == f'{bad}:3: "prompt" must be a string'
    assert records[3]["error"] == f"{bad}:4: id 'a' repeats line 1's"
    assert records[6]["error"] == (  # line 6 has no id: its line number names it
        f"{bad}:7: id '6' repeats line 6's (its line number: a line without an id is named so)"
    )
    assert records[7]["error"] == f'{bad}:8: "id" must be a string or an integer, got null'
    assert records[0]["token_ids"] and records[4]["token_ids"] and records[5]["token_ids"]


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
    assert [r["id"] for r in records] == ["a", "line-2", "line-3", "line-4", "line-5", "line-6", "sep", "d"]
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


@pytest.fixture(scope="module")
def local_ray(ray_lock):
    """A local Ray (2 CPUs, loopback) for this module's Ray tests, the only one on the machine while they run;
    skipped, saying why, where it cannot start."""
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    with ray_lock:
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except Exception as err:  # noqa: BLE001 - whatever keeps Ray from starting here: say so
            pytest.skip(f"Ray cannot start here: {err}")
        yield ray
        ray.shutdown()


def test_ray_workers_give_the_same_output(local_ray, stories, requests_file, tmp_path):
    """Ray Data with two ShardWorker actors: the in-process output, line for line."""
    here = str(tmp_path / "here.jsonl")
    run_job(job(stories, requests_file, here, shard_size=4))
    there = str(tmp_path / "ray.jsonl")
    summary = run_job(job(stories, requests_file, there, shard_size=3, ray=LOCAL, workers=2))
    assert summary["shards"] == 4 and read(there) == read(here)


def test_drafter_data_on_ray(local_ray, tmp_path, capsys):
    """``drafter-data --ray --workers 2`` on a tiny chat Llama: the prompts of a one-machine run, and its
    greedy answers (the even prompts), in one merged data set."""
    from test_eagle_data import save_target
    from verispec.drafting.learned.data import _sequences, read_data_meta

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
