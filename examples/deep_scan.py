"""A 64-layer network applied with `eb.scan_layers` instead of a Python loop.

The question: my network is many copies of the same block. Written as a Python loop
over the blocks, `jax.jit` traces and compiles every block separately, so compile
time grows with depth. How do I keep compile time flat without giving up speed or
changing the result?

The answer: keep the blocks stacked (one block whose every array has a leading
layer axis, built here with `eb.ensemble`) and apply them with `eb.scan_layers`,
which runs them in sequence with one `jax.lax.scan`: one block is traced and
compiled, whatever the depth. This script times compilation and running of both
versions, and checks that outputs and gradients agree.

    python examples/deep_scan.py [--out DIR]

It writes nothing (`--out` is accepted for uniformity) and ends with one line
`RESULT {...}` in JSON, for scripts and tests to read. Timings vary by machine.
"""

import argparse
import json
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import eqx_batch as eb


DEPTH = 64
WIDTH = 64
BATCH = 256
REPEATS = 20


class ResidualBlock(eqx.Module):
    """`x + 0.1 * tanh(linear(x))`: residual, so 64 of them keep activations tame."""

    linear: eqx.nn.Linear

    def __init__(self, width: int, *, key: jax.Array):
        self.linear = eqx.nn.Linear(width, width, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + 0.1 * jnp.tanh(self.linear(x))


def scanned(blocks: ResidualBlock, x: jax.Array) -> jax.Array:
    """All blocks in sequence with one `lax.scan`, for a batch of inputs."""
    return jax.vmap(lambda x: eb.scan_layers(blocks, x))(x)


def unrolled(blocks: list[ResidualBlock], x: jax.Array) -> jax.Array:
    """The same with a Python loop: `jax.jit` traces every block separately."""
    for block in blocks:
        x = jax.vmap(block)(x)
    return x


def scanned_loss(blocks: ResidualBlock, x: jax.Array) -> jax.Array:
    return jnp.mean(scanned(blocks, x) ** 2)


def unrolled_loss(blocks: list[ResidualBlock], x: jax.Array) -> jax.Array:
    return jnp.mean(unrolled(blocks, x) ** 2)


def compile_and_time(fn, *args) -> tuple[float, float, jax.Array]:
    """Seconds to trace and compile, seconds per call, and the output."""
    start = time.perf_counter()
    compiled = eqx.filter_jit(fn).lower(*args).compile()
    compile_seconds = time.perf_counter() - start
    out = jax.block_until_ready(compiled(*args))  # warm up
    start = time.perf_counter()
    for _ in range(REPEATS):
        out = compiled(*args)
    jax.block_until_ready(out)
    return compile_seconds, (time.perf_counter() - start) / REPEATS, out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.parse_args()

    block_key, x_key = jr.split(jr.key(0))
    blocks = eb.ensemble(ResidualBlock, DEPTH, width=WIDTH, key=block_key)
    block_list = eb.unstack(blocks)  # the same blocks, as a Python list
    x = jr.normal(x_key, (BATCH, WIDTH))
    print(
        f"{eb.batch_size(blocks)} residual blocks of width {WIDTH}, stacked: "
        f"linear.weight {blocks.linear.weight.shape}; batch of {BATCH} inputs.\n"
    )

    # --- Forward pass: compile time and run time --------------------------------------
    scan_compile, scan_run, scan_out = compile_and_time(scanned, blocks, x)
    loop_compile, loop_run, loop_out = compile_and_time(unrolled, block_list, x)
    forward_diff = float(jnp.max(jnp.abs(scan_out - loop_out)))

    # --- Gradients agree too ----------------------------------------------------------
    scan_grads = eqx.filter_jit(eqx.filter_grad(scanned_loss))(blocks, x)
    loop_grads = eqx.filter_jit(eqx.filter_grad(unrolled_loss))(block_list, x)
    stacked_loop_grads = eb.stack(loop_grads)
    grad_diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(scan_grads),
            jax.tree.leaves(stacked_loop_grads),
            strict=True,
        )
    )
    grad_scale = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(scan_grads))

    print(f"{'':22s}{'compile':>10s}{'run (per call)':>18s}")
    print(f"{'eb.scan_layers':22s}{scan_compile:9.2f}s{scan_run * 1e3:15.2f} ms")
    print(f"{'Python loop, unrolled':22s}{loop_compile:9.2f}s{loop_run * 1e3:15.2f} ms")
    print(f"\ncompile time, unrolled / scanned: {loop_compile / scan_compile:.1f}x")
    print(f"max |output difference|:   {forward_diff:.2e}")
    print(f"max |gradient difference|: {grad_diff:.2e}", end=" ")
    print(f"(largest gradient {grad_scale:.2e})")

    result = {
        "depth": DEPTH,
        "output_shape": list(scan_out.shape),
        "compile_seconds": {"scan": scan_compile, "unrolled": loop_compile},
        "run_seconds": {"scan": scan_run, "unrolled": loop_run},
        "max_output_difference": forward_diff,
        "max_gradient_difference": grad_diff,
        "max_gradient": grad_scale,
        "outputs_finite": bool(jnp.all(jnp.isfinite(scan_out))),
    }
    print("\nRESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
