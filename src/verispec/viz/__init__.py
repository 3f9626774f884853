"""Pictures of speculative decoding, drawn from real runs and from the analytic model.

- :mod:`verispec.viz.overlap` — the p/q overlap picture of one next-token position (PNG and SVG).
- :mod:`verispec.viz.trace` — token-fate traces as one self-contained HTML file or as terminal text.
- :mod:`verispec.viz.charts` — the simulation charts of ``verispec simulate --plot``.
- :mod:`verispec.viz.figures` — the shared matplotlib style and PNG + SVG output.

Every file is written atomically (:mod:`verispec.files`): an output path that cannot be written raises a
one-line UsageError and leaves nothing half-written. Figures use matplotlib's object-oriented API (no pyplot,
no display, no global backend).
"""

from __future__ import annotations

__all__ = ["visible_text"]


def visible_text(text: str, token_id: int) -> str:
    """A token's text made visible as a label: spaces as ␣, newlines as ↵, tabs as →, other control
    characters as their code, and an empty text (a special token, or a byte that only starts a UTF-8
    character) as ⟨id⟩."""
    if not text:
        return f"⟨{token_id}⟩"
    marks = {" ": "␣", "\n": "↵", "\t": "→"}
    return "".join(marks.get(c, c if c.isprintable() else f"\\x{ord(c):02x}") for c in text)
