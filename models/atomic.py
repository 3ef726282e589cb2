"""Files written whole or not at all, and the leftovers of writers that were killed.

A writer works in a hidden `.<tag>-*.gguf.part` beside its target, holds an exclusive lock on it
while it writes, and renames it into place when done.  The store never lists names starting with
'.', so a part file is never served; `clean_leftovers` removes the part files nobody holds locked:
those of writers that died (`kill -9` leaves the file, the kernel drops the lock), never one that a
writer in another process is still filling.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PART_GLOB = ".*.gguf.part"


@contextmanager
def atomic_file(target: Path, tag: str) -> Iterator[tuple[int, Path]]:
    """(an open descriptor, its path) of a locked part file beside `target`, renamed onto `target`
    (mode 0644) if the block ends normally, removed if it raises."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, part = _locked_part(target.parent, tag)
    try:
        yield fd, Path(part)
        os.fsync(fd)
        os.chmod(part, 0o644)  # mkstemp makes it 0600; the model is for every user of the service
        os.replace(part, target)
    finally:
        if os.path.exists(part):
            os.unlink(part)
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _locked_part(directory: Path, tag: str) -> tuple[int, str]:
    """A new part file, locked.  A cleaner may take it between its creation and the lock (it looks
    abandoned then): that one is dropped and another made."""
    while True:
        fd, part = tempfile.mkstemp(prefix=f".{tag}-", suffix=".gguf.part", dir=directory)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(part).st_ino == os.fstat(fd).st_ino:
                return fd, part
        except FileNotFoundError:
            pass
        os.close(fd)


def clean_leftovers(directory: Path) -> list[Path]:
    """Remove the part files of writers that are gone; the removed paths."""
    removed = []
    for part in sorted(Path(directory).glob(PART_GLOB)) if Path(directory).is_dir() else []:
        try:
            fd = os.open(part, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # renamed or removed meanwhile, or a link: not ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live writer holds it
        try:
            os.unlink(part)
            removed.append(part)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed
