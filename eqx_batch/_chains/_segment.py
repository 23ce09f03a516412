"""The compiled segment: `length` steps of every chain, in one program.

The program is a `lax.scan` over steps whose body `vmap`s one step over all chains.
Keeping the step counter outside the `vmap` leaves it unbatched, so the trace write,
the progress bar and the segment offsets are plain scalar logic, and nothing about one
chain depends on how many others run beside it. An `eb.all_chains` step is called once
on the whole stack instead, with the keys split per chain as for a per-chain step.

Typed PRNG keys in the states enter and leave the program as their raw data
(`as_key_data`), so that the trace buffer, chunks and checkpoints handle plain arrays;
they are keys again only inside, where wrapping and unwrapping cost nothing. The chains'
own keys enter and leave typed (each segment unwraps and wraps them), so that a run of
typed keys makes no eager JAX operation on them before or after its program. This module
knows nothing about files.
"""

import dataclasses
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

from .._compile import AsyncJit
from .._memo import BoundedCache
from .._progress import ProgressHandle
from .._tree import as_key_data, as_keys_like, is_array
from ._all_chains import AllChains
from ._moments import record
from ._placement import made_zeros
from ._step import numbers_as_arrays


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """Everything about a segment that is fixed at trace time."""

    length: int
    num_draws: int
    thin: int
    burn_in: int
    with_output: bool
    record: bool
    legacy: bool  # `step` takes legacy `uint32` keys rather than typed ones
    # How many draws from the segment's first one on to return a copy of, for the
    # checkpoint (the next segment takes over, donates, the trace buffer while they
    # are written). The most any segment of this length records, so that segments
    # that record fewer share the compiled loop; the slice then ends at the buffer's
    # end and starts before the segment's first draw.
    emit: int = 0

    def window(self, length: int, emit: int) -> "SegmentPlan":
        """This plan for a segment of `length` steps that emits `emit` draws: the
        same object as on earlier calls, so that `run_segment` finds its program by
        identity."""
        return _windows.get_or_make(
            (self, length, emit),
            lambda: dataclasses.replace(self, length=length, emit=emit),
        )


_windows = BoundedCache(256)


class ChainState(NamedTuple):
    """Every chain between two steps: the array leaves of its state as raw data (typed
    keys as `as_key_data` makes them), its key, and its NaN report."""

    # JAX arrays on the devices, or NumPy arrays on the host before they are placed.
    states: Any
    # Typed keys: their raw data only in checkpoint files and on the way to the devices
    # of other processes.
    keys: Any
    first_bad: Any  # the first non-finite step, counted from 1; 0 while finite
    # The running moments of the recorded draws (`_moments.py`), with
    # `diagnostics=True`; else None.
    moments: Any = None


class OneChain(NamedTuple):
    """One chain's state (array leaves) and key as shape-dtype structs, typed keys as
    keys: what the raw data of `ChainState` is wrapped back into inside the program."""

    state: Any
    key: jax.ShapeDtypeStruct


class SegmentProgress(NamedTuple):
    """The progress bar as a segment drives it."""

    handle: ProgressHandle
    due: Any  # the step at which the next report is due
    steps_before: Any  # steps of chunks run before this one (`int32`, so chunks
    # share the program)


class SegmentResult(NamedTuple):
    chains: ChainState
    trace_buffer: Any
    due: Any  # the due step of the next progress report; None without a bar
    new_draws: Any  # the draws around the segment's, if `plan.emit`; else None


def draws_before(step: int, burn_in: int, thin: int) -> int:
    """How many draws are recorded in the first `step` steps."""
    return max(0, -(-(step - burn_in) // thin))


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


def _segment(
    plan: SegmentPlan,
    step: Callable,
    shared: Any,
    one_chain_like: OneChain,
    chains: ChainState,
    start: jax.Array,
    progress: SegmentProgress | None,
    trace_buffer: Any,
) -> SegmentResult:
    """Runs `plan.length` steps of every chain from step `start`.

    `shared` holds the non-array leaves of the state. The trace buffer holds every
    draw of the run (`[chains, draws, ...]` per leaf, raw data) and is written in place.
    A run of one segment passes it, and the NaN report, as the shape-dtype structs of
    the zeros they start as (`Placement.zeros_to_make`), made here: one program to
    dispatch rather than two, and no buffer handed between them.
    """
    trace_buffer = made_zeros(trace_buffer)
    keys_in = chains.keys
    chains = chains._replace(
        keys=as_key_data(keys_in), first_bad=made_zeros(chains.first_bad)
    )

    def next_key(raw_key: jax.Array) -> tuple:
        # The chain's carried key (raw) and the key its step gets.
        key, subkey = jr.split(as_keys_like(raw_key, one_chain_like.key))
        return jr.key_data(key), jr.key_data(subkey) if plan.legacy else subkey

    def advance(raw_states: Any, step_keys: Any, *count: jax.Array) -> tuple:
        # `step` on one chain's state, or every chain's with their `count`.
        states = as_keys_like(raw_states, one_chain_like.state)
        result = step(eqx.combine(states, shared), step_keys, *count)
        new, output = result if plan.with_output else (result, None)
        # Only arrays are recorded: the output's other leaves are the same every step.
        output = eqx.filter(numbers_as_arrays(output), is_array)
        return eqx.filter(new, is_array), output

    def one_chain(raw_state: Any, raw_key: jax.Array) -> tuple:
        key, step_key = next_key(raw_key)
        new, output = advance(raw_state, step_key)
        return as_key_data(new), key, as_key_data(output)

    def every_chain(raw_states: Any, raw_keys: jax.Array, t: jax.Array) -> tuple:
        keys, step_keys = jax.vmap(next_key)(raw_keys)
        new, output = advance(raw_states, step_keys, t)
        return as_key_data(new), keys, as_key_data(output)

    def body(carry: tuple, _: None) -> tuple:
        (states, keys, first_bad, moments), buffer, t, due = carry
        # The states carried in are those after step `t` (counted from 1; at `t = 0`
        # no step has run, and 0 stays 0). They are read where they are held, so
        # XLA does not repeat the step's arithmetic to check them.
        first_bad = _with_first_bad(first_bad, states, t)
        if isinstance(step, AllChains):
            states, keys, output = every_chain(states, keys, t)
        else:
            states, keys, output = jax.vmap(one_chain)(states, keys)
        moments = record(
            moments,
            states,
            t,
            burn_in=plan.burn_in,
            thin=plan.thin,
            num_draws=plan.num_draws,
        )
        if plan.record:
            # One slot written per step, rather than a `lax.cond`, which XLA may turn
            # into a copy of the whole buffer per step. A step before `burn_in` gives a
            # slot of 0 or below, which XLA clamps to 0, as it clamps any slot past the
            # buffer's end to the last: nothing is computed to bound it (else XLA
            # repeats that arithmetic in every leaf's write, for longer compiles).
            slot = t - plan.burn_in
            if plan.thin > 1:
                # Truncated, not floored: equal from `burn_in` on, and at most 0 before.
                slot = lax.div(slot, slot.dtype.type(plan.thin))

            def write(draws: jax.Array, x: jax.Array) -> jax.Array:
                if plan.thin > 1:
                    # A step between two draws rewrites the last draw's slot as it was.
                    keep = (t >= plan.burn_in) & ((t - plan.burn_in) % plan.thin == 0)
                    old = lax.dynamic_index_in_dim(
                        draws, slot, 1, keepdims=False, allow_negative_indices=False
                    )
                    x = jnp.where(keep, x, old)
                # Without thinning, every step from `burn_in` on is a draw, and a step
                # before it writes slot 0, which holds no draw until step `burn_in`
                # overwrites it: nothing needs reading.
                return lax.dynamic_update_index_in_dim(
                    draws, x, slot, 1, allow_negative_indices=False
                )

            recorded = (states, output) if plan.with_output else states
            buffer = jtu.tree_map(write, buffer, recorded)
        if progress is not None:
            # Counted over the whole run: chains run earlier (in chunks) included.
            due = progress.handle(progress.steps_before + t + 1, due)
        return (ChainState(states, keys, first_bad, moments), buffer, t + 1, due), None

    due = None if progress is None else progress.due
    (chains, trace_buffer, end, due), _ = lax.scan(
        body, (chains, trace_buffer, start, due), None, length=plan.length
    )
    # The states after the segment's last step, which no step of it carried in.
    chains = chains._replace(
        keys=as_keys_like(chains.keys, keys_in),
        first_bad=_with_first_bad(chains.first_bad, chains.states, end),
    )
    new_draws = None
    if plan.emit:
        # In the same program as the loop: no extra dispatch, and XLA can overlap it.
        first = jnp.maximum(0, -((plan.burn_in - start) // plan.thin))
        new_draws = jtu.tree_map(
            lambda b: lax.dynamic_slice_in_dim(b, first, plan.emit, 1), trace_buffer
        )
    return SegmentResult(chains, trace_buffer, due, new_draws)


# Dispatched without waiting: the next segment is queued while this one runs, and the
# checkpoint writer waits on the results it needs, not the loop. The trace buffer is
# donated and updated in place.
run_segment = AsyncJit(_segment, donate=("trace_buffer",))


# `run_segment` finds its program at once for arguments whose non-array leaves are the
# very objects of an earlier call (else it partitions and hashes them): the plan and
# shape-dtype structs that every call makes anew are swapped for equal ones seen before.
_seen: BoundedCache = BoundedCache(256)


def seen_before(tree: Any) -> Any:
    """`tree` with each leaf (hashable: a `SegmentPlan`, shape-dtype structs) replaced
    by an equal one passed here before, if any."""

    return jtu.tree_map(lambda leaf: _seen.get_or_make(leaf, lambda: leaf), tree)
