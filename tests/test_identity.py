"""A run's identity: what must not change between a kill and its resume."""

import functools as ft
import json
from typing import Any

import jax
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from chains_workloads import make_init, metropolis, outputs
from helpers import assert_trees_identical

import eqx_batch as eb


def test_another_prng_configuration_is_refused(tmp_path):
    path = tmp_path / "run.ckpt"
    now = jax.config.values["jax_threefry_partitionable"]
    eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    with jax.threefry_partitionable(not now):
        with pytest.raises(eb.BatchError, match="random bits may differ") as info:
            eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    assert f"threefry_partitionable={now}" in str(info.value)


def test_a_checkpoint_of_another_jax_is_refused():
    from eqx_batch._chains._jobs._identity import RunIdentity, RunOptions

    program = jax.make_jaxpr(metropolis)(make_init(1), jr.key(0))
    options = RunOptions(5, 1, 0, False, True, False, False, None, None)
    keys = jr.split(jr.key(0), 2)
    identity = RunIdentity.of(program, make_init(2), keys, options)
    saved = dict(identity.fields) | {"jax": "0.4.30"}
    (line,) = identity.differences(saved)
    assert line.startswith("jax: the checkpoint was written with 0.4.30")
    assert jax.__version__ in line


@pytest.mark.parametrize("with_output", [False, True])
def test_every_run_records_every_option(tmp_path, with_output):
    # One rule for every run: no field is left out to keep an older identity.
    from eqx_batch._chains._jobs._identity import RunOptions
    from eqx_batch._files._file_format import read_metadata

    path = tmp_path / "run.ckpt"
    step = (lambda s, k: (metropolis(s, k), {"n": 1})) if with_output else metropolis
    eb.run_chains(
        step, make_init(2), jr.key(0), 5, with_output=with_output, checkpoint=path
    )
    fields = json.loads(read_metadata(path)["run_chains.run"])
    recorded = {name: fields[name] for name in RunOptions._fields}
    assert recorded["with_output"] == str(with_output)
    assert recorded["diagnostics"] == recorded["all_chains"] == "False"
    assert recorded["until"] == recorded["superchains"] == "None"


def _callback_step(source: str) -> Any:
    """A step calling `loglik` on the host, `loglik` defined by `source`: the same
    name and the same program, whatever its body."""
    namespace: dict = {"np": np}
    exec(source, namespace)
    loglik = namespace["loglik"]

    def step(state: dict, key: jax.Array) -> dict:
        x = state["layer1"]["weights"]
        shift = jax.pure_callback(
            loglik, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="sequential"
        )
        return jtu.tree_map(lambda w: w + 0.01 * shift, metropolis(state, key))

    return step


def test_an_edited_host_callback_does_not_resume_the_old_run(tmp_path):
    path = tmp_path / "run.ckpt"
    before = _callback_step("def loglik(x):\n    return np.sin(x)\n")
    after = _callback_step("def loglik(x):\n    return np.cos(x)\n")
    eb.run_chains(before, make_init(2), jr.key(0), 5, checkpoint=path)
    with pytest.raises(eb.BatchError, match="host callback of `step` differs"):
        eb.run_chains(after, make_init(2), jr.key(0), 5, checkpoint=path)
    # The same code reads back.
    eb.run_chains(before, make_init(2), jr.key(0), 5, checkpoint=path)


def test_a_host_callback_closing_over_other_data_does_not_resume(tmp_path):
    path = tmp_path / "run.ckpt"

    def step_with(data: np.ndarray) -> Any:
        def loglik(x: np.ndarray) -> np.ndarray:
            return (x * data[0]).astype(x.dtype)

        def step(state: dict, key: jax.Array) -> dict:
            x = state["layer1"]["weights"]
            out = jax.ShapeDtypeStruct(x.shape, x.dtype)
            shift = jax.pure_callback(loglik, out, x, vmap_method="sequential")
            return jtu.tree_map(lambda w: w + 0.01 * shift, metropolis(state, key))

        return step

    eb.run_chains(step_with(np.ones(3)), make_init(2), jr.key(0), 5, checkpoint=path)
    with pytest.raises(eb.BatchError, match="host callback of `step` differs"):
        eb.run_chains(
            step_with(np.full(3, 2.0)), make_init(2), jr.key(0), 5, checkpoint=path
        )


def test_a_host_callback_that_cannot_be_identified_is_refused(tmp_path):
    class Opaque:
        scale = 1.0

    opaque = Opaque()

    def loglik(x: np.ndarray) -> np.ndarray:
        return x * opaque.scale

    def step(state: dict, key: jax.Array) -> dict:
        x = state["layer1"]["weights"]
        shift = jax.pure_callback(
            loglik, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="sequential"
        )
        return jtu.tree_map(lambda w: w + 0.01 * shift, metropolis(state, key))

    with pytest.raises(eb.BatchError, match="cannot be identified") as info:
        eb.run_chains(step, make_init(2), jr.key(0), 5, checkpoint=tmp_path / "c")
    assert "pure_callback" in str(info.value)
    assert not list(tmp_path.iterdir())
    # Without a checkpoint, nothing needs identifying.
    eb.run_chains(step, make_init(2), jr.key(0), 5)


def test_a_host_callback_s_globals_are_not_walked(tmp_path):
    # `settings` has no identity of its own (its repr is its address), but it is a
    # global the callback reads, not a value it closes over: the callback is
    # identified by its own code, so the run is checkpointed, and a new definition of
    # the same code (another `settings` object) reads it back.
    source = (
        "class Settings:\n    scale = 1.0\n\nsettings = Settings()\n\n"
        "def loglik(x):\n    return x * settings.scale\n"
    )
    path = tmp_path / "run.ckpt"
    run = ft.partial(eb.run_chains, init=make_init(2), key=jr.key(0), num_steps=5)
    first = run(_callback_step(source), checkpoint=path)
    again = run(_callback_step(source), checkpoint=path)
    assert_trees_identical(outputs(again), outputs(first))
