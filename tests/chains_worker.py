"""The chains workloads that the tests run in other processes.

Run as a script, it runs `eb.run_chains` on one workload and saves `final`, `trace`
and `keys` with `eb.save`:

    python chains_worker.py [--job] [--workload NAME] OUT NUM_CHAINS NUM_STEPS
        [CHECKPOINT CHECKPOINT_EVERY [THIN]]

The workloads (`WORKLOADS`) are random-walk Metropolis on a dict of weights
(`metropolis`, the default), a state that carries its own typed PRNG keys (`keys`), an
Equinox MLP whose activation is a function (`mlp`), and the emcee stretch move, a step
that sees every chain (`stretch`), whose state records the step count it was given.
With `--job --held OUT`, it makes the runs of `held_runs` and saves what each process
holds of them and their gathered results; with `--job --problems OUT [--until]
[CHECKPOINT]`, the run of many problems of `problems_run` (`stopping_problems_run`),
gathered, its problem 1 (after slicing every problem thrice) and that problem's
`to_arviz()` posterior. The test suite runs the script with a checkpoint and SIGKILLs
it mid-run, runs it with another device count (set through `XLA_FLAGS` by the caller)
to compare bits, and runs it as a job of several processes (`multiprocess_launch`,
with `--job` first), where each process gathers the results (`Chains.gathered`)
and saves them to `OUT.<process id>`.
"""

import json
import pathlib
import sys
from collections.abc import Callable

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


def make_mlp_init(num_chains: int) -> eqx.nn.MLP:
    def make(key: jax.Array) -> eqx.nn.MLP:
        return eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.relu, key=key)

    return eqx.filter_vmap(make)(jr.split(jr.key(0), num_chains))


WORKLOADS: dict[str, tuple[Callable, Callable]] = {
    "metropolis": (metropolis, make_init),
    "keys": (key_step, make_key_init),
    "mlp": (mlp_step, make_mlp_init),
    "stretch": (counted_stretch, make_stretch_init),
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


def held_runs() -> dict[str, eb.Chains]:
    """The runs whose layout a job's test inspects: 6 chains, which 4 devices split
    only with padding, one of them infinite from the start, with diagnostics; and 8
    chains in chunks of 3, checked by `until`."""
    init = make_init(6)
    init["layer1"]["weights"] = init["layer1"]["weights"].at[4].set(jnp.inf)
    return {
        "padded": eb.run_chains(metropolis, init, jr.key(0), 20, diagnostics=True),
        "chunked": eb.run_chains(
            metropolis,
            make_init(8),
            jr.key(1),
            40,
            chunk_size=3,
            until=eb.converged(every=10),
        ),
    }


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


def ar1_problem(state: jax.Array, key: jax.Array, data: dict) -> jax.Array:
    """An AR(1) chain whose correlation is its problem's: the problems mix at
    different speeds; stationary: N(0, 1)."""
    rho = data["rho"]
    return rho * state + jnp.sqrt(1 - rho**2) * jr.normal(key, state.shape)


RHOS = np.array([0.5, 0.99, 0.7, 0.9, 0.95, 0.8], np.float32)


def stopping_problems_run(
    checkpoint: str | None = None, num_steps: int = 3000, **options
) -> eb.Chains:
    """6 problems that mix at different speeds, each 4 superchains of 8 chains from
    starts far apart, each stopped when its own nested R-hat says it has mixed
    (between 50 and a few hundred steps)."""
    starts = jnp.tile(jnp.linspace(-3.0, 3.0, 4)[:, None], (6, 2))
    return eb.run_chains(
        ar1_problem,
        starts,
        jr.split(jr.key(0), 6 * 4 * 8),
        num_steps,
        thin=2,
        data={"rho": RHOS},
        superchains=6 * 4,
        until=eb.converged(every=50),
        checkpoint=checkpoint,
        checkpoint_every=None if checkpoint is None else 30,
        **options,
    )


def everything(result: eb.Chains) -> dict:
    """What the layout test compares, bit for bit, with one process's run."""
    return {
        **outputs(result),
        "nonfinite": result.nonfinite,
        "diagnostics": result.diagnostics,
        "steps_done": np.asarray(result.steps_done, np.int64),
        "draws_made": result.draws_made,
    }


# Eight schools' `eta` labelled by school, for `Chains.to_arviz`.
SCHOOL_LABELS = {
    "dims": {"eta": ["school"]},
    "coords": {"school": [f"school {i}" for i in range(8)]},
}


def posterior(data) -> dict:
    """The values of the group `posterior` of `to_arviz()`'s data, with its
    `superchain` coordinate."""
    group = data["posterior"]
    values = {name: group[name].values for name in group.data_vars}
    return values | {"superchain": group.superchain.values}


def held_here(result: eb.Chains) -> dict:
    """What this process holds of `final`, `trace` and `keys`: each array's distinct
    rows and the bytes on its devices, beside the whole array's."""
    arrays = {
        "final": result.final["layer1"]["weights"],
        "trace": result.trace["layer1"]["weights"],
        "keys": result.keys,
    }
    held = {}
    for name, x in arrays.items():
        rows: set[int] = set()
        nbytes = 0
        for shard in x.addressable_shards:
            rows.update(range(*shard.index[0].indices(x.shape[0])))
            data = shard.data
            nbytes += (
                jr.key_data(data)
                if jnp.issubdtype(data.dtype, jax.dtypes.prng_key)
                else data
            ).nbytes
        whole = jax.eval_shape(jr.key_data, x) if name == "keys" else x
        held[name] = {
            "rows": sorted(rows),
            "bytes": nbytes,
            "whole_bytes": int(np.prod(whole.shape)) * whole.dtype.itemsize,
            "fully_addressable": x.is_fully_addressable,
        }
    try:
        result.to_arviz()
        held["to_arviz"] = "converted"
    except eb.BatchError as error:
        held["to_arviz"] = str(error)
    return held


def main(argv: list[str]) -> None:
    job = argv[0] == "--job"
    process_id = 0
    if job:
        from multiprocess_launch import initialize

        process_id, _ = initialize()
        argv = argv[1:]
    if argv[0] == "--held":
        # Each run's layout in this process (JSON), and its gathered results.
        out = argv[1]
        held = {}
        for name, result in held_runs().items():
            held[name] = held_here(result)
            eb.save(f"{out}.{name}.{process_id}", everything(result.gathered()))
        pathlib.Path(f"{out}.{process_id}.json").write_text(json.dumps(held))
        jax.distributed.shutdown()
        return
    if argv[0] == "--problems":
        # Many problems in a job: every chain gathered, and problem 1's own result.
        out = argv[1]
        make, labels = problems_run, SCHOOL_LABELS
        if argv[2:3] == ["--until"]:
            make, argv, labels = stopping_problems_run, argv[:2] + argv[3:], {}
        result = make(argv[2] if len(argv) > 2 else None)
        # Every problem, thrice, before any is read, as a user's loop over them
        # slices: many collectives in flight.
        one = [[result.problem(p) for p in range(6)] for _ in range(3)][-1][1]
        # A problem's rows are whole in every process: converted with no gathering.
        eb.save(f"{out}.arviz.{process_id}", posterior(one.to_arviz(**labels)))
        eb.save(f"{out}.{process_id}", everything(result.gathered()))
        eb.save(f"{out}.one.{process_id}", everything(one.gathered()))
        jax.distributed.shutdown()
        return
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
    if job:
        # Each process holds only its own chains' rows; every process gathers them all.
        result = result.gathered()
    eb.save(f"{out}.{process_id}" if job else out, outputs(result))
    if job:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
