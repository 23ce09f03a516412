"""Loading a file saved in one layout into a `like` of the other: a stacked tree (every
array with a leading member axis) into a list of members, and a list of members into
a stacked tree.

Every record is checked against `like` before any tensor is read, as for one tree.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from ._errors import BatchError, leaf_name
from ._file_format import CheckedFile
from ._leaf_records import (
    check_leaf,
    is_array_template,
    leaf_value,
    materialise,
    Stored,
)
from ._stack import unstack


def list_length(file_paths: list[str], member_paths: list[str]) -> int | None:
    """`n` if the file holds a list of `n` trees with `member_paths`, else `None`."""
    if not member_paths or len(file_paths) % len(member_paths):
        return None
    length = len(file_paths) // len(member_paths)
    expected = [f"[{i}]{path}" for i in range(length) for path in member_paths]
    return length if expected == file_paths else None


def stacked_into_list(
    file: CheckedFile,
    like: Sequence,
    flat: list[tuple[list[Any], Any]],
    argname: str,
    on_host: bool,
) -> Any:
    """Loads a stacked file into `like`, a list of members flattened to `flat`."""
    count = len(like)
    for record in file.records:
        if record["kind"] in ("array", "key") and record["shape"][:1] != [count]:
            raise BatchError(
                f"`{argname}` is a list of {count} members but the file `{file.path}` "
                f"holds one stacked tree whose leaf `{record['path']}` has shape "
                f"{tuple(record['shape'])}: a stacked leaf needs {count} along its "
                "leading (member) axis. Pass a list of as many members as were saved."
            )
    key_paths = [path for path, _ in jtu.tree_flatten_with_path(like[0])[0]]
    shapes = [tuple(record.get("shape", ()))[1:] for record in file.records]
    for i, (leaves, _) in enumerate(flat):
        for path, leaf, record, shape in zip(
            key_paths, leaves, file.records, shapes, strict=True
        ):
            check_leaf(file, record, leaf, (f"{argname}[{i}]", path), shape)
    first = flat[0][0]
    stacked = [
        leaf_value(file, record, leaf)
        for record, leaf in zip(file.records, first, strict=True)
    ]
    if on_host:
        members = [
            [
                v._replace(data=v.data[i]) if isinstance(v, Stored) else v
                for v in stacked
            ]
            for i in range(count)
        ]
    else:
        # Placed stacked and split on the devices: one transfer per leaf, not per
        # member and leaf.
        templates = [
            jax.ShapeDtypeStruct((count, *np.shape(leaf)), leaf.dtype)
            if is_array_template(leaf)
            else leaf
            for leaf in first
        ]
        placed = materialise(stacked, templates, on_host=False)
        members = _unstack_leaves(placed, stacked)
    restored = [
        jtu.tree_unflatten(treedef, _with_types_of(values, leaves, on_host))
        for values, (leaves, treedef) in zip(members, flat, strict=True)
    ]
    return tuple(restored) if isinstance(like, tuple) else restored


def _unstack_leaves(placed: list[Any], stored: list[Any]) -> list[list[Any]]:
    """Member lists of leaves from stacked ones; other leaves are shared."""
    axes = [0 if isinstance(s, Stored) else None for s in stored]
    return [list(member) for member in unstack(placed, axes=axes)]


def _with_types_of(values: list[Any], like_leaves: list[Any], on_host: bool) -> list:
    """`values` (a member's, split from stacked arrays) as `like_leaves`' types."""
    out = []
    for value, like_leaf in zip(values, like_leaves, strict=True):
        if isinstance(value, Stored):
            value = materialise([value], [like_leaf], on_host)[0]
        elif isinstance(like_leaf, np.generic):
            value = np.asarray(value)[()]
        elif isinstance(like_leaf, np.ndarray):
            value = np.asarray(value)
        out.append(value)
    return out


def list_into_stacked(
    file: CheckedFile, like: Any, argname: str, length: int, on_host: bool
) -> Any:
    leaves, treedef = jtu.tree_flatten_with_path(like)
    per_member = len(leaves)
    for path, leaf in leaves:
        if is_array_template(leaf) and tuple(leaf.shape)[:1] != (length,):
            raise BatchError(
                f"the file `{file.path}` holds a list of {length} members but "
                f"`{argname}` is stacked with {tuple(leaf.shape)[:1] or 'no'} members "
                f"(`{leaf_name(argname, path)}` has shape {tuple(leaf.shape)}). Pass "
                "a `like` stacked from as many members as were saved."
            )
    # Every leaf is checked before any tensor is read.
    columns = []
    for j, (path, leaf) in enumerate(leaves):
        name = leaf_name(argname, path)
        records = [file.records[i * per_member + j] for i in range(length)]
        member_like = (
            jax.ShapeDtypeStruct(tuple(leaf.shape)[1:], leaf.dtype)
            if is_array_template(leaf)
            else leaf
        )
        for record in records:
            shape = tuple(record.get("shape", ()))
            check_leaf(file, record, member_like, (argname, path), shape)
        if not is_array_template(leaf):
            _check_shared(file, name, records, leaf)
        columns.append(records)
    values = [
        _stacked_value(file, records, leaf)
        for records, (_, leaf) in zip(columns, leaves, strict=True)
    ]
    like_leaves = [leaf for _, leaf in leaves]
    return jtu.tree_unflatten(treedef, materialise(values, like_leaves, on_host))


def _check_shared(
    file: CheckedFile, name: str, records: list[dict], like_leaf: Any
) -> None:
    """Raises unless the members' values of a leaf a stacked `like` shares agree."""
    values = [leaf_value(file, record, like_leaf) for record in records]
    first = values[0]
    for record, value in zip(records, values, strict=True):
        # NaN, a float that differs from itself, is the same NaN in every member.
        same = value == first or (value != value and first != first)
        if type(value) is not type(first) or not same:
            raise BatchError(
                f"`{name}` is one value shared by all members of a stacked `like`, "
                f"but the members saved in `{file.path}` differ there: "
                f"`{records[0]['path']}` is {first!r} and `{record['path']}` is "
                f"{value!r}. Load the file into a list of members instead."
            )


def _stacked_value(file: CheckedFile, records: list[dict], like_leaf: Any) -> Any:
    """The value of a stacked leaf from its members' records (checked)."""
    values = [leaf_value(file, record, like_leaf) for record in records]
    first = values[0]
    if not isinstance(first, Stored):
        return first
    return Stored(
        np.stack([v.data for v in values]), all(v.weak for v in values), first.impl
    )
