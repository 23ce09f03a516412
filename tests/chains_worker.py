"""The chains workloads that the tests run in other processes.

Run as a script, it runs `eb.run_chains` on one workload and saves `final`, `trace`
and `keys` with `eb.save`:

    python chains_worker.py [--job] [--workload NAME] OUT NUM_CHAINS NUM_STEPS
        [CHECKPOINT CHECKPOINT_EVERY [THIN]]

The workloads (`WORKLOADS`) are random-walk Metropolis on a dict of weights
(`metropolis`, the default), a state that carries its own typed PRNG keys (`keys`), and
an Equinox MLP whose activation is a function (`mlp`). The test suite runs the script
with a checkpoint and SIGKILLs it mid-run, runs it with another device count (set
through `XLA_FLAGS` by the caller) to compare bits, and runs it as a job of several
processes (`multiprocess_launch`, with `--job` first), where each process saves the
results it got to `OUT.<process id>`.
"""

import sys
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu

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


WORKLOADS: dict[str, tuple[Callable, Callable]] = {
    "metropolis": (metropolis, make_init),
    "keys": (key_step, make_key_init),
    "mlp": (mlp_step, make_mlp_init),
}


def outputs(result: eb.Chains) -> dict:
    return {"final": result.final, "trace": result.trace, "keys": result.keys}


def run(
    workload: str,
    num_chains: int,
    num_steps: int,
    checkpoint: str | None = None,
    checkpoint_every: int | None = None,
    thin: int = 1,
) -> eb.Chains:
    """The run the script makes, for the tests to make it too."""
    step, make = WORKLOADS[workload]
    return eb.run_chains(
        step,
        make(num_chains),
        jr.key(0),
        num_steps,
        thin=thin,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
    )


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


def main(argv: list[str]) -> None:
    job = argv[0] == "--job"
    process_id = 0
    if job:
        from multiprocess_launch import initialize

        process_id, _ = initialize()
        argv = argv[1:]
    workload = "metropolis"
    if argv[0] == "--workload":
        workload, argv = argv[1], argv[2:]
    out, num_chains, num_steps, *rest = argv
    result = run(
        workload,
        int(num_chains),
        int(num_steps),
        checkpoint=rest[0] if rest else None,
        checkpoint_every=int(rest[1]) if rest else None,
        thin=int(rest[2]) if len(rest) > 2 else 1,
    )
    eb.save(f"{out}.{process_id}" if job else out, outputs(result))
    if job:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
