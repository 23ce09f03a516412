"""The runs of many problems (`run_chains(..., data=data)`) the tests share, for a test
to run here and `problems_worker.py` in each process of a job: eight schools with
diagnostics (`problems_run`), and AR(1) chains that mix at their problem's speed, each
problem stopped by its own `until` (`stopping_problems_run`). A job's processes import
this module before they initialise JAX: nothing here touches it at import.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

import eqx_batch as eb


# NumPy: a JAX array here would start JAX before a job initialises it.
SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], np.float32)


def schools_step(state: dict, key: jax.Array, data: dict) -> dict:
    """Random-walk Metropolis on eight schools (non-centred), given one problem's
    data: `y` and `sigma` of its eight schools."""

    def log_density(s: dict) -> jax.Array:
        theta = s["mu"] + jnp.exp(s["log_tau"]) * s["eta"]
        prior = -0.5 * (s["mu"] / 5.0) ** 2 - 0.5 * jnp.sum(s["eta"] ** 2)
        likelihood = -0.5 * jnp.sum(((data["y"] - theta) / data["sigma"]) ** 2)
        return prior + likelihood + s["log_tau"] - 0.5 * s["log_tau"] ** 2

    move, accept = jr.split(key)
    leaves, treedef = jtu.tree_flatten(state)
    noise = jr.split(move, len(leaves))
    proposal = treedef.unflatten(
        [x + 0.3 * jr.normal(k, x.shape) for x, k in zip(leaves, noise, strict=True)]
    )
    log_ratio = log_density(proposal) - log_density(state)
    take = jnp.log(jr.uniform(accept)) < log_ratio
    return jtu.tree_map(lambda new, old: jnp.where(take, new, old), proposal, state)


def schools_data(num_problems: int) -> dict:
    """`num_problems` datasets of eight schools, drawn from the model."""
    theta = 5.0 * jr.normal(jr.key(7), (num_problems, 8))
    y = theta + SIGMA[None] * jr.normal(jr.key(8), (num_problems, 8))
    return {"y": y, "sigma": jnp.broadcast_to(SIGMA, (num_problems, 8))}


def schools_init(num_chains: int) -> dict:
    starts = jnp.linspace(-1.0, 1.0, num_chains)
    return {
        "mu": starts,
        "log_tau": 0.5 * starts,
        "eta": jnp.broadcast_to(starts[:, None], (num_chains, 8)),
    }


def problems_run(
    checkpoint: str | None = None,
    num_steps: int = 60,
    thin: int = 2,
    checkpoint_every: int = 20,
    **options,
) -> eb.Chains:
    """6 problems of eight schools, 2 superchains of 3 chains each (36 chains, which
    4 devices split only with padding), with diagnostics."""
    return eb.run_chains(
        schools_step,
        schools_init(12),
        jr.split(jr.key(5), 36),
        num_steps,
        thin=thin,
        data=schools_data(6),
        superchains=12,
        diagnostics=True,
        checkpoint=checkpoint,
        checkpoint_every=None if checkpoint is None else checkpoint_every,
        **options,
    )


# Eight schools' `eta` labelled by school, for `Chains.to_arviz`.
SCHOOL_LABELS = {
    "dims": {"eta": ["school"]},
    "coords": {"school": [f"school {i}" for i in range(8)]},
}


def ar1_problem(state: jax.Array, key: jax.Array, data: dict) -> jax.Array:
    """An AR(1) chain whose correlation is its problem's: the problems mix at
    different speeds; stationary: N(0, 1)."""
    rho = data["rho"]
    if "weights" in data:
        # A row too large to copy per chain (`wide_rows`), whose mean is exactly 1.
        rho = rho * jnp.mean(data["weights"])
    return rho * state + jnp.sqrt(1 - rho**2) * jr.normal(key, state.shape)


RHOS = np.array([0.5, 0.99, 0.7, 0.9, 0.95, 0.8], np.float32)


def wide_rows(data: dict) -> dict:
    """`data` with a row of ones per problem, 12 KiB: more than a run copies per
    chain on any platform, so that each problem's chains are given their row once
    (in two levels of `vmap`), where the AR(1) rows alone are copied per chain."""
    num_problems = len(data["rho"])
    return data | {"weights": jnp.ones((num_problems, 3072), jnp.float32)}


def stopping_problems_run(
    checkpoint: str | None = None, num_steps: int = 3000, wide: bool = False, **options
) -> eb.Chains:
    """6 problems that mix at different speeds, each 4 superchains of 8 chains from
    starts far apart, each stopped when its own nested R-hat says it has mixed
    (between 50 and a few hundred steps); with `wide`, given `wide_rows` (the same
    draws)."""
    starts = jnp.tile(jnp.linspace(-3.0, 3.0, 4)[:, None], (6, 2))
    return eb.run_chains(
        ar1_problem,
        starts,
        jr.split(jr.key(0), 6 * 4 * 8),
        num_steps,
        thin=2,
        data=wide_rows({"rho": RHOS}) if wide else {"rho": RHOS},
        superchains=6 * 4,
        until=eb.converged(every=50),
        checkpoint=checkpoint,
        checkpoint_every=None if checkpoint is None else 30,
        **options,
    )


def posterior(data) -> dict:
    """The values of the group `posterior` of `to_arviz()`'s data, with its
    `superchain` coordinate."""
    group = data["posterior"]
    values = {name: group[name].values for name in group.data_vars}
    return values | {"superchain": group.superchain.values}
