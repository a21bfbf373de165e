"""Output files that appear whole or not at all.

A command's ``--out`` file, or a report rewritten in place, is written to a
temporary file in the same directory and renamed over the target at the end,
so a failure part way (a locked state, a full disk, Ctrl-C) leaves the file
that was there before.
"""

from __future__ import annotations

import errno
import os
import tempfile
from contextlib import contextmanager
from typing import IO, Any, Iterator

__all__ = ["atomic_output"]


@contextmanager
def atomic_output(path: str, mode: str = "w") -> Iterator[IO[Any]]:
    """A file that replaces ``path`` only once everything was written: a temporary file in the same
    directory, renamed over ``path`` at the end (removed if anything fails, leaving ``path`` as it was)."""
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise IsADirectoryError(errno.EISDIR, "is a directory; name a file", path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # what open() would have created
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
