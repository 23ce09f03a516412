"""The chunks of one run through their steps, in one loop.

The chunks run in the turns the run's stopping gives (`_until/_how_it_stops.py`): one
after another, each to the end (one chunk's memory at a time), or, with `until`, all at
once, boundary by boundary, so that each check sees every chain's moments and every
chunk stops at the same step: a chunked run stops where the unchunked one does.
"""

import contextlib
import functools as ft
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np

from ._chunk import ChunkJob, ChunkRun, RunContext
from ._common import ChainState, CheckTexts
from ._placement import joined, whole_here
from ._plan import RunPlan
from ._until._convergence import diagnose
from ._until._decision import decide, Decision, read_details
from ._until._problem_records import ProblemRecords
from ._until._records import Check
from ._until._schedule import Schedule
from ._until._stopping import check, postfix, worst_each


def run_chunks(
    context: RunContext, jobs: list[ChunkJob]
) -> tuple[list[tuple[ChainState, Any]], ProblemRecords]:
    """Every chunk's chains and trace after the run, and the record of `until`'s
    checks, one per problem (a run without `data` is one; empty without `until`)."""
    groups = context.plan.stopping.turns(jobs)
    results, record = [], context.plan.stopping.no_checks()
    for group in groups:
        with contextlib.ExitStack() as stack:
            chunks = [stack.enter_context(ChunkRun(context, job)) for job in group]
            record = _run_group(context, chunks, separate=len(jobs) > 1)
        results += [chunk.result() for chunk in chunks]
        if len(groups) > 1:
            # Segments are dispatched without waiting: left alone, every chunk would
            # be queued at once and, on a CPU, run side by side, with the working
            # memory of all of them. Each chunk finishes before the next starts.
            jax.block_until_ready(results[-1])
    if _shows_moments(context) and len(groups) > 1:
        # Per chain, not per draw: small enough to gather in a job.
        moments, first_bad = whole_here(
            ([c.moments for c, _ in results], [c.first_bad for c, _ in results])
        )
        nonfinite = _nonfinite(first_bad)
        _show(context, context.plan.num_steps * len(jobs), moments, nonfinite)
    return results, record


class _Boundary(NamedTuple):
    """A segment's end, queued: finished (its check read, its chunks checkpointed)
    once the next segment is queued behind it."""

    stop: int
    moving: list[ChunkRun]
    checks: "_ProblemChecks | None"  # the check of `until` made there, on the devices


def _run_group(
    context: RunContext, chunks: list[ChunkRun], separate: bool
) -> ProblemRecords:
    """Moves `chunks` to the run's end, boundary by boundary, checkpointing each after
    every segment; with `until`, checks the rule where due (every chunk there). Each
    problem is checked on its own, and a segment runs only the chains of the problems
    still running.

    The checks are decided on the devices (`_until/_decision.py`), and the host reads
    each one while the next segment runs: the device never waits for the host. The
    host's record is then a check behind the devices' `live` mask: the problems it
    thinks running may have stopped (their chains frozen, `_compaction.py`). A segment
    queued after every problem stopped runs in vain, changes nothing, and is
    forgotten."""
    plan, stopping = context.plan, context.plan.stopping
    record = _furthest(plan, chunks)
    live = None  # with `until`, whether each problem still runs, on the devices
    pending: _Boundary | None = None
    while (here := min(chunk.steps_done for chunk in chunks)) < stopping.end(record):
        stop = context.next_stop(here)
        moving = [chunk for chunk in chunks if chunk.steps_done == here]
        running = stopping.running(record, here)
        if running is not None and live is None:
            live = chunks[0].everywhere(running)
        for chunk in moving:
            chunk.advance(stop, running, live)
            if len(chunks) > 1:
                # As between groups: one chunk's working memory at a time.
                jax.block_until_ready(chunk.chains)
        checks, schedule = None, stopping.checked_at(stop)
        if schedule is not None:
            if record.decided(stop):
                # Decided by a chunk further on, as its checkpoint says.
                _discard(moving, record.failed(stop))
                live = None
            else:
                decision = _decision(plan, schedule, chunks, live, stop)
                checks = _ProblemChecks(plan, schedule, decision)
                live = chunks[0].everywhere(decision.running)
                for chunk in moving:
                    chunk.discard(live)
        if pending is not None:
            record = _finish(context, pending, record, separate)
        pending = _Boundary(stop, moving, checks)
        if stopping.end(record) < stop:
            for chunk in moving:
                chunk.forget_last(stopping.end(record))
            pending = None
    if pending is not None:
        record = _finish(context, pending, record, separate)
    return record


def _decision(
    plan: RunPlan, schedule: Schedule, chunks: list[ChunkRun], live: Any, stop: int
) -> Decision:
    """The check of `schedule` at step `stop` (every chunk there) of the problems
    `live` says still run, queued on a device."""
    return decide(
        schedule,
        joined([chunk.moments() for chunk in chunks]),
        joined([chunk.first_bad() for chunk in chunks]),
        live,
        plan.problems.blocks,
        plan.superchains,
        at_cap=stop == plan.num_steps,
    )


def _discard(chunks: list[ChunkRun], failed: np.ndarray) -> None:
    """Discards the moments of the problems whose check `failed` (on the host)."""
    if failed.any():
        on_devices = chunks[0].everywhere(failed)
        for chunk in chunks:
            chunk.discard(on_devices)


def _finish(
    context: RunContext, boundary: _Boundary, record: ProblemRecords, separate: bool
) -> ProblemRecords:
    """The record after `boundary`, its check read; its chunks' checkpoints written
    and the bar moved."""
    plan, stop, moving = context.plan, boundary.stop, boundary.moving
    chains = [chunk.oldest.chains for chunk in moving]
    if context.bar is not None:
        # Counted over the run: the steps of chunks run before included.
        done = moving[0].steps_before + stop
        context.bar.follow(done, [c.first_bad for c in chains])
    if boundary.checks is not None:
        record = _decide(context, record, stop, boundary.checks)
    elif _shows_moments(context) and not separate:
        moments = [chunk.moments(c) for chunk, c in zip(moving, chains, strict=True)]
        first_bad = [
            np.asarray(chunk.first_bad(c))
            for chunk, c in zip(moving, chains, strict=True)
        ]
        _show(context, stop, moments, _nonfinite(first_bad))
    kept = plan.stopping.kept(record)
    for chunk in moving:
        chunk.write(kept)
    return record


def _furthest(plan: RunPlan, chunks: list[ChunkRun]) -> ProblemRecords:
    """The record the chunks go on from. Resumed chunks may stand at different steps
    (a kill between two chunks' writes): the one furthest on holds the decisions of
    the others' next checks."""
    records = [chunk.record or plan.stopping.no_checks() for chunk in chunks]
    if len(records) == 1:
        return records[0]
    return max(records, key=lambda r: r.progress)


def _decide(
    context: RunContext, records: ProblemRecords, stop: int, checks: "_ProblemChecks"
) -> ProblemRecords:
    """The records with the checks at step `stop` of every problem still running,
    each made on its own chains (`checks`, as the devices decided them). A reason
    is written only where a problem stops (it passed, or the run is at its cap)."""
    plan = context.plan
    at_cap = stop == plan.num_steps
    running = records.stop_steps < 0
    # Not checked before `burn_in`: no draw to check (nor any moment, so the
    # devices' check failed too).
    checked = running & (
        plan.draws.before(records.last_checks) != plan.draws.before(stop)
    )
    stopping = np.flatnonzero(checked & (checks.passed | at_cap)).tolist()
    worst, reasons = checks.worst.astype(np.float64), {}
    for p, result in checks.reasons(stopping).items():
        reason = result.reason if result.passed else _at_cap(result.reason, stop)
        worst[p], reasons[p] = result.worst, (result.passed, reason)
    if at_cap:
        for p in np.flatnonzero(running & ~checked).tolist():
            reasons[p] = (False, _undrawn(int(records.last_checks[p]), stop))
    records = records.with_checks(stop, checked, worst, reasons, plan.draws.burn_in)
    if context.bar is not None:
        _show_checks(context, records, stop, checks, np.flatnonzero(checked).tolist())
    return records


def _at_cap(reason: str, stop: int) -> str:
    """The reason of a problem stopped by the cap, `stop`, whose check failed."""
    return f"reached the cap, num_steps={stop}: {reason}"


def _undrawn(start: int, stop: int) -> str:
    """The reason of a problem stopped by the cap, `stop`, with no draw recorded
    since its last check, at `start`, to check (before `burn_in`)."""
    return (
        f"reached the cap, num_steps={stop}, with no draw recorded since step "
        f"{start} to check"
    )


class _ProblemChecks:
    """What the checks of every problem at one step read, as the devices decided
    them: which problems pass, with the worst value of each, read at once; their
    diagnostics (each statistic with a leading axis of problems) and the chains gone
    NaN or infinite, read only for a reason (a problem stops, or the bar shows it).
    Nothing is read before it is asked for: the next segment is queued first."""

    def __init__(self, plan: RunPlan, schedule: Schedule, decision: Decision):
        self.plan, self.schedule, self._decision = plan, schedule, decision

    @ft.cached_property
    def _outcome(self) -> tuple[np.ndarray, np.ndarray]:
        return jax.device_get((self._decision.passed, self._decision.worst))

    @property
    def passed(self) -> np.ndarray:
        return self._outcome[0]

    @property
    def worst(self) -> np.ndarray:
        return self._outcome[1]

    @ft.cached_property
    def _details(self) -> tuple[Any, np.ndarray]:
        diagnostics, first_bad = read_details(self._decision)
        return diagnostics, _nonfinite([first_bad])

    @property
    def diagnostics(self) -> Any:
        return self._details[0]

    @property
    def nonfinite(self) -> np.ndarray:
        return self._details[1]

    def row(self, p: int) -> Any:
        """Problem `p`'s diagnostics."""
        return jtu.tree_map(lambda x: x[p], self.diagnostics)

    def reasons(self, problems: list[int]) -> dict[int, Check]:
        """Each of `problems`' check with its reason, as `check` makes it, their
        worst elements found at once."""
        if not problems:
            return {}
        rows = np.asarray(problems, np.intp)
        criteria = self.schedule.criteria
        worst = [worst_each(self.diagnostics, c.statistic, rows) for c in criteria]
        nonfinite, layout = self.nonfinite, self.plan.layout
        none = nonfinite[:0]
        return {
            p: check(
                self.schedule,
                [w[i] for w in worst],
                layout.own(nonfinite, p) if len(nonfinite) else none,
            )
            for i, p in enumerate(problems)
        }


def _show_checks(
    context: RunContext,
    records: ProblemRecords,
    stop: int,
    checks: "_ProblemChecks",
    checked: list[int],
) -> None:
    """The bar at step `stop`: the problems still running and, of those `checked`
    there (by `checks`), the worst, with its check's reason; without `data`, the one
    problem's statistics, if it was checked."""
    assert context.bar is not None

    def worst(still: list[int]) -> str:
        # The worst by the first criterion, NaN (nothing to compare) last.
        worst = checks.worst
        p = max(still, key=lambda p: (not np.isnan(worst[p]), worst[p]))
        return f"problem {p}, {checks.reasons([p])[p].reason}"

    def statistics() -> str:
        return postfix(checks.row(0), checks.nonfinite)

    text = context.plan.problems.checks_label(
        checked, CheckTexts(records.running(stop), statistics, worst)
    )
    if text is not None:
        context.bar.show(stop, text)


def _shows_moments(context: RunContext) -> bool:
    """Whether the bar shows the statistics so far (`progress` and `diagnostics`):
    not with `until`, whose moments are a window's, since its last check."""
    plan = context.plan
    return (
        context.bar is not None
        and plan.options.diagnostics
        and not plan.stopping.discards_moments
    )


def _show(
    context: RunContext, done: int, moments: list[Any], nonfinite: np.ndarray
) -> None:
    """The bar at `done` steps, with the worst (nested) R-hat and smallest ESS of the
    chunks' `moments`, and the `nonfinite` chains; with `data`, each problem's, the
    first index of an element being its problem."""
    assert context.bar is not None
    plan = context.plan
    diagnostics = diagnose(joined(moments), plan.superchains, plan.problems.blocks)
    context.bar.show(done, plan.problems.label(postfix(diagnostics, nonfinite)))


def _nonfinite(first_bad: list[Any]) -> np.ndarray:
    """The indices of the chains gone NaN or infinite, from each chunk's whole NaN
    report (`ChainState.first_bad`), the chunks in the order of their chains."""
    return np.flatnonzero(np.concatenate([np.asarray(x) for x in first_bad]))
