"""The chains workload that `test_chains.py` runs in other processes.

Run as a script, it runs `eb.run_chains` on the random-walk Metropolis workload and
saves `final`, `trace` and `keys` with `eb.save`:

    python chains_worker.py OUT NUM_CHAINS NUM_STEPS [CHECKPOINT CHECKPOINT_EVERY]

The test suite runs it with a checkpoint and SIGKILLs it mid-run, runs it with another
device count (set through `XLA_FLAGS` by the caller) to compare bits, and runs it as a
job of several processes (`multiprocess_launch.launch`, with `--job` before the other
arguments), where each process saves the results it got to `OUT.<process id>`.
"""

import sys

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


def outputs(result: eb.Chains) -> dict:
    return {"final": result.final, "trace": result.trace, "keys": result.keys}


def main(argv: list[str]) -> None:
    if argv[0] == "--job":
        from multiprocess_launch import initialize

        process_id, _ = initialize()
        main([f"{argv[1]}.{process_id}", *argv[2:]])
        jax.distributed.shutdown()
        return
    out, num_chains, num_steps, *rest = argv
    checkpoint = rest[0] if rest else None
    checkpoint_every = int(rest[1]) if rest else None
    init = make_init(int(num_chains))
    result = eb.run_chains(
        metropolis,
        init,
        jr.key(0),
        int(num_steps),
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
    )
    eb.save(out, outputs(result))


if __name__ == "__main__":
    main(sys.argv[1:])
