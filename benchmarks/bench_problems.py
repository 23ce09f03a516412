"""One `eb.run_chains` call for many problems (`data=`) against a loop of calls.

Workload: eight schools, non-centred (the model of `examples/many_short_chains.py`),
sampled by random-walk Metropolis for a fixed 500 steps (no `until=`, so that every
side does the same work), on P = 256 datasets: the schools' effects and standard
errors, the first the original and the others perturbed. Each problem has 4
superchains of 4 chains (16 chains), started from over-dispersed points. Every side
computes the same draws, with the same starts and keys, and returns them (the trace of
every chain).

- The one call: `run_chains(step, starts, keys, 500, superchains=4 * 256,
    data=datasets)`, 4096 chains in one compiled loop.
- Against the loop a user writes with the data as an argument: 256 calls of
    `run_chains(functools.partial(step, data=row), ...)`, one per dataset. A
    partial's arrays are arguments of the compiled loop, so it compiles once
    (checked: no compile in its timed calls). Target: the one call in at most a
    quarter of the loop's time. Why it is met or not, reported beside it: the
    loop's calls of 1 step against those of 500 (what a call costs beyond its
    steps, all the one call can save), and the one call against the same chains
    written by hand, `jax.jit` of `lax.scan` over `jax.vmap(step)` stacking the
    trace as `scan` does (the floor of its compute; `benchmarks/bench_chains.py`
    times the two at other sizes).
- Against the loop users write today with a closure, `lambda s, k: step(s, k, row)`,
    which bakes the row into the program as constants and so compiles on every call:
    a few of the 256 calls are timed and their time scaled to 256 (said in the row).
    Reported.
- Against NumPyro, if it imports: `MCMC(kernel, chain_method="vectorized")` with 16
    chains, reused over the datasets, each passed to `MCMC.run` as its argument with
    `jit_model_args=True` (NumPyro's option to compile once for data of one shape).
    The kernel is the same random walk, written as NumPyro's `MCMCKernel` docstring
    writes a Metropolis kernel, with `run_chains`' key schedule (each step's key split
    from the chain's carried key), so its draws are ours bit for bit: the loop and
    the framework are what is measured, not the sampler. NumPyro 0.22 still compiles
    its sampling loop in every `run` (its `fori_collect` wraps the loop's body in a
    new `jax.jit` each time), so a few of the runs are timed and scaled to 256 (said
    in the row). Goal: 0.05 of it. Reported beside it: NumPyro's time less the
    tracing, lowering and compiling JAX reports in it, as `bench_peers.py` does.

Before timing, problem p's chains of the one call are checked equal, bit for bit, to
the partial loop's, the closure loop's and NumPyro's runs of p alone, for a few p,
and all its chains to the loop by hand's.

Each problem stopping on its own (section `until`): the same eight schools, the one
call with `until=eb.converged(every=250)` and a cap of 1500 steps (windows of 250
draws pass at checks from the first to the cap: the problems stop at different
steps) against the loop of 256 calls of `run_chains(partial(step, data=row), ...,
until=)` with the same rule. Problem p's steps and draws are checked equal, bit for
bit, to its call's, for the first and last problem to stop and the ends. Both are
timed warm (the loop's programs compiled by a first pass over every problem, the one
call's by its first call, which is its own row).

Compaction (section `compaction`): the mean of 256 observations (flat prior, the
posterior's sd about 1), sampled by random-walk Metropolis whose proposal scale is
the problem's data: 2.4 for the even problems, 0.15 (mixing about ten times slower)
for the odd ones; scalar state, so that nested R-hat passes on windows of 25 draws;
the likelihood of 256 observations gives a step real compute. The one call with
`until=eb.converged(every=25)` against the same chains with no `until` and
`num_steps` the slowest problem's stop (what a run that does not compact computes);
each problem's draws are checked equal to the first of its chains' in that run. Then
the chain-steps the compacted run executed, padding included
(`executed_chain_steps`), against the chain-steps its problems needed.

Stopping against the cap (section `stopping`, issue 42): the one call with
`until=eb.converged(every=200)` and a cap of 4000 against the same call run to the cap,
the trace on, warm and on a first call, and the programs the first `until=` call
compiles (`stopping_rows` states the targets). Section `parts` reports where its warm
`until=` run spends its time: the cap in segments, with diagnostics, one check at the
cap, checks that never pass, and the problems stopping, each against the cap.

Against the loop by hand alone (section `hand`), at 256 and at 4096 problems (the
loops of calls would take minutes at 4096): the one call at most 1.05 of it on a CPU
and 1.1 on an accelerator (issue 34), checked bit for bit. Reported beside it: the
same loop with its trace turned `[chains, draws]` at its end, the layout `Chains.trace`
returns and the loop by hand does not; and a call of 2 steps against the loop by
hand's, where the call's fixed part is most of it. The `fixed` section's row against
the loop by hand has the same target.

Times are medians of repeats in which the sides alternate, so that the load of a
shared machine falls on all of them. The per-problem starts, keys and data rows of the
loops are sliced before timing (a loop pays only for its calls). Usage:
`python benchmarks/bench_problems.py [fixed] [hand] [until] [compaction] [stopping]
[parts]`,
every section when none is named (or through `benchmarks/run.py problems`).
"""

import functools as ft
import importlib
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from _report import report

import eqx_batch as eb
from eqx_batch._chains._compaction import piece_rows


PROBLEMS = 256
SUPERCHAINS = 4  # per problem
CHAINS_PER_SUPERCHAIN = 4
CHAINS = SUPERCHAINS * CHAINS_PER_SUPERCHAIN  # per problem
STEPS = 500
CLOSURE_TIMED = 2  # of the 256 closure calls, each of which compiles
NUMPYRO_TIMED = 2  # of the 256 NumPyro runs
REPEAT = 5
COMPILING = {"closure loop", "NumPyro loop"}  # the sides that compile in every call
CHECKED = (0, PROBLEMS - 1)  # the problems whose chains are checked bit for bit
SCHOOLS_Y = jnp.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SCHOOLS_SIGMA = jnp.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
PROPOSAL_SCALE = {"mu": 2.0, "log_tau": 0.5, "theta_tilde": 0.5}


def log_density(state: dict, data: dict) -> jax.Array:
    """mu ~ N(0, 5), tau ~ half-Cauchy(5), theta = mu + tau * theta_tilde with
    theta_tilde ~ N(0, 1), y ~ N(theta, sigma); in (mu, log tau, theta_tilde), with
    the log Jacobian log tau."""
    mu, log_tau, theta_tilde = state["mu"], state["log_tau"], state["theta_tilde"]
    tau = jnp.exp(log_tau)
    theta = mu + tau * theta_tilde
    return (
        -0.5 * (mu / 5.0) ** 2
        - jnp.log1p((tau / 5.0) ** 2)
        + log_tau
        - 0.5 * jnp.sum(theta_tilde**2)
        - 0.5 * jnp.sum(((data["y"] - theta) / data["sigma"]) ** 2)
    )


def step(state: dict, key: jax.Array, data: dict) -> dict:
    """One random-walk Metropolis step of one chain on one dataset."""
    noise_key, accept_key = jr.split(key)
    noise_keys = dict(zip(state, jr.split(noise_key, len(state)), strict=True))
    proposal = {
        name: x + PROPOSAL_SCALE[name] * jr.normal(noise_keys[name], x.shape, x.dtype)
        for name, x in state.items()
    }
    log_ratio = log_density(proposal, data) - log_density(state, data)
    accept = jnp.log(jr.uniform(accept_key)) < log_ratio
    return jax.tree.map(lambda p, s: jnp.where(accept, p, s), proposal, state)


class Workload(NamedTuple):
    """Every problem's data, starts and keys, whole and sliced per problem."""

    problems: int
    data: dict  # [problems, 8] per leaf
    starts: dict  # [problems * SUPERCHAINS, ...] per leaf, problem 0's first
    keys: jax.Array  # [problems * CHAINS]
    rows: list[dict]  # problem p's data
    problem_starts: list[dict]  # problem p's SUPERCHAINS starts
    problem_keys: list[jax.Array]  # problem p's CHAINS keys


def workload(problems: int = PROBLEMS) -> Workload:
    y_key, sigma_key, mu_key, tau_key, theta_key, chain_key = jr.split(jr.key(0), 6)
    y = SCHOOLS_Y + 5.0 * jr.normal(y_key, (problems, 8))
    sigma = SCHOOLS_SIGMA * jr.uniform(sigma_key, (problems, 8), minval=0.8, maxval=1.2)
    data = {"y": y.at[0].set(SCHOOLS_Y), "sigma": sigma.at[0].set(SCHOOLS_SIGMA)}
    k = problems * SUPERCHAINS
    # Wider than the posterior in mu and log tau; theta_tilde from its prior.
    starts = {
        "mu": 10.0 * jr.normal(mu_key, (k,)),
        "log_tau": 1.0 + 1.5 * jr.normal(tau_key, (k,)),
        "theta_tilde": jr.normal(theta_key, (k, 8)),
    }
    keys = jr.split(chain_key, problems * CHAINS)

    def rows(tree: dict, size: int) -> list[dict]:
        # Problem p's `size` rows of every leaf.
        return [
            {name: x[p * size : (p + 1) * size] for name, x in tree.items()}
            for p in range(problems)
        ]

    return Workload(
        problems,
        data,
        starts,
        keys,
        [{name: x[p] for name, x in data.items()} for p in range(problems)],
        rows(starts, SUPERCHAINS),
        [keys[p * CHAINS : (p + 1) * CHAINS] for p in range(problems)],
    )


def repeated(tree: dict, times: int) -> dict:
    """Each row of every leaf `times` times: a superchain's start for each of its
    chains, as `superchains=` starts them, or a problem's data for each chain."""
    return {name: jnp.repeat(x, times, axis=0) for name, x in tree.items()}


class Compiles(NamedTuple):
    """The XLA compiles JAX reported in a block: how many, and the seconds of tracing,
    lowering and compiling."""

    number: int
    seconds: float


@contextmanager
def compiles() -> Iterator[list[Compiles]]:
    """Yields a list that holds, once the block is done, its `Compiles`."""
    count, seconds, done = [0], [0.0], []

    def listen(event: str, duration_secs: float, **kwargs: object) -> None:
        if event.startswith("/jax/core/compile/"):
            seconds[0] += duration_secs
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield done
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        done.append(Compiles(count[0], seconds[0]))


def assert_same(name: str, got: Any, expected: Any) -> None:
    """Bit for bit, leaf by leaf."""
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    for (path, a), b in zip(got_leaves, jax.tree.leaves(expected), strict=True):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise AssertionError(f"{name}: {jax.tree_util.keystr(path)} differs")


# -- The sides -------------------------------------------------------------------


def one_call(w: Workload, steps: int = STEPS) -> Callable[..., eb.Chains]:
    """The one call of every problem, `steps` steps, with `run_chains`' `options`."""

    def run(**options: Any) -> eb.Chains:
        return jax.block_until_ready(
            eb.run_chains(
                step,
                w.starts,
                w.keys,
                steps,
                superchains=w.problems * SUPERCHAINS,
                data=w.data,
                **options,
            )
        )

    return run


def solo(w: Workload, p: int, problem_step: Callable, steps: int = STEPS) -> eb.Chains:
    """Problem p alone, its data given by `problem_step`."""
    return jax.block_until_ready(
        eb.run_chains(
            problem_step,
            w.problem_starts[p],
            w.problem_keys[p],
            steps,
            superchains=SUPERCHAINS,
        )
    )


def partial_step(w: Workload, p: int) -> Callable:
    return ft.partial(step, data=w.rows[p])


def closure_step(w: Workload, p: int) -> Callable:
    row = w.rows[p]
    return lambda state, key: step(state, key, row)


def loop(
    w: Workload,
    make_step: Callable,
    problems: range,
    steps: int = STEPS,
) -> Callable[[], list]:
    def run() -> list:
        return [solo(w, p, make_step(w, p), steps) for p in problems]

    return run


def by_hand(
    w: Workload, steps: int = STEPS, chain_major: bool = False
) -> Callable[[], tuple]:
    """The one call's chains as `jax.jit` of `lax.scan` over `jax.vmap(step)`, with
    `run_chains`' key schedule and every chain's start and data row gathered before
    the loop: `(final states, keys), trace` with the trace `[draws, chains, ...]`,
    which `scan` writes contiguously; with `chain_major`, turned `[chains, draws,
    ...]` at the loop's end, the layout of `Chains.trace` (and ArviZ's)."""
    chain_starts = repeated(w.starts, CHAINS_PER_SUPERCHAIN)
    chain_rows = repeated(w.data, CHAINS)

    @jax.jit
    def chains(states: dict, keys: jax.Array, rows: dict) -> tuple:
        def one_step(carry: tuple, _: None) -> tuple:
            states, keys = carry
            keys, step_keys = jax.vmap(jr.split, out_axes=1)(keys)
            states = jax.vmap(step)(states, step_keys, rows)
            return (states, keys), states

        carry, trace = jax.lax.scan(one_step, (states, keys), None, length=steps)
        if chain_major:
            trace = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), trace)
        return carry, trace

    def run() -> tuple:
        return jax.block_until_ready(chains(chain_starts, w.keys, chain_rows))

    return run


def numpyro_side(w: Workload, problems: range) -> tuple:
    """NumPyro's loop over `problems` and one problem's run: `(loop, run_one)`; only
    called once NumPyro has imported."""
    from numpyro.infer import MCMC
    from numpyro.infer.mcmc import MCMCKernel

    class WalkState(NamedTuple):
        z: dict
        rng_key: jax.Array

    class RandomWalk(MCMCKernel):
        """`step` as NumPyro's `MCMCKernel` docstring writes a Metropolis kernel.
        With `chain_method="vectorized"` the kernel gets every chain at once and maps
        over them itself, as NumPyro's HMC does."""

        sample_field = "z"

        def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
            return WalkState(init_params, rng_key)

        def sample(self, state, model_args, model_kwargs):
            (data,) = model_args

            def one_chain(z: dict, key: jax.Array) -> WalkState:
                key, step_key = jr.split(key)
                return WalkState(step(z, step_key, data), key)

            return jax.vmap(one_chain)(state.z, state.rng_key)

    mcmc = MCMC(
        RandomWalk(),
        num_warmup=0,
        num_samples=STEPS,
        num_chains=CHAINS,
        chain_method="vectorized",
        progress_bar=False,
        jit_model_args=True,
    )
    # A superchain's chains start from its one start, as `superchains=` starts them.
    chain_starts = [repeated(s, CHAINS_PER_SUPERCHAIN) for s in w.problem_starts]

    def run_one(p: int) -> dict:
        mcmc.run(w.problem_keys[p], w.rows[p], init_params=chain_starts[p])
        return jax.block_until_ready(mcmc.get_samples(group_by_chain=True))

    def run() -> list:
        return [run_one(p) for p in problems]

    return run, run_one


# -- Checks and timing -----------------------------------------------------------


def assert_as_by_hand(ours: eb.Chains, hand: tuple, chain_major: bool = False) -> None:
    """The one call's chains are the loop by hand's, bit for bit."""
    (final, _), trace = hand
    assert_same("by hand: final", ours.final, final)
    if not chain_major:
        trace = {name: jnp.swapaxes(x, 0, 1) for name, x in trace.items()}
    assert_same("by hand: trace", ours.trace, trace)


def check_problems(
    w: Workload, ours: eb.Chains, hand: tuple, numpyro_one: Callable | None
) -> None:
    """Problem p's chains of the one call are p's run alone, by every side, and all
    chains' final states are those of the loop written by hand."""
    assert ours.problems is not None and ours.problems.count == w.problems
    assert_as_by_hand(ours, hand)
    for p in CHECKED:
        mine = ours.problem(p)
        for name, make_step in (("partial", partial_step), ("closure", closure_step)):
            alone = solo(w, p, make_step(w, p))
            assert_same(f"problem {p}, {name}: final", mine.final, alone.final)
            assert_same(f"problem {p}, {name}: trace", mine.trace, alone.trace)
        if numpyro_one is not None:
            assert_same(f"problem {p}, NumPyro: trace", mine.trace, numpyro_one(p))


class Timing(NamedTuple):
    """A side's median wall time over the rounds, the median of that less the compiling
    in it, and the fewest and most compiles in a round."""

    seconds: float
    less_compiling: float
    compiles: tuple[int, int]


def interleaved_medians(sides: dict[str, Callable], repeat: int) -> dict[str, Timing]:
    """Times each side in `repeat` rounds, the sides alternating in each round."""
    walls: dict[str, list[float]] = {name: [] for name in sides}
    counted: dict[str, list[Compiles]] = {name: [] for name in sides}
    for _ in range(repeat):
        for name, run in sides.items():
            with compiles() as done:
                start = time.perf_counter()
                run()
                walls[name].append(time.perf_counter() - start)
            counted[name] += done
    timings = {}
    for name in sides:
        counts = [c.number for c in counted[name]]
        less = [w - c.seconds for w, c in zip(walls[name], counted[name], strict=True)]
        timings[name] = Timing(
            statistics.median(walls[name]),
            statistics.median(less),
            (min(counts), max(counts)),
        )
    return timings


def optional(module: str) -> tuple[Any, str]:
    """The peer `module`, or None and why it could not be imported."""
    try:
        return importlib.import_module(module), ""
    except Exception as error:  # a peer broken by a newer JAX fails in many ways
        return None, f"{type(error).__name__}: {error}"


def fixed_budget_rows() -> None:
    """The rows of the fixed budget: 500 steps for every problem, on every side."""
    w = workload()
    numpyro, why_not = optional("numpyro")
    sides = {
        "one call": one_call(w),
        "partial loop": loop(w, partial_step, range(PROBLEMS)),
        "closure loop": loop(w, closure_step, range(CLOSURE_TIMED)),
        "by hand": by_hand(w),
        "partial loop, 1 step": loop(w, partial_step, range(PROBLEMS), steps=1),
    }
    numpyro_one = None
    if numpyro is not None:
        sides["NumPyro loop"], numpyro_one = numpyro_side(w, range(NUMPYRO_TIMED))
    # Compiles the one call, the partial step and the loop by hand; then the other
    # sides that compile once (the closure and NumPyro compile on every call, which
    # their rows measure).
    check_problems(w, sides["one call"](), sides["by hand"](), numpyro_one)
    for side in sides.keys() - {"one call", "by hand", *COMPILING}:
        sides[side]()

    t = interleaved_medians(sides, REPEAT)
    # The rows compare what they say: every side but the closure and NumPyro runs
    # compiled programs, the closure compiles in every call.
    for side in sides.keys() - COMPILING:
        assert t[side].compiles == (0, 0), (side, t[side].compiles)
    assert t["closure loop"].compiles[0] >= CLOSURE_TIMED, t["closure loop"].compiles

    ours = t["one call"].seconds
    what = (
        f"eight schools RWM, {PROBLEMS} problems x {SUPERCHAINS} superchains x "
        f"{CHAINS_PER_SUPERCHAIN} chains, {STEPS} steps"
    )
    partial = t["partial loop"].seconds
    ratio = ours / partial
    report(
        f"{what}: run_chains(data=) / loop of run_chains(partial(step, data=row))",
        ratio,
        "<= 0.25",
        ratio <= 0.25,
        f"{ours:.3f}s vs {partial:.3f}s ({PROBLEMS} calls, none compiling), "
        "bit for bit",
    )
    # Why: what a call costs beyond its steps is all that one call can save, ...
    fixed = t["partial loop, 1 step"].seconds
    report(
        f"{what}: loop of run_chains(partial) of 1 step / of {STEPS} steps",
        fixed / partial,
        "report",
        True,
        f"{fixed:.3f}s vs {partial:.3f}s: {fixed / PROBLEMS * 1e3:.1f} ms a call "
        "beyond its steps, which the one call saves; the loop's steps alone take "
        f"{partial - fixed:.3f}s",
    )
    # ... and the rest is the chains' compute, at its floor.
    report_against_hand(what, ours, t["by hand"].seconds)

    scale = PROBLEMS / CLOSURE_TIMED
    closure = t["closure loop"]
    report(
        f"{what}: run_chains(data=) / loop of run_chains(closure), "
        f"{CLOSURE_TIMED} of {PROBLEMS} calls timed x{scale:g}",
        ours / (closure.seconds * scale),
        "report",
        True,
        f"{ours:.3f}s vs {closure.seconds * scale:.0f}s "
        f"({closure.seconds / CLOSURE_TIMED:.2f}s a call, "
        f"{closure.less_compiling / CLOSURE_TIMED:.3f}s of it not compiling; "
        f"{closure.compiles[0]} compiles in {CLOSURE_TIMED} calls), bit for bit",
    )

    name = (
        f"{what}: run_chains(data=) / loop of NumPyro MCMC.run (vectorized, "
        f"{CHAINS} chains, same kernel)"
    )
    rows = [(name, "<= 0.05"), (f"{name} less its compiling", "report")]
    if numpyro is None:
        for row, target in rows:
            detail = f"peer unavailable: {why_not}"
            report(row, float("nan"), target, False, detail)
        return
    scale = PROBLEMS / NUMPYRO_TIMED
    theirs = t["NumPyro loop"]
    per_run = (
        f"{theirs.compiles[0]} to {theirs.compiles[1]} compiles in {NUMPYRO_TIMED} "
        f"runs timed x{scale:g}; bit for bit"
    )
    ratio = ours / (theirs.seconds * scale)
    report(
        rows[0][0],
        ratio,
        rows[0][1],
        ratio <= 0.05,
        f"{ours:.3f}s vs {theirs.seconds * scale:.0f}s "
        f"({theirs.seconds / NUMPYRO_TIMED:.2f}s a run; {per_run})",
    )
    less = theirs.less_compiling * scale
    report(
        rows[1][0],
        ours / less,
        rows[1][1],
        True,
        f"{ours:.3f}s vs {less:.2f}s (NumPyro's wall less the tracing, lowering and "
        f"compiling JAX reports in it; {per_run})",
    )


def report_against_hand(what: str, ours: float, hand: float) -> None:
    """The one call against the loop written by hand: at most 1.05 of it on a CPU,
    1.1 on an accelerator (issue 34), where a dispatch costs more beside short
    loops."""
    limit = 1.05 if jax.default_backend() == "cpu" else 1.1
    report(
        f"{what}: run_chains(data=) / jit(scan(vmap(step))) by hand",
        ours / hand,
        f"<= {limit}",
        ours / hand <= limit,
        f"{ours * 1e3:.1f} ms vs {hand * 1e3:.1f} ms on {jax.default_backend()}, the "
        "same chains and trace, bit for bit",
    )


HAND_PROBLEMS = (PROBLEMS, 4096)
HAND_REPEAT = 15
# A call this short is its fixed part: the host's work before its loop is queued,
# and what it does after, which a longer loop on an accelerator hides.
SHORT_STEPS, SHORT_REPEAT = 2, 101


def hand_rows() -> None:
    """The one call against the loop by hand alone, at 256 and 4096 problems (the
    loops of calls would take minutes at 4096); and, reported, the same of
    `SHORT_STEPS` steps, where the call's fixed part is most of it."""
    for problems in HAND_PROBLEMS:
        w = workload(problems)
        ours, hand = one_call(w), by_hand(w)
        turned = by_hand(w, chain_major=True)
        assert_as_by_hand(ours(), hand())
        assert_as_by_hand(ours(), turned(), chain_major=True)
        t = interleaved_medians(
            {"one call": ours, "by hand": hand, "turned": turned}, HAND_REPEAT
        )
        what = (
            f"eight schools RWM, {problems} problems x {SUPERCHAINS} superchains x "
            f"{CHAINS_PER_SUPERCHAIN} chains"
        )
        ours_s = t["one call"].seconds
        report_against_hand(f"{what}, {STEPS} steps", ours_s, t["by hand"].seconds)
        turned_s = t["turned"].seconds
        report(
            f"{what}, {STEPS} steps: one call / by hand with its trace turned "
            "chain-major",
            ours_s / turned_s,
            "report",
            True,
            f"{ours_s * 1e3:.1f} vs {turned_s * 1e3:.1f} ms on "
            f"{jax.default_backend()}: the same result as ours, `[chains, draws]`; "
            f"the turn alone costs the loop by hand "
            f"{turned_s / t['by hand'].seconds:.3f} of its time",
        )
        short = {
            "one call": one_call(w, SHORT_STEPS),
            "by hand": by_hand(w, SHORT_STEPS),
        }
        assert_as_by_hand(short["one call"](), short["by hand"]())
        t = interleaved_medians(short, SHORT_REPEAT)
        ours_s, hand_s = t["one call"].seconds, t["by hand"].seconds
        report(
            f"{what}, {SHORT_STEPS} steps: one call / by hand",
            ours_s / hand_s,
            "report",
            True,
            f"{ours_s * 1e3:.2f} vs {hand_s * 1e3:.2f} ms on {jax.default_backend()}: "
            f"the call's fixed part, {(ours_s - hand_s) * 1e3:.2f} ms more than a "
            "jitted loop's",
        )


# -- Each problem stops on its own (`until=`) -------------------------------------

UNTIL_EVERY = 250  # eight schools: a window of 250 draws passes at different checks
UNTIL_CAP = 1500
UNTIL_REPEAT = 3
MEAN_OBSERVATIONS = 256  # a problem's data: its observations
MEAN_EVERY = 25
MEAN_CAP = 3000
# The proposal's scale (the posterior's sd is about 1): the even problems' near the
# best, the odd ones' 16 times smaller, which mixes about 10 times slower.
MEAN_SCALES = (2.4, 0.15)


def until_call(
    problem_step: Callable,
    starts: Any,
    keys: jax.Array,
    data: dict,
    cap: int,
    **options,
) -> eb.Chains:
    return jax.block_until_ready(
        eb.run_chains(
            problem_step,
            starts,
            keys,
            cap,
            superchains=PROBLEMS * SUPERCHAINS,
            data=data,
            **options,
        )
    )


def assert_stops_as_alone(name: str, ours: eb.Chains, p: int, alone: eb.Chains) -> None:
    """Problem p of a run with `until` stopped where its run alone did, with its
    draws."""
    mine = ours.problem(p)
    assert mine.steps_done == alone.steps_done, (
        name,
        p,
        mine.steps_done,
        alone.steps_done,
    )
    assert_same(f"{name}, problem {p}: final", mine.final, alone.final)
    assert_same(f"{name}, problem {p}: trace", mine.trace, alone.trace)


def until_rows() -> None:
    """Eight schools with `until=`: the one call against the loop of calls, each
    problem stopping on its own."""
    w = workload()
    rule = eb.converged(every=UNTIL_EVERY)

    def one() -> eb.Chains:
        return until_call(step, w.starts, w.keys, w.data, UNTIL_CAP, until=rule)

    def alone(p: int) -> eb.Chains:
        return jax.block_until_ready(
            eb.run_chains(
                partial_step(w, p),
                w.problem_starts[p],
                w.problem_keys[p],
                UNTIL_CAP,
                superchains=SUPERCHAINS,
                until=rule,
            )
        )

    def loop_of_calls() -> list:
        return [alone(p) for p in range(PROBLEMS)]

    with compiles() as cold:
        start = time.perf_counter()
        ours = one()
        cold_seconds = time.perf_counter() - start
    assert ours.problems is not None
    steps = ours.problems.steps_done
    # The first problem to stop, the last, and the ends: bit for bit.
    for p in sorted({0, PROBLEMS - 1, int(steps.argmin()), int(steps.argmax())}):
        assert_stops_as_alone("until", ours, p, alone(p))
    # Problems that stop at other steps take other paths: compiled before timing.
    loop_of_calls()
    t = interleaved_medians({"one call": one, "loop": loop_of_calls}, UNTIL_REPEAT)
    assert t["loop"].compiles == (0, 0), t["loop"].compiles

    values, counts = np.unique(steps, return_counts=True)
    stops = ", ".join(f"{n} at {s}" for s, n in zip(values, counts, strict=True))
    what = (
        f"eight schools RWM, {PROBLEMS} problems x {SUPERCHAINS} superchains x "
        f"{CHAINS_PER_SUPERCHAIN} chains, until=converged(every={UNTIL_EVERY}), "
        f"cap {UNTIL_CAP}"
    )
    ours_s, loop_s = t["one call"].seconds, t["loop"].seconds
    ratio = ours_s / loop_s
    report(
        f"{what}: run_chains(data=, until=) / loop of run_chains(partial, until=)",
        ratio,
        "<= 0.25",
        ratio <= 0.25,
        f"{ours_s:.2f}s vs {loop_s:.2f}s (warm; {t['one call'].compiles[1]} and "
        f"{t['loop'].compiles[1]} compiles); stops: {stops}; each problem's steps "
        "and draws as its call's, bit for bit",
    )
    report(
        f"{what}: run_chains(data=, until=) cold / warm",
        cold_seconds / ours_s,
        "report",
        True,
        f"{cold_seconds:.2f}s ({cold[0].number} compiles, {cold[0].seconds:.2f}s "
        f"compiling) vs {ours_s:.2f}s",
    )


def mean_step(mu: jax.Array, key: jax.Array, data: dict) -> jax.Array:
    """One random-walk Metropolis step for the mean of a problem's observations
    (`data["y"]`, each N(mu, sqrt(n)), flat prior: the posterior's sd is about 1),
    with the problem's proposal scale (`data["scale"]`)."""
    noise_key, accept_key = jr.split(key)
    proposal = mu + data["scale"] * jr.normal(noise_key, mu.shape)

    def log_density(m: jax.Array) -> jax.Array:
        return -0.5 * jnp.sum((data["y"] - m) ** 2) / MEAN_OBSERVATIONS

    log_ratio = log_density(proposal) - log_density(mu)
    return jnp.where(jnp.log(jr.uniform(accept_key)) < log_ratio, proposal, mu)


def executed_chain_steps(steps_done: np.ndarray, every: int, cap: int) -> tuple:
    """The chain-steps a compacted run executes, padding included, and without it.

    A segment runs from one check to the next (multiples of `every`, and the cap);
    before it, the problems still running are those whose `steps_done` is past its
    start. While every problem runs, the segment runs all the chains; once some have
    stopped, the running chains in pieces of `_compaction.piece_rows` rows (or all
    the chains, where pieces would not run fewer: one device here)."""
    everyone = len(steps_done) * CHAINS
    padded = unpadded = 0
    boundaries = [*range(0, cap, every), cap]
    for start, end in itertools.pairwise(boundaries):
        running = int((steps_done > start).sum()) * CHAINS
        if running == 0:
            break
        per_chain = jax.default_backend() == "cpu"
        piece = piece_rows(running, everyone, CHAINS, per_chain)
        size = everyone if piece is None else -(-running // piece) * piece
        padded += (end - start) * size
        unpadded += (end - start) * running
    return padded, unpadded


def compaction_rows() -> None:
    """Half the problems mix about ten times slower (their proposal's scale): the one
    call with `until=` (which compacts) against the same chains run to the slowest
    problem's stop."""
    w = workload()
    even_odd = np.resize(np.array(MEAN_SCALES, np.float32), PROBLEMS)
    y_key = jr.key(1)
    n = MEAN_OBSERVATIONS
    data = {
        "scale": jnp.asarray(even_odd),
        "y": n**0.5 * jr.normal(y_key, (PROBLEMS, n)),
    }
    # Each problem's superchains start apart, at -3, -1, 1 and 3 posterior sds
    # around 0 (its observations' mean is about N(0, 1)).
    starts = jnp.tile(jnp.linspace(-3.0, 3.0, SUPERCHAINS), PROBLEMS)
    rule = eb.converged(every=MEAN_EVERY)

    def compacted() -> eb.Chains:
        return until_call(mean_step, starts, w.keys, data, MEAN_CAP, until=rule)

    with compiles() as cold:
        start = time.perf_counter()
        ours = compacted()
        cold_seconds = time.perf_counter() - start
    assert ours.problems is not None
    steps = ours.problems.steps_done
    slowest = int(steps.max())

    def to_the_slowest() -> eb.Chains:
        return until_call(mean_step, starts, w.keys, data, slowest)

    everyone = to_the_slowest()
    # The same chains: each problem's draws are the first of its chains run on.
    for p in sorted({0, 1, int(steps.argmin()), int(steps.argmax())}):
        made = int(ours.problems.draws_made[p])
        mine, theirs = ours.problem(p), everyone.problem(p)
        first = jax.tree.map(lambda x, made=made: x[:, :made], theirs.trace)
        assert_same(f"compaction, problem {p}", mine.trace, first)
    t = interleaved_medians(
        {"compacted": compacted, "to the slowest": to_the_slowest}, UNTIL_REPEAT
    )

    fast, slow = steps[0::2], steps[1::2]
    what = (
        f"mean of {n} observations RWM, scale {MEAN_SCALES[0]} (half) or "
        f"{MEAN_SCALES[1]}, {PROBLEMS} problems x {SUPERCHAINS} superchains x "
        f"{CHAINS_PER_SUPERCHAIN} chains, until=converged(every={MEAN_EVERY}), "
        f"cap {MEAN_CAP}"
    )
    ours_s, theirs_s = t["compacted"].seconds, t["to the slowest"].seconds
    ratio = ours_s / theirs_s
    report(
        f"{what}: run_chains(data=, until=) / run_chains(data=) to the slowest stop",
        ratio,
        "<= 0.65",
        ratio <= 0.65,
        f"{ours_s:.2f}s vs {theirs_s:.2f}s (warm; {slowest} steps, "
        f"{t['compacted'].compiles[1]} and {t['to the slowest'].compiles[1]} "
        f"compiles); median stop {np.median(fast):g} (fast) and {np.median(slow):g} "
        f"(slow), from {steps.min()} to {slowest}; draws as the run to the slowest's, "
        "bit for bit",
    )
    report(
        f"{what}: run_chains(data=, until=) cold / warm",
        cold_seconds / ours_s,
        "report",
        True,
        f"{cold_seconds:.2f}s ({cold[0].number} compiles, {cold[0].seconds:.2f}s "
        f"compiling) vs {ours_s:.2f}s",
    )
    needed = int(steps.sum()) * CHAINS
    padded, unpadded = executed_chain_steps(steps, MEAN_EVERY, MEAN_CAP)
    report(
        f"{what}: chain-steps executed (padding included) / needed",
        padded / needed,
        "<= 1.25",
        padded / needed <= 1.25,
        f"{padded} vs {needed} (sum of steps_done x {CHAINS}); without padding "
        f"{unpadded / needed:.3f}; the run to the slowest executes "
        f"{PROBLEMS * CHAINS * slowest / needed:.2f}x",
    )


# -- Stopping against running to the cap (issue 42) --------------------------------

STOP_EVERY, STOP_CAP = 200, 4000
STOP_REPEAT = 3


def stopping_rows() -> None:
    """The one call with `until=eb.converged(every=200)` against the same call run to
    its cap of 4000 steps with no `until`, the trace on: warm, on a first call (each
    the first of its kind in the process, compile included), and the programs the
    first call with `until` compiles. 256 problems on an accelerator, 16 on a CPU
    (its trace at 256 would take 650 MB). Each problem's draws are checked equal, bit
    for bit, to the first of its rows in the run to the cap. Targets (issue 42): warm,
    at most 1.2 times the mean share of the cap that the problems run, and never more
    than the run to the cap (on a CPU, at most 0.8 of it); a first call at most 3
    times the first call without `until`; at most 10 programs compiled."""
    on_cpu = jax.default_backend() == "cpu"
    w = workload(16 if on_cpu else PROBLEMS)
    until = eb.converged(every=STOP_EVERY)
    run = one_call(w, STOP_CAP)

    first: dict[str, float] = {}
    counted: dict[str, list[Compiles]] = {}
    for name, options in (("until", {"until": until}), ("cap", {})):
        with compiles() as counted[name]:
            start = time.perf_counter()
            result = run(**options)
            first[name] = time.perf_counter() - start
        if name == "until":
            stopped = result
    to_cap = result
    assert stopped.problems is not None
    made = stopped.problems.draws_made
    for p in range(w.problems):
        rows = (slice(p * CHAINS, (p + 1) * CHAINS), slice(0, made[p]))
        assert_same(
            f"problem {p}'s draws",
            jax.tree.map(lambda x, rows=rows: x[rows], stopped.trace),
            jax.tree.map(lambda x, rows=rows: x[rows], to_cap.trace),
        )
    share = float(np.mean(stopped.problems.steps_done)) / STOP_CAP
    # How the step's time grows with the chains here: the run to the cap of a
    # quarter of the problems. Where it costs about what all of them cost, stopping
    # can shorten a run only to the last problem's stop, however few run.
    quarter = one_call(workload(w.problems // 4), STOP_CAP)
    quarter()
    t = interleaved_medians(
        {"until": lambda: run(until=until), "cap": run, "quarter": quarter},
        STOP_REPEAT,
    )
    ratio = t["until"].seconds / t["cap"].seconds
    limit = 0.8 if on_cpu else min(1.2 * share, 1.0)
    what = (
        f"eight schools RWM, {w.problems} problems x {CHAINS} chains, until every "
        f"{STOP_EVERY} (cap {STOP_CAP}; problems run {share:.0%} of it on average)"
    )
    report(
        f"{what}: warm until= / warm run to the cap",
        ratio,
        f"<= {limit:.2f}",
        ratio <= limit,
        f"{t['until'].seconds * 1e3:.1f} ms vs {t['cap'].seconds * 1e3:.1f} ms on "
        f"{jax.default_backend()}; stops at steps "
        f"{sorted(set(stopped.problems.steps_done.tolist()))}",
    )
    report(
        f"{what}: first until= call / first call to the cap",
        first["until"] / first["cap"],
        "<= 3",
        first["until"] / first["cap"] <= 3,
        f"{first['until']:.1f} s vs {first['cap']:.1f} s",
    )
    report(
        f"{what}: warm run to the cap of {w.problems // 4} problems / of all",
        t["quarter"].seconds / t["cap"].seconds,
        "report",
        True,
        f"{t['quarter'].seconds * 1e3:.1f} ms vs {t['cap'].seconds * 1e3:.1f} ms: "
        "how the step's time follows the chains on this device",
    )
    programs = counted["until"][0].number
    report(
        f"{what}: programs compiled by the first until= call (count)",
        programs,
        "<= 10",
        programs <= 10,
        f"the first call to the cap compiled {counted['cap'][0].number}",
    )


def stopping_parts_rows() -> None:
    """Where a warm `until=` run of `stopping_rows` spends its time, side by side in
    one process, each against the run to the cap: the cap cut into as many segments
    (`progress=True`), one check at the cap (the loop body with `until`), checks
    every 200 steps that never pass (`ess=1e9`: the boundaries, no compaction), and
    the problems stopping (the row of `stopping`). Reported, not targets: they say
    which part the next change should take on."""
    on_cpu = jax.default_backend() == "cpu"
    w = workload(16 if on_cpu else PROBLEMS)
    run = one_call(w, STOP_CAP)
    options = {
        "cap": {},
        "segments": {"progress": True},
        "diagnostics": {"diagnostics": True},
        "one check": {"until": eb.converged(every=STOP_CAP)},
        "never passing": {
            "until": eb.converged(nested_rhat=None, ess=1e9, every=STOP_EVERY)
        },
        "stopping": {"until": eb.converged(every=STOP_EVERY)},
    }
    sides = {name: ft.partial(run, **o) for name, o in options.items()}
    for side in sides.values():
        side()
    t = interleaved_medians(sides, STOP_REPEAT)
    cap = t["cap"].seconds
    for name in list(options)[1:]:
        report(
            f"eight schools RWM, {w.problems} problems x {CHAINS} chains, cap "
            f"{STOP_CAP}: {name} / the run to the cap",
            t[name].seconds / cap,
            "report",
            True,
            f"{t[name].seconds * 1e3:.1f} ms vs {cap * 1e3:.1f} ms on "
            f"{jax.default_backend()}",
        )


SECTIONS = {
    "fixed": fixed_budget_rows,
    "hand": hand_rows,
    "until": until_rows,
    "compaction": compaction_rows,
    "stopping": stopping_rows,
    "parts": stopping_parts_rows,
}


def main() -> None:
    """Every section, or those named on the command line."""
    for name in sys.argv[1:] or SECTIONS:
        SECTIONS[name]()


if __name__ == "__main__":
    main()
