"""Cache files written atomically: built beside their final path, renamed into place only when whole."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_path(target: str, suffix: str = ".tmp", shared: bool = True) -> Iterator[str]:
    """Yields a fresh temporary path in ``target``'s folder (the folder is made if missing) for the caller to write;
    on a normal exit it is renamed onto ``target`` (``os.replace``: atomic, so a concurrent reader sees the old file
    or the whole new one, and concurrent writers the last whole one), on an exception it is removed and the exception
    goes on. ``shared``: the file gets the permissions of a new file under the umask (``mkstemp`` makes it 0600; a
    cache may be shared); False leaves them as the writer made them (a compiler's output keeps its mode).

    Raises:
        OSError: from making the folder or the temporary file, or from the rename.
    """
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=suffix, dir=folder)
    os.close(fd)
    done = False
    try:
        yield tmp
        if shared:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
        done = True
    finally:
        if not done and os.path.exists(tmp):
            os.unlink(tmp)
