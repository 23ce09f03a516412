"""What a run starts from: its chains before the first step, the context its chunks
share (the progress bar, the right to write the checkpoint), and each chunk's job."""

import contextlib

import jax
import numpy as np

from .._progress import ProgressBar
from .._stacking._select import take
from ._arguments import Init
from ._checkpoints._run_checkpoint import FileNames, RunCheckpoint
from ._chunk import ChunkJob, RunContext
from ._common import ChainState
from ._plan import RunPlan
from ._until._moments import zeros


def start_state(plan: RunPlan, whole: Init, keys: jax.Array) -> ChainState:
    """The chains before their first step (with `diagnostics`, their moments zero;
    with `data`, each chain's problem)."""
    moments = None
    if plan.options.diagnostics:
        moments = zeros(plan.prepared.one_chain.state, whole.num_chains)
    problems = plan.problems.chain_ids()
    steps = np.zeros(whole.num_chains, np.int32)
    return ChainState(whole.arrays, keys, steps, moments, problems)


def run_context(
    stack: contextlib.ExitStack,
    plan: RunPlan,
    *,
    progress: bool,
    checkpoint: RunCheckpoint,
) -> RunContext:
    """What the run's chunks share: its plan, its progress bar (if `progress`) and
    its `checkpoint` with the right to write it, each closed with `stack`."""
    bar = None
    if progress:
        # The steps before the last chunk starts, and its own.
        total = plan.stopping.steps_before(len(plan.chunks) - 1) + plan.num_steps
        bar = stack.enter_context(ProgressBar(total, "run_chains"))
    chunked = len(plan.chunks) > 1
    names = FileNames(
        plan.chunks if chunked else None,
        plan.num_chains,
        plan.recording.num_draws(plan.draws),
    )
    opened = checkpoint.opened(stack, names)
    return RunContext(plan, bar, opened)


def chunk_jobs(plan: RunPlan, start: ChainState) -> list[ChunkJob]:
    """Each chunk's chains, from every chain's `start`."""
    chunks = plan.chunks
    if len(chunks) == 1:
        return [ChunkJob(start, None, 0)]
    jobs = []
    for index, chunk in enumerate(chunks):
        # Gathered (one program per chunk size), not sliced (one per chunk).
        chains = take(start, np.asarray(chunk))
        jobs.append(ChunkJob(chains, chunk, plan.stopping.steps_before(index)))
    return jobs
