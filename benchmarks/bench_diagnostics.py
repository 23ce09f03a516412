"""`run_chains(diagnostics=True)` against the same run without diagnostics, and its
memory as the steps grow.

Workload: `bench_chains.py`'s, 1000 chains x 1000 steps of random-walk Metropolis on a
state of two 3x3 weights. Diagnostics on against off, recording every state as
`bench_chains.py` does (the issue's row), and with `trace=False` (where the moments
are all the loop adds, reported). Then `trace=False` with diagnostics at 10x the steps
against 1x, each in its own process reporting its peak resident set size: the running
moments do not grow with the steps. Usage: `python benchmarks/bench_diagnostics.py`.
"""

import functools as ft
import json
import sys

import jax
import jax.numpy as jnp
import jax.random as jr
from _report import interleaved, measure_in_child, print_time_and_peak, report
from bench_chains import compare, metropolis, NUM_CHAINS, NUM_STEPS

import eqx_batch as eb


TIME_TARGET = 1.05
MEMORY_TARGET = 1.1
LONG = 10


def _init() -> dict:
    return {
        "layer1": {"weights": jnp.zeros((NUM_CHAINS, 3, 3))},
        "layer2": {"weights": jnp.zeros((NUM_CHAINS, 3, 3))},
    }


def time_rows() -> None:
    init, keys = _init(), jr.split(jr.key(0), NUM_CHAINS)

    def run(trace: bool, diagnostics: bool) -> object:
        return jax.block_until_ready(
            eb.run_chains(
                metropolis, init, keys, NUM_STEPS, trace=trace, diagnostics=diagnostics
            )
        )

    for trace in (True, False):
        on, off = ft.partial(run, trace, True), ft.partial(run, trace, False)
        on()
        off()
        name = f"run_chains diagnostics=True / without (trace={trace})"
        if trace:
            compare(name, on, off, f"<= {TIME_TARGET}", repeat=5)
        else:
            t_on, t_off = interleaved(on, off, repeat=5)
            report(name, t_on / t_off, "report", True, f"{t_on:.3f}s vs {t_off:.3f}s")


def memory_child(num_steps: int) -> None:
    init, keys = _init(), jr.split(jr.key(0), NUM_CHAINS)

    def run() -> object:
        return jax.block_until_ready(
            eb.run_chains(
                metropolis, init, keys, num_steps, trace=False, diagnostics=True
            )
        )

    print_time_and_peak(run)


def memory_row() -> None:
    short = measure_in_child(__file__, NUM_STEPS)
    long = measure_in_child(__file__, LONG * NUM_STEPS)
    ratio = long["peak_mib"] / short["peak_mib"]
    report(
        f"run_chains trace=False diagnostics=True, {LONG}x steps / 1x: peak RSS",
        ratio,
        f"<= {MEMORY_TARGET}",
        ratio <= MEMORY_TARGET,
        f"{long['peak_mib']:.0f} MiB vs {short['peak_mib']:.0f} MiB "
        f"({long['seconds']:.2f}s vs {short['seconds']:.2f}s)",
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        memory_child(json.loads(sys.argv[2]))
    else:
        time_rows()
        memory_row()
