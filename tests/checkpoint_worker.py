"""Checkpointed runs of `eb.run_chains` in another process, or in each process of a job.

    python checkpoint_worker.py [--job] OUT WORKLOAD CHECKPOINT [OPTIONS...]

`WORKLOAD` is `metropolis` (`metropolis_run`: 16 chains of
`chains_workloads.metropolis`, 20 000 steps, thin 10, checkpointed every 200), `disk`
(the same with `trace="disk"`) or `stopping` (`chains_workloads.stopping_run`). The
process saves `final`, `trace`, `keys` and `steps_done` (gathered) to
`OUT.<process id>` (`eb.save`), the bytes it wrote during the run (`/proc/self/io`'s
`write_bytes`) to `OUT.<process id>.io`, and, if `run_chains` raises a `BatchError`,
its message to `OUT.<process id>.error` (and exits cleanly: the test reads every
process's error).

Options, each for process 1 of a job only:

- `--elsewhere DIR`: the checkpoint's path names its file in `DIR` in this process
    only, a folder the others do not see (as node-local storage at one path would):
    every process works in the checkpoint's folder (this one in `DIR`) and names the
    checkpoint `/proc/self/cwd/<name>`, the same path in every process.
- `--file-size-limit-after STEP`: once the checkpoint holds step `STEP`, this process
    may write no file larger than 4 KiB (`RLIMIT_FSIZE`): its next checkpoint write
    fails (`EFBIG`), as on a full disk, while the others' succeed.
"""

import os
import pathlib
import resource
import signal
import sys
import threading
import time

import jax
import jax.random as jr
import numpy as np
from chains_workloads import make_init, metropolis, outputs, run, stopping_run
from helpers import checkpoint_steps_done

import eqx_batch as eb


def metropolis_run(checkpoint: str | None = None) -> eb.Chains:
    """Long enough to be killed mid-run, small enough to run in seconds."""
    return run(
        "metropolis",
        16,
        20_000,
        checkpoint,
        None if checkpoint is None else 200,
        thin=10,
    )


def disk_run(checkpoint: str) -> eb.Chains:
    """`metropolis_run` with its trace on disk."""
    return eb.run_chains(
        metropolis,
        make_init(16),
        jr.key(0),
        20_000,
        thin=10,
        checkpoint=checkpoint,
        checkpoint_every=200,
        trace="disk",
    )


WORKLOADS = {"metropolis": metropolis_run, "disk": disk_run, "stopping": stopping_run}


def written_bytes() -> int:
    """The bytes this process has sent to storage so far (files, not sockets)."""
    for line in pathlib.Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no write_bytes in /proc/self/io")


def limit_file_size_after(path: pathlib.Path, step: int) -> None:
    # Writes past the limit fail with EFBIG rather than kill the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def watch() -> None:
        while checkpoint_steps_done(path) < step:
            time.sleep(0.001)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> None:
    job = argv[0] == "--job"
    process_id = 0
    if job:
        from multiprocess_launch import initialize

        process_id, _ = initialize()
        argv = argv[1:]
    out, workload, checkpoint, *options = argv
    if "--elsewhere" in options:
        folder = pathlib.Path(checkpoint).parent
        if process_id == 1:
            folder = pathlib.Path(options[options.index("--elsewhere") + 1])
        os.chdir(folder)
        checkpoint = f"/proc/self/cwd/{pathlib.Path(checkpoint).name}"
    if process_id == 1 and "--file-size-limit-after" in options:
        step = int(options[options.index("--file-size-limit-after") + 1])
        limit_file_size_after(pathlib.Path(checkpoint), step)
    before = written_bytes()
    try:
        result = WORKLOADS[workload](checkpoint)
    except eb.BatchError as e:
        pathlib.Path(f"{out}.{process_id}.error").write_text(str(e))
    else:
        wrote = written_bytes() - before
        # In a job, each process holds its own chains' rows: gathered to be saved.
        # A trace on disk is every chain's, read lazily from the files here.
        whole = outputs(result.gathered())
        whole["trace"] = jax.tree.map(np.asarray, whole["trace"])
        saved = {**whole, "steps_done": np.int64(result.steps_done)}
        eb.save(f"{out}.{process_id}", saved)
        pathlib.Path(f"{out}.{process_id}.io").write_text(str(wrote))
    if job:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
