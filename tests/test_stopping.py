"""`run_chains(until=eb.converged(...))`: stopping when converged, checked between
segments; chunked, killed and resumed, and read back, always at the same step."""

import dataclasses
import json
import pathlib
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import safetensors
from chains_workloads import ar1, stopping_run
from helpers import assert_trees_identical, checkpoint_steps_done

import eqx_batch as eb


TESTS = pathlib.Path(__file__).parent


def fast(x, key):
    """An AR(1) chain that forgets its start in tens of steps; stationary: N(0, 1)."""
    return 0.9 * x + 0.44 * jr.normal(key, x.shape)


def stuck(x, key):
    """A chain that never leaves its start: superchains never agree."""
    return x + 1e-3 * jr.normal(key, x.shape)


STARTS = jnp.array([[-3.0, 0.0], [-1.0, 1.0], [1.0, -1.0], [3.0, 2.0]])
KEYS = jr.split(jr.key(0), 4 * 32)


def _run(step=fast, num_steps=2000, **kwargs):
    kwargs.setdefault("until", eb.converged(every=50))
    return eb.run_chains(step, STARTS, KEYS, num_steps, superchains=4, **kwargs)


def _stopped(result: eb.Chains) -> eb.Stopped:
    assert isinstance(result.stopped, eb.Stopped)
    return result.stopped


def _outputs(result: eb.Chains) -> dict:
    return {
        "final": result.final,
        "trace": result.trace,
        "keys": result.keys,
        "steps_done": result.steps_done,
        "stopped": dataclasses.astuple(_stopped(result)),
        "diagnostics": result.diagnostics,
    }


@pytest.mark.accelerator
def test_stops_early_on_chains_that_mix():
    result = _run(burn_in=5, thin=3)
    stopped = _stopped(result)
    assert stopped.converged
    assert result.steps_done == stopped.step < 2000
    assert result.steps_done % 50 == 0
    assert stopped.checks[-1] == result.steps_done
    assert stopped.checks.dtype == np.int64 and stopped.worst.dtype == np.float64
    threshold = np.sqrt(1 + 4 / (16 * 32) + 1e-4)  # K = 4: a quarter of 1/M
    assert stopped.worst[-1] <= threshold < stopped.worst[0]
    assert "nested R-hat" in stopped.reason and "at state[" in stopped.reason
    assert stopped.window_start == stopped.checks[-2]
    # Only the draws made: those of `steps_done` steps after `burn_in`, every 3rd.
    made = -(-(result.steps_done - 5) // 3)
    assert result.trace.shape == (128, made, 2)
    # The chains after `steps_done` steps: what a plain run of that many steps gives.
    plain = eb.run_chains(
        fast, STARTS, KEYS, int(result.steps_done), superchains=4, burn_in=5, thin=3
    )
    assert_trees_identical(
        (result.final, result.keys, result.trace),
        (plain.final, plain.keys, plain.trace),
    )
    # The passing statistics describe the last window only; split R-hat's halves
    # would be those of the planned draws.
    assert result.diagnostics is not None and result.diagnostics.split_rhat is None
    assert float(jnp.max(result.diagnostics.nested_rhat)) == stopped.worst[-1]


def test_outputs_hold_the_draws_made_beside_the_same_trace():
    def step(x, key):
        new = fast(x, key)
        return new, {"first": new[0]}

    result = _run(step, burn_in=5, thin=3, with_output=True)
    plain = _run(burn_in=5, thin=3)
    assert result.steps_done == plain.steps_done < 2000
    # The states are the trace of the run without outputs, bit for bit, and the
    # outputs those of the same draws, the draws made.
    assert_trees_identical(result.trace, plain.trace)
    np.testing.assert_array_equal(result.outputs["first"], result.trace[..., 0])


def test_runs_to_the_cap_on_chains_that_cannot_mix():
    result = _run(stuck, num_steps=120)
    stopped = _stopped(result)
    assert not stopped.converged
    assert result.steps_done == stopped.step == 120
    assert "cap" in stopped.reason and "num_steps=120" in stopped.reason
    assert list(stopped.checks) == [50, 100, 120]
    assert np.all(stopped.worst > 2)
    assert result.trace.shape == (128, 120, 2)


def test_without_superchains_the_default_checks_classic_rhat():
    # Classic R-hat <= 1.01 needs windows of about 50 times the chains'
    # autocorrelation time (here about 19 steps).
    result = eb.run_chains(
        fast, jnp.linspace(-3, 3, 64), jr.key(1), 20_000, until=eb.converged(every=2000)
    )
    assert _stopped(result).converged and result.steps_done < 20_000
    reason = _stopped(result).reason
    assert reason.startswith("R-hat") and "at state <= 1.01" in reason
    # A classic R-hat threshold given replaces the default's.
    loose = eb.run_chains(
        fast,
        jnp.linspace(-3, 3, 64),
        jr.key(1),
        1000,
        until=eb.converged(rhat=1.2, every=100),
    )
    assert _stopped(loose).converged and "<= 1.2" in _stopped(loose).reason
    with pytest.raises(eb.BatchError, match="nested_rhat=1.1 but no `superchains`"):
        eb.run_chains(
            fast, jnp.zeros(8), jr.key(1), 100, until=eb.converged(nested_rhat=1.1)
        )


def test_every_criterion_must_hold():
    # An ESS no run of 128 chains reaches in 200 steps: never stops early.
    result = _run(num_steps=200, until=eb.converged(ess=1e6, every=50))
    assert not _stopped(result).converged and result.steps_done == 200
    reason = _stopped(result).reason
    assert (
        reason.startswith("reached the cap, num_steps=200: ESS") and "< 1e+06" in reason
    )
    # The default interval is a tenth of the cap.
    assert list(_stopped(_run(num_steps=200, until=eb.converged(ess=1e6))).checks) == [
        20 * i for i in range(1, 11)
    ]


def test_until_needs_a_cap():
    with pytest.raises(eb.BatchError, match="`until`.*`num_steps` is None"):
        _run(num_steps=None)  # pyright: ignore[reportArgumentType]
    with pytest.raises(eb.BatchError, match="`until` is 3; pass a rule"):
        _run(until=3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every": 0}, "`every` is 0"),
        ({"every": -5}, "`every` is -5"),
        ({"every": True}, "`every` is True"),
        ({"every": 2.5}, "`every` is 2.5"),
        ({"rhat": 0.99}, "`rhat` is 0.99; the R-hat threshold must be a number >= 1"),
        ({"nested_rhat": 0.5}, "`nested_rhat` is 0.5"),
        ({"nested_rhat": "paper"}, "`nested_rhat` is 'paper'"),
        ({"rhat": True}, "`rhat` is True"),
        ({"rhat": float("nan")}, "`rhat` is nan"),
        ({"ess": 0}, "`ess` is 0; the ESS threshold must be a number > 0"),
        ({"ess": -10.0}, "`ess` is -10.0"),
        ({"ess": False}, "`ess` is False"),
        ({"nested_rhat": None}, "no criterion"),
    ],
)
def test_bad_rule_parameters_are_refused(kwargs, match):
    with pytest.raises(eb.BatchError, match=match):
        eb.converged(**kwargs)


def test_a_rule_is_hashable_and_equal_by_value():
    assert eb.converged(every=5) == eb.converged(every=5)
    assert hash(eb.converged(rhat=1.05)) == hash(eb.converged(rhat=1.05))
    assert isinstance(eb.converged(), eb.StoppingRule)


# Chunks whose chains per device (of 4) are a multiple of 8: jaxlib 0.8's CPU code for
# `jr.normal` differs in the last bit between its vector loop and its remainder, so a
# chunk of 48 (12 per device) can differ from 128 (32 per device) even without `until`.
@pytest.mark.parametrize(
    "chunk_size", [pytest.param(96, marks=pytest.mark.accelerator), 64]
)
def test_chunked_equals_unchunked_bit_for_bit(chunk_size):
    # Chunks take turns window by window, each check merges every chunk's moments,
    # and every chunk stops at the same step (96 does not divide 128: padded).
    whole = _run(burn_in=10)
    chunked = _run(burn_in=10, chunk_size=chunk_size)
    assert whole.steps_done < 2000
    assert_trees_identical(_outputs(chunked), _outputs(whole))


_steps_done = checkpoint_steps_done


_KILLED_WORKER = """
import sys
from chains_workloads import stopping_run
stopping_run(sys.argv[1], chunk_size=48)
"""


def test_killed_and_resumed_stops_at_the_same_step(tmp_path):
    # SIGKILLed mid-run in another process (chunks of 48 of 128 chains, taking
    # turns), then resumed here: it stops where a run never killed stops, bit for bit.
    path = tmp_path / "run.ckpt"
    last_chunk = tmp_path / "run.ckpt.chains-96-128"
    worker = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WORKER, str(path)], cwd=TESTS
    )
    try:
        deadline = time.monotonic() + 180
        while not (last_chunk.exists() and _steps_done(last_chunk) >= 100):
            assert worker.poll() is None, "the worker exited before the kill"
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == -signal.SIGKILL
    killed_at = _steps_done(last_chunk)

    resumed = stopping_run(str(path), chunk_size=48)
    plain = stopping_run()
    assert killed_at < plain.steps_done < 5000
    assert_trees_identical(_outputs(resumed), _outputs(plain))


def test_a_run_that_stopped_early_is_read_back(tmp_path):
    path = tmp_path / "run.ckpt"
    first = _run(checkpoint=path, checkpoint_every=30)
    assert first.steps_done < 2000
    assert _steps_done(path) == first.steps_done
    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    again = _run(checkpoint=path, checkpoint_every=30)
    assert_trees_identical(_outputs(again), _outputs(first))
    # Read back: nothing run, nothing written.
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == written


def test_the_rule_is_part_of_the_run_identity(tmp_path):
    path = tmp_path / "run.ckpt"
    _run(checkpoint=path)
    with pytest.raises(eb.BatchError, match="until: the checkpoint has nested R-hat"):
        _run(checkpoint=path, until=eb.converged(every=40))
    with pytest.raises(eb.BatchError, match="written by a different run"):
        _run(checkpoint=path, until=None, diagnostics=True)
    # Every run records its rule: a run without one says so.
    plain = tmp_path / "plain.ckpt"
    _run(num_steps=10, until=None, checkpoint=plain)
    with safetensors.safe_open(plain, "np") as file:
        assert json.loads(file.metadata()["run_chains.run"])["until"] == "None"


@pytest.mark.accelerator
def test_the_progress_bar_shows_the_worst_statistics_with_their_leaf(capsys):
    result = _run(progress=True)
    err = capsys.readouterr().err
    assert f"{result.steps_done}/2000" in err
    assert "nested R-hat" in err and "at state[" in err and "ESS" in err
    # Without `until`, with diagnostics: at the end of the run too.
    eb.run_chains(
        lambda state, key: {"w": ar1(state["w"], key)},
        {"w": jnp.zeros((16, 3))},
        jr.key(0),
        50,
        diagnostics=True,
        progress=True,
    )
    err = capsys.readouterr().err
    assert "R-hat" in err and "at ['w'][" in err


def _poisoned(chain: int, element: slice | int) -> eb.AllChains:
    """`fast` on every chain, but chain `chain`'s state turns NaN at `element` from
    step 20 on."""

    @eb.all_chains
    def step(states: jax.Array, keys: jax.Array, count: jax.Array) -> jax.Array:
        new = jax.vmap(fast)(states, keys)
        poisoned = (count >= 20) & (jnp.arange(states.shape[0]) == chain)
        return new.at[:, element].set(
            jnp.where(
                poisoned[:, None], jnp.nan, new[:, element].reshape(len(new), -1)
            ).reshape(new[:, element].shape)
        )

    return step


@pytest.mark.parametrize("element", [0, slice(None)], ids=["one element", "whole leaf"])
def test_a_nan_chain_never_converges(element, capsys):
    # Without the guard, the statistics skip the NaN chain and the run "converges".
    result = _run(_poisoned(5, element), num_steps=400, progress=True)
    stopped = _stopped(result)
    assert result.steps_done == 400 and not stopped.converged
    assert "1 chains are NaN or infinite (5)" in stopped.reason
    assert list(result.nonfinite.chains) == [5]
    assert "1 chains are NaN or infinite (5)" in capsys.readouterr().err


def test_a_nan_chain_never_converges_under_classic_rhat():
    result = eb.run_chains(
        _poisoned(0, 1),
        jnp.zeros((16, 2)),
        jr.key(0),
        300,
        until=eb.converged(rhat=1.5, every=50),
    )
    assert result.steps_done == 300 and not _stopped(result).converged
    assert "NaN or infinite (0)" in _stopped(result).reason


@pytest.mark.parametrize("every", [-5, 0, True, 2.5])
def test_a_rule_built_by_hand_is_checked_as_converged_checks_it(every):
    with pytest.raises(eb.BatchError, match="`every` is"):
        eb.StoppingRule(nested_rhat="default", rhat=None, ess=None, every=every)
    with pytest.raises(eb.BatchError, match="no criterion"):
        eb.StoppingRule(nested_rhat=None, rhat=None, ess=None, every=None)


def _edited(field: str, rule: eb.StoppingRule, value) -> eb.StoppingRule:
    """`rule` with `field` set to `value` by `eqx.tree_at`, which skips its checks."""
    return eqx.tree_at(
        lambda r: getattr(r, field), rule, value, is_leaf=lambda x: x is None
    )


@pytest.mark.parametrize(
    "rule, match",
    [
        (
            _edited("every", eb.converged(every=50), -5),
            "`until.every` is -5; it must be an int >= 1",
        ),
        (_edited("every", eb.converged(every=50), 0), "`until.every` is 0"),
        (_edited("every", eb.converged(every=50), True), "`until.every` is True"),
        (_edited("every", eb.converged(every=50), 2.5), "`until.every` is 2.5"),
        (
            _edited("rhat", eb.converged(), "1.01"),
            "`until.rhat` is '1.01'; the R-hat threshold must be",
        ),
        (_edited("nested_rhat", eb.converged(), 0.9), "`until.nested_rhat` is 0.9"),
        (
            _edited("ess", eb.converged(ess=100.0), -1.0),
            "`until.ess` is -1.0; the ESS threshold must be",
        ),
        (
            _edited("nested_rhat", eb.converged(), None),
            r"`until` has no criterion: pass `until.nested_rhat`",
        ),
    ],
    ids=[
        "every negative",
        "every 0",
        "every True",
        "every float",
        "rhat a string",
        "nested_rhat below 1",
        "ess negative",
        "no criterion",
    ],
)
def test_a_rule_edited_with_tree_at_is_checked_by_run_chains(rule, match):
    # With `every=-5` the run used to never return.
    with pytest.raises(eb.BatchError, match=match):
        _run(until=rule)


@pytest.mark.parametrize("until", [None, eb.converged(every=40)])
def test_adding_or_removing_until_on_resume_names_the_difference(tmp_path, until):
    path = tmp_path / "run.ckpt"
    other = eb.converged(every=40) if until is None else None
    _run(num_steps=80, until=until, diagnostics=True, checkpoint=path)
    with pytest.raises(eb.BatchError, match="until: the checkpoint has") as info:
        _run(num_steps=80, until=other, diagnostics=True, checkpoint=path)
    assert "its run id" not in str(info.value)


def test_superchains_are_part_of_the_run_identity(tmp_path):
    # K = 2 starts repeated twice expand to the chains K = 4 runs from: the same
    # chains, but another nested R-hat, so another stop.
    path = tmp_path / "run.ckpt"
    starts = jnp.concatenate([STARTS[:2], STARTS[:2]])
    keys = KEYS[:64]
    eb.run_chains(fast, starts[:2], keys, 100, superchains=2, checkpoint=path)
    with pytest.raises(eb.BatchError, match="superchains: the checkpoint has 2"):
        eb.run_chains(fast, starts, keys, 100, superchains=4, checkpoint=path)


def test_a_record_that_disagrees_with_the_progress_is_refused(tmp_path):
    # A stop at an earlier step than the state's, written as a sound file (as a bug,
    # or someone who knows the format, would write it): read back, it would give the
    # state of one step under the report of another.
    from eqx_batch._chains._until._moments import Moments
    from eqx_batch._files._serialise import read_tree, write_tree

    path = tmp_path / "run.ckpt"
    stop = _stopped(_run(checkpoint=path, checkpoint_every=50)).step
    like = {
        "states": np.zeros((128, 2), np.float32),
        "keys": np.zeros((128, 2), np.uint32),
        "first_bad": np.zeros(128, np.int32),
        "moments": Moments(
            np.zeros((128, 3), np.int32),
            np.zeros((128, 3, 2), np.float32),
            np.zeros((128, 3, 2), np.float32),
        ),
    }
    [state_file] = tmp_path.glob(f"run.ckpt.*.state-{stop}.rows-0-128")
    state, metadata = read_tree(state_file, like, on_host=True)
    progress = json.loads(metadata["run_chains.progress"])
    progress["stopping"]["stopped"][0] = stop - 50
    metadata["run_chains.progress"] = json.dumps(progress)
    write_tree(state_file, state, metadata=metadata)
    with pytest.raises(eb.BatchError, match=f"stopped at step {stop - 50}, but its"):
        _run(checkpoint=path, checkpoint_every=50)


def test_until_on_a_run_of_no_draws_says_until_asked():
    with pytest.raises(eb.BatchError, match="`until` reads the chains' diagnostics"):
        _run(num_steps=0)
