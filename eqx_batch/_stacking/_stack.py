"""Stacking and unstacking pytrees along a member axis: `stack`, `unstack`,
`batch_size` and `concat`. Selecting members by position (`index`, `take`) is in
`_select.py`, above this module.

Concrete arrays that live on the CPU are stacked and split through host NumPy (a view,
not a copy), and the results become JAX arrays through `_from_host.py`. Tracers (inside
`jax.jit`) use `jax.numpy`. Arrays on other platforms (GPU, TPU) are split by one
compiled indexing program per leaf shape and stacked by `jnp.stack`, so that they never
leave their device. Why members cannot be stacked is diagnosed in
`_member_mismatch.py`.

A grid (`ndim` member axes) goes through the same machinery as one member axis of all
its members, row by row: `unstack` merges the member axes with a reshape and splits
once, `stack` stacks along one new axis and reshapes it into the grid's axes.
"""

import functools as ft
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal, overload, TypeVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, check_int, KeyPath, leaf_name
from .._tree import (
    axis_sizes,
    common_size,
    host_array,
    is_array,
    is_numpy,
    is_tracer,
    is_weak,
    mapped_leaves,
    resolve_axes,
)
from ._from_host import (
    key_impl,
    on_cpu,
    Placement,
    placement_of,
    put_like,
    rows_as_arrays,
)
from ._member_mismatch import (
    check_kept_once,
    check_mapped_column,
    flatten_members,
    grid_members,
    MemberGrid,
    members_of,
)


Tree = TypeVar("Tree")

_NDIM_HINT = (
    "It is the number of member axes: 1 for a sequence of members, 2 for a grid of "
    "rows of members."
)


@ft.partial(jax.jit, static_argnums=2)
def index_leaf(x: jax.Array, i: jax.Array, axis: int) -> jax.Array:
    """Member `i` of `x` along `axis`: one compiled program per shape, not per index.

    A negative `i` counts from the end once, as it does eagerly; what is then still
    out of range (a traced `i`, which cannot be checked) is clamped into range, as
    `jnp.take(..., mode="clip")` does.
    """
    size = x.shape[axis]
    # Clamped here: `dynamic_index_in_dim` would wrap a still-negative index again.
    i = jnp.clip(jnp.where(i < 0, i + size, i), 0, size - 1)
    return lax.dynamic_index_in_dim(x, i, axis, keepdims=False)


def _join(column: list[Any], axis: int, new_axis: bool) -> Any:
    """Stacks (`new_axis`) or concatenates `column` along `axis`."""
    np_join = np.stack if new_axis else np.concatenate
    jnp_join = jnp.stack if new_axis else jnp.concatenate
    if all(is_numpy(leaf) for leaf in column):
        return np_join(column, axis=axis)
    # `check_mapped_column` has made sure that the weak types agree, so `put_like`
    # makes the result weak like member 0's leaf.
    jax_leaves = [leaf for leaf in column if isinstance(leaf, jax.Array)]
    if not any(is_tracer(leaf) for leaf in column) and all(
        on_cpu(leaf) for leaf in jax_leaves
    ):
        host = np_join([host_array(leaf) for leaf in column], axis=axis)
        return put_like(host, jax_leaves[0])
    return jnp_join([jnp.asarray(leaf) for leaf in column], axis=axis)


def _join_members(
    trees: Sequence[Any], axes: Any, member_grid: MemberGrid, verb: str, new_axis: bool
) -> Any:
    """Stacks (`new_axis`) or concatenates the members `trees`, in `member_grid` order.

    Stacking a grid stacks its members along one new axis, then splits that axis
    into the grid's axes.
    """
    treedef, by_member = flatten_members(trees, member_grid, verb)
    if new_axis:
        resolved = resolve_axes(trees[0], axes, member_grid.member(0))
        axis_leaves = treedef.flatten_up_to(resolved)
    else:
        # Every tree's own mapped leaves must agree on its member count;
        # `leaves_and_count` also checks member 0's axes against its leaves and makes
        # them non-negative.
        mapped, _ = leaves_and_count(trees[0], axes, member_grid.member(0))
        axis_leaves = [axis for _, _, axis in mapped]
        for i, tree in enumerate(trees[1:], start=1):
            leaves_and_count(tree, axes, member_grid.member(i))
    paths = [path for path, _ in jtu.tree_flatten_with_path(trees[0])[0]]
    grid_ndim = len(member_grid.shape)
    out = []
    for j, (path, axis) in enumerate(zip(paths, axis_leaves, strict=True)):
        column = [leaves[j] for leaves in by_member]
        if axis is None:
            check_kept_once(column, path, member_grid)
            out.append(column[0])
            continue
        first = column[0]
        if new_axis and is_array(first):
            # The new axes count among the stacked leaf's axes, and the spec names
            # the first of them. `check_mapped_column` reports a non-array member 0.
            ndim = np.ndim(first) + grid_ndim
            if not -ndim <= axis < ndim or axis % ndim > np.ndim(first):
                axes_named = (
                    f"member axis {axis}"
                    if grid_ndim == 1
                    else f"member axes starting at {axis} ({grid_ndim} of them)"
                )
                raise BatchError(
                    f"{axes_named} is out of range for "
                    f"`{leaf_name(member_grid.member(0), path)}`, which has {ndim} "
                    f"axes after {verb}."
                )
            axis %= ndim
        check_mapped_column(column, path, member_grid, None if new_axis else axis)
        joined = _join(column, axis, new_axis)
        out.append(
            _split_axis(joined, axis, member_grid.shape) if grid_ndim > 1 else joined
        )
    return jtu.tree_unflatten(treedef, out)


def _reshape(leaf: Any, shape: tuple[int, ...]) -> Any:
    """`leaf` reshaped, NumPy staying NumPy; JAX keeps weak types and typed keys."""
    return np.reshape(leaf, shape) if is_numpy(leaf) else jnp.reshape(leaf, shape)


def _split_axis(leaf: Any, axis: int, grid: tuple[int, ...]) -> Any:
    """`leaf` with its axis `axis` (of size `prod(grid)`) split into `grid`'s axes."""
    shape = np.shape(leaf)
    return _reshape(leaf, shape[:axis] + grid + shape[axis + 1 :])


def _merge_axes(leaf: Any, axis: int, ndim: int) -> Any:
    """`leaf` with its `ndim` axes from `axis` on merged into one, row by row."""
    shape = np.shape(leaf)
    merged = math.prod(shape[axis : axis + ndim])
    return _reshape(leaf, shape[:axis] + (merged,) + shape[axis + ndim :])


# ------------------------------------------------------------------------------------
# Splitting a leaf.


def leaves_and_count(tree: Any, axes: Any, argname: str) -> tuple[list, int]:
    """`mapped_leaves` of `tree` and the common member-axis size.

    Raises `BatchError` if the mapped leaves disagree on it, naming each.
    """
    leaves = mapped_leaves(tree, axes, argname)
    size = common_size(
        axis_sizes(leaves, argname),
        fix="Every mapped array leaf needs the same member-axis size; give leaves that "
        "are not per-member the axis spec None.",
    )
    return leaves, size


def _leaves_and_grid(
    tree: Any, axes: Any, ndim: int, argname: str
) -> tuple[list[tuple[KeyPath, Any, int | None]], tuple[int, ...]]:
    """`mapped_leaves` of `tree` and the common sizes of its `ndim` member axes.

    A mapped leaf's member axes are the `ndim` consecutive axes starting at the one
    its spec names.
    """
    if ndim == 1:
        leaves, size = leaves_and_count(tree, axes, argname)
        return leaves, (size,)
    leaves = mapped_leaves(tree, axes, argname)
    for path, leaf, axis in leaves:
        if axis is not None and axis + ndim > np.ndim(leaf):
            raise BatchError(
                f"`{leaf_name(argname, path)}` has shape {tuple(np.shape(leaf))}, "
                f"too few axes for `ndim={ndim}` member axes from axis {axis}: "
                "give it axis spec None."
            )
    grid = tuple(
        common_size(
            [
                (leaf_name(argname, path), np.shape(leaf)[axis + k])
                for path, leaf, axis in leaves
                if axis is not None
            ],
            what=f"member axis {k} of {ndim}",
            fix="Every mapped array leaf needs the same sizes along its member axes; "
            "give leaves that are not per-member the axis spec None.",
        )
        for k in range(ndim)
    )
    return leaves, grid


def _split_leaves(
    leaves: list[tuple[KeyPath, Any, int | None]], size: int
) -> list[list[Any]]:
    """For each `(path, leaf, axis)` of `mapped_leaves`, its `size` member pieces.

    A leaf with axis None is given to every member as it is.
    """
    columns: list[list[Any]] = []
    # CPU leaves, by where their pieces go: their member rows (host views) and
    # their positions in `columns`, split together by `rows_as_arrays`.
    by_placement: dict[Placement, list[tuple[int, np.ndarray, Any]]] = {}
    for _, leaf, axis in leaves:
        if axis is None:
            columns.append([leaf] * size)
        elif is_numpy(leaf):
            # `np.array` keeps 0-d pieces ndarrays (iteration gives NumPy scalars).
            columns.append([np.array(piece) for piece in np.moveaxis(leaf, axis, 0)])
        elif is_tracer(leaf):
            pieces = [
                lax.index_in_dim(leaf, i, axis, keepdims=False) for i in range(size)
            ]
            columns.append(pieces)
        elif on_cpu(leaf) and is_weak(leaf):
            # Rare (stacked Python scalars), so one program call per piece.
            rows = np.moveaxis(host_array(leaf), axis, 0)
            columns.append([put_like(np.asarray(row), leaf) for row in rows])
        elif on_cpu(leaf):
            rows = np.moveaxis(host_array(leaf), axis, 0)
            group = by_placement.setdefault(placement_of(leaf), [])
            group.append((len(columns), rows, key_impl(leaf)))
            columns.append([])
        else:
            columns.append([index_leaf(leaf, i, axis) for i in range(size)])
    for placement, group in by_placement.items():
        positions, hosts, key_impls = zip(*group, strict=True)
        split = rows_as_arrays(list(hosts), key_impls, placement)
        for position, pieces in zip(positions, split, strict=True):
            columns[position] = pieces
    return columns


# ------------------------------------------------------------------------------------
# Public API.


@overload
def stack(
    trees: Sequence[Tree] | Iterator[Tree],
    *,
    axes: Any = eqx.if_array(0),
    ndim: Literal[1] = 1,
) -> Tree: ...


@overload
def stack(
    trees: Sequence[Sequence[Tree]] | Iterator[Sequence[Tree]],
    *,
    axes: Any = eqx.if_array(0),
    ndim: Literal[2],
) -> Tree: ...


@overload
def stack(trees: Any, *, axes: Any = eqx.if_array(0), ndim: int) -> Any: ...


def stack(trees: Any, *, axes: Any = eqx.if_array(0), ndim: int = 1) -> Any:
    """Stacks a sequence of pytrees into one pytree with a member axis.

    Ensembles, populations and Markov chains are most efficient as one pytree whose
    arrays carry a leading member axis, so that `jax.vmap` and `jax.lax.scan` can map
    over it. `stack` builds that pytree from separately created members, and checks that
    they really are alike: any leaf that is kept once (a Python scalar, an activation
    function, a static field, a leaf with axis spec `None`) must be equal across
    members, rather than silently taking member 0's.

    **Arguments:**

    - `trees`: a non-empty sequence (a list, a tuple, or an iterator) of members:
        pytrees with the same structure (Equinox modules, dicts, lists, tuples,
        NamedTuples, nested). One member on its own (a dict, a module, a NamedTuple,
        an array) is refused rather than read as a sequence of its keys or fields.
    - `axes`: an axis spec, a pytree prefix of `trees[0]` of `None`, ints and callables
        such as `eqx.if_array(0)` (the default). An int is where the new member axis
        goes in the stacked leaf; `None` marks a leaf that is shared, kept once. With
        `ndim > 1` the int is where the first of the new member axes goes; the others
        follow it.
    - `ndim`: the number of member axes (default 1). With `ndim=2`, `trees` is a
        grid: a sequence of `m` rows, each a sequence of `n` members, and mapped leaves
        gain two member axes of sizes `(m, n)`; `ndim=3` nests once more, and so on.

    **Returns:**

    One pytree of the same structure. Mapped array leaves are stacked along their member
    axes (NumPy leaves stay NumPy, JAX arrays stay JAX arrays on the same device, typed
    PRNG keys stay typed keys); every other leaf is member 0's. A stacked leaf is
    weakly typed (as `jnp.asarray(1.0)` is) when every member's is, so that `unstack`
    gives back exactly what was stacked.

    **Raises:**

    `BatchError` if `ndim` is not an int of at least 1 (a bool is refused); if `trees`
    is not a sequence of members (with `ndim > 1`: of rows, each a sequence of members),
    or is empty; if the rows of a grid differ in length (naming the row); if the members
    differ in structure (naming the first differing path); if a mapped leaf is not an
    array, or differs in shape, dtype or weak type across members (a weakly typed leaf
    in one member and a strongly typed one in another cannot both survive a round trip,
    so the mix is refused); or if a leaf kept once differs across members (same type and
    value are needed: two separately created lambdas are different objects).

    !!! Example

        ```python
        members = [eqx.nn.Linear(2, 3, key=k) for k in jr.split(jr.key(0), 4)]
        stacked = eb.stack(members)
        stacked.weight.shape  # (4, 3, 2)

        grid = [[eqx.nn.Linear(2, 3, key=k) for k in jr.split(row, 5)]
                for row in jr.split(jr.key(1), 4)]
        eb.stack(grid, ndim=2).weight.shape  # (4, 5, 3, 2)
        ```
    """
    ndim = check_int(ndim, "ndim", minimum=1, hint=_NDIM_HINT)
    members, grid = grid_members(members_of(trees, "stack"), ndim, "trees")
    member_grid = MemberGrid("trees", grid)
    return _join_members(members, axes, member_grid, "stack", new_axis=True)


@overload
def unstack(
    tree: Tree, *, axes: Any = eqx.if_array(0), ndim: Literal[1] = 1
) -> list[Tree]: ...


@overload
def unstack(
    tree: Tree, *, axes: Any = eqx.if_array(0), ndim: Literal[2]
) -> list[list[Tree]]: ...


@overload
def unstack(tree: Any, *, axes: Any = eqx.if_array(0), ndim: int) -> list[Any]: ...


def unstack(tree: Any, *, axes: Any = eqx.if_array(0), ndim: int = 1) -> list[Any]:
    """Splits a stacked pytree into a list of members: the inverse of `stack`.

    `jax.vmap`, `jax.pmap` and `eqx.filter_vmap` return one pytree whose arrays carry a
    member axis; to inspect, edit or save a single member you want a list of ordinary
    pytrees instead. `unstack(stack(trees))` equals `trees` and `stack(unstack(tree))`
    equals `tree`, bit for bit.

    **Arguments:**

    - `tree`: a stacked pytree.
    - `axes`: an axis spec, as for `stack`. Leaves with axis spec `None` are given to
        every member as they are. With `ndim > 1` an int names the first member axis;
        the others follow it.
    - `ndim`: the number of member axes (default 1). With `ndim=2`, a grid built by
        two nested `eqx.filter_vmap`s (or `stack(..., ndim=2)`) splits into rows of
        members.

    **Returns:**

    A `list` with one pytree per member; with `ndim=2`, a list of `m` lists of `n`
    members (nested once more per extra axis). NumPy leaves give NumPy arrays (0-d
    arrays, not NumPy scalars, where the member leaf is 0-d); JAX arrays give JAX arrays
    on the same device.

    **Raises:**

    `BatchError` if `ndim` is not an int of at least 1 (a bool is refused); if mapped
    array leaves disagree on the size of a member axis (every offending leaf is listed);
    if a mapped leaf is not an array or has fewer axes than its member axes need (a 0-d
    leaf, or one with fewer than `ndim` axes from its member axis on); or if no leaf is
    mapped (the number of members is undefined).

    !!! Example

        ```python
        stacked = {"w": jnp.zeros((3, 2)), "name": "layer"}
        members = eb.unstack(stacked)
        members[0]["w"].shape  # (2,)

        grid = {"w": jnp.zeros((4, 3, 2))}
        rows = eb.unstack(grid, ndim=2)  # 4 lists of 3 members
        rows[3][2]["w"].shape  # (2,)
        ```
    """
    ndim = check_int(ndim, "ndim", minimum=1, hint=_NDIM_HINT)
    leaves, grid = _leaves_and_grid(tree, axes, ndim, "tree")
    if ndim > 1:
        # Split once along the merged member axes, then regroup into rows.
        leaves = [
            (path, leaf if axis is None else _merge_axes(leaf, axis, ndim), axis)
            for path, leaf, axis in leaves
        ]
    treedef = jtu.tree_structure(tree)
    columns = _split_leaves(leaves, math.prod(grid))
    members = [treedef.unflatten(member) for member in zip(*columns, strict=True)]
    return _rows(members, grid)


def _rows(members: list[Any], grid: tuple[int, ...]) -> list[Any]:
    """`members` (row by row) nested into lists of `grid`'s shape."""
    if len(grid) == 1:
        return members
    step = math.prod(grid[1:])
    return [_rows(members[r * step : (r + 1) * step], grid[1:]) for r in range(grid[0])]


@overload
def batch_size(
    tree: Any, *, axes: Any = eqx.if_array(0), ndim: Literal[1] = 1
) -> int: ...


@overload
def batch_size(
    tree: Any, *, axes: Any = eqx.if_array(0), ndim: int
) -> tuple[int, ...]: ...


def batch_size(
    tree: Any, *, axes: Any = eqx.if_array(0), ndim: int = 1
) -> int | tuple[int, ...]:
    """The number of members of a stacked pytree: the common member-axis size.

    Stacked pytrees have no field recording their size; this reads it off the mapped
    leaves and checks that they all agree.

    **Arguments:**

    - `tree`: a stacked pytree.
    - `axes`: an axis spec, as for `stack`.
    - `ndim`: the number of member axes (default 1), as for `unstack`.

    **Returns:**

    The member-axis size shared by every mapped array leaf, as an `int`; with
    `ndim > 1`, the tuple of sizes of the member axes (`(m, n)` for a grid).

    **Raises:**

    `BatchError` for the reasons `unstack` raises.

    !!! Example

        ```python
        eb.batch_size({"w": jnp.zeros((5, 2)), "b": jnp.zeros(5)})  # 5
        eb.batch_size({"w": jnp.zeros((4, 5, 2))}, ndim=2)  # (4, 5)
        ```
    """
    ndim = check_int(ndim, "ndim", minimum=1, hint=_NDIM_HINT)
    grid = _leaves_and_grid(tree, axes, ndim, "tree")[1]
    return grid[0] if ndim == 1 else grid


def concat(
    trees: Sequence[Tree] | Iterator[Tree], *, axes: Any = eqx.if_array(0)
) -> Tree:
    """Joins stacked pytrees along their member axis.

    Combines populations or ensembles built separately (e.g. on different hosts, or in
    chunks) into one stacked pytree, with the same checks as `stack`.

    **Arguments:**

    - `trees`: a non-empty sequence of stacked pytrees with the same structure (one
        stacked pytree on its own is refused, as by `stack`).
    - `axes`: an axis spec, as for `stack`, here naming the existing member axis.

    **Returns:**

    One stacked pytree whose member count is the sum of the inputs'.

    **Raises:**

    `BatchError` if `trees` is not a sequence of stacked pytrees, or is empty; if the
    trees differ in structure; if a tree's own mapped leaves disagree on its member
    count; if a mapped leaf differs in dtype or weak type, or in shape other than along
    the member axis; or if a leaf kept once differs.

    !!! Example

        ```python
        a = {"w": jnp.zeros((2, 3))}
        b = {"w": jnp.ones((5, 3))}
        eb.concat([a, b])["w"].shape  # (7, 3)
        ```
    """
    members = members_of(trees, "concat")
    member_grid = MemberGrid("trees", (len(members),))
    return _join_members(members, axes, member_grid, "concat", new_axis=False)
