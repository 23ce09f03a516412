"""Many problems in one run (`run_chains(..., data=data)`): each problem's chains are
those of running it alone, bit for bit, however the run is chunked, placed, split over
processes, checkpointed or killed; and bad input is refused naming the fix."""

import functools as ft
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from chains_workloads import everything
from helpers import (
    assert_trees_identical,
    checkpoint_steps_done,
    compilations,
    raises,
    tree_allclose,
)
from multiprocess_launch import launch
from problems_workloads import (
    ar1_problem,
    posterior,
    problems_run,
    RHOS,
    SCHOOL_LABELS,
    schools_data,
    schools_init,
    schools_step,
    stopping_problems_run,
    wide_rows,
)

import eqx_batch as eb
from eqx_batch._chains import _placement
from eqx_batch._chains._problems import ProblemStep


TESTS = pathlib.Path(__file__).parent
PROBLEMS_WORKER = TESTS / "problems_worker.py"


def _alone(result: eb.Chains, p: int, **options) -> eb.Chains:
    """Problem `p` of `problems_run` run alone: its starts, keys and row of the data,
    the row an argument of the loop (a partial), as `data` is."""
    row = jax.tree.map(lambda x: x[p], schools_data(6))
    return eb.run_chains(
        ft.partial(schools_step, data=row),
        jax.tree.map(lambda x: x[2 * p : 2 * p + 2], schools_init(12)),
        jr.split(jr.key(5), 36)[6 * p : 6 * p + 6],
        60,
        thin=2,
        superchains=2,
        diagnostics=True,
        **options,
    )


def _read(tree):
    """`tree` with its `trace="disk"` leaves read."""
    return jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x)) if isinstance(x, eb.DiskArray) else x,
        tree,
        is_leaf=lambda x: isinstance(x, eb.DiskArray),
    )


def _own(result: eb.Chains) -> dict:
    """What a problem's result holds that its run alone must equal bit for bit."""
    return {
        "final": result.final,
        "trace": result.trace,
        "keys": result.keys,
        "superchain": result.superchain,
        "nonfinite": result.nonfinite,
    }


@pytest.mark.accelerator
@pytest.mark.parametrize("chunk_size", [None, 10])
def test_each_problem_is_its_run_alone(chunk_size):
    # 36 chains over 4 devices (padded), and in chunks of 10 that cut problems apart.
    result = problems_run(chunk_size=chunk_size)
    problems = result.problems
    assert problems is not None and problems.count == 6
    assert result.trace["eta"].shape == (36, 30, 8)
    # One problem's shape beside `problems`, which holds each problem's values.
    assert result.steps_done == 60 and result.stopped is None
    assert result.diagnostics is None and problems.stopped is None
    assert problems.steps_done.dtype == np.int64
    assert problems.steps_done.tolist() == [60] * 6
    assert problems.draws_made.tolist() == [30] * 6
    assert problems.diagnostics is not None
    assert problems.diagnostics.nested_rhat["eta"].shape == (6, 8)
    for p in range(6):
        mine, alone = result.problem(p), _alone(result, p)
        assert_trees_identical(_own(mine), _own(alone))
        assert mine.problems is None and mine.steps_done == 60
        assert np.asarray(mine.superchain).tolist() == [0, 0, 0, 1, 1, 1]
        # Computed for every problem in one program: equal to the last bits or so.
        assert tree_allclose(mine.diagnostics, alone.diagnostics, rtol=1e-6)
    # The problems differ: each chain read its own problem's row.
    assert not np.array_equal(
        result.problem(0).trace["mu"], result.problem(1).trace["mu"]
    )


def _ar1_problems(num_steps: int) -> eb.Chains:
    """The AR(1) step of 6 problems, each its own `rho` of `RHOS`, 32 chains a
    problem from 4 starts far apart."""
    return eb.run_chains(
        ar1_problem,
        jnp.tile(jnp.linspace(-3.0, 3.0, 4)[:, None], (6 * 8, 2)),
        jr.split(jr.key(0), 6 * 32),
        num_steps,
        data={"rho": jnp.asarray(RHOS)},
    )


def _ar1_alone(p: int, step: Any, num_steps: int) -> eb.Chains:
    """Problem `p` of `_ar1_problems` run alone, with `step` as its step."""
    return eb.run_chains(
        step,
        jnp.tile(jnp.linspace(-3.0, 3.0, 4)[:, None], (8, 2)),
        jr.split(jr.key(0), 6 * 32)[32 * p : 32 * p + 32],
        num_steps,
    )


def test_a_problem_is_its_run_alone_given_its_row_as_an_argument():
    # The row given as the one call gives it, an argument of the loop: bit for bit,
    # `rho = 0.9` and `0.99` too, whose scale `sqrt(1 - rho**2)` rounds
    # differently when `rho` is a constant (the test below).
    result = _ar1_problems(20)
    for p in range(6):
        row = {"rho": jnp.asarray(RHOS)[p]}
        alone = _ar1_alone(p, ft.partial(ar1_problem, data=row), 20)
        assert_trees_identical(_own(result.problem(p)), _own(alone))


def test_a_row_closed_over_as_a_constant_may_round_differently():
    # XLA folds `sqrt(1 - rho**2)` of a constant `rho` op by op, rounding `rho**2`
    # first; its CPU code computes `1 - rho * rho` of a `rho` it is given as one
    # fused multiply-add, rounded once. Where the two scales are equal, so are the
    # runs; where they are not (0.9 and 0.99 on a CPU with FMA), the first step's
    # draws differ by 2 ULP at most.
    def scale(rho: jax.Array) -> jax.Array:
        return jnp.sqrt(1 - rho**2)

    result = _ar1_problems(1)
    for p, rho in enumerate(RHOS):
        folded = jax.jit(lambda rho=rho: scale(jnp.asarray(rho)))()
        computed = jax.jit(scale)(jnp.asarray(rho))
        closed = {"rho": jnp.asarray(rho)}  # a constant of the program
        alone = _ar1_alone(
            p, lambda state, key, row=closed: ar1_problem(state, key, row), 1
        )
        mine = np.asarray(result.problem(p).trace)
        assert np.array_equal(mine, alone.trace) == bool(folded == computed), p
        np.testing.assert_array_max_ulp(mine, np.asarray(alone.trace), maxulp=2)


def test_outputs_and_a_nonfinite_chain_are_the_problems_own():
    def step(x, key, data):
        new = data["scale"] * x + jr.normal(key, x.shape)
        return new, {"size": jnp.sum(new**2)}

    data = {"scale": jnp.array([0.5, 1.0, 1e30])}  # problem 2 overflows
    init = jnp.ones((6, 2))
    result = eb.run_chains(step, init, jr.key(1), 5, data=data, with_output=True)
    keys = jr.split(jr.key(1), 6)
    for p in range(3):
        alone = eb.run_chains(
            ft.partial(step, data={"scale": data["scale"][p]}),
            init[2 * p : 2 * p + 2],
            keys[2 * p : 2 * p + 2],
            5,
            with_output=True,
        )
        mine = result.problem(p)
        assert_trees_identical(
            (mine.trace, mine.outputs, mine.nonfinite),
            (alone.trace, alone.outputs, alone.nonfinite),
        )
    assert result.nonfinite.chains.tolist() == [4, 5]
    assert result.problem(2).nonfinite.chains.tolist() == [0, 1]
    assert result.problem(1).nonfinite.chains.tolist() == []


def test_new_data_of_the_same_shapes_runs_the_same_program():
    # `data` is an argument of the compiled loop, not a constant baked into it.
    def step(x, key, data):
        return x + data

    def run(data):
        return eb.run_chains(step, jnp.zeros(4), jr.key(0), 3, data=jnp.array(data))

    first = run([1.0, 2.0])
    assert compilations(lambda: run([3.0, 4.0])) == 0
    # The control: data of another shape is another program.
    assert compilations(lambda: run([1.0, 2.0, 3.0, 4.0])) > 0
    assert first.final.tolist() == [3.0, 3.0, 6.0, 6.0]
    assert run([3.0, 4.0]).final.tolist() == [9.0, 9.0, 12.0, 12.0]


def test_a_leaf_of_data_that_is_not_an_array_is_given_as_it_is():
    # Only `data`'s arrays hold a row per problem and go to the devices (with the
    # chains, in one program); any other leaf reaches every problem's step unchanged.
    def step(x, key, data):
        return x + data["shift"] * data["scale"]

    data = {"shift": jnp.array([1.0, 2.0]), "scale": 3.0}
    result = eb.run_chains(step, jnp.zeros(4), jr.key(0), 2, data=data)
    assert result.final.tolist() == [6.0, 6.0, 12.0, 12.0]


@pytest.mark.parametrize("copied_below", [0, 1 << 30])
@pytest.mark.parametrize("where", ["fresh", "host", "another device"])
def test_init_and_data_are_placed_from_wherever_they_are(where, copied_below):
    # The chains go to their devices by one program if they are small for those
    # devices and committed nowhere, else by `device_put` (`_placement._put_on`);
    # either way, from wherever they are, the run is the same.
    def run(init: dict, data: dict) -> eb.Chains:
        return eb.run_chains(schools_step, init, jr.split(jr.key(5), 12), 20, data=data)

    init, data = schools_init(12), schools_data(6)
    expected = run(init, data)
    if where == "host":
        init, data = jax.tree.map(np.asarray, (init, data))
    elif where == "another device":
        init, data = jax.device_put((init, data), jax.devices()[-1])
    with pytest.MonkeyPatch.context() as patch:
        platform = jax.devices()[0].platform
        patch.setattr(_placement, "_COPIED_BELOW", {platform: copied_below})
        got = run(init, data)
    assert_trees_identical((got.final, got.trace), (expected.final, expected.trace))


def test_a_disk_trace_of_one_problem_is_read_lazily(tmp_path):
    result = problems_run(str(tmp_path / "run"), trace="disk")
    memory = problems_run()
    mine = result.problem(4)
    leaf = mine.trace["eta"]
    assert isinstance(leaf, eb.DiskArray) and leaf.shape == (6, 30, 8)
    assert np.array_equal(
        leaf[2, -3:, 1], np.asarray(memory.problem(4).trace["eta"])[2, -3:, 1]
    )
    assert_trees_identical(_read(mine.trace), _read(memory.problem(4).trace))
    posterior = mine.to_arviz()["posterior"]
    assert posterior["eta"].shape == (6, 30, 8)
    assert np.asarray(posterior["superchain"]).tolist() == [0, 0, 0, 1, 1, 1]


def test_a_saved_disk_trace_of_one_problem_holds_its_numbers(tmp_path):
    mine = problems_run(str(tmp_path / "run"), trace="disk").problem(4).trace
    eb.save(tmp_path / "kept", mine)
    for path in tmp_path.glob("run*"):
        path.unlink()
    back = eb.load(tmp_path / "kept", like=mine)
    memory = problems_run().problem(4).trace
    assert_trees_identical(back, {k: np.asarray(v) for k, v in memory.items()})


def test_other_data_is_another_run(tmp_path):
    path = str(tmp_path / "run")
    problems_run(path)
    other = schools_data(6)
    other["y"] = other["y"].at[3, 0].add(1.0)
    with pytest.raises(eb.BatchError, match="data values: `data` holds other values"):
        eb.run_chains(
            schools_step,
            schools_init(12),
            jr.split(jr.key(5), 36),
            60,
            thin=2,
            data=other,
            superchains=12,
            diagnostics=True,
            checkpoint=path,
            checkpoint_every=20,
        )
    # The same data reads the finished run back.
    assert_trees_identical(everything(problems_run(path)), everything(problems_run()))


@pytest.mark.parametrize("written_with_data", [True, False], ids=["data", "no data"])
def test_resuming_with_or_without_data_names_data(tmp_path, written_with_data):
    path = tmp_path / "run.ckpt"
    init, data = jnp.zeros((6, 2)), {"shift": jnp.ones(3)}

    def with_data() -> eb.Chains:
        return eb.run_chains(_step, init, jr.key(0), 20, data=data, checkpoint=path)

    def without_data() -> eb.Chains:
        return eb.run_chains(lambda x, k: x + 1.0, init, jr.key(0), 20, checkpoint=path)

    if written_with_data:
        with_data()
        expected = "written with `data=` (3 problems), this call has no `data`"
        message = raises(re.escape(expected), without_data)
    else:
        without_data()
        expected = "written without `data`, this call has `data=` (3 problems)"
        message = raises(re.escape(expected), with_data)
    # Not "`step` computes something else": it is the same step, given no row.
    assert "step program" not in message


def _killed_at(run: str, path: pathlib.Path, steps: int) -> int:
    """Runs `run` (a call of `problems_workloads`, given the checkpoint's path as
    `path`) in a process SIGKILLed once its checkpoint holds `steps` steps; the steps
    it holds then."""
    script = (
        f"import sys\nfrom problems_workloads import *\npath = sys.argv[1]\n{run}\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=TESTS)
    try:
        deadline = time.monotonic() + 300
        while checkpoint_steps_done(path) < steps:
            assert worker.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "no checkpoint in 300 s"
            time.sleep(0.02)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    return checkpoint_steps_done(path)


def test_killed_and_resumed_equals_one_run(tmp_path):
    path = tmp_path / "run"
    run = ft.partial(problems_run, num_steps=20000, thin=50, checkpoint_every=200)
    done = _killed_at(
        "problems_run(path, num_steps=20000, thin=50, checkpoint_every=200)", path, 400
    )
    assert 400 <= done < 20000
    resumed, plain = run(str(path)), run()
    assert_trees_identical(everything(resumed), everything(plain))
    assert_trees_identical(everything(resumed.problem(5)), everything(plain.problem(5)))


@pytest.mark.parametrize("until", [False, True], ids=["fixed", "until"])
def test_a_job_of_two_processes_runs_each_problem_as_one(tmp_path, until):
    out = tmp_path / "problems"
    launch(PROBLEMS_WORKER, [str(out), "until" if until else "fixed"], timeout=480)
    here = stopping_problems_run() if until else problems_run()
    for process_id in range(2):
        whole = eb.load(f"{out}.{process_id}", everything(here))
        assert_trees_identical(whole, everything(here))
        one = eb.load(f"{out}.one.{process_id}", everything(here.problem(1)))
        assert_trees_identical(one, everything(here.problem(1)))
        # Its `to_arviz()`, in each process with no gathering, as in one process.
        expected = posterior(
            here.problem(1).to_arviz(**({} if until else SCHOOL_LABELS))
        )
        converted = eb.load(f"{out}.arviz.{process_id}", expected)
        assert_trees_identical(converted, expected)


def _alone_until(p: int, num_steps: int = 3000) -> eb.Chains:
    """Problem `p` of `stopping_problems_run` run alone, with its own `until`."""
    starts = jnp.tile(jnp.linspace(-3.0, 3.0, 4)[:, None], (6, 2))
    return eb.run_chains(
        ft.partial(ar1_problem, data={"rho": jnp.asarray(RHOS[p])}),
        starts[4 * p : 4 * p + 4],
        jr.split(jr.key(0), 6 * 4 * 8)[32 * p : 32 * p + 32],
        num_steps,
        thin=2,
        superchains=4,
        until=eb.converged(every=50),
    )


def _stops(result: eb.Chains) -> dict:
    stopped = result.stopped
    assert stopped is not None
    return {
        "steps_done": np.int64(result.steps_done),
        "stopped": (stopped.step, stopped.converged, stopped.reason),
        "window": stopped.window_start,
        "checks": stopped.checks,
        "worst": stopped.worst,
    }


@pytest.fixture(scope="module")
def alone_until() -> list[eb.Chains]:
    return [_alone_until(p) for p in range(6)]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, marks=pytest.mark.accelerator),
        {"chunk_size": 40},
        {"trace": "disk"},
        {"progress": True, "chunk_size": 80},
        {"trace": False},
        {"wide": True},
        {"wide": True, "chunk_size": 40},
    ],
    ids=["whole", "chunks", "disk", "bar", "no trace", "wide", "wide chunks"],
)
def test_each_problem_stops_where_it_would_alone(tmp_path, alone_until, options):
    # Each problem's check is made on its own chains, and a problem that stops
    # leaves the batch (compaction): what is left of it is its run alone, bit for
    # bit, its trace cut at its own stop.
    checkpoint = str(tmp_path / "run") if options.get("trace") == "disk" else None
    result = stopping_problems_run(checkpoint, **options)
    problems = result.problems
    assert problems is not None
    steps = problems.steps_done
    assert steps.dtype == np.int64 and steps.shape == (6,), steps
    assert len(set(steps.tolist())) > 2, steps
    assert problems.stopped is not None and len(problems.stopped) == 6
    assert [s.step for s in problems.stopped] == steps.tolist()
    assert problems.draws_made.dtype == np.int64
    assert problems.draws_made.tolist() == (steps // 2).tolist()
    # The fields beside `problems` keep one problem's types.
    assert result.steps_done == steps.max() and type(result.steps_done) is int
    assert result.stopped is None and result.diagnostics is None
    assert problems.diagnostics is not None
    # Every problem's statistics are reduced over its chains in one program: on a TPU
    # they may round apart from the run alone's in the last bits (not on a CPU).
    rounds_apart = "chunk_size" in options or jax.default_backend() != "cpu"
    for p, alone in enumerate(alone_until):
        mine = result.problem(p)
        if rounds_apart:
            # See below: the same stops, statistics equal to the last bits or so.
            (a, b), (ra, rb) = (_stops(mine), _stops(alone)), (mine, alone)
            assert a["steps_done"] == b["steps_done"] and a["window"] == b["window"]
            assert a["stopped"][:2] == b["stopped"][:2]
            assert np.array_equal(a["checks"], b["checks"])
            assert np.allclose(a["worst"], b["worst"], rtol=1e-5), (ra, rb)
        else:
            assert_trees_identical(_stops(mine), _stops(alone))
        if result.trace is None:
            assert_trees_identical(_own(mine), {**_own(alone), "trace": None})
            continue
        if "chunk_size" in options:
            # Chunks of 40 or 80 chains: on JAX 0.8.1, XLA's CPU code for
            # `jr.normal` rounds some draws by a chain's place in its batch (in its
            # vector loop or its remainder, as in chunks of 40 over 4 devices, 10
            # chains each), so a chunked run and the run alone may differ in the
            # last bits (its stops above are equal). JAX 0.10.2 gives them bit for
            # bit.
            assert tree_allclose(_read(_own(mine)), _own(alone), rtol=1e-5)
        else:
            assert_trees_identical(_read(_own(mine)), _own(alone))
        # A stopped problem's rows hold zeros after its draws.
        rows = np.asarray(result.trace)[32 * p : 32 * (p + 1)]
        assert not rows[:, problems.draws_made[p] :].any()
    if result.trace is None:
        return
    assert result.trace.shape == (192, steps.max() // 2, 2)
    posterior = result.problem(1).to_arviz()["posterior"]
    assert posterior["state"].shape == (32, problems.draws_made[1], 2)


@pytest.mark.accelerator
def test_problems_that_stop_early_are_compacted_out():
    # Half the problems stop at the first check, the other half run far longer: the
    # longer half runs alone in a smaller batch, and still each problem is its run
    # alone (the test above); here, that the run is not the slowest problem's for
    # all: the fast problems' final states are those at their own stops.
    result = stopping_problems_run()
    assert result.problems is not None
    fast = int(np.argmin(result.problems.steps_done))
    alone = _alone_until(fast, num_steps=result.steps_done)
    assert_trees_identical(result.problem(fast).final, alone.final)


def test_killed_after_some_problems_stopped_resumes_bit_for_bit(tmp_path):
    path = tmp_path / "run"
    # Past the first checks (50, 100): some problems have stopped.
    done = _killed_at("stopping_problems_run(path, num_steps=20000)", path, 120)
    resumed = stopping_problems_run(str(path), num_steps=20000)
    plain = stopping_problems_run(num_steps=20000)
    assert done < plain.steps_done, done
    assert_trees_identical(everything(resumed), everything(plain))
    for p in (0, 1):
        assert_trees_identical(_stops(resumed.problem(p)), _stops(plain.problem(p)))


def _step(x, key, data):
    return x + data["shift"]


def test_bad_input_is_refused_naming_the_fix():
    init = jnp.zeros((6, 2))
    data = {"shift": jnp.ones(3)}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            dict(data={"shift": jnp.ones(4)}),
            "4 problems, which do not divide the 6 chains",
        ),
        (
            dict(data={"shift": jnp.ones(3), "other": jnp.ones((2, 5))}),
            r"`data\['other'\]`: 2",
        ),
    ]
    for options, message in cases:
        with pytest.raises(eb.BatchError, match=message):
            eb.run_chains(_step, init, jr.key(0), 20, **options)
    with pytest.raises(eb.BatchError, match=r"called as `step\(state, key, data\)`"):
        eb.run_chains(lambda x, key: x, init, jr.key(0), 20, data=data)
    with pytest.raises(eb.BatchError, match="do not divide `superchains=4`"):
        eb.run_chains(
            _step,
            jnp.zeros((4, 2)),
            jr.split(jr.key(0), 8),
            20,
            data=data,
            superchains=4,
        )
    with pytest.raises(eb.BatchError, match="`eb.all_chains` step"):
        eb.run_chains(
            eb.all_chains(lambda s, k, count: s), init, jr.key(0), 20, data=data
        )
    result = eb.run_chains(_step, init, jr.key(0), 20, data=data)
    with pytest.raises(eb.BatchError, match=r"result.problem\(p\).to_arviz\(\)"):
        result.to_arviz()
    with pytest.raises(eb.BatchError, match="`p`"):
        result.problem(3)
    with pytest.raises(eb.BatchError, match="ran without `data`"):
        eb.run_chains(lambda x, key: x, init, jr.key(0), 2).problem(0)


@pytest.mark.parametrize(
    "data, expected, fix",
    [
        (
            [1.0, 2.0, 3.0],
            "`data` is [1.0, 2.0, 3.0], with no array",
            "stack each problem's row along axis 0",
        ),
        ({}, "`data` is {}, with no array", "stack each problem's row"),
        (
            {"shift": jnp.float32(1.0)},
            "`data['shift']` is a 0-d array (float32[]), with no row per problem",
            "(see docs/chains.md#many-problems-in-one-run)",
        ),
        (
            {"shift": jnp.zeros((0, 2))},
            "`data` holds no problem: `data['shift']` is float32[0,2]",
            "float32[0,2]",
        ),
    ],
    ids=["list of floats", "empty dict", "0-d leaf", "no problem"],
)
def test_data_that_is_not_rows_of_problems_is_refused_naming_data(data, expected, fix):
    raises(
        re.escape(expected),
        lambda: eb.run_chains(_step, jnp.zeros((6, 2)), jr.key(0), 20, data=data),
        fix,
    )


def _float_shapes(jaxpr: Any) -> set[tuple[int, ...]]:
    """The shapes of the floating-point arrays a jaxpr makes, its inner ones' too."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes |= {
            tuple(v.aval.shape)
            for v in eqn.outvars
            if jnp.issubdtype(v.aval.dtype, jnp.floating)
        }
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                shapes |= _float_shapes(inner)
    return shapes


@pytest.mark.parametrize("wide", [False, True])
def test_a_wide_row_is_given_once_per_problem_not_copied_per_chain(wide):
    # 6 problems of 32 chains: a row of one number is copied per chain before the
    # loop; a row of 12 KiB is sliced once per problem and each problem's chains
    # read it unbatched (no array of one row per chain is made).
    data = wide_rows({"rho": jnp.asarray(RHOS)}) if wide else {"rho": jnp.asarray(RHOS)}
    step = ProblemStep.of(ar1_problem, data)
    problem = jnp.repeat(jnp.arange(6, dtype=jnp.int32), 32)

    def segment_step(states: jax.Array, keys: jax.Array) -> Any:
        one_chain, map_chains = step.for_chains(problem, 32)
        return map_chains(one_chain, states, keys)

    states, keys = jnp.zeros((192, 2)), jr.split(jr.key(0), 192)
    shapes = _float_shapes(jax.make_jaxpr(segment_step)(states, keys).jaxpr)
    if wide:
        assert (6, 3072) in shapes and (192, 3072) not in shapes, shapes
        assert (192,) not in shapes
    else:
        assert (192,) in shapes
    rows = jax.tree.map(lambda x: x[problem], data)
    direct = jax.vmap(ar1_problem)(states, keys, rows)
    np.testing.assert_array_equal(segment_step(states, keys), direct)


_WRITTEN_AFTER_THE_CALL = """
import numpy as np, jax, jax.numpy as jnp, jax.random as jr
import eqx_batch as eb

def step(x, key, data):
    return x * data["c"] + 0.1 * jr.normal(key, x.shape)

def aligned(shape, value):
    # JAX's CPU client aliases a NumPy array whose memory is 64-byte aligned.
    size = int(np.prod(shape))
    memory = np.full(size + 16, value, np.float32)
    start = (-memory.ctypes.data % 64) // 4
    return memory[start : start + size].reshape(shape)

def arguments():
    return aligned((64, 16), 0.0), {"c": aligned((4,), 0.5)}

# Whether JAX aliases an argument, and whether the write lands while the loop still
# reads it, vary from call to call: each case is tried several times.
for num_steps in (0, 3, 200) * 4:
    init, data = arguments()
    result = eb.run_chains(step, init, jr.key(0), num_steps, data=data)
    init[:], data["c"][:] = 7.0, 2.0
    expected = eb.run_chains(step, arguments()[0], jr.key(0), num_steps,
                             data=arguments()[1])
    for got, want in ((result.final, expected.final), (result.trace, expected.trace)):
        assert np.array_equal(np.asarray(got), np.asarray(want)), num_steps
print("same")
"""


def test_numpy_arguments_written_after_the_call_do_not_reach_the_run():
    # The loop runs on after `run_chains` returns, and on one CPU device JAX may
    # alias a NumPy argument's memory: the run reads copies, so a caller's write
    # into `init` or `data` right after the call changes nothing of it. In a process
    # of its own, on one device (the suite's four split the arguments, which copies).
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.run(
        [sys.executable, "-c", _WRITTEN_AFTER_THE_CALL],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "same", proc.stderr[-2000:]
