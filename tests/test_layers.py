from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import tree_allclose
from hypothesis import given, settings, strategies as st

import eqx_batch as eb


class Residual(eqx.Module):
    linear: eqx.nn.Linear
    # A non-array field: shared by every layer, closed over by the scan.
    activation: Callable[[jax.Array], jax.Array]

    def __init__(self, width: int, *, key: jax.Array):
        self.linear = eqx.nn.Linear(width, width, key=key)
        self.activation = jax.nn.tanh

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.activation(self.linear(x))


def make_layers(depth: int, width: int, seed: int = 0) -> Residual:
    return eb.ensemble(Residual, depth, width=width, key=jr.key(seed))


def loop(layers: Residual, x: jax.Array) -> jax.Array:
    for layer in eb.unstack(layers):
        x = layer(x)
    return x


def loss(apply: Callable[[Residual, jax.Array], jax.Array]):
    @eqx.filter_grad
    def grad(layers: Residual, x: jax.Array) -> jax.Array:
        return jnp.sum(apply(layers, x) ** 2)

    return grad


@eqx.filter_jit
def scan_and_loop(layers: Residual, x: jax.Array, unroll: int | bool, remat: bool):
    # One compilation per example for both sides, forward and gradient.
    def scanned(layers: Residual, x: jax.Array) -> jax.Array:
        return eb.scan_layers(layers, x, unroll=unroll, remat=remat)

    forward = (scanned(layers, x), loop(layers, x))
    gradient = (loss(scanned)(layers, x), loss(loop)(layers, x))
    return forward, gradient


@settings(max_examples=15, deadline=None)
@given(
    depth=st.integers(1, 6),
    width=st.integers(1, 4),
    unroll=st.sampled_from([1, 2, True]),
    remat=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_equals_python_loop(depth: int, width: int, unroll, remat: bool, seed: int):
    layers = make_layers(depth, width, seed)
    x = jr.normal(jr.key(seed + 1), (width,))
    (ours, expected), (ours_grad, expected_grad) = scan_and_loop(
        layers, x, unroll, remat
    )
    assert tree_allclose(ours, expected)
    assert tree_allclose(ours_grad, expected_grad)


def test_under_jit_equals_eager(getkey):
    layers = make_layers(5, 3)
    x = jr.normal(getkey(), (3,))
    jitted = eqx.filter_jit(eb.scan_layers)(layers, x)
    assert tree_allclose(jitted, eb.scan_layers(layers, x))


def test_checks_cost_nothing_at_run_time(getkey):
    # Every check runs while tracing: the traced program is the scan and nothing else.
    layers = make_layers(4, 3)
    params, static = eqx.partition(layers, eqx.is_array)
    jaxpr = jax.make_jaxpr(
        lambda params, x: eb.scan_layers(eqx.combine(params, static), x)
    )(params, jnp.ones(3))
    assert [eqn.primitive.name for eqn in jaxpr.eqns] == ["scan"]


def test_per_layer_extra_inputs(getkey):
    layers = make_layers(4, 3)
    x = jr.normal(getkey(), (3,))
    xs = {"scale": jnp.arange(4.0), "shift": jnp.ones((4, 3)), "name": "extra"}

    def fn(layer: Residual, x: jax.Array, extra: dict) -> jax.Array:
        assert extra["name"] == "extra"
        return extra["scale"] * layer(x) + extra["shift"]

    expected = x
    for i, layer in enumerate(eb.unstack(layers)):
        expected = fn(layer, expected, eb.index(xs, i))
    assert tree_allclose(eb.scan_layers(layers, x, fn=fn, xs=xs), expected)


def test_per_layer_outputs(getkey):
    layers = make_layers(4, 3)
    x = jr.normal(getkey(), (3,))

    def fn(layer: Residual, x: jax.Array) -> tuple[jax.Array, dict]:
        y = layer(x)
        return y, {"norm": jnp.linalg.norm(y), "hidden": y}

    final, ys = eb.scan_layers(layers, x, fn=fn, outputs=True)
    expected_ys = []
    expected = x
    for layer in eb.unstack(layers):
        expected, y = fn(layer, expected)
        expected_ys.append(y)
    assert tree_allclose(final, expected)
    assert tree_allclose(ys, eb.stack(expected_ys))
    assert ys["hidden"].shape == (4, 3)


def test_extra_inputs_and_outputs_together(getkey):
    layers = make_layers(3, 2)
    x = jr.normal(getkey(), (2,))
    masks = jnp.array([1.0, 0.0, 1.0])

    def fn(layer, x, mask):
        new = mask * layer(x) + (1 - mask) * x
        return new, jnp.sum(new)

    final, sums = eb.scan_layers(layers, x, fn=fn, xs=masks, outputs=True)
    kept = eb.take(layers, jnp.array([0, 2]))
    assert tree_allclose(final, loop(kept, x))
    assert sums.shape == (3,)


def test_layers_disagree_names_the_leaves():
    layers = make_layers(4, 3)
    bad = eqx.tree_at(lambda m: m.linear.bias, layers, jnp.zeros((3, 3)))
    with pytest.raises(eb.BatchError, match=r"layers\.linear\.bias`: 3") as info:
        eb.scan_layers(bad, jnp.ones(3))
    assert "layers.linear.weight`: 4" in str(info.value)


def test_xs_disagree_with_layers_names_the_leaf():
    layers = make_layers(4, 3)
    with pytest.raises(eb.BatchError, match=r"xs\['scale'\]`: 5"):
        eb.scan_layers(
            layers,
            jnp.ones(3),
            fn=lambda layer, x, extra: layer(x),
            xs={"scale": jnp.ones(5)},
        )


def test_scalar_leaf_has_no_layer_axis():
    layers = {"weight": jnp.ones((4, 3)), "bias": jnp.array(1.0)}
    with pytest.raises(eb.BatchError, match=r"layers\['bias'\]"):
        eb.scan_layers(layers, jnp.ones(3), fn=lambda layer, x: layer["weight"] * x)


def test_no_array_leaf():
    with pytest.raises(eb.BatchError, match="no array leaf"):
        eb.scan_layers({"activation": jax.nn.relu}, jnp.ones(3))


def test_xs_without_fn():
    with pytest.raises(eb.BatchError, match="`xs` is given but `fn` is not"):
        eb.scan_layers(make_layers(2, 3), jnp.ones(3), xs=jnp.ones(2))


def test_layer_changing_the_carry_names_it():
    layers = {"weight": jnp.ones((2, 3, 4))}
    with pytest.raises(eb.BatchError, match=r"x\['h'\]`: float32\[3\] in"):
        eb.scan_layers(
            layers,
            {"h": jnp.ones(3)},
            fn=lambda layer, x: {"h": x["h"] @ layer["weight"]},
        )


def test_layer_changing_the_carry_structure():
    with pytest.raises(eb.BatchError, match="outputs=True"):
        eb.scan_layers(
            make_layers(2, 3), jnp.ones(3), fn=lambda layer, x: (layer(x), x)
        )


def test_outputs_without_a_pair():
    with pytest.raises(eb.BatchError, match=r"pair `\(x, y\)`"):
        eb.scan_layers(make_layers(2, 3), jnp.ones(3), outputs=True)
