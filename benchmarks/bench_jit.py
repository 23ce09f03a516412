"""`eb.filter_jit` against `jax.jit` on the partitioned arrays, with `eqx.filter_jit`.

The job is one training step of an ensemble of MLPs with per-member Adam
(`eb.per_member(optax.adam(...))`), taken many times in a loop, each step's model and
optimiser state going into the next, as a training loop does; the loop waits for its
last result. The baseline is what one writes by hand for speed: `jax.jit` of the same
step on the model's arrays, the static part put back inside. Every timed loop is run
once first and its results compared bit for bit with the baseline's. Rows:

- dispatch-bound (8 MLPs of width 32, 64 points): the per-call cost of the wrapper
    shows; `eqx.filter_jit`'s ratio is reported beside ours;
- compute-bound (width 512, 4096 points): the wrapper must cost nothing.

Usage: `python benchmarks/bench_jit.py` (or through `benchmarks/run.py jit`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from _report import interleaved, report

import eqx_batch as eb


MEMBERS = 8
OPTIMISER = eb.per_member(optax.adam(1e-3))


def step(model, opt_state, x, y):
    """One Adam step of every member on its mean squared error."""

    def loss(model):
        def member_loss(member):
            return jnp.mean((jax.vmap(member)(x) - y) ** 2)

        losses = eqx.filter_vmap(member_loss)(model)
        return jnp.sum(losses), losses

    grads, losses = eqx.filter_grad(loss, has_aux=True)(model)
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = OPTIMISER.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, losses


def case(
    name: str, width: int, points: int, steps: int, repeat: int, target: float
) -> None:
    keys = jr.split(jr.key(0), MEMBERS)
    model = eqx.filter_vmap(lambda key: eqx.nn.MLP(1, 1, width, 2, key=key))(keys)
    opt_state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    x = jr.normal(jr.key(1), (points, 1))
    y = jnp.sin(3 * x)

    params, static = eqx.partition(model, eqx.is_array)

    @jax.jit
    def array_step(params, opt_state, x, y):
        model, opt_state, losses = step(eqx.combine(params, static), opt_state, x, y)
        return eqx.filter(model, eqx.is_array), opt_state, losses

    ours_step = eb.filter_jit(step)
    eqx_step = eqx.filter_jit(step)

    def loop(one_step, start):
        def run():
            state = start
            for _ in range(steps):
                state = one_step(*state, x, y)[:2]
            return jax.block_until_ready(state)

        return run

    ours = loop(ours_step, (model, opt_state))
    equinox = loop(eqx_step, (model, opt_state))
    baseline = loop(array_step, (params, opt_state))

    # Bit for bit the same training, then every loop is compiled and warm.
    expected = jax.tree.leaves(baseline())
    for got in (ours(), equinox()):
        arrays = jax.tree.leaves(eqx.filter(got, eqx.is_array))
        for a, b in zip(arrays, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    t_ours, t_base = interleaved(ours, baseline, repeat=repeat)
    t_eqx, t_base_eqx = interleaved(equinox, baseline, repeat=repeat)
    per_step = 1e6 / steps
    ratio = t_ours / t_base
    report(
        f"filter_jit {name}: eb.filter_jit / jax.jit",
        ratio,
        f"<= {target}",
        ratio <= target,
        f"ours {t_ours * per_step:.0f} us, jax.jit {t_base * per_step:.0f} us per step",
    )
    report(
        f"filter_jit {name}: eqx.filter_jit / jax.jit",
        t_eqx / t_base_eqx,
        "report",
        True,
        f"eqx.filter_jit {t_eqx * per_step:.0f} us, "
        f"jax.jit {t_base_eqx * per_step:.0f} us per step",
    )


if __name__ == "__main__":
    case("dispatch-bound (8 MLPs, width 32, 64 points)", 32, 64, 200, 7, 1.3)
    case("compute-bound (8 MLPs, width 512, 4096 points)", 512, 4096, 2, 4, 1.02)
