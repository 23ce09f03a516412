"""`save` and `load`: pytrees in safetensors files, written atomically, read validated.

A file is a [safetensors](https://huggingface.co/docs/safetensors) file, so any
safetensors reader (`safetensors.numpy.load_file`, PyTorch, Rust, the Hub's viewer)
sees every array leaf as a tensor named by its `jax.tree_util.keystr` path
(`.layers[0].weight`). What safetensors cannot express goes in its string metadata,
under keys that start with `eqx_batch.`:

- `eqx_batch.header_crc32` and `eqx_batch.data_crc32`: CRC-32s (8 hex digits) of the
    header, taken with these 16 digits as zeros, and of the tensor data. `eb.save`
    writes them first in the header, at a fixed place, so that they are found and
    checked before anything else in the file is interpreted.
- `eqx_batch.version`: the format version, `"1"`.
- `eqx_batch.leaves`: JSON, one record per leaf in flattening order: its path and kind;
    for arrays the true dtype, shape and weak type; for typed PRNG keys the
    implementation's name (the tensor holds the key data); for `bool`, `int`, `float`,
    `complex` and `str` leaves the value; for other objects (functions) their
    qualified name, checked against `like` on loading.
- entries of the caller (`write_tree(metadata=...)`), whose keys must not start with
    `eqx_batch.`.

Dtypes that `safetensors.numpy` reads natively (bool, integers, float16/32/64,
bfloat16) are stored as such; others (complex, float8 variants, int4...) as raw
little-endian bytes, a `U8` tensor with one extra trailing axis of the item size, their
dtype named in `eqx_batch.leaves`.

The checksums guard against accidents (torn or truncated copies, flipped bits), as
CRC-32 does in zip, gzip and PNG files; a crafted file can carry valid checksums, so
every field is checked before it is used, and the safetensors package (a maintained,
fuzzed parser) reads the tensors. Nothing is ever executed or unpickled.
"""

import contextlib
import functools
import json
import os
import pathlib
import secrets
import stat
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple, TypeVar

import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import safetensors

from ._errors import BatchError, bullet_list, describe, KeyPath, leaf_name
from ._stack import unstack
from ._tree import is_array, is_key


Tree = TypeVar("Tree")


class BadFileError(BatchError):
    """The file itself cannot be read as an eqx_batch file.

    It is not a regular file, not an eqx_batch file (junk, another tool's safetensors
    file), corrupt or truncated, or from a newer format version: no `like` would
    load it. A plain `BatchError` from `load`/`read_tree` means the file is sound but
    does not fit `like`.
    """


_NAMESPACE = "eqx_batch."
_VERSION = 1
_LENGTH = struct.Struct("<Q")
# Where `eb.save` puts the checksums: first in the header, so at fixed offsets.
_HEAD = b'{"__metadata__":{"eqx_batch.header_crc32":"'
_MIDDLE = b'","eqx_batch.data_crc32":"'
_HEADER_CRC_AT = _LENGTH.size + len(_HEAD)
_DATA_CRC_AT = _HEADER_CRC_AT + 8 + len(_MIDDLE)
_FIXED_END = _DATA_CRC_AT + 8
# safetensors refuses headers over 100 MB; so do we, before reading one.
_MAX_HEADER = 100_000_000
_CHUNK = 1 << 22
# Files of the container format eqx_batch wrote before it wrote safetensors.
_OLD_MAGIC = b"\x89EQXBATCH\r\n\x1a\n"
_NATIVE = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "bfloat16": "BF16",
}
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


def _describe(x: Any) -> str:
    if isinstance(x, jax.ShapeDtypeStruct):
        return f"{x.dtype}[{','.join(map(str, x.shape))}]"
    return describe(x)


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


def _stored_as(dtype: np.dtype, shape: Sequence[int]) -> tuple[str, list[int]]:
    """The safetensors dtype and shape of an array: native, or raw bytes (`U8`)."""
    code = _NATIVE.get(dtype.name)
    if code is not None:
        return code, list(shape)
    return "U8", [*shape, dtype.itemsize]


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


@functools.cache
def _key_dtype(impl: str) -> Any:
    """The dtype of typed keys of the implementation named `impl` (traced, not run)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


@functools.lru_cache(maxsize=64)
def _weak_identity(specs: tuple[jax.ShapeDtypeStruct, ...]) -> Callable:
    return jax.jit(lambda *xs: xs).lower(*specs).compile()


def make_weak(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """`arrays` with the same values, dtypes and shardings, weakly typed.

    Weak types decide dtype promotion (a weak float32 scalar times a bfloat16 array is
    bfloat16), so a round trip must keep them. Public JAX makes weak arrays only from
    Python scalars, or as the outputs of a program whose inputs are weak: this runs
    one identity program compiled for weak inputs, one compilation per combination of
    shapes and dtypes (cached), whatever the number of arrays.
    """
    if not arrays:
        return []
    specs = tuple(
        jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=True, sharding=x.sharding)
        for x in arrays
    )
    return list(_weak_identity(specs)(*arrays))


# ------------------------------------------------------------------------------------
# Writing.


class _Tensor(NamedTuple):
    name: str
    code: str
    shape: list[int]
    data: np.ndarray  # C-contiguous, little-endian


def _little_endian(data: np.ndarray) -> np.ndarray:
    """`data` C-contiguous and little-endian, copied only if it is not already."""
    # Not `np.ascontiguousarray`: it turns 0-d arrays into 1-d ones.
    return np.array(data, dtype=data.dtype.newbyteorder("<"), order="C", copy=None)


def _flatten_for_file(tree: Any) -> tuple[list[dict], list[_Tensor]]:
    """The leaf records of `tree` and its tensors, fetched from devices in one batch."""
    leaves = jtu.tree_flatten_with_path(tree)[0]
    records: list[dict] = []
    on_device: list[Any] = []
    for key_path, leaf in leaves:
        name = leaf_name("tree", key_path)
        record: dict[str, Any] = {"path": jtu.keystr(key_path)}
        if isinstance(leaf, jax.core.Tracer):
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
            if not _storable(np.dtype(leaf.dtype)):
                raise BatchError(
                    f"`{name}` is {describe(leaf)}; only numeric arrays (bool, "
                    "integer, floating, complex and ml_dtypes such as bfloat16) can "
                    "be saved."
                )
            weak = bool(getattr(leaf, "weak_type", False))
            record.update(
                kind="array",
                dtype=np.dtype(leaf.dtype).name,
                shape=list(np.shape(leaf)),
                weak=weak,
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
    hosts = iter(jax.device_get(on_device))
    tensors = []
    for record in records:
        if record["kind"] in ("array", "key"):
            data = _little_endian(np.asarray(next(hosts)))
            code, shape = _stored_as(data.dtype, data.shape)
            tensors.append(_Tensor(record["path"], code, shape, data))
    names = [tensor.name for tensor in tensors]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise BatchError(
            f"`tree` has several array leaves with the path {twice[0]!r}, and a file "
            "names each array by its path. Give the leaves distinct keys."
        )
    return records, tensors


def _header(
    records: list[dict], tensors: list[_Tensor], metadata: Mapping[str, str]
) -> tuple[bytes, list[_Tensor]]:
    """The length prefix and header, checksums included, padded to a multiple of 8
    bytes; and the tensors in the order of their data."""
    # Largest items first keeps every tensor aligned to its item size, as
    # safetensors' own writer does, for readers that map the file.
    ordered = sorted(tensors, key=lambda t: -t.data.dtype.itemsize)
    entries = {}
    offset = 0
    data_crc = 0
    for tensor in ordered:
        entries[tensor.name] = {
            "dtype": tensor.code,
            "shape": tensor.shape,
            "data_offsets": [offset, offset + tensor.data.nbytes],
        }
        offset += tensor.data.nbytes
        data_crc = zlib.crc32(_raw(tensor.data), data_crc)
    ours = {
        f"{_NAMESPACE}version": str(_VERSION),
        f"{_NAMESPACE}leaves": json.dumps(records, separators=(",", ":")),
    }
    rest = json.dumps({**ours, **metadata}, separators=(",", ":"))[1:]
    header = _HEAD + b"00000000" + _MIDDLE + b"00000000" + b'",' + rest.encode()
    if entries:
        header += b"," + json.dumps(entries, separators=(",", ":"))[1:].encode()
    else:
        header += b"}"
    header += b" " * (-(len(header) + _LENGTH.size) % 8)
    prefix = _LENGTH.pack(len(header))
    header_crc = zlib.crc32(prefix + header)
    patched = bytearray(prefix + header)
    patched[_HEADER_CRC_AT : _HEADER_CRC_AT + 8] = b"%08x" % header_crc
    patched[_DATA_CRC_AT : _DATA_CRC_AT + 8] = b"%08x" % data_crc
    return bytes(patched), ordered


def _raw(data: np.ndarray) -> memoryview:
    return data.reshape(-1).view(np.uint8).data


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    entries = dict(metadata or {})
    for key, value in entries.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise BatchError(
                f"`metadata` maps {key!r} to {value!r}; safetensors metadata maps "
                "strings to strings."
            )
        if key.startswith(_NAMESPACE):
            raise BatchError(
                f"`metadata` has the key {key!r}; keys starting with {_NAMESPACE!r} "
                "are eqx_batch's own. Choose another name."
            )
    return entries


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
    entries = _check_metadata(metadata)
    records, tensors = _flatten_for_file(tree)
    header, ordered = _header(records, tensors, entries)

    def write(file: BinaryIO) -> None:
        file.write(header)
        for tensor in ordered:
            file.write(_raw(tensor.data))

    atomic_write(path, write, keep_cached=keep_cached)


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
# Opening and checking a file.


def _read_at(descriptor: int, offset: int, count: int) -> bytes:
    """`count` bytes at `offset`, fewer only if the file ends first."""
    chunks = []
    while count > 0:
        chunk = os.pread(descriptor, min(count, _CHUNK), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def _file_kind(mode: int) -> str:
    for test, phrase in [
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]:
        if test(mode):
            return phrase
    return "not a regular file"


def _open_regular(path: str) -> tuple[int, int]:
    """A read-only descriptor of `path` and its size; refuses anything but a file."""
    # Non-blocking, so that opening a FIFO with no writer returns at once; a regular
    # file reads the same either way.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    descriptor = os.open(path, flags)
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        raise BadFileError(
            f"`{path}` is {_file_kind(info.st_mode)}, not a regular file: only files "
            "written by `eb.save` can be loaded."
        )
    return descriptor, info.st_size


def _similar(head: bytes) -> bool:
    """Whether `head` has `eb.save`'s fixed opening, give or take one damaged byte."""
    expected = (
        (_LENGTH.size, _HEAD),
        (_HEADER_CRC_AT + 8, _MIDDLE),
    )
    differing = 0
    seen = 0
    for start, part in expected:
        got = head[start : start + len(part)]
        seen += len(got)
        differing += sum(a != b for a, b in zip(got, part, strict=False))
    return seen > 0 and differing <= 1


def _crc_digits(raw: bytes | bytearray, at: int) -> int | None:
    digits = raw[at : at + 8]
    if len(digits) != 8 or digits.strip(b"0123456789abcdef"):
        return None
    return int(digits, 16)


class _Envelope(NamedTuple):
    """What the checks of a file's opening established."""

    header: dict[str, Any]
    metadata: dict[str, str]
    data_start: int
    data_crc: int


def _not_ours(path: str, head: bytes) -> BadFileError:
    return BadFileError(
        f"`{path}` is not an eqx_batch file (its first bytes are {head[:16]!r}). "
        "Only files written by `eb.save` can be loaded."
    )


def _corrupt(path: str, problem: str) -> BadFileError:
    return BadFileError(
        f"`{path}` is corrupt: {problem}. It was damaged after `eb.save` wrote it (an "
        "interrupted copy, a failing disk), so its contents cannot be trusted."
    )


def _parse_header(raw: bytes) -> Any:
    try:
        return json.loads(raw[_LENGTH.size :].decode())
    except (ValueError, RecursionError):
        return None


def _check_foreign(
    path: str, descriptor: int, size: int, head: bytes, header_nbytes: int
) -> BadFileError:
    """The error for a file without `eb.save`'s opening: junk, or another tool's."""
    if header_nbytes > _MAX_HEADER or _LENGTH.size + header_nbytes > size:
        return _not_ours(path, head)
    header = _parse_header(_read_at(descriptor, 0, _LENGTH.size + header_nbytes))
    if not isinstance(header, dict):
        return _not_ours(path, head)
    metadata = header.get("__metadata__")
    if isinstance(metadata, dict) and any(
        isinstance(k, str) and k.startswith(_NAMESPACE) for k in metadata
    ):
        return _corrupt(
            path,
            "it has eqx_batch metadata, but its checksums are not where `eb.save` "
            "puts them (or another tool rewrote the file)",
        )
    try:
        with safetensors.safe_open(_descriptor_path(path, descriptor), "np") as file:
            count = len(list(file.keys()))
    except Exception:  # noqa: BLE001 - any failure of the parser means "not a file of it"
        return _not_ours(path, head)
    return BadFileError(
        f"`{path}` is a safetensors file ({count} tensor{'' if count == 1 else 's'}) "
        "but not an eqx_batch file: it lacks the metadata `eb.save` writes (the "
        "tree's structure, Python scalars, key implementations, checksums), so it "
        "cannot be checked against `like`. Read its arrays with "
        "`safetensors.numpy.load_file`, put them into your tree (e.g. with "
        "`eqx.tree_at`), and `eb.save` that to get a file `eb.load` reads."
    )


def _descriptor_path(path: str, descriptor: int) -> str:
    # The parser opens files by name. Naming the descriptor makes it read the very file
    # that was checked, even if `eb.save` replaces `path` meanwhile.
    by_descriptor = f"/dev/fd/{descriptor}"
    return by_descriptor if os.path.exists(by_descriptor) else path


def _check_envelope(path: str, descriptor: int, size: int) -> _Envelope:
    """Checks sizes and the header's checksum and version, without reading tensors."""
    head = _read_at(descriptor, 0, _FIXED_END)
    if head.startswith(_OLD_MAGIC):
        raise BadFileError(
            f"`{path}` was written by an earlier eqx_batch, in the container format "
            "it used before its files became safetensors files. Load it with the "
            "eqx_batch that wrote it and `eb.save` it again."
        )
    if size < _LENGTH.size:
        raise BadFileError(
            f"`{path}` is not an eqx_batch file: it has {size} bytes, fewer than any "
            "safetensors file (empty, or cut short)."
        )
    (header_nbytes,) = _LENGTH.unpack_from(head)
    if not _similar(head):
        raise _check_foreign(path, descriptor, size, head, header_nbytes)
    if size < _FIXED_END:
        raise _corrupt(path, f"it is truncated to {size} bytes")
    if header_nbytes > _MAX_HEADER or _LENGTH.size + header_nbytes > size:
        raise _corrupt(
            path,
            f"its header claims {header_nbytes} bytes but the whole file has {size}"
            if header_nbytes <= _MAX_HEADER
            else f"its header claims {header_nbytes} bytes, more than safetensors' "
            f"limit of {_MAX_HEADER}",
        )
    raw = bytearray(_read_at(descriptor, 0, _LENGTH.size + header_nbytes))
    header_crc = _crc_digits(raw, _HEADER_CRC_AT)
    data_crc = _crc_digits(raw, _DATA_CRC_AT)
    raw[_HEADER_CRC_AT : _HEADER_CRC_AT + 8] = b"0" * 8
    raw[_DATA_CRC_AT : _DATA_CRC_AT + 8] = b"0" * 8
    if header_crc is None or data_crc is None or zlib.crc32(raw) != header_crc:
        raise _corrupt(path, "the CRC-32 checksum of its header does not match it")
    header = _parse_header(bytes(raw))
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        raise _malformed(path)
    version = metadata.get(f"{_NAMESPACE}version")
    if not isinstance(version, str) or not version.isdigit() or len(version) > 9:
        raise _malformed(path)
    if int(version) > _VERSION:
        raise BadFileError(
            f"`{path}` was written in eqx_batch file format version {version}, but "
            f"this eqx_batch reads versions up to {_VERSION}. Upgrade eqx_batch to "
            "load it."
        )
    if int(version) != _VERSION:
        raise _malformed(path)
    assert isinstance(header, dict)
    data_start = _LENGTH.size + header_nbytes
    claimed = _data_nbytes(header)
    if claimed is None:
        raise _malformed(path)
    if claimed != size - data_start:
        raise _corrupt(
            path,
            f"its header describes {claimed} bytes of tensor data but "
            f"{size - data_start} follow it (truncated, or extended)",
        )
    return _Envelope(header, metadata, data_start, data_crc)


def _data_nbytes(header: dict[str, Any]) -> int | None:
    """The end of the last tensor the header describes; `None` if ill-formed."""
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_count(o) for o in offsets)
        ):
            return None
        end = max(end, offsets[1])
    return end


def _malformed(path: str) -> BadFileError:
    return BadFileError(
        f"`{path}` has a malformed header, though its checksums match: it was not "
        "written by `eb.save`."
    )


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


class _File:
    """A checked eqx_batch file: its leaf records, and its tensors on demand.

    The records are checked against the header's tensor entries when the file is
    opened; the data's checksum and the safetensors parser come in at the first
    tensor read, after `like` has been checked (cheaper than streaming all the data,
    and a hostile header's sizes never reach the parser's memory map).
    """

    def __init__(
        self,
        path: str,
        envelope: _Envelope,
        read_tensors: Callable[[], dict[str, np.ndarray]],
    ):
        self.path = path
        self._read_tensors = read_tensors
        self._tensors: dict[str, np.ndarray] | None = None
        metadata = envelope.metadata
        self.caller_metadata = {
            k: v for k, v in metadata.items() if not k.startswith(_NAMESPACE)
        }
        entries = {k: v for k, v in envelope.header.items() if k != "__metadata__"}
        try:
            records = json.loads(metadata[f"{_NAMESPACE}leaves"])
            if not isinstance(records, list):
                raise TypeError
            for record in records:
                self._check_record(record, entries)
            if entries:
                raise ValueError
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            raise _malformed(path) from None
        self.records: list[dict] = records
        self.paths = [record["path"] for record in records]

    @staticmethod
    def _check_record(record: Any, entries: dict[str, Any]) -> None:
        """Checks a leaf record, and pops its tensor's entry from `entries`.

        Adds what the checks parsed to an array record: `numpy_dtype` (the dtype the
        file names) and `stored_shape` (the tensor's shape in the file).
        """
        if not isinstance(record, dict) or not isinstance(record["path"], str):
            raise TypeError
        kind = record["kind"]
        if kind in ("array", "key"):
            shape = record["shape"]
            if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
                raise TypeError
            entry = entries.pop(record["path"])
            code, stored_shape = entry["dtype"], entry["shape"]
            if kind == "array":
                dtype = _numeric_dtype(record["dtype"])
                if (code, stored_shape) != _stored_as(dtype, shape):
                    raise ValueError
                record["numpy_dtype"] = dtype
                if record["weak"] not in (True, False):
                    raise TypeError
            elif not (
                isinstance(record["impl"], str)
                and code == "U32"
                and isinstance(stored_shape, list)
                and stored_shape[: len(shape)] == shape
            ):
                raise ValueError
            record["stored_shape"] = stored_shape
        elif kind == "complex":
            value = record["value"]
            if len(value) != 2 or not all(isinstance(v, float) for v in value):
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
        """The data of an `array` record (in its true dtype) or a `key` record."""
        if self._tensors is None:
            self._tensors = self._read_tensors()
        data = self._tensors[record["path"]]
        # The parser read the header too: it must have seen what the checks saw.
        if list(data.shape) != record["stored_shape"]:
            raise _malformed(self.path)
        if record["kind"] == "array":
            dtype = record["numpy_dtype"]
            if data.dtype != dtype:
                data = data.view(dtype.newbyteorder("<")).reshape(record["shape"])
        return data


def _too_big(path: str, what: str) -> BatchError:
    return BatchError(
        f"`{path}` is sound, but {what} does not fit in the memory this process may "
        "use (see `ulimit -v` and the machine's free memory)."
    )


@contextlib.contextmanager
def _opened(path: str | os.PathLike) -> Iterator[_File]:
    """`path` checked but for its data's checksum, left to the first tensor read."""
    name = os.fspath(path)
    descriptor, size = _open_regular(name)
    try:
        envelope = _check_envelope(name, descriptor, size)
        yield _File(
            name,
            envelope,
            functools.partial(_read_tensors, name, descriptor, envelope, size),
        )
    finally:
        os.close(descriptor)


def _read_tensors(
    path: str, descriptor: int, envelope: _Envelope, size: int
) -> dict[str, np.ndarray]:
    """Every tensor, read by the safetensors parser, and checked against the data's
    checksum. Every tensor is needed: a file's leaves all map to `like`'s."""
    try:
        reader = safetensors.safe_open(_descriptor_path(path, descriptor), "np")
    except Exception as e:  # noqa: BLE001 - the parser's errors name no path
        if isinstance(e, MemoryError) or "os error 12" in str(e):
            raise _too_big(path, f"mapping its {size} bytes") from None
        raise BadFileError(
            f"`{path}` passed its checksums but safetensors cannot read it ({e}): it "
            "was not written by `eb.save`."
        ) from None
    entries = {k: v for k, v in envelope.header.items() if k != "__metadata__"}
    tensors = {}
    crc = 0
    with reader:
        # In the order of the data, so that the checksums add up as the file's bytes.
        for name in sorted(entries, key=lambda n: entries[n]["data_offsets"]):
            try:
                tensors[name] = reader.get_tensor(name)
            except MemoryError:
                raise _too_big(path, f"its tensor `{name}`") from None
            crc = zlib.crc32(_raw(tensors[name]), crc)
    if crc != envelope.data_crc:
        raise _corrupt(path, "the CRC-32 checksum of its tensor data does not match it")
    return tensors


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The caller metadata of a file written by `write_tree`, without reading tensors.

    The file is checked as by `read_tree` except for the checksum of the tensor data
    (which would read it all). Raises `BadFileError` for a file that is not a sound
    eqx_batch file, `OSError` if it cannot be opened.
    """
    name = os.fspath(path)
    descriptor, size = _open_regular(name)
    try:
        metadata = _check_envelope(name, descriptor, size).metadata
    finally:
        os.close(descriptor)
    return {k: v for k, v in metadata.items() if not k.startswith(_NAMESPACE)}


# ------------------------------------------------------------------------------------
# Loading into `like`.


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
    file: _File,
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
            _describe(like_leaf)
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


def _value(file: _File, record: dict, like_leaf: Any) -> Any:
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


def _restore(file: _File, like: Any, argname: str, on_host: bool) -> Any:
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
    file: _File,
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
    file: _File, like: Any, argname: str, length: int, on_host: bool
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


def _check_shared(file: _File, name: str, records: list[dict], like_leaf: Any) -> None:
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


def _stacked_value(file: _File, records: list[dict], like_leaf: Any) -> Any:
    """The value of a stacked leaf from its members' records (checked)."""
    values = [_value(file, record, like_leaf) for record in records]
    first = values[0]
    if not isinstance(first, _Stored):
        return first
    return _Stored(
        np.stack([v.data for v in values]), all(v.weak for v in values), first.impl
    )


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


def _load_into(file: _File, like: Any, argname: str, on_host: bool) -> Any:
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
    with _opened(path) as file:
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
