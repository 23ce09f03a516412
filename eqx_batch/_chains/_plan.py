"""The plan of one call of `run_chains`: everything its chunks share, fixed before any
step runs."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.extend

from .._errors import BatchError
from ._all_chains import RunStep
from ._arguments import Counts, Init
from ._checkpoints._recording import DrawsInBuffer, DrawsOnDisk, NoDraws, Recording
from ._common import ChainState, Draws, ProblemForm, ProblemLayout
from ._jobs._identity import RunIdentity, RunOptions
from ._placement import chain_devices, Placement
from ._prepared import prepared_run, PreparedRun
from ._segment_plan import SegmentPlan, TraceMode
from ._step import TracedStep
from ._until._how_it_stops import how_it_stops, HowItStops
from ._until._moments import check_diagnostics
from ._until._stopping import StoppingRule


# With `trace="disk"`, a segment records at most this many bytes of draws (of a whole
# chunk of chains), so that the draws in memory, on the devices and on their way to
# the files, do not grow with `num_steps`. Large enough that a segment's dispatch and
# file are a small cost beside its draws.
STREAMED_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What every chunk of one call of `run_chains` shares."""

    step: RunStep
    static: Any  # the non-array leaves of the state
    prepared: PreparedRun  # one chain's structs, and the segments and placements
    segment: SegmentPlan  # with `length` 0: `prepared.segment` sets it per segment
    options: RunOptions  # the arguments that change results, for the identity
    # `trace` as given, which the result reads (`_assembly.py`); `options.trace`
    # records only whether draws are recorded, which is what makes two calls one run.
    trace: TraceMode
    recording: Recording  # where each chunk's draws go, as `trace` chose
    num_chains: int
    chunk_size: int  # chains per chunk: `num_chains` unless chunked
    checkpoint_every: int | None
    stopping: HowItStops  # at the cap, or where `until` holds
    superchains: int | None
    problems: ProblemForm  # one, or with `data` many
    # `step`, traced: for the run's identity (None without a checkpoint).
    program: jax.extend.core.ClosedJaxpr | None
    # With `trace="disk"`: the most steps of a segment, which bound its draws to
    # `STREAMED_BYTES`; else None.
    streamed_steps: int | None = None

    @property
    def num_steps(self) -> int:
        return self.options.num_steps

    @property
    def draws(self) -> Draws:
        return self.segment.draws

    @property
    def layout(self) -> ProblemLayout:
        """Which problem each chain is in (one problem without `data`)."""
        return self.problems.layout

    @property
    def chunks(self) -> list[range]:
        """The chains of each chunk, in order (one, empty, without chains)."""
        return _chunk_ranges(self.num_chains, self.chunk_size) or [range(0)]

    def next_boundary(self, step: int) -> int:
        """The step the segment from `step` ends at: the next checkpoint, the next
        check of `until`, or the last step."""
        stops = [self.num_steps]
        if self.checkpoint_every is not None:
            stops.append((step // self.checkpoint_every + 1) * self.checkpoint_every)
        stops.append(self.stopping.next_check(step))
        if self.streamed_steps is not None:
            stops.append((step // self.streamed_steps + 1) * self.streamed_steps)
        return min(stops)

    def placement(self, num_chains: int) -> Placement:
        """Where a chunk of `num_chains` chains lives: padded to the size of the
        others, so that every chunk runs one program; never padded for a step that
        sees every chain (it would see the padding). A step that sees a problem's
        chains at once gets each problem on one device, so that what it computes
        across them does not depend on the chunks or the devices."""
        chunked = len(self.chunks) > 1
        return self.prepared.placement(
            num_chains,
            pad_to=self.chunk_size if chunked else 0,
            pad=not self.options.all_chains,
            unit=self._device_unit(num_chains),
        )

    def _device_unit(self, num_chains: int) -> int:
        """The chains of a chunk of `num_chains` that share a device (`OneProblem`'s or
        `ManyProblems`' `device_unit`)."""
        sizes = [len(chunk) for chunk in self.chunks]
        return self.problems.device_unit(num_chains, sizes, self.step.chunk_unit)

    @property
    def own_draws_segment(self) -> SegmentPlan:
        """`segment`, returning each segment's own draws: for a batch of the running
        problems' chains, whose draws are then written over their rows
        (`ChunkRun._advance_running`)."""
        return dataclasses.replace(
            self.segment, writes_trace=False, returns_own_draws=True
        )

    def trace_like(self, num_chains: int) -> Any:
        """The trace buffer's shape-dtype structs; None without a trace buffer."""
        if not self.segment.writes_trace:
            return None
        return self.prepared.trace_like(
            num_chains, self.draws.total, self.segment.records_states
        )

    def draws_like(self, num_chains: int, num_draws: int | None = None) -> Any:
        """The shape-dtype structs of `num_draws` draws (all of the run's by
        default), the trace buffer's or the files'; None if nothing is recorded."""
        total = self.draws.total if num_draws is None else num_draws
        return self.recording.like(
            lambda: self.prepared.trace_like(
                num_chains, total, self.segment.records_states
            )
        )

    @property
    def data(self) -> Any:
        """`data` of a run of many problems, as the step holds it; else None."""
        return self.step.data

    def identity(self, chains: ChainState) -> RunIdentity:
        """The identity of the run of these chains (at their start)."""
        assert self.program is not None
        own, shared = self.step.own_and_shared(eqx.combine(chains.states, self.static))
        return RunIdentity.of(
            self.program,
            own,
            chains.keys,
            self.options,
            self.data,
            self.trace.value,
            shared=shared,
        )


def plan_run(
    step: RunStep,
    init: Init,
    keys: jax.Array,
    legacy: bool,
    counts: Counts,
    *,
    with_output: bool,
    trace: bool | Literal["disk"],
    diagnostics: bool,
    until: StoppingRule | None,
    superchains: int | None,
    problems: ProblemForm,
    traced: TracedStep | None,
) -> RunPlan:
    """The plan of a run of `step` from `init`, one row per chain.

    `traced` is `step` traced already, for the run's identity (its constants' values
    are part of it): a checkpointed run traces it on every call; any other run only
    the first time it meets these shapes (`prepared_run`).

    **Raises:**

    As `trace_step` does, and `BatchError` if `diagnostics` has nothing to diagnose
    or an all-chains step cannot take the run.
    """
    num_chains = init.num_chains
    all_chains = step.sees_every_chain
    if all_chains:
        _check_all_chains_run(num_chains, counts.chunk_size, step.chunk_unit, problems)
    prepared = prepared_run(step, init.whole, keys, legacy, with_output, traced)
    draws = Draws.of(counts.num_steps, counts.burn_in, counts.thin)
    stopping = how_it_stops(until, counts.num_steps, problems.layout, superchains)
    diagnostics = _checked_diagnostics(stopping, diagnostics, prepared, draws)
    chunk_size = min(counts.chunk_size or num_chains, num_chains)
    mode = TraceMode(trace)  # decided once: nothing below asks `trace` again
    segment = _segment_plan(mode, draws, with_output, legacy, stopping.freezes)
    streamed_steps = None
    if segment.returns_own_draws:
        streamed_steps = _streamed_steps(prepared, chunk_size, draws.thin)
    return RunPlan(
        step=step,
        static=init.static,
        prepared=prepared,
        segment=segment,
        options=_run_options(
            counts,
            with_output,
            segment.records_states,
            diagnostics,
            all_chains,
            superchains,
            stopping,
        ),
        trace=mode,
        recording=_recording(segment),
        num_chains=num_chains,
        chunk_size=chunk_size,
        checkpoint_every=counts.checkpoint_every,
        stopping=stopping,
        superchains=superchains,
        problems=problems,
        program=None if traced is None else traced.program,
        streamed_steps=streamed_steps,
    )


def _check_all_chains_run(
    num_chains: int,
    chunk_size: int | None,
    chunk_unit: Callable[[int], int],
    problems: ProblemForm,
) -> None:
    """Refuses, before any work, a run that an all-chains step cannot take.

    **Raises:**

    `BatchError` if a chunk of `chunk_size` would hold only some of the chains the
    step sees at once (`chunk_unit`: every chain, or a problem's with `shared`), or
    if the chains of a chunk cannot be split evenly over the processes of a job.
    """
    unit = chunk_unit(num_chains)
    if chunk_size is not None and chunk_size < num_chains and chunk_size % unit:
        if unit == num_chains:
            fix = "pass None"
        else:
            fix = f"pass a multiple of {unit}, a problem's chains, or None"
        raise BatchError(
            f"`chunk_size={chunk_size}` with an `eb.all_chains` step: {fix} "
            "(see docs/chains.md#what-is-refused)."
        )
    sizes = [len(c) for c in _chunk_ranges(num_chains, chunk_size or num_chains)]
    for chunk in set(sizes):
        chain_devices(chunk, problems.device_unit(chunk, sizes, chunk_unit))


def _chunk_ranges(num_chains: int, chunk_size: int) -> list[range]:
    """The chains of each chunk of `chunk_size` (or fewer, the last), in order."""
    size = max(min(chunk_size, num_chains), 1)
    return [range(a, min(a + size, num_chains)) for a in range(0, num_chains, size)]


def _run_options(
    counts: Counts,
    with_output: bool,
    records_states: bool,
    diagnostics: bool,
    all_chains: bool,
    superchains: int | None,
    stopping: HowItStops,
) -> RunOptions:
    """The arguments that change the run's results or where it stops, as its identity
    names them."""
    return RunOptions(
        num_steps=counts.num_steps,
        thin=counts.thin,
        burn_in=counts.burn_in,
        with_output=with_output,
        # `"disk"` records the draws that `True` does: one run, read back either way.
        trace=records_states,
        diagnostics=diagnostics,
        all_chains=all_chains,
        superchains=superchains,
        until=stopping.rule,
    )


def _checked_diagnostics(
    stopping: HowItStops, diagnostics: bool, prepared: PreparedRun, draws: Draws
) -> bool:
    """Whether the run keeps diagnostics: asked for by `diagnostics=True`, or by
    `until`, which reads them.

    **Raises:**

    `BatchError` naming what asked for them, if there is nothing to diagnose.
    """
    asked_by = stopping.diagnostics_asked_by(diagnostics)
    if asked_by is not None:
        check_diagnostics(prepared.one_chain.state, draws.total, asked_by)
    return asked_by is not None


def _segment_plan(
    mode: TraceMode, draws: Draws, with_output: bool, legacy: bool, freezes: bool
) -> SegmentPlan:
    """The run's segments (their `length` set per segment) for the trace `mode`: a
    run that records draws writes them into its trace buffer, or with the trace on
    disk each segment returns its own draws, for the files; neither records any if
    the run makes no draw. Without a trace, a run `with_output` records its step's
    outputs alone, in a buffer of them. With `until`, a segment `freezes` the chains
    of the problems that have stopped."""
    records = (mode is not TraceMode.NONE or with_output) and draws.total > 0
    return SegmentPlan(
        0,
        draws,
        with_output,
        writes_trace=records and mode is not TraceMode.DISK,
        legacy=legacy,
        returns_own_draws=records and mode is TraceMode.DISK,
        records_states=mode is not TraceMode.NONE,
        freezes=freezes,
    )


def _recording(segment: SegmentPlan) -> Recording:
    """Where the chunks' draws go, as `segment` records them."""
    if segment.returns_own_draws:
        return DrawsOnDisk()
    if segment.writes_trace:
        return DrawsInBuffer()
    return NoDraws()


def _streamed_steps(prepared: PreparedRun, chunk_size: int, thin: int) -> int:
    """The most steps of a segment whose draws of a chunk of chains fit in
    `STREAMED_BYTES`: as many draws as fit (at least one), `thin` steps each."""
    one_draw = prepared.trace_like(max(chunk_size, 1), 1, states=True)
    draw_bytes = sum(
        math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(one_draw)
    )
    return max(1, STREAMED_BYTES // max(draw_bytes, 1)) * thin
