"""Stacking and unstacking pytrees along a member axis: `stack`, `unstack` and friends.

Concrete arrays that live on the CPU are stacked and split through host NumPy (a view,
not a copy) and the results are created directly by XLA's transfer, with the abstract
value computed once per leaf. This runs no XLA program, so the first call is as fast as
later ones and the number of compilations does not grow with the number of members.
Tracers (inside `jax.jit`) use `jax.numpy`. Arrays on other platforms (GPU, TPU) are
split by one compiled indexing program per leaf shape and stacked by `jnp.stack`, so
that they never leave their device.
"""

import dataclasses
import functools as ft
import math
import operator
from collections.abc import Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax._src.lib import xla_client

from ._errors import BatchError, describe, KeyPath, leaf_name
from ._tree import (
    axis_sizes,
    common_size,
    is_array,
    is_key,
    mapped_leaves,
    resolve_axes,
)


Tree = TypeVar("Tree")

_SAME_STRUCTURE_FIX = (
    "stack and concat need members with the same structure: the same containers, "
    "keys, module types and static fields."
)


# ------------------------------------------------------------------------------------
# Leaf kinds.


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _is_numpy(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic))


def _on_cpu(x: jax.Array) -> bool:
    """Whether a concrete JAX array can go through host NumPy without a transfer."""
    return x.is_fully_addressable and all(
        device.platform == "cpu" for device in x.sharding.device_set
    )


def _is_weak(x: Any) -> bool:
    # Typed PRNG key arrays have no `weak_type` attribute; they are never weak.
    return getattr(x, "weak_type", False)


def _placement(x: jax.Array) -> Any:
    """Where results derived from `x` go: its device if committed to one, else None."""
    sharding = x.sharding
    if x.committed and isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


def _host(x: Any) -> np.ndarray:
    """The raw bits of a concrete leaf as NumPy (key data for typed PRNG keys)."""
    if isinstance(x, jax.Array) and is_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x)


# ------------------------------------------------------------------------------------
# Compiled per-leaf programs: cached by shape, dtype and axis, never by member count.


@ft.partial(jax.jit, static_argnums=2)
def _index_one(x: jax.Array, i: jax.Array, axis: int) -> jax.Array:
    return lax.dynamic_index_in_dim(x, i, axis, keepdims=False)


@ft.partial(jax.jit, static_argnums=2)
def _take_many(x: jax.Array, indices: jax.Array, axis: int) -> jax.Array:
    return jnp.take(x, indices, axis=axis, mode="clip")


def _to_device(pieces: list[np.ndarray], like: jax.Array, weak: bool) -> list[Any]:
    """New JAX arrays holding copies of `pieces`, placed and weak-typed like `like`.

    `jax.device_put` spends most of its time re-deriving the abstract value and
    sharding of every piece; all pieces of a leaf share them, so they are computed once
    and the pieces go straight to XLA's batched transfer. This is also the one way to
    create a weak-typed array without running an XLA program.
    """
    if not pieces:
        return []
    placement = _placement(like)
    committed = placement is not None
    if placement is None:
        # Uncommitted arrays stay where they are; pieces of an array sharded over
        # several devices go, uncommitted, to the default device like `jnp` results.
        devices = like.sharding.device_set
        device = next(iter(devices)) if len(devices) == 1 else jax.devices()[0]
        placement = jax.sharding.SingleDeviceSharding(device)
    device = next(iter(placement.device_set))
    aval = jax.core.ShapedArray(pieces[0].shape, pieces[0].dtype, weak_type=weak)
    put, devices = xla_client.batched_device_put, [device]
    out = [put(aval, placement, [piece], devices, committed) for piece in pieces]
    if is_key(like):
        impl = jax.random.key_impl(like)
        out = [jax.random.wrap_key_data(data, impl=impl) for data in out]
    return out


# ------------------------------------------------------------------------------------
# Equality of leaves that are kept once.


def _same_value(a: Any, b: Any) -> bool:
    """Same type and value; floats bit-for-bit (so -0.0 and NaN round-trip)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if is_array(a):
        if _is_tracer(a) or _is_tracer(b):
            return False
        if np.shape(a) != np.shape(b) or a.dtype != b.dtype:
            return False
        if _is_weak(a) != _is_weak(b):
            return False
        return _host(a).tobytes() == _host(b).tobytes()
    if isinstance(a, float):
        return (
            a == b
            and math.copysign(1, a) == math.copysign(1, b)
            or (math.isnan(a) and math.isnan(b))
        )
    try:
        equal = a == b
    except Exception:
        return False
    return isinstance(equal, (bool, np.bool_)) and bool(equal)


def _describe_leaf(x: Any) -> str:
    """`describe`, but functions by name: wrappers such as `jax.jit` hide it in repr."""
    name = getattr(x, "__qualname__", None) or getattr(x, "__name__", None)
    if callable(x) and not isinstance(x, type) and isinstance(name, str):
        return f"<function {name}>"
    return describe(x)


def _check_kept_once(column: list[Any], path: KeyPath, argname: str) -> None:
    """Raises unless every member holds the same non-stacked leaf."""
    first = column[0]
    for i, leaf in enumerate(column[1:], start=1):
        if _same_value(first, leaf):
            continue
        here = leaf_name(f"{argname}[{i}]", path)
        there = leaf_name(f"{argname}[0]", path)
        if is_array(first) or is_array(leaf):
            if (_is_tracer(first) or _is_tracer(leaf)) and type(first) is type(leaf):
                raise BatchError(
                    f"`{here}` has axis spec None (shared: kept once), but it is a "
                    f"traced array other than `{there}`, so it cannot be checked to be "
                    "equal. Give it a member axis to stack it, or pass the same array "
                    "object to every member."
                )
            what = f"is {describe(leaf)} but `{there}` is {describe(first)}"
            if describe(leaf) == describe(first) and type(leaf) is type(first):
                what = f"({describe(leaf)}) holds other values than `{there}`"
            raise BatchError(
                f"`{here}` {what}, "
                "and the leaf has axis spec None (shared: kept once), so it must be "
                "equal across members. Give it a member axis (e.g. "
                "`axes=eqx.if_array(0)`) to stack it, or make the members equal."
            )
        message = (
            f"`{here}` is {_describe_leaf(leaf)} ({type(leaf).__name__}) but "
            f"`{there}` is {_describe_leaf(first)} ({type(first).__name__}). "
            "Non-array leaves are kept once, so they must be equal (same type and "
            "value) across members."
        )
        if isinstance(first, (bool, int, float, complex)) and isinstance(
            leaf, (bool, int, float, complex)
        ):
            message += (
                " To let it differ per member, make it an array "
                "(`jnp.asarray(...)`) so that it is stacked."
            )
        elif callable(first):
            message += (
                " Two separately created functions (e.g. two lambdas) are different "
                "objects; create the function once and share it."
            )
        raise BatchError(message)


# ------------------------------------------------------------------------------------
# Structure.


def _node_summary(treedef: Any) -> str:
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return "a leaf"
    node_type, aux = treedef.node_data()
    if node_type is dict:
        return f"a dict with keys {list(aux)}"
    if node_type in (list, tuple):
        return f"a {node_type.__name__} of length {len(treedef.children())}"
    if node_type is type(None):
        return "None"
    return (
        f"a {node_type.__name__} with {len(treedef.children())} children and static "
        f"data {describe(aux)}"
    )


def _first_difference(a: Any, b: Any, path: KeyPath) -> tuple[KeyPath, str, str]:
    """The first path where `a` and `b` differ in structure, and the nodes there."""
    treedef_a = jtu.tree_structure(a)
    treedef_b = jtu.tree_structure(b)
    is_node_a = not (treedef_a.num_nodes == 1 and treedef_a.num_leaves == 1)
    is_node_b = not (treedef_b.num_nodes == 1 and treedef_b.num_leaves == 1)
    if (
        is_node_a
        and is_node_b
        and isinstance(a, eqx.Module)
        and treedef_a.node_data()[0] is treedef_b.node_data()[0]
    ):
        for field in dataclasses.fields(a):
            if field.metadata.get("static", False):
                value_a = getattr(a, field.name, None)
                value_b = getattr(b, field.name, None)
                if not _same_value(value_a, value_b):
                    return (
                        path + (jtu.GetAttrKey(field.name),),
                        f"static field {_describe_leaf(value_a)}",
                        f"static field {_describe_leaf(value_b)}",
                    )
    if (
        is_node_a
        and is_node_b
        and treedef_a.node_data() == treedef_b.node_data()
        and len(treedef_a.children()) == len(treedef_b.children())
    ):
        children_a = jtu.flatten_one_level_with_keys(a)[0]
        children_b = jtu.flatten_one_level_with_keys(b)[0]
        for (key, child_a), (_, child_b) in zip(children_a, children_b, strict=True):
            if jtu.tree_structure(child_a) != jtu.tree_structure(child_b):
                return _first_difference(child_a, child_b, path + (key,))
    return path, _node_summary(treedef_a), _node_summary(treedef_b)


def _flatten_members(trees: Sequence[Any], argname: str, verb: str) -> tuple[Any, list]:
    """Flattens every member, raising at the first that differs from `trees[0]`."""
    if len(trees) == 0:
        raise BatchError(f"`{argname}` is empty: {verb} needs at least one member.")
    treedef = jtu.tree_structure(trees[0])
    columns_by_member = []
    for i, tree in enumerate(trees):
        leaves, member_treedef = jtu.tree_flatten(tree)
        if member_treedef != treedef:
            path, first, other = _first_difference(trees[0], tree, ())
            raise BatchError(
                f"`{leaf_name(f'{argname}[{i}]', path)}` is {other} but "
                f"`{leaf_name(f'{argname}[0]', path)}` is {first}. "
                + _SAME_STRUCTURE_FIX
            )
        columns_by_member.append(leaves)
    return treedef, columns_by_member


# ------------------------------------------------------------------------------------
# Joining a column of leaves.


def _check_column(
    column: list[Any], path: KeyPath, argname: str, axis: int | None
) -> None:
    """Every member leaf is an array with the shape and dtype of member 0's.

    With `axis` given (concat), shapes may differ along that axis.
    """
    first = column[0]
    there = leaf_name(f"{argname}[0]", path)
    if not is_array(first):
        raise BatchError(
            f"`{there}` is {describe(first)}, not an array, but is asked to have a "
            "member axis. Make it an array, or give the leaf the axis spec None to "
            "keep it once."
        )
    for i, leaf in enumerate(column[1:], start=1):
        here = leaf_name(f"{argname}[{i}]", path)
        if not is_array(leaf):
            raise BatchError(
                f"`{here}` is {describe(leaf)}, not an array, but `{there}` is an "
                f"array ({describe(first)}) with a member axis. Make it an array, or "
                "give the leaf the axis spec None to keep it once."
            )
        if leaf.dtype != first.dtype:
            raise BatchError(
                f"`{here}` has dtype {leaf.dtype} but `{there}` has dtype "
                f"{first.dtype}. Cast the members to one dtype before stacking."
            )
        shape, first_shape = list(np.shape(leaf)), list(np.shape(first))
        if axis is not None and len(shape) == len(first_shape):
            shape[axis] = first_shape[axis] = -1
        if shape != first_shape:
            what = "shape" if axis is None else f"shape (apart from member axis {axis})"
            raise BatchError(
                f"`{here}` has shape {tuple(np.shape(leaf))} but `{there}` has shape "
                f"{tuple(np.shape(first))}; members need the same {what}."
            )


def _join(column: list[Any], axis: int, new_axis: bool) -> Any:
    """Stacks (`new_axis`) or concatenates `column` along `axis`."""
    np_join = np.stack if new_axis else np.concatenate
    jnp_join = jnp.stack if new_axis else jnp.concatenate
    if all(_is_numpy(leaf) for leaf in column):
        return np_join(column, axis=axis)
    if any(_is_tracer(leaf) for leaf in column):
        return jnp_join([jnp.asarray(leaf) for leaf in column], axis=axis)
    jax_leaves = [leaf for leaf in column if isinstance(leaf, jax.Array)]
    like = jax_leaves[0]
    weak = all(_is_weak(leaf) for leaf in jax_leaves) and len(jax_leaves) == len(column)
    if all(_on_cpu(leaf) for leaf in jax_leaves):
        host = np_join([_host(leaf) for leaf in column], axis=axis)
        return _to_device([host], like, weak)[0]
    return jnp_join([jnp.asarray(leaf) for leaf in column], axis=axis)


def _join_members(
    trees: Sequence[Any], axes: Any, argname: str, verb: str, new_axis: bool
) -> Any:
    treedef, by_member = _flatten_members(trees, argname, verb)
    if new_axis:
        resolved = resolve_axes(trees[0], axes, f"{argname}[0]")
        axis_leaves = treedef.flatten_up_to(resolved)
    else:
        # Every tree's own mapped leaves must agree on its member count; `_sizes` also
        # checks member 0's axes against its leaves and makes them non-negative.
        mapped, _ = _sizes(trees[0], axes, f"{argname}[0]")
        axis_leaves = [axis for _, _, axis in mapped]
        for i, tree in enumerate(trees[1:], start=1):
            _sizes(tree, axes, f"{argname}[{i}]")
    paths = [path for path, _ in jtu.tree_flatten_with_path(trees[0])[0]]
    out = []
    for j, (path, axis) in enumerate(zip(paths, axis_leaves, strict=True)):
        column = [leaves[j] for leaves in by_member]
        if axis is None:
            _check_kept_once(column, path, argname)
            out.append(column[0])
            continue
        first = column[0]
        if new_axis and is_array(first):
            # The new axis counts among the stacked leaf's axes. A non-array member 0
            # is reported by `_check_column`.
            ndim = np.ndim(first) + 1
            if not -ndim <= axis < ndim:
                raise BatchError(
                    f"member axis {axis} is out of range for "
                    f"`{leaf_name(f'{argname}[0]', path)}`, which has {ndim} axes "
                    f"after {verb}."
                )
            axis %= ndim
        _check_column(column, path, argname, None if new_axis else axis)
        out.append(_join(column, axis, new_axis))
    return jtu.tree_unflatten(treedef, out)


# ------------------------------------------------------------------------------------
# Splitting a leaf.


def _sizes(tree: Any, axes: Any, argname: str) -> tuple[list, int]:
    """`mapped_leaves` of `tree` and the common member-axis size."""
    leaves = mapped_leaves(tree, axes, argname)
    size = common_size(
        axis_sizes(leaves, argname),
        fix="Every mapped array leaf needs the same member-axis size; give leaves that "
        "are not per-member the axis spec None.",
    )
    return leaves, size


def _split(leaf: Any, axis: int, size: int) -> list[Any]:
    """`leaf` cut into `size` pieces along `axis`, each without that axis."""
    if _is_numpy(leaf):
        # `np.array` keeps 0-d pieces ndarrays (iteration would give NumPy scalars).
        return [np.array(piece) for piece in np.moveaxis(leaf, axis, 0)]
    if _is_tracer(leaf):
        return [lax.index_in_dim(leaf, i, axis, keepdims=False) for i in range(size)]
    if _on_cpu(leaf):
        pieces = list(np.moveaxis(_host(leaf), axis, 0))
        return _to_device(pieces, leaf, _is_weak(leaf))
    return [_index_one(leaf, i, axis) for i in range(size)]


def _select(leaf: Any, where: Any, axis: int) -> Any:
    """`leaf` indexed along `axis` by an integer (dropping the axis) or a 1-d array."""
    concrete = not _is_tracer(leaf) and not _is_tracer(where)
    if concrete and _is_numpy(leaf):
        # `np.array` keeps a 0-d result an ndarray rather than a NumPy scalar.
        return np.array(np.take(leaf, where, axis=axis))
    if concrete and _on_cpu(leaf):
        picked = np.asarray(np.take(_host(leaf), where, axis=axis))
        return _to_device([picked], leaf, _is_weak(leaf))[0]
    if np.ndim(where) == 0:
        return _index_one(jnp.asarray(leaf), where, axis)
    return _take_many(jnp.asarray(leaf), jnp.asarray(where), axis)


def _check_index(i: Any, size: int, argname: str) -> int:
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


# ------------------------------------------------------------------------------------
# Public API.


def stack(trees: Sequence[Tree], *, axes: Any = eqx.if_array(0)) -> Tree:
    """Stacks a sequence of pytrees into one pytree with a member axis.

    Ensembles, populations and Markov chains are most efficient as one pytree whose
    arrays carry a leading member axis, so that `jax.vmap` and `jax.lax.scan` can map
    over it. `stack` builds that pytree from separately created members, and checks that
    they really are alike: any leaf that is kept once (a Python scalar, an activation
    function, a static field, a leaf with axis spec `None`) must be equal across
    members, rather than silently taking member 0's.

    **Arguments:**

    - `trees`: a non-empty sequence of pytrees with the same structure (Equinox
        modules, dicts, lists, tuples, NamedTuples, nested).
    - `axes`: an axis spec, a pytree prefix of `trees[0]` of `None`, ints and callables
        such as `eqx.if_array(0)` (the default). An int is where the new member axis
        goes in the stacked leaf; `None` marks a leaf that is shared, kept once.

    **Returns:**

    One pytree of the same structure. Mapped array leaves are stacked along their member
    axis (NumPy leaves stay NumPy, JAX arrays stay JAX arrays on the same device, typed
    PRNG keys stay typed keys); every other leaf is member 0's.

    **Raises:**

    `BatchError` if `trees` is empty; if the members differ in structure (naming the
    first differing path); if a mapped leaf is not an array or differs in shape or dtype
    across members; or if a leaf kept once differs across members (same type and value
    are needed: two separately created lambdas are different objects).

    !!! Example

        ```python
        members = [eqx.nn.Linear(2, 3, key=k) for k in jr.split(jr.key(0), 4)]
        stacked = eb.stack(members)
        stacked.weight.shape  # (4, 3, 2)
        ```
    """
    return _join_members(list(trees), axes, "trees", "stack", new_axis=True)


def unstack(tree: Tree, *, axes: Any = eqx.if_array(0)) -> list[Tree]:
    """Splits a stacked pytree into a list of members: the inverse of `stack`.

    `jax.vmap`, `jax.pmap` and `eqx.filter_vmap` return one pytree whose arrays carry a
    member axis; to inspect, edit or save a single member you want a list of ordinary
    pytrees instead. `unstack(stack(trees))` equals `trees` and `stack(unstack(tree))`
    equals `tree`, bit for bit.

    **Arguments:**

    - `tree`: a stacked pytree.
    - `axes`: an axis spec, as for `stack`. Leaves with axis spec `None` are given to
        every member as they are.

    **Returns:**

    A `list` with one pytree per member. NumPy leaves give NumPy arrays (0-d arrays,
    not NumPy scalars, where the member leaf is 0-d); JAX arrays give JAX arrays on the
    same device.

    **Raises:**

    `BatchError` if mapped array leaves disagree on the member-axis size (every
    offending leaf is listed), if a mapped leaf is 0-d or not an array, or if no leaf is
    mapped (the number of members is undefined).

    !!! Example

        ```python
        stacked = {"w": jnp.zeros((3, 2)), "name": "layer"}
        members = eb.unstack(stacked)
        members[0]["w"].shape  # (2,)
        ```
    """
    leaves, size = _sizes(tree, axes, "tree")
    treedef = jtu.tree_structure(tree)
    columns = [
        [leaf] * size if axis is None else _split(leaf, axis, size)
        for _, leaf, axis in leaves
    ]
    return [treedef.unflatten(member) for member in zip(*columns, strict=True)]


def batch_size(tree: Any, *, axes: Any = eqx.if_array(0)) -> int:
    """The number of members of a stacked pytree: the common member-axis size.

    Stacked pytrees have no field recording their size; this reads it off the mapped
    leaves and checks that they all agree.

    **Arguments:**

    - `tree`: a stacked pytree.
    - `axes`: an axis spec, as for `stack`.

    **Returns:**

    The member-axis size shared by every mapped array leaf, as an `int`.

    **Raises:**

    `BatchError` if mapped array leaves disagree on the size (every offending leaf is
    listed), if a mapped leaf is 0-d or not an array, or if no leaf is mapped.

    !!! Example

        ```python
        eb.batch_size({"w": jnp.zeros((5, 2)), "b": jnp.zeros(5)})  # 5
        ```
    """
    return _sizes(tree, axes, "tree")[1]


def index(tree: Tree, i: int, *, axes: Any = eqx.if_array(0)) -> Tree:
    """Member `i` of a stacked pytree.

    Like `unstack(tree)[i]`, without building the other members. Indexing every member
    in a loop compiles nothing for CPU arrays, and at most one program per leaf shape
    elsewhere, never one per index (as `tree.weight[i]` can).

    **Arguments:**

    - `tree`: a stacked pytree.
    - `i`: the member, an integer; negative values count from the end. A traced `i`
        (inside `jax.jit`) cannot be checked and is clamped into range.
    - `axes`: an axis spec, as for `stack`.

    **Returns:**

    One member, a pytree of the same structure with the member axis removed from every
    mapped leaf.

    **Raises:**

    `BatchError` if `i` is not an integer or is out of range, or for the reasons
    `batch_size` raises.

    !!! Example

        ```python
        stacked = {"w": jnp.arange(6.0).reshape(3, 2)}
        eb.index(stacked, -1)["w"]  # [4., 5.]
        ```
    """
    leaves, size = _sizes(tree, axes, "tree")
    if not _is_tracer(i):
        i = _check_index(i, size, "i")
    out = [leaf if axis is None else _select(leaf, i, axis) for _, leaf, axis in leaves]
    return jtu.tree_unflatten(jtu.tree_structure(tree), out)


def take(tree: Tree, indices: Any, *, axes: Any = eqx.if_array(0)) -> Tree:
    """A stacked pytree of the members at `indices`.

    Selects a subset (or a reordering, or repeats) of an ensemble or population while
    keeping it stacked, e.g. the best members after an evaluation.

    **Arguments:**

    - `tree`: a stacked pytree.
    - `indices`: a 1-d sequence or array of integers; negative values count from the
        end. Traced indices (inside `jax.jit`) cannot be checked and are clamped into
        range.
    - `axes`: an axis spec, as for `stack`.

    **Returns:**

    A stacked pytree with `len(indices)` members. NumPy leaves stay NumPy.

    **Raises:**

    `BatchError` if `indices` is not a 1-d array of integers, if an index is out of
    range, or for the reasons `batch_size` raises.

    !!! Example

        ```python
        stacked = {"w": jnp.arange(4.0)}
        eb.take(stacked, [3, 0])["w"]  # [3., 0.]
        ```
    """
    leaves, size = _sizes(tree, axes, "tree")
    traced = _is_tracer(indices)
    positions = indices if traced else np.asarray(indices)
    # An empty Python list becomes a float array; it selects nothing either way.
    empty = not traced and positions.size == 0
    if positions.ndim != 1 or not (
        jnp.issubdtype(positions.dtype, jnp.integer) or empty
    ):
        raise BatchError(
            f"`indices` is {describe(positions)}; it must be a 1-d sequence or array "
            "of integers (use `eb.index` for a single member)."
        )
    if not traced:
        positions = positions.astype(np.int64)
        bad = (positions < -size) | (positions >= size)
        if bad.any():
            raise BatchError(
                f"indices {positions[bad].tolist()} are out of range for {size} "
                f"members (valid: {-size} to {size - 1})."
            )
        positions = positions % max(size, 1)
    out = [
        leaf if axis is None else _select(leaf, positions, axis)
        for _, leaf, axis in leaves
    ]
    return jtu.tree_unflatten(jtu.tree_structure(tree), out)


def concat(trees: Sequence[Tree], *, axes: Any = eqx.if_array(0)) -> Tree:
    """Joins stacked pytrees along their member axis.

    Combines populations or ensembles built separately (e.g. on different hosts, or in
    chunks) into one stacked pytree, with the same checks as `stack`.

    **Arguments:**

    - `trees`: a non-empty sequence of stacked pytrees with the same structure.
    - `axes`: an axis spec, as for `stack`, here naming the existing member axis.

    **Returns:**

    One stacked pytree whose member count is the sum of the inputs'.

    **Raises:**

    `BatchError` if `trees` is empty; if the trees differ in structure; if a tree's own
    mapped leaves disagree on its member count; if a mapped leaf differs in dtype, or in
    shape other than along the member axis; or if a leaf kept once differs.

    !!! Example

        ```python
        a = {"w": jnp.zeros((2, 3))}
        b = {"w": jnp.ones((5, 3))}
        eb.concat([a, b])["w"].shape  # (7, 3)
        ```
    """
    return _join_members(list(trees), axes, "trees", "concat", new_axis=False)
