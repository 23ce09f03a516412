"""The ChEES-HMC recipe of `examples/chees.py` (issue 44), checked as laws.

- Dual averaging moves the step size towards the target acceptance: up when every
  proposal is accepted, down when few are, and from a step size 50 times too large
  or 100 times too small to a harmonic-mean acceptance near 0.651.
- On a standard normal in D dimensions, the adapted step size scales as D^(-1/4)
  (leapfrog's energy error grows as D step^4) and the trajectory length is near
  ChEES's optimum.
- Sampling with the adapted values frozen gives the known moments of a standard
  normal and of eight schools (quadrature, `examples/posteriors.py`), and leaves the
  shared state as it was.
- BlackJAX's `chees_adaptation`, the same maths from the same starts, adapts a step
  size within a factor of 1.5 of ours (measured: within 7%).

The kernel runs in a plain `lax.scan` (`chees.run_loop`), apart from `eb.run_chains`.
"""

import functools as ft
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import blackjax
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest


sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
import chees  # noqa: E402
import posteriors  # noqa: E402


CHAINS = 128


def standard_normal(position, data=None):
    del data
    return -0.5 * jnp.sum(position**2)


def harmonic_mean(acceptance) -> float:
    """The harmonic mean over chains of each step's acceptance, averaged over steps."""
    with np.errstate(divide="ignore"):  # a chain that accepts nothing: 0
        return float(np.mean(1.0 / np.mean(1.0 / np.asarray(acceptance), axis=0)))


@ft.cache
def warmed_normal(dimension: int, step_size: float = 0.1, steps: int = 1000):
    """A ChEES warmup of 128 chains on N(0, I_D), started at N(0, 2^2 I)."""
    starts = 2.0 * jr.normal(jr.key(dimension), (CHAINS, dimension))
    return chees.run_loop(
        chees.warmup_step(standard_normal),
        starts,
        jr.key(1),
        steps,
        chees.chees_init(step_size),
    )


def test_dual_averaging_direction():
    # One adaptation step, from proposals all accepted or mostly refused.
    state = chees.chees_init(0.1)
    start = jr.normal(jr.key(0), (8, 3))

    def after(acceptance: float) -> float:
        proposal = chees.Proposal(
            start,
            start + 0.1,
            jnp.ones((8, 3)),
            jnp.full(8, acceptance),
            jnp.zeros(8, bool),
        )
        return float(jnp.exp(chees.adapt(state, proposal, start, 0.5).log_step_size))

    assert after(1.0) > 0.1  # too cautious: a larger step
    assert after(0.2) < after(0.6) < after(1.0)


@pytest.mark.parametrize("initial", [5.0, 0.001])
def test_dual_averaging_reaches_target(initial):
    # From a step size far too large (nearly everything refused) or far too small
    # (everything accepted), 300 steps bring the acceptance to the target.
    _, shared, _, outputs = warmed_normal(10, initial, 300)
    assert harmonic_mean(outputs["acceptance"][:, -100:]) == pytest.approx(
        chees.TARGET_ACCEPTANCE, abs=0.05
    )
    assert 0.5 < float(shared.step_size) < 1.5  # this run: 0.87 to 0.93


@pytest.mark.parametrize("dimension", [10, 100])
def test_standard_normal_step_size_and_length(dimension):
    _, shared, _, outputs = warmed_normal(dimension)
    # Leapfrog's energy error on N(0, I_D) grows as D step^4, so a fixed acceptance
    # needs step ~ D^(-1/4): this run, 1.56 (D = 10) and 1.67 (D = 100) times it.
    scaled = float(shared.step_size) * dimension**0.25
    assert 1.2 < scaled < 2.2
    assert harmonic_mean(outputs["acceptance"][:, -200:]) == pytest.approx(
        chees.TARGET_ACCEPTANCE, abs=0.03
    )
    # With exact dynamics, ChEES on N(0, I) is proportional to E_u sin^2(u T), u
    # uniform: 1/2 - sin(2T) / 4T, largest at T = 2.25 and within 75% of that from
    # 1.4 to 3.9. Leapfrog's large steps move it (this run: 1.5 and 1.9).
    assert 1.2 < float(shared.trajectory_length) < 3.0
    # The first steps, whose step size dual averaging throws far, may diverge.
    assert not bool(outputs["divergent"][:, 500:].any())


def moment_errors(draws, mean, variance) -> tuple[float, float]:
    """The largest |mean error| in posterior sds, and |variance ratio - 1|."""
    draws = np.asarray(draws, np.float64).reshape(-1, draws.shape[-1])
    mean_error = np.abs(draws.mean(axis=0) - mean) / np.sqrt(variance)
    return float(mean_error.max()), float(
        np.abs(draws.var(axis=0) / variance - 1).max()
    )


def test_frozen_sampling_standard_normal():
    warm, shared, _, _ = warmed_normal(100)
    final, after, trace, outputs = chees.run_loop(
        chees.sample_step(standard_normal), warm, jr.key(2), 400, shared
    )
    assert jax.tree.all(jax.tree.map(jnp.array_equal, after, shared))  # frozen
    # 128 chains x 400 draws, nearly independent at ChEES's length: a mean's
    # standard error is about 0.005 sd; this run's errors: 0.014 sd and 2.4%.
    mean_error, variance_error = moment_errors(trace, 0.0, 1.0)
    assert mean_error < 0.05 and variance_error < 0.08
    assert harmonic_mean(outputs["acceptance"]) == pytest.approx(0.651, abs=0.05)


def test_frozen_sampling_eight_schools():
    posterior = posteriors.EIGHT_SCHOOLS_NON_CENTRED
    data = jax.tree.map(jnp.asarray, posterior.reference_data)
    warm, shared, _, _ = chees.run_loop(
        ft.partial(chees.warmup_step(posterior.log_density), data=data),
        posterior.initial(jr.key(0), CHAINS),
        jr.key(1),
        500,
        chees.chees_init(0.1),
    )
    _, _, trace, outputs = chees.run_loop(
        ft.partial(chees.sample_step(posterior.log_density), data=data),
        warm,
        jr.key(2),
        500,
        shared,
    )
    # The quadrature's moments; this run's errors: 0.010 sd and 1.2%. log tau's
    # posterior is skewed with a long left tail, the hardest coordinate to mix.
    assert posterior.moments is not None
    mean_error, variance_error = moment_errors(trace, *posterior.moments(data))
    assert mean_error < 0.05 and variance_error < 0.1
    assert not bool(outputs["divergent"].any())


@pytest.mark.parametrize("dimension", [10, 100])
def test_agrees_with_blackjax(dimension):
    _, shared, _, _ = warmed_normal(dimension)
    starts = 2.0 * jr.normal(jr.key(dimension), (CHAINS, dimension))
    # BlackJAX's internals mix dtypes and ranks as JAX's defaults allow.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        warmup = blackjax.chees_adaptation(lambda x: standard_normal(x), CHAINS)
        # BlackJAX types `run` as its base protocol's, of two arguments.
        run: Any = warmup.run
        _, info = run(
            jr.key(1),
            starts,
            0.1,
            optax.adam(chees.ADAM_RATE, chees.ADAM_B1, chees.ADAM_B2),
            1000,
        )
    # Its adapted values are the moving averages our `ChEESState` keeps too.
    adapted = info.adaptation_state
    step_size = float(jnp.exp(adapted.log_step_size_moving_average[-1]))
    length = float(jnp.exp(adapted.log_trajectory_length_moving_average[-1]))
    # The same dual averaging, target and average: this run, within 1%.
    assert 1 / 1.1 < float(shared.step_size) / step_size < 1.1
    # The same criterion and Adam, but BlackJAX restarts Adam's iterate from the
    # moving average at every step: this run, T within 6% (D = 100: 1.89 against
    # ours 2.00; with optax's default Adam, 1.06 against 1.9).
    assert 1 / 1.25 < float(shared.trajectory_length) / length < 1.25


@pytest.mark.examples
def test_example_script(tmp_path):
    # `python examples/chees.py`, run with eb.run_chains(shared=...), as a user would.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    script = pathlib.Path(__file__).parents[1] / "examples" / "chees.py"
    completed = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)],
        cwd=tmp_path,
        env=dict(env, PYTHONWARNINGS="error"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(completed.stdout.splitlines()[-1].removeprefix("RESULT "))
    one, many = result["one"], result["many"]
    # This run: stopped at 400 steps, step size 0.27, T 8.0, errors 0.008 sd, 2.1%.
    # `burn_in=200`: no check before step 400.
    assert one["converged"] and one["warmup_steps"] in (400, 600, 800, 1000)
    assert 0.1 < one["step_size"] < 0.6 and one["divergent"] == 0
    assert one["mean_error_sd"] < 0.05 and one["variance_error"] < 0.1
    # Each of 8 problems adapted and stopped on its own (this run: 400 steps each,
    # step sizes 0.07 to 0.35, mean errors at most 0.014 sd).
    assert len(many["step_size"]) == 8
    assert all(400 <= steps <= 1000 for steps in many["warmup_steps"])
    assert max(many["mean_error_sd"]) < 0.05 and max(many["variance_error"]) < 0.1
