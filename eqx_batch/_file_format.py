"""The eqx_batch file format: leaf records and tensors in a safetensors file, with
checksums; written atomically, opened with bounded, validated reads.

A file is a [safetensors](https://huggingface.co/docs/safetensors) file, so any
safetensors reader (`safetensors.numpy.load_file`, PyTorch, Rust, the Hub's viewer)
sees every array leaf as a tensor named by its `jax.tree_util.keystr` path
(`.layers[0].weight`). What safetensors cannot express goes in its string metadata,
under keys that start with `eqx_batch.`:

- `eqx_batch.header_crc32` and `eqx_batch.data_crc32`: CRC-32s (8 hex digits) of the
    header, taken with these 16 digits as zeros, and of the tensor data. `write_file`
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

This module knows records and tensors, not trees: `_serialise.py` turns a tree into
records and arrays for `write_file`, and the records of a `CheckedFile` back into a
tree shaped like `like`.
"""

import contextlib
import functools
import json
import os
import stat
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple

import jax.numpy as jnp
import numpy as np
import safetensors

from ._atomic import atomic_write
from ._errors import BatchError


class BadFileError(BatchError):
    """The file itself cannot be read as an eqx_batch file.

    It is not a regular file, not an eqx_batch file (junk, another tool's safetensors
    file), corrupt or truncated, or from a newer format version: no `like` would
    load it. A plain `BatchError` from `load`/`read_tree` means the file is sound but
    does not fit `like`.
    """


class ForeignFileError(BadFileError):
    """The file is not an eqx_batch file at all: junk, or another tool's file."""


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


# ------------------------------------------------------------------------------------
# Dtypes.


def storable(dtype: np.dtype) -> bool:
    """Numeric dtypes only: bool, ints, floats, complex and ml_dtypes' (bfloat16...)."""
    return dtype.kind in "biufc" or dtype.type.__module__ == "ml_dtypes"


def _numeric_dtype(name: Any) -> np.dtype:
    """The dtype called `name`, if it is one `storable` allows; else `ValueError`."""
    try:
        dtype = jnp.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.name != name or not storable(dtype):
        raise ValueError(f"not a numeric dtype: {name!r}")
    return dtype


def _stored_as(dtype: np.dtype, shape: Sequence[int]) -> tuple[str, list[int]]:
    """The safetensors dtype and shape of an array: native, or raw bytes (`U8`)."""
    code = _NATIVE.get(dtype.name)
    if code is not None:
        return code, list(shape)
    return "U8", [*shape, dtype.itemsize]


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


def _raw(data: np.ndarray) -> memoryview:
    return data.reshape(-1).view(np.uint8).data


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


def check_caller_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The caller's metadata as a dict; raises `BatchError` for an entry that is not
    a string to a string or whose key starts with `eqx_batch.`."""
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


def write_file(
    path: str | os.PathLike,
    records: list[dict],
    arrays: Sequence[Any],
    metadata: Mapping[str, str],
    *,
    keep_cached: bool,
) -> None:
    """Writes leaf records and their arrays as an eqx_batch file, with `atomic_write`.

    `records` are the leaf records described above, whose `path`s name distinct
    tensors; `arrays` holds the host data of their `array` and `key` records, in
    order (key data for keys); `metadata` is the caller's, as `check_caller_metadata`
    returns it.
    """
    hosts = iter(arrays)
    tensors = []
    for record in records:
        if record["kind"] in ("array", "key"):
            data = _little_endian(np.asarray(next(hosts)))
            code, shape = _stored_as(data.dtype, data.shape)
            tensors.append(_Tensor(record["path"], code, shape, data))
    header, ordered = _header(records, tensors, metadata)

    def write(file: BinaryIO) -> None:
        file.write(header)
        for tensor in ordered:
            file.write(_raw(tensor.data))

    atomic_write(path, write, keep_cached=keep_cached)


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
    data_crc: int


def _not_ours(path: str, head: bytes) -> BadFileError:
    return ForeignFileError(
        f"`{path}` is not an eqx_batch file (its first bytes are {head[:16]!r}). "
        "Only files written by `eb.save` can be loaded."
    )


def _corrupt(path: str, problem: str) -> BadFileError:
    return BadFileError(
        f"`{path}` is corrupt: {problem}. It was damaged after `eb.save` wrote it (an "
        "interrupted copy, a failing disk), so its contents cannot be trusted."
    )


def _malformed(path: str) -> BadFileError:
    return BadFileError(
        f"`{path}` has a malformed header, though its checksums match: it was not "
        "written by `eb.save`."
    )


def _parse_header(raw: bytes) -> Any:
    try:
        return json.loads(raw[_LENGTH.size :].decode())
    except (ValueError, RecursionError):
        return None


def _descriptor_path(path: str, descriptor: int) -> str:
    # The parser opens files by name. Naming the descriptor makes it read the very file
    # that was checked, even if `eb.save` replaces `path` meanwhile.
    by_descriptor = f"/dev/fd/{descriptor}"
    return by_descriptor if os.path.exists(by_descriptor) else path


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
    return ForeignFileError(
        f"`{path}` is a safetensors file ({count} tensor{'' if count == 1 else 's'}) "
        "but not an eqx_batch file: it lacks the metadata `eb.save` writes (the "
        "tree's structure, Python scalars, key implementations, checksums), so it "
        "cannot be checked against `like`. Read its arrays with "
        "`safetensors.numpy.load_file`, put them into your tree (e.g. with "
        "`eqx.tree_at`), and `eb.save` that to get a file `eb.load` reads."
    )


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


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


def _check_envelope(path: str, descriptor: int, size: int) -> _Envelope:
    """Checks sizes and the header's checksum and version, without reading tensors."""
    head = _read_at(descriptor, 0, _FIXED_END)
    if size < _LENGTH.size:
        raise ForeignFileError(
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
    return _Envelope(header, metadata, data_crc)


class CheckedFile:
    """A checked eqx_batch file: its leaf records, and its tensors on demand.

    `records` are the file's leaf records, in flattening order, each checked to be
    well formed; an `array` record also holds `numpy_dtype` (the dtype it names),
    and `array` and `key` records `stored_shape` (their tensor's shape in the file).
    `paths` are the records' paths, and `caller_metadata` the caller's entries.

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


@contextlib.contextmanager
def open_checked(path: str | os.PathLike) -> Iterator[CheckedFile]:
    """`path` checked but for its data's checksum, left to the first tensor read."""
    name = os.fspath(path)
    descriptor, size = _open_regular(name)
    try:
        envelope = _check_envelope(name, descriptor, size)
        yield CheckedFile(
            name,
            envelope,
            functools.partial(_read_tensors, name, descriptor, envelope, size),
        )
    finally:
        os.close(descriptor)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The caller metadata of a file written by `write_tree`, without reading tensors.

    The file's sizes, header checksum and version are checked as by `read_tree`; its
    leaf records and tensor data (which would read it all) are not. Raises
    `BadFileError` for a file that is not a sound eqx_batch file, `OSError` if it
    cannot be opened.
    """
    name = os.fspath(path)
    descriptor, size = _open_regular(name)
    try:
        metadata = _check_envelope(name, descriptor, size).metadata
    finally:
        os.close(descriptor)
    return {k: v for k, v in metadata.items() if not k.startswith(_NAMESPACE)}
