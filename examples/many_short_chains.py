"""Many short chains that stop when nested R-hat says they have converged.

The question: I run a thousand chains on an accelerator. Each one is short, so
"has each chain forgotten its start?" is the wrong test, and a fixed number of steps
is either too few or, more often, far too many. How do I let the chains tell me when
they are done, and how close is the answer to the truth when they stop?

The answer, after Margossian et al. ("Nested R-hat: assessing the convergence of MCMC
when running many short chains", arXiv 2110.13017): run the chains in superchains,
K groups of M chains each started from the same over-dispersed point
(`superchains=K`), and stop when the superchains agree, `until=eb.converged()`. The
run checks nested R-hat on the devices every `every` steps and stops at the first
check it passes; `num_steps` is only the cap. The steps to the stop are the warmup:
the draws that describe the posterior are sampled afresh from where the chains
stopped (`result.final`, `result.keys`).

Two targets, each run with 16 superchains of 64 chains (1024 chains) of HMC written
here with JAX:

- eight schools, non-centred (Rubin 1981), whose posterior mean and variance are
  computed here by quadrature over tau (the other parameters are Gaussian given
  tau), so they are known to many digits;
- a 100-dimensional Gaussian with standard deviations log-spaced from 0.1 to 10, a
  condition number of 10^4, whose mean and variance are known.

For each, the run that stops is compared with the fixed budget (2000 steps, the
second half kept, as Stan's 1000 warmup and 1000 sampling iterations): the steps each
used, and the error of the posterior mean and variance given by the draws of the
window that passed, by the first 100 and 1000 steps sampled after the stop, and by
the fixed budget's second half. One run gives all four: the chains that stopped are
continued (exactly, from `result.final` and `result.keys`) to the budget.

    python examples/many_short_chains.py [--out DIR]

It prints both tables and ArviZ's summary of a few variables, writes the plot of
nested R-hat against the steps to `DIR/many_short_chains.png` (default
`examples/out/`), and ends with one line `RESULT {...}` in JSON, for scripts and
tests to read.
"""

import argparse
import functools as ft
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import arviz_stats
import jax
import jax.numpy as jnp
import jax.random as jr
import matplotlib
import numpy as np
from jax.flatten_util import ravel_pytree


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import eqx_batch as eb  # noqa: E402


DEFAULT_OUT = pathlib.Path(__file__).parent / "out"
SUPERCHAINS = 16  # K
CHAINS_PER_SUPERCHAIN = 64  # M
BUDGET = 2000  # the fixed budget's steps; its first half is warmup
THIN = 5  # keep every 5th state: enough draws, a fifth of the memory
EVERY = 50  # steps between convergence checks: 10 kept draws per chain each
# The sampling phase after the stop, as long as the fixed budget's; its first 100
# steps are compared too.
SAMPLING = BUDGET // 2
SHORT_SAMPLING = 100
# eb.converged()'s default threshold with 16 superchains or more: the paper's
# sqrt(1 + 1/M + tau) (tighter below; docs/chains.md, "Calibration of the default").
THRESHOLD = float(np.sqrt(1.0 + 1.0 / CHAINS_PER_SUPERCHAIN + 1e-4))


# --- HMC for ONE chain, on any pytree of floats ---------------------------------------


def hmc(
    state: Any,
    key: jax.Array,
    *,
    log_density: Callable,
    step_size: float,
    leapfrog_steps: int,
) -> tuple[Any, dict]:
    """One step of Hamiltonian Monte Carlo with a unit mass matrix.

    The step size is drawn uniformly from `[step_size / 2, step_size]` at each step,
    so that no trajectory length resonates with a period of the target. Returns the
    new state and, to record, the acceptance probability.
    """
    momentum_key, jitter_key, accept_key = jr.split(key, 3)
    position, unravel = ravel_pytree(state)

    def potential(q: jax.Array) -> jax.Array:
        return -log_density(unravel(q))

    gradient = jax.grad(potential)
    eps = step_size * jr.uniform(jitter_key, minval=0.5, maxval=1.0)

    def leapfrog(_: jax.Array, carry: tuple) -> tuple:
        q, p, g = carry
        p = p - 0.5 * eps * g
        q = q + eps * p
        g = gradient(q)
        return q, p - 0.5 * eps * g, g

    momentum = jr.normal(momentum_key, position.shape, position.dtype)
    q, p, _ = jax.lax.fori_loop(
        0, leapfrog_steps, leapfrog, (position, momentum, gradient(position))
    )
    energy_change = (
        potential(q) + 0.5 * p @ p - potential(position) - 0.5 * momentum @ momentum
    )
    # A trajectory that diverged (NaN energy) is rejected.
    accept_prob = jnp.where(
        jnp.isnan(energy_change), 0.0, jnp.exp(jnp.minimum(0.0, -energy_change))
    )
    accept = jr.uniform(accept_key) < accept_prob
    new = unravel(jnp.where(accept, q, position))
    return new, {"acceptance": accept_prob}


# --- The targets ----------------------------------------------------------------------


class Target(NamedTuple):
    """A posterior to sample, how to start it, and its known mean and variance."""

    name: str
    log_density: Callable  # of one chain's state
    step_size: float
    leapfrog_steps: int
    starts: Any  # K over-dispersed starts, one per superchain
    names: list[str]  # the quantities whose mean and variance are compared
    quantities: Callable  # state draws [chains, draws, ...] -> [chains, draws, q]
    mean: np.ndarray  # the known posterior mean of each quantity
    var: np.ndarray  # and its variance
    shown: dict  # the variables ArviZ summarises (its `var_names` and `coords`)


SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SCHOOLS_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def eight_schools_log_density(state: dict) -> jax.Array:
    """mu ~ N(0, 5), tau ~ half-Cauchy(5), theta = mu + tau * theta_tilde with
    theta_tilde ~ N(0, 1), y ~ N(theta, sigma); sampled in (mu, log tau,
    theta_tilde), so the log Jacobian log tau is added."""
    mu, log_tau, theta_tilde = state["mu"], state["log_tau"], state["theta_tilde"]
    tau = jnp.exp(log_tau)
    theta = mu + tau * theta_tilde
    return (
        -0.5 * (mu / 5.0) ** 2
        - jnp.log1p((tau / 5.0) ** 2)
        + log_tau
        - 0.5 * jnp.sum(theta_tilde**2)
        - 0.5 * jnp.sum(((SCHOOLS_Y - theta) / SCHOOLS_SIGMA) ** 2)
    )


def eight_schools_moments() -> tuple[np.ndarray, np.ndarray]:
    """The posterior mean and variance of (mu, tau, theta_1..8), by quadrature.

    Given tau, the model is Gaussian: mu | tau, y ~ N(m, v) with precision
    1/25 + sum_j 1/d_j and v * sum_j y_j / d_j as mean (d_j = sigma_j^2 + tau^2), and
    theta_j | mu, tau, y is Gaussian with a mean linear in mu. So the posterior of
    tau alone, p(tau | y), is known up to a constant in closed form, and every
    moment is a one-dimensional integral over tau, done here on a fine grid (the
    density falls as tau^-9: tau beyond 400 holds nothing float64 sees).
    """
    tau = np.linspace(0.0, 400.0, 400_001)[:, None]
    d = SCHOOLS_SIGMA**2 + tau**2
    v = 1.0 / (1.0 / 25.0 + np.sum(1.0 / d, axis=1, keepdims=True))
    m = v * np.sum(SCHOOLS_Y / d, axis=1, keepdims=True)
    log_weight = (
        -np.log1p((tau / 5.0) ** 2)  # the prior of tau
        - 0.5 * np.sum(np.log(d) + SCHOOLS_Y**2 / d, axis=1, keepdims=True)
        + 0.5 * np.log(v)
        + 0.5 * m**2 / v  # with mu integrated out
    )
    weight = np.exp(log_weight - log_weight.max())
    weight /= np.trapezoid(weight, tau, axis=0)
    # theta_j | tau, y: mean a_j + b_j m, variance c_j + b_j^2 v.
    b = SCHOOLS_SIGMA**2 / d
    theta_mean = tau**2 * SCHOOLS_Y / d + b * m
    theta_var = SCHOOLS_SIGMA**2 * tau**2 / d + b**2 * v
    conditional_mean = np.concatenate([m, tau, theta_mean], axis=1)
    conditional_var = np.concatenate([v, 0 * tau, theta_var], axis=1)
    mean = np.trapezoid(weight * conditional_mean, tau, axis=0)
    second = np.trapezoid(weight * (conditional_var + conditional_mean**2), tau, axis=0)
    return np.asarray(mean), np.asarray(second - mean**2)


def eight_schools_quantities(draws: dict) -> np.ndarray:
    mu, tau = draws["mu"], np.exp(draws["log_tau"])
    theta = mu[..., None] + tau[..., None] * draws["theta_tilde"]
    return np.concatenate([mu[..., None], tau[..., None], theta], axis=-1)


def eight_schools(key: jax.Array) -> Target:
    mu_key, tau_key, theta_key = jr.split(key, 3)
    k = SUPERCHAINS
    # Wider than the posterior in mu (whose sd is 3.3) and log tau (1.2); theta_tilde
    # from its prior. Wider still, a superchain can start where tau * theta_tilde is
    # so large that the step size diverges and it never moves: nested R-hat then
    # never passes (try it), but the fixed budget's answer is as wrong.
    starts = {
        "mu": 10.0 * jr.normal(mu_key, (k,)),
        "log_tau": 1.0 + 1.5 * jr.normal(tau_key, (k,)),
        "theta_tilde": jr.normal(theta_key, (k, 8)),
    }
    mean, var = eight_schools_moments()
    return Target(
        name="eight schools",
        log_density=eight_schools_log_density,
        step_size=0.3,
        leapfrog_steps=10,
        starts=starts,
        names=["mu", "tau", *(f"theta[{j}]" for j in range(8))],
        quantities=eight_schools_quantities,
        mean=mean,
        var=var,
        shown={
            "var_names": ["mu", "log_tau", "theta_tilde"],
            "coords": {"theta_tilde_dim_0": [0, 7]},
        },
    )


GAUSSIAN_SCALES = np.logspace(-1.0, 1.0, 100)  # standard deviations, 0.1 to 10
GAUSSIAN_MEAN = np.linspace(-1.0, 1.0, 100)


def gaussian_log_density(x: jax.Array) -> jax.Array:
    return -0.5 * jnp.sum(((x - GAUSSIAN_MEAN) / GAUSSIAN_SCALES) ** 2)


def ill_conditioned_gaussian(key: jax.Array) -> Target:
    # Three standard deviations off the mean in every coordinate, on average.
    noise = jr.normal(key, (SUPERCHAINS, GAUSSIAN_SCALES.size))
    return Target(
        name="100-d Gaussian",
        log_density=gaussian_log_density,
        # The narrowest coordinate (sd 0.1) bounds the step size; the widest (sd 10)
        # needs many steps to cross: this is what ill-conditioning costs.
        step_size=0.15,
        leapfrog_steps=16,
        starts=jnp.asarray(GAUSSIAN_MEAN + 3.0 * GAUSSIAN_SCALES * noise, jnp.float32),
        names=[f"x[{i}]" for i in range(GAUSSIAN_SCALES.size)],
        quantities=np.asarray,
        mean=GAUSSIAN_MEAN,
        var=GAUSSIAN_SCALES**2,
        # The narrowest, a middle and the widest coordinate.
        shown={"coords": {"state_dim_0": [0, 50, 99]}},
    )


# --- Stopping when converged ----------------------------------------------------------


def run_until_converged(step: Callable, target: Target, keys: jax.Array) -> eb.Chains:
    """Runs at most BUDGET steps, and stops at the first check nested R-hat passes.

    `eb.converged()` is the default rule: the worst element's nested R-hat at most
    THRESHOLD (with 16 superchains, the paper's). It is checked every EVERY steps on
    the draws since the last check (a failed check discards them, as the paper's
    adaptive warmup does).
    """
    return eb.run_chains(
        step,
        target.starts,
        keys,
        BUDGET,
        thin=THIN,
        superchains=SUPERCHAINS,
        with_output=True,
        until=eb.converged(every=EVERY),
    )


# --- Reporting ------------------------------------------------------------------------


def errors(target: Target, draws) -> dict[str, float]:
    """The worst error, over the quantities, of the mean and variance of `draws`.

    The mean's error is in posterior standard deviations, the variance's relative:
    both are then comparable across quantities of any scale.
    """
    values = np.asarray(target.quantities(jax.tree.map(np.asarray, draws)), np.float64)
    values = values.reshape(-1, values.shape[-1])
    sd = np.sqrt(target.var)
    return {
        "mean": float(np.max(np.abs(values.mean(axis=0) - target.mean) / sd)),
        "var": float(np.max(np.abs(values.var(axis=0) / target.var - 1.0))),
    }


def draws_between(states, first: int, end: int | None):
    """Draws `first` to `end` (excluded) of every chain."""
    return jax.tree.map(lambda leaf: leaf[:, first:end], states)


def worst_nested_rhat(draws, superchain_ids: np.ndarray) -> float:
    """ArviZ's nested R-hat without rank normalisation (the statistic the run checks
    on the devices), worst over every element of `draws`."""
    return max(
        float(
            np.max(
                arviz_stats.rhat_nested(
                    np.asarray(leaf, np.float64),
                    superchain_ids=superchain_ids,
                    method="identity",
                )
            )
        )
        for leaf in jax.tree.leaves(draws)
    )


def stop_then_continue(
    step: Callable, target: Target, keys: jax.Array
) -> tuple[eb.Chains, eb.Stopped, eb.Chains]:
    """The run until converged, why it stopped, and the same chains continued to the
    fixed budget.

    `final` and `keys` continue the chains exactly where they stopped, so the
    continued chains are, step for step, those a run of BUDGET steps would give:
    one run serves both the early stop (the draws after it) and the fixed budget (the
    draws after step BUDGET // 2).
    """
    began = time.perf_counter()
    warmup = run_until_converged(step, target, keys)
    stopped = warmup.stopped
    assert stopped is not None  # until= was given
    rest = BUDGET - warmup.steps_done
    continued = eb.run_chains(
        step, warmup.final, warmup.keys, rest, thin=THIN, with_output=True
    )
    seconds = time.perf_counter() - began
    print(
        f"until converged: stopped after {warmup.steps_done} of {BUDGET} steps "
        f"(converged: {stopped.converged}); continued for the other {rest}; "
        f"{seconds:.1f} s in all\n   {stopped.reason}"
    )
    for check, worst in zip(stopped.checks, stopped.worst, strict=True):
        print(f"   check at step {check:4d}: worst nested R-hat {worst:.4f}")
    return warmup, stopped, continued


def study(target: Target, key: jax.Array) -> dict:
    """Runs `target` until converged and on to the fixed budget, and compares the
    draws after the stop with those of the budget's second half."""
    step = ft.partial(
        hmc,
        log_density=target.log_density,
        step_size=target.step_size,
        leapfrog_steps=target.leapfrog_steps,
    )
    keys = jr.split(key, SUPERCHAINS * CHAINS_PER_SUPERCHAIN)
    print(f"\n=== {target.name}: {keys.shape[0]} chains in {SUPERCHAINS} superchains")
    warmup, stopped, continued = stop_then_continue(step, target, keys)
    superchain_ids = np.asarray(warmup.superchain)  # chain c's is c // M
    assert stopped.step + SAMPLING <= BUDGET, "the comparison needs an earlier stop"

    # Draw i of a run is the state after its step 1 + THIN * i.
    window = draws_between(warmup.trace, -(-stopped.window_start // THIN), None)
    draws_after_stop = ft.partial(draws_between, continued.trace, 0)
    # The fixed budget keeps the states after steps BUDGET // 2 + 1 to BUDGET.
    budget_start = -(-(BUDGET // 2 - stopped.step) // THIN)
    budget = draws_between(continued.trace, budget_start, None)

    # The draws the passing check saw, and ArviZ's nested R-hat of them.
    arviz_nested = worst_nested_rhat(window, superchain_ids)
    budget_nested = worst_nested_rhat(budget, superchain_ids)
    print(
        f"   ArviZ's nested R-hat of the passing window: {arviz_nested:.4f}; of the "
        f"fixed budget's second half: {budget_nested:.4f}"
    )

    measured = {
        "window": errors(target, window),
        "short": errors(target, draws_after_stop(SHORT_SAMPLING // THIN)),
        "fresh": errors(target, draws_after_stop(SAMPLING // THIN)),
        "budget": errors(target, budget),
    }
    window_steps = f"{stopped.window_start + 1}-{stopped.step}"
    rows = [
        (f"stop: the window (steps {window_steps})", stopped.step),
        (f"stop + {SHORT_SAMPLING} fresh steps", stopped.step + SHORT_SAMPLING),
        (f"stop + {SAMPLING} fresh steps", stopped.step + SAMPLING),
        (f"fixed budget (steps {BUDGET // 2 + 1}-{BUDGET})", BUDGET),
    ]
    print(f"\n{'draws from':<36} {'steps':>5}  mean error (sd)  variance error")
    for (label, steps), error in zip(rows, measured.values(), strict=True):
        print(f"{label:<36} {steps:5d}  {error['mean']:15.3f}  {error['var']:14.1%}")

    # The report comes from ArviZ, on the SAMPLING steps after the stop, for a few
    # variables (ArviZ takes a minute for all 100 of the Gaussian's). The continued
    # run has no superchains (its chains do not start equal): ArviZ is given their
    # ids.
    fresh = continued.to_arviz().isel(draw=slice(None, SAMPLING // THIN))
    nested = arviz_stats.rhat_nested(
        fresh, superchain_ids=superchain_ids, **target.shown
    )
    fresh_nested = max(float(value.max()) for value in nested.data_vars.values())
    summary = arviz_stats.summary(fresh, **target.shown)
    print(
        f"\nArviZ on the {SAMPLING} steps after the stop: nested R-hat up to "
        f"{fresh_nested:.4f}, and its summary:"
    )
    print(summary.to_string())
    acceptance = float(np.mean(np.asarray(continued.outputs["acceptance"])))
    print(f"mean acceptance probability: {acceptance:.2f}")

    return {
        "chains": int(keys.shape[0]),
        "budget": BUDGET,
        "steps_done": int(warmup.steps_done),
        "converged": bool(stopped.converged),
        "window_start": int(stopped.window_start),
        "checks": stopped.checks.tolist(),
        "worst": stopped.worst.tolist(),
        "arviz_nested_rhat": arviz_nested,
        "fixed_nested_rhat": budget_nested,
        "errors": measured,
        "fresh_nested_rhat": fresh_nested,
        "summary_rhat_max": float(summary["r_hat"].to_numpy().max()),
        "summary_rows": len(summary),
        "acceptance": acceptance,
    }


def plot(results: dict, threshold: float, path: pathlib.Path) -> None:
    """Nested R-hat - 1 at each check, on a log scale: the approach to the threshold."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, result) in enumerate(results.items()):
        excess = np.asarray(result["worst"]) - 1.0
        ax.plot(result["checks"], excess, "o-", color=f"C{i}", label=name)
        ax.axvline(result["steps_done"], color=f"C{i}", ls=":", lw=1)
    ax.axhline(threshold - 1.0, color="k", ls="--", lw=1, label="threshold")
    ax.set(
        xlabel="step (dotted: where each run stopped; the budget is the right edge)",
        ylabel="worst nested R-hat - 1",
        yscale="log",
        xlim=(0, BUDGET),
        title=f"{SUPERCHAINS} superchains x {CHAINS_PER_SUPERCHAIN} chains, "
        f"checked every {EVERY} steps",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    start_key, chain_key = jr.split(jr.key(0))
    targets = [eight_schools, ill_conditioned_gaussian]
    results = {}
    for make, target_key, key in zip(
        targets, jr.split(start_key, 2), jr.split(chain_key, 2), strict=True
    ):
        target = make(target_key)
        results[target.name] = study(target, key)

    png = args.out / "many_short_chains.png"
    plot(results, THRESHOLD, png)
    print(f"\nnested R-hat against the steps: {png}")
    print("RESULT " + json.dumps({"targets": results, "png": str(png)}))


if __name__ == "__main__":
    main()
