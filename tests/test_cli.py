"""Tests of the verispec command line: in-process through main(), and as a process for the exit contract."""

import errno
import json
import re
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from verispec import cli
from verispec.cli.generate import busy_machine, why_slower

SMALL = ["--k", "1,3", "--agreement", "0.5,0.9", "--rounds", "2000", "--seed", "3"]
HEADERS = ["mode", "agreement", "K", "acceptance", "tau MC", "tau analytic", "speedup MC", "speedup analytic"]
TABLE_FIELDS = [
    "mode",
    "agreement",
    "k",
    "acceptance",
    "tau_mc",
    "tau_analytic",
    "speedup_mc",
    "speedup_analytic",
]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) in-process: (status, stdout, stderr)."""
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_simulate_prints_an_aligned_table(capsys):
    status, out, err = run(capsys, "simulate", *SMALL)
    assert status == 0 and err == ""
    lines = out.splitlines()
    header, rows = lines[1], lines[2:]
    assert re.split(r"\s{2,}", header.strip()) == HEADERS
    assert len(rows) == 2 * 2 * 2  # modes × agreements × K
    assert len({len(line) for line in lines[1:]}) == 1  # aligned: every line as wide as the header
    assert rows[0].split()[:3] == ["sampled", "0.5", "1"]


def test_json_is_one_object_with_the_table_fields(capsys):
    status, out, _ = run(capsys, "simulate", *SMALL, "--json")
    assert status == 0
    data = json.loads(out)
    assert data["config"]["ks"] == [1, 3] and data["config"]["rounds"] == 2000
    assert len(data["cells"]) == 8
    for cell in data["cells"]:
        assert set(TABLE_FIELDS) <= set(cell)
    # Same seed: the table shows the JSON's numbers.
    _, table, _ = run(capsys, "simulate", *SMALL)
    first_row = table.splitlines()[2].split()
    cell = data["cells"][0]
    assert first_row[4:] == [f"{cell[key]:.3f}" for key in TABLE_FIELDS[4:]]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["simulate", "--k", "0,x"], "argument --k"),
        (["simulate", "--k", "0"], "ks must be"),  # parses, rejected by the library
        (["simulate", "--agreement", "1.5"], "agreements must be"),
        (["simulate", "--agreement", "a"], "argument --agreement"),
        (["simulate", "--cost-ratio", "-1"], "cost_ratio"),
        (["simulate", "--rounds", "1"], "rounds"),
        (["simulate", "--rounds", "many"], "argument --rounds"),
        (["simulate", "--bogus"], "unrecognized arguments"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_input_is_one_line_and_status_2(capsys, argv, fragment):
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert err.endswith("\n") and err.count("\n") == 1
    assert err.startswith("verispec: error: ") and fragment in err


def test_help_and_version_exit_0(capsys):
    status, out, _ = run(capsys, "simulate", "--help")
    assert status == 0 and "--agreement" in out and "default: 1,2,4,8" in out
    status, out, _ = run(capsys, "--version")
    assert status == 0 and out.startswith("verispec ")


@pytest.mark.parametrize(
    "error, status, err",
    [
        (KeyboardInterrupt, 130, "verispec: interrupted\n"),
        (BrokenPipeError, 141, ""),
        # an output with no room (> /dev/full): one line, not an internal error
        (OSError(errno.ENOSPC, "No space left on device"), 2,
         "verispec: error: cannot write the output: No space left on device\n"),
        (OSError(errno.EACCES, "Permission denied"), 1, "verispec: internal error: PermissionError"),
    ],
)  # fmt: skip
def test_interrupt_and_broken_pipe(capsys, monkeypatch, error, status, err):
    def fail(config):
        """Stand-in for simulate that is interrupted."""
        raise error

    monkeypatch.setattr("verispec.cli.viz.simulate", fail)
    got = run(capsys, "simulate")
    assert got[:2] == (status, "") and got[2].startswith(err), got


def test_subprocess_exit_contract():
    """python -m verispec, as a real process: bad input → status 2, one line on stderr, no traceback."""
    bad = subprocess.run(
        [sys.executable, "-m", "verispec", "simulate", "--k", "0,x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "verispec: error: argument --k: expected comma-separated integers, got '0,x'"
    ]


def test_console_script_is_main():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "verispec"]
    assert script.load() is cli.main


def test_subprocess_closed_pipe_is_quiet():
    """`verispec simulate | head` with head gone before the output: no traceback, status 141."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "verispec", "simulate", *SMALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # the reader leaves before the process writes (it is still importing)
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141 and err == b""


HEAVY = ("torch", "transformers", "verispec.api", "verispec.bench.suite")
COMMANDS = [c for c in cli.build_parser()._actions if c.dest == "command"][0].choices


def test_help_and_usage_errors_import_no_torch():
    """`verispec --help`, every `verispec COMMAND --help` and an argument error answer without importing
    torch or transformers (what made them take seconds): one process, each command parsed in it."""
    script = (
        "import contextlib, io, sys\n"
        "from verispec import cli\n"
        "for argv in sys.argv[1:]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        cli.main(argv.split())\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    argvs = ["--help", *(f"{name} --help" for name in COMMANDS), "viz overlap --help", "generate --k"]
    argvs += ["generate x --max-new-tokens many", "serve --port x", "bench --bogus"]
    # mistakes found once parsed, still before anything loads: K, sampling, stop strings, batch settings
    argvs += ["generate x --k ²", "generate x --temperature -1", "generate x --top-p 0", "generate x --stop="]
    argvs += ["generate x --max-new-tokens 0", "generate --batch f --k x", "demo --k x"]
    argvs += ["batch --input i --output o --k x", "batch --input i --output i"]
    # structured output: a bad regex, an unreadable schema, two constraints (llguidance, not torch)
    argvs += [
        "generate x --regex [0-9",
        "generate x --json-schema /no/file",
        "batch --input i --output o --regex (",
    ]
    argvs += ["generate x --regex a --grammar g"]
    done = subprocess.run([sys.executable, "-c", script, *argvs], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""  # none of them imported


def test_mistakes_that_need_no_model_are_answered_before_torch_loads(tmp_path):
    """Issue 52: drafter and model names, files, ports and contradictory flags are refused in one line each
    (status 2), the closest name suggested, with neither torch nor transformers imported (what made them take
    6-8 s): one process, main() run for each, a port taken by that process itself."""
    checkpoint = tmp_path / "model.bin"
    checkpoint.write_bytes(b"\0")
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "x"}\n')
    cases = {
        "generate x --drafter eagel": "unknown drafter 'eagel' (did you mean eagle?)",
        "generate x --target smollm2": "unknown model 'smollm2' (did you mean smollm2-135m?)",
        "generate x --target missing.gguf": "no such file or directory: missing.gguf",
        f"generate x --target {checkpoint}": "is a llama2.c checkpoint: give its tokenizer file",
        f"generate x --draft {checkpoint}": "give its tokenizer file (tok*.bin: --draft-tokenizer, or",
        "generate x --tokenizer missing.bin": "no such file: missing.bin",
        "generate x --drafter-path missing.safetensors": "no such drafter file: missing.safetensors",
        "generate x --drafter model": "drafter 'model' needs a draft model (--draft SPEC)",
        "generate x --max-tokens 3": "arguments: --max-tokens 3 (did you mean --max-new-tokens?)",
        "generate x --max_new_tokens=3": "(did you mean --max-new-tokens?)",
        "generate x --drafter none --k 4": "--drafter none drafts nothing: --k 4 would change nothing",
        "demo --drafter model": "drafter 'model' needs a draft model",
        "calibrate --drafter eagel": "(did you mean eagle?)",
        "batch --input i --output o --drafter eagel": "(did you mean eagle?)",
        f"batch --input {requests} --output {tmp_path / 'o'} --target smollm2": "did you mean smollm2-135m",
        "serve --port 99999": "--port must be in [0, 65535], got 99999",
        "serve --port TAKEN": "cannot listen on 127.0.0.1:TAKEN: Address already in use",
        "serve --drafter model": "drafter 'model' needs a draft model",
        "serve --max-batch 0": "max-batch must be an integer >= 1, got 0",
        "serve --k 65": "k must be at most 64 (a round scores at most 64 tokens)",
        "generate x --k 65": "k must be at most 64",
        "batch --input i --output o --k 99": "k must be at most 64",
        "serve --allow-drafters eagel": "--allow-drafters: 'eagel' cannot be chosen by requests",
        "bench-gguf nothing.gguf": "no such GGUF file: nothing.gguf",
        "bench --target smollm2": "did you mean smollm2-135m",
        "bench-load --target smollm2": "did you mean smollm2-135m",
        "train-drafter --data d --out o --target missing.gguf": "missing.gguf",
    }
    script = (
        "import contextlib, io, json, socket, sys\n"
        "from verispec import cli\n"
        "taken = socket.create_server(('127.0.0.1', 0))\n"
        "port = str(taken.getsockname()[1])\n"
        "answers = []\n"
        "for argv in sys.argv[1:]:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):\n"
        "        status = cli.main(argv.replace('TAKEN', port).split())\n"
        f"    heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "    answers.append([status, err.getvalue().replace(port, 'TAKEN'), heavy])\n"
        "print(json.dumps(answers))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *cases], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for (argv, fragment), (status, err, heavy) in zip(cases.items(), json.loads(done.stdout), strict=True):
        assert (status, heavy) == (2, []), (argv, err, heavy)
        assert err.startswith("verispec: error: ") and err.count("\n") == 1 and fragment in err, (argv, err)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--drafter", "none", "--tree-width", "2", "--tree-depth", "2"], "token trees need the"),
        (["--drafter", "ngram", "--tree-width", "2", "--tree-depth", "2", "--tree-nodes", "3"], "dynamic"),
        (["--k", "3", "--tree-width", "2", "--tree-depth", "2"], "--k is not used with a token tree"),
        (["--target", ""], "--target is empty"),  # not the default model
        (["--draft", " "], "--draft is empty"),
    ],
)
def test_tree_mistakes_are_refused_before_a_model_loads(capsys, monkeypatch, argv, fragment):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr("verispec.resolve._load", load)
    status, out, err = run(capsys, "generate", "a prompt", *argv)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("verispec: error: ") and fragment in err


@pytest.mark.parametrize("argv", [["generate", "  "], ["demo", "--prompt", ""], ["demo", "--prompt", "\n"]])
def test_an_empty_prompt_is_refused_before_a_model_loads(capsys, monkeypatch, argv):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr("verispec.resolve._load", load)
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == "" and err == "verispec: error: the prompt is empty\n"


def test_demo_on_a_model_without_a_chat_template_takes_its_prompt_as_it_is(capsys, shared_model):
    """A llama2.c target has no chat template: the demo's prompt is then plain text, not a user's message."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    status, out, err = run(capsys, "demo", "--prompt", "Once upon a time", "--max-new-tokens", "8", *model)
    assert status == 0 and "error" not in err
    assert "--- none ---" in out and "identical to none: yes" in out
    assert (
        "the median of 3 runs each, in turns:" in out
    )  # issue 52: one run each said little on a busy machine


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--max-batch", "99999999999999999999"],
            "argument --max-batch: 99999999999999999999 is out of range (at most 2**63 - 1 in size)",
        ),
        (["--threads", "4096"], "--threads must be an integer in [1, 1024], got 4096"),
        (["--seed", "-1"], "seed must be an integer in [0, 2**63), got -1"),
    ],
)
def test_integers_beyond_what_they_count_are_one_line(capsys, argv, message):
    """An integer beyond 64 bits, a thread count beyond any machine, a negative seed: one line, exit 2."""
    command = ["serve"] if argv[0] == "--max-batch" else ["generate", "x", "--temperature", "1"]
    status, out, err = run(capsys, *command, *argv)
    assert status == 2 and out == "" and err == f"verispec: error: {message}\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_trace_that_cannot_be_written_is_refused_before_anything_runs(capsys, monkeypatch):
    """/proc takes no new files, even for root (whom access() lets write anywhere): found out before a
    model loads, not after the text was generated."""

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the trace's path was checked")

    monkeypatch.setattr("verispec.resolve._load", load)
    status, out, err = run(capsys, "generate", "x", "--trace", "/proc/verispec-trace.html")
    assert (
        status == 2
        and out == ""
        and err.startswith("verispec: error: cannot write /proc/verispec-trace.html")
    )


def test_running_out_of_memory_is_one_line_asking_for_less(capsys, monkeypatch):
    """A count or size this machine cannot hold (torch's allocator refuses it, or Python's): one line, exit
    2, not an internal error to report; another RuntimeError stays one."""
    for error, status in (
        (RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory"), 2),
        (MemoryError(), 2),
        (RuntimeError("something else"), 1),
    ):

        def fail(args, error=error):
            raise error

        monkeypatch.setattr("verispec.cli.generate.run_generate", fail)
        got, out, err = run(capsys, "generate", "x")
        assert got == status and out == "" and err.count("\n") == 1
        if status == 2:
            assert err.startswith("verispec: error: out of memory (") and err.endswith("): ask for less\n")
        else:
            assert err.startswith("verispec: internal error: RuntimeError: something else")


def test_max_new_tokens_beyond_the_context_is_a_warning(capsys, shared_model):
    """More new tokens than the target's context leaves: one warning naming the limit, and the output stops
    at the context."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    status, out, err = run(capsys, "generate", "Once", "--max-new-tokens", "100000", "--json", *model)
    (warning,) = [line for line in err.splitlines() if "warning" in line]
    limit = int(re.search(r"at most (\d+) new tokens", warning).group(1))
    assert status == 0 and warning.startswith("verispec: warning: --max-new-tokens 100000 is more than")
    result = json.loads(out)
    assert result["stats"]["stop_reason"] in ("context", "eos") and len(result["token_ids"]) <= limit


def _has(parser, flag: str) -> bool:
    return any(flag in action.option_strings for action in parser._actions)


def test_threads_on_every_command_that_runs_a_model(capsys, shared_model, monkeypatch):
    """--threads N on generate, demo, batch and serve: refused below 1 before a model loads; torch's count
    otherwise, and the same tokens on one thread as on two (outputs never depend on it)."""
    import torch

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("verispec.resolve._load", no_load)
    for command in (["generate", "x"], ["demo"], ["batch", "--input", "a", "--output", "b"], ["serve"]):
        status, out, err = run(capsys, *command, "--threads", "0")
        assert status == 2 and err == "verispec: error: --threads must be an integer in [1, 1024], got 0\n", (
            command
        )
    commands = COMMANDS  # name -> its parser
    overlap = commands["viz"]._subparsers._group_actions[0].choices["overlap"]
    with_threads = {
        name for name, sub in [*commands.items(), ("viz overlap", overlap)] if _has(sub, "--threads")
    }
    assert with_threads == {
        "generate", "batch", "demo", "viz overlap", "bench", "bench-load", "serve", "bench-serve",
        "bench-suffix-cache", "calibrate", "drafter-data", "train-drafter", "bench-gguf",
    }  # fmt: skip
    monkeypatch.undo()
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in ("1", "2"):
            status, out, _ = run(
                capsys, "generate", "Once upon a time", "--threads", threads, "--json", *model
            )
            assert status == 0 and torch.get_num_threads() == int(threads)
            outputs.append(json.loads(out)["token_ids"])
        assert outputs[0] == outputs[1]
    finally:
        torch.set_num_threads(before)


def test_the_demo_says_why_a_drafter_ran_slower():
    """From the run's own stats: a round's cost in plain steps (each a whole plain round), split into
    verifying, drafting and the rest, and what it committed; a drafter that never drafted says so."""
    plain = {"total_seconds": 1.1, "prefill_seconds": 0.1, "target_calls": 100}  # a plain step: 10 ms
    stats = {"target_calls": 50, "target_seconds": 0.65, "draft_seconds": 0.5, "tokens_per_target_call": 1.6}
    stats |= {"total_seconds": 1.3, "prefill_seconds": 0.1, "drafted": 40}  # 24 ms a round
    line = why_slower(stats, plain)
    assert (
        "a round cost 2.40 plain steps (1.30 verifying, 1.00 drafting, 0.10 the rest) and committed 1.60"
        in line
    )
    assert "drafted nothing" not in line and "\n" not in line
    idle = {"target_calls": 100, "target_seconds": 0.95, "draft_seconds": 0.0, "tokens_per_target_call": 1.0}
    idle |= {"total_seconds": 1.15, "prefill_seconds": 0.1, "drafted": 0}
    line = why_slower(idle, plain)
    assert "a round cost 1.05 plain steps (0.95 verifying, 0.00 drafting, 0.10 the rest)" in line
    assert "it drafted nothing" in line


def test_generate_without_a_prompt_says_how_to_give_one(capsys, monkeypatch):
    """Issue 52: an empty standard input (a script's /dev/null) was "the prompt is empty"."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    status, out, err = run(capsys, "generate")
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("verispec: error: no prompt: standard input was empty; give PROMPT")


def test_the_summary_says_what_was_drafted_why_it_stopped_and_what_its_time_holds(
    capsys, shared_model, monkeypatch
):
    """Issue 52: the line on stderr after a generation names the tokens drafted and accepted and the stop
    reason, and says that its time (and tokens/s, as --json's) includes the prefill; a constraint's setup
    (slowed here by half a second) is timed apart, before the generation's clock starts."""
    from verispec import api
    from verispec.grammar.matcher import start_state

    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    status, out, err = run(capsys, "generate", "Once upon a time", "--draft", "layers:2", "--k", "3", *model,
                           "--max-new-tokens", "24")  # fmt: skip
    (summary,) = err.splitlines()
    found = re.fullmatch(
        r"\[model, k=3\] 24 tokens in [\d.]+ s, prefill [\d.]+ s included: [\d.]+ tokens/s, [\d.]+ "
        r"tokens per target call; (\d+) drafted, (\d+) accepted \([\d.]+\); stopped by --max-new-tokens",
        summary,
    )
    assert found, summary
    assert int(found.group(2)) <= int(found.group(1)) and int(found.group(1)) > 0

    def slow_setup(constraint, tokenizer):
        time.sleep(0.5)
        return start_state(constraint, tokenizer)

    monkeypatch.setattr(api, "start_state", slow_setup)
    status, out, err = run(
        capsys, "generate", "Once upon a time", "--regex", "[a-z ]{4,12}", "--json", *model
    )
    stats = json.loads(out)["stats"]
    assert status == 0 and stats["grammar_seconds"] >= 0.5  # before the generation's clock starts
    status, out, err = run(capsys, "generate", "Once upon a time", "--regex", "[a-z ]{4,12}", *model)
    assert status == 0 and re.search(r"; grammar setup [\d.]+ s before it$", err.strip()), err


def test_an_instruct_model_that_ends_at_once_without_chat_gets_a_hint(capsys, monkeypatch):
    """Issue 52: an instruct model (one with a chat template) given a plain prompt may end at once; the
    command says why and what to add, and only then."""
    from types import SimpleNamespace

    from verispec.cli import generate

    monkeypatch.setattr("verispec.models.base.has_chat_template", lambda tokenizer: True)
    speculator = SimpleNamespace(tokenizer=None)
    ended = {"stop_reason": "eos", "new_tokens": 1}
    generate._chat_hint(SimpleNamespace(chat=False), speculator, ended)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "verispec: warning: the model ended at once, after 1 token: it is an instruct model (it has a chat"
    )
    assert line.endswith("add --chat to wrap the prompt in a user's turn")
    for chat, stats in ((True, ended), (False, {"stop_reason": "eos", "new_tokens": 30}),
                        (False, {"stop_reason": "max_new_tokens", "new_tokens": 2})):  # fmt: skip
        generate._chat_hint(SimpleNamespace(chat=chat), speculator, stats)
        assert capsys.readouterr().err == ""
    monkeypatch.setattr("verispec.models.base.has_chat_template", lambda tokenizer: False)  # llama2.c
    generate._chat_hint(SimpleNamespace(chat=False), speculator, ended)
    assert capsys.readouterr().err == ""


def test_the_demo_says_when_the_machine_was_busy():
    """Issue 52: a demo on a busy machine (ngram 9.09x in one run, 0.11x in the next) said nothing of it:
    plain decoding's step varying across its runs says so; a steady one says nothing."""
    steady = [{"total_seconds": 1.1 + d, "prefill_seconds": 0.1, "target_calls": 100} for d in (0, 0.05, 0.1)]
    assert busy_machine(steady) == ""
    busy = [*steady[:2], {"total_seconds": 4.1, "prefill_seconds": 0.1, "target_calls": 100}]
    line = busy_machine(busy)
    assert line.startswith(
        "this machine was busy: a plain decoding step took 10.0 to 40.0 ms across the 3 runs"
    )
    assert "speedups above are rough" in line and "\n" not in line
