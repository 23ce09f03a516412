"""`eb.filter_vmap(..., chunk_size=N/16)` against the unchunked map: peak memory, time.

Workload: N = 256 members, each building a 2000x2000 intermediate (16 MB in float32)
that XLA must materialise (it feeds a matrix-vector product), so the unchunked map holds
N of them at once (4 GB) and the chunked one N/16. Both are compiled under `jax.jit`.

Peak memory is the maximum resident set size of a separate process per variant
(`resource.getrusage` in the child, after the run), so neither sees the other's
allocations. Time is the best of two compiled calls in each process.
Usage: `python benchmarks/bench_chunk.py` (or through `benchmarks/run.py chunk`).
"""

import json
import sys

from _report import measure_in_child, print_time_and_peak, report


MEMBERS = 256
SIZE = 2000
CHUNK = MEMBERS // 16
MEMORY_TARGET = 0.25
TIME_TARGET = 1.3


def child(chunk_size: int | None) -> None:
    import jax
    import jax.numpy as jnp

    import eqx_batch as eb

    def member(v: jax.Array, u: jax.Array) -> jax.Array:
        matrix = jnp.sin(jnp.outer(v, v))
        return matrix @ u

    vs = jnp.linspace(0.0, 1.0, MEMBERS * SIZE, dtype=jnp.float32).reshape(
        MEMBERS, SIZE
    )
    u = jnp.ones(SIZE, jnp.float32)
    mapped = jax.jit(eb.filter_vmap(member, in_axes=(0, None), chunk_size=chunk_size))
    print_time_and_peak(lambda: jax.block_until_ready(mapped(vs, u)))


def main() -> None:
    runs = {
        "unchunked": measure_in_child(__file__, None),
        "chunked": measure_in_child(__file__, CHUNK),
    }
    peak = {name: run["peak_mib"] for name, run in runs.items()}
    seconds = {name: run["seconds"] for name, run in runs.items()}

    memory_ratio = peak["chunked"] / peak["unchunked"]
    report(
        f"filter_vmap chunk_size=N/16 peak RSS (N={MEMBERS}, {SIZE}x{SIZE} each)",
        memory_ratio,
        f"<= {MEMORY_TARGET}",
        memory_ratio <= MEMORY_TARGET,
        f"chunked {peak['chunked']:.0f} MiB, unchunked {peak['unchunked']:.0f} MiB",
    )
    time_ratio = seconds["chunked"] / seconds["unchunked"]
    report(
        f"filter_vmap chunk_size=N/16 time (N={MEMBERS}, {SIZE}x{SIZE} each)",
        time_ratio,
        f"<= {TIME_TARGET}",
        time_ratio <= TIME_TARGET,
        f"chunked {seconds['chunked']:.2f} s, unchunked {seconds['unchunked']:.2f} s",
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(json.loads(sys.argv[2]))
    else:
        main()
