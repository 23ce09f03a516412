"""One chunk of chains: placed on the devices, resumed from its checkpoint if there is
one, advanced one segment at a time and checkpointed after each (`_turns.py` decides
where segments end and in which order chunks run)."""

import contextlib
import dataclasses
import functools as ft
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend
import jax.tree_util as jtu
import numpy as np

from .._memo import BoundedCache
from .._progress import ProgressHandle
from .._tree import as_key_data, as_keys_like
from ._all_chains import AllChains
from ._checkpoint import Checkpoint, DrawFile, Restored, Snapshot
from ._identity import RunIdentity
from ._lock import WriteAccess
from ._placement import Placement, put_draws
from ._segment import (
    ChainState,
    draws_before,
    OneChain,
    run_segment,
    SegmentPlan,
    SegmentProgress,
)
from ._stopping import Record, Schedule


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What every chunk of chains of one call of `run_chains` shares."""

    step: Callable
    shared: Any  # the non-array leaves of the state
    one_chain: OneChain  # one chain's state and key, typed keys as keys
    plan: SegmentPlan  # with `length` 0: set per segment
    num_steps: int
    recorded: Any  # one chain's recorded arrays, as shape-dtype structs; None if none
    recorded_static: Any  # the recorded leaves that are the same in every draw
    # `step`, traced: for the run's identity (None without a checkpoint)
    program: jax.extend.core.ClosedJaxpr | None
    counts: dict[str, Any]  # the arguments that change results, for the identity
    checkpoint_every: int | None
    until: Schedule | None = None  # when to check whether to stop

    def next_boundary(self, step: int) -> int:
        """The step the segment from `step` ends at: the next checkpoint, the next
        check of `until`, or the last step."""
        stops = [self.num_steps]
        if self.checkpoint_every is not None:
            stops.append((step // self.checkpoint_every + 1) * self.checkpoint_every)
        if self.until is not None:
            stops.append(self.until.next_check(step))
        return min(stops)

    def identity(self, chains: ChainState, num_chains: int) -> RunIdentity:
        """The identity of the run of these chains."""
        init_like = _with_leading(self.one_chain.state, num_chains)
        assert self.program is not None
        return RunIdentity.of(
            self.program,
            eqx.combine(chains.states, self.shared),
            eqx.combine(init_like, self.shared),
            as_key_data(chains.keys),
            _with_leading(self.one_chain.key, num_chains),
            self.counts,
        )


class ChunkRun:
    """One chunk of chains, placed on the devices (resumed from its checkpoint if
    there is one) and advanced one segment at a time, so that with `until` the
    chunks of a run can take turns window by window.

    Used as a context manager (it holds the chunk's checkpoint). The chains are
    padded to `pad_to` chains (and to a multiple of the device count), so that every
    chunk of a chunked run runs one program. `steps_before` is the steps of the
    chunks before this one, for the progress bar.
    """

    def __init__(
        self,
        run: RunPlan,
        chains: ChainState,
        *,
        pad_to: int,
        checkpoint: pathlib.Path | None,
        access: WriteAccess | None,
        writes: bool,
        bar: ProgressHandle | None,
        steps_before: int,
    ):
        self.run = run
        # Closed here if opening fails (nothing else would close the checkpoint's
        # writer); kept open for the with-block otherwise.
        with contextlib.ExitStack() as stack:
            num_chains = chains.keys.shape[0]
            trace_like = None
            if run.recorded is not None:
                trace_like = _trace_like(run.recorded, num_chains, run.plan.num_draws)
            self.store = restored = None
            # The checks of `until` as this chunk's checkpoint has them.
            self.record: Record | None = None
            if checkpoint is not None:
                assert access is not None
                self.store = stack.enter_context(
                    Checkpoint(
                        checkpoint,
                        run.identity(chains, num_chains),
                        num_chains,
                        access=access,
                        writes=writes,
                    )
                )
                restored = self.store.restore(
                    # As the files hold them: keys as their raw data.
                    as_key_data(_shapes(chains)),
                    trace_like,
                    num_steps=run.num_steps,
                    draws_after=ft.partial(
                        draws_before, burn_in=run.plan.burn_in, thin=run.plan.thin
                    ),
                    read_stopping=Record.from_json if run.until is not None else None,
                )
                if restored is not None:
                    self.record = restored.stopping
                stopped = self.record is not None and self.record.stopped is not None
                if restored is None or (
                    restored.steps_done < run.num_steps and not stopped
                ):
                    self.store.start_writing()
            # A step that sees every chain would see padding chains too.
            self.placement = Placement.of(
                num_chains, pad_to=pad_to, pad=not isinstance(run.step, AllChains)
            )
            self.steps_done, self.chains, self.trace_buffer = _start(
                self.placement,
                chains,
                trace_like,
                restored,
                one_segment=0 < run.num_steps == run.next_boundary(0),
            )
            self.progress = None
            if bar is not None:
                self.progress = SegmentProgress(
                    bar,
                    bar.start(steps_before + self.steps_done),
                    np.int32(steps_before),
                )
            # The last segment's new draws and where they go, until written.
            self._unwritten: tuple[Any, _Window] | None = None
            self._stack = stack.pop_all()

    def __enter__(self) -> "ChunkRun":
        return self

    def __exit__(self, *error: Any) -> None:
        self._stack.__exit__(*error)

    def advance(self, stop: int) -> None:
        """Runs the chains from `steps_done` to step `stop`, in one segment."""
        run = self.run
        window = _Window.of(
            run.plan, self.steps_done, stop - self.steps_done, self.store
        )
        result = run_segment(
            run.plan.window(window.length, window.emit),
            run.step,
            run.shared,
            run.one_chain,
            self.chains,
            np.int32(self.steps_done),
            self.progress,
            self.trace_buffer,
        )
        self.chains, self.trace_buffer = result.chains, result.trace_buffer
        if self.progress is not None:
            self.progress = self.progress._replace(due=result.due)
        self.steps_done = stop
        self._unwritten = (result.new_draws, window)

    def write(self, record: Record | None = None) -> None:
        """Checkpoints the chains after the last segment (in the background), with
        `until`'s `record`."""
        assert self._unwritten is not None
        new_draws, window = self._unwritten
        self._unwritten = None
        if self.store is not None:
            self.store.write(
                _snapshot(
                    self.placement, self.steps_done, self.chains, new_draws, window
                )._replace(stopping=record)
            )

    def moments(self) -> Any:
        """The running moments of the real chains, whole on every process."""
        return self.placement.real_chains(self.chains.moments)

    def discard_moments(self) -> None:
        """Starts the moments afresh: a failed check's window is discarded."""
        self.chains = self.chains._replace(
            moments=self.placement.zeros(_shapes(self.chains.moments))
        )

    def result(self) -> tuple[ChainState, Any]:
        """The chains and their trace (None without one), whole on every process."""
        return (
            self.placement.real_chains(self.chains),
            None
            if self.trace_buffer is None
            else self.placement.real_chains(self.trace_buffer),
        )


def _with_leading(like: Any, *sizes: int) -> Any:
    """Shape-dtype structs of `like`'s with leading axes of `sizes` added."""
    return jtu.tree_map(
        lambda x: jax.ShapeDtypeStruct((*sizes, *x.shape), x.dtype), like
    )


def _trace_like(recorded: Any, num_chains: int, num_draws: int) -> Any:
    """The trace buffer's shape-dtype structs, raw key data for keys: the same objects
    for the same recorded draws, chains and number of draws as on earlier calls."""
    leaves, treedef = jtu.tree_flatten(recorded)
    return _trace_likes.get_or_make(
        (treedef, num_chains, num_draws, *leaves),
        lambda: as_key_data(_with_leading(recorded, num_chains, num_draws)),
    )


_trace_likes = BoundedCache(64)


def _shapes(tree: Any) -> Any:
    return jtu.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class _Window(NamedTuple):
    """One segment's steps and, when checkpointing, where its new draws lie."""

    length: int
    emit: int  # see `SegmentPlan.emit`
    draw_file: DrawFile | None  # the file for the segment's draws, if it records any
    offset: int  # where they start in the emitted slice

    @classmethod
    def of(
        cls, plan: SegmentPlan, start: int, length: int, store: Checkpoint | None
    ) -> "_Window":
        if store is None or not plan.record:
            return cls(length, 0, None, 0)
        first = draws_before(start, plan.burn_in, plan.thin)
        stop = draws_before(start + length, plan.burn_in, plan.thin)
        if stop == first:
            return cls(length, 0, None, 0)
        emit = min(-(-length // plan.thin), plan.num_draws)
        draw_file = DrawFile(store.draws_name(first, stop), first, stop)
        return cls(length, emit, draw_file, first - min(first, plan.num_draws - emit))


class _Start(NamedTuple):
    steps_done: int
    chains: ChainState
    trace_buffer: Any  # with the draws already made; None without a trace


def _start(
    placement: Placement,
    chains: ChainState,
    trace_like: Any,
    restored: Restored | None,
    *,
    one_segment: bool,
) -> _Start:
    """The chains and trace buffer on the devices, at the start or as checkpointed.

    At the start of a run of `one_segment`, the trace buffer and the NaN report are
    the shape-dtype structs of their zeros, which the segment's program makes.
    """
    if restored is None:
        # Every chain starts finite: its report is made on the devices, with the
        # trace buffer (placing a host array costs as much). Made by the loop's own
        # program if it is the only one, else by one program the segments share.
        report = chains.first_bad
        like = (trace_like, jax.ShapeDtypeStruct(report.shape, report.dtype))
        if one_segment:
            trace_buffer, first_bad = placement.zeros_to_make(like)
        else:
            trace_buffer, first_bad = placement.zeros(like)
        chains = placement.put(chains._replace(first_bad=None))
        return _Start(0, chains._replace(first_bad=first_bad), trace_buffer)
    trace_buffer = None
    if trace_like is not None:
        made = jtu.tree_leaves(restored.draws)[0].shape[1]
        if made == jtu.tree_leaves(trace_like)[0].shape[1]:
            # A finished run: the draws are the whole trace, placed once.
            trace_buffer = placement.put(restored.draws)
        else:
            trace_buffer = placement.zeros(trace_like)
            if made:
                trace_buffer = put_draws(placement.put(restored.draws), trace_buffer)
    # Keys again, of the implementation of the keys the run was given.
    restored_chains = restored.chains._replace(
        keys=as_keys_like(restored.chains.keys, chains.keys)
    )
    return _Start(restored.steps_done, placement.put(restored_chains), trace_buffer)


def _snapshot(
    placement: Placement,
    steps_done: int,
    chains: ChainState,
    new_draws: Any,
    window: _Window,
) -> Snapshot:
    """What to checkpoint after `steps_done` steps."""
    if jax.process_count() > 1:
        # Every process takes part in gathering (a collective); process 0 writes.
        chains, new_draws = placement.replicated((chains, new_draws))
    return Snapshot(
        steps_done,
        # As the files hold them: keys as their raw data.
        chains._replace(keys=as_key_data(chains.keys)),
        draws=new_draws,
        draw_file=window.draw_file,
        offset=window.offset,
    )
