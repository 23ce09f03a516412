"""Simulation-based calibration of eight schools: a thousand posteriors in one run.

The question: my sampler runs, its R-hat is fine, but does it sample the right
posterior? One fit cannot tell: its truth is unknown. Simulation-based calibration
(SBC; Talts, Betancourt, Simpson, Vehtari and Gelman, "Validating Bayesian inference
algorithms with simulation-based calibration", arXiv 1804.06788) can: draw parameters
from the prior, data from the model given them, and fit the data. If the sampler is
right, the rank of the true value among the posterior draws is uniform, over many such
replications, for every parameter. A sampler that is too confident, too vague or
biased bends the histogram of ranks out of its band.

SBC needs hundreds of fits of the same model to different data: many problems of one
shape, which `eb.run_chains(..., data=...)` runs in ONE compiled loop. Here R = 1000
replications of eight schools, non-centred (Rubin 1981; the classic
sigma = [15, 10, 16, 11, 9, 11, 10, 18]):

    mu ~ N(0, 5),  tau ~ half-normal(5),  theta_tilde_j ~ N(0, 1),
    theta_j = mu + tau * theta_tilde_j,  y_j ~ N(theta_j, sigma_j),

sampled in (mu, log tau, theta_tilde) by HMC written here in JAX (a unit mass matrix,
a fixed number of leapfrog steps of a jittered size). Each replication gets 4
superchains of 4 chains started from 4 prior draws, a fixed budget of steps, and R-hat
per replication (`diagnostics=True`). The ranks and their histograms are computed on
the device, by a function of pytrees (`jax.tree.map`), for the sampled parameters and
for theta.

The prior of tau is half-normal(5), not the half-Cauchy(5) of many_short_chains.py:
a half-Cauchy draws tau above 50 in 6% of replications and above 500 in 0.6%, where
the data pin each theta_j down to within sigma_j, so theta_tilde's posterior has a
standard deviation of sigma_j / tau, a hundredth of its prior's: no one step size
serves both, and a sampler with one step size for every replication is miscalibrated
there. SBC shows it (`--tau-prior half-cauchy`): that is its job, but the lesson is
about step-size adaptation, not this example's.

Then it fits the same replications again (other chains), with a warmup that stops
per replication: `until=eb.converged(every=50)` with `data=`, each replication
checked on its own superchains and leaving the run when nested R-hat passes (the
fixed budget's 1000 steps the cap), followed by a fresh sampling phase of 700 steps
from each chain's `final` and `keys`, ranked as the fixed budget's draws are. It
also ranks the draws of the window each stop was decided on (`window_start` to
`steps_done`), and, as their control, the same number of draws from the first window
of the fresh sample: a window chosen because it passed may be biased, a fresh one is
not.

    python examples/sbc.py [--out DIR] [--replications R] [--tau-prior half-cauchy]

It prints the acceptance rate, R-hat and, for each quantity, a chi-square and a
Kolmogorov-Smirnov test of the ranks' uniformity; for the second run, the steps each
replication's warmup took, the chain-steps and seconds of both ways, and the same
tests of each of its three sets of ranks. It writes the histograms of the fixed
budget's ranks with their 99% band to `DIR/sbc_ranks.png` and the comparison to
`DIR/sbc_stopping.png` (`_half_cauchy` before `.png` with that prior; default
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

import jax
import jax.numpy as jnp
import jax.random as jr
import matplotlib
import numpy as np
import scipy.stats
from jax.flatten_util import ravel_pytree


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import eqx_batch as eb  # noqa: E402


DEFAULT_OUT = pathlib.Path(__file__).parent / "out"
SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], np.float32)
SUPERCHAINS = 4  # per replication
CHAINS_PER_SUPERCHAIN = 4
CHAINS = SUPERCHAINS * CHAINS_PER_SUPERCHAIN  # per replication
NUM_STEPS = 1000
BURN_IN = 300
THIN = 5  # the trace: 140 draws per chain, for R-hat
# SBC ranks every 10th of them: draws 50 steps apart, nearly independent. Ranks among
# autocorrelated draws are not uniform even for an exact sampler (Talts et al. thin
# to the effective sample size), and R-hat of 14 draws per chain is too noisy to read.
RANK_THIN = 10
DRAWS = (NUM_STEPS - BURN_IN) // THIN // RANK_THIN  # ranked per chain
L = CHAINS * DRAWS  # posterior draws per replication: a rank is one of 0..L
STEP_SIZE = 0.4
LEAPFROG_STEPS = 8
PER_BIN = 20  # Talts et al.'s advice: about 20 replications per bin, expected
# Stopping per replication: the warmup ends at the first check nested R-hat passes
# (every CHECK_EVERY steps, NUM_STEPS the cap), then a sampling phase as long as the
# fixed budget's, ranked the same way.
CHECK_EVERY = 50
SAMPLE_STEPS = NUM_STEPS - BURN_IN
# The window that passed, and the first window of the fresh sample (its control),
# ranked on the same draws: every 10th step, 5 per chain, 80 per replication.
WINDOW_RANK_THIN = 2
WINDOW_DRAWS = CHECK_EVERY // THIN // WINDOW_RANK_THIN
L_WINDOW = CHAINS * WINDOW_DRAWS


# --- The model ------------------------------------------------------------------------


class TauPrior(NamedTuple):
    """A prior of tau: how to draw it, and its log density up to a constant."""

    draw: Callable[[jax.Array], jax.Array]
    log_density: Callable[[jax.Array], jax.Array]


TAU_PRIORS = {
    "half-normal": TauPrior(
        draw=lambda key: 5.0 * jnp.abs(jr.normal(key)),
        log_density=lambda tau: -0.5 * (tau / 5.0) ** 2,
    ),
    # The one many_short_chains.py uses; see the docstring for what SBC says of it.
    "half-cauchy": TauPrior(
        draw=lambda key: 5.0 * jnp.abs(jr.cauchy(key)),
        log_density=lambda tau: -jnp.log1p((tau / 5.0) ** 2),
    ),
}


def draw_prior(key: jax.Array, tau_prior: TauPrior) -> dict:
    """ONE draw of the parameters from the prior, in the sampled coordinates."""
    mu_key, tau_key, theta_key = jr.split(key, 3)
    return {
        "mu": 5.0 * jr.normal(mu_key),
        "log_tau": jnp.log(tau_prior.draw(tau_key)),
        "theta_tilde": jr.normal(theta_key, (8,)),
    }


def quantities(params: dict) -> dict:
    """What SBC ranks: the sampled parameters (tau for log tau: a rank does not change
    under an increasing map) and the schools' effects theta, the model's point."""
    tau = jnp.exp(params["log_tau"])
    return {
        "mu": params["mu"],
        "tau": tau,
        "theta_tilde": params["theta_tilde"],
        "theta": params["mu"] + tau * params["theta_tilde"],
    }


def simulate(key: jax.Array, tau_prior: TauPrior) -> tuple[dict, dict]:
    """ONE replication: parameters from the prior and data from the model given them."""
    params_key, noise_key = jr.split(key)
    params = draw_prior(params_key, tau_prior)
    theta = quantities(params)["theta"]
    y = theta + SIGMA * jr.normal(noise_key, (8,))
    return params, {"y": y, "sigma": jnp.asarray(SIGMA)}


def log_density(params: dict, data: dict, tau_prior: TauPrior) -> jax.Array:
    """The log posterior of ONE replication's data, in (mu, log tau, theta_tilde): the
    log Jacobian of tau = exp(log tau) is log tau."""
    mu, log_tau, theta_tilde = params["mu"], params["log_tau"], params["theta_tilde"]
    tau = jnp.exp(log_tau)
    theta = mu + tau * theta_tilde
    return (
        -0.5 * (mu / 5.0) ** 2
        + tau_prior.log_density(tau)
        + log_tau
        - 0.5 * jnp.sum(theta_tilde**2)
        - 0.5 * jnp.sum(((data["y"] - theta) / data["sigma"]) ** 2)
    )


# --- HMC for ONE chain, on any pytree of floats ---------------------------------------


def hmc(
    state: Any,
    key: jax.Array,
    data: Any,
    *,
    log_density: Callable,
    step_size: float,
    leapfrog_steps: int,
) -> tuple[Any, dict]:
    """One step of Hamiltonian Monte Carlo with a unit mass matrix, for ONE chain of
    the problem whose data is `data`.

    The step size is drawn uniformly from `[step_size / 2, step_size]` at each step,
    so that no trajectory length resonates with a period of the target. Returns the
    new state and, to record, the acceptance probability.
    """
    momentum_key, jitter_key, accept_key = jr.split(key, 3)
    position, unravel = ravel_pytree(state)

    def potential(q: jax.Array) -> jax.Array:
        return -log_density(unravel(q), data)

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


# --- Simulation-based calibration -----------------------------------------------------


@ft.partial(jax.jit, static_argnums=(1, 2))
def simulate_all(
    key: jax.Array, replications: int, tau_prior: str
) -> tuple[dict, dict, dict]:
    """Every replication's truth and data, and its superchains' starts (prior draws),
    in one compiled call on the device."""
    prior = TAU_PRIORS[tau_prior]
    truth_key, start_key = jr.split(key)
    keys = jr.split(truth_key, replications)
    truth, data = jax.vmap(ft.partial(simulate, tau_prior=prior))(keys)
    keys = jr.split(start_key, replications * SUPERCHAINS)
    starts = jax.vmap(ft.partial(draw_prior, tau_prior=prior))(keys)
    return truth, data, starts


def make_step(tau_prior: str) -> Callable:
    """HMC of ONE chain of ONE replication, for `run_chains(..., data=...)`."""
    return ft.partial(
        hmc,
        log_density=ft.partial(log_density, tau_prior=TAU_PRIORS[tau_prior]),
        step_size=STEP_SIZE,
        leapfrog_steps=LEAPFROG_STEPS,
    )


def fit_all(data: dict, starts: dict, key: jax.Array, tau_prior: str) -> eb.Chains:
    """Fits every replication in ONE run of a fixed budget: problem p is replication
    p, its data row `data[p]`, its superchains `starts[SUPERCHAINS * p:]`, its chains
    rows `CHAINS * p` to `CHAINS * (p + 1) - 1`."""
    replications = data["y"].shape[0]
    return eb.run_chains(
        make_step(tau_prior),
        starts,
        jr.split(key, replications * CHAINS),
        NUM_STEPS,
        data=data,
        superchains=replications * SUPERCHAINS,
        burn_in=BURN_IN,
        thin=THIN,
        with_output=True,
        diagnostics=True,
    )


def warm_up_all(data: dict, starts: dict, key: jax.Array, tau_prior: str) -> eb.Chains:
    """The warmup of every replication in ONE run, each stopping on its own: at the
    first check (every CHECK_EVERY steps) where nested R-hat of its own superchains
    passes `eb.converged()`'s default, or at the fixed budget's NUM_STEPS. Every
    THIN-th state is kept, to rank the window that passed."""
    replications = data["y"].shape[0]
    return eb.run_chains(
        make_step(tau_prior),
        starts,
        jr.split(key, replications * CHAINS),
        NUM_STEPS,
        data=data,
        superchains=replications * SUPERCHAINS,
        thin=THIN,
        with_output=True,
        until=eb.converged(every=CHECK_EVERY),
    )


def sample_all(warm: eb.Chains, data: dict, tau_prior: str) -> eb.Chains:
    """A fresh sampling phase of SAMPLE_STEPS for every replication, continuing each
    chain exactly where its warmup stopped: draws that no check selected."""
    return eb.run_chains(
        make_step(tau_prior),
        warm.final,
        warm.keys,
        SAMPLE_STEPS,
        data=data,
        thin=THIN,
        with_output=True,
        diagnostics=True,
    )


@jax.jit
def sbc_ranks(draws: Any, truth: Any) -> Any:
    """The rank of each true value among its replication's posterior draws.

    **Arguments:**

    - `draws`: a pytree whose leaves are `[replications, chains, draws, ...]`.
    - `truth`: the same pytree, leaves `[replications, ...]`.

    **Returns:**

    The pytree of ranks, leaves `int32[replications, ...]`: how many of the
    replication's `chains * draws` pooled draws are below its true value, from 0 to
    `chains * draws`.
    """

    def rank(leaf: jax.Array, true: jax.Array) -> jax.Array:
        pooled = leaf.reshape(leaf.shape[0], -1, *leaf.shape[3:])
        return jnp.sum(pooled < true[:, None], axis=1, dtype=jnp.int32)

    return jax.tree.map(rank, draws, truth)


@ft.partial(jax.jit, static_argnums=(1, 2))
def rank_histograms(ranks: Any, num_ranks: int, bins: int) -> Any:
    """Histograms of the ranks (of `num_ranks` possible values, `bins` dividing it):
    leaves `int32[bins, ...]`, one histogram per scalar."""

    def histogram(leaf: jax.Array) -> jax.Array:
        binned = leaf * bins // num_ranks
        return jnp.sum(jax.nn.one_hot(binned, bins, axis=1, dtype=jnp.int32), axis=0)

    return jax.tree.map(histogram, ranks)


def choose_bins(num_ranks: int, replications: int) -> int:
    """The most bins that divide the ranks evenly and expect PER_BIN replications
    each; with too few replications for any, the fewest that divide them."""
    divisors = [bins for bins in range(2, num_ranks + 1) if num_ranks % bins == 0]
    fits = [bins for bins in divisors if replications / bins >= PER_BIN]
    return max(fits, default=divisors[0])


@jax.jit
def window_draws(trace: Any, first_draw: jax.Array) -> Any:
    """The draws ranked from each replication's window of CHECK_EVERY steps.

    **Arguments:**

    - `trace`: a trace kept every THIN steps, leaves `[replications * CHAINS, draws,
        ...]`; draw `i` is the state after step `THIN * (i + 1)`.
    - `first_draw`: `int[replications]`, each replication's first draw of its window.

    **Returns:**

    Leaves `[replications * CHAINS, WINDOW_DRAWS, ...]`: every WINDOW_RANK_THIN-th
    state of the window, ending at its last step.
    """

    def window(leaf: jax.Array) -> jax.Array:
        per_replication = leaf.reshape(first_draw.size, CHAINS, *leaf.shape[1:])

        def take(rows: jax.Array, start: jax.Array) -> jax.Array:
            kept = jax.lax.dynamic_slice_in_dim(rows, start, CHECK_EVERY // THIN, 1)
            return kept[:, WINDOW_RANK_THIN - 1 :: WINDOW_RANK_THIN]

        taken = jax.vmap(take)(per_replication, first_draw)
        return taken.reshape(-1, *taken.shape[2:])

    return jax.tree.map(window, trace)


def rank(draws: Any, truth: Any, num_ranks: int) -> tuple[dict, dict]:
    """The ranks and their histograms, per scalar quantity, of the truths among
    `draws` (states, leaves `[replications * CHAINS, draws, ...]`), of `num_ranks`
    possible values."""
    replications = jax.tree.leaves(truth)[0].shape[0]
    posterior = jax.tree.map(
        lambda leaf: leaf.reshape(replications, CHAINS, *leaf.shape[1:]),
        jax.vmap(jax.vmap(quantities))(draws),
    )
    ranks = sbc_ranks(posterior, jax.vmap(quantities)(truth))
    bins = choose_bins(num_ranks, replications)
    return scalars(ranks), scalars(rank_histograms(ranks, num_ranks, bins))


@ft.partial(jax.jit, static_argnums=1)
def spread(draws: Any, replications: int) -> Any:
    """The standard deviation of each quantity over each replication's pooled draws
    (states, leaves `[replications * CHAINS, draws, ...]`): leaves
    `[replications, ...]`."""
    posterior = jax.vmap(jax.vmap(quantities))(draws)
    return jax.tree.map(
        lambda leaf: jnp.std(leaf.reshape(replications, -1, *leaf.shape[2:]), axis=1),
        posterior,
    )


def scalars(tree: Any) -> dict[str, np.ndarray]:
    """Every scalar of `tree`'s leaves `[lead, ...]` by name (`mu`, `theta[3]`), each
    its `[lead]` values."""
    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)[2:-2]  # "['theta']" -> "theta"
        leaf = np.asarray(leaf)
        flat = leaf.reshape(leaf.shape[0], -1)
        if leaf.ndim == 1:
            named[name] = flat[:, 0]
        else:
            for i in range(flat.shape[1]):
                named[f"{name}[{i}]"] = flat[:, i]
    return named


def uniformity(ranks: np.ndarray, histogram: np.ndarray, num_ranks: int) -> dict:
    """Two tests of one quantity's ranks against the uniform on 0..num_ranks - 1.

    - chi-square, of the histogram: Talts et al.'s picture, made a number. Its bins
      lose the ranks' order, so it is weak with few replications, but it sees a
      spike in one bin (chains stuck in some replications) that KS hardly does.
    - Kolmogorov-Smirnov, of the ranks themselves: the largest gap between their
      empirical CDF and the uniform's, which a sampler too confident (a U shape),
      too vague (a hump) or biased (a slope) widens. Its p-value, from the
      continuous distribution's, is conservative for ranks that are discrete.
    """
    replications, bins = ranks.size, histogram.size
    expected = replications / bins
    chi2 = float(np.sum((histogram - expected) ** 2) / expected)
    empirical = np.cumsum(np.bincount(ranks, minlength=num_ranks)) / replications
    ks = float(np.max(np.abs(empirical - np.arange(1, num_ranks + 1) / num_ranks)))
    return {
        "chi2": chi2,
        "chi2_p": float(scipy.stats.chi2.sf(chi2, bins - 1)),
        "ks": ks,
        "ks_p": float(scipy.stats.kstwo.sf(ks, replications)),
    }


def band(replications: int, bins: int, level: float = 0.99) -> tuple[float, float]:
    """The central `level` interval of one bin's count under uniform ranks:
    Binomial(replications, 1 / bins)."""
    low, high = scipy.stats.binom.interval(level, replications, 1.0 / bins)
    return float(low), float(high)


def plot(
    histograms: dict, replications: int, tau_prior: str, path: pathlib.Path
) -> None:
    """The histogram of each quantity's ranks, in the grey band where 99% of a
    uniform's bins fall."""
    names = list(histograms)
    columns = 6
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(2.2 * columns, 1.9 * rows), sharex=True, sharey=True
    )
    bins = next(iter(histograms.values())).size
    low, high = band(replications, bins)
    for ax, name in zip(axes.flat, names, strict=False):
        counts = histograms[name]
        ax.axhspan(low, high, color="0.85", lw=0)
        ax.axhline(replications / bins, color="0.5", lw=0.8)
        width = (L + 1) / bins  # ranks per bin
        ax.bar(width * np.arange(bins), counts, width=width, align="edge", color="C0")
        ax.set_title(name, fontsize=9)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    fig.supxlabel(f"rank of the true value among its {L} posterior draws, {bins} bins")
    fig.supylabel("replications")
    fig.suptitle(
        f"SBC of eight schools, tau ~ {tau_prior}(5): {replications} replications; "
        "grey: the 99% band of a uniform bin"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report_mixing(result: eb.Chains, replications: int) -> dict:
    """The acceptance rate and R-hat of each replication, summarised over them
    (nested R-hat only for a run of superchains)."""
    acceptance = np.asarray(result.outputs["acceptance"])
    acceptance = acceptance.reshape(replications, -1).mean(axis=1)
    assert result.problems is not None  # a run of `data=`: one entry per replication
    worst = {}
    for statistic in ("rhat", "nested_rhat"):
        # Leaves [replications, ...]: the worst element of each replication.
        leaves = jax.tree.leaves(getattr(result.problems.diagnostics, statistic))
        if not leaves:
            continue
        worst[statistic] = np.max(
            [np.asarray(leaf).reshape(replications, -1).max(axis=1) for leaf in leaves],
            axis=0,
        )
    print(
        f"acceptance rate: mean {acceptance.mean():.3f}, lowest replication's "
        f"{acceptance.min():.3f}"
    )
    for statistic, values in worst.items():
        print(
            f"{statistic}, worst element of each replication: median "
            f"{np.median(values):.4f}, worst {values.max():.4f}, above 1.01 in "
            f"{np.sum(values > 1.01)} of {replications}"
        )
    return {
        "acceptance": {
            "mean": float(acceptance.mean()),
            "min": float(acceptance.min()),
        },
        **{
            statistic: {
                "median": float(np.median(values)),
                "max": float(values.max()),
                "above_1.01": int(np.sum(values > 1.01)),
            }
            for statistic, values in worst.items()
        },
    }


def report_uniformity(
    ranks: dict, histograms: dict, replications: int, num_ranks: int
) -> dict:
    """Each quantity's tests of uniformity, and its bins outside the 99% band."""
    bins = next(iter(histograms.values())).size
    low, high = band(replications, bins)
    tests = {}
    print(
        f"{'':16}{'chi2':>8}{'p':>10}{'KS':>8}{'p':>10}  bins outside the 99% band "
        f"(of {bins})"
    )
    for name, histogram in histograms.items():
        test = uniformity(ranks[name], histogram, num_ranks)
        test["outside_band"] = int(np.sum((histogram < low) | (histogram > high)))
        tests[name] = test
        print(
            f"{name:16}{test['chi2']:8.2f}{test['chi2_p']:10.4f}{test['ks']:8.3f}"
            f"{test['ks_p']:10.4f}  {test['outside_band']}"
        )
    return tests


def ecdf_gap(ranks: np.ndarray, num_ranks: int) -> np.ndarray:
    """The empirical CDF of the ranks minus the uniform's, at ranks 0..num_ranks - 1."""
    empirical = np.cumsum(np.bincount(ranks, minlength=num_ranks)) / ranks.size
    return empirical - np.arange(1, num_ranks + 1) / num_ranks


def plot_stopping(
    variants: dict, steps_done: np.ndarray, chain_steps: dict, path: pathlib.Path
) -> None:
    """The steps each replication's warmup took, the chain-steps of each way, and
    for each variant the gap of each quantity's rank ECDF from the uniform's, in the
    pointwise 99% band of a uniform's."""
    fig, axes = plt.subplots(2, 3, figsize=(13.2, 7.0))
    replications = steps_done.size
    stops, counts = np.unique(steps_done, return_counts=True)
    axes[0, 0].bar(stops, counts, width=0.8 * CHECK_EVERY, color="C0")
    axes[0, 0].set_xlabel("steps of warmup (the step nested R-hat passed)")
    axes[0, 0].set_ylabel("replications")
    axes[0, 0].set_title(f"where each of {replications} replications stopped")
    names = list(chain_steps)
    axes[1, 0].barh(names, [chain_steps[name] / 1e6 for name in names], color="C0")
    axes[1, 0].invert_yaxis()
    axes[1, 0].set_xlabel("million chain-steps")
    axes[1, 0].set_title("the cost of each way")
    for ax, (title, (ranks, num_ranks)) in zip(
        axes[:, 1:].T.flat, variants.items(), strict=True
    ):
        fraction = np.arange(1, num_ranks + 1) / num_ranks
        low, high = scipy.stats.binom.interval(0.99, replications, fraction)
        ax.fill_between(
            fraction,
            low / replications - fraction,
            high / replications - fraction,
            color="0.85",
            lw=0,
            step="post",
        )
        for name, quantity_ranks in ranks.items():
            ax.plot(
                fraction,
                ecdf_gap(quantity_ranks, num_ranks),
                color="C3" if name == "tau" else "C0",
                lw=1.2 if name == "tau" else 0.6,
                alpha=1.0 if name == "tau" else 0.5,
                drawstyle="steps-post",
            )
        ax.axhline(0.0, color="0.5", lw=0.8)
        ax.set_title(f"{title}: {num_ranks - 1} draws", fontsize=10)
        ax.set_xlabel("rank / draws")
        ax.set_ylabel("ECDF - uniform")
    fig.suptitle(
        "SBC of eight schools with a warmup that stops per replication: each "
        "quantity's rank ECDF minus the uniform's (red: tau); grey: pointwise 99% "
        "band",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report_stopping(warm: eb.Chains, replications: int) -> dict:
    """Where each replication's warmup stopped, summarised over them."""
    assert warm.problems is not None  # a run of `data=`: one entry per replication
    steps_done = warm.problems.steps_done
    each = warm.problems.stopped
    assert each is not None  # with `until`: one `eb.Stopped` per replication
    converged = sum(stopped.converged for stopped in each)
    stops, counts = np.unique(steps_done, return_counts=True)
    print(
        f"warmup steps per replication: median {np.median(steps_done):.0f}, mean "
        f"{steps_done.mean():.1f}, max {steps_done.max()}; converged in {converged} "
        f"of {replications} (the others ran to the cap, {NUM_STEPS})"
    )
    at_each = zip(stops, counts, strict=True)
    print(
        "replications stopping at each check: "
        + ", ".join(f"{stop}: {count}" for stop, count in at_each)
    )
    return {
        "steps_done": steps_done.tolist(),
        "converged": int(converged),
        "window_start": [stopped.window_start for stopped in each],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--replications", type=int, default=1000)
    parser.add_argument(
        "--tau-prior", choices=sorted(TAU_PRIORS), default="half-normal"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    replications = args.replications
    suffix = "" if args.tau_prior == "half-normal" else "_" + args.tau_prior
    suffix = suffix.replace("-", "_")

    simulate_key, fit_key = jr.split(jr.key(0))
    began = time.perf_counter()
    truth, data, starts = jax.block_until_ready(
        simulate_all(simulate_key, replications, args.tau_prior)
    )
    simulated = time.perf_counter()
    result = fit_all(data, starts, fit_key, args.tau_prior)
    jax.block_until_ready(result.trace)
    fitted = time.perf_counter()
    ranks, histograms = rank(
        jax.tree.map(lambda leaf: leaf[:, ::RANK_THIN], result.trace), truth, L + 1
    )
    ranked = time.perf_counter()
    seconds = {
        "simulate": simulated - began,
        "fit": fitted - simulated,
        "rank": ranked - fitted,
    }
    print(
        f"{replications} replications x {CHAINS} chains ({SUPERCHAINS} superchains of "
        f"{CHAINS_PER_SUPERCHAIN}), {NUM_STEPS} steps of HMC each;\nthe states "
        f"after step {BURN_IN + 1} and every {THIN}th kept, every {THIN * RANK_THIN}th "
        f"ranked: {L} draws per replication"
    )
    print(
        f"simulated in {seconds['simulate']:.2f} s, fitted in {seconds['fit']:.1f} s "
        f"(compiling included), ranked in {seconds['rank']:.2f} s"
    )
    mixing = report_mixing(result, replications)
    tests = report_uniformity(ranks, histograms, replications, L + 1)
    png = args.out / f"sbc_ranks{suffix}.png"
    plot(histograms, replications, args.tau_prior, png)
    print(f"histograms of the ranks: {png}")

    # The same replications (truths, data, starts), other chains: a warmup that
    # stops per replication, then a fresh sample as long as the fixed budget's.
    began = time.perf_counter()
    warm = warm_up_all(data, starts, jr.fold_in(fit_key, 1), args.tau_prior)
    jax.block_until_ready(warm.final)
    warmed = time.perf_counter()
    sample = sample_all(warm, data, args.tau_prior)
    jax.block_until_ready(sample.trace)
    sampled = time.perf_counter()
    assert warm.problems is not None
    steps_done = warm.problems.steps_done
    chain_steps = {
        "fixed budget": replications * CHAINS * NUM_STEPS,
        "stopping + fresh sample": CHAINS
        * int(steps_done.sum() + SAMPLE_STEPS * replications),
    }
    stopping_seconds = {"warmup": warmed - began, "sample": sampled - warmed}
    print(
        f"\nSTOPPING: a warmup of at most {NUM_STEPS} steps stopping per replication "
        f"(nested R-hat checked every {CHECK_EVERY}), then {SAMPLE_STEPS} fresh "
        f"steps ranked as above"
    )
    print(
        f"warmed up in {stopping_seconds['warmup']:.1f} s, sampled in "
        f"{stopping_seconds['sample']:.1f} s (compiling included), against "
        f"{seconds['fit']:.1f} s for the fixed budget"
    )
    stopping = report_stopping(warm, replications)
    print(
        f"chain-steps: {chain_steps['stopping + fresh sample']:,} against "
        f"{chain_steps['fixed budget']:,} for the fixed budget ("
        f"{chain_steps['stopping + fresh sample'] / chain_steps['fixed budget']:.3f})"
    )
    print("the fresh sample:")
    fresh_mixing = report_mixing(sample, replications)
    # The stopped window: the one the check passed on, `window_start` to the stop;
    # its control: the fresh sample's first window, ranked on the same draws.
    window_starts = np.asarray(stopping["window_start"])
    variants = {
        "fresh sample": (
            jax.tree.map(lambda leaf: leaf[:, ::RANK_THIN], sample.trace),
            L + 1,
        ),
        "stopped window": (
            window_draws(warm.trace, jnp.asarray(window_starts // THIN)),
            L_WINDOW + 1,
        ),
        "fresh first window": (
            window_draws(sample.trace, jnp.zeros(replications, jnp.int32)),
            L_WINDOW + 1,
        ),
    }
    stopping_tests = {}
    ecdfs = {"fixed budget": (ranks, L + 1)}
    for name, (draws, num_ranks) in variants.items():
        variant_ranks, variant_histograms = rank(draws, truth, num_ranks)
        print(f"{name}: {num_ranks - 1} draws per replication")
        stopping_tests[name] = report_uniformity(
            variant_ranks, variant_histograms, replications, num_ranks
        )
        ecdfs[name] = (variant_ranks, num_ranks)
    # What the chains guide warns of, measured directly: whether the window that
    # passed understates the posterior's spread against its control's.
    ratio = scalars(
        jax.tree.map(
            jnp.divide,
            spread(variants["stopped window"][0], replications),
            spread(variants["fresh first window"][0], replications),
        )
    )
    spread_ratio = {name: float(np.median(value)) for name, value in ratio.items()}
    print(
        "standard deviation of the stopped window's draws over its control's, median "
        "over replications: from "
        f"{min(spread_ratio.values()):.3f} to {max(spread_ratio.values()):.3f} over "
        f"the {len(spread_ratio)} quantities (tau {spread_ratio['tau']:.3f})"
    )
    stopping_png = args.out / f"sbc_stopping{suffix}.png"
    plot_stopping(ecdfs, steps_done, chain_steps, stopping_png)
    print(f"the comparison: {stopping_png}")

    summary = {
        "replications": replications,
        "tau_prior": args.tau_prior,
        "chains_per_replication": CHAINS,
        "superchains_per_replication": SUPERCHAINS,
        "num_steps": NUM_STEPS,
        "draws": L,
        "bins": histograms["mu"].size,
        "band": band(replications, histograms["mu"].size),
        "seconds": seconds,
        **mixing,
        "uniformity": tests,
        "min_chi2_p": min(test["chi2_p"] for test in tests.values()),
        "min_ks_p": min(test["ks_p"] for test in tests.values()),
        "histograms": {name: h.tolist() for name, h in histograms.items()},
        "png": str(png),
        "stopping": {
            "check_every": CHECK_EVERY,
            "sample_steps": SAMPLE_STEPS,
            "window_draws": L_WINDOW,
            **stopping,
            "chain_steps": chain_steps,
            "seconds": stopping_seconds,
            "fresh_mixing": fresh_mixing,
            "uniformity": stopping_tests,
            "min_p": {
                name: min(min(t["chi2_p"], t["ks_p"]) for t in tests.values())
                for name, tests in stopping_tests.items()
            },
            "outside_band": {
                name: sum(t["outside_band"] for t in tests.values())
                for name, tests in stopping_tests.items()
            },
            "spread_ratio": spread_ratio,
            "png": str(stopping_png),
        },
    }
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
