from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_trees_identical
from hypothesis import given, settings, strategies as st

import eqx_batch as eb


class Block(eqx.Module):
    linear: eqx.nn.Linear
    scale: jax.Array
    activation: str = eqx.field(static=True)
    depth: int

    def __init__(self, size: int, *, activation: str = "tanh", key: jax.Array):
        linear_key, scale_key = jr.split(key)
        self.linear = eqx.nn.Linear(size, size, key=linear_key)
        self.scale = jr.uniform(scale_key, (size,))
        self.activation = activation
        self.depth = 3


def make_mlp(*, key: jax.Array) -> eqx.nn.MLP:
    return eqx.nn.MLP(2, 1, 4, 1, key=key)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), typed=st.booleans())
def test_member_equals_make_alone_bit_for_bit(n: int, seed: int, typed: bool):
    key = jr.key(seed) if typed else jr.PRNGKey(seed)
    models = eb.ensemble(Block, n, size=3, activation="relu", key=key)
    keys = jr.split(key, n)
    assert eb.batch_size(models) == n
    for i in range(n):
        alone = Block(3, activation="relu", key=keys[i])
        assert_trees_identical(eb.index(models, i), alone)


def test_non_array_fields_come_out_once(getkey):
    models = eb.ensemble(Block, 4, size=3, key=getkey())
    # Static checkers read `eb.Stacked[...]` as the model class; at run time it is a
    # class whose metaclass checks the leading dims.
    stacked: Any = eb.Stacked
    assert isinstance(models, stacked[Block, "4"])
    assert not isinstance(models, stacked[Block, "5"])
    assert models.activation == "tanh"
    assert models.depth == 3
    assert models.linear.weight.shape == (4, 3, 3)
    assert models.scale.shape == (4, 3)


@pytest.mark.accelerator
def test_function_constructor_and_eqx_module(getkey):
    key = getkey()
    models = eb.ensemble(make_mlp, 3, key=key)
    for i, k in enumerate(jr.split(key, 3)):
        assert_trees_identical(eb.index(models, i), make_mlp(key=k))
    # The same as eqx.filter_vmap over the split keys, the definition in the docs.
    assert_trees_identical(
        models, eqx.filter_vmap(lambda k: make_mlp(key=k))(jr.split(key, 3))
    )


def test_members_differ(getkey):
    models = eb.ensemble(make_mlp, 2, key=getkey())
    first, second = eb.unstack(models)
    assert not np.array_equal(first.layers[0].weight, second.layers[0].weight)


def test_under_jit_with_static_n(getkey):
    key = getkey()

    @eqx.filter_jit
    def build(key):
        return eb.ensemble(make_mlp, 3, key=key)

    models = build(key)
    assert models.layers[0].weight.shape == (3, 4, 2)


def test_numpy_integer_n(getkey):
    models = eb.ensemble(make_mlp, np.int64(2), key=getkey())  # pyright: ignore
    assert eb.batch_size(models) == 2


def test_rbg_warns():
    key = jr.key(0, impl="rbg")
    with pytest.warns(UserWarning, match="rbg"):
        models = eb.ensemble(make_mlp, 3, key=key)
    assert models.layers[0].weight.shape == (3, 4, 2)


@pytest.mark.parametrize("n", [0, -2, 2.0, True, np.bool_(True), "3", None])
def test_bad_n(n, getkey):
    with pytest.raises(eb.BatchError, match="`n` is"):
        eb.ensemble(make_mlp, n, key=getkey())


@pytest.mark.parametrize("n", [3, np.int64(3)])
def test_n_takes_numpy_integers(n, getkey):
    key = getkey()
    models = eb.ensemble(make_mlp, n, key=key)
    assert models.layers[0].weight.shape == (3, 4, 2)
    assert_trees_identical(models, eb.ensemble(make_mlp, 3, key=key))


def test_traced_n(getkey):
    build = jax.jit(lambda n, key: eb.ensemble(make_mlp, n, key=key))
    with pytest.raises(eb.BatchError, match="static"):
        build(3, getkey())


@pytest.mark.parametrize(
    "key",
    [
        0,
        np.zeros(2, np.uint32),
        jnp.zeros(2, jnp.float32),
        jnp.zeros(3, jnp.uint32),
        jr.split(jr.key(0), 3),
        jr.split(jr.PRNGKey(0), 3),
    ],
    ids=["int", "numpy", "float", "bad-shape", "split-typed", "split-legacy"],
)
def test_bad_key(key):
    with pytest.raises(eb.BatchError, match="`key`"):
        eb.ensemble(make_mlp, 3, key=key)


def test_already_split_key_says_so(getkey):
    with pytest.raises(eb.BatchError, match="pass one key, unsplit"):
        eb.ensemble(make_mlp, 3, key=jr.split(getkey(), 3))


def test_make_not_callable(getkey):
    with pytest.raises(eb.BatchError, match="not callable"):
        eb.ensemble(3, 2, key=getkey())  # pyright: ignore[reportArgumentType]


def test_make_without_key(getkey):
    def make(*, seed: jax.Array) -> jax.Array:
        return jr.normal(seed, (2,))

    with pytest.raises(
        eb.BatchError, match=r"cannot be called as `make\(\*\*kwargs, key=\.\.\.\)`"
    ):
        eb.ensemble(make, 2, key=getkey())


def test_make_with_wrong_kwargs(getkey):
    with pytest.raises(eb.BatchError, match="width"):
        eb.ensemble(Block, 2, width=3, key=getkey())


def test_make_that_raises(getkey):
    def make(*, key: jax.Array) -> jax.Array:
        raise RuntimeError("boom")

    with pytest.raises(eb.BatchError, match="RuntimeError.*boom") as info:
        eb.ensemble(make, 2, key=getkey())
    assert isinstance(info.value.__cause__, RuntimeError)


def test_make_with_control_flow_on_key(getkey):
    def make(*, key: jax.Array) -> jax.Array:
        value = jr.uniform(key)
        return value if value > 0.5 else -value

    with pytest.raises(
        eb.BatchError, match=r"under vmap(?s:.*)docs/ensembles\.md#what-is-refused"
    ):
        eb.ensemble(make, 2, key=getkey())
