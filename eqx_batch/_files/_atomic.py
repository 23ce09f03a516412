"""`atomic_write`: replace a file so that a crash leaves the old contents or the new.

`eb.save` and the checkpoints of `eb.run_chains` write through it: a temporary file
beside the target, fsynced, renamed over the target, and the folder fsynced so that the
rename itself survives a power cut.
"""

import os
import pathlib
import secrets
from collections.abc import Callable
from typing import BinaryIO


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[BinaryIO], object],
    *,
    keep_cached: bool = True,
) -> None:
    """Calls `write(file)` on a temporary file beside `path`, then renames it to `path`.

    The temporary file is flushed and fsynced before the rename, and the folder after
    it, so after a crash `path` holds either its previous contents or the new ones,
    never a mixture. If `write` raises, the temporary file is removed and `path` is
    untouched.

    With `keep_cached=False` the file's pages are dropped from the operating system's
    cache once they are on disk (where the OS allows it): for files written once and
    rarely read back, such as the draws of a checkpointed run. Pages the cache has just
    freed are the cheapest for the next write to fill, and a long run does not push
    everything else out of the cache.
    """
    target = pathlib.Path(path)
    folder = target.parent
    # A random name opened with O_EXCL, rather than `tempfile` (which creates 0600
    # files), gives the file the permissions the user's umask asks for, as `open` does.
    temporary = folder / temporary_name(target.name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    descriptor = os.open(temporary, flags, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
            if not keep_cached and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(folder)


def temporary_name(name: str) -> str:
    """The name of a temporary file that `atomic_write` writes before renaming it to
    `name`: hidden, random, and 22 characters longer."""
    return f".{name}.{secrets.token_hex(8)}.tmp"


def temporary_name_pattern(name: str) -> str:
    """A regular expression of the names `temporary_name` gives files whose names
    match the regular expression `name`."""
    return rf"\.(?:{name})\.[0-9a-f]{{16}}\.tmp"


def _fsync_folder(folder: pathlib.Path) -> None:
    # The rename is only durable once the folder's entry is on disk. Windows cannot open
    # a folder this way; there `os.replace` is as durable as it gets.
    if not hasattr(os, "O_DIRECTORY"):
        return
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
