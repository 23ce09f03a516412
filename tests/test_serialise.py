"""`eb.save` / `eb.load`: round trips, stacked <-> list, atomic writes, every error."""

import json
import math
import os
import pathlib
import pickle
import struct
import subprocess
import sys
import textwrap
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
from helpers import assert_trees_identical
from hypothesis import given, HealthCheck, settings

import eqx_batch as eb
from eqx_batch._serialise import (
    _CRC,
    _MAGIC,
    _PREFIX,
    _VERSION,
    atomic_write,
    write_tree,
)


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
        "host": np.arange(6, dtype=np.int64).reshape(2, 3),
        "host_scalar": np.float32(-0.0),
        "empty": jnp.zeros((0, 3)),
        "weak": jnp.asarray(0.5),
        "flags": jnp.array([True, False]),
        "settings": [1.5, 3, True, "adam", 1 - 2j],
    }


def _rewrite(path: pathlib.Path, header_edit=None, version: int | None = None) -> None:
    """Edits a saved file's header or version and re-signs it with a valid checksum."""
    data = path.read_bytes()
    magic, old_version, header_nbytes = _PREFIX.unpack_from(data)
    header = json.loads(data[_PREFIX.size : _PREFIX.size + header_nbytes])
    payload_start = _PREFIX.size + header_nbytes
    payload = data[payload_start + -payload_start % 64 : -_CRC.size]
    if header_edit is not None:
        header_edit(header)
    raw = json.dumps(header).encode()
    new_version = old_version if version is None else version
    prefix = _PREFIX.pack(magic, new_version, len(raw))
    padding = bytes(-(len(prefix) + len(raw)) % 64)
    body = prefix + raw + padding + payload
    path.write_bytes(_signed(body))


def _signed(body: bytes) -> bytes:
    """`body` followed by its checksum."""
    return body + _CRC.pack(zlib.crc32(body))


# ------------------------------------------------------------------------------------
# Round trips.


def test_round_trip_mixed_tree(getkey, tmp_path):
    tree = _mixed_tree(getkey())
    path = tmp_path / "tree.eqx"
    eb.save(path, tree)
    assert_trees_identical(eb.load(path, like=tree), tree)
    # A fresh `like` with other values gets the saved ones.
    other = _mixed_tree(getkey())
    assert_trees_identical(eb.load(str(path), like=other), tree)


def test_leaf_types_follow_like(getkey, tmp_path):
    tree = {"w": jr.normal(getkey(), (3, 2)), "b": np.arange(3, dtype=np.float32)}
    path = tmp_path / "tree.eqx"
    eb.save(path, tree)
    like = {"w": np.zeros((3, 2), np.float32), "b": jnp.zeros(3)}
    loaded = eb.load(path, like=like)
    assert type(loaded["w"]) is np.ndarray and loaded["w"].flags.writeable
    assert isinstance(loaded["b"], jax.Array)
    np.testing.assert_array_equal(loaded["w"], np.asarray(tree["w"]))
    np.testing.assert_array_equal(np.asarray(loaded["b"]), tree["b"])


def test_big_endian_arrays_are_stored_little_endian(tmp_path):
    path = tmp_path / "tree.eqx"
    eb.save(path, {"w": np.arange(4, dtype=">i4")})
    loaded = eb.load(path, like={"w": np.zeros(4, np.int32)})
    np.testing.assert_array_equal(loaded["w"], np.arange(4, dtype=np.int32))
    assert loaded["w"].dtype == np.int32


def test_like_of_shape_dtype_structs(getkey, tmp_path):
    tree = {"model": eqx.nn.Linear(3, 2, key=getkey()), "key": getkey()}
    path = tmp_path / "tree.eqx"
    eb.save(path, tree)
    abstract = eqx.filter_eval_shape(lambda: tree)
    assert isinstance(abstract["model"].weight, jax.ShapeDtypeStruct)
    assert_trees_identical(eb.load(path, like=abstract), tree)


def test_loaded_arrays_keep_like_sharding(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("members",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("members"))
    tree = {"w": jax.device_put(jnp.arange(8.0).reshape(4, 2), sharding)}
    path = tmp_path / "tree.eqx"
    eb.save(path, tree)
    loaded = eb.load(path, like=tree)
    assert loaded["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(loaded["w"]), np.asarray(tree["w"]))


def test_save_replaces_previous_file(getkey, tmp_path):
    path = tmp_path / "tree.eqx"
    first, second = jr.normal(getkey(), (3,)), jr.normal(getkey(), (3,))
    eb.save(path, first)
    eb.save(path, second)
    assert_trees_identical(eb.load(path, like=first), second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tree.eqx"]


_DTYPES = [
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(np.int8),
    np.dtype(np.uint32),
    np.dtype(np.complex64),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float8_e5m2),
]


@st.composite
def _arrays(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    # Raw bytes reach every bit pattern: NaN payloads, -0.0, infinities, subnormals.
    size = int(np.prod(shape)) * dtype.itemsize
    raw = draw(st.binary(min_size=size, max_size=size))
    host = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape)
    if draw(st.booleans()):
        return host.copy()
    return jnp.asarray(host)


_scalars = st.one_of(
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
_trees = st.recursive(
    st.one_of(_arrays(), _scalars),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
    ),
    max_leaves=6,
)


@SETTINGS
@given(tree=_trees)
def test_save_load_round_trip_is_identity(tmp_path, tree):
    path = tmp_path / "tree.eqx"
    eb.save(path, tree)
    loaded = eb.load(path, like=tree)
    assert_trees_identical(loaded, tree)
    # `==` cannot tell -0.0 from 0.0; the bits can.
    for x, y in zip(jtu.tree_leaves(loaded), jtu.tree_leaves(tree), strict=True):
        if isinstance(x, float):
            assert struct.pack("<d", x) == struct.pack("<d", y)


def test_python_float_specials_round_trip(tmp_path):
    tree = [math.inf, -math.inf, math.nan, -0.0]
    path = tmp_path / "floats.eqx"
    eb.save(path, tree)
    loaded = eb.load(path, like=[0.0, 0.0, 0.0, 0.0])
    assert loaded[:2] == [math.inf, -math.inf]
    assert math.isnan(loaded[2])
    assert math.copysign(1.0, loaded[3]) == -1.0


# ------------------------------------------------------------------------------------
# Stacked <-> list.


def _members(key, count):
    return [
        {"mlp": eqx.nn.MLP(2, 1, 4, 1, key=k), "key": k, "steps": np.int32(i)}
        for i, k in enumerate(jr.split(key, count))
    ]


def test_stacked_file_loads_into_a_list(getkey, tmp_path):
    members = _members(getkey(), 3)
    path = tmp_path / "stacked.eqx"
    eb.save(path, eb.stack(members))
    loaded = eb.load(path, like=_members(getkey(), 3))
    assert isinstance(loaded, list)
    assert_trees_identical(loaded, members)


def test_list_file_loads_into_stacked_like(getkey, tmp_path):
    members = _members(getkey(), 3)
    path = tmp_path / "list.eqx"
    eb.save(path, members)
    like = eb.stack(_members(getkey(), 3))
    assert_trees_identical(eb.load(path, like=like), eb.stack(members))


def test_tuple_like_gets_a_tuple(getkey, tmp_path):
    members = _members(getkey(), 2)
    path = tmp_path / "stacked.eqx"
    eb.save(path, eb.stack(members))
    loaded = eb.load(path, like=tuple(members))
    assert isinstance(loaded, tuple)
    assert_trees_identical(list(loaded), members)


def test_member_count_mismatch_stacked_file_into_list(getkey, tmp_path):
    path = tmp_path / "stacked.eqx"
    eb.save(path, eb.stack(_members(getkey(), 3)))
    with pytest.raises(eb.BatchError, match="list of 2 members") as info:
        eb.load(path, like=_members(getkey(), 2))
    assert "leaf `['key']` has shape (3,)" in str(info.value)


def test_member_count_mismatch_list_file_into_stacked(getkey, tmp_path):
    path = tmp_path / "list.eqx"
    eb.save(path, _members(getkey(), 3))
    with pytest.raises(eb.BatchError, match="list of 3 members") as info:
        eb.load(path, like=eb.stack(_members(getkey(), 2)))
    assert "stacked with 2 members" in str(info.value)
    assert "like['key']" in str(info.value)


# ------------------------------------------------------------------------------------
# Mismatches between the file and `like`.


def test_shape_mismatch_names_path_and_both_shapes(getkey, tmp_path):
    path = tmp_path / "model.eqx"
    eb.save(path, {"layer1": {"weights": jnp.zeros((3, 4))}})
    with pytest.raises(eb.BatchError) as info:
        eb.load(path, like={"layer1": {"weights": jnp.zeros((5, 4))}})
    message = str(info.value)
    assert "like['layer1']['weights']" in message
    assert "(5, 4)" in message and "(3, 4)" in message


def test_dtype_mismatch(tmp_path):
    path = tmp_path / "tree.eqx"
    eb.save(path, {"w": jnp.zeros(3, jnp.bfloat16)})
    with pytest.raises(eb.BatchError, match="dtype float32 .* dtype bfloat16") as info:
        eb.load(path, like={"w": jnp.zeros(3, jnp.float32)})
    assert "like['w']" in str(info.value)


def test_structure_mismatch_lists_the_differing_leaves(tmp_path):
    path = tmp_path / "tree.eqx"
    eb.save(path, {"a": jnp.zeros(2), "b": jnp.zeros(2)})
    with pytest.raises(eb.BatchError, match="structure") as info:
        eb.load(path, like={"a": jnp.zeros(2), "c": jnp.zeros(2)})
    message = str(info.value)
    assert "in `like` only: `like['c']`" in message
    assert "in the file only: `['b']`" in message


def test_kind_mismatch_array_against_scalar(tmp_path):
    path = tmp_path / "tree.eqx"
    eb.save(path, {"lr": 0.1})
    with pytest.raises(eb.BatchError, match="the file has a float") as info:
        eb.load(path, like={"lr": jnp.asarray(0.1)})
    assert "like['lr']" in str(info.value)
    with pytest.raises(eb.BatchError, match="like\\['lr'\\]"):
        eb.load(path, like={"lr": 1})


def test_key_against_array_and_other_impl(tmp_path):
    path = tmp_path / "keys.eqx"
    eb.save(path, {"key": jr.key(0)})
    with pytest.raises(eb.BatchError, match="typed PRNG key") as info:
        eb.load(path, like={"key": jnp.zeros((), jnp.uint32)})
    assert "like['key']" in str(info.value)
    with pytest.raises(eb.BatchError, match="'threefry2x32' key") as info:
        eb.load(path, like={"key": jr.key(0, impl="unsafe_rbg")})
    assert "like['key']" in str(info.value)


def test_function_leaves_are_checked_by_name(getkey, tmp_path):
    key = getkey()
    path = tmp_path / "mlp.eqx"
    eb.save(path, eqx.nn.MLP(2, 1, 4, 1, activation=jax.nn.relu, key=key))
    tanh_like = eqx.nn.MLP(2, 1, 4, 1, activation=jnp.tanh, key=key)
    with pytest.raises(eb.BatchError, match="relu") as info:
        eb.load(path, like=tanh_like)
    assert "like.activation" in str(info.value)


# ------------------------------------------------------------------------------------
# Bad files.


def test_foreign_files(tmp_path):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    npy = tmp_path / "array.npy"
    np.save(npy, np.arange(3))
    for path in (empty, text, npy):
        with pytest.raises(eb.BatchError, match="not an eqx_batch checkpoint") as info:
            eb.load(path, like=jnp.zeros(3))
        assert str(path) in str(info.value)


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
    with pytest.raises(eb.BatchError, match="not an eqx_batch checkpoint"):
        eb.load(path, like=jnp.zeros(3))
    # The same bytes behind our magic, correctly checksummed, still do not run.
    body = _PREFIX.pack(_MAGIC, _VERSION, 0) + pickle.dumps(_Payload(str(marker)))
    path.write_bytes(_signed(body))
    with pytest.raises(eb.BatchError, match="malformed header"):
        eb.load(path, like=jnp.zeros(3))
    assert not marker.exists()


@SETTINGS
@given(data=st.data())
def test_truncated_file_raises(getkey, tmp_path, data):
    tree = {"w": jr.normal(getkey(), (4, 3)), "name": "model"}
    path = tmp_path / "tree.eqx"
    eb.save(path, tree)
    whole = path.read_bytes()
    cut = data.draw(st.integers(0, len(whole) - 1))
    path.write_bytes(whole[:cut])
    with pytest.raises(eb.BatchError) as info:
        eb.load(path, like=tree)
    assert str(path) in str(info.value)


@SETTINGS
@given(data=st.data())
def test_any_flipped_byte_raises(getkey, tmp_path, data):
    tree = {"w": jr.normal(getkey(), (4, 3)), "key": getkey()}
    path = tmp_path / "tree.eqx"
    eb.save(path, tree)
    corrupt = bytearray(path.read_bytes())
    where = data.draw(st.integers(0, len(corrupt) - 1))
    corrupt[where] ^= data.draw(st.integers(1, 255))
    path.write_bytes(bytes(corrupt))
    with pytest.raises(eb.BatchError) as info:
        eb.load(path, like=tree)
    assert str(path) in str(info.value)


def test_checksum_mismatch_says_corrupt(tmp_path):
    path = tmp_path / "tree.eqx"
    eb.save(path, jnp.arange(100.0))
    data = bytearray(path.read_bytes())
    data[-40] ^= 1  # inside the payload
    path.write_bytes(bytes(data))
    with pytest.raises(eb.BatchError, match="corrupt or truncated: its CRC-32"):
        eb.load(path, like=jnp.zeros(100))


def test_version_0_is_unknown(tmp_path):
    path = tmp_path / "tree.eqx"
    eb.save(path, jnp.zeros(3))
    _rewrite(path, version=0)
    with pytest.raises(eb.BatchError, match="unknown checkpoint format version, 0"):
        eb.load(path, like=jnp.zeros(3))


def test_newer_format_version(tmp_path):
    path = tmp_path / "tree.eqx"
    eb.save(path, jnp.zeros(3))
    _rewrite(path, version=99)
    with pytest.raises(eb.BatchError, match="version 99") as info:
        eb.load(path, like=jnp.zeros(3))
    assert "Upgrade eqx_batch" in str(info.value)


def _set_first_leaf(field, value):
    def edit(header):
        header["leaves"][0][field] = value

    return edit


@pytest.mark.parametrize(
    "edit",
    [
        _set_first_leaf("dtype", "object"),
        _set_first_leaf("dtype", "|S4"),
        _set_first_leaf("offset", 10**9),
        _set_first_leaf("nbytes", 7),
        _set_first_leaf("shape", [-3]),
        _set_first_leaf("kind", "pickle"),
        lambda header: header.pop("leaves"),
    ],
)
def test_crafted_headers_with_valid_checksum(tmp_path, edit):
    path = tmp_path / "tree.eqx"
    eb.save(path, {"w": jnp.zeros(3)})
    _rewrite(path, header_edit=edit)
    with pytest.raises(eb.BatchError) as info:
        eb.load(path, like={"w": jnp.zeros(3)})
    assert str(path) in str(info.value)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        eb.load(tmp_path / "absent.eqx", like=jnp.zeros(3))


# ------------------------------------------------------------------------------------
# Errors while saving.


def test_save_inside_jit_names_the_tracer(tmp_path):
    path = tmp_path / "tree.eqx"

    @jax.jit
    def f(x):
        eb.save(path, {"state": [x]})
        return x

    with pytest.raises(eb.BatchError, match="traced") as info:
        f(jnp.zeros(2))
    assert "tree['state'][0]" in str(info.value)
    assert not path.exists()


def test_save_rejects_non_numeric_arrays(tmp_path):
    path = tmp_path / "tree.eqx"
    with pytest.raises(eb.BatchError, match="numeric") as info:
        eb.save(path, {"names": np.array(["a", "b"])})
    assert "tree['names']" in str(info.value)
    with pytest.raises(eb.BatchError, match="tree\\['things'\\]"):
        eb.save(path, {"things": np.array([object()])})
    assert list(tmp_path.iterdir()) == []


def test_save_into_missing_folder_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        eb.save(tmp_path / "absent" / "tree.eqx", jnp.zeros(3))


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
    eb.save(tmp_path / "cached.eqx", tree)
    write_tree(tmp_path / "uncached.eqx", tree, keep_cached=False)
    cached = (tmp_path / "cached.eqx").read_bytes()
    assert (tmp_path / "uncached.eqx").read_bytes() == cached
    assert_trees_identical(eb.load(tmp_path / "uncached.eqx", like=tree), tree)


def test_atomic_write_uses_the_umask(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    atomic_write(tmp_path / "atomic", lambda file: None)
    mode = (tmp_path / "atomic").stat().st_mode & 0o777
    assert mode == plain.stat().st_mode & 0o777


def test_failed_write_leaves_previous_file_whole(getkey, tmp_path):
    tree = {"w": jr.normal(getkey(), (5,))}
    path = tmp_path / "tree.eqx"
    eb.save(path, tree)

    def write(file):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, write)
    assert_trees_identical(eb.load(path, like=tree), tree)
    assert [p.name for p in tmp_path.iterdir()] == ["tree.eqx"]


def test_crash_mid_write_leaves_previous_file_whole(getkey, tmp_path):
    tree = {"w": jr.normal(getkey(), (5,)), "key": getkey()}
    path = tmp_path / "tree.eqx"
    eb.save(path, tree)
    # A real process dies (no cleanup, no exception handling) halfway through a save.
    script = textwrap.dedent(
        f"""
        import os
        from eqx_batch._serialise import atomic_write

        def write(file):
            file.write(b"x" * 100_000)
            file.flush()
            os._exit(3)

        atomic_write({str(path)!r}, write)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=os.environ.copy())
    assert proc.returncode == 3
    leftovers = [p for p in tmp_path.iterdir() if p.name != "tree.eqx"]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size == 100_000
    assert_trees_identical(eb.load(path, like=tree), tree)
