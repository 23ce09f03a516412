"""A checkpoint read back: the run as last checkpointed, checked file by file, and the
draw files that hold its draws.

Reading writes nothing, so a finished run reads back from read-only storage. Only the
files' metadata are read here (`_checkpoint_metadata.py`): the newest step whose state
files cover every chain (`RunFiles.newest_complete`), its progress records, and the
draw files they list, checked to cover every draw so far. The arrays are read when they
are placed, each process reading the rows its devices hold (`_checkpoint_rows.py`).

What the writer needs to go on from is handed to it as data (`OnDisk`): the reader
and the writer never call each other.
"""

import pathlib
from typing import Any, NamedTuple

import jax

from ..._errors import BatchError
from ..._tree import as_key_data, is_int
from .._common import ChainState, Draws, ProblemForm
from .._jobs._job import every_process, raise_if_any_failed
from .._until._problem_records import ProblemRecords
from ._checkpoint_files import DrawFile, OnDisk, RunFiles, StateFile, uncovered
from ._checkpoint_metadata import RunMetadata
from ._checkpoint_rows import RowReader
from ._disk_trace import ListedFile


class Expected(NamedTuple):
    """What a run expects its checkpoint to hold: the structs it restores, its steps
    and draws, and how it keeps the record of `until`'s checks."""

    chains_like: ChainState  # shape-dtype structs
    trace_like: Any  # the whole trace's structs; None without a trace
    num_steps: int
    draws: Draws
    checks: bool  # whether it keeps a record of `until`'s checks
    # Its problems, whose form the record is kept in (one problem's without `data`).
    problems: ProblemForm


class Restored(NamedTuple):
    """A run as checkpointed: its steps, where its rows are, `until`'s record."""

    steps_done: int
    rows: RowReader  # reads the chains and draws of any rows, to place them
    # The checks of `until`, one per problem (one without `data`); None without it.
    record: ProblemRecords | None


class Found(NamedTuple):
    """What `CheckpointReader.read` found: what is on disk, for the writer, and the
    run to resume (None without a step that covers every chain)."""

    on_disk: OnDisk
    restored: Restored | None


class CheckpointReader:
    """The checkpoint of `num_chains` chains of the run that `metadata` names, read
    back."""

    def __init__(self, metadata: RunMetadata, num_chains: int):
        self.metadata = metadata
        self.path = metadata.path
        self.num_chains = num_chains
        self.files = RunFiles(metadata.path, metadata.identity.run_id)

    def read(self, expected: Expected) -> Found:
        """The run as last checkpointed, and what of it is on disk, checked against
        what the run `expected`.

        Raises if a file is not a checkpoint's, is corrupt, or belongs to another run;
        in a job, in every process if any process raises, or if the processes found
        different steps (they do not see the same folder).
        """
        failure, found = None, Found(OnDisk(), None)
        try:
            found = self._found(expected)
        except BatchError as e:
            failure = e
        raise_if_any_failed(
            failure,
            f"Reading `checkpoint` ({self.path})",
            fix="Nothing was run or written.",
        )
        _check_every_process_found(self.path, found.restored)
        return found

    def _found(self, expected: Expected) -> Found:
        if not self.path.exists():
            return Found(OnDisk(), None)
        self._check_run_file()
        tiles = self.files.newest_complete(self.num_chains)
        if tiles is None:
            return Found(OnDisk(run_file=True), None)
        progress = [self._progress(tile, expected.num_steps) for tile in tiles]
        steps_done = tiles[0].step
        record = None
        if expected.checks:
            record = self._record(progress[0], expected, steps_done)
        trace_like = expected.trace_like
        num_draws = 0 if trace_like is None else expected.draws.before(steps_done)
        draw_files = self._draw_files(progress, tiles, num_draws, trace_like)
        rows = RowReader(
            self.metadata,
            chains_like=as_key_data(expected.chains_like._asdict()),
            trace_like=None if trace_like is None else as_key_data(trace_like),
            states=tiles,
            draws=draw_files,
            num_draws=num_draws,
        )
        return Found(
            OnDisk(True, steps_done, tuple(draw_files)),
            Restored(steps_done, rows, record),
        )

    def _check_run_file(self) -> None:
        """Raises unless the run file is this run's, as this eqx_batch writes it."""
        metadata = self.metadata.read(self.path, "checkpoint")
        if not self.metadata.is_run_description(metadata):
            raise BatchError(
                f"`checkpoint` ({self.path}) is an eqx_batch file, not a `run_chains` "
                "checkpoint: pass another path."
            )
        self.metadata.check_run(self.path, metadata)
        if self.metadata.has_progress(metadata):
            raise BatchError(
                f"`checkpoint` ({self.path}) was written by an earlier eqx_batch: "
                f"finish it with that one (see docs/chains.md#checkpoint-and-resume)."
            )

    def _record(
        self, progress: dict, expected: Expected, steps_done: int
    ) -> ProblemRecords:
        """The record of `until`'s checks in a state file's `progress`, checked
        against its steps: one problem's as it is kept without `data`."""
        problems = expected.problems
        try:
            record = ProblemRecords.from_json(
                progress["stopping"], expected.draws.burn_in, problems
            )
        except (ValueError, TypeError, KeyError) as e:
            raise self.metadata.damaged(
                f"its record of `until`'s checks does not parse ({e!r})"
            ) from None
        problem = record.disagreement(steps_done, problems)
        if problem is not None:
            raise self.metadata.damaged(problem)
        return record

    def _draw_files(
        self,
        progress: list[dict],
        tiles: list[StateFile],
        num_draws: int,
        trace_like: Any,
    ) -> list[DrawFile]:
        """The draw files that the state files list, checked to hold every chain's
        first `num_draws` draws, and to be none without a trace."""
        draw_files = self._listed_draws(progress, tiles)
        gap = uncovered(draw_files, (0, self.num_chains), num_draws)
        if gap is not None:
            steps_done = tiles[0].step
            raise self.metadata.damaged(
                f"no draw file for draw {gap[1]} of chain {gap[0]} "
                f"(of {num_draws}, step {steps_done})"
            )
        if trace_like is None and draw_files:
            raise self.metadata.damaged("it lists draw files for a run without a trace")
        return draw_files

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
        names_run = self.metadata.naming_the_run()
        return [
            ListedFile(
                self.path.with_name(e.name), e.rows, e.draws, names_run, e.holds()
            )
            for e in entries
        ]

    def _progress(self, tile: StateFile, num_steps: int) -> dict:
        """The progress record of a state file, checked against its name."""
        metadata = self.metadata.read_checked(tile.path, "state file")
        try:
            progress = self.metadata.progress(metadata)
            steps_done, rows = progress["steps_done"], tuple(progress["rows"])
            progress["draws"] = [DrawFile.from_json(e) for e in progress["draws"]]
        except (ValueError, TypeError, KeyError) as e:
            raise self.metadata.damaged(
                f"the progress record of its state file {tile.path.name} does not "
                f"parse ({e})"
            ) from None
        if not (is_int(steps_done) and 0 <= steps_done <= num_steps):
            raise self.metadata.damaged(
                f"its progress says {steps_done!r} steps were done, of {num_steps}"
            )
        if (steps_done, rows) != (tile.step, tile.rows):
            raise self.metadata.damaged(
                f"its state file {tile.path.name} holds chains {rows} after step "
                f"{steps_done}"
            )
        return progress

    def _listed_draws(
        self, progress: list[dict], tiles: list[StateFile]
    ) -> list[DrawFile]:
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
                    raise self.metadata.damaged(
                        f"its state file {tile.path.name} lists {entry.name!r}, "
                        "not this run's draw file"
                    )
                listed[entry.name] = entry
        return list(listed.values())


def _check_every_process_found(path: pathlib.Path, restored: Restored | None) -> None:
    """In a job, raises in every process unless every process found the same step of
    the checkpoint at `path` (a collective): one that found another does not see the
    same folder."""
    if jax.process_count() == 1:
        return
    found = "nothing" if restored is None else f"step {restored.steps_done}"
    seen = every_process(found)
    if len(set(seen)) > 1:
        raise BatchError(
            f"The processes of this job read different checkpoints at "
            f"`checkpoint` ({path}): "
            + ", ".join(f"process {i} found {s}" for i, s in enumerate(seen))
            + ". Every process of the job must see the checkpoint's folder, "
            "a shared file system mounted at the same path; nothing was run "
            "or written."
        )
