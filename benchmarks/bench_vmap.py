"""`eqx.filter_jit(eb.filter_vmap(f))` against `eqx.filter_jit(eqx.filter_vmap(f))`.

`eb.filter_vmap` binds arguments by name and checks every mapped leaf's size; under
`filter_jit` all of that runs while tracing, so the per-call time must match Equinox's.
The workload is dispatch-bound on purpose (an ensemble of 8 small MLPs on a batch of 8
inputs): any per-call work would show. Both are compiled before timing.
Usage: `python benchmarks/bench_vmap.py` (or through `benchmarks/run.py vmap`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from _report import interleaved, report

import eqx_batch as eb


MEMBERS = 8
TARGET = 1.05


def evaluate(model: eqx.nn.MLP, x: jax.Array) -> jax.Array:
    return model(x)


def main() -> None:
    keys = jr.split(jr.key(0), MEMBERS)
    ensemble = eqx.filter_vmap(lambda key: eqx.nn.MLP(4, 4, 16, 2, key=key))(keys)
    x = jr.normal(jr.key(1), (MEMBERS, 4))

    ours = eqx.filter_jit(eb.filter_vmap(evaluate))
    baseline = eqx.filter_jit(eqx.filter_vmap(evaluate))
    assert jnp.array_equal(ours(ensemble, x), baseline(ensemble, x))

    def run_ours() -> None:
        jax.block_until_ready(ours(ensemble, x))

    def run_baseline() -> None:
        jax.block_until_ready(baseline(ensemble, x))

    time_ours, time_base = interleaved(run_ours, run_baseline, repeat=15, number=200)
    ratio = time_ours / time_base
    report(
        "filter_vmap under filter_jit, per call",
        ratio,
        f"<= {TARGET}",
        ratio <= TARGET,
        f"ours {time_ours * 1e6:.1f} us, eqx.filter_vmap {time_base * 1e6:.1f} us",
    )


if __name__ == "__main__":
    main()
