"""`eb.filter_pmap` and `eb.shard` in a job of 2 processes with 2 CPU devices each.

The job's results must equal, bit for bit, the same computation in this (single)
process over its 4 forced devices: the partitioned program is the same, only the
devices live in different processes.
"""

import os
import pathlib

import numpy as np
import pytest
from multiprocess_launch import launch
from multiprocess_worker import computation


WORKER = pathlib.Path(__file__).parent / "multiprocess_worker.py"


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
