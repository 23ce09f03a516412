"""`eb.filter_pmap`, `eb.shard` and `eb.run_chains` in a job of 2 processes with 2 CPU
devices each.

The job's results must equal, bit for bit, the same computation in this (single)
process over its 4 forced devices: the partitioned program is the same, only the
devices live in different processes.
"""

import json
import os
import pathlib
import time

import numpy as np
import pytest
from chains_workloads import everything, outputs, run as run_chains_workload
from held_worker import held_runs
from helpers import assert_trees_identical, checkpoint_progress, checkpoint_steps_done
from multiprocess_launch import Job, launch
from multiprocess_worker import computation

import eqx_batch as eb


WORKER = pathlib.Path(__file__).parent / "multiprocess_worker.py"
JOB_RUN_WORKER = pathlib.Path(__file__).parent / "job_run_worker.py"
HELD_WORKER = pathlib.Path(__file__).parent / "held_worker.py"


def test_two_processes_match_one_process_bit_for_bit(tmp_path):
    launch(WORKER, [str(tmp_path)], num_processes=2, devices_per_process=2)
    expected = computation()
    assert int(expected["device_count"]) == 4
    assert int(expected["num_partitions"]) == 4
    # Padding members stayed out of the collectives: 1 + ... + 6 and 1 + ... + 4.
    assert (expected["out_count"] == 21).all()
    assert (expected["four_count"] == 10).all()
    for process_id in range(2):
        with np.load(tmp_path / f"process{process_id}.npz") as saved:
            got = dict(saved)
        assert sorted(got) == sorted(expected)
        # Every process sees the global job's devices and gets whole results.
        assert int(got["device_count"]) == 4
        assert int(got["num_partitions"]) == 4
        assert got["fully_addressable"].all()
        for name, value in expected.items():
            assert got[name].dtype == value.dtype, name
            assert got[name].shape == value.shape, name
            assert got[name].tobytes() == value.tobytes(), f"{name} differs"


FAILING = """
import os, pathlib, sys, time
process_id = int(os.environ["EQX_BATCH_PROCESS_ID"])
pathlib.Path(sys.argv[1], f"pid{process_id}").write_text(str(os.getpid()))
if process_id == 0 and sys.argv[2] == "fail":
    # Fail only once process 1 is up, so that it is left waiting.
    while not pathlib.Path(sys.argv[1], "pid1").exists():
        time.sleep(0.01)
    print("process 0 gives up")
    sys.exit(3)
time.sleep(600)
"""


def _assert_gone(pid_file: pathlib.Path) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_launch_reaps_every_process(tmp_path, mode):
    script = tmp_path / "script.py"
    script.write_text(FAILING)
    expected = "failed" if mode == "fail" else "timed out"
    with pytest.raises(AssertionError, match=expected) as info:
        launch(script, [str(tmp_path), mode], timeout=5.0)
    if mode == "fail":
        assert "process 0 gives up" in str(info.value)
        assert "exit code 3" in str(info.value)
    # The one left waiting (or both, on timeout) was killed and waited for.
    for process_id in range(2):
        _assert_gone(tmp_path / f"pid{process_id}")


def _progress(path: pathlib.Path) -> dict:
    progress = checkpoint_progress(path)
    assert progress is not None, f"no complete step at {path}"
    return progress


_steps_done = checkpoint_steps_done


def test_two_processes_checkpoint_are_killed_and_resume(tmp_path):
    # A job of 2 processes runs checkpointed chains (process 0 writes) and is
    # SIGKILLed mid-run; a new job resumes from the checkpoint, and what each of its
    # processes gets equals this one process's uninterrupted run, bit for bit.
    num_chains, num_steps, every, thin = 16, 10_000, 200, 10
    path, out = tmp_path / "run.ckpt", tmp_path / "job.eqx"
    run = (num_chains, num_steps, path, every, thin)
    args = [str(out), "metropolis", *map(str, run)]
    with Job.start(JOB_RUN_WORKER, args, timeout=480) as job:
        deadline = time.monotonic() + 480
        while not (path.exists() and _steps_done(path) >= 5 * every):
            assert job.running(), job.finished()
            assert time.monotonic() < deadline, "no checkpoint in 480 s"
            time.sleep(0.001)
        job.kill()
    killed_at = _steps_done(path)
    assert 0 < killed_at < num_steps, "the kill did not land mid-run"
    first_draws = path.with_name(_progress(path)["draws"][0][0])
    written = first_draws.stat().st_mtime_ns

    # A generous timeout: each process compiles for a while on a busy machine.
    launch(JOB_RUN_WORKER, args, timeout=480)
    assert _steps_done(path) == num_steps
    # Resumed, not restarted: the draws from before the kill were not written again.
    assert first_draws.stat().st_mtime_ns == written
    here = outputs(run_chains_workload("metropolis", num_chains, num_steps, thin=thin))
    for process_id in range(2):
        assert_trees_identical(eb.load(f"{out}.{process_id}", here), here)


def test_two_processes_each_hold_their_own_chains(tmp_path):
    # In a job, results stay where they were computed: each process holds only its
    # own chains' rows, gathers every chain on asking, and shares the small
    # statistics (NaN report, diagnostics) of every chain.
    out = tmp_path / "held"
    launch(HELD_WORKER, [str(out)], timeout=480)
    here = {name: everything(result) for name, result in held_runs().items()}
    # 6 chains in 2 groups of 3 (padding dropped, one device per process); 8 chains
    # in chunks of 3 joined as 4 blocks of 2 (two devices per process).
    rows = {"padded": [[0, 1, 2], [3, 4, 5]], "chunked": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    total = {"padded": 6, "chunked": 8}
    for process_id in range(2):
        held = json.loads(pathlib.Path(f"{out}.{process_id}.json").read_text())
        for name, expected in here.items():
            for field in ("final", "trace", "keys"):
                layout = held[name][field]
                assert layout["rows"] == rows[name][process_id], (name, field)
                assert 2 * layout["bytes"] == layout["whole_bytes"], (name, field)
                assert not layout["fully_addressable"]
            message = held[name]["to_arviz"]
            assert "`chains.trace['layer1']['weights']`" in message
            # Which rows each process holds, as they are.
            mine, theirs = rows[name][process_id], rows[name][1 - process_id]
            assert (
                f"this process ({process_id}) holds {len(mine)} of its {total[name]} "
                f"rows (rows {mine[0]}-{mine[-1]}; process {1 - process_id} holds "
                f"rows {theirs[0]}-{theirs[-1]})"
            ) in message
            assert "result.gathered().to_arviz()" in message
            gathered = eb.load(f"{out}.{name}.{process_id}", expected)
            assert_trees_identical(gathered, expected)
    # The infinite chain is reported, as in one process (compared above, bit for bit).
    assert here["padded"]["nonfinite"].chains.tolist() == [4]
    assert here["padded"]["nonfinite"].steps.tolist() == [1]
