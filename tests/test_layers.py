from collections.abc import Callable
from typing import Any

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


@pytest.mark.accelerator
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


# A module in the carry: its arrays are scanned, the rest is closed over.


class Hidden(eqx.Module):
    h: jax.Array
    activation: Callable[[jax.Array], jax.Array]
    label: str


def test_module_as_carry_equals_loop(getkey):
    layers = make_layers(4, 3)
    carry = Hidden(jr.normal(getkey(), (3,)), jax.nn.relu, "hidden")

    def fn(layer: Residual, carry: Hidden) -> Hidden:
        return Hidden(
            carry.activation(layer.linear(carry.h)), carry.activation, "hidden"
        )

    expected = carry
    for layer in eb.unstack(layers):
        expected = fn(layer, expected)
    ours = eb.scan_layers(layers, carry, fn=fn)
    assert ours.activation is jax.nn.relu and ours.label == "hidden"
    assert tree_allclose(ours.h, expected.h)


def test_module_as_carry_under_grad(getkey):
    layers = make_layers(3, 2)
    carry = Hidden(jr.normal(getkey(), (2,)), jnp.tanh, "hidden")

    def fn(layer: Residual, carry: Hidden) -> Hidden:
        return eqx.tree_at(lambda c: c.h, carry, layer(carry.h))

    def scanned(layers: Residual, x: jax.Array) -> jax.Array:
        return eb.scan_layers(layers, eqx.tree_at(lambda c: c.h, carry, x), fn=fn).h

    x = carry.h
    assert tree_allclose(loss(scanned)(layers, x), loss(loop)(layers, x))


def test_layer_changing_a_non_array_leaf_names_it():
    layers = make_layers(2, 3)
    carry = Hidden(jnp.ones(3), jax.nn.relu, "hidden")
    with pytest.raises(eb.BatchError, match=r"non-array leaf") as info:
        eb.scan_layers(
            layers, carry, fn=lambda layer, c: Hidden(layer(c.h), jnp.tanh, c.label)
        )
    assert "`x.activation`" in str(info.value)
    assert "`x.label`" not in str(info.value)


def test_python_number_as_the_carry_is_an_array_that_starts_as_it():
    # Issue 15, item 9: a user's running total, started at 0.0, as `jax.lax.scan`
    # takes it.
    xs = jnp.arange(5.0)

    def fn(x: jax.Array, total: Any) -> jax.Array:
        return total + x**2

    init: Any = 0.0  # what `jax.lax.scan` accepts, though typed as its carry
    expected = jax.lax.scan(lambda total, x: (fn(x, total), None), init, xs)[0]
    assert tree_allclose(eb.scan_layers(xs, 0.0, fn=fn), expected)
    assert tree_allclose(eb.scan_layers(xs, 0, fn=fn), expected)
    assert tree_allclose(jax.jit(lambda xs: eb.scan_layers(xs, 0.0, fn=fn))(xs), 30.0)
    assert tree_allclose(
        jax.grad(lambda xs: eb.scan_layers(xs, 0.0, fn=fn))(xs), 2 * xs
    )


def test_python_numbers_in_carry_change_while_functions_stay():
    layers = make_layers(2, 3)
    carry = ({"h": jnp.ones(3), "scale": 1.0}, jax.nn.relu, "name")

    def fn(layer: Residual, c: Any) -> Any:
        hidden, activation, name = c
        h = activation(layer(hidden["h"]))
        return {"h": h, "scale": hidden["scale"] * jnp.sum(h)}, activation, name

    expected = carry
    for layer in eb.unstack(layers):
        expected = fn(layer, expected)
    ours = eb.scan_layers(layers, carry, fn=fn)
    assert ours[1] is jax.nn.relu and ours[2] == "name"
    assert tree_allclose(ours[0], expected[0])
    # A layer may return a Python number for it, as in `jax.lax.scan`.
    assert eb.scan_layers(layers, (jnp.ones(3), 1.0), fn=lambda layer, c: (c[0], 2.0))[
        1
    ] == jnp.asarray(2.0)


def test_non_array_outputs_pass_through():
    layers = make_layers(3, 2)
    final, ys = eb.scan_layers(
        layers,
        jnp.ones(2),
        fn=lambda layer, x: (layer(x), {"out": layer(x), "kind": "residual"}),
        outputs=True,
    )
    assert ys["kind"] == "residual" and ys["out"].shape == (3, 2)
    assert tree_allclose(final, ys["out"][-1])


# Telling an unstacked layer, or a list of layers, from a stack.


def test_one_unstacked_layer_is_called_out(getkey):
    linear = eqx.nn.Linear(4, 4, key=getkey())
    with pytest.raises(eb.BatchError, match="looks like one layer") as info:
        eb.scan_layers(linear, jnp.ones(4))
    message = str(info.value)
    assert "`x`: float32[4] in, float32[] out" in message
    for fix in ("eb.ensemble", "eqx.filter_vmap", "eb.stack"):
        assert fix in message


def test_one_unstacked_deep_layer_is_called_out(getkey):
    # Its leaves disagree on their first axis, so the scan never starts.
    mlp = eqx.nn.MLP(4, 4, 8, 2, key=getkey())
    with pytest.raises(eb.BatchError, match="looks like one layer") as info:
        eb.scan_layers(mlp, jnp.ones(4))
    assert "layers.layers[0].weight`: 8" in str(info.value)


def test_one_unstacked_layer_raising_is_called_out(getkey):
    conv = eqx.nn.Conv1d(2, 2, 3, padding=1, key=getkey())
    with pytest.raises(eb.BatchError, match="looks like one layer") as info:
        eb.scan_layers(conv, jnp.ones((2, 5)))
    assert info.value.__cause__ is not None


def test_stacked_layers_get_no_unstacked_advice():
    with pytest.raises(eb.BatchError) as info:
        eb.scan_layers(make_layers(4, 3), jnp.ones(3), fn=lambda layer, x: layer(x)[:2])
    assert "looks like one layer" not in str(info.value)


def test_list_of_layers_is_called_out(getkey):
    layers = [eqx.nn.Linear(3, 3, key=getkey()) for _ in range(3)]
    with pytest.raises(eb.BatchError, match=r"a list of 3 layers.*eb\.stack\(layers\)"):
        eb.scan_layers(layers, jnp.ones(3))


# Stateful layers: an `eqx.nn.State` threaded through the scan.


class Cached(eqx.Module):
    """A layer with a small cache of its past outputs, like a KV cache."""

    linear: eqx.nn.Linear
    cache: eqx.nn.StateIndex

    def __init__(self, width: int, *, key: jax.Array):
        self.linear = eqx.nn.Linear(width, width, key=key)
        self.cache = eqx.nn.StateIndex(jnp.zeros((2, width)))

    def __call__(self, x: jax.Array, state: eqx.nn.State):
        cache = state.get(self.cache)
        h = jnp.tanh(self.linear(x) + jnp.mean(cache, axis=0))
        return h, state.set(self.cache, jnp.concatenate([cache[1:], h[None]]))


def stateful_loop(layers: Any, x: jax.Array, state: eqx.nn.State):
    """The unrolled reference: each layer with its own slice of the state."""
    substate = state.substate(layers)
    new = []
    for i, layer in enumerate(eb.unstack(layers)):
        x, layer_state = layer(x, eb.index(substate, i))
        new.append(layer_state)
    return x, state.update(eb.stack(new))


def state_values(state: eqx.nn.State, layers: Any) -> list[jax.Array]:
    return jax.tree.leaves(state.substate(layers))


def build_cached(how: str, depth: int, width: int, key: jax.Array):
    make = eqx.nn.make_with_state(Cached)
    if how == "ensemble":
        return eb.ensemble(make, depth, width=width, key=key)
    if how == "filter_vmap":
        return eqx.filter_vmap(lambda k: make(width, key=k))(jr.split(key, depth))
    members = [make(width, key=k) for k in jr.split(key, depth)]
    return eb.stack([m for m, _ in members]), eb.stack([s for _, s in members])


@pytest.mark.parametrize("how", ["ensemble", "filter_vmap", "stack"])
def test_state_equals_unrolled_loop(how: str, getkey):
    layers, state = build_cached(how, 4, 3, getkey())
    x = jr.normal(getkey(), (3,))

    @eqx.filter_jit
    def both(layers, x, state):
        # Two steps, so that the second reads what the first wrote.
        clone = jax.tree.map(lambda a: a, state)
        y, state = eb.scan_layers(layers, x, state=state)
        y, state = eb.scan_layers(layers, y, state=state)
        z, clone = stateful_loop(layers, x, clone)
        z, clone = stateful_loop(layers, z, clone)
        return (y, state), (z, clone)

    (y, new_state), (z, expected_state) = both(layers, x, state)
    assert tree_allclose(y, z)
    assert tree_allclose(
        state_values(new_state, layers), state_values(expected_state, layers)
    )
    assert not tree_allclose(
        state_values(new_state, layers),
        state_values(build_cached(how, 4, 3, getkey())[1], layers),
    )


def test_state_gradients_equal_unrolled_loop(getkey):
    layers, state = build_cached("ensemble", 3, 2, getkey())
    x = jr.normal(getkey(), (2,))

    def total(run):
        @eqx.filter_jit
        @eqx.filter_grad
        def grad(layers, x, state):
            y, state = run(layers, x, state)
            y, state = run(layers, y, state)
            return jnp.sum(y**2) + jnp.sum(state_values(state, layers)[0] ** 2)

        return grad

    def scanned(layers, x, state):
        return eb.scan_layers(layers, x, state=state, remat=True, unroll=2)

    clone = jax.tree.map(lambda a: a, state)
    ours = total(scanned)(layers, x, state)
    expected = total(stateful_loop)(layers, x, clone)
    assert tree_allclose(ours, expected)


class Model(eqx.Module):
    """Stacked stateful blocks inside a model that has a state of its own."""

    blocks: Cached
    steps: eqx.nn.StateIndex

    def __init__(self, *, key: jax.Array):
        self.blocks = eb.ensemble(Cached, 3, width=2, key=key)
        self.steps = eqx.nn.StateIndex(jnp.array(0))

    def __call__(self, x: jax.Array, state: eqx.nn.State):
        state = state.set(self.steps, state.get(self.steps) + 1)
        return eb.scan_layers(self.blocks, x, state=state)


def test_state_of_a_whole_model_passes_other_entries_through(getkey):
    model, state = eqx.nn.make_with_state(Model)(key=getkey())
    x = jr.normal(getkey(), (2,))
    clone = jax.tree.map(lambda a: a, state)
    y, state = model(x, state)
    y, state = model(y, state)
    clone = clone.set(model.steps, jnp.array(2))
    z, clone = stateful_loop(model.blocks, x, clone)
    z, clone = stateful_loop(model.blocks, z, clone)
    assert tree_allclose(y, z)
    assert state.get(model.steps) == 2
    assert tree_allclose(
        state_values(state, model.blocks), state_values(clone, model.blocks)
    )


def test_state_with_extra_inputs_and_outputs(getkey):
    layers, state = build_cached("ensemble", 3, 2, getkey())
    scales = jnp.array([1.0, 0.5, 2.0])

    def fn(layer, x, state, scale):
        x, state = layer(scale * x, state)
        return x, state, jnp.sum(x)

    y, state, sums = eb.scan_layers(
        layers, jnp.ones(2), fn=fn, xs=scales, state=state, outputs=True
    )
    assert sums.shape == (3,)
    assert tree_allclose(sums[-1], jnp.sum(y))
    assert state.get(layers.cache).shape == (3, 2, 2)


class Norm(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, width: int, *, key: jax.Array):
        self.linear = eqx.nn.Linear(width, width, key=key)
        self.norm = eqx.nn.BatchNorm(width, axis_name="batch", mode="ema")

    def __call__(self, x: jax.Array, state: eqx.nn.State):
        x, state = self.norm(self.linear(x), state)
        return jnp.tanh(x), state


def test_batch_norm_in_training_equals_unrolled_loop(getkey):
    # BatchNorm's batch statistics need the batch axis named: the scan runs inside
    # `jax.vmap(..., axis_name="batch")` and the state comes out unbatched.
    layers, state = eb.ensemble(eqx.nn.make_with_state(Norm), 3, width=4, key=getkey())
    xs = jr.normal(getkey(), (8, 4))

    def batched(run):
        @eqx.filter_jit
        def value_and_grad(layers, xs, state):
            def total(layers):
                ys, new_state = jax.vmap(
                    lambda x: run(layers, x, state),
                    axis_name="batch",
                    out_axes=(0, None),
                )(xs)
                return jnp.sum(ys**2), (ys, new_state)

            return eqx.filter_value_and_grad(total, has_aux=True)(layers)

        return value_and_grad

    def scanned(layers, x, state):
        return eb.scan_layers(layers, x, state=state)

    clone = jax.tree.map(lambda a: a, state)
    (_, (ys, new_state)), grads = batched(scanned)(layers, xs, state)
    (_, (zs, expected_state)), expected_grads = batched(stateful_loop)(
        layers, xs, clone
    )
    assert tree_allclose(ys, zs, rtol=1e-4, atol=1e-5)
    assert tree_allclose(grads, expected_grads, rtol=1e-4, atol=1e-5)
    assert tree_allclose(
        state_values(new_state, layers), state_values(expected_state, layers)
    )


def test_state_not_a_state(getkey):
    layers, state = build_cached("ensemble", 2, 2, getkey())
    with pytest.raises(
        eb.BatchError, match=r"`state` is a dict, not an `eqx\.nn\.State`"
    ):
        eb.scan_layers(
            layers,
            jnp.ones(2),
            state={"cache": jnp.zeros((2, 2, 2))},  # pyright: ignore[reportArgumentType, reportCallIssue]
        )


def test_state_of_other_layers_names_the_index(getkey):
    layers, _ = build_cached("ensemble", 2, 2, getkey())
    _, other = eqx.nn.make_with_state(Model)(key=getkey())
    with pytest.raises(eb.BatchError, match=r"no entry.*\n  `layers\.cache`"):
        eb.scan_layers(layers, jnp.ones(2), state=other)


def test_state_without_layer_axis_names_the_leaf(getkey):
    layers, _ = build_cached("ensemble", 4, 2, getkey())
    # The state of one layer, not of the stack: same index, no layer axis.
    _, one = eqx.nn.make_with_state(Cached)(2, key=getkey())
    with pytest.raises(eb.BatchError, match=r"state\.get\(layers\.cache\)`: 2") as info:
        eb.scan_layers(layers, jnp.ones(2), state=one)
    assert "layers.linear.weight`: 4" in str(info.value)


def test_state_for_stateless_layers():
    _, state = eqx.nn.make_with_state(Cached)(2, key=jr.key(0))
    with pytest.raises(eb.BatchError, match="holds no `eqx.nn.StateIndex`"):
        eb.scan_layers(make_layers(2, 2), jnp.ones(2), state=state)


def test_used_up_state(getkey):
    layers, state = build_cached("ensemble", 2, 2, getkey())
    eb.scan_layers(layers, jnp.ones(2), state=state)
    with pytest.raises(eb.BatchError, match="`state` cannot be read"):
        eb.scan_layers(layers, jnp.ones(2), state=state)


def test_stateful_layers_without_state(getkey):
    layers, _ = build_cached("ensemble", 2, 2, getkey())
    with pytest.raises(eb.BatchError, match=r"StateIndex` at `layers\.cache`.*state="):
        eb.scan_layers(layers, jnp.ones(2))


def test_layer_changing_its_state_names_the_leaf(getkey):
    layers, state = build_cached("ensemble", 2, 2, getkey())

    def fn(layer, x, state):
        # `state.set` refuses a new dtype itself; a mapped state does not.
        return x, jax.tree.map(lambda a: a.astype(jnp.int32), state)

    with pytest.raises(
        eb.BatchError, match=r"`state\.get\(layers\.cache\)`: float32\[2,2\] in"
    ):
        eb.scan_layers(layers, jnp.ones(2), fn=fn, state=state)


def test_fn_returning_no_state(getkey):
    layers, state = build_cached("ensemble", 2, 2, getkey())
    with pytest.raises(eb.BatchError, match=r"pair `\(x, state\)`"):
        eb.scan_layers(layers, jnp.ones(2), fn=lambda layer, x, state: x, state=state)
    _, state = build_cached("ensemble", 2, 2, getkey())
    with pytest.raises(eb.BatchError, match=r"after `x`, not an `eqx\.nn\.State`"):
        eb.scan_layers(
            layers, jnp.ones(2), fn=lambda layer, x, state: (x, None), state=state
        )
