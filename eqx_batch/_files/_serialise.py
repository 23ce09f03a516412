"""`save` and `load`: pytrees to and from eqx_batch files, written atomically, read
validated against `like`.

A tree is written as one record per leaf and the arrays of its array leaves
(`_leaf_records.py`); the file format (safetensors with eqx_batch metadata and
checksums) is `_file_layout.py`'s, opened by `_file_format.py`. Loading checks every
record of a file against the leaf of `like` at the same place before it reads any
tensor, then gives each value the type of `like`'s leaf. A file loads only into the
structure it was saved from: a stacked tree is not split into members, nor a list
stacked, but the error names the `eb.stack` or `eb.unstack` line that does it.
"""

import os
import pathlib
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import jax.tree_util as jtu

from .._errors import BatchError, bullet_list, leaf_name
from .._tree import is_lazy_array
from ._file_format import CheckedFile, open_checked
from ._file_layout import check_caller_metadata, write_file
from ._leaf_records import (
    check_leaf,
    is_array_template,
    leaf_records,
    leaf_value,
    materialise,
)


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
    # Fetched from the devices in one batch; lazy arrays are read as they are written,
    # a block at a time, not whole here.
    fetched = iter(jax.device_get([x for x in arrays if not is_lazy_array(x)]))
    hosts = [x if is_lazy_array(x) else next(fetched) for x in arrays]
    write_file(path, records, hosts, entries, keep_cached=keep_cached)


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
    `bool`/`int`/`float`/`complex`/`str` leaves are stored. The `eb.DiskArray`s of a
    `trace="disk"` trace are stored as arrays of their values, read from their draw
    files 16 MiB at a time, so a trace larger than memory can be saved, and the file
    does not need the checkpoint. Any other leaf, such as an activation function, is
    not stored: its qualified name is recorded, and `eb.load` checks it against
    `like`, which supplies the object.

    **Arguments:**

    - `path`: the file to write. Its folder must exist; a previous file is replaced.
    - `tree`: any pytree: an Equinox module, a stacked ensemble, a list of members, a
        dict of optimiser states...

    **Returns:**

    `None`.

    **Raises:**

    `BatchError`, before anything is written, if `path` is a folder or its folder
    does not exist; if an `eb.DiskArray` leaf reads from `path` (one of its draw
    files, or a file of its run's checkpoint, which the save would destroy); if a
    leaf is a tracer (call `save` outside `jax.jit`) or an array of a non-numeric
    dtype (strings, objects); or if two array leaves have the same path, or one has
    the path `__metadata__` (which safetensors reserves; a custom pytree key can
    print so). `OSError` if the file cannot be written otherwise (no permission,
    disk full); `path` is then left as it was. A `BatchError` naming the draw file,
    if an `eb.DiskArray`'s file cannot be read (missing, damaged); `path` is then
    left as it was.

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
            f"`path` ({path}) is in the folder {target.parent}, which {problem}."
        )
    _check_not_read_from(path, tree)
    write_tree(path, tree)


def _check_not_read_from(path: str | os.PathLike, tree: Any) -> None:
    """Refuses `path` if a lazy leaf of `tree` reads from it: the save would read the
    file, then replace it, and the run whose file it is would be lost."""
    for key_path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        found = leaf.replaced_by(path) if is_lazy_array(leaf) else None
        if found is not None:
            file, lost = found
            named = "" if os.fspath(path) == str(file) else f" (`path` {path})"
            raise BatchError(
                f"`{leaf_name('tree', key_path)}` reads from {file}{named}: saving "
                f"over it loses {lost}. Save to another path."
            )


# ------------------------------------------------------------------------------------
# Loading into `like`.


def _restore(file: CheckedFile, like: Any, argname: str, on_host: bool) -> Any:
    """`like` with every leaf replaced by the file's; their paths must match."""
    leaves, treedef = jtu.tree_flatten_with_path(like)
    like_paths = [jtu.keystr(path) for path, _ in leaves]
    if like_paths != file.paths:
        raise _structure_error(file, like, like_paths)
    like_leaves = [leaf for _, leaf in leaves]
    for (path, leaf), record in zip(leaves, file.records, strict=True):
        check_leaf(file, record, leaf, (argname, path))
    values = [
        leaf_value(file, record, leaf)
        for leaf, record in zip(like_leaves, file.records, strict=True)
    ]
    return jtu.tree_unflatten(treedef, materialise(values, like_leaves, on_host))


def _paths(tree: Any) -> list[str]:
    return [jtu.keystr(path) for path, _ in jtu.tree_flatten_with_path(tree)[0]]


def _leading_sizes(shapes: list[tuple[int, ...]], ndim: int) -> tuple[int, ...] | None:
    """The sizes of the `ndim` leading axes of `shapes`, if they all have the same."""
    leading = {shape[:ndim] for shape in shapes}
    sizes = leading.pop() if len(leading) == 1 else ()
    return sizes if len(sizes) == ndim else None


def _list_levels(like: Any, file_paths: list[str]) -> int | None:
    """`ndim` if `like` is `ndim` levels of lists around members of the file's
    structure, as `eb.unstack(tree, ndim=ndim)` makes them; else `None`."""
    inner, ndim = like, 0
    while type(inner) in (list, tuple) and inner:
        inner, ndim = inner[0], ndim + 1
        if file_paths and _paths(inner) == file_paths:
            return ndim
    return None


def _list_length(file_paths: list[str], member_paths: list[str]) -> int | None:
    """`n` if the file holds a list of `n` trees with `member_paths`, else `None`."""
    if not member_paths or len(file_paths) % len(member_paths):
        return None
    length = len(file_paths) // len(member_paths)
    expected = [f"[{i}]{path}" for i in range(length) for path in member_paths]
    return length if expected == file_paths else None


def _of_like(function: str, like: Any, ndim: int) -> str:
    """The code `eb.<function>(like)`, for `like` in an error's fix.

    `eb.stack` keeps `ShapeDtypeStruct`s as leaves shared by all members, so a
    shape-only `like` is stacked or unstacked by `eqx.filter_eval_shape`.
    """
    arguments = "like" if ndim == 1 else f"like, ndim={ndim}"
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jtu.tree_leaves(like)):
        return f"eqx.filter_eval_shape(eb.{function}, {arguments})"
    return f"eb.{function}({arguments})"


def _as_saved(saved: int, given: int | None) -> str:
    """How many members a fix's `like` needs, if the caller's has another number."""
    return "" if given == saved else f", with `like` of {saved} members as saved"


def _stacked_file_fix(file: CheckedFile, like: Any, ndim: int) -> str:
    """What a stacked file and `like`, `ndim` levels of lists of members, are, and the
    line that loads the file into the lists."""
    shapes = [
        tuple(record["shape"])
        for record in file.records
        if record["kind"] in ("array", "key")
    ]
    sizes = _leading_sizes(shapes, ndim)
    if sizes is None:
        stacked, count = "one stacked tree", ""
    else:
        stacked = f"one tree stacked from {' x '.join(map(str, sizes))} members"
        count = _as_saved(sizes[0], len(like)) if ndim == 1 else ""
    if ndim == 1:
        lists, unstack_ndim = f"a {type(like).__name__} of {len(like)} members", ""
    else:
        lists, unstack_ndim = f"{ndim} levels of lists of members", f", ndim={ndim}"
    return (
        f"the file holds {stacked} (as `eb.stack` makes it), and `like` is {lists}. "
        f"Load it stacked and unstack it: `eb.unstack(eb.load({file.path!r}, "
        f"like={_of_like('stack', like, ndim)}){unstack_ndim})`{count}."
    )


def _list_file_fix(file: CheckedFile, like: Any, length: int) -> str:
    """What a file of a list of `length` trees of `like`'s structure and `like` are,
    and the line that loads the file."""
    holds = f"the file holds a list of {length} members (saved as a list, not stacked)"
    arrays = [leaf for leaf in jtu.tree_leaves(like) if is_array_template(leaf)]
    sizes = _leading_sizes([tuple(leaf.shape) for leaf in arrays], 1)
    if sizes is None:
        return (
            f"{holds}, and `like` is one member. Load the list: "
            f"`eb.load({file.path!r}, like=[like] * {length})`."
        )
    return (
        f"{holds}, and `like` is one tree stacked from {sizes[0]} members. Load the "
        f"list and stack it: `eb.stack(eb.load({file.path!r}, "
        f"like={_of_like('unstack', like, 1)}))`{_as_saved(length, sizes[0])}."
    )


def _structure_error(file: CheckedFile, like: Any, like_paths: list[str]) -> BatchError:
    heading = f"`like` does not have the structure of the tree saved in `{file.path}`"
    # `load` returns the tree as it was saved; `eb.stack` and `eb.unstack` convert.
    ndim = _list_levels(like, file.paths)
    if ndim is not None:
        return BatchError(f"{heading}: {_stacked_file_fix(file, like, ndim)}")
    length = _list_length(file.paths, like_paths)
    if length is not None:
        return BatchError(f"{heading}: {_list_file_fix(file, like, length)}")
    in_file, in_like = set(file.paths), set(like_paths)
    missing = [f"like{p}" for p in like_paths if p not in in_file]
    extra = [p for p in file.paths if p not in in_like]
    lines = [f"in `like` only: `{p}`" for p in missing]
    lines += [f"in the file only: `{p}`" for p in extra]
    if not lines:
        lines = ["the same leaves, in a different order"]
    return BatchError(
        f"{heading} ({len(like_paths)} leaves in `like`, {len(file.paths)} in the "
        "file):\n"
        + bullet_list(lines)
        + "\nPass a `like` built the same way as the saved tree (the same model "
        "constructor and sizes)."
    )


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
        return _restore(file, like, argname, on_host), file.caller_metadata


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

    A file loads as it was saved: a stacked tree (every array with a leading member
    axis, as `eb.stack` makes it) into a stacked `like`, a list of members into a
    list. To get the other one, convert after loading with `eb.unstack` or `eb.stack`.

    `like` need not hold any values: `jax.ShapeDtypeStruct` leaves, as
    `eqx.filter_eval_shape` gives them, say what to load without initialising
    anything: a stacked file loads into `eqx.filter_eval_shape(eqx.filter_vmap(make),
    keys)`, and a list file into `[eqx.filter_eval_shape(make, k) for k in keys]`.

    **Arguments:**

    - `path`: a file written by `eb.save`.
    - `like`: a pytree with the structure of the saved one, such as a freshly
        constructed model. Its array leaves may be JAX or NumPy arrays,
        `eb.DiskArray`s or `jax.ShapeDtypeStruct`s.

    **Returns:**

    A pytree with the structure of `like` holding the file's values. Leaves have the
    types of `like`'s: JAX arrays (on `like`'s devices when it was placed on them, or
    with a `ShapeDtypeStruct`'s sharding) for JAX arrays and `ShapeDtypeStruct`s,
    with the saved weak types; NumPy arrays for NumPy arrays and `eb.DiskArray`s (a
    saved `trace="disk"` trace loads as NumPy arrays); typed PRNG keys for
    keys. Python scalars are the saved values; other objects (functions) are `like`'s
    own.

    **Raises:**

    `BatchError` if `path` is not a regular file (a FIFO, a device), is not an
    eqx_batch file (junk, or a safetensors file written by another tool, which the
    message says how to use), was rewritten by another tool (an `eb.save` file
    re-saved by safetensors: the message says how to read its arrays), is corrupt,
    truncated or crafted (a checksum or a size does not match), or comes from a newer
    format version; if `like`'s structure differs from the saved tree's (listing the
    leaves only one of them has, or, for a stacked file and a list of members or the
    other way round, saying which is which and the line of `eb.stack` or `eb.unstack`
    that loads it); or if a leaf differs in kind, shape, dtype, key implementation or
    function name (naming the leaf and both values). `OSError` (e.g.
    `FileNotFoundError`) if the file cannot be opened.

    !!! Example

        ```python
        def make(key):
            return eqx.nn.Linear(2, 3, key=key)

        keys = jr.split(jr.key(0), 4)
        eb.save("ensemble.safetensors", eb.stack([make(k) for k in keys]))
        # From shapes only: nothing is initialised.
        shapes = eqx.filter_eval_shape(eqx.filter_vmap(make), keys)
        ensemble = eb.load("ensemble.safetensors", like=shapes)
        members = eb.unstack(ensemble)  # a list of 4 Linear layers
        ```
    """
    return read_tree(path, like)[0]
