"""`eb.run_chains` and `eb.Chains`: per-chain bits, checkpoints, real kills, errors."""

import concurrent.futures
import dataclasses
import functools as ft
import os
import pathlib
import subprocess
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from chains_workloads import (
    key_step,
    make_init,
    make_key_init,
    metropolis,
    outputs,
)
from helpers import assert_trees_identical, raises, tree_allclose
from multiprocess_launch import launch

import eqx_batch as eb


RUN_WORKER = pathlib.Path(__file__).with_name("run_worker.py")
JOB_RUN_WORKER = pathlib.Path(__file__).with_name("job_run_worker.py")


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


@pytest.mark.accelerator
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


@pytest.mark.accelerator
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


@pytest.mark.accelerator
@pytest.mark.needs_devices(4)
def test_chains_are_spread_over_every_device():
    result = eb.run_chains(metropolis, make_init(8), jr.key(0), 20)
    assert len(result.final["layer1"]["weights"].sharding.device_set) == 4
    assert len(result.trace["layer1"]["weights"].sharding.device_set) == 4


def test_one_device_and_four_devices_give_the_same_bits(tmp_path):
    # The worker runs in a process with a single CPU device; this one has four.
    out = tmp_path / "one_device.eqx"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    subprocess.run(
        [sys.executable, str(RUN_WORKER), str(out), "metropolis", "6", "20"],
        env=env,
        check=True,
        timeout=120,
    )
    four = outputs(eb.run_chains(metropolis, make_init(6), jr.key(0), 20))
    one = eb.load(out, four)
    assert_trees_identical(one, four)


def test_two_processes_give_the_same_bits(tmp_path):
    # A job of 2 processes with 2 devices each: the chains are split over all 4
    # devices of both processes, and every process gathers whole results.
    out = tmp_path / "job.eqx"
    launch(JOB_RUN_WORKER, [str(out), "metropolis", "6", "20"], devices_per_process=2)
    four = outputs(eb.run_chains(metropolis, make_init(6), jr.key(0), 20))
    for process_id in range(2):
        assert_trees_identical(eb.load(f"{out}.{process_id}", four), four)


def test_gathered_in_one_process_is_the_result_itself():
    # In one process every array is whole already: nothing to gather or copy.
    result = eb.run_chains(metropolis, make_init(6), jr.key(0), 5, diagnostics=True)
    assert result.trace["layer1"]["weights"].is_fully_addressable
    assert result.gathered() is result


@pytest.mark.accelerator
def test_matmul_step_is_allclose_to_running_alone():
    # XLA may sum a matmul in another order for another batch size: allclose, not bits.
    # At the default precision a TPU multiplies float32 in bfloat16 passes, so the two
    # programs may round apart by far more than a CPU's last bits: at "highest" it
    # multiplies in float32, and only the order of the sums differs, as on a CPU.
    weights = jr.normal(jr.key(3), (4, 4)) / 4

    def step(state: jax.Array, key: jax.Array) -> jax.Array:
        return jnp.tanh(state @ weights) + 0.1 * jr.normal(key, state.shape)

    init = jr.normal(jr.key(4), (3, 4))
    keys = jr.split(jr.key(5), 3)
    with jax.default_matmul_precision("highest"):
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


@pytest.mark.parametrize("options", [{}, {"chunk_size": 2}, {"checkpoint_every": 2}])
def test_keys_of_another_implementation_continue_and_resume(tmp_path, options):
    # The chains' keys stay typed through the run: they come back of the
    # implementation they were given and continue the chains bit for bit, also after a
    # resume from files that hold their raw data. (JAX's `rbg` keys draw differently
    # under `vmap` when the batch changes, so the runs compared have the same chunks.)
    keys = jr.split(jr.key(3, impl="rbg"), 5)
    init = make_init(5)
    chunks = {k: v for k, v in options.items() if k == "chunk_size"}
    if "checkpoint_every" in options:
        options = {**options, "checkpoint": tmp_path / "run"}
    whole = eb.run_chains(metropolis, init, keys, 6, **options)
    assert whole.keys.dtype == keys.dtype
    first = eb.run_chains(metropolis, init, keys, 3, **chunks)
    rest = eb.run_chains(metropolis, first.final, first.keys, 3, **chunks)
    assert_trees_identical(whole.final, rest.final)
    assert_trees_identical(jr.key_data(whole.keys), jr.key_data(rest.keys))
    if "checkpoint" in options:
        again = eb.run_chains(metropolis, init, keys, 6, **options)  # read back
        assert again.keys.dtype == keys.dtype
        assert_trees_identical(jr.key_data(again.keys), jr.key_data(whole.keys))


@pytest.mark.parametrize("with_output", [False, True])
def test_result_is_the_module_its_constructor_builds(with_output):
    # `run_chains` builds its result without calling the constructor: the same module,
    # field for field, with the same structure.
    step = _state_and_output if with_output else metropolis
    result = eb.run_chains(
        step, make_init(4), jr.key(3), 5, with_output=with_output, diagnostics=True
    )
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(eb.Chains)}
    nonfinite = eb.NonFinite(result.nonfinite.first_step)
    built = eb.Chains(**{**fields, "nonfinite": nonfinite})
    assert type(result) is eb.Chains and type(result.nonfinite) is eb.NonFinite
    assert (result.outputs is not None) is with_output
    assert jtu.tree_structure(result) == jtu.tree_structure(built)
    assert_trees_identical(result, built)


def test_with_output_records_outputs_beside_the_same_trace():
    result = eb.run_chains(
        _state_and_output, make_init(6), jr.key(8), 20, thin=4, with_output=True
    )
    assert result.outputs["moved"].shape == (6, 5)
    assert result.outputs["moved"].dtype == jnp.bool_
    plain = eb.run_chains(metropolis, make_init(6), jr.key(8), 20, thin=4)
    assert_trees_identical(result.final, plain.final)
    # `trace` holds the states whatever `with_output` says: the very bits of a run
    # without outputs.
    assert_trees_identical(result.trace, plain.trace)
    assert plain.outputs is None


def test_outputs_are_those_of_the_steps_that_made_the_draws():
    # Without thinning, draw t's output says whether step t moved the chain: whether
    # draw t differs from the draw (or the start) before it.
    init = make_init(4)
    result = eb.run_chains(_state_and_output, init, jr.key(2), 30, with_output=True)
    weights = result.trace["layer1"]["weights"]
    before = jnp.concatenate([init["layer1"]["weights"][:, None], weights[:, :-1]], 1)
    moved = jnp.any(weights != before, axis=(2, 3))
    np.testing.assert_array_equal(result.outputs["moved"], moved)
    assert jnp.any(moved) and not jnp.all(moved)


@pytest.mark.accelerator
def test_numpy_float64_init_runs_as_float32():
    # As BlackJAX's how-to on multiple chains starts them: NumPy float64 positions,
    # and a step whose results are float32 (JAX's default 32-bit mode).
    def step(x: jax.Array, key: jax.Array) -> jax.Array:
        return x + 0.1 * jr.normal(key, x.shape)

    init = np.random.default_rng(0).standard_normal((4, 2))
    assert init.dtype == np.float64
    from_numpy = eb.run_chains(step, init, jr.key(0), 10)
    from_float32 = eb.run_chains(step, jnp.asarray(init), jr.key(0), 10)
    assert from_numpy.final.dtype == jnp.float32
    assert_trees_identical(outputs(from_numpy), outputs(from_float32))
    # Integers too: int64 is int32, as `jnp.asarray` makes it.
    counts = eb.run_chains(lambda n, key: n + 1, np.arange(3), jr.key(0), 2)
    assert counts.trace.dtype == jnp.int32


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
    assert result.trace is None and result.outputs is None
    assert result.final["layer1"]["weights"].shape == (2, 3, 3)


@pytest.mark.parametrize(
    "options",
    [{}, {"thin": 2, "burn_in": 3}, {"chunk_size": 3}, {"checkpoint_every": True}],
    ids=["plain", "thinned", "chunked", "checkpointed"],
)
def test_outputs_without_a_trace_are_recorded_alone(tmp_path, options):
    options = dict(options)
    # tfp#799: a step's outputs, without its states: `trace=False` with
    # `with_output=True` records the outputs, the same as with the trace, and no state.
    checkpoints = {}
    if options.pop("checkpoint_every", None):
        checkpoints = {"checkpoint": str(tmp_path / "alone"), "checkpoint_every": 2}
    run = ft.partial(
        eb.run_chains, _state_and_output, make_init(5), jr.key(0), 9, with_output=True
    )
    alone = run(trace=False, **options, **checkpoints)
    with_trace = run(**options)
    assert alone.trace is None and alone.outputs is not None
    assert_trees_identical(alone.outputs, with_trace.outputs)
    assert_trees_identical(alone.final, with_trace.final)
    if checkpoints:
        # Read back from its checkpoint: the outputs are its draws.
        again = run(trace=False, **options, **checkpoints)
        assert again.trace is None
        assert_trees_identical(again.outputs, with_trace.outputs)


@pytest.mark.parametrize("trace", [True, "disk"])
@pytest.mark.parametrize(
    "num_steps, burn_in", [(0, 0), (4, 4)], ids=["no step", "all burn-in"]
)
def test_a_run_of_no_draws_has_an_empty_trace(tmp_path, trace, num_steps, burn_in):
    # `None` is for `trace=False` only: no draw is an empty trace, `[chains, 0, ...]`.
    result = eb.run_chains(
        _state_and_output,
        make_init(2),
        jr.key(0),
        num_steps,
        burn_in=burn_in,
        with_output=True,
        trace=trace,
        checkpoint=tmp_path / "run.ckpt",
    )
    one_draw = eb.run_chains(
        _state_and_output, make_init(2), jr.key(0), 1, with_output=True
    )
    for recorded, like in [
        (result.trace, one_draw.trace),
        (result.outputs, one_draw.outputs),
    ]:
        assert jtu.tree_map(lambda x: (x.shape, x.dtype), recorded) == jtu.tree_map(
            lambda x: ((2, 0, *x.shape[2:]), x.dtype), like
        )
    assert result.trace["layer1"]["weights"].shape == (2, 0, 3, 3)
    assert np.asarray(result.outputs["moved"]).shape == (2, 0)


@pytest.mark.accelerator
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


@pytest.mark.parametrize("segments", ["one", "checkpointed", "chunked"])
def test_nonfinite_report_at_segment_ends_and_after_recovery(segments, tmp_path):
    # The report is the first step whose state is not finite: a chain that recovers
    # keeps it, and a step at a segment's end (3 and 6 with `checkpoint_every=3`) or
    # the run's last is caught. Integer and boolean leaves are never checked.
    def step(state: dict, key: jax.Array) -> dict:
        del key
        n, when = state["n"], state["when"]
        x = jnp.where(n == when, jnp.nan, state["x"])
        x = jnp.where((n == when + 1) & state["recovers"], 0.0, x)
        return {**state, "x": x + 1.0, "n": n + 1}

    init = {
        "x": jnp.zeros((5, 2), jnp.float32),
        "n": jnp.zeros(5, jnp.int32),
        # Step `when + 1` (counted from 1) makes the state NaN.
        "when": jnp.array([2, 5, 8, 9, 100], jnp.int32),
        "recovers": jnp.array([False, True, False, False, False]),
    }
    options: dict = {
        "one": {},
        "checkpointed": {"checkpoint": tmp_path / "run", "checkpoint_every": 3},
        "chunked": {"chunk_size": 2},
    }[segments]
    result = eb.run_chains(step, init, jr.key(0), 10, **options)
    np.testing.assert_array_equal(result.nonfinite.chains, [0, 1, 2, 3])
    np.testing.assert_array_equal(result.nonfinite.steps, [3, 6, 9, 10])
    assert bool(jnp.isfinite(result.final["x"][1]).all())


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


@pytest.mark.parametrize("with_output", [False, True])
def test_static_leaves_are_the_callers_own_on_a_cached_step(with_output):
    # The layout of a step is cached by equality of the state's static leaves, and
    # `1 == 1.0 == True`: each call still gets back the very leaves it passed.
    def step(state: dict, key: jax.Array) -> Any:
        new = {**state, "x": state["x"] + jr.normal(key, state["x"].shape)}
        output = {"sum": jnp.sum(new["x"]), "tag": "output"}
        return (new, output) if with_output else new

    for scale in [1, 1.0, True]:
        init = {"x": jnp.zeros((3, 2)), "scale": scale}
        result = eb.run_chains(step, init, jr.key(0), 4, with_output=with_output)
        for got in [result.final["scale"], result.trace["scale"]]:
            assert got is scale
        assert result.trace["x"].shape == (3, 4, 2)
        if with_output:
            assert result.outputs["tag"] == "output"
            assert result.outputs["sum"].shape == (3, 4)


def test_runs_in_threads_share_the_caches_and_equal_runs_alone():
    # Every call meets the caches of checked steps, placements and programs; calls
    # from several threads at once, over several chain counts, must each get their
    # own run's bits.
    counts = [3, 5, 8, 13]
    alone = {n: eb.run_chains(metropolis, make_init(n), jr.key(n), 7) for n in counts}

    def run(n: int) -> eb.Chains:
        return eb.run_chains(metropolis, make_init(n), jr.key(n), 7)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, counts * 5))
    for n, result in zip(counts * 5, results, strict=True):
        assert_trees_identical(outputs(result), outputs(alone[n]))


def test_trace_is_written_in_place():
    # The compiled loop updates the (donated) trace buffer in place: memory stays at the
    # trace's size, with no second copy of it.
    from eqx_batch._chains._common import ChainState, Draws
    from eqx_batch._chains._segment import run_segment, SegmentPlan
    from eqx_batch._chains._step import PerChain

    num_chains, num_steps = 8, 50
    init = make_init(num_chains)
    buffer = jtu.tree_map(lambda x: jnp.zeros((num_chains, num_steps, 3, 3)), init)
    plan = SegmentPlan(
        length=num_steps,
        draws=Draws.of(num_steps, burn_in=0, thin=1),
        with_output=False,
        writes_trace=True,
        legacy=False,
    )
    chains = ChainState(
        states=init,
        keys=jr.split(jr.key(0), num_chains),
        first_bad=jnp.zeros(num_chains, jnp.int32),
    )
    lowered: Any = run_segment.lower(
        plan,
        PerChain(metropolis),
        eqx.filter(init, eqx.is_array, inverse=True),
        chains,
        jnp.asarray(0, jnp.int32),
        buffer,
    )
    stats = lowered.compile().memory_analysis()
    trace_bytes = sum(x.nbytes for x in jtu.tree_leaves(buffer))
    assert stats.alias_size_in_bytes >= trace_bytes
    assert stats.temp_size_in_bytes < trace_bytes / 4


def test_a_second_call_does_not_trace_the_step_again():
    # The step's checks are cached like its compiled loop: calling `run_chains` again
    # with the same step and kind of state runs Python code of neither.
    calls = []

    def step(state: dict, key: jax.Array) -> dict:
        calls.append(key)
        return metropolis(state, key)

    first = eb.run_chains(step, make_init(4), jr.key(0), 5)
    traced = len(calls)
    assert traced > 0
    again = eb.run_chains(step, make_init(4), jr.key(0), 5)
    assert len(calls) == traced
    assert_trees_identical(outputs(again), outputs(first))


def test_progress_bar_leaves_results_unchanged(capsys):
    init = make_init(4)
    plain = eb.run_chains(metropolis, init, jr.key(0), 50)
    shown = eb.run_chains(metropolis, init, jr.key(0), 50, progress=True)
    assert_trees_identical(outputs(shown), outputs(plain))
    err = capsys.readouterr().err
    assert "50/50" in err


# ------------------------------------------------------------------------------------
# More chains than fit in memory: `chunk_size`.


@pytest.mark.parametrize(
    "chunk_size", [1, pytest.param(3, marks=pytest.mark.accelerator), 4, 9, 10, 64]
)
def test_chunked_run_equals_unchunked_run(chunk_size):
    # 10 chains over 4 devices: chunks of 3 and 9 leave remainders (1 chain) that are
    # padded; 10 and 64 are one chunk, the unchunked run itself.
    init = make_init(10)
    plain = eb.run_chains(metropolis, init, jr.key(0), 30, thin=3, burn_in=4)
    chunked = eb.run_chains(
        metropolis, init, jr.key(0), 30, thin=3, burn_in=4, chunk_size=chunk_size
    )
    assert chunked.trace["layer1"]["weights"].shape == (10, 9, 3, 3)
    assert_trees_identical(outputs(chunked), outputs(plain))


def test_chunked_run_without_trace():
    init = make_init(10)
    plain = eb.run_chains(metropolis, init, jr.key(0), 20, trace=False)
    chunked = eb.run_chains(metropolis, init, jr.key(0), 20, trace=False, chunk_size=4)
    assert chunked.trace is None
    assert_trees_identical(outputs(chunked), outputs(plain))


def test_chunked_run_with_output_and_keys_in_the_state():
    def step(state: dict, key: jax.Array) -> tuple:
        new = key_step(state, key)
        return new, {"k": new["k"], "size": jnp.sum(new["x"] ** 2)}

    init = make_key_init(7)
    keys = jr.split(jr.key(3), 7)
    plain = eb.run_chains(step, init, keys, 20, with_output=True, thin=2)
    chunked = eb.run_chains(
        step, init, keys, 20, with_output=True, thin=2, chunk_size=3
    )
    assert chunked.trace["k"].dtype == jr.key(0).dtype
    assert chunked.outputs["k"].dtype == jr.key(0).dtype
    assert_trees_identical(chunked.trace, plain.trace)
    assert_trees_identical(chunked.outputs, plain.outputs)
    assert_trees_identical(outputs(chunked)["final"], outputs(plain)["final"])
    assert_trees_identical(jr.key_data(chunked.keys), jr.key_data(plain.keys))
    # Legacy keys too: given and returned as `uint32` data.
    legacy = eb.run_chains(step, init, jr.key_data(keys), 20, with_output=True, thin=2)
    legacy_chunked = eb.run_chains(
        step, init, jr.key_data(keys), 20, with_output=True, thin=2, chunk_size=2
    )
    assert_trees_identical(legacy_chunked.keys, legacy.keys)


def test_chunked_nonfinite_report_numbers_chains_across_chunks():
    def step(state: jax.Array, key: jax.Array) -> jax.Array:
        return state * 10.0 + jr.uniform(key, state.shape)

    init = jnp.array([[0.0], [1e30], [1.0], [0.0], [1e35], [1.0], [1e30]])
    plain = eb.run_chains(step, init, jr.key(9), 25)
    chunked = eb.run_chains(step, init, jr.key(9), 25, chunk_size=3)
    np.testing.assert_array_equal(chunked.nonfinite.chains, [1, 4, 6])
    np.testing.assert_array_equal(chunked.nonfinite.steps, [9, 4, 9])
    assert_trees_identical(chunked.nonfinite, plain.nonfinite)


def test_every_chunk_runs_one_compiled_program():
    names = []

    def listener(event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name"))

    # A new step: nothing of it is compiled yet. 11 chains in chunks of 4: the last
    # chunk (3 chains) is padded to 4, so all three run the same segment program.
    def step(state: dict, key: jax.Array) -> dict:
        return metropolis(state, key)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        eb.run_chains(step, make_init(11), jr.key(0), 20, chunk_size=4, progress=True)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert names.count("jit(run)") == 1, names


def test_progress_bar_counts_every_chunk(capsys):
    init = make_init(10)
    plain = eb.run_chains(metropolis, init, jr.key(0), 50)
    shown = eb.run_chains(metropolis, init, jr.key(0), 50, progress=True, chunk_size=4)
    assert_trees_identical(outputs(shown), outputs(plain))
    # Three chunks of 50 steps: one bar of 150.
    err = capsys.readouterr().err
    assert "150/150" in err
    assert "/50 " not in err


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True, "4", np.float32(2)])
def test_bad_chunk_size_is_refused(chunk_size):
    with pytest.raises(eb.BatchError, match="`chunk_size`"):
        eb.run_chains(metropolis, make_init(4), jr.key(0), 5, chunk_size=chunk_size)


# ------------------------------------------------------------------------------------
# Errors.


def test_init_whose_leaves_disagree_on_the_chains_is_refused_naming_them():
    # The count is read from the bare leaves first; a disagreement, or a leaf with no
    # chain axis, must still name the leaves.
    init = {"a": jnp.zeros((4, 2)), "b": {"c": jnp.zeros((3,))}}
    with pytest.raises(eb.BatchError, match=r"init\['b'\]\['c'\]") as info:
        eb.run_chains(metropolis, init, jr.key(0), 2)
    assert "init['a']" in str(info.value) and "3" in str(info.value)
    with pytest.raises(eb.BatchError, match=r"init\['s'\].*0-d"):
        eb.run_chains(
            metropolis, {"w": jnp.zeros((4, 2)), "s": jnp.zeros(())}, jr.key(0), 2
        )


def test_step_changing_a_shape_is_refused():
    def step(state: dict, key: jax.Array) -> dict:
        state = dict(state)
        state["layer2"] = {"weights": jnp.zeros((3, 4))}
        return state

    with pytest.raises(eb.BatchError, match=r"init\['layer2'\]\['weights'\]") as info:
        eb.run_chains(step, make_init(2), jr.key(0), 3)
    assert "float32[3,4]" in str(info.value)


def test_step_is_checked_again_for_another_kind_of_state():
    # Fine on 3x3 weights, wrong on any other shape: a call with other shapes is
    # checked anew, not taken for the one checked before.
    def step(state: dict, key: jax.Array) -> dict:
        return jtu.tree_map(lambda x: x if x.shape == (3, 3) else x[:1], state)

    eb.run_chains(step, make_init(2), jr.key(0), 3)
    wide = {"layer1": {"weights": jnp.zeros((2, 3, 4))}}
    with pytest.raises(eb.BatchError, match=r"init\['layer1'\]\['weights'\]"):
        eb.run_chains(step, wide, jr.key(0), 3)


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
        # A bool is no count, though Python takes `True` for 1.
        ({"num_steps": True}, "num_steps"),
        ({"thin": True}, "thin"),
        ({"burn_in": False}, "burn_in"),
        ({"checkpoint": "x", "checkpoint_every": True}, "checkpoint_every"),
        ({"chunk_size": np.bool_(True)}, "chunk_size"),
    ],
)
def test_bad_counts_are_refused(kwargs, match):
    arguments = {"num_steps": 10} | kwargs
    with pytest.raises(eb.BatchError, match=match):
        eb.run_chains(metropolis, make_init(2), jr.key(0), **arguments)


def test_numpy_integer_counts_are_taken(tmp_path):
    init = make_init(3)
    plain = eb.run_chains(metropolis, init, jr.key(0), 12, thin=2, burn_in=2)
    # As a user's untyped values: NumPy integers, one of each width.
    counts: dict[str, Any] = {
        "thin": np.int32(2),
        "burn_in": np.uint8(2),
        "checkpoint_every": np.int16(5),
        "chunk_size": np.int64(2),
    }
    num_steps: Any = np.int64(12)
    counted = eb.run_chains(
        metropolis,
        init,
        jr.key(0),
        num_steps,
        checkpoint=tmp_path / "run.ckpt",
        **counts,
    )
    assert_trees_identical(outputs(counted), outputs(plain))


def test_python_numbers_in_outputs_are_recorded_as_arrays():
    def step(x: jax.Array, key: jax.Array) -> tuple:
        return x + 1.0, {"constant": 0.5, "total": jnp.sum(x), "name": "sum"}

    result = eb.run_chains(step, jnp.zeros((3, 2)), jr.key(0), 4, with_output=True)
    assert result.outputs["name"] == "sum"
    assert result.outputs["constant"].shape == (3, 4)
    assert np.all(result.outputs["constant"] == 0.5)
    np.testing.assert_array_equal(result.outputs["total"][0], [0.0, 2.0, 4.0, 6.0])


@pytest.mark.parametrize("shape", [(3,), (4, 3)])
def test_key_data_of_the_wrong_shape_is_refused(shape):
    with pytest.raises(eb.BatchError, match=r"`key` is uint32\[.*not legacy keys"):
        eb.run_chains(metropolis, make_init(4), jnp.zeros(shape, jnp.uint32), 5)


@pytest.mark.parametrize("flag", ["with_output", "trace", "progress", "diagnostics"])
@pytest.mark.parametrize("value", ["False", "false", 0, None])
def test_a_flag_that_is_not_a_bool_is_refused(flag, value):
    # `trace="False"` is a string, which Python counts as true.
    with pytest.raises(
        eb.BatchError, match=f"`{flag}` is .*; it must be True(, False)? or"
    ):
        eb.run_chains(metropolis, make_init(2), jr.key(0), 5, **{flag: value})


def test_trace_is_true_false_or_disk():
    init = make_init(2)
    for wrong in ["Disk", "True", 1, 0.0, None, np.array([True])]:
        raises(
            "`trace` is",
            lambda w=wrong: eb.run_chains(metropolis, init, jr.key(0), 3, trace=w),
            "'disk'",
        )
    # NumPy's bools are flags, as for every other flag.
    no = np.False_
    assert eb.run_chains(metropolis, init, jr.key(0), 3, trace=no).trace is None  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpoint", [5, b"path", ["a", "b"]])
def test_a_checkpoint_that_is_not_a_path_is_refused(checkpoint):
    raises(
        "pass a path",
        lambda: eb.run_chains(
            metropolis, make_init(2), jr.key(0), 3, checkpoint=checkpoint
        ),
        "`checkpoint` is",
    )


def test_disk_without_a_checkpoint_is_refused_before_any_step():
    calls = []

    def counted(state, key):
        calls.append(None)
        return metropolis(state, key)

    raises(
        "`checkpoint` is None",
        lambda: eb.run_chains(counted, make_init(2), jr.key(0), 3, trace="disk"),
        "trace='disk'",
    )
    assert not calls
