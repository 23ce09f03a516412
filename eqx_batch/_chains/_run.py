"""`run_chains`: many Markov chains at once, from a step written for one.

The algorithm: check the arguments; plan the run (trace and check the step, once per
step and kind of state); open the checkpoint and the progress bar; run each chunk of
chains (all of them, unless `chunk_size`) through every step; join the chunks into
the result.
"""

import contextlib
import dataclasses
import functools as ft
import os
import pathlib
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .._progress import ProgressBar
from .._select import take
from .._tree import owned
from ._agreement import CallAgreement
from ._arguments import (
    chain_keys,
    checked_counts,
    checked_flags,
    checked_trace,
    Init,
    split_init,
)
from ._checkpoints._checkpoint_files import (
    chunk_path,
    longest_file_name,
    warn_of_other_chunkings,
)
from ._checkpoints._disk_trace import disk_trace
from ._checkpoints._lock import check_folder, refuse_if_in_use, WriteAccess
from ._chunk import ChunkJob, RunContext
from ._common import ChainState, ProblemLayout
from ._loop import run_chunks
from ._placement import joined_chains, whole_here, without_copies
from ._plan import plan_run, RunPlan
from ._problems import problem_step
from ._results._nonfinite import NonFinite
from ._results._per_problem import Problems
from ._results._result import assembled, Chains
from ._segment_plan import TraceMode
from ._step import pytree_step
from ._superchains import expand_superchains
from ._until._convergence import diagnose, Diagnostics
from ._until._moments import zeros
from ._until._problem_records import ProblemRecords
from ._until._records import Stopped
from ._until._stopping import checked_until, StoppingRule


def run_chains(
    step: Callable,
    init: Any,
    key: Any,
    num_steps: int,
    *,
    thin: int = 1,
    burn_in: int = 0,
    with_output: bool = False,
    trace: bool | Literal["disk"] = True,
    progress: bool = False,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    chunk_size: int | None = None,
    superchains: int | None = None,
    diagnostics: bool = False,
    until: StoppingRule | None = None,
    data: Any = None,
) -> Chains:
    """Runs many independent Markov chains in parallel, from a step written for one.

    `step` advances one chain's state, a pytree such as a model's weights; `init`
    stacks many such states along axis 0. All chains run in one compiled loop, spread
    over every device of every process. Each step's key is split from the chain's own
    carried key, so chain `i` gets the same result (bit for bit, when its step is
    elementwise) as running it alone, whatever the number of chains, devices,
    processes, chunks or checkpoints. A chain gone NaN or infinite disturbs no other,
    and is reported in `nonfinite`.

    The guide, [Markov chains](../chains.md), has a section for each argument.

    **Arguments:**

    - `step`: `step(state, key) -> new_state` for ONE chain (with `with_output=True`,
        `-> (new_state, output)`), keeping the state's structure, shapes and dtypes;
        data through `functools.partial`. Or [`eb.all_chains`][]`(step)`, for a step
        that takes every chain at once.
    - `init`: the chains' initial states, stacked along axis 0 of every array leaf
        (non-array leaves are shared).
    - `key`: one PRNG key, split into one per chain, or an array of one key per
        chain; typed (`jr.key`) or legacy (`jr.PRNGKey`), and `step` gets the same kind.
    - `num_steps`: how many steps each chain takes; with `until`, the most.
    - `thin`, `burn_in`: the trace keeps the states after steps `burn_in + 1`,
        `burn_in + 1 + thin`, ...: the uninterrupted trace `[:, burn_in::thin]`.
    - `with_output`: record `step`'s second output in `Chains.outputs`.
    - `trace`: whether to record the states; `"disk"` streams them to the
        checkpoint's files ([Traces larger than
        memory](../chains.md#traces-larger-than-memory)).
    - `progress`: one tqdm bar for all chains ([Progress](../chains.md#progress)).
    - `checkpoint`: a file path: the run is checkpointed there, and a call of the same
        run resumes from it bit for bit, or reads a finished run back ([Checkpoint and
        resume](../chains.md#checkpoint-and-resume)).
    - `checkpoint_every`: write the checkpoint every this many steps (`None`: at the
        end).
    - `chunk_size`: run this many chains at a time, bit for bit the unchunked run
        ([More chains than fit in memory](../chains.md#more-chains-than-fit-in-memory)).
    - `superchains`: `K` superchains started from one point each: `init` holds K
        starts, `key` K * M keys ([Superchains](../chains.md#superchains)).
    - `diagnostics`: R-hat, nested R-hat and ESS computed while sampling, into
        `Chains.diagnostics` ([Diagnostics while
        sampling](../chains.md#diagnostics-while-sampling)).
    - `until`: an [`eb.converged`][] rule: stop once the chains have converged
        ([Stopping when converged](../chains.md#stopping-when-converged)).
    - `data`: many problems in one run: one row per problem along axis 0 of every
        array leaf (P problems). `step(state, key, data)` gets its chain's problem's
        row; chain `c` is problem `c // (chains // P)`'s, and with `until` each
        problem stops on its own ([Many problems in one
        run](../chains.md#many-problems-in-one-run)).

    **Returns:**

    A [`eb.Chains`][] ([The result](../chains.md#the-result)): `final`, `trace`
    (`[chains, draws, ...]` per leaf), `outputs`, `keys` (to continue the run
    exactly), `nonfinite`, `superchain`, `diagnostics`, `steps_done` and `stopped`,
    and with `data` the [`eb.Problems`][] of each problem. Its arrays stay split over
    the devices; in a job each process holds its own chains' rows ([What each process
    holds](../multi.md#what-each-process-holds)).

    **Raises:**

    `eb.BatchError`, naming the argument, the leaf and the fix, before any step: if
    `step` changes the state's structure, shapes or dtypes; if the arguments disagree
    on the chains, problems or superchains, or a count or a flag is out of range; if
    `checkpoint` cannot be used; in a job, if the processes' calls differ or one does
    not answer. During the run, if a checkpoint cannot be written (the last good one
    is kept). Each case: [What is refused](../chains.md#what-is-refused).

    !!! Example

        ```python
        def step(state, key):  # random-walk Metropolis on a standard normal
            proposal = state + 0.5 * jr.normal(key, state.shape)
            log_ratio = 0.5 * (jnp.sum(state**2) - jnp.sum(proposal**2))
            accept = jnp.log(jr.uniform(jr.fold_in(key, 1))) < log_ratio
            return jnp.where(accept, proposal, state)

        init = jnp.zeros((8, 3))  # 8 chains of a 3-d state
        result = eb.run_chains(step, init, jr.key(0), 200, burn_in=100, thin=2)
        result.trace.shape  # (8, 50, 3)

        # 4 superchains of 16 chains, stopped once nested R-hat says they have mixed.
        starts = jnp.array([[-4.0] * 3, [-1.0] * 3, [1.0] * 3, [4.0] * 3])
        keys = jr.split(jr.key(1), 4 * 16)
        result = eb.run_chains(
            step, starts, keys, 5000, superchains=4, until=eb.converged(every=100)
        )
        result.steps_done, result.stopped.reason  # e.g. 200, 'nested R-hat 1.01...'
        ```
    """
    # In a job, before any collective that the arguments decide (the lock's, the
    # placement's): every process runs this call, or every process raises.
    with CallAgreement(checkpoint=checkpoint) as agreement:
        until = checked_until(until, num_steps)
        counts = checked_counts(
            num_steps,
            thin,
            burn_in,
            checkpoint_every,
            chunk_size,
            checkpointed=checkpoint is not None,
        )
        with_output, progress, diagnostics = checked_flags(
            with_output=with_output, progress=progress, diagnostics=diagnostics
        )
        trace = checked_trace(trace, checkpointed=checkpoint is not None)
        diagnostics = diagnostics or until is not None  # the rule reads them
        # The loop runs on after the call returns (`Chains` waits on its fields),
        # so it reads copies of the caller's NumPy arrays, never the arrays.
        init, key, data = owned(init), owned(key), owned(data)
        whole, superchain_ids = split_init(init), None
        if superchains is not None:
            whole, superchain_ids = expand_superchains(whole, key, superchains)
            superchains = int(superchains)
        keys, legacy = chain_keys(key, whole.num_chains)
        step, num_problems, problems = owned(pytree_step(step)), None, None
        if data is not None:
            step, num_problems = problem_step(step, data, whole.num_chains, superchains)
            problems = ProblemLayout(whole.num_chains, num_problems).ids()
        plan = plan_run(
            step,
            whole,
            keys,
            legacy,
            counts,
            with_output=with_output,
            trace=trace,
            diagnostics=diagnostics,
            until=until,
            superchains=superchains,
            problems=num_problems,
            checkpointed=checkpoint is not None,
        )
        start = _start(plan, whole, keys, problems)
        agreement.on(plan, start, progress=progress)
    with contextlib.ExitStack() as stack:
        bar = None
        if progress:
            # With `until`, the chunks take turns: the bar counts the run's steps.
            laps = 1 if until is not None else len(plan.chunks)
            bar = stack.enter_context(
                ProgressBar(counts.num_steps * laps, "run_chains")
            )
        access = None
        if checkpoint is not None:
            access = stack.enter_context(_write_access(plan, pathlib.Path(checkpoint)))
        context = RunContext(plan, bar, access)
        results, record = run_chunks(context, _jobs(plan, start, access))
    return _result(
        plan,
        results,
        record,
        superchain_ids,
        None if checkpoint is None else pathlib.Path(checkpoint),
    )


def _start(
    plan: RunPlan, whole: Init, keys: jax.Array, problems: np.ndarray | None
) -> ChainState:
    """The chains before their first step (with `diagnostics`, their moments zero)."""
    moments = None
    if plan.options.diagnostics:
        moments = zeros(plan.prepared.one_chain.state, whole.num_chains)
    steps = np.zeros(whole.num_chains, np.int32)
    return ChainState(whole.arrays, keys, steps, moments, problems)


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


def _jobs(
    plan: RunPlan, start: ChainState, access: WriteAccess | None
) -> list[ChunkJob]:
    """Each chunk's chains and checkpoint path."""
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


def _result(
    plan: RunPlan,
    results: list[tuple[ChainState, Any]],
    record: ProblemRecords,
    superchain_ids: np.ndarray | None,
    checkpoint: pathlib.Path | None,
) -> Chains:
    """The chunks' chains and traces joined into `Chains`; with `trace="disk"`, the
    trace read lazily from the chunks' draw files."""
    chains = joined_chains([chains for chains, _ in results])
    stopped, steps_done = _stops(plan, record)
    # The trace holds the draws made by the problem that ran longest.
    last = plan.num_steps if plan.until is None else int(np.max(steps_done))
    recorded = _recorded(plan, results, last, chains, checkpoint)
    states = outputs = None
    if recorded is not None:
        # The leaves of a draw that are the same in every draw (an MLP's activation)
        # are the caller's own: the state's as `init` holds them.
        layout = plan.prepared.layout
        if plan.segment.with_output:
            states, outputs = recorded
            outputs = eqx.combine(outputs, layout.output_static)
        else:
            states = recorded
        if states is not None:  # None: `trace=False`, the outputs recorded alone
            states = eqx.combine(states, plan.shared)
    # Legacy keys are returned as they were given: raw data.
    keys = jr.key_data(chains.keys) if plan.segment.legacy else chains.keys
    final, states, outputs, keys = without_copies(
        (eqx.combine(chains.states, plan.shared), states, outputs, keys)
    )
    diagnostics, problems = _diagnostics(chains.moments, plan), None
    if plan.problems is not None:
        # What differs between the problems has a field of its own: the rest is
        # shaped as one problem's result, whatever the options.
        problems = assembled(
            Problems,
            count=plan.problems,
            steps_done=steps_done,
            stopped=stopped,
            draws_made=plan.draws.before(steps_done),
            diagnostics=diagnostics,
        )
        stopped, diagnostics = None, None
    return assembled(
        Chains,
        final=final,
        trace=states,
        outputs=outputs,
        keys=keys,
        # Left on the devices: read when asked for, so that the call returns while
        # the loop runs (on a TPU, reading it back was a third of a short run's cost
        # beyond the loop). In a job, gathered, as the moments are: one row per chain
        # (and waited for: see `whole_here`).
        nonfinite=assembled(NonFinite, first_step=whole_here(chains.first_bad)),
        superchain=superchain_ids,
        diagnostics=diagnostics,
        steps_done=last,
        stopped=None if stopped is None else stopped[0],
        problems=problems,
    )


def _recorded(
    plan: RunPlan,
    results: list[tuple[ChainState, Any]],
    last: int,
    chains: ChainState,
    checkpoint: pathlib.Path | None,
) -> Any:
    """The draws of the first `last` steps, `[chains, draws, ...]` per leaf (with
    `with_output`, states and outputs): the chunks' traces joined, or with
    `trace="disk"` read lazily from their files; None with `trace=False`, or with it
    and `with_output`, the outputs alone beside None for the states.

    A run that makes no draw (`num_steps=0`, or `burn_in=num_steps`) has no trace
    buffer and writes no draw file: its trace is empty, `[chains, 0, ...]` per leaf,
    in memory or, with `trace="disk"`, as `DiskArray`s.
    """
    if plan.trace is TraceMode.NONE and not plan.segment.with_output:
        return None
    like = plan.prepared.trace_like(
        plan.num_chains, plan.draws.before(last), plan.segment.records_states
    )
    if plan.trace is TraceMode.DISK:
        assert checkpoint is not None
        listing = [
            entry._replace(
                rows=(chunk.start + entry.rows[0], chunk.start + entry.rows[1])
            )
            for chunk, (_, files) in zip(plan.chunks, results, strict=True)
            for entry in files or ()
        ]
        return disk_trace(checkpoint, listing, like)
    if results[0][1] is None:
        # Split by chain as the chains are, as a trace buffer would be.
        split = chains.first_bad.sharding
        return jtu.tree_map(lambda x: jnp.zeros(x.shape, x.dtype, device=split), like)
    recorded = joined_chains([trace for _, trace in results])
    if last < plan.num_steps:
        # Only the draws made: the buffer was sized for the cap.
        recorded = _first_draws(recorded, plan.draws.before(last))
    return recorded


@ft.partial(jax.jit, static_argnums=1)
def _first_draws(trace: Any, made: int) -> Any:
    """The first `made` draws of every leaf of `trace`, in one program (sliced
    eagerly, each leaf compiled programs of its own, several when split over
    devices)."""
    return jtu.tree_map(lambda x: x[:, :made], trace)


def _stops(
    plan: RunPlan, record: ProblemRecords
) -> tuple[tuple[Stopped, ...] | None, np.ndarray]:
    """Each problem's `Stopped` (one problem without `data`; None without `until`)
    and steps run (NumPy `int64`), of a run that ended with `record`."""
    if plan.until is None:
        return None, np.full(plan.layout.num_problems, plan.num_steps, np.int64)
    # The cap stops every problem still running: each has its `Stopped`.
    return record.stops(plan.num_steps)


def _diagnostics(moments: Any, plan: RunPlan) -> Diagnostics | None:
    """Every problem's diagnostics (a leading axis of P with `data`); None without
    `diagnostics`."""
    if not plan.options.diagnostics:
        return None
    # Moments are per chain, not per draw: small enough to gather in a job.
    diagnostics = diagnose(whole_here(moments), plan.superchains, plan.problems)
    if plan.until is not None:
        # Its halves are those of the planned draws, which an early stop never makes.
        diagnostics = dataclasses.replace(diagnostics, split_rhat=None)
    return diagnostics
