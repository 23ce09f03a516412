"""`Chains.to_arviz`: chains as ArviZ data, and ArviZ's diagnostics on them."""

import functools as ft
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from typing import NamedTuple

import arviz_base
import arviz_stats
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import xarray as xr

import eqx_batch as eb
from eqx_batch._chains._results._arviz import trace_to_arviz


def noisy(state, key):
    """A random walk on every array leaf of any state (one chain)."""
    arrays, static = eqx.partition(state, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    keys = jr.split(key, len(leaves))
    moved = [x + jr.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return eqx.combine(treedef.unflatten(moved), static)


def ar1(x, key, rho):
    """An AR(1) step whose stationary distribution is the standard normal."""
    return rho * x + jnp.sqrt(1.0 - rho**2) * jr.normal(key, x.shape)


@pytest.mark.accelerator
def test_matches_a_hand_built_datatree(getkey):
    init = {
        "w": {"layer1": jr.normal(getkey(), (4, 3, 2))},
        "b": jnp.zeros(4),
    }
    result = eb.run_chains(noisy, init, getkey(), 12, thin=2)
    data = result.to_arviz()

    layer1 = np.asarray(result.trace["w"]["layer1"])
    b = np.asarray(result.trace["b"])
    assert layer1.shape == (4, 6, 3, 2) and b.shape == (4, 6)
    d0, d1 = "w.layer1_dim_0", "w.layer1_dim_1"
    posterior = xr.Dataset(
        {
            "b": (("chain", "draw"), b),
            "w.layer1": (("chain", "draw", d0, d1), layer1),
        },
        coords={
            "chain": np.arange(4),
            "draw": np.arange(6),
            d0: np.arange(3),
            d1: np.arange(2),
        },
    )
    expected = xr.DataTree.from_dict({"posterior": posterior})
    # Equal: the same groups, variables, dims, coords and values (not timestamps).
    xr.testing.assert_equal(data, expected)
    assert list(data.children) == ["posterior"]
    assert data["posterior"]["w.layer1"].dtype == np.float32
    assert data["posterior"]["w.layer1"].dims == ("chain", "draw", d0, d1)


def test_a_module_s_variables_are_named_by_dotted_paths(getkey):
    # An Equinox MLP: its activation functions are not arrays and are left out.
    mlp = eb.ensemble(
        eqx.nn.MLP, 3, in_size=2, out_size=1, width_size=4, depth=1, key=getkey()
    )
    result = eb.run_chains(noisy, mlp, getkey(), 5)
    data = result.to_arviz()
    # `.layers[0].weight` and so on, as PyTorch's `state_dict` names them.
    leaves = {
        "layers.0.weight": result.trace.layers[0].weight,
        "layers.0.bias": result.trace.layers[0].bias,
        "layers.1.weight": result.trace.layers[1].weight,
        "layers.1.bias": result.trace.layers[1].bias,
    }
    assert list(data["posterior"].data_vars) == list(leaves)
    for name, leaf in leaves.items():
        variable = data["posterior"][name]
        axes = tuple(f"{name}_dim_{axis}" for axis in range(leaf.ndim - 2))
        assert variable.dims == ("chain", "draw", *axes)
        np.testing.assert_array_equal(variable.values, leaf)
    assert data["posterior"]["layers.0.weight"].dims == (
        "chain",
        "draw",
        "layers.0.weight_dim_0",
        "layers.0.weight_dim_1",
    )


class Pair(NamedTuple):
    first: jax.Array
    second: jax.Array


def test_dict_list_and_nested_paths_are_joined_with_dots(getkey):
    init = {
        "layer1": {"weights": jnp.zeros((2, 3, 4)), "bias": jnp.zeros((2, 4))},
        "blocks": [jnp.zeros((2, 5)), Pair(jnp.zeros(2), jnp.zeros((2, 1)))],
        "heads": {7: jnp.zeros(2)},
    }
    result = eb.run_chains(noisy, init, getkey(), 3)
    posterior = result.to_arviz()["posterior"].to_dataset()
    dims = {name: variable.dims[2:] for name, variable in posterior.data_vars.items()}
    # Dict keys, attributes and indices, each written plainly (the int key too).
    assert dims == {
        "blocks.0": ("blocks.0_dim_0",),
        "blocks.1.first": (),
        "blocks.1.second": ("blocks.1.second_dim_0",),
        "heads.7": (),
        "layer1.bias": ("layer1.bias_dim_0",),
        "layer1.weights": ("layer1.weights_dim_0", "layer1.weights_dim_1"),
    }
    np.testing.assert_array_equal(
        posterior["blocks.1.second"].values, result.trace["blocks"][1].second
    )


def test_one_array_is_named_state(getkey):
    result = eb.run_chains(noisy, jnp.zeros((2, 3)), getkey(), 4)
    variable = result.to_arviz()["posterior"]["state"]
    assert variable.dims == ("chain", "draw", "state_dim_0")
    np.testing.assert_array_equal(variable.values, result.trace)


def test_more_chains_than_draws_convert_without_a_warning(getkey):
    # Many short chains, as nested R-hat is made for (the suite makes warnings errors).
    result = eb.run_chains(noisy, jnp.zeros((16, 2)), getkey(), 3)
    assert result.to_arviz()["posterior"]["state"].shape == (16, 3, 2)


def test_prng_keys_in_the_state_are_left_out(getkey):
    def step(state, key):
        carried, subkey = jr.split(state["key"])
        return {"x": state["x"] + jr.normal(subkey), "key": carried}

    init = {"x": jnp.zeros(3), "key": jr.split(getkey(), 3)}
    data = eb.run_chains(step, init, getkey(), 4).to_arviz()
    assert list(data["posterior"].data_vars) == ["x"]


def test_legacy_keys_in_the_state_are_data_like_any_other(getkey):
    # Legacy keys are plain uint32 arrays, which nothing tells apart from counts or
    # bit masks: they stay variables (the docs recommend typed keys).
    def step(state, key):
        carried, subkey = jr.split(state["key"])
        return {"x": state["x"] + jr.normal(subkey), "key": carried}

    init = {"x": jnp.zeros(3), "key": jr.key_data(jr.split(getkey(), 3))}
    data = eb.run_chains(step, init, getkey(), 4).to_arviz()
    assert list(data["posterior"].data_vars) == ["key", "x"]
    assert data["posterior"]["key"].dtype == np.uint32


def test_outputs_are_sample_stats_beside_the_posterior(getkey):
    def step(x, key):
        new = x + jr.normal(key, x.shape)
        return new, {"norm": jnp.sqrt(jnp.sum(new**2)), "first": new[:2]}

    init = jnp.zeros((3, 5))
    result = eb.run_chains(step, init, getkey(), 8, with_output=True)
    data = result.to_arviz()
    # The layout of BlackJAX and NumPyro: the states are the posterior, the step's
    # per-draw information its sample statistics.
    assert list(data.children) == ["posterior", "sample_stats"]
    np.testing.assert_array_equal(data["posterior"]["state"].values, result.trace)
    stats = data["sample_stats"]
    assert set(stats.data_vars) == {"first", "norm"}
    assert stats["norm"].dims == ("chain", "draw")
    assert stats["first"].dims == ("chain", "draw", "first_dim_0")
    np.testing.assert_array_equal(stats["norm"].values, result.outputs["norm"])
    np.testing.assert_array_equal(stats["first"].values, result.outputs["first"])
    # ArviZ's diagnostics read the group when told to.
    rhat = arviz_stats.rhat(data, group="sample_stats")
    assert rhat["first"].shape == (2,)

    scalar = eb.run_chains(
        lambda x, key: (x, jnp.sum(x)), jnp.ones((2, 3)), getkey(), 3, with_output=True
    )
    output = scalar.to_arviz()["sample_stats"]["output"]
    assert output.dims == ("chain", "draw")
    np.testing.assert_array_equal(output.values, np.full((2, 3), 3.0))


def test_a_state_and_an_output_may_share_a_name(getkey):
    # A scalar state and a vector output, both named `x` (and a state `x_dim_0` beside
    # the output's axis `x_dim_0`): each group has its own names.
    def step(state, key):
        new = {"x": state["x"] + jr.normal(key), "x_dim_0": state["x_dim_0"]}
        return new, {"x": new["x"] * jnp.arange(3.0)}

    init = {"x": jnp.zeros(2), "x_dim_0": jnp.ones(2)}
    data = eb.run_chains(step, init, getkey(), 4, with_output=True).to_arviz()
    assert data["posterior"]["x"].dims == ("chain", "draw")
    assert data["posterior"]["x_dim_0"].dims == ("chain", "draw")
    assert data["sample_stats"]["x"].dims == ("chain", "draw", "x_dim_0")


@pytest.mark.parametrize(
    "init, paths, name",
    [
        # A key with a dot, beside the nested keys that join to it.
        (
            {"a.b": jnp.zeros(2), "a": {"b": jnp.zeros(2)}},
            ["chains.trace['a.b']", "chains.trace['a']['b']"],
            "a.b",
        ),
        # An index and a dict key written alike.
        (
            {"a": [jnp.zeros(2)], "a.0": jnp.zeros(2)},
            ["chains.trace['a.0']", "chains.trace['a'][0]"],
            "a.0",
        ),
        # A leaf named as another leaf's axis.
        (
            {"a": jnp.zeros((2, 3)), "a_dim_0": jnp.zeros(2)},
            ["chains.trace['a_dim_0']", "a dimension of `chains.trace['a']`"],
            "a_dim_0",
        ),
        # ArviZ's own dimensions.
        ({"draw": jnp.zeros(2)}, ["chains.trace['draw']", "dimension `draw`"], "draw"),
        (
            {"chain": jnp.zeros((2, 3))},
            ["chains.trace['chain']", "dimension `chain`"],
            "chain",
        ),
    ],
)
def test_two_leaves_of_one_name_are_refused(getkey, init, paths, name):
    result = eb.run_chains(noisy, init, getkey(), 3)
    with pytest.raises(eb.BatchError) as error:
        result.to_arviz()
    message = str(error.value)
    for path in paths:
        assert path in message
    assert f"both be named `{name}` in `posterior`" in message
    assert "rename a key (see docs/chains.md#how-variables-are-named)" in message


def test_two_outputs_of_one_name_are_refused(getkey):
    def step(x, key):
        new = x + jr.normal(key, x.shape)
        return new, {"accept": {"rate": jnp.mean(new)}, "accept.rate": jnp.sum(new)}

    result = eb.run_chains(step, jnp.zeros((2, 3)), getkey(), 3, with_output=True)
    message = (
        "`chains.outputs['accept.rate']` and `chains.outputs['accept']['rate']` would "
        "both be named `accept.rate` in `sample_stats`"
    )
    with pytest.raises(eb.BatchError, match=re.escape(message)):
        result.to_arviz()


def test_a_leaf_named_superchain_is_refused_with_superchains(getkey):
    init = {"superchain": jnp.zeros(2)}
    grouped = eb.run_chains(noisy, init, jr.split(getkey(), 4), 3, superchains=2)
    with pytest.raises(eb.BatchError, match="coordinate `superchain`"):
        grouped.to_arviz()
    # Without superchains there is no such coordinate, and the name is free.
    plain = eb.run_chains(noisy, {"superchain": jnp.zeros(4)}, getkey(), 3)
    assert list(plain.to_arviz()["posterior"].data_vars) == ["superchain"]


def test_a_name_with_a_slash_is_refused(getkey):
    # xarray's DataTree reads `/` as a path between groups.
    result = eb.run_chains(noisy, {"a/b": jnp.zeros(2)}, getkey(), 3)
    with pytest.raises(eb.BatchError, match=r"`chains.trace\['a/b'\]` .* refuses `/`"):
        result.to_arviz()


def test_arviz_selects_variables_by_the_names_users_type(getkey):
    init = {"layer1": {"weights": jr.normal(getkey(), (4, 2))}, "layer2": jnp.zeros(4)}
    result = eb.run_chains(noisy, init, getkey(), 20)
    data = result.to_arviz()
    summary = arviz_stats.summary(data, var_names=["layer1.weights"])
    assert list(summary.index) == ["layer1.weights[0]", "layer1.weights[1]"]
    rhat = arviz_stats.rhat(data, var_names="layer1.weights")
    assert list(rhat.data_vars) == ["layer1.weights"]
    second = data["posterior"]["layer1.weights"].sel({"layer1.weights_dim_0": 1})
    np.testing.assert_array_equal(
        second.values, result.trace["layer1"]["weights"][..., 1]
    )


def hmc_like_step(x, key):
    """A random-walk Metropolis step whose outputs are named as ArviZ names a
    sampler's statistics (as docs/chains.md maps BlackJAX's HMCInfo)."""
    proposal_key, accept_key = jr.split(key)
    proposal = x + 2.0 * jr.normal(proposal_key, x.shape)
    log_ratio = 0.5 * (jnp.sum(x**2) - jnp.sum(proposal**2))
    accept = jnp.log(jr.uniform(accept_key)) < log_ratio
    new = jnp.where(accept, proposal, x)
    energy = 0.5 * jnp.sum(new**2)
    return new, {
        "diverging": log_ratio < -5.0,
        "energy": energy,
        "lp": -energy,
        "acceptance_rate": jnp.minimum(1.0, jnp.exp(log_ratio)),
    }


def hmc_like_run(getkey) -> eb.Chains:
    def step(state, key):
        new, stats = hmc_like_step(state["layer1"]["weights"], key)
        return {"layer1": {"weights": new}}, stats

    init = {"layer1": {"weights": jnp.zeros((4, 2))}}
    return eb.run_chains(step, init, getkey(), 50, with_output=True)


def test_energy_is_found_where_arviz_looks(getkey):
    result = hmc_like_run(getkey)
    energy = np.asarray(result.outputs["energy"])
    # Betancourt's E-BFMI of each chain, which ArviZ computes from `energy` in
    # `sample_stats` unless told otherwise.
    deviations = energy - energy.mean(axis=1, keepdims=True)
    by_hand = np.sum(np.diff(energy, axis=1) ** 2, axis=1) / np.sum(
        deviations**2, axis=1
    )
    bfmi = arviz_stats.bfmi(result.to_arviz())
    np.testing.assert_allclose(bfmi["energy"].values, by_hand, rtol=1e-5)


def test_diagnose_counts_the_divergences(getkey):
    result = hmc_like_run(getkey)
    divergences = int(jnp.sum(result.outputs["diverging"]))
    assert 0 < divergences < result.outputs["diverging"].size
    diagnose = getattr(arviz_stats, "diagnose", None)
    if diagnose is None:
        # arviz-stats 0.8, the last on Python 3.11, predates `diagnose`; the trace
        # plot's divergence marks test the same name there.
        assert importlib.metadata.version("arviz-stats").startswith("0.")
        return
    _, found = diagnose(
        result.to_arviz(), show_diagnostics=False, return_diagnostics=True
    )
    assert found["divergent"]["n_divergent"] == divergences
    assert found["bfmi"]["bfmi_values"].shape == (4,)


def test_a_trace_plot_marks_the_divergences_and_titles_the_typed_name(getkey):
    # Imported here: plotting is not part of `-m accelerator`, and the accelerator's
    # machine has no network to install it.
    import arviz_plots
    import matplotlib.pyplot as plt

    result = hmc_like_run(getkey)
    assert bool(jnp.any(result.outputs["diverging"]))
    plots = arviz_plots.plot_trace(
        result.to_arviz(), coords={"layer1.weights_dim_0": [0]}, backend="matplotlib"
    )
    try:
        assert "divergence" in plots.viz.children
        titles = np.ravel(plots.viz["title"].to_dataset()["layer1.weights"].values)
        assert [title.get_text().splitlines()[0] for title in titles] == [
            "layer1.weights"
        ]
    finally:
        plt.close("all")


@pytest.mark.accelerator
def test_summary_reads_the_posterior_without_the_step_information(getkey):
    def step(x, key):
        new = ar1(x, key, rho=0.5)
        return new, {"accepted": jnp.array(True), "energy": jnp.sum(new**2)}

    init, key = jr.normal(getkey(), (4, 2)), getkey()
    result = eb.run_chains(step, init, key, 50, with_output=True)
    summary = arviz_stats.summary(result.to_arviz())
    assert list(summary.index) == ["state[0]", "state[1]"]
    # The summary of the same chains run without outputs, number for number.
    plain = eb.run_chains(ft.partial(ar1, rho=0.5), init, key, 50)
    expected = arviz_stats.summary(plain.to_arviz())
    assert list(summary.index) == list(expected.index)
    np.testing.assert_array_equal(
        np.asarray(summary, dtype=float), np.asarray(expected, dtype=float)
    )


def test_narrow_floats_become_float32_exactly(getkey):
    def step(state, key):
        keys = {"b": key, "h": jr.fold_in(key, 1)}
        return jax.tree.map(
            lambda x, k: 0.5 * x + jr.normal(k, x.shape, x.dtype), state, keys
        )

    init = {
        "b": jr.normal(getkey(), (4, 3), jnp.bfloat16),
        "h": jr.normal(getkey(), (4,), jnp.float16),
    }
    result = eb.run_chains(step, init, getkey(), 40)
    data = result.to_arviz()
    for name, leaf in [("b", result.trace["b"]), ("h", result.trace["h"])]:
        variable = data["posterior"][name]
        assert variable.dtype == np.float32
        # Every value kept: back in the narrow dtype, the very same bits.
        back = jnp.asarray(variable.values).astype(leaf.dtype)
        np.testing.assert_array_equal(
            np.asarray(jax.lax.bitcast_convert_type(back, jnp.uint16)),
            np.asarray(jax.lax.bitcast_convert_type(leaf, jnp.uint16)),
        )
    summary = arviz_stats.summary(data)
    assert list(summary.index) == ["b[0]", "b[1]", "b[2]", "h"]
    assert np.all(np.isfinite(np.asarray(summary["r_hat"], dtype=float)))


def test_superchain_ids_are_a_coordinate_of_the_chains(getkey):
    # Three superchains of two chains: each pair starts from one point, far apart.
    starts = jnp.array([[-10.0], [0.0], [10.0]])
    init = jnp.repeat(starts, 2, axis=0)
    result = eb.run_chains(ft.partial(ar1, rho=0.9), init, getkey(), 30)
    ids = np.array([0, 0, 1, 1, 2, 2])
    data = trace_to_arviz(result.trace, superchain_ids=ids)
    superchain = data["posterior"].superchain
    assert superchain.dims == ("chain",)
    np.testing.assert_array_equal(superchain.values, ids)
    nested = arviz_stats.rhat_nested(data, superchain_ids=superchain.values)
    # ArviZ's nested R-hat of the same draws, given the ids by hand.
    by_hand = arviz_stats.rhat_nested(trace_to_arviz(result.trace), superchain_ids=ids)
    np.testing.assert_array_equal(nested["state"].values, by_hand["state"].values)
    # Superchains that start apart and have not mixed: far from 1.
    assert float(nested["state"][0]) > 1.5


@pytest.mark.parametrize(
    "ids", [np.array([0, 0, 1]), np.array([[0, 0, 1, 1]]), np.array([0.0, 0, 1, 1])]
)
def test_superchain_ids_not_one_integer_per_chain_are_refused(getkey, ids):
    result = eb.run_chains(noisy, jnp.zeros((4, 2)), getkey(), 3)
    with pytest.raises(eb.BatchError, match=r"`superchain_ids` is .* 4 chains"):
        trace_to_arviz(result.trace, superchain_ids=ids)


@pytest.mark.accelerator
def test_rhat_flags_chains_started_far_apart_until_they_converge():
    # Four chains of an AR(1) with stationary distribution N(0, 1), started at +-20
    # and +-10: a few steps in, they still sit apart; after a long burn-in, they mix.
    init = jnp.array([[-20.0], [-10.0], [10.0], [20.0]])
    step = ft.partial(ar1, rho=0.9)
    early = eb.run_chains(step, init, jr.key(0), 20)
    late = eb.run_chains(step, init, jr.key(0), 2200, burn_in=200)

    early_rhat = float(arviz_stats.rhat(early.to_arviz())["state"][0])
    late_rhat = float(arviz_stats.rhat(late.to_arviz())["state"][0])
    assert early_rhat > 1.5
    assert abs(late_rhat - 1.0) < 0.02

    # The effective sample size of an AR(1): draws x (1 - rho) / (1 + rho).
    ess = float(arviz_stats.ess(late.to_arviz())["state"][0])
    expected = 4 * 2000 * (1 - 0.9) / (1 + 0.9)
    assert 0.7 * expected < ess < 1.4 * expected


SCHOOLS = ["Choate", "Deerfield", "Andover", "Exeter", "Hotchkiss", "Lawrenceville"]


def schools_state(num_chains: int) -> dict:
    """A state with a vector per school, a scalar, and a matrix."""
    return {
        "mu": jnp.zeros(num_chains),
        "theta": jnp.zeros((num_chains, 6)),
        "eta": jnp.ones((num_chains, 6)),
        "scale": jnp.zeros((num_chains, 2, 3)),
    }


def test_dims_and_coords_label_the_axes_as_arviz_converters_do(getkey):
    # arviz#1443: theta indexed by school name, as `arviz_base.from_dict` takes it.
    def step(state, key):
        new = noisy(state, key)
        return new, {"jump": new["theta"] - state["theta"]}

    result = eb.run_chains(step, schools_state(3), getkey(), 8, with_output=True)
    dims = {"theta": ["school"], "eta": ("school",), "jump": ["school"]}
    data = result.to_arviz(dims=dims, coords={"school": SCHOOLS})

    posterior, stats = data["posterior"], data["sample_stats"]
    assert posterior["theta"].dims == ("chain", "draw", "school")
    assert posterior["eta"].dims == ("chain", "draw", "school")
    assert stats["jump"].dims == ("chain", "draw", "school")
    assert list(posterior.school.values) == SCHOOLS
    assert list(stats.school.values) == SCHOOLS
    # What `dims` does not name keeps ArviZ's names.
    assert posterior["scale"].dims == ("chain", "draw", "scale_dim_0", "scale_dim_1")
    np.testing.assert_array_equal(
        posterior["theta"].sel(school="Exeter").values, result.trace["theta"][..., 3]
    )
    summary = arviz_stats.summary(data, var_names=["theta"])
    assert list(summary.index) == [f"theta[{school}]" for school in SCHOOLS]
    # The same data as ArviZ's own converter makes from the same arrays.
    by_arviz = arviz_base.from_dict(
        {"posterior": {k: np.asarray(v) for k, v in result.trace.items()}},
        dims={"theta": ["school"], "eta": ["school"]},
        coords={"school": SCHOOLS},
        sample_dims=["chain", "draw"],
        check_conventions=False,
    )
    xr.testing.assert_equal(posterior.to_dataset(), by_arviz["posterior"].to_dataset())


def test_coords_label_arviz_s_own_dimensions_and_the_draws(getkey):
    result = eb.run_chains(noisy, schools_state(2), getkey(), 20, thin=5)
    coords = {
        "draw": np.arange(5, 21, 5),
        "chain": ["a", "b"],
        "scale_dim_1": [1, 2, 3],
    }
    data = result.to_arviz(coords=coords)
    posterior = data["posterior"]
    assert list(posterior.draw.values) == [5, 10, 15, 20]
    assert list(posterior.chain.values) == ["a", "b"]
    np.testing.assert_array_equal(
        posterior["scale"].sel(scale_dim_1=3, chain="b").values,
        result.trace["scale"][1, :, :, 2],
    )


def test_labels_keep_the_types_they_were_given(getkey):
    # Issue 43 (AZ07): NumPy would make every label of a mixed list a string, so that
    # `.sel(school=1)` found nothing.
    result = eb.run_chains(noisy, schools_state(2), getkey(), 4)
    mixed = [1, 2, "3", 4, 5.5, 6]
    data = result.to_arviz(dims={"theta": ["school"]}, coords={"school": mixed})
    posterior = data["posterior"]
    assert posterior.school.dtype == object
    assert list(posterior.school.values) == mixed
    assert [type(label) for label in posterior.school.values] == [
        int,
        int,
        str,
        int,
        float,
        int,
    ]
    theta = result.trace["theta"]
    np.testing.assert_array_equal(posterior["theta"].sel(school=1), theta[..., 0])
    np.testing.assert_array_equal(posterior["theta"].sel(school="3"), theta[..., 2])
    # Labels of one kind are the array NumPy makes of them: ints stay ints.
    data = result.to_arviz(
        dims={"theta": ["school"]}, coords={"school": [10, 11, 12, 13, 14, 15]}
    )
    school = data["posterior"].school
    assert np.issubdtype(school.dtype, np.integer)
    np.testing.assert_array_equal(
        data["posterior"]["theta"].sel(school=12), theta[..., 2]
    )


def test_tuple_labels_label_one_entry_each(getkey):
    # Issue 43 (AZ24): `np.asarray` makes 4 pairs a [4, 2] array, which was refused.
    result = eb.run_chains(noisy, {"m": jnp.zeros((3, 4))}, getkey(), 5)
    pairs = [(0, 1), (0, 2), (1, 2), (2, 3)]
    data = result.to_arviz(dims={"m": ["pair"]}, coords={"pair": pairs})
    m = data["posterior"]["m"]
    assert m.dims == ("chain", "draw", "pair")
    assert list(m.pair.values) == pairs
    np.testing.assert_array_equal(m.sel(pair=(1, 2)), result.trace["m"][..., 2])
    summary = arviz_stats.summary(data, var_names=["m"])
    assert list(summary.index) == [f"m[{pair}]" for pair in pairs]


@pytest.mark.parametrize(
    "axes, shape", [(["a", "a"], (3, 3)), (["a", "b", "a"], (2, 3, 4))]
)
def test_a_name_given_to_two_axes_of_a_variable_is_refused(getkey, axes, shape):
    # Issue 43 (AZ17): xarray only warns, and a reduction over `a` then fails.
    result = eb.run_chains(noisy, {"m": jnp.zeros((2, *shape))}, getkey(), 3)
    expected = "`dims['m']` names two axes `a`: give each axis of `m` its own name."
    with pytest.raises(eb.BatchError, match=re.escape(expected)) as error:
        result.to_arviz(dims={"m": axes})
    assert len(str(error.value)) <= 90


def test_dims_of_a_lazy_disk_trace_and_of_one_problem(getkey, tmp_path):
    # A `trace="disk"` trace stays lazy, labelled; one problem's chains alike.
    labels = {"dims": {"theta": ["school"]}, "coords": {"school": SCHOOLS}}
    init = schools_state(4)
    disk = eb.run_chains(
        noisy, init, jr.key(1), 6, trace="disk", checkpoint=tmp_path / "run"
    )
    memory = eb.run_chains(noisy, init, jr.key(1), 6)
    xr.testing.assert_equal(disk.to_arviz(**labels), memory.to_arviz(**labels))

    def step(state, key, data):
        return noisy(state, key)

    problems = eb.run_chains(step, init, jr.key(2), 6, data=jnp.arange(2.0))
    theta = problems.problem(1).to_arviz(**labels)["posterior"]["theta"]
    assert theta.dims == ("chain", "draw", "school") and theta.shape == (2, 6, 6)
    np.testing.assert_array_equal(theta.values, problems.trace["theta"][2:])


@pytest.mark.parametrize(
    "labels, expected",
    [
        # A variable the chains do not have: their variables are listed.
        (
            {"dims": {"thetas": ["school"]}},
            "`dims` names `thetas`, not a variable of these chains: "
            "`eta`, `mu`, `scale`, `theta` (group `posterior`)",
        ),
        # Not one name per axis after chain and draw.
        (
            {"dims": {"theta": ["chain", "draw", "school"]}},
            "`dims['theta']` names 3 axes (['chain', 'draw', 'school']), but "
            "`chains.trace['theta']` (`theta` of `posterior`) has draws of shape "
            "(6,): name each axis but `chain` and `draw`.",
        ),
        (
            {"dims": {"mu": ["school"]}},
            "`dims['mu']` names 1 axis (['school']), but `chains.trace['mu']`",
        ),
        # A string where a list of names goes (it would name one axis per letter).
        ({"dims": {"theta": "school"}}, "`dims['theta']` is 'school': pass a list"),
        ({"dims": ["theta", "school"]}, "`dims` is ['theta', 'school']: pass a dict"),
        # One dimension of two sizes.
        (
            {"dims": {"theta": ["school"], "scale": ["school", "x"]}},
            "a dimension of `chains.trace['scale']` (of size 2) and a dimension of "
            "`chains.trace['theta']` (of size 6) would both be the dimension `school`",
        ),
        # An axis named as ArviZ's own dimensions, or as a variable.
        (
            {"dims": {"theta": ["chain"]}},
            "a dimension of `chains.trace['theta']` and ArviZ's dimension `chain` "
            "would both be named `chain`",
        ),
        (
            {"dims": {"theta": ["mu"]}},
            "a dimension of `chains.trace['theta']` and `chains.trace['mu']` would "
            "both be named `mu`",
        ),
        # Not one label per entry.
        (
            {"dims": {"theta": ["school"]}, "coords": {"school": SCHOOLS[:5]}},
            "`coords['school']` holds 5 labels, but the dimension `school` (an axis "
            "of `chains.trace['theta']`, in the group `posterior`) has 6 entries: "
            "give one label per entry, 6 in all.",
        ),
        (
            {"coords": {"draw": range(5)}},
            "`coords['draw']` holds 5 labels, but the dimension `draw` (the draws of "
            "the group `posterior`) has 4 entries",
        ),
        (
            {"dims": {"theta": ["school"]}, "coords": {"school": [SCHOOLS]}},
            "`coords['school']` is [['Choate', ",
        ),
        # A dimension the data do not have (a typo, or one not named in `dims`).
        (
            {"coords": {"school": SCHOOLS}},
            "`coords['school']` labels `school`, not a dimension of these chains "
            "(`chain`, `draw`, `eta_dim_0`, `scale_dim_0`, `scale_dim_1`, "
            "`theta_dim_0`): name it in `dims` first.",
        ),
        ({"coords": SCHOOLS}, "`coords` is ['Choate', "),
    ],
    ids=[
        "unknown variable",
        "chain and draw named",
        "axis of a scalar",
        "a string",
        "not a dict",
        "two sizes",
        "axis named chain",
        "axis named as a variable",
        "too few labels",
        "labels of the draws",
        "labels not 1-d",
        "unknown dimension",
        "coords not a dict",
    ],
)
def test_dims_and_coords_that_do_not_fit_are_refused(getkey, labels, expected):
    result = eb.run_chains(noisy, schools_state(2), getkey(), 4)
    with pytest.raises(eb.BatchError, match=re.escape(expected)):
        result.to_arviz(**labels)


def test_dims_name_the_variables_of_every_group(getkey):
    # A name of `dims` may be a variable of either group; one of neither is listed
    # with both groups' variables.
    def step(x, key):
        new = x + jr.normal(key, x.shape)
        return new, {"accept": jnp.ones(2)}

    result = eb.run_chains(step, jnp.zeros((2, 6)), getkey(), 3, with_output=True)
    data = result.to_arviz(dims={"state": ["school"], "accept": ["side"]})
    assert data["posterior"]["state"].dims == ("chain", "draw", "school")
    assert data["sample_stats"]["accept"].dims == ("chain", "draw", "side")
    message = (
        "not a variable of these chains: `state` (group `posterior`) and `accept` "
        "(group `sample_stats`)"
    )
    with pytest.raises(eb.BatchError, match=re.escape(message)):
        result.to_arviz(dims={"x": ["school"]})


def test_no_trace_is_an_error(getkey):
    result = eb.run_chains(noisy, jnp.zeros((2, 3)), getkey(), 4, trace=False)
    with pytest.raises(
        eb.BatchError, match=r"no trace to convert: run them with `trace=True`"
    ):
        result.to_arviz()


def test_a_trace_of_keys_only_is_an_error(getkey):
    def step(state, key):
        return {"key": jr.split(state["key"])[0]}

    result = eb.run_chains(step, {"key": jr.split(getkey(), 2)}, getkey(), 2)
    with pytest.raises(eb.BatchError, match="hold no array to convert"):
        result.to_arviz()


def test_without_arviz_the_error_names_the_extra(tmp_path):
    # A fresh interpreter where `import arviz_base` fails, as when it is not installed.
    script = textwrap.dedent(
        """
        import sys

        sys.modules["arviz_base"] = None

        import jax.numpy as jnp
        import jax.random as jr

        import eqx_batch as eb

        result = eb.run_chains(lambda x, key: x + 1.0, jnp.zeros(2), jr.key(0), 3)
        try:
            result.to_arviz()
        except ImportError as error:
            print(type(error).__name__, isinstance(error, ValueError))
            print(error)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    completed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env | {"PYTHONWARNINGS": "error"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    # An ImportError (an environment to fix), not a BatchError (bad input).
    assert lines[0] == "ImportError False"
    assert "pip install 'eqx_batch[arviz]'" in lines[1]
