"""Static checks: pyright (`nox -s typecheck`) reads `eb.Stacked[Model, "n"]` as Model.

Pytest does not collect this file; `test_typing.py` calls these functions so the same
annotations are known to work at run time too.
"""

# The `# pyright: ignore[...]` below must be needed: were `Stacked[...]` read as `Any`,
# or as anything but the model class, pyright would report an unneeded ignore.
# pyright: reportUnnecessaryTypeIgnoreComment=true
# Ruff reads the dims strings of jaxtyping annotations as forward references; a
# leading space (" n") keeps a single name from being one, F722 covers the rest.
# ruff: noqa: F722

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

import eqx_batch as eb


class Affine(eqx.Module):
    weight: Float[Array, "out in"]
    bias: Float[Array, " out"]


def affine_weight(model: Affine) -> Float[Array, "..."]:
    return model.weight


@eb.typecheck
def stacked_weight(models: eb.Stacked[Affine, " n"]) -> Float[Array, "n out in"]:
    # A stacked model is accepted wherever its class is expected.
    return affine_weight(models)


@eb.typecheck
def first_member(models: eb.Stacked[Affine, " n"]) -> Affine:
    return Affine(models.weight[0], models.bias[0])


def make_stacked(n: int) -> eb.Stacked[Affine, " n"]:
    return Affine(jnp.ones((n, 3, 2)), jnp.zeros((n, 3)))


def stacked_is_not_an_int(models: eb.Stacked[Affine, " n"]) -> int:
    return models  # pyright: ignore[reportReturnType]


stacked: eb.Stacked[Affine, " n"] = make_stacked(4)
as_affine: Affine = stacked
