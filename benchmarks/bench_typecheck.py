"""`eb.typecheck` inside `jit` costs nothing per call; the check itself is per leaf.

1. A stacked MLP ensemble's forward pass, `eqx.filter_jit(eb.typecheck(f))` against
   `eqx.filter_jit(f)`: the checks run when tracing, so once compiled the two must be
   the same speed (target <= 1.05).
2. The same with `jax.jit` and a dict of arrays.
3. The check when it does run (eagerly, or at trace time): `eb.Stacked[...]` against
   `jaxtyping.PyTree[Shaped[Array, "n ..."]]` on a model with many leaves (reported).
"""

# ruff: noqa: F722

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from _report import best_of, interleaved, report
from jaxtyping import Array, Float, jaxtyped, PyTree, Shaped

import eqx_batch as eb


MEMBERS, BATCH, SIZES = 8, 32, (4, 64, 64, 2)


class Linear(eqx.Module):
    weight: Float[Array, "out in"]
    bias: Float[Array, " out"]


class MLP(eqx.Module):
    layers: list[Linear]


def make_mlp(key: Array) -> MLP:
    keys = jr.split(key, len(SIZES) - 1)
    pairs = zip(SIZES[:-1], SIZES[1:], strict=True)
    return MLP(
        [
            Linear(jr.normal(k, (out, in_)) / in_**0.5, jnp.zeros(out))
            for k, (in_, out) in zip(keys, pairs, strict=True)
        ]
    )


def forward(model: MLP, x: Float[Array, "b 4"]) -> Float[Array, "b 2"]:
    for layer in model.layers[:-1]:
        x = jax.nn.tanh(x @ layer.weight.T + layer.bias[None])
    last = model.layers[-1]
    return x @ last.weight.T + last.bias[None]


def predict(
    models: eb.Stacked[MLP, " n"], x: Float[Array, "n b 4"]
) -> Float[Array, "n b 2"]:
    return jax.vmap(forward)(models, x)


def predict_dict(
    params: eb.Stacked[dict, " n"], x: Float[Array, "n b 4"]
) -> Float[Array, "n b 64"]:
    return jnp.tanh(jnp.einsum("nbi,noi->nbo", x, params["w"]) + params["b"][:, None])


def ratio_of(ours: Any, baseline: Any, args: tuple) -> tuple[float, float, float]:
    run_ours = lambda: jax.block_until_ready(ours(*args))
    run_base = lambda: jax.block_until_ready(baseline(*args))
    run_ours()  # compile both
    run_base()
    t_ours, t_base = interleaved(run_ours, run_base, repeat=60, number=50)
    return t_ours / t_base, t_ours, t_base


def main() -> None:
    key = jr.key(0)
    models = eqx.filter_vmap(make_mlp)(jr.split(key, MEMBERS))
    x = jr.normal(jr.key(1), (MEMBERS, BATCH, SIZES[0]))

    ratio, t_ours, t_base = ratio_of(
        eqx.filter_jit(eb.typecheck(predict)), eqx.filter_jit(predict), (models, x)
    )
    report(
        "typecheck filter_jit MLP",
        ratio,
        "<= 1.05",
        ratio <= 1.05,
        f"{t_ours * 1e6:.1f} us vs {t_base * 1e6:.1f} us per call, checks at trace",
    )

    params = {
        "w": jr.normal(key, (MEMBERS, 64, SIZES[0])),
        "b": jnp.zeros((MEMBERS, 64)),
    }
    ratio, t_ours, t_base = ratio_of(
        jax.jit(eb.typecheck(predict_dict)), jax.jit(predict_dict), (params, x)
    )
    report(
        "typecheck jax.jit dict",
        ratio,
        "<= 1.05",
        ratio <= 1.05,
        f"{t_ours * 1e6:.1f} us vs {t_base * 1e6:.1f} us per call, checks at trace",
    )

    # What one check costs when it runs: a 40-layer stack, 80 leaves.
    deep = MLP([Linear(jnp.ones((MEMBERS, 8, 8)), jnp.ones((MEMBERS, 8)))] * 40)
    leaves = len(jax.tree.leaves(deep))
    stacked: Any = eb.Stacked[MLP, " n"]
    as_pytree: Any = PyTree[Shaped[Array, "n ..."]]

    def check(annotation: Any) -> None:
        with jaxtyped("context"):
            assert isinstance(deep, annotation)

    check(stacked)  # build the caches of both
    check(as_pytree)
    t_ours = best_of(lambda: check(stacked), repeat=7, number=20)
    t_base = best_of(lambda: check(as_pytree), repeat=7, number=20)
    report(
        "Stacked check vs PyTree[...]",
        t_ours / t_base,
        "report",
        True,
        f"per leaf: {t_ours / leaves * 1e6:.1f} us vs {t_base / leaves * 1e6:.1f} us "
        f"({leaves} leaves; ours also checks field shapes per member)",
    )


if __name__ == "__main__":
    main()
