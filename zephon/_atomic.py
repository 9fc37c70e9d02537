"""Files written whole or not at all: a temporary file beside the target, then ``os.replace``.

Readers in other processes see the old file or the new one, never a part. ``durable=True`` also
survives a crash of the machine: the file is fsynced before the rename and its folder after.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator


@contextlib.contextmanager
def replacing(target: str | os.PathLike, *, durable: bool = False) -> Iterator[IO[bytes]]:
    """A binary file to write; on a clean exit it replaces ``target``, on any error it is removed.

    Raises ``OSError`` when the folder cannot take the temporary file.
    """
    target = os.fspath(target)
    folder = os.path.dirname(target) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".part")
    try:
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


def discard(path: str) -> None:
    """Remove ``path`` if it is there."""
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make a rename in ``directory`` durable (POSIX; other systems do not open directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)
