"""`save` and `load`: atomic, validated checkpoints in a format that never runs code.

A file is, in order:

1. a fixed prefix: magic bytes, the format version (`uint32`) and the length of the
   header (`uint64`), little-endian;
2. the header: UTF-8 JSON with one record per leaf (its `keystr` path and kind; for
   arrays the dtype name, shape and where its bytes lie in the payload; for Python
   scalars the value; for other objects their qualified name);
3. zero padding to a multiple of 64 bytes, then the payload: the raw little-endian
   bytes of every array, each starting on a 64-byte boundary;
4. a checksum of everything before it: its CRC-32 (`zlib.crc32`, 4 bytes,
   little-endian).

The checksum guards against accidents (a torn or truncated write, flipped bits), as
CRC-32 does in zip, gzip and PNG files: it catches every change of up to 32
consecutive bits and all but one in 2**32 of any others, and it costs a fraction of
SHA-256's time, which matters when checkpoints are written while a computation runs.
A truncated file is also caught by its length, which the header fixes.

Nothing in a file is ever executed or unpickled: the header is JSON, dtypes are looked
up by name among numeric ones, and objects that JSON cannot hold (functions,
activations) are not stored but checked by name against the `like` given to `load`.
"""

import json
import math
import os
import pathlib
import secrets
import struct
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax._src.lax.lax import _convert_element_type

from ._errors import BatchError, bullet_list, describe, leaf_name
from ._stack import batch_size, stack, unstack
from ._tree import is_array, is_key


Tree = TypeVar("Tree")

_MAGIC = b"\x89EQXBATCH\r\n\x1a\n"
_VERSION = 1
_PREFIX = struct.Struct(f"<{len(_MAGIC)}sIQ")
_ALIGN = 64
_CRC = struct.Struct("<I")
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
# Atomic writes.


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[BinaryIO], object],
    *,
    keep_cached: bool = True,
) -> None:
    """Calls `write(file)` on a temporary file beside `path`, then renames it to `path`.

    The temporary file is flushed and fsynced before the rename, and the folder after
    it, so after a crash `path` holds either its previous contents or the new ones,
    never a mixture. If `write` raises, the temporary file is removed and `path` is
    untouched.

    With `keep_cached=False` the file's pages are dropped from the operating system's
    cache once they are on disk (where the OS allows it): for files written once and
    rarely read back, such as the draws of a checkpointed run. Pages the cache has just
    freed are the cheapest for the next write to fill, and a long run does not push
    everything else out of the cache.
    """
    target = pathlib.Path(path)
    folder = target.parent
    # A random name opened with O_EXCL, rather than `tempfile` (which creates 0600
    # files), gives the file the permissions the user's umask asks for, as `open` does.
    temporary = folder / f".{target.name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    descriptor = os.open(temporary, flags, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
            if not keep_cached and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: pathlib.Path) -> None:
    # The rename is only durable once the folder's entry is on disk. Windows cannot open
    # a folder this way; there `os.replace` is as durable as it gets.
    if not hasattr(os, "O_DIRECTORY"):
        return
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ------------------------------------------------------------------------------------
# Leaf kinds and dtypes.


def _is_array_template(x: Any) -> bool:
    """Whether `x` stands for an array in `like`: an array or a `ShapeDtypeStruct`."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _storable(dtype: np.dtype) -> bool:
    """Numeric dtypes only: bool, ints, floats, complex and ml_dtypes' (bfloat16...)."""
    return dtype.kind in "biufc" or dtype.type.__module__ == "ml_dtypes"


def _numeric_dtype(name: Any) -> np.dtype:
    """The dtype called `name`, if it is one `_storable` allows; else `ValueError`."""
    try:
        dtype = jnp.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.name != name or not _storable(dtype):
        raise ValueError(f"not a numeric dtype: {name!r}")
    return dtype


def _object_name(x: Any) -> str:
    """What is recorded of a leaf JSON cannot hold: its qualified name or its type's."""
    module = getattr(x, "__module__", None)
    qualname = getattr(x, "__qualname__", None)
    if (
        isinstance(module, str)
        and isinstance(qualname, str)
        and not isinstance(x, type)
    ):
        return f"{module}.{qualname}"
    kind = type(x)
    return f"instance of {kind.__module__}.{kind.__qualname__}"


# ------------------------------------------------------------------------------------
# Saving.


def _host_data(leaf: Any, name: str) -> tuple[dict, np.ndarray | None]:
    """The header record of `leaf` and the array whose bytes go in the payload."""
    if isinstance(leaf, jax.core.Tracer):
        raise BatchError(
            f"`{name}` is a traced array ({describe(leaf)}): `save` reads concrete "
            "values on the host. Call it outside `jax.jit`, `jax.vmap` and friends."
        )
    if isinstance(leaf, jax.Array) and is_key(leaf):
        data = np.asarray(jax.random.key_data(leaf))
        record = {
            "kind": "key",
            "impl": str(jax.random.key_impl(leaf)),
            "shape": list(leaf.shape),
        }
        return record, data
    if is_array(leaf):
        data = np.asarray(leaf)
        if not _storable(data.dtype):
            raise BatchError(
                f"`{name}` is {describe(leaf)}; only numeric arrays (bool, integer, "
                "floating, complex and ml_dtypes such as bfloat16) can be saved."
            )
        weak = bool(getattr(leaf, "weak_type", False))
        return {"kind": "array", "shape": list(data.shape), "weak_type": weak}, data
    kind = _SCALAR_KINDS.get(type(leaf))
    if kind == "complex":
        return {"kind": kind, "value": [leaf.real, leaf.imag]}, None
    if kind is not None:
        return {"kind": kind, "value": leaf}, None
    return {"kind": "object", "name": _object_name(leaf)}, None


def _little_endian(data: np.ndarray) -> np.ndarray:
    """`data` C-contiguous and little-endian, copied only if it is not already."""
    # Not `np.ascontiguousarray`: it turns 0-d arrays into 1-d ones.
    return np.array(data, dtype=data.dtype.newbyteorder("<"), order="C", copy=None)


def _padding(offset: int) -> int:
    return -offset % _ALIGN


def save(path: str | os.PathLike, tree: Any) -> None:
    """Saves a pytree to a file, atomically, in a format that never runs code.

    Checkpoints must survive crashes and must not be a way to run someone else's code.
    `save` writes a temporary file in the same folder, flushes and fsyncs it, and only
    then renames it over `path`: a crash mid-write leaves the previous file whole. The
    format is a JSON header plus raw array bytes and a CRC-32 checksum, with no pickle,
    so `eb.load` can validate a file completely before trusting it.

    Arrays (JAX or NumPy, any numeric dtype including bfloat16 and other ml_dtypes),
    typed PRNG keys (with their implementation) and `bool`/`int`/`float`/`complex`/`str`
    leaves are stored. Any other leaf, such as an activation function, is not stored:
    its qualified name is recorded, and `eb.load` checks it against `like`, which
    supplies the object.

    **Arguments:**

    - `path`: the file to write. Its folder must exist; a previous file is replaced.
    - `tree`: any pytree: an Equinox module, a stacked ensemble, a list of members, a
        dict of optimiser states...

    **Returns:**

    `None`.

    **Raises:**

    `BatchError` if a leaf is a tracer (call `save` outside `jax.jit`), an array of a
    non-numeric dtype (strings, objects). `OSError` if the
    file cannot be written (no such folder, no permission, disk full); `path` is then
    left as it was.

    !!! Example

        ```python
        model = eqx.nn.MLP(2, 1, 8, 2, key=jr.key(0))
        eb.save("model.eqx", model)
        same = eb.load("model.eqx", like=model)
        ```
    """
    write_tree(path, tree)


def write_tree(path: str | os.PathLike, tree: Any, *, keep_cached: bool = True) -> None:
    """`eb.save`, with `atomic_write`'s `keep_cached`."""
    records = []
    arrays: list[np.ndarray] = []
    offset = 0
    for key_path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        record, data = _host_data(leaf, leaf_name("tree", key_path))
        record["path"] = jtu.keystr(key_path)
        if data is not None:
            data = _little_endian(data)
            offset += _padding(offset)
            record["dtype"] = data.dtype.name
            record["data_shape"] = list(data.shape)
            record["offset"] = offset
            record["nbytes"] = data.nbytes
            offset += data.nbytes
            arrays.append(data)
        records.append(record)
    header = json.dumps(
        {"leaves": records, "payload_nbytes": offset}, separators=(",", ":")
    ).encode()
    prefix = _PREFIX.pack(_MAGIC, _VERSION, len(header))

    def write(file: BinaryIO) -> None:
        crc = 0

        def put(chunk: bytes | memoryview) -> None:
            nonlocal crc
            crc = zlib.crc32(chunk, crc)
            file.write(chunk)

        put(prefix)
        put(header)
        put(bytes(_padding(len(prefix) + len(header))))
        written = 0
        for data in arrays:
            put(bytes(_padding(written)))
            written += _padding(written)
            put(data.reshape(-1).view(np.uint8).data)
            written += data.nbytes
        file.write(_CRC.pack(crc))

    atomic_write(path, write, keep_cached=keep_cached)


# ------------------------------------------------------------------------------------
# Reading and checking a file.


class _File:
    """A checked file: its leaf records by path, and its payload."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.data = pathlib.Path(path).read_bytes()
        self._check_envelope()
        self.records = self._parse_header()
        self.paths = [record["path"] for record in self.records]

    def _fail(self, problem: str, fix: str = "") -> BatchError:
        message = f"`{self.path}` {problem}"
        if fix:
            message += f" {fix}"
        return BatchError(message)

    def _check_envelope(self) -> None:
        data = self.data
        if not data.startswith(_MAGIC):
            raise self._fail(
                f"is not an eqx_batch checkpoint (its first bytes are {data[:16]!r}).",
                "Only files written by `eb.save` can be loaded.",
            )
        if len(data) < _PREFIX.size:
            raise self._fail(f"is truncated: it has only {len(data)} bytes.")
        _, version, header_nbytes = _PREFIX.unpack_from(data)
        if version > _VERSION:
            raise self._fail(
                f"was written in checkpoint format version {version}, but this "
                f"eqx_batch reads versions up to {_VERSION}.",
                "Upgrade eqx_batch to load it.",
            )
        if version != _VERSION:
            raise self._fail(f"has an unknown checkpoint format version, {version}.")
        if len(data) < _PREFIX.size + _CRC.size:
            raise self._fail(f"is truncated: it has only {len(data)} bytes.")
        crc = zlib.crc32(memoryview(data)[: -_CRC.size])
        if _CRC.pack(crc) != data[-_CRC.size :]:
            raise self._fail(
                "is corrupt or truncated: its CRC-32 checksum does not match its "
                f"contents ({len(data)} bytes).",
                "Load an earlier checkpoint.",
            )
        self.header_nbytes = header_nbytes
        self.payload_start = _PREFIX.size + header_nbytes
        self.payload_start += _padding(self.payload_start)

    def _parse_header(self) -> list[dict]:
        # The checksum guards against accidents, not against a crafted file: every field
        # is checked before it is used.
        raw = self.data[_PREFIX.size : _PREFIX.size + self.header_nbytes]
        try:
            header = json.loads(raw.decode())
            records = header["leaves"]
            payload_nbytes = header["payload_nbytes"]
            if not isinstance(records, list) or not _is_count(payload_nbytes):
                raise TypeError
            expected = self.payload_start + payload_nbytes + _CRC.size
            if expected != len(self.data):
                raise ValueError
            for record in records:
                self._check_record(record, payload_nbytes)
        except (ValueError, TypeError, KeyError, RecursionError, UnicodeDecodeError):
            raise self._fail(
                "has a malformed header, though its checksum matches.",
                "It was not written by `eb.save`.",
            ) from None
        return records

    def _check_record(self, record: Any, payload_nbytes: int) -> None:
        if not isinstance(record, dict) or not isinstance(record["path"], str):
            raise TypeError
        kind = record["kind"]
        if kind in ("array", "key"):
            shape, data_shape = record["shape"], record["data_shape"]
            offset, nbytes = record["offset"], record["nbytes"]
            if not all(_is_count(d) for d in [*shape, *data_shape, offset, nbytes]):
                raise TypeError
            dtype = _numeric_dtype(record["dtype"])
            if nbytes != math.prod(data_shape) * dtype.itemsize:
                raise ValueError
            if offset + nbytes > payload_nbytes:
                raise ValueError
            if kind == "array" and (
                shape != data_shape or record["weak_type"] not in (True, False)
            ):
                raise ValueError
            if kind == "key" and (
                not isinstance(record["impl"], str) or data_shape[: len(shape)] != shape
            ):
                raise ValueError
        elif kind == "complex":
            if (
                not all(isinstance(v, float) for v in record["value"])
                or len(record["value"]) != 2
            ):
                raise TypeError
        elif kind in ("bool", "int", "float", "str"):
            if type(record["value"]).__name__ != kind:
                raise TypeError
        elif kind == "object":
            if not isinstance(record["name"], str):
                raise TypeError
        else:
            raise ValueError

    def array(self, record: dict) -> np.ndarray:
        """The array of an `array` or `key` record, read-only, without a copy."""
        dtype = jnp.dtype(record["dtype"]).newbyteorder("<")
        start = self.payload_start + record["offset"]
        flat = np.frombuffer(
            self.data, dtype=np.uint8, count=record["nbytes"], offset=start
        )
        return flat.view(dtype).reshape(record["data_shape"])


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


# ------------------------------------------------------------------------------------
# Loading into `like`.


def _mismatch(
    name: str, file: _File, record: dict, problem: str, fix: str
) -> BatchError:
    return BatchError(
        f"`{name}` does not match the leaf `{record['path']}` of the file "
        f"`{file.path}`: {problem} {fix}"
    )


def _place(x: Any, like_leaf: Any) -> jax.Array:
    """`x` as a JAX array with the sharding of `like_leaf` if that was committed."""
    sharding = getattr(like_leaf, "sharding", None)
    if isinstance(like_leaf, jax.Array) and not like_leaf.committed:
        sharding = None
    return jnp.asarray(x) if sharding is None else jax.device_put(x, sharding)


def _restore_array(file: _File, record: dict, like_leaf: Any, name: str) -> Any:
    like_key = is_key(like_leaf)
    kind = "key" if like_key else "array"
    if record["kind"] != kind:
        raise _mismatch(
            name,
            file,
            record,
            f"`like` has {_KIND_PHRASES[kind]} there ({describe(like_leaf)}) but the "
            f"file has {_KIND_PHRASES[record['kind']]}.",
            "Pass a `like` built the same way as the saved tree.",
        )
    shape = tuple(record["shape"])
    if shape != like_leaf.shape:
        raise _mismatch(
            name,
            file,
            record,
            f"`like` has shape {like_leaf.shape} but the file has shape {shape}.",
            "Build `like` with the sizes the saved tree had.",
        )
    data = file.array(record)
    if like_key:
        try:
            key = jax.random.wrap_key_data(jnp.asarray(data), impl=record["impl"])
        except (ValueError, TypeError, KeyError):
            key = None
        if key is None or key.dtype != like_leaf.dtype:
            raise _mismatch(
                name,
                file,
                record,
                f"`like` has a key of type {like_leaf.dtype} but the file has a "
                f"{record['impl']!r} key.",
                "Create `like`'s keys with the same `impl`.",
            )
        return _place(key, like_leaf)
    # By name: the byte order of `like` does not matter, only the values do.
    if data.dtype.name != np.dtype(like_leaf.dtype).name:
        raise _mismatch(
            name,
            file,
            record,
            f"`like` has dtype {like_leaf.dtype} but the file has dtype {data.dtype}.",
            "Build `like` with the dtypes the saved tree had.",
        )
    if isinstance(like_leaf, np.generic):
        return data[()]
    if isinstance(like_leaf, np.ndarray):
        return data.copy()
    restored = _place(data, like_leaf)
    return _make_weak(restored) if record["weak_type"] else restored


def _make_weak(x: jax.Array) -> Any:
    # No public API makes a weak-typed array from data; this is the primitive that
    # `jnp` itself uses, and it leaves the data alone. Weak types are worth keeping:
    # they decide dtype promotion (a weak float32 scalar times bfloat16 is bfloat16).
    return _convert_element_type(x, x.dtype, weak_type=True)


def _restore_leaf(file: _File, record: dict, like_leaf: Any, name: str) -> Any:
    if _is_array_template(like_leaf):
        return _restore_array(file, record, like_leaf, name)
    kind = _SCALAR_KINDS.get(type(like_leaf), "object")
    if record["kind"] != kind:
        raise _mismatch(
            name,
            file,
            record,
            f"`like` has {describe(like_leaf)} ({type(like_leaf).__name__}) there but "
            f"the file has {_KIND_PHRASES[record['kind']]}.",
            "Pass a `like` built the same way as the saved tree.",
        )
    if kind == "object":
        if record["name"] != _object_name(like_leaf):
            raise _mismatch(
                name,
                file,
                record,
                f"`like` has {_object_name(like_leaf)} but the saved tree had "
                f"{record['name']}.",
                "Objects are not stored, only checked: `like` must hold the same one.",
            )
        return like_leaf
    if kind == "complex":
        return complex(*record["value"])
    return record["value"]


def _restore(file: _File, like: Tree, argname: str) -> Tree:
    """`like` with every leaf replaced by the file's; the paths are known to match."""
    leaves, treedef = jtu.tree_flatten_with_path(like)
    restored = [
        _restore_leaf(file, record, leaf, leaf_name(argname, path))
        for (path, leaf), record in zip(leaves, file.records, strict=True)
    ]
    return jtu.tree_unflatten(treedef, restored)


def _paths(tree: Any) -> list[str]:
    return [jtu.keystr(path) for path, _ in jtu.tree_flatten_with_path(tree)[0]]


def _list_length(file_paths: list[str], member_paths: list[str]) -> int | None:
    """`n` if the file holds a list of `n` trees with `member_paths`, else `None`."""
    if not member_paths or len(file_paths) % len(member_paths):
        return None
    length = len(file_paths) // len(member_paths)
    expected = [f"[{i}]{path}" for i in range(length) for path in member_paths]
    return length if expected == file_paths else None


def _with_types_of(tree: Tree, like: Tree) -> Tree:
    """`tree` with NumPy/JAX leaf types made those of `like`: stacking and unstacking
    may turn a NumPy scalar into a 0-d array, and `load` promises `like`'s types."""

    def convert(x: Any, like_leaf: Any) -> Any:
        if isinstance(like_leaf, np.generic):
            return np.asarray(x)[()]
        if isinstance(like_leaf, np.ndarray):
            return np.asarray(x)
        return x

    return jtu.tree_map(convert, tree, like)


def _load_stacked_into_list(file: _File, like: Any) -> Any:
    count = len(like)
    for record in file.records:
        if record["kind"] in ("array", "key") and record["shape"][:1] != [count]:
            raise BatchError(
                f"`like` is a list of {count} members but the file `{file.path}` holds "
                f"one stacked tree whose leaf `{record['path']}` has shape "
                f"{tuple(record['shape'])}: a stacked leaf needs {count} along its "
                f"leading (member) axis. Pass a list of as many members as were saved."
            )
    members = unstack(_restore(file, stack(list(like)), "like[*]"))
    return type(like)(
        _with_types_of(m, member) for m, member in zip(members, like, strict=True)
    )


def _load_list_into_stacked(file: _File, like: Any, length: int) -> Any:
    count = batch_size(like)
    if length != count:
        path, leaf = next(
            (path, leaf)
            for path, leaf in jtu.tree_flatten_with_path(like)[0]
            if _is_array_template(leaf)
        )
        raise BatchError(
            f"the file `{file.path}` holds a list of {length} members but `like` is "
            f"stacked with {count} members (`{leaf_name('like', path)}` has shape "
            f"{np.shape(leaf)}). Pass a `like` stacked from as many members as were "
            "saved."
        )
    stacked = stack(_restore(file, unstack(like), "unstack(like)"))
    return _with_types_of(stacked, like)


def _structure_error(file: _File, like_paths: list[str]) -> BatchError:
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


def load(path: str | os.PathLike, like: Tree) -> Tree:
    """Loads a pytree saved by `eb.save`, checked leaf by leaf against `like`.

    A checkpoint is only useful if it loads into the model you have now, and a file
    from elsewhere must not be able to run code. `load` checks the file's magic bytes,
    version and checksum, then checks every leaf against `like` (structure,
    shapes, dtypes, PRNG key implementations, the names of functions) before
    returning anything. Nothing is unpickled.

    Stacked and unstacked checkpoints read each other: a file saved from a stacked
    tree (every array with a leading member axis, as `eb.stack` makes it) loads into a
    list of members when `like` is a list, and a file saved from a list of members
    loads into a stacked `like`.

    **Arguments:**

    - `path`: a file written by `eb.save`.
    - `like`: a pytree with the structure of the saved one, such as a freshly
        constructed model. Its array leaves may be JAX or NumPy arrays or
        `jax.ShapeDtypeStruct`s (e.g. from `eqx.filter_eval_shape`), so nothing needs
        to be initialised just to be overwritten.

    **Returns:**

    A pytree with the structure of `like` holding the file's values. Leaves have the
    types of `like`'s: JAX arrays (on `like`'s devices when it was placed on them) for
    JAX arrays and `ShapeDtypeStruct`s, NumPy arrays for NumPy arrays, typed PRNG keys
    for keys. Python scalars are the saved values; other objects (functions) are
    `like`'s own.

    **Raises:**

    `BatchError` if the file is not an eqx_batch checkpoint, is truncated or corrupt
    (checksum mismatch), or comes from a newer format version; if `like`'s structure
    differs from the saved tree's (listing the leaves only one of them has); if a leaf
    differs in kind, shape, dtype, key implementation or function name (naming the leaf
    and both values); or, between stacked and list checkpoints, if the member counts
    differ (naming the leaf and both counts). `OSError` (e.g. `FileNotFoundError`) if
    the file cannot be read.

    !!! Example

        ```python
        members = [eqx.nn.Linear(2, 3, key=k) for k in jr.split(jr.key(0), 4)]
        eb.save("ensemble.eqx", eb.stack(members))
        stacked = eb.load("ensemble.eqx", like=eb.stack(members))
        as_list = eb.load("ensemble.eqx", like=members)  # a list of 4 Linear layers
        ```
    """
    file = _File(path)
    like_paths = _paths(like)
    members: Any = like
    if file.paths == like_paths:
        return _restore(file, like, "like")
    if type(like) in (list, tuple) and like and file.paths == _paths(members[0]):
        return _load_stacked_into_list(file, like)
    length = _list_length(file.paths, like_paths)
    if length is not None:
        return _load_list_into_stacked(file, like, length)
    raise _structure_error(file, like_paths)
