"""Selecting members of a stacked pytree by position: `index` and `take`.

Concrete indices are range-checked; traced ones (inside `jax.jit`) cannot be, so a
negative one counts from the end once and the result is clamped into range, as
`jnp.take(..., mode="clip")` does. CPU leaves are indexed through host NumPy and
compile nothing; other leaves use one compiled program per leaf shape.
"""

import functools as ft
import operator
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, describe, is_bool
from .._tree import host_array, is_numpy, is_tracer
from ._from_host import on_cpu, put_like
from ._stack import index_leaf, leaves_and_count


Tree = TypeVar("Tree")


@ft.partial(jax.jit, static_argnums=2)
def _take_many(x: jax.Array, indices: jax.Array, axis: int) -> jax.Array:
    indices = jnp.where(indices < 0, indices + x.shape[axis], indices)
    return jnp.take(x, indices, axis=axis, mode="clip")


def _select(leaf: Any, where: Any, axis: int) -> Any:
    """`leaf` indexed along `axis` by an integer (dropping the axis) or a 1-d array.

    Integers must be in range when concrete; traced ones wrap once if negative and
    are then clamped.
    """
    concrete = not is_tracer(leaf) and not is_tracer(where)
    if concrete and is_numpy(leaf):
        # `np.array` keeps a 0-d result an ndarray rather than a NumPy scalar.
        return np.array(np.take(leaf, where, axis=axis))
    if concrete and on_cpu(leaf):
        return put_like(np.asarray(np.take(host_array(leaf), where, axis=axis)), leaf)
    if np.ndim(where) == 0:
        return index_leaf(jnp.asarray(leaf), where, axis)
    return _take_many(jnp.asarray(leaf), jnp.asarray(where), axis)


def _check_traced_index(i: Any, argname: str) -> None:
    if not jnp.issubdtype(i.dtype, jnp.integer):
        raise BatchError(
            f"`{argname}` is a traced {describe(i)}; it must be an integer."
        )


def _check_index(i: Any, size: int, argname: str) -> int:
    if is_bool(i):
        raise BatchError(f"`{argname}` is {i!r}, a bool; it must be an integer.")
    try:
        index_ = operator.index(i)
    except TypeError:
        raise BatchError(
            f"`{argname}` is {describe(i)}; an index must be an integer."
        ) from None
    if not -size <= index_ < size:
        raise BatchError(
            f"index {index_} is out of range for {size} members (valid: {-size} to "
            f"{size - 1})."
        )
    return index_ % size


def index(tree: Tree, i: int, *, axes: Any = eqx.if_array(0)) -> Tree:
    """Member `i` of a stacked pytree.

    Like `unstack(tree)[i]`, without building the other members. Indexing every member
    in a loop compiles nothing for CPU arrays, and at most one program per leaf shape
    elsewhere, never one per index (as `tree.weight[i]` can).

    **Arguments:**

    - `tree`: a stacked pytree.
    - `i`: the member, an integer (not a bool); negative values count from the end.
        A traced `i` (inside `jax.jit`) cannot be range-checked: a negative one
        counts from the end as well, once, and the result is clamped into range
        (of 4 members, `-5` gives member 0 and `7` member 3), as by `take`.
    - `axes`: an axis spec, as for `stack`.

    **Returns:**

    One member, a pytree of the same structure with the member axis removed from every
    mapped leaf.

    **Raises:**

    `BatchError` if `i` is not an integer (a bool included) or is out of range, or
    for the reasons `batch_size` raises.

    !!! Example

        ```python
        stacked = {"w": jnp.arange(6.0).reshape(3, 2)}
        eb.index(stacked, -1)["w"]  # [4., 5.]
        ```
    """
    leaves, size = leaves_and_count(tree, axes, "tree")
    if is_tracer(i):
        _check_traced_index(i, "i")
    else:
        i = _check_index(i, size, "i")
    out = [leaf if axis is None else _select(leaf, i, axis) for _, leaf, axis in leaves]
    return jtu.tree_unflatten(jtu.tree_structure(tree), out)


def take(tree: Tree, indices: Any, *, axes: Any = eqx.if_array(0)) -> Tree:
    """A stacked pytree of the members at `indices`.

    Selects a subset (or a reordering, or repeats) of an ensemble or population while
    keeping it stacked, e.g. the best members after an evaluation.

    **Arguments:**

    - `tree`: a stacked pytree.
    - `indices`: a 1-d sequence or array of integers (not bools); negative values
        count from the end. Traced indices (inside `jax.jit`) cannot be
        range-checked: negative ones count from the end as well, and the results are
        clamped into range.
    - `axes`: an axis spec, as for `stack`.

    **Returns:**

    A stacked pytree with `len(indices)` members. NumPy leaves stay NumPy.

    **Raises:**

    `BatchError` if `indices` is not a 1-d array of integers or holds a bool, if an
    index is out of range (checked in the indices' own dtype, so a `uint64` above
    int64's range is out of range, not negative), or for the reasons `batch_size`
    raises.

    !!! Example

        ```python
        stacked = {"w": jnp.arange(4.0)}
        eb.take(stacked, [3, 0])["w"]  # [3., 0.]
        ```
    """
    leaves, size = leaves_and_count(tree, axes, "tree")
    traced = is_tracer(indices)
    positions = indices if traced else np.asarray(indices)
    # An empty Python list becomes a float array; it selects nothing either way.
    empty = not traced and positions.size == 0
    # NumPy reads `[1, True]` as integers; a bool is refused wherever it is.
    has_bool = isinstance(indices, (list, tuple)) and any(map(is_bool, indices))
    if (
        positions.ndim != 1
        or not (jnp.issubdtype(positions.dtype, jnp.integer) or empty)
        or has_bool
    ):
        raise BatchError(
            f"`indices` is {describe(positions)}; it must be 1-d integers, no bools."
        )
    if not traced:
        # Checked in the indices' own dtype: casting first would wrap a uint64 above
        # int64's range to a negative index.
        bad = positions >= size
        if not jnp.issubdtype(positions.dtype, jnp.unsignedinteger):
            bad |= positions < -size
        if bad.any():
            raise BatchError(
                f"indices {positions[bad].tolist()} are out of range for {size} "
                f"members (valid: {-size} to {size - 1})."
            )
        positions = positions.astype(np.int64) % max(size, 1)
    out = [
        leaf if axis is None else _select(leaf, positions, axis)
        for _, leaf, axis in leaves
    ]
    return jtu.tree_unflatten(jtu.tree_structure(tree), out)
