"""The progress bar moved from the host: a real tqdm bar on a real stream, following
real work queued on the devices."""

import io

import hypothesis.strategies as st
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import given

import eqx_batch as eb
from eqx_batch._chains._chunk import bar_spacing, BAR_UPDATES
from eqx_batch._progress import ProgressBar


@jax.jit
def _piece(states: jax.Array) -> jax.Array:
    """Twenty steps of a contraction, queued without waiting."""
    return lax.fori_loop(0, 20, lambda _, x: jnp.sin(x) * 0.9 + 0.1, states)


def _final_line(stream: io.StringIO) -> str:
    return stream.getvalue().split("\r")[-1].strip()


def test_bar_follows_each_piece_one_behind_and_reaches_total(getkey):
    states = jr.normal(getkey(), (8, 3))
    stream = io.StringIO()
    with ProgressBar(100, "sampling", file=stream) as bar:
        seen = []
        for done in range(20, 101, 20):
            states = _piece(states)
            bar.follow(done, states)
            # The piece just queued is not waited for: the bar shows the one before.
            seen.append(bar.n)
    assert seen == [0, 20, 40, 60, 80]
    assert bar.n == 100
    assert _final_line(stream).startswith("sampling: 100%")
    assert "100/100" in _final_line(stream)


def test_an_error_leaves_the_bar_where_the_finished_pieces_left_it(getkey):
    stream = io.StringIO()
    states = jr.normal(getkey(), (2, 2))
    with pytest.raises(KeyboardInterrupt), ProgressBar(100, file=stream) as bar:
        for done in (20, 40, 60):
            states = _piece(states)
            bar.follow(done, states)
        raise KeyboardInterrupt
    assert bar.n == 40
    assert "40/100" in _final_line(stream)


def test_show_moves_only_forward_and_sets_the_postfix():
    stream = io.StringIO()
    with ProgressBar(10, file=stream) as bar:
        bar.show(6, "R-hat 1.2")
        bar.show(3)
        assert bar.n == 6
        bar.follow(4, jnp.zeros(()))
    assert bar.n == 6
    assert "R-hat 1.2" in _final_line(stream)


def test_bad_total():
    with pytest.raises(eb.BatchError, match="`total` is -1"):
        ProgressBar(-1)


@given(num_steps=st.integers(1, 100_000))
def test_run_chains_bar_moves_about_bar_updates_times(num_steps):
    spacing = bar_spacing(num_steps)
    segments = -(-num_steps // spacing)
    assert 1 <= spacing <= num_steps
    assert segments <= 2 * BAR_UPDATES
    if num_steps >= BAR_UPDATES:
        assert segments >= BAR_UPDATES // 2
    divisors = [c for c in range(BAR_UPDATES // 2, 2 * BAR_UPDATES + 1)]
    if any(num_steps % c == 0 for c in divisors):
        assert num_steps % spacing == 0  # every segment is one compiled length


def test_run_chains_bar_shows_every_step_and_the_same_draws(capsys):
    def step(x, key):
        return x + jr.normal(key, x.shape)

    init = jnp.zeros((4, 2))
    shown = eb.run_chains(step, init, jr.key(0), 50, progress=True)
    plain = eb.run_chains(step, init, jr.key(0), 50)
    np.testing.assert_array_equal(np.asarray(shown.trace), np.asarray(plain.trace))
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.startswith("run_chains: 100%") and "50/50" in last
