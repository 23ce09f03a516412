"""Comparisons, error checks and run fixtures shared by the tests."""

import contextlib
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from chains_workloads import metropolis

import eqx_batch as eb


def _raw(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_trees_identical(a: Any, b: Any) -> None:
    """Same treedef, leaf types, dtypes, shapes, weak types and bits.

    Bits, so NaN payloads and -0.0 count.
    """
    leaves_a, treedef_a = jtu.tree_flatten_with_path(a)
    leaves_b, treedef_b = jtu.tree_flatten_with_path(b)
    assert treedef_a == treedef_b, f"{treedef_a} != {treedef_b}"
    for (path, x), (_, y) in zip(leaves_a, leaves_b, strict=True):
        where = jtu.keystr(path)
        assert type(x) is type(y), f"{where}: {type(x)} != {type(y)}"
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            assert x.dtype == y.dtype, f"{where}: {x.dtype} != {y.dtype}"
            assert x.shape == y.shape, f"{where}: {x.shape} != {y.shape}"
            if isinstance(x, jax.Array):
                # Typed PRNG key arrays have no `weak_type`; they are never weak.
                weak_x = getattr(x, "weak_type", False)
                weak_y = getattr(y, "weak_type", False)
                assert weak_x == weak_y, f"{where}: weak_type differs"
            raw_x, raw_y = _raw(x), _raw(y)
            assert raw_x.tobytes() == raw_y.tobytes(), f"{where}: bits differ"
        else:
            assert x == y, f"{where}: {x!r} != {y!r}"


def tree_allclose(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Same structure and all array leaves allclose; other leaves equal."""
    if jtu.tree_structure(a) != jtu.tree_structure(b):
        return False
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True):
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            if np.shape(x) != np.shape(y) or not np.allclose(
                _raw(x), _raw(y), rtol=rtol, atol=atol, equal_nan=True
            ):
                return False
        elif x != y:
            return False
    return True


def assert_members_identical(a: list, b: list) -> None:
    """Two lists of members, each pair identical as by `assert_trees_identical`."""
    assert type(a) is list and type(b) is list
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert_trees_identical(x, y)


def raises(match: str, fn: Callable[[], Any], *names: str) -> str:
    """The message of the `BatchError` (a `ValueError`) that `fn()` raises, which
    matches `match` and holds every one of `names`."""
    with pytest.raises(eb.BatchError, match=match) as info:
        fn()
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    assert isinstance(info.value, ValueError)
    return message


def mixed_tree(key):
    """A tree with a leaf of every kind a file stores: arrays of many dtypes, typed
    keys of two implementations, weak arrays, NumPy arrays and Python scalars."""
    model_key, chain_key = jr.split(key)
    return {
        "model": eqx.nn.MLP(2, 1, 4, 2, key=model_key),
        "keys": jr.split(chain_key, 3),
        "rbg_key": jr.key(1, impl="rbg"),
        "half": jnp.arange(3, dtype=jnp.bfloat16),
        "fp8": np.linspace(-1, 1, 4).astype(jnp.float8_e4m3fn),
        "int4": jnp.arange(-2, 3, dtype=jnp.int4),
        "complex": jnp.asarray([1 + 2j, -0.5j], dtype=jnp.complex64),
        "host": np.arange(6, dtype=np.int64).reshape(2, 3),
        "host_scalar": np.float32(-0.0),
        "empty": jnp.zeros((0, 3)),
        "weak": jnp.asarray(0.5),
        "weak_vector": jnp.full((3,), 2),
        "flags": jnp.array([True, False]),
        "settings": [1.5, 3, True, "adam", 1 - 2j],
    }


# One entry per step of `counted_metropolis` that ran: a test clears it, runs, and
# counts, to see whether a checkpoint was read back or recomputed.
STEPS_RUN: list[int] = []


def counted_metropolis(state: dict, key: jax.Array) -> dict:
    """`metropolis`, telling the host each time it runs (to see what was recomputed)."""
    jax.debug.callback(lambda: STEPS_RUN.append(1))
    return metropolis(state, key)


@contextlib.contextmanager
def mounted(folder: pathlib.Path, *options: str) -> Any:
    """`folder` with a filesystem mounted on it (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    result = subprocess.run(["mount", *options, str(folder)], capture_output=True)
    if result.returncode:
        pytest.skip(f"cannot mount here: {result.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@contextlib.contextmanager
def made_read_only(folder: pathlib.Path) -> Any:
    """`folder` made read-only for real: permission bits, or a read-only bind mount
    as root (whom permission bits do not stop)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    with mounted(folder, "--bind", str(folder)):
        subprocess.run(
            ["mount", "-o", "remount,bind,ro", str(folder)], check=True, timeout=30
        )
        yield folder


def checkpoint_progress(path: pathlib.Path) -> dict | None:
    """The progress of the checkpoint at `path`, read with safetensors alone: the
    newest step whose state files (`<name>.<run id>.state-S.rows-A-B`) hold every
    chain, with the draw files they list (`[name, A, B, X, Y]` each, once, in order);
    None before any step is complete."""
    # A live run removes the state files of older steps as it goes.
    while True:
        with contextlib.suppress(FileNotFoundError):
            return _checkpoint_progress(path)


def _checkpoint_progress(path: pathlib.Path) -> dict | None:
    import json
    import re

    import safetensors

    pattern = re.compile(
        rf"{re.escape(path.name)}\.[0-9a-f]{{16}}\.state-(\d+)\.rows-(\d+)-(\d+)"
    )
    by_step: dict[int, dict[tuple[int, int], pathlib.Path]] = {}
    for file in path.parent.iterdir():
        if match := pattern.fullmatch(file.name):
            step, first, stop = map(int, match.groups())
            by_step.setdefault(step, {})[first, stop] = file
    num_chains = max((b for rows in by_step.values() for _, b in rows), default=0)
    for step in sorted(by_step, reverse=True):
        tiles, row = [], 0
        while row < num_chains:
            # Several layouts may have written a step: the widest file first.
            files = [(b, f) for (a, b), f in by_step[step].items() if a == row]
            if not files:
                break
            row, file = max(files)
            tiles.append(file)
        if row != num_chains:
            continue
        draws: dict[str, list] = {}
        progress: dict = {}
        for tile in tiles:
            with safetensors.safe_open(tile, "np") as opened:
                progress = json.loads(opened.metadata()["run_chains.progress"])
            draws.update((entry[0], entry) for entry in progress["draws"])
        progress["draws"] = sorted(draws.values(), key=lambda e: (e[3], e[1]))
        return progress
    return None


def checkpoint_steps_done(path: pathlib.Path) -> int:
    """The steps of the checkpoint at `path`'s newest complete step; 0 before one."""
    progress = checkpoint_progress(path)
    return 0 if progress is None else progress["steps_done"]


def compilations(run: Callable[[], Any]) -> int:
    """How many programs XLA compiles while `run()` runs."""
    seen = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        run()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(seen)


def kill_once_checkpointed(
    worker_args: list[str], checkpoint: Any, out: Any, env: Any = None
) -> None:
    """Starts `python *worker_args` (a worker that writes `out` when its run ends),
    SIGKILLs it as soon as `checkpoint` exists, and checks that it had not ended."""
    worker = subprocess.Popen([sys.executable, *worker_args], env=env)
    try:
        while not pathlib.Path(checkpoint).exists():
            assert worker.poll() is None, "the worker exited before its checkpoint"
            time.sleep(0.001)
    finally:
        worker.kill()
        worker.wait()
    assert not pathlib.Path(out).exists(), "the run ended before the kill"
