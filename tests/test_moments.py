"""Running moments (`_chains/_until/_moments.py`): merging the moments of two parts of
the draws gives the moments of the whole (a law, checked by hypothesis), and the
moments updated draw by draw in the loop are the draws' mean and second central
moment."""

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import given, settings

import eqx_batch as eb
from eqx_batch._chains._until._moments import merge, Summary


def _summary(draws: np.ndarray) -> Summary:
    """The moments of `draws` (axis 0), computed in two passes."""
    count = np.asarray(len(draws), np.int32)
    if len(draws) == 0:
        zeros = np.zeros(draws.shape[1:])
        return Summary(count, zeros, zeros)
    mean = draws.mean(axis=0)
    return Summary(count, mean, ((draws - mean) ** 2).sum(axis=0))


# No subnormal numbers anywhere: XLA on the CPU may flush them to zero in any
# arithmetic, as it would in the loop itself. Draws of magnitude 0 or at least 1e-100
# keep means and second moments far from them too (the mean of 3e-308 and -2.9e-308
# is subnormal, as hypothesis found).
_magnitude = st.floats(1e-100, 1e3)
_draws = hnp.arrays(
    np.float64,
    st.tuples(st.integers(0, 40), st.integers(1, 3)),
    elements=st.one_of(st.just(0.0), _magnitude, _magnitude.map(lambda x: -x)),
)


@settings(deadline=None, max_examples=60)
@given(draws=_draws, data=st.data())
def test_merging_two_parts_gives_the_moments_of_the_whole(draws, data):
    cut = data.draw(st.integers(0, len(draws)))
    with jax.enable_x64(True):
        merged = merge(
            Summary(*map(jnp.asarray, _summary(draws[:cut]))),
            Summary(*map(jnp.asarray, _summary(draws[cut:]))),
        )
        whole = _summary(draws)
        assert int(merged.count) == len(draws)
        scale = 1 + np.abs(draws).max(initial=0)
        np.testing.assert_allclose(
            merged.mean, whole.mean, rtol=1e-9, atol=1e-9 * scale
        )
        np.testing.assert_allclose(
            merged.m2, whole.m2, rtol=1e-9, atol=1e-9 * scale**2 * max(len(draws), 1)
        )


@settings(deadline=None, max_examples=30)
@given(draws=_draws.filter(lambda d: len(d) > 0))
def test_merging_is_exactly_symmetric_in_count_and_empty_parts_change_nothing(draws):
    with jax.enable_x64(True):
        part = Summary(*map(jnp.asarray, _summary(draws)))
        empty = Summary(*map(jnp.asarray, _summary(draws[:0])))
        for merged in (merge(part, empty), merge(empty, part)):
            np.testing.assert_array_equal(merged.mean, part.mean)
            np.testing.assert_array_equal(merged.m2, part.m2)


@pytest.mark.accelerator
def test_moments_of_a_run_are_those_of_its_trace():
    # Welford's update, draw by draw in the compiled loop, against the stored draws;
    # bfloat16 states keep their moments in float32.
    def step(state, key):
        noise = jr.normal(key, state["a"].shape)
        return {
            "a": state["a"] + noise,
            "b": (state["b"].astype(jnp.float32) + noise[..., :1]).astype(jnp.bfloat16),
        }

    init = {"a": jnp.zeros((5, 4)), "b": jnp.zeros((5, 1), jnp.bfloat16)}
    result = eb.run_chains(
        step, init, jr.key(0), 90, thin=2, burn_in=7, diagnostics=True
    )
    assert result.diagnostics is not None
    assert result.diagnostics.rhat["b"].dtype == np.float32
    draws = np.asarray(result.trace["a"], np.float64)
    n = draws.shape[1]
    means = draws.mean(axis=1)
    between = n * means.var(axis=0, ddof=1)
    within = draws.var(axis=1, ddof=1).mean(axis=0)
    expected = np.sqrt((between / within + n - 1) / n)
    np.testing.assert_allclose(result.diagnostics.rhat["a"], expected, rtol=1e-5)
