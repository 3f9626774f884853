"""Files written atomically, the one way verispec writes a file that must never be seen half-written.

A temporary file beside the target is filled, then renamed over it (``os.replace``): a reader sees the old
file or the new one, never part of either, and a failure leaves the old file and no temporary file. A
symbolic link's target is what is written (the link stays); a device, a pipe or a socket is refused, never
replaced by a file. The new
file gets the permissions a plain ``open(path, "w")`` would give it: an existing file's own mode, else
0o666 less the umask (never ``mkstemp``'s 0o600, nor the 0o600 some libraries create their files with),
unless the caller gives a ``mode`` (a secret's 0o600: the temporary file has it from its creation on).
An OSError is a one-line UsageError naming the path.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from verispec.errors import UsageError

__all__ = ["atomic_path", "atomic_write", "check_writable"]


def check_writable(path: str | os.PathLike, suffix: str | None = None) -> Path:
    """The Path a file given as ``path`` is written to (a symbolic link's target: the link stays, the file it
    names is written, as ``open()`` would), if a file can be created there (its directory exists and is
    writable, and it is not a directory, nor a device, a pipe or a socket, which a rename would replace) and
    it ends in ``suffix`` (None: any); else UsageError. Checked before a long computation whose result goes
    there."""
    given = Path(path)
    if suffix is not None and given.suffix != suffix:
        raise UsageError(f"the output file must end in {suffix}, got {given.name}")
    path = Path(os.path.realpath(given)) if given.is_symlink() else given
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"cannot write {given}: it is a directory")
    if path.exists() and not path.is_file():
        raise UsageError(f"cannot write {given}: not a regular file (a device, a pipe or a socket)")
    if not parent.is_dir():
        raise UsageError(f"cannot write {path}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {path}: directory {parent} is not writable")
    try:  # what access() cannot tell: a file system that takes no files (/proc, even for root), a full one
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """A temporary path beside ``path`` (an empty file, same suffix) for the body of the ``with`` to write,
    by itself or through a library that writes to a path (safetensors' ``save_file``, ``torch.save``,
    matplotlib's ``savefig``); when the body returns, the file gets plain ``open()``'s permissions (or
    ``mode``, given) and replaces ``path``. If the body raises, ``path`` is untouched and the temporary file
    removed; an OSError becomes a one-line UsageError."""
    path = check_writable(path)
    try:
        created = 0o666 if mode is None else 0o600  # the umask applies; a mode given: nobody else's meanwhile
        if mode is None and path.is_file():
            mode = stat.S_IMODE(path.stat().st_mode)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp{path.suffix}")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, created))
        mode = stat.S_IMODE(tmp.stat().st_mode) if mode is None else mode
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
    try:
        yield tmp
        os.chmod(tmp, mode)  # a library may have recreated it with its own mode
        os.replace(tmp, path)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int | None = None) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (see :func:`atomic_path`; ``mode``: the file's
    permissions, None: plain ``open()``'s); the path written."""
    with atomic_path(path, mode) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
    return Path(path)
