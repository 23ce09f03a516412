"""Why members cannot be stacked or concatenated: each is a BatchError naming the leaf
by the member's place in `trees` and its path."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_members_identical, raises

import eqx_batch as eb


class Named(eqx.Module):
    weight: Any
    name: str = eqx.field(static=True, default="named")


def _mlps(n: int) -> list[eqx.nn.MLP]:
    return [eqx.nn.MLP(4, 3, 5, 2, key=k) for k in jr.split(jr.key(0), n)]


def test_stack_empty():
    raises("empty", lambda: eb.stack([]), "`trees`")
    raises("empty", lambda: eb.concat([]), "`trees`")


def test_stack_different_structure():
    a = {"layer1": [1.0, jnp.zeros(2)], "layer2": {"weights": jnp.zeros(2)}}
    b = {"layer1": [1.0, jnp.zeros(2)], "layer2": {"weight": jnp.zeros(2)}}
    raises("same structure", lambda: eb.stack([a, a, a, b]), "trees[3]['layer2']")
    c = {"layer1": [1.0], "layer2": {"weights": jnp.zeros(2)}}
    raises("length 1", lambda: eb.stack([a, c]), "trees[1]['layer1']")
    raises("same structure", lambda: eb.concat([a, b]), "trees[1]['layer2']")


def test_stack_different_static_field():
    a = Named(jnp.zeros(2), name="a")
    b = Named(jnp.zeros(2), name="b")
    message = raises("same structure", lambda: eb.stack([a, b]), "trees[1].name")
    assert "'a'" in message and "'b'" in message
    mlp = _mlps(1)[0]
    deeper = eqx.nn.MLP(4, 3, 5, 3, key=jr.key(0))
    raises("static field", lambda: eb.stack([mlp, deeper]), "trees[1].depth", "3")


def test_stack_shape_mismatch():
    members = _mlps(2)
    odd = eqx.tree_at(lambda m: m.layers[1].weight, members[0], jnp.zeros((5, 6)))
    message = raises(
        "shape", lambda: eb.stack([*members, odd]), "trees[2].layers[1].weight"
    )
    assert "(5, 6)" in message and "(5, 5)" in message


def test_stack_dtype_mismatch():
    a, b = {"w": jnp.zeros(2)}, {"w": jnp.zeros(2, jnp.int32)}
    raises("dtype", lambda: eb.stack([a, b]), "trees[1]['w']", "int32", "float32")


def test_stack_different_activation():
    # The partition/combine idiom would silently keep member 0's activation.
    relu = _mlps(1)[0]
    tanh = eqx.nn.MLP(4, 3, 5, 2, activation=jax.nn.tanh, key=jr.key(0))
    message = raises(
        "must be equal", lambda: eb.stack([relu, relu, tanh]), "trees[2].activation"
    )
    assert "relu" in message and "tanh" in message


def test_stack_two_lambdas_differ():
    a, b = {"f": lambda x: x}, {"f": lambda x: x}
    raises("create the function once", lambda: eb.stack([a, b]), "trees[1]['f']")


def test_stack_python_scalar_differs():
    a, b = {"lr": 0.1, "w": jnp.zeros(1)}, {"lr": 0.2, "w": jnp.zeros(1)}
    raises("make it an array", lambda: eb.stack([a, b]), "trees[1]['lr']", "0.2")
    c = {"lr": 1, "w": jnp.zeros(1)}
    raises(
        "must be equal", lambda: eb.stack([{"lr": 1.0, "w": jnp.zeros(1)}, c]), "int"
    )
    d = {"lr": -0.0, "w": jnp.zeros(1)}
    raises("must be equal", lambda: eb.stack([{"lr": 0.0, "w": jnp.zeros(1)}, d]))


def test_stack_shared_leaf_differs():
    axes = {"w": 0, "shared": None}
    a = {"w": jnp.zeros(2), "shared": jnp.arange(3.0)}
    b = {"w": jnp.zeros(2), "shared": jnp.arange(3.0) + 1}
    raises("other values", lambda: eb.stack([a, b], axes=axes), "trees[1]['shared']")
    c = {"w": jnp.zeros(2), "shared": jnp.arange(4.0)}
    raises("float32\\[4\\]", lambda: eb.stack([a, c], axes=axes), "trees[1]")
    equal = {"w": jnp.ones(2), "shared": jnp.arange(3.0)}
    assert eb.stack([a, equal], axes=axes)["shared"] is a["shared"]


def test_stack_shared_traced_leaf():
    axes = {"w": 0, "shared": None}

    @jax.jit
    def f(x, y):
        return eb.stack([{"w": x, "shared": x}, {"w": y, "shared": y}], axes=axes)

    with pytest.raises(eb.BatchError, match="traced") as info:
        f(jnp.zeros(2), jnp.ones(2))
    assert "trees[1]['shared']" in str(info.value)


def test_stack_array_versus_non_array():
    a, b = {"w": jnp.zeros(2)}, {"w": 2.0}
    raises("not an array", lambda: eb.stack([a, b], axes=0), "trees[1]['w']")
    raises("is an array", lambda: eb.stack([b, a]), "trees[1]['w']")
    # Member 0 itself not an array: the message is about member 0 alone.
    message = raises("not an array", lambda: eb.stack([b, a], axes=0), "trees[0]['w']")
    assert "trees[1]" not in message


def test_weak_and_strong_members_are_refused():
    mixed = [jnp.asarray(1.0), jnp.ones(())]
    message = raises("weakly typed", lambda: eb.stack(mixed), "trees[0]", "trees[1]")
    assert "jnp.asarray(x, dtype=jnp.float32)" in message
    raises("weakly typed", lambda: eb.stack(mixed[::-1]))
    raises("weakly typed", lambda: eb.stack([np.float32(1.0), jnp.asarray(1.0)]))
    raises("weakly typed", lambda: eb.concat([jnp.full(2, 1.0), jnp.ones(2)]))
    # The advised fix makes a round trip exact.
    fixed = [jnp.asarray(x, dtype=jnp.float32) for x in mixed]
    assert_members_identical(eb.unstack(eb.stack(fixed)), fixed)
    weak = [jnp.asarray(1.0), jnp.asarray(2.0)]
    assert_members_identical(eb.unstack(eb.stack(weak)), weak)


def test_python_scalar_then_array_gets_advice_that_stacks():
    members = [{"a": 1.0}, {"a": jnp.array(1.0)}]
    message = raises("is an array", lambda: eb.stack(members), "trees[1]['a']")
    assert "`jnp.asarray(1.0)` in `trees[0]['a']`" in message
    # Following the advice stacks the leaf.
    advised = [{"a": jnp.asarray(1.0)}, {"a": jnp.array(1.0)}]
    assert eb.stack(advised)["a"].tolist() == [1.0, 1.0]


def test_concat_shape_mismatch_off_member_axis():
    a, b = {"w": jnp.zeros((2, 3))}, {"w": jnp.zeros((2, 4))}
    raises("apart from member axis", lambda: eb.concat([a, b]), "trees[1]['w']")


def test_grid_members_named_by_row_and_column():
    grid = [[{"w": jnp.zeros(2), "lr": 0.1}] * 3 for _ in range(2)]
    grid[1] = [*grid[1][:2], {"w": jnp.zeros(3), "lr": 0.1}]
    raises(
        "shape",
        lambda: eb.stack(grid, ndim=2),
        "`trees[1][2]['w']`",
        "`trees[0][0]['w']`",
    )
    grid[1][2] = {"w": jnp.zeros(2), "lr": 0.2}
    raises("kept once", lambda: eb.stack(grid, ndim=2), "`trees[1][2]['lr']`")
    grid[1][2] = {"w": jnp.zeros(2)}
    raises("same structure", lambda: eb.stack(grid, ndim=2), "`trees[1][2]`")


def _linear_in(module: str) -> type:
    """A module class named `Linear`, as if defined in `module`."""

    class Linear(eqx.Module):
        weight: Any

    Linear.__module__ = module
    return Linear


class _Config:
    def __init__(self, module: str):
        self.module = module

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = None  # pyright: ignore[reportAssignmentType]


def test_types_of_one_name_are_told_apart_by_module():
    # Issue 15, item 14: "a Linear ... but ... a Linear".
    ours, theirs = _linear_in("mylib.layers"), _linear_in("otherlib.nn")
    message = raises(
        "same structure",
        lambda: eb.stack([{"x": ours(jnp.ones(2))}, {"x": theirs(jnp.ones(2))}]),
    )
    assert "otherlib.nn" in message and "mylib.layers" in message
    a, b = type("Config", (_Config,), {}), type("Config", (_Config,), {})
    a.__module__, b.__module__ = "mylib.a", "mylib.b"
    message = raises("kept once", lambda: eb.stack([{"c": a("x")}, {"c": b("x")}]))
    assert "(mylib.b.Config)" in message and "(mylib.a.Config)" in message
    # Names that differ stay short.
    message = raises("kept once", lambda: eb.stack([{"c": 1}, {"c": "1"}]))
    assert "(str)" in message and "(int)" in message
