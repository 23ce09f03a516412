"""The chunks of one run through their steps, in one loop.

Without `until`, the chunks run one after another, each to the end (one chunk's
memory at a time). With `until`, every chunk is open at once and they move boundary by
boundary, so that each check sees every chain's moments and every chunk stops at the
same step: a chunked run stops where the unchunked one does.
"""

import contextlib
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np

from ._chunk import ChunkJob, ChunkRun, RunContext
from ._common import ChainState
from ._convergence import diagnose
from ._placement import joined, whole_here
from ._plan import RunPlan
from ._problem_records import ProblemRecords
from ._records import Check, Record
from ._stopping import check, passes, postfix


def run_chunks(
    context: RunContext, jobs: list[ChunkJob]
) -> tuple[list[tuple[ChainState, Any]], ProblemRecords]:
    """Every chunk's chains and trace after the run, and the record of `until`'s
    checks, one per problem (a run without `data` is one; empty without `until`)."""
    together = context.plan.until is not None
    groups = [jobs] if together else [[job] for job in jobs]
    results, record = [], _no_checks(context.plan)
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
    if _shows_moments(context) and len(jobs) > 1 and not together:
        # Per chain, not per draw: small enough to gather in a job.
        moments, first_bad = whole_here(
            ([c.moments for c, _ in results], [c.first_bad for c, _ in results])
        )
        nonfinite = _nonfinite(first_bad)
        _show(context, context.plan.num_steps * len(jobs), moments, nonfinite)
    return results, record


def _no_checks(plan: RunPlan) -> ProblemRecords:
    """The record of `until`'s checks before any, one per problem; without `until`,
    one, so that a run of many problems does not walk a record per problem at every
    boundary for checks it never makes."""
    return ProblemRecords.empty(1 if plan.until is None else plan.layout.num_problems)


def _run_group(
    context: RunContext, chunks: list[ChunkRun], separate: bool
) -> ProblemRecords:
    """Moves `chunks` to the run's end, boundary by boundary, checkpointing each after
    every segment; with `until`, checks the rule where due (every chunk there). Each
    problem is checked on its own, and a segment runs only the chains of the problems
    still running."""
    plan = context.plan
    record = _furthest(plan, chunks)
    while (here := min(chunk.steps_done for chunk in chunks)) < _end(plan, record):
        stop = context.next_stop(here)
        moving = [chunk for chunk in chunks if chunk.steps_done == here]
        # Without `until` no problem stops: its record is not walked.
        running = None if plan.until is None else record.running(here)
        for chunk in moving:
            chunk.advance(stop, running)
            if len(chunks) > 1:
                # As between groups: one chunk's working memory at a time.
                jax.block_until_ready(chunk.chains)
        if context.bar is not None:
            # Counted over the run: the steps of chunks run before included.
            done = chunks[0].steps_before + stop
            context.bar.follow(done, [chunk.chains.first_bad for chunk in moving])
        if plan.until is None:
            if _shows_moments(context) and not separate:
                moments = [chunk.moments() for chunk in chunks]
                _show(context, stop, moments, _nonfinite(_first_bad(chunks)))
        elif plan.until.is_check(stop, plan.num_steps) and not record.decided(stop):
            record = _decide(context, record, stop, chunks)
        for chunk in moving:
            if plan.until is not None:
                chunk.discard_moments(record.failed(stop))
            chunk.write(None if plan.until is None else record.as_of(stop))
    return record


def _furthest(plan: RunPlan, chunks: list[ChunkRun]) -> ProblemRecords:
    """The record the chunks go on from. Resumed chunks may stand at different steps
    (a kill between two chunks' writes): the one furthest on holds the decisions of
    the others' next checks."""
    if plan.until is None:
        return _no_checks(plan)
    records = [chunk.record or _no_checks(plan) for chunk in chunks]
    return max(records, key=lambda r: r.progress)


def _end(plan: RunPlan, record: ProblemRecords) -> int:
    """The step the run ends at: the cap, or, with `until`, the last problem's stop."""
    return plan.num_steps if plan.until is None else record.end(plan.num_steps)


def _decide(
    context: RunContext, records: ProblemRecords, stop: int, chunks: list[ChunkRun]
) -> ProblemRecords:
    """The records with the checks at step `stop` (every chunk is there) of every
    problem still running, each made on its own chains."""
    plan = context.plan
    # Diagnosed once a problem has draws to check: not before `burn_in`.
    checks: _ProblemChecks | None = None
    decided, checked = [], []
    for p, record in enumerate(records.records):
        if record.stopped is None:
            undrawn = _without_draws(plan, record, stop)
            if undrawn is not None:
                record = undrawn
            else:
                if checks is None:
                    checks = _ProblemChecks.of(plan, chunks)
                checked.append(p)
                record = _with_check(plan, record, stop, checks.result(p, stop))
        decided.append(record)
    records = ProblemRecords(tuple(decided))
    if context.bar is not None:
        _show_checks(context, records, stop, checks, checked)
    return records


def _without_draws(plan: RunPlan, record: Record, stop: int) -> Record | None:
    """`record` at step `stop` if no draw was recorded since its last check (before
    `burn_in`): as it is, or stopped at the cap, with nothing to check. None if there
    are draws to check."""
    start = record.window_start(stop)
    if plan.draws.before(stop) != plan.draws.before(start):
        return None
    if stop != plan.num_steps:
        return record
    reason = (
        f"reached the cap, num_steps={stop}, with no draw recorded since step "
        f"{start} to check"
    )
    return record.stop(stop, False, reason, plan.draws.burn_in)


def _with_check(plan: RunPlan, record: Record, stop: int, result: Check) -> Record:
    """`record` with `result`, the check at step `stop`, added: the chains stop if it
    passed or at the cap, where a failed check's reason says so."""
    at_cap = stop == plan.num_steps
    if at_cap and not result.passed:
        result = result._replace(
            reason=f"reached the cap, num_steps={stop}: {result.reason}"
        )
    return record.with_check(stop, result, result.passed or at_cap, plan.draws.burn_in)


class _ProblemChecks(NamedTuple):
    """What the checks of every problem at one step read: their diagnostics (on the
    host, each statistic with a leading axis of problems), the chains gone NaN or
    infinite, and which problems pass, with the worst value of each."""

    plan: RunPlan
    diagnostics: Any
    nonfinite: np.ndarray
    passed: np.ndarray
    worst: np.ndarray

    @classmethod
    def of(cls, plan: RunPlan, chunks: list[ChunkRun]) -> "_ProblemChecks":
        assert plan.until is not None
        # On the host at once: each problem's check reads its row of every statistic.
        diagnostics = jax.device_get(
            diagnose(
                joined([chunk.moments() for chunk in chunks]),
                plan.superchains,
                plan.problems,
            )
        )
        if plan.problems is None:
            # The one problem's row: its statistics have no axis of problems.
            diagnostics = jtu.tree_map(lambda x: x[None], diagnostics)
        nonfinite = _nonfinite(_first_bad(chunks))
        has_nonfinite = np.zeros(plan.layout.num_problems, bool)
        has_nonfinite[plan.layout.problem_of(nonfinite)] = True
        passed, worst = passes(plan.until, diagnostics, has_nonfinite)
        return cls(plan, diagnostics, nonfinite, passed, worst)

    def row(self, p: int) -> Any:
        """Problem `p`'s diagnostics."""
        return jtu.tree_map(lambda x: x[p], self.diagnostics)

    def checked(self, p: int) -> Check:
        """Problem `p`'s check with its reason, as `check` makes it."""
        assert self.plan.until is not None
        own = self.plan.layout.own(self.nonfinite, p)
        return check(self.plan.until, self.row(p), own)

    def result(self, p: int, stop: int) -> Check:
        """Problem `p`'s check at step `stop`: a reason is made only where the
        problem stops (it passed, or the run is at its cap)."""
        if self.passed[p] or stop == self.plan.num_steps:
            return self.checked(p)
        return Check(False, float(self.worst[p]), "")


def _show_checks(
    context: RunContext,
    records: ProblemRecords,
    stop: int,
    checks: _ProblemChecks | None,
    checked: list[int],
) -> None:
    """The bar at step `stop`: the problems still running and, of those `checked`
    there (by `checks`, None if none was), the worst, with its check's reason;
    without `data`, the one problem's statistics, if it was checked."""
    assert context.bar is not None
    if context.plan.problems is None:
        if checks is not None:
            context.bar.show(stop, postfix(checks.row(0), checks.nonfinite))
        return
    running = records.running(stop)
    text = f"{int(running.sum())} of {context.plan.problems} problems running"
    still = [p for p in checked if running[p]]
    if still and checks is not None:
        # The worst by the first criterion, NaN (nothing to compare) last.
        worst = checks.worst
        p = max(still, key=lambda p: (not np.isnan(worst[p]), worst[p]))
        text = f"{text}; worst: problem {p}, {checks.checked(p).reason}"
    context.bar.show(stop, text)


def _shows_moments(context: RunContext) -> bool:
    """Whether the bar shows the statistics so far (`progress` and `diagnostics`)."""
    return context.bar is not None and context.plan.options.diagnostics


def _show(
    context: RunContext, done: int, moments: list[Any], nonfinite: np.ndarray
) -> None:
    """The bar at `done` steps, with the worst (nested) R-hat and smallest ESS of the
    chunks' `moments`, and the `nonfinite` chains; with `data`, each problem's, the
    first index of an element being its problem."""
    assert context.bar is not None
    plan = context.plan
    diagnostics = diagnose(joined(moments), plan.superchains, plan.problems)
    text = postfix(diagnostics, nonfinite)
    if plan.problems is not None:
        text = f"{plan.problems} problems, at [problem, ...]: {text}"
    context.bar.show(done, text)


def _nonfinite(first_bad: list[Any]) -> np.ndarray:
    """The indices of the chains gone NaN or infinite, from each chunk's whole NaN
    report (`ChainState.first_bad`), the chunks in the order of their chains."""
    return np.flatnonzero(np.concatenate([np.asarray(x) for x in first_bad]))


def _first_bad(chunks: list[ChunkRun]) -> list[np.ndarray]:
    return [chunk.first_bad() for chunk in chunks]
