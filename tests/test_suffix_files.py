"""A suffix cache kept in a file (verispec.drafting.suffix_files): ``--suffix-cache`` / ``--suffix-budget`` of
``generate`` and ``batch`` checked before any model loads (a bad budget, a drafter without a shared cache, an
unwritable path, a corrupt file: one line, exit 2, the file untouched), a file of another tokenizer refused
once it loads, the cache loaded at start and saved at exit (Ctrl-C too); ``batch`` merging its workers'
additions (SuffixCache.merge) and a resumed job starting warm; greedy output the same as ``none``'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verispec import batch as batch_module
from verispec import cli
from verispec.api import Speculator
from verispec.batch import BatchJob, run_job
from verispec.choice import ModelChoice
from verispec.drafting.suffix_cache import SuffixCache
from verispec.errors import UsageError
from verispec.resolve import Target
from verispec.server.tenants import installation_salt, tenant_id, tenants_dir

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def stories(shared_model) -> list[str]:
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]


def test_sequences_since_a_mark_and_merge():
    worker = SuffixCache(10, vocabulary="v")
    worker.add([], [1, 2, 3])
    mark = worker.added
    worker.add([], [4, 5])
    worker.add([], [6, 7, 8, 9])
    assert worker.sequences(since=mark) == [[4, 5], [6, 7, 8, 9]]
    worker.add([], [10, 11, 12])  # evicts [1, 2, 3]
    worker.add([], [13, 14, 15, 16])  # evicts [4, 5] and [6, 7, 8, 9], added after the mark
    assert worker.sequences(since=mark) == [[10, 11, 12], [13, 14, 15, 16]]
    assert worker.sequences(since=worker.added) == []
    merged = SuffixCache(5)
    merged.merge(worker.sequences(since=mark), worker.vocabulary)
    assert merged.vocabulary == "v" and merged.sequences() == [[13, 14, 15, 16]]  # its budget evicts
    with pytest.raises(UsageError, match="another tokenizer"):
        merged.merge([[1]], "w")


def test_tenant_files_never_name_the_key(tmp_path):
    salt = installation_salt(tenants_dir(tmp_path / "cache.npz"))
    tenant = tenant_id("sesame", salt)
    assert len(tenant) == 32 and "sesame" not in tenant and tenant != tenant_id("sesame2", salt)
    assert tenant != tenant_id("sesame", bytes(32))  # keyed by the installation's salt, not a fixed one
    assert installation_salt(tenants_dir(tmp_path / "cache.npz")) == salt  # made once
    assert tenants_dir("dir/cache.npz") == Path("dir/cache.npz.tenants")


def one_line_error(capsys, argv: list[str], message: str) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", [["generate", PROMPT], ["batch", "--input", "in.jsonl", "--output", "o"]])
def test_bad_suffix_flags_are_one_line_before_any_model_loads(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("in.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n")
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"not a zip")
    (tmp_path / "broken.gguf").write_bytes(b"not a model")  # a file that would fail to load: never reached
    absent = ["--target", str(tmp_path / "broken.gguf")]
    suffix = [*command, *absent, "--drafter", "suffix"]
    one_line_error(capsys, [*command, *absent, "--suffix-cache", "c.npz"], "give --drafter suffix (not auto)")
    one_line_error(
        capsys,
        [*command, *absent, "--drafter", "ngram", "--suffix-budget", "9"],
        "--drafter suffix (not ngram)",
    )
    one_line_error(capsys, [*suffix, "--suffix-budget", "0"], "--suffix-budget must be an integer >= 1")
    one_line_error(capsys, [*suffix, "--suffix-cache", str(tmp_path / "no" / "c.npz")], "no directory")
    one_line_error(capsys, [*suffix, "--suffix-cache", str(corrupt)], "is not a verispec suffix cache")
    assert corrupt.read_bytes() == b"not a zip"  # nothing lost


def generate(stories, capsys, *flags: str) -> list[int]:
    assert cli.main(["generate", PROMPT, *stories, "--max-new-tokens", "24", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["token_ids"]


def test_generate_loads_and_saves_the_cache(stories, tmp_path, capsys):
    path = tmp_path / "cache.npz"
    flags = ["--drafter", "suffix", "--k", "4", "--suffix-cache", str(path)]
    plain = generate(stories, capsys, "--drafter", "none", "--k", "0")
    assert generate(stories, capsys, *flags) == plain  # cold
    assert SuffixCache.load(path).sequences() == [plain]
    assert generate(stories, capsys, *flags, "--suffix-budget", "1000") == plain  # warm from the file
    saved = SuffixCache.load(path)
    assert saved.sequences() == [plain, plain] and saved.budget == 1000
    foreign = tmp_path / "foreign.npz"
    SuffixCache(vocabulary="7:other").save(foreign)
    before = foreign.read_bytes()
    assert (
        cli.main(["generate", PROMPT, *stories, "--drafter", "suffix", "--suffix-cache", str(foreign)]) == 2
    )
    assert "saved for another tokenizer" in capsys.readouterr().err
    assert foreign.read_bytes() == before


def test_ctrl_c_still_saves_the_cache(stories, tmp_path, capsys, monkeypatch):
    path = tmp_path / "cache.npz"

    def interrupted(args, speculator, *rest):
        speculator.suffix_cache.add([], [5, 6, 7])
        raise KeyboardInterrupt

    monkeypatch.setattr("verispec.cli.generate._generate", interrupted)
    assert cli.main(["generate", PROMPT, *stories, "--drafter", "suffix", "--suffix-cache", str(path)]) == 130
    assert SuffixCache.load(path).sequences() == [[5, 6, 7]]


def test_generate_batch_saves_the_cache(stories, tmp_path, capsys):
    requests = tmp_path / "in.jsonl"
    requests.write_text(
        "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate([PROMPT, "Tom"]))
    )
    path = tmp_path / "cache.npz"
    argv = ["generate", "--batch", str(requests), *stories, "--drafter", "suffix", "--json"]
    assert cli.main([*argv, "--max-new-tokens", "12", "--suffix-cache", str(path)]) == 0
    outputs = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert sorted(SuffixCache.load(path).sequences()) == sorted(outputs)


def batch_job(stories, tmp_path: Path, output: str, **changes) -> BatchJob:
    requests = tmp_path / "in.jsonl"
    if not requests.exists():
        prompts = [PROMPT, "The little dog", "Lily was sad", "Tom and Sue", "One day"]
        requests.write_text(
            "".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts))
        )
    fields = dict(input=str(requests), output=output, target=stories[1], tokenizer=stories[3],
                  drafter="suffix", k="3", max_new_tokens=12, suffix_cache_file=str(tmp_path / "cache.npz"),
                  progress=False)  # fmt: skip
    return BatchJob(**{**fields, **changes})


def outputs(path: str) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in Path(path).read_text().splitlines()]


def test_batch_merges_its_worker_into_the_file_and_resumes_warm(stories, tmp_path, monkeypatch):
    """Greedy == ``none``; an interrupted job leaves its finished shards' outputs in the file, the resumed job
    starts from it (its worker loads it) and adds the rest."""
    plain = str(tmp_path / "plain.jsonl")
    run_job(batch_job(stories, tmp_path, plain, drafter="none", k="0", suffix_cache_file=None))
    real, calls, loaded = batch_module._shard_lines, [], []

    def dies_on_the_third(job, speculator, *args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(job, speculator, *args)

    monkeypatch.setattr(batch_module, "_shard_lines", dies_on_the_third)
    output = str(tmp_path / "out.jsonl")
    with pytest.raises(KeyboardInterrupt):
        run_job(batch_job(stories, tmp_path, output, shard_size=2))
    first = outputs(plain)[:4]
    assert sorted(SuffixCache.load(tmp_path / "cache.npz").sequences()) == sorted(first)  # saved as they came
    on = Speculator.on

    def watched(target, **kwargs):
        made = on(target, **kwargs)
        loaded.append(made.suffix_cache.sequences())
        return made

    monkeypatch.setattr(batch_module, "_shard_lines", real)
    monkeypatch.setattr(Speculator, "on", watched)
    run_job(batch_job(stories, tmp_path, output, shard_size=2))
    assert [sorted(held) for held in loaded] == [sorted(first)]  # the resumed job's worker started warm
    assert outputs(output) == outputs(plain)
    assert sorted(SuffixCache.load(tmp_path / "cache.npz").sequences()) == sorted(outputs(plain))


def test_a_library_choice_checks_the_cache_too(stories, tmp_path):
    with pytest.raises(UsageError, match=r"--drafter suffix \(not ngram\)"):
        ModelChoice(drafter="ngram", suffix_cache_file=str(tmp_path / "c.npz"))
    choice = ModelChoice(target=stories[1], tokenizer=stories[3], drafter="suffix", suffix_budget=50)
    speculator = Speculator.on(Target.load(choice))
    assert speculator.suffix_cache.budget == 50 and speculator.suffix_cache.vocabulary
