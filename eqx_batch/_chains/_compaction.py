"""Compaction: once some problems have stopped (`data=` with `until=`), a segment runs
only the chains of the problems still running, so that the compute follows them rather
than the slowest problem.

Before a segment, the running chains are gathered into a smaller batch; after it, their
states (and draws) are written back over their rows, and the stopped chains' rows stay
as they stopped. The batch moves whole blocks of a problem's chains (the chunk's
`block_size`), and its count of blocks is padded to a power of two or 1.5 times one
(`batch_size`), each size a compiled program of its own, shared by every call of
the same shapes: two sizes an octave, so a batch is on average about a fifth larger
than the chains it runs (a third at most), for twice the compiles of powers of two
alone, which pad by 44% on average (measured: `benchmarks/bench_problems.py`). The
padding rows repeat a running chain, whose results they equal: written back over
its row, they change no bit.
"""

import functools as ft
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding


def batch_size(running: int, most: int) -> int:
    """The size of the batch that runs `running` chains: the smallest of 1, 2, 3, 4,
    6, 8, 12, 16, 24, ... (powers of two and 1.5 times them) at least `running`;
    never more than `most`."""
    size = 1
    while size < running:
        power = 1 << (size.bit_length() - 1)
        size = power * 3 // 2 if size == power and power >= 2 else 2 * power
    return min(size, most)


def padded_rows(rows: np.ndarray, size: int) -> np.ndarray:
    """`rows` (the running chains, at least one) padded to `size` with its first."""
    return np.concatenate([rows, np.full(size - len(rows), rows[0], rows.dtype)])


@ft.partial(jax.jit, static_argnums=2)
def gathered(tree: Any, rows: jax.Array, sharding: NamedSharding) -> Any:
    """The `rows` of every leaf of `tree` (one row per chain), split as `sharding`."""
    return jtu.tree_map(lambda x: lax.with_sharding_constraint(x[rows], sharding), tree)


def batch_slots(rows: np.ndarray, num_rows: int) -> np.ndarray:
    """Where each of `num_rows` rows is in a batch of `rows` (its first place there),
    or -1 for a row the batch leaves out: the write-backs read the batch by it."""
    slots = np.full(num_rows, -1, np.int32)
    # Reversed, so that a row repeated as padding keeps its first place.
    slots[rows[::-1]] = np.arange(len(rows), dtype=np.int32)[::-1]
    return slots


def _from_batch(batch: jax.Array, slots: jax.Array) -> jax.Array:
    """Each row's row of `batch` (row 0's for a row it leaves out): a gather, where a
    scatter of the batch's rows would be serialized row by row on a TPU."""
    return batch[jnp.maximum(slots, 0)]


def _rows_mask(slots: jax.Array, ndim: int) -> jax.Array:
    """Whether each row is in the batch, shaped to broadcast over a leaf of `ndim`."""
    return (slots >= 0).reshape(slots.shape + (1,) * (ndim - 1))


# Not donated: the checkpoint may still be writing the chains of the last segment.
@ft.partial(jax.jit, static_argnums=3)
def written_back(
    full: Any, batch: Any, slots: jax.Array, sharding: NamedSharding
) -> Any:
    """`full` with each row that the batch holds (`slots`, `batch_slots`) replaced by
    its row of `batch`."""
    return jtu.tree_map(
        lambda x, y: lax.with_sharding_constraint(
            jnp.where(_rows_mask(slots, x.ndim), _from_batch(y, slots), x), sharding
        ),
        full,
        batch,
    )


@ft.partial(jax.jit, static_argnums=5, donate_argnums=0)
def draws_written_back(
    trace: Any,
    draws: Any,
    slots: jax.Array,
    first: jax.Array,
    count: jax.Array,
    sharding: NamedSharding,
) -> Any:
    """`trace` (`[chains, slots, ...]` per leaf) with the first `count` draws of each
    row of `draws` (`[batch, emit, ...]`) written at slots `first`, `first + 1`, ...
    of the rows that the batch holds (`slots`, `batch_slots`); other slots and rows
    are left alone.

    Only the window of `emit` slots from `first` is read and written (moved back to
    end at the buffer's end, where the new draws then sit later in it), not the whole
    buffer. `trace` is donated and updated in place, as a segment updates it: the
    checkpoint writes a copy of the new draws (`sliced_draws`), not the buffer."""

    def leaf(x: jax.Array, y: jax.Array) -> jax.Array:
        total = x.shape[1]
        y = y[:, :total]
        emit = y.shape[1]
        start = jnp.clip(first, 0, total - emit)
        shift = first - start
        # Window slot i holds the batch's draw i - shift, if it is one of `count`.
        draw = jnp.arange(emit, dtype=jnp.int32) - shift
        fresh = (draw >= 0) & (draw < count)
        ahead = jnp.concatenate([jnp.zeros_like(y), y], axis=1)
        new = _from_batch(lax.dynamic_slice_in_dim(ahead, emit - shift, emit, 1), slots)
        old = lax.dynamic_slice_in_dim(x, start, emit, 1)
        mask = _rows_mask(slots, 2) & fresh[None, :]
        window = jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 2)), new, old)
        updated = lax.dynamic_update_slice_in_dim(x, window, start, 1)
        return lax.with_sharding_constraint(updated, sharding)

    return jtu.tree_map(leaf, trace, draws)


@ft.partial(jax.jit, static_argnums=2)
def zeroed_rows(tree: Any, mask: jax.Array, sharding: NamedSharding) -> Any:
    """`tree` with the rows where `mask` holds set to zeros."""

    def leaf(x: jax.Array) -> jax.Array:
        shaped = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
        return lax.with_sharding_constraint(
            jnp.where(shaped, jnp.zeros_like(x), x), sharding
        )

    return jtu.tree_map(leaf, tree)


@ft.partial(jax.jit, static_argnums=2)
def sliced_draws(trace: Any, first: jax.Array, emit: int) -> Any:
    """The `emit` draws of `trace` from slot `first` on (the last `emit`, near its
    end), as a segment returns them for the checkpoint."""
    return jtu.tree_map(lambda x: lax.dynamic_slice_in_dim(x, first, emit, 1), trace)
