"""How a loop over many problems should read each chain's row of the data (issue 34).

Loops written by hand, `jax.jit` of `lax.scan` over `jax.vmap(step)`, 4096 chains of
256 problems (16 chains each), 500 steps of a random walk whose log density reads the
chain's row of R floats, for R from 8 to 16,384. Three ways to give each chain its
row, the draws checked equal:

- read by index in every step (`data[problem]` inside the loop: a gather in its body,
    which XLA moves out of the loop on a CPU but not on a TPU);
- copied once per chain before the loop (`data[problems]`, a loop invariant): what
    `run_chains(data=)` does while the copy takes at most `COPY_LIMIT` bytes;
- two vmaps, over the problems and over each problem's chains, each row read once
    per problem (no copy; needs the chains grouped by problem).

Rows: the first and the third against the copy (report). `run_chains` chooses the copy
up to 256 MiB by these numbers (docs/benchmarks.md, "On an accelerator"). Usage:
`python benchmarks/bench_data_rows.py` (or through `benchmarks/run.py data_rows`).
"""

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.random as jr
from _report import report


PROBLEMS, PER_PROBLEM, STEPS = 256, 16, 500
CHAINS = PROBLEMS * PER_PROBLEM
ROW_FLOATS = (8, 64, 256, 1024, 4096, 16384)
REPEAT = 7


def step(x: jax.Array, key: jax.Array, row: jax.Array) -> jax.Array:
    """Random-walk Metropolis on the mean of the row's observations."""
    noise_key, accept_key = jr.split(key)
    proposal = x + 0.5 * jr.normal(noise_key, x.shape)

    def log_density(m: jax.Array) -> jax.Array:
        return -0.5 * jnp.sum((row - m) ** 2) / row.shape[0]

    log_ratio = log_density(proposal) - log_density(x)
    return jnp.where(jnp.log(jr.uniform(accept_key)) < log_ratio, proposal, x)


def loop(chains_step: Callable) -> Callable:
    """`jit(scan(...))` of `chains_step(x, step_keys, *args)`, `run_chains`' key
    schedule, the states stacked by `scan`."""

    @jax.jit
    def run(x: jax.Array, keys: jax.Array, *args: jax.Array) -> tuple:
        def body(carry: tuple, _: None) -> tuple:
            x, keys = carry
            keys, step_keys = jax.vmap(jr.split, out_axes=1)(keys)
            x = chains_step(x, step_keys, *args)
            return (x, keys), x

        return jax.lax.scan(body, (x, keys), None, length=STEPS)

    return run


by_index = loop(
    lambda x, k, data, problem: jax.vmap(lambda x, k, p: step(x, k, data[p]))(
        x, k, problem
    )
)
_copied = loop(lambda x, k, rows: jax.vmap(step)(x, k, rows))
copied = jax.jit(lambda x, k, data, problem: _copied(x, k, data[problem]))


def _grouped(x: jax.Array, k: jax.Array, data: jax.Array) -> jax.Array:
    def one_problem(xs: jax.Array, ks: jax.Array, row: jax.Array) -> jax.Array:
        return jax.vmap(step, (0, 0, None))(xs, ks, row)

    shape = (PROBLEMS, PER_PROBLEM)
    return jax.vmap(one_problem)(x.reshape(shape), k.reshape(shape), data).reshape(
        CHAINS
    )


two_vmaps = loop(_grouped)


def median_seconds(run: Callable) -> float:
    jax.block_until_ready(run())
    times = []
    for _ in range(REPEAT):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    x = jnp.zeros(CHAINS)
    keys = jr.split(jr.key(0), CHAINS)
    problem = jnp.arange(CHAINS, dtype=jnp.int32) // PER_PROBLEM
    for floats in ROW_FLOATS:
        data = jr.normal(jr.key(floats), (PROBLEMS, floats))
        sides = {
            "by index": lambda data=data: by_index(x, keys, data, problem),
            "copied": lambda data=data: copied(x, keys, data, problem),
            "two vmaps": lambda data=data: two_vmaps(x, keys, data),
        }
        draws = [side()[1] for side in sides.values()]
        # Up to the last bits: a broadcast row may be fused otherwise than a copied one.
        assert all(jnp.allclose(d, draws[0], rtol=1e-5, atol=1e-5) for d in draws)
        t = {name: median_seconds(run) for name, run in sides.items()}
        what = (
            f"{CHAINS} chains of {PROBLEMS} problems x {STEPS} steps, rows of "
            f"{floats} floats ({CHAINS * floats * 4 / 2**20:g} MiB copied) on "
            f"{jax.default_backend()}"
        )
        for name in ("by index", "two vmaps"):
            report(
                f"{what}: {name} / copied once",
                t[name] / t["copied"],
                "report",
                True,
                f"{t[name] * 1e3:.2f} ms vs {t['copied'] * 1e3:.2f} ms",
            )


if __name__ == "__main__":
    main()
