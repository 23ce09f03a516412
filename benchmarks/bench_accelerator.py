"""`eb.run_chains` on an accelerator (issue 34): the loop, its options and its files.

Written for one TPU v5e chip (one process; JAX picks the chip), and runnable on the
CPU at sizes 16 times smaller (fewer chains, the same steps), chosen by
`jax.default_backend()`. Workload: random-walk Metropolis on a state of 16 float32
per chain, targeting a standard normal, recording every state (a trace of
`chains x steps x 16` floats).

- `trace`: `run_chains(step, init, key, 250)` with 65,536 chains (a trace of 1 GiB)
    against the loop a user writes by hand: `jax.jit` of `lax.scan` over
    `jax.vmap(step)`, with `run_chains`' key schedule (the key split into one per
    chain, and each step's key split from the chain's carried key), stacking the trace
    as `scan` does (`[draws, chains, ...]`, which it writes contiguously; `run_chains`
    returns `[chains, draws, ...]`). Checked equal bit for bit (final states, keys and
    the trace, swapped outside the timing). Target: at most 1.05 of it. Reported
    beside it: the share of the chip's memory bandwidth (819 GB/s on a v5e) that
    writing the trace reaches, the trace's bytes over our wall time: a lower bound on
    the traffic, which also reads states and writes keys.
- `options`: 16,384 chains x 1000 steps, the same walk; `progress=True` (its tqdm bar
    sent to `os.devnull`) and `diagnostics=True` (running moments in the loop) each
    against the plain run. Their final states and traces are checked equal to the plain
    run's. Target: at most 1.1 each.
- `disk`: the same run with `checkpoint=`, once with `checkpoint_every=250` (the trace
    also in memory) and once with `trace="disk"` (no trace in memory), against the
    floor: the plain run's trace (computed before timing) copied from the device
    (`np.asarray` of it put anew on the device before each call, so that no host copy
    is cached) and written to one file, fsynced as `run_chains` fsyncs each of its files
    (`eqx_batch/_files/_atomic.py`). The floor leaves out what the checkpoint adds to
    the bytes: the safetensors header, the CRC-32 of the data, the state files, the
    renames and the folder's fsync. Each call gets a new, empty folder (deleted after
    it, outside the timing), so every call writes its whole checkpoint; the folders
    are made by `tempfile` (under `$TMPDIR`, else `/tmp`; its file system is said in
    the rows). The final states (and the draws) are checked equal to the plain run's.
    Target: at most 1.3 of the floor each. Said beside them: the plain run's time (the
    compute that the writes overlap, in the ratio but not in the floor: where it is
    not small next to the floor, as on a CPU, the ratio says little) and what the
    checkpoint adds to it, as a share of the floor.

Before any row, a `report` row gives JAX's version, the backend, its device kind and
the sizes used (its ratio is the number of devices). Times are medians of repeats in
which the sides alternate, every side called once before timing (compiled), so that a
shared machine's load falls on all of them. Usage:
`python benchmarks/bench_accelerator.py [trace] [options] [disk]`, every section when
none is named (or through `benchmarks/run.py accelerator`).
"""

import contextlib
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from _report import report

import eqx_batch as eb


STATE_SIZE = 16
PROPOSAL_SCALE = 0.5
BANDWIDTH = 819e9  # bytes/s of a TPU v5e chip's HBM
TRACE_STEPS = 250
STEPS = 1000
CHECKPOINT_EVERY = 250


class Sizes(NamedTuple):
    trace_chains: int  # the `trace` section's
    chains: int  # the `options` and `disk` sections'
    repeat: int


ACCELERATOR = Sizes(trace_chains=65_536, chains=16_384, repeat=7)
CPU = Sizes(trace_chains=65_536 // 16, chains=16_384 // 16, repeat=5)


def sizes() -> Sizes:
    return CPU if jax.default_backend() == "cpu" else ACCELERATOR


def step(state: jax.Array, key: jax.Array) -> jax.Array:
    """One random-walk Metropolis step of one chain on a standard normal."""
    noise_key, accept_key = jr.split(key)
    proposal = state + PROPOSAL_SCALE * jr.normal(noise_key, state.shape, state.dtype)
    log_ratio = 0.5 * (jnp.sum(state**2) - jnp.sum(proposal**2))
    accept = jnp.log(jr.uniform(accept_key)) < log_ratio
    return jnp.where(accept, proposal, state)


def starts(chains: int) -> jax.Array:
    return jnp.zeros((chains, STATE_SIZE), jnp.float32)


def on_host(tree: Any) -> Any:
    """`tree`'s arrays as NumPy arrays: what a check keeps while the device's memory
    goes to the next run."""
    return jax.tree.map(np.asarray, tree)


def assert_same(name: str, got: Any, expected: Any) -> None:
    """Bit for bit, leaf by leaf (compared on the host)."""
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    for (path, a), b in zip(got_leaves, jax.tree.leaves(expected), strict=True):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise AssertionError(f"{name}: {jax.tree_util.keystr(path)} differs")


Side = Callable[[], AbstractContextManager[Callable[[], object]]]


def ready(run: Callable[[], object]) -> Side:
    """A side that needs nothing prepared before its timed call."""
    return lambda: contextlib.nullcontext(run)


def interleaved_medians(sides: dict[str, Side], repeat: int) -> dict[str, float]:
    """Each side's median seconds over `repeat` rounds, the sides alternating in each.

    A side is entered untimed (it may prepare a folder, and clean it on exit) and
    yields the call that is timed.
    """
    walls: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeat):
        for name, side in sides.items():
            with side() as run:
                start = time.perf_counter()
                run()
                walls[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in walls.items()}


def ratio_row(name: str, ours: float, base: float, bound: float, note: str) -> None:
    ratio = ours / base
    detail = f"{ours * 1e3:.1f} ms vs {base * 1e3:.1f} ms; {note}"
    report(name, ratio, f"<= {bound}", ratio <= bound, detail)


def environment_row() -> None:
    s = sizes()
    device = jax.devices()[0]
    report(
        f"JAX {jax.__version__}, backend {jax.default_backend()}: devices",
        float(jax.device_count()),
        "report",
        True,
        f"{device.device_kind}; trace: {s.trace_chains} chains x {TRACE_STEPS} "
        f"steps; options, disk: {s.chains} x {STEPS}; {s.repeat} rounds",
    )


# -- trace -----------------------------------------------------------------------


def scan_of_vmap(chains: int, num_steps: int) -> Callable:
    """The hand-written loop, with `run_chains`' key schedule: the key split into one
    per chain, each step's key split from the chain's carried key. Returns
    `(final states, keys), trace` with the trace `[draws, chains, ...]`."""

    @jax.jit
    def run(init: jax.Array, key: jax.Array) -> tuple:
        def one_step(carry: tuple, _: None) -> tuple:
            states, keys = carry
            keys, step_keys = jax.vmap(jr.split, out_axes=1)(keys)
            states = jax.vmap(step)(states, step_keys)
            return (states, keys), states

        carry = (init, jr.split(key, chains))
        return jax.lax.scan(one_step, carry, None, length=num_steps)

    return run


def trace_rows() -> None:
    chains = sizes().trace_chains
    init, key = starts(chains), jr.key(0)
    by_hand = scan_of_vmap(chains, TRACE_STEPS)

    def ours() -> eb.Chains:
        return jax.block_until_ready(eb.run_chains(step, init, key, TRACE_STEPS))

    def hand() -> tuple:
        return jax.block_until_ready(by_hand(init, key))

    # One side's arrays on the device at a time, the other's on the host.
    result = ours()
    expected = on_host((result.final, jr.key_data(result.keys), result.trace))
    trace_bytes = result.trace.nbytes
    del result
    (final, end_keys), trace = hand()
    assert_same("by hand: final", final, expected[0])
    assert_same("by hand: keys", jr.key_data(end_keys), expected[1])
    assert_same("by hand: trace", np.swapaxes(np.asarray(trace), 0, 1), expected[2])
    del final, end_keys, trace, expected

    times = interleaved_medians(
        {"ours": ready(ours), "hand": ready(hand)}, sizes().repeat
    )
    ratio_row(
        f"run_chains / jit(scan(vmap(step))) ({chains} x {TRACE_STEPS}, trace)",
        times["ours"],
        times["hand"],
        1.05,
        f"trace {trace_bytes / 2**20:.0f} MiB",
    )
    rate = trace_bytes / times["ours"]
    report(
        "run_chains trace write / v5e memory bandwidth",
        rate / BANDWIDTH,
        "report",
        True,
        f"{rate / 1e9:.1f} GB/s of {BANDWIDTH / 1e9:.0f} GB/s: the trace's bytes over "
        "our wall time, a lower bound on the traffic",
    )


# -- options ---------------------------------------------------------------------


def plain_run(chains: int) -> Callable[..., eb.Chains]:
    init, key = starts(chains), jr.key(0)

    def run(**options: Any) -> eb.Chains:
        return jax.block_until_ready(eb.run_chains(step, init, key, STEPS, **options))

    return run


def final_and_trace(result: eb.Chains) -> dict:
    return {"final": result.final, "trace": result.trace}


@contextlib.contextmanager
def stderr_to_devnull() -> Iterator[None]:
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        yield


def options_rows() -> None:
    chains = sizes().chains
    run = plain_run(chains)

    def with_progress() -> eb.Chains:
        with stderr_to_devnull():
            return run(progress=True)

    sides = {
        "plain": run,
        "progress": with_progress,
        "diagnostics": lambda: run(diagnostics=True),
    }
    plain = on_host(final_and_trace(run()))
    for name in ("progress", "diagnostics"):
        assert_same(name, final_and_trace(sides[name]()), plain)
    del plain

    times = interleaved_medians(
        {name: ready(side) for name, side in sides.items()}, sizes().repeat
    )
    for name, option in (("progress", "progress"), ("diagnostics", "diagnostics")):
        ratio_row(
            f"run_chains {option}=True / without ({chains} x {STEPS})",
            times[name],
            times["plain"],
            1.1,
            f"trace {4 * chains * STEPS * STATE_SIZE / 2**20:.0f} MiB",
        )


# -- disk ------------------------------------------------------------------------


def filesystem(path: pathlib.Path) -> str:
    """The type of the file system that holds `path` (Linux), else `"?"`."""
    try:
        mounts = pathlib.Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "?"
    best, kind = "", "?"
    for line in mounts:
        _, point, fs_type, *_ = line.split()
        inside = str(path.resolve()).startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fs_type
    return kind


def in_fresh_folder(
    base: pathlib.Path, make: Callable[[pathlib.Path], Callable]
) -> Side:
    """A side whose every call gets a new, empty folder under `base`, deleted after."""

    @contextlib.contextmanager
    def side() -> Iterator[Callable[[], object]]:
        folder = pathlib.Path(tempfile.mkdtemp(dir=base))
        try:
            yield make(folder)
        finally:
            shutil.rmtree(folder)

    return side


def write_floor(trace: np.ndarray) -> Callable[[pathlib.Path], Callable]:
    """The draws' bytes from the device to one fsynced file: what a checkpoint's draw
    files cannot avoid."""

    def make(folder: pathlib.Path) -> Callable[[], object]:
        # Put on the device before the timed call, as a new array: `np.asarray` keeps
        # the host copy of an array it has read once.
        on_device = jax.block_until_ready(jax.device_put(trace))

        def write() -> None:
            # A TPU may hand the array back in its own (not C-contiguous) layout.
            host = np.ascontiguousarray(on_device)
            with open(folder / "draws.bin", "wb") as file:
                file.write(memoryview(host).cast("B"))
                file.flush()
                os.fsync(file.fileno())

        return write

    return make


def checkpointed(
    run: Callable[..., eb.Chains], **options: Any
) -> Callable[[pathlib.Path], Callable]:
    """`run` with a checkpoint in the folder it is given."""

    def make(folder: pathlib.Path) -> Callable[[], eb.Chains]:
        return lambda: run(checkpoint=folder / "run.eqx", **options)

    return make


def disk_rows() -> None:
    chains = sizes().chains
    run = plain_run(chains)
    plain = on_host(final_and_trace(run()))
    checkpoints = {
        f"checkpoint_every={CHECKPOINT_EVERY}, trace=True": checkpointed(
            run, checkpoint_every=CHECKPOINT_EVERY
        ),
        'trace="disk"': checkpointed(run, trace="disk"),
    }
    with tempfile.TemporaryDirectory() as name:
        base = pathlib.Path(name)
        where = f"{base.parent} ({filesystem(base)})"
        for options, make in checkpoints.items():
            with in_fresh_folder(base, make)() as call:
                assert_same(options, final_and_trace(call()), plain)
        sides = {
            "plain": ready(run),
            "floor": in_fresh_folder(base, write_floor(plain["trace"])),
            **{options: in_fresh_folder(base, m) for options, m in checkpoints.items()},
        }
        with sides["floor"]() as write:
            write()
        times = interleaved_medians(sides, sizes().repeat)
    trace_mib = plain["trace"].nbytes / 2**20
    for options in checkpoints:
        added = times[options] - times["plain"]
        ratio_row(
            f"run_chains checkpoint, {options} / write floor ({chains} x {STEPS})",
            times[options],
            times["floor"],
            1.3,
            f"floor: {trace_mib:.0f} MiB device to host, written, fsynced, in {where}; "
            f"the plain run {times['plain'] * 1e3:.1f} ms, so the checkpoint adds "
            f"{added * 1e3:.1f} ms ({added / times['floor']:.2f} of the floor)",
        )


SECTIONS = {"trace": trace_rows, "options": options_rows, "disk": disk_rows}


def main() -> None:
    """Every section, or those named on the command line."""
    environment_row()
    for name in sys.argv[1:] or SECTIONS:
        SECTIONS[name]()


if __name__ == "__main__":
    main()
