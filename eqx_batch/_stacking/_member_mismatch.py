"""The members given to `stack` or `concat`: how they are arranged, and why they
cannot be joined, in the user's names.

A sequence of members is a list, tuple or iterator (one member on its own is refused,
not read as a sequence of its keys or fields); a grid nests such sequences. Members
are named by their place in the user's sequence or grid (`trees[3]`, `trees[0][3]`).
A leaf kept once (not stacked) must be equal across members, compared by type and
value, floats and arrays bit for bit; members must have one structure, and where they
do not, the first path where they differ is named with both nodes; a mapped leaf must
have one dtype, weak type and member shape.
"""

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, describe, KeyPath, leaf_name, type_names
from .._tree import host_array, is_array, is_tracer, is_weak


_SAME_STRUCTURE_FIX = (
    "Members need the same structure (containers, keys, module types, static fields)."
)


class MemberGrid(NamedTuple):
    """How the members given to `stack` or `concat` are arranged, for messages.

    `shape` is `(n,)` for a sequence of `n` members, `(m, n)` for `m` rows of `n`
    (`ndim=2`), and so on; members are numbered row by row.
    """

    argname: str
    shape: tuple[int, ...]

    def member(self, i: int) -> str:
        """Member `i`'s name: `trees[3]`, or `trees[0][3]` in a grid."""
        if len(self.shape) == 1:
            return f"{self.argname}[{i}]"
        indices = np.unravel_index(i, self.shape)
        return self.argname + "".join(f"[{int(j)}]" for j in indices)


# ------------------------------------------------------------------------------------
# Reading the user's sequence (or grid) of members.


def is_sequence(x: Any) -> bool:
    """A list, tuple or iterator of members; not a string, and not a NamedTuple (one
    member on its own)."""
    if isinstance(x, (str, bytes)) or (isinstance(x, tuple) and hasattr(x, "_fields")):
        return False
    return isinstance(x, (Sequence, Iterator))


def members_of(trees: Any, verb: str) -> list[Any]:
    """`trees` as a list of members, refusing what is one member or has no order."""
    if is_sequence(trees):
        return list(trees)
    namedtuple = isinstance(trees, tuple) and hasattr(trees, "_fields")
    what = f"a {type(trees).__qualname__}"
    if isinstance(trees, Mapping):
        what += f" with keys {list(trees)[:5]}"
    elif is_array(trees):
        what = f"an array ({describe(trees)})"
    raise BatchError(
        f"`trees` is {what}, but {verb} takes a sequence of members: a list or tuple "
        f"with one pytree per member, as in `eb.{verb}([a, b])`. To {verb} a "
        f"single member, pass `[trees]`"
        + (
            "; to use the fields of this NamedTuple as members, `list(trees)`."
            if namedtuple
            else "."
        )
    )


def grid_members(rows: list[Any], ndim: int, argname: str) -> tuple[list, tuple]:
    """The members of a grid `ndim` deep, row by row, and the grid's shape.

    `rows` is the outer sequence; each row must be a sequence `ndim - 1` deep, of the
    same shape as row 0.
    """
    if ndim == 1:
        return rows, (len(rows),)
    flat: list[Any] = []
    inner: tuple[int, ...] | None = None
    for r, row in enumerate(rows):
        name = f"{argname}[{r}]"
        if not is_sequence(row):
            raise BatchError(
                f"`{name}` is {describe(row)} ({type(row).__qualname__}); with "
                f"`ndim={ndim}` each row must be a list or tuple."
            )
        members, shape = grid_members(list(row), ndim - 1, name)
        if inner is not None and shape != inner:
            first = f"{argname}[0]"
            if ndim == 2:
                what = f"has {shape[0]} members where `{first}` has {inner[0]}"
            else:
                what = f"has shape {shape} where `{first}` has shape {inner}"
            raise BatchError(
                f"`{name}` {what}; pad or trim the rows to one "
                f"{'length' if ndim == 2 else 'shape'}."
            )
        inner = shape
        flat.extend(members)
    return flat, (len(rows),) + (inner if inner is not None else (0,) * (ndim - 1))


# ------------------------------------------------------------------------------------
# Equality of leaves that are kept once.


def same_value(a: Any, b: Any) -> bool:
    """Same type and value; floats bit-for-bit (so -0.0 and NaN round-trip)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if is_array(a):
        if is_tracer(a) or is_tracer(b):
            return False
        if np.shape(a) != np.shape(b) or a.dtype != b.dtype:
            return False
        if is_weak(a) != is_weak(b):
            return False
        return host_array(a).tobytes() == host_array(b).tobytes()
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


def check_kept_once(column: list[Any], path: KeyPath, member_grid: MemberGrid) -> None:
    """Raises unless every member holds the same non-stacked leaf."""
    first = column[0]
    for i, leaf in enumerate(column[1:], start=1):
        if same_value(first, leaf):
            continue
        here = leaf_name(member_grid.member(i), path)
        there = leaf_name(member_grid.member(0), path)
        if is_array(leaf) and not is_array(first):
            raise BatchError(
                f"`{here}` is an array ({describe(leaf)}) but `{there}` is "
                f"{describe(first)}: use `jnp.asarray({describe(first)})` in `{there}` "
                "too (see docs/stacking.md#what-is-refused)."
            )
        if is_array(first) or is_array(leaf):
            if (is_tracer(first) or is_tracer(leaf)) and type(first) is type(leaf):
                raise BatchError(
                    f"`{here}` is kept once (axis spec None) but is a traced array "
                    f"other than `{there}`: give it a member axis "
                    "(see docs/stacking.md#what-is-refused)."
                )
            what = f"is {describe(leaf)} but `{there}` is {describe(first)}"
            if describe(leaf) == describe(first) and type(leaf) is type(first):
                what = f"({describe(leaf)}) holds other values than `{there}`"
            raise BatchError(
                f"`{here}` {what}, and axis spec None keeps it once: give it a "
                "member axis, or make the members equal."
            )
        leaf_type, first_type = type_names(type(leaf), type(first))
        message = (
            f"`{here}` is {describe(leaf)} ({leaf_type}) but "
            f"`{there}` is {describe(first)} ({first_type}). "
            "Non-array leaves are kept once, so must be equal"
        )
        if isinstance(first, (bool, int, float, complex)) and isinstance(
            leaf, (bool, int, float, complex)
        ):
            message += ": make it an array to stack it"
        elif callable(first):
            message += ": create the function once and share it"
        raise BatchError(message + ".")


# ------------------------------------------------------------------------------------
# Structure.


def _is_leaf(treedef: Any) -> bool:
    return treedef.num_nodes == 1 and treedef.num_leaves == 1


def _node_summary(treedef: Any, type_name: str) -> str:
    if _is_leaf(treedef):
        return "a leaf"
    node_type, aux = treedef.node_data()
    if node_type is dict:
        return f"a dict with keys {list(aux)}"
    if node_type in (list, tuple):
        return f"a {type_name} of length {len(treedef.children())}"
    if node_type is type(None):
        return "None"
    return (
        f"a {type_name} with {len(treedef.children())} children and static "
        f"data {describe(aux)}"
    )


def _node_summaries(treedef_a: Any, treedef_b: Any) -> tuple[str, str]:
    """`_node_summary` of two nodes, their types told apart where names coincide."""
    type_a, type_b = (
        None if _is_leaf(treedef) else treedef.node_data()[0]
        for treedef in (treedef_a, treedef_b)
    )
    names = ("", "")
    if type_a is not None and type_b is not None:
        names = type_names(type_a, type_b)
    return _node_summary(treedef_a, names[0]), _node_summary(treedef_b, names[1])


def _first_difference(a: Any, b: Any, path: KeyPath) -> tuple[KeyPath, str, str]:
    """The first path where `a` and `b` differ in structure, and the nodes there."""
    treedef_a = jtu.tree_structure(a)
    treedef_b = jtu.tree_structure(b)
    is_node_a = not _is_leaf(treedef_a)
    is_node_b = not _is_leaf(treedef_b)
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
                if not same_value(value_a, value_b):
                    return (
                        path + (jtu.GetAttrKey(field.name),),
                        f"static field {describe(value_a)}",
                        f"static field {describe(value_b)}",
                    )
    if (
        is_node_a
        and is_node_b
        and treedef_a.node_data() == treedef_b.node_data()
        and len(treedef_a.children()) == len(treedef_b.children())
    ):
        children_a, children_b = _children(a), _children(b)
        for (key, child_a), (_, child_b) in zip(children_a, children_b, strict=True):
            if jtu.tree_structure(child_a) != jtu.tree_structure(child_b):
                return _first_difference(child_a, child_b, path + (key,))
    return (path, *_node_summaries(treedef_a, treedef_b))


def _children(node: Any) -> list[tuple[Any, Any]]:
    """The (key, child) pairs one level below `node`.

    `jax.tree_util.flatten_one_level_with_keys` says this, but only from JAX 0.10.2 on.
    """
    flat = jtu.tree_flatten_with_path(node, is_leaf=lambda child: child is not node)[0]
    return [(path[0], child) for path, child in flat]


def flatten_members(
    trees: Sequence[Any], member_grid: MemberGrid, verb: str
) -> tuple[Any, list]:
    """Flattens every member, raising at the first that differs from `trees[0]`."""
    if len(trees) == 0:
        raise BatchError(
            f"`{member_grid.argname}` is empty: {verb} needs at least one member."
        )
    treedef = jtu.tree_structure(trees[0])
    columns_by_member = []
    for i, tree in enumerate(trees):
        leaves, member_treedef = jtu.tree_flatten(tree)
        if member_treedef != treedef:
            path, first, other = _first_difference(trees[0], tree, ())
            raise BatchError(
                f"`{leaf_name(member_grid.member(i), path)}` is {other} but "
                f"`{leaf_name(member_grid.member(0), path)}` is {first}. "
                + _SAME_STRUCTURE_FIX
            )
        columns_by_member.append(leaves)
    return treedef, columns_by_member


# ------------------------------------------------------------------------------------
# A column of mapped leaves.


def check_mapped_column(
    column: list[Any], path: KeyPath, member_grid: MemberGrid, axis: int | None
) -> None:
    """Every member leaf is an array with the shape and dtype of member 0's.

    With `axis` given (concat), shapes may differ along that axis.
    """
    first = column[0]
    there = leaf_name(member_grid.member(0), path)
    if not is_array(first):
        raise BatchError(
            f"`{there}` is {describe(first)}, not an array, but has a member axis: "
            "make it an array, or give it axis spec None."
        )
    for i, leaf in enumerate(column[1:], start=1):
        here = leaf_name(member_grid.member(i), path)
        if not is_array(leaf):
            raise BatchError(
                f"`{here}` is {describe(leaf)}, not an array, but `{there}` is "
                f"{describe(first)}: make it an array too."
            )
        if leaf.dtype != first.dtype:
            raise BatchError(
                f"`{here}` has dtype {leaf.dtype} but `{there}` has dtype "
                f"{first.dtype}: cast them to one dtype."
            )
        if is_weak(leaf) != is_weak(first):
            weak, strong = (here, there) if is_weak(leaf) else (there, here)
            raise BatchError(
                f"`{weak}` is weakly typed but `{strong}` is not: use "
                f"`jnp.asarray(x, dtype=jnp.{leaf.dtype})` "
                "(see docs/stacking.md#what-is-refused)."
            )
        shape, first_shape = list(np.shape(leaf)), list(np.shape(first))
        if axis is not None and len(shape) == len(first_shape):
            shape[axis] = first_shape[axis] = -1
        if shape != first_shape:
            what = "" if axis is None else f" (apart from member axis {axis})"
            raise BatchError(
                f"`{here}` has shape {tuple(np.shape(leaf))} but `{there}` has shape "
                f"{tuple(np.shape(first))}{what}."
            )
