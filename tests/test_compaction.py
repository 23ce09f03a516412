"""Compaction's batch sizes: as problems stop, the running chains are run in a batch of
the smallest of 1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5 times them) that holds
them, never more than every chain; and its write-backs, which put each row of the batch
back over its row, as a scatter would (`_chains/_compaction.py`)."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from eqx_batch._chains._compaction import (
    batch_size,
    batch_slots,
    draws_written_back,
    padded_rows,
    written_back,
)


@pytest.mark.parametrize(
    "running, total, size",
    [
        # Every size of the sequence, where it holds its chains exactly.
        (1, 4096, 1),
        (2, 4096, 2),
        (3, 4096, 3),
        (4, 4096, 4),
        (6, 4096, 6),
        (8, 4096, 8),
        (12, 4096, 12),
        (16, 4096, 16),
        (24, 4096, 24),
        (32, 4096, 32),
        (48, 4096, 48),
        # One chain past a size: the next size.
        (5, 4096, 6),
        (7, 4096, 8),
        (9, 4096, 12),
        (13, 4096, 16),
        (17, 4096, 24),
        (25, 4096, 32),
        (33, 4096, 48),
        (49, 4096, 64),
        (1025, 4096, 1536),
        (1537, 4096, 2048),
        # Never more than every chain: a size past them is cut to them.
        (40, 40, 40),
        (33, 40, 40),
        (50, 60, 60),
        (5, 5, 5),
        (1, 1, 1),
        # Every chain running, a size of the sequence or not.
        (48, 48, 48),
        (36, 36, 36),
    ],
)
def test_batch_size_is_the_smallest_size_that_holds_the_running_chains(
    running, total, size
):
    assert batch_size(running, total) == size


def test_batch_sizes_as_the_problems_of_a_run_stop_one_by_one():
    # 6 problems of 8 chains: 48 chains, then 40, 32, ... as each problem stops.
    sizes = [batch_size(8 * problems, 48) for problems in (6, 5, 4, 3, 2, 1)]
    assert sizes == [48, 48, 32, 24, 16, 8]


@pytest.mark.parametrize("total", [1, 5, 36, 48, 100, 4096])
def test_batch_sizes_hold_their_chains_with_little_padding(total):
    for running in range(1, total + 1):
        size = batch_size(running, total)
        assert running <= size <= total, (running, total)
        # Padding is less than a third of the batch: at least 2 of 3 rows run.
        assert 3 * (size - running) < size, (running, size)


@pytest.mark.parametrize("total", [1, 5, 36, 48, 100, 4096])
def test_batch_sizes_are_few_and_never_shrink_as_chains_are_added(total):
    # Each size is a compiled program: two sizes an octave, and `total` itself.
    sizes = [batch_size(running, total) for running in range(1, total + 1)]
    assert sizes == sorted(sizes)
    octaves = total.bit_length()
    assert len(set(sizes)) <= 2 * octaves
    sequence = {1 << k for k in range(octaves + 1)} | {3 << k for k in range(octaves)}
    assert set(sizes) - sequence <= {total}


@st.composite
def _write_backs(draw: st.DrawFn) -> tuple:
    """A chunk of rows, the running rows of a batch padded with its first, and a
    segment's draws written at `first` (past the buffer's end too, where the window
    moves back), `count` of the batch's `emit` draws made."""
    num_rows = draw(st.integers(1, 12))
    running = draw(st.lists(st.booleans(), min_size=num_rows, max_size=num_rows))
    rows = np.flatnonzero(running)
    if not len(rows):
        rows = np.array([draw(st.integers(0, num_rows - 1))])
    size = len(rows) + draw(st.integers(0, 3))
    total = draw(st.integers(1, 9))
    emit = draw(st.integers(1, total + 2))
    first = draw(st.integers(0, total))
    count = draw(st.integers(0, min(emit, total - first)))
    return num_rows, padded_rows(rows, size), total, emit, first, count


@settings(max_examples=60, deadline=None)
@given(_write_backs())
def test_write_backs_put_each_batch_row_over_its_row(case):
    num_rows, batch_rows, total, emit, first, count = case
    slots = jnp.asarray(batch_slots(batch_rows, num_rows))
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("chains",)),
        jax.sharding.PartitionSpec(),
    )
    full = np.arange(num_rows * 3, dtype=np.float32).reshape(num_rows, 3)
    batch = -np.arange(len(batch_rows) * 3, dtype=np.float32).reshape(-1, 3) - 1
    expected = full.copy()
    expected[batch_rows[::-1]] = batch[::-1]  # each row's first place in the batch
    got = written_back(jnp.asarray(full), jnp.asarray(batch), slots, sharding)
    np.testing.assert_array_equal(got, expected)

    trace = np.arange(num_rows * total * 2, dtype=np.float32).reshape(
        num_rows, total, 2
    )
    draws = -np.arange(len(batch_rows) * emit * 2, dtype=np.float32) - 1
    draws = draws.reshape(len(batch_rows), emit, 2)
    expected = trace.copy()
    for place, row in reversed(list(enumerate(batch_rows))):
        expected[row, first : first + count] = draws[place, :count]
    got = draws_written_back(
        jnp.asarray(trace), jnp.asarray(draws), slots, first, count, sharding
    )
    np.testing.assert_array_equal(got, expected)
