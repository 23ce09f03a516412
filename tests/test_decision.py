"""A check of `until` decided on the devices (`_chains/_until/_decision.py`) decides as
the host's check does (`_chains/_until/_stopping.py`): the same pass or fail at every
value, a threshold's last bits included, and the same worst element for the reason."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from eqx_batch._chains._until._convergence import Diagnostics
from eqx_batch._chains._until._decision import _holds
from eqx_batch._chains._until._schedule import Criterion
from eqx_batch._chains._until._stopping import worst_each, worst_of


_THRESHOLDS = st.floats(0.5, 2000.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["rhat", "nested_rhat", "ess"]),
    _THRESHOLDS,
    st.integers(-3, 3),
)
def test_the_devices_compare_a_threshold_as_the_host_does(statistic, threshold, ulps):
    # float32 values at and around the threshold's float32 neighbours: the host
    # compares a Python float, the devices a float32.
    criterion = Criterion(statistic, threshold)
    near = np.float32(threshold)
    step = np.float32(np.inf) if ulps > 0 else np.float32(-np.inf)
    for _ in range(abs(ulps)):
        near = np.nextafter(near, step)
    values = np.array([near, np.nan, np.inf, -np.inf, threshold], np.float32)
    on_device = np.asarray(jax.jit(lambda v: _holds(criterion, v))(jnp.asarray(values)))
    on_host = [bool(criterion.holds(float(v))) for v in values]
    assert on_device.tolist() == on_host


@st.composite
def _diagnostics(draw: st.DrawFn) -> tuple[Diagnostics, np.ndarray]:
    """Statistics of a few problems over a scalar and a vector leaf, with NaNs, ties
    and whole NaN leaves; and some problems' rows."""
    problems = draw(st.integers(1, 5))
    value = st.sampled_from([np.nan, 1.0, 1.01, 1.5, 400.0, 3.0])

    def leaf(shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        cells = draw(st.lists(value, min_size=size, max_size=size))
        return np.asarray(cells, np.float32).reshape(shape)

    def statistic() -> dict:
        return {"a": leaf((problems,)), "b": leaf((problems, 2, 3))}

    rows = draw(st.lists(st.integers(0, problems - 1), min_size=1, max_size=4))
    return Diagnostics(statistic(), None, statistic(), statistic()), np.asarray(rows)


@settings(max_examples=100, deadline=None)
@given(_diagnostics(), st.sampled_from(["rhat", "nested_rhat", "ess"]))
def test_the_worst_of_many_problems_at_once_is_each_ones_worst(case, statistic):
    diagnostics, rows = case
    at_once = worst_each(diagnostics, statistic, rows)
    one_by_one = [
        worst_of(jax.tree.map(lambda x, p=p: x[p], diagnostics), statistic)
        for p in rows
    ]
    for (path, value), (alone_path, alone_value) in zip(
        at_once, one_by_one, strict=True
    ):
        assert path == alone_path
        assert value == alone_value or (np.isnan(value) and np.isnan(alone_value))
