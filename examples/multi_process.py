"""Many Markov chains run as a job of 2 processes, as on a cluster, on one machine.

The question: my chains (as in `parallel_markov_chains.py`) run on one machine. How
do I run the same code as several JAX processes (one per host on a cluster), and do
I get the same chains?

JAX's multi-process model: every process runs the same program, calls
`jax.distributed.initialize(...)` first, and then sees the devices of ALL processes
(`jax.devices()`), of which it drives its own (`jax.local_devices()`). Every process
passes the same global inputs to `eb.filter_pmap`, which spreads the chains over all
devices of all processes and hands every process the whole result; the processes'
CPUs talk to each other through gloo. Only process 0 prints and saves.

Here the "cluster" is this machine: 2 processes with 2 CPU devices each, talking
over 127.0.0.1. Run without arguments, this script launches them itself, then runs
the same chains in ONE process with 4 devices and checks the results agree (there,
`eb.run_chains` runs them once more, as a cross-check):

    python examples/multi_process.py [--out DIR]

It prints the command to start each process by hand (each in its own terminal, or
on its own host with the coordinator's address). It writes `DIR/multi_process.npz`
(from the 2-process job) and `DIR/single_process.npz` (default `examples/out/`) and
ends with one line `RESULT {...}` in JSON, for scripts and tests to read.
"""

import argparse
import functools as ft
import json
import os
import pathlib
import shlex
import socket
import subprocess
import sys
import tempfile
import time


DEFAULT_OUT = pathlib.Path(__file__).parent / "out"
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
TIMEOUT = 180  # seconds, for the whole job; every process is killed after it
NUM_CHAINS = 8
NUM_STEPS = 2000


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
    parser.add_argument(
        "--single", action="store_true", help="run the job's chains in this one process"
    )
    return parser.parse_args()


# =====================================================================================
# The computation: every process runs this with the same inputs.


def run_the_chains(check_with_run_chains: bool = False) -> dict:
    """Random-walk Metropolis on a small Bayesian network; host arrays by name.

    Each chain is a `lax.scan` over steps; `eb.filter_pmap` runs all chains, spread
    over every device of every process, and hands each process the whole result.
    """
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import numpy as np

    import eqx_batch as eb

    def log_posterior(state: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        hidden = jnp.tanh(x[:, None] * state["layer1"]["weights"])
        prediction = hidden @ state["layer2"]["weights"]
        log_likelihood = -0.5 * jnp.sum((prediction - y) ** 2) / 0.1**2
        log_prior = -0.5 * sum(jnp.sum(w**2) for w in jax.tree.leaves(state))
        return log_likelihood + log_prior

    def metropolis(state: dict, key: jax.Array, x: jax.Array, y: jax.Array):
        """One step of ONE chain: the new state, and whether it moved."""
        noise_key, accept_key = jr.split(key)
        leaves, treedef = jax.tree.flatten(state)
        noise_keys = jr.split(noise_key, len(leaves))
        noise = [jr.normal(k, w.shape) for w, k in zip(leaves, noise_keys, strict=True)]
        proposal = treedef.unflatten(
            [w + 0.02 * n for w, n in zip(leaves, noise, strict=True)]
        )
        log_ratio = log_posterior(proposal, x, y) - log_posterior(state, x, y)
        accept = jnp.log(jr.uniform(accept_key)) < log_ratio
        new = jax.tree.map(lambda p, s: jnp.where(accept, p, s), proposal, state)
        return new, accept.astype(jnp.float32)

    def run_chain(state: dict, key: jax.Array, x: jax.Array, y: jax.Array):
        """ONE chain, all its steps; each step's key is split from the chain's key."""

        def body(carry, _):
            state, key = carry
            key, step_key = jr.split(key)
            state, accepted = metropolis(state, step_key, x, y)
            return (state, key), accepted

        (state, _), accepted = jax.lax.scan(body, (state, key), None, NUM_STEPS)
        return state, jnp.mean(accepted)

    # Global inputs: every process builds exactly the same ones from the same seeds.
    data_key, init_key, chain_key = jr.split(jr.key(0), 3)
    x = jnp.linspace(-1.5, 1.5, 32)
    y = jnp.sin(2 * x) + 0.1 * jr.normal(data_key, x.shape)
    key1, key2 = jr.split(init_key)
    init = {
        "layer1": {"weights": 0.5 * jr.normal(key1, (NUM_CHAINS, 4))},
        "layer2": {"weights": 0.5 * jr.normal(key2, (NUM_CHAINS, 4))},
    }
    chain_keys = jr.split(chain_key, NUM_CHAINS)

    # Chains and their keys are split over the devices; the data is shared (None).
    final, acceptance = eb.filter_pmap(run_chain, in_axes=(0, 0, None, None))(
        init, chain_keys, x, y
    )
    results = {
        "layer1_weights": np.asarray(final["layer1"]["weights"]),
        "layer2_weights": np.asarray(final["layer2"]["weights"]),
        "acceptance": np.asarray(acceptance),
    }
    if check_with_run_chains:
        # `eb.run_chains` splits each step's key from the chain's key the same way,
        # so it must give the same chains.
        step = ft.partial(metropolis, x=x, y=y)
        chains = eb.run_chains(step, init, chain_keys, NUM_STEPS, with_output=True)
        same = all(
            np.allclose(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(
                jax.tree.leaves(chains.final), jax.tree.leaves(final), strict=True
            )
        )
        results["run_chains_agrees"] = np.array(same)
    return results


def checksum(results: dict) -> str:
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(results):
        digest.update(name.encode() + results[name].tobytes())
    return digest.hexdigest()[:16]


def report(results: dict, where: str) -> None:
    print(f"[{where}] chain  acceptance  final layer2 weights")
    for i in range(NUM_CHAINS):
        weights = " ".join(f"{w:+.2f}" for w in results["layer2_weights"][i])
        print(f"[{where}] {i:5d}  {results['acceptance'][i]:10.2f}  {weights}")
    print(f"[{where}] checksum {checksum(results)}")


# =====================================================================================
# One process of the job, and the single-process reference.


def force_cpu_devices(count: int) -> None:
    """Must run before JAX starts: pretend this process has `count` CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(
        [*flags, f"--xla_force_host_platform_device_count={count}"]
    )
    os.environ["JAX_PLATFORMS"] = "cpu"


def run_process(args: argparse.Namespace) -> None:
    force_cpu_devices(args.devices)
    import jax
    import numpy as np

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


def run_single(args: argparse.Namespace) -> None:
    force_cpu_devices(args.devices)
    import jax
    import numpy as np

    print(f"[single] {jax.device_count()} devices in one process", flush=True)
    results = run_the_chains(check_with_run_chains=True)
    agrees = results.pop("run_chains_agrees")
    report(results, "single")
    print(f"[single] eb.run_chains gives the same chains: {bool(agrees)}")
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / "single_process.npz", run_chains_agrees=agrees, **results)


# =====================================================================================
# The launcher: starts the processes, waits with a deadline, always reaps them.


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
    return "\n".join(
        line for line in lines if "Gloo" not in line and "peer" not in line
    )


def launch(args: argparse.Namespace) -> None:
    import numpy as np

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
    job_ok = all(code == 0 for code, _ in job)
    print(f"\nThe job took {time.monotonic() - start:.1f}s. Now the same chains in ONE")
    print(f"process with {NUM_PROCESSES * DEVICES_PER_PROCESS} devices:\n")

    single_command = [
        sys.executable, script, "--single",
        "--devices", str(NUM_PROCESSES * DEVICES_PER_PROCESS), "--out", out,
    ]  # fmt: skip
    [(single_code, single_output)] = run_all([single_command], TIMEOUT)
    print(without_gloo_chatter(single_output))

    match = exact = run_chains_agrees = False
    if job_ok and single_code == 0:
        with np.load(args.out / "multi_process.npz") as f:
            job_results = dict(f)
        with np.load(args.out / "single_process.npz") as f:
            single_results = dict(f)
        run_chains_agrees = bool(single_results.pop("run_chains_agrees"))
        match = sorted(job_results) == sorted(single_results) and all(
            np.allclose(job_results[k], single_results[k], rtol=1e-5, atol=1e-6)
            for k in single_results
        )
        exact = checksum(job_results) == checksum(single_results)
    print(f"\n2-process job and 1-process run agree: {match} (bit for bit: {exact})")
    summary = {
        "process_exit_codes": [code for code, _ in job],
        "single_exit_code": single_code,
        "match": match,
        "bit_for_bit": exact,
        "run_chains_agrees": run_chains_agrees,
        "files": [
            str(args.out / "multi_process.npz"),
            str(args.out / "single_process.npz"),
        ],
    }
    print("RESULT " + json.dumps(summary))
    if not (job_ok and single_code == 0 and match):
        sys.exit(1)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.process_id is not None:
        run_process(arguments)
    elif arguments.single:
        run_single(arguments)
    else:
        launch(arguments)
