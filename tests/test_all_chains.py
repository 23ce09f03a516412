"""`eb.all_chains`: steps that see every chain, run by `eb.run_chains`."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from chains_workloads import (
    counted_stretch,
    GAUSSIAN_COV,
    gaussian_log_density,
    GAUSSIAN_MEAN,
    make_init,
    make_stretch_init,
    metropolis,
    outputs,
    run as run_workload,
    stretch_move,
)
from helpers import (
    assert_trees_identical,
    kill_once_checkpointed,
    raises,
    tree_allclose,
)
from multiprocess_launch import launch

import eqx_batch as eb


RUN_WORKER = pathlib.Path(__file__).with_name("run_worker.py")
JOB_RUN_WORKER = pathlib.Path(__file__).with_name("job_run_worker.py")


@eb.all_chains
def _disguised(states: dict, keys: jax.Array, count: jax.Array) -> dict:
    """`metropolis`, a per-chain step, as a step of every chain."""
    return jax.vmap(metropolis)(states, keys)


def _moved(state: dict, key: jax.Array) -> tuple:
    new = metropolis(state, key)
    return new, {
        "moved": jnp.any(new["layer1"]["weights"] != state["layer1"]["weights"])
    }


@eb.all_chains
def _disguised_with_output(states: dict, keys: jax.Array, count: jax.Array) -> tuple:
    return jax.vmap(_moved)(states, keys)


# ------------------------------------------------------------------------------------
# The same draws as a per-chain step.


@pytest.mark.parametrize("num_chains", [8, 5])
@pytest.mark.parametrize("legacy", [False, True])
def test_a_per_chain_step_in_disguise_gives_the_same_bits(num_chains, legacy):
    # 8 chains over 4 devices; 5, which a per-chain run pads and an all-chains run
    # places on one device. Each chain's step keys are split as for a per-chain step.
    init = make_init(num_chains)
    key = jr.PRNGKey(3) if legacy else jr.key(3)
    per_chain = eb.run_chains(
        metropolis, init, key, 20, thin=3, burn_in=4, diagnostics=True
    )
    together = eb.run_chains(
        _disguised, init, key, 20, thin=3, burn_in=4, diagnostics=True
    )
    assert_trees_identical(outputs(together), outputs(per_chain))
    if num_chains == 8:
        assert_trees_identical(together.diagnostics, per_chain.diagnostics)
    else:
        # The same moments, but the statistics pool the chains on other devices (one
        # rather than four), which may sum them in another order.
        assert tree_allclose(together.diagnostics, per_chain.diagnostics, rtol=1e-6)


def test_outputs_in_disguise_give_the_same_bits():
    init = make_init(8)
    per_chain = eb.run_chains(_moved, init, jr.key(4), 12, with_output=True)
    together = eb.run_chains(
        _disguised_with_output, init, jr.key(4), 12, with_output=True
    )
    assert_trees_identical(outputs(together), outputs(per_chain))
    assert_trees_identical(together.outputs, per_chain.outputs)
    assert together.outputs["moved"].shape == (8, 12)


@pytest.mark.accelerator
def test_the_step_gets_every_chain_and_keys_of_the_kind_passed():
    seen = []

    @eb.all_chains
    def step(states: jax.Array, keys: jax.Array, count: jax.Array) -> jax.Array:
        seen.append((states.shape, keys.shape, keys.dtype, count.shape, count.dtype))
        return states

    eb.run_chains(step, jnp.zeros((6, 3)), jr.key(0), 2)
    eb.run_chains(step, jnp.zeros((6, 3)), jr.PRNGKey(0), 2)
    typed_key = jr.key(0).dtype
    assert seen[0] == ((6, 3), (6,), typed_key, (), jnp.int32)
    assert seen[-1] == ((6, 3), (6, 2), jnp.uint32, (), jnp.int32)


def test_superchains_expand_before_the_step_sees_them():
    starts = make_init(2)
    keys = jr.split(jr.key(5), 8)
    per_chain = eb.run_chains(
        metropolis, starts, keys, 10, superchains=2, diagnostics=True
    )
    together = eb.run_chains(
        _disguised, starts, keys, 10, superchains=2, diagnostics=True
    )
    assert_trees_identical(outputs(together), outputs(per_chain))
    np.testing.assert_array_equal(together.superchain, [0, 0, 0, 0, 1, 1, 1, 1])
    assert together.diagnostics is not None
    assert together.diagnostics.nested_rhat is not None
    assert_trees_identical(together.diagnostics, per_chain.diagnostics)


def test_progress_bar_leaves_results_unchanged(capsys):
    init = make_stretch_init(8)
    plain = eb.run_chains(counted_stretch, init, jr.key(0), 40)
    shown = eb.run_chains(counted_stretch, init, jr.key(0), 40, progress=True)
    assert_trees_identical(outputs(shown), outputs(plain))
    assert "40/40" in capsys.readouterr().err


def test_nonfinite_chains_are_reported():
    @eb.all_chains
    def step(states: jax.Array, keys: jax.Array, count: jax.Array) -> jax.Array:
        # Chain 2 goes NaN at step 5 (counted from 1), chain 3 infinite at step 8.
        bad = jnp.array([0.0, 0.0, jnp.nan, jnp.inf])
        when = jnp.array([0, 0, 4, 7])
        return states + jnp.where(count == when, bad, 0.0)[:, None]

    result = eb.run_chains(step, jnp.zeros((4, 2)), jr.key(0), 10)
    np.testing.assert_array_equal(result.nonfinite.chains, [2, 3])
    np.testing.assert_array_equal(result.nonfinite.steps, [5, 8])


# ------------------------------------------------------------------------------------
# The count: the absolute step, over segments, resumes and devices.


@eb.all_chains
def _counting(states: jax.Array, keys: jax.Array, count: jax.Array) -> tuple:
    return states + 1.0, jnp.full(states.shape[0], count)


def test_count_is_the_step_number_across_segments(tmp_path):
    plain = eb.run_chains(_counting, jnp.zeros((4, 1)), jr.key(0), 23, with_output=True)
    segmented = eb.run_chains(
        _counting,
        jnp.zeros((4, 1)),
        jr.key(0),
        23,
        with_output=True,
        checkpoint=tmp_path / "run.ckpt",
        checkpoint_every=5,
    )
    expected = np.broadcast_to(np.arange(23, dtype=np.int32), (4, 23))
    for result in (plain, segmented):
        np.testing.assert_array_equal(result.outputs, expected)
        assert result.outputs.dtype == np.int32


def test_a_run_killed_mid_way_resumes_counting_bit_for_bit(tmp_path):
    # The stretch move in another process, SIGKILLed once it has checkpointed, then
    # resumed here: the same bits as an uninterrupted run, and the count goes on.
    run = ("stretch", 64, 4_000)
    path, out = tmp_path / "run.ckpt", tmp_path / "out.eqx"
    args = [str(RUN_WORKER), str(out), *map(str, (*run, path, 100, 10))]
    kill_once_checkpointed(args, path, out)

    resumed = run_workload(*run, checkpoint=path, checkpoint_every=100, thin=10)
    plain = run_workload(*run, thin=10)
    assert_trees_identical(outputs(resumed), outputs(plain))
    np.testing.assert_array_equal(resumed.final["count"], np.full(64, 4_000 - 1))
    np.testing.assert_array_equal(resumed.trace["count"][0], np.arange(0, 4_000, 10))


def test_one_device_and_four_devices_give_the_same_bits(tmp_path):
    # 6 chains: on 3 of this process's 4 devices (never padded), and on the one
    # device of the worker's process.
    out = tmp_path / "one_device.eqx"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    subprocess.run(
        [sys.executable, str(RUN_WORKER), str(out), "stretch", "6", "30"],
        env=env,
        check=True,
        timeout=120,
    )
    four = eb.run_chains(counted_stretch, make_stretch_init(6), jr.key(0), 30)
    assert len(four.final["x"].sharding.device_set) == 3
    assert len(four.trace["x"].sharding.device_set) == 3
    assert_trees_identical(eb.load(out, outputs(four)), outputs(four))


def test_a_job_of_two_processes_uses_as_many_devices_of_each(tmp_path):
    # 2 processes of 2 devices: 6 chains on one device of each (4 do not divide 6),
    # the same bits as here on 3 devices; 5 chains cannot be split over 2 processes.
    out = tmp_path / "job.eqx"
    args = [str(out), "stretch"]
    launch(JOB_RUN_WORKER, [*args, "6", "20"], devices_per_process=2)
    here = outputs(eb.run_chains(counted_stretch, make_stretch_init(6), jr.key(0), 20))
    for process_id in range(2):
        assert_trees_identical(eb.load(f"{out}.{process_id}", here), here)
    with pytest.raises(AssertionError, match="5 chains do not split over 2 processes"):
        launch(JOB_RUN_WORKER, [*args, "5", "20"], devices_per_process=2)


@pytest.mark.parametrize("num_chains, devices", [(8, 4), (12, 4), (6, 3), (7, 1)])
def test_chains_are_placed_on_the_most_devices_they_divide_over(num_chains, devices):
    # A step that reads every chain: padding chains would change its result.
    @eb.all_chains
    def step(states: jax.Array, keys: jax.Array, count: jax.Array) -> jax.Array:
        return states - jnp.mean(states, axis=0, keepdims=True)

    init = jnp.arange(num_chains, dtype=jnp.float32)[:, None] + 1.0
    result = eb.run_chains(step, init, jr.key(0), 1)
    assert len(result.final.sharding.device_set) == devices
    np.testing.assert_allclose(result.final, init - jnp.mean(init), rtol=1e-6)


# ------------------------------------------------------------------------------------
# A real cross-chain sampler: the emcee stretch move.


def test_stretch_move_finds_the_gaussian_s_mean_and_covariance():
    num_chains = 64
    init = 0.1 * jr.normal(jr.key(10), (num_chains, 2))
    result = eb.run_chains(
        stretch_move(gaussian_log_density),
        init,
        jr.key(11),
        3000,
        burn_in=1000,
        diagnostics=True,
    )
    assert result.diagnostics is not None
    draws = np.asarray(result.trace, np.float64).reshape(-1, 2)
    mean, cov = draws.mean(axis=0), np.cov(draws, rowvar=False)
    ess = np.asarray(result.diagnostics.ess, np.float64)
    assert np.all(np.asarray(result.diagnostics.rhat) < 1.02)
    # Enough independent draws that the check below is tight.
    assert np.all(ess > 1000), ess
    sd = np.sqrt(np.diag(GAUSSIAN_COV))
    assert np.all(np.abs(mean - GAUSSIAN_MEAN) < 4 * sd / np.sqrt(ess)), mean
    # A sample covariance's standard error: sqrt((s_ii s_jj + s_ij^2) / n).
    cov_se = np.sqrt(
        (np.outer(sd**2, sd**2) + GAUSSIAN_COV.astype(np.float64) ** 2) / ess.min()
    )
    assert np.all(np.abs(cov - GAUSSIAN_COV) < 4 * cov_se), cov


# ------------------------------------------------------------------------------------
# Mistakes.


def test_chunk_size_is_refused():
    raises(
        "chunk_size",
        lambda: eb.run_chains(_disguised, make_init(8), jr.key(0), 5, chunk_size=4),
        "`chunk_size=4`",
        "`eb.all_chains` step: pass None",
        "docs/chains.md#what-is-refused",
    )


def test_a_step_that_drops_the_chain_axis_is_refused():
    @eb.all_chains
    def step(states: dict, keys: jax.Array, count: jax.Array) -> dict:
        return jtu.tree_map(lambda x: x[0], states)

    raises(
        "changed the shape",
        lambda: eb.run_chains(step, make_init(8), jr.key(0), 5),
        "`init['layer1']['weights']` is float32[8,3,3] for every chain",
        "returned float32[3,3]",
        "stacked on axis 0",
    )


def test_a_step_that_changes_the_structure_is_refused():
    @eb.all_chains
    def step(states: dict, keys: jax.Array, count: jax.Array) -> dict:
        return {"layer1": states["layer1"]}

    raises(
        "structure",
        lambda: eb.run_chains(step, make_init(8), jr.key(0), 5),
        "`init['layer2']['weights']` is missing",
    )


def test_outputs_without_a_row_per_chain_are_refused():
    @eb.all_chains
    def step(states: jax.Array, keys: jax.Array, count: jax.Array) -> tuple:
        return states, {"rate": jnp.mean(states), "per_chain": states[:, 0], "n": 1}

    raises(
        "one row per chain",
        lambda: eb.run_chains(step, jnp.zeros((8, 2)), jr.key(0), 5, with_output=True),
        "`output['rate']` is float32[]",
        "`output['n']` is int32[]",
        "8 chains",
        "jnp.broadcast_to",
    )


def test_a_step_that_is_not_a_function_is_refused():
    raises(
        "not a function",
        lambda: eb.all_chains(3),  # pyright: ignore[reportArgumentType]
        "`step`",
    )


def test_marking_twice_is_marking_once():
    assert eb.all_chains(_disguised) is _disguised


def test_an_all_chains_run_is_another_run_for_its_checkpoint(tmp_path):
    # The same program and values as a per-chain run, but another kind of step.
    path = tmp_path / "run.ckpt"
    eb.run_chains(metropolis, make_init(8), jr.key(0), 5, checkpoint=path)
    raises(
        "different run",
        lambda: eb.run_chains(_disguised, make_init(8), jr.key(0), 5, checkpoint=path),
        "all_chains: the checkpoint has False, this call has True",
    )


def test_a_per_chain_step_marked_all_chains_names_the_signature():
    def step(state, key):
        return state

    with pytest.raises(eb.BatchError, match=r"step\(states, keys, count\)") as info:
        eb.all_chains(step)
    assert "step(state, key)" in str(info.value)
