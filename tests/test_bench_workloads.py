"""The bench's agentic workloads (verispec.bench.workloads): sequences of requests fed the earlier outputs,
their task files, and the suffix drafter run cold and warm on stories260K."""

import json

import pytest
import torch

from verispec.bench.prompts import Prompt, builtin_tasks, load_prompts
from verispec.bench.workloads import CacheSnapshots
from verispec.cli import main

AGENTIC = ("agent_tools", "code_edit_loop", "chat_quoting")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_agentic_tasks_are_sequences():
    tasks = builtin_tasks()
    for name in AGENTIC:
        assert all(len(p.follow_ups) >= 1 for p in tasks[name]), name
        assert sum(len(p.follow_ups) >= 2 for p in tasks[name]) >= 3, name
    calls = [p for p in tasks["agent_tools"] if p.messages[0][0] == "system"]
    assert len(calls) == len(tasks["agent_tools"])
    assert all(json.loads(f.removeprefix("Tool result: ")) for p in calls for f in p.follow_ups)


def test_a_turn_is_the_conversation_so_far():
    prompt = Prompt("t", "s", (("user", "edit a"),), ("edit b", "edit c"))
    assert prompt.turn([]) is prompt
    second = prompt.turn(["file v1"])
    assert second.messages == (("user", "edit a"), ("assistant", "file v1"), ("user", "edit b"))
    assert second.id == "s#1" and not second.follow_ups
    assert prompt.turn(["v1", "v2"]).for_model(chat=False) == "edit a\n\nv1\n\nedit b\n\nv2\n\nedit c"


def test_bad_follow_ups_are_one_line(tmp_path):
    path = tmp_path / "p.jsonl"
    for bad in ('"next"', "[1]", '[""]'):
        path.write_text(f'{{"prompt": "a", "follow_ups": {bad}}}\n')
        with pytest.raises(ValueError, match="follow_ups"):
            load_prompts(path)


def test_a_warm_cache_is_the_first_pass_copied_for_each_sample():
    passes = []

    def first_pass(cache):
        passes.append(1)
        cache.add([], [1, 2, 3])

    snapshots = CacheSnapshots()
    assert snapshots.cache_for("suffix", "t", first_pass).stats()["sequences"] == 0
    warm = snapshots.cache_for("suffix-warm", "t", first_pass)
    warm.add([], [4, 5])  # a sample's own outputs do not reach the next sample
    again = snapshots.cache_for("suffix-warm", "t", first_pass)
    assert again.sequences() == [[1, 2, 3]] and passes == [1]


@pytest.mark.slow
def test_suffix_cold_and_warm_on_sequences(capsys, tmp_path, shared_model):
    """A seconds-long bench of a sequence task: each request fed the earlier outputs, suffix cold and warm
    reported apart, both greedy-identical to none; warm accepts more."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    prompts = tmp_path / "loop.jsonl"
    story = {"id": "s", "prompt": "Once upon a time", "follow_ups": ["Tell it again.", "Once more."]}
    prompts.write_text(json.dumps(story) + "\n")
    out = tmp_path / "out"
    argv = ["bench", "--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    argv += ["--prompts", str(prompts), "--tasks", "loop", "--threads", "1", "--max-new-tokens", "24"]
    argv += ["--methods", "none,suffix,suffix-warm", "--k", "4", "--repetitions", "1", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    cells = {c["label"]: c for c in json.loads((out / "results.json").read_text())["cells"]}
    assert set(cells) == {"none", "suffix k=4", "suffix-warm k=4"}
    for cell in cells.values():
        assert cell["greedy_identity"]["differ"] == [] and cell["samples"][0]["prompts"] == 3
        assert cell["samples"][0]["tokens"] == cells["none"]["samples"][0]["tokens"] > 24
    cold, warm = (cells[label]["samples"][0]["accepted"] for label in ("suffix k=4", "suffix-warm k=4"))
    assert warm > cold
