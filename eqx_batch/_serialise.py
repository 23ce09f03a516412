"""`save` and `load`: pytrees to and from eqx_batch files, written atomically, read
validated against `like`.

A tree is written as one record per leaf and the arrays of its array leaves; the file
format (safetensors with eqx_batch metadata and checksums) is `_file_format.py`'s.
Loading checks every record of a file against the leaf of `like` at the same place
before it reads any tensor, then gives each value the type of `like`'s leaf. A file of
a stacked tree loads into a list of members and a file of a list into a stacked
`like`: those layouts are here too.
"""

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.tree_util as jtu
import numpy as np

from ._errors import (
    BatchError,
    bullet_list,
    describe,
    KeyPath,
    leaf_name,
    qualified_name,
)
from ._file_format import (
    check_caller_metadata,
    CheckedFile,
    open_checked,
    storable,
    write_file,
)
from ._stack import unstack
from ._tree import is_array, is_key, is_tracer, is_weak, make_weak


Tree = TypeVar("Tree")


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


def _is_array_template(x: Any) -> bool:
    """Whether `x` stands for an array in `like`: an array or a `ShapeDtypeStruct`."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _object_name(x: Any) -> str:
    """What is recorded of a leaf JSON cannot hold: its qualified name or its type's."""
    name = qualified_name(x)
    if name is not None and not isinstance(x, type):
        return name
    return f"instance of {qualified_name(type(x))}"


# ------------------------------------------------------------------------------------
# Writing.


def _leaf_records(tree: Any) -> tuple[list[dict], list[Any]]:
    """The leaf records of `tree`, and its arrays (key data for keys) in their order."""
    leaves = jtu.tree_flatten_with_path(tree)[0]
    records: list[dict] = []
    on_device: list[Any] = []
    for key_path, leaf in leaves:
        name = leaf_name("tree", key_path)
        record: dict[str, Any] = {"path": jtu.keystr(key_path)}
        if is_tracer(leaf):
            raise BatchError(
                f"`{name}` is a traced array ({describe(leaf)}): `save` reads concrete "
                "values on the host. Call it outside `jax.jit`, `jax.vmap` and friends."
            )
        if isinstance(leaf, jax.Array) and is_key(leaf):
            record.update(
                kind="key", impl=str(jax.random.key_impl(leaf)), shape=list(leaf.shape)
            )
            on_device.append(jax.random.key_data(leaf))
        elif is_array(leaf):
            if not storable(np.dtype(leaf.dtype)):
                raise BatchError(
                    f"`{name}` is {describe(leaf)}; only numeric arrays (bool, "
                    "integer, floating, complex and ml_dtypes such as bfloat16) can "
                    "be saved."
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
                record.update(kind="object", name=_object_name(leaf))
        records.append(record)
    names = [r["path"] for r in records if r["kind"] in ("array", "key")]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise BatchError(
            f"`tree` has several array leaves with the path {twice[0]!r}, and a file "
            "names each array by its path. Give the leaves distinct keys."
        )
    return records, on_device


def write_tree(
    path: str | os.PathLike,
    tree: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    keep_cached: bool = True,
) -> None:
    """`eb.save`, with caller metadata and `atomic_write`'s `keep_cached`.

    `metadata` holds string entries stored in the file's safetensors metadata and
    returned verbatim by `read_tree` and `read_metadata`; keys must not start with
    `eqx_batch.`. Raises `BatchError` for such a key or a non-string entry.
    """
    entries = check_caller_metadata(metadata)
    records, arrays = _leaf_records(tree)
    # Fetched from the devices in one batch.
    write_file(path, records, jax.device_get(arrays), entries, keep_cached=keep_cached)


def save(path: str | os.PathLike, tree: Any) -> None:
    """Saves a pytree to a safetensors file, atomically; loading it never runs code.

    Checkpoints must survive crashes, must not be a way to run someone else's code, and
    should open in other tools. `save` writes a temporary file in the same folder,
    flushes and fsyncs it, and only then renames it over `path`: a crash mid-write
    leaves the previous file whole. The file is a
    [safetensors](https://huggingface.co/docs/safetensors) file: every array leaf is a
    tensor named by its `jax.tree_util.keystr` path (`.layers[0].weight`), readable by
    `safetensors.numpy.load_file` or PyTorch, and what safetensors cannot express (the
    tree's structure, Python scalars, key implementations, weak types, CRC-32
    checksums) is in its metadata. See the [checkpoints guide](../checkpoints.md).

    Arrays (JAX or NumPy, any numeric dtype including bfloat16 and other ml_dtypes),
    typed PRNG keys (their key data, with the implementation's name) and
    `bool`/`int`/`float`/`complex`/`str` leaves are stored. Any other leaf, such as an
    activation function, is not stored: its qualified name is recorded, and `eb.load`
    checks it against `like`, which supplies the object.

    **Arguments:**

    - `path`: the file to write. Its folder must exist; a previous file is replaced.
    - `tree`: any pytree: an Equinox module, a stacked ensemble, a list of members, a
        dict of optimiser states...

    **Returns:**

    `None`.

    **Raises:**

    `BatchError` if a leaf is a tracer (call `save` outside `jax.jit`) or an array of
    a non-numeric dtype (strings, objects). `OSError` if the file cannot be written
    (no such folder, no permission, disk full); `path` is then left as it was.

    !!! Example

        ```python
        model = eqx.nn.MLP(2, 1, 8, 2, key=jr.key(0))
        eb.save("model.safetensors", model)
        same = eb.load("model.safetensors", like=model)
        ```
    """
    write_tree(path, tree)


# ------------------------------------------------------------------------------------
# Loading into `like`.


@functools.cache
def _key_dtype(impl: str) -> Any:
    """The dtype of typed keys of the implementation named `impl` (traced, not run)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


class _Stored(NamedTuple):
    """An array leaf read from a file, on the host, before it takes `like`'s type."""

    data: np.ndarray  # key data for keys
    weak: bool
    impl: str | None  # the key implementation, for keys


def _expected_kind(like_leaf: Any) -> str:
    if _is_array_template(like_leaf):
        return "key" if is_key(like_leaf) else "array"
    return _SCALAR_KINDS.get(type(like_leaf), "object")


def _check_leaf(
    file: CheckedFile,
    record: dict,
    like_leaf: Any,
    where: tuple[str, KeyPath],
    shape: tuple[int, ...],
) -> None:
    """Raises if `record`, of shape `shape` (a member's, between layouts), is not
    what `like_leaf`, at `leaf_name(*where)`, stands for."""
    problem = _leaf_problem(record, like_leaf, shape)
    if problem is not None:
        raise BatchError(
            f"`{leaf_name(*where)}` does not match the leaf `{record['path']}` of the "
            f"file `{file.path}`: {problem}"
        )


def _leaf_problem(record: dict, like_leaf: Any, shape: tuple[int, ...]) -> str | None:
    """What differs between a leaf record and `like_leaf`, with the fix; or `None`."""
    kind = _expected_kind(like_leaf)
    if record["kind"] != kind:
        shown = (
            describe(like_leaf)
            if _is_array_template(like_leaf)
            else f"{describe(like_leaf)} ({type(like_leaf).__name__})"
        )
        return (
            f"`like` has {_KIND_PHRASES[kind]} there ({shown}) but the file has "
            f"{_KIND_PHRASES[record['kind']]}. Pass a `like` built the same way as the "
            "saved tree."
        )
    if kind in ("array", "key") and shape != tuple(like_leaf.shape):
        return (
            f"`like` has shape {tuple(like_leaf.shape)} but the file has shape "
            f"{shape}. Build `like` with the sizes the saved tree had."
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
    if kind == "object" and record["name"] != _object_name(like_leaf):
        return (
            f"`like` has {_object_name(like_leaf)} but the saved tree had "
            f"{record['name']}. Objects are not stored, only checked: `like` must "
            "hold the same one."
        )
    return None


def _value(file: CheckedFile, record: dict, like_leaf: Any) -> Any:
    """The file's value of a checked leaf: `_Stored` for arrays, else the value."""
    kind = record["kind"]
    if kind in ("array", "key"):
        return _Stored(
            file.array(record), record.get("weak", False), record.get("impl")
        )
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


def _materialise(values: list[Any], like_leaves: list[Any], on_host: bool) -> list:
    """`values` with `_Stored` arrays turned into leaves of the types of `like`'s.

    Arrays for the default device travel in one transfer; weak ones are made weak in
    one program.
    """
    out = list(values)
    to_place: list[int] = []
    for i, (value, like_leaf) in enumerate(zip(values, like_leaves, strict=True)):
        if not isinstance(value, _Stored):
            continue
        if isinstance(like_leaf, np.generic):
            out[i] = value.data[()]
        elif isinstance(like_leaf, np.ndarray) or on_host:
            out[i] = np.array(value.data)
        else:
            to_place.append(i)
    placed = jax.device_put([values[i].data for i in to_place]) if to_place else []
    weak: list[int] = []
    for i, data in zip(to_place, placed, strict=True):
        value, sharding = values[i], _committed_sharding(like_leaves[i])
        if value.impl is not None:
            data = jax.random.wrap_key_data(data, impl=value.impl)
        if sharding is not None:
            data = jax.device_put(data, sharding)
        out[i] = data
        if value.weak:
            weak.append(i)
    for i, data in zip(weak, make_weak([out[i] for i in weak]), strict=True):
        out[i] = data
    return out


def _restore(file: CheckedFile, like: Any, argname: str, on_host: bool) -> Any:
    """`like` with every leaf replaced by the file's, whose paths match `like`'s."""
    leaves, treedef = jtu.tree_flatten_with_path(like)
    like_leaves = [leaf for _, leaf in leaves]
    for (path, leaf), record in zip(leaves, file.records, strict=True):
        _check_leaf(file, record, leaf, (argname, path), tuple(record.get("shape", ())))
    values = [
        _value(file, record, leaf)
        for leaf, record in zip(like_leaves, file.records, strict=True)
    ]
    return jtu.tree_unflatten(treedef, _materialise(values, like_leaves, on_host))


def _paths(tree: Any) -> list[str]:
    return [jtu.keystr(path) for path, _ in jtu.tree_flatten_with_path(tree)[0]]


def _list_length(file_paths: list[str], member_paths: list[str]) -> int | None:
    """`n` if the file holds a list of `n` trees with `member_paths`, else `None`."""
    if not member_paths or len(file_paths) % len(member_paths):
        return None
    length = len(file_paths) // len(member_paths)
    expected = [f"[{i}]{path}" for i in range(length) for path in member_paths]
    return length if expected == file_paths else None


def _stacked_into_list(
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
            _check_leaf(file, record, leaf, (f"{argname}[{i}]", path), shape)
    first = flat[0][0]
    stacked = [
        _value(file, record, leaf)
        for record, leaf in zip(file.records, first, strict=True)
    ]
    if on_host:
        members = [
            [
                v._replace(data=v.data[i]) if isinstance(v, _Stored) else v
                for v in stacked
            ]
            for i in range(count)
        ]
    else:
        # Placed stacked and split on the devices: one transfer per leaf, not per
        # member and leaf.
        templates = [
            jax.ShapeDtypeStruct((count, *np.shape(leaf)), leaf.dtype)
            if _is_array_template(leaf)
            else leaf
            for leaf in first
        ]
        placed = _materialise(stacked, templates, on_host=False)
        members = _unstack_leaves(placed, stacked)
    restored = [
        jtu.tree_unflatten(treedef, _with_types_of(values, leaves, on_host))
        for values, (leaves, treedef) in zip(members, flat, strict=True)
    ]
    return tuple(restored) if isinstance(like, tuple) else restored


def _unstack_leaves(placed: list[Any], stored: list[Any]) -> list[list[Any]]:
    """Member lists of leaves from stacked ones; other leaves are shared."""
    axes = [0 if isinstance(s, _Stored) else None for s in stored]
    return [list(member) for member in unstack(placed, axes=axes)]


def _with_types_of(values: list[Any], like_leaves: list[Any], on_host: bool) -> list:
    """`values` (a member's, split from stacked arrays) as `like_leaves`' types."""
    out = []
    for value, like_leaf in zip(values, like_leaves, strict=True):
        if isinstance(value, _Stored):
            value = _materialise([value], [like_leaf], on_host)[0]
        elif isinstance(like_leaf, np.generic):
            value = np.asarray(value)[()]
        elif isinstance(like_leaf, np.ndarray):
            value = np.asarray(value)
        out.append(value)
    return out


def _list_into_stacked(
    file: CheckedFile, like: Any, argname: str, length: int, on_host: bool
) -> Any:
    leaves, treedef = jtu.tree_flatten_with_path(like)
    per_member = len(leaves)
    for path, leaf in leaves:
        if _is_array_template(leaf) and tuple(leaf.shape)[:1] != (length,):
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
            if _is_array_template(leaf)
            else leaf
        )
        for record in records:
            shape = tuple(record.get("shape", ()))
            _check_leaf(file, record, member_like, (argname, path), shape)
        if not _is_array_template(leaf):
            _check_shared(file, name, records, leaf)
        columns.append(records)
    values = [
        _stacked_value(file, records, leaf)
        for records, (_, leaf) in zip(columns, leaves, strict=True)
    ]
    like_leaves = [leaf for _, leaf in leaves]
    return jtu.tree_unflatten(treedef, _materialise(values, like_leaves, on_host))


def _check_shared(
    file: CheckedFile, name: str, records: list[dict], like_leaf: Any
) -> None:
    """Raises unless the members' values of a leaf a stacked `like` shares agree."""
    values = [_value(file, record, like_leaf) for record in records]
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
    values = [_value(file, record, like_leaf) for record in records]
    first = values[0]
    if not isinstance(first, _Stored):
        return first
    return _Stored(
        np.stack([v.data for v in values]), all(v.weak for v in values), first.impl
    )


def _structure_error(file: CheckedFile, like_paths: list[str]) -> BatchError:
    in_file, in_like = set(file.paths), set(like_paths)
    missing = [f"like{p}" for p in like_paths if p not in in_file]
    extra = [p for p in file.paths if p not in in_like]
    lines = [f"in `like` only: `{p}`" for p in missing]
    lines += [f"in the file only: `{p}`" for p in extra]
    if not lines:
        lines = ["the same leaves, in a different order"]
    return BatchError(
        f"`like` does not have the structure of the tree saved in `{file.path}` "
        f"({len(like_paths)} leaves in `like`, {len(file.paths)} in the file):\n"
        + bullet_list(lines)
        + "\nPass a `like` built the same way as the saved tree (the same model "
        "constructor and sizes), or a list of members for a stacked file."
    )


def _load_into(file: CheckedFile, like: Any, argname: str, on_host: bool) -> Any:
    # Only a file without leaves could fit both `like` and `like[0]`: it fits `like`.
    if (
        type(like) in (list, tuple)
        and like
        and file.paths
        and _paths(like[0]) == file.paths
    ):
        # Members of one structure have the same paths: compare them once.
        flat = [jtu.tree_flatten(member) for member in like]
        if all(treedef == flat[0][1] for _, treedef in flat):
            return _stacked_into_list(file, like, flat, argname, on_host)
    like_paths = _paths(like)
    if file.paths == like_paths:
        return _restore(file, like, argname, on_host)
    length = _list_length(file.paths, like_paths)
    if length is not None:
        return _list_into_stacked(file, like, argname, length, on_host)
    raise _structure_error(file, like_paths)


def read_tree(
    path: str | os.PathLike,
    like: Any,
    *,
    argname: str = "like",
    on_host: bool = False,
) -> tuple[Any, dict[str, str]]:
    """`eb.load`, returning the caller metadata of `write_tree` too.

    `argname` names `like` in error messages. With `on_host=True` nothing is placed on
    a device or compiled: numeric array leaves come back as NumPy arrays (weak types,
    which NumPy lacks, are dropped: `make_weak` restores them), and typed-key leaves
    as their raw key data, a NumPy `uint32` array of shape `like_leaf.shape + (2,)`
    for the default implementation, whose implementation was checked against `like`
    (wrap it with `jax.random.wrap_key_data(data, impl=...)`).

    Raises `BadFileError` (a `BatchError`) if the file is not a sound eqx_batch file,
    a plain `BatchError` if it does not fit `like`, `OSError` if it cannot be opened.
    """
    with open_checked(path) as file:
        tree = _load_into(file, like, argname, on_host)
        return tree, file.caller_metadata


def load(path: str | os.PathLike, like: Tree) -> Tree:
    """Loads a pytree saved by `eb.save`, checked leaf by leaf against `like`.

    A checkpoint is only useful if it loads into the model you have now, and a file
    from elsewhere must not be able to run code. `load` refuses anything but a regular
    file, checks the sizes the file's header claims against its actual size before
    reading anything else (so a hostile file cannot make it allocate more than the
    file holds), then the file's CRC-32 checksums (before its version field, so damage
    reads as damage), then every leaf against `like` (structure, shapes, dtypes, PRNG
    key implementations, the names of functions) before returning anything. Nothing
    is unpickled.

    Stacked and unstacked files read each other: a file saved from a stacked tree
    (every array with a leading member axis, as `eb.stack` makes it) loads into a list
    (or tuple) of members when `like` is one, and a file saved from a list of members
    loads into a stacked `like`.

    `like` need not hold any values: `jax.ShapeDtypeStruct` leaves, as
    `eqx.filter_eval_shape` gives them, say what to load without initialising
    anything, in either layout: a stacked file loads into
    `[eqx.filter_eval_shape(make, k) for k in keys]`, and a list file into
    `eqx.filter_eval_shape(make_stacked, keys)`.

    **Arguments:**

    - `path`: a file written by `eb.save`.
    - `like`: a pytree with the structure of the saved one, such as a freshly
        constructed model, or a list of members for a stacked file (and the other way
        round). Its array leaves may be JAX or NumPy arrays or `jax.ShapeDtypeStruct`s.

    **Returns:**

    A pytree with the structure of `like` holding the file's values. Leaves have the
    types of `like`'s: JAX arrays (on `like`'s devices when it was placed on them, or
    with a `ShapeDtypeStruct`'s sharding) for JAX arrays and `ShapeDtypeStruct`s,
    with the saved weak types; NumPy arrays for NumPy arrays; typed PRNG keys for
    keys. Python scalars are the saved values; other objects (functions) are `like`'s
    own.

    **Raises:**

    `BatchError` if `path` is not a regular file (a FIFO, a device), is not an
    eqx_batch file (junk, or a safetensors file written by another tool, which the
    message says how to use), is corrupt or truncated (a checksum or a size does not
    match), or comes from a newer format version; if `like`'s structure differs from
    the saved tree's (listing the leaves only one of them has); if a leaf differs in
    kind, shape, dtype, key implementation or function name (naming the leaf and both
    values); or, between stacked and list files, if the member counts differ (naming
    the leaf and both counts). `OSError` (e.g. `FileNotFoundError`) if the file cannot
    be opened.

    !!! Example

        ```python
        def make(key):
            return eqx.nn.Linear(2, 3, key=key)

        keys = jr.split(jr.key(0), 4)
        eb.save("ensemble.safetensors", eb.stack([make(k) for k in keys]))
        # A list of 4 Linear layers, from shapes only: nothing is initialised.
        shapes = [eqx.filter_eval_shape(make, k) for k in keys]
        as_list = eb.load("ensemble.safetensors", like=shapes)
        ```
    """
    return read_tree(path, like)[0]
