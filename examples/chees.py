"""ChEES-HMC: step size and trajectory length adapted across many chains (issue 44).

The recipe of Hoffman, Radul and Sountsov ("An adaptive MCMC scheme for setting
trajectory lengths in Hamiltonian Monte Carlo", AISTATS 2021), written here with JAX:

- every chain of a problem runs HMC with ONE step size and ONE trajectory length T,
  jittered: each step makes ceil(u T / step size) leapfrog steps, u in (0, 1] from a
  Halton (van der Corput, base 2) sequence, the same u for every chain of the step;
- the step size is adapted by dual averaging towards a harmonic-mean acceptance
  probability of 0.651 over the chains;
- log T is adapted by Adam, ascending the ChEES criterion (the change in the
  estimator of the expected square) estimated over the chains;
- the sampling phase runs the kernel with the averaged step size and T frozen.

The adaptation's state, `ChEESState`, is the `shared` state of `eb.run_chains`: one
pytree without a chain axis, carried through the loop beside the chains.

    python examples/chees.py [--out DIR]

It runs eight schools (non-centred, `examples/posteriors.py`) as one problem of 128
chains and as 8 problems (simulated data) of 64 chains, each warmed up until nested
R-hat passes and then sampled with its adapted values frozen. It prints the adapted
step sizes and trajectory lengths and the posterior means against the reference
moments, and ends with one line `RESULT {...}` in
JSON, for scripts and tests to read. It writes nothing (`--out` is accepted for
uniformity).
"""

import argparse
import functools as ft
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import posteriors

import eqx_batch as eb


TARGET_ACCEPTANCE = 0.651  # optimal for HMC as the dimension grows (Beskos et al.)
# Dual averaging (Nesterov 2009, as NUTS uses it): t0 damps the first steps, gamma
# sets how far the step size moves; the iterate is shrunk towards 10x the start.
DA_T0, DA_GAMMA = 10.0, 0.05
# The values the sampling phase uses are averages of the iterates' logarithms, with
# weight t^-0.5 on the t-th: the paper's choice, which forgets the first steps fast.
AVERAGE_DECAY = 0.5
# Adam on log T as the paper's authors run it (TensorFlow Probability's
# `GradientBasedTrajectoryLengthAdaptation`): the rate 0.025, no momentum, and a
# short memory of the squared gradient (0.5). optax's defaults (0.9, 0.999) kept
# the huge gradients of chains far from their mode in that memory for a thousand
# steps: on the logistic regression T stayed at one leapfrog step (issue 44 (a)).
ADAM_RATE, ADAM_B1, ADAM_B2, ADAM_EPS = 0.025, 0.0, 0.5, 1e-8
MAX_LEAPFROG_STEPS = 1000  # a trajectory is cut there, and T clipped to it
DIVERGENCE = 1000.0  # an energy error above this is a divergence


class ChEESState(NamedTuple):
    """The adaptation's state: scalars shared by every chain of a problem."""

    log_step_size: jax.Array  # dual averaging's iterate, used while adapting
    log_step_size_average: jax.Array  # what the sampling phase uses
    error_average: jax.Array  # dual averaging's mean of (target - acceptance)
    log_step_size_anchor: jax.Array  # log(10 x initial step size)
    log_trajectory_length: jax.Array  # Adam's iterate, used while adapting
    log_trajectory_length_average: jax.Array  # what the sampling phase uses
    adam_mean: jax.Array  # Adam's first moment of the gradient of -ChEES
    adam_square: jax.Array  # and its second
    iteration: jax.Array  # int32: adaptation steps done

    @property
    def step_size(self) -> jax.Array:
        """The adapted (averaged) step size."""
        return jnp.exp(self.log_step_size_average)

    @property
    def trajectory_length(self) -> jax.Array:
        """The adapted (averaged) trajectory length."""
        return jnp.exp(self.log_trajectory_length_average)


def chees_init(step_size: float, trajectory_length: float | None = None) -> ChEESState:
    """The adaptation's state before its first step.

    **Arguments:**

    - `step_size`: the initial step size.
    - `trajectory_length`: the initial T; `None` starts at one leapfrog step.

    **Returns:**

    A `ChEESState` of float32 scalars (and an int32 iteration).
    """
    log_step = jnp.log(jnp.float32(step_size))
    log_length = jnp.log(jnp.float32(trajectory_length or step_size))
    zero = jnp.float32(0.0)
    return ChEESState(
        log_step, log_step, zero, log_step + jnp.log(jnp.float32(10.0)),
        log_length, log_length, zero, zero, jnp.int32(0),
    )  # fmt: skip


def halton(index: jax.Array) -> jax.Array:
    """The van der Corput sequence in base 2 at `index + 1`: a number in (0, 1)
    whose successive values fill the interval evenly, so that the jittered lengths
    cover their range with less variance than uniform draws."""
    bits = jnp.arange(31, dtype=jnp.int32)
    digits = ((index + 1) >> bits) & 1
    weights = jnp.exp2(-(bits + 1).astype(jnp.float32))
    return jnp.sum(digits.astype(jnp.float32) * weights)


class Proposal(NamedTuple):
    """One HMC step of every chain: what the adaptation reads."""

    positions: jax.Array  # [C, D] after the accept / reject
    proposed: jax.Array  # [C, D] the ends of the trajectories (starts if divergent)
    momenta: jax.Array  # [C, D] the momenta there, not negated
    acceptance: jax.Array  # [C] Metropolis acceptance probabilities, 0 if divergent
    divergent: jax.Array  # [C] bool


def hmc(
    log_density: Callable,
    positions: jax.Array,
    keys: jax.Array,
    step_size: jax.Array,
    num_steps: jax.Array,
) -> Proposal:
    """One HMC step of every chain, all with `num_steps` leapfrog steps of
    `step_size` and an identity mass matrix.

    **Arguments:**

    - `log_density`: `log_density(position [D]) -> []`.
    - `positions`: `[C, D]`, one row per chain; `keys`: one key per chain.
    - `step_size`, `num_steps`: scalars shared by the chains.

    **Returns:**

    A `Proposal`.
    """
    value_and_grad = jax.vmap(jax.value_and_grad(log_density))
    momentum_key, accept_key = jax.vmap(jr.split, out_axes=1)(keys)
    momenta = jax.vmap(lambda k: jr.normal(k, positions.shape[1:]))(momentum_key)
    log_p, grad = value_and_grad(positions)

    def leapfrog(_, carry):
        q, p, grad = carry
        p = p + 0.5 * step_size * grad
        q = q + step_size * p
        _, grad = value_and_grad(q)
        return q, p + 0.5 * step_size * grad, grad

    q, p, _ = jax.lax.fori_loop(0, num_steps, leapfrog, (positions, momenta, grad))
    energy_start = -log_p + 0.5 * jnp.sum(momenta**2, axis=1)
    energy_end = -value_and_grad(q)[0] + 0.5 * jnp.sum(p**2, axis=1)
    energy_error = energy_end - energy_start
    divergent = ~(energy_error < DIVERGENCE)  # NaN included
    acceptance = jnp.where(divergent, 0.0, jnp.exp(jnp.minimum(-energy_error, 0.0)))
    uniform = jax.vmap(jr.uniform)(accept_key)
    accept = uniform < acceptance
    proposed = jnp.where(divergent[:, None], positions, q)
    return Proposal(
        jnp.where(accept[:, None], q, positions),
        proposed,
        jnp.where(divergent[:, None], 0.0, p),
        acceptance,
        divergent,
    )


def leapfrog_steps(
    trajectory_length: jax.Array, step_size: jax.Array, jitter: jax.Array
) -> jax.Array:
    """ceil(jitter T / step size), between 1 and `MAX_LEAPFROG_STEPS`."""
    steps = jnp.ceil(jitter * trajectory_length / step_size)
    return jnp.clip(steps, 1, MAX_LEAPFROG_STEPS).astype(jnp.int32)


def adapt(
    state: ChEESState, proposal: Proposal, start: jax.Array, jitter
) -> ChEESState:
    """One adaptation step from every chain's HMC step.

    **Arguments:**

    - `state`: the adaptation's state the step was made with.
    - `proposal`: the step of every chain; `start`: `[C, D]` positions before it.
    - `jitter`: the step's u, its trajectory being u exp(log T).

    **Returns:**

    The next `ChEESState`.
    """
    t = (state.iteration + 1).astype(jnp.float32)
    kept = ~proposal.divergent
    num_kept = jnp.sum(kept.astype(jnp.float32))
    # Dual averaging on the harmonic mean of the acceptance probabilities: unlike
    # the arithmetic mean it is dragged down by the chains that hardly move, which
    # for ChEES's shared step size are the ones that matter.
    inverse = jnp.sum(jnp.where(kept, 1.0 / proposal.acceptance, 0.0))
    harmonic = jnp.where(kept.any(), num_kept / inverse, 0.0)
    error = (1.0 - 1.0 / (t + DA_T0)) * state.error_average + (
        TARGET_ACCEPTANCE - harmonic
    ) / (t + DA_T0)
    log_step = state.log_step_size_anchor - jnp.sqrt(t) / DA_GAMMA * error
    weight = t**-AVERAGE_DECAY

    # The ChEES gradient with respect to log T, per chain (the paper's eq. 6): the
    # change in the squared distance from the chains' mean, times the speed at which
    # the proposal moves away from it, times d(trajectory)/d(log T) = u T.
    def centred(x):
        total = jnp.sum(jnp.where(kept[:, None], x, 0.0), axis=0, keepdims=True)
        return x - total / jnp.maximum(num_kept, 1.0)

    end, begin = centred(proposal.proposed), centred(start)
    change = jnp.sum(end**2, axis=1) - jnp.sum(begin**2, axis=1)
    per_chain = change * jnp.sum(end * proposal.momenta, axis=1)
    per_chain *= jitter * jnp.exp(state.log_trajectory_length)
    # Weighted by acceptance: a rejected proposal changes nothing.
    gradient = jnp.sum(proposal.acceptance * per_chain) / jnp.sum(proposal.acceptance)
    finite = jnp.isfinite(gradient)
    # Adam minimises, so it is given the gradient of -ChEES.
    mean = ADAM_B1 * state.adam_mean - (1.0 - ADAM_B1) * gradient
    square = ADAM_B2 * state.adam_square + (1.0 - ADAM_B2) * gradient**2
    move = (mean / (1.0 - ADAM_B1**t)) / (
        jnp.sqrt(square / (1.0 - ADAM_B2**t)) + ADAM_EPS
    )
    # Above the cap, T no longer changes the trajectory. (No floor at one leapfrog
    # step: when the step size jumps up in the first steps, a floor would drag T up
    # with it, to a length Adam takes hundreds of steps to come back from.)
    log_length = jnp.minimum(
        state.log_trajectory_length - ADAM_RATE * move,
        log_step + jnp.log(jnp.float32(MAX_LEAPFROG_STEPS)),
    )
    log_length = jnp.where(finite, log_length, state.log_trajectory_length)

    def averaged(average, new):
        return (1.0 - weight) * average + weight * new

    return ChEESState(
        log_step,
        averaged(state.log_step_size_average, log_step),
        error,
        state.log_step_size_anchor,
        log_length,
        averaged(state.log_trajectory_length_average, log_length),
        jnp.where(finite, mean, state.adam_mean),
        jnp.where(finite, square, state.adam_square),
        state.iteration + 1,
    )


def warmup_step(log_density: Callable) -> Callable:
    """The ChEES warmup as a step of every chain of one problem.

    **Arguments:**

    - `log_density`: `log_density(position [D], data) -> []`.

    **Returns:**

    `fn(states, keys, count, shared, data=None) -> (states, shared, outputs)`:
    one jittered HMC step of every chain (`states`: `[C, D]`) with the step size
    and trajectory length of `shared` (a `ChEESState`), then one adaptation step.
    `outputs` holds each chain's acceptance probability and divergence.
    """

    def fn(states, keys, count, shared, data=None):
        jitter = halton(count)
        step_size = jnp.exp(shared.log_step_size)
        num_steps = leapfrog_steps(
            jnp.exp(shared.log_trajectory_length), step_size, jitter
        )
        density = ft.partial(log_density, data=data)
        proposal = hmc(density, states, keys, step_size, num_steps)
        shared = adapt(shared, proposal, states, jitter)
        outputs = {"acceptance": proposal.acceptance, "divergent": proposal.divergent}
        return proposal.positions, shared, outputs

    return fn


def sample_step(log_density: Callable) -> Callable:
    """Jittered HMC with the adapted values frozen: the same signature as
    `warmup_step`'s step, `shared` returned unchanged.

    **Arguments:**

    - `log_density`: `log_density(position [D], data) -> []`.

    **Returns:**

    `fn(states, keys, count, shared, data=None) -> (states, shared, outputs)`.
    """

    def fn(states, keys, count, shared, data=None):
        jitter = halton(count)
        num_steps = leapfrog_steps(shared.trajectory_length, shared.step_size, jitter)
        density = ft.partial(log_density, data=data)
        proposal = hmc(density, states, keys, shared.step_size, num_steps)
        outputs = {"acceptance": proposal.acceptance, "divergent": proposal.divergent}
        return proposal.positions, shared, outputs

    return fn


def run_loop(fn: Callable, states, key, num_steps: int, shared) -> tuple:
    """Runs `fn` for `num_steps` steps in a `lax.scan`: the plain loop that checks
    the kernel apart from `eb.run_chains`.

    **Arguments:**

    - `fn`: `fn(states, keys, count, shared) -> (states, shared, outputs)`.
    - `states`: `[C, D]`; `key`: one key, split into one per chain and step.
    - `num_steps`: steps to run; `shared`: the initial shared state.

    **Returns:**

    `(states, shared, trace, outputs)`: the final states and shared state, and
    the states and outputs after every step, `[C, num_steps, ...]`.
    """

    @jax.jit
    def run(states, key, shared):
        def body(carry, count):
            states, shared = carry
            keys = jr.split(jr.fold_in(key, count), states.shape[0])
            states, shared, outputs = fn(states, keys, count, shared)
            return (states, shared), (states, outputs)

        counts = jnp.arange(num_steps, dtype=jnp.int32)
        (states, shared), (trace, outputs) = jax.lax.scan(
            body, (states, shared), counts
        )
        swap = ft.partial(jnp.swapaxes, axis1=0, axis2=1)
        return states, shared, swap(trace), jax.tree.map(swap, outputs)

    return run(states, key, shared)


def warm_then_sample(posterior, data, starts, keys, shared, superchains: int):
    """The two phases with `eb.run_chains`: the warmup, stopped per problem by
    nested R-hat, then a fresh sample from where it stopped with the adapted values
    frozen. Two calls, because a kernel that still adapts is not a fixed Markov
    kernel (its draws need not have the posterior as their law), and the draws of
    the window that passed a stopping rule are biased towards passing it.

    **Arguments:**

    - `posterior`: an `examples/posteriors.py` model; `data`: its data, one row
        per problem (`None` for one problem, then given by closure).
    - `starts`: one start per superchain; `keys`: one key per chain.
    - `shared`: the initial `ChEESState` (one row per problem with `data`).
    - `superchains`: superchains of every problem together.

    **Returns:**

    `(warmup, sample)`: the two `eb.Chains`.
    """
    many = data is not None
    warmup_fn, sample_fn = (
        f(posterior.log_density) for f in (warmup_step, sample_step)
    )
    if not many:
        row = jax.tree.map(jnp.asarray, posterior.reference_data)
        warmup_fn = ft.partial(warmup_fn, data=row)
        sample_fn = ft.partial(sample_fn, data=row)
    warmup = eb.run_chains(
        eb.all_chains(warmup_fn),
        starts,
        keys,
        1000,  # the cap
        shared=shared,
        data=data,
        superchains=superchains,
        # Ends the warmup when the chains have forgotten their starts, which is
        # what a warmup is for and what nested R-hat over superchains measures. A
        # rule on the adaptation alone (the step size settled) could stop chains
        # that still carry their starts.
        until=eb.converged(every=200),
        # But not before T has grown: the first 200 steps only adapt (their draws
        # are not checked), so the first check is at step 400. On an easy posterior
        # nested R-hat passed at step 200 while T was about one leapfrog step, and
        # the frozen sample was a random walk (`docs/benchmarks.md`, issue 44 (a)).
        burn_in=200,
        trace=False,
        with_output=True,
    )
    adapted = warmup.problems.shared if many else warmup.shared
    sample = eb.run_chains(
        eb.all_chains(sample_fn),
        warmup.final,
        warmup.keys,
        500,
        shared=adapted,
        data=data,
        with_output=True,
    )
    return warmup, sample


def moment_errors(draws, moments) -> tuple[float, float]:
    """The largest |mean error| in posterior sds, and |variance ratio - 1|, over
    the coordinates of `draws` `[chains, draws, D]`."""
    draws = np.asarray(draws, np.float64).reshape(-1, draws.shape[-1])
    sd = np.sqrt(moments.variance)
    mean_error = np.abs(draws.mean(0) - moments.mean) / sd
    return float(mean_error.max()), float(
        np.abs(draws.var(0) / moments.variance - 1.0).max()
    )


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.parse_args()
    posterior = posteriors.EIGHT_SCHOOLS_NON_CENTRED
    result: dict[str, Any] = {}

    # One problem: the classic data, 8 superchains of 16 chains.
    begin = time.perf_counter()
    warmup, sample = warm_then_sample(
        posterior,
        None,
        posterior.initial(jr.key(0), 8),
        jr.split(jr.key(1), 128),
        chees_init(0.1),
        superchains=8,
    )
    moments = posterior.moments(posterior.reference_data)
    mean_error, variance_error = moment_errors(sample.trace, moments)
    draws = np.asarray(sample.trace, np.float64).reshape(-1, posterior.dimension)
    print(f"{posterior.name}, classic data, 128 chains:")
    print(f"  warmup stopped after {warmup.steps_done} steps ({warmup.stopped.reason})")
    print(
        f"  step size {float(sample.shared.step_size):.3f}, trajectory length "
        f"{float(sample.shared.trajectory_length):.2f}"
    )
    print(f"  {'':14} {'mean':>8} {'reference':>10} {'sd':>8} {'reference':>10}")
    for i, name in enumerate(posterior.coordinates):
        print(
            f"  {name:14} {draws[:, i].mean():8.3f} {moments.mean[i]:10.3f}"
            f" {draws[:, i].std():8.3f} {np.sqrt(moments.variance[i]):10.3f}"
        )
    result["one"] = {
        "warmup_steps": warmup.steps_done,
        "converged": bool(warmup.stopped.converged),
        "step_size": float(sample.shared.step_size),
        "trajectory_length": float(sample.shared.trajectory_length),
        "acceptance": float(np.mean(sample.outputs["acceptance"])),
        "divergent": int(np.sum(sample.outputs["divergent"])),
        "mean_error_sd": mean_error,
        "variance_error": variance_error,
        "seconds": time.perf_counter() - begin,
    }

    # Many problems: 8 datasets from the model, each with its own 4 superchains of
    # 16 chains, its own adaptation (a row of `shared`) and its own stop.
    begin = time.perf_counter()
    num_problems = 8
    data = posteriors.simulate_problems(posterior, jr.key(2), num_problems)
    shared = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (num_problems,)), chees_init(0.1)
    )
    warmup, sample = warm_then_sample(
        posterior,
        data,
        posterior.initial(jr.key(3), num_problems * 4),
        jr.split(jr.key(4), num_problems * 64),
        shared,
        superchains=num_problems * 4,
    )
    adapted = sample.problems.shared
    errors = [
        moment_errors(
            sample.problem(p).trace,
            posterior.moments(jax.tree.map(lambda x, p=p: x[p], data)),
        )
        for p in range(num_problems)
    ]
    print(f"\n{num_problems} problems (simulated data), 64 chains each:")
    print(f"  {'problem':>7} {'warmup':>6} {'step':>6} {'length':>6} {'mean err':>8}")
    for p in range(num_problems):
        print(
            f"  {p:7} {warmup.problems.steps_done[p]:6}"
            f" {float(adapted.step_size[p]):6.3f}"
            f" {float(adapted.trajectory_length[p]):6.2f} {errors[p][0]:8.3f}"
        )
    result["many"] = {
        "warmup_steps": warmup.problems.steps_done.tolist(),
        "step_size": np.asarray(adapted.step_size).tolist(),
        "trajectory_length": np.asarray(adapted.trajectory_length).tolist(),
        "mean_error_sd": [e[0] for e in errors],
        "variance_error": [e[1] for e in errors],
        "seconds": time.perf_counter() - begin,
    }
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
