"""The chains workloads the tests share: each a step and its starts, and the runs made
of them, for a test to run here and a worker script (`run_worker.py`,
`job_run_worker.py`, `held_worker.py`, `checkpoint_worker.py`) in another process.

The workloads of `run` (`WORKLOADS`) are random-walk Metropolis on a dict of weights
(`metropolis`), a state that carries its own typed PRNG keys (`keys`), an Equinox MLP
whose activation is a function (`mlp`), and the emcee stretch move, a step that sees
every chain (`stretch`), whose state records the step count it was given, and a
random walk whose chains share an adapted scale (`adapting`, with `shared=`). A job's
processes import this module before they initialise JAX: nothing here touches it at
import.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

import eqx_batch as eb


def log_density(state: dict) -> jax.Array:
    """A standard normal over every leaf."""
    return -0.5 * sum((jnp.sum(x**2) for x in jtu.tree_leaves(state)), jnp.zeros(()))


def metropolis(state: dict, key: jax.Array) -> dict:
    """One random-walk Metropolis step: elementwise updates, so bitwise per chain."""
    noise_key, accept_key = jr.split(key)
    leaves, treedef = jtu.tree_flatten(state)
    noise_keys = jr.split(noise_key, len(leaves))
    noise = [
        jr.normal(k, x.shape, x.dtype) for x, k in zip(leaves, noise_keys, strict=True)
    ]
    proposal = treedef.unflatten(
        [x + 0.5 * n for x, n in zip(leaves, noise, strict=True)]
    )
    log_ratio = log_density(proposal) - log_density(state)
    accept = jnp.log(jr.uniform(accept_key)) < log_ratio
    return jtu.tree_map(lambda p, s: jnp.where(accept, p, s), proposal, state)


def make_init(num_chains: int) -> dict:
    """Distinct starting points, so a mix-up of chains shows."""
    start = jnp.linspace(-1.0, 1.0, num_chains * 9).reshape(num_chains, 3, 3)
    return {"layer1": {"weights": start}, "layer2": {"weights": -start}}


def key_step(state: dict, key: jax.Array) -> dict:
    """A step whose state carries a typed PRNG key of its own, split every step."""
    carried, own = jr.split(state["k"])
    noise = jr.normal(own, state["x"].shape) + 0.1 * jr.normal(key, state["x"].shape)
    return {"x": state["x"] + noise, "k": carried}


def make_key_init(num_chains: int) -> dict:
    start = jnp.linspace(-1.0, 1.0, num_chains * 2).reshape(num_chains, 2)
    return {"x": start, "k": jr.split(jr.key(5), num_chains)}


def mlp_step(model: eqx.nn.MLP, key: jax.Array) -> eqx.nn.MLP:
    """Moves an MLP's weights by noise scaled with its output: uses its activation."""
    params, static = eqx.partition(model, eqx.is_array)
    scale = 0.01 * jnp.tanh(jnp.sum(model(jnp.ones(2))))
    leaves, treedef = jtu.tree_flatten(params)
    keys = jr.split(key, len(leaves))
    moved = [
        w + scale * jr.normal(k, w.shape) for w, k in zip(leaves, keys, strict=True)
    ]
    return eqx.combine(jtu.tree_unflatten(treedef, moved), static)


def make_mlp_init(num_chains: int) -> eqx.nn.MLP:
    def make(key: jax.Array) -> eqx.nn.MLP:
        return eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.relu, key=key)

    return eqx.filter_vmap(make)(jr.split(jr.key(0), num_chains))


# A correlated 2-d Gaussian: standard deviations 1 and 2, correlation 0.95. NumPy
# constants: a job's processes must not touch JAX before it is initialised.
GAUSSIAN_MEAN = np.array([1.0, -2.0], np.float32)
GAUSSIAN_COV = np.array([[1.0, 1.9], [1.9, 4.0]], np.float32)
_PRECISION = np.linalg.inv(GAUSSIAN_COV).astype(np.float32)


def gaussian_log_density(x: jax.Array) -> jax.Array:
    # Elementwise products and sums rather than a matmul, whose summation order XLA
    # may choose by batch size: each chain's bits do not depend on the device count.
    centred = x - GAUSSIAN_MEAN
    return -0.5 * jnp.sum(centred * jnp.sum(_PRECISION * centred[None, :], axis=-1))


def stretch_move(log_density: Callable, scale: float = 2.0) -> eb.AllChains:
    """The affine-invariant stretch move of emcee (Goodman & Weare 2010) on walkers
    `[chains, dim]`: each half of the ensemble moves against the other, each walker
    with its own key for its stretch `z`, its partner and its acceptance uniform."""

    def move(walkers: jax.Array, keys: jax.Array, others: jax.Array) -> jax.Array:
        def draws(key: jax.Array) -> tuple:
            z_key, partner_key, accept_key = jr.split(key, 3)
            # z has density proportional to 1/sqrt(z) on [1/scale, scale].
            z = ((scale - 1.0) * jr.uniform(z_key) + 1.0) ** 2 / scale
            partner = jr.randint(partner_key, (), 0, others.shape[0])
            return z, partner, jr.uniform(accept_key)

        z, partner, uniform = jax.vmap(draws)(keys)
        chosen = others[partner]
        proposal = chosen + z[:, None] * (walkers - chosen)
        log_ratio = (
            (walkers.shape[1] - 1) * jnp.log(z)
            + jax.vmap(log_density)(proposal)
            - jax.vmap(log_density)(walkers)
        )
        accept = jnp.log(uniform) < log_ratio
        return jnp.where(accept[:, None], proposal, walkers)

    def step(walkers: jax.Array, keys: jax.Array, count: jax.Array) -> jax.Array:
        half = walkers.shape[0] // 2
        first = move(walkers[:half], keys[:half], walkers[half:])
        second = move(walkers[half:], keys[half:], first)
        return jnp.concatenate([first, second])

    return eb.all_chains(step)


_gaussian_stretch = stretch_move(gaussian_log_density)


@eb.all_chains
def counted_stretch(state: dict, keys: jax.Array, count: jax.Array) -> dict:
    """The stretch move on the Gaussian, each chain recording the step count."""
    walkers = _gaussian_stretch(state["x"], keys, count)
    return {"x": walkers, "count": jnp.full(walkers.shape[0], count)}


def make_stretch_init(num_chains: int) -> dict:
    start = jnp.linspace(-1.0, 1.0, num_chains * 2).reshape(num_chains, 2)
    return {"x": start, "count": jnp.full(num_chains, -1, jnp.int32)}


def adapting(
    states: dict, keys: jax.Array, count: jax.Array, shared: dict, centre: Any = 0.0
) -> tuple:
    """Random-walk Metropolis on a normal around `centre` whose chains share one
    proposal scale, tuned towards an acceptance of 0.44 by Robbins-Monro steps on its
    log from the mean acceptance of the chains (the kind of step `shared=` is for)."""
    scale = jnp.exp(shared["log_scale"])

    def one(x: jax.Array, key: jax.Array) -> tuple:
        move_key, accept_key = jr.split(key)
        proposal = x + scale * jr.normal(move_key, x.shape, x.dtype)
        log_ratio = 0.5 * (
            jnp.sum((x - centre) ** 2) - jnp.sum((proposal - centre) ** 2)
        )
        accept = jnp.log(jr.uniform(accept_key)) < log_ratio
        return jnp.where(accept, proposal, x), accept

    x, accepted = jax.vmap(one)(states["x"], keys)
    rate = jnp.mean(accepted.astype(jnp.float32))
    gain = (count.astype(jnp.float32) + 1.0) ** -0.6
    new_shared = {
        "log_scale": shared["log_scale"] + gain * (rate - 0.44),
        "accepted": shared["accepted"] + jnp.sum(accepted.astype(jnp.int32)),
    }
    return {"x": x}, new_shared


def make_adapting_init(num_chains: int) -> dict:
    return {"x": jnp.linspace(-3.0, 3.0, num_chains * 3).reshape(num_chains, 3)}


ADAPTING_SHARED = {"log_scale": np.float32(0.0), "accepted": np.int32(0)}


WORKLOADS: dict[str, tuple[Callable, Callable]] = {
    "metropolis": (metropolis, make_init),
    "keys": (key_step, make_key_init),
    "mlp": (mlp_step, make_mlp_init),
    "stretch": (counted_stretch, make_stretch_init),
    "adapting": (eb.all_chains(adapting), make_adapting_init),
}
# The shared state each workload starts from, for those that carry one.
SHARED = {"adapting": ADAPTING_SHARED}


def run(
    workload: str,
    num_chains: int,
    num_steps: int,
    checkpoint: str | None = None,
    checkpoint_every: int | None = None,
    thin: int = 1,
) -> eb.Chains:
    """The run of `workload` (a name of `WORKLOADS`) that the worker scripts make,
    for the tests to make it too."""
    step, make = WORKLOADS[workload]
    return eb.run_chains(
        step,
        make(num_chains),
        jr.key(0),
        num_steps,
        thin=thin,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        shared=SHARED.get(workload),
    )


def outputs(result: eb.Chains) -> dict:
    kept = {"final": result.final, "trace": result.trace, "keys": result.keys}
    return kept if result.shared is None else {**kept, "shared": result.shared}


def everything(result: eb.Chains) -> dict:
    """What a test compares, bit for bit, with one process's run."""
    return {
        **outputs(result),
        "nonfinite": result.nonfinite,
        "diagnostics": result.diagnostics,
        "steps_done": np.int64(result.steps_done),
        "problems": result.problems,
    }


def ar1(state: jax.Array, key: jax.Array) -> jax.Array:
    """An AR(1) chain that forgets its start over about a hundred steps;
    stationary: N(0, 1)."""
    return 0.95 * state + 0.312 * jr.normal(key, state.shape)


def stopping_run(
    checkpoint: str | None = None, chunk_size: int | None = None
) -> eb.Chains:
    """4 superchains of 32 chains from starts far apart, until nested R-hat says
    they have mixed (a thousand steps or so), checkpointed every 50 steps."""
    starts = jnp.linspace(-2.0, 2.0, 4 * 64).reshape(4, 64)
    return eb.run_chains(
        ar1,
        starts,
        jr.split(jr.key(3), 4 * 32),
        5000,
        thin=5,
        superchains=4,
        until=eb.converged(every=500),
        checkpoint=checkpoint,
        checkpoint_every=None if checkpoint is None else 50,
        chunk_size=chunk_size,
    )
