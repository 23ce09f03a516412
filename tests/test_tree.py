"""The shared helpers in `_tree.py`: leaf predicates, the key codec, axis specs."""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import assert_trees_identical
from hypothesis import given, settings

import eqx_batch as eb
from eqx_batch._tree import (
    as_key_data,
    as_keys_like,
    common_size,
    host_array,
    is_array,
    is_int,
    is_numpy,
    is_tracer,
    is_weak,
    mapped_leaves,
    normalise_axis,
    resolve_axes,
)


def test_is_int_refuses_bools():
    assert is_int(3) and is_int(-1)
    assert not is_int(True) and not is_int(np.bool_(True)) and not is_int(1.0)
    with pytest.raises(eb.BatchError, match="int or None"):
        resolve_axes({"a": jnp.ones(2)}, lambda leaf: True, "tree")


def test_is_array():
    assert is_array(jnp.zeros(2)) and is_array(np.zeros(2)) and is_array(np.float32(1))
    assert not is_array(1.0) and not is_array("a") and not is_array(None)


def test_leaf_predicates():
    assert is_numpy(np.zeros(2)) and is_numpy(np.float32(1))
    assert not is_numpy(jnp.zeros(2)) and not is_numpy(1.0)
    assert is_weak(jnp.asarray(1.0)) and not is_weak(jnp.float32(1.0))
    assert not is_weak(jr.key(0)) and not is_weak(np.zeros(2))
    assert not is_tracer(jnp.zeros(2))
    assert jax.jit(lambda x: jnp.asarray(is_tracer(x)))(jnp.zeros(2))


def test_host_array_gives_key_data_for_keys():
    keys = jr.split(jr.key(0), 3)
    assert_trees_identical(host_array(keys), np.asarray(jr.key_data(keys)))
    assert_trees_identical(host_array(jnp.arange(3)), np.arange(3, dtype=np.int32))


def test_key_codec_round_trips():
    tree = {"key": jr.key(1), "spec": jax.ShapeDtypeStruct((2,), jr.key(0).dtype)}
    tree["x"] = jnp.arange(2.0)
    raw = as_key_data(tree)
    assert raw["key"].dtype == jnp.uint32 and raw["spec"].shape == (2, 2)
    assert_trees_identical(raw["key"], jr.key_data(tree["key"]))
    back = as_keys_like(raw, tree)
    assert_trees_identical(back["key"], tree["key"])
    assert back["x"] is tree["x"]
    # A `ShapeDtypeStruct` key in `like` makes key data a key of its implementation.
    data = jr.key_data(jr.split(jr.key(2), 2))
    spec = as_keys_like({"spec": data}, {"spec": tree["spec"]})["spec"]
    assert_trees_identical(spec, jr.wrap_key_data(data))


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
    with pytest.raises(
        eb.BatchError, match="must be None, an int or a callable"
    ) as info:
        resolve_axes(tree, {"w": "zero"}, "model")
    assert "model['w']" in str(info.value)
    with pytest.raises(eb.BatchError, match="must return an int or None") as info:
        resolve_axes(tree, lambda _: 1.5, "model")
    assert "model['w']" in str(info.value)
    with pytest.raises(eb.BatchError, match="must be None, an int or a callable"):
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
