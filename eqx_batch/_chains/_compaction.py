"""Compaction: once some problems have stopped (`data=` with `until=`), a segment runs
only the chains of the problems still running, so that the compute follows them rather
than the slowest problem.

Every segment of a run with `until` freezes the chains of the problems that have
stopped (`SegmentPlan.freezes`): the whole chunk may run, its stopped chains kept as
they are, and so may a batch that still holds a problem which stopped since the host
last looked (it reads each check a segment late, `_loop.py`). The running chains go
to a smaller batch in *pieces*: calls of one program on a fixed share of the chunk
(a quarter, a sixteenth or a 64th, in whole blocks of a problem's chains), each
gathering its rows, running the segment and writing them back, in one program.
However many problems run, and wherever they stop, a run compiles at most three
programs for its pieces (issue 42 counted 23, one per batch size, before).

Whether pieces pay depends on the device. A CPU's step takes time in proportion to
the chains it runs: there every segment runs in pieces, the first ones too, so that
while every problem runs a run compiles one segment program (its first call costs
about what a run without `until` costs). On an accelerator a step's time is partly
fixed (on a TPU v5e a quarter of the chains took 0.42 of the time of all of them:
`benchmarks/bench_problems.py`): there the whole chunk runs until a quarter holds
every running chain, and smaller pieces would save less than they cost to compile.
Padding rows repeat a block of running chains, whose results they equal: written
back over their rows, they change no bit.
"""

import functools as ft
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding

from .._compiling._compile import AsyncJit
from ._all_chains import RunStep
from ._common import ChainState
from ._placement import made_zeros
from ._segment import segment
from ._segment_plan import SegmentPlan


# The share of a chunk that one piece holds: a quarter, so that pieces of the running
# chains pad them by an eighth of the chunk on average.
PIECES = 4
# The sizes of pieces: a quarter of the chunk, a sixteenth, a 64th, each a program of
# its own once reached. Where a step's time does not grow with the chains, only the
# quarter: a smaller piece saves less there than its compile costs.
LEVELS = 3
# The most calls a segment makes: with 4, the problems left last padded the chain-steps
# of `bench_problems.py compaction` by 26%; with 8, by 16%.
MOST_CALLS = 8


def piece_rows(running: int, num_rows: int, unit: int, per_chain: bool) -> int | None:
    """The rows of each piece that runs `running` rows of a chunk of `num_rows`, or
    None to run the whole chunk. A piece is a `PIECES`-th of the chunk, or of such a
    piece, down to `LEVELS` levels, in a whole number of `unit`s (a problem's block
    on each device), and less than the chunk: of those that run them in at most
    `MOST_CALLS` calls, the one that runs the fewest rows, padding included, each
    call counted a unit more (for what a call costs beyond its rows), the fewest
    calls of equals. On a device whose step time does not grow with the chains
    (`per_chain` False), only a quarter, and only if one piece holds them all."""
    sizes = []
    for level in range(1, (LEVELS if per_chain else 1) + 1):
        size = -(-num_rows // (PIECES**level * unit)) * unit
        if size < num_rows and size not in sizes:
            sizes.append(size)
    most = MOST_CALLS if per_chain else 1
    fitting = [size for size in sizes if -(-running // size) <= most]
    # Sizes are largest first, and `min` keeps the first of equals: the fewest calls.
    return min(
        fitting, key=lambda size: -(-running // size) * (size + unit), default=None
    )


def pieces(rows: np.ndarray, size: int, block: int) -> list[np.ndarray]:
    """`rows` (the running chains, in whole blocks of `block` rows of one problem) cut
    into pieces of `size` rows, the last padded with copies of its first block."""
    cut = [rows[i : i + size] for i in range(0, len(rows), size)]
    last = cut[-1]
    copies = -(-(size - len(last)) // block)
    cut[-1] = np.concatenate([last, *[last[:block]] * copies])[:size]
    return cut


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
    buffer."""

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


def _piece(
    plan: SegmentPlan,
    step: RunStep,
    static: Any,
    chains: ChainState,
    trace: Any,
    rows: jax.Array,
    slots: jax.Array,
    start: jax.Array,
    running: jax.Array,
    first: jax.Array,
    count: jax.Array,
    own: Any,
    splits: tuple[NamedSharding, NamedSharding],
) -> tuple[ChainState, Any]:
    """One piece of a segment: the chunk's `rows` gathered into a batch (split as
    `splits[0]`), run by the segment of `plan` (which returns its own draws, in a
    buffer made as `own`), and written back over the chunk's `chains` (split as
    `splits[1]`) and, from slot `first`, its first `count` draws over `trace` (the
    run's trace buffer, or the segment's own draws of every chain; None if nothing is
    recorded). In one program: no batch is handed between programs."""
    batch_split, split = splits
    # A run of one segment passes what starts as zeros as the structs to make.
    trace = made_zeros(trace)
    chains = chains._replace(
        first_bad=made_zeros(chains.first_bad), moments=made_zeros(chains.moments)
    )
    batch = jtu.tree_map(
        lambda x: lax.with_sharding_constraint(x[rows], batch_split), chains
    )
    result = segment(plan, step, static, batch, start, own, running)
    chains = written_back(chains, result.chains, slots, split)
    if trace is not None and result.new_draws is not None:
        trace = draws_written_back(trace, result.new_draws, slots, first, count, split)
    return chains, trace


# The trace buffer is donated and updated in place, as a segment updates it: the
# checkpoint writes a copy of the new draws (`sliced_draws`), not the buffer. The
# chains are not: the checkpoint may still be writing those of the last segment.
run_piece = AsyncJit(_piece, donate=("trace",))


@ft.partial(jax.jit, static_argnums=3)
def zeroed_problems(
    tree: Any, problems: jax.Array, problem: Any, sharding: NamedSharding
) -> Any:
    """`tree` (one row per chain) with the rows of the chains of `problems`
    (`bool[problems]`) set to zeros, `problem` being each row's (None: every row is
    problem 0's)."""
    mask = problems[0] if problem is None else problems[problem]

    def leaf(x: jax.Array) -> jax.Array:
        shaped = mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))
        return lax.with_sharding_constraint(
            jnp.where(shaped, jnp.zeros_like(x), x), sharding
        )

    return jtu.tree_map(leaf, tree)


@ft.partial(jax.jit, static_argnums=2)
def sliced_draws(trace: Any, first: jax.Array, emit: int) -> Any:
    """The `emit` draws of `trace` from slot `first` on (the last `emit`, near its
    end), as a segment returns them for the checkpoint."""
    return jtu.tree_map(lambda x: lax.dynamic_slice_in_dim(x, first, emit, 1), trace)
