"""`eb.run_chains` against a hand-written `jit(vmap(scan))` and a Python loop.

Workload (from the issue): 1000 chains x 1000 steps of random-walk Metropolis on a state
`{"layer1": {"weights": (3, 3)}, "layer2": {"weights": (3, 3)}}` targeting a standard
normal, recording every state. Every variant returns the final states, the keys and
the trace, and each is compiled before timing. Reading back a finished checkpointed run
is timed against computing it.

The loop's own cost is measured against the hand-written loop: `jax.jit` of `lax.scan`
over `jax.vmap(step)`, with the same per-chain key schedule (each step's key split from
the chain's carried key), stacking the trace as `scan` does (`[draws, chains, ...]`,
which it writes contiguously; `run_chains` returns `[chains, draws, ...]`), checked
equal bit for bit. Once at 1000 x 1000 (the loop), and once at 50 chains x 100 steps
on a second call (the fixed cost of a call).

More chains than fit in memory (`chunk_size`): 4096 chains of random-walk Metropolis on
a Bayesian neural network (8 inputs, 16 hidden units) over 4096 data points, whose
log-density makes each chain's step hold 256 KB (the hidden activations for every data
point) while the state is small: the final states are returned whole however the
chains are chunked, so what chunks save is the working memory of the step (and of the
trace, here off). Unchunked, every step holds those of all 4096 chains at once (1 GiB
and more); with `chunk_size=256`, those of 256. Each variant runs in its own process,
which reports its peak resident set size and the best of two compiled runs. Usage:
`python benchmarks/bench_chains.py [chunked]` (`chunked`: that row only).
"""

import functools as ft
import json
import pathlib
import sys
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from _report import interleaved, measure_in_child, print_time_and_peak, report

import eqx_batch as eb


# The workload is the test suite's: one Metropolis step, written once.
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
from chains_workloads import metropolis  # noqa: E402


NUM_CHAINS = 1000
NUM_STEPS = 1000


def one_chain(state: dict, key: jax.Array, num_steps: int) -> tuple:
    def body(carry: tuple, _: None) -> tuple:
        state, key = carry
        key, subkey = jr.split(key)
        state = metropolis(state, subkey)
        return (state, key), state

    (state, key), trace = jax.lax.scan(body, (state, key), None, length=num_steps)
    return state, key, trace


@jax.jit
def vmap_of_scan(init: dict, keys: jax.Array) -> tuple:
    return jax.vmap(lambda s, k: one_chain(s, k, NUM_STEPS))(init, keys)


def scan_of_vmap(num_steps: int) -> Callable:
    """The hand-written loop: every chain advanced by one `vmap`ped step per `scan`
    iteration, its trace stacked by `scan`."""

    def one_chain_step(state: dict, key: jax.Array) -> tuple:
        key, subkey = jr.split(key)
        return metropolis(state, subkey), key

    def body(carry: tuple, _: None) -> tuple:
        states, keys = jax.vmap(one_chain_step)(*carry)
        return (states, keys), states

    @jax.jit
    def run(init: dict, keys: jax.Array) -> tuple:
        (states, keys), trace = jax.lax.scan(body, (init, keys), None, length=num_steps)
        return states, keys, trace

    return run


def loop_row(name: str, num_chains: int, num_steps: int, target: str, **timing) -> None:
    """`run_chains` against `scan_of_vmap`, both called once before timing."""
    init = {
        "layer1": {"weights": jnp.zeros((num_chains, 3, 3))},
        "layer2": {"weights": jnp.zeros((num_chains, 3, 3))},
    }
    keys = jr.split(jr.key(0), num_chains)
    recipe = scan_of_vmap(num_steps)

    def ours() -> object:
        return jax.block_until_ready(eb.run_chains(metropolis, init, keys, num_steps))

    def baseline() -> object:
        return jax.block_until_ready(recipe(init, keys))

    result = jax.block_until_ready(eb.run_chains(metropolis, init, keys, num_steps))
    states, end_keys, trace = jax.block_until_ready(recipe(init, keys))
    by_chain = jtu.tree_map(lambda x: jnp.swapaxes(x, 0, 1), trace)
    for a, b in [(result.final, states), (result.trace, by_chain)]:
        assert all(
            bool(jnp.array_equal(x, y))
            for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True)
        )
    assert bool(jnp.array_equal(jr.key_data(result.keys), jr.key_data(end_keys)))
    compare(name, ours, baseline, target, **timing)


def compare(
    name: str,
    a: Callable[[], object],
    b: Callable[[], object],
    target: str,
    repeat: int,
    number: int = 1,
) -> None:
    """Reports the time of `a` over that of `b` (both compiled), timed alternately
    (`repeat` times `number` calls each).

    `target` is `"<= x"` or `">= x"`: the bound the ratio must meet.
    """
    t_a, t_b = interleaved(a, b, repeat=repeat, number=number)
    ratio = t_a / t_b
    op, bound = target.split()
    ok = ratio <= float(bound) if op == "<=" else ratio >= float(bound)
    report(name, ratio, target, ok, f"{t_a:.3f}s vs {t_b:.3f}s")


CHUNKED_CHAINS = 4096
CHUNK_SIZE = 256
DATA_POINTS = 4096
FEATURES = 8
HIDDEN = 16
CHUNKED_STEPS = 10
MEMORY_TARGET = 0.25
TIME_TARGET = 1.3


def network_step(w: dict, key: jax.Array, x: jax.Array, y: jax.Array) -> dict:
    """Metropolis on the weights `w` of a one-hidden-layer network with unit noise."""

    def log_density(w: dict) -> jax.Array:
        # The hidden layer's activations, for every data point (the heavy part: XLA
        # materialises them, as they feed the product with `w["out"]`).
        hidden = jnp.tanh(x @ w["hidden"])
        fit = jnp.sum((y - hidden @ w["out"]) ** 2)
        return -0.5 * (fit + sum(jnp.sum(v**2) for v in jtu.tree_leaves(w)))

    noise_key, accept_key = jr.split(key)
    noise = jr.normal(noise_key, (w["hidden"].size + w["out"].size,))
    proposal = {
        "hidden": w["hidden"]
        + 0.01 * noise[: w["hidden"].size].reshape(w["hidden"].shape),
        "out": w["out"] + 0.01 * noise[w["hidden"].size :],
    }
    log_ratio = log_density(proposal) - log_density(w)
    accept = jnp.log(jr.uniform(accept_key)) < log_ratio
    return jtu.tree_map(lambda p, s: jnp.where(accept, p, s), proposal, w)


def chunked_child(chunk_size: int | None) -> None:
    """Runs the chains once to compile, then twice timed; prints seconds and peak."""
    x = jr.normal(jr.key(1), (DATA_POINTS, FEATURES))
    y = jnp.sin(x @ jnp.ones(FEATURES)) + 0.1 * jr.normal(jr.key(2), (DATA_POINTS,))
    step = ft.partial(network_step, x=x, y=y)
    init = {
        "hidden": jnp.zeros((CHUNKED_CHAINS, FEATURES, HIDDEN)),
        "out": jnp.zeros((CHUNKED_CHAINS, HIDDEN)),
    }

    def run() -> object:
        return jax.block_until_ready(
            eb.run_chains(
                step, init, jr.key(0), CHUNKED_STEPS, trace=False, chunk_size=chunk_size
            )
        )

    print_time_and_peak(run)


def chunked_rows() -> None:
    unchunked, chunked = (
        measure_in_child(__file__, None),
        measure_in_child(__file__, CHUNK_SIZE),
    )
    name = f"run_chains chunk_size={CHUNK_SIZE} / unchunked ({CHUNKED_CHAINS} chains)"
    memory_ratio = chunked["peak_mib"] / unchunked["peak_mib"]
    report(
        f"{name}: peak RSS",
        memory_ratio,
        f"<= {MEMORY_TARGET}",
        memory_ratio <= MEMORY_TARGET,
        f"{chunked['peak_mib']:.0f} MiB vs {unchunked['peak_mib']:.0f} MiB",
    )
    time_ratio = chunked["seconds"] / unchunked["seconds"]
    report(
        f"{name}: time",
        time_ratio,
        f"<= {TIME_TARGET}",
        time_ratio <= TIME_TARGET,
        f"{chunked['seconds']:.2f}s vs {unchunked['seconds']:.2f}s",
    )


def main() -> None:
    init = {
        "layer1": {"weights": jnp.zeros((NUM_CHAINS, 3, 3))},
        "layer2": {"weights": jnp.zeros((NUM_CHAINS, 3, 3))},
    }
    keys = jr.split(jr.key(0), NUM_CHAINS)

    def ours() -> object:
        return jax.block_until_ready(eb.run_chains(metropolis, init, keys, NUM_STEPS))

    def baseline() -> object:
        return jax.block_until_ready(vmap_of_scan(init, keys))

    ours()
    baseline()
    compare("run_chains / jit(vmap(scan))", ours, baseline, "<= 1.1", repeat=5)
    loop_row(
        f"run_chains / jit(scan(vmap(step))) ({NUM_CHAINS} x {NUM_STEPS})",
        NUM_CHAINS,
        NUM_STEPS,
        "<= 1.05",
        repeat=7,
    )
    # Called once in `loop_row` before timing: every timed call is a second call.
    loop_row(
        "run_chains / jit(scan(vmap(step))) (50 x 100, warm)",
        50,
        100,
        "<= 1.3",
        repeat=20,
        number=5,
    )

    one_jitted = jax.jit(lambda s, k: one_chain(s, k, NUM_STEPS))

    def python_loop() -> object:
        return jax.block_until_ready(
            [one_jitted(eb.index(init, i), keys[i]) for i in range(NUM_CHAINS)]
        )

    python_loop()
    compare("Python loop over chains / run_chains", python_loop, ours, ">= 3", repeat=2)

    with tempfile.TemporaryDirectory() as folder:
        runs = iter(range(10**6))

        def run_checkpointed(path: pathlib.Path, every: int) -> object:
            return jax.block_until_ready(
                eb.run_chains(
                    metropolis,
                    init,
                    keys,
                    NUM_STEPS,
                    checkpoint=path,
                    checkpoint_every=every,
                )
            )

        def checkpointed() -> object:
            # A fresh path each time: an existing final checkpoint would be read back.
            return run_checkpointed(pathlib.Path(folder) / f"run{next(runs)}.ckpt", 100)

        checkpointed()
        compare(
            "run_chains checkpoint_every=100 / without",
            checkpointed,
            ours,
            "<= 1.1",
            repeat=5,
        )

        # A finished run written in 50 draw files, read back whole.
        finished = pathlib.Path(folder) / "finished.ckpt"
        every = NUM_STEPS // 50

        def read_back() -> object:
            return run_checkpointed(finished, every)

        read_back()  # computes and writes the run; later calls read it back
        read_back()
        compare(
            "run_chains read back (50 draw files) / computing it",
            read_back,
            ours,
            "<= 0.2",
            repeat=5,
        )

    def with_progress() -> object:
        return jax.block_until_ready(
            eb.run_chains(metropolis, init, keys, NUM_STEPS, progress=True)
        )

    with_progress()
    compare(
        "run_chains progress=True / without", with_progress, ours, "<= 1.05", repeat=5
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        chunked_child(json.loads(sys.argv[2]))
    elif sys.argv[1:2] == ["chunked"]:
        chunked_rows()
    else:
        main()
        chunked_rows()
