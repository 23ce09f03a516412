"""The checkpoint files of `eb.run_chains`: read back, and written in the background.

A checkpoint at `path` is a few safetensors files in one folder (their names:
`_checkpoint_files.py`):

- `path`: the run file, written once by process 0 when the run first writes: the
    run's identity. A call of another run is refused, saying what differs.
- the state files of each checkpointed step, and the draw files, each written by the
    process whose devices hold those chains, in its own writer thread, with no
    gathering between processes: in one process, one state file and one draw file
    per segment. Every file repeats the run's identity, checked when it is read.
- `path.chains-A-B` and its files: with `chunk_size`, the checkpoint of chains `A`
    to `B`, a run of its own (the chunks share the lock of `path`).
- `path.lock`: locked (`flock`) by process 0 while the run writes (`_lock.py`).

Every file is written atomically, draw files before the state files that list them,
and a step counts once its state files cover every chain: a kill at any moment loses
at most the segment in flight. A run resumes, or reads back, on any layout of
processes and devices, each process reading the rows its devices now hold
(`_checkpoint_rows.py`).

The files hold raw data: typed PRNG keys are written as their key data, and made keys
again when read back.
"""

import concurrent.futures
import errno
import json
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu

from .._errors import BatchError, bullet_list
from .._file_format import BadFileError, ForeignFileError, read_metadata
from .._serialise import write_tree
from .._tree import as_key_data, is_int
from ._checkpoint_files import (
    chunk_path as chunk_path,
    DrawFile,
    longest_file_name as longest_file_name,
    RunFiles,
    StateFile,
    uncovered,
    warn_of_other_chunkings as warn_of_other_chunkings,
)
from ._checkpoint_rows import own_rows, RowReader, rows_on_host
from ._common import ChainState, Draws
from ._disk_trace import ListedFile
from ._identity import RunIdentity
from ._job import every_process, raise_if_any_failed
from ._lock import is_writer, WriteAccess
from ._problem_records import ProblemRecords
from ._stopping import Record


class SegmentFiles(NamedTuple):
    """Where a segment's new draws go: draws `first` to `stop`, and where they lie
    in the `emit` draws the segment returns (see `SegmentPlan.emit`)."""

    first: int
    stop: int
    emit: int
    offset: int  # of the first draw, along axis 1 of what the segment returns


class Restored(NamedTuple):
    """A run as checkpointed: its steps, where its rows are, `until`'s record."""

    steps_done: int
    rows: RowReader  # reads the chains and draws of any rows, to place them
    record: Record | ProblemRecords | None  # the checks of `until`; None without it


class Snapshot(NamedTuple):
    """What one checkpoint writes: the chains after `steps_done` steps, and new draws.

    Arrays are split over the devices of every process, may still be being computed,
    and may hold padding chains (rows beyond the run's chains); `draws` holds what the
    segment returned of the trace, or None when it recorded nothing to write.
    """

    steps_done: int
    chains: ChainState
    draws: Any
    files: SegmentFiles | None
    record: Record | ProblemRecords | None  # with `until`: the checks so far


_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

# Metadata entries of every file of a run.
_IDENTITY = "run_chains.run"
_RUN_ID = "run_chains.run_id"
_PROGRESS = "run_chains.progress"


class Checkpoint:
    """A run's checkpoint files: read back, then written in the background.

    Used as a context manager. `restore` reads what is there without writing; a run
    with steps left then calls `start_writing`, which takes the right to write
    (`access`, shared by every chunk of a chunked run: the folder, the lock, and in a
    job a folder every process sees), writes the run file and starts this process's
    writer thread. Leaving it waits for the last write.
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
        self.files = RunFiles(path, identity.run_id)
        # The draw files known to hold this run's draws: read back, or written here.
        self.draw_files: list[DrawFile] = []
        # The newest step that every process has written (None: none yet).
        self.steps_written: int | None = None
        self._has_run_file = False
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._pending_step: int | None = None
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
            self._settle()

    def start_writing(self) -> None:
        """Takes the right to write (see `WriteAccess`), writes the run file (process
        0) and starts this process's writer."""
        self.access.acquire()
        if not self._has_run_file:
            failure = None
            if is_writer():
                try:
                    write_tree(self.path, {}, metadata=self._metadata)
                except OSError as e:
                    failure = self._write_failed(e, 0)
            raise_if_any_failed(
                failure,
                f"Writing the run file of `checkpoint` ({self.path})",
                fix="Nothing else was written.",
            )
            self._has_run_file = True
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1)

    # -- reading back ----------------------------------------------------------------

    def restore(
        self,
        chains_like: ChainState,
        trace_like: Any,
        *,
        num_steps: int,
        draws: Draws,
        record_kind: type[Record] | type[ProblemRecords] | None,
    ) -> Restored | None:
        """The run as last checkpointed; None if there is no checkpoint, or no step
        whose state files cover every chain.

        `chains_like` and `trace_like` (the whole trace, or None) are shape-dtype
        structs. Only the files' metadata are read here: the arrays are read when
        placed (`RowReader`), each process reading the rows its devices hold. Nothing
        is written. A run with `until` reads the record of its checks, a `record_kind`.

        Raises if a file is not a checkpoint's, is corrupt, or belongs to another run;
        in a job, in every process if any process raises, or if the processes found
        different steps (they do not see the same folder).
        """
        failure, restored = None, None
        try:
            restored = self._restored(
                chains_like,
                trace_like,
                num_steps=num_steps,
                draws=draws,
                record_kind=record_kind,
            )
        except BatchError as e:
            failure = e
        raise_if_any_failed(
            failure,
            f"Reading `checkpoint` ({self.path})",
            fix="Nothing was run or written.",
        )
        if jax.process_count() > 1:
            found = "nothing" if restored is None else f"step {restored.steps_done}"
            seen = every_process(found)
            if len(set(seen)) > 1:
                raise BatchError(
                    f"The processes of this job read different checkpoints at "
                    f"`checkpoint` ({self.path}): "
                    + ", ".join(f"process {i} found {s}" for i, s in enumerate(seen))
                    + ". Every process of the job must see the checkpoint's folder, "
                    "a shared file system mounted at the same path; nothing was run "
                    "or written."
                )
        return restored

    def _restored(
        self,
        chains_like: ChainState,
        trace_like: Any,
        *,
        num_steps: int,
        draws: Draws,
        record_kind: type[Record] | type[ProblemRecords] | None,
    ) -> Restored | None:
        if not self.path.exists():
            return None
        metadata = self._read_metadata(self.path, "checkpoint")
        if _IDENTITY not in metadata:
            raise BatchError(
                f"`checkpoint` ({self.path}) is an eqx_batch file but not a "
                "`run_chains` checkpoint (it has no run description). Pass another "
                "path: this one would be overwritten."
            )
        self._check_run(self.path, metadata)
        if _PROGRESS in metadata:
            raise BatchError(
                f"`checkpoint` ({self.path}) was written by an earlier eqx_batch, "
                "whose checkpoints keep every chain in this one file; this eqx_batch "
                "writes each process's chains to files of their own and cannot read "
                "it. Finish the run with the eqx_batch that wrote it, or delete the "
                "checkpoint's files to start it afresh."
            )
        self._has_run_file = True
        tiles = self.files.newest_complete(self.num_chains)
        if tiles is None:
            return None
        progress = [self._progress(tile, num_steps) for tile in tiles]
        steps_done = tiles[0].step
        record = None
        if record_kind is not None:
            try:
                record = record_kind.from_json(progress[0]["stopping"], draws.burn_in)
            except (ValueError, TypeError, KeyError) as e:
                raise self.damaged(
                    f"its record of `until`'s checks does not parse ({e!r})"
                ) from None
            problem = record.disagreement(steps_done)
            if problem is not None:
                raise self.damaged(problem)
        draw_files = self._listed_draws(progress, tiles)
        num_draws = 0 if trace_like is None else draws.before(steps_done)
        gap = uncovered(draw_files, (0, self.num_chains), num_draws)
        if gap is not None:
            raise self.damaged(
                f"the state files of step {steps_done} list no draw file for draw "
                f"{gap[1]} of chain {gap[0]}, of the {num_draws} that {steps_done} "
                "steps record"
            )
        if trace_like is None and draw_files:
            raise self.damaged("it lists draw files for a run without a trace")
        self.draw_files = draw_files
        self.steps_written = steps_done
        rows = RowReader(
            self,
            chains_like=as_key_data(chains_like._asdict()),
            trace_like=None if trace_like is None else as_key_data(trace_like),
            states=tiles,
            draws=draw_files,
            num_draws=num_draws,
        )
        return Restored(steps_done, rows, record)

    def draw_listing(self) -> list[ListedFile]:
        """The draw files of the newest complete step, for a reader of the draws on
        disk (`disk_trace`): together every chain's draws so far, in order of draws,
        then chains; files of several layouts may overlap, with the same bits. Empty
        before a step is complete. Call it after the writes: in a job, leaving the
        checkpoint waits for them in every process."""
        tiles = self.files.newest_complete(self.num_chains)
        if tiles is None:
            return []
        progress = [self._progress(tile, tile.step) for tile in tiles]
        entries = sorted(
            self._listed_draws(progress, tiles), key=lambda e: (e.draws, e.rows)
        )
        names_run = {_RUN_ID: self.identity.run_id}
        return [
            ListedFile(
                self.path.with_name(e.name), e.rows, e.draws, names_run, e.holds()
            )
            for e in entries
        ]

    def _progress(self, tile: StateFile, num_steps: int) -> dict:
        """The progress record of a state file, checked against its name."""
        metadata = self._read_metadata(tile.path, "state file")
        self._check_run(tile.path, metadata)
        try:
            progress = json.loads(metadata[_PROGRESS])
            steps_done, rows = progress["steps_done"], tuple(progress["rows"])
            progress["draws"] = [DrawFile.from_json(e) for e in progress["draws"]]
        except (ValueError, TypeError, KeyError) as e:
            raise self.damaged(
                f"the progress record of its state file {tile.path.name} does not "
                f"parse ({e})"
            ) from None
        if not (is_int(steps_done) and 0 <= steps_done <= num_steps):
            raise self.damaged(
                f"its progress says {steps_done!r} steps were done, of {num_steps}"
            )
        if (steps_done, rows) != (tile.step, tile.rows):
            raise self.damaged(
                f"its state file {tile.path.name} says it holds chains {rows} after "
                f"step {steps_done}: the checkpoint's files were mixed up"
            )
        return progress

    def _listed_draws(self, progress: list[dict], tiles: list[StateFile]) -> list:
        """The draw files that the state files list, once each, checked to be named
        as this run names them."""
        listed: dict[str, DrawFile] = {}
        for record, tile in zip(progress, tiles, strict=True):
            for entry in record["draws"]:
                rows, drawn = entry.rows, entry.draws
                if not (
                    all(is_int(x) for x in (*rows, *drawn))
                    and 0 <= rows[0] < rows[1] <= self.num_chains
                    and 0 <= drawn[0] < drawn[1]
                    and entry.name == self.files.draws_name(rows, drawn)
                ):
                    raise self.damaged(
                        f"its state file {tile.path.name} lists the draw file "
                        f"{entry.name!r} for chains {rows!r} and draws {drawn!r}, "
                        "which is not this run's file of them (expected "
                        "`<name>.<run id>.rows-A-B.draws-X-Y`)"
                    )
                listed[entry.name] = entry
        return list(listed.values())

    def check_draw_file(self, entry: DrawFile) -> pathlib.Path:
        """The path of a listed draw file, checked to hold what the listing says."""
        path = self.path.with_name(entry.name)
        metadata = self._read_metadata(path, "draw file")
        self._check_run(path, metadata)
        expected = tuple(entry.holds().values())
        holds = tuple(metadata.get(key) for key in entry.holds())
        if holds != expected:
            raise BatchError(
                f"the draw file {path} of `checkpoint` ({self.path}) holds chains "
                f"{holds[0]!r} and draws {holds[1]!r}, but the checkpoint names it "
                f"for chains {expected[0]} and draws {expected[1]}: the "
                "checkpoint's files were mixed up. Delete them to start this run "
                "afresh."
            )
        return path

    def damaged(self, problem: str) -> BatchError:
        return BatchError(
            f"`checkpoint` ({self.path}) cannot be resumed: {problem}. Delete the "
            "checkpoint's files (or pass another path) to start this run afresh."
        )

    def _check_run(self, path: pathlib.Path, metadata: Mapping[str, str]) -> None:
        try:
            saved = json.loads(metadata[_IDENTITY])
        except (KeyError, ValueError):
            saved = None
        if not isinstance(saved, dict):
            raise BatchError(
                f"the file {path} of `checkpoint` ({self.path}) has no readable run "
                "description: it is not a `run_chains` checkpoint file."
            )
        differences = self.identity.differences(saved)
        if differences or metadata.get(_RUN_ID) != self.identity.run_id:
            where = (
                f"`checkpoint` ({self.path})"
                if path == self.path
                else f"the file {path} of `checkpoint` ({self.path})"
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
            raise self.unreadable(what, e) from None

    def unreadable(self, what: str, error: Exception) -> BatchError:
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
        return SegmentFiles(first, end, emit, offset)

    def write(self, snapshot: Snapshot) -> None:
        """Writes this process's rows of `snapshot` in the background, once the
        previous write is done (in every process of a job: see `_settle`).

        At most one write is in flight: a slow disk slows the run down rather than
        piling up copies of the draws.
        """
        assert self._thread is not None
        # Off a CPU, the copies to the host start as soon as the segment ends, rather
        # than when the writer thread asks for them.
        for leaf in jtu.tree_leaves(snapshot):
            if isinstance(leaf, jax.Array):
                for shard in leaf.addressable_shards:
                    shard.data.copy_to_host_async()
        self._settle()
        rows = own_rows(snapshot.chains.first_bad, self.num_chains)
        self._pending = self._thread.submit(self._write, snapshot, rows)
        self._pending_step = snapshot.steps_done

    def _settle(self) -> None:
        """Waits for the write in flight; in a job, every process then learns
        whether every process's write succeeded (a collective, at the same points in
        every process), and all raise if one failed."""
        if self._thread is None or (self._pending is None and jax.process_count() == 1):
            return
        failure, step = None, self._pending_step
        if self._pending is not None:
            pending, self._pending, self._pending_step = self._pending, None, None
            try:
                pending.result()
            except BatchError as e:
                failure = e
        kept = self._kept()
        raise_if_any_failed(
            failure,
            f"Writing `checkpoint` ({self.path}) after step {step}",
            fix=f"{kept[0].upper()}{kept[1:]}: call `run_chains` again to resume once "
            "the cause is fixed.",
        )
        if step is not None:
            self.steps_written = step

    def _kept(self) -> str:
        if self.steps_written is None:
            return "no checkpoint was complete before"
        return f"the checkpoint of step {self.steps_written} is kept"

    def _write_failed(self, error: OSError, step: int) -> BatchError:
        fix = "Free space" if error.errno in _DISK_FULL else "Fix the cause"
        return BatchError(
            f"writing `checkpoint` ({self.path}) after step {step} failed in process "
            f"{jax.process_index()}: {error.strerror or error} "
            f"({error.filename or self.path}); {self._kept()}. {fix} and call "
            "`run_chains` again to resume."
        )

    def _write(self, snapshot: Snapshot, own: list[tuple[int, int]]) -> None:
        # On the writer thread: each host copy waits for its segment to finish.
        written: list[DrawFile] = []
        try:
            for rows in own:
                if snapshot.files is not None:
                    written.append(self._write_draws(snapshot, rows))
                self._write_state(snapshot, rows, [*self.draw_files, *written])
            self.files.remove_states_before(self.num_chains)
        except OSError as e:
            raise self._write_failed(e, snapshot.steps_done) from e
        self.draw_files = [*self.draw_files, *written]

    def _write_draws(self, snapshot: Snapshot, rows: tuple[int, int]) -> DrawFile:
        files = snapshot.files
        assert files is not None
        in_file = slice(files.offset, files.offset + files.stop - files.first)
        draws = jtu.tree_map(
            lambda x: rows_on_host(x, rows)[:, in_file], snapshot.draws
        )
        entry = DrawFile(
            self.files.draws_name(rows, (files.first, files.stop)),
            rows,
            (files.first, files.stop),
        )
        write_tree(
            self.path.with_name(entry.name),
            draws,
            metadata={**self._metadata, **entry.holds()},
            keep_cached=False,
        )
        return entry

    def _write_state(
        self, snapshot: Snapshot, rows: tuple[int, int], draw_files: list[DrawFile]
    ) -> None:
        state = jtu.tree_map(lambda x: rows_on_host(x, rows), snapshot.chains._asdict())
        progress: dict[str, Any] = {
            "steps_done": snapshot.steps_done,
            "rows": list(rows),
            # The draw files of these rows: others' may hold more rows than these.
            "draws": [
                entry.to_json()
                for entry in draw_files
                if entry.rows[0] < rows[1] and rows[0] < entry.rows[1]
            ],
        }
        if snapshot.record is not None:
            progress["stopping"] = snapshot.record.to_json()
        write_tree(
            self.files.state_path(snapshot.steps_done, rows),
            state,
            metadata={**self._metadata, _PROGRESS: json.dumps(progress)},
        )
