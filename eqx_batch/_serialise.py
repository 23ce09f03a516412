"""`save` and `load`: pytrees to and from eqx_batch files, written atomically, read
validated against `like`.

A tree is written as one record per leaf and the arrays of its array leaves
(`_leaf_records.py`); the file format (safetensors with eqx_batch metadata and
checksums) is `_file_layout.py`'s, opened by `_file_format.py`. Loading checks every
record of a file against the leaf of `like` at the same place before it reads any
tensor, then gives each value the type of `like`'s leaf. A file of a stacked tree loads
into a list of members and a file of a list into a stacked `like` (`_load_layouts.py`).
"""

import os
import pathlib
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import jax.tree_util as jtu

from ._errors import BatchError, bullet_list
from ._file_format import CheckedFile, open_checked
from ._file_layout import check_caller_metadata, write_file
from ._leaf_records import check_leaf, leaf_records, leaf_value, materialise
from ._load_layouts import list_into_stacked, list_length, stacked_into_list


Tree = TypeVar("Tree")


# ------------------------------------------------------------------------------------
# Writing.


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
    records, arrays = leaf_records(tree)
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

    `BatchError`, before anything is written, if `path` is a folder or its folder
    does not exist; if a leaf is a tracer (call `save` outside `jax.jit`) or an array
    of a non-numeric dtype (strings, objects); or if two array leaves have the same
    path, or one has the path `__metadata__` (which safetensors reserves; a custom
    pytree key can print so). `OSError` if the file cannot be written otherwise (no
    permission, disk full); `path` is then left as it was.

    !!! Example

        ```python
        model = eqx.nn.MLP(2, 1, 8, 2, key=jr.key(0))
        eb.save("model.safetensors", model)
        same = eb.load("model.safetensors", like=model)
        ```
    """
    target = pathlib.Path(path)
    if target.is_dir():
        raise BatchError(
            f"`path` ({path}) is a folder; `save` writes a file. Name a file in it, "
            f"such as {target / 'model.safetensors'}."
        )
    if not target.parent.is_dir():
        problem = "is not a folder" if target.parent.exists() else "does not exist"
        raise BatchError(
            f"`path` ({path}) is in the folder {target.parent}, which {problem}. "
            "Create the folder first (`os.makedirs`), or pass another path."
        )
    write_tree(path, tree)


# ------------------------------------------------------------------------------------
# Loading into `like`.


def _restore(file: CheckedFile, like: Any, argname: str, on_host: bool) -> Any:
    """`like` with every leaf replaced by the file's, whose paths match `like`'s."""
    leaves, treedef = jtu.tree_flatten_with_path(like)
    like_leaves = [leaf for _, leaf in leaves]
    for (path, leaf), record in zip(leaves, file.records, strict=True):
        check_leaf(file, record, leaf, (argname, path), tuple(record.get("shape", ())))
    values = [
        leaf_value(file, record, leaf)
        for leaf, record in zip(like_leaves, file.records, strict=True)
    ]
    return jtu.tree_unflatten(treedef, materialise(values, like_leaves, on_host))


def _paths(tree: Any) -> list[str]:
    return [jtu.keystr(path) for path, _ in jtu.tree_flatten_with_path(tree)[0]]


def _grid_ndim(like: Any, file_paths: list[str]) -> int | None:
    """`ndim` if `like` is `ndim >= 2` levels of lists around members of the file's
    structure, as `eb.unstack(grid, ndim=ndim)` makes them; else `None`."""
    inner, ndim = like, 0
    while type(inner) in (list, tuple) and inner:
        inner, ndim = inner[0], ndim + 1
        if ndim >= 2 and file_paths and _paths(inner) == file_paths:
            return ndim
    return None


def _structure_error(file: CheckedFile, like: Any, like_paths: list[str]) -> BatchError:
    in_file, in_like = set(file.paths), set(like_paths)
    missing = [f"like{p}" for p in like_paths if p not in in_file]
    extra = [p for p in file.paths if p not in in_like]
    lines = [f"in `like` only: `{p}`" for p in missing]
    lines += [f"in the file only: `{p}`" for p in extra]
    if not lines:
        lines = ["the same leaves, in a different order"]
    ndim = _grid_ndim(like, file.paths)
    if ndim is None:
        fix = (
            "Pass a `like` built the same way as the saved tree (the same model "
            "constructor and sizes), or a list of members for a stacked file."
        )
    else:
        fix = (
            f"`like` is {ndim} levels of lists around members of the saved tree's "
            f"structure, and the file holds them stacked into one grid (as "
            f"`eb.stack(..., ndim={ndim})` makes it): load it stacked and split it, "
            f"`eb.unstack(eb.load({file.path!r}, like=eb.stack(like, ndim={ndim})), "
            f"ndim={ndim})`."
        )
    return BatchError(
        f"`like` does not have the structure of the tree saved in `{file.path}` "
        f"({len(like_paths)} leaves in `like`, {len(file.paths)} in the file):\n"
        + bullet_list(lines)
        + "\n"
        + fix
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
            return stacked_into_list(file, like, flat, argname, on_host)
    like_paths = _paths(like)
    if file.paths == like_paths:
        return _restore(file, like, argname, on_host)
    length = list_length(file.paths, like_paths)
    if length is not None:
        return list_into_stacked(file, like, argname, length, on_host)
    raise _structure_error(file, like, like_paths)


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
    message says how to use), was rewritten by another tool (an `eb.save` file
    re-saved by safetensors: the message says how to read its arrays), is corrupt,
    truncated or crafted (a checksum or a size does not match), or comes from a newer
    format version; if `like`'s structure differs from the saved tree's (listing the
    leaves only one of them has, and for a grid file loaded into lists of rows, how to
    load it stacked and unstack it with `ndim`); if a leaf differs in
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
