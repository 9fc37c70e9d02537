"""Files written whole or not at all: a temporary file beside the target, then ``os.replace``.

``durable=True`` also survives a machine crash (fsync of the file and its folder). Files get the
permissions of any new file (``0666`` less the umask), so teammates on a cluster can read them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator


@contextlib.contextmanager
def replacing(target: str | os.PathLike, *, durable: bool = False) -> Iterator[IO[bytes]]:
    """A binary file to write: on a clean exit it replaces ``target``, on an error it is removed."""
    target = os.fspath(target)
    folder = os.path.dirname(target) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".part")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as out:
            yield out
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        discard(tmp)
        raise
    if durable:
        fsync_directory(folder)


def current_umask() -> int:
    """The process umask: from Linux ``/proc`` without changing it, else set and put back."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def discard(path: str) -> None:
    """Remove ``path`` if it is there."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make a rename in ``directory`` durable (POSIX; other systems do not open directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse; the rename is still atomic
            os.fsync(fd)
    finally:
        os.close(fd)
