"""`superchains=K`: K starts, K * M keys; chain `c` starts from `init[c // M]`, and
ArviZ sees each chain's superchain."""

from typing import Any

import arviz_stats
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from chains_workloads import metropolis
from helpers import assert_trees_identical

import eqx_batch as eb


def _starts() -> dict:
    return {
        "w": jnp.arange(3 * 4.0).reshape(3, 2, 2),
        "b": jnp.array([-1.0, 0.0, 1.0]),
    }


@pytest.mark.accelerator
def test_chain_c_starts_from_init_c_over_m_and_runs_as_an_expanded_init():
    starts, keys = _starts(), jr.split(jr.key(0), 3 * 5)
    ids = np.repeat(np.arange(3), 5)
    at_start = eb.run_chains(metropolis, starts, keys, 0, superchains=3)
    assert_trees_identical(at_start.final, eb.take(starts, ids))
    assert at_start.superchain is not None
    np.testing.assert_array_equal(at_start.superchain, ids)
    assert at_start.superchain.dtype == np.int64

    grouped = eb.run_chains(metropolis, starts, keys, 30, superchains=3)
    expanded = eb.run_chains(metropolis, eb.take(starts, ids), keys, 30)
    assert_trees_identical(
        (grouped.final, grouped.trace, grouped.keys),
        (expanded.final, expanded.trace, expanded.keys),
    )
    assert expanded.superchain is None


def test_legacy_keys_and_numpy_integers():
    starts = _starts()
    legacy = jr.key_data(jr.split(jr.key(1), 6))
    three: Any = np.int64(3)
    result = eb.run_chains(metropolis, starts, legacy, 3, superchains=three)
    assert result.superchain is not None
    np.testing.assert_array_equal(result.superchain, [0, 0, 1, 1, 2, 2])
    assert result.keys.dtype == np.uint32


@pytest.mark.accelerator
def test_to_arviz_names_each_chain_s_superchain_for_rhat_nested():
    starts, keys = _starts(), jr.split(jr.key(2), 3 * 4)
    result = eb.run_chains(
        metropolis, starts, keys, 40, superchains=3, diagnostics=True
    )
    data = result.to_arviz()
    np.testing.assert_array_equal(
        data.posterior.superchain.values, np.repeat(np.arange(3), 4)
    )
    assert data.posterior.superchain.dims == ("chain",)
    nested = arviz_stats.rhat_nested(
        data, superchain_ids=data.posterior.superchain.values, method="identity"
    )
    assert result.diagnostics is not None
    np.testing.assert_allclose(
        result.diagnostics.nested_rhat["b"], nested["b"], rtol=2e-5
    )


@pytest.mark.parametrize(
    "superchains, keys, match",
    [
        (True, 6, "`superchains` is True; it must be"),
        (0, 6, "`superchains`"),
        (4, 12, r"`init` has 3 members but `superchains=4`"),
        (3, 7, r"`key` holds 7 keys, which `superchains=3` does not divide"),
        (3, None, r"`superchains=3` needs one key per chain"),
    ],
)
def test_bad_superchains_are_refused(superchains, keys, match):
    key = jr.key(0) if keys is None else jr.split(jr.key(0), keys)
    with pytest.raises(eb.BatchError, match=match):
        eb.run_chains(metropolis, _starts(), key, 3, superchains=superchains)


def test_an_init_with_a_start_per_chain_is_refused():
    # 2 superchains of 3: `init` given already expanded, with 6 members that need not
    # start equal, is refused rather than read as 6 superchains' starts.
    starts = eb.take(_starts(), np.arange(2))
    expanded = eb.take(starts, np.repeat(np.arange(2), 3))
    with pytest.raises(
        eb.BatchError, match=r"`init` has 6 members .*one start per superchain"
    ):
        eb.run_chains(metropolis, expanded, jr.split(jr.key(0), 6), 3, superchains=2)
