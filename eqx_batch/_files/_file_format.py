"""Opening an eqx_batch file (`_file_layout.py` describes it) with bounded, validated
reads: every kind of file that is not a sound one (not a regular file, junk, another
tool's file, corrupt, truncated, crafted, newer) is refused, naming the path, before
the tensors are read; the tensors are read by the safetensors parser.

The checksums guard against accidents (torn or truncated copies, flipped bits); a
crafted file can carry valid checksums, so every field is checked before it is used.
"""

import contextlib
import functools
import json
import math
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import safetensors

from .._errors import BatchError
from ._file_layout import (
    DATA_CRC_AT,
    FIXED_END,
    HEAD,
    HEADER_CRC_AT,
    ITEM_SIZES,
    LENGTH,
    MIDDLE,
    NAMESPACE,
    numeric_dtype,
    raw_bytes,
    stored_as,
    VERSION,
)


class BadFileError(BatchError):
    """The file itself cannot be read as an eqx_batch file.

    It is not a regular file, not an eqx_batch file (junk, another tool's safetensors
    file), corrupt or truncated, or from a newer format version: no `like` would
    load it. A plain `BatchError` from `load`/`read_tree` means the file is sound but
    does not fit `like`.
    """


class ForeignFileError(BadFileError):
    """The file is not an eqx_batch file at all: junk, or another tool's file."""


# safetensors refuses headers over 100 MB; so do we, before reading one.
_MAX_HEADER = 100_000_000
_CHUNK = 1 << 22


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
        (LENGTH.size, HEAD),
        (HEADER_CRC_AT + 8, MIDDLE),
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


def _wrong_size(path: str, problem: str) -> BadFileError:
    return BadFileError(
        f"`{path}` is corrupt or crafted: {problem}. A copy cut short or extended (an "
        "interrupted download or copy) leaves a file like this, and so does a header "
        "crafted to claim sizes the file does not hold: its contents cannot be trusted."
    )


def _malformed(path: str) -> BadFileError:
    return BadFileError(
        f"`{path}` has a malformed header, though its checksums match: it was not "
        "written by `eb.save`."
    )


def _rewritten(path: str) -> BadFileError:
    return BadFileError(
        f"`{path}` was rewritten by another tool: it holds the metadata `eb.save` "
        "writes, but not where `eb.save` puts it, so its checksums cannot be "
        "checked and `eb.load` does not read it. Its arrays are readable with "
        f"`safetensors.numpy.load_file('{path}')`, named by their leaf paths; put "
        "them into your tree (e.g. with `eqx.tree_at`) and `eb.save` that."
    )


# The order in which `eb.save` writes its own metadata, before the caller's.
_OUR_KEYS = [
    f"{NAMESPACE}header_crc32",
    f"{NAMESPACE}data_crc32",
    f"{NAMESPACE}version",
    f"{NAMESPACE}leaves",
]


def _reordered(path: str, descriptor: int, raw: bytes) -> bool:
    """Whether a header that fails its checksum was written again in another order.

    Damage (a flipped byte, a torn copy) leaves keys where they were; another writer
    (safetensors' own, whose metadata order is arbitrary in older releases) can keep
    `eb.save`'s opening by chance while moving the rest.
    """
    header = _parse_header(raw)
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    # A rewrite keeps every key; damage to one of ours removes it.
    if not isinstance(metadata, dict) or not set(_OUR_KEYS) <= metadata.keys():
        return False
    if list(metadata)[:4] == _OUR_KEYS:
        return False
    try:
        with safetensors.safe_open(_descriptor_path(path, descriptor), "np"):
            return True
    except Exception:  # noqa: BLE001 - any failure of the parser means "damaged"
        return False


def _parse_header(raw: bytes) -> Any:
    try:
        return json.loads(raw[LENGTH.size :].decode())
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
    if header_nbytes > _MAX_HEADER or LENGTH.size + header_nbytes > size:
        return _not_ours(path, head)
    header = _parse_header(_read_at(descriptor, 0, LENGTH.size + header_nbytes))
    if not isinstance(header, dict):
        return _not_ours(path, head)
    metadata = header.get("__metadata__")
    try:
        with safetensors.safe_open(_descriptor_path(path, descriptor), "np") as file:
            count = len(list(file.keys()))
    except Exception:  # noqa: BLE001 - any failure of the parser means "not a file of it"
        return _not_ours(path, head)
    if isinstance(metadata, dict) and any(
        isinstance(k, str) and k.startswith(NAMESPACE) for k in metadata
    ):
        # Sound for the parser, with our metadata moved from where `eb.save` puts
        # it: another writer (`safetensors.numpy.save_file` reorders the header) did it.
        return _rewritten(path)
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
    """The bytes of tensor data the header describes; `None` unless its tensors lie
    back to back from the start of the data, each as long as its dtype and shape say,
    as `eb.save` lays them out."""
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            return None
        offsets, shape = entry.get("data_offsets"), entry.get("shape")
        code = entry.get("dtype")
        item_size = ITEM_SIZES.get(code) if isinstance(code, str) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_count(o) for o in offsets)
            and isinstance(shape, list)
            and all(_is_count(d) for d in shape)
            and item_size is not None
            and offsets[1] - offsets[0] == math.prod(shape) * item_size
        ):
            return None
        spans.append(offsets)
    end = 0
    for start, stop in sorted(spans):
        if start != end:
            return None
        end = stop
    return end


def _check_envelope(path: str, descriptor: int, size: int) -> _Envelope:
    """Checks sizes and the header's checksum and version, without reading tensors."""
    head = _read_at(descriptor, 0, FIXED_END)
    if size < LENGTH.size:
        raise ForeignFileError(
            f"`{path}` is not an eqx_batch file: it has only {size} bytes."
        )
    (header_nbytes,) = LENGTH.unpack_from(head)
    if not _similar(head):
        raise _check_foreign(path, descriptor, size, head, header_nbytes)
    if size < FIXED_END:
        raise _corrupt(path, f"it is truncated to {size} bytes")
    if header_nbytes > _MAX_HEADER or LENGTH.size + header_nbytes > size:
        raise _wrong_size(
            path,
            f"its header claims {header_nbytes} bytes but the whole file has {size}"
            if header_nbytes <= _MAX_HEADER
            else f"its header claims {header_nbytes} bytes, more than safetensors' "
            f"limit of {_MAX_HEADER}",
        )
    raw = bytearray(_read_at(descriptor, 0, LENGTH.size + header_nbytes))
    header_crc = _crc_digits(raw, HEADER_CRC_AT)
    data_crc = _crc_digits(raw, DATA_CRC_AT)
    raw[HEADER_CRC_AT : HEADER_CRC_AT + 8] = b"0" * 8
    raw[DATA_CRC_AT : DATA_CRC_AT + 8] = b"0" * 8
    if header_crc is None or data_crc is None or zlib.crc32(raw) != header_crc:
        if _reordered(path, descriptor, bytes(raw)):
            raise _rewritten(path)
        raise _corrupt(path, "the CRC-32 checksum of its header does not match it")
    header = _parse_header(bytes(raw))
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        raise _malformed(path)
    version = metadata.get(f"{NAMESPACE}version")
    if not isinstance(version, str) or not version.isdigit() or len(version) > 9:
        raise _malformed(path)
    if int(version) > VERSION:
        raise BadFileError(
            f"`{path}` has file format version {version} > {VERSION}: upgrade "
            "eqx_batch."
        )
    if int(version) != VERSION:
        raise _malformed(path)
    assert isinstance(header, dict)
    data_start = LENGTH.size + header_nbytes
    claimed = _data_nbytes(header)
    if claimed is None:
        raise _malformed(path)
    if claimed != size - data_start:
        raise _wrong_size(
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
            k: v for k, v in metadata.items() if not k.startswith(NAMESPACE)
        }
        entries = {k: v for k, v in envelope.header.items() if k != "__metadata__"}
        try:
            records = json.loads(metadata[f"{NAMESPACE}leaves"])
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
                dtype = numeric_dtype(record["dtype"])
                if (code, stored_shape) != stored_as(dtype, shape):
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
            f"`{path}` passed its checksums but safetensors cannot read it ({e})."
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
            crc = zlib.crc32(raw_bytes(tensors[name]), crc)
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
    return {k: v for k, v in metadata.items() if not k.startswith(NAMESPACE)}
