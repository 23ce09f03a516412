"""What a run starts from: its chains before the first step, the context its chunks
share (the progress bar, the right to write the checkpoint), and each chunk's job."""

import contextlib
import os
import pathlib

import jax
import numpy as np

from .._progress import ProgressBar
from .._stacking._select import take
from ._arguments import Init
from ._checkpoints._checkpoint_files import (
    chunk_path,
    longest_file_name,
    warn_of_other_chunkings,
)
from ._checkpoints._lock import check_folder, refuse_if_in_use, WriteAccess
from ._chunk import ChunkJob, RunContext
from ._common import ChainState, ProblemLayout
from ._plan import RunPlan
from ._until._moments import zeros


def start_state(plan: RunPlan, whole: Init, keys: jax.Array) -> ChainState:
    """The chains before their first step (with `diagnostics`, their moments zero;
    with `data`, each chain's problem)."""
    moments = None
    if plan.options.diagnostics:
        moments = zeros(plan.prepared.one_chain.state, whole.num_chains)
    problems = None
    if plan.problems is not None:
        problems = ProblemLayout(whole.num_chains, plan.problems).ids()
    steps = np.zeros(whole.num_chains, np.int32)
    return ChainState(whole.arrays, keys, steps, moments, problems)


def run_context(
    stack: contextlib.ExitStack,
    plan: RunPlan,
    *,
    progress: bool,
    checkpoint: str | os.PathLike | None,
) -> RunContext:
    """What the run's chunks share: its plan, its progress bar (if `progress`) and
    the right to write its `checkpoint` (if any), each closed with `stack`."""
    bar = None
    if progress:
        # With `until`, the chunks take turns: the bar counts the run's steps.
        laps = 1 if plan.until is not None else len(plan.chunks)
        bar = stack.enter_context(ProgressBar(plan.num_steps * laps, "run_chains"))
    access = None
    if checkpoint is not None:
        access = stack.enter_context(_write_access(plan, pathlib.Path(checkpoint)))
    return RunContext(plan, bar, access)


def _write_access(plan: RunPlan, path: pathlib.Path) -> WriteAccess:
    """The right to write the run's checkpoint at `path`, taken when first needed,
    after the checks that need no writing."""
    check_folder(path)
    refuse_if_in_use(path)
    chunked = len(plan.chunks) > 1
    warn_of_other_chunkings(path, plan.chunks if chunked else None)
    longest = longest_file_name(
        path,
        num_chains=plan.num_chains,
        num_draws=plan.draws.total if plan.records else 0,
        chunked=chunked,
    )
    return WriteAccess(path, longest)


def chunk_jobs(
    plan: RunPlan, start: ChainState, access: WriteAccess | None
) -> list[ChunkJob]:
    """Each chunk's chains, from every chain's `start`, and checkpoint path."""
    chunks = plan.chunks
    if len(chunks) == 1:
        return [ChunkJob(start, None if access is None else access.path, 0)]
    jobs = []
    for index, chunk in enumerate(chunks):
        checkpoint = None
        if access is not None:
            checkpoint = chunk_path(access.path, chunk.start, chunk.stop)
        # Gathered (one program per chunk size), not sliced (one per chunk).
        chains = take(start, np.asarray(chunk))
        steps_before = 0 if plan.until is not None else index * plan.num_steps
        jobs.append(ChunkJob(chains, checkpoint, steps_before))
    return jobs
