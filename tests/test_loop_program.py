"""What the compiled loop holds: no gather of `data` in its body, no copy of the state.

Each chain's row of `data` is read once per segment, before the loop, as a loop written
by hand over `vmap(step)` reads it. A row read by index in every step is a gather in
the loop's body, which XLA hoists out of the loop on a CPU but not on a TPU (issue 34:
5 to 8 times the loop by hand there). So the program is read as it is lowered, before
XLA optimizes it, where the CPU would hide the gather.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_trees_identical
from hlo import loop_body_lines, loop_body_ops
from problems_workloads import problems_run, stopping_problems_run

import eqx_batch as eb
from eqx_batch._chains import _chunk, _chunk_pieces, _problems, _segment


@pytest.fixture
def loop_programs(monkeypatch):
    """The HLO text of every segment that `run_chains` runs in the test (the pieces
    of the running chains' too), as lowered for its arguments before it runs."""
    programs: list[str] = []

    def recording(program):
        def recorded(*args):
            programs.append(program.lower(*args).as_text(dialect="hlo"))
            return program(*args)

        return recorded

    for module, name in ((_chunk, "run_segment"), (_chunk_pieces, "run_piece")):
        monkeypatch.setattr(module, name, recording(getattr(module, name)))
    return programs


def _gathers(programs: list[str]) -> list[int]:
    return [loop_body_ops(program)["gather"] for program in programs]


@pytest.mark.accelerator
@pytest.mark.parametrize("chunk_size", [None, 10])
def test_the_loop_of_a_data_run_holds_no_gather(loop_programs, chunk_size):
    # 36 chains over the devices (padded on 4), whole or in chunks that cut problems
    # apart.
    problems_run(chunk_size=chunk_size)
    assert loop_programs and _gathers(loop_programs) == [0] * len(loop_programs)


@pytest.mark.accelerator
def test_the_compacted_segments_hold_no_gather(loop_programs):
    # Problems stop at different checks: later segments run the running chains only.
    result = stopping_problems_run(num_steps=600)
    assert result.problems is not None
    assert len(np.unique(result.problems.steps_done)) > 1
    assert len(loop_programs) > 2 and _gathers(loop_programs) == [0] * len(
        loop_programs
    )


def test_a_loop_without_data_holds_no_gather_either(loop_programs):
    # The baseline the two tests above hold the `data=` loop to.
    walk = lambda x, k: x + jr.normal(k, x.shape)  # noqa: E731
    eb.run_chains(walk, jnp.zeros((8, 2)), jr.key(0), 5)
    assert _gathers(loop_programs) == [0]


def test_rows_past_the_copy_limit_are_read_in_the_loop_with_the_same_draws(
    loop_programs, monkeypatch
):
    # Past `COPY_LIMIT`, each step reads its row by index (no copy per chain): the
    # gather is back in the loop, and the draws are the same.
    copied = problems_run()
    monkeypatch.setattr(_problems, "COPY_LIMIT", 0)
    jax.clear_caches()  # the limit is read when the loop is traced
    indexed = problems_run()
    copying, indexing = _gathers(loop_programs)
    assert copying == 0 and indexing == 2  # one per leaf of the data
    assert_trees_identical(
        (copied.final, copied.trace, copied.keys),
        (indexed.final, indexed.trace, indexed.keys),
    )


def test_the_loop_copies_no_state_to_check_it(monkeypatch):
    # The finiteness check reads each step's new states as the loop carries them.
    # Reading those carried in, beside the step that overwrites them in place, made
    # XLA copy the whole state every step (5 to 13% of a step on a CPU).
    compiled: list[str] = []

    def recorded(*args):
        text = program.lower(*args).compile().as_text()
        assert text is not None
        compiled.append(text)
        return program(*args)

    program = _chunk.run_segment
    monkeypatch.setattr(_chunk, "run_segment", recorded)

    def density(w, data):
        logits = data["X"] @ w
        return jnp.sum(data["y"] * logits - jnp.logaddexp(0.0, logits)) - 0.5 * w @ w

    def mala(w, key, data):
        # Logistic regression by MALA, as `benchmarks/bench_logistic.py` samples it.
        noise_key, accept_key = jr.split(key)
        value, grad = jax.value_and_grad(density)(w, data)
        mean = w + 0.01 * grad
        proposal = mean + jnp.sqrt(0.02) * jr.normal(noise_key, w.shape)
        new_value, new_grad = jax.value_and_grad(density)(proposal, data)
        back = proposal + 0.01 * new_grad
        log_q = lambda to, at: -jnp.sum((to - at) ** 2) / 0.04  # noqa: E731
        log_ratio = new_value - value + log_q(w, back) - log_q(proposal, mean)
        accept = jnp.log(jr.uniform(accept_key)) < log_ratio
        return jnp.where(accept, proposal, w)

    X = jr.normal(jr.key(1), (16, 16, 8))
    data = {"X": X, "y": (X[..., 0] > 0).astype(jnp.float32)}
    eb.run_chains(mala, jnp.zeros((256, 8)), jr.key(0), 50, data=data)
    (hlo,) = compiled
    # The states of a device's chains (the run splits them over the devices).
    state = f"f32[{256 // jax.device_count()},8]"
    copies = [
        line
        for line in loop_body_lines(hlo)
        if " copy(" in line and state in line.split("=")[1].split(" copy(")[0]
    ]
    assert not copies, copies


def test_a_state_the_step_returns_as_given_stays_out_of_the_barrier():
    # A frozen shared state's copies, passed through the loop unchanged: behind the
    # barrier, XLA would no longer see them constant over the loop.
    def carried(x, y):
        new = _segment._as_carried({"own": x + 1, "shared": y}, {"own": x, "shared": y})
        assert new["shared"] is y
        return new

    jaxpr = jax.make_jaxpr(carried)(jnp.zeros(3), jnp.ones(2))
    (barrier,) = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barrier.invars) == 1
