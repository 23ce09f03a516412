"""Leaf predicates, axis-spec resolution and member-axis bookkeeping shared by
everything above.

What kind of leaf a value is (array, tracer, NumPy, weakly typed, typed PRNG key), its
raw bits on the host, its shape-dtype struct, and the codec between typed PRNG keys and
their raw key data are here, so that no module spells them again.

An *axis spec* is Equinox's vocabulary: a pytree prefix of `None` (not mapped / shared),
an `int` (the member axis of that leaf), or a callable such as `eqx.if_array(0)` that is
called on each leaf and returns one of those.
"""

import functools as ft
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from ._errors import BatchError, bullet_list, describe, KeyPath, leaf_name


def is_array(x: Any) -> bool:
    """Whether `x` is an array leaf (a JAX array, tracer, or NumPy array/scalar)."""
    return eqx.is_array(x)


def is_key(x: Any) -> bool:
    """Whether `x`, an array or `jax.ShapeDtypeStruct`, holds typed PRNG keys."""
    # A key's dtype is JAX's own kind, never a NumPy dtype: most leaves are told
    # apart at once, without `jnp.issubdtype`, which costs microseconds per leaf.
    dtype = x.dtype
    return not isinstance(dtype, np.dtype) and jnp.issubdtype(
        dtype, jax.dtypes.prng_key
    )


class LazyArray:
    """An array on the host whose values are read when asked for, such as the leaves
    of a `trace="disk"` trace (`eb.DiskArray`).

    It has a `shape` and a NumPy `dtype`, and indexing it with ints and slices
    (`x[3, 10:20]`, `x[...]`) reads only that part, as a NumPy array. `eb.save`
    stores its values a bounded part at a time, so a leaf larger than memory can be
    saved; `eb.load` into one gives a NumPy array.
    """

    shape: tuple[int, ...]
    dtype: np.dtype

    def __getitem__(self, key: Any) -> np.ndarray:
        raise NotImplementedError

    def replaced_by(self, path: Any) -> tuple[Any, str] | None:
        """The file it reads that writing `path` would replace, and what that file
        holds; None if none (`eb.save` refuses such a `path`)."""
        return None


def is_lazy_array(x: Any) -> bool:
    """Whether `x` is a `LazyArray`: an array on the host read when indexed."""
    return isinstance(x, LazyArray)


def is_tracer(x: Any) -> bool:
    """Whether `x` is a tracer (a value inside `jax.jit`, `jax.vmap` and friends)."""
    return isinstance(x, jax.core.Tracer)


def is_numpy(x: Any) -> bool:
    """Whether `x` is a NumPy array or scalar."""
    return isinstance(x, (np.ndarray, np.generic))


_Tree = TypeVar("_Tree")


def owned(tree: _Tree) -> _Tree:
    """`tree` with each NumPy array leaf copied, for a computation that may outlive
    the call: on the CPU, JAX may alias a NumPy argument's memory rather than copy
    it, so a caller's write into the array after the call returns would reach a
    computation still in flight. The tree itself is returned if it holds none."""
    leaves, treedef = jtu.tree_flatten(tree)
    if not any(isinstance(x, np.ndarray) for x in leaves):
        return tree
    copies = [
        np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in leaves
    ]
    return jtu.tree_unflatten(treedef, copies)


def is_weak(x: Any) -> bool:
    """Whether `x` is a weakly typed array (as `jnp.asarray(1.0)` is)."""
    # Typed PRNG key arrays have no `weak_type` attribute; they are never weak.
    return bool(getattr(x, "weak_type", False))


def host_array(x: Any) -> np.ndarray:
    """The raw bits of a concrete leaf as NumPy (key data for typed PRNG keys)."""
    if isinstance(x, jax.Array) and is_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x)


def as_key_data(tree: Any) -> Any:
    """`tree` with its typed PRNG keys (arrays or `ShapeDtypeStruct`s) as raw data."""

    def raw(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) and is_key(x):
            return jax.eval_shape(jr.key_data, x)
        if isinstance(x, jax.Array) and is_key(x):
            return jr.key_data(x)
        return x

    return jtu.tree_map(raw, tree)


def as_keys_like(tree: Any, like: Any) -> Any:
    """The inverse of `as_key_data`: leaves that are keys in `like` made keys again."""

    def wrap(x: Any, like_leaf: Any) -> Any:
        if not (hasattr(like_leaf, "dtype") and is_key(like_leaf)):
            return x
        if not is_array(like_leaf):
            # A `ShapeDtypeStruct`: JAX offers the implementation of arrays only.
            like_leaf = jnp.zeros((0,), like_leaf.dtype)
        return jr.wrap_key_data(x, impl=jr.key_impl(like_leaf))

    return jtu.tree_map(wrap, tree, like)


def weak_scalar(host: np.ndarray) -> int | float | complex | None:
    """The Python scalar that `jax.device_put` turns into a weakly typed array equal,
    bit for bit, to the 0-d `host`; `None` if there is none.

    `jax.device_put` of a Python scalar makes a weak array of JAX's default dtype for
    its type without compiling anything, so a 0-d weak leaf of that dtype (the common
    case: a Python number that became an array) needs no `make_weak`. A NaN goes
    through `make_weak`, which keeps its payload bits.
    """
    python_type = _PYTHON_TYPES.get(host.dtype.kind)
    if (
        host.ndim != 0
        or python_type is None
        or jax.dtypes.canonicalize_dtype(python_type) != host.dtype
    ):
        return None
    value = host.item()
    return None if value != value else value


_PYTHON_TYPES = {"i": int, "f": float, "c": complex}


def make_weak(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """`arrays` with the same values, dtypes and placement, weakly typed.

    Weak types decide dtype promotion (a weak float32 scalar times a bfloat16 array is
    bfloat16), so stacking and saving must keep them. Public JAX makes weak arrays only
    from Python scalars (see `weak_scalar`), or as the outputs of a program whose
    inputs are weak: each array goes through an identity program compiled ahead of
    time for one weak input (it accepts a strong one of the same shape). There is one
    program per shape, dtype and placement, never one per tree, so the first call on
    a tree of thousands of leaves compiles as many programs as it has distinct
    shapes. Committed arrays stay committed to their shardings; uncommitted ones stay
    uncommitted on their device.
    """
    return [
        _weak_identity(
            x.shape,
            x.dtype,
            x.sharding if x.committed else None,
            None if x.committed else next(iter(x.devices())),
        )(x)
        for x in arrays
    ]


@ft.lru_cache(maxsize=4096)
def _weak_identity(
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: jax.sharding.Sharding | None,
    device: Any,
) -> Any:
    spec = jax.ShapeDtypeStruct(shape, dtype, weak_type=True, sharding=sharding)
    with jax.default_device(device):
        return jax.jit(lambda x: x).lower(spec).compile()


def is_int(x: Any) -> TypeGuard[int]:
    """Whether `x` is a Python `int` and not a `bool`."""
    return isinstance(x, int) and not isinstance(x, bool)


def _resolve_subtree(spec: Any, subtree: Any, argname: str, path: KeyPath) -> Any:
    if spec is None or is_int(spec):
        return jtu.tree_map(lambda _: spec, subtree)
    if callable(spec):

        def call(leaf_path: KeyPath, leaf: Any) -> int | None:
            axis = spec(leaf)
            if axis is not None and not is_int(axis):
                raise BatchError(
                    f"axis spec for `{leaf_name(argname, path + leaf_path)}` returned "
                    f"{axis!r}; a callable spec must return an int or None."
                )
            return axis

        return jtu.tree_map_with_path(call, subtree)
    raise BatchError(
        f"axis spec for `{leaf_name(argname, path)}` is {spec!r}; it must be None, "
        "an int or a callable."
    )


def resolve_axes(tree: Any, axes: Any, argname: str) -> Any:
    """Broadcasts the prefix spec `axes` to a pytree shaped like `tree`.

    Every leaf of the result is the leaf's member axis as written (an int, possibly
    negative) or `None`.

    Raises `BatchError` if `axes` is not a prefix of `tree`, or holds something that is
    not an axis spec.
    """
    try:
        specs, prefix = jtu.tree_flatten_with_path(axes, is_leaf=_is_none)
        subtrees = prefix.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise BatchError(
            f"the axis spec for `{argname}` is not a pytree prefix of it: {e}"
        ) from None
    resolved = [
        _resolve_subtree(spec, subtree, argname, path)
        for (path, spec), subtree in zip(specs, subtrees, strict=True)
    ]
    return jtu.tree_unflatten(prefix, resolved)


def with_leaves_replaced(
    tree: Any, chosen: Callable[[Any], bool], replace: Callable[[list[Any]], list[Any]]
) -> Any:
    """`tree` with the leaves that `chosen` picks replaced by `replace(those)`, one
    call for all of them (placing arrays on devices costs per call as well as per
    leaf); `tree` itself if it picks none."""
    leaves, treedef = jtu.tree_flatten(tree)
    picked = [i for i, x in enumerate(leaves) if chosen(x)]
    if not picked:
        return tree
    for i, x in zip(picked, replace([leaves[i] for i in picked]), strict=True):
        leaves[i] = x
    return jtu.tree_unflatten(treedef, leaves)


def _is_none(x: Any) -> bool:
    return x is None


def mapped_leaves(
    tree: Any, axes: Any, argname: str
) -> list[tuple[KeyPath, Any, int | None]]:
    """`(path, leaf, axis)` for every leaf of `tree`, with `axes` resolved.

    Mapped axes are normalised to be non-negative. Raises `BatchError` for a mapped leaf
    that is not an array, is 0-d, or whose axis is out of range.
    """
    resolved = resolve_axes(tree, axes, argname)
    leaves, treedef = jtu.tree_flatten_with_path(tree)
    axis_leaves = treedef.flatten_up_to(resolved)
    out = []
    for (path, leaf), axis in zip(leaves, axis_leaves, strict=True):
        if axis is not None:
            axis = normalise_axis(leaf, axis, leaf_name(argname, path))
        out.append((path, leaf, axis))
    return out


def normalise_axis(leaf: Any, axis: int, name: str) -> int:
    """`axis` made non-negative for `leaf`, which must be an array with that axis."""
    if not is_array(leaf):
        raise BatchError(
            f"`{name}` is {describe(leaf)}, not an array, but has member axis {axis}: "
            "make it an array, or give it axis spec None."
        )
    ndim = np.ndim(leaf)
    if ndim == 0:
        raise BatchError(
            f"`{name}` is a 0-d array ({describe(leaf)}) but has member axis {axis}: "
            "give it axis spec None."
        )
    if not -ndim <= axis < ndim:
        raise BatchError(
            f"`{name}` has shape {tuple(np.shape(leaf))}: member axis {axis} is out of "
            "range."
        )
    return axis % ndim


def axis_sizes(
    leaves: list[tuple[KeyPath, Any, int | None]], argname: str
) -> list[tuple[str, int]]:
    """`(leaf name, member-axis size)` of every mapped leaf in `mapped_leaves`' output,
    in the form `common_size` takes."""
    return [
        (leaf_name(argname, path), np.shape(leaf)[axis])
        for path, leaf, axis in leaves
        if axis is not None
    ]


def common_size(
    sizes: list[tuple[str, int]], what: str = "member axis", fix: str = ""
) -> int:
    """The one size shared by all `(leaf name, size)` pairs.

    Raises `BatchError` listing every leaf with its size, against the most common size,
    if they differ, or if there is no leaf at all.
    """
    if not sizes:
        raise BatchError(f"no array leaf has a {what}: map at least one array leaf.")
    counts = Counter(size for _, size in sizes)
    if len(counts) == 1:
        return sizes[0][1]
    # The majority is most likely right; on a tie, the size seen first.
    majority = max(counts, key=counts.__getitem__)
    lines = [f"`{name}`: {size}" for name, size in sizes]
    message = (
        f"array leaves disagree on the size of their {what} "
        f"(sizes seen: {sorted(counts)}; most leaves have {majority}):\n"
        + bullet_list(lines)
    )
    if fix:
        message += "\n" + fix
    raise BatchError(message)


def structs(tree: Any, *, drop: int = 0, add: tuple[int, ...] = ()) -> Any:
    """Shape-dtype structs of `tree`'s array leaves (or structs), with their first
    `drop` axes replaced by axes of sizes `add`; other leaves are kept as they are.

    `structs(states, drop=1)` is one chain of a stack; `structs(one, add=(n,))` is `n`
    of them.
    """

    def struct(x: Any) -> Any:
        if not (is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
            return x
        return jax.ShapeDtypeStruct((*add, *x.shape[drop:]), x.dtype)

    return jtu.tree_map(struct, tree)


def is_struct(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)
