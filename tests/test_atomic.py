"""Atomic writes: a file is replaced whole or not at all, whatever happens mid-write."""

import os
import subprocess
import sys
import textwrap

import jax.random as jr
import numpy as np
import pytest
from helpers import assert_trees_identical

import eqx_batch as eb
from eqx_batch._files._atomic import atomic_write
from eqx_batch._files._serialise import write_tree


def test_atomic_write_replaces(tmp_path):
    path = tmp_path / "blob"
    atomic_write(path, lambda file: file.write(b"first"))
    atomic_write(path, lambda file: file.write(b"second"))
    assert path.read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["blob"]


def test_write_tree_uncached_writes_the_same_file(getkey, tmp_path):
    # Dropping the pages from the OS cache after the fsync changes nothing on disk.
    tree = {"w": jr.normal(getkey(), (64, 1024)), "name": "draws"}
    eb.save(tmp_path / "cached.safetensors", tree)
    write_tree(tmp_path / "uncached.safetensors", tree, keep_cached=False)
    cached = (tmp_path / "cached.safetensors").read_bytes()
    assert (tmp_path / "uncached.safetensors").read_bytes() == cached
    assert_trees_identical(eb.load(tmp_path / "uncached.safetensors", like=tree), tree)


def test_atomic_write_uses_the_umask(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    atomic_write(tmp_path / "atomic", lambda file: None)
    mode = (tmp_path / "atomic").stat().st_mode & 0o777
    assert mode == plain.stat().st_mode & 0o777


def test_failed_write_leaves_previous_file_whole(getkey, tmp_path):
    tree = {"w": jr.normal(getkey(), (5,))}
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)

    def write(file):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, write)
    assert_trees_identical(eb.load(path, like=tree), tree)
    assert [p.name for p in tmp_path.iterdir()] == ["tree.safetensors"]


def test_crash_mid_write_leaves_previous_file_whole(getkey, tmp_path):
    tree = {"w": jr.normal(getkey(), (5,)), "key": getkey()}
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    # A real process dies (no cleanup, no exception handling) halfway through a save.
    script = textwrap.dedent(
        f"""
        import os
        from eqx_batch._files._atomic import atomic_write

        def write(file):
            file.write(b"x" * 100_000)
            file.flush()
            os._exit(3)

        atomic_write({str(path)!r}, write)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=os.environ.copy())
    assert proc.returncode == 3
    leftovers = [p for p in tmp_path.iterdir() if p.name != "tree.safetensors"]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size == 100_000
    assert_trees_identical(eb.load(path, like=tree), tree)


def test_concurrent_writers_never_leave_a_torn_file(tmp_path):
    path = tmp_path / "shared.safetensors"
    eb.save(path, {"w": np.zeros(100_000, np.float32)})
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import eqx_batch as eb

        value = float(sys.argv[2])
        for _ in range(40):
            eb.save(sys.argv[1], {"w": np.full(100_000, value, np.float32)})
        """
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", script, str(path), str(value)])
        for value in (1.0, 2.0)
    ]
    like = {"w": np.zeros(100_000, np.float32)}
    seen = set()
    while any(w.poll() is None for w in writers):
        w = eb.load(path, like=like)["w"]
        assert np.all(w == w[0]), "a file mixes two writes"
        seen.add(float(w[0]))
    assert all(w.wait() == 0 for w in writers)
    assert float(eb.load(path, like=like)["w"][0]) in (1.0, 2.0)
    assert seen <= {0.0, 1.0, 2.0}
    assert [p.name for p in tmp_path.iterdir()] == ["shared.safetensors"]


def test_disk_full_keeps_the_previous_file(tmp_path):
    # A real full disk: a 1 MiB tmpfs (needs the privilege to mount one).
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here, so no disk can be filled honestly")
    try:
        path = folder / "tree.safetensors"
        small = {"w": np.arange(1000, dtype=np.float32)}
        eb.save(path, small)
        with pytest.raises(OSError) as info:
            eb.save(path, {"w": np.zeros(1_000_000, np.float32)})
        assert info.value.errno == 28  # ENOSPC
        assert_trees_identical(eb.load(path, like=small), small)
        assert [p.name for p in folder.iterdir()] == ["tree.safetensors"]
    finally:
        subprocess.run(["umount", str(folder)], check=True)
