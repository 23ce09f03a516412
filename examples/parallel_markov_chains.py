"""Many Markov chains over a small Bayesian neural network, all at once.

The question: my sampler's state is a nested dict of layer weights,
`{"layer1": {"weights": ...}, "layer2": {"weights": ...}}`, and one step of it needs
the training data. How do I run many independent chains in parallel, each with its
own random key, and get per-chain summaries, a trace plot, and a verdict on whether
the chains have converged?

The answer is `eb.run_chains`: write `step(state, key)` for ONE chain (the data
closed over with `functools.partial`), stack the chains' initial states along axis
0, and hand over one key per chain. All chains run in one compiled loop, spread over
every device, and chain `i` gets exactly the draws it would get run alone.
`result.to_arviz()` hands the draws to ArviZ, which computes R-hat and the effective
sample size (ESS) and draws its trace and rank plots (`pip install 'eqx_batch[arviz]'`).

The model is a one-hidden-layer tanh network fitted to noisy samples of
`sin(2x)`; the sampler is random-walk Metropolis on the weights' posterior (a
Gaussian likelihood and a standard normal prior).

    python examples/parallel_markov_chains.py [--out DIR]

It writes `DIR/chains_trace.png`, and ArviZ's `DIR/chains_arviz_trace.png` and
`DIR/chains_arviz_rank.png` (default `examples/out/`), and ends with one line
`RESULT {...}` in JSON, for scripts and tests to read.
"""

import argparse
import functools as ft
import json
import pathlib

import arviz_stats
import jax
import jax.numpy as jnp
import jax.random as jr
import matplotlib
import numpy as np


matplotlib.use("Agg")
import arviz_plots  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

import eqx_batch as eb  # noqa: E402


DEFAULT_OUT = pathlib.Path(__file__).parent / "out"
HIDDEN = 5
NOISE = 0.1  # the likelihood's noise scale, known
STEP_SIZE = 0.015
NUM_CHAINS = 8
NUM_STEPS = 20_000
BURN_IN = 10_000
THIN = 50


# --- The model and its posterior ------------------------------------------------------


def network(state: dict, x: jax.Array) -> jax.Array:
    """The network at inputs `x` (shape `[points]`); a bias column is appended."""
    ones = jnp.ones_like(x)
    hidden = jnp.tanh(jnp.stack([x, ones], axis=1) @ state["layer1"]["weights"].T)
    hidden = jnp.concatenate([hidden, ones[:, None]], axis=1)
    return (hidden @ state["layer2"]["weights"].T)[:, 0]


def log_posterior(state: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    log_likelihood = -0.5 * jnp.sum((network(state, x) - y) ** 2) / NOISE**2
    log_prior = -0.5 * sum(jnp.sum(w**2) for w in jax.tree.leaves(state))
    return log_likelihood + log_prior


def metropolis(
    state: dict, key: jax.Array, *, x: jax.Array, y: jax.Array, grid: jax.Array
) -> tuple[dict, dict]:
    """One random-walk Metropolis step of ONE chain.

    Returns the new state and what to record: whether the proposal was accepted, the
    log posterior, and the network's prediction on `grid`.
    """
    noise_key, accept_key = jr.split(key)
    leaves, treedef = jax.tree.flatten(state)
    noise_keys = jr.split(noise_key, len(leaves))
    proposal = treedef.unflatten(
        [
            w + STEP_SIZE * jr.normal(k, w.shape)
            for w, k in zip(leaves, noise_keys, strict=True)
        ]
    )
    current = log_posterior(state, x, y)
    proposed = log_posterior(proposal, x, y)
    accept = jnp.log(jr.uniform(accept_key)) < proposed - current
    new = jax.tree.map(lambda p, s: jnp.where(accept, p, s), proposal, state)
    record = {
        "accepted": accept.astype(jnp.float32),
        "log_posterior": jnp.where(accept, proposed, current),
        "prediction": network(new, grid),
    }
    return new, record


def make_problem() -> tuple[tuple[jax.Array, ...], dict, jax.Array]:
    """The data `(x, y, grid)`, the stacked initial states, and the chains' key.

    Built from fixed seeds, so that every process of `multi_process.py` builds the same.
    """
    data_key, init_key, chain_key = jr.split(jr.key(0), 3)
    x = jnp.linspace(-1.5, 1.5, 40)
    y = jnp.sin(2 * x) + NOISE * jr.normal(data_key, x.shape)
    grid = jnp.linspace(-2.0, 2.0, 41)
    layer1_key, layer2_key = jr.split(init_key)
    init = {
        "layer1": {"weights": 0.5 * jr.normal(layer1_key, (NUM_CHAINS, HIDDEN, 2))},
        "layer2": {"weights": 0.5 * jr.normal(layer2_key, (NUM_CHAINS, 1, HIDDEN + 1))},
    }
    return (x, y, grid), init, chain_key


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    # --- Data, and the chains' initial states: one nested dict, stacked on axis 0 -----
    (x, y, grid), init, chain_key = make_problem()
    print(f"{eb.batch_size(init)} chains; one chain's state:")
    for path, leaf in jax.tree_util.tree_flatten_with_path(eb.index(init, 0))[0]:
        print(f"   state{jax.tree_util.keystr(path)}: shape {leaf.shape}")

    # --- Run them all: the data is closed over, each chain gets its own key -----------
    step = ft.partial(metropolis, x=x, y=y, grid=grid)
    chain_keys = jr.split(chain_key, NUM_CHAINS)
    print(
        f"\nRunning {NUM_CHAINS} chains x {NUM_STEPS} steps "
        f"(burn-in {BURN_IN}, keeping every {THIN}th) on {jax.device_count()} "
        "device(s)..."
    )
    result = eb.run_chains(
        step,
        init,
        chain_keys,
        NUM_STEPS,
        burn_in=BURN_IN,
        thin=THIN,
        with_output=True,
    )
    # What the step recorded per draw; `result.trace` holds the states (the weights).
    outputs = jax.tree.map(np.asarray, result.outputs)
    print(f"output shapes: { {k: v.shape for k, v in outputs.items()} }")
    print(f"chains that went NaN/inf: {result.nonfinite.chains.tolist()}\n")

    # --- Per-chain summaries ----------------------------------------------------------
    # The weights themselves are not identifiable (hidden units can swap and flip
    # sign), so chains are compared by what they predict.
    x_query = 0.5
    query = int(np.argmin(np.abs(np.asarray(grid) - x_query)))
    truth = float(np.sin(2 * grid[query]))
    acceptance = outputs["accepted"].mean(axis=1)
    print("acceptance: the fraction of recorded steps whose proposal was accepted")
    print(f"chain  acceptance  mean log posterior  posterior mean f({x_query}) +- sd")
    for i in range(NUM_CHAINS):
        draws = outputs["prediction"][i, :, query]
        print(
            f"{i:5d}  {acceptance[i]:10.2f}  {outputs['log_posterior'][i].mean():18.1f}"
            f"  {draws.mean():+.3f} +- {draws.std():.3f}"
        )
    print(f"truth: sin(2 * {grid[query]:.1f}) = {truth:+.3f}")

    pooled = outputs["prediction"].reshape(-1, grid.shape[0])
    mean, sd = pooled.mean(axis=0), pooled.std(axis=0)
    inside = np.abs(np.asarray(grid)) <= 1.5
    rmse = float(np.sqrt(np.mean((mean[inside] - np.sin(2 * grid[inside])) ** 2)))
    print(f"\nposterior mean vs sin(2x) on the data's range: RMSE {rmse:.3f}")

    # --- Trace plot -------------------------------------------------------------------
    fig, (ax_lp, ax_f, ax_fit) = plt.subplots(1, 3, figsize=(14, 4))
    draw_steps = (BURN_IN + 1 + THIN * np.arange(outputs["accepted"].shape[1])) / 1000
    for i in range(NUM_CHAINS):
        ax_lp.plot(draw_steps, outputs["log_posterior"][i], lw=0.8, label=f"chain {i}")
        ax_f.plot(draw_steps, outputs["prediction"][i, :, query], lw=0.8)
    ax_lp.set(title="log posterior", xlabel="step (thousands)")
    ax_f.axhline(truth, color="k", ls="--", label="truth")
    ax_f.set(title=f"prediction f({x_query})", xlabel="step (thousands)")
    ax_f.legend(loc="lower right")
    ax_fit.scatter(x, y, s=10, color="k", label="data")
    ax_fit.plot(grid, mean, color="C0", label="posterior mean")
    ax_fit.fill_between(grid, mean - 2 * sd, mean + 2 * sd, alpha=0.3, label="+- 2 sd")
    ax_fit.plot(grid, np.sin(2 * grid), "k--", lw=1, label="sin(2x)")
    ax_fit.set(title="posterior predictive (all chains)", xlabel="x")
    ax_fit.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    png = args.out / "chains_trace.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"trace plot: {png}")

    # --- Convergence, from ArviZ: R-hat and ESS per variable, trace and rank plots ----
    # The states (weights) are the group "posterior" and the recorded outputs the group
    # "sample_stats", as for BlackJAX and NumPyro, variables named by their paths. The
    # weights are not identifiable, so the outputs are what to diagnose.
    data = result.to_arviz()
    diagnosed = ["log_posterior", "prediction"]
    rhat = arviz_stats.rhat(data, group="sample_stats", var_names=diagnosed)
    ess = arviz_stats.ess(data, group="sample_stats", var_names=diagnosed)
    # Per variable, the worst of its entries (the prediction has one per grid point).
    worst_rhat = {name: float(rhat[name].max()) for name in diagnosed}
    least_ess = {name: float(ess[name].min()) for name in diagnosed}
    total = int(
        data["sample_stats"].sizes["chain"] * data["sample_stats"].sizes["draw"]
    )
    print(f"\nArviZ's diagnostics, over all {total} draws:")
    print("variable             worst R-hat  least ESS (bulk)")
    for name in diagnosed:
        print(f"{name:<19}  {worst_rhat[name]:11.3f}  {least_ess[name]:16.0f}")
    # R-hat compares the spread between chains with that within them; the usual bar
    # for trusting the pooled draws is below 1.01 for every variable.
    converged = max(worst_rhat.values()) < 1.01
    if converged:
        print("every R-hat is below 1.01: the chains agree")
    else:
        print(
            "R-hat above 1.01: the chains have not mixed. Random-walk Metropolis moves "
            "slowly\nthrough this posterior, and each chain still keeps to its own "
            "region (their log\nposteriors differ: see the rank plot). Near the data "
            "they roughly agree; their\nspread, and the fit away from the data, are "
            "not yet to be trusted. Run longer,\nor use a gradient-based sampler."
        )

    at_query = {"prediction_dim_0": [query]}
    arviz_pngs = []
    plots = {"trace": arviz_plots.plot_trace, "rank": arviz_plots.plot_rank}
    for kind, plot in plots.items():
        figure = plot(
            data,
            group="sample_stats",
            var_names=diagnosed,
            coords=at_query,
            backend="matplotlib",
            figure_kwargs={"figsize": (10, 4)},
        )
        arviz_png = args.out / f"chains_arviz_{kind}.png"
        figure.savefig(arviz_png, dpi=100, bbox_inches="tight")
        arviz_pngs.append(str(arviz_png))
        print(f"ArviZ {kind} plot: {arviz_png}")
    plt.close("all")

    summary = {
        "chains": NUM_CHAINS,
        "draws": int(outputs["accepted"].shape[1]),
        "acceptance": acceptance.tolist(),
        "posterior_mean_at_query": outputs["prediction"][:, :, query]
        .mean(axis=1)
        .tolist(),
        "truth_at_query": truth,
        "rmse": rmse,
        "nonfinite_chains": result.nonfinite.chains.tolist(),
        "png": str(png),
        "rhat": worst_rhat,
        "ess": least_ess,
        "converged": converged,
        "total_draws": total,
        "arviz_pngs": arviz_pngs,
    }
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
