"""verispec.files: the one atomic write — nothing half-written, no temporary file left, and the permissions a
plain open() gives (drafter files included, which safetensors would create 0o600)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from test_eagle import VOCAB, fresh_head, tiny_target
from verispec.errors import UsageError
from verispec.files import atomic_path, atomic_write, check_writable


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def plain_open_mode(folder: Path) -> int:
    """The mode a plain open(..., "w") gives a new file in ``folder``."""
    reference = folder / "reference"
    reference.write_text("")
    try:
        return mode(reference)
    finally:
        reference.unlink()


def test_atomic_write_replaces_and_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.json"
    assert atomic_write(target, "old") == target and target.read_text() == "old"
    atomic_write(target, b"new \xe2\x9c\x93")
    assert target.read_text(encoding="utf-8") == "new ✓" and os.listdir(tmp_path) == ["out.json"]

    def half_written(error: BaseException) -> None:
        with atomic_path(target) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".json" and tmp.exists()
            tmp.write_text("half")
            raise error

    with pytest.raises(UsageError, match="cannot write .*out.json: No space left on device"):
        half_written(OSError(28, "No space left on device"))
    with pytest.raises(KeyboardInterrupt):
        half_written(KeyboardInterrupt())
    assert target.read_text(encoding="utf-8") == "new ✓" and os.listdir(tmp_path) == ["out.json"]
    with pytest.raises(UsageError, match="is a directory"):
        atomic_write(tmp_path, "x")
    with pytest.raises(UsageError, match="no directory"):
        atomic_write(tmp_path / "missing" / "out.json", "x")


def test_files_get_the_permissions_of_a_plain_open(tmp_path):
    old = os.umask(0o022)
    try:
        expected = plain_open_mode(tmp_path)
        assert expected == 0o644
        new = atomic_write(tmp_path / "new.txt", "x")
        assert mode(new) == expected

        def save_0600(tmp: Path) -> None:  # a library that makes its own file, 0o600
            tmp.unlink()
            tmp.touch(mode=0o600)

        with atomic_path(tmp_path / "library.bin") as tmp:
            save_0600(tmp)
        assert mode(tmp_path / "library.bin") == expected

        kept = tmp_path / "kept.txt"  # an existing file keeps its mode, as open() would leave it
        kept.write_text("old")
        kept.chmod(0o640)
        atomic_write(kept, "new")
        assert mode(kept) == 0o640 and kept.read_text() == "new"

        head = fresh_head(tiny_target(), torch.arange(VOCAB))
        drafter = head.save(tmp_path / "drafters" / "eagle.safetensors")
        assert mode(drafter) == expected  # was 0o600
        assert sorted(os.listdir(drafter.parent)) == ["eagle.safetensors"]
    finally:
        os.umask(old)


def test_a_link_is_written_through_and_a_pipe_or_device_is_never_replaced(tmp_path):
    """A symbolic link stays a link, the file it names written (a dangling one: that file created); a FIFO
    (as a device or a socket) is refused in one line and left as it was, never renamed over."""
    target, link = tmp_path / "real.txt", tmp_path / "link.txt"
    target.write_text("old")
    link.symlink_to(target)
    atomic_write(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "made.txt")
    atomic_write(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "made.txt").read_text() == "made"
    fifo = tmp_path / "fifo.html"
    os.mkfifo(fifo)
    for write in (lambda: atomic_write(fifo, "x"), lambda: check_writable(fifo)):
        with pytest.raises(UsageError, match="not a regular file") as info:
            write()
        assert "\n" not in str(info.value)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == [
        "dangling.txt", "fifo.html", "link.txt", "made.txt", "real.txt"
    ]  # fmt: skip
    if os.path.exists("/dev/null"):
        with pytest.raises(UsageError, match="not a regular file"):
            check_writable("/dev/null")
