"""`eb.run_chains` scaled out: a loopback job of 2 processes x 2 CPU devices against one
process, measured in each process (issue 26, "Past one host's memory").

Workload (the issue's): 64 chains of random-walk Metropolis on a standard normal over
256 float32, 6400 steps, every state recorded (a trace of 64 x 6400 x 256 x 4 bytes =
419 MB), checkpointed every 400 steps into a fresh temporary folder. Every variant runs
in its own fresh processes: one process of 2 devices (the baseline), a job of 2
processes of 2 devices each (gloo CPU collectives, coordinator on 127.0.0.1), and one
process of 4 devices (the same devices in one process, for the wall time).

Each process of a variant runs the checkpointed run once to compile it (the same
sizes, in its own fresh folder: a shorter run compiles other programs), then resets
its memory high-water mark and runs it again, measuring around that second run:

- peak RSS over its start: `VmHWM` after the run less `VmRSS` before it, both from
    `/proc/self/status`, the high-water mark reset just before by writing "5" to
    `/proc/self/clear_refs` (Linux). Resident memory of every kind: the heap, the
    devices' buffers (host memory on CPU), and mapped file pages.
- bytes written: the increase of `write_bytes` in `/proc/self/io` (every thread of the
    process): bytes of files the process dirtied, counted when written to the page
    cache, flushed or not. `wchar` (every `write`, to sockets and pipes too, so gloo's
    traffic and the output as well) is given beside it.
- the trace's bytes on its devices: the sum of `nbytes` over the `addressable_shards`
    of every leaf of `Chains.trace`, whether the trace is whole in each process
    (today) or split over the processes.
- the wall time of the run, checkpoints included: the best of it and one more run (in
    another fresh folder); a job's is its slowest process's.

A fourth row runs `trace="disk"` (draws streamed to the checkpoint's files, the trace
read lazily) at 8 times the steps against 1 time (6400 against 800, one process of 2
devices): its memory should not grow with the steps. Until `run_chains` takes that
option, the row is reported not met with `run_chains`'s refusal in its detail.

Usage: `python benchmarks/bench_scale.py` (or `benchmarks/run.py scale`). A process
that fails fails the script, with its output; none is left behind.
"""

import dataclasses
import gc
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import jax.random as jr
from _report import report

import eqx_batch as eb


NUM_CHAINS = 64
STATE_SIZE = 256
NUM_STEPS = 6400
CHECKPOINT_EVERY = 400
DISK_FACTOR = 8
TRACE_MB = NUM_CHAINS * NUM_STEPS * STATE_SIZE * 4 / 1e6
# A variant's processes must all have finished within this; every one takes a few
# seconds to a minute on the 2-core machine.
JOB_TIMEOUT = 240.0

# The variables through which the launcher tells a process its place in the job.
COORDINATOR = "EQX_BATCH_BENCH_COORDINATOR"
NUM_PROCESSES = "EQX_BATCH_BENCH_NUM_PROCESSES"
PROCESS_ID = "EQX_BATCH_BENCH_PROCESS_ID"
LAUNCHER = "EQX_BATCH_BENCH_LAUNCHER"
# The line a process prints its measurements on.
MEASURED = "MEASURED "


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running the workload: its processes, devices and trace."""

    processes: int
    devices_per_process: int
    num_steps: int = NUM_STEPS
    trace: bool | str = True

    def describe(self) -> str:
        trace = "" if self.trace is True else f", trace={self.trace!r}"
        return (
            f"{self.processes} x {self.devices_per_process} devices, "
            f"{self.num_steps} steps{trace}"
        )


# --- In each process of a variant ---------------------------------------------------


def metropolis(state: jax.Array, key: jax.Array) -> jax.Array:
    """One random-walk Metropolis step of one chain on a standard normal."""
    noise_key, accept_key = jr.split(key)
    proposal = state + 0.1 * jr.normal(noise_key, state.shape, state.dtype)
    log_ratio = 0.5 * (jnp.sum(state**2) - jnp.sum(proposal**2))
    accept = jnp.log(jr.uniform(accept_key)) < log_ratio
    return jnp.where(accept, proposal, state)


def proc_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """The named `name: value [kB]` fields of a `/proc` file, in bytes."""
    fields = {}
    for line in pathlib.Path(path).read_text().splitlines():
        name, _, value = line.partition(":")
        if name in names:
            number, *unit = value.split()
            fields[name] = int(number) * (1024 if unit == ["kB"] else 1)
    return fields


def memory() -> dict[str, int]:
    return proc_fields("/proc/self/status", ("VmHWM", "VmRSS"))


def written() -> dict[str, int]:
    return proc_fields("/proc/self/io", ("write_bytes", "wchar"))


def bytes_on_devices(tree: object) -> int:
    """The bytes of `tree`'s arrays held by this process's devices: of its own shards,
    however the arrays are split over processes. Leaves that are not JAX arrays (a
    trace read lazily from files) hold none."""
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
        for shard in leaf.addressable_shards
    )


def leave_with_launcher(deadline: float) -> None:
    """Ends this process once its launcher is gone or the job overruns, so that no
    process outlives the benchmark, even if the launcher itself is killed."""
    # The launcher's pid, not this process's parent now: by the time the imports are
    # done, an orphan's parent is already another process.
    launcher = int(os.environ[LAUNCHER])

    def watch() -> None:
        while os.getppid() == launcher and time.monotonic() < deadline:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def join_job() -> int:
    """Joins the job of several processes, if this is one; returns the process id."""
    num_processes = int(os.environ[NUM_PROCESSES])
    process_id = int(os.environ[PROCESS_ID])
    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=os.environ[COORDINATOR],
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=int(JOB_TIMEOUT),
        )
    return process_id


def measure(variant: Variant, folder: pathlib.Path) -> None:
    """In a launched process: one compiling run, then the measured one; prints the
    measurements as JSON on a line starting with `MEASURED`."""
    leave_with_launcher(time.monotonic() + JOB_TIMEOUT)
    process_id = join_job()
    init = jnp.zeros((NUM_CHAINS, STATE_SIZE), jnp.float32)
    compiled: list[float] = []

    def count_compiles(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event.startswith("/jax/core/compile/"):
            compiled.append(duration_secs)

    def run(name: str) -> eb.Chains:
        return jax.block_until_ready(
            eb.run_chains(
                metropolis,
                init,
                jr.key(0),
                variant.num_steps,
                trace=variant.trace,  # type: ignore[arg-type]  # "disk" is to come
                checkpoint=folder / name / "chains.eqx",
                checkpoint_every=CHECKPOINT_EVERY,
            )
        )

    try:
        run("compile")
    except eb.BatchError as error:
        if variant.trace is True:
            raise
        # The option this variant measures is not there (yet): say so, don't fail.
        print(MEASURED + json.dumps({"refused": str(error)}), flush=True)
        return
    gc.collect()
    jax.monitoring.register_event_duration_secs_listener(count_compiles)
    written_before = written()
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    start = memory()
    started = time.perf_counter()
    result = run("measured")
    seconds = time.perf_counter() - started
    end = memory()
    written_after = written()
    measured = {
        "process": process_id,
        "peak_over_start": end["VmHWM"] - start["VmRSS"],
        "rss_start": start["VmRSS"],
        "write_bytes": written_after["write_bytes"] - written_before["write_bytes"],
        "wchar": written_after["wchar"] - written_before["wchar"],
        "trace_on_devices": bytes_on_devices(result.trace),
        "trace_is_arrays": all(
            isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(result.trace)
        ),
    }
    del result
    gc.collect()
    # Timed once more, in another fresh folder, to take the best of two: one timing
    # on a shared machine is noise as much as measurement.
    started = time.perf_counter()
    run("timed")
    measured["seconds"] = min(seconds, time.perf_counter() - started)
    measured["compile_seconds"] = sum(compiled)
    print(MEASURED + json.dumps(measured), flush=True)
    if jax.process_count() > 1:
        jax.distributed.shutdown()


# --- The launcher --------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(variant: Variant, process_id: int, port: int) -> dict[str, str]:
    # Built explicitly: this process's JAX and XLA settings must not leak into the
    # variant's processes, which get their own device count.
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("XLA_", "JAX_", "EQX_BATCH_"))
    }
    env.update(
        {
            "XLA_FLAGS": "--xla_force_host_platform_device_count="
            f"{variant.devices_per_process}",
            "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",
            COORDINATOR: f"127.0.0.1:{port}",
            NUM_PROCESSES: str(variant.processes),
            PROCESS_ID: str(process_id),
            LAUNCHER: str(os.getpid()),
        }
    )
    return env


def run_variant(variant: Variant) -> list[dict]:
    """Runs `variant` in fresh processes (a job, if several) and returns what each
    measured, in process order.

    Raises `SystemExit`, with every process's output, if one fails, prints no
    measurements or the job overruns `JOB_TIMEOUT`; every process is killed and
    waited for on every path.
    """
    print(f"  {variant.describe()} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_scale") as folder:
        for name in ("compile", "measured", "timed"):
            (pathlib.Path(folder) / name).mkdir()
        port = free_port()
        logs = [tempfile.TemporaryFile("w+") for _ in range(variant.processes)]
        processes: list[subprocess.Popen] = []
        try:
            for process_id, log in enumerate(logs):
                processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "measure",
                            json.dumps(dataclasses.asdict(variant)),
                            folder,
                        ],
                        env=environment(variant, process_id, port),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
            deadline = time.monotonic() + JOB_TIMEOUT
            # A process that failed leaves its peers waiting in a collective: stop
            # at the first failure rather than at the deadline.
            while any(p.poll() is None for p in processes):
                if any(p.poll() not in (None, 0) for p in processes):
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
            for process in processes:
                process.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    measured = [
        json.loads(line[len(MEASURED) :])
        for output in outputs
        for line in output.splitlines()
        if line.startswith(MEASURED)
    ]
    codes = [p.returncode for p in processes]
    if any(codes) or len(measured) != variant.processes:
        for process_id, (code, output) in enumerate(zip(codes, outputs, strict=True)):
            print(
                f"--- process {process_id} (exit code {code}) ---\n{output[-4000:]}",
                file=sys.stderr,
            )
        raise SystemExit(f"bench_scale: {variant.describe()}: exit codes {codes}")
    return measured


# --- The rows ------------------------------------------------------------------------


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def bounded(name: str, ratio: float, bound: float, detail: str) -> None:
    report(name, ratio, f"<= {bound}", ratio <= bound, detail)


def scale_rows() -> None:
    one, two, four = (
        run_variant(Variant(1, 2)),
        run_variant(Variant(2, 2)),
        run_variant(Variant(1, 4)),
    )
    (alone,), (alone_4,) = one, four
    sizes = (
        f"{NUM_CHAINS} chains x {STATE_SIZE} float32 x {NUM_STEPS} steps "
        f"({TRACE_MB:.0f} MB of trace), checkpoint every {CHECKPOINT_EVERY}"
    )
    per_process = ", ".join(mb(p["peak_over_start"]) for p in two)
    busiest = max(p["peak_over_start"] for p in two)
    bounded(
        "rss_2proc_over_1proc: peak RSS over start per process, 2 x 2 / 1 x 2 devices",
        busiest / alone["peak_over_start"],
        0.6,
        f"processes {per_process} vs {mb(alone['peak_over_start'])}; {sizes}",
    )

    wrote = [p["write_bytes"] for p in two]
    by_process = ", ".join(
        f"process {p['process']} {mb(p['write_bytes'])} (wchar {mb(p['wchar'])})"
        for p in two
    )
    name = "busiest_writer_share: bytes written by the busiest process / all, 2 x 2"
    detail = f"{by_process}; 1 process {mb(alone['write_bytes'])}; {sizes}"
    if sum(wrote) == 0:
        # tmpfs counts no write_bytes: nothing measured is not a share of 0.
        report(name, float("nan"), "<= 0.55", False, f"nothing counted: {detail}")
    else:
        bounded(name, max(wrote) / sum(wrote), 0.55, detail)

    held = ", ".join(mb(p["trace_on_devices"]) for p in two)
    report(
        "trace_held_2proc_over_1proc: trace bytes on the process's devices, "
        "2 x 2 / 1 x 2 devices",
        max(p["trace_on_devices"] for p in two) / alone["trace_on_devices"],
        "report",
        True,
        f"processes {held} vs {mb(alone['trace_on_devices'])} (ideal 0.5)",
    )

    slowest = max(p["seconds"] for p in two)
    compiled = [p["compile_seconds"] for p in (*two, alone_4)]
    bounded(
        "wall_2x2_over_1x4: checkpointed run's wall time, 2 x 2 / 1 x 4 devices",
        slowest / alone_4["seconds"],
        1.2,
        f"{slowest:.2f}s vs {alone_4['seconds']:.2f}s (1 x 2 devices "
        f"{alone['seconds']:.2f}s); compiling within the runs: "
        f"{max(compiled):.2f}s at most",
    )


def disk_trace_row() -> None:
    name = "disk_trace_rss_8x_over_1x: trace='disk' peak RSS over start, 8x / 1x steps"
    short = Variant(1, 2, NUM_STEPS // DISK_FACTOR, "disk")
    (one,) = run_variant(short)
    if "refused" in one:
        first_line = one["refused"].splitlines()[0]
        report(name, float("nan"), "<= 1.2", False, f"not run: {first_line}")
        return
    (eight,) = run_variant(dataclasses.replace(short, num_steps=NUM_STEPS))
    ratio = eight["peak_over_start"] / one["peak_over_start"]
    detail = (
        f"{mb(eight['peak_over_start'])} vs {mb(one['peak_over_start'])} "
        f"({NUM_STEPS} vs {short.num_steps} steps of {NUM_CHAINS} x {STATE_SIZE} "
        f"float32, 1 x 2 devices)"
    )
    if eight["trace_is_arrays"]:
        # Accepted but the trace is still whole in memory: not what the row measures.
        detail += f"; the trace came back as arrays ({mb(eight['trace_on_devices'])})"
        report(name, ratio, "<= 1.2", False, detail)
    else:
        bounded(name, ratio, 1.2, detail)


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        measure(Variant(**json.loads(sys.argv[2])), pathlib.Path(sys.argv[3]))
    else:
        scale_rows()
        disk_trace_row()
