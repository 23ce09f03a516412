"""The processes of a job agree on the call of `eb.run_chains` before any step: one
that passes another argument stops every process with the same `BatchError`, naming
the argument, where gloo aborted, the job hung or JAX named no argument.

Every job is real: 2 processes of 2 CPU devices on loopback (`multiprocess_launch`),
ended by PID if they outlive the timeout.
"""

import pathlib
import time

import pytest
from multiprocess_launch import Job, launch


WORKER = pathlib.Path(__file__).with_name("agreement_worker.py")
TIMEOUT = 240  # each process compiles for a while on a busy machine
FIX = "Nothing was run: every process must pass the same arguments"


def _errors(
    argument: str, tmp_path: pathlib.Path, checkpoint: bool = False
) -> list[str]:
    """What each process of a job whose process 1 changes `argument` raised."""
    out = tmp_path / "job"
    args = [str(out), argument]
    if checkpoint:
        args.append(str(tmp_path / "run.ckpt"))
    launch(WORKER, args, timeout=TIMEOUT)
    errors = []
    for process_id in range(2):
        error = pathlib.Path(f"{out}.{process_id}.error")
        assert error.exists(), f"process {process_id} ran without an error"
        errors.append(error.read_text())
    return errors


def _agreed_error(
    argument: str, tmp_path: pathlib.Path, checkpoint: bool = False
) -> str:
    """The one error of every process of such a job: each knows what every other
    has."""
    errors = _errors(argument, tmp_path, checkpoint)
    assert errors[0] == errors[1]
    assert errors[0].startswith(
        "the 2 processes called `run_chains` with other arguments:\n"
    )
    assert FIX in errors[0]
    return errors[0]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["memory", "checkpoint"])
def test_another_num_steps_in_one_process_is_refused_by_every_process(
    tmp_path, checkpoint
):
    # Each process ran its own count, or gloo aborted both (SIGABRT); with a
    # checkpoint, both hung.
    error = _agreed_error("num_steps", tmp_path, checkpoint)
    assert (
        "- `num_steps` differs between the processes of the job: process 0 has 40, "
        "process 1 has 20\n"
    ) in error
    # Refused before the checkpoint's folder was touched.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.0.error", "job.1.error"]


@pytest.mark.parametrize(
    ("argument", "named"),
    [
        ("init", "`init` holds other values"),
        ("key", "`key` gives the chains other keys"),
        ("data", "`data` holds other values"),
        ("data_dtype", "`data` holds other values"),
    ],
)
def test_other_values_in_one_process_are_refused_by_every_process(
    tmp_path, argument, named
):
    # JAX's raw `AssertionError` from `device_put`, naming no argument.
    error = _agreed_error(argument, tmp_path)
    assert f"- {named} in process 1 than in process 0\n" in error


def test_other_values_given_to_the_step_are_refused_without_a_checkpoint(tmp_path):
    # Process 1's `functools.partial` gives the step another number (issue 43, AG28):
    # each process ran its own program, and the job returned chains of both. The step
    # is traced (its program compared) only with a checkpoint: its values are
    # compared in every job.
    error = _agreed_error("step", tmp_path)
    assert (
        "- `step` carries other values in process 1 than in process 0 (arrays or "
        "numbers given through `functools.partial` or held as a Module's fields, or "
        "another function)\n"
    ) in error
    assert error.count("\n- ") == 1, error  # nothing else differs


def test_another_checkpoint_path_in_one_process_is_refused_by_every_process(tmp_path):
    # Another file in the same folder (issue 43, AG23, AG24): it was refused as a
    # folder that is not shared, and process 0's lock file was left behind. Both paths
    # are named, and nothing is written or locked.
    error = _agreed_error("checkpoint", tmp_path, checkpoint=True)
    assert (
        "- `checkpoint` (its absolute path) differs between the processes of the job: "
        f"process 0 has {tmp_path / 'run.ckpt'}, process 1 has "
        f"{tmp_path / 'other.ckpt'}\n"
    ) in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.0.error", "job.1.error"]


@pytest.mark.parametrize(
    ("argument", "values"),
    [
        ("chunk_size", "process 0 has 8, process 1 has 4"),
        ("trace", "process 0 has True, process 1 has False"),
        ("progress", "process 0 has False, process 1 has True"),
    ],
)
def test_other_options_in_one_process_are_refused_by_every_process(
    tmp_path, argument, values
):
    # Each process ran its own run into the one checkpoint, or (a bar in one process
    # only) the job hung.
    error = _agreed_error(argument, tmp_path, checkpoint=True)
    assert f"- `{argument}`" in error
    assert f"differs between the processes of the job: {values}\n" in error


def test_arguments_refused_in_one_process_stop_every_process(tmp_path):
    # Process 1's 9 chains are refused by its checks: it raises its own error, and
    # process 0, which would have waited for it, names it.
    own = "`data` holds 2 problems, which do not divide the 9 chains: pass 2 * M."
    other, refused = _errors("refused", tmp_path)
    assert refused.startswith(own)
    assert other.startswith(
        "Checking `run_chains`' arguments failed in process 1 of this job of 2:\n"
        f"- process 1: {own}"
    )
    assert FIX in other


def _unanswered_error(argument: str, tmp_path: pathlib.Path) -> tuple[str, Job]:
    """What process 0 of a job whose process 1 never calls `run_chains` raised, and
    the job (still running: its processes may still be shutting down)."""
    out = tmp_path / "job"
    job = Job.start(WORKER, [str(out), argument], timeout=TIMEOUT)
    error = pathlib.Path(f"{out}.0.error")
    deadline = time.monotonic() + TIMEOUT
    while not error.exists() and time.monotonic() < deadline:
        assert job.processes[0].poll() is None, job.finished()[0].output[-4000:]
        time.sleep(0.1)
    assert error.exists(), "process 0 raised nothing"
    return error.read_text(), job


UNANSWERED = (
    "Process 0 of this job of 2 waited at `run_chains`' first collective, where the "
    "processes agree on the call, and process 1 did not answer (JAX: "
)


def test_a_process_that_raised_before_run_chains_is_named(tmp_path):
    # JAX's raw DEADLINE_EXCEEDED of gloo after 30 s, naming no process.
    error, job = _unanswered_error("raised", tmp_path)
    with job:
        assert error.startswith(UNANSWERED)
        assert "DEADLINE_EXCEEDED" in error
        assert "Check the log of process 1: a process that raised or exited" in error
        # Process 1 waited for process 0 in the shutdown barrier: both end.
        finished = [process.wait(TIMEOUT) for process in job.processes]
        output = job.finished()[1].output
        assert finished == [0, 1], output[-4000:]
        assert "process 1 failed before calling run_chains" in output


def test_a_process_killed_before_run_chains_is_named(tmp_path):
    # Process 0 then waits at its exit for the dead process until JAX's heartbeat
    # timeout, and JAX aborts it (no public API of JAX lets a library leave its
    # shutdown barrier): only the message is checked here.
    error, job = _unanswered_error("killed", tmp_path)
    with job:
        assert error.startswith(UNANSWERED)
        assert "or was killed, never answers" in error
