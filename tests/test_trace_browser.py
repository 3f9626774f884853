"""The HTML token-fate trace, opened in headless Chromium: the rendered DOM has one element per generated
token with the class of its fate, in numbers that match the run's stats, and a screenshot shows the colours.

Chromium is the Debian package ``chromium`` (``make test`` installs it where it can: as root, with apt-get);
where it is absent these tests skip, saying so. No Python browser driver is needed: Chromium's own
``--headless --dump-dom`` and ``--screenshot`` do the work.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from verispec import cli
from verispec.viz.figures import COLOURS
from verispec.viz.trace import KINDS, write_trace_html
from viz_helpers import Elements, assert_picture, has_colour, toy_trace

WINDOW = (1200, 900)
RUNS = {  # name -> extra generate arguments; both sample at temperature 1 with a fixed seed
    "layers2": ["--draft", "layers:2", "--k", "1"],
    "ngram": ["--drafter", "ngram", "--k", "3"],
}


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip(
            "Chromium is not installed, so the HTML trace was not checked in a browser: install the Debian "
            "package chromium (`make test` does so when run as root on a machine with apt-get)"
        )
    return path


def headless(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Run headless Chromium with its own profile directory, no network services and no sandbox (tests may
    run as root)."""
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
    ]
    result = subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def rendered_dom(chromium: str, page: Path, tmp_path: Path) -> Elements:
    dom = headless(chromium, tmp_path / "profile-dom", "--dump-dom", page.as_uri()).stdout
    assert "<html" in dom
    elements = Elements()
    elements.feed(dom)
    return elements


def screenshot(chromium: str, page: Path, tmp_path: Path) -> Path:
    shot = tmp_path / f"{page.stem}.png"
    headless(
        chromium,
        tmp_path / "profile-shot",
        f"--screenshot={shot}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        page.as_uri(),
    )
    return shot


@pytest.fixture(scope="module")
def traces(shared_model, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """name -> (HTML trace, stats) of a real generation on stories260K through ``verispec generate``."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    out = tmp_path_factory.mktemp("traces")
    made = {}
    for name, extra in RUNS.items():
        page = out / f"{name}.html"
        model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
        sampling = ["--temperature", "1", "--seed", "3", "--no-invariant", "--max-new-tokens", "40"]
        prompt = (  # it repeats itself, so that prompt lookup finds two-token matches
            "Once upon a time, there was a little girl named Lily. She liked to play with her ball. "
            "Lily and her mom went to the park. She liked to play"
        )
        argv = ["generate", prompt, *model, *extra, *sampling, "--json", "--trace", str(page)]
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(argv) == 0
        made[name] = (page, json.loads(stdout.getvalue())["stats"])
    return made


@pytest.mark.parametrize("name", RUNS)
def test_rendered_tokens_match_the_stats(chromium, traces, name, tmp_path):
    page, stats = traces[name]
    assert stats["stop_reason"] == "max_new_tokens"  # no end-of-sequence: every round ends with a token
    dom = rendered_dom(chromium, page, tmp_path)
    tokens = [a for tag, a in dom.elements if tag == "span" and "tok" in a.get("class", "").split()]
    fates = [next(c for c in a["class"].split() if c in KINDS) for a in tokens]
    assert len(tokens) == stats["new_tokens"]
    assert fates.count("accepted") == stats["accepted"]
    assert fates.count("recovered") + fates.count("bonus") + fates.count("plain") == stats["target_calls"]
    rejected = [a for tag, a in dom.elements if tag == "s" and a.get("class", "").split()[0] == "rejected"]
    assert len(rejected) == fates.count("recovered")
    rounds = [a for tag, a in dom.elements if tag == "span" and a.get("class") == "round"]
    assert len(rounds) == stats["target_calls"]
    assert sorted({int(a["data-round"]) for a in tokens}) == list(range(stats["target_calls"]))
    for a in tokens:
        assert 0 <= float(a["data-p"]) <= 1 and "p(x) = " in a["data-tip"]
        assert (a["data-accept"] == "") == any(k in a["class"] for k in ("bonus", "plain"))
    if name == "layers2":  # a 2-layer early exit of a 5-layer model: all three fates at temperature 1
        assert {"accepted", "recovered", "bonus"} <= set(fates)


@pytest.mark.parametrize("name", RUNS)
def test_screenshot_is_not_blank(chromium, traces, name, tmp_path):
    page, stats = traces[name]
    rgb = assert_picture(screenshot(chromium, page, tmp_path), *WINDOW)
    source = Elements()
    source.feed(page.read_text(encoding="utf-8"))
    classes = " ".join(a.get("class", "") for tag, a in source.elements if tag == "span")
    for fate in KINDS:  # the colour of every kind in the run is on screen (the strip, the underlines)
        assert has_colour(rgb, COLOURS[fate]) or f"tok {fate}" not in classes, fate


def test_token_text_cannot_become_markup(chromium, tmp_path):
    """A token whose text is an <img onerror> tag stays text in the rendered page."""
    page = write_trace_html(toy_trace(), tmp_path / "toy.html")
    dom = rendered_dom(chromium, page, tmp_path)
    assert not any(tag in ("img", "script") for tag, _ in dom.elements)
    assert ' <img src=x onerror="alert(1)">' in dom.token_texts
