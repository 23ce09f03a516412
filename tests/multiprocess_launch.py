"""Run a script as several local JAX processes, the way `jax.distributed` runs a job.

The launching side is `launch(...)`; the launched script calls `initialize()` first.
Every process gets its own forced CPU devices, CPU collectives go through gloo, and the
coordinator listens on 127.0.0.1. Processes are always reaped: on success, on failure,
on timeout, and if the test itself is interrupted.
"""

import dataclasses
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import jax


# The variables through which `launch` tells each process its place in the job.
COORDINATOR = "EQX_BATCH_COORDINATOR"
NUM_PROCESSES = "EQX_BATCH_NUM_PROCESSES"
PROCESS_ID = "EQX_BATCH_PROCESS_ID"
TIMEOUT = "EQX_BATCH_TIMEOUT"


@dataclasses.dataclass(frozen=True)
class Finished:
    """What one launched process left behind."""

    process_id: int
    returncode: int
    output: str  # stdout and stderr, interleaved


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment(
    process_id: int, num_processes: int, devices: int, port: int, timeout: float
) -> dict[str, str]:
    # Built explicitly: the parent's XLA/JAX settings (e.g. the test suite's 4 forced
    # devices) must not leak into the children.
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("XLA_", "JAX_", "EQX_BATCH_"))
    }
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        **{
            COORDINATOR: f"127.0.0.1:{port}",
            NUM_PROCESSES: str(num_processes),
            PROCESS_ID: str(process_id),
            TIMEOUT: str(int(timeout)),
        },
    )
    return env


class Job:
    """A running job of local JAX processes, started by `Job.start`.

    Use it as a context manager: leaving it kills and waits for any process still
    running, so nothing is left behind even if the test fails.
    """

    def __init__(self, processes: list[subprocess.Popen], logs: list) -> None:
        self.processes = processes
        self._logs = logs

    @classmethod
    def start(
        cls,
        script: str | pathlib.Path,
        args: Sequence[str] = (),
        *,
        num_processes: int = 2,
        devices_per_process: int = 2,
        timeout: float = 180.0,
    ) -> "Job":
        """Starts `python script *args` as `num_processes` processes of one JAX job."""
        port = free_port()
        logs = [tempfile.TemporaryFile(mode="w+") for _ in range(num_processes)]
        job = cls([], logs)
        try:
            for process_id, log in enumerate(logs):
                env = _environment(
                    process_id, num_processes, devices_per_process, port, timeout
                )
                job.processes.append(
                    subprocess.Popen(
                        [sys.executable, str(script), *args],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        except BaseException:
            job.close()
            raise
        return job

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def running(self) -> bool:
        return all(p.poll() is None for p in self.processes)

    def kill(self) -> None:
        """SIGKILLs every process still running and waits for all of them."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()

    def wait(self, timeout: float) -> list[Finished]:
        """Waits for every process, at most `timeout` seconds in total.

        If one fails, the others are killed rather than left waiting in a collective
        for a peer that is gone. Returns each process's `Finished`, in process order;
        raises `AssertionError` with every process's output if any process fails or
        the job times out.
        """
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.poll() is None for p in self.processes):
            if any(p.poll() not in (None, 0) for p in self.processes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        self.kill()
        finished = self.finished()
        if timed_out or any(f.returncode != 0 for f in finished):
            report = "\n".join(
                f"--- process {f.process_id} (exit code {f.returncode}) ---\n"
                f"{f.output[-4000:]}"
                for f in finished
            )
            reason = f"timed out after {timeout}s" if timed_out else "failed"
            raise AssertionError(f"multi-process job {reason}:\n{report}")
        return finished

    def finished(self) -> list[Finished]:
        """What each (ended) process left behind."""
        finished = []
        for process_id, (process, log) in enumerate(
            zip(self.processes, self._logs, strict=True)
        ):
            log.seek(0)
            finished.append(Finished(process_id, process.returncode, log.read()))
        return finished

    def close(self) -> None:
        self.kill()
        for log in self._logs:
            log.close()


def launch(
    script: str | pathlib.Path,
    args: Sequence[str] = (),
    *,
    num_processes: int = 2,
    devices_per_process: int = 2,
    timeout: float = 180.0,
) -> list[Finished]:
    """Runs `python script *args` as `num_processes` processes of one JAX job.

    Waits for all of them, at most `timeout` seconds in total (see `Job.wait`).
    """
    with Job.start(
        script,
        args,
        num_processes=num_processes,
        devices_per_process=devices_per_process,
        timeout=timeout,
    ) as job:
        return job.wait(timeout)


def initialize() -> tuple[int, int]:
    """In a launched process: joins the job. Call before anything else touches JAX.

    Returns `(process_id, num_processes)`.
    """
    process_id = int(os.environ[PROCESS_ID])
    num_processes = int(os.environ[NUM_PROCESSES])
    timeout = int(os.environ[TIMEOUT])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ[COORDINATOR],
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=timeout,
        shutdown_timeout_seconds=timeout,
    )
    return process_id, num_processes
