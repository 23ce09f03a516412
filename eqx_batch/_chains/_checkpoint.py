"""The checkpoint files of `eb.run_chains`: read back, and written in the background.

A checkpoint at `path` is a few safetensors files in one folder:

- `path`: the run state (every chain's state and key, the NaN report), with the run's
    identity and progress (steps done, the draw files so far) in its metadata. It is
    rewritten atomically after each segment, after the draws it names.
- `path.<run id>.draws-A-B`: draws `A` to `B` of the trace, written once. The run id
    is a digest of the run's identity, so two runs never share a file name, and each
    file repeats the identity in its metadata, which is checked when it is read.
- `path.chains-A-B` and its draw files: with `chunk_size`, the checkpoint of chains `A`
    to `B`, a run of its own (the chunks share the lock of `path`).
- `path.lock`: locked (`flock`) by the process writing the run. The operating system
    releases the lock when that process ends, however it ends, so a crashed run never
    blocks its own resume while a live one keeps every other run out (`_lock.py`).

The files hold raw data: typed PRNG keys are written as their key data, and made keys
again when read back. This is the one place, with the run's identity, that sees them so.
"""

import concurrent.futures
import errno
import json
import os
import pathlib
import re
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np

from .._atomic import temporary_name
from .._errors import BatchError, bullet_list
from .._file_format import BadFileError, ForeignFileError, read_metadata
from .._serialise import read_tree, write_tree
from .._tree import as_key_data, as_keys_like, host_array, is_int
from ._common import ChainState, Draws, structs
from ._identity import RunIdentity
from ._lock import is_writer, WriteAccess
from ._stopping import Record


class DrawFile(NamedTuple):
    """One file of draws: draws `first` to `stop` of the trace."""

    name: str
    first: int
    stop: int


class SegmentFiles(NamedTuple):
    """Where a segment's new draws go: the draw file, and where they lie in the
    `emit` draws the segment returns (see `SegmentPlan.emit`)."""

    draw_file: DrawFile
    emit: int
    offset: int  # of the file's first draw, along axis 1 of what the segment returns


class Restored(NamedTuple):
    """A run read back from its checkpoint (keys typed again)."""

    steps_done: int
    chains: ChainState
    draws: Any  # the draws so far, `[chains, draws, ...]` per leaf; None without trace
    record: Record | None  # the checks of `until`; None without it


class Snapshot(NamedTuple):
    """What one checkpoint writes: the chains after `steps_done` steps, and new draws.

    Arrays may still be being computed and may hold padding chains (rows beyond the
    run's chains); `draws` holds what the segment returned of the trace, or None when
    it recorded nothing to write.
    """

    steps_done: int
    chains: ChainState
    draws: Any
    files: SegmentFiles | None
    record: Record | None  # with `until`: the checks so far


_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

# Metadata entries of every file of a run.
_IDENTITY = "run_chains.run"
_RUN_ID = "run_chains.run_id"
_PROGRESS = "run_chains.progress"
_DRAWS = "run_chains.draws"


def chunk_path(path: pathlib.Path, first: int, stop: int) -> pathlib.Path:
    """The checkpoint of chains `first` to `stop` of a chunked run checkpointed at
    `path`: named by the chains it holds, so it is the same whatever the chunk size
    that made it."""
    return path.with_name(f"{path.name}.chains-{first}-{stop}")


def warn_of_other_chunkings(path: pathlib.Path, chunks: list[range] | None) -> None:
    """Warns of the checkpoints at `path` that a run in `chunks` (None: unchunked)
    does not read: those of chains split another way, by another `chunk_size`.

    Chunks that coincide are read back as they are; the chains of the others would be
    computed again, which can be days of work, so the user hears of it.
    """
    pattern = re.compile(rf"{re.escape(path.name)}\.chains-(\d+)-(\d+)")
    planned = {(chunk.start, chunk.stop) for chunk in chunks or []}
    other_sizes = set()
    for entry in os.scandir(path.parent):
        match = pattern.fullmatch(entry.name)
        if match and (int(match[1]), int(match[2])) not in planned:
            if int(match[1]) == 0:  # a chunking's first chunk has its full size
                other_sizes.add(int(match[2]))
    written = [f"with `chunk_size={size}`" for size in sorted(other_sizes)]
    if chunks is not None and path.exists():
        written.append("without `chunk_size`")
    if not written:
        return
    now = "without `chunk_size`" if chunks is None else f"`chunk_size={len(chunks[0])}`"
    warnings.warn(
        f"`checkpoint` ({path}) holds checkpoints written {' and '.join(written)}, "
        f"which this call ({now}) does not read: it computes those chains again. To "
        f"resume from them, call `run_chains` {' or '.join(written)}.",
        stacklevel=3,
    )


def longest_file_name(
    path: pathlib.Path, *, num_chains: int, num_draws: int, chunked: bool
) -> str:
    """The longest name of a file that a run checkpointed at `path` may write: the
    temporary file of a draw file (of a chunk, if `chunked`)."""
    name = chunk_path(path, num_chains, num_chains).name if chunked else path.name
    if num_draws:
        name = f"{name}.{'f' * 16}.draws-{num_draws}-{num_draws}"
    return temporary_name(name)


class Checkpoint:
    """A run's checkpoint files: read back, then written in the background.

    Used as a context manager. `restore` reads what is there without writing; a run
    with steps left then calls `start_writing`, which checks that the folder can be
    written and takes the lock (`access`, shared by every chunk of a chunked run), and,
    in the process that writes (process 0 of a job), starts the writer thread. Leaving
    it waits for the last write.
    """

    def __init__(
        self,
        path: pathlib.Path,
        identity: RunIdentity,
        num_chains: int,
        access: WriteAccess,
    ):
        self.path = path
        self.identity = identity
        self.num_chains = num_chains
        self.access = access
        self.draw_files: list[DrawFile] = []
        self.steps_written: int | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._metadata = {
            _IDENTITY: json.dumps(dict(identity.fields)),
            _RUN_ID: identity.run_id,
        }

    # -- entering and leaving --------------------------------------------------------

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if kind is None:
            self._wait()

    def start_writing(self) -> None:
        """Takes the right to write (see `WriteAccess`) and starts the writer."""
        self.access.acquire()
        if is_writer() and self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1)

    # -- reading back ----------------------------------------------------------------

    def restore(
        self,
        chains_like: ChainState,
        trace_like: Any,
        *,
        num_steps: int,
        draws: Draws,
        with_record: bool,
    ) -> Restored | None:
        """The run as last checkpointed; None if there is no checkpoint.

        `chains_like` and `trace_like` (the whole trace, or None) are shape-dtype
        structs. Draw files are read on the host and joined there, so reading back
        compiles nothing whatever their number. Nothing is written. A run with `until`
        (`with_record`) reads the record of its checks.

        Raises if the file is not a checkpoint, is corrupt, or belongs to another run.
        """
        if not self.path.exists():
            return None
        metadata = self._read_metadata(self.path, "checkpoint")
        if _IDENTITY not in metadata or _PROGRESS not in metadata:
            raise BatchError(
                f"`checkpoint` ({self.path}) is an eqx_batch file but not a "
                "`run_chains` checkpoint (it has no run description). Pass another "
                "path: this one would be overwritten."
            )
        self._check_run(self.path, metadata, "checkpoint")
        record = None
        if with_record:
            try:
                saved = json.loads(metadata[_PROGRESS])["stopping"]
                record = Record.from_json(saved, draws.burn_in)
            except (ValueError, TypeError, KeyError) as e:
                raise self._damaged(
                    f"its record of `until`'s checks does not parse ({e!r})"
                ) from None
        steps_done, draw_files = self._progress(
            metadata[_PROGRESS],
            num_steps=num_steps,
            num_draws=0 if trace_like is None else draws.before,
        )
        problem = None if record is None else record.disagreement(steps_done)
        if problem is not None:
            raise self._damaged(problem)
        saved = self._read(self.path, as_key_data(chains_like._asdict()), "checkpoint")
        self.draw_files = draw_files
        self.steps_written = steps_done
        made = None
        if trace_like is not None:
            made = as_keys_like(self._read_draws(as_key_data(trace_like)), trace_like)
        chains = ChainState(**as_keys_like(saved, chains_like._asdict()))
        return Restored(steps_done, chains, made, record)

    def _progress(
        self, text: str, *, num_steps: int, num_draws: Any
    ) -> tuple[int, list[DrawFile]]:
        """The steps done and the draw files of a progress record, checked: the
        steps in range, and draw files named as this run names them that hold every
        draw of those steps, in order, with no gap."""
        try:
            progress = json.loads(text)
            steps_done = progress["steps_done"]
            draw_files = [DrawFile(*entry) for entry in progress["draws"]]
        except (ValueError, TypeError, KeyError) as e:
            raise self._damaged(f"its progress record does not parse ({e})") from None
        if not (is_int(steps_done) and 0 <= steps_done <= num_steps):
            raise self._damaged(
                f"its progress says {steps_done!r} steps were done, of {num_steps}"
            )
        expected = num_draws(steps_done) if callable(num_draws) else num_draws
        made = 0
        for entry in draw_files:
            if not (
                entry.first == made
                and is_int(entry.stop)
                and entry.stop > entry.first
                and entry.name == self.draws_name(entry.first, entry.stop)
            ):
                raise self._damaged(
                    f"its progress lists the draw file {entry.name!r} for draws "
                    f"{entry.first!r}-{entry.stop!r}, where this run's file for "
                    f"draws {made} on is expected"
                )
            made = entry.stop
        if made != expected:
            raise self._damaged(
                f"its progress lists draw files for {made} draws, but {steps_done} "
                f"steps record {expected}"
            )
        return steps_done, draw_files

    def _damaged(self, problem: str) -> BatchError:
        return BatchError(
            f"`checkpoint` ({self.path}) cannot be resumed: {problem}. Delete the "
            "checkpoint's files (or pass another path) to start this run afresh."
        )

    def _read_draws(self, trace_like: Any) -> Any:
        per_file = [
            self._read_draw_file(entry, trace_like) for entry in self.draw_files
        ]
        if not per_file:
            return jtu.tree_map(
                lambda x: np.zeros((x.shape[0], 0, *x.shape[2:]), x.dtype), trace_like
            )
        return jtu.tree_map(lambda *xs: np.concatenate(xs, axis=1), *per_file)

    def _read_draw_file(self, entry: DrawFile, trace_like: Any) -> Any:
        num_chains = jtu.tree_leaves(trace_like)[0].shape[0]
        like = structs(trace_like, drop=2, add=(num_chains, entry.stop - entry.first))
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
            saved = json.loads(metadata[_IDENTITY])
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

    def segment_files(self, draws: Draws, start: int, stop: int) -> SegmentFiles | None:
        """Where the draws of the segment from step `start` to `stop` go; None if it
        makes none."""
        first, end = draws.before(start), draws.before(stop)
        if first == end:
            return None
        emit = draws.most_in(stop - start)
        # The segment returns the `emit` draws from its first on, or, near the end of
        # the buffer, the last `emit` of the trace.
        offset = first - min(first, draws.total - emit)
        return SegmentFiles(
            DrawFile(self.draws_name(first, end), first, end), emit, offset
        )

    def write(self, snapshot: Snapshot) -> None:
        """Writes `snapshot` in the background, once the previous write is done.

        Does nothing in a process that does not write. At most one write is in flight:
        a slow disk slows the run down rather than piling up copies of the draws.
        """
        if self._thread is None:
            return
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
        # Padding chains (beyond the run's own) are not written.
        real = slice(self.num_chains)
        draw_files = self.draw_files
        try:
            if snapshot.files is not None:
                draw_file = snapshot.files.draw_file
                offset = snapshot.files.offset
                in_file = slice(offset, offset + draw_file.stop - draw_file.first)
                draws = jtu.tree_map(
                    lambda x: host_array(x)[real, in_file], snapshot.draws
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
            state = jtu.tree_map(
                lambda x: host_array(x)[real], snapshot.chains._asdict()
            )
            progress = {
                "steps_done": snapshot.steps_done,
                "draws": [list(d) for d in draw_files],
            }
            if snapshot.record is not None:
                progress["stopping"] = snapshot.record.to_json()
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
            fix = "Free space" if e.errno in _DISK_FULL else "Fix the cause"
            raise BatchError(
                f"writing `checkpoint` ({self.path}) after step {snapshot.steps_done} "
                f"failed: {e.strerror or e} ({e.filename or self.path}); {kept}. "
                f"{fix} and call `run_chains` again to resume."
            ) from e
        self.draw_files = draw_files
        self.steps_written = snapshot.steps_done
