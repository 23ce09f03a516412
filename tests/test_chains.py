"""`eb.run_chains` and `eb.Chains`: per-chain bits, checkpoints, a real kill, errors."""

import functools as ft
import json
import os
import pathlib
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
from chains_worker import make_init, metropolis, outputs
from helpers import assert_trees_identical, tree_allclose
from multiprocess_launch import launch

import eqx_batch as eb


WORKER = pathlib.Path(__file__).with_name("chains_worker.py")


def _alone(result: eb.Chains, i: int) -> dict:
    """Chain `i` of a result, as a one-chain result."""
    return jtu.tree_map(lambda x: x[i : i + 1], outputs(result))


def _state_and_output(state: dict, key: jax.Array) -> tuple:
    new = metropolis(state, key)
    return new, {
        "moved": jnp.any(new["layer1"]["weights"] != state["layer1"]["weights"])
    }


# ------------------------------------------------------------------------------------
# Results.


def test_shapes_and_trace():
    init = make_init(6)
    result = eb.run_chains(metropolis, init, jr.key(0), 20)
    assert isinstance(result, eb.Chains)
    assert result.final["layer1"]["weights"].shape == (6, 3, 3)
    assert result.trace["layer2"]["weights"].shape == (6, 20, 3, 3)
    assert result.keys.shape == (6,)
    assert result.nonfinite.chains.shape == (0,)
    assert result.nonfinite.steps.shape == (0,)
    # The last draw is the final state, and the state moved along the way.
    assert_trees_identical(jtu.tree_map(lambda x: x[:, -1], result.trace), result.final)
    assert not np.array_equal(
        result.trace["layer1"]["weights"][:, 0], init["layer1"]["weights"]
    )


def test_thin_and_burn_in_slice_the_full_trace():
    init = make_init(5)
    full = eb.run_chains(metropolis, init, jr.key(1), 20)
    thinned = eb.run_chains(metropolis, init, jr.key(1), 20, thin=3, burn_in=4)
    assert_trees_identical(
        thinned.trace, jtu.tree_map(lambda x: x[:, 4::3], full.trace)
    )
    assert_trees_identical(thinned.final, full.final)
    assert_trees_identical(thinned.keys, full.keys)


def test_each_chain_equals_running_it_alone():
    # 5 chains over 4 devices: padded internally, which must not change a bit.
    init = make_init(5)
    keys = jr.split(jr.key(2), 5)
    together = eb.run_chains(metropolis, init, keys, 20, thin=3, burn_in=4)
    for i in range(5):
        alone = eb.run_chains(
            metropolis, eb.take(init, [i]), keys[i : i + 1], 20, thin=3, burn_in=4
        )
        assert_trees_identical(outputs(alone), _alone(together, i))


def test_chains_are_spread_over_every_device():
    result = eb.run_chains(metropolis, make_init(8), jr.key(0), 20)
    assert len(result.final["layer1"]["weights"].sharding.device_set) == 4
    assert len(result.trace["layer1"]["weights"].sharding.device_set) == 4


def test_one_device_and_four_devices_give_the_same_bits(tmp_path):
    # The worker runs in a process with a single CPU device; this one has four.
    out = tmp_path / "one_device.eqx"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    subprocess.run(
        [sys.executable, str(WORKER), str(out), "6", "20"],
        env=env,
        check=True,
        timeout=120,
    )
    four = outputs(eb.run_chains(metropolis, make_init(6), jr.key(0), 20))
    one = eb.load(out, four)
    assert_trees_identical(one, four)


def test_two_processes_give_the_same_bits(tmp_path):
    # A job of 2 processes with 2 devices each: the chains are split over all 4
    # devices of both processes, and every process gets whole results.
    out = tmp_path / "job.eqx"
    launch(WORKER, ["--job", str(out), "6", "20"], devices_per_process=2)
    four = outputs(eb.run_chains(metropolis, make_init(6), jr.key(0), 20))
    for process_id in range(2):
        assert_trees_identical(eb.load(f"{out}.{process_id}", four), four)


def test_two_processes_resume_and_checkpoint(tmp_path):
    # A checkpoint stopped at step 10 of 20 (a finished 10-step run with `num_steps`
    # rewritten), made by a zeroing step of the same name so that resuming it shows,
    # is resumed by a job of 2 processes (process 0 writes the later checkpoints) and,
    # from a copy, by this process: the same bits.
    init = make_init(6)
    job_dir, here_dir = tmp_path / "job", tmp_path / "here"
    job_dir.mkdir()
    path = job_dir / "run.ckpt"
    eb.run_chains(_zeros_named_metropolis, init, jr.key(0), 10, checkpoint=path)
    saved = _checkpoint(path, init)
    saved["run"] = saved["run"].replace('"num_steps": 10', '"num_steps": 20')
    eb.save(path, saved)
    shutil.copytree(job_dir, here_dir)

    out = tmp_path / "job.eqx"
    launch(
        WORKER, ["--job", str(out), "6", "20", str(path), "7"], devices_per_process=2
    )
    here = eb.run_chains(
        metropolis, init, jr.key(0), 20, checkpoint=here_dir / "run.ckpt"
    )
    assert not jnp.any(here.trace["layer1"]["weights"][:, :10])
    for process_id in range(2):
        assert_trees_identical(
            eb.load(f"{out}.{process_id}", outputs(here)), outputs(here)
        )
    assert _steps_done(path, init) == 20
    again = eb.run_chains(metropolis, init, jr.key(0), 20, checkpoint=path)
    assert_trees_identical(outputs(again), outputs(here))


def test_matmul_step_is_allclose_to_running_alone():
    # XLA may sum a matmul in another order for another batch size: allclose, not bits.
    weights = jr.normal(jr.key(3), (4, 4)) / 4

    def step(state: jax.Array, key: jax.Array) -> jax.Array:
        return jnp.tanh(state @ weights) + 0.1 * jr.normal(key, state.shape)

    init = jr.normal(jr.key(4), (3, 4))
    keys = jr.split(jr.key(5), 3)
    together = eb.run_chains(step, init, keys, 10)
    alone = eb.run_chains(step, init[1:2], keys[1:2], 10)
    assert tree_allclose(alone.trace, together.trace[1:2])


def test_keys_continue_the_run_exactly():
    init = make_init(6)
    whole = eb.run_chains(metropolis, init, jr.key(6), 20)
    first = eb.run_chains(metropolis, init, jr.key(6), 10)
    second = eb.run_chains(metropolis, first.final, first.keys, 10)
    assert_trees_identical(second.final, whole.final)
    assert_trees_identical(second.keys, whole.keys)
    joined = jtu.tree_map(
        lambda a, b: jnp.concatenate([a, b], axis=1), first.trace, second.trace
    )
    assert_trees_identical(joined, whole.trace)


def test_legacy_and_typed_keys_give_the_same_bits():
    init = make_init(6)
    typed = eb.run_chains(metropolis, init, jr.key(7), 20)
    legacy = eb.run_chains(metropolis, init, jr.PRNGKey(7), 20)
    legacy_each = eb.run_chains(metropolis, init, jr.split(jr.PRNGKey(7), 6), 20)
    assert legacy.keys.dtype == jnp.uint32 and legacy.keys.shape == (6, 2)
    assert_trees_identical(legacy.keys, jr.key_data(typed.keys))
    assert_trees_identical(legacy.trace, typed.trace)
    assert_trees_identical(outputs(legacy_each), outputs(legacy))


def test_with_output_records_outputs():
    result = eb.run_chains(
        _state_and_output, make_init(6), jr.key(8), 20, thin=4, with_output=True
    )
    assert result.trace["moved"].shape == (6, 5)
    assert result.trace["moved"].dtype == jnp.bool_
    plain = eb.run_chains(metropolis, make_init(6), jr.key(8), 20)
    assert_trees_identical(result.final, plain.final)


def test_data_passed_with_partial():
    def step(state: jax.Array, key: jax.Array, *, data: jax.Array) -> jax.Array:
        return state + data + jr.normal(key, state.shape)

    init = jnp.zeros((3, 2))
    data = jnp.array([1.0, -1.0])
    with_partial = eb.run_chains(ft.partial(step, data=data), init, jr.key(0), 5)
    closed = eb.run_chains(lambda s, k: step(s, k, data=data), init, jr.key(0), 5)
    assert_trees_identical(with_partial.trace, closed.trace)
    assert not jnp.array_equal(with_partial.final, init)


def test_no_trace():
    result = eb.run_chains(metropolis, make_init(2), jr.key(0), 5, trace=False)
    assert result.trace is None
    assert result.final["layer1"]["weights"].shape == (2, 3, 3)


def test_nonfinite_chains_are_reported_and_do_not_disturb_the_others():
    def step(state: jax.Array, key: jax.Array) -> jax.Array:
        return state * 10.0 + jr.uniform(key, state.shape)

    # Multiplying by 10 each step overflows float32 (max ~3.4e38) at step 9 from
    # 1e30 and at step 4 from 1e35; from 0 or 1 it stays finite for 25 steps.
    init = jnp.array([[0.0], [1e30], [1.0], [1e35]])
    keys = jr.split(jr.key(9), 4)
    result = eb.run_chains(step, init, keys, 25)
    np.testing.assert_array_equal(result.nonfinite.chains, [1, 3])
    np.testing.assert_array_equal(result.nonfinite.steps, [9, 4])
    assert result.nonfinite.chains.dtype == np.int64
    for i in (0, 2):
        alone = eb.run_chains(step, init[i : i + 1], keys[i : i + 1], 25)
        assert_trees_identical(alone.final, result.final[i : i + 1])


def test_equinox_module_state(getkey):
    # An MLP also holds non-array leaves (its activations): shared, never stacked.
    models = eqx.filter_vmap(lambda k: eqx.nn.MLP(2, 2, 4, 1, key=k))(
        jr.split(getkey(), 3)
    )

    def step(model: eqx.nn.MLP, key: jax.Array) -> eqx.nn.MLP:
        params, static = eqx.partition(model, eqx.is_array)
        params = jtu.tree_map(lambda w: w + 0.01 * jr.normal(key, w.shape), params)
        return eqx.combine(params, static)

    result = eb.run_chains(step, models, getkey(), 4)
    assert isinstance(result.final, eqx.nn.MLP)
    assert result.final.layers[0].weight.shape == (3, 4, 2)
    assert result.trace.layers[0].weight.shape == (3, 4, 4, 2)
    assert result.final.activation is models.activation
    assert result.trace.activation is models.activation


def test_trace_is_written_in_place():
    # The compiled loop updates the (donated) trace buffer in place: memory stays at the
    # trace's size, with no second copy of it.
    from eqx_batch._chains import _compiled_segment, _Plan

    num_chains, num_steps = 8, 50
    init = make_init(num_chains)
    buffer = jtu.tree_map(lambda x: jnp.zeros((num_chains, num_steps, 3, 3)), init)
    plan = _Plan(num_steps, num_steps, 1, 0, False, True, False)
    keys = jr.split(jr.key(0), num_chains)
    first_bad = jnp.zeros(num_chains, jnp.int32)
    inputs = (plan, metropolis, init, keys, first_bad, jnp.asarray(0, jnp.int32), None)
    leaves, treedef = jtu.tree_flatten(inputs)
    arrays = [x if eqx.is_array(x) else None for x in leaves]
    others = tuple(None if eqx.is_array(x) else x for x in leaves)
    lowered: Any = _compiled_segment.lower(arrays, buffer, (treedef, others))
    stats = lowered.compile().memory_analysis()
    trace_bytes = sum(x.nbytes for x in jtu.tree_leaves(buffer))
    assert stats.alias_size_in_bytes >= trace_bytes
    assert stats.temp_size_in_bytes < trace_bytes / 4


def test_progress_bar_leaves_results_unchanged(capsys):
    init = make_init(4)
    plain = eb.run_chains(metropolis, init, jr.key(0), 50)
    shown = eb.run_chains(metropolis, init, jr.key(0), 50, progress=True)
    assert_trees_identical(outputs(shown), outputs(plain))
    err = capsys.readouterr().err
    assert "50/50" in err


# ------------------------------------------------------------------------------------
# Checkpoints.


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


def test_finished_checkpoint_is_read_back_without_recomputing(tmp_path):
    init = make_init(6)
    path = tmp_path / "run.ckpt"
    first = eb.run_chains(metropolis, init, jr.key(0), 20, checkpoint=path)

    again = eb.run_chains(_zeros_named_metropolis, init, jr.key(0), 20, checkpoint=path)
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
    first = run(metropolis, init, jr.key(0), 40)
    chunks = json.loads(_checkpoint(path, init)["progress"])["chunks"]
    bounds = [[0, 1], [1, 4], [4, 6], [6, 8], [8, 11], [11, 12]]
    assert [chunk[1:] for chunk in chunks] == bounds
    again = run(_zeros_named_metropolis, init, jr.key(0), 40)
    assert_trees_identical(outputs(again), outputs(first))


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


def _zeros_named_metropolis(state: dict, key: jax.Array) -> dict:
    return jtu.tree_map(jnp.zeros_like, state)


# Same qualified name as the real step, other behaviour: shows what was recomputed.
_zeros_named_metropolis.__qualname__ = "metropolis"


def _checkpoint(path: pathlib.Path, init: Any) -> dict:
    """The run state file of a checkpoint, as written (for the key `jr.key(0)`)."""
    from eqx_batch._chains import _host_like

    keys = jr.split(jr.key(0), eb.batch_size(init))
    return eb.load(path, {"run": "", "progress": "", **_host_like(init, keys)})


def _steps_done(path: pathlib.Path, init: Any) -> int:
    return json.loads(_checkpoint(path, init)["progress"])["steps_done"]


def test_kill_and_resume_gives_the_same_bits(tmp_path):
    num_chains, num_steps, every = 16, 2000, 40
    path = tmp_path / "run.ckpt"
    out = tmp_path / "never.eqx"
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), str(out), str(num_chains), str(num_steps)]
        + [str(path), str(every)]
    )
    try:
        deadline = time.monotonic() + 120
        while not path.exists():
            assert worker.poll() is None, (
                "the worker exited before its first checkpoint"
            )
            assert time.monotonic() < deadline, "no checkpoint appeared in 120 s"
            time.sleep(0.01)
        worker.send_signal(signal.SIGKILL)
    finally:
        worker.kill()
        worker.wait()
    assert worker.returncode == -signal.SIGKILL
    init = make_init(num_chains)
    steps_done = _steps_done(path, init)
    assert 0 < steps_done < num_steps, "the kill did not land mid-run"
    assert not out.exists()

    resumed = eb.run_chains(
        metropolis, init, jr.key(0), num_steps, checkpoint=path, checkpoint_every=every
    )
    plain = eb.run_chains(metropolis, init, jr.key(0), num_steps)
    assert_trees_identical(outputs(resumed), outputs(plain))
    assert _steps_done(path, init) == num_steps


def test_resume_continues_from_the_checkpoint(tmp_path):
    # Resuming with a step of the same name but other behaviour: draws up to the
    # checkpoint come from the file, the rest from the new step.
    init = make_init(6)
    path = tmp_path / "run.ckpt"
    done = eb.run_chains(metropolis, init, jr.key(0), 10, checkpoint=path)
    # Turn the finished checkpoint of a 10-step run into one of a 20-step run stopped
    # at step 10: same files, with `num_steps` rewritten.
    saved = _checkpoint(path, init)
    saved["run"] = saved["run"].replace('"num_steps": 10', '"num_steps": 20')
    eb.save(path, saved)

    resumed = eb.run_chains(
        _zeros_named_metropolis, init, jr.key(0), 20, checkpoint=path
    )
    assert_trees_identical(jtu.tree_map(lambda x: x[:, :10], resumed.trace), done.trace)
    assert not jnp.any(resumed.trace["layer1"]["weights"][:, 10:])


def test_checkpoint_of_another_run_is_refused(tmp_path):
    path = tmp_path / "run.ckpt"
    eb.run_chains(metropolis, make_init(2), jr.key(0), 5, checkpoint=path)
    with pytest.raises(eb.BatchError, match="num_steps: the checkpoint has 5, this"):
        eb.run_chains(metropolis, make_init(2), jr.key(0), 6, checkpoint=path)
    with pytest.raises(eb.BatchError, match="init values"):
        eb.run_chains(metropolis, _shifted(2), jr.key(0), 5, checkpoint=path)
    with pytest.raises(
        eb.BatchError, match=r"does not fit this call's `init`.*shape \(3,\)"
    ):
        eb.run_chains(metropolis, make_init(3), jr.key(0), 5, checkpoint=path)
    with pytest.raises(eb.BatchError, match="keys"):
        eb.run_chains(metropolis, make_init(2), jr.key(1), 5, checkpoint=path)
    with pytest.raises(eb.BatchError, match="step: the checkpoint has 'metropolis'"):
        eb.run_chains(_other_step, make_init(2), jr.key(0), 5, checkpoint=path)


_DESCRIBE_MLP_RUN = """
import equinox as eqx, jax.random as jr
from eqx_batch._chains import _describe_run
keys = jr.split(jr.key(0), 3)
models = eqx.filter_vmap(lambda k: eqx.nn.MLP(2, 2, 4, 1, key=k))(keys)
print(_describe_run(print, models, jr.split(jr.key(1), 3), 10, 1, 0, False, True))
"""


def test_run_description_is_the_same_in_another_process():
    # An MLP holds functions (its activations), whose reprs carry memory addresses that
    # differ per process; a resumed run in a new process must still match.
    from eqx_batch._chains import _describe_run

    models = eqx.filter_vmap(lambda k: eqx.nn.MLP(2, 2, 4, 1, key=k))(
        jr.split(jr.key(0), 3)
    )
    here = _describe_run(print, models, jr.split(jr.key(1), 3), 10, 1, 0, False, True)
    there = subprocess.run(
        [sys.executable, "-c", _DESCRIBE_MLP_RUN],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert there.strip() == str(here)


def _other_step(state: dict, key: jax.Array) -> dict:
    return metropolis(state, key)


def _shifted(num_chains: int) -> dict:
    return jtu.tree_map(lambda x: x + 1.0, make_init(num_chains))


# ------------------------------------------------------------------------------------
# Errors.


def test_step_changing_a_shape_is_refused():
    def step(state: dict, key: jax.Array) -> dict:
        state = dict(state)
        state["layer2"] = {"weights": jnp.zeros((3, 4))}
        return state

    with pytest.raises(eb.BatchError, match=r"init\['layer2'\]\['weights'\]") as info:
        eb.run_chains(step, make_init(2), jr.key(0), 3)
    assert "float32[3,4]" in str(info.value)


def test_step_changing_a_dtype_is_refused():
    def step(state: dict, key: jax.Array) -> dict:
        return jtu.tree_map(lambda x: x.astype(jnp.bfloat16), state)

    with pytest.raises(eb.BatchError, match=r"init\['layer1'\]\['weights'\]"):
        eb.run_chains(step, make_init(2), jr.key(0), 3)


def test_step_changing_the_structure_is_refused():
    def step(state: dict, key: jax.Array) -> dict:
        return {**state, "layer3": {"weights": jnp.zeros(3)}}

    with pytest.raises(eb.BatchError, match=r"new_state\['layer3'\]\['weights'\]"):
        eb.run_chains(step, make_init(2), jr.key(0), 3)


def test_with_output_needs_a_pair():
    with pytest.raises(eb.BatchError, match="new_state, output"):
        eb.run_chains(metropolis, make_init(2), jr.key(0), 3, with_output=True)


def test_key_count_must_match_the_chains():
    with pytest.raises(eb.BatchError, match=r"`key` holds 3 keys but `init` has 2"):
        eb.run_chains(metropolis, make_init(2), jr.split(jr.key(0), 3), 3)
    with pytest.raises(eb.BatchError, match="`key`"):
        eb.run_chains(metropolis, make_init(2), jnp.zeros(3), 3)


def test_init_leaves_must_agree_on_the_chain_count():
    init = {"a": jnp.zeros((2, 3)), "b": jnp.zeros((3, 3))}
    with pytest.raises(eb.BatchError, match=r"init\['b'\]"):
        eb.run_chains(lambda s, k: s, init, jr.key(0), 3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_steps": -1}, "num_steps"),
        ({"thin": 0}, "thin"),
        ({"burn_in": 11}, "burn_in"),
        ({"checkpoint_every": 5}, "checkpoint_every"),
        ({"checkpoint": "x", "checkpoint_every": 0}, "checkpoint_every"),
    ],
)
def test_bad_counts_are_refused(kwargs, match):
    arguments = {"num_steps": 10} | kwargs
    with pytest.raises(eb.BatchError, match=match):
        eb.run_chains(metropolis, make_init(2), jr.key(0), **arguments)
