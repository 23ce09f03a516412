"""Shared warmup (issue 44): the ChEES recipe of `examples/chees.py` on `eb.run_chains`
with `shared=` and `until=`, against BlackJAX's two warmups, side by side in one run.

Every model of `examples/posteriors.py` here runs as 1 problem x many chains and as
many problems x 16 chains (the same model, its data resimulated per problem), from
the same over-dispersed starts (one per superchain of 4 chains, every method), by:

- **ours**: `eb.run_chains(eb.all_chains(chees.warmup_step(...)), ..., shared=...,
    until=eb.converged(every=200))`, each problem adapting its own step size and
    trajectory length and stopping when nested R-hat passes (a cap of 1000 steps);
- **window NUTS**: BlackJAX's `window_adaptation(nuts)` of `WARMUP` steps, per chain,
    `jax.vmap`ped over the chains and the problems, then NUTS;
- **ChEES dHMC**: BlackJAX's `chees_adaptation` of `WARMUP` steps over the chains of a
    problem (Adam at the rate of ours), vmapped over the problems, then its dynamic
    HMC.

Then every method samples `DRAWS` steps with its adapted values frozen, and a problem
reaches the gate at the first round of `ROUND` draws (250, 500, 750) after which
ArviZ's rank-normalised split R-hat is below 1.01 and its bulk ESS at least 400 on
every coordinate, with no divergence so far: a method whose draws cost fewer
gradients may take more of them. Gradient evaluations are counted over the warmup and
the sample up to the gate (all of it for a problem that never reaches it): for NUTS
and dynamic HMC, BlackJAX's `num_integration_steps` (their states cache the gradient
at the start); for ours, the leapfrog steps plus one (the start's gradient, which
`chees.hmc` evaluates again each step), times the chains. Wall times are each
method's one call (every round) less the tracing and compiling JAX reports during it.

Rows (issue 44's targets):

- (a) problems at the gate: ours / the better BlackJAX recipe, over every model and
    problem of both layouts (>= 1);
- (b) the median over models of gradient evaluations, ours / window NUTS, per
    layout (<= 0.5);
- (c) wall time, ours / window NUTS under vmap, per layout: the target, <= 0.2, is
    for an accelerator; on the CPU the row is reported;
- (d) `shared=` against the same frozen step with the adapted state closed over,
    per step (<= 1.02): the slope of each side's best time from runs of 400 to 4000
    steps, both warm, interleaved; a call's fixed part is reported beside it.

On the CPU (2 cores) the run takes about 9 minutes at 1 x 32 and 4 x 16 chains on
three models: eight schools (non-centred), the ill-conditioned Gaussian and the
logistic regression. Left out there, for the time: the centred eight schools, the
funnel, the hierarchical logistic regression and the banana; and more chains, since
NUTS under `vmap` on the Gaussian takes 1.3 ms a chain and step there (its chains wait
for the deepest tree of the batch), over half the run at these sizes. `python
benchmarks/bench_warmup.py full` runs all seven models at issue 44's sizes, 1 x 1024
and 256 x 16, for an accelerator (`full 1x1024` or `full 256x16`: one of them).
"""

import functools as ft
import pathlib
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import blackjax
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from _report import interleaved, report
from arviz_stats.base import array_stats
from blackjax.adaptation.base import get_filter_adapt_info_fn

import eqx_batch as eb


sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
import chees  # noqa: E402
import posteriors  # noqa: E402


FULL = sys.argv[1:2] == ["full"]
if FULL:
    MODELS = list(posteriors.POSTERIORS.values())
    LAYOUTS = [(1, 1024), (256, 16)]  # problems x chains per problem
    # `full 1x1024` or `full 256x16`, then optionally models by their indices in
    # `posteriors.POSTERIORS` (`full 256x16 1 3 4`): a part that an accelerator's
    # call (ten minutes at most) holds; (a) then counts that part's problems.
    chosen = sys.argv[2:3]
    LAYOUTS = [(p, c) for p, c in LAYOUTS if chosen in ([], [f"{p}x{c}"])]
    assert LAYOUTS, f"no layout {chosen}: pass 1x1024 or 256x16"
    MODELS = [MODELS[int(i)] for i in sys.argv[3:]] or MODELS
else:
    MODELS = [posteriors.EIGHT_SCHOOLS_NON_CENTRED, posteriors.GAUSSIAN]
    MODELS.append(posteriors.LOGISTIC)
    LAYOUTS = [(1, 32), (4, 16)]
CHAINS_PER_SUPERCHAIN = 4
WARMUP = 1000  # BlackJAX's warmups, and the cap of ours
# Every method's sample after its warmup: `DRAWS` draws, checked at the gate after
# each `ROUND` of them; a problem reaches the gate at the first round that passes.
DRAWS, ROUND = 750, 250
INITIAL_STEP_SIZE = 0.1  # both ChEES
RHAT, ESS = 1.01, 400
SHORT, LONG = 400, 4000  # (d)'s two lengths of run, for its cost per step


class Sample(NamedTuple):
    """One method's run of one model and layout."""

    positions: np.ndarray  # [P, C, DRAWS, D]
    divergences: np.ndarray  # [P, DRAWS]: each draw's, over the chains
    warmup_gradients: np.ndarray  # [P]: every chain's
    gradients: np.ndarray  # [P, DRAWS]: each draw's, over the chains
    seconds: float  # wall, less JAX's tracing and compiling


class Gate(NamedTuple):
    """Each problem's sample at the gate, `[P]` each."""

    passed: np.ndarray  # reached it, at some round
    draws: np.ndarray  # the draws it took (all of them if it never passed)
    rhat: np.ndarray  # the worst R-hat over the coordinates there
    ess: np.ndarray  # the least bulk ESS
    gradients: np.ndarray  # the warmup's and the sample's up to there


def gate(sample: Sample) -> Gate:
    """Each problem at the first round of draws that reaches the gate (R-hat, bulk
    ESS, no divergence so far), or at the last round."""
    problems = len(sample.positions)
    at = Gate(*(np.zeros(problems, dtype) for dtype in (bool, int, float, float, int)))
    for draws in range(ROUND, DRAWS + 1, ROUND):
        kept = sample.positions[:, :, :draws].astype(np.float64)
        rhat = array_stats.rhat(kept, chain_axis=1, draw_axis=2).max(-1)
        ess = array_stats.ess(kept, chain_axis=1, draw_axis=2, method="bulk").min(-1)
        passed = (rhat < RHAT) & (ess >= ESS)
        passed &= sample.divergences[:, :draws].sum(1) == 0
        gradients = sample.warmup_gradients + sample.gradients[:, :draws].sum(1)
        now = ~at.passed
        for field, value in zip(
            Gate._fields, (passed, draws, rhat, ess, gradients), strict=True
        ):
            getattr(at, field)[now] = np.broadcast_to(value, now.shape)[now]
    return at


def mean_error(posterior, data, sample: Sample) -> float:
    """The largest error of the sample's means, in posterior sds, over the problems and
    coordinates of a model with reference moments (NaN for one without)."""
    if posterior.moments is None:
        return float("nan")
    errors = []
    for p, draws in enumerate(sample.positions):
        moments = posterior.moments(jax.tree.map(lambda rows, p=p: rows[p], data))
        mean = draws.reshape(-1, draws.shape[-1]).mean(0)
        errors.append(np.abs(mean - moments.mean) / np.sqrt(moments.variance))
    return float(np.max(errors))


def timed(run: Callable[[], tuple]) -> tuple[tuple, float]:
    """`run()`'s result and its wall time less the tracing and compiling in it."""
    compiling = [0.0]

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event.startswith("/jax/core/compile/"):
            compiling[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    start = time.perf_counter()
    result = jax.block_until_ready(run())
    wall = time.perf_counter() - start
    jax.monitoring.unregister_event_duration_listener(listen)
    return result, wall - compiling[0]


# -- Ours: ChEES on run_chains, shared= and until= ---------------------------------


def counting(step: Callable, lengths: Callable) -> Callable:
    """The ChEES `step` with each chain's gradient evaluations as an output: its
    leapfrog steps, from the trajectory length and step size `lengths(shared)`, and
    the start's gradient."""

    def fn(states, keys, count, shared, data):
        length, step_size = lengths(shared)
        leapfrogs = chees.leapfrog_steps(length, step_size, chees.halton(count))
        states, shared, outputs = step(states, keys, count, shared, data)
        per_chain = jnp.broadcast_to(leapfrogs + 1, outputs["divergent"].shape)
        return states, shared, outputs | {"gradients": per_chain}

    return fn


def iterates(shared):
    return jnp.exp(shared.log_trajectory_length), jnp.exp(shared.log_step_size)


def averages(shared):
    return shared.trajectory_length, shared.step_size


def ours(posterior, data, starts, key) -> Sample:
    problems, chains = starts.shape[:2]
    superchain_starts = starts[:, ::CHAINS_PER_SUPERCHAIN].reshape(-1, starts.shape[-1])
    keys = jr.split(key, problems * chains)
    shared = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (problems,)), chees.chees_init(INITIAL_STEP_SIZE)
    )

    def run():
        warmup = eb.run_chains(
            eb.all_chains(counting(chees.warmup_step(posterior.log_density), iterates)),
            superchain_starts,
            keys,
            WARMUP,
            shared=shared,
            data=data,
            superchains=superchain_starts.shape[0],
            until=eb.converged(every=200),
            burn_in=200,  # as the recipe: no check before T has grown
            trace=False,
            with_output=True,
        )
        sample = eb.run_chains(
            eb.all_chains(counting(chees.sample_step(posterior.log_density), averages)),
            warmup.final,
            warmup.keys,
            DRAWS,
            shared=warmup.problems.shared,
            data=data,
            with_output=True,
        )
        return warmup, sample

    (warmup, sample), seconds = timed(run)
    warmup_gradients = [
        # Summed on the host: `np.sum` of a JAX array sums on its device, where
        # without x64 (a TPU) int64 is truncated to int32, with a warning.
        np.asarray(warmup.problem(p).outputs["gradients"], np.int64).sum()
        for p in range(problems)
    ]

    def per_draw(x):  # [P x C, DRAWS] -> [P, DRAWS], summed over the chains
        return np.asarray(x, np.int64).reshape(problems, chains, DRAWS).sum(1)

    return Sample(
        np.asarray(sample.trace).reshape(problems, chains, DRAWS, -1),
        per_draw(sample.outputs["divergent"]),
        np.array(warmup_gradients),
        per_draw(sample.outputs["gradients"]),
        seconds,
    )


# -- BlackJAX's recipes, vmapped over problems -------------------------------------

STEPS_INFO = get_filter_adapt_info_fn(info_keys={"num_integration_steps"})


def sample_chain(kernel, state, key):
    """`DRAWS` steps of one chain: its positions, divergences and gradient counts."""

    def one_step(state, key):
        state, info = kernel.step(key, state)
        return state, (state.position, info.is_divergent, info.num_integration_steps)

    _, (positions, divergent, steps) = jax.lax.scan(
        one_step, state, jr.split(key, DRAWS)
    )
    return positions, divergent, steps


def window_nuts_problem(posterior, starts, key, data):
    """One problem: every chain warmed up by its own window adaptation, then NUTS."""
    density = ft.partial(posterior.log_density, data=data)

    def one_chain(start, key):
        warmup_key, sample_key = jr.split(key)
        warmup = blackjax.window_adaptation(
            blackjax.nuts, density, adaptation_info_fn=STEPS_INFO
        )
        (state, parameters), info = warmup.run(warmup_key, start, num_steps=WARMUP)
        kernel = blackjax.nuts(density, **parameters)
        positions, divergent, steps = sample_chain(kernel, state, sample_key)
        return positions, divergent, info.info.num_integration_steps.sum(), steps

    positions, divergent, warmup_steps, steps = jax.vmap(one_chain)(
        starts, jr.split(key, len(starts))
    )
    return positions, divergent.sum(0), warmup_steps.sum(), steps.sum(0)


def chees_dhmc_problem(posterior, starts, key, data):
    """One problem: its chains warmed up together by `chees_adaptation`, then dynamic
    HMC with the adapted values."""
    density = ft.partial(posterior.log_density, data=data)
    warmup_key, sample_key = jr.split(key)
    warmup = blackjax.chees_adaptation(
        density, len(starts), adaptation_info_fn=STEPS_INFO
    )
    (states, parameters), info = warmup.run(
        warmup_key,
        starts,
        INITIAL_STEP_SIZE,
        optax.adam(chees.ADAM_RATE, chees.ADAM_B1, chees.ADAM_B2),
        WARMUP,
    )
    kernel = blackjax.dynamic_hmc(density, **parameters)
    positions, divergent, steps = jax.vmap(ft.partial(sample_chain, kernel))(
        states, jr.split(sample_key, len(starts))
    )
    warmup_steps = info.info.num_integration_steps.sum()
    return positions, divergent.sum(0), warmup_steps, steps.sum(0)


def blackjax_recipe(problem: Callable) -> Callable:
    def run(posterior, data, starts, key) -> Sample:
        keys = jr.split(key, starts.shape[0])
        recipe = jax.jit(jax.vmap(ft.partial(problem, posterior)))
        result, seconds = timed(lambda: recipe(starts, keys, data))
        return Sample(*(np.asarray(x) for x in result), seconds)

    return run


METHODS = {
    "ours": ours,
    "window NUTS": blackjax_recipe(window_nuts_problem),
    "ChEES dHMC": blackjax_recipe(chees_dhmc_problem),
}


# -- The rows ----------------------------------------------------------------------


def run_model(posterior, problems: int, chains: int, seed: int) -> dict[str, dict]:
    """Every method on one model and layout: its problems at the gate, its gradient
    evaluations (mean over problems), its seconds and its worst mean error."""
    data_key, start_key, run_key = jr.split(jr.key(seed), 3)
    data = posteriors.simulate_problems(posterior, data_key, problems)
    superchains = problems * chains // CHAINS_PER_SUPERCHAIN
    starts = posterior.initial(start_key, superchains)
    starts = jnp.repeat(starts, CHAINS_PER_SUPERCHAIN, axis=0)
    starts = starts.reshape(problems, chains, posterior.dimension)
    results = {}
    for name, method in METHODS.items():
        sample = method(posterior, data, starts, run_key)
        at = gate(sample)
        results[name] = {
            "passed": int(at.passed.sum()),
            "draws": np.bincount(at.draws // ROUND, minlength=DRAWS // ROUND + 1)[
                1:
            ].tolist(),
            "worst_rhat": float(at.rhat.max()),
            "least_ess": float(at.ess.min()),
            "divergences": int(sample.divergences.sum()),
            "gradients": float(at.gradients.mean()),
            "seconds": sample.seconds,
            "mean_error": mean_error(posterior, data, sample),
        }
        print(
            f"  {posterior.name}, {problems} x {chains}, {name}: {results[name]}",
            file=sys.stderr,
            flush=True,
        )
    return results


def shared_against_closed_over() -> None:
    """(d): the frozen step given `shared=adapted` against the same step with
    `adapted` closed over (and given as a program argument), same chains, both warm.

    A call costs a fixed part (the host's checks and dispatches, the shared state's
    copies in and out) and a part per step. The target is per step: the slope of
    each side's best time between runs of `SHORT` and `LONG` steps. The fixed part
    is reported beside it."""
    posterior = posteriors.EIGHT_SCHOOLS_NON_CENTRED
    chains = 64
    data = jax.tree.map(jnp.asarray, posterior.reference_data)
    sample = chees.sample_step(posterior.log_density)
    # Every side gets the model's data the same way, through `functools.partial`,
    # whose arrays are arguments of the program. Closed over, the data would be
    # folded into the step as well: 8% of this step on a CPU, which is not what
    # `shared=` changes (the row first read 1.07 to 1.17 for it).
    step = ft.partial(sample, data=data)
    adapted = chees.chees_init(0.3, 3.0)
    starts = posterior.initial(jr.key(0), chains)
    keys = jr.split(jr.key(1), chains)

    def closed_over(states, keys, count, data):
        states, _, outputs = sample(states, keys, count, adapted, data)
        return states, outputs

    closed = ft.partial(closed_over, data=data)
    # The state as an argument of the program instead (a `jax.tree_util.Partial`'s
    # arrays are), which XLA cannot fold into the step.
    given = jax.tree_util.Partial(
        lambda shared, data, states, keys, count: sample(
            states, keys, count, shared, data
        )[::2],
        jax.tree.map(jnp.asarray, adapted),
        data,
    )

    def side(fn: Callable, steps: int, **options) -> Callable[[], jax.Array]:
        def run() -> jax.Array:
            chains = eb.run_chains(
                eb.all_chains(fn), starts, keys, steps, with_output=True, **options
            )
            return jax.block_until_ready(chains.trace)

        return run

    # Not bit for bit: XLA folds the closed-over constants into the step, which
    # rounds differently; a flipped accept would show as a jump far above this.
    # Over the first 20 draws: HMC's trajectories are chaotic, and the TPU's
    # roundings grew to a flipped accept by step 400 (0.06 apart there).
    ours, theirs = side(step, SHORT, shared=adapted)(), side(closed, SHORT)()
    difference = float(np.max(np.abs(ours - theirs)[:, :20]))
    assert difference < 1e-3, difference
    for name, baseline, target in (
        ("closed over", closed, 1.02),
        ("given as an argument (a Partial)", given, None),
    ):
        times = {
            steps: interleaved(
                side(step, steps, shared=adapted), side(baseline, steps), repeat=15
            )
            for steps in (SHORT, LONG)
        }
        per_step = [(times[LONG][i] - times[SHORT][i]) / (LONG - SHORT) for i in (0, 1)]
        fixed = [times[SHORT][i] - SHORT * per_step[i] for i in (0, 1)]
        ratio = per_step[0] / per_step[1]
        report(
            f"ChEES frozen step, {chains} chains: shared= / {name}, per step",
            ratio,
            "report" if target is None else f"<= {target}",
            target is None or ratio <= target,
            f"{per_step[0] * 1e6:.2f} vs {per_step[1] * 1e6:.2f} us a step (the "
            f"slope of the best of 15 from {SHORT} to {LONG} steps); a call's fixed "
            f"part {fixed[0] * 1e3:.2f} vs {fixed[1] * 1e3:.2f} ms; {SHORT} steps "
            f"{times[SHORT][0] / times[SHORT][1]:.3f} of it; the first 20 draws "
            f"within {difference:.1e}",
        )


def main() -> None:
    shared_against_closed_over()
    names = list(METHODS)
    passed = dict.fromkeys(names, 0)
    total_problems = 0
    for problems, chains in LAYOUTS:
        layout = f"{problems} x {chains}"
        by_model = {
            posterior.name: run_model(posterior, problems, chains, seed)
            for seed, posterior in enumerate(MODELS)
        }
        total_problems += problems * len(MODELS)
        for name in names:
            passed[name] += sum(r[name]["passed"] for r in by_model.values())
        gradients = {
            model: r["ours"]["gradients"] / r["window NUTS"]["gradients"]
            for model, r in by_model.items()
        }
        median = float(np.median(list(gradients.values())))
        report(
            f"warmup {layout}: gradient evaluations, ours / window NUTS (median)",
            median,
            "<= 0.5",
            median <= 0.5,
            ", ".join(
                f"{model} {gradients[model]:.2f} ({r['ours']['gradients']:.3g} vs "
                f"{r['window NUTS']['gradients']:.3g})"
                for model, r in by_model.items()
            ),
        )
        seconds = {n: sum(r[n]["seconds"] for r in by_model.values()) for n in names}
        ratio = seconds["ours"] / seconds["window NUTS"]
        report(
            f"warmup {layout}: wall to the gate, ours / window NUTS under vmap",
            ratio,
            "<= 0.2" if FULL else "report",
            ratio <= 0.2 or not FULL,
            ", ".join(f"{n} {s:.1f}s" for n, s in seconds.items())
            + "; mean errors (sd): "
            + "; ".join(
                f"{model} " + " / ".join(f"{r[n]['mean_error']:.2f}" for n in names)
                for model, r in by_model.items()
                if posteriors.POSTERIORS[model].moments is not None
            ),
        )
    better = max(passed["window NUTS"], passed["ChEES dHMC"])
    report(
        f"warmup: problems at the gate, ours / better BlackJAX, of {total_problems}",
        passed["ours"] / max(better, 1),
        ">= 1",
        passed["ours"] >= better,
        ", ".join(f"{n} {k}" for n, k in passed.items()),
    )


if __name__ == "__main__":
    main()
