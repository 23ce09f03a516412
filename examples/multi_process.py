"""Many Markov chains run as a job of 2 processes, as on a cluster, on one machine.

The question: my chains (`parallel_markov_chains.py`) run on one machine. How do I
run the same code as several JAX processes (one per host on a cluster), and do I get
the same chains?

JAX's multi-process model: every process runs the same program, calls
`jax.distributed.initialize(...)` first, and then sees the devices of ALL processes
(`jax.devices()`), of which it drives its own (`jax.local_devices()`). After that,
nothing changes: every process calls `eb.run_chains` with the same step, the same
initial states and the same key, and the chains are spread over every device of every
process. The results stay where they were computed: each process holds only its own
chains' rows (JAX's convention for a compiled program's outputs), so no host holds
more than its share. Where one process needs every chain, every process calls
`result.gathered()` (a collective) and gets them all. The processes' CPUs talk to
each other through gloo. Only process 0 prints and saves.

Here the "cluster" is this machine: 2 processes with 2 CPU devices each, talking
over 127.0.0.1, running the chains of `parallel_markov_chains.py` (its model and
step, imported from it). Run without arguments, this script launches them itself,
then runs the same chains in this one process with 4 devices and checks that both
give the same bits:

    python examples/multi_process.py [--out DIR]

It prints the command to start each process by hand (each in its own terminal, or
on its own host with the coordinator's address). It writes `DIR/multi_process.npz`
(the job's chains; default `examples/out/`) and ends with one line `RESULT {...}` in
JSON, for scripts and tests to read.
"""

import argparse
import functools as ft
import hashlib
import json
import os
import pathlib
import shlex
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np


DEFAULT_OUT = pathlib.Path(__file__).parent / "out"
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
TIMEOUT = 180  # seconds, for the whole job; every process is killed after it


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--process-id", type=int, help="run as this process of the job (0, 1, ...)"
    )
    parser.add_argument("--num-processes", type=int, default=NUM_PROCESSES)
    parser.add_argument(
        "--coordinator", help="host:port of process 0, e.g. 127.0.0.1:1234"
    )
    parser.add_argument("--devices", type=int, default=DEVICES_PER_PROCESS)
    return parser.parse_args()


def force_cpu_devices(count: int) -> None:
    """Must run before JAX starts: pretend this process has `count` CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(
        [*flags, f"--xla_force_host_platform_device_count={count}"]
    )
    os.environ["JAX_PLATFORMS"] = "cpu"


# =====================================================================================
# The computation: every process runs this with the same inputs.


def run_the_chains() -> dict[str, np.ndarray]:
    """The run of `parallel_markov_chains.py`; its results as host arrays by name."""
    # Imported here, after `force_cpu_devices`: the chains example imports JAX.
    import jax
    import jax.random as jr
    from parallel_markov_chains import (
        BURN_IN,
        make_problem,
        metropolis,
        NUM_CHAINS,
        NUM_STEPS,
        THIN,
    )

    import eqx_batch as eb

    # Global inputs: every process builds exactly the same ones from the same seeds.
    (x, y, grid), init, chain_key = make_problem()

    result = eb.run_chains(
        ft.partial(metropolis, x=x, y=y, grid=grid),
        init,
        jr.split(chain_key, NUM_CHAINS),
        NUM_STEPS,
        burn_in=BURN_IN,
        thin=THIN,
        with_output=True,
    )
    if jax.process_count() > 1:
        # In a job, each process holds its own chains' rows of every array...
        rows = sorted(
            {
                row
                for shard in result.keys.addressable_shards
                for row in range(*shard.index[0].indices(NUM_CHAINS))
            }
        )
        print(
            f"[process {jax.process_index()}] holds chains {rows[0]} to {rows[-1]} "
            f"of {NUM_CHAINS}",
            flush=True,
        )
    # ... and gathers all of them here: a collective, which every process calls
    # (in one process, the result itself).
    result = result.gathered()
    # Typed keys cannot go to NumPy; their data can.
    arrays = {
        "final": result.final,
        "outputs": result.outputs,
        "keys": jr.key_data(result.keys),
    }
    leaves = jax.tree_util.tree_flatten_with_path(arrays)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
        for path, leaf in leaves
    }


def checksum(results: dict[str, np.ndarray]) -> str:
    """Equal for equal names, dtypes, shapes and bits."""
    digest = hashlib.sha256()
    for name in sorted(results):
        value = results[name]
        digest.update(f"{name} {value.dtype} {value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()[:16]


def report(results: dict[str, np.ndarray], where: str) -> None:
    acceptance = results["outputs.accepted"].mean(axis=1)
    log_posterior = results["outputs.log_posterior"].mean(axis=1)
    print(f"[{where}] chain  acceptance  mean log posterior")
    for i, (rate, value) in enumerate(zip(acceptance, log_posterior, strict=True)):
        print(f"[{where}] {i:5d}  {rate:10.2f}  {value:18.1f}")
    print(f"[{where}] checksum {checksum(results)}", flush=True)


# =====================================================================================
# One process of the job.


def run_process(args: argparse.Namespace) -> None:
    force_cpu_devices(args.devices)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=TIMEOUT,
        heartbeat_timeout_seconds=TIMEOUT,
        shutdown_timeout_seconds=TIMEOUT,
    )
    where = f"process {jax.process_index()}"
    print(
        f"[{where}] joined: {jax.device_count()} devices in the job, "
        f"{jax.local_device_count()} of them here",
        flush=True,
    )
    results = run_the_chains()
    if jax.process_index() == 0:
        report(results, where)
        args.out.mkdir(parents=True, exist_ok=True)
        np.savez(args.out / "multi_process.npz", **results)
    jax.distributed.shutdown()


# =====================================================================================
# The launcher: starts the processes, waits with a deadline, always reaps them; then
# runs the same chains here, in one process.


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_all(commands: list[list[str]], timeout: float) -> list[tuple[int, str]]:
    """Runs `commands` at once; returns each one's exit code and output.

    If one fails, the others are killed rather than left waiting for a peer that is
    gone; after `timeout` seconds, all are killed. None is left running.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = [tempfile.TemporaryFile(mode="w+") for _ in commands]
    processes: list[subprocess.Popen] = []
    try:
        try:
            for command, log in zip(commands, logs, strict=True):
                process = subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                processes.append(process)
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in processes):
                failed = any(p.poll() not in (None, 0) for p in processes)
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
            for process in processes:
                process.wait()
        outputs = []
        for process, log in zip(processes, logs, strict=True):
            log.seek(0)
            outputs.append((process.returncode, log.read()))
        return outputs
    finally:
        for log in logs:
            log.close()


def without_gloo_chatter(output: str) -> str:
    """The output without gloo's connection messages (which processes interleave)."""
    lines = output.rstrip().splitlines()
    return "\n".join(line for line in lines if not line.startswith("[Gloo]"))


def launch(args: argparse.Namespace) -> None:
    script = str(pathlib.Path(__file__).resolve())
    out = str(args.out.resolve())
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [
        [
            sys.executable, script, "--process-id", str(i),
            "--num-processes", str(NUM_PROCESSES), "--coordinator", coordinator,
            "--devices", str(DEVICES_PER_PROCESS), "--out", out,
        ]
        for i in range(NUM_PROCESSES)
    ]  # fmt: skip
    print(
        f"Starting a job of {NUM_PROCESSES} processes with {DEVICES_PER_PROCESS} CPU "
        "devices each."
    )
    print("To start it by hand instead, run each command in its own terminal:")
    for command in commands:
        print("   " + shlex.join(["python", *command[1:]]))
    print()

    start = time.monotonic()
    job = run_all(commands, TIMEOUT)
    for i, (code, output) in enumerate(job):
        print(f"--- process {i} (exit code {code}) ---")
        print(without_gloo_chatter(output))
    print(f"\nThe job took {time.monotonic() - start:.1f}s.")
    exit_codes = [code for code, _ in job]
    if any(exit_codes):
        print("RESULT " + json.dumps({"process_exit_codes": exit_codes}))
        sys.exit(1)

    force_cpu_devices(NUM_PROCESSES * DEVICES_PER_PROCESS)
    import jax

    print(
        f"Now the same chains in this ONE process, on {jax.device_count()} devices:\n"
    )
    here = run_the_chains()
    report(here, "one process")
    with np.load(args.out / "multi_process.npz") as saved:
        job_results = dict(saved)
    bit_for_bit = checksum(job_results) == checksum(here)
    print(f"\nThe 2-process job and the 1-process run agree bit for bit: {bit_for_bit}")

    summary = {
        "process_exit_codes": exit_codes,
        "bit_for_bit": bit_for_bit,
        "checksum": checksum(job_results),
        "chains": int(job_results["outputs.accepted"].shape[0]),
        "draws": int(job_results["outputs.accepted"].shape[1]),
        "acceptance": job_results["outputs.accepted"].mean(axis=1).tolist(),
        "file": str(args.out / "multi_process.npz"),
    }
    print("RESULT " + json.dumps(summary))
    if not bit_for_bit:
        sys.exit(1)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.process_id is None:
        launch(arguments)
    else:
        run_process(arguments)
