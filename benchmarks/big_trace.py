"""A trace larger than memory: `run_chains(..., trace="disk")` and ArviZ on it.

Not run in CI (it writes as many bytes as asked for). Runs random-walk chains whose
trace totals `--gigabytes`, then converts it with `to_arviz()` and runs
`arviz_stats.rhat`, `ess` and `summary` on it, reporting each phase's time and peak
resident memory (VmHWM, reset between phases) above the memory after imports:

    python benchmarks/big_trace.py --gigabytes 4 --folder /big/disk
    python benchmarks/big_trace.py --gigabytes 4 --folder /tmp/t --in-memory  # baseline

`--no-arviz` runs the chains only. The files are left in `--folder` (delete them).
"""

import argparse
import pathlib
import time

import jax.numpy as jnp
import jax.random as jr

import eqx_batch as eb


def _status(field: str) -> int:
    """A `/proc/self/status` entry, in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) // 1024
    raise LookupError(field)


def _reset_peak() -> None:
    # Linux: VmHWM starts again from the resident memory now.
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def _phase(name: str, base: int, run: object) -> object:
    _reset_peak()
    start = time.perf_counter()
    result = run()  # type: ignore[operator]
    seconds = time.perf_counter() - start
    print(
        f"{name:>12}: {seconds:8.1f} s, peak RSS {_status('VmHWM:'):6d} MiB "
        f"({_status('VmHWM:') - base:+d} MiB above the imports)",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=4.0)
    parser.add_argument("--chains", type=int, default=8)
    parser.add_argument("--dim", type=int, default=4096, help="floats in each state")
    parser.add_argument("--folder", type=pathlib.Path, required=True)
    parser.add_argument("--in-memory", action="store_true", help="trace=True")
    parser.add_argument("--no-arviz", action="store_true")
    options = parser.parse_args()

    draw_bytes = options.chains * options.dim * 4
    num_steps = int(options.gigabytes * 2**30 // draw_bytes)

    def step(x: jnp.ndarray, key: jnp.ndarray) -> jnp.ndarray:
        return 0.99 * x + jr.normal(key, x.shape)

    init = jnp.zeros((options.chains, options.dim))
    options.folder.mkdir(parents=True, exist_ok=True)
    base = _status("VmRSS:")
    print(
        f"{options.chains} chains x {num_steps} steps x {options.dim} floats: "
        f"{num_steps * draw_bytes / 2**30:.1f} GiB of trace, "
        f"trace={'True' if options.in_memory else 'disk'}; {base} MiB after imports"
    )
    result = _phase(
        "run_chains",
        base,
        lambda: eb.run_chains(
            step,
            init,
            jr.key(0),
            num_steps,
            trace=True if options.in_memory else "disk",
            checkpoint=options.folder / "run",
        ),
    )
    if options.no_arviz:
        return
    import arviz_stats

    data = _phase("to_arviz", base, result.to_arviz)  # type: ignore[attr-defined]
    for diagnostic in [arviz_stats.rhat, arviz_stats.ess, arviz_stats.summary]:
        _phase(diagnostic.__name__, base, lambda f=diagnostic: f(data))
    # In bounded memory: a block of parameters at a time, each read lazily.
    block = max(1, options.dim // 16)

    def by_blocks() -> None:
        posterior = data["posterior"].to_dataset()  # type: ignore[index]
        for first in range(0, options.dim, block):
            part = posterior.isel(state_dim_0=slice(first, first + block))
            arviz_stats.rhat(part)

    _phase("rhat, blocks", base, by_blocks)


if __name__ == "__main__":
    main()
