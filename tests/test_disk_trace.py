"""`trace="disk"`: the draws streamed to the checkpoint's files, the trace read lazily
from them, bit for bit the in-memory trace, in memory that does not grow with the
steps."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from chains_workloads import key_step, make_init, make_key_init, metropolis
from helpers import assert_trees_identical, checkpoint_steps_done, raises

import eqx_batch as eb
from eqx_batch._chains._checkpoints._disk_trace import disk_trace, DiskArray, ListedFile
from eqx_batch._files._serialise import write_tree


def _read(trace):
    """A lazy trace read whole, keys made keys again as in the in-memory trace."""
    return jtu.tree_map(
        lambda x: jr.wrap_key_data(jnp.asarray(x)) if x.holds_keys else np.asarray(x),
        trace,
    )


def _in_memory(result):
    """An in-memory trace on the host, as `_read` gives a lazy one."""
    return jtu.tree_map(
        lambda x: x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x),
        result,
    )


def _with_output_step(state, key):
    new = key_step(state, key)
    return new, {"moved": jnp.sum(new["x"] - state["x"]), "k": jr.fold_in(new["k"], 1)}


@pytest.mark.parametrize(
    "thin, burn_in, every, chunk_size, with_output",
    [
        (1, 0, None, None, False),
        pytest.param(3, 5, 7, None, True, marks=pytest.mark.accelerator),
        (2, 11, 4, 3, False),
        (4, 0, None, 5, True),
    ],
)
def test_disk_trace_is_the_in_memory_trace_bit_for_bit(
    tmp_path, thin, burn_in, every, chunk_size, with_output
):
    # Typed keys in the state (and the output): their raw data is read lazily.
    step = _with_output_step if with_output else key_step
    arguments = dict(
        thin=thin, burn_in=burn_in, chunk_size=chunk_size, with_output=with_output
    )
    init = make_key_init(7)
    memory = eb.run_chains(step, init, jr.key(0), 41, **arguments)
    disk = eb.run_chains(
        step,
        init,
        jr.key(0),
        41,
        trace="disk",
        checkpoint=tmp_path / "run",
        checkpoint_every=every,
        **arguments,
    )
    assert all(isinstance(x, DiskArray) for x in jtu.tree_leaves(disk.trace))
    assert disk.trace["x"].shape == memory.trace["x"].shape
    assert_trees_identical(_read(disk.trace), _in_memory(memory.trace))
    if with_output:
        assert_trees_identical(_read(disk.outputs), _in_memory(memory.outputs))
    assert_trees_identical(disk.final, memory.final)
    # Slices read only what they ask for, and give what NumPy gives.
    whole = np.asarray(memory.trace["x"])
    for index in [(slice(1, 6, 2), slice(-5, None)), 3, (Ellipsis, 1), (-1, 2)]:
        assert np.array_equal(disk.trace["x"][index], whole[index])


def test_a_finished_run_reads_back_either_way(tmp_path):
    # `"disk"` and `True` record the same draws: one run, read back with either.
    init = make_init(6)
    memory = eb.run_chains(metropolis, init, jr.key(1), 30, checkpoint=tmp_path / "a")
    calls = []

    def counted(state, key):
        calls.append(None)
        return metropolis(state, key)

    back = eb.run_chains(
        counted, init, jr.key(1), 30, trace="disk", checkpoint=tmp_path / "a"
    )
    assert_trees_identical(_read(back.trace), _in_memory(memory.trace))
    disk = eb.run_chains(
        metropolis, init, jr.key(1), 30, trace="disk", checkpoint=tmp_path / "b"
    )
    back = eb.run_chains(metropolis, init, jr.key(1), 30, checkpoint=tmp_path / "b")
    assert_trees_identical(_in_memory(back.trace), _read(disk.trace))


def test_to_arviz_stays_lazy(tmp_path):
    arviz_stats = pytest.importorskip("arviz_stats")
    result = eb.run_chains(
        metropolis,
        make_init(4),
        jr.key(0),
        60,
        trace="disk",
        checkpoint=tmp_path / "r",
        checkpoint_every=20,
    )
    draw_files = sorted(tmp_path.glob("r.*.draws-*"))
    assert len(draw_files) == 3
    moved = draw_files[1].rename(tmp_path / "away")
    # Nothing is read to convert: a missing file is not noticed...
    data = result.to_arviz()
    assert data["posterior"]["layer1.weights"].shape == (4, 60, 3, 3)
    # ...until its draws are asked for.
    raises(
        "is missing",
        lambda: data["posterior"]["layer1.weights"].values,
        str(draw_files[1]),
    )
    moved.rename(draw_files[1])
    memory = eb.run_chains(metropolis, make_init(4), jr.key(0), 60).to_arviz()
    assert arviz_stats.summary(data).equals(arviz_stats.summary(memory))


# ------------------------------------------------------------------------------------
# The lazy trace on files in the checkpoint's new layout: rows and draws of each file.


def _write_layout(folder: pathlib.Path, trace: dict, cuts: list[tuple]) -> list:
    listing = []
    for (a, b), (x, y) in cuts:
        path = folder / f"0.abc.rows-{a}-{b}.draws-{x}-{y}"
        part = {name: v[a:b, x:y] for name, v in trace.items()}
        write_tree(path, part, metadata={"run_chains.run_id": "abc"})
        listing.append(ListedFile(path, (a, b), (x, y), {"run_chains.run_id": "abc"}))
    return listing


def _trace():
    rng = np.random.default_rng(0)
    return {
        "w": rng.normal(size=(6, 10, 2, 3)).astype(np.float32),
        "n": rng.integers(0, 9, size=(6, 10)).astype(np.int32),
        "h": rng.normal(size=(6, 10, 4)).astype(jnp.bfloat16),
    }


_CUTS = [((0, 4), (0, 7)), ((4, 6), (0, 3)), ((4, 6), (3, 7)), ((0, 6), (7, 10))]


def test_files_of_several_row_ranges_read_as_one_trace(tmp_path):
    trace = _trace()
    listing = _write_layout(tmp_path, trace, _CUTS)
    lazy = disk_trace(tmp_path / "0", listing, jax.eval_shape(lambda: trace))
    assert_trees_identical(jtu.tree_map(np.asarray, lazy), trace)
    for index in [(slice(2, 6), slice(1, 9)), (5, 8), (slice(None, None, -1), -3, 1)]:
        assert np.array_equal(lazy["w"][index], trace["w"][index])
    assert lazy["h"].astype(np.float32)[1].dtype == np.float32


@pytest.mark.parametrize("damage", ["missing", "truncated", "another run", "tampered"])
def test_a_damaged_file_is_an_error_when_read_never_numbers(tmp_path, damage):
    trace = _trace()
    listing = _write_layout(tmp_path, trace, _CUTS)
    path = listing[2].path
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        os.truncate(path, path.stat().st_size - 8)
    elif damage == "another run":
        part = jtu.tree_map(lambda v: v[4:6, 3:7], trace)
        write_tree(path, part, metadata={"run_chains.run_id": "xyz"})
    else:
        data = bytearray(path.read_bytes())
        data[-3] ^= 1
        path.write_bytes(bytes(data))
    lazy = disk_trace(tmp_path / "0", listing, jax.eval_shape(lambda: trace))
    # The files not damaged read; any read of the damaged one is refused.
    assert np.array_equal(lazy["w"][:4], trace["w"][:4])
    expected = {
        "missing": "is missing",
        "truncated": "is damaged",
        "another run": "another run",
        "tampered": "CRC-32",
    }[damage]
    raises(
        expected, lambda: np.asarray(lazy["n"]), str(path), "draws 3-7 of chains 4-6"
    )
    raises(expected, lambda: lazy["w"][5, 4], str(path))


def test_a_file_changed_after_its_check_is_checked_again(tmp_path):
    trace = _trace()
    listing = _write_layout(tmp_path, trace, _CUTS)
    lazy = disk_trace(tmp_path / "0", listing, jax.eval_shape(lambda: trace))
    np.asarray(lazy["w"])
    path = listing[0].path
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    raises("CRC-32", lambda: lazy["w"][0], str(path))


def test_a_listing_that_does_not_tile_the_trace_is_refused(tmp_path):
    trace = _trace()
    listing = _write_layout(tmp_path, trace, _CUTS)
    like = jax.eval_shape(lambda: trace)
    raises("miss some of the", lambda: disk_trace(tmp_path / "0", listing[:-1], like))
    # Files that overlap (a run resumed on another layout) hold the same bits: read.
    both = disk_trace(tmp_path / "0", [*listing, listing[0]], like)
    assert_trees_identical(jtu.tree_map(np.asarray, both), trace)


# ------------------------------------------------------------------------------------
# Other processes: a kill and resume; memory in the steps.

_RUN = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp, jax.random as jr
    import eqx_batch as eb
    sys.path.insert(0, {tests!r})
    from chains_workloads import key_step, make_key_init

    eb.run_chains(
        key_step, make_key_init(8), jr.key(2), {steps}, thin=3, trace="disk",
        checkpoint={path!r}, checkpoint_every=20,
    )
    """
)


def _steps_done(path: pathlib.Path) -> int:
    return checkpoint_steps_done(path)


def test_a_killed_disk_run_resumes_to_the_same_trace(tmp_path):
    path = tmp_path / "run"
    script = _RUN.format(
        tests=str(pathlib.Path(__file__).parent), steps=6000, path=str(path)
    )
    worker = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 180
        while _steps_done(path) < 200:
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    assert 0 < _steps_done(path) < 6000
    resumed = eb.run_chains(
        key_step,
        make_key_init(8),
        jr.key(2),
        6000,
        thin=3,
        trace="disk",
        checkpoint=path,
        checkpoint_every=20,
    )
    memory = eb.run_chains(key_step, make_key_init(8), jr.key(2), 6000, thin=3)
    assert_trees_identical(_read(resumed.trace), _in_memory(memory.trace))


# The memory scripts' prelude: this process's peak and resident memory, in KiB
# (writing 5 to `/proc/self/clear_refs` restarts the peak from the resident memory).
_MEMORY_PROBE = textwrap.dedent(
    """
    import sys

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    def rss_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    """
)


_MEMORY = _MEMORY_PROBE + textwrap.dedent(
    """
    import jax.numpy as jnp, jax.random as jr
    import eqx_batch as eb

    def step(x, key):
        return x + jr.normal(key, x.shape)

    init = jnp.zeros((16, 1024))  # 64 KiB a draw
    # The same programs, compiled: a run of segments of the bound.
    eb.run_chains(
        step, init, jr.key(0), 1024, trace="disk", checkpoint=sys.argv[1] + "w"
    )
    before = rss_kib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the resident memory now
    eb.run_chains(
        step, init, jr.key(0), int(sys.argv[2]), trace="disk", checkpoint=sys.argv[1]
    )
    print(peak_kib() - before)
    """
)


def _peak_growth_kib(folder: pathlib.Path, steps: int) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _MEMORY, str(folder / "run"), str(steps)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.split()[-1])


def test_peak_memory_is_a_few_segments_however_many_the_steps(tmp_path):
    # 64 MiB of draws (four segments of the 16 MiB bound), then 512 MiB, which an
    # in-memory trace would hold whole. The disk trace holds a bounded number of
    # segments' draws: one running, one being written, one spare, and the host copy
    # of the one being written. How many of those the allocator has touched by the
    # end of a short run varies, so the bound is on segments, not a ratio of runs:
    # eight, a quarter of the longer run's draws (JAX 0.8 on a loaded 2-core machine
    # touched 6.8 segments' worth once, 5 at most on other runs).
    segment_kib = 16 * 1024
    (tmp_path / "one").mkdir()
    (tmp_path / "eight").mkdir()
    one = _peak_growth_kib(tmp_path / "one", 1024)
    eight = _peak_growth_kib(tmp_path / "eight", 8 * 1024)
    assert one < 8 * segment_kib, one
    assert eight < 8 * segment_kib, (one, eight)


def test_a_run_stopped_by_until_holds_the_draws_made(tmp_path):
    # AR(1) chains that forget their start in tens of steps: stopped before the cap,
    # with a trace of the draws made, as in memory.
    def fast(x, key):
        return 0.9 * x + 0.44 * jr.normal(key, x.shape)

    until = eb.converged(every=2000)
    init = jnp.linspace(-3, 3, 64)
    memory = eb.run_chains(
        fast, init, jr.key(1), 20_000, until=until, chunk_size=48, thin=2
    )
    disk = eb.run_chains(
        fast,
        init,
        jr.key(1),
        20_000,
        until=until,
        chunk_size=48,
        thin=2,
        trace="disk",
        checkpoint=tmp_path / "r",
    )
    assert disk.steps_done == memory.steps_done < 20_000
    assert_trees_identical(_read(disk.trace), _in_memory(memory.trace))


# ------------------------------------------------------------------------------------
# The numbers kept apart from the checkpoint; files moved on disk; another directory.


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_a_saved_disk_trace_holds_its_numbers_without_the_checkpoint(
    tmp_path, chunk_size
):
    disk = eb.run_chains(
        _with_output_step,
        make_key_init(7),
        jr.key(0),
        41,
        trace="disk",
        checkpoint=tmp_path / "run",
        checkpoint_every=10,
        chunk_size=chunk_size,
        with_output=True,
    )
    kept = tmp_path / "kept"
    eb.save(kept, (disk.trace, disk.outputs))
    numbers = jtu.tree_map(np.asarray, (disk.trace, disk.outputs))
    for path in tmp_path.glob("run*"):
        path.unlink()
    back = eb.load(kept, like=(disk.trace, disk.outputs))
    # NumPy arrays of the values, typed keys as their raw data, as the trace reads.
    assert_trees_identical(back, numbers)
    assert kept.stat().st_size > sum(x.nbytes for x in jtu.tree_leaves(numbers))


_SAVE_MEMORY = _MEMORY_PROBE + textwrap.dedent(
    """
    import jax.numpy as jnp, jax.random as jr, numpy as np
    import eqx_batch as eb

    # 16 KiB a draw, 32 MiB a chain: 128 MiB saved in blocks of part of a chain.
    result = eb.run_chains(
        lambda x, key: x + 1.0, jnp.zeros((4, 4096)), jr.key(0), 2048,
        trace="disk", checkpoint=sys.argv[1] + "/run",
    )
    before = rss_kib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the resident memory now
    eb.save(sys.argv[1] + "/kept", result.trace)
    growth = peak_kib() - before
    back = eb.load(sys.argv[1] + "/kept", like=result.trace)
    expected = np.arange(1, 2049, dtype=np.float32)[None, :, None]
    print(growth, type(back).__name__, bool((back == expected).all()))
    """
)


def test_saving_a_disk_trace_larger_than_a_block_reads_it_a_block_at_a_time(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _SAVE_MEMORY, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    growth_kib, kind, equal = done.stdout.split()[-3:]
    assert (kind, equal) == ("ndarray", "True")
    assert (tmp_path / "kept").stat().st_size > 128 << 20
    # Blocks of 16 MiB, each read and copied once or twice: not the 128 MiB trace.
    assert int(growth_kib) < 64 * 1024, growth_kib


def test_saving_a_disk_trace_whose_file_is_gone_keeps_the_file_there(tmp_path):
    result = eb.run_chains(
        metropolis,
        make_init(4),
        jr.key(0),
        60,
        trace="disk",
        checkpoint=tmp_path / "r",
        checkpoint_every=20,
    )
    kept = tmp_path / "kept"
    eb.save(kept, {"earlier": np.arange(3)})
    before = kept.read_bytes()
    gone = sorted(tmp_path.glob("r.*.draws-*"))[1]
    gone.unlink()
    raises("is missing", lambda: eb.save(kept, result.trace), str(gone))
    assert kept.read_bytes() == before
    assert not list(tmp_path.glob(".kept*"))  # nor a temporary file left


def _swap(a: pathlib.Path, b: pathlib.Path) -> None:
    a.rename(a.with_name("swapping"))
    b.rename(a)
    a.with_name("swapping").rename(b)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_two_draw_files_swapped_are_refused_never_read_in_their_order(
    tmp_path, chunk_size
):
    def run(trace):
        return eb.run_chains(
            metropolis,
            make_init(6),
            jr.key(0),
            60,
            trace=trace,
            checkpoint=tmp_path / "r",
            checkpoint_every=20,
            chunk_size=chunk_size,
        )

    result = run("disk")
    # Two files of the same chains, draws 0-20 and 20-40: each sound on its own.
    first, second = sorted(tmp_path.glob("r*.draws-*"))[:2]
    assert first.name.replace("draws-0-20", "draws-20-40") == second.name
    _swap(first, second)
    names = (str(first), "run_chains.draws='20-40'", "'0-20'")
    raises("mixed up", lambda: jtu.tree_map(np.asarray, result.trace), *names)
    # Draws 40 to 60 are in a file of their own: still read.
    assert result.trace["layer1"]["weights"][:, 45].shape == (6, 3, 3)
    again = run("disk")
    raises("mixed up", lambda: np.asarray(again.trace["layer2"]["weights"]), *names)
    raises("mixed up", lambda: run(True))
    raises("mixed up", lambda: eb.save(tmp_path / "kept", result.trace), *names)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_a_disk_trace_on_a_relative_path_reads_from_another_directory(
    tmp_path, monkeypatch, chunk_size
):
    (tmp_path / "run here").mkdir()
    (tmp_path / "read here").mkdir()
    monkeypatch.chdir(tmp_path / "run here")
    arguments = dict(chunk_size=chunk_size)
    result = eb.run_chains(
        metropolis,
        make_init(6),
        jr.key(0),
        60,
        trace="disk",
        checkpoint="run",
        checkpoint_every=20,
        **arguments,
    )
    monkeypatch.chdir(tmp_path / "read here")
    memory = eb.run_chains(metropolis, make_init(6), jr.key(0), 60, **arguments)
    assert_trees_identical(_read(result.trace), _in_memory(memory.trace))
    eb.save("kept", result.trace)
    assert_trees_identical(eb.load("kept", like=result.trace), _read(result.trace))


# ------------------------------------------------------------------------------------
# `eb.save` over the files the trace reads (issue 43, SV06/SV07).


def _run_into(folder: pathlib.Path, chunk_size: int | None = None):
    return eb.run_chains(
        metropolis,
        make_init(4),
        jr.key(0),
        40,
        trace="disk",
        checkpoint=folder / "r",
        checkpoint_every=20,
        chunk_size=chunk_size,
    )


def _contents(folder: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


_OWN_FILES = {
    # The checkpoint's own path (SV06), a draw file (SV07), the other files of the
    # checkpoint: a state file, a chunk's checkpoint and one of its draw files.
    "checkpoint": (None, lambda runs: runs / "r", "the run's checkpoint"),
    "draw file": (
        None,
        lambda runs: sorted(runs.glob("r.*.draws-20-40"))[0],
        "draws 20-40 of chains 0-4",
    ),
    "state file": (None, lambda runs: next(runs.glob("r.*.state-*")), "checkpoint"),
    "chunk checkpoint": (2, lambda runs: runs / "r.chains-2-4", "checkpoint"),
    "chunk draw file": (
        2,
        lambda runs: sorted(runs.glob("r.chains-2-4.*.draws-0-20"))[0],
        "draws 0-20 of chains 2-4",
    ),
}


@pytest.mark.parametrize("which", list(_OWN_FILES))
def test_saving_a_disk_trace_over_its_own_files_is_refused_and_changes_nothing(
    tmp_path, which
):
    chunk_size, pick, lost = _OWN_FILES[which]
    runs = tmp_path / "runs"
    runs.mkdir()
    result = _run_into(runs, chunk_size)
    numbers = _read(result.trace)
    target = pick(runs)
    before = _contents(runs)
    raises(
        "Save to another path",
        lambda: eb.save(target, result.trace),
        "`tree['layer1']['weights']` reads from",
        str(target),
        lost,
    )
    assert _contents(runs) == before  # not a byte, nor a temporary file
    assert_trees_identical(_read(result.trace), numbers)
    again = _run_into(runs, chunk_size)  # the run reads back from its checkpoint
    assert again.steps_done == 40
    assert_trees_identical(_read(again.trace), numbers)
    # The same name in another folder is another file.
    (tmp_path / "kept").mkdir()
    eb.save(tmp_path / "kept" / target.name, result.trace)
    back = eb.load(tmp_path / "kept" / target.name, like=result.trace)
    assert_trees_identical(back, numbers)


@pytest.mark.parametrize("naming", ["relative", "dotted", "linked folder", "link"])
@pytest.mark.parametrize("which", ["checkpoint", "draw file"])
def test_a_path_naming_its_own_file_another_way_is_refused(
    tmp_path, monkeypatch, which, naming
):
    _, pick, lost = _OWN_FILES[which]
    runs = tmp_path / "runs"
    runs.mkdir()
    result = _run_into(runs)
    target = pick(runs)
    monkeypatch.chdir(tmp_path)
    if naming == "relative":
        path = os.path.join("runs", target.name)
    elif naming == "dotted":
        path = str(tmp_path / "runs" / ".." / "runs" / target.name)
    elif naming == "linked folder":
        (tmp_path / "alias").symlink_to(runs, target_is_directory=True)
        path = os.path.join("alias", target.name)
    else:
        (tmp_path / "link").symlink_to(target)
        path = "link"
    before = _contents(runs)
    raises(
        "Save to another path",
        lambda: eb.save(path, result.trace),
        "`tree['layer1']['weights']`",
        str(target),
        f"(`path` {path})",
        lost,
    )
    assert _contents(runs) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["runs", *{"linked folder": ["alias"], "link": ["link"]}.get(naming, [])]
    )
    eb.save("kept", result.trace)
    assert_trees_identical(eb.load("kept", like=result.trace), _read(result.trace))
