"""The layout of an eqx_batch file: leaf records and tensors in a safetensors file,
with checksums; and writing one, atomically.

A file is a [safetensors](https://huggingface.co/docs/safetensors) file, so any
safetensors reader (`safetensors.numpy.load_file`, PyTorch, Rust, the Hub's viewer)
sees every array leaf as a tensor named by its `jax.tree_util.keystr` path
(`.layers[0].weight`). What safetensors cannot express goes in its string metadata,
under keys that start with `eqx_batch.`:

- `eqx_batch.header_crc32` and `eqx_batch.data_crc32`: CRC-32s (8 hex digits) of the
    header, taken with these 16 digits as zeros, and of the tensor data. `write_file`
    writes them first in the header, at a fixed place, so that they are found and
    checked before anything else in the file is interpreted; the data's last, once
    the data are written (a `LazyArray`'s read block by block as it is written).
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

This module defines the layout and writes it; `_file_format.py` opens and checks files.
Both know records and tensors, not trees: `_leaf_records.py` turns a tree into records
and arrays for `write_file`, and the records of a `CheckedFile` back into leaves.
"""

import json
import os
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple

import jax.numpy as jnp
import numpy as np

from .._errors import BatchError
from .._tree import is_lazy_array, LazyArray
from ._atomic import atomic_write


NAMESPACE = "eqx_batch."
VERSION = 1
LENGTH = struct.Struct("<Q")
# Where `eb.save` puts the checksums: first in the header, so at fixed offsets.
HEAD = b'{"__metadata__":{"eqx_batch.header_crc32":"'
MIDDLE = b'","eqx_batch.data_crc32":"'
HEADER_CRC_AT = LENGTH.size + len(HEAD)
DATA_CRC_AT = HEADER_CRC_AT + 8 + len(MIDDLE)
FIXED_END = DATA_CRC_AT + 8
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
# The item size of every safetensors dtype `eb.save` writes.
ITEM_SIZES = {code: jnp.dtype(name).itemsize for name, code in _NATIVE.items()}


# ------------------------------------------------------------------------------------
# Dtypes.


def storable(dtype: np.dtype) -> bool:
    """Numeric dtypes only: bool, ints, floats, complex and ml_dtypes' (bfloat16...)."""
    return dtype.kind in "biufc" or dtype.type.__module__ == "ml_dtypes"


def numeric_dtype(name: Any) -> np.dtype:
    """The dtype called `name`, if it is one `storable` allows; else `ValueError`."""
    try:
        dtype = jnp.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.name != name or not storable(dtype):
        raise ValueError(f"not a numeric dtype: {name!r}")
    return dtype


def stored_as(dtype: np.dtype, shape: Sequence[int]) -> tuple[str, list[int]]:
    """The safetensors dtype and shape of an array: native, or raw bytes (`U8`)."""
    code = _NATIVE.get(dtype.name)
    if code is not None:
        return code, list(shape)
    return "U8", [*shape, dtype.itemsize]


# ------------------------------------------------------------------------------------
# Writing.


# The most bytes of a `LazyArray` read at once when it is written: the memory a
# leaf of any size costs to save.
_BLOCK_BYTES = 1 << 24


class _Tensor(NamedTuple):
    name: str
    code: str
    shape: list[int]
    data: np.ndarray | LazyArray  # a NumPy array C-contiguous and little-endian

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.data.shape, dtype=np.int64)) * self.data.dtype.itemsize


def _little_endian(data: np.ndarray) -> np.ndarray:
    """`data` C-contiguous and little-endian, copied only if it is not already."""
    # Not `np.ascontiguousarray`: it turns 0-d arrays into 1-d ones.
    return np.array(data, dtype=data.dtype.newbyteorder("<"), order="C", copy=None)


def raw_bytes(data: np.ndarray) -> memoryview:
    return data.reshape(-1).view(np.uint8).data


def _blocks(tensor: _Tensor) -> Iterator[memoryview]:
    """The bytes of a tensor's data in order: a NumPy array at once, a `LazyArray`
    in C-ordered blocks of at most `_BLOCK_BYTES` (or one item)."""
    data = tensor.data
    if isinstance(data, np.ndarray):
        yield raw_bytes(data)
        return
    shape = data.shape
    # Axes from `inner` on fit in a block: a block is a run of `step` indices along
    # the axis before them, at fixed indices of the axes before that.
    inner, inner_bytes = len(shape), data.dtype.itemsize
    while inner > 0 and inner_bytes * shape[inner - 1] <= _BLOCK_BYTES:
        inner -= 1
        inner_bytes *= shape[inner]
    if inner == 0:
        yield raw_bytes(_little_endian(np.asarray(data[...])))
        return
    step = max(1, _BLOCK_BYTES // inner_bytes)
    for outer in np.ndindex(*shape[: inner - 1]):
        for start in range(0, shape[inner - 1], step):
            index = (*outer, slice(start, min(start + step, shape[inner - 1])))
            yield raw_bytes(_little_endian(np.asarray(data[index])))


def _header(
    records: list[dict], tensors: list[_Tensor], metadata: Mapping[str, str]
) -> tuple[bytes, list[_Tensor]]:
    """The length prefix and header, padded to a multiple of 8 bytes, with the
    header's checksum and zeros for the data's (`_write_tensors` writes it); and the
    tensors in the order of their data."""
    # Largest items first keeps every tensor aligned to its item size, as
    # safetensors' own writer does, for readers that map the file.
    ordered = sorted(tensors, key=lambda t: -t.data.dtype.itemsize)
    entries = {}
    offset = 0
    for tensor in ordered:
        entries[tensor.name] = {
            "dtype": tensor.code,
            "shape": tensor.shape,
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    ours = {
        f"{NAMESPACE}version": str(VERSION),
        f"{NAMESPACE}leaves": json.dumps(records, separators=(",", ":")),
    }
    rest = json.dumps({**ours, **metadata}, separators=(",", ":"))[1:]
    header = HEAD + b"00000000" + MIDDLE + b"00000000" + b'",' + rest.encode()
    if entries:
        header += b"," + json.dumps(entries, separators=(",", ":"))[1:].encode()
    else:
        header += b"}"
    header += b" " * (-(len(header) + LENGTH.size) % 8)
    prefix = LENGTH.pack(len(header))
    # Taken with both checksums as zeros, so the data's can be written after it.
    header_crc = zlib.crc32(prefix + header)
    patched = bytearray(prefix + header)
    patched[HEADER_CRC_AT : HEADER_CRC_AT + 8] = b"%08x" % header_crc
    return bytes(patched), ordered


def _write_tensors(file: BinaryIO, tensors: list[_Tensor]) -> None:
    """Writes the tensors' data after the header, then its CRC-32 into the header:
    a `LazyArray` is read once, a block at a time."""
    data_crc = 0
    for tensor in tensors:
        written = 0
        for block in _blocks(tensor):
            data_crc = zlib.crc32(block, data_crc)
            written += file.write(block)
        if written != tensor.nbytes:
            raise BatchError(
                f"`tree{tensor.name}` read {written} bytes, not {tensor.nbytes}: "
                "nothing was saved."
            )
    file.seek(DATA_CRC_AT)
    file.write(b"%08x" % data_crc)


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
        if key.startswith(NAMESPACE):
            raise BatchError(
                f"`metadata` has the key {key!r}; {NAMESPACE!r} keys are reserved."
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
    order (key data for keys), or `LazyArray`s, read a bounded block at a time as
    they are written; `metadata` is the caller's, as `check_caller_metadata` returns
    it. A `BatchError` of a `LazyArray`'s read leaves `path` as it was.
    """
    hosts = iter(arrays)
    tensors = []
    for record in records:
        if record["kind"] in ("array", "key"):
            data = next(hosts)
            if not is_lazy_array(data):
                data = _little_endian(np.asarray(data))
            code, shape = stored_as(np.dtype(data.dtype), data.shape)
            tensors.append(_Tensor(record["path"], code, shape, data))
    header, ordered = _header(records, tensors, metadata)

    def write(file: BinaryIO) -> None:
        file.write(header)
        _write_tensors(file, ordered)

    atomic_write(path, write, keep_cached=keep_cached)
