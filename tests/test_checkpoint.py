"""Checkpoints of `eb.run_chains`: resume bit for bit, real kills, chunks, processes."""

import functools as ft
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from chains_workloads import (
    make_init,
    metropolis,
    mlp_step,
    outputs,
    run as run_workload,
)
from helpers import (
    assert_trees_identical,
    checkpoint_progress,
    checkpoint_steps_done,
    compilations,
    counted_metropolis,
    made_read_only,
    mounted,
    STEPS_RUN,
)
from multiprocess_launch import launch

import eqx_batch as eb


TESTS = pathlib.Path(__file__).parent
RUN_WORKER = TESTS / "run_worker.py"


def _progress(path: pathlib.Path) -> dict:
    progress = checkpoint_progress(path)
    assert progress is not None, f"no complete step at {path}"
    return progress


_steps_done = checkpoint_steps_done


@pytest.mark.accelerator
def test_checkpointed_run_equals_plain_run(tmp_path):
    init = make_init(5)
    plain = eb.run_chains(metropolis, init, jr.key(0), 20, thin=3, burn_in=4)
    path = tmp_path / "run.ckpt"
    saved = eb.run_chains(
        metropolis,
        init,
        jr.key(0),
        20,
        thin=3,
        burn_in=4,
        checkpoint=path,
        checkpoint_every=7,
    )
    assert_trees_identical(outputs(saved), outputs(plain))
    assert path.exists()
    assert not list(tmp_path.glob(".*.tmp"))
    # Every file is a safetensors file that safetensors alone reads.
    draws = safetensors.numpy.load_file(tmp_path / _progress(path)["draws"][0][0])
    assert sorted(draws) == ["['layer1']['weights']", "['layer2']['weights']"]


@pytest.mark.accelerator
def test_finished_checkpoint_is_read_back_without_recomputing(tmp_path):
    init = make_init(6)
    path = tmp_path / "run.ckpt"
    first = eb.run_chains(counted_metropolis, init, jr.key(0), 20, checkpoint=path)
    STEPS_RUN.clear()
    again = eb.run_chains(counted_metropolis, init, jr.key(0), 20, checkpoint=path)
    assert not STEPS_RUN
    assert_trees_identical(outputs(again), outputs(first))
    assert_trees_identical(again.nonfinite.chains, first.nonfinite.chains)


def test_draw_files_of_a_thinned_run_read_back_exactly(tmp_path):
    # Segments of 7 steps against thin=3 and burn_in=4: each segment's draws start
    # and stop at other offsets, and their counts differ.
    init = make_init(5)
    path = tmp_path / "run.ckpt"
    run = ft.partial(
        eb.run_chains, thin=3, burn_in=4, checkpoint=path, checkpoint_every=7
    )
    first = run(counted_metropolis, init, jr.key(0), 40)
    bounds = [[0, 1], [1, 4], [4, 6], [6, 8], [8, 11], [11, 12]]
    assert [entry[3:] for entry in _progress(path)["draws"]] == bounds
    STEPS_RUN.clear()
    again = run(counted_metropolis, init, jr.key(0), 40)
    assert not STEPS_RUN
    assert_trees_identical(outputs(again), outputs(first))


def _moved(state: dict, key: jax.Array) -> tuple:
    """`metropolis`, with whether the step moved the chain as its output."""
    new = counted_metropolis(state, key)
    moved = jnp.any(new["layer1"]["weights"] != state["layer1"]["weights"])
    return new, {"moved": moved}


def test_states_and_outputs_checkpoint_and_read_back(tmp_path):
    init = make_init(5)
    path = tmp_path / "run.ckpt"
    run = ft.partial(eb.run_chains, thin=3, burn_in=4, with_output=True)
    plain = run(_moved, init, jr.key(0), 20)
    saved = run(_moved, init, jr.key(0), 20, checkpoint=path, checkpoint_every=7)
    assert_trees_identical(saved.outputs, plain.outputs)
    assert_trees_identical(outputs(saved), outputs(plain))
    # Each draw file holds the states and the outputs of its draws.
    draws = safetensors.numpy.load_file(tmp_path / _progress(path)["draws"][0][0])
    assert sorted(draws) == [
        "[0]['layer1']['weights']",
        "[0]['layer2']['weights']",
        "[1]['moved']",
    ]
    STEPS_RUN.clear()
    again = run(_moved, init, jr.key(0), 20, checkpoint=path, checkpoint_every=7)
    assert not STEPS_RUN
    assert_trees_identical(again.outputs, plain.outputs)
    assert_trees_identical(outputs(again), outputs(plain))


def test_reading_back_compiles_the_same_whatever_the_number_of_draw_files(tmp_path):
    init = make_init(5)
    few, many = tmp_path / "few.ckpt", tmp_path / "many.ckpt"
    eb.run_chains(metropolis, init, jr.key(0), 40, checkpoint=few, checkpoint_every=20)
    eb.run_chains(metropolis, init, jr.key(0), 48, checkpoint=many, checkpoint_every=4)
    assert len(_progress(few)["draws"]) == 2
    assert len(_progress(many)["draws"]) == 12
    read_few = compilations(
        lambda: eb.run_chains(metropolis, init, jr.key(0), 40, checkpoint=few)
    )
    read_many = compilations(
        lambda: eb.run_chains(metropolis, init, jr.key(0), 48, checkpoint=many)
    )
    assert read_many == read_few <= 4


def test_progress_bar_across_checkpoint_segments(tmp_path, capsys):
    init = make_init(4)
    plain = eb.run_chains(metropolis, init, jr.key(0), 50)
    path = tmp_path / "run.ckpt"
    shown = eb.run_chains(
        metropolis,
        init,
        jr.key(0),
        50,
        progress=True,
        checkpoint=path,
        checkpoint_every=15,
    )
    assert_trees_identical(outputs(shown), outputs(plain))
    assert "50/50" in capsys.readouterr().err


def _start_worker(out: pathlib.Path, *args: Any, workload: str = "metropolis"):
    return subprocess.Popen(
        [sys.executable, str(RUN_WORKER), str(out), workload] + [str(a) for a in args]
    )


def _wait_for(condition: Any, worker: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 180
    while not condition():
        assert worker.poll() is None, f"the worker exited before {what}"
        assert time.monotonic() < deadline, f"no {what} in 180 s"
        time.sleep(0.0005)


def _kill(worker: subprocess.Popen) -> None:
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()


def test_kills_at_random_moments_all_resume_bit_for_bit(tmp_path):
    # Fault injection: a worker process running a checkpointed run is SIGKILLed by
    # its pid at random moments, during a segment and during a write, and restarted
    # each time; every restart resumes where the last checkpoint left off.
    run = ("metropolis", 64, 20_000)
    path, out = tmp_path / "run.ckpt", tmp_path / "out.eqx"
    args = (*run[1:], path, 100, 10)
    rng = random.Random(0)
    steps_seen = []
    kills_during_writes = 0
    for attempt in range(8):
        if attempt >= 4 and kills_during_writes:
            break
        worker = _start_worker(out, *args)
        try:
            _wait_for(path.exists, worker, "checkpoint")
            before = _steps_done(path)
            if attempt % 2 == 0:
                # During a segment: a random moment after the run has resumed.
                _wait_for(
                    lambda done=before: _steps_done(path) > done, worker, "resuming"
                )
                time.sleep(rng.uniform(0.0, 0.3))
                _kill(worker)
            else:
                # During a write: as soon as a new temporary file appears (those of
                # earlier kills stay behind).
                stale = set(tmp_path.glob(".*.tmp"))

                def writing(stale: set = stale) -> bool:
                    return bool(set(tmp_path.glob(".*.tmp")) - stale)

                _wait_for(writing, worker, "write in progress")
                _kill(worker)
                kills_during_writes += writing()
        finally:
            if worker.poll() is None:
                _kill(worker)
        assert worker.returncode == -signal.SIGKILL, "the run ended before the kill"
        steps_seen.append(_steps_done(path))
        assert not out.exists()
    assert kills_during_writes, "no kill landed while a file was being written"
    assert 0 < steps_seen[0] and steps_seen == sorted(steps_seen)
    assert steps_seen[-1] < run[2], "the kills did not land mid-run"

    resumed = run_workload(*run, checkpoint=path, checkpoint_every=100, thin=10)
    plain = run_workload(*run, thin=10)
    assert_trees_identical(outputs(resumed), outputs(plain))
    assert _steps_done(path) == run[2]
    # The resume removed the temporary files that the kills left behind.
    assert not list(tmp_path.glob(".*.tmp"))


def test_typed_keys_in_the_state_checkpoint_and_resume(tmp_path):
    # A state that carries its own typed keys: killed mid-run in another process, then
    # resumed here, bit for bit; a second identical call reads the result back.
    path, out = tmp_path / "run.ckpt", tmp_path / "out.eqx"
    worker = _start_worker(out, 8, 4000, path, 20, workload="keys")
    try:
        _wait_for(lambda: path.exists() and _steps_done(path) >= 200, worker, "steps")
        _kill(worker)
    finally:
        if worker.poll() is None:
            _kill(worker)
    assert 0 < _steps_done(path) < 4000
    resumed = run_workload("keys", 8, 4000, checkpoint=path, checkpoint_every=20)
    assert resumed.trace["k"].dtype == jr.key(0).dtype
    plain = run_workload("keys", 8, 4000)
    assert_trees_identical(outputs(resumed), outputs(plain))
    assert_trees_identical(resumed.final, plain.final)
    again = run_workload("keys", 8, 4000, checkpoint=path, checkpoint_every=20)
    assert_trees_identical(again.final, plain.final)


def test_a_live_run_locks_its_checkpoint(tmp_path):
    # Another process holds the checkpoint: refused at once, naming the path. Once
    # that process is killed (SIGKILL), the lock is gone and the run resumes.
    path, out = tmp_path / "run.ckpt", tmp_path / "out.eqx"
    worker = _start_worker(out, 16, 20_000, path, 100, 100)
    try:
        _wait_for(path.exists, worker, "checkpoint")
        init = make_init(16)
        started = time.monotonic()
        with pytest.raises(eb.BatchError, match="in use") as info:
            eb.run_chains(metropolis, init, jr.key(0), 20_000, checkpoint=path)
        assert str(path) in str(info.value)
        assert f"process {worker.pid}" in str(info.value)
        assert time.monotonic() - started < 30
    finally:
        _kill(worker)
    resumed = run_workload("metropolis", 16, 20_000, path, 100, thin=100)
    assert resumed.trace["layer1"]["weights"].shape == (16, 200, 3, 3)


def test_mlp_run_resumes_in_another_process(tmp_path):
    # The run's identity (an MLP holds functions; the step's program names them) is
    # the same in a new process: its finished checkpoint is read back, not refused.
    path, out = tmp_path / "run.ckpt", tmp_path / "out.eqx"
    subprocess.run(
        [sys.executable, str(RUN_WORKER), str(out), "mlp", "3", "30"]
        + [str(path), "10"],
        check=True,
        timeout=300,
    )
    STEPS_RUN.clear()
    here = run_workload("mlp", 3, 30, checkpoint=path, checkpoint_every=10)
    there = eb.load(out, outputs(here))
    assert_trees_identical(outputs(here), there)


def test_runs_never_share_draw_files(tmp_path):
    # Two runs at one path differ only by their key: their draw files have other
    # names, and a draw file of one put in place of the other's is refused.
    init = make_init(2)
    first, second = tmp_path / "a" / "run.ckpt", tmp_path / "b" / "run.ckpt"
    first.parent.mkdir()
    second.parent.mkdir()
    run = ft.partial(eb.run_chains, metropolis, init, num_steps=10, checkpoint_every=5)
    run(key=jr.key(0), checkpoint=first)
    run(key=jr.key(1), checkpoint=second)
    names_a = {p.name for p in first.parent.iterdir()}
    names_b = {p.name for p in second.parent.iterdir()}
    assert names_a & names_b == {"run.ckpt", "run.ckpt.lock"}
    ours = first.with_name(_progress(first)["draws"][1][0])
    theirs = second.with_name(_progress(second)["draws"][1][0])
    shutil.copy(theirs, ours)
    with pytest.raises(eb.BatchError, match="written by a different run") as info:
        run(key=jr.key(0), checkpoint=first)
    assert str(ours) in str(info.value)
    assert "keys" in str(info.value)


def test_checkpoint_of_another_run_is_refused(tmp_path):
    path = tmp_path / "run.ckpt"
    eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    with pytest.raises(eb.BatchError, match="num_steps: the checkpoint has 5, this"):
        eb.run_chains(metropolis, make_init(2), jr.key(0), 6, checkpoint=path)
    with pytest.raises(eb.BatchError, match="init values"):
        eb.run_chains(metropolis, _shifted(2), jr.key(0), 5, checkpoint=path)
    with pytest.raises(eb.BatchError, match="init leaves"):
        eb.run_chains(metropolis, make_init(3), jr.key(0), 5, checkpoint=path)
    with pytest.raises(eb.BatchError, match="keys"):
        eb.run_chains(metropolis, make_init(2), jr.key(1), 5, checkpoint=path)
    # A step is what it computes: another name for the same computation resumes.
    same = eb.run_chains(_other_step, make_init(2), jr.key(0), 5, checkpoint=path)
    assert same.final["layer1"]["weights"].shape == (2, 3, 3)


@pytest.mark.parametrize(
    "written, resumed, expected",
    [
        (False, "disk", 'written with `trace=False`, this call has `trace="disk"`'),
        (False, True, "written with `trace=False`, this call has `trace=True`"),
        (
            "disk",
            False,
            'written with `trace=True` (or `trace="disk"`), this call has '
            "`trace=False`",
        ),
    ],
)
def test_another_trace_mode_on_resume_is_named_as_written(
    tmp_path, written, resumed, expected
):
    path = tmp_path / "run.ckpt"
    run = ft.partial(eb.run_chains, metropolis, make_init(2), jr.key(0), 5)
    run(trace=written, checkpoint=path)
    with pytest.raises(eb.BatchError, match="different run") as info:
        run(trace=resumed, checkpoint=path)
    assert f"trace: the checkpoint was {expected}" in str(info.value)


def test_a_checkpoint_of_the_earlier_layout_is_refused(tmp_path):
    # Earlier eqx_batch kept every chain at the path, with its progress there: the
    # same run's checkpoint in that layout is refused, naming both layouts, and no
    # file is touched.
    from eqx_batch._files._file_format import read_metadata
    from eqx_batch._files._serialise import write_tree

    path = tmp_path / "run.ckpt"
    eb.run_chains(metropolis, make_init(2), jr.key(0), 10, checkpoint=path)
    progress = checkpoint_progress(path)
    assert progress is not None
    [state] = tmp_path.glob("run.ckpt.*.state-10.rows-0-2")
    like = {
        "states": make_init(2),
        "keys": np.zeros((2, 2), np.uint32),
        "first_bad": np.zeros(2, np.int32),
    }
    old = {"steps_done": 10, "draws": [[e[0], *e[3:]] for e in progress["draws"]]}
    metadata = read_metadata(path) | {"run_chains.progress": json.dumps(old)}
    write_tree(path, eb.load(state, like), metadata=metadata)
    for file in tmp_path.glob("run.ckpt.*"):
        file.unlink()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(eb.BatchError) as info:
        eb.run_chains(metropolis, make_init(2), jr.key(0), 10, checkpoint=path)
    message = str(info.value)
    assert "written by an earlier eqx_batch" in message
    assert "finish it with that one" in message
    assert "docs/chains.md#checkpoint-and-resume" in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_step_that_computes_something_else_is_refused(tmp_path):
    init = jnp.zeros((3, 2))

    def scaled(state: jax.Array, key: jax.Array, scale: Any) -> jax.Array:
        return state + scale * jr.normal(key, state.shape)

    cases = [
        (lambda s, k: s + 1.0, lambda s, k: s - 1.0, "step program"),
        (ft.partial(scaled, scale=0.1), ft.partial(scaled, scale=100.0), "program"),
        (
            ft.partial(scaled, scale=jnp.full(2, 0.1)),
            ft.partial(scaled, scale=jnp.full(2, 100.0)),
            "step constants",
        ),
    ]
    for i, (before, after, what) in enumerate(cases):
        path = tmp_path / f"run{i}.ckpt"
        eb.run_chains(before, init, jr.key(0), 5, checkpoint=path)
        with pytest.raises(eb.BatchError, match=f"different run.*\n.*{what}"):
            eb.run_chains(after, init, jr.key(0), 5, checkpoint=path)


def test_a_state_holding_another_function_is_refused(tmp_path, getkey):
    def make(activation: Any) -> eqx.nn.MLP:
        keys = jr.split(jr.key(0), 2)
        return eqx.filter_vmap(
            lambda k: eqx.nn.MLP(2, 2, 4, 1, activation=activation, key=k)
        )(keys)

    path = tmp_path / "run.ckpt"
    eb.run_chains(mlp_step, make(jax.nn.relu), jr.key(0), 3, checkpoint=path)
    with pytest.raises(eb.BatchError, match="different run") as info:
        eb.run_chains(mlp_step, make(jax.nn.relu6), jr.key(0), 3, checkpoint=path)
    assert "relu6" in str(info.value)
    assert "step program" in str(info.value)


def test_files_that_are_not_this_checkpoint_are_named_for_what_they_are(tmp_path):
    init = make_init(2)
    path = tmp_path / "run.ckpt"
    run = ft.partial(eb.run_chains, metropolis, init, jr.key(0), 5, checkpoint=path)
    path.write_bytes(b"hello, this is not a checkpoint at all")
    with pytest.raises(eb.BatchError, match="not an eqx_batch checkpoint") as info:
        run()
    assert "earlier checkpoint" not in str(info.value)
    assert path.read_bytes() == b"hello, this is not a checkpoint at all"
    eb.save(path, {"weights": jnp.zeros(3)})
    with pytest.raises(eb.BatchError, match="not a `run_chains` checkpoint"):
        run()
    path.unlink()
    run()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # a bit of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(eb.BatchError, match="corrupt") as info:
        run()
    assert "earlier checkpoint" not in str(info.value)


@pytest.mark.parametrize("every", [None, 5])
def test_a_checkpoint_that_cannot_be_written_is_found_before_any_work(tmp_path, every):
    init = make_init(2)
    (tmp_path / "a_file").write_text("")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    cases = [
        (tmp_path / "missing" / "run.ckpt", "missing does not exist"),
        (tmp_path / "a_file" / "run.ckpt", "a_file is a file, not a folder"),
        (tmp_path, "is a folder"),
        (read_only / "run.ckpt", "Read-only file system|Permission denied"),
    ]
    with made_read_only(read_only):
        for path, match in cases:
            STEPS_RUN.clear()
            with pytest.raises(eb.BatchError, match=match) as info:
                eb.run_chains(
                    counted_metropolis,
                    init,
                    jr.key(0),
                    20,
                    checkpoint=path,
                    checkpoint_every=every,
                )
            assert str(path) in str(info.value)
            assert not STEPS_RUN, "steps ran before the error"


def test_a_full_disk_keeps_the_last_good_checkpoint(tmp_path):
    # A small tmpfs fills up mid-run: the error names the checkpoint, the last good
    # checkpoint stays whole, and once there is room the run resumes bit for bit.
    folder = tmp_path / "small"
    folder.mkdir()
    init = make_init(8)
    plain = eb.run_chains(metropolis, init, jr.key(0), 200)
    path = folder / "run.ckpt"
    run = ft.partial(
        eb.run_chains,
        metropolis,
        init,
        jr.key(0),
        200,
        checkpoint=path,
        checkpoint_every=20,
    )
    with mounted(folder, "-t", "tmpfs", "-o", "size=64k", "tmpfs"):
        with pytest.raises(eb.BatchError, match="No space left") as info:
            run()
        message = str(info.value)
        assert f"`checkpoint` ({path})" in message
        kept = _steps_done(path)
        assert 0 < kept < 200
        assert f"the checkpoint of step {kept} is kept" in message
        subprocess.run(
            ["mount", "-o", "remount,size=4m", str(folder)], check=True, timeout=30
        )
        resumed = run()
        assert_trees_identical(outputs(resumed), outputs(plain))


def _other_step(state: dict, key: jax.Array) -> dict:
    return metropolis(state, key)


def _shifted(num_chains: int) -> dict:
    return jtu.tree_map(lambda x: x + 1.0, make_init(num_chains))


_CHUNKED_WORKER = """
import sys
import jax.random as jr
import eqx_batch as eb
from chains_workloads import make_init, metropolis
path, out = sys.argv[1:]
result = eb.run_chains(metropolis, make_init(12), jr.key(0), 4000, thin=10,
    checkpoint=path, checkpoint_every=20, chunk_size=5)
eb.save(out, {"final": result.final})
"""


def _chunked_run(path: pathlib.Path | None) -> eb.Chains:
    every = None if path is None else 20
    return eb.run_chains(
        metropolis,
        make_init(12),
        jr.key(0),
        4000,
        thin=10,
        checkpoint=path,
        checkpoint_every=every,
        chunk_size=5,
    )


def test_chunked_run_killed_mid_chunk_resumes_bit_for_bit(tmp_path):
    # 12 chains in chunks of 5 (the last one padded): SIGKILLed in its second chunk,
    # then resumed here. The first chunk is read back, the second resumes from its
    # checkpoint, the third runs: all equal to an uninterrupted run.
    path, out = tmp_path / "run.ckpt", tmp_path / "out.eqx"
    first, second = tmp_path / "run.ckpt.chains-0-5", tmp_path / "run.ckpt.chains-5-10"
    worker = subprocess.Popen(
        [sys.executable, "-c", _CHUNKED_WORKER, str(path), str(out)],
        cwd=TESTS,
    )
    try:
        _wait_for(
            lambda: second.exists() and _steps_done(second) >= 200, worker, "chunk 2"
        )
        # The job holds the lock of the user's path, whichever chunk it runs.
        with pytest.raises(eb.BatchError, match="in use"):
            _chunked_run(path)
        _kill(worker)
    finally:
        if worker.poll() is None:
            _kill(worker)
    assert worker.returncode == -signal.SIGKILL
    assert _steps_done(first) == 4000
    assert 0 < _steps_done(second) < 4000
    assert not out.exists()

    resumed = _chunked_run(path)
    plain = eb.run_chains(metropolis, make_init(12), jr.key(0), 4000, thin=10)
    assert_trees_identical(outputs(resumed), outputs(plain))
    assert _steps_done(tmp_path / "run.ckpt.chains-10-12") == 4000
    assert not list(tmp_path.glob(".*.tmp"))

    # Finished: read back whole, nothing rewritten.
    def written() -> dict:
        files = tmp_path.glob("run.ckpt.chains-*")
        return {p.name: p.stat().st_mtime_ns for p in files}

    before = written()
    again = _chunked_run(path)
    assert_trees_identical(outputs(again), outputs(plain))
    assert written() == before


def test_chunk_size_of_all_chains_is_the_unchunked_run(tmp_path):
    # Same files, same checkpoint: one call's checkpoint is read back by the other.
    init = make_init(6)
    path = tmp_path / "run.ckpt"
    STEPS_RUN.clear()
    first = eb.run_chains(
        counted_metropolis, init, jr.key(0), 20, checkpoint=path, chunk_size=6
    )
    assert list(tmp_path.glob("*.chains-*")) == []
    ran = len(STEPS_RUN)
    again = eb.run_chains(counted_metropolis, init, jr.key(0), 20, checkpoint=path)
    assert len(STEPS_RUN) == ran
    assert_trees_identical(outputs(again), outputs(first))


_CHUNKED_JOB = """
import sys
sys.path.insert(0, {tests!r})
from multiprocess_launch import initialize
process_id, _ = initialize()
import jax
import jax.random as jr
import eqx_batch as eb
from chains_workloads import make_init, metropolis, outputs
out, path = sys.argv[1:]
result = eb.run_chains(metropolis, make_init(7), jr.key(0), 40, thin=3,
    checkpoint=path, checkpoint_every=15, chunk_size=3)
eb.save(f"{{out}}.{{process_id}}", outputs(result.gathered()))
jax.distributed.shutdown()
"""


def test_chunked_run_in_two_processes(tmp_path):
    # 7 chains in chunks of 3, each chunk spread over the 4 devices of both processes
    # (padded to 4), checkpointed by process 0: every process gathers whole results,
    # bit for bit those of one unchunked process, and the checkpoint reads back.
    script = tmp_path / "job.py"
    script.write_text(_CHUNKED_JOB.format(tests=str(TESTS)))
    out, path = tmp_path / "job.eqx", tmp_path / "run.ckpt"
    launch(script, [str(out), str(path)], devices_per_process=2)
    plain = outputs(eb.run_chains(metropolis, make_init(7), jr.key(0), 40, thin=3))
    for process_id in range(2):
        assert_trees_identical(eb.load(f"{out}.{process_id}", plain), plain)
    assert _steps_done(tmp_path / "run.ckpt.chains-6-7") == 40
    again = eb.run_chains(
        metropolis,
        make_init(7),
        jr.key(0),
        40,
        thin=3,
        checkpoint=path,
        checkpoint_every=15,
        chunk_size=3,
    )
    assert_trees_identical(outputs(again), plain)


def test_the_draw_listing_names_every_draw_of_the_newest_step(tmp_path):
    # What a reader of the trace on disk gets: the files of the newest complete step,
    # in order of draws, each with its chains and draws.
    from eqx_batch._chains._checkpoints._checkpoint import Checkpoint
    from eqx_batch._chains._jobs._identity import RunIdentity
    from eqx_batch._files._file_format import read_metadata

    path = tmp_path / "run.ckpt"
    result = eb.run_chains(
        metropolis, make_init(4), jr.key(0), 30, checkpoint=path, checkpoint_every=10
    )
    identity = RunIdentity(json.loads(read_metadata(path)["run_chains.run"]))
    listing = Checkpoint(path, identity, 4, None).draw_listing()  # type: ignore[arg-type]
    assert [(entry.rows, entry.draws) for entry in listing] == [
        ((0, 4), (0, 10)),
        ((0, 4), (10, 20)),
        ((0, 4), (20, 30)),
    ]
    like = jtu.tree_map(lambda x: x[:, :10], outputs(result)["trace"])
    assert_trees_identical(
        eb.load(listing[1].path, like),
        jtu.tree_map(lambda x: x[:, 10:20], outputs(result)["trace"]),
    )
