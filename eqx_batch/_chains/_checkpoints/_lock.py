"""Before a run writes its checkpoint: the folder can be written, and no other live
run holds the path.

Process 0 of the run takes `path.lock` with `flock`, for its whole job. The operating
system releases the lock when that process ends, however it ends, so a crashed run
never blocks its own resume while a live one keeps every other run out. Windows has no
`flock`: checkpoints are not locked there. In a job, every process checks that it sees
the checkpoint's folder, and every process stops if a check fails in any of them.
"""

import contextlib
import errno
import os
import pathlib
import re
import secrets
import stat
import sys
from typing import Any, NamedTuple

import jax

from ..._errors import BatchError
from ..._files._atomic import temporary_name_pattern
from .._jobs._job import from_process_zero, raise_if_any_failed, shared_failures
from ._checkpoint_files import checkpoint_name_pattern, run_file_pattern


if sys.platform != "win32":
    import fcntl


def is_writer() -> bool:
    """Whether this process holds the lock and writes the run file: process 0 of a
    job (every process writes the rows of its own chains)."""
    return jax.process_index() == 0


def check_folder(path: pathlib.Path) -> None:
    """Raises, naming `path`, unless it can be a file (not a link) in an existing
    folder.

    Reads only, so that a finished run can be read back from read-only storage.
    """
    folder = path.parent
    if path.is_symlink():
        # The run's files are named after the path and written beside it: through a
        # link, its draw files would be looked for (and written) beside the link, away
        # from the checkpoint it points to, and a live run's files could be mixed up.
        raise BatchError(
            f"`checkpoint` ({path}) is a symbolic link (to {os.readlink(path)}): "
            f"pass the path it points to (see docs/chains.md#checkpoint-and-resume)."
        )
    if path.is_dir():
        raise BatchError(
            f"`checkpoint` ({path}) is a folder; pass the path of a file in it, "
            f"such as {path / 'chains.ckpt'}."
        )
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise BatchError(
            f"`checkpoint` ({path}) cannot be written: its folder {folder} {what}."
        )


def check_writable(path: pathlib.Path, longest_name: str) -> None:
    """Raises, naming `path`, unless a file named as long as `longest_name` (the
    longest name the run will write) can be created in its folder."""
    check_folder(path)
    folder = path.parent
    # A real write, not `os.access`: permission bits say nothing of a read-only
    # mount, and nothing to root. Found now, not after the run.
    probe_name = f".{path.name}.{secrets.token_hex(8)}.probe"
    padding = len(longest_name.encode()) - len(probe_name.encode())
    if padding > 0:
        probe_name = probe_name[: -len(".probe")] + "p" * padding + ".probe"
    probe = folder / probe_name
    try:
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.close(descriptor)
        probe.unlink()
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise BatchError(
                f"`checkpoint` ({path}): {longest_name} is too long a name for "
                f"{folder}: pass a shorter name."
            ) from None
        raise BatchError(
            f"`checkpoint` ({path}) cannot be written: creating a file in {folder} "
            f"failed ({e.strerror or e})."
        ) from None


def refuse_if_in_use(path: pathlib.Path) -> None:
    """Raises if a live run holds the lock of `path`, without creating or writing
    anything: a run is refused for being in use before its files are read.

    The other processes of a job leave the lock to process 0: they check nothing.
    """
    if sys.platform == "win32" or not is_writer():
        return
    lock_path = _lock_path(path)
    try:
        descriptor = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # no lock file (or none to follow): `take_lock` judges it, if needed
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(path, lock_path, descriptor) from None
    except OSError:
        pass  # not a file that can be locked: `take_lock` judges it, if needed
    finally:
        os.close(descriptor)


class HeldLock(NamedTuple):
    """A lock of a checkpoint that this process holds (`take_lock`)."""

    path: pathlib.Path  # the lock file
    descriptor: int  # open on it, holding the `flock`
    created: bool  # whether this run created the file (and may remove it)

    def release(self, *, remove: bool = False) -> None:
        """Releases the lock. With `remove` (for a run that failed before writing
        anything), first removes the lock file if this run created it and the path
        still names it: never another's file."""
        if remove and self.created and _names(self.path, self.descriptor):
            # Removed while still locked: a run that opened the file meanwhile finds,
            # once it holds the lock, that the path no longer names it (`take_lock`).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self.descriptor)


# How often `take_lock` opens the lock file again when it was removed or replaced
# between its opening and its locking (another run released it meanwhile).
_LOCK_ATTEMPTS = 100


def take_lock(path: pathlib.Path) -> HeldLock | None:
    """Locks `path.lock` for this process; returns the lock held (`release` it).

    The lock file is opened without following a link, and only a regular file that
    is empty or holds a process id (what this function writes) is used: anything else
    at that path may be the user's, and is neither truncated nor written. The lock is
    held only once the path still names the file locked: a run that fails removes the
    lock file it created (`HeldLock.release`), and a file removed is locked in vain.

    **Raises:**

    `BatchError` if another live process holds the lock, or if `path.lock` is a link,
    not a regular file, or a file that is not a lock of eqx_batch. Returns None on
    Windows, which has no `flock`: no lock there.
    """
    if sys.platform == "win32":
        return None
    lock_path = _lock_path(path)
    for _ in range(_LOCK_ATTEMPTS):
        opened = _opened_lock(path, lock_path)
        if opened is None:
            continue  # removed between two looks: open it again
        held = HeldLock(lock_path, *opened)
        try:
            locked = _locked(path, lock_path, held.descriptor)
        except BaseException:
            held.release()
            raise
        if locked:
            _claim(held, path)
            return held
        held.release()
    raise BatchError(
        f"`checkpoint` ({path}) cannot be locked: other runs replaced {lock_path} "
        f"{_LOCK_ATTEMPTS} times. Pass another path."
    )


def _opened_lock(
    path: pathlib.Path, lock_path: pathlib.Path
) -> tuple[int, bool] | None:
    """`lock_path` opened for reading and writing, created if absent, and whether it
    was created now; None if it was removed between two looks.

    **Raises:**

    `BatchError` if it cannot be opened, naming what is there if not a regular file.
    """
    # No link is followed (a link there could point at any file), and opening a FIFO
    # does not wait for a writer.
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        try:
            # Exclusive: only a file this run created is ever removed by it.
            return os.open(lock_path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            return os.open(lock_path, flags), False
    except FileNotFoundError:
        return None
    except OSError as e:
        kind = _kind_at(lock_path)
        if kind is not None:
            raise _not_a_lock(path, lock_path, kind) from None
        raise BatchError(
            f"`checkpoint` ({path}) cannot be locked: opening {lock_path} failed "
            f"({e.strerror or e})."
        ) from None


def _locked(path: pathlib.Path, lock_path: pathlib.Path, descriptor: int) -> bool:
    """Locks the file open as `descriptor`; whether `lock_path` still names it (if
    not, it was removed or replaced before it was locked, and locks nothing).

    **Raises:**

    `BatchError` if another live process holds the lock, or if the file is not a
    regular file or not a lock of eqx_batch.
    """
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        raise _not_a_lock(path, lock_path, _kind_at(lock_path))
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(path, lock_path, descriptor) from None
    if not _names(lock_path, descriptor):
        return False
    # Only a file this function wrote (or created just now) is rewritten: a hard
    # link, or a file with other contents, is someone else's.
    content = os.pread(descriptor, 64, 0)
    if os.fstat(descriptor).st_nlink != 1 or not re.fullmatch(rb"(\d+\n)?", content):
        raise _not_a_lock(path, lock_path, "a file that is not a lock of eqx_batch")
    return True


def _claim(held: HeldLock, path: pathlib.Path) -> None:
    """Writes this process's id in the lock it holds, and removes what a killed run
    left of `path`'s writes; if that fails, releases the lock (removing the file if
    this run created it) and raises."""
    try:
        os.ftruncate(held.descriptor, 0)
        os.pwrite(held.descriptor, f"{os.getpid()}\n".encode(), 0)
        _remove_torn_writes(path)
    except BaseException:
        held.release(remove=True)
        raise


def _names(path: pathlib.Path, descriptor: int) -> bool:
    """Whether `path` names the file open as `descriptor` (not a file since removed,
    or replaced by another)."""
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (there.st_dev, there.st_ino) == (opened.st_dev, opened.st_ino)


def _lock_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f"{path.name}.lock")


def _in_use(path: pathlib.Path, lock_path: pathlib.Path, descriptor: int) -> BatchError:
    holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
    who = f"process {holder}" if holder.isdigit() else "another process"
    return BatchError(
        f"`checkpoint` ({path}) is in use: a live run ({who}) holds its lock "
        f"{lock_path}. Wait for it to finish, or pass another path."
    )


def _kind_at(path: pathlib.Path) -> str | None:
    """What is at `path` if it is not a regular file (a link, a FIFO...), else None."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    return "not a regular file"


def _not_a_lock(path: pathlib.Path, lock_path: pathlib.Path, what: Any) -> BatchError:
    return BatchError(
        f"`checkpoint` ({path}) cannot be locked: its lock file {lock_path} is {what}, "
        "which `run_chains` neither follows nor overwrites. Move it away, or pass "
        "another path."
    )


def check_shared_folder(path: pathlib.Path) -> None:
    """In a job of several processes, raises in every process unless every process
    sees the folder of `path` as process 0 does (a shared file system): each process
    writes the checkpoint rows of its own chains there, and reads those of others on
    resume.

    Process 0 writes a probe file holding a random token, and every other process
    reads it back at the same path. A collective: every process must call it.
    """
    if jax.process_count() == 1:
        return
    token = ""
    if is_writer():
        token = secrets.token_hex(8)
        # Written before the token is announced, so the others can read it then.
        try:
            with open(_probe_path(path, token), "x") as file:
                file.write(token)
        except OSError:
            token = ""  # every process then reports the folder unseen
    token = from_process_zero(token)
    probe = _probe_path(path, token)
    try:
        seen = bool(token) and probe.read_text() == token
    except OSError:
        seen = False
    failures = shared_failures(None if seen else str(probe.parent))
    if is_writer():
        probe.unlink(missing_ok=True)
    if failures:
        names = ", ".join(str(index) for index in sorted(failures))
        raise BatchError(
            f"`checkpoint` ({path}): process{'es' if len(failures) > 1 else ''} "
            f"{names} of {jax.process_count()} did not find the file {probe.name} in "
            f"{path.parent}; nothing was written "
            "(see docs/multi.md#several-processes)."
        )


class WriteAccess:
    """The right to write a run's checkpoint files, taken when first needed.

    Taking it checks that the folder can be written (`check_writable`) and, in the
    process that writes (`is_writer`), takes the lock of `path`. A chunked run
    shares one among its chunks (`chunk_path`), so a second live run on `path` is
    refused whichever chunk the first one is running; a run whose checkpoints are all
    finished never takes it, so it reads back from read-only storage. Used as a context
    manager, which releases the lock.
    """

    def __init__(self, path: pathlib.Path, longest_name: str):
        self.path = path
        self.longest_name = longest_name
        self._taken = False
        self._lock: HeldLock | None = None

    def acquire(self) -> None:
        """Checks the folder, takes the lock (process 0) and, in a job, checks that
        every process sees the folder; in a job every process raises if any check
        fails in any process (see `_jobs/_job.py`), before anything is written."""
        if self._taken:
            return
        failure = None
        try:
            check_writable(self.path, self.longest_name)
            if is_writer():
                self._lock = take_lock(self.path)
        except BatchError as e:
            failure = e
        try:
            raise_if_any_failed(
                failure,
                f"Taking `checkpoint` ({self.path}) for writing",
                fix="Nothing was written.",
            )
            check_shared_folder(self.path)
        except BaseException:
            # Nothing was written: nor is the lock file left behind, if this run
            # created it.
            self._release(remove=True)
            raise
        self._taken = True

    def __enter__(self) -> "WriteAccess":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self, *, remove: bool = False) -> None:
        if self._lock is not None:
            self._lock.release(remove=remove)
            self._lock = None


def _probe_path(path: pathlib.Path, token: str) -> pathlib.Path:
    """The file by which `check_shared_folder` sees whether a folder is shared."""
    return path.with_name(f".{path.name}.{token}.shared")


def _probe_name_pattern(name: str) -> str:
    """A regular expression of `_probe_path`'s names for paths whose names match the
    regular expression `name`."""
    return rf"\.(?:{name})\.[0-9a-f]{{16}}\.shared"


def _remove_torn_writes(path: pathlib.Path) -> None:
    """Removes the temporary files of writes that a killed run left behind.

    Only the job holding the lock writes this checkpoint's files (its chunks'
    included), and none of its processes writes before the lock is taken, so every
    temporary file of theirs (`atomic_write` names them `.<file>.<16 hex digits>.tmp`)
    and every probe of `check_shared_folder` that exists now belongs to a run that is
    gone.
    """
    checkpoint = checkpoint_name_pattern(path)
    written = temporary_name_pattern(rf"{checkpoint}(?:{run_file_pattern()})?")
    torn = re.compile(rf"{written}|{_probe_name_pattern(checkpoint)}")
    for entry in os.scandir(path.parent):
        if torn.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
