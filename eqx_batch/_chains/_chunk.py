"""One chunk of chains: placed on the devices, resumed from its checkpoint if there is
one, advanced one segment at a time and checkpointed after each (`_loop.py` decides
where segments end and in which order chunks move).

Its rows by problem and its running chains in pieces are `_chunk_pieces.py`'s; the
buffers of a `trace="disk"` segment's draws, `_checkpoints/_draw_buffers.py`'s."""

import contextlib
from typing import Any, NamedTuple

import jax
import numpy as np

from .._progress import ProgressBar
from .._tree import structs
from ._all_chains import RunStep
from ._checkpoints._checkpoint import Checkpoint
from ._checkpoints._checkpoint_reader import Expected, Restored
from ._checkpoints._checkpoint_writer import Snapshot
from ._checkpoints._draw_buffers import DrawBuffers
from ._checkpoints._recording import SegmentFiles
from ._checkpoints._run_checkpoint import NoFiles, RunCheckpoint
from ._chunk_pieces import ChunkPieces
from ._common import ChainState
from ._compaction import zeroed_problems
from ._placement import Placement
from ._plan import RunPlan
from ._segment import run_segment
from ._until._problem_records import ProblemRecords


# About how many times the progress bar moves over a run without a checkpoint.
BAR_UPDATES = 16


class RunContext(NamedTuple):
    """What every chunk of a run shares: its plan, and what the run opened."""

    plan: RunPlan
    bar: ProgressBar | None
    checkpoint: RunCheckpoint  # opened: with the right to write it

    def next_stop(self, step: int) -> int:
        """The step the segment from `step` ends at: the plan's next boundary, or
        with a progress bar and no checkpoint, the bar's next update if sooner (the
        bar moves between segments; a checkpointed run moves it at each write)."""
        stop = self.plan.next_boundary(step)
        if self.bar is None or self.checkpoint.bounds_segments:
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


class Advanced(NamedTuple):
    """A chunk after a segment, until its checkpoint is written."""

    steps_done: int
    chains: ChainState
    new_draws: Any  # the segment's draws for the files, or None
    files: SegmentFiles | None  # where they go


class ChunkJob(NamedTuple):
    """One chunk's chains at the start, and which they are (for its checkpoint's
    name)."""

    chains: ChainState
    chunk: range | None  # None: every chain, unchunked
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
            self.store = stack.enter_context(
                context.checkpoint.chunk_files(
                    job.chunk, lambda: plan.identity(job.chains), num_chains
                )
            )
            restored = _restored(self.store, plan, job.chains)
            # The checks of `until` as this chunk's checkpoint has them.
            self.record = None if restored is None else restored.record
            self.placement = plan.placement(num_chains)
            self._pieces = ChunkPieces(
                plan, self.placement, job.chains.problem, num_chains
            )
            self.step, self.steps_done, self.chains, self.trace = _start(
                self.placement,
                plan.step,
                job.chains,
                plan.trace_like(num_chains),
                restored,
                one_segment=0 < plan.num_steps == context.next_stop(0),
            )
            # The steps of the chunks run before it, for the progress bar.
            self.steps_before = job.steps_before
            # The segments run and not yet checkpointed (the loop writes one while
            # the next runs), oldest first.
            self._unwritten: list[Advanced] = []
            # With `trace="disk"`: the draws being written, and those written.
            self._buffers = DrawBuffers(self.placement)
            self._stack = stack.pop_all()

    def __enter__(self) -> "ChunkRun":
        return self

    def __exit__(self, *error: Any) -> None:
        self._stack.__exit__(*error)

    def advance(
        self, stop: int, running: np.ndarray | None = None, live: Any = None
    ) -> None:
        """Runs the chains from `steps_done` to step `stop`, in one segment.

        With `until`, `live` says on the devices whether each problem still runs
        (the segment freezes the chains of the others), and `running`
        (`bool[problems]`, on the host) which problems may: if their chains are few,
        they run in pieces (`_chunk_pieces.py`)."""
        files = self.store.segment_files(
            self.plan.recording, self.plan.draws, self.steps_done, stop
        )
        rows = self._pieces.running_rows(running)
        if rows is not None:
            self.chains, self.trace, new_draws = self._pieces.advance(
                self.step,
                self.chains,
                self.trace,
                self.steps_done,
                stop,
                rows,
                live,
                files,
            )
            return self._advanced(stop, new_draws, files)
        plan = self.plan
        emit = 0 if files is None else files.emit
        # With the trace on disk, the segment's own draws, from its first, written
        # over a buffer whose draws are in their file (`DrawBuffers`).
        own = plan.recording.own_draws(
            files,
            lambda emit: self._buffers.take(
                plan.draws_like(self.placement.num_chains, emit)
            ),
        )
        trace = self.trace if own is None else own
        # The first step is traced, also in a run of one segment: as a constant, it
        # made the TPU's loop 7% faster with a trace and no `data`, and 12% slower
        # with `data` (issue 34). One program serves every segment of a length.
        result = run_segment(
            plan.prepared.segment(
                plan.segment, stop - self.steps_done, emit, self._pieces.block
            ),
            self.step,
            plan.static,
            self.chains,
            np.int32(self.steps_done),
            trace,
            live,
        )
        self.chains, self.trace = result.chains, result.trace
        self._advanced(stop, result.new_draws, files)

    def _advanced(self, stop: int, new_draws: Any, files: SegmentFiles | None) -> None:
        self.steps_done = stop
        self._unwritten.append(Advanced(stop, self.chains, new_draws, files))

    @property
    def oldest(self) -> "Advanced":
        """The oldest segment not yet checkpointed."""
        return self._unwritten[0]

    def forget_last(self, steps_done: int) -> None:
        """Forgets the last segment, run in vain: every problem had stopped, at
        `steps_done` at the latest, so that it froze every chain, and its draws
        are zeros where the trace holds zeros."""
        self._unwritten.pop()
        self.steps_done = steps_done

    def everywhere(self, x: Any) -> Any:
        """`x` (on the host, or on one device of this process) whole on each device
        of the chunk: a copy between devices in one process; in a job, through the
        host (the same value in every process)."""
        if jax.process_count() > 1:
            x = np.asarray(x)
        return jax.device_put(x, self.placement.everywhere)

    def discard(self, problems: Any) -> None:
        """Starts afresh the moments of the chains of `problems` (`bool[problems]`,
        placed by `everywhere`), in the chains and in the last segment's snapshot:
        their check failed, and a failed check's window is discarded."""
        moments = zeroed_problems(
            self.chains.moments, problems, self.chains.problem, self.placement.split
        )
        self.chains = self.chains._replace(moments=moments)
        self._unwritten[-1] = self._unwritten[-1]._replace(chains=self.chains)

    def write(self, record: ProblemRecords | None = None) -> None:
        """Checkpoints the chains after the oldest segment not yet written (in the
        background), with `until`'s `record`."""
        done = self._unwritten.pop(0)
        # Every process writes the rows its own devices hold: nothing is gathered.
        self.store.write(
            Snapshot(done.steps_done, done.chains, done.new_draws, done.files, record)
        )
        self.plan.recording.handed_over(self._buffers, done.new_draws)

    def moments(self, chains: ChainState | None = None) -> Any:
        """The running moments of the real chains (of `chains`, by default the
        last), whole on every process (small: per chain, not per draw)."""
        return self.placement.whole_real_chains((chains or self.chains).moments)

    def first_bad(self, chains: ChainState | None = None) -> Any:
        """The NaN report of the real chains (`ChainState.first_bad`) of `chains` (by
        default the last), whole on every process."""
        return self.placement.whole_real_chains((chains or self.chains).first_bad)

    def result(self) -> tuple[ChainState, Any]:
        """The chains and their trace: the trace buffer (in a job of several
        processes, split by chain: each process holds its own chains' rows), or with
        `trace="disk"` the draw files that hold it (`ListedFile`s, their rows counted
        in the chunk); None without a trace."""
        if self.trace is not None:
            trace = self.placement.real_chains(self.trace)
        else:
            trace = self.plan.recording.listing(self._draw_listing)
        return self.placement.real_chains(self.chains), trace

    def _draw_listing(self) -> Any:
        return self.store.draw_listing()


def _restored(
    store: Checkpoint | NoFiles, plan: RunPlan, chains: ChainState
) -> Restored | None:
    """The chunk of `chains` as checkpointed in `store`, if it was; writing starts
    unless it is done."""
    # What is expected is made only if there are files to check it against. The
    # whole trace's structs, with `trace="disk"` too: the files listed are checked
    # to hold every draw so far (only their metadata is read here).
    restored = store.restore(
        lambda: Expected(
            structs(chains),
            plan.draws_like(chains.keys.shape[0]),
            plan.num_steps,
            plan.draws,
            checks=plan.stopping.keeps_record,
            problems=plan.problems,
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
        store.start_writing()
    return restored


def _start(
    placement: Placement,
    step: RunStep,
    chains: ChainState,
    trace_like: Any,
    restored: Restored | None,
    *,
    one_segment: bool,
) -> tuple[RunStep, int, ChainState, Any]:
    """The step with its `data` on the devices, and the steps done, the chains and the
    trace buffer there, at the start or as checkpointed.

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
        chains, data = placement.put(
            chains._replace(first_bad=None, moments=None), step.data
        )
        chains = chains._replace(first_bad=first_bad, moments=moments)
        return _with_placed_data(step, data), 0, chains, trace
    # Each process reads the rows its devices hold, whatever layout wrote them.
    trace = None
    if trace_like is not None:
        trace = restored.rows.trace(placement, trace_like)
    _, data = placement.put(None, step.data)
    chains = restored.rows.chains(placement, chains)
    return _with_placed_data(step, data), restored.steps_done, chains, trace


def _with_placed_data(step: RunStep, data: Any) -> RunStep:
    # Without `data`, the step is not asked (an `eqx.Module`'s methods cost a bound
    # method made on every call).
    return step if data is None else step.with_placed_data(data)
