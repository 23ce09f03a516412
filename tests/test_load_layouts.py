"""Files loaded across layouts: a stacked file into a list (or tuple) of members, a
list file into a stacked `like`, shape-only `like`s, and the member counts and shared
values that must agree."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_trees_identical

import eqx_batch as eb
from eqx_batch._serialise import read_tree


def _members(key, count):
    return [
        {"mlp": eqx.nn.MLP(2, 1, 4, 1, key=k), "key": k, "steps": np.int32(i)}
        for i, k in enumerate(jr.split(key, count))
    ]


def test_stacked_file_loads_into_a_list(getkey, tmp_path):
    members = _members(getkey(), 3)
    path = tmp_path / "stacked.safetensors"
    eb.save(path, eb.stack(members))
    loaded = eb.load(path, like=_members(getkey(), 3))
    assert isinstance(loaded, list)
    assert_trees_identical(loaded, members)


def test_list_file_loads_into_stacked_like(getkey, tmp_path):
    members = _members(getkey(), 3)
    path = tmp_path / "list.safetensors"
    eb.save(path, members)
    like = eb.stack(_members(getkey(), 3))
    assert_trees_identical(eb.load(path, like=like), eb.stack(members))


def test_tuple_like_gets_a_tuple(getkey, tmp_path):
    members = _members(getkey(), 2)
    path = tmp_path / "stacked.safetensors"
    eb.save(path, eb.stack(members))
    loaded = eb.load(path, like=tuple(members))
    assert isinstance(loaded, tuple)
    assert_trees_identical(list(loaded), members)


def _make(key):
    return eqx.nn.MLP(2, 2, 8, 2, key=key)


def test_stacked_file_into_shape_only_members(tmp_path):
    keys = jr.split(jr.key(3), 4)
    ensemble = eqx.filter_vmap(_make)(keys)
    eb.save(tmp_path / "ens", ensemble)
    like = [eqx.filter_eval_shape(_make, k) for k in keys]
    loaded = eb.load(tmp_path / "ens", like=like)
    assert_trees_identical(loaded, eb.unstack(ensemble))


def test_list_file_into_shape_only_stacked_like(tmp_path):
    keys = jr.split(jr.key(3), 4)
    members = [_make(k) for k in keys]
    eb.save(tmp_path / "members", members)
    like = eqx.filter_eval_shape(eqx.filter_vmap(_make), keys)
    loaded = eb.load(tmp_path / "members", like=like)
    assert_trees_identical(loaded, eb.stack(members))


def test_shape_only_member_count_mismatch(tmp_path):
    keys = jr.split(jr.key(3), 4)
    eb.save(tmp_path / "members", [_make(k) for k in keys])
    like = eqx.filter_eval_shape(eqx.filter_vmap(_make), keys[:3])
    with pytest.raises(eb.BatchError, match="list of 4 members") as info:
        eb.load(tmp_path / "members", like=like)
    assert "stacked with (3,) members" in str(info.value)
    assert "like.layers[0].weight" in str(info.value)


def test_member_count_mismatch_stacked_file_into_list(getkey, tmp_path):
    path = tmp_path / "stacked.safetensors"
    eb.save(path, eb.stack(_members(getkey(), 3)))
    with pytest.raises(eb.BatchError, match="list of 2 members") as info:
        eb.load(path, like=_members(getkey(), 2))
    assert "leaf `['key']` has shape (3,)" in str(info.value)


def test_member_count_mismatch_list_file_into_stacked(getkey, tmp_path):
    path = tmp_path / "list.safetensors"
    eb.save(path, _members(getkey(), 3))
    with pytest.raises(eb.BatchError, match="list of 3 members") as info:
        eb.load(path, like=eb.stack(_members(getkey(), 2)))
    assert "stacked with (2,) members" in str(info.value)
    assert "like['key']" in str(info.value)


def test_grid_file_into_rows_of_members_hints_at_ndim_2(tmp_path):
    rows = [[{"w": jnp.full(2, 3.0 * i + j)} for j in range(3)] for i in range(2)]
    path = tmp_path / "grid.safetensors"
    eb.save(path, eb.stack(rows, ndim=2))
    like = [[{"w": jnp.zeros(2)} for _ in range(3)] for _ in range(2)]
    with pytest.raises(eb.BatchError, match="ndim=2") as info:
        eb.load(path, like=like)
    message = str(info.value)
    assert "eb.unstack(" in message and "eb.stack(like, ndim=2)" in message
    # The hint works.
    loaded = eb.unstack(eb.load(path, like=eb.stack(like, ndim=2)), ndim=2)
    assert_trees_identical(loaded, rows)


def test_list_file_members_that_differ_where_stacked_like_shares(tmp_path):
    path = tmp_path / "list.safetensors"
    eb.save(path, [{"w": jnp.zeros(2), "lr": 0.1}, {"w": jnp.ones(2), "lr": 0.2}])
    like = {"w": jnp.zeros((2, 2)), "lr": 0.1}
    with pytest.raises(eb.BatchError, match="differ there") as info:
        eb.load(path, like=like)
    assert "`[0]['lr']` is 0.1 and `[1]['lr']` is 0.2" in str(info.value)


def test_read_tree_on_host_between_layouts(getkey, tmp_path):
    members = _members(getkey(), 3)
    path = tmp_path / "stacked.safetensors"
    eb.save(path, eb.stack(members))
    loaded, _ = read_tree(path, members, on_host=True)
    for member, got in zip(members, loaded, strict=True):
        np.testing.assert_array_equal(
            got["mlp"].layers[0].weight, np.asarray(member["mlp"].layers[0].weight)
        )
        np.testing.assert_array_equal(
            got["key"], np.asarray(jr.key_data(member["key"]))
        )
