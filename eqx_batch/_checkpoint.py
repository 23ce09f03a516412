"""The checkpoints of `eb.run_chains`: a run's identity, its files, and its writer.

A checkpoint at `path` is a few safetensors files in one folder:

- `path`: the run state (every chain's state and key, the NaN report), with the run's
    identity and progress (steps done, the draw files so far) in its metadata. It is
    rewritten atomically after each segment, after the draws it names.
- `path.<run id>.draws-A-B`: draws `A` to `B` of the trace, written once. The run id
    is a digest of the run's identity, so two runs never share a file name, and each
    file repeats the identity in its metadata, which is checked when it is read.
- `path.chains-A-B` and its draw files: with `chunk_size`, the checkpoint of chains `A`
    to `B`, a run of its own (the chunks share the lock of `path`, `job_lock`).
- `path.lock`: locked (`flock`) by the process writing the run. The operating system
    releases the lock when that process ends, however it ends, so a crashed run never
    blocks its own resume while a live one keeps every other run out.

A run's identity is what decides its results: `init`'s structure and values, the
chains' keys, the counts, and what `step` computes: a digest of its traced program
(the jaxpr) and of the values of its constants, never its name.
"""

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import secrets
import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from ._errors import BatchError, bullet_list, describe
from ._file_format import BadFileError, ForeignFileError, read_metadata
from ._serialise import read_tree, write_tree
from ._tree import as_key_data, host_array, is_array, is_key


if sys.platform != "win32":
    import fcntl


# ------------------------------------------------------------------------------------
# The run's identity.


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:16]


def _values_digest(tree: Any) -> str:
    """A digest of the paths and values of `tree`'s leaves (keys: data and impl)."""
    parts = []
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        parts.append(jtu.keystr(path).encode())
        if is_array(leaf):
            data = np.ascontiguousarray(host_array(leaf))
            kind = str(jr.key_impl(leaf)) if is_key(leaf) else str(data.dtype)
            parts.append(f"{kind}{data.shape}".encode())
            parts.append(data.tobytes())
        else:
            parts.append(stable_name(leaf).encode())
    return _digest(*parts)


def stable_name(x: Any) -> str:
    """A name of `x` that is the same in every process: no memory addresses."""
    module = getattr(x, "__module__", None)
    qualname = getattr(x, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        # Functions, and wrappers such as `jax.custom_jvp` (`jax.nn.relu`), whose repr
        # would otherwise be an anonymous object at an address.
        return f"{module}.{qualname}"
    return _without_addresses(repr(x))


def _without_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def step_digests(program: jax.extend.core.ClosedJaxpr) -> dict[str, str]:
    """Digests of what a step computes: its traced program and its constants' values.

    The printed jaxpr names variables by position and functions by name, so it is the
    same in every process (once the addresses in reprs are dropped); the constants
    (arrays the step closes over, or is given through `functools.partial`) are
    compared by value.
    """
    text = _without_addresses(str(program.jaxpr))
    return {
        "step program": _digest(text.encode()),
        "step constants": _values_digest(list(program.consts)),
    }


_EXPLAINED = {
    "step program": "`step` computes something else (its traced program differs)",
    "step constants": (
        "`step`'s constants differ (arrays it closes over or is given through "
        "`functools.partial`)"
    ),
    "init values": "`init` holds other values",
    "keys": "the chains' keys differ (another `key`)",
}


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What makes two calls of `run_chains` the same run, as named strings."""

    fields: Mapping[str, str]

    @classmethod
    def of(
        cls,
        program: jax.extend.core.ClosedJaxpr,
        init: Any,
        keys: jax.Array,
        counts: Mapping[str, Any],
    ) -> "RunIdentity":
        """The identity of a run of the traced step `program` from `init` and `keys`.

        `counts` holds the other arguments that change results (`num_steps`, `thin`...).
        """
        leaves, treedef = jtu.tree_flatten_with_path(init)
        fields = {
            "init structure": _without_addresses(str(treedef)),
            "init leaves": "; ".join(
                f"{jtu.keystr(path)}: "
                + (describe(leaf) if is_array(leaf) else stable_name(leaf))
                for path, leaf in leaves
            ),
            "init values": _values_digest(init),
            "keys": _values_digest(keys),
            **{name: str(value) for name, value in counts.items()},
            **step_digests(program),
        }
        return cls(fields)

    @property
    def run_id(self) -> str:
        """A short digest of the whole identity: part of every file name of the run."""
        return _digest(json.dumps(dict(self.fields), sort_keys=True).encode())

    def differences(self, saved: Mapping[str, str]) -> list[str]:
        lines = []
        for name, value in self.fields.items():
            if saved.get(name) == value:
                continue
            if name in _EXPLAINED:
                lines.append(f"{name}: {_EXPLAINED[name]}")
            else:
                lines.append(
                    f"{name}: the checkpoint has {saved.get(name, '(nothing)')}, this "
                    f"call has {value}"
                )
        return lines


# ------------------------------------------------------------------------------------
# What a checkpoint holds.


class DrawFile(NamedTuple):
    """One file of draws: draws `first` to `stop` of the trace."""

    name: str
    first: int
    stop: int


class Restored(NamedTuple):
    """A run read back from its checkpoint, on the host (typed keys as raw data)."""

    steps_done: int
    states: Any
    keys: np.ndarray
    first_bad: np.ndarray
    draws: Any  # the draws so far, `[chains, draws, ...]` per leaf; None without trace


class Snapshot(NamedTuple):
    """What one checkpoint writes: the chains after `steps_done` steps, and new draws.

    Arrays may still be being computed and may hold padding chains (rows beyond the
    run's chains); `draws` holds the new draws `draw_file.first` to `draw_file.stop`
    from index `offset` along axis 1, or is None when the segment recorded none.
    """

    steps_done: int
    states: Any
    keys: jax.Array
    first_bad: jax.Array
    draws: Any = None
    draw_file: DrawFile | None = None
    offset: int = 0


# Metadata entries of every file of a run.
_RUN = "run_chains.run"
_RUN_ID = "run_chains.run_id"
_PROGRESS = "run_chains.progress"
_DRAWS = "run_chains.draws"


class Checkpoint:
    """A run's checkpoint files: checked, locked, read back, written in the background.

    Used as a context manager. Entering it checks, before any work, that the folder
    exists and takes a file; in the process that writes (`writes=True`, process 0 of a
    job), it takes the lock (unless `locks=False`: a chunk of a chunked run, whose job
    holds the lock of the user's path, `job_lock`) and starts the writer thread. Leaving
    it waits for the last write and releases both.
    """

    def __init__(
        self,
        path: pathlib.Path,
        identity: RunIdentity,
        num_chains: int,
        *,
        writes: bool,
        locks: bool = True,
    ):
        self.path = path
        self.identity = identity
        self.num_chains = num_chains
        self.writes = writes
        self.locks = locks
        self.draw_files: list[DrawFile] = []
        self.steps_written: int | None = None
        self._lock: int | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._metadata = {
            _RUN: json.dumps(dict(identity.fields)),
            _RUN_ID: identity.run_id,
        }

    # -- entering and leaving --------------------------------------------------------

    def __enter__(self) -> "Checkpoint":
        check_writable(self.path)
        if self.writes:
            if self.locks:
                self._lock = take_lock(self.path)
            self._thread = concurrent.futures.ThreadPoolExecutor(1)
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        try:
            if self._thread is not None:
                self._thread.shutdown(wait=True)
            if kind is None:
                self._wait()
        finally:
            if self._lock is not None:
                os.close(self._lock)  # releases the `flock`
                self._lock = None

    # -- reading back ----------------------------------------------------------------

    def restore(
        self, state_like: Mapping[str, Any], trace_like: Any
    ) -> Restored | None:
        """The run as last checkpointed, on the host; None if there is no checkpoint.

        `state_like` has `states`, `keys` and `first_bad`; `trace_like` is the whole
        trace (or None). Draw files are read on the host and joined there, so reading
        back compiles nothing whatever their number.

        Raises if the file is not a checkpoint, is corrupt, or belongs to another run.
        """
        if not self.path.exists():
            return None
        metadata = self._read_metadata(self.path, "checkpoint")
        if _RUN not in metadata or _PROGRESS not in metadata:
            raise BatchError(
                f"`checkpoint` ({self.path}) is an eqx_batch file but not a "
                "`run_chains` checkpoint (it has no run description). Pass another "
                "path: this one would be overwritten."
            )
        self._check_run(self.path, metadata, "checkpoint")
        like = as_key_data(dict(state_like))
        saved = self._read(self.path, like, "checkpoint")
        progress = json.loads(metadata[_PROGRESS])
        self.draw_files = [DrawFile(*entry) for entry in progress["draws"]]
        self.steps_written = progress["steps_done"]
        draws = None
        if trace_like is not None:
            draws = self._read_draws(as_key_data(trace_like))
        return Restored(
            steps_done=progress["steps_done"],
            states=saved["states"],
            keys=saved["keys"],
            first_bad=saved["first_bad"],
            draws=draws,
        )

    def _read_draws(self, trace_like: Any) -> Any:
        pieces = [self._read_draw_file(entry, trace_like) for entry in self.draw_files]
        if not pieces:
            return jtu.tree_map(
                lambda x: np.zeros((x.shape[0], 0, *x.shape[2:]), x.dtype), trace_like
            )
        return jtu.tree_map(lambda *xs: np.concatenate(xs, axis=1), *pieces)

    def _read_draw_file(self, entry: DrawFile, trace_like: Any) -> Any:
        count = entry.stop - entry.first
        like = jtu.tree_map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0], count, *x.shape[2:]), x.dtype),
            trace_like,
        )
        path = self.path.with_name(entry.name)
        metadata = self._read_metadata(path, "draw file")
        self._check_run(path, metadata, "draw file")
        if metadata.get(_DRAWS) != f"{entry.first}-{entry.stop}":
            raise BatchError(
                f"the draw file {path} of `checkpoint` ({self.path}) holds draws "
                f"{metadata.get(_DRAWS)!r}, but the checkpoint names it for draws "
                f"{entry.first}-{entry.stop}: the checkpoint's files were mixed up. "
                "Delete them to start this run afresh."
            )
        return self._read(path, like, "draw file")

    def _check_run(
        self, path: pathlib.Path, metadata: Mapping[str, str], what: str
    ) -> None:
        try:
            saved = json.loads(metadata[_RUN])
        except (KeyError, ValueError):
            saved = None
        if not isinstance(saved, dict):
            raise BatchError(
                f"the {what} {path} of `checkpoint` ({self.path}) has no readable run "
                "description: it is not a `run_chains` checkpoint file."
            )
        differences = self.identity.differences(saved)
        if differences or metadata.get(_RUN_ID) != self.identity.run_id:
            where = (
                f"`checkpoint` ({self.path})"
                if path == self.path
                else f"the draw file {path} of `checkpoint` ({self.path})"
            )
            raise BatchError(
                f"{where} was written by a different run:\n"
                + bullet_list(differences or ["its run id"])
                + "\nPass another path, or delete the checkpoint's files to start this "
                "run afresh."
            )

    def _read_metadata(self, path: pathlib.Path, what: str) -> dict[str, str]:
        try:
            return read_metadata(path)
        except FileNotFoundError:
            raise BatchError(
                f"the {what} {path} of `checkpoint` ({self.path}) is missing. Delete "
                "the checkpoint's files to start this run afresh."
            ) from None
        except (BadFileError, OSError) as e:
            raise self._unreadable(what, e) from None

    def _read(self, path: pathlib.Path, like: Any, what: str) -> Any:
        try:
            tree, _ = read_tree(path, like, argname=what, on_host=True)
        except (BadFileError, OSError) as e:
            raise self._unreadable(what, e) from None
        except BatchError as e:
            # Its run identity matched: only a damaged or tampered file gets here.
            raise BatchError(
                f"`checkpoint` ({self.path}) cannot be resumed: its {what} {path} "
                f"names this run but does not hold its arrays: {e}"
            ) from None
        return tree

    def _unreadable(self, what: str, error: Exception) -> BatchError:
        if isinstance(error, ForeignFileError) and what == "checkpoint":
            # Not a file of ours: it may be the user's, so it is not to be deleted.
            return BatchError(
                f"`checkpoint` ({self.path}) is not an eqx_batch checkpoint: {error}\n"
                "Pass another path: `run_chains` would overwrite this file."
            )
        return BatchError(
            f"`checkpoint` ({self.path}) cannot be resumed: its {what} is unreadable. "
            f"{error}\nDelete the checkpoint's files (or pass another path) to start "
            "this run afresh."
        )

    # -- writing ---------------------------------------------------------------------

    def draws_name(self, first: int, stop: int) -> str:
        return f"{self.path.name}.{self.identity.run_id}.draws-{first}-{stop}"

    def write(self, snapshot: Snapshot) -> None:
        """Writes `snapshot` in the background, once the previous write is done.

        Does nothing in a process that does not write. At most one write is in flight:
        a slow disk slows the run down rather than piling up copies of the draws.
        """
        if self._thread is None:
            return
        snapshot = snapshot._replace(
            states=as_key_data(snapshot.states),
            keys=jr.key_data(snapshot.keys),
            draws=as_key_data(snapshot.draws),
        )
        # Off a CPU, the copies to the host start as soon as the segment ends, rather
        # than when the writer thread asks for them.
        for leaf in jtu.tree_leaves(snapshot):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()
        self._wait()
        self._pending = self._thread.submit(self._write, snapshot)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write(self, snapshot: Snapshot) -> None:
        # On the writer thread: each host copy waits for its segment to finish.
        rows = self.num_chains
        draw_files = self.draw_files
        try:
            if snapshot.draw_file is not None:
                draw_file = snapshot.draw_file
                count = draw_file.stop - draw_file.first
                window = slice(snapshot.offset, snapshot.offset + count)
                draws = jtu.tree_map(
                    lambda x: np.asarray(x)[:rows, window], snapshot.draws
                )
                write_tree(
                    self.path.with_name(draw_file.name),
                    draws,
                    metadata={
                        **self._metadata,
                        _DRAWS: f"{draw_file.first}-{draw_file.stop}",
                    },
                    keep_cached=False,
                )
                draw_files = [*draw_files, draw_file]
            state = {
                "states": jtu.tree_map(lambda x: np.asarray(x)[:rows], snapshot.states),
                "keys": np.asarray(snapshot.keys)[:rows],
                "first_bad": np.asarray(snapshot.first_bad)[:rows],
            }
            progress = {
                "steps_done": snapshot.steps_done,
                "draws": [list(d) for d in draw_files],
            }
            write_tree(
                self.path,
                state,
                metadata={**self._metadata, _PROGRESS: json.dumps(progress)},
            )
        except OSError as e:
            kept = (
                "no checkpoint was written before"
                if self.steps_written is None
                else f"the checkpoint of step {self.steps_written} is kept"
            )
            raise BatchError(
                f"writing `checkpoint` ({self.path}) after step {snapshot.steps_done} "
                f"failed: {e.strerror or e}; {kept}. Free space (or fix the folder) "
                "and call `run_chains` again to resume."
            ) from e
        self.draw_files = draw_files
        self.steps_written = snapshot.steps_done


# ------------------------------------------------------------------------------------
# Before any work: the folder can be written, and no other live run holds the path.


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


def chunk_path(path: pathlib.Path, first: int, stop: int) -> pathlib.Path:
    """The checkpoint of chains `first` to `stop` of a chunked run checkpointed at
    `path`: named by the chains it holds, so it is the same whatever the chunk size
    that made it."""
    return path.with_name(f"{path.name}.chains-{first}-{stop}")


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
