"""Pictures of speculative decoding, drawn from real runs and from the analytic model.

- :mod:`verispec.viz.overlap` — the p/q overlap picture of one next-token position (PNG and SVG).
- :mod:`verispec.viz.trace` — token-fate traces as one self-contained HTML file or as terminal text.
- :mod:`verispec.viz.charts` — the simulation charts of ``verispec simulate --plot``.
- :mod:`verispec.viz.figures` — the shared matplotlib style and PNG + SVG output.

Every file is written atomically (a temporary file beside it, then ``os.replace``): an output path that cannot
be written raises a one-line UsageError and leaves nothing half-written. Figures use matplotlib's
object-oriented API (no pyplot, no display, no global backend).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from verispec.errors import UsageError

__all__ = ["check_writable", "visible_text", "write_atomic"]


def check_writable(path: str | os.PathLike) -> Path:
    """``path`` as a Path, if a file can be created there (its directory exists and is writable, and it is
    not a directory); else UsageError. Checked before a long computation whose result goes there."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"cannot write {path}: it is a directory")
    if not parent.is_dir():
        raise UsageError(f"cannot write {path}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {path}: directory {parent} is not writable")
    return path


def write_atomic(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Create ``path`` atomically: ``write(temporary_path)`` fills a temporary file in the same directory,
    which then replaces ``path`` (what ``write`` returns is ignored). An OSError becomes a one-line
    UsageError; the temporary file is removed."""
    path = check_writable(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def visible_text(text: str, token_id: int) -> str:
    """A token's text made visible as a label: spaces as ␣, newlines as ↵, tabs as →, other control
    characters as their code, and an empty text (a special token, or a byte that only starts a UTF-8
    character) as ⟨id⟩."""
    if not text:
        return f"⟨{token_id}⟩"
    marks = {" ": "␣", "\n": "↵", "\t": "→"}
    return "".join(marks.get(c, c if c.isprintable() else f"\\x{ord(c):02x}") for c in text)
