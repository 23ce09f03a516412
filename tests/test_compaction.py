"""Compaction's pieces: as problems stop, the running chains run in pieces of a
fixed share of the chunk, one compiled program for any count of them; and the
write-backs, which put each row of a piece back over its row, as a scatter would
(`_chains/_compaction.py`)."""

import functools as ft
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import given, settings

import eqx_batch as eb
from eqx_batch._chains._compaction import (
    batch_slots,
    draws_written_back,
    piece_rows,
    pieces,
    written_back,
)


@pytest.mark.parametrize(
    "running, num_rows, unit, per_chain, size",
    [
        # 256 rows in units of 4: pieces of 64, 16 or 4 rows, those that run the
        # fewest rows (a unit more per call) in at most 8 calls, the fewest calls of
        # equals; every row running too (one program while they all run).
        (256, 256, 4, True, 64),
        (65, 256, 4, True, 16),
        (64, 256, 4, True, 64),
        (17, 256, 4, True, 16),
        (16, 256, 4, True, 16),
        (5, 256, 4, True, 4),
        (1, 256, 4, True, 4),
        # Rounded up to whole units, and never the whole chunk.
        (8, 60, 8, True, 8),
        (60, 60, 8, True, 16),
        # Where a step's time does not grow with its chains: one quarter or none.
        (256, 256, 4, False, None),
        (65, 256, 4, False, None),
        (64, 256, 4, False, 64),
        (1, 256, 4, False, 64),
        # A chunk of one unit never has pieces.
        (4, 4, 4, True, None),
    ],
)
def test_piece_rows(running, num_rows, unit, per_chain, size):
    assert piece_rows(running, num_rows, unit, per_chain) == size


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda block: st.tuples(
            st.just(block),
            st.lists(st.booleans(), min_size=1, max_size=24),
            st.integers(1, 4),
        )
    )
)
def test_pieces_hold_every_running_block_whole(case):
    block, running_blocks, units = case
    num_rows = block * len(running_blocks)
    rows = np.concatenate(
        [
            np.arange(b * block, (b + 1) * block)
            for b, r in enumerate(running_blocks)
            if r
        ]
        or [np.arange(0, block)]
    )
    size = block * units
    cut = pieces(rows, size, block)
    assert all(len(piece) == size for piece in cut)
    assert len(cut) == -(-len(rows) // size)
    # Every running row in a piece, in order, and nothing else but padding.
    np.testing.assert_array_equal(np.concatenate(cut)[: len(rows)], rows)
    for piece in cut:
        # Each block of a piece is one block of the chunk: a problem's chains whole.
        for start in range(0, size, block):
            held = piece[start : start + block]
            assert held[0] % block == 0 and np.all(np.diff(held) == 1), piece
        assert set(piece) <= set(rows) and piece.max() < num_rows


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
    padded = np.concatenate([rows, np.full(size - len(rows), rows[0])])
    return num_rows, padded, total, emit, first, count


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
    got = jax.jit(written_back, static_argnums=3)(
        jnp.asarray(full), jnp.asarray(batch), slots, sharding
    )
    np.testing.assert_array_equal(got, expected)

    trace = np.arange(num_rows * total * 2, dtype=np.float32).reshape(
        num_rows, total, 2
    )
    draws = -np.arange(len(batch_rows) * emit * 2, dtype=np.float32) - 1
    draws = draws.reshape(len(batch_rows), emit, 2)
    expected = trace.copy()
    for place, row in reversed(list(enumerate(batch_rows))):
        expected[row, first : first + count] = draws[place, :count]
    got = jax.jit(draws_written_back, static_argnums=5)(
        jnp.asarray(trace), jnp.asarray(draws), slots, first, count, sharding
    )
    np.testing.assert_array_equal(got, expected)


def _compiles(run: Callable[[], Any]) -> tuple[int, Any]:
    """How many programs `run` compiles, and what it returns."""
    count = [0]

    def listen(event: str, duration_secs: float, **kwargs: object) -> None:
        count[0] += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        result = jax.block_until_ready(run())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return count[0], result


def test_a_run_with_until_compiles_as_many_programs_at_any_count_of_problems():
    # Issue 42: one program per batch size made the count grow with the problems and
    # with where they stop (28 programs at 8 problems, 45 at 32).
    def step(state, key, data):  # new here: nothing of it is compiled before
        rho = data["rho"]
        return rho * state + jnp.sqrt(1 - rho**2) * jr.normal(key, state.shape)

    counts, stops = [], []
    for rhos in ([0.5, 0.95, 0.7, 0.9], [0.6, 0.8, 0.95, 0.3, 0.97, 0.9, 0.85, 0.5]):
        problems = len(rhos)
        starts = jnp.tile(jnp.linspace(-3.0, 3.0, 4)[:, None], (problems, 2))
        keys = jr.split(jr.key(1), problems * 4 * 8)
        data = {"rho": jnp.asarray(rhos, jnp.float32)}
        run = ft.partial(
            eb.run_chains,
            step,
            starts,
            keys,
            3000,
            data=data,
            superchains=problems * 4,
            until=eb.converged(every=50),
        )
        jax.clear_caches()  # what other tests compiled is not counted out
        count, result = _compiles(run)
        counts.append(count)
        stops.append(sorted(set(result.problems.steps_done.tolist())))
    assert stops[0] != stops[1] and len(stops[1]) > 2, stops
    assert counts[0] == counts[1] <= 10, counts
