"""`eb.scan_layers` against the Python loop over unstacked layers, at depth 64.

Two stacks of 64 identical layers: pre-norm transformer blocks (width 64, 4 heads,
4 sequences of 16 tokens), the case scanning over layers is for, which carries the
targets; and residual MLP blocks (width 256, batch 64), reported alongside. Both sides
are `eqx.filter_jit`-compiled with `.lower(...).compile()`:

- ours: `eb.scan_layers(layers, x)` on the stacked layers;
- baseline: `for layer in layers: x = layer(x)` over the 64 unstacked layers, which
  JAX traces and XLA compiles 64 times over.

Compile time (tracing, lowering and compiling, each side from a fresh function so that
nothing is cached) is measured alternately, best of three; runtime of the two compiled
executables is measured interleaved. A small layer compiles in little more than XLA's
fixed cost per executable, which bounds what the scan can save there; that is why the
MLP row is reported rather than held to the target. Usage:
`python benchmarks/bench_layers.py` (or through `benchmarks/run.py layers`).
"""

import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from _report import interleaved, report

import eqx_batch as eb


DEPTH = 64
COMPILE_REPEATS = 3


class TransformerBlock(eqx.Module):
    attention_norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, *, key: jax.Array):
        attention_key, up_key, down_key = jr.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(4, width, key=attention_key)
        self.mlp_norm = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, 4 * width, key=up_key)
        self.down = eqx.nn.Linear(4 * width, width, key=down_key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.sequence)(x)

    def sequence(self, tokens: jax.Array) -> jax.Array:
        normed = jax.vmap(self.attention_norm)(tokens)
        tokens = tokens + self.attention(normed, normed, normed)
        normed = jax.vmap(self.mlp_norm)(tokens)
        return tokens + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(normed)


class MLPBlock(eqx.Module):
    hidden: eqx.nn.Linear
    output: eqx.nn.Linear

    def __init__(self, width: int, *, key: jax.Array):
        hidden_key, output_key = jr.split(key)
        self.hidden = eqx.nn.Linear(width, width, key=hidden_key)
        self.output = eqx.nn.Linear(width, width, key=output_key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.vmap(lambda row: self.output(jax.nn.gelu(self.hidden(row))))(x)


def scanned(layers: Any, x: jax.Array) -> jax.Array:
    return eb.scan_layers(layers, x)


def unrolled(layers: list[Any], x: jax.Array) -> jax.Array:
    for layer in layers:
        x = layer(x)
    return x


def compile_fresh(fn: Callable[[Any, jax.Array], jax.Array], layers: Any, x: Any):
    # A new function object each time, so no tracing or lowering cache can answer.
    def fresh(layers: Any, x: jax.Array) -> jax.Array:
        return fn(layers, x)

    # Typed as `fresh` by static checkers, which do not see `.lower`.
    jitted: Any = eqx.filter_jit(fresh)
    return jitted.lower(layers, x).compile()


def measure(label: str, block: type, width: int, shape: tuple[int, ...], gate: bool):
    stacked = eb.ensemble(block, DEPTH, width=width, key=jr.key(0))
    members = eb.unstack(stacked)
    x = jr.normal(jr.key(1), shape)

    compile_ours = compile_base = float("inf")
    for _ in range(COMPILE_REPEATS):
        start = time.perf_counter()
        compile_fresh(unrolled, members, x)
        compile_base = min(compile_base, time.perf_counter() - start)
        start = time.perf_counter()
        compile_fresh(scanned, stacked, x)
        compile_ours = min(compile_ours, time.perf_counter() - start)
    speedup = compile_base / compile_ours
    report(
        f"scan_layers compile, {label} x64, unrolled / ours",
        speedup,
        ">= 8" if gate else "report",
        speedup >= 8 or not gate,
        f"ours {compile_ours * 1e3:.0f} ms, unrolled loop {compile_base * 1e3:.0f} ms",
    )

    run_ours = compile_fresh(scanned, stacked, x)
    run_base = compile_fresh(unrolled, members, x)
    expected = run_base(members, x)
    assert jnp.allclose(run_ours(stacked, x), expected, rtol=1e-4, atol=1e-4)
    ours, base = interleaved(
        lambda: jax.block_until_ready(run_ours(stacked, x)),
        lambda: jax.block_until_ready(run_base(members, x)),
        repeat=7,
        number=3,
    )
    ratio = ours / base
    report(
        f"scan_layers runtime, {label} x64, ours / unrolled",
        ratio,
        "<= 1.1" if gate else "report",
        ratio <= 1.1 or not gate,
        f"ours {ours * 1e3:.2f} ms, unrolled loop {base * 1e3:.2f} ms per call",
    )


def main() -> None:
    measure("transformer", TransformerBlock, 64, (4, 16, 64), gate=True)
    measure("MLP", MLPBlock, 256, (64, 256), gate=False)


if __name__ == "__main__":
    main()
