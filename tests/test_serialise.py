"""`eb.save` / `eb.load` and the checkpoint layer's `write_tree` / `read_tree`: round
trips, and every mismatch between a file and `like` or problem of a tree to save."""

import logging
import math
import re
import struct
from typing import Any

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
from helpers import assert_trees_identical, mixed_tree
from hypothesis import given, HealthCheck, settings

import eqx_batch as eb
from eqx_batch._files._file_format import BadFileError
from eqx_batch._files._serialise import read_tree, write_tree


SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


# ------------------------------------------------------------------------------------
# Round trips.


@pytest.mark.accelerator
def test_round_trip_mixed_tree(getkey, tmp_path):
    tree = mixed_tree(getkey())
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    assert_trees_identical(eb.load(path, like=tree), tree)
    # A fresh `like` with other values gets the saved ones.
    other = mixed_tree(getkey())
    assert_trees_identical(eb.load(str(path), like=other), tree)


@pytest.mark.accelerator
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


def _backend_compiles(caplog: Any) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "Finished XLA compilation" in r.getMessage()
    ]


def test_many_weak_leaves_compile_per_shape_not_per_leaf(tmp_path, caplog):
    # 0-d weak leaves of JAX's default dtypes arrive weak from Python scalars; the
    # rest go through one identity program per shape, dtype and placement.
    nan = np.frombuffer(struct.pack("<I", 0x7FC0_1234), np.float32)[0]
    second = jax.devices()[1]  # device_put to a device commits the array there
    values = [
        jnp.asarray(-0.0),
        jnp.asarray(7),
        jnp.asarray(1 + 2j),
        # A weak NaN with a payload, which a Python float need not keep.
        jax.jit(lambda x: x)
        .lower(jax.ShapeDtypeStruct((), jnp.float32, weak_type=True))
        .compile()(nan),
        jnp.full((3, 7), 2.5),
        jnp.full((11,), -4),
        jax.device_put(jnp.full((3, 7), 0.5), second),
        jax.device_put(jnp.asarray(9.0), second),
        jnp.ones((3, 7)),
    ]
    tree = [values[i % len(values)] for i in range(300)]
    assert [x.weak_type for x in tree[:9]] == [True] * 8 + [False]
    path = tmp_path / "weak.safetensors"
    eb.save(path, tree)
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
        loaded = eb.load(path, like=tree)
    assert_trees_identical(loaded, tree)
    assert (
        loaded[6].sharding == tree[6].sharding == tree[7].sharding == loaded[7].sharding
    )
    assert (
        loaded[6].committed and loaded[7].committed and loaded[6].devices() == {second}
    )
    # At most the NaN's, (3, 7) float32 on two placements and (11,) int32.
    assert len(_backend_compiles(caplog)) <= 4
    # Another tree of the same shapes compiles nothing.
    caplog.clear()
    eb.save(path, tree[:123])
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
        assert_trees_identical(eb.load(path, like=tree[:123]), tree[:123])
    assert _backend_compiles(caplog) == []


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


@pytest.mark.accelerator
def test_like_of_shape_dtype_structs(getkey, tmp_path):
    tree = {"model": eqx.nn.Linear(3, 2, key=getkey()), "key": getkey()}
    path = tmp_path / "tree.safetensors"
    eb.save(path, tree)
    abstract = eqx.filter_eval_shape(lambda: tree)
    assert isinstance(abstract["model"].weight, jax.ShapeDtypeStruct)
    assert_trees_identical(eb.load(path, like=abstract), tree)


@pytest.mark.accelerator
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
# Reading on the host.


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


def _members(key, count):
    # 0-d NumPy arrays, not NumPy scalars: `eb.unstack` gives those back as arrays.
    return [
        {"mlp": eqx.nn.MLP(2, 1, 4, 1, key=k), "key": k, "steps": np.asarray(i)}
        for i, k in enumerate(jr.split(key, count))
    ]


def _refused(path, like) -> str:
    """The message of `eb.load(path, like)`, which must refuse and leave `path` be."""
    before = path.read_bytes()
    with pytest.raises(eb.BatchError) as info:
        eb.load(path, like=like)
    assert isinstance(info.value, ValueError)
    assert path.read_bytes() == before
    return str(info.value)


def _run_fix(message: str, like: Any) -> Any:
    """Runs the line of code that ends `message`, the fix it names."""
    line = re.findall(r"`(eb\.[^`]*)`", message)[-1]
    return eval(line, {"eb": eb, "eqx": eqx, "like": like})


def test_stacked_file_into_a_list_of_members_names_unstack(getkey, tmp_path):
    members = _members(getkey(), 3)
    path = tmp_path / "stacked.safetensors"
    eb.save(path, eb.stack(members))
    like = _members(getkey(), 3)
    message = _refused(path, like)
    assert "the file holds one tree stacked from 3 members" in message
    assert "`like` is a list of 3 members" in message
    assert message.endswith(
        f"`eb.unstack(eb.load({str(path)!r}, like=eb.stack(like)))`."
    )
    assert_trees_identical(_run_fix(message, like), members)


def test_list_file_into_a_stacked_like_names_stack(getkey, tmp_path):
    members = _members(getkey(), 3)
    path = tmp_path / "list.safetensors"
    eb.save(path, members)
    like = eb.stack(_members(getkey(), 3))
    message = _refused(path, like)
    assert "the file holds a list of 3 members" in message
    assert "`like` is one tree stacked from 3 members" in message
    assert message.endswith(
        f"`eb.stack(eb.load({str(path)!r}, like=eb.unstack(like)))`."
    )
    assert_trees_identical(_run_fix(message, like), eb.stack(members))


def _make(key):
    return eqx.nn.MLP(2, 2, 8, 2, key=key)


def test_layout_fixes_for_shape_only_likes(tmp_path):
    # `eb.stack` would keep `ShapeDtypeStruct`s as shared leaves: the fix says
    # `eqx.filter_eval_shape`.
    keys = jr.split(jr.key(3), 4)
    members = [_make(k) for k in keys]
    eb.save(tmp_path / "stacked", eb.stack(members))
    eb.save(tmp_path / "list", members)
    like = [eqx.filter_eval_shape(_make, k) for k in keys]
    message = _refused(tmp_path / "stacked", like)
    assert "like=eqx.filter_eval_shape(eb.stack, like)" in message
    assert_trees_identical(_run_fix(message, like), members)
    like = eqx.filter_eval_shape(eqx.filter_vmap(_make), keys)
    message = _refused(tmp_path / "list", like)
    assert "like=eqx.filter_eval_shape(eb.unstack, like)" in message
    assert_trees_identical(_run_fix(message, like), eb.stack(members))


def test_layout_errors_say_when_the_member_counts_differ(getkey, tmp_path):
    path = tmp_path / "list.safetensors"
    eb.save(path, _members(getkey(), 3))
    message = _refused(path, eb.stack(_members(getkey(), 2)))
    assert "`like` is one tree stacked from 2 members" in message
    assert message.endswith("with `like` of 3 members as saved.")
    eb.save(path, eb.stack(_members(getkey(), 3)))
    message = _refused(path, _members(getkey(), 2))
    assert "`like` is a list of 2 members" in message
    assert message.endswith("with `like` of 3 members as saved.")


def test_list_file_into_one_member(getkey, tmp_path):
    members = _members(getkey(), 3)
    path = tmp_path / "list.safetensors"
    eb.save(path, members)
    like = _members(getkey(), 1)[0]
    message = _refused(path, like)
    assert "`like` is one member" in message
    assert_trees_identical(_run_fix(message, like), members)


def test_grid_file_into_rows_of_members_names_unstack_with_ndim(tmp_path):
    rows = [[{"w": jnp.full(2, 3.0 * i + j)} for j in range(3)] for i in range(2)]
    path = tmp_path / "grid.safetensors"
    eb.save(path, eb.stack(rows, ndim=2))
    like = [[{"w": jnp.zeros(2)} for _ in range(3)] for _ in range(2)]
    message = _refused(path, like)
    assert "one tree stacked from 2 x 3 members" in message
    assert "eb.unstack(eb.load(" in message
    assert "like=eb.stack(like, ndim=2)), ndim=2)" in message
    assert_trees_identical(_run_fix(message, like), rows)


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
    with pytest.raises(eb.BatchError, match="several array leaves at '.w'"):
        eb.save(path, _Twins(jnp.zeros(2), jnp.ones(2)))
    assert not path.exists()


class _Named:
    """A pytree key printed as its name alone, as custom pytrees may have."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name

    def __eq__(self, other):
        return isinstance(other, _Named) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


class _Header:
    """A pytree whose one leaf's path prints as safetensors' reserved `__metadata__`."""

    def __init__(self, leaf):
        self.leaf = leaf


jtu.register_pytree_with_keys(
    _Header,
    lambda t: (((_Named("__metadata__"), t.leaf),), None),
    lambda _, children: _Header(*children),
)


def test_save_refuses_a_leaf_named_like_the_safetensors_metadata(tmp_path):
    path = tmp_path / "tree.safetensors"
    with pytest.raises(eb.BatchError, match="__metadata__") as info:
        eb.save(path, _Header(jnp.zeros(2)))
    assert "`tree__metadata__`" in str(info.value)
    assert list(tmp_path.iterdir()) == []
    # A dict key of that name prints as `['__metadata__']`: no clash.
    eb.save(path, {"__metadata__": jnp.arange(2.0)})
    loaded = eb.load(path, like={"__metadata__": jnp.zeros(2)})
    assert loaded["__metadata__"].tolist() == [0.0, 1.0]
    # A scalar leaf is not a tensor: no clash either.
    eb.save(path, _Header(0.5))
    assert eb.load(path, like=_Header(0.0)).leaf == 0.5


def test_save_into_missing_folder_names_the_path(tmp_path):
    path = tmp_path / "absent" / "tree.safetensors"
    with pytest.raises(eb.BatchError) as info:
        eb.save(path, jnp.zeros(3))
    message = str(info.value)
    assert f"`path` ({path})" in message and "does not exist" in message
    assert ".tmp" not in message
    assert list(tmp_path.iterdir()) == []


def test_save_onto_a_folder_names_the_path(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    with pytest.raises(eb.BatchError) as info:
        eb.save(folder, jnp.zeros(3))
    message = str(info.value)
    assert f"`path` ({folder}) is a folder" in message
    assert ".tmp" not in message
    assert list(tmp_path.iterdir()) == [folder]
    assert list(folder.iterdir()) == []
