"""Checkpoints across platforms: a run that failed mid-way resumes on the platform
that wrote its checkpoint bit for bit, and on another platform from the same bits.
Both tests are in the subset that `python -m pytest -m accelerator` runs on the
backend JAX picks."""

import os
import pathlib
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from chains_workloads import ar1, outputs
from helpers import assert_trees_identical, checkpoint_steps_done, tree_allclose

import eqx_batch as eb


pytestmark = pytest.mark.accelerator

TESTS = pathlib.Path(__file__).parent
NUM_STEPS, THIN, EVERY, INTERRUPT_AT = 400, 5, 50, 200


class Interrupted(Exception):
    """What the step raises, from the host, at `INTERRUPTED[0]` steps."""


# The step count at which the step fails (None: never), and the counts it was given.
# Globals, which a run's identity leaves out: the step computes the same whether it
# will fail or not, and its checkpoint resumes either way.
INTERRUPTED: list[int | None] = [None]
COUNTS_SEEN: list[int] = []


def _see(count: jax.Array) -> None:
    COUNTS_SEEN.append(int(count))
    if INTERRUPTED[0] is not None and count >= INTERRUPTED[0]:
        raise Interrupted(f"interrupted at step {count}")


@eb.all_chains
def watched_ar1(states: jax.Array, keys: jax.Array, count: jax.Array) -> jax.Array:
    """`ar1` on every chain, telling the host each step's count. An AR(1) forgets
    its rounding: runs that round apart stay within a few ulps of each other."""
    jax.debug.callback(_see, count)
    return jax.vmap(ar1)(states, keys)


def watched_run(
    checkpoint: str | pathlib.Path | None = None, init: Any = None, **kw
) -> eb.Chains:
    """8 chains of `watched_ar1`, from the starts of `init` (default: spread out)."""
    if init is None:
        # NumPy's: `jnp.linspace` rounds otherwise on a TPU than on a CPU, and a
        # checkpoint resumes only a run from the same `init`, bit for bit.
        init = np.linspace(-2.0, 2.0, 8 * 3, dtype=np.float32).reshape(8, 3)
    kw.setdefault("key", jr.split(jr.key(0), 8))
    kw.setdefault("num_steps", NUM_STEPS)
    result = eb.run_chains(
        watched_ar1,
        init,
        thin=THIN,
        checkpoint=checkpoint,
        checkpoint_every=None if checkpoint is None else EVERY,
        **kw,
    )
    # `run_chains` returns while its loop may still run: its callbacks must see
    # `INTERRUPTED` as it is now, not as the next run sets it.
    return jax.block_until_ready(result)


def interrupted_run(checkpoint: str | pathlib.Path) -> None:
    """`watched_run` with its checkpoint, failing at step `INTERRUPT_AT` as a step
    whose host callback raises does. The checkpoint keeps the last whole segment, step
    `INTERRUPT_AT`: its write was under way while the failing segment ran, and a run
    that fails waits for it."""
    INTERRUPTED[0] = INTERRUPT_AT
    try:
        with pytest.raises(jax.errors.JaxRuntimeError, match="Interrupted"):
            watched_run(checkpoint)
    finally:
        INTERRUPTED[0] = None
    assert checkpoint_steps_done(pathlib.Path(checkpoint)) == INTERRUPT_AT


def resumed_run(checkpoint: pathlib.Path) -> eb.Chains:
    """`watched_run` resumed from `checkpoint`, checking that it ran only the steps
    after the checkpoint."""
    COUNTS_SEEN.clear()
    resumed = watched_run(checkpoint)
    jax.effects_barrier()  # every callback has run
    assert sorted(set(COUNTS_SEEN)) == list(range(INTERRUPT_AT, NUM_STEPS))
    return resumed


def test_an_interrupted_run_resumes_in_this_process_bit_for_bit(tmp_path):
    # The same program on the same platform: an uninterrupted run's bits, whatever
    # the backend.
    path = tmp_path / "run.ckpt"
    plain = watched_run()
    interrupted_run(path)
    assert_trees_identical(outputs(resumed_run(path)), outputs(plain))


# Run as a script in a process of its own on the CPU: saves an uninterrupted run and
# the run of its first `INTERRUPT_AT` steps to OUT, then leaves a checkpoint of step
# `INTERRUPT_AT` at CHECKPOINT.
_CPU_WRITER = """
import sys
import eqx_batch as eb
from chains_workloads import outputs
from test_platforms import INTERRUPT_AT, interrupted_run, watched_run
checkpoint, out = sys.argv[1:]
first = watched_run(num_steps=INTERRUPT_AT)
saved = {"plain": outputs(watched_run()), "first": outputs(first)}
eb.save(out, saved)
interrupted_run(checkpoint)
"""


def _like(num_steps: int) -> dict:
    """The shapes of `outputs(watched_run(num_steps=num_steps))`."""
    return {
        "final": jax.ShapeDtypeStruct((8, 3), jnp.float32),
        "trace": jax.ShapeDtypeStruct((8, num_steps // THIN, 3), jnp.float32),
        "keys": jax.eval_shape(lambda: jr.split(jr.key(0), 8)),
    }


def test_a_checkpoint_written_on_the_cpu_resumes_here(tmp_path):
    # The child process sees only the CPU (`JAX_PLATFORMS=cpu`: one process at a time
    # may hold an accelerator chip, and this one holds it where there is one).
    path, out = tmp_path / "run.ckpt", tmp_path / "cpu.eqx"
    subprocess.run(
        [sys.executable, "-c", _CPU_WRITER, str(path), str(out)],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        cwd=TESTS,
        check=True,
        timeout=300,
    )
    cpu = eb.load(out, {"plain": _like(NUM_STEPS), "first": _like(INTERRUPT_AT)})
    resumed = resumed_run(path)

    # What holds on every backend: the draws before the checkpoint are the CPU's,
    # read back; and the steps after it continue the CPU's states and keys at step
    # `INTERRUPT_AT` exactly as a run from them on this backend does.
    first_draws = INTERRUPT_AT // THIN
    assert_trees_identical(resumed.trace[:, :first_draws], cpu["first"]["trace"])
    first = cpu["first"]
    rest = watched_run(init=first["final"], key=first["keys"], num_steps=INTERRUPT_AT)
    assert_trees_identical(resumed.trace[:, first_draws:], rest.trace)
    assert_trees_identical((resumed.final, resumed.keys), (rest.final, rest.keys))

    if jax.default_backend() == "cpu":
        # The platform that wrote the checkpoint: an uninterrupted run's bits.
        assert_trees_identical(outputs(resumed), cpu["plain"])
    else:
        # Another backend rounds the normal draws' transcendental functions
        # (`erf_inv`) in its own way, so its steps drift from the CPU's by rounding,
        # which the AR(1) keeps small.
        assert tree_allclose(outputs(resumed), cpu["plain"], rtol=1e-4, atol=1e-5)
