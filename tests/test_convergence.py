"""`diagnostics=True`: R-hat, split R-hat, nested R-hat and ESS computed on the devices
from running moments, against ArviZ on the same stored draws; the same whatever the
trace, chunking, devices, or a kill and resume."""

import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import arviz_stats
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from chains_workloads import make_init, metropolis
from helpers import assert_trees_identical, checkpoint_steps_done

import eqx_batch as eb


def ar1(state: dict, key: jax.Array) -> dict:
    """An AR(1) step on every float leaf (stationary: N(0, 1)); integers count steps."""
    a_key, b_key = jr.split(key)
    x = state["x"]
    rho = jnp.asarray(0.8, x.dtype)
    noise = jr.normal(a_key, x.shape, x.dtype)
    return {
        "x": rho * x + jnp.sqrt(1 - rho**2) * noise,
        "y": state["y"] + jr.normal(b_key, state["y"].shape, state["y"].dtype),
        "n": state["n"] + 1,
    }


def starts(members: int, dtype: type = np.float32) -> dict:
    """`members` distinct starting points, far enough apart that R-hat is above 1."""
    spread = np.linspace(-3.0, 3.0, members * 6).reshape(members, 2, 3)
    return {
        "x": jnp.asarray(spread, dtype),
        "y": jnp.asarray(spread[:, 0, :1], dtype),
        "n": jnp.zeros(members, jnp.int32),
    }


def _arviz_statistics(result: eb.Chains, superchains: bool) -> dict:
    data = result.to_arviz()
    found = {
        "rhat": arviz_stats.rhat(data, method="identity"),
        "split_rhat": arviz_stats.rhat(data, method="split"),
    }
    if superchains:
        found["nested_rhat"] = arviz_stats.rhat_nested(
            data, superchain_ids=data.posterior.superchain.values, method="identity"
        )
    return {
        name: {leaf: np.asarray(values[leaf]) for leaf in ("x", "y")}
        for name, values in found.items()
    }


def _assert_equal_to_arviz(result: eb.Chains, superchains: bool, rtol: float) -> None:
    assert result.diagnostics is not None
    expected = _arviz_statistics(result, superchains)
    for name, per_leaf in expected.items():
        ours = getattr(result.diagnostics, name)
        assert ours["n"] is None  # integers have no R-hat
        for leaf, values in per_leaf.items():
            assert np.all(np.isfinite(values)) and np.any(values > 1.01)
            np.testing.assert_allclose(
                np.asarray(ours[leaf]), values, rtol=rtol, err_msg=f"{name} {leaf}"
            )
    if not superchains:
        assert result.diagnostics.nested_rhat is None


# 3 superchains of 4 chains (12 chains, padded over 4 devices: 3 per device; and 10
# chains: 2 superchains of 5, padded to 12); odd and even numbers of draws.
@pytest.mark.parametrize(
    "members, num_chains, num_steps, thin, burn_in",
    [(3, 12, 120, 1, 0), (2, 10, 97, 3, 8), (4, 8, 40, 2, 3)],
)
@pytest.mark.parametrize("superchains", [True, False])
def test_equal_to_arviz_in_float64(
    members, num_chains, num_steps, thin, burn_in, superchains
):
    with jax.enable_x64(True):
        init = starts(members if superchains else num_chains, np.float64)
        keys = jr.split(jr.key(1), num_chains)
        result = eb.run_chains(
            ar1,
            init,
            keys,
            num_steps,
            thin=thin,
            burn_in=burn_in,
            superchains=members if superchains else None,
            diagnostics=True,
        )
        assert result.trace["x"].dtype == np.float64
        _assert_equal_to_arviz(result, superchains, rtol=1e-10)


@pytest.mark.parametrize(
    "superchains", [pytest.param(True, marks=pytest.mark.accelerator), False]
)
def test_equal_to_arviz_in_float32(superchains):
    init = starts(3 if superchains else 12)
    keys = jr.split(jr.key(2), 12)
    result = eb.run_chains(
        ar1,
        init,
        keys,
        301,
        burn_in=10,
        superchains=3 if superchains else None,
        diagnostics=True,
    )
    assert result.diagnostics is not None
    assert result.diagnostics.rhat["x"].dtype == np.float32
    _assert_equal_to_arviz(result, superchains, rtol=2e-5)


def test_ess_estimate_is_near_arviz_bulk_ess_for_stationary_chains():
    # AR(1) with rho = 0.8 from its stationary distribution: tau = 9, so 256 chains of
    # 300 draws hold about 256 * 300 / 9 = 8500 effective draws.
    init = {
        "x": jr.normal(jr.key(3), (256, 2, 3)),
        "y": jnp.zeros((256, 1)),
        "n": jnp.zeros(256, jnp.int32),
    }
    result = eb.run_chains(ar1, init, jr.key(4), 300, diagnostics=True)
    assert result.diagnostics is not None
    ours = np.asarray(result.diagnostics.ess["x"])
    bulk = np.asarray(arviz_stats.ess(result.to_arviz())["x"])
    np.testing.assert_allclose(ours, bulk, rtol=0.25)
    np.testing.assert_allclose(ours, 256 * 300 / 9, rtol=0.25)


def test_off_by_default_and_with_trace_false_the_same_statistics():
    init, keys = starts(2), jr.split(jr.key(5), 6)
    plain = eb.run_chains(ar1, init, keys, 50, thin=2, superchains=2)
    assert plain.diagnostics is None
    traced = eb.run_chains(ar1, init, keys, 50, thin=2, superchains=2, diagnostics=True)
    untraced = eb.run_chains(
        ar1, init, keys, 50, thin=2, superchains=2, diagnostics=True, trace=False
    )
    assert untraced.trace is None
    assert_trees_identical(untraced.diagnostics, traced.diagnostics)
    # Diagnostics change nothing else.
    assert_trees_identical(
        (traced.final, traced.trace, traced.keys),
        (plain.final, plain.trace, plain.keys),
    )


def test_chunked_equals_unchunked():
    init, keys = starts(3), jr.split(jr.key(6), 15)
    whole = eb.run_chains(ar1, init, keys, 60, superchains=3, diagnostics=True)
    chunked = eb.run_chains(
        ar1, init, keys, 60, superchains=3, diagnostics=True, chunk_size=4
    )
    assert_trees_identical(chunked.diagnostics, whole.diagnostics)


def test_segments_and_a_finished_checkpoint_give_the_same_statistics(tmp_path):
    init, keys = starts(2), jr.split(jr.key(7), 6)
    whole = eb.run_chains(ar1, init, keys, 61, thin=2, superchains=2, diagnostics=True)
    path = tmp_path / "run.ckpt"
    for _ in range(2):  # run in segments, then read back
        saved = eb.run_chains(
            ar1,
            init,
            keys,
            61,
            thin=2,
            superchains=2,
            diagnostics=True,
            checkpoint=path,
            checkpoint_every=7,
        )
        assert_trees_identical(saved.diagnostics, whole.diagnostics)


def test_a_checkpoint_without_diagnostics_is_another_run(tmp_path):
    init, keys = starts(2), jr.split(jr.key(8), 4)
    path = tmp_path / "run.ckpt"
    eb.run_chains(ar1, init, keys, 10, superchains=2, checkpoint=path)
    with pytest.raises(eb.BatchError, match="diagnostics"):
        eb.run_chains(
            ar1, init, keys, 10, superchains=2, diagnostics=True, checkpoint=path
        )


_KILLED_WORKER = """
import sys
import jax.random as jr
import eqx_batch as eb
from chains_workloads import make_init, metropolis
path, out = sys.argv[1:]
result = eb.run_chains(metropolis, make_init(6), jr.key(0), 4000, thin=3, burn_in=5,
    trace=False, diagnostics=True, checkpoint=path, checkpoint_every=20)
eb.save(out, {"final": result.final})
"""


def test_killed_and_resumed_equals_one_run_bit_for_bit(tmp_path):
    # SIGKILLed mid-run in another process, then resumed here: the moments were
    # checkpointed with the chains, so the statistics are those of an unkilled run.
    path, out = tmp_path / "run.ckpt", tmp_path / "out.eqx"
    worker = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WORKER, str(path), str(out)],
        cwd=pathlib.Path(__file__).parent,
    )
    try:
        deadline = time.monotonic() + 180
        while not (path.exists() and _steps_done(path) >= 200):
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
    assert worker.returncode == -signal.SIGKILL
    assert 0 < _steps_done(path) < 4000 and not out.exists()

    def run(**checkpointing: Any) -> eb.Chains:
        return eb.run_chains(
            metropolis,
            make_init(6),
            jr.key(0),
            4000,
            thin=3,
            burn_in=5,
            trace=False,
            diagnostics=True,
            **checkpointing,
        )

    resumed = run(checkpoint=path, checkpoint_every=20)
    plain = run()
    assert_trees_identical(resumed.diagnostics, plain.diagnostics)
    assert resumed.diagnostics is not None
    assert set(resumed.diagnostics.worst()) == {
        "['layer1']['weights']",
        "['layer2']['weights']",
    }


_steps_done = checkpoint_steps_done


def test_worst_finds_the_element_whose_chains_disagree():
    # Element [1, 2] of `x` starts far apart and barely moves: the worst R-hat.
    def step(state, key):
        moved = ar1(state, key)
        stuck = moved["x"].at[1, 2].set(state["x"][1, 2] + 0.01 * moved["x"][1, 2])
        return {**moved, "x": stuck}

    init = starts(8)
    result = eb.run_chains(step, init, jr.key(9), 100, diagnostics=True)
    assert result.diagnostics is not None
    worst = result.diagnostics.worst()
    assert list(worst) == ["['x']", "['y']"]  # worst leaf first; `n` has none
    assert worst["['x']"].element == (1, 2)
    assert worst["['x']"].value == pytest.approx(
        float(np.max(np.asarray(result.diagnostics.rhat["x"])))
    )
    smallest = result.diagnostics.worst("ess")
    assert smallest["['x']"].element == (1, 2)
    with pytest.raises(eb.BatchError, match="superchains"):
        result.diagnostics.worst("nested_rhat")
    with pytest.raises(eb.BatchError, match="'r_hat'"):
        result.diagnostics.worst("r_hat")


def test_nothing_to_diagnose_is_refused():
    init = starts(4)
    with pytest.raises(eb.BatchError, match="records no draw"):
        eb.run_chains(ar1, init, jr.key(0), 10, burn_in=10, diagnostics=True)
    ints = {"n": jnp.zeros(4, jnp.int32)}
    with pytest.raises(eb.BatchError, match="no floating-point"):
        eb.run_chains(lambda s, k: s, ints, jr.key(0), 10, diagnostics=True)
