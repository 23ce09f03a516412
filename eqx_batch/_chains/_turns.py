"""The chunks of one run through their steps: one chunk after another or, with `until`,
taking turns window by window, so that each check sees every chain's moments and every
chunk stops at the same step (a chunked run stops where the unchunked one does).

Without `until`, the run is as it always was: each chunk runs segment by segment to the
end (checkpointed after each), then the next.
"""

import contextlib
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._progress import ProgressBar
from ._chunk import ChunkRun, RunPlan
from ._convergence import diagnose
from ._lock import WriteAccess
from ._segment import ChainState, draws_before
from ._stopping import check, postfix, Record


class ChunkJob(NamedTuple):
    """One chunk's chains and, when checkpointing, the path of its checkpoint."""

    chains: ChainState
    checkpoint: pathlib.Path | None


class RunContext(NamedTuple):
    """What every chunk of a run shares besides the plan."""

    pad_to: int  # chains per chunk; 0 unchunked
    access: WriteAccess | None  # the lock of the checkpoint, if any
    writes: bool  # whether this process writes the checkpoint
    bar: ProgressBar | None
    superchains: int | None


def run_chunks(
    run: RunPlan, jobs: list[ChunkJob], context: RunContext
) -> tuple[list[tuple[ChainState, Any]], Record | None]:
    """Every chunk's chains and trace after the run, and, with `until`, the record of
    its checks (stopped)."""
    if run.until is not None:
        return _in_turns(run, jobs, context)
    # With `progress` and `diagnostics`, the bar shows the statistics so far.
    show = context.bar is not None and jobs[0].chains.moments is not None
    results = []
    for index, job in enumerate(jobs):
        with _open(run, job, context, steps_before=index * run.num_steps) as chunk:
            while chunk.steps_done < run.num_steps:
                chunk.advance(run.next_boundary(chunk.steps_done))
                chunk.write()
                if show and len(jobs) == 1:
                    _show(context, chunk.steps_done, chunk.moments())
        results.append(chunk.result())
        if len(jobs) > 1:
            # Segments are dispatched without waiting: left alone, every chunk would
            # be queued at once and, on a CPU, run side by side, with the working
            # memory of all of them. Each chunk finishes before the next starts.
            jax.block_until_ready(results[-1])
    if show and len(jobs) > 1:
        moments = joined([chains.moments for chains, _ in results])
        _show(context, run.num_steps * len(jobs), moments)
    return results, None


def _in_turns(
    run: RunPlan, jobs: list[ChunkJob], context: RunContext
) -> tuple[list[tuple[ChainState, Any]], Record]:
    assert run.until is not None
    with contextlib.ExitStack() as stack:
        # One bar of the run's steps, which every chunk moves in turn.
        chunks = [
            stack.enter_context(_open(run, job, context, steps_before=0))
            for job in jobs
        ]
        # Resumed chunks may stand at different steps (a kill between two chunks'
        # writes): the one furthest on holds the decisions of the others' next checks.
        record = max(
            (chunk.record or Record() for chunk in chunks),
            key=lambda r: (len(r.checks), r.stopped is not None),
        )
        while True:
            end = run.num_steps if record.stopped is None else record.stopped[0]
            here = min(chunk.steps_done for chunk in chunks)
            if here >= end:
                break
            stop = run.next_boundary(here)
            moving = [chunk for chunk in chunks if chunk.steps_done == here]
            for chunk in moving:
                chunk.advance(stop)
                if len(chunks) > 1:
                    # As above: one chunk's working memory at a time.
                    jax.block_until_ready(chunk.chains)
            if run.until.is_check(stop, run.num_steps) and not record.decided(stop):
                record = _decide(run, record, stop, chunks, context)
            for chunk in moving:
                if record.failed(stop):
                    chunk.discard_moments()
                chunk.write(record.as_of(stop))
    return [chunk.result() for chunk in chunks], record


def _decide(
    run: RunPlan, record: Record, stop: int, chunks: list[ChunkRun], context: RunContext
) -> Record:
    """The record with the check at step `stop` (every chunk is there) added."""
    assert run.until is not None
    at_cap = stop == run.num_steps
    start = record.window_start(stop)
    plan = run.plan
    if draws_before(stop, plan.burn_in, plan.thin) == draws_before(
        start, plan.burn_in, plan.thin
    ):
        # Nothing recorded since the last check (before `burn_in`): nothing to check.
        if not at_cap:
            return record
        reason = (
            f"reached the cap, num_steps={stop}, with no draw recorded since step "
            f"{start} to check"
        )
        return record._replace(stopped=(stop, False, reason))
    diagnostics = diagnose(
        joined([chunk.moments() for chunk in chunks]), context.superchains
    )
    result = check(run.until, diagnostics)
    if context.bar is not None:
        context.bar.show(stop, postfix(diagnostics))
    if at_cap and not result.passed:
        result = result._replace(
            reason=f"reached the cap, num_steps={stop}: {result.reason}"
        )
    return record.with_check(stop, result, stop=result.passed or at_cap)


def _open(
    run: RunPlan, job: ChunkJob, context: RunContext, *, steps_before: int
) -> ChunkRun:
    return ChunkRun(
        run,
        job.chains,
        pad_to=context.pad_to,
        checkpoint=job.checkpoint,
        access=context.access,
        writes=context.writes,
        bar=None if context.bar is None else context.bar.handle,
        steps_before=steps_before,
    )


def joined(trees: list[Any]) -> Any:
    """The chunks' trees (one row per chain) as one, in the order of the chains."""
    if len(trees) == 1:
        return trees[0]
    return jtu.tree_map(lambda *xs: jnp.concatenate(xs), *trees)


def _show(context: RunContext, done: int, moments: Any) -> None:
    """The bar at `done` steps, with the worst (nested) R-hat and smallest ESS."""
    assert context.bar is not None
    context.bar.show(done, postfix(diagnose(moments, context.superchains)))
