"""The number of members of a mapped call: checked across every mapped leaf before
tracing, and when leaves disagree, a diagnosis in the user's own names.

JAX and Equinox report a size mismatch with internal names
(`_dynamic_args[0].layers[0].weight`) and without saying which leaf is wrong. Here every
disagreeing leaf is named by argument and path with its size, and where the mistake is
a common one, the message says how to fix it: the `in_axes` that shares an argument
every member uses, or `eb.stack` for a Python list of members. Only shapes are read, so
under `jax.jit` this runs once per trace and costs nothing per call.
"""

from collections import Counter
from typing import Any, NamedTuple

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, bullet_list, check_int, describe, KeyPath, leaf_name
from .._tree import is_array, is_int, mapped_leaves
from ._bind import DEFAULT_AXIS, LeavesByArgument


def check_axis_size(axis_size: Any) -> int | None:
    """`axis_size` as an int, checked when a transform is made rather than deep inside
    JAX when it is called.

    **Raises:**

    `BatchError` if `axis_size` is neither `None` nor a non-negative integer (bools
    are refused).
    """
    if axis_size is None:
        return None
    return check_int(
        axis_size,
        "axis_size",
        hint="It is the number of members, needed only when no argument is mapped; "
        "None takes it from the mapped arguments.",
    )


def check_mapped_sizes(
    arguments: dict[str, Any],
    axes: dict[str, Any],
    axis_size: int | None = None,
    *,
    positional: int | None = None,
) -> int | None:
    """The size of the mapped axis, checked across every mapped leaf before tracing.

    When one size is known to be right (`axis_size`, or the one size that arguments
    whose mapped leaves agree among themselves have), every leaf of another size is
    listed, and whole arguments without a leaf of the right size are suggested the axis
    spec `None`. When two or more arguments each agree among themselves but on
    different sizes (`f(model, x)` with an unstacked `eqx.nn.Linear` and a batch `x`),
    any of those sizes could be the number of members: the sizes are listed by
    argument, and every reading that maps the arguments of one size and broadcasts the
    rest is suggested, most likely first:

    1. the size more arguments agree on: separate arguments rarely share a size by
        accident, whereas within one argument sizes often agree by construction (a
        `Linear`'s weight and bias both start with `out_features`);
    2. then a reading that maps no 1-d leaf: it would give each member a scalar, and a
        single vector (a bias, one input) mistaken for a batch is the usual culprit;
    3. then the larger size;
    4. then the order of the arguments.

    An argument that is a Python list (or tuple) of members of one structure, where a
    stacked tree was expected, gets no `in_axes` reading: the message says it is a list
    of members and that `eb.stack` makes it one stacked tree.

    **Arguments:**

    - `arguments`, `axes`: as returned by `bind_arguments`.
    - `axis_size`: the user's `axis_size`, if any; mapped leaves must then have it too.
    - `positional`: how many leading entries of `arguments` were passed positionally
        (`len(args)`); with it, the suggested fix can be written as a tuple `in_axes`.

    **Returns:**

    The common size of every mapped leaf; `axis_size` if no leaf is mapped (`None` if
    that is not given either).

    **Raises:**

    `BatchError` if an axis spec is not a prefix of its argument or is not an axis spec,
    if a mapped leaf is not an array, is 0-d, or lacks the axis, or if mapped leaves (or
    `axis_size`) disagree on the size.

    !!! Example

        ```python
        from eqx_batch._transforms._sizes import check_mapped_sizes

        arguments = {"x": jnp.ones((8, 3)), "w": jnp.ones((3, 2))}
        axes = {"x": 0, "w": None}
        assert check_mapped_sizes(arguments, axes) == 8
        ```
    """
    return mapped_size(arguments, axes, axis_size, positional)[0]


def mapped_size(
    arguments: dict[str, Any],
    axes: dict[str, Any],
    axis_size: int | None,
    positional: int | None,
) -> tuple[int | None, LeavesByArgument]:
    """`check_mapped_sizes`, also returning every leaf with its resolved member axis."""
    mapped = {
        name: mapped_leaves(value, axes[name], name)
        for name, value in arguments.items()
    }
    sizes = [
        (name, path, leaf, axis)
        for name, triples in mapped.items()
        for path, leaf, axis in triples
        if axis is not None
    ]
    if not sizes:
        return axis_size, mapped
    own = _own_sizes(mapped)
    if axis_size is None and len(set(own.values())) > 1:
        raise BatchError(_ambiguous(arguments, axes, mapped, own, positional))
    size, source = _reference_size(mapped, own, axis_size)
    wrong = [
        (name, path, leaf, axis)
        for name, path, leaf, axis in sizes
        if leaf.shape[axis] != size
    ]
    if not wrong:
        return size, mapped
    wrong_names = list(dict.fromkeys(name for name, *_ in wrong))
    lists = _member_lists(arguments, wrong_names)
    message = (
        f"mapped leaves disagree on the size of the mapped axis. {lists}Taking "
        f"{size} ({source}) as the number of members, these mapped leaves differ:\n"
        + bullet_list([_size_line(*leaf) for leaf in wrong])
    )
    if lists:
        raise BatchError(message)
    # The fix is obvious when whole arguments have no mapped leaf of the right size:
    # they are most likely shared by every member and should not be mapped.
    right_names = {name for name, path, leaf, axis in sizes if leaf.shape[axis] == size}
    unmap = [name for name in wrong_names if name not in right_names]
    if unmap == wrong_names:
        message += (
            f"\n{_arguments(unmap, 'Argument')} {_plural(unmap, 'has', 'have')} no "
            f"mapped leaf of size {size}; if shared by every member, give "
            f"{_plural(unmap, 'it', 'them')} the axis spec None"
        )
        suggestion = _suggest_in_axes(arguments, axes, unmap, positional)
        message += f": did you mean in_axes={suggestion}?" if suggestion else "."
    raise BatchError(message)


def _own_sizes(mapped: LeavesByArgument) -> dict[str, int]:
    """The size of each argument whose mapped leaves agree among themselves."""
    own = {}
    for name, triples in mapped.items():
        sizes = {leaf.shape[axis] for _, leaf, axis in triples if axis is not None}
        if len(sizes) == 1:
            own[name] = sizes.pop()
    return own


def _reference_size(
    mapped: LeavesByArgument, own: dict[str, int], axis_size: int | None
) -> tuple[int, str]:
    """The size the others are checked against, and where it comes from: `axis_size`;
    else the one size that arguments agreeing among themselves have; else the size
    most mapped leaves have."""
    if axis_size is not None:
        return axis_size, f"axis_size={axis_size}"
    if own:
        name = next(iter(own))
        return own[name], f"the size of `{name}`"
    counts = Counter(
        leaf.shape[axis]
        for triples in mapped.values()
        for _, leaf, axis in triples
        if axis is not None
    )
    size = max(counts, key=counts.__getitem__)  # on a tie, the size seen first
    return size, "the size most mapped leaves have"


# Each argument's mapped leaves only (those with a member axis), for arguments that
# have any.
_MappedLeaves = dict[str, list[tuple[KeyPath, Any, int]]]


def _ambiguous(
    arguments: dict[str, Any],
    axes: dict[str, Any],
    mapped: LeavesByArgument,
    own: dict[str, int],
    positional: int | None,
) -> str:
    """The message for arguments that each agree on a size of their own: the sizes by
    argument, and each reading that maps one size, in the order documented in
    `check_mapped_sizes`."""
    leaves: _MappedLeaves = {
        name: [(path, leaf, axis) for path, leaf, axis in triples if axis is not None]
        for name, triples in mapped.items()
    }
    leaves = {name: triples for name, triples in leaves.items() if triples}
    lists = _member_lists(arguments, list(leaves))
    message = (
        f"mapped leaves disagree on the size of the mapped axis. {lists}With no "
        "axis_size given, any of several sizes could be the number of members. "
        "Mapped sizes by argument:\n" + bullet_list(_sizes_by_argument(leaves, own))
    )
    if lists:
        return message
    readings = _readings(leaves, own)
    if not readings:
        return message
    return message + _suggested_readings(arguments, axes, readings, positional)


def _sizes_by_argument(leaves: _MappedLeaves, own: dict[str, int]) -> list[str]:
    """One line per argument whose mapped leaves agree among themselves (one is enough
    to show the size), one per leaf of the others."""
    lines = []
    for name, triples in leaves.items():
        if name in own and len(triples) > 1:
            path, leaf, axis = triples[0]
            lines.append(
                f"`{name}`: size {own[name]} (all {len(triples)} mapped leaves, such "
                f"as `{leaf_name(name, path)}`: axis {axis} of {describe(leaf)})"
            )
        else:
            lines.extend(_size_line(name, *triple) for triple in triples)
    return lines


class _Reading(NamedTuple):
    """One way to read an ambiguous call: the arguments of one size mapped, giving
    `size` members, and the others `shared` by every member."""

    size: int
    shared: list[str]


def _readings(leaves: _MappedLeaves, own: dict[str, int]) -> list[_Reading]:
    """Every reading that maps whole arguments of one size, most likely first (see
    `check_mapped_sizes`); none that would map only part of an argument."""
    sizes = {
        name: {leaf.shape[axis] for _, leaf, axis in triples}
        for name, triples in leaves.items()
    }
    ranked = []
    for size in dict.fromkeys(own.values()):
        kept = [name for name in own if own[name] == size]
        shared = [name for name in leaves if name not in kept]
        if any(size in sizes[name] for name in shared):
            continue  # it would map only part of an argument
        scalar = any(np.ndim(leaf) == 1 for name in kept for _, leaf, _ in leaves[name])
        ranked.append(((-len(kept), scalar, -size), _Reading(size, shared)))
    ranked.sort(key=lambda entry: entry[0])  # stable: then argument order
    return [reading for _, reading in ranked]


def _suggested_readings(
    arguments: dict[str, Any],
    axes: dict[str, Any],
    readings: list[_Reading],
    positional: int | None,
) -> str:
    """The advice that names each of `readings` (at least one), the first as the
    question and the others as alternatives."""
    clauses = []
    for size, shared in readings:
        suggestion = _suggest_in_axes(arguments, axes, shared, positional)
        clause = f"{_arguments(shared)} shared ({size} members)"
        if not clauses:
            ask = f": did you mean in_axes={suggestion}?" if suggestion else "."
            clauses.append(f"With {clause}{ask}")
        else:
            fix = f": in_axes={suggestion}" if suggestion else ""
            clauses.append(f"with {clause}{fix}")
    advice = (
        "\nMap the arguments of one size, and give the others, if shared by every "
        f"member, the axis spec None. {clauses[0]}"
    )
    if len(clauses) > 1:
        advice += f" Otherwise, {'; '.join(clauses[1:])}."
    return advice


def _member_lists(arguments: dict[str, Any], names: list[str]) -> str:
    """Advice for each of `names` that is a Python list (or tuple) of members of one
    structure, where a stacked tree was expected: one sentence each, each followed by
    a line break; empty if there is none.

    Neither mapping it (each member's leaves along their own first axis) nor sharing
    it (every member gets the whole list) is what such a call means, so no `in_axes`
    is suggested for it.
    """
    advice = []
    for name in names:
        value = arguments[name]
        if type(value) not in (list, tuple) or len(value) < 2:
            continue
        first = _array_layout(value[0])
        if not first[1] or any(_array_layout(other) != first for other in value[1:]):
            continue
        kind = type(value[0]).__name__
        container = type(value).__name__
        advice.append(
            f"`{name}` is a {container} of {len(value)} members of one structure "
            f"({kind}), not one stacked {kind}: members are mapped along an axis of "
            f"each array, not taken from the entries of a {container}. "
            f"`eb.stack({name})` makes it one stacked {kind} whose arrays have a "
            f"member axis of size {len(value)} in front.\n"
        )
    return "".join(advice)


def _array_layout(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    """`tree`'s structure with the shape and dtype of each array leaf: what members
    must share to be stacked."""
    leaves, treedef = jtu.tree_flatten(tree)
    arrays = tuple((np.shape(leaf), leaf.dtype) for leaf in leaves if is_array(leaf))
    return treedef, arrays


def _suggest_in_axes(
    arguments: dict[str, Any],
    axes: dict[str, Any],
    unmap: list[str],
    positional: int | None,
) -> str | None:
    """A full `in_axes` that maps as before except for `unmap`, if one can be."""
    rendered = {
        name: "None" if name in unmap else _render_spec(axes[name], value)
        for name, value in arguments.items()
    }
    if any(text is None for text in rendered.values()):
        return None
    names = list(arguments)
    if positional is not None and not set(unmap) & set(names[positional:]):
        default = {
            name: _render_spec(DEFAULT_AXIS, arguments[name])
            for name in names[positional:]
        }
        if all(rendered[name] == default[name] for name in names[positional:]):
            specs = [str(rendered[name]) for name in names[:positional]]
            trailing = "," if len(specs) == 1 else ""
            return f"({', '.join(specs)}{trailing})"
    if any("[" in name for name in names):
        return None  # `*args` / `**kwargs` entries cannot be keyed one by one.
    return "{" + ", ".join(f"{name!r}: {rendered[name]}" for name in names) + "}"


def _render_spec(spec: Any, value: Any) -> str | None:
    """How to write `spec` for `value` in a suggested `in_axes`, if it can be."""
    if spec is None or is_int(spec):
        return repr(spec)
    if isinstance(spec, eqx.if_array):
        leaves = jtu.tree_leaves(value)
        if not any(is_array(leaf) for leaf in leaves):
            return "None"
        if len(leaves) == 1:
            return repr(spec.axis)
        return f"eqx.if_array({spec.axis})"
    return None


def _size_line(name: str, path: KeyPath, leaf: Any, axis: int) -> str:
    size = leaf.shape[axis]
    return f"`{leaf_name(name, path)}`: size {size} (axis {axis} of {describe(leaf)})"


def _arguments(names: list[str], noun: str = "argument") -> str:
    """``argument `x` `` or ``arguments `a`, `w` and `b` ``."""
    *rest, last = [f"`{name}`" for name in names]
    listed = f"{', '.join(rest)} and {last}" if rest else last
    return f"{_plural(names, noun, noun + 's')} {listed}"


def _plural(names: list[str], one: str, many: str) -> str:
    return one if len(names) == 1 else many
