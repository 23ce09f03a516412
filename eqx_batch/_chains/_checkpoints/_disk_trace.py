"""The trace of a `trace="disk"` run: arrays read lazily from the checkpoint's draw
files.

Each draw file holds draws `X` to `Y` of chains `A` to `B`, one tensor per array leaf of
the trace (`[B - A, Y - X, ...]`, as `write_tree` writes it, named by its `keystr`
path), and the files tile every chain and draw of the run. A `DiskArray` is one leaf of
the whole trace, `[chains, draws, ...]`: NumPy reads it (`np.asarray`, `leaf[:, -100:]`)
and reading reads only the chains and draws asked for, one `pread` per block of
contiguous bytes. No memory map: mapped pages count in a process's resident memory.

A file is checked the first time it is read, and again if it changed since (another
size, inode or modification time): its header and sizes as `eb.load` checks them, its
metadata (the run that wrote it, and the chains and draws it holds: two files of one
run swapped are each sound), its tensors against the leaves, and the CRC-32 of all
its data, streamed in bounded chunks. After that a read trusts it: a byte changed in
place without touching the file's modification time is not seen. A file missing,
truncated, from another run, swapped or damaged is a `BatchError` naming it, never
numbers.

A `DiskArray` is a `LazyArray`: `eb.save` writes its numbers, a block at a time.
"""

import json
import os
import pathlib
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np

from ..._errors import BatchError
from ..._files._file_format import BadFileError, open_checked
from ..._files._file_layout import LENGTH, NAMESPACE
from ..._tree import as_key_data, is_key, LazyArray
from ._checkpoint_files import checkpoint_name_pattern, run_file_pattern


# Bytes read at once when a file's checksum is computed: its memory is this, whatever
# the file's size.
_CHUNK = 1 << 22


class ListedFile(NamedTuple):
    """One draw file: draws `draws[0]` to `draws[1]` of chains `rows[0]` to `rows[1]`.

    `metadata` holds the entries its metadata must have: the id of the run that wrote
    it. `holds` holds those that say which chains and draws it holds, as its own
    checkpoint counts them (a chunk's from its first chain, not the trace's): one
    that differs is the file of other draws, renamed or copied over this one.
    """

    path: pathlib.Path
    rows: tuple[int, int]
    draws: tuple[int, int]
    metadata: Mapping[str, str] = {}
    holds: Mapping[str, str] = {}


class _Checked(NamedTuple):
    """A draw file as its checks found it."""

    signature: tuple[int, int, int]  # inode, size, modification time in ns
    data_start: int  # where the tensor data starts, in bytes
    offsets: dict[str, int]  # each leaf's tensor, from `data_start`


class DrawFiles:
    """The draw files of one trace, checked on first read (see the module's notes).

    `checkpoint` names the run in messages; `listing` must tile `num_chains` chains
    and `num_draws` draws; `leaves` are the trace's leaves, by path, as shape-dtype
    structs of the whole trace (typed keys as their raw data).
    """

    def __init__(
        self,
        checkpoint: pathlib.Path,
        listing: Sequence[ListedFile],
        leaves: dict[str, jax.ShapeDtypeStruct],
    ):
        self.checkpoint = checkpoint
        self.listing = list(listing)
        self.leaves = leaves
        self._checked: dict[pathlib.Path, _Checked] = {}

    def read(
        self,
        path: str,
        rows: tuple[int, int],
        draws: tuple[int, int],
        within: tuple = (),
    ) -> np.ndarray:
        """Chains `rows` and draws `draws` of the leaf at `path`, as stored, indexed
        by `within` (ints and slices) along the axes of one draw.

        Each file's block is indexed as it is read: the memory is the result's and
        one block's, so a few parameters of a large state read in little memory.
        """
        like = self.leaves[path]
        # The shape `within` selects, from a view of no memory.
        rest = np.broadcast_to(np.empty((), bool), like.shape[2:])[within].shape
        out = np.empty((rows[1] - rows[0], draws[1] - draws[0], *rest), like.dtype)
        for entry in self.listing:
            r0, r1 = max(rows[0], entry.rows[0]), min(rows[1], entry.rows[1])
            d0, d1 = max(draws[0], entry.draws[0]), min(draws[1], entry.draws[1])
            if r0 < r1 and d0 < d1:
                block = self._read_block(entry, path, (r0, r1), (d0, d1))
                out[r0 - rows[0] : r1 - rows[0], d0 - draws[0] : d1 - draws[0]] = block[
                    (slice(None), slice(None), *within)
                ]
        return out

    def replaced_by(self, path: str | os.PathLike) -> tuple[pathlib.Path, str] | None:
        """The file of this trace that writing `path` would replace, and what it
        holds; None if none.

        Its draw files, and every file of the checkpoint they belong to (the run's,
        its chunks' and their states, which resume it), compared with symlinks and
        relative parts resolved.
        """
        for entry in self.listing:
            if _same_file(path, entry.path):
                return entry.path, "draws {}-{} of chains {}-{}".format(
                    *entry.draws, *entry.rows
                )
        if _same_file(path, self.checkpoint):
            return self.checkpoint, "the run's checkpoint"
        target = pathlib.Path(os.path.realpath(path))
        own_names = checkpoint_name_pattern(self.checkpoint) + (
            f"(?:{run_file_pattern()})?"
        )
        if target.parent == pathlib.Path(
            os.path.realpath(self.checkpoint.parent)
        ) and re.fullmatch(own_names, target.name):
            return target, "the run's checkpoint"
        return None

    def _read_block(
        self,
        entry: ListedFile,
        path: str,
        rows: tuple[int, int],
        draws: tuple[int, int],
    ) -> np.ndarray:
        like = self.leaves[path]
        draw_bytes = int(np.prod(like.shape[2:], dtype=np.int64)) * like.dtype.itemsize
        file_draws = entry.draws[1] - entry.draws[0]
        row_bytes = file_draws * draw_bytes
        file = _DrawFile(self.checkpoint, entry).opened()
        try:
            checked = self._check(file)
            start = checked.data_start + checked.offsets[path]
            first_row = rows[0] - entry.rows[0]
            first_draw = draws[0] - entry.draws[0]
            shape = (rows[1] - rows[0], draws[1] - draws[0], *like.shape[2:])
            if draws[1] - draws[0] == file_draws:
                # Whole rows of the file: one read.
                count = (rows[1] - rows[0]) * row_bytes
                data = file.pread(start + first_row * row_bytes, count)
            else:
                count = (draws[1] - draws[0]) * draw_bytes
                data = b"".join(
                    file.pread(
                        start + (first_row + i) * row_bytes + first_draw * draw_bytes,
                        count,
                    )
                    for i in range(rows[1] - rows[0])
                )
        finally:
            os.close(file.descriptor)
        return np.frombuffer(data, like.dtype.newbyteorder("<")).reshape(shape)

    def _check(self, file: "_DrawFile") -> _Checked:
        """The file's checks, made now if it is new or changed since."""
        info = os.fstat(file.descriptor)
        signature = (info.st_ino, info.st_size, info.st_mtime_ns)
        checked = self._checked.get(file.entry.path)
        if checked is None or checked.signature != signature:
            checked = self._checked[file.entry.path] = _checks(
                file, self.leaves, signature
            )
        return checked


class _DrawFile(NamedTuple):
    """A draw file of a trace, read once `opened`, and what names it in messages."""

    checkpoint: pathlib.Path  # the run's
    entry: ListedFile
    descriptor: int = -1  # once opened

    def opened(self) -> "_DrawFile":
        """The file open for reading (closed by the caller)."""
        flags = os.O_RDONLY | getattr(os, "O_BINARY", 0)
        try:
            return self._replace(descriptor=os.open(self.entry.path, flags))
        except FileNotFoundError:
            raise self.error("is missing") from None
        except OSError as e:
            raise self.error(f"cannot be opened ({e})") from None

    def pread(self, offset: int, count: int) -> bytes:
        """The `count` bytes from `offset`; a file cut shorter is a `BatchError`."""
        chunks = []
        while count > 0:
            chunk = os.pread(self.descriptor, min(count, 1 << 30), offset)
            if not chunk:
                raise self.error("was cut short after it was checked")
            chunks.append(chunk)
            offset += len(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    def error(self, problem: str) -> BatchError:
        """The error of this file, whose `problem` makes it unreadable."""
        entry = self.entry
        return BatchError(
            f"the draw file {entry.path} of `checkpoint` ({self.checkpoint}), which "
            f"holds draws {entry.draws[0]}-{entry.draws[1]} of chains "
            f"{entry.rows[0]}-{entry.rows[1]} of the trace, {problem}. The trace "
            "cannot be read: put the file back as the run wrote it, or delete the "
            "checkpoint's files and call `run_chains` again to run it afresh."
        )


def _checks(
    file: _DrawFile,
    leaves: dict[str, jax.ShapeDtypeStruct],
    signature: tuple[int, int, int],
) -> _Checked:
    """The checks of a draw file on its first read (see the module's notes) against
    the trace's `leaves`; `signature` is its inode, size and modification time."""
    entry = file.entry
    # The header as `eb.load` checks it: sizes, the header's CRC-32, the version;
    # of the very file open here, if the system can name it by its descriptor.
    by_descriptor = f"/dev/fd/{file.descriptor}"
    name = by_descriptor if os.path.exists(by_descriptor) else str(entry.path)
    try:
        with open_checked(name) as opened:
            records = {record["path"]: record for record in opened.records}
            metadata = opened.caller_metadata
    except BadFileError as e:
        problem = str(e).replace(f"`{name}`", "it").rstrip(".")
        raise file.error(f"is damaged: {problem}") from None
    _check_metadata(file, metadata)
    rows = entry.rows[1] - entry.rows[0]
    draws = entry.draws[1] - entry.draws[0]
    for path, like in leaves.items():
        record = records.get(path)
        expected = [rows, draws, *like.shape[2:]]
        if record is None or record["kind"] != "array":
            raise file.error(f"holds no array for the leaf {path!r}")
        if record["shape"] != expected or record["numpy_dtype"] != like.dtype:
            raise file.error(
                f"holds {record['dtype']}{record['shape']} for the leaf {path!r}, "
                f"where {like.dtype.name}{expected} is expected",
            )
    header_nbytes = LENGTH.unpack(file.pread(0, LENGTH.size))[0]
    # Parsed again here for the tensors' offsets, which `open_checked` checked.
    header = json.loads(file.pread(LENGTH.size, header_nbytes))
    data_start = LENGTH.size + header_nbytes
    crc = 0
    for at in range(data_start, signature[1], _CHUNK):
        crc = zlib.crc32(file.pread(at, min(_CHUNK, signature[1] - at)), crc)
    if f"{crc:08x}" != header["__metadata__"][f"{NAMESPACE}data_crc32"]:
        raise file.error(
            "is damaged: the CRC-32 checksum of its tensor data does not match it"
        )
    offsets = {path: header[path]["data_offsets"][0] for path in leaves}
    return _Checked(signature, data_start, offsets)


def _check_metadata(file: _DrawFile, metadata: Mapping[str, str]) -> None:
    """Refuses a file of another run, or of other draws than its listing's: each
    file is internally sound, so only its own metadata tell a swap apart."""
    entry = file.entry
    for key, value in entry.metadata.items():
        if metadata.get(key) != value:
            raise file.error(
                f"was written by another run (its {key!r} is "
                f"{metadata.get(key)!r}, this run's {value!r})",
            )
    differ = [key for key, value in entry.holds.items() if metadata.get(key) != value]
    if differ:
        raise file.error(
            "is not the file its name says: its metadata give "
            + ", ".join(f"{key}={metadata.get(key)!r}" for key in differ)
            + ", where the checkpoint lists it for "
            + ", ".join(f"{key}={entry.holds[key]!r}" for key in differ)
            + ". The checkpoint's files were mixed up (renamed, or copied over "
            "one another)",
        )


class DiskArray(LazyArray):
    """One leaf of a `trace="disk"` trace, `[chains, draws, ...]`, read from its files
    when asked for.

    NumPy reads it whole (`np.asarray(leaf)`) or in part (`leaf[:, -100:]`, `leaf[3]`):
    indexing with integers and slices reads only the chains and draws asked for, and
    keeps only the part of each draw asked for (`leaf[..., 3]`) as it reads; it
    returns a NumPy array. Any other index (arrays, masks) reads the leaf whole
    first. `astype` gives a `DiskArray` that converts as it reads. A leaf of typed
    PRNG keys holds their raw data (`holds_keys`): `jr.wrap_key_data` makes them keys.

    The leaf reads the checkpoint's files, so it lasts as long as they do: to keep
    the numbers apart from the checkpoint, `eb.save(path, result.trace)` writes them
    (16 MiB at a time; `path` may not be one of the checkpoint's files), and
    `eb.load(path, like=result.trace)` reads them back as NumPy arrays.

    `eb.run_chains(..., trace="disk")` makes them; they are not built by hand. See
    [Traces larger than memory](../chains.md#traces-larger-than-memory).

    **Raises** (when read): `eb.BatchError` naming the file, for a draw file that is
    missing, truncated, damaged, another run's, or another file's (two files renamed
    or copied over one another); `IndexError` for an index out of bounds.

    !!! Example

        ```python
        result = eb.run_chains(
            lambda x, key: x + jr.normal(key, x.shape), jnp.zeros((4, 3)),
            jr.key(0), 1000, trace="disk", checkpoint="walk.eqx",
        )
        leaf = result.trace  # DiskArray(float32[4,1000,3], trace)
        isinstance(leaf, eb.DiskArray)  # True
        np.asarray(leaf[:, -100:]).shape  # (4, 100, 3): only those draws are read
        ```
    """

    def __init__(
        self,
        files: DrawFiles,
        path: str,
        holds_keys: bool = False,
        dtype: Any = None,
        chains: range | None = None,
        draws: range | None = None,
    ):
        self._files = files
        self._path = path
        self.holds_keys = holds_keys
        stored = files.leaves[path]
        # The chains and draws of the files this leaf shows (`Chains.problem`: one
        # problem's).
        self._chains = range(stored.shape[0]) if chains is None else chains
        self._draws = range(stored.shape[1]) if draws is None else draws
        self.shape: tuple[int, ...] = (
            len(self._chains),
            len(self._draws),
            *stored.shape[2:],
        )
        self.dtype = np.dtype(stored.dtype if dtype is None else dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        shape = ",".join(map(str, self.shape))
        return f"DiskArray({self.dtype.name}[{shape}], {self._path or 'trace'})"

    def astype(self, dtype: Any) -> "DiskArray":
        """This leaf, read as `dtype`."""
        return DiskArray(
            self._files, self._path, self.holds_keys, dtype, self._chains, self._draws
        )

    def chains(self, start: int, stop: int) -> "DiskArray":
        """The chains `start` to `stop` of this leaf, read as lazily."""
        return DiskArray(
            self._files,
            self._path,
            self.holds_keys,
            self.dtype,
            self._chains[start:stop],
            self._draws,
        )

    def draws(self, start: int, stop: int) -> "DiskArray":
        """The draws `start` to `stop` of this leaf, read as lazily."""
        return DiskArray(
            self._files,
            self._path,
            self.holds_keys,
            self.dtype,
            self._chains,
            self._draws[start:stop],
        )

    def replaced_by(self, path: str | os.PathLike) -> tuple[pathlib.Path, str] | None:
        """The file this leaf reads, or of the checkpoint it belongs to, that writing
        `path` would replace, and what it holds (`"draws 0-20 of chains 0-4"`, `"the
        run's checkpoint"`); None if none. `eb.save` refuses such a `path`."""
        return self._files.replaced_by(path)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self[...]
        return values if dtype is None else values.astype(dtype, copy=False)

    def __getitem__(self, key: Any) -> np.ndarray:
        basic = _basic_key(key, self.ndim)
        if basic is None:
            return self[...][key]
        picks, bounds = [], []
        for index, size in zip(basic[:2], self.shape[:2], strict=True):
            if isinstance(index, int):
                if not -size <= index < size:
                    raise IndexError(f"index {index} is out of bounds for size {size}")
                index %= size
                bounds.append((index, index + 1))
                picks.append(0)
            else:
                steps = range(*index.indices(size))
                low = min(steps, default=0)
                high = max(steps, default=-1) + 1
                bounds.append((low, max(low, high)))
                picks.append(
                    slice(steps.start - low, None, steps.step) if steps else slice(0, 0)
                )
        if self.ndim < 2:
            raise IndexError("a trace leaf has axes chains and draws")
        chain, draw = self._chains.start, self._draws.start
        rows = (chain + bounds[0][0], chain + bounds[0][1])
        slots = (draw + bounds[1][0], draw + bounds[1][1])
        values = self._files.read(self._path, rows, slots, basic[2:])
        return values[tuple(picks)].astype(self.dtype, copy=False)


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether `a` and `b` name one file: the same file if both exist, else the same
    path once symlinks are resolved."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _basic_key(key: Any, ndim: int) -> tuple | None:
    """`key` as one int or slice per axis, if it is made of ints, slices and one
    Ellipsis; else None."""
    key = key if isinstance(key, tuple) else (key,)
    if (
        not all(isinstance(k, (int, np.integer, slice)) or k is Ellipsis for k in key)
        or sum(k is Ellipsis for k in key) > 1
        or any(isinstance(k, bool) for k in key)
    ):
        return None
    if Ellipsis in key:
        at = key.index(Ellipsis)
        key = (*key[:at], *[slice(None)] * (ndim - len(key) + 1), *key[at + 1 :])
    if len(key) > ndim:
        return None
    key = (*key, *[slice(None)] * (ndim - len(key)))
    return tuple(int(k) if isinstance(k, np.integer) else k for k in key)


def disk_trace(
    checkpoint: pathlib.Path, listing: Sequence[ListedFile], structs: Any
) -> Any:
    """The trace held by the draw files of `listing`, as a tree of `DiskArray`s.

    **Arguments:**

    - `checkpoint`: the run's checkpoint, for messages.
    - `listing`: the draw files, which must tile the chains and draws of `structs`.
        Relative paths are taken from the working directory now, not when read.
    - `structs`: the whole trace's shape-dtype structs, `[chains, draws, ...]` per
        array leaf (typed keys may be typed).

    **Returns:**

    `structs` with each leaf a `DiskArray`; no file is read before a leaf is.

    **Raises:**

    `BatchError` if `listing` does not cover the trace (a file missing from it). A
    read raises it for a file that is missing, damaged, truncated, another run's, or
    whose metadata say it holds other chains or draws than `holds`.

    !!! Example

        ```python
        trace = disk_trace(path, [ListedFile(draw_file, (0, 4), (0, 100))], structs)
        np.asarray(trace["x"][:, -10:])  # the last 10 draws of every chain
        ```
    """
    # Absolute now: the trace is read later, perhaps from another working directory.
    checkpoint = checkpoint.absolute()
    listing = [entry._replace(path=entry.path.absolute()) for entry in listing]
    leaves, treedef = jtu.tree_flatten_with_path(structs)
    raw = jtu.tree_leaves(as_key_data(structs))
    by_path = {jtu.keystr(path): x for (path, _), x in zip(leaves, raw, strict=True)}
    num_chains, num_draws = raw[0].shape[:2] if raw else (0, 0)
    _check_tiling(checkpoint, listing, num_chains, num_draws)
    files = DrawFiles(checkpoint, listing, by_path)
    return jtu.tree_unflatten(
        treedef,
        [DiskArray(files, jtu.keystr(path), is_key(x)) for path, x in leaves],
    )


def _check_tiling(
    checkpoint: pathlib.Path,
    listing: Sequence[ListedFile],
    num_chains: int,
    num_draws: int,
) -> None:
    """Refuses a listing whose files do not hold every chain and draw. Files may
    overlap: a run resumed on another layout of processes writes its chains in other
    ranges than the files before it, and two files of one run (their run id is
    checked) hold the same bits of a draw they share."""
    row_cuts = sorted({0, num_chains, *(r for e in listing for r in e.rows)})
    draw_cuts = sorted({0, num_draws, *(d for e in listing for d in e.draws)})
    covered = np.zeros((len(row_cuts) - 1, len(draw_cuts) - 1), np.int64)
    for entry in listing:
        (a, b), (x, y) = entry.rows, entry.draws
        if not (0 <= a < b <= num_chains and 0 <= x < y <= num_draws):
            covered[:] = -1
            break
        rows = slice(row_cuts.index(a), row_cuts.index(b))
        draws = slice(draw_cuts.index(x), draw_cuts.index(y))
        covered[rows, draws] += 1
    if num_chains * num_draws and not (covered >= 1).all():
        raise BatchError(
            f"the draw files of `checkpoint` ({checkpoint}) miss some of the "
            f"{num_chains} chains' {num_draws} draws: delete them (listed: "
            f"{[(str(e.path), e.rows, e.draws) for e in listing][:10]})."
        )
