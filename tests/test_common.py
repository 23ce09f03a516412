"""`Draws`, the one rule for "is step `t` a draw?", against the uninterrupted trace
`[burn_in::thin]` it must agree with."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from eqx_batch._chains._common import Draws


@settings(deadline=None, max_examples=60)
@given(num_steps=st.integers(0, 60), burn_in=st.integers(0, 60), thin=st.integers(1, 7))
def test_draws_agree_with_the_uninterrupted_trace(num_steps, burn_in, thin):
    burn_in = min(burn_in, num_steps)
    draws = Draws.of(num_steps, burn_in, thin)
    # Step `t` (from 0) makes the state after `t + 1` steps: the trace keeps
    # `states[burn_in::thin]` of the states after steps 1, 2, ...
    kept = list(range(num_steps))[burn_in::thin]
    assert draws.total == len(kept)
    for step in range(num_steps + 1):
        assert draws.before(step) == len([t for t in kept if t < step])
    t = jnp.arange(num_steps, dtype=jnp.int32)
    is_draw = np.asarray(draws.is_draw(t))
    assert list(np.flatnonzero(is_draw)) == kept
    slots = np.asarray(draws.slot(t))
    assert list(slots[is_draw]) == list(range(len(kept)))
    # Inside the loop too: traced, `before` gives what it gives on the host.
    assert int(draws.before(jnp.int32(num_steps))) == draws.total
    # And for every problem at once, on the host: a NumPy array of each one's steps.
    steps = np.arange(num_steps + 1, dtype=np.int64)
    each = draws.before(steps)
    assert isinstance(each, np.ndarray) and each.dtype == np.int64
    assert list(each) == [draws.before(int(s)) for s in steps]
    for length in range(1, num_steps + 1):
        most = max(
            draws.before(start + length) - draws.before(start)
            for start in range(num_steps - length + 1)
        )
        assert most <= draws.most_in(length)
