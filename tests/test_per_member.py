from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from hypothesis import given, settings, strategies as st

import eqx_batch as eb


N = 3
X = jnp.linspace(-1.0, 1.0, 8)[:, None]
# Targets of very different scales, so that members' gradient norms differ and
# clipping by the norm of the whole ensemble differs from clipping per member.
Y = jnp.stack([(5.0 * i + 1.0) * jnp.sin(3.0 * X) for i in range(N)])


def make_models(seed: int = 0) -> eqx.nn.MLP:
    return eb.ensemble(
        eqx.nn.MLP, N, in_size=1, out_size=1, width_size=8, depth=1, key=jr.key(seed)
    )


def member_loss(model: eqx.nn.MLP, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(X) - y) ** 2)


def ensemble_loss(models: eqx.nn.MLP) -> jax.Array:
    return jnp.sum(eqx.filter_vmap(member_loss)(models, Y))


def make_step(tx: Any, loss: Any) -> Any:
    """One jitted training step; reused across members so it compiles once."""

    @eqx.filter_jit
    def step(model: Any, state: Any, *data: Any) -> tuple[Any, Any]:
        grads = eqx.filter_grad(loss)(model, *data)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    return step


def train(model: Any, tx: Any, steps: int, *data: Any, step: Any = None) -> Any:
    step = step or make_step(tx, member_loss if data else ensemble_loss)
    state = tx.init(eqx.filter(model, eqx.is_array))
    for _ in range(steps):
        model, state = step(model, state, *data)
    return model


def train_alone(models: Any, tx: Any, steps: int) -> Any:
    """Each member trained on its own, with its own state, restacked."""
    step = make_step(tx, member_loss)
    return eb.stack(
        [
            train(member, tx, steps, Y[i], step=step)
            for i, member in enumerate(eb.unstack(models))
        ]
    )


def clipped_adam() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


def test_training_equals_each_member_alone():
    # optax's Adam computes `decay ** count` from a Python float and an int32 count,
    # which the suite's strict dtype promotion rejects; users run with the default.
    with jax.numpy_dtype_promotion("standard"):
        models = make_models()
        trained = train(models, eb.per_member(clipped_adam()), 5)
        plain = train(models, clipped_adam(), 5)
        alone = train_alone(models, clipped_adam(), 5)
    assert tree_allclose(trained, alone, rtol=1e-4, atol=1e-5)
    # The plain transform clips by the norm of the whole ensemble, which is not the
    # same training.
    assert not tree_allclose(plain, alone, rtol=1e-4, atol=1e-5)


@eqx.filter_jit
def clip_per_member_and_alone(models: Any, max_norm: jax.Array) -> tuple[Any, Any]:
    grads = eqx.filter(eqx.filter_grad(ensemble_loss)(models), eqx.is_array)
    tx = optax.clip_by_global_norm(max_norm)
    optim = eb.per_member(tx)
    updates, _ = optim.update(grads, optim.init(grads))
    alone = [tx.update(member, tx.init(member))[0] for member in eb.unstack(grads)]
    return updates, eb.stack(alone)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), max_norm=st.floats(0.1, 10.0))
def test_clipping_is_per_member(seed: int, max_norm: float):
    updates, alone = clip_per_member_and_alone(make_models(seed), jnp.float32(max_norm))
    assert tree_allclose(updates, alone, rtol=1e-5, atol=1e-6)
    for member in eb.unstack(updates):
        assert optax.tree.norm(member) <= max_norm * (1 + 1e-5)


def test_state_counts_are_per_member():
    schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
    optim = eb.per_member(optax.sgd(schedule))
    state = optim.init(eqx.filter(make_models(), eqx.is_array))
    counts = [leaf for leaf in jax.tree.leaves(state) if leaf.dtype == jnp.int32]
    assert counts and all(count.shape == (N,) for count in counts)


def test_multisteps_per_member():
    def tx() -> optax.MultiSteps:
        return optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)

    models = make_models()
    # MultiSteps, like Adam, mixes int32 counters into float arithmetic.
    with jax.numpy_dtype_promotion("standard"):
        trained = train(models, eb.per_member(tx()), 3)
        alone = train_alone(models, tx(), 3)
    assert tree_allclose(trained, alone, rtol=1e-5, atol=1e-6)


def test_whole_module_as_params_and_none_params():
    # optax's annotations ask for a pytree of arrays; the module is one with extras.
    models: Any = make_models()
    optim = eb.per_member(optax.sgd(0.1))
    # The module holds activation functions; per_member drops the non-array leaves.
    state = optim.init(models)
    grads = eqx.filter_grad(ensemble_loss)(models)
    with_params, _ = optim.update(grads, state, models)
    without_params, _ = optim.update(grads, state)
    assert tree_allclose(with_params, without_params)
    assert tree_allclose(
        with_params, jax.tree.map(lambda g: -0.1 * g, eqx.filter(grads, eqx.is_array))
    )


def test_under_jit():
    models: Any = make_models()
    optim = eb.per_member(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))

    @eqx.filter_jit
    def step(models, state):
        grads = eqx.filter_grad(ensemble_loss)(models)
        updates, state = optim.update(grads, state, models)
        return eqx.apply_updates(models, updates), state

    state = optim.init(eqx.filter(models, eqx.is_array))
    jitted, _ = step(models, state)
    grads = eqx.filter_grad(ensemble_loss)(models)
    updates, _ = optim.update(grads, state, models)
    eager = eqx.apply_updates(models, updates)
    assert tree_allclose(jitted, eager, rtol=1e-5, atol=1e-6)


def test_checks_cost_nothing_at_run_time():
    # Every check runs while tracing: the traced update is the hand-vmapped one.
    tx = optax.sgd(0.1, momentum=0.9)
    optim = eb.per_member(tx)
    grads = {"w": jnp.ones((N, 2)), "b": jnp.ones((N,))}
    state = optim.init(grads)
    ours = jax.make_jaxpr(lambda g, s: optim.update(g, s))(grads, state)
    by_hand = jax.make_jaxpr(jax.vmap(lambda g, s: tx.update(g, s)))(grads, state)
    assert [e.primitive for e in ours.eqns] == [e.primitive for e in by_hand.eqns]


def scale_by_value() -> optax.GradientTransformationExtraArgs:
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, **extra_args):
        return jax.tree.map(lambda u: extra_args["value"] * u, updates), state

    return optax.GradientTransformationExtraArgs(init, update)


def test_extra_args_are_per_member():
    optim = eb.per_member(scale_by_value())
    grads = {"w": jnp.ones((N, 2))}
    state = optim.init(grads)
    updates = cast(
        dict, optim.update(grads, state, value=jnp.array([1.0, 2.0, 3.0]))[0]
    )
    np.testing.assert_array_equal(updates["w"], [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])


def test_member_axis_other_than_zero():
    params = {"w": jr.normal(jr.key(0), (2, N)), "b": jr.normal(jr.key(1), (N,))}
    tx = optax.clip_by_global_norm(0.5)
    optim = eb.per_member(tx, axes={"w": 1, "b": 0})
    updates = cast(dict, optim.update(params, optim.init(params))[0])
    assert updates["w"].shape == (2, N)
    for i in range(N):
        member = {"w": params["w"][:, i], "b": params["b"][i]}
        expected, _ = tx.update(member, tx.init(member))
        assert tree_allclose({"w": updates["w"][:, i], "b": updates["b"][i]}, expected)


def test_params_disagree_names_the_leaf():
    params = {"w": jnp.ones((N, 2)), "b": jnp.ones((N + 1,))}
    with pytest.raises(eb.BatchError, match=r"params\['b'\]`: 4"):
        eb.per_member(optax.sgd(0.1)).init(params)


def test_updates_disagree_with_state_names_the_leaves():
    optim = eb.per_member(optax.sgd(0.1, momentum=0.9))
    state = optim.init({"w": jnp.ones((N, 2))})
    with pytest.raises(eb.BatchError, match=r"updates\['w'\]`: 5") as info:
        optim.update({"w": jnp.ones((5, 2))}, state)
    assert "state" in str(info.value)


def test_state_from_plain_init():
    params = {"w": jnp.ones((N, 2))}
    optim = eb.per_member(optax.adam(1e-2))
    with pytest.raises(eb.BatchError, match=r"per_member\(tx\)\.init") as info:
        optim.update(params, optax.adam(1e-2).init(params))
    assert "state[0].count" in str(info.value)


def test_leaf_without_member_axis():
    params = {"w": jnp.ones((N, 2)), "shared": jnp.ones(2)}
    optim = eb.per_member(optax.sgd(0.1), axes={"w": 0, "shared": None})
    with pytest.raises(eb.BatchError, match=r"params\['shared'\]"):
        optim.init(params)


def test_scalar_leaf_has_no_member_axis():
    with pytest.raises(eb.BatchError, match=r"params\['t'\]"):
        eb.per_member(optax.sgd(0.1)).init({"t": jnp.array(1.0)})


def test_extra_arg_disagrees_names_it():
    optim = eb.per_member(scale_by_value())
    grads = {"w": jnp.ones((N, 2))}
    with pytest.raises(eb.BatchError, match=r"`value`: 2"):
        optim.update(grads, optim.init(grads), value=jnp.ones(2))


def test_not_a_transformation():
    with pytest.raises(eb.BatchError, match="not an `optax.GradientTransformation`"):
        eb.per_member(lambda x: x)  # pyright: ignore[reportArgumentType]


# Per-member hyperparameters: optax.inject_hyperparams given one value per member.

LEARNING_RATES = jnp.array([1e-3, 1e-2, 1e-1])


def injected_adam(learning_rate: Any) -> optax.GradientTransformationExtraArgs:
    return optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate, b1=0.8)


def train_each_alone(models: Any, make_tx: Any, steps: int) -> Any:
    """Member i trained on its own with `make_tx(i)`, restacked."""
    return eb.stack(
        [
            train(member, make_tx(i), steps, Y[i])
            for i, member in enumerate(eb.unstack(models))
        ]
    )


def test_per_member_learning_rates_equal_training_each_alone():
    models = make_models()
    with jax.numpy_dtype_promotion("standard"):
        swept = train(models, eb.per_member(injected_adam(LEARNING_RATES)), 5)
        injected = train_each_alone(
            models, lambda i: injected_adam(LEARNING_RATES[i]), 5
        )
        plain = train_each_alone(
            models, lambda i: optax.adam(float(LEARNING_RATES[i]), b1=0.8), 5
        )
        shared = train(models, eb.per_member(injected_adam(1e-2)), 5)
    assert tree_allclose(swept, injected, rtol=1e-5, atol=1e-7)
    # Plain Adam computes with Python floats where the injected one holds float32.
    assert tree_allclose(swept, plain, rtol=1e-4, atol=1e-5)
    # Only member 1 has the shared rate.
    for i, same in enumerate([False, True, False]):
        assert tree_allclose(eb.index(swept, i), eb.index(shared, i)) == same


def test_per_member_hyperparameters_live_in_the_state():
    optim = eb.per_member(injected_adam(LEARNING_RATES))
    params = {"w": jnp.ones((N, 2))}
    state = cast(optax.InjectStatefulHyperparamsState, optim.init(params))
    np.testing.assert_array_equal(state.hyperparams["learning_rate"], LEARNING_RATES)
    # A shared value is copied to every member, as before.
    np.testing.assert_allclose(state.hyperparams["b1"], [0.8] * N)
    # Set per member between steps, like any injected hyperparameter.
    state.hyperparams["learning_rate"] = jnp.array([0.0, 1.0, 0.0])
    sgd = eb.per_member(optax.inject_hyperparams(optax.sgd)(learning_rate=jnp.ones(N)))
    sgd_state = cast(optax.InjectStatefulHyperparamsState, sgd.init(params))
    sgd_state.hyperparams["learning_rate"] = jnp.array([0.0, 1.0, 2.0])
    updates = cast(dict, sgd.update(params, sgd_state)[0])
    np.testing.assert_array_equal(
        updates["w"], [[0.0, 0.0], [-1.0, -1.0], [-2.0, -2.0]]
    )


def test_per_member_hyperparameters_inside_chain_and_multisteps():
    params = {"w": jnp.ones((N, 2))}
    tx = optax.MultiSteps(
        optax.chain(
            optax.clip_by_global_norm(10.0),
            optax.inject_hyperparams(optax.sgd)(learning_rate=LEARNING_RATES),
        ),
        every_k_schedule=1,
    )
    optim = eb.per_member(tx)
    with jax.numpy_dtype_promotion("standard"):
        updates = cast(dict, optim.update(params, optim.init(params), params)[0])
    np.testing.assert_allclose(
        updates["w"], -LEARNING_RATES[:, None] * jnp.ones((1, 2))
    )


def test_hyperparameter_of_wrong_length_names_it():
    optim = eb.per_member(injected_adam(jnp.ones(N + 2)))
    with pytest.raises(
        eb.BatchError,
        match=r"`learning_rate` \(`state\.hyperparams\['learning_rate'\]`\) has 5 "
        r"values.*3 members",
    ):
        optim.init({"w": jnp.ones((N, 2))})


def test_hyperparameter_of_two_axes_names_it():
    tx = optax.chain(
        optax.clip(1.0),
        optax.inject_hyperparams(optax.sgd)(learning_rate=jnp.ones((N, 2))),
    )
    with pytest.raises(
        eb.BatchError,
        match=r"`learning_rate` \(`state\[1\]\.hyperparams\['learning_rate'\]`\) has "
        r"shape \(3, 2\).*shape \(3,\)",
    ):
        eb.per_member(tx).init({"w": jnp.ones((N, 2))})


def test_schedule_of_per_member_values_is_refused():
    def schedule(count: jax.Array) -> jax.Array:
        return LEARNING_RATES * 0.5 ** count.astype(jnp.float32)

    optim = eb.per_member(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))
    with pytest.raises(eb.BatchError, match=r"`learning_rate`.*schedule.*shape \(3,\)"):
        optim.init({"w": jnp.ones((N, 2))})


# A seeds x learning-rates grid: nested per_member, one value per cell.

GRID_TARGETS = jnp.arange(24.0).reshape(2, 3, 4) / 10


def cell_loss(params: dict, target: jax.Array) -> jax.Array:
    return jnp.sum((params["w"] - target) ** 2)


def grid_loss(params: dict) -> jax.Array:
    return jnp.sum(jax.vmap(jax.vmap(cell_loss))(params, GRID_TARGETS))


def injected_sgd(learning_rate: Any) -> optax.GradientTransformationExtraArgs:
    return optax.inject_hyperparams(optax.sgd)(
        learning_rate=learning_rate, momentum=0.9
    )


def test_learning_rate_per_cell_of_a_grid_equals_each_cell_alone():
    # Issue 15, item 10: the outer level misread the inner per-cell values.
    params = {"w": jnp.zeros((2, 3, 4))}
    rates = jnp.array([[0.01, 0.02, 0.03], [0.04, 0.05, 0.06]])
    grid = eb.per_member(eb.per_member(injected_sgd(rates)))
    trained = train(params, grid, 4, step=make_step(grid, grid_loss))
    state = cast(optax.InjectStatefulHyperparamsState, grid.init(params))
    np.testing.assert_array_equal(state.hyperparams["learning_rate"], rates)
    for i in range(2):
        for j in range(3):
            alone = injected_sgd(rates[i, j])
            cell = train(
                {"w": params["w"][i, j]},
                alone,
                4,
                GRID_TARGETS[i, j],
                step=make_step(alone, cell_loss),
            )
            assert tree_allclose(cell["w"], trained["w"][i, j], rtol=1e-6)
    # One rate per column (shared by the seeds) is the grid's broadcast.
    columns = eb.per_member(eb.per_member(injected_sgd(rates[0])))
    by_column = train(params, columns, 4, step=make_step(columns, grid_loss))
    broadcast = eb.per_member(eb.per_member(injected_sgd(jnp.stack([rates[0]] * 2))))
    expected = train(params, broadcast, 4, step=make_step(broadcast, grid_loss))
    assert tree_allclose(by_column, expected)


def test_hyperparameter_not_fitting_the_grid_names_it():
    params = {"w": jnp.zeros((2, 3, 4))}
    grid = eb.per_member(eb.per_member(injected_sgd(jnp.ones((3, 3)))))
    with pytest.raises(
        eb.BatchError,
        match=r"`learning_rate`.*shape \(3, 3\).*grid of shape \(2, 3\)",
    ):
        grid.init(params)


# Changing hyperparameters between steps.


def test_shared_value_set_in_the_state_goes_to_every_member():
    # Issue 15, item 11: a 0-d value was refused as a state "not made by init".
    params = {"w": jnp.ones((N, 2))}
    sgd = eb.per_member(injected_sgd(LEARNING_RATES))
    state = cast(optax.InjectStatefulHyperparamsState, sgd.init(params))
    state.hyperparams["learning_rate"] = jnp.asarray(0.05)
    updates, new_state = sgd.update(params, state)
    new_state = cast(optax.InjectStatefulHyperparamsState, new_state)
    np.testing.assert_allclose(cast(dict, updates)["w"], -0.05 * jnp.ones((N, 2)))
    np.testing.assert_allclose(new_state.hyperparams["learning_rate"], [0.05] * N)


def test_learning_rates_as_a_python_list_say_to_make_an_array():
    params = {"w": jnp.ones((N, 2))}
    sgd = eb.per_member(injected_sgd([0.1, 0.2, 0.3]))
    with pytest.raises(eb.BatchError, match=r"(?s)TypeError.*as an array, not a list"):
        sgd.update(params, sgd.init(params))
