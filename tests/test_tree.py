"""The shared helpers in `_tree.py` and `_errors.py`."""

import equinox as eqx
import hypothesis.strategies as st
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import given, settings

import eqx_batch as eb
from eqx_batch._errors import bullet_list, describe, leaf_name
from eqx_batch._tree import (
    common_size,
    is_array,
    is_int,
    mapped_leaves,
    normalise_axis,
    resolve_axes,
)


def test_is_int_refuses_bools():
    assert is_int(3) and is_int(-1)
    assert not is_int(True) and not is_int(np.bool_(True)) and not is_int(1.0)
    with pytest.raises(eb.BatchError, match="int or None"):
        resolve_axes({"a": jnp.ones(2)}, lambda leaf: True, "tree")


def test_batch_error_is_a_value_error():
    assert issubclass(eb.BatchError, ValueError)


def test_leaf_name_uses_keystr():
    tree = {"layer2": {"weights": 1}, "layers": [0, (1, 2)]}
    paths = [path for path, _ in jtu.tree_flatten_with_path(tree)[0]]
    names = [leaf_name("trees[3]", path) for path in paths]
    assert "trees[3]['layer2']['weights']" in names
    assert "trees[3]['layers'][1][0]" in names
    mlp_paths = jtu.tree_flatten_with_path(
        eqx.nn.Linear(2, 2, key=jnp.zeros(2, "uint32"))
    )
    assert leaf_name("model", mlp_paths[0][0][0]) == "model.weight"
    assert leaf_name("tree", ()) == "tree"


def test_describe():
    assert describe(jnp.zeros((3, 4))) == "float32[3,4]"
    assert describe(np.zeros((), np.int8)) == "int8[]"
    assert describe(np.float32(1.0)) == "float32[]"
    assert describe("abc") == "'abc'"
    long = describe("x" * 200)
    assert len(long) == 80 and long.endswith("...")


def test_bullet_list():
    assert bullet_list(["a", "b"]) == "  a\n  b"
    text = bullet_list([str(i) for i in range(25)], limit=20)
    assert text.splitlines()[-1] == "  ... and 5 more"
    assert len(text.splitlines()) == 21


def test_is_array():
    assert is_array(jnp.zeros(2)) and is_array(np.zeros(2)) and is_array(np.float32(1))
    assert not is_array(1.0) and not is_array("a") and not is_array(None)


def test_resolve_axes_prefix_and_callables():
    tree = {"w": jnp.zeros((2, 3)), "meta": {"name": "x", "b": jnp.zeros(2)}}
    resolved = resolve_axes(tree, {"w": 1, "meta": eqx.if_array(0)}, "tree")
    assert resolved == {"w": 1, "meta": {"name": None, "b": 0}}
    assert resolve_axes(tree, None, "tree") == {
        "w": None,
        "meta": {"name": None, "b": None},
    }
    assert resolve_axes(tree, -1, "tree")["meta"]["name"] == -1


def test_resolve_axes_errors():
    tree = {"w": jnp.zeros(2)}
    with pytest.raises(eb.BatchError, match="not a pytree prefix") as info:
        resolve_axes(tree, {"v": 0}, "model")
    assert "`model`" in str(info.value)
    with pytest.raises(eb.BatchError, match="axis specs consist") as info:
        resolve_axes(tree, {"w": "zero"}, "model")
    assert "model['w']" in str(info.value)
    with pytest.raises(eb.BatchError, match="must return an int or None") as info:
        resolve_axes(tree, lambda _: 1.5, "model")
    assert "model['w']" in str(info.value)
    with pytest.raises(eb.BatchError, match="axis specs consist"):
        resolve_axes(tree, True, "model")


def test_mapped_leaves_normalises():
    tree = {"a": jnp.zeros((2, 3)), "s": "static"}
    out = mapped_leaves(tree, {"a": -1, "s": None}, "tree")
    assert [(jtu.keystr(p), axis) for p, _, axis in out] == [
        ("['a']", 1),
        ("['s']", None),
    ]


@pytest.mark.parametrize(
    "leaf, axis, match",
    [
        (1.0, 0, "not an array"),
        (jnp.float32(1.0), 0, "0-d"),
        (jnp.zeros((2, 3)), 2, "out of range"),
        (jnp.zeros((2, 3)), -3, "out of range"),
    ],
)
def test_normalise_axis_errors(leaf, axis, match):
    with pytest.raises(eb.BatchError, match=match) as info:
        mapped_leaves({"x": [leaf]}, axis, "params")
    assert "params['x'][0]" in str(info.value)


@settings(max_examples=25, deadline=None)
@given(ndim=st.integers(1, 4), data=st.data())
def test_normalise_axis_matches_numpy(ndim, data):
    axis = data.draw(st.integers(-ndim, ndim - 1))
    leaf = np.zeros((1,) * ndim)
    # The same law as Python's negative indexing.
    assert normalise_axis(leaf, axis, "x") == list(range(ndim))[axis]


def test_common_size():
    assert common_size([("a", 3), ("b", 3)]) == 3
    with pytest.raises(eb.BatchError, match="no array leaf"):
        common_size([])
    sizes = [("tree.a", 3), ("tree.b", 4), ("tree.c", 3), ("tree.d", 5)]
    with pytest.raises(eb.BatchError, match="disagree") as info:
        common_size(sizes, fix="Do the thing.")
    message = str(info.value)
    for name in ("tree.a", "tree.b", "tree.c", "tree.d"):
        assert name in message
    assert "most leaves have 3" in message and message.endswith("Do the thing.")
