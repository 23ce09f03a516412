"""Before any work: the checkpoint's folder can be written, and no other live run holds
its path.

The process that writes a run takes `path.lock` with `flock`. The operating system
releases the lock when that process ends, however it ends, so a crashed run never
blocks its own resume while a live one keeps every other run out. Windows has no
`flock`: checkpoints are not locked there.
"""

import contextlib
import os
import pathlib
import re
import secrets
import sys
from collections.abc import Iterator

from .._errors import BatchError


if sys.platform != "win32":
    import fcntl


def check_writable(path: pathlib.Path) -> None:
    """Raises, naming `path`, unless a file can be created in its folder."""
    folder = path.parent
    if path.is_dir():
        raise BatchError(
            f"`checkpoint` ({path}) is a folder; pass the path of a file in it, "
            f"such as {path / 'chains.ckpt'}."
        )
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise BatchError(
            f"`checkpoint` ({path}) cannot be written: its folder {folder} {what}. "
            "Create the folder first, or pass a path in an existing one."
        )
    # A real write, not `os.access`: permission bits say nothing of a read-only
    # mount, and nothing to root. Found now, not after the run.
    probe = folder / f".{path.name}.{secrets.token_hex(8)}.probe"
    try:
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.close(descriptor)
        probe.unlink()
    except OSError as e:
        raise BatchError(
            f"`checkpoint` ({path}) cannot be written: creating a file in {folder} "
            f"failed ({e.strerror or e}). Pass a path in a folder you can write to."
        ) from None


def take_lock(path: pathlib.Path) -> int | None:
    """Locks `path.lock` for this process; returns its descriptor (close to release).

    Raises if another live process holds it. Returns None on Windows, which has no
    `flock`: no lock there.
    """
    if sys.platform == "win32":
        return None
    lock_path = path.with_name(f"{path.name}.lock")
    descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
        os.close(descriptor)
        who = f"process {holder}" if holder.isdigit() else "another process"
        raise BatchError(
            f"`checkpoint` ({path}) is in use: a live run ({who}) holds "
            f"its lock {lock_path}. Wait for it to finish, or pass another path."
        ) from None
    except BaseException:
        os.close(descriptor)
        raise
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    _remove_torn_writes(path)
    return descriptor


@contextlib.contextmanager
def job_lock(path: pathlib.Path, *, writes: bool) -> Iterator[None]:
    """Holds the lock of `path` for a whole chunked run (in the process that writes).

    The chunks' checkpoints (`chunk_path`) are written under it without locks of
    their own, so a second live run on `path` is refused at once, whichever chunk the
    first one is running.
    """
    check_writable(path)
    descriptor = take_lock(path) if writes else None
    try:
        yield
    finally:
        if descriptor is not None:
            os.close(descriptor)  # releases the `flock`


def _remove_torn_writes(path: pathlib.Path) -> None:
    """Removes the temporary files of writes that a killed run left behind.

    Only the holder of the lock writes this checkpoint's files (its chunks' included),
    so every temporary file of theirs (`atomic_write` names them
    `.<file>.<16 hex digits>.tmp`) that exists now belongs to a run that is gone.
    """
    name = re.escape(path.name)
    torn = re.compile(
        rf"\.{name}(\.chains-\d+-\d+)?(\.[0-9a-f]{{16}}\.draws-\d+-\d+)?"
        rf"\.[0-9a-f]{{16}}\.tmp"
    )
    for entry in os.scandir(path.parent):
        if torn.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
