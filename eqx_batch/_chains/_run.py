"""`run_chains`: many Markov chains at once, from a step written for one.

The algorithm: check the arguments; plan the run (trace and check the step, once per
step and kind of state); open the checkpoint and the progress bar; run each chunk of
chains (all of them, unless `chunk_size`) through every step; join the chunks into
the result.
"""

import contextlib
import os
from collections.abc import Callable
from typing import Any, Literal

from .._tree import owned
from ._agreement import CallAgreement
from ._arguments import (
    chain_starts,
    checked_counts,
    checked_flags,
    checked_trace,
    Counts,
    Init,
    Starts,
)
from ._assembly import result
from ._checkpoints._run_checkpoint import run_checkpoint, RunCheckpoint
from ._loop import run_chunks
from ._plan import plan_run, RunPlan
from ._results._result import Chains
from ._shared import composed_step
from ._start import chunk_jobs, run_context, start_state
from ._step import trace_step
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
    shared: Any = None,
) -> Chains:
    """Runs many independent Markov chains in parallel, from a step written for one.

    `step` advances one chain's state (a pytree); `init` stacks many along axis 0.
    All chains run in one compiled loop over every device of every process. Each
    step's key is split from the chain's own, so chain `i` gets its result alone (bit
    for bit, for an elementwise step) whatever the chains, devices, processes, chunks
    or checkpoints. A chain gone NaN or infinite disturbs no other (`nonfinite`).

    The guide, [Markov chains](../chains.md), has a section for each argument.

    **Arguments:**

    - `step`: `step(state, key) -> new_state` for ONE chain (with `with_output=True`,
        `-> (new_state, output)`), keeping the state's structure, shapes and dtypes;
        data through `functools.partial`. Or [`eb.all_chains`][]`(step)`, for a step
        that takes every chain at once.
    - `init`: the chains' initial states, stacked along axis 0 of every array leaf
        (non-array leaves are the same for every chain).
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
    - `checkpoint_every`: checkpoint every this many steps (`None`: at the end).
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
    - `shared`: a state the chains of a problem share (a tuned step size), with no
        chain axis (with `data`, a row per problem), for an [`eb.all_chains`][] step
        `fn(states, keys, count, shared[, data]) -> (states, shared)`; its final
        value is `Chains.shared` ([A state the chains
        share](../chains.md#a-state-the-chains-share)).

    **Returns:**

    A [`eb.Chains`][] ([The result](../chains.md#the-result)), its arrays split over
    the devices; in a job each process holds its own chains' rows ([What each
    process holds](../multi.md#what-each-process-holds)).

    **Raises:**

    `eb.BatchError`, naming the argument, the leaf and the fix, before any step: if
    `step` changes the state, the arguments disagree or are out of range,
    `checkpoint` cannot be used, or in a job the processes' calls differ. During the
    run, if a checkpoint cannot be written (the last good one is kept). Each case:
    [What is refused](../chains.md#what-is-refused).

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
    with CallAgreement() as agreement:
        checkpointing = run_checkpoint(checkpoint)
        until = checked_until(until, num_steps)
        counts = checked_counts(
            num_steps,
            thin,
            burn_in,
            checkpoint_every,
            chunk_size,
            require_checkpoint=checkpointing.require,
        )
        with_output, progress, diagnostics = checked_flags(
            with_output=with_output, progress=progress, diagnostics=diagnostics
        )
        trace = checked_trace(trace, require_checkpoint=checkpointing.require)
        # The loop runs on after the call returns (`Chains` waits on its fields),
        # so it reads copies of the caller's NumPy arrays, never the arrays.
        init, key, data, shared = owned(init), owned(key), owned(data), owned(shared)
        starts = chain_starts(init, key, superchains)
        plan, whole = _planned(
            step,
            starts,
            counts,
            shared=shared,
            data=data,
            with_output=with_output,
            trace=trace,
            diagnostics=diagnostics,
            until=until,
            checkpointing=checkpointing,
        )
        start = start_state(plan, whole, starts.keys)
        agreement.on(plan, start, progress=progress, checkpoint=checkpointing)
    with contextlib.ExitStack() as stack:
        context = run_context(stack, plan, progress=progress, checkpoint=checkpointing)
        results, record = run_chunks(context, chunk_jobs(plan, start))
    return result(plan, results, record, starts.superchain_ids, context.checkpoint)


def _planned(
    step: Callable,
    starts: Starts,
    counts: Counts,
    *,
    shared: Any,
    data: Any,
    with_output: bool,
    trace: bool | Literal["disk"],
    diagnostics: bool,
    until: StoppingRule | None,
    checkpointing: RunCheckpoint,
) -> tuple[RunPlan, Init]:
    """The run's plan, and `starts.init` as the composed step takes it (with
    `shared`, its state beside each chain's)."""
    run_step, whole, problems = composed_step(
        step,
        starts.init,
        shared,
        data,
        with_output=with_output,
        superchains=starts.superchains,
    )
    traced = checkpointing.traced(
        lambda: trace_step(
            run_step, whole.whole, starts.keys, starts.legacy, with_output
        )
    )
    plan = plan_run(
        run_step,
        whole,
        starts.keys,
        starts.legacy,
        counts,
        with_output=with_output,
        trace=trace,
        diagnostics=diagnostics,
        until=until,
        superchains=starts.superchains,
        problems=problems,
        traced=traced,
    )
    return plan, whole
