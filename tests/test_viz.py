"""The pictures: the overlap decomposition and its figure, the simulation charts, the HTML and terminal traces
(static checks; the browser checks are in test_trace_browser.py), atomic output and the command lines."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from verispec import cli
from verispec.costs.analytic import acceptance_rate
from verispec.costs.simulate import SimulationConfig, simulate
from verispec.viz import visible_text
from verispec.viz.charts import CHARTS, simulation_charts
from verispec.viz.figures import COLOURS, figure_paths, save_figure
from verispec.viz.overlap import next_token_distributions, overlap_bars, overlap_figure
from verispec.viz.trace import trace_html, trace_terminal, write_trace_html
from viz_helpers import Elements, assert_picture, has_colour, toy_trace

TOY_P, TOY_Q = (0.5, 0.3, 0.2), (0.2, 0.3, 0.5)


def random_pair(seed: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(vocab, 0.3)), rng.dirichlet(np.full(vocab, 0.3))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


# ---------------------------------------------------------------------------------------------- overlap


@pytest.mark.parametrize(("seed", "vocab", "top"), [(0, 3, 3), (1, 40, 10), (2, 512, 12), (3, 5, 1)])
def test_overlap_bars_decompose_p_and_q(seed, vocab, top):
    p, q = random_pair(seed, vocab)
    bars = overlap_bars(p=p, q=q, top=top)
    alpha = acceptance_rate(p=p, q=q)
    assert bars.alpha == alpha
    assert bars.green.sum() == pytest.approx(alpha, abs=1e-12)
    assert bars.red.sum() == pytest.approx(1 - alpha, abs=1e-12)
    assert bars.blue.sum() == pytest.approx(1 - alpha, abs=1e-12)
    np.testing.assert_allclose(bars.green + bars.blue, bars.p, atol=1e-15)
    np.testing.assert_allclose(bars.green + bars.red, bars.q, atol=1e-15)
    assert bars.rest == vocab - min(top, vocab) and len(bars.p) == min(top, vocab) + (bars.rest > 0)
    shown = np.maximum(p, q)[list(bars.tokens)]
    assert list(shown) == sorted(shown, reverse=True)
    assert bars.residual.sum() == pytest.approx(1.0)


def test_overlap_figure_draws_the_numbers_of_acceptance_rate():
    """The heights of the drawn green, red and blue bars add up to α, 1 − α, 1 − α, and the title says α."""
    p, q = random_pair(5, 30)
    alpha = acceptance_rate(p=p, q=q)
    fig = overlap_figure(p=p, q=q, top=8, title="random")
    top_ax = fig.axes[0]
    heights = {gid: sum(r.get_height() for r in top_ax.patches if r.get_gid() == gid) for gid in COLOURS}
    assert heights["accepted"] == pytest.approx(2 * alpha)  # green under the p bar and under the q bar
    assert heights["rejected"] == pytest.approx(1 - alpha)
    assert heights["residual"] == pytest.approx(1 - alpha)
    assert f"α = Σ min(p, q) = {alpha:.4f}" in top_ax.get_title()


def test_identical_distributions_have_nothing_to_reject():
    bars = overlap_bars(p=[0.25] * 4, q=[0.25] * 4, top=2)
    assert bars.alpha == 1.0 and not bars.residual.any()
    overlap_figure(p=[0.25] * 4, q=[0.25] * 4)  # draws without dividing by zero


@pytest.mark.parametrize(
    ("p", "q", "message"),
    [
        ((0.5, 0.3, 0.3), TOY_Q, "p must sum to 1"),
        (TOY_P, (0.5, -0.5, 1.0), "q must be finite and non-negative"),
        ((0.5, float("nan"), 0.5), TOY_Q, "p must be finite and non-negative"),
        ((), (), "V >= 1"),
        ((0.5, 0.5), TOY_Q, "same length"),
        (((0.5, 0.5), (0.5, 0.5)), ((0.5, 0.5), (0.5, 0.5)), "same length"),
        (("a", "b"), (0.5, 0.5), "lists of numbers"),
    ],
)
def test_distributions_are_validated(p, q, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        overlap_bars(p=p, q=q, top=2)
    with pytest.raises(ValueError, match="top"):
        overlap_bars(p=TOY_P, q=TOY_Q, top=0)


def test_figure_files_are_pictures(tmp_path):
    p, q = random_pair(7, 50)
    png, svg = save_figure(overlap_figure(p=p, q=q, top=10), tmp_path / "overlap")
    assert (png.name, svg.name) == ("overlap.png", "overlap.svg")
    rgb = assert_picture(png, 600, 500)
    for colour in ("accepted", "rejected", "residual"):
        assert has_colour(rgb, COLOURS[colour]), colour
    text = svg.read_text()
    assert text.startswith("<?xml") and "<svg" in text and "α = Σ min(p, q)" in text
    assert sorted(os.listdir(tmp_path)) == ["overlap.png", "overlap.svg"]  # no temporary file left


def test_figure_paths(tmp_path):
    for out in ("x.png", "x.svg", "x"):
        assert figure_paths(tmp_path / out) == (tmp_path / "x.png", tmp_path / "x.svg")
    with pytest.raises(ValueError, match="must end in .png or .svg"):
        figure_paths(tmp_path / "x.jpg")
    with pytest.raises(ValueError, match="no directory"):
        figure_paths("/nonexistent-verispec-dir/x.png")


def test_next_token_distributions_refuse_a_draft_with_another_vocabulary():
    from fakes import TableLM
    from verispec.options import SamplingParams

    with pytest.raises(ValueError, match="share the target's vocabulary"):
        next_token_distributions(TableLM(6, seed=0), TableLM(7, seed=0), [1, 2], SamplingParams())
    p, q = next_token_distributions(TableLM(6, seed=0), TableLM(6, seed=1), [1, 2], SamplingParams())
    assert p.shape == q.shape == (6,) and p.sum() == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------- output


def test_visible_text():
    assert visible_text(" a\nb\tc", 5) == "␣a↵b→c"
    assert visible_text("", 7) == "⟨7⟩"
    assert visible_text("\x00", 0) == "\\x00"


# ---------------------------------------------------------------------------------------------- charts


def test_simulation_charts(tmp_path):
    result = simulate(SimulationConfig(ks=(1, 3), agreements=(0.5, 0.9), rounds=2000, seed=1))
    paths = simulation_charts(result, tmp_path / "charts")
    assert [p.name for p in paths] == [f"{name}.{ext}" for name in CHARTS for ext in ("png", "svg")]
    for path in paths:
        if path.suffix == ".png":
            assert_picture(path, 500, 400)
        else:
            assert "<svg" in path.read_text()


def test_simulate_plot_command(tmp_path, capsys):
    status, out, err = run(
        capsys, "simulate", "--k", "1,2", "--agreement", "0.7", "--rounds", "500", "--plot", tmp_path / "c"
    )
    assert status == 0 and "agreement" in out and "charts written" in err
    assert sorted(os.listdir(tmp_path / "c")) == sorted(f"{n}.{e}" for n in CHARTS for e in ("png", "svg"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, out, err = run(capsys, "simulate", "--rounds", "500", "--plot", blocker)
    assert status == 2 and out == "" and err.startswith("verispec: error: cannot create the chart directory")


# ---------------------------------------------------------------------------------------------- traces


def test_html_trace_is_self_contained_and_escaped(tmp_path):
    document = trace_html(toy_trace())
    parsed = Elements()
    parsed.feed(document)
    tags = {tag for tag, _ in parsed.elements}
    assert not tags & {"script", "img", "link", "iframe", "object"}  # the token text stayed text
    assert not any(k in ("src", "href") or k.startswith("on") for _, a in parsed.elements for k in a)
    assert "default-src 'none'" in document
    tokens = [a for tag, a in parsed.elements if tag == "span" and "tok" in a.get("class", "")]
    assert [a["class"] for a in tokens] == [
        "tok accepted",
        "tok bonus",
        "tok recovered",
        "tok plain",  # alone in its round: nothing was drafted, a plain decoding step
        "tok plain empty",
    ]
    assert parsed.token_texts == ["Hel", "lo", ' <img src=x onerror="alert(1)">', "↵\n", "⟨6⟩"]
    assert [a["data-round"] for a in tokens] == ["0", "0", "1", "2", "3"]
    assert tokens[0]["data-p"] == "0.25" and tokens[0]["data-accept"] == "0.5" and tokens[1]["data-q"] == ""
    assert "p(x) = 0.25" in tokens[2]["data-tip"] and "'&p'" in tokens[2]["data-tip"]
    assert sum(tag == "s" and a["class"] == "rejected" for tag, a in parsed.elements) == 1
    assert "plain step (nothing drafted)" in tokens[3]["data-tip"] and "bonus token" in tokens[1]["data-tip"]
    assert '<b id="count-bonus">1</b>' in document and '<b id="count-plain">2</b>' in document
    assert sum(tag == "span" and a.get("class") == "round" for tag, a in parsed.elements) == 4
    path = write_trace_html(toy_trace(), tmp_path / "t.html")
    assert path.read_text(encoding="utf-8") == document


def test_terminal_trace_plain_markers_and_colours():
    plain = trace_terminal(toy_trace(), colour=False)
    header, legend, blank, *text = plain.split("\n")
    assert header.startswith("tokens 5, target calls 4,") and "target toy" in header
    assert legend.startswith(
        "accepted draft token  [recovered token]  {bonus token}  <plain step (nothing drafted)>  ~rejected"
    )
    assert "(1 accepted, 1 recovered, 1 bonus, 2 plain)" in legend
    assert "\n".join(text) == 'Hel{lo}~&p~[ <img src=x onerror="alert(1)">]<↵\n><⟨6⟩>\n'
    coloured = trace_terminal(toy_trace(), colour=True)
    assert "\x1b[32mHel\x1b[0m" in coloured and "\x1b[2;9;31m&p\x1b[0m" in coloured
    assert "[" not in coloured.split("\n", 3)[3].replace("\x1b[", "")  # no plain markers with colours


# ---------------------------------------------------------------------------------------------- command lines


def test_viz_overlap_toy_command(tmp_path, capsys):
    status, out, err = run(
        capsys,
        "viz",
        "overlap",
        "--p",
        "0.5,0.3,0.2",
        "--q",
        "0.2,0.3,0.5",
        "--labels",
        "a,b,c",
        "--out",
        tmp_path / "o.png",
    )
    assert status == 0 and err == ""
    assert out.splitlines()[0] == "alpha = sum min(p, q) = 0.700000"
    assert_picture(tmp_path / "o.png", 600, 500)
    assert (tmp_path / "o.svg").is_file()
    inside = tmp_path / "pictures"  # a directory: the picture's files go in it
    inside.mkdir()
    assert run(capsys, "viz", "overlap", "--p", "0.5,0.5", "--q", "0.5,0.5", "--out", inside)[0] == 0
    assert sorted(p.name for p in inside.iterdir()) == ["overlap.png", "overlap.svg"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--p", "0.5,0.3,0.3", "--q", "0.2,0.3,0.5"], "p must sum to 1"),
        (["--p", "0.5,0.5", "--q", "0.2,0.3,0.5"], "p and q must be lists of the same length"),
        (["--p", "0.5,0.5", "--q", "1.5,-0.5"], "q must be finite and non-negative"),
        (["--p", "0.5,0.5"], "toy mode needs both --p and --q"),
        (["--p", "0.5,x", "--q", "0.5,0.5"], "expected comma-separated numbers"),
        (["--p", "1", "--q", "1", "--labels", "a,b"], "--labels names 2 tokens"),
        ([], "give either --p and --q"),
        (["--p", "1", "--q", "1", "--prompt", "x"], "give either --p and --q"),
        (["--p", "1", "--q", "1", "--out", "/nonexistent-verispec-dir/o.png"], "cannot write"),
        (["--p", "1", "--q", "1", "--out", "o.pdf"], "must end in .png or .svg"),
        (["--p", "1", "--q", "1", "--top", "0"], "top must be an integer >= 1"),
        (["--p", "1", "--q", "1", "--temperature", "nan"], "temperature must be a number in"),
        (["--p", "1", "--q", "1", "--top-p", "-1"], "top_p must be in (0, 1]"),
        (["--p", "1", "--q", "1", "--temperature", "0.5"], "toy mode draws --p and --q as they are"),
    ],
)
def test_viz_overlap_bad_input(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = run(capsys, "viz", "overlap", *args)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("verispec: error: ") and message in err
    assert os.listdir(tmp_path) == []  # nothing written


@pytest.fixture(scope="module")
def stories_args(shared_model) -> list[str]:
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]


def test_viz_overlap_model_command(stories_args, tmp_path, capsys):
    """The α printed is acceptance_rate of the two models' transformed next-token distributions."""
    from verispec.api import Speculator
    from verispec.options import SamplingParams

    prompt = "Once upon a time, there was a little girl named Lily. She"
    argv = ["viz", "overlap", *stories_args, "--draft", "layers:4", "--prompt", prompt, "--top", "8"]
    status, out, err = run(capsys, *argv, "--temperature", "0.8", "--top-k", "40", "--out", tmp_path / "m")
    assert status == 0, err
    speculator = Speculator(stories_args[1], "layers:4", tokenizer=stories_args[3])
    ids = speculator.encode_prompt(prompt)
    sampling = SamplingParams(temperature=0.8, top_k=40)
    p, q = next_token_distributions(speculator.model, speculator.draft, ids, sampling)
    assert out.splitlines()[0] == f"alpha = sum min(p, q) = {acceptance_rate(p=p, q=q):.6f}"
    assert_picture(tmp_path / "m.png", 800, 500)
    status, out, err = run(capsys, "viz", "overlap", *stories_args, "--draft", "layers:9", "--prompt", "Once")
    assert (
        status == 2
        and "layers:9 needs a target of more layers; this one has 5" in err
        and err.count("\n") == 1
    )


def test_generate_show_trace_and_html_trace(stories_args, tmp_path, capsys):
    """--show-trace prints the plain trace when stdout is not a terminal; --trace writes the HTML file whose
    fates add up to the --json stats."""
    common = ["generate", "Once upon a time", *stories_args, "--draft", "layers:2", "--k", "4"]
    common += ["--temperature", "1", "--seed", "2", "--no-invariant", "--max-new-tokens", "24"]
    status, out, err = run(capsys, *common, "--show-trace")
    assert status == 0 and "\x1b[" not in out
    assert out.startswith("tokens 24, target calls") and "~rejected draft token~" in out
    assert "tokens per target call" in err  # the one-line summary
    status, out, err = run(capsys, *common, "--json", "--trace", tmp_path / "t.html")
    assert status == 0 and f"trace written to {tmp_path / 't.html'}" in err
    stats = json.loads(out)["stats"]
    parsed = Elements()
    parsed.feed((tmp_path / "t.html").read_text(encoding="utf-8"))
    classes = [a["class"].split()[1] for tag, a in parsed.elements if "tok" in a.get("class", "").split()]
    assert len(classes) == stats["new_tokens"] and classes.count("accepted") == stats["accepted"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "/nonexistent-verispec-dir/t.html"], "cannot write /nonexistent-verispec-dir/t.html"),
        (["--show-trace", "--json"], "--show-trace and --json"),
    ],
)
def test_generate_trace_bad_input(stories_args, args, message, capsys):
    status, out, err = run(capsys, "generate", "Once", *stories_args, "--max-new-tokens", "4", *args)
    assert status == 2 and out == "" and err.count("\n") == 1 and message in err
