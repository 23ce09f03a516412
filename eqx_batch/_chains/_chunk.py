"""One chunk of chains: placed on the devices, resumed from its checkpoint if there is
one, advanced one segment at a time and checkpointed after each (`_loop.py` decides
where segments end and in which order chunks move)."""

import contextlib
import pathlib
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np

from .._progress import ProgressBar
from .._tree import structs
from ._checkpoint import Checkpoint
from ._checkpoint_reader import Expected, Restored
from ._checkpoint_writer import segment_files, SegmentFiles, Snapshot
from ._common import ChainState
from ._compaction import (
    batch_size,
    batch_slots,
    draws_written_back,
    gathered,
    padded_rows,
    sliced_draws,
    written_back,
    zeroed_rows,
)
from ._lock import WriteAccess
from ._placement import Placement
from ._plan import RunPlan
from ._problem_records import ProblemRecords
from ._segment import run_segment
from ._segment_plan import TraceMode


# About how many times the progress bar moves over a run without a checkpoint.
BAR_UPDATES = 16


class RunContext(NamedTuple):
    """What every chunk of a run shares: its plan, and what the run opened."""

    plan: RunPlan
    bar: ProgressBar | None
    access: WriteAccess | None  # the right to write the checkpoint, if any

    def next_stop(self, step: int) -> int:
        """The step the segment from `step` ends at: the plan's next boundary, or
        with a progress bar and no checkpoint, the bar's next update if sooner (the
        bar moves between segments; a checkpointed run moves it at each write)."""
        stop = self.plan.next_boundary(step)
        if self.bar is None or self.access is not None:
            return stop
        every = bar_spacing(self.plan.num_steps)
        return min(stop, (step // every + 1) * every)


def bar_spacing(num_steps: int) -> int:
    """The steps between two moves of the progress bar: about `num_steps /
    BAR_UPDATES`, chosen to divide `num_steps` where a divisor is near, so that every
    segment is one compiled length."""
    spacings = [
        num_steps // count
        for count in range(BAR_UPDATES // 2, 2 * BAR_UPDATES + 1)
        if num_steps % count == 0
    ]
    if not spacings:
        return max(1, -(-num_steps // BAR_UPDATES))
    return min(spacings, key=lambda s: abs(num_steps / s - BAR_UPDATES))


class ChunkJob(NamedTuple):
    """One chunk's chains at the start, and where it is checkpointed."""

    chains: ChainState
    checkpoint: pathlib.Path | None
    steps_before: int  # the steps of the chunks run before it, for the progress bar


class ChunkRun:
    """One chunk of chains, placed on the devices (resumed from its checkpoint if
    there is one) and advanced one segment at a time, so that with `until` the chunks
    of a run can take turns window by window.

    Used as a context manager: it holds the chunk's checkpoint.
    """

    def __init__(self, context: RunContext, job: ChunkJob):
        self.plan = plan = context.plan
        # Closed here if opening fails (nothing else would close the checkpoint's
        # writer); kept open for the with-block otherwise.
        with contextlib.ExitStack() as stack:
            num_chains = job.chains.keys.shape[0]
            self.store: Checkpoint | None = None
            restored = None
            if job.checkpoint is not None:
                assert context.access is not None
                self.store = stack.enter_context(
                    Checkpoint(
                        job.checkpoint,
                        plan.identity(job.chains),
                        num_chains,
                        context.access,
                    )
                )
                # The whole trace's structs, with `trace="disk"` too: the files
                # listed are checked to hold every draw so far (only their metadata
                # is read here; the files are the trace).
                restored = self._restore(
                    structs(job.chains), plan.draws_like(num_chains)
                )
            # The checks of `until` as this chunk's checkpoint has them.
            self.record = None if restored is None else restored.record
            self.placement = plan.placement(num_chains)
            # Each chain's problem, on the host (a run without `data` is one
            # problem); with `data`, one copy of it on every device of the chunk's
            # chains.
            if job.chains.problem is None:
                self.problem_of_row = np.zeros(num_chains, np.intp)
            else:
                self.problem_of_row = np.asarray(job.chains.problem)
            # The chains that share a problem, in blocks of this many on a device.
            self.block = self.placement.block_size(self.problem_of_row)
            self.step = plan.step
            if plan.data is not None:
                # Asked only of a step with `data`: asking an `eqx.Module` costs a
                # bound method made on every call.
                self.step = plan.step.placed(self.placement.everywhere)
            self.steps_done, self.chains, self.trace = _start(
                self.placement,
                job.chains,
                plan.trace_like(num_chains),
                restored,
                one_segment=0 < plan.num_steps == context.next_stop(0),
            )
            # The steps of the chunks run before it, for the progress bar.
            self.steps_before = job.steps_before
            # The last segment's new draws and where they go, until written.
            self._unwritten: tuple[Any, SegmentFiles | None] | None = None
            # With `trace="disk"`: the draws being written, and those written.
            self._writing: Any = None
            self._spare: Any = None
            self._stack = stack.pop_all()

    def __enter__(self) -> "ChunkRun":
        return self

    def __exit__(self, *error: Any) -> None:
        self._stack.__exit__(*error)

    def _restore(self, chains_like: ChainState, trace_like: Any) -> Restored | None:
        """The chunk as checkpointed, if it was; writing starts unless it is done."""
        assert self.store is not None
        plan = self.plan
        restored = self.store.restore(
            Expected(
                chains_like,
                trace_like,
                plan.num_steps,
                plan.draws,
                checks=plan.until is not None,
                one_problem=plan.problems is None,
            )
        )
        done = restored is not None and (
            restored.steps_done == plan.num_steps
            or (
                restored.record is not None
                and restored.steps_done >= restored.record.end(plan.num_steps)
            )
        )
        if not done:
            self.store.start_writing()
        return restored

    def advance(self, stop: int, running: np.ndarray | None = None) -> None:
        """Runs the chains from `steps_done` to step `stop`, in one segment: of the
        problems still `running` (`bool[problems]`), if some have stopped."""
        if running is not None:
            rows = np.flatnonzero(running[self.problem_of_row])
            if len(rows) < len(self.problem_of_row):
                return self._advance_running(stop, rows)
        plan = self.plan
        files = self._files(self.steps_done, stop)
        emit = 0 if files is None else files.emit
        trace = self.trace
        if plan.trace is TraceMode.DISK and files is not None:
            # The segment's own draws, from its first, written over a buffer whose
            # draws are in their file: memory reused rather than allocated for each
            # segment, which the allocator fragments until resident memory grows
            # with the steps. Slots past the segment's draws are not written out.
            like = plan.draws_like(self.placement.num_chains, emit)
            spare, self._spare = self._spare, None
            if spare is None or _shapes(spare) != _shapes(
                self.placement.zeros_to_make(like)
            ):
                spare = self.placement.zeros(like)
            trace = spare
        # The first step is traced, also in a run of one segment: as a constant, it
        # made the TPU's loop 7% faster with a trace and no `data`, and 12% slower
        # with `data` (issue 34). One program serves every segment of a length.
        result = run_segment(
            plan.prepared.segment(
                plan.segment, stop - self.steps_done, emit, self.block
            ),
            self.step,
            plan.shared,
            self.chains,
            np.int32(self.steps_done),
            trace,
        )
        self.chains, self.trace = result.chains, result.trace
        self.steps_done = stop
        self._unwritten = (result.new_draws, files)

    def _advance_running(self, stop: int, rows: np.ndarray) -> None:
        """`advance` for the chains of `rows` only (`_compaction.py`): the others'
        problems have stopped, and their rows stay as they are."""
        plan, start = self.plan, self.steps_done
        split = self.placement.split
        files = self._files(start, stop)
        first, end = plan.draws.before(start), plan.draws.before(stop)
        made = None  # the segment's own draws, from its first, in the batch's rows
        if len(rows):
            # Counted in blocks of a problem's chains (`block_size`), so that the
            # batch's chains of a problem stay in blocks as large as the chunk's.
            unit = self.block
            size = unit * batch_size(
                -(-len(rows) // unit), -(-self.placement.num_chains // unit)
            )
            batch = plan.prepared.placement(size, 0, pad=True)
            batch_rows = padded_rows(rows, batch.num_rows)
            index = jax.device_put(batch_rows, self.placement.everywhere)
            # Where each of the chunk's rows is in the batch, for the write-backs.
            slots = jax.device_put(
                batch_slots(rows, self.placement.num_rows), self.placement.everywhere
            )
            block = batch.block_size(self.problem_of_row[batch_rows])
            emit = (
                plan.draws.most_in(stop - start) if plan.records and end > first else 0
            )
            own = None
            if emit:
                own = batch.zeros(plan.draws_like(batch.num_chains, emit))
            result = run_segment(
                plan.prepared.segment(
                    plan.own_draws_segment, stop - start, emit, block
                ),
                self.step,
                plan.shared,
                gathered(self.chains, index, batch.split),
                np.int32(start),
                own,
            )
            self.chains = written_back(self.chains, result.chains, slots, split)
            if result.new_draws is not None:
                made = (result.new_draws, slots, np.int32(end - first))
        new_draws = None
        if self.trace is not None:
            if made is not None:
                self.trace = draws_written_back(
                    self.trace, made[0], made[1], np.int32(first), made[2], split
                )
            if files is not None:
                new_draws = sliced_draws(self.trace, np.int32(first), files.emit)
        elif plan.trace is TraceMode.DISK and files is not None:
            # The stopped chains' draws are zeros, as in a trace buffer.
            like = plan.draws_like(self.placement.num_chains, files.emit)
            new_draws = self.placement.zeros(like)
            if made is not None:
                new_draws = draws_written_back(
                    new_draws, made[0], made[1], np.int32(0), made[2], split
                )
        self.steps_done = stop
        self._unwritten = (new_draws, files)

    def _files(self, start: int, stop: int) -> SegmentFiles | None:
        """Where the draws of the segment from step `start` to `stop` go: None if the
        chunk is not checkpointed, or the segment records no draw. With the trace on
        disk, the segment returns its own draws, the first at offset 0; else the
        draws around the segment's, sliced from the trace buffer."""
        plan = self.plan
        if self.store is None or not plan.records:
            return None
        files = segment_files(plan.draws, start, stop)
        if files is not None and plan.trace is TraceMode.DISK:
            files = files._replace(offset=0)
        return files

    def write(self, record: ProblemRecords | None = None) -> None:
        """Checkpoints the chains after the last segment (in the background), with
        `until`'s `record`."""
        assert self._unwritten is not None
        new_draws, files = self._unwritten
        self._unwritten = None
        if self.store is None:
            return
        # Every process writes the rows its own devices hold: nothing is gathered.
        self.store.write(
            Snapshot(self.steps_done, self.chains, new_draws, files, record)
        )
        if self.plan.trace is TraceMode.DISK and new_draws is not None:
            # `Checkpoint.write` waited for the write before this one: the draws it
            # wrote are free for the next segment to write over.
            self._spare, self._writing = self._writing, new_draws

    def moments(self) -> Any:
        """The running moments of the real chains, whole on every process (small:
        per chain, not per draw)."""
        return self.placement.whole_real_chains(self.chains.moments)

    def first_bad(self) -> np.ndarray:
        """The NaN report of the real chains (`ChainState.first_bad`), on the host of
        every process."""
        return np.asarray(self.placement.whole_real_chains(self.chains.first_bad))

    def discard_moments(self, failed: np.ndarray) -> None:
        """Starts afresh the moments of the problems whose check `failed`
        (`bool[problems]`): a failed check's window is discarded."""
        rows = failed[self.problem_of_row]
        if rows.all():
            moments = self.placement.zeros(structs(self.chains.moments))
        elif rows.any():
            moments = zeroed_rows(
                self.chains.moments, self.placement.put(rows), self.placement.split
            )
        else:
            return
        self.chains = self.chains._replace(moments=moments)

    def result(self) -> tuple[ChainState, Any]:
        """The chains and their trace: the trace buffer (in a job of several
        processes, split by chain: each process holds its own chains' rows), or with
        `trace="disk"` the draw files that hold it (`ListedFile`s, their rows counted
        in the chunk); None without a trace."""
        trace = None
        if self.trace is not None:
            trace = self.placement.real_chains(self.trace)
        elif self.plan.trace is TraceMode.DISK and self.plan.records:
            assert self.store is not None
            trace = self.store.draw_listing()
        return self.placement.real_chains(self.chains), trace


def _start(
    placement: Placement,
    chains: ChainState,
    trace_like: Any,
    restored: Restored | None,
    *,
    one_segment: bool,
) -> tuple[int, ChainState, Any]:
    """The steps done, the chains and the trace buffer on the devices, at the start or
    as checkpointed.

    At the start of a run of `one_segment`, the trace buffer and the NaN report are
    the shape-dtype structs of their zeros, which the segment's program makes.
    """
    if restored is None:
        # Every chain starts finite and with no draw: its report and its moments are
        # made on the devices, with the trace buffer (placing host arrays costs as
        # much: a millisecond for 16,384 chains' moments on a TPU). Made by the
        # loop's own program if it is the only one, else by one program the segments
        # share.
        like = (trace_like, structs(chains.first_bad), structs(chains.moments))
        if one_segment:
            trace, first_bad, moments = placement.zeros_to_make(like)
        else:
            trace, first_bad, moments = placement.zeros(like)
        chains = placement.put(chains._replace(first_bad=None, moments=None))
        return 0, chains._replace(first_bad=first_bad, moments=moments), trace
    # Each process reads the rows its devices hold, whatever layout wrote them.
    trace = None
    if trace_like is not None:
        trace = restored.rows.trace(placement, trace_like)
    return restored.steps_done, restored.rows.chains(placement, chains), trace


def _shapes(tree: Any) -> list[tuple[int, ...]]:
    return [x.shape for x in jtu.tree_leaves(tree)]
