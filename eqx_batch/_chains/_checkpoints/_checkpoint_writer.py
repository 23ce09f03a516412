"""A checkpoint written in the background: the writer thread, the write in flight, and
the files each write makes.

Each process writes the rows its own devices hold (`own_rows`), copied from its own
shards, in its own writer thread, with no gathering between processes: per segment,
one draw file and one state file per run of rows (`_checkpoint_files.py` names them).
Draw files are written before the state files that list them, and every file
atomically, so a kill at any moment loses at most the segment in flight. At most one
write is in flight; in a job, every process learns after each whether every process's
write succeeded (`_jobs/_job.py`).
"""

import concurrent.futures
import errno
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu

from ..._errors import BatchError
from ..._files._serialise import write_tree
from .._common import ChainState, ProblemForm
from .._jobs._job import raise_if_any_failed
from .._until._problem_records import ProblemRecords
from ._checkpoint_files import DrawFile, OnDisk, RunFiles
from ._checkpoint_metadata import RunMetadata
from ._checkpoint_rows import own_rows, rows_on_host
from ._lock import is_writer, WriteAccess
from ._recording import SegmentFiles


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
    record: ProblemRecords | None  # with `until`: the checks so far


_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class CheckpointWriter:
    """Writes the checkpoint of `num_chains` chains of the run that `metadata` names,
    going on from what the reader found there (`on_disk`).

    `start` takes the right to write (`access`, shared by every chunk of a chunked
    run: the folder, the lock, and in a job a folder every process sees), writes the
    run file and starts this process's writer thread; `close` waits for the last
    write.
    """

    def __init__(
        self,
        metadata: RunMetadata,
        num_chains: int,
        access: WriteAccess,
        on_disk: OnDisk,
        problems: ProblemForm,
    ):
        self.metadata = metadata
        self.path = metadata.path
        self.num_chains = num_chains
        self.access = access
        self.files = RunFiles(metadata.path, metadata.identity.run_id)
        self._has_run_file = on_disk.run_file
        # The newest step that every process has written (None: none yet).
        self._steps_written = on_disk.steps_done
        # The draw files known to hold this run's draws: read back, or written here.
        self._draw_files = list(on_disk.draw_files)
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._pending_step: int | None = None
        # The form the files keep the record in: one problem's, without `data`.
        self._problems = problems

    def start(self) -> None:
        """Takes the right to write (see `WriteAccess`), writes the run file (process
        0) and starts this process's writer thread."""
        self.access.acquire()
        if not self._has_run_file:
            failure = None
            if is_writer():
                try:
                    write_tree(self.path, {}, metadata=self.metadata.entries)
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

    def close(self, *, failed: bool) -> None:
        """Stops the writer thread once its write is done; unless the run `failed`,
        then raises (in every process of a job) if the write failed anywhere."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if not failed:
            self._settle()

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
            self._steps_written = step

    def _kept(self) -> str:
        if self._steps_written is None:
            return "no checkpoint was complete before"
        return f"the checkpoint of step {self._steps_written} is kept"

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
                self._write_state(snapshot, rows, [*self._draw_files, *written])
            self.files.remove_states_before(self.num_chains)
        except OSError as e:
            raise self._write_failed(e, snapshot.steps_done) from e
        self._draw_files = [*self._draw_files, *written]

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
            metadata={**self.metadata.entries, **entry.holds()},
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
            # As of this step: a chunk further on may have added later checks.
            record = snapshot.record.as_of(snapshot.steps_done)
            progress["stopping"] = record.to_json(self._problems)
        write_tree(
            self.files.state_path(snapshot.steps_done, rows),
            state,
            metadata=self.metadata.of_state_file(progress),
        )
