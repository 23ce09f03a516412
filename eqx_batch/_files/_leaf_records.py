"""A leaf and its record in an eqx_batch file: the record `save` writes for each leaf
of a tree, the check of a record against the leaf of `like` at its place, and the value
that leaf gets back.

Array values travel as `Stored` (host data, weak type, key implementation) until
`materialise` gives them the types of `like`'s leaves, all of a tree's at once, so that
they reach the devices in one transfer.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, describe, KeyPath, leaf_name, qualified_name
from .._tree import (
    is_array,
    is_key,
    is_lazy_array,
    is_tracer,
    is_weak,
    make_weak,
    weak_scalar,
)
from ._file_format import CheckedFile
from ._file_layout import storable


_KIND_PHRASES = {
    "array": "an array",
    "key": "a typed PRNG key",
    "bool": "a bool",
    "int": "an int",
    "float": "a float",
    "complex": "a complex number",
    "str": "a str",
    "object": "an object that is not stored",
}
_SCALAR_KINDS = {
    bool: "bool",
    int: "int",
    float: "float",
    complex: "complex",
    str: "str",
}


# ------------------------------------------------------------------------------------
# Leaf kinds.


def is_array_template(x: Any) -> bool:
    """Whether `x` stands for an array in `like`: an array, a `LazyArray` (such as a
    leaf of a `trace="disk"` trace) or a `ShapeDtypeStruct`."""
    return is_array(x) or is_lazy_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def object_name(x: Any) -> str:
    """What is recorded of a leaf JSON cannot hold: its qualified name or its type's."""
    name = qualified_name(x)
    if name is not None and not isinstance(x, type):
        return name
    return f"instance of {qualified_name(type(x))}"


# ------------------------------------------------------------------------------------
# Writing.


def leaf_records(tree: Any) -> tuple[list[dict], list[Any]]:
    """The leaf records of `tree`, and its arrays (key data for keys) in their order.

    A `LazyArray` is an array whose values `write_file` reads in bounded parts.
    """
    leaves = jtu.tree_flatten_with_path(tree)[0]
    records: list[dict] = []
    on_device: list[Any] = []
    for key_path, leaf in leaves:
        name = leaf_name("tree", key_path)
        record: dict[str, Any] = {"path": jtu.keystr(key_path)}
        if is_tracer(leaf):
            raise BatchError(
                f"`{name}` is a traced array ({describe(leaf)}): call `save` outside "
                "`jax.jit`."
            )
        if isinstance(leaf, jax.Array) and is_key(leaf):
            record.update(
                kind="key", impl=str(jax.random.key_impl(leaf)), shape=list(leaf.shape)
            )
            on_device.append(jax.random.key_data(leaf))
        elif is_array(leaf) or is_lazy_array(leaf):
            if not storable(np.dtype(leaf.dtype)):
                raise BatchError(
                    f"`{name}` is {describe(leaf)}; only numeric arrays can be saved."
                )
            record.update(
                kind="array",
                dtype=np.dtype(leaf.dtype).name,
                shape=list(np.shape(leaf)),
                weak=is_weak(leaf),
            )
            on_device.append(leaf)
        else:
            kind = _SCALAR_KINDS.get(type(leaf))
            if kind == "complex":
                record.update(kind=kind, value=[leaf.real, leaf.imag])
            elif kind is not None:
                record.update(kind=kind, value=leaf)
            else:
                record.update(kind="object", name=object_name(leaf))
        if record["path"] == "__metadata__" and record["kind"] in ("array", "key"):
            raise BatchError(
                f"`{name}` is an array at '__metadata__', a name safetensors "
                "reserves: rename it (see docs/checkpoints.md#what-is-refused)."
            )
        records.append(record)
    names = [r["path"] for r in records if r["kind"] in ("array", "key")]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise BatchError(
            f"`tree` has several array leaves at {twice[0]!r}: give them distinct keys."
        )
    return records, on_device


# ------------------------------------------------------------------------------------
# Reading, checked against `like`.


@functools.cache
def _key_dtype(impl: str) -> Any:
    """The dtype of typed keys of the implementation named `impl` (traced, not run)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


class Stored(NamedTuple):
    """An array leaf read from a file, on the host, before it takes `like`'s type."""

    data: np.ndarray  # key data for keys
    weak: bool
    impl: str | None  # the key implementation, for keys


def _expected_kind(like_leaf: Any) -> str:
    if is_array_template(like_leaf):
        return "key" if is_key(like_leaf) else "array"
    return _SCALAR_KINDS.get(type(like_leaf), "object")


def check_leaf(
    file: CheckedFile,
    record: dict,
    like_leaf: Any,
    where: tuple[str, KeyPath],
) -> None:
    """Raises unless `record` is what `like_leaf` stands for; `where` names the leaf
    (as `leaf_name(*where)`)."""
    problem = _leaf_problem(record, like_leaf)
    if problem is not None:
        raise BatchError(
            f"`{leaf_name(*where)}` does not match the leaf `{record['path']}` of the "
            f"file `{file.path}`: {problem}"
        )


def _leaf_problem(record: dict, like_leaf: Any) -> str | None:
    """What differs between a leaf record and `like_leaf`, with the fix; or `None`."""
    kind = _expected_kind(like_leaf)
    if record["kind"] != kind:
        shown = (
            describe(like_leaf)
            if is_array_template(like_leaf)
            else f"{describe(like_leaf)} ({type(like_leaf).__name__})"
        )
        return (
            f"`like` has {_KIND_PHRASES[kind]} there ({shown}) but the file has "
            f"{_KIND_PHRASES[record['kind']]}. Pass a `like` built the same way as the "
            "saved tree."
        )
    if kind in ("array", "key") and tuple(record["shape"]) != tuple(like_leaf.shape):
        return (
            f"`like` has shape {tuple(like_leaf.shape)} but the file has shape "
            f"{tuple(record['shape'])}. Build `like` with the sizes the saved tree had."
        )
    if kind == "key":
        try:
            same = _key_dtype(record["impl"]) == like_leaf.dtype
        except (ValueError, TypeError, KeyError):
            same = False
        if not same:
            return (
                f"`like` has a key of type {like_leaf.dtype} but the file has a "
                f"{record['impl']!r} key. Create `like`'s keys with the same `impl`."
            )
    # By name: the byte order of `like` does not matter, only the values do.
    if (
        kind == "array"
        and like_leaf.dtype != record["numpy_dtype"]
        and np.dtype(like_leaf.dtype).name != record["dtype"]
    ):
        return (
            f"`like` has dtype {like_leaf.dtype} but the file has dtype "
            f"{record['dtype']}. Build `like` with the dtypes the saved tree had."
        )
    if kind == "object" and record["name"] != object_name(like_leaf):
        return (
            f"`like` has {object_name(like_leaf)} but the saved tree had "
            f"{record['name']}. Objects are not stored, only checked: `like` must "
            "hold the same one."
        )
    return None


def leaf_value(file: CheckedFile, record: dict, like_leaf: Any) -> Any:
    """The file's value of a checked leaf: `Stored` for arrays, else the value."""
    kind = record["kind"]
    if kind in ("array", "key"):
        return Stored(file.array(record), record.get("weak", False), record.get("impl"))
    if kind == "object":
        return like_leaf
    if kind == "complex":
        return complex(*record["value"])
    return record["value"]


def _committed_sharding(like_leaf: Any) -> Any:
    """The sharding to place a leaf like `like_leaf` with; `None` for the default."""
    if isinstance(like_leaf, jax.Array):
        return like_leaf.sharding if like_leaf.committed else None
    return getattr(like_leaf, "sharding", None)


def materialise(values: list[Any], like_leaves: list[Any], on_host: bool) -> list:
    """`values` with `Stored` arrays turned into leaves of the types of `like`'s: NumPy
    arrays for NumPy arrays and `LazyArray`s (whose values live on the host).

    Arrays for the default device travel in one transfer, 0-d weak ones as Python
    scalars (`weak_scalar`), which arrive weak; other weak ones are made weak by
    `make_weak`, which compiles per shape and dtype, not per tree.
    """
    out = list(values)
    to_place: list[int] = []
    sources: list[Any] = []
    for i, (value, like_leaf) in enumerate(zip(values, like_leaves, strict=True)):
        if not isinstance(value, Stored):
            continue
        if isinstance(like_leaf, np.generic):
            out[i] = value.data[()]
        elif isinstance(like_leaf, np.ndarray) or is_lazy_array(like_leaf) or on_host:
            out[i] = np.array(value.data)
        else:
            to_place.append(i)
            scalar = weak_scalar(value.data) if value.weak else None
            sources.append(value.data if scalar is None else scalar)
    placed = jax.device_put(sources) if to_place else []
    weak: list[int] = []
    for i, data in zip(to_place, placed, strict=True):
        value, sharding = values[i], _committed_sharding(like_leaves[i])
        if value.impl is not None:
            data = jax.random.wrap_key_data(data, impl=value.impl)
        if sharding is not None:
            data = jax.device_put(data, sharding)
        out[i] = data
        if value.weak and not is_weak(data):
            weak.append(i)
    for i, data in zip(weak, make_weak([out[i] for i in weak]), strict=True):
        out[i] = data
    return out
