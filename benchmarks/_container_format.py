"""The baseline of `bench_serialise.py`: eqx_batch's own container format, before
`eb.save` wrote safetensors files, kept only to measure the new format against it.

A file was: magic bytes, a version and the header's length; a JSON header with one
record per leaf; the arrays' bytes, each on a 64-byte boundary; a CRC-32 of all that.
`read` read the whole file, checked the checksum, then every leaf against `like`. This
is that code cut down to what an MLP ensemble needs (arrays and objects, one layout).
"""

import json
import os
import struct
import zlib
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from eqx_batch._atomic import atomic_write


_MAGIC = b"\x89EQXBATCH\r\n\x1a\n"
_PREFIX = struct.Struct(f"<{len(_MAGIC)}sIQ")
_ALIGN = 64
_CRC = struct.Struct("<I")


def _padding(offset: int) -> int:
    return -offset % _ALIGN


def _object_name(x: Any) -> str:
    return f"{type(x).__module__}.{getattr(x, '__qualname__', type(x).__qualname__)}"


def write(path: str | os.PathLike, tree: Any) -> None:
    records, arrays = [], []
    offset = 0
    for key_path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        record: dict[str, Any] = {"path": jtu.keystr(key_path)}
        if hasattr(leaf, "dtype"):
            data = np.asarray(leaf)
            offset += _padding(offset)
            record.update(
                kind="array",
                dtype=data.dtype.name,
                shape=list(data.shape),
                offset=offset,
                nbytes=data.nbytes,
            )
            offset += data.nbytes
            arrays.append(data)
        else:
            record.update(kind="object", name=_object_name(leaf))
        records.append(record)
    header = json.dumps({"leaves": records, "payload_nbytes": offset}).encode()
    prefix = _PREFIX.pack(_MAGIC, 1, len(header))

    def put_all(file: Any) -> None:
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

    atomic_write(path, put_all)


def read(path: str | os.PathLike, like: Any) -> Any:
    data = open(path, "rb").read()
    _, _, header_nbytes = _PREFIX.unpack_from(data)
    if _CRC.pack(zlib.crc32(memoryview(data)[: -_CRC.size])) != data[-_CRC.size :]:
        raise ValueError("corrupt")
    header = json.loads(data[_PREFIX.size : _PREFIX.size + header_nbytes])
    start = _PREFIX.size + header_nbytes
    start += _padding(start)
    leaves, treedef = jtu.tree_flatten_with_path(like)
    restored = []
    for (path_, leaf), record in zip(leaves, header["leaves"], strict=True):
        if record["path"] != jtu.keystr(path_):
            raise ValueError("structure")
        if record["kind"] == "object":
            if record["name"] != _object_name(leaf):
                raise ValueError("object")
            restored.append(leaf)
            continue
        if tuple(record["shape"]) != leaf.shape or record["dtype"] != leaf.dtype.name:
            raise ValueError("shape or dtype")
        flat = np.frombuffer(
            data,
            dtype=np.uint8,
            count=record["nbytes"],
            offset=start + record["offset"],
        )
        host = flat.view(jnp.dtype(record["dtype"])).reshape(record["shape"])
        restored.append(jnp.asarray(host))
    return jtu.tree_unflatten(treedef, restored)
