"""`eb.save` / `eb.load` and the checkpoint layer's `write_tree` / `read_tree`:
safetensors files, round trips, stacked <-> list, atomic writes, every error."""

import json
import logging
import math
import os
import pathlib
import pickle
import struct
import subprocess
import sys
import textwrap
import threading
import zlib

import equinox as eqx
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from helpers import assert_trees_identical
from hypothesis import given, HealthCheck, settings

import eqx_batch as eb
from eqx_batch._atomic import atomic_write
from eqx_batch._file_format import BadFileError, read_metadata
from eqx_batch._serialise import read_tree, write_tree


SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _mixed_tree(key):
    model_key, chain_key = jr.split(key)
    return {
        "model": eqx.nn.MLP(2, 1, 4, 2, key=model_key),
        "keys": jr.split(chain_key, 3),
        "rbg_key": jr.key(1, impl="rbg"),
        "half": jnp.arange(3, dtype=jnp.bfloat16),
        "fp8": np.linspace(-1, 1, 4).astype(jnp.float8_e4m3fn),
        "int4": jnp.arange(-2, 3, dtype=jnp.int4),
        "complex": jnp.asarray([1 + 2j, -0.5j], dtype=jnp.complex64),
        "host": np.arange(6, dtype=np.int64).reshape(2, 3),
        "host_scalar": np.float32(-0.0),
        "empty": jnp.zeros((0, 3)),
        "weak": jnp.asarray(0.5),
        "weak_vector": jnp.full((3,), 2),
        "flags": jnp.array([True, False]),
        "settings": [1.5, 3, True, "adam", 1 - 2j],
    }


def _parts(path: pathlib.Path) -> tuple[dict, dict, bytes]:
    """A file's `__metadata__`, its tensor entries and its data."""
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + length])
    return header.pop("__metadata__"), header, raw[8 + length :]


def _resign(path: pathlib.Path, edit=None, data: bytes | None = None) -> None:
    """Rewrites a file with `edit(metadata, tensors)` applied and valid checksums, as a
    crafted file would have them: this writes the layout by hand, not with eqx_batch."""
    metadata, tensors, old_data = _parts(path)
    data = old_data if data is None else data
    del metadata["eqx_batch.header_crc32"], metadata["eqx_batch.data_crc32"]
    if edit is not None:
        edit(metadata, tensors)
    rest = json.dumps(metadata)[1:-1]
    # Both checksums are taken with their digits as zeros, then filled in.
    text = (
        '{"__metadata__":{"eqx_batch.header_crc32":"00000000",'
        '"eqx_batch.data_crc32":"00000000"'
        + (f",{rest}" if rest else "")
        + "}"
        + (f",{json.dumps(tensors)[1:-1]}" if tensors else "")
        + "}"
    )
    text += " " * (-(len(text) + 8) % 8)
    head = struct.pack("<Q", len(text)) + text.encode()
    crcs = f'{zlib.crc32(head):08x}","eqx_batch.data_crc32":"{zlib.crc32(data):08x}'
    head = head.replace(b'00000000","eqx_batch.data_crc32":"00000000', crcs.encode())
    path.write_bytes(head + data)


def _edit_leaf(index, field, value):
    """Sets `field` of the `index`th leaf record (`{"w", "lr"}` flattens to lr, w)."""

    def edit(metadata, tensors):
        leaves = json.loads(metadata["eqx_batch.leaves"])
        leaves[index][field] = value
        metadata["eqx_batch.leaves"] = json.dumps(leaves)

    return edit


# ------------------------------------------------------------------------------------
# Round trips.


def test_round_trip_mixed_tree(getkey, tmp_path):
    tree = _mixed_tree(getkey())
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    assert_trees_identical(eb.load(path, like=tree), tree)
    # A fresh `like` with other values gets the saved ones.
    other = _mixed_tree(getkey())
    assert_trees_identical(eb.load(str(path), like=other), tree)


def test_weak_types_come_back(tmp_path):
    # Weak types decide promotion: a weak float32 times bfloat16 stays bfloat16.
    tree = {
        "scale": jnp.asarray(2.0),
        "steps": jnp.full((2,), 3),
        "strong": jnp.ones(2),
    }
    path = tmp_path / "weak.safetensors"
    eb.save(path, tree)
    loaded = eb.load(path, like=eqx.filter_eval_shape(lambda: tree))
    assert loaded["scale"].weak_type and loaded["steps"].weak_type
    assert not loaded["strong"].weak_type
    assert (loaded["scale"] * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16
    assert_trees_identical(loaded, tree)
    # Between layouts too.
    stacked = {"steps": tree["steps"], "strong": tree["strong"]}
    eb.save(path, stacked)
    member = {"steps": jnp.asarray(0), "strong": jnp.ones(())}
    members = eb.load(path, like=[member, member])
    assert members[0]["steps"].weak_type and not members[1]["strong"].weak_type
    eb.save(path, members)
    assert_trees_identical(eb.load(path, like=stacked), stacked)


def test_leaf_types_follow_like(getkey, tmp_path):
    tree = {"w": jr.normal(getkey(), (3, 2)), "b": np.arange(3, dtype=np.float32)}
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    like = {"w": np.zeros((3, 2), np.float32), "b": jnp.zeros(3)}
    loaded = eb.load(path, like=like)
    assert type(loaded["w"]) is np.ndarray and loaded["w"].flags.writeable
    assert isinstance(loaded["b"], jax.Array)
    np.testing.assert_array_equal(loaded["w"], np.asarray(tree["w"]))
    np.testing.assert_array_equal(np.asarray(loaded["b"]), tree["b"])


def test_big_endian_arrays_are_stored_little_endian(tmp_path):
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"w": np.arange(4, dtype=">i4")})
    assert safetensors.numpy.load_file(path)["['w']"].tolist() == [0, 1, 2, 3]
    loaded = eb.load(path, like={"w": np.zeros(4, np.int32)})
    np.testing.assert_array_equal(loaded["w"], np.arange(4, dtype=np.int32))
    assert loaded["w"].dtype == np.int32


def test_like_of_shape_dtype_structs(getkey, tmp_path):
    tree = {"model": eqx.nn.Linear(3, 2, key=getkey()), "key": getkey()}
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    abstract = eqx.filter_eval_shape(lambda: tree)
    assert isinstance(abstract["model"].weight, jax.ShapeDtypeStruct)
    assert_trees_identical(eb.load(path, like=abstract), tree)


def test_loaded_arrays_keep_like_sharding(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("members",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("members"))
    tree = {
        "w": jax.device_put(jnp.arange(8.0).reshape(4, 2), sharding),
        "keys": jax.device_put(jr.split(jr.key(0), 4), sharding),
    }
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    loaded = eb.load(path, like=tree)
    assert loaded["w"].sharding == sharding and loaded["keys"].sharding == sharding
    assert_trees_identical(loaded, tree)


def test_a_single_array_is_the_tensor_named_by_the_empty_path(tmp_path):
    path = tmp_path / "array.safetensors"
    eb.save(path, jnp.arange(3.0))
    assert list(safetensors.numpy.load_file(path)) == [""]
    assert_trees_identical(eb.load(path, like=jnp.zeros(3)), jnp.arange(3.0))


def test_trees_without_leaves_round_trip(tmp_path):
    path = tmp_path / "empty.safetensors"
    for tree in ([[]], [{}, {}], {"a": []}, None):
        eb.save(path, tree)
        assert eb.load(path, like=tree) == tree
        assert safetensors.numpy.load_file(path) == {}


def test_save_replaces_previous_file(getkey, tmp_path):
    path = tmp_path / "tree.safetensors"
    first, second = jr.normal(getkey(), (3,)), jr.normal(getkey(), (3,))
    eb.save(path, first)
    eb.save(path, second)
    assert_trees_identical(eb.load(path, like=first), second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tree.safetensors"]


_DTYPES = [
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(np.int8),
    np.dtype(np.uint32),
    np.dtype(np.complex64),
    np.dtype(bool),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float8_e5m2),
]


@st.composite
def _arrays(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    size = math.prod(shape)
    if dtype == np.dtype(bool):
        host = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
        host = host.reshape(shape)
    else:
        # Raw bytes reach every bit pattern: NaN payloads, -0.0, infinities, subnormals.
        raw = draw(
            st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize)
        )
        host = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape)
    if draw(st.booleans()):
        return host.copy()
    return jnp.asarray(host)


@st.composite
def _weak_arrays(draw):
    value = draw(st.one_of(st.integers(-(2**31), 2**31 - 1), st.floats(width=32)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
    return jnp.full(shape, value)


@st.composite
def _keys(draw):
    impl = draw(st.sampled_from(["threefry2x32", "rbg"]))
    count = draw(st.integers(0, 3))
    key = jr.key(draw(st.integers(0, 2**31 - 1)), impl=impl)
    return key if count == 0 else jr.split(key, count)


_scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.complex_numbers(allow_nan=False),
    st.text(max_size=8),
)
_objects = st.sampled_from([jax.nn.relu, jnp.tanh, math.sqrt])
_trees = st.recursive(
    st.one_of(_arrays(), _weak_arrays(), _keys(), _scalars, _objects),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
    ),
    max_leaves=6,
)


@SETTINGS
@given(tree=_trees)
def test_save_load_round_trip_is_identity(tmp_path, tree):
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    loaded = eb.load(path, like=tree)
    assert_trees_identical(loaded, tree)
    # `==` cannot tell -0.0 from 0.0; the bits can.
    for x, y in zip(jtu.tree_leaves(loaded), jtu.tree_leaves(tree), strict=True):
        if isinstance(x, float):
            assert struct.pack("<d", x) == struct.pack("<d", y)
    # Any safetensors reader sees every array leaf, by its path.
    arrays = {
        jtu.keystr(p)
        for p, leaf in jtu.tree_flatten_with_path(tree)[0]
        if eqx.is_array(leaf)
    }
    assert set(safetensors.numpy.load_file(path)) == arrays


def test_python_float_specials_round_trip(tmp_path):
    tree = [math.inf, -math.inf, math.nan, -0.0]
    path = tmp_path / "floats.safetensors"
    eb.save(path, tree)
    loaded = eb.load(path, like=[0.0, 0.0, 0.0, 0.0])
    assert loaded[:2] == [math.inf, -math.inf]
    assert math.isnan(loaded[2])
    assert math.copysign(1.0, loaded[3]) == -1.0


# ------------------------------------------------------------------------------------
# Any safetensors reader.


def test_safetensors_reads_every_array_by_its_path(getkey, tmp_path):
    tree = _mixed_tree(getkey())
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    tensors = safetensors.numpy.load_file(path)
    model = tree["model"]
    np.testing.assert_array_equal(
        tensors["['model'].layers[0].weight"], np.asarray(model.layers[0].weight)
    )
    assert tensors["['half']"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        tensors["['keys']"], np.asarray(jr.key_data(tree["keys"]))
    )
    # Dtypes safetensors lacks are raw little-endian bytes, one trailing axis of them.
    complex_bytes = tensors["['complex']"]
    assert complex_bytes.dtype == np.uint8 and complex_bytes.shape == (2, 8)
    np.testing.assert_array_equal(
        complex_bytes.view(np.complex64)[..., 0], np.asarray(tree["complex"])
    )
    assert tensors["['fp8']"].shape == (4, 1)
    # Python scalars and functions are in the metadata, not tensors.
    assert not any(name.startswith("['settings']") for name in tensors)
    assert ".activation" not in "".join(tensors)
    with safetensors.safe_open(path, "np") as file:
        metadata = file.metadata()
    assert metadata["eqx_batch.version"] == "1"
    records = json.loads(metadata["eqx_batch.leaves"])
    assert {"path": "['settings'][3]", "kind": "str", "value": "adam"} in records


def test_caller_metadata_round_trips(getkey, tmp_path):
    path = tmp_path / "state.safetensors"
    tree = {"x": jr.normal(getkey(), (2,))}
    write_tree(path, tree, metadata={"run": '{"seed": 1}', "eqx.other": ""})
    assert read_metadata(path) == {"run": '{"seed": 1}', "eqx.other": ""}
    loaded, metadata = read_tree(path, tree)
    assert metadata == {"run": '{"seed": 1}', "eqx.other": ""}
    assert_trees_identical(loaded, tree)
    with safetensors.safe_open(path, "np") as file:
        assert file.metadata()["run"] == '{"seed": 1}'


def test_caller_metadata_is_checked(tmp_path):
    path = tmp_path / "state.safetensors"
    with pytest.raises(eb.BatchError, match="'eqx_batch.version'.*eqx_batch's own"):
        write_tree(path, jnp.zeros(2), metadata={"eqx_batch.version": "7"})
    with pytest.raises(eb.BatchError, match="strings to strings"):
        write_tree(path, jnp.zeros(2), metadata={"steps": 3})  # type: ignore
    assert not path.exists()


def test_read_tree_on_host_places_and_compiles_nothing(getkey, tmp_path, caplog):
    tree = {"w": jr.normal(getkey(), (3, 2)), "keys": jr.split(getkey(), 3), "n": 4}
    path = tmp_path / "draws.safetensors"
    write_tree(path, tree, metadata={"part": "1"})
    like = eqx.filter_eval_shape(lambda: tree)
    with (
        jax.transfer_guard("disallow"),
        jax.log_compiles(True),
        caplog.at_level(logging.WARNING),
    ):
        loaded, metadata = read_tree(path, like, on_host=True)
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
    assert metadata == {"part": "1"}
    assert type(loaded["w"]) is np.ndarray and loaded["n"] == 4
    np.testing.assert_array_equal(loaded["w"], np.asarray(tree["w"]))
    # Keys come back as their key data, ready to be joined and wrapped once.
    np.testing.assert_array_equal(loaded["keys"], np.asarray(jr.key_data(tree["keys"])))


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


# ------------------------------------------------------------------------------------
# Stacked <-> list.


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
    eb.save(tmp_path / "members", [_make(k) for k in keys])
    like = eqx.filter_eval_shape(eqx.filter_vmap(_make), keys)
    loaded = eb.load(tmp_path / "members", like=like)
    assert_trees_identical(loaded, eqx.filter_vmap(_make)(keys))


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


def test_list_file_members_that_differ_where_stacked_like_shares(tmp_path):
    path = tmp_path / "list.safetensors"
    eb.save(path, [{"w": jnp.zeros(2), "lr": 0.1}, {"w": jnp.ones(2), "lr": 0.2}])
    like = {"w": jnp.zeros((2, 2)), "lr": 0.1}
    with pytest.raises(eb.BatchError, match="differ there") as info:
        eb.load(path, like=like)
    assert "`[0]['lr']` is 0.1 and `[1]['lr']` is 0.2" in str(info.value)


# ------------------------------------------------------------------------------------
# Mismatches between the file and `like`.


def test_shape_mismatch_names_path_and_both_shapes(tmp_path):
    path = tmp_path / "model.safetensors"
    eb.save(path, {"layer1": {"weights": jnp.zeros((3, 4))}})
    with pytest.raises(eb.BatchError) as info:
        eb.load(path, like={"layer1": {"weights": jnp.zeros((5, 4))}})
    message = str(info.value)
    assert "like['layer1']['weights']" in message
    assert "(5, 4)" in message and "(3, 4)" in message
    assert not isinstance(info.value, BadFileError)


def test_dtype_mismatch(tmp_path):
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"w": jnp.zeros(3, jnp.bfloat16)})
    with pytest.raises(eb.BatchError, match="dtype float32 .* dtype bfloat16") as info:
        eb.load(path, like={"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
    assert "like['w']" in str(info.value)


def test_structure_mismatch_lists_the_differing_leaves(tmp_path):
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"a": jnp.zeros(2), "b": jnp.zeros(2)})
    with pytest.raises(eb.BatchError, match="structure") as info:
        eb.load(path, like={"a": jnp.zeros(2), "c": jnp.zeros(2)})
    message = str(info.value)
    assert "in `like` only: `like['c']`" in message
    assert "in the file only: `['b']`" in message


def test_kind_mismatch_array_against_scalar(tmp_path):
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"lr": 0.1})
    with pytest.raises(eb.BatchError, match="the file has a float") as info:
        eb.load(path, like={"lr": jnp.asarray(0.1)})
    assert "like['lr']" in str(info.value)
    with pytest.raises(eb.BatchError, match="like\\['lr'\\]"):
        eb.load(path, like={"lr": 1})


def test_key_against_array_and_other_impl(tmp_path):
    path = tmp_path / "keys.safetensors"
    eb.save(path, {"key": jr.key(0)})
    with pytest.raises(eb.BatchError, match="typed PRNG key") as info:
        eb.load(path, like={"key": jnp.zeros((), jnp.uint32)})
    assert "like['key']" in str(info.value)
    with pytest.raises(eb.BatchError, match="'threefry2x32' key") as info:
        eb.load(path, like={"key": jr.key(0, impl="unsafe_rbg")})
    assert "like['key']" in str(info.value)


def test_function_leaves_are_checked_by_name(getkey, tmp_path):
    key = getkey()
    path = tmp_path / "mlp.safetensors"
    eb.save(path, eqx.nn.MLP(2, 1, 4, 1, activation=jax.nn.relu, key=key))
    tanh_like = eqx.nn.MLP(2, 1, 4, 1, activation=jnp.tanh, key=key)
    with pytest.raises(eb.BatchError, match="relu") as info:
        eb.load(path, like=tanh_like)
    assert "like.activation" in str(info.value)


def test_like_is_checked_before_the_data_is_read(tmp_path):
    # A wrong `like` is reported as such even when the data is also damaged: the
    # header (checked first) says enough.
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"w": jnp.arange(100.0)})
    damaged = bytearray(path.read_bytes())
    damaged[-3] ^= 1
    path.write_bytes(bytes(damaged))
    with pytest.raises(eb.BatchError, match="shape") as info:
        eb.load(path, like={"w": jnp.zeros(7)})
    assert not isinstance(info.value, BadFileError)
    with pytest.raises(BadFileError, match="corrupt"):
        eb.load(path, like={"w": jnp.zeros(100)})


# ------------------------------------------------------------------------------------
# Bad files.


def test_foreign_files(tmp_path):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint, just some notes\n")
    npy = tmp_path / "array.npy"
    np.save(npy, np.arange(3))
    for path in (empty, text, npy):
        with pytest.raises(BadFileError, match="not an eqx_batch file") as info:
            eb.load(path, like=jnp.zeros(3))
        assert str(path) in str(info.value)
        assert "corrupt" not in str(info.value)


def test_safetensors_file_of_another_tool(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"weight": np.ones((2, 3), np.float32)}, path)
    with pytest.raises(BadFileError, match=r"safetensors file \(1 tensor\)") as info:
        eb.load(path, like={"weight": jnp.zeros((2, 3))})
    message = str(info.value)
    assert "not an eqx_batch file" in message
    assert "safetensors.numpy.load_file" in message


class _Payload:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickles_are_never_unpickled(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(BadFileError, match="not an eqx_batch file"):
        eb.load(path, like=jnp.zeros(3))
    # A pickle where the leaf records belong, correctly checksummed, still does not run.
    path = tmp_path / "evil.safetensors"
    eb.save(path, jnp.zeros(3))
    payload = pickle.dumps(_Payload(str(marker))).decode("latin-1")
    _resign(path, lambda metadata, _: metadata.update({"eqx_batch.leaves": payload}))
    with pytest.raises(BadFileError, match="malformed header"):
        eb.load(path, like=jnp.zeros(3))
    assert not marker.exists()


@SETTINGS
@given(data=st.data())
def test_truncated_file_raises(getkey, tmp_path, data):
    tree = {"w": jr.normal(getkey(), (4, 3)), "name": "model"}
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    whole = path.read_bytes()
    cut = data.draw(st.integers(0, len(whole) - 1))
    path.write_bytes(whole[:cut])
    with pytest.raises(BadFileError) as info:
        eb.load(path, like=tree)
    assert str(path) in str(info.value)
    if cut > 8:
        assert "corrupt" in str(info.value)


@SETTINGS
@given(data=st.data())
def test_any_flipped_bit_says_corrupt(getkey, tmp_path, data):
    tree = {"w": jr.normal(getkey(), (4, 3)), "key": getkey(), "lr": 0.5}
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    corrupt = bytearray(path.read_bytes())
    where = data.draw(st.integers(0, len(corrupt) - 1))
    corrupt[where] ^= 1 << data.draw(st.integers(0, 7))
    path.write_bytes(bytes(corrupt))
    with pytest.raises(BadFileError, match="is corrupt") as info:
        eb.load(path, like=tree)
    assert str(path) in str(info.value)
    assert "earlier" not in str(info.value)


def test_flipped_version_bit_says_corrupt_not_upgrade(tmp_path):
    path = tmp_path / "tree.safetensors"
    eb.save(path, jnp.zeros(3))
    raw = path.read_bytes()
    where = raw.index(b'"eqx_batch.version":"1"') + len(b'"eqx_batch.version":"')
    flipped = bytearray(raw)
    flipped[where] ^= 0b10  # "1" becomes "3"
    path.write_bytes(bytes(flipped))
    with pytest.raises(BadFileError, match="corrupt") as info:
        eb.load(path, like=jnp.zeros(3))
    assert "Upgrade" not in str(info.value)


def test_data_checksum_mismatch_says_corrupt(tmp_path):
    path = tmp_path / "tree.safetensors"
    eb.save(path, jnp.arange(100.0))
    data = bytearray(path.read_bytes())
    data[-40] ^= 1  # inside the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(BadFileError, match="checksum of its tensor data"):
        eb.load(path, like=jnp.zeros(100))
    # Reading the metadata does not read the data, so it does not see the damage.
    assert read_metadata(path) == {}


def test_newer_format_version(tmp_path):
    path = tmp_path / "tree.safetensors"
    eb.save(path, jnp.zeros(3))
    _resign(path, lambda metadata, _: metadata.update({"eqx_batch.version": "99"}))
    with pytest.raises(BadFileError, match="version 99") as info:
        eb.load(path, like=jnp.zeros(3))
    assert "Upgrade eqx_batch" in str(info.value)
    with pytest.raises(BadFileError, match="version 99"):
        read_metadata(path)


@pytest.mark.parametrize(
    "edit",
    [
        _edit_leaf(1, "dtype", "object"),
        _edit_leaf(1, "dtype", "|S4"),
        _edit_leaf(1, "dtype", "float64"),
        _edit_leaf(1, "shape", [-3]),
        _edit_leaf(1, "shape", [2]),
        _edit_leaf(1, "kind", "pickle"),
        _edit_leaf(1, "weak", "yes"),
        _edit_leaf(1, "path", "['other']"),
        _edit_leaf(0, "value", "not a float"),
        lambda metadata, tensors: metadata.pop("eqx_batch.leaves"),
        lambda metadata, tensors: metadata.update({"eqx_batch.version": "0"}),
        lambda metadata, tensors: metadata.update({"eqx_batch.leaves": "[[[[" * 10**5}),
        lambda metadata, tensors: tensors["['w']"].update(dtype="I32"),
        lambda metadata, tensors: tensors["['w']"].update(data_offsets=[0, 8]),
        lambda metadata, tensors: tensors["['w']"].update(data_offsets=[0, 10**12]),
        lambda metadata, tensors: tensors.update({"extra": tensors["['w']"]}),
        lambda metadata, tensors: tensors.clear(),
    ],
)
def test_crafted_headers_with_valid_checksums(tmp_path, edit):
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"w": jnp.zeros(3), "lr": 0.5})
    _resign(path, edit)
    with pytest.raises(BadFileError) as info:
        eb.load(path, like={"w": jnp.zeros(3), "lr": 0.5})
    assert str(path) in str(info.value)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        eb.load(tmp_path / "absent.safetensors", like=jnp.zeros(3))


def test_not_regular_files_are_refused(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    outcome = {}

    def load(path):
        try:
            eb.load(path, like=jnp.zeros(3))
        except eb.BatchError as e:
            outcome[path] = str(e)

    # A FIFO with no writer blocks a plain open() forever: load in a thread, so that a
    # regression fails the test instead of hanging it.
    for path in (str(fifo), "/dev/zero", str(tmp_path)):
        thread = threading.Thread(target=load, args=(path,), daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), f"eb.load({path!r}) blocked"
    assert "is a FIFO (named pipe), not a regular file" in outcome[str(fifo)]
    assert "is a character device" in outcome["/dev/zero"]
    assert "is a folder" in outcome[str(tmp_path)]
    with pytest.raises(BadFileError, match="character device"):
        read_metadata("/dev/zero")


def test_hostile_sizes_under_an_address_space_limit(tmp_path):
    """8 GiB sparse files that start like valid ones, read with 2 GiB of address space:
    each gets a `BatchError`, never a `MemoryError`."""
    big = 8 << 30
    valid = tmp_path / "valid.safetensors"
    eb.save(valid, {"w": jnp.zeros((4, 3))})
    raw = valid.read_bytes()
    (length,) = struct.unpack_from("<Q", raw)
    files = {}

    def sparse(name, content):
        path = tmp_path / name
        path.write_bytes(content)
        os.truncate(path, big)
        files[name] = path

    # A whole valid file followed by zeros: its header describes far less data.
    sparse("extended", raw)
    # The header's length claims the whole file.
    sparse("long_header", struct.pack("<Q", big - 8) + raw[8:])
    # A foreign file claiming an 8 GiB header.
    sparse("foreign", struct.pack("<Q", big - 8) + b'{"x":' + bytes(64))
    # A crafted header, checksums valid, whose tensor fills the 8 GiB.
    crafted = tmp_path / "crafted.safetensors"
    crafted.write_bytes(raw)

    def claim_all(metadata, tensors):
        tensors["['w']"].update(shape=[big // 4], data_offsets=[0, big])
        leaves = metadata["eqx_batch.leaves"].replace("[4,3]", f"[{big // 4}]")
        metadata["eqx_batch.leaves"] = leaves

    _resign(crafted, claim_all, data=b"")
    os.truncate(crafted, crafted.stat().st_size + big)
    files["crafted"] = crafted
    script = textwrap.dedent(
        """
        import resource, sys
        import jax.numpy as jnp
        import eqx_batch as eb
        from eqx_batch._file_format import read_metadata

        like = {"w": jnp.zeros((4, 3))}
        eb.load(sys.argv[1], like)  # everything loading needs is imported and ready
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        for path in sys.argv[2:]:
            for read in (lambda: eb.load(path, like), lambda: read_metadata(path)):
                try:
                    read()
                    print("LOADED", path)
                except eb.BatchError as e:
                    print("REFUSED", type(e).__name__, str(e).replace("\\n", " "))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(valid), *map(str, files.values())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    # The crafted file's header is sound: its metadata can be read.
    assert len(lines) == 2 * len(files) and all(
        line.startswith("REFUSED") for line in lines[:-1]
    ), proc.stdout
    assert lines[-1] == f"LOADED {crafted}"
    by_name = dict(zip(files, lines[::2], strict=True))
    assert "describes 48 bytes of tensor data but 8589934" in by_name["extended"]
    assert "more than safetensors' limit" in by_name["long_header"]
    assert "not an eqx_batch file" in by_name["foreign"]
    assert "shape (4, 3) but the file has shape (2147483648,)" in by_name["crafted"]


# ------------------------------------------------------------------------------------
# Errors while saving.


def test_save_inside_jit_names_the_tracer(tmp_path):
    path = tmp_path / "tree.safetensors"

    @jax.jit
    def f(x):
        eb.save(path, {"state": [x]})
        return x

    with pytest.raises(eb.BatchError, match="traced") as info:
        f(jnp.zeros(2))
    assert "tree['state'][0]" in str(info.value)
    assert not path.exists()


def test_save_rejects_non_numeric_arrays(tmp_path):
    path = tmp_path / "tree.safetensors"
    with pytest.raises(eb.BatchError, match="numeric") as info:
        eb.save(path, {"names": np.array(["a", "b"])})
    assert "tree['names']" in str(info.value)
    with pytest.raises(eb.BatchError, match="tree\\['things'\\]"):
        eb.save(path, {"things": np.array([object()])})
    assert list(tmp_path.iterdir()) == []


class _Twins:
    """Two leaves whose key paths print the same: a file could not tell them apart."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jtu.register_pytree_with_keys(
    _Twins,
    lambda t: (((jtu.GetAttrKey("w"), t.a), (jtu.GetAttrKey("w"), t.b)), None),
    lambda _, children: _Twins(*children),
)


def test_save_rejects_leaves_with_the_same_path(tmp_path):
    path = tmp_path / "twins.safetensors"
    with pytest.raises(eb.BatchError, match="several array leaves with the path '.w'"):
        eb.save(path, _Twins(jnp.zeros(2), jnp.ones(2)))
    assert not path.exists()


def test_save_into_missing_folder_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        eb.save(tmp_path / "absent" / "tree.safetensors", jnp.zeros(3))


# ------------------------------------------------------------------------------------
# Atomic writes.


def test_atomic_write_replaces(tmp_path):
    path = tmp_path / "blob"
    atomic_write(path, lambda file: file.write(b"first"))
    atomic_write(path, lambda file: file.write(b"second"))
    assert path.read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["blob"]


def test_write_tree_uncached_writes_the_same_file(getkey, tmp_path):
    # Dropping the pages from the OS cache after the fsync changes nothing on disk.
    tree = {"w": jr.normal(getkey(), (64, 1024)), "name": "draws"}
    eb.save(tmp_path / "cached.safetensors", tree)
    write_tree(tmp_path / "uncached.safetensors", tree, keep_cached=False)
    cached = (tmp_path / "cached.safetensors").read_bytes()
    assert (tmp_path / "uncached.safetensors").read_bytes() == cached
    assert_trees_identical(eb.load(tmp_path / "uncached.safetensors", like=tree), tree)


def test_atomic_write_uses_the_umask(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    atomic_write(tmp_path / "atomic", lambda file: None)
    mode = (tmp_path / "atomic").stat().st_mode & 0o777
    assert mode == plain.stat().st_mode & 0o777


def test_failed_write_leaves_previous_file_whole(getkey, tmp_path):
    tree = {"w": jr.normal(getkey(), (5,))}
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)

    def write(file):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, write)
    assert_trees_identical(eb.load(path, like=tree), tree)
    assert [p.name for p in tmp_path.iterdir()] == ["tree.safetensors"]


def test_crash_mid_write_leaves_previous_file_whole(getkey, tmp_path):
    tree = {"w": jr.normal(getkey(), (5,)), "key": getkey()}
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    # A real process dies (no cleanup, no exception handling) halfway through a save.
    script = textwrap.dedent(
        f"""
        import os
        from eqx_batch._atomic import atomic_write

        def write(file):
            file.write(b"x" * 100_000)
            file.flush()
            os._exit(3)

        atomic_write({str(path)!r}, write)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=os.environ.copy())
    assert proc.returncode == 3
    leftovers = [p for p in tmp_path.iterdir() if p.name != "tree.safetensors"]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size == 100_000
    assert_trees_identical(eb.load(path, like=tree), tree)


def test_concurrent_writers_never_leave_a_torn_file(tmp_path):
    path = tmp_path / "shared.safetensors"
    eb.save(path, {"w": np.zeros(100_000, np.float32)})
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import eqx_batch as eb

        value = float(sys.argv[2])
        for _ in range(40):
            eb.save(sys.argv[1], {"w": np.full(100_000, value, np.float32)})
        """
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", script, str(path), str(value)])
        for value in (1.0, 2.0)
    ]
    like = {"w": np.zeros(100_000, np.float32)}
    seen = set()
    while any(w.poll() is None for w in writers):
        w = eb.load(path, like=like)["w"]
        assert np.all(w == w[0]), "a file mixes two writes"
        seen.add(float(w[0]))
    assert all(w.wait() == 0 for w in writers)
    assert float(eb.load(path, like=like)["w"][0]) in (1.0, 2.0)
    assert seen <= {0.0, 1.0, 2.0}
    assert [p.name for p in tmp_path.iterdir()] == ["shared.safetensors"]


def test_disk_full_keeps_the_previous_file(tmp_path):
    # A real full disk: a 1 MiB tmpfs (needs the privilege to mount one).
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here, so no disk can be filled honestly")
    try:
        path = folder / "tree.safetensors"
        small = {"w": np.arange(1000, dtype=np.float32)}
        eb.save(path, small)
        with pytest.raises(OSError) as info:
            eb.save(path, {"w": np.zeros(1_000_000, np.float32)})
        assert info.value.errno == 28  # ENOSPC
        assert_trees_identical(eb.load(path, like=small), small)
        assert [p.name for p in folder.iterdir()] == ["tree.safetensors"]
    finally:
        subprocess.run(["umount", str(folder)], check=True)
