"""The compiled-loop progress bar: a real tqdm bar on a real stream, bounded updates."""

import io

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import given, settings

import eqx_batch as eb
from eqx_batch._progress import _receive, ProgressBar, ProgressHandle


TRACES: list[int] = []


def _step(x: jax.Array) -> jax.Array:
    return jnp.sin(x) * 0.9 + 0.1


@eqx.filter_jit
def _run_chains(states, progress: ProgressHandle | None, start, length: int, due=None):
    """Scan over steps outside, vmap over chains inside: the counter stays unbatched.

    Returns the states and the step at which the next report is due (or None).
    """
    TRACES.append(length)
    if progress is not None and due is None:
        due = progress.start(start)

    def body(carry, _):
        states, t, due = carry
        states = jax.vmap(_step)(states)
        if progress is not None:
            due = progress(t + 1, due)
        return (states, t + 1, due), None

    (states, _, due), _ = lax.scan(body, (states, start, due), None, length=length)
    return states, due


def _final_line(stream: io.StringIO) -> str:
    return stream.getvalue().split("\r")[-1].strip()


def test_one_bar_for_all_chains_reaches_total(getkey):
    states = jr.normal(getkey(), (8, 3))
    stream = io.StringIO()
    with ProgressBar(1000, "sampling", max_updates=50, file=stream) as bar:
        out, _ = _run_chains(states, bar.handle, jnp.int32(0), 1000)
    assert bar.n == 1000
    # One callback per update for all eight chains, not one per chain.
    assert 0 < bar.updates <= 51
    assert _final_line(stream).startswith("sampling: 100%")
    assert "1000/1000" in _final_line(stream)
    # The bar does not change what is computed.
    expected, _ = _run_chains(states, None, jnp.int32(0), 1000)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_one_compilation_serves_every_bar(getkey):
    states = jr.normal(getkey(), (4, 2))
    TRACES.clear()
    first_stream, second_stream = io.StringIO(), io.StringIO()
    with ProgressBar(300, file=first_stream) as first:
        _run_chains(states, first.handle, jnp.int32(0), 300)
    with ProgressBar(300, file=second_stream) as second:
        _run_chains(states, second.handle, jnp.int32(0), 300)
    assert TRACES == [300]
    assert first.n == second.n == 300
    assert "300/300" in _final_line(first_stream)
    assert "300/300" in _final_line(second_stream)


def test_segments_of_one_run_share_a_bar(getkey):
    # Checkpointed runs call the compiled loop once per segment, counting on globally.
    states = jr.normal(getkey(), (4, 2))
    with ProgressBar(600, file=io.StringIO()) as bar:
        due = None
        for start in (0, 200, 400):
            states, due = _run_chains(states, bar.handle, jnp.int32(start), 200, due)
    assert bar.n == 600
    assert bar.updates <= 101


def test_unfinished_run_shows_how_far_it_got(getkey):
    # Reported every step (`every` is 1 and no wait), the bar stops where the loop did.
    stream = io.StringIO()
    with ProgressBar(100, min_interval=0, file=stream) as bar:
        _run_chains(jr.normal(getkey(), (2, 2)), bar.handle, jnp.int32(0), 40)
    assert bar.n == 40
    assert "40/100" in _final_line(stream)


def test_fori_loop_under_jit():
    @jax.jit
    def count(progress: ProgressHandle) -> jax.Array:
        def body(i, carry):
            total, due = carry
            return total + i, progress(i + 1, due)

        init = (jnp.int32(0), progress.start(0))
        return lax.fori_loop(0, progress.total, body, init)[0]

    # Fewer steps than `max_updates` and no wait between reports: every step reported.
    with ProgressBar(7, min_interval=0, file=io.StringIO()) as bar:
        total = count(bar.handle)
    assert int(total) == sum(range(7))
    assert bar.every == 1 and bar.updates == 7 and bar.n == 7


@settings(max_examples=25, deadline=None)
@given(total=st.integers(1, 2000), max_updates=st.integers(1, 150))
def test_updates_are_bounded_and_reach_total(total, max_updates):
    @jax.jit
    def loop(progress: ProgressHandle) -> None:
        def body(carry, _):
            t, due = carry
            return (t + 1, progress(t + 1, due)), None

        init = (jnp.int32(0), progress.start(0))
        lax.scan(body, init, None, length=progress.total)

    stream = io.StringIO()
    with ProgressBar(total, max_updates=max_updates, file=stream) as bar:
        loop(bar.handle)
    assert bar.n == total
    assert bar.updates <= max_updates + 1
    assert f"{total}/{total}" in _final_line(stream)


def test_out_of_order_callbacks_only_move_forward():
    with ProgressBar(10, file=io.StringIO()) as bar:
        bar_id = np.asarray(bar.handle.bar_id)
        for done in (4, 9, 2, 6):
            due = _receive(bar_id, np.asarray(done))
            assert done < due <= 10
        assert bar.n == 9
        assert bar.updates == 4


def test_callbacks_for_a_closed_bar_are_ignored():
    with ProgressBar(5, file=io.StringIO()) as bar:
        handle = bar.handle

    @jax.jit
    def finish(progress: ProgressHandle) -> jax.Array:
        return progress(progress.total, progress.start(0))

    # The host answers that no report is ever due again.
    assert int(finish(handle)) == np.iinfo(np.int32).max
    jax.effects_barrier()
    assert bar.n == 0 and bar.updates == 0


def test_bad_arguments():
    with pytest.raises(eb.BatchError, match="`total` is -1"):
        ProgressBar(-1)
    with pytest.raises(eb.BatchError, match="`max_updates` is 0"):
        ProgressBar(10, max_updates=0)
    with pytest.raises(eb.BatchError, match="`min_interval` is -1"):
        ProgressBar(10, min_interval=-1)
    with pytest.raises(eb.BatchError, match="not open"):
        _ = ProgressBar(10).handle


def test_reports_are_spaced_by_the_loops_speed(getkey):
    # A fast loop: after the first report, the host asks for the next ones only about
    # `min_interval` apart, so far fewer than `max_updates` calls are made.
    states = jr.normal(getkey(), (4, 2))
    with ProgressBar(20_000, max_updates=1000, min_interval=10.0) as bar:
        _run_chains(states, bar.handle, jnp.int32(0), 20_000)
    assert bar.n == 20_000
    assert bar.updates < 20
    # Without a wait between reports, `max_updates` bounds them.
    with ProgressBar(20_000, max_updates=1000, min_interval=0) as bar:
        _run_chains(states, bar.handle, jnp.int32(0), 20_000)
    assert bar.n == 20_000
    assert 900 <= bar.updates <= 1001
