"""The user's step, traced on one chain and checked before anything runs.

A run without a checkpoint needs of the trace only its checks and the shapes of the
step's output, which depend on nothing but the step and the abstract state: they are
cached, so that calling `run_chains` again with the same step and kind of state costs no
trace (as the compiled loop costs no compile).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import jax.tree_util as jtu

from .._compile import array_types, partition
from .._errors import BatchError, bullet_list, describe, leaf_name
from .._tree import is_array


def per_chain(states: Any) -> Any:
    """Shape-dtype structs of one chain's state (array leaves; others kept as they
    are)."""
    return jtu.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if is_array(x) else x,
        states,
    )


# Python numbers in an output are JAX values that happen to start as numbers, as in
# the outputs of `lax.scan`: they are recorded as arrays.
_NUMBERS = (bool, int, float, complex)


def numbers_as_arrays(tree: Any) -> Any:
    """`tree` with its Python numbers as JAX arrays."""
    return jtu.tree_map(
        lambda x: jnp.asarray(x) if isinstance(x, _NUMBERS) else x, tree
    )


class TracedStep(NamedTuple):
    """`step` traced on one chain: its program (for the run's identity) and output."""

    program: jax.extend.core.ClosedJaxpr
    # With `with_output`, its second output: shape-dtype structs of its arrays and
    # numbers (see `numbers_as_arrays`), its other leaves as they are. Else None.
    output: Any


def trace_step(
    step: Callable, states: Any, key: jax.Array, legacy: bool, with_output: bool
) -> TracedStep:
    """Traces `step` on one chain of `states` with one of `key`'s keys.

    **Raises:**

    `BatchError` if the new state's structure, shapes or dtypes differ from the
    state's (`lax.scan` would refuse too, but naming neither the step nor the leaf), or
    if `step` does not return a pair with `with_output`.
    """
    one_key = jax.ShapeDtypeStruct(
        (2,) if legacy else (), jnp.uint32 if legacy else key.dtype
    )
    # Through a closure, so that the arrays of a partial are the program's constants.
    program, dynamic, static = eqx.filter_make_jaxpr(lambda s, k: step(s, k))(
        per_chain(states), one_key
    )
    result = eqx.combine(dynamic, static)
    if with_output:
        if not isinstance(result, tuple) or len(result) != 2:
            raise BatchError(
                "`step` must return `(new_state, output)` when `with_output=True`, but "
                f"returned {jtu.tree_structure(result)}."
            )
        new, output = result
        output = jtu.tree_map(
            lambda x: jax.eval_shape(jnp.asarray, x) if isinstance(x, _NUMBERS) else x,
            output,
        )
    else:
        new, output = result, None
    before = jtu.tree_flatten_with_path(per_chain(states))
    after = jtu.tree_flatten_with_path(new)
    if before[1] != after[1]:
        raise BatchError(_structure_change(before, after))
    changed = [
        f"`{leaf_name('init', path)}` is {describe(old)} per chain, but `step` "
        f"returned {describe(new_leaf)}"
        for (path, old), (_, new_leaf) in zip(before[0], after[0], strict=True)
        if describe(old) != describe(new_leaf)
    ]
    if changed:
        raise BatchError(
            "`step` changed the shape or dtype of the state:\n"
            + bullet_list(changed)
            + "\nIt must return every leaf with the shape and dtype it was given "
            "(cast with `.astype`)."
        )
    return TracedStep(program, output)


# Checked steps are looked up by the static part of `step` and of the state, and the
# shapes and dtypes of their arrays: what the compiled loop's cache keys on too. An
# entry keeps its step alive (as `jax.jit`'s cache does), so at most this many are kept.
_CHECKED_STEPS = 256
_checked_outputs: dict[tuple, Any] = {}


def checked_output(
    step: Callable, states: Any, key: jax.Array, legacy: bool, with_output: bool
) -> Any:
    """`trace_step(...).output`, traced only the first time `step` meets states and
    keys of these shapes and dtypes (and raising as `trace_step` does)."""
    step_arrays, step_static = partition(step)
    state_arrays, state_static = partition(states)
    signature = (
        step_static,
        array_types(step_arrays),
        state_static,
        tuple((x.shape[1:], x.dtype) for x in state_arrays),
        key.dtype,
        legacy,
        with_output,
    )
    try:
        return _checked_outputs[signature]
    except KeyError:
        pass
    except TypeError:
        # A non-array leaf that cannot be hashed: traced every time (and refused, by
        # name, when the loop is compiled).
        return trace_step(step, states, key, legacy, with_output).output
    output = trace_step(step, states, key, legacy, with_output).output
    if len(_checked_outputs) >= _CHECKED_STEPS:
        del _checked_outputs[next(iter(_checked_outputs))]
    _checked_outputs[signature] = output
    return output


def _structure_change(before: tuple, after: tuple) -> str:
    old = {jtu.keystr(path) for path, _ in before[0]}
    new = {jtu.keystr(path) for path, _ in after[0]}
    lines = [f"`init{p}` is missing from the new state" for p in sorted(old - new)]
    lines += [f"`new_state{p}` is not in `init`" for p in sorted(new - old)]
    if not lines:
        lines = [f"init (per chain): {before[1]}", f"step returned:    {after[1]}"]
    return (
        "`step` changed the structure of the state:\n"
        + bullet_list(lines)
        + "\nIt must return a state with the same containers, keys and static fields."
    )
