"""Token-fate traces rendered as one self-contained HTML file, or as text for a terminal.

HTML (:func:`trace_html`, :func:`write_trace_html`): no network, no script — inline CSS only, and a
Content-Security-Policy that forbids loading anything. Each generated token is one
``<span class="tok KIND">`` (KIND: accepted, recovered, bonus, or plain: the token of a round that drafted
nothing, a plain decoding step, which the trace records as a bonus token) with data attributes
``data-token-id``, ``data-round`` (0-based), ``data-p``, ``data-q``, ``data-accept`` (the last two empty
where undefined) and a tooltip (``data-tip``, shown on hover by CSS) with p(x), q(x) and the acceptance
probability; the tokens of a round sit in one ``<span class="round">``, drawn with a boundary after it. A
recovered token is preceded by the draft token it replaced, struck through (``<s class="rejected">``, hidden
by a checkbox). A header gives the run's stats and the count of each kind, and a strip shows each round's
tokens as a column of coloured cells.
All token text is escaped.

Terminal (:func:`trace_terminal`): with ``colour``, ANSI colours — accepted green, recovered blue, bonus
amber, plain steps dim, rejected draft tokens struck through in red. Without (stdout is not a terminal),
markers::

    plain text  accepted draft token      [text]  recovered token
    {text}      bonus token               ~text~  rejected draft token (before the token that replaced it)
    <text>      plain step (nothing drafted)

Either way a token without text of its own (a special token, or a byte that only starts a UTF-8 character)
is shown as ⟨id⟩, a newline as ↵ (followed by the line break, except in a rejected draft token), and every
round ends with its recovered, bonus or plain step's token.
"""

from __future__ import annotations

import html
import itertools
import os
import string
from collections import Counter
from pathlib import Path

from verispec.files import atomic_write
from verispec.trace import FATES, TokenFate, TokenProbs, Trace
from verispec.viz.figures import COLOURS

__all__ = ["KINDS", "token_kinds", "trace_html", "trace_terminal", "write_trace_html"]

KINDS = (*FATES, "plain")  # how a generated token is shown: its fate, or "plain" for a plain step's token
FATE_NAMES = {
    "accepted": "accepted draft token",
    "recovered": "recovered token",
    "bonus": "bonus token",
    "plain": "plain step (nothing drafted)",
}

_ANSI = {"accepted": "\x1b[32m", "recovered": "\x1b[1;34m", "bonus": "\x1b[1;33m", "plain": "\x1b[2m",
         "rejected": "\x1b[2;9;31m"}  # fmt: skip
_ANSI_RESET = "\x1b[0m"
_PLAIN = {"accepted": "{}", "recovered": "[{}]", "bonus": "{{{}}}", "plain": "<{}>", "rejected": "~{}~"}
_KIND_NAMES = {**FATE_NAMES, "rejected": "rejected draft token"}

_CELL = 9  # px: one token in the rounds strip

_CSS = """
body { font: 15px/1.5 system-ui, sans-serif; margin: 1.5em auto; max-width: 60em; padding: 0 1em;
       color: #222; background: #fff; }
h1 { font-size: 1.3em; margin: 0 0 .5em; }
h2 { font-size: 1em; margin: 1.2em 0 .3em; color: #555; }
dl.stats { display: flex; flex-wrap: wrap; gap: .3em 1.4em; margin: 0; }
dl.stats div { display: flex; gap: .4em; }
dt { color: #666; } dd { margin: 0; font-weight: 600; }
.legend { margin: .8em 0; display: flex; flex-wrap: wrap; gap: .4em 1.2em; align-items: center; }
.key { padding: 0 .4em; border-radius: 3px; }
pre.prompt { white-space: pre-wrap; color: #666; background: #f6f6f6; padding: .5em; margin: 0; }
.text { white-space: pre-wrap; font: 15px/1.9 ui-monospace, monospace; word-break: break-word; }
.round { border-right: 2px solid #888; margin-right: 1px; }
.tok, .rejected { position: relative; border-radius: 2px; }
.accepted { background: ${accepted}33; border-bottom: 2px solid $accepted; }
.recovered { background: ${recovered}33; border-bottom: 2px solid $recovered; }
.bonus { background: ${bonus}33; border-bottom: 2px solid $bonus; }
.plain { background: ${plain}33; border-bottom: 2px solid $plain; }
.rejected { color: $rejected; font-size: .75em; text-decoration: line-through; }
.empty { color: #888; font-style: italic; }
.tok:hover, .rejected:hover { outline: 1px solid #222; }
.tok:hover::after, .rejected:hover::after {
  content: attr(data-tip); position: absolute; left: 0; top: 1.8em; z-index: 10; white-space: pre;
  background: #222; color: #fff; font: 12px/1.4 ui-monospace, monospace; padding: .4em .6em;
  border-radius: 4px; text-decoration: none; pointer-events: none; }
#show-rejected:not(:checked) ~ .text .rejected { display: none; }
svg.strip { display: block; margin: .3em 0; max-width: 100%; height: auto; }
.caption { font-size: .85em; color: #666; margin: 0; }
footer { margin-top: 1.5em; font-size: .85em; color: #555; }
"""


def token_kinds(trace: Trace) -> list[str]:
    """Each generated token's kind (:data:`KINDS`), in order: its fate, but "plain" for a bonus token alone
    in its round — a round that drafted nothing (K = 0, or no proposal) is a plain decoding step."""
    sizes = Counter(t.round for t in trace.tokens)
    return ["plain" if t.fate == "bonus" and sizes[t.round] == 1 else t.fate for t in trace.tokens]


def _rounds(trace: Trace) -> list[list[tuple[TokenFate, str]]]:
    """The tokens of each round with their kinds."""
    pairs = zip(trace.tokens, token_kinds(trace), strict=True)
    return [list(group) for _, group in itertools.groupby(pairs, key=lambda pair: pair[0].round)]


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _header_items(trace: Trace) -> list[tuple[str, str]]:
    """The run's stats and settings, as (name, value) pairs for the header of either rendering."""
    s = trace.stats
    return [
        ("tokens", str(s["new_tokens"])),
        ("target calls", str(s["target_calls"])),
        ("τ (tokens per call)", f"{s['tokens_per_target_call']:.2f}"),
        ("acceptance", f"{s['acceptance_rate']:.2f} ({s['accepted']}/{s['drafted']} drafted)"),
        ("tokens/s", f"{s['tokens_per_second']:.1f}"),
        ("drafter", str(s["drafter"])),
        ("k", str(s["k"])),
        *trace.settings,
        ("stop", str(s["stop_reason"])),
    ]


def _probs_line(name: str, probs: TokenProbs) -> str:
    line = f"p({name}) = {_fmt(probs.p)}"
    if probs.p_softmax is not None:
        line += f" (greedy; softmax {_fmt(probs.p_softmax)})"
    return line + ("" if probs.q is None else f"   q({name}) = {_fmt(probs.q)}")


def _tip(t: TokenFate, kind: str) -> str:
    """The hover text of a generated token of ``kind``."""
    lines = [f"{t.token.text!r} (id {t.token.token_id}): {FATE_NAMES[kind]}, round {t.round + 1}"]
    lines.append(_probs_line("x", t.token))
    if kind == "plain":
        lines.append("nothing drafted this round: x ~ p, as plain decoding")
    elif t.fate == "bonus":
        lines.append("all drafted tokens accepted: x ~ p")
    elif t.fate == "accepted":
        lines.append(f"accept prob min(1, p/q) = {_fmt(t.accept_prob)}")
    else:
        assert t.rejected is not None  # a recovered token: TokenFate makes it carry the rejected draft token
        lines.append(f"replaced draft {t.rejected.text!r}: {_probs_line('draft', t.rejected)}")
        lines.append(f"rejected with accept prob min(1, p/q) = {_fmt(t.accept_prob)}")
        lines.append("x ~ residual (p - q)+, normalized")
    return "\n".join(lines)


def _rejected_tip(t: TokenFate) -> str:
    """The hover text of the rejected draft token of a recovered token."""
    r = t.rejected
    assert r is not None  # a recovered token: TokenFate makes it carry the rejected draft token
    return "\n".join(
        [
            f"{r.text!r} (id {r.token_id}): rejected draft token, round {t.round + 1}",
            _probs_line("x", r),
            f"accept prob min(1, p/q) = {_fmt(t.accept_prob)}",
        ]
    )


def _shown(probs: TokenProbs, line_breaks: bool = True) -> tuple[str, str]:
    """(text to show, extra class): ⟨id⟩ for an empty text, and a visible ↵ for a newline, followed by the
    line break itself when ``line_breaks``."""
    if not probs.text:
        return f"⟨{probs.token_id}⟩", " empty"
    return probs.text.replace("\n", "↵\n" if line_breaks else "↵"), ""


def _token_html(t: TokenFate, kind: str) -> str:
    parts = []
    if t.rejected is not None:
        shown, extra = _shown(t.rejected, line_breaks=False)
        tip = html.escape(_rejected_tip(t))
        parts.append(f'<s class="rejected{extra}" data-tip="{tip}">{html.escape(shown)}</s>')
    shown, extra = _shown(t.token)
    attrs = {
        "data-token-id": str(t.token.token_id),
        "data-round": str(t.round),
        "data-p": _fmt(t.token.p),
        "data-q": _fmt(t.token.q),
        "data-accept": _fmt(t.accept_prob),
        "data-tip": _tip(t, kind),
    }
    attr_text = " ".join(f'{k}="{html.escape(v)}"' for k, v in attrs.items())
    parts.append(f'<span class="tok {kind}{extra}" {attr_text}>{html.escape(shown)}</span>')
    return "".join(parts)


def _strip_svg(trace: Trace) -> str:
    """An inline SVG: one column per round, one cell per emitted token (coloured by kind) from the bottom,
    a red cell on top of a round whose draft was rejected."""
    rounds = _rounds(trace)
    height = max((len(r) + (r[-1][1] == "recovered") for r in rounds), default=1)
    cells = []
    for i, tokens in enumerate(rounds):
        fates = [kind for _, kind in tokens] + (["rejected"] if tokens[-1][1] == "recovered" else [])
        for j, fate in enumerate(fates):
            x, y = i * _CELL, (height - 1 - j) * _CELL
            cells.append(
                f'<rect x="{x}" y="{y}" width="{_CELL - 1}" height="{_CELL - 1}" fill="{COLOURS[fate]}"/>'
            )
    width, tall = max(len(rounds), 1) * _CELL, height * _CELL
    return (
        f'<svg class="strip" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{tall}" '
        f'viewBox="0 0 {width} {tall}" role="img" aria-label="tokens per round">{"".join(cells)}</svg>'
    )


def trace_html(trace: Trace) -> str:
    """The trace as one self-contained HTML document (see the module doc)."""
    css = string.Template(_CSS).substitute(COLOURS)
    stats = "".join(
        f"<div><dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd></div>" for k, v in _header_items(trace)
    )
    counts = Counter(token_kinds(trace))
    legend = "".join(
        f'<span><span class="key {kind}">{FATE_NAMES[kind]}</span> × <b id="count-{kind}">'
        f"{counts[kind]}</b></span>"
        for kind in KINDS
    )
    legend += '<span><s class="key rejected">rejected draft token</s></span>'
    body = "".join(
        f'<span class="round" data-round="{tokens[0][0].round}">'
        f"{''.join(_token_html(t, kind) for t, kind in tokens)}</span>"
        for tokens in _rounds(trace)
    )
    greedy = any(t.token.p_softmax is not None for t in trace.tokens)
    note = (
        "At temperature 0 the verifier's p is the point mass on the target's argmax (p(x) is 1 or 0) and q "
        "the point mass on the draft's guess; the softmax at temperature 1 is shown beside p."
        if greedy
        else "p is the target's distribution and q the draft's, both after the same temperature / top-k / "
        "top-p / min-p transform; a drafter without probabilities (n-gram) has q = 1 on its guess."
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>verispec token-fate trace</title>
<style>{css}</style>
</head>
<body>
<header>
<h1>verispec token-fate trace</h1>
<dl class="stats">{stats}</dl>
<div class="legend">{legend}</div>
</header>
<main>
<h2>prompt</h2>
<pre class="prompt">{html.escape(trace.prompt)}</pre>
<h2>tokens per round (one column per target call)</h2>
{_strip_svg(trace)}
<p class="caption">from the bottom: accepted (green), then recovered (blue) or bonus (amber); a red cell on
top marks the rejected draft token that the recovered token replaced; a grey cell alone, a plain step</p>
<h2>generated text (hover a token for p, q and its acceptance probability)</h2>
<input type="checkbox" id="show-rejected" checked>
<label for="show-rejected">show rejected draft tokens</label>
<div class="text" id="trace">{body}</div>
</main>
<footer>Each round drafts tokens, the target scores them in one call, and the verifier keeps a prefix
(accepted, accept prob min(1, p/q)), then emits one recovered token (sampled from the residual (p − q)⁺ after
a rejection) or one bonus token (sampled from p after a fully accepted draft); a round that drafted nothing
is a plain step (its token sampled from p, as plain decoding). A grey bar ends each round.
{html.escape(note)}</footer>
</body>
</html>
"""


def write_trace_html(trace: Trace, path: str | os.PathLike) -> Path:
    """Write :func:`trace_html` to ``path`` atomically (one-line UsageError when it cannot be written)."""
    document = trace_html(trace)
    return atomic_write(path, document)


def trace_terminal(trace: Trace, colour: bool) -> str:
    """The trace as terminal text: a header line, a legend, then the generated text marked by fate, with
    ANSI colours when ``colour`` else the plain markers of the module doc."""

    def mark(kind: str, text: str) -> str:
        return f"{_ANSI[kind]}{text}{_ANSI_RESET}" if colour else _PLAIN[kind].format(text)

    def token(kind: str, probs: TokenProbs) -> str:
        return mark(kind, _shown(probs, line_breaks=kind != "rejected")[0])

    header = ", ".join(f"{k} {v}" for k, v in _header_items(trace))
    legend = "  ".join(mark(kind, name) for kind, name in _KIND_NAMES.items())
    kinds = token_kinds(trace)
    counts = ", ".join(f"{kinds.count(kind)} {kind}" for kind in KINDS)
    text = []
    for t, kind in zip(trace.tokens, kinds, strict=True):
        if t.rejected is not None:
            text.append(token("rejected", t.rejected))
        text.append(token(kind, t.token))
    return f"{header}\n{legend}  ({counts})\n\n{''.join(text)}\n"
