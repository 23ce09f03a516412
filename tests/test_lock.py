"""What users and attackers put at a checkpoint's paths, and what `run_chains` does."""

import functools as ft
import json
import os
import pathlib
import re
from typing import Any

import jax.random as jr
import numpy as np
import pytest
from chains_workloads import make_init, metropolis, outputs
from helpers import (
    assert_trees_identical,
    counted_metropolis,
    made_read_only,
    STEPS_RUN,
)

import eqx_batch as eb


def test_a_link_at_the_lock_path_is_neither_followed_nor_written(tmp_path):
    path = tmp_path / "c.eqx"
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    lock = tmp_path / "c.eqx.lock"
    lock.symlink_to(notes)
    with pytest.raises(eb.BatchError, match="symbolic link") as info:
        eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    assert str(lock) in str(info.value)
    assert notes.read_text() == "my notes\n"
    # A dangling link creates nothing where it points.
    lock.unlink()
    elsewhere = tmp_path / "elsewhere"
    lock.symlink_to(elsewhere)
    with pytest.raises(eb.BatchError, match="symbolic link"):
        eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    assert not elsewhere.exists()
    assert not path.exists()


def test_a_fifo_or_a_foreign_file_at_the_lock_path_is_refused(tmp_path):
    path = tmp_path / "c.eqx"
    lock = tmp_path / "c.eqx.lock"
    os.mkfifo(lock)
    with pytest.raises(eb.BatchError, match="FIFO") as info:
        eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    assert str(lock) in str(info.value)
    lock.unlink()
    lock.write_text("not a process id")
    with pytest.raises(eb.BatchError, match="not a lock of eqx_batch"):
        eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    assert lock.read_text() == "not a process id"
    # A hard link to another file is another file's contents too.
    lock.unlink()
    other = tmp_path / "other"
    other.write_text("")
    os.link(other, lock)
    with pytest.raises(eb.BatchError, match="not a lock of eqx_batch"):
        eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)


def test_a_lock_left_by_an_earlier_run_is_taken_again(tmp_path):
    path = tmp_path / "c.eqx"
    first = eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    lock = tmp_path / "c.eqx.lock"
    assert lock.read_text().strip().isdigit()
    for file in tmp_path.iterdir():
        if file != lock:
            file.unlink()
    again = eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    assert_trees_identical(outputs(again), outputs(first))
    assert path.exists()


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_a_name_too_long_for_the_run_s_files_is_refused_before_any_work(
    tmp_path, chunk_size
):
    # The checkpoint's own name fits; the names of its draw files (and their
    # temporary files) would not.
    path = tmp_path / ("c" * 215 + ".eqx")
    STEPS_RUN.clear()
    with pytest.raises(
        eb.BatchError, match="too long a name .*pass a shorter name"
    ) as info:
        eb.run_chains(
            counted_metropolis,
            make_init(3),
            jr.key(0),
            20,
            checkpoint=path,
            checkpoint_every=5,
            chunk_size=chunk_size,
        )
    assert "Free space" not in str(info.value)
    assert not STEPS_RUN, "steps ran before the error"
    assert list(tmp_path.iterdir()) == []
    # The longest name that fits runs to the end and reads back.
    fits = tmp_path / ("c" * 150 + ".eqx")
    result = eb.run_chains(
        metropolis, make_init(3), jr.key(0), 20, checkpoint=fits, chunk_size=chunk_size
    )
    again = eb.run_chains(
        metropolis, make_init(3), jr.key(0), 20, checkpoint=fits, chunk_size=chunk_size
    )
    assert_trees_identical(outputs(again), outputs(result))


def _rewrite_progress(path: pathlib.Path, edit: Any) -> None:
    """Rewrites the state file of a checkpoint's last step with its progress record
    edited, and sound otherwise (as a bug, or someone who knows the format, would
    write it)."""
    from eqx_batch._files._file_format import read_metadata
    from eqx_batch._files._serialise import write_tree

    [path] = path.parent.glob(f"{path.name}.*.state-20.rows-0-3")
    metadata = read_metadata(path)
    like = {
        "states": make_init(3),
        "keys": np.zeros((3, 2), np.uint32),
        "first_bad": np.zeros(3, np.int32),
    }
    state = eb.load(path, like)
    metadata["run_chains.progress"] = edit(metadata["run_chains.progress"])
    write_tree(path, state, metadata=metadata)


@pytest.mark.parametrize(
    "edit, match",
    [
        # Too few draw files: the draws of the last would read back as zeros.
        (
            lambda p: json.dumps(json.loads(p) | {"draws": json.loads(p)["draws"][:1]}),
            r"no draw file for draw 5 of chain 0 \(of 20, step 20\)",
        ),
        (lambda p: p.replace("draws-5-10", "draws-5-9"), "not this run's draw file"),
        (
            lambda p: p.replace(json.loads(p)["draws"][1][0], "../../etc/passwd"),
            "not this run's draw file",
        ),
        (lambda p: p[:-3], "does not parse"),
        (
            lambda p: json.dumps({"steps_done": "20", "rows": [0, 3], "draws": []}),
            "steps were done",
        ),
        (
            lambda p: json.dumps(json.loads(p) | {"rows": [0, 2]}),
            "holds chains",
        ),
        (lambda p: json.dumps(["not", "a", "dict"]), "does not parse"),
    ],
)
def test_a_damaged_progress_record_cannot_be_resumed(tmp_path, edit, match):
    path = tmp_path / "run.ckpt"
    eb.run_chains(
        metropolis, make_init(3), jr.key(0), 20, checkpoint=path, checkpoint_every=5
    )
    _rewrite_progress(path, edit)
    with pytest.raises(eb.BatchError, match="cannot be resumed") as info:
        eb.run_chains(
            metropolis, make_init(3), jr.key(0), 20, checkpoint=path, checkpoint_every=5
        )
    assert re.search(match, str(info.value)), str(info.value)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_a_finished_run_reads_back_from_read_only_storage(tmp_path, chunk_size):
    folder = tmp_path / "archive"
    folder.mkdir()
    path = folder / "run.ckpt"
    run = ft.partial(
        eb.run_chains,
        counted_metropolis,
        make_init(3),
        jr.key(0),
        20,
        checkpoint=path,
        checkpoint_every=5,
        chunk_size=chunk_size,
    )
    first = run()
    (folder / "run.ckpt.lock").unlink()
    STEPS_RUN.clear()
    with made_read_only(folder):
        again = run()
    assert not STEPS_RUN
    assert_trees_identical(outputs(again), outputs(first))


def test_another_chunk_size_warns_of_the_checkpoints_it_does_not_read(tmp_path):
    path = tmp_path / "run.ckpt"
    run = ft.partial(
        eb.run_chains, metropolis, make_init(6), jr.key(0), 20, checkpoint=path
    )
    chunked = run(chunk_size=2)
    with pytest.warns(UserWarning, match=r"written with `chunk_size=2`.*computes"):
        whole = run()
    assert_trees_identical(outputs(whole), outputs(chunked))
    with pytest.warns(UserWarning, match=r"and without `chunk_size`, which this"):
        run(chunk_size=4)
    # Chunks that coincide are read back, without a word (warnings are errors here).
    STEPS_RUN.clear()
    other = ft.partial(
        eb.run_chains,
        counted_metropolis,
        make_init(6),
        jr.key(0),
        20,
        checkpoint=tmp_path / "other.ckpt",
        chunk_size=2,
    )
    first = other()
    ran = len(STEPS_RUN)
    assert_trees_identical(outputs(other()), outputs(first))
    assert len(STEPS_RUN) == ran


def test_a_checkpoint_path_that_is_a_link_is_refused_as_a_link(tmp_path):
    # A link to another run's checkpoint (live or not): its draw files would be looked
    # for beside the link, and the message must not advise deleting that run's files.
    real, link = tmp_path / "real.ckpt", tmp_path / "link.ckpt"
    eb.run_chains(metropolis, make_init(3), jr.key(0), 10, checkpoint=real)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    link.symlink_to(real)
    with pytest.raises(eb.BatchError, match="is a symbolic link") as info:
        eb.run_chains(metropolis, make_init(3), jr.key(0), 10, checkpoint=link)
    assert "Delete" not in str(info.value) and str(real) in str(info.value)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.is_symlink()}
    assert after == before


def test_a_run_that_fails_removes_only_the_lock_file_it_created(tmp_path):
    # A job whose checks fail after process 0 took the lock (issue 43, AG24; the job
    # itself is in test_multiprocess_checkpoint.py) releases it this way.
    from eqx_batch._chains._checkpoints._lock import take_lock

    path, lock = tmp_path / "c.eqx", tmp_path / "c.eqx.lock"
    created = take_lock(path)
    assert created is not None and lock.exists()
    created.release(remove=True)
    assert list(tmp_path.iterdir()) == []
    # An earlier run's lock file is kept, and a later run takes it.
    lock.write_text("12345\n")
    found = take_lock(path)
    assert found is not None
    found.release(remove=True)
    assert lock.exists()
    eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    assert lock.read_text() == f"{os.getpid()}\n"


def test_a_lock_file_removed_before_it_was_locked_is_not_held(tmp_path):
    # A run that opened the lock file just before a failed run removed it, and locks
    # it once that run closed it, holds a lock no other run sees: the next run would
    # create the file anew and lock it too. The window between opening and locking
    # cannot be reached from outside, so the locking is called on such a file.
    from eqx_batch._chains._checkpoints._lock import _locked, take_lock

    path, lock = tmp_path / "c.eqx", tmp_path / "c.eqx.lock"
    failed = take_lock(path)
    assert failed is not None
    opened = os.open(lock, os.O_RDWR)
    try:
        failed.release(remove=True)
        assert not _locked(path, lock, opened)
        # Another file at the path (a new run's): not the one opened either.
        held = take_lock(path)
        assert held is not None
        assert not _locked(path, lock, opened)
        with pytest.raises(eb.BatchError, match="is in use"):
            take_lock(path)
        held.release()
    finally:
        os.close(opened)
