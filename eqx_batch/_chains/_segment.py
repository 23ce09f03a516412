"""The compiled segment: `length` steps of every chain, in one program.

The program is a `lax.scan` over steps whose body `vmap`s one step over all chains.
Keeping the step counter outside the `vmap` leaves it unbatched, so the trace write
and the segment offsets are plain scalar logic, and nothing about one chain depends on
how many others run beside it. The program holds no host callback: the progress bar
moves from the host between segments (`_progress.py` says why). An `eb.all_chains`
step is called once on the whole stack instead, with the keys split per chain as for a
per-chain step.

Typed PRNG keys, in the states and the chains' keys, stay typed in and out of the
program. This module knows nothing about files.
"""

import functools as ft
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu

from .._compiling._compile import AsyncJit
from .._tree import is_array, with_leaves_replaced
from ._all_chains import RunStep
from ._common import ChainState
from ._placement import made_zeros
from ._segment_plan import SegmentPlan
from ._step import numbers_as_arrays
from ._until._moments import add_draw, pack, unpack


class SegmentResult(NamedTuple):
    chains: ChainState
    # The trace buffer, every draw so far written in; None if the segment returns its
    # own draws.
    trace: Any
    new_draws: Any  # the draws around the segment's, if `plan.emit`; else None


def _with_first_bad(first_bad: jax.Array, raw_states: Any, step: Any) -> jax.Array:
    """`first_bad` with `step` for each chain whose state (chains first) has a
    non-finite value, if none was found before.

    The leaves of each dtype are checked as one array, so the check is a kernel or
    two for XLA to compile rather than one per leaf: at tens of leaves those took a
    quarter of the loop's compile time.
    """
    by_dtype: dict[Any, list[jax.Array]] = {}
    for x in jtu.tree_leaves(raw_states):
        if is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact):
            per_chain = math.prod(x.shape[1:])
            by_dtype.setdefault(x.dtype, []).append(x.reshape(x.shape[0], per_chain))
    finite = [
        jnp.all(jnp.isfinite(jnp.concatenate(xs, axis=1)), axis=1)
        for xs in by_dtype.values()
    ]
    if not finite:
        return first_bad
    bad = ~ft.reduce(jnp.logical_and, finite)
    return jnp.where((first_bad == 0) & bad, step, first_bad)


def segment(
    plan: SegmentPlan,
    step: RunStep,
    static: Any,
    chains: ChainState,
    start: jax.Array,
    trace: Any,
    running: jax.Array | None = None,
) -> SegmentResult:
    """Runs `plan.length` steps of every chain from step `start`.

    `static` holds the non-array leaves of the state. `trace`, the trace buffer, holds
    every draw of the run (`[chains, draws, ...]` per leaf) and is written in place.
    A run of one segment passes it, and the NaN report, as the shape-dtype structs of
    the zeros they start as (`Placement.zeros_to_make`), made here: one program to
    dispatch rather than two, and no buffer handed between them. A segment that
    `returns_own_draws` gets a buffer of `emit` draws instead (donated: an earlier
    segment's, written out already), records its own draws in it from slot 0 and
    returns it as `new_draws` (its `trace` is then None): nothing of the run's size is
    kept.

    A segment that `freezes` (a run with `until`) gets `running`, whether each
    problem still runs (`bool[problems]`; one, without `data`): the chains of the
    others end it as they began it (state, key, moments and NaN report) and record
    zeros (or, where a thinned trace rewrites a slot, what it holds), so that a batch
    may hold problems that stopped since the host last looked (`_compaction.py`).
    """
    trace = made_zeros(trace)
    chains = chains._replace(
        first_bad=made_zeros(chains.first_bad), moments=made_zeros(chains.moments)
    )
    # The slot of the segment's first draw in `trace`: 0 when it holds only its own.
    first = plan.draws.before(start)
    offset = first if plan.returns_own_draws else 0
    records = plan.writes_trace or (plan.returns_own_draws and plan.emit > 0)

    move = _mover(plan, step, static, chains.problem)
    live = _live(plan, running, chains.problem)

    def body(carry: tuple, _: None) -> tuple:
        (states, keys, first_bad, moments, problem), buffer, t = carry
        keys, new, output = move(states, keys, t)
        # Checked as the step leaves them, at step `t + 1` (counted from 1).
        states = _as_carried(new, states)
        first_bad = _with_first_bad(first_bad, states, t + 1)
        # A shared state carried beside the chains is neither diagnosed nor recorded.
        own, _ = step.own_and_shared(states)
        moments = add_draw(moments, own, t, plan.draws)
        if records:
            recorded = plan.recorded(own, output)
            buffer = _written(plan, buffer, recorded, t, offset, live)
        chains = ChainState(states, keys, first_bad, moments, problem)
        return (chains, buffer, t + 1), None

    # The moments are carried packed, one array per dtype (`Packed`).
    packed = chains._replace(moments=pack(chains.moments))
    (after, trace, _), _ = lax.scan(
        body, (packed, trace, start), None, length=plan.length
    )
    moments = unpack(after.moments, chains.moments)
    before, chains = chains, after._replace(moments=moments)
    if live is not None:
        # A stopped chain ran on with the others, its results dropped here (a
        # select per step costs the CPU's loop a third more); only what it recorded
        # was kept out of the trace, step by step.
        chains = _frozen(live, chains, before)
    new_draws = None
    if plan.returns_own_draws:
        new_draws, trace = (trace if records else None), None
    elif plan.emit:
        # In the same program as the loop: no extra dispatch, and XLA can overlap it.
        new_draws = jtu.tree_map(
            lambda b: lax.dynamic_slice_in_dim(b, first, plan.emit, 1), trace
        )
    return SegmentResult(chains, trace, new_draws)


def _as_carried(new: Any, old: Any) -> Any:
    """The states `new` a step made from `old`, as the loop carries them: each new
    leaf behind one optimization barrier, so that XLA computes it once, for the
    loop and the finiteness check alike.

    Without it XLA computed a step's last op (a sampler's accept) again inside the
    check, which then read the states carried in beside the step that overwrites
    them in place: XLA copied them every step, 5 to 13% of a step on a CPU. A leaf
    the step returned as it was given (a frozen shared state) stays out of the
    barrier, so that XLA still sees it constant over the loop.
    """
    given = {id(x) for x in jtu.tree_leaves(old)}
    return with_leaves_replaced(
        new, lambda x: id(x) not in given, lax.optimization_barrier
    )


def _live(plan: SegmentPlan, running: Any, problem: Any) -> jax.Array | None:
    """Whether each chain's problem still runs (`running[problem]`; one for all
    without `data`), if the segment `freezes` the others; else None."""
    if not plan.freezes:
        return None
    assert running is not None
    return running[0] if problem is None else running[problem]


def _mover(
    plan: SegmentPlan, step: RunStep, static: Any, problem: Any
) -> Callable[[Any, jax.Array, jax.Array], tuple]:
    """One step of every chain, as the segment's loop takes it: `(states, keys, t)`
    to the new keys, states and outputs (arrays only).

    Made before the loop: with `data`, what each block of a problem's chains reads of
    it is made here, so that the loop body holds no gather of it and reads each
    problem's row once per step (`ProblemStep.for_chains`)."""

    def next_key(key: jax.Array) -> tuple:
        # The chain's carried key and the key its step gets.
        key, subkey = jr.split(key)
        return key, jr.key_data(subkey) if plan.legacy else subkey

    def advance(step: Callable, states: Any, step_keys: Any, *extra: Any) -> tuple:
        # `step` on one chain's state (and what it reads of `data`), or on every
        # chain's with their `count`.
        result = step(eqx.combine(states, static), step_keys, *extra)
        new, output = result if plan.with_output else (result, None)
        # Only arrays are recorded: the output's other leaves are the same every step.
        output = eqx.filter(numbers_as_arrays(output), is_array)
        return eqx.filter(new, is_array), output

    chain_step, map_chains = step.for_chains(problem, plan.block)

    def one_chain(state: Any, key: jax.Array, *row: Any) -> tuple:
        key, step_key = next_key(key)
        return key, *advance(chain_step, state, step_key, *row)

    def move(states: Any, keys: jax.Array, t: jax.Array) -> tuple:
        if step.sees_every_chain:
            keys, step_keys = jax.vmap(next_key)(keys)
            return keys, *advance(chain_step, states, step_keys, t)
        return map_chains(one_chain, states, keys)

    return move


def _written(
    plan: SegmentPlan,
    trace: Any,
    recorded: Any,
    t: jax.Array,
    offset: Any,
    live: jax.Array | None,
) -> Any:
    """`trace` with step `t`'s draw, `recorded`, written in its slot (counted from
    `offset`), for the chains that are `live` (None: all)."""
    # One slot written per step, rather than a `lax.cond`, which XLA may turn into a
    # copy of the whole buffer per step. A step before `burn_in` gives a slot of 0 or
    # below, which XLA clamps to 0, as it clamps any slot past the buffer's end to the
    # last: nothing is computed to bound it (else XLA repeats that arithmetic in every
    # leaf's write, for longer compiles). Before the segment's first draw, the slot of
    # a segment that returns its own draws is below 0, clamped to 0 like the slots
    # before `burn_in`.
    draws = plan.draws
    slot = draws.slot(t) - offset
    is_draw = draws.is_draw(t) if draws.thin > 1 else None
    return jtu.tree_map(
        lambda buffer, x: _write_slot(
            buffer, x, slot, is_draw, draws.thin, live, plan.returns_own_draws
        ),
        trace,
        recorded,
    )


def _rows(mask: jax.Array, ndim: int) -> jax.Array:
    """`mask` (one per chain) shaped to broadcast over a leaf of `ndim` axes."""
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def _frozen(live: jax.Array, new: ChainState, old: ChainState) -> ChainState:
    """`new`, with the chains that are not `live` (a bool per chain, or one for all)
    as they were in `old`."""
    return jtu.tree_map(lambda n, o: jnp.where(_rows(live, n.ndim), n, o), new, old)


def _write_slot(
    buffer: jax.Array,
    x: jax.Array,
    slot: jax.Array,
    is_draw: Any,
    thin: int,
    live: jax.Array | None,
    own_draws: bool,
) -> jax.Array:
    """`buffer` with `x` written at `slot` along axis 1, if `is_draw` (None when
    every step from `burn_in` on is a draw); for the chains that are not `live`
    (None: all are), zeros, or what the slot holds where a thinned run's trace
    buffer is rewritten (a stopped chain's last draw may sit there)."""
    old = None
    if thin > 1:
        # A step between two draws rewrites the last draw's slot as it was.
        old = lax.dynamic_index_in_dim(
            buffer, slot, 1, keepdims=False, allow_negative_indices=False
        )
        x = jnp.where(is_draw, x, old)
    if live is not None:
        # A segment's own buffer held another segment's draws: zeros, not those.
        kept = jnp.zeros_like(x) if old is None or own_draws else old
        x = jnp.where(_rows(live, x.ndim), x, kept)
    # Without thinning, every step from `burn_in` on is a draw, and a step before it
    # writes slot 0, which holds no draw until step `burn_in` overwrites it: nothing
    # needs reading.
    return lax.dynamic_update_index_in_dim(
        buffer, x, slot, 1, allow_negative_indices=False
    )


# Dispatched without waiting: the next segment is queued while this one runs, and the
# checkpoint writer waits on the results it needs, not the loop. The trace buffer is
# donated and updated in place.
run_segment = AsyncJit(segment, donate=("trace",))
