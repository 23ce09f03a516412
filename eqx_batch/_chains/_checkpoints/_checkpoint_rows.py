"""A checkpoint's rows (chains): those this process writes, and those it reads back
onto the devices of any layout of processes and devices.

Each process writes the rows its own devices hold, copied from its own shards
(`own_rows`, `rows_on_host`). The chains of a checkpoint are thus in files of rows `A`
to `B`, written by the layout that ran them; the run resuming may split the chains
otherwise. Each of its
processes builds its shards of the run's arrays (`jax.make_array_from_callback` on the
run's split sharding) from the files that hold those rows, reading each such file
once, and no other: nothing goes through one host.
"""

import pathlib
from collections.abc import Callable, Sequence
from typing import Any, TYPE_CHECKING

import jax
import jax.tree_util as jtu
import numpy as np

from ..._errors import BatchError
from ..._files._file_format import BadFileError
from ..._files._serialise import read_tree
from ..._tree import as_keys_like, host_array, structs
from .._common import ChainState
from ._checkpoint_files import DrawFile, StateFile
from ._checkpoint_metadata import RunMetadata


if TYPE_CHECKING:
    from .._placement import Placement


class RowReader:
    """The chains and draws of a checkpointed step, read by rows where placed.

    `chains_like` and `trace_like` hold key data (not typed keys) for the whole run,
    one row per chain; `states` tile the chains; `draws` cover the chains' first
    `num_draws` draws. `metadata` checks each draw file as it is opened, and words
    the errors of files that do not read.
    """

    def __init__(
        self,
        metadata: RunMetadata,
        *,
        chains_like: dict,
        trace_like: Any,
        states: list[StateFile],
        draws: list[DrawFile],
        num_draws: int,
    ):
        self.metadata = metadata
        self.chains_like = chains_like
        self.trace_like = trace_like
        self.states = states
        self.draws = draws
        self.num_draws = num_draws
        self._read: dict[str, list[Any]] = {}  # file name: its leaves, once read

    def chains(self, placement: "Placement", typed_like: ChainState) -> ChainState:
        """The chains on the devices of `placement`, padded, keys typed again like
        `typed_like`'s."""
        placed = self._placed(placement, self.chains_like, self._chain_rows)
        return ChainState(**as_keys_like(placed, typed_like._asdict()))

    def trace(self, placement: "Placement", typed_like: Any) -> Any:
        """The trace buffer on the devices of `placement`, padded: the draws so far,
        zeros after them."""
        placed = self._placed(placement, self.trace_like, self._draw_rows)
        return as_keys_like(placed, typed_like)

    def _placed(
        self,
        placement: "Placement",
        like: Any,
        read: Callable[[np.ndarray], list[np.ndarray]],
    ) -> Any:
        leaves, treedef = jtu.tree_flatten(like)
        # One read per shard serves every leaf.
        by_rows: dict[tuple[int, int], list[np.ndarray]] = {}

        def rows_of(index: tuple[slice, ...]) -> list[np.ndarray]:
            start, stop = index[0].indices(placement.num_rows)[:2]
            if (start, stop) not in by_rows:
                rows = np.arange(start, stop)
                # Padding rows repeat chain 0, as `Placement.put` makes them.
                rows[rows >= placement.num_chains] = 0
                by_rows[start, stop] = read(rows)
            return by_rows[start, stop]

        def leaf_callback(i: int) -> Callable[[Any], np.ndarray]:
            return lambda index: rows_of(index)[i][(slice(None), *index[1:])]

        placed = [
            jax.make_array_from_callback(
                (placement.num_rows, *leaf.shape[1:]), placement.split, leaf_callback(i)
            )
            for i, leaf in enumerate(leaves)
        ]
        return jtu.tree_unflatten(treedef, placed)

    def _chain_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        like = structs(self.chains_like, drop=1, add=(len(rows),))
        return self._gather(like, rows, self.states, self._state_leaves)

    def _draw_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        like = structs(self.trace_like, drop=1, add=(len(rows),))
        return self._gather(like, rows, self.draws, self._draw_leaves)

    def _gather(
        self,
        like: Any,
        rows: np.ndarray,
        blocks: Sequence[StateFile | DrawFile],
        leaves_of: Callable[[Any], list[np.ndarray]],
    ) -> list[np.ndarray]:
        out = [np.zeros(x.shape, x.dtype) for x in jtu.tree_leaves(like)]
        # A shard of real chains is a run of rows: copied by slices, not gathered.
        contiguous = bool(np.all(np.diff(rows) == 1))
        for block in blocks:
            first, stop = block.rows
            if contiguous:
                lo, hi = max(first, int(rows[0])), min(stop, int(rows[-1]) + 1)
                if lo >= hi:
                    continue
                inside: Any = slice(lo - int(rows[0]), hi - int(rows[0]))
                where: Any = slice(lo - first, hi - first)
            else:
                inside = (rows >= first) & (rows < stop)
                if not inside.any():
                    continue
                where = rows[inside] - first
            # State files hold whole rows; draw files draws X to Y of theirs.
            to = inside
            if isinstance(block, DrawFile):
                to = (inside, slice(*block.draws))
            for target, source in zip(out, leaves_of(block), strict=True):
                target[to] = source[where]
        return out

    def _state_leaves(self, block: StateFile) -> list[np.ndarray]:
        like = structs(self.chains_like, drop=1, add=(block.rows[1] - block.rows[0],))
        return self._leaves(block.path, like, "state file")

    def _draw_leaves(self, block: DrawFile) -> list[np.ndarray]:
        path = self.metadata.check_draw_file(block)
        like = structs(
            self.trace_like,
            drop=2,
            add=(block.rows[1] - block.rows[0], block.draws[1] - block.draws[0]),
        )
        return self._leaves(path, like, "draw file")

    def _leaves(self, path: pathlib.Path, like: Any, what: str) -> list[np.ndarray]:
        if path.name not in self._read:
            try:
                tree, _ = read_tree(path, like, argname=what, on_host=True)
            except (BadFileError, OSError) as e:
                raise self.metadata.unreadable(what, e) from None
            except BatchError as e:
                # Its run identity matched: only a damaged or tampered file gets here.
                raise self.metadata.damaged(
                    f"its {what} {path} names this run but does not hold its "
                    f"arrays: {e}"
                ) from None
            self._read[path.name] = jtu.tree_leaves(tree)
        return self._read[path.name]


def own_rows(x: jax.Array, num_chains: int) -> list[tuple[int, int]]:
    """The rows of `x` (one per chain, split over the devices) that this process's
    devices hold, as ranges, neighbours merged and padding rows dropped."""
    starts_stops = sorted(
        shard.index[0].indices(x.shape[0])[:2] for shard in x.addressable_shards
    )
    ranges: list[tuple[int, int]] = []
    for start, stop in starts_stops:
        stop = min(stop, num_chains)
        if start >= stop:
            continue
        if ranges and start <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(stop, ranges[-1][1]))
        else:
            ranges.append((start, stop))
    return ranges


def rows_on_host(x: jax.Array, rows: tuple[int, int]) -> np.ndarray:
    """Rows `rows` of `x` on the host (key data for typed keys), copied from the
    shards this process holds: no other process takes part."""
    if x.is_fully_addressable:
        # One process holds every row: one host copy, as it has always been.
        return host_array(x)[rows[0] : rows[1]]
    out: np.ndarray | None = None
    for shard in x.addressable_shards:
        start, stop = shard.index[0].indices(x.shape[0])[:2]
        first, end = max(start, rows[0]), min(stop, rows[1])
        if first >= end:
            continue
        data = host_array(shard.data)
        if out is None:
            out = np.empty((rows[1] - rows[0], *data.shape[1:]), data.dtype)
        out[first - rows[0] : end - rows[0]] = data[first - start : end - start]
    assert out is not None, "rows that no device of this process holds"
    return out
