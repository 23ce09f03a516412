"""The result of a run: its chunks' chains, traces and records assembled into
`eb.Chains` (one problem's fields, and with `data` each problem's in `eb.Problems`)."""

import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from ._checkpoints._run_checkpoint import RunCheckpoint
from ._common import ChainState
from ._placement import joined_chains, whole_here, without_copies
from ._plan import RunPlan
from ._results._nonfinite import NonFinite
from ._results._per_problem import Problems
from ._results._result import assembled, Chains
from ._segment_plan import TraceMode
from ._until._convergence import diagnose, Diagnostics
from ._until._problem_records import ProblemRecords


def result(
    plan: RunPlan,
    results: list[tuple[ChainState, Any]],
    record: ProblemRecords,
    superchain_ids: np.ndarray | None,
    checkpoint: RunCheckpoint,
) -> Chains:
    """The chunks' chains and traces joined into `Chains`; with `trace="disk"`, the
    trace read lazily from the chunks' draw files."""
    chains = joined_chains([chains for chains, _ in results])
    stopped, steps_done = plan.stopping.stops(record)
    # The trace holds the draws made by the problem that ran longest.
    last = int(np.max(steps_done))
    states, outputs = _states_and_outputs(
        plan, _recorded(plan, results, last, chains, checkpoint)
    )
    # The chains' own states, and each problem's shared state carried beside them.
    own, copies = plan.step.own_and_shared(eqx.combine(chains.states, plan.static))
    # Legacy keys are returned as they were given: raw data.
    keys = jr.key_data(chains.keys) if plan.segment.legacy else chains.keys
    final, states, outputs, keys = without_copies((own, states, outputs, keys))
    shared = None if copies is None else _shared_rows(copies, plan)
    # With `data`, what differs between the problems has a field of its own: the
    # rest is shaped as one problem's result, whatever the options.
    problems, own_fields = plan.problems.of_problems(
        {
            "stopped": stopped,
            "diagnostics": _diagnostics(chains.moments, plan),
            "shared": shared,
        },
        lambda **fields: assembled(
            Problems,
            steps_done=steps_done,
            draws_made=plan.draws.before(steps_done),
            **fields,
        ),
    )
    stopped = own_fields.pop("stopped")
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
        steps_done=last,
        stopped=None if stopped is None else stopped[0],
        problems=problems,
        **own_fields,
    )


def _states_and_outputs(plan: RunPlan, recorded: Any) -> tuple[Any, Any]:
    """The recorded states and outputs, each None if not recorded, with the leaves
    that are the same in every draw (an MLP's activation) as the caller gave them:
    the state's as `init` holds them."""
    if recorded is None:
        return None, None
    states, outputs = recorded if plan.segment.with_output else (recorded, None)
    if outputs is not None:
        outputs = eqx.combine(outputs, plan.prepared.layout.output_static)
    if states is not None:  # None: `trace=False`, the outputs recorded alone
        static, _ = plan.step.own_and_shared(plan.static)
        states = eqx.combine(states, static)
    return states, outputs


def _shared_rows(rows: Any, plan: RunPlan) -> Any:
    """The shared state of each problem (a row each with `data`; else the one
    problem's), whole in every process."""
    return plan.problems.rows(whole_here(rows))  # small: a few numbers per problem


def _recorded(
    plan: RunPlan,
    results: list[tuple[ChainState, Any]],
    last: int,
    chains: ChainState,
    checkpoint: RunCheckpoint,
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
        listing = [
            entry._replace(
                rows=(chunk.start + entry.rows[0], chunk.start + entry.rows[1])
            )
            for chunk, (_, files) in zip(plan.chunks, results, strict=True)
            for entry in files or ()
        ]
        return checkpoint.disk_trace(listing, like)
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


def _diagnostics(moments: Any, plan: RunPlan) -> Diagnostics | None:
    """Every problem's diagnostics (a leading axis of P with `data`); None without
    `diagnostics`."""
    if not plan.options.diagnostics:
        return None
    # Moments are per chain, not per draw: small enough to gather in a job.
    diagnostics = diagnose(whole_here(moments), plan.superchains, plan.problems.blocks)
    return plan.stopping.diagnosed(diagnostics)
