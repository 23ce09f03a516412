"""`run_chains(shared=)`: a state the chains of a problem share, carried through the
loop for an `eb.all_chains` step `fn(states, keys, count, shared[, data])`."""

import os
import pathlib

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from chains_workloads import (
    adapting,
    ADAPTING_SHARED,
    make_adapting_init,
    outputs,
    run as run_workload,
)
from helpers import assert_trees_identical, kill_once_checkpointed, raises
from hypothesis import given, settings, strategies as st
from multiprocess_launch import launch

import eqx_batch as eb


RUN_WORKER = pathlib.Path(__file__).with_name("run_worker.py")
JOB_RUN_WORKER = pathlib.Path(__file__).with_name("job_run_worker.py")
STEP = eb.all_chains(adapting)


def adapting_on(states: dict, keys: jax.Array, count, shared: dict, data) -> tuple:
    """`adapting` on a normal centred on the problem's `data`."""
    return adapting(states, keys, count, shared, centre=data)


def by_hand(
    fn, init, key, num_steps: int, shared, data=None, chains_each=None, sharding=None
):
    """The loop a user writes: `jit(scan)` over steps of `fn` on every chain (with
    `data`, a `vmap` over problems of `fn` on each problem's chains), each chain's key
    split as `run_chains` splits it, the chains split over the devices as `sharding`
    says (as `run_chains` splits them, so that XLA compiles the same arithmetic).
    Returns the final states, trace, keys and shared state."""
    num_chains = jtu.tree_leaves(init)[0].shape[0]
    keys = jr.split(key, num_chains)
    if sharding is not None:
        init, keys = jax.device_put((init, keys), sharding)

    def move(states, step_keys, t, shared):
        if data is None:
            return fn(states, step_keys, t, shared)
        problems = num_chains // chains_each

        def grouped(x):
            return x.reshape(problems, chains_each, *x.shape[1:])

        new, new_shared = jax.vmap(lambda s, k, sh, row: fn(s, k, t, sh, row))(
            jtu.tree_map(grouped, states), grouped(step_keys), shared, data
        )
        return jtu.tree_map(lambda x: x.reshape(num_chains, *x.shape[2:]), new), (
            new_shared
        )

    def body(carry, t):
        states, keys, shared = carry
        split = jax.vmap(jr.split)(keys)
        keys, step_keys = split[:, 0], split[:, 1]
        states, shared = move(states, step_keys, t, shared)
        return (states, keys, shared), states

    @jax.jit
    def loop(states, keys, shared):
        steps = jnp.arange(num_steps, dtype=jnp.int32)
        (states, keys, shared), trace = lax.scan(body, (states, keys, shared), steps)
        return (
            states,
            jtu.tree_map(lambda x: jnp.swapaxes(x, 0, 1), trace),
            keys,
            shared,
        )

    return loop(init, keys, shared)


def _host(tree):
    """`tree` on the host, typed keys as their data: compared whatever the devices."""

    def host(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jr.key_data(x)
        return np.asarray(x)

    return jtu.tree_map(host, tree)


# ------------------------------------------------------------------------------------
# The same numbers as the loop by hand.


@settings(max_examples=6, deadline=None)
@given(num_chains=st.sampled_from([2, 5, 8]), num_steps=st.integers(1, 30))
def test_one_problem_is_the_loop_by_hand_bit_for_bit(num_chains, num_steps):
    init = make_adapting_init(num_chains)
    result = eb.run_chains(STEP, init, jr.key(3), num_steps, shared=ADAPTING_SHARED)
    final, trace, keys, shared = by_hand(
        adapting,
        init,
        jr.key(3),
        num_steps,
        ADAPTING_SHARED,
        sharding=result.final["x"].sharding,
    )
    assert_trees_identical(_host(result.final), _host(final))
    assert_trees_identical(_host(result.trace), _host(trace))
    assert_trees_identical(_host(result.shared), _host(shared))
    assert result.problems is None


def test_the_scale_adapts_and_the_count_is_every_acceptance():
    init = make_adapting_init(16)
    result = eb.run_chains(
        STEP,
        init,
        jr.key(0),
        400,
        shared={"log_scale": -3.0, "accepted": 0},  # Python numbers are carried too
    )
    scale = float(np.exp(result.shared["log_scale"]))
    # A 3-d standard normal accepts 0.44 of random-walk proposals near scale 1.7.
    assert 1.0 < scale < 3.0, scale
    path = np.concatenate([init["x"][:, None], np.asarray(result.trace["x"])], 1)
    moved = np.sum(np.any(np.diff(path, axis=1) != 0, -1))
    assert int(result.shared["accepted"]) == moved
    assert result.shared["log_scale"].dtype == jnp.float32
    assert result.shared["accepted"].dtype == jnp.int32


def test_many_problems_are_the_nested_loop_by_hand_and_each_its_run_alone():
    problems, each, steps = 3, 4, 25
    data = jnp.array([-2.0, 0.0, 5.0])
    shared = {
        "log_scale": jnp.array([-1.0, 0.0, 1.0]),
        "accepted": jnp.zeros(3, jnp.int32),
    }
    init = make_adapting_init(problems * each)
    step = eb.all_chains(adapting_on)
    result = eb.run_chains(step, init, jr.key(1), steps, shared=shared, data=data)
    assert result.shared is None and result.problems is not None
    final, trace, _, by_hand_shared = by_hand(
        adapting_on,
        init,
        jr.key(1),
        steps,
        shared,
        data,
        each,
        sharding=result.final["x"].sharding,
    )
    assert_trees_identical(_host(result.final), _host(final))
    assert_trees_identical(_host(result.trace), _host(trace))
    assert_trees_identical(_host(result.problems.shared), _host(by_hand_shared))
    keys = jr.split(jr.key(1), problems * each)
    for p in range(problems):
        rows = slice(p * each, (p + 1) * each)
        alone = eb.run_chains(
            step,
            jtu.tree_map(lambda x, rows=rows: x[rows], init),
            keys[rows],
            steps,
            shared=jtu.tree_map(lambda x, p=p: x[p : p + 1], shared),
            data=data[p : p + 1],
        )
        mine = result.problem(p)
        assert alone.problems is not None
        assert_trees_identical(_host(mine.final), _host(alone.final))
        assert_trees_identical(_host(mine.trace), _host(alone.trace))
        assert_trees_identical(
            _host(mine.shared),
            _host(jtu.tree_map(lambda x: x[0], alone.problems.shared)),
        )


def test_the_trace_records_the_states_as_carried():
    # 2 problems of 8 chains, each problem on a device of its own: every draw is the
    # state of the loop by hand, bit for bit (XLA once computed the recorded copy in
    # a fusion of its own, an ulp away at some steps).
    init = {"x": jnp.repeat(jnp.linspace(-4.0, 4.0, 24).reshape(8, 3), 2, axis=0)}
    data = jnp.array([0.0, 3.0])
    shared = {"log_scale": jnp.array([-4.0, 0.5]), "accepted": jnp.zeros(2, jnp.int32)}
    step = eb.all_chains(adapting_on)
    result = eb.run_chains(step, init, jr.key(2), 60, data=data, shared=shared)
    final, trace, _, _ = by_hand(
        adapting_on, init, jr.key(2), 60, shared, data, 8, result.final["x"].sharding
    )
    assert_trees_identical(_host(result.trace), _host(trace))
    assert_trees_identical(_host(result.final), _host(final))


def test_with_output_records_the_outputs_and_not_the_shared_state():
    def fn(states, keys, count, shared):
        new, new_shared = adapting(states, keys, count, shared)
        return new, new_shared, {"scale": jnp.full(keys.shape[0], shared["log_scale"])}

    result = eb.run_chains(
        eb.all_chains(fn),
        make_adapting_init(4),
        jr.key(0),
        10,
        shared=ADAPTING_SHARED,
        with_output=True,
        diagnostics=True,
    )
    assert set(result.trace) == {"x"}
    assert result.outputs["scale"].shape == (4, 10)
    # The shared state is neither recorded nor diagnosed: only the chains' own.
    assert result.diagnostics is not None
    assert set(result.diagnostics.rhat) == {"x"}
    np.testing.assert_array_equal(result.outputs["scale"][:, 0], 0.0)
    assert float(result.outputs["scale"][0, -1]) != 0.0


def test_a_shared_state_gone_nan_marks_every_chain_of_its_problem_only():
    @eb.all_chains
    def fn(states, keys, count, shared, data):
        bad = (count == 3) & (data == 1.0)
        return states + 1.0, {"s": jnp.where(bad, jnp.nan, shared["s"])}

    result = eb.run_chains(
        fn,
        jnp.zeros((6, 2)),
        jr.key(0),
        6,
        shared={"s": jnp.ones(3)},
        data=jnp.array([0.0, 1.0, 2.0]),
    )
    np.testing.assert_array_equal(result.nonfinite.first_step, [0, 0, 4, 4, 0, 0])
    assert result.problems is not None
    assert np.isnan(result.problems.shared["s"][1])
    np.testing.assert_array_equal(np.asarray(result.problems.shared["s"])[[0, 2]], 1.0)


# ------------------------------------------------------------------------------------
# With the other options.


def test_until_superchains_and_progress_freeze_each_problem_s_shared_state(capsys):
    # 2 problems x 4 superchains x 2 chains. Each problem's count of acceptances
    # matches its own trace: its shared state stopped with its chains.
    problems, superchains, each = 2, 8, 8
    data = jnp.array([0.0, 3.0])
    starts = jnp.linspace(-4.0, 4.0, superchains * 3).reshape(superchains, 3)
    shared = {"log_scale": jnp.array([-4.0, 0.5]), "accepted": jnp.zeros(2, jnp.int32)}
    result = eb.run_chains(
        eb.all_chains(adapting_on),
        {"x": starts},
        jr.split(jr.key(2), problems * each),
        2000,
        superchains=superchains,
        until=eb.converged(every=100),
        data=data,
        shared=shared,
        progress=True,
    )
    assert "run_chains" in capsys.readouterr().err
    assert result.problems is not None and result.problems.stopped is not None
    initial = np.repeat(np.asarray(starts), 2, axis=0)
    for p in range(problems):
        mine = result.problem(p)
        trace = np.concatenate(
            [initial[p * each : (p + 1) * each, None], np.asarray(mine.trace["x"])], 1
        )
        moved = np.sum(np.any(np.diff(trace, axis=1) != 0, -1))
        assert int(mine.shared["accepted"]) == moved
        assert mine.trace["x"].shape[1] == result.problems.steps_done[p]
    assert len(set(result.problems.steps_done.tolist())) == 2, (
        "no problem stopped first"
    )


def test_trace_on_disk_is_the_trace_in_memory(tmp_path):
    on_disk = eb.run_chains(
        STEP,
        make_adapting_init(6),
        jr.key(0),
        30,
        shared=ADAPTING_SHARED,
        trace="disk",
        checkpoint=tmp_path / "disk.ckpt",
        checkpoint_every=7,
    )
    in_memory = eb.run_chains(
        STEP, make_adapting_init(6), jr.key(0), 30, shared=ADAPTING_SHARED
    )
    read = {"x": np.asarray(on_disk.trace["x"])}
    assert_trees_identical(read, _host(in_memory.trace))
    for name in ("final", "keys", "shared"):
        assert_trees_identical(outputs(on_disk)[name], outputs(in_memory)[name])


def test_a_finished_checkpoint_reads_back_its_shared_state(tmp_path):
    path = tmp_path / "run.ckpt"
    first = run_workload("adapting", 8, 40, checkpoint=str(path), checkpoint_every=10)
    again = run_workload("adapting", 8, 40, checkpoint=str(path), checkpoint_every=10)
    assert_trees_identical(outputs(again), outputs(first))
    plain = run_workload("adapting", 8, 40)
    assert_trees_identical(outputs(first), outputs(plain))


def test_a_shared_state_of_keys_and_dtypes_is_checkpointed_as_it_is(tmp_path):
    # Typed keys, two dtypes and a vector: packed apart by dtype, read back whole.
    @eb.all_chains
    def fn(states, keys, count, shared):
        key, sub = jr.split(shared["key"])
        scale = shared["scale"] * 0.9
        moved = states + scale[0] * jr.normal(sub, states.shape)
        return moved, {"key": key, "n": shared["n"] + 1, "scale": scale}

    shared = {"key": jr.key(7), "n": 0, "scale": np.array([1.0, 2.0], np.float32)}

    def run(**options):
        return eb.run_chains(
            fn, jnp.zeros((4, 2)), jr.key(0), 12, shared=shared, **options
        )

    path = tmp_path / "keys.ckpt"
    first = run(checkpoint=path, checkpoint_every=5)
    again = run(checkpoint=path, checkpoint_every=5)
    plain = run()
    for result in (first, again):
        assert_trees_identical(outputs(result), outputs(plain))
    assert plain.shared is not None
    assert int(plain.shared["n"]) == 12
    np.testing.assert_allclose(plain.shared["scale"], [0.9**12, 2 * 0.9**12], 1e-5)
    expected = jr.key(7)
    for _ in range(12):
        expected, _ = jr.split(expected)
    assert_trees_identical(plain.shared["key"], expected)


def test_a_run_killed_mid_way_resumes_on_another_layout_bit_for_bit(tmp_path):
    # On one device in another process, SIGKILLed once it has checkpointed; resumed
    # here, on this process's devices.
    path, out = tmp_path / "run.ckpt", tmp_path / "out.eqx"
    run = ("adapting", 8, 3000)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    args = [str(RUN_WORKER), str(out), *map(str, run), str(path), "100"]
    kill_once_checkpointed(args, path, out, env)
    resumed = run_workload(*run, checkpoint=str(path), checkpoint_every=100)
    plain = run_workload(*run)
    assert_trees_identical(outputs(resumed), outputs(plain))


def test_another_shared_start_is_another_run_for_its_checkpoint(tmp_path):
    path = tmp_path / "run.ckpt"
    init = make_adapting_init(4)
    eb.run_chains(STEP, init, jr.key(0), 5, shared=ADAPTING_SHARED, checkpoint=path)
    other = {**ADAPTING_SHARED, "log_scale": jnp.float32(1.0)}
    raises(
        "different run",
        lambda: eb.run_chains(STEP, init, jr.key(0), 5, shared=other, checkpoint=path),
        "shared values: `shared` holds other values",
    )


def test_a_job_of_two_processes_gives_the_bits_of_one(tmp_path):
    out = tmp_path / "job.eqx"
    launch(JOB_RUN_WORKER, [str(out), "adapting", "8", "40"], devices_per_process=2)
    here = outputs(run_workload("adapting", 8, 40))
    for process_id in range(2):
        assert_trees_identical(eb.load(f"{out}.{process_id}", here), here)


# ------------------------------------------------------------------------------------
# What is refused.


def test_a_per_chain_step_with_shared_is_refused():
    raises(
        "`shared` is given",
        lambda: eb.run_chains(
            lambda x, key: x, jnp.zeros(4), jr.key(0), 3, shared={"a": 1.0}
        ),
        "eb.all_chains",
    )


def test_a_step_without_the_shared_argument_names_the_call():
    step = eb.all_chains(lambda states, keys, count: states)
    raises(
        r"fn\(states, keys, count, shared\)",
        lambda: eb.run_chains(step, jnp.zeros(4), jr.key(0), 3, shared={"a": 1.0}),
    )
    with_shared = eb.all_chains(lambda states, keys, count, shared: (states, shared))
    raises(
        r"without `shared` it is called as `fn\(states, keys, count\)`",
        lambda: eb.run_chains(with_shared, jnp.zeros(4), jr.key(0), 3),
    )
    raises(
        r"fn\(states, keys, count, shared, data\)",
        lambda: eb.run_chains(
            with_shared,
            jnp.zeros(4),
            jr.key(0),
            3,
            shared={"a": jnp.zeros(2)},
            data=jnp.zeros(2),
        ),
    )


def test_a_step_that_changes_the_shared_state_is_refused_naming_the_leaf():
    @eb.all_chains
    def fn(states, keys, count, shared):
        return states, {"scale": shared["scale"].astype(jnp.float16)}

    raises(
        "shape or dtype of `shared`",
        lambda: eb.run_chains(
            fn, jnp.zeros(4), jr.key(0), 3, shared={"scale": jnp.float32(1.0)}
        ),
        "`shared['scale']` is float32[]",
        "float16[]",
    )

    @eb.all_chains
    def dropped(states, keys, count, shared):
        return states, {}

    raises(
        "structure of `shared`",
        lambda: eb.run_chains(dropped, jnp.zeros(4), jr.key(0), 3, shared={"a": 1.0}),
    )


def test_a_step_that_returns_no_shared_state_is_refused():
    raises(
        r"returns `\(states, shared\)`",
        lambda: eb.run_chains(
            eb.all_chains(lambda s, k, c, sh: s), jnp.zeros(4), jr.key(0), 3, shared=1.0
        ),
    )
    raises(
        r"returns `\(states, shared, outputs\)`",
        lambda: eb.run_chains(
            eb.all_chains(lambda s, k, c, sh: (s, sh)),
            jnp.zeros(4),
            jr.key(0),
            3,
            shared=1.0,
            with_output=True,
        ),
    )


def test_shared_rows_that_do_not_match_the_problems_are_refused():
    raises(
        r"one row per problem \(3\)",
        lambda: eb.run_chains(
            eb.all_chains(adapting_on),
            make_adapting_init(6),
            jr.key(0),
            3,
            shared=ADAPTING_SHARED,  # one problem's, not three rows
            data=jnp.zeros(3),
        ),
        "`shared['accepted']` is int32[]",
    )


def test_a_shared_state_with_no_array_or_another_leaf_is_refused():
    raises(
        "with no array",
        lambda: eb.run_chains(STEP, make_adapting_init(4), jr.key(0), 3, shared={}),
    )
    raises(
        "arrays and numbers only",
        lambda: eb.run_chains(
            STEP, make_adapting_init(4), jr.key(0), 3, shared={"a": 1.0, "b": "x"}
        ),
        "`shared['b']` is 'x'",
    )


@pytest.mark.parametrize("until", [None, eb.converged(every=50)])
def test_chunks_of_whole_problems_are_the_unchunked_run(until, tmp_path):
    data = jnp.array([-2.0, 0.0, 5.0, 1.0])
    shared = {
        "log_scale": jnp.array([-1.0, 0.0, 1.0, 0.5]),
        "accepted": jnp.zeros(4, jnp.int32),
    }
    starts = {"x": jnp.linspace(-3.0, 3.0, 8 * 3).reshape(8, 3)}

    def run(**options):
        return eb.run_chains(
            eb.all_chains(adapting_on),
            starts,
            jr.split(jr.key(1), 16),  # 4 problems x 2 superchains x 2 chains
            400,
            shared=shared,
            data=data,
            superchains=8,
            until=until,
            **options,
        )

    whole = run()
    assert whole.problems is not None
    for chunk_size in (8, 12):
        chunked = run(chunk_size=chunk_size, checkpoint=tmp_path / f"{chunk_size}.ckpt")
        assert chunked.problems is not None
        assert_trees_identical(_host(outputs(chunked)), _host(outputs(whole)))
        assert_trees_identical(
            _host(chunked.problems.shared), _host(whole.problems.shared)
        )
        np.testing.assert_array_equal(
            chunked.problems.steps_done, whole.problems.steps_done
        )


def test_chunks_that_split_a_problem_are_refused():
    raises(
        "chunk_size=6",
        lambda: eb.run_chains(
            eb.all_chains(adapting_on),
            make_adapting_init(16),
            jr.key(0),
            3,
            shared={"log_scale": jnp.zeros(4), "accepted": jnp.zeros(4, jnp.int32)},
            data=jnp.zeros(4),
            chunk_size=6,
        ),
        "pass a multiple of 4",
    )
    raises(
        "chunk_size=2",
        lambda: eb.run_chains(
            STEP,
            make_adapting_init(4),
            jr.key(0),
            3,
            shared=ADAPTING_SHARED,
            chunk_size=2,
        ),
        "pass None",
    )


def test_no_chain_runs_without_shared_and_is_refused_with_it():
    empty = jnp.zeros((0, 2))
    result = eb.run_chains(eb.all_chains(lambda s, k, c: s), empty, jr.key(0), 3)
    assert result.final.shape == (0, 2)
    raises(
        "holds no chain",
        lambda: eb.run_chains(
            eb.all_chains(lambda s, k, c, shared: (s, shared)),
            empty,
            jr.key(0),
            3,
            shared={"a": 1.0},
        ),
    )
