"""Checkpoints of jobs of several processes: each process writes the rows of its own
chains, and a run resumes, or reads back, on another layout of processes and devices,
bit for bit.

Every job is real: 2 processes of 2 CPU devices on loopback (`multiprocess_launch`);
the single-process runs are this process (4 forced devices) or a subprocess with 2.
Each result is compared with the uninterrupted run in this process, without a
checkpoint.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import jax.random as jr
import numpy as np
import pytest
from chains_workloads import make_init, metropolis, outputs, stopping_run
from checkpoint_worker import metropolis_run
from helpers import assert_trees_identical, checkpoint_progress, checkpoint_steps_done
from multiprocess_launch import Job, launch

import eqx_batch as eb


WORKER = pathlib.Path(__file__).with_name("checkpoint_worker.py")
TIMEOUT = 480  # each process compiles for a while on a busy machine


@pytest.fixture(scope="module")
def plain() -> dict:
    """The metropolis run, uninterrupted, in this process."""
    assert jax.device_count() == 4
    return _saved(metropolis_run())


def _saved(result: eb.Chains) -> dict:
    return {**outputs(result), "steps_done": np.int64(result.steps_done)}


def _loaded(out: pathlib.Path, like: dict, process_id: int | None = None) -> dict:
    return eb.load(out if process_id is None else f"{out}.{process_id}", like)


def _alone(args: list[str], devices: int) -> None:
    """The worker as one process with `devices` CPU devices, to the end."""
    _alone_started(args, devices).wait(timeout=TIMEOUT)


def _alone_started(args: list[str], devices: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
    )
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=env)


def _wait_for_step(path: pathlib.Path, step: int, running: object) -> int:
    deadline = time.monotonic() + TIMEOUT
    while (done := checkpoint_steps_done(path)) < step:
        assert running(), "the run ended before the kill"  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no step {step} in {TIMEOUT} s"
        time.sleep(0.001)
    return done


def test_each_process_writes_its_own_rows_and_fewer_processes_read_them(
    tmp_path, plain
):
    # A job of 2 x 2 devices runs to the end: each process writes about half of the
    # bytes (its own chains' rows), and nothing is gathered to one writer. Read back
    # by 1 process of 4 devices (here) and of 2 (a subprocess): the same bits, and
    # nothing is written again.
    path, out = tmp_path / "run.ckpt", tmp_path / "job.eqx"
    launch(WORKER, ["--job", str(out), "metropolis", str(path)], timeout=TIMEOUT)
    for process_id in range(2):
        assert_trees_identical(_loaded(out, plain, process_id), plain)
    wrote = [int(pathlib.Path(f"{out}.{i}.io").read_text()) for i in range(2)]
    assert min(wrote) > 0.35 * sum(wrote), wrote
    states = sorted(p.name.split(".")[-1] for p in tmp_path.glob("run.ckpt.*.state-*"))
    assert states == ["rows-0-8", "rows-8-16"]
    assert checkpoint_steps_done(path) == 20_000

    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert_trees_identical(_saved(metropolis_run(str(path))), plain)
    alone = tmp_path / "alone.eqx"
    _alone([str(alone), "metropolis", str(path)], devices=2)
    assert_trees_identical(_loaded(alone, plain, 0), plain)
    after = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert {k: v for k, v in after.items() if k in written} == written


def test_a_disk_trace_job_gives_every_process_every_chain_lazily(tmp_path, plain):
    # With `trace="disk"`, each process writes its own chains' draws, and each reads
    # every chain's from the shared folder, lazily: the same bits as in memory.
    path, out = tmp_path / "run.ckpt", tmp_path / "job.eqx"
    launch(WORKER, ["--job", str(out), "disk", str(path)], timeout=TIMEOUT)
    for process_id in range(2):
        assert_trees_identical(_loaded(out, plain, process_id), plain)
    draws = {p.name.split(".")[-2] for p in tmp_path.glob("run.ckpt.*.draws-*")}
    assert draws == {"rows-0-8", "rows-8-16"}
    wrote = [int(pathlib.Path(f"{out}.{i}.io").read_text()) for i in range(2)]
    assert min(wrote) > 0.35 * sum(wrote), wrote


def test_a_killed_run_of_one_process_resumes_as_a_job(tmp_path, plain):
    # 1 process of 4 devices, SIGKILLed mid-run, resumed by a job of 2 x 2: the draw
    # files from before the kill are read (not written again) and listed by the job's
    # state files beside its own.
    path, out = tmp_path / "run.ckpt", tmp_path / "job.eqx"
    worker = _alone_started([str(tmp_path / "alone.eqx"), "metropolis", str(path)], 4)
    try:
        _wait_for_step(path, 2000, lambda: worker.poll() is None)
        worker.send_signal(signal.SIGKILL)
    finally:
        worker.kill()
        worker.wait()
    killed_at = checkpoint_steps_done(path)
    assert 0 < killed_at < 20_000
    progress = checkpoint_progress(path)
    assert progress is not None
    first = path.with_name(progress["draws"][0][0])
    assert ".rows-0-16." in first.name
    written = first.stat().st_mtime_ns

    launch(WORKER, ["--job", str(out), "metropolis", str(path)], timeout=TIMEOUT)
    for process_id in range(2):
        assert_trees_identical(_loaded(out, plain, process_id), plain)
    assert first.stat().st_mtime_ns == written
    listed = [entry[0] for entry in checkpoint_progress(path)["draws"]]  # type: ignore[index]
    assert first.name in listed
    assert any(".rows-8-16." in name for name in listed)


def test_one_process_of_a_job_killed_mid_write_resumes_alone(tmp_path, plain):
    # Process 1 of a 2 x 2 job is SIGKILLed while a file is being written, then the
    # rest of the job; 1 process of 2 devices resumes from the last complete step.
    path = tmp_path / "run.ckpt"
    with Job.start(
        WORKER, ["--job", str(tmp_path / "job.eqx"), "metropolis", str(path)]
    ) as job:
        _wait_for_step(path, 2000, job.running)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # a write in flight, if one is seen
            if list(tmp_path.glob(".run.ckpt.*.tmp")):
                break
        job.processes[1].kill()
        job.processes[1].wait()
        time.sleep(0.2)
        job.kill()
    killed_at = checkpoint_steps_done(path)
    assert 0 < killed_at < 20_000

    alone = tmp_path / "alone.eqx"
    _alone([str(alone), "metropolis", str(path)], devices=2)
    assert_trees_identical(_loaded(alone, plain, 0), plain)
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_stopping_job_resumes_alone_and_stops_at_the_same_step(tmp_path):
    # `until=` in a job of 2 x 2, killed mid-run; resumed here (1 x 4), it stops
    # where the run never killed, in one process, stops, bit for bit.
    path = tmp_path / "run.ckpt"
    with Job.start(
        WORKER, ["--job", str(tmp_path / "job.eqx"), "stopping", str(path)]
    ) as job:
        _wait_for_step(path, 100, job.running)
        job.kill()
    killed_at = checkpoint_steps_done(path)
    resumed, uninterrupted = stopping_run(str(path)), stopping_run()
    assert killed_at < uninterrupted.steps_done < 5000
    assert resumed.steps_done == uninterrupted.steps_done
    assert_trees_identical(outputs(resumed), outputs(uninterrupted))


def test_a_folder_that_one_process_does_not_see_is_refused_by_every_process(
    tmp_path,
):
    # The one path names another folder in process 1 (`/proc/self/cwd`, as node-local
    # storage at one path would): every process raises, and no file is left in either
    # folder, the lock that process 0 took included (issue 43, AG24).
    folder, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    out = tmp_path / "job.eqx"
    args = [str(out), "metropolis", str(folder / "run.ckpt")]
    launch(WORKER, ["--job", *args, "--elsewhere", str(elsewhere)], timeout=TIMEOUT)
    for process_id in range(2):
        error = pathlib.Path(f"{out}.{process_id}.error").read_text()
        assert "docs/multi.md#several-processes" in error
        assert "process 1 of 2 did not find the file" in error
        assert "nothing was written" in error
    assert list(folder.iterdir()) == []
    assert list(elsewhere.iterdir()) == []
    # A later run takes the lock and writes the checkpoint.
    path = folder / "run.ckpt"
    eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    assert (folder / "run.ckpt.lock").read_text() == f"{os.getpid()}\n"
    assert path.exists()


def test_a_write_that_fails_in_one_process_stops_every_process(tmp_path, plain):
    # Process 1 can no longer write its files (`RLIMIT_FSIZE`: EFBIG, as a full disk
    # gives ENOSPC) once step 2000 is checkpointed. Both processes raise; process 0
    # names process 1 and the step kept, which is complete and resumes bit for bit.
    path, out = tmp_path / "run.ckpt", tmp_path / "job.eqx"
    args = [str(out), "metropolis", str(path), "--file-size-limit-after", "2000"]
    launch(WORKER, ["--job", *args], timeout=TIMEOUT)
    own = pathlib.Path(f"{out}.1.error").read_text()
    assert "failed in process 1: File too large" in own
    other = pathlib.Path(f"{out}.0.error").read_text()
    match = re.search(r"checkpoint of step (\d+) is kept", other)
    assert match, other
    assert "failed in process 1 of this job of 2" in other
    kept = int(match[1])
    assert 2000 <= kept < 20_000
    assert checkpoint_steps_done(path) == kept
    assert_trees_identical(_saved(metropolis_run(str(path))), plain)
