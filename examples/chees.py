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

It prints the adapted step size and trajectory length and the posterior means and
variances against the reference moments, and ends with one line `RESULT {...}` in
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


TARGET_ACCEPTANCE = 0.651  # optimal for HMC as the dimension grows (Beskos et al.)
# Dual averaging (Nesterov 2009, as NUTS uses it): t0 damps the first steps, gamma
# sets how far the step size moves; the iterate is shrunk towards 10x the start.
DA_T0, DA_GAMMA = 10.0, 0.05
# The values the sampling phase uses are averages of the iterates' logarithms, with
# weight t^-0.5 on the t-th: the paper's choice, which forgets the first steps fast.
AVERAGE_DECAY = 0.5
# Adam on log T (optax.adam's defaults but the rate, which is the paper's).
ADAM_RATE, ADAM_B1, ADAM_B2, ADAM_EPS = 0.025, 0.9, 0.999, 1e-8
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


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.parse_args()

    posterior = posteriors.EIGHT_SCHOOLS_NON_CENTRED
    data = jax.tree.map(jnp.asarray, posterior.reference_data)
    num_chains = 128
    starts = posterior.initial(jr.key(0), num_chains)
    begin = time.perf_counter()
    warm, shared, _, warm_outputs = run_loop(
        ft.partial(warmup_step(posterior.log_density), data=data),
        starts,
        jr.key(1),
        500,
        chees_init(0.1),
    )
    final, _, trace, outputs = run_loop(
        ft.partial(sample_step(posterior.log_density), data=data),
        warm,
        jr.key(2),
        500,
        shared,
    )
    draws = np.asarray(trace, np.float64).reshape(-1, posterior.dimension)
    moments = posterior.moments(data)
    sd = np.sqrt(moments.variance)
    result = {
        "seconds": time.perf_counter() - begin,
        "step_size": float(shared.step_size),
        "trajectory_length": float(shared.trajectory_length),
        "acceptance": float(outputs["acceptance"].mean()),
        "divergent": int(outputs["divergent"].sum()),
        "mean_error_sd": float(np.max(np.abs(draws.mean(0) - moments.mean) / sd)),
        "variance_error": float(np.max(np.abs(draws.var(0) / moments.variance - 1.0))),
    }
    print(result)
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
