"""The eqx_batch file format: safetensors files that any reader opens, with eqx_batch's
metadata and checksums, and every kind of file that is not one, refused before it is
read."""

import json
import os
import pathlib
import pickle
import struct
import subprocess
import sys
import textwrap
import threading
import zlib

import hypothesis.strategies as st
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from helpers import assert_trees_identical, mixed_tree
from hypothesis import given, HealthCheck, settings

import eqx_batch as eb
from eqx_batch._files._file_format import BadFileError, read_metadata
from eqx_batch._files._file_layout import FIXED_END
from eqx_batch._files._serialise import read_tree, write_tree


SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


# ------------------------------------------------------------------------------------
# The layout: a safetensors file any reader opens, with eqx_batch's metadata.


def test_big_endian_arrays_are_stored_little_endian(tmp_path):
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"w": np.arange(4, dtype=">i4")})
    assert safetensors.numpy.load_file(path)["['w']"].tolist() == [0, 1, 2, 3]
    loaded = eb.load(path, like={"w": np.zeros(4, np.int32)})
    np.testing.assert_array_equal(loaded["w"], np.arange(4, dtype=np.int32))
    assert loaded["w"].dtype == np.int32


def test_safetensors_reads_every_array_by_its_path(getkey, tmp_path):
    tree = mixed_tree(getkey())
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
    with pytest.raises(
        eb.BatchError, match="'eqx_batch.version'; 'eqx_batch.' keys are reserved"
    ):
        write_tree(path, jnp.zeros(2), metadata={"eqx_batch.version": "7"})
    with pytest.raises(eb.BatchError, match="strings to strings"):
        write_tree(path, jnp.zeros(2), metadata={"steps": 3})  # type: ignore
    assert not path.exists()


# ------------------------------------------------------------------------------------
# Bad files: foreign, corrupt, truncated, crafted or hostile.


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
    assert "upgrade eqx_batch" in str(info.value)
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
        from eqx_batch._files._file_format import read_metadata

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


def _resave_with_safetensors(path, *, keep_opening):
    """Writes `path` again with safetensors' own writer, until the bytes differ from
    `eb.save`'s and its opening is (or is not) kept: safetensors orders metadata
    arbitrarily, so either can happen to a user."""
    original = path.read_bytes()
    with safetensors.safe_open(path, "np") as file:
        metadata = file.metadata()
    arrays = safetensors.numpy.load_file(path)
    for _ in range(1000):
        data = safetensors.numpy.save(arrays, metadata=metadata)
        kept = data[:FIXED_END] == original[:FIXED_END]
        if data != original and kept == keep_opening:
            path.write_bytes(data)
            return
    raise AssertionError("safetensors never wrote the wanted order")


@pytest.mark.parametrize("keep_opening", [False, True])
def test_file_resaved_by_safetensors_says_another_tool_rewrote_it(
    tmp_path, keep_opening
):
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"w": jnp.arange(3.0)})
    _resave_with_safetensors(path, keep_opening=keep_opening)
    with pytest.raises(BadFileError, match="rewritten by another tool") as info:
        eb.load(path, like={"w": jnp.zeros(3)})
    message = str(info.value)
    assert str(path) in message
    assert "failing disk" not in message and "damaged" not in message
    assert f"safetensors.numpy.load_file('{path}')" in message
    # ...which does give the arrays back.
    assert safetensors.numpy.load_file(path)["['w']"].tolist() == [0.0, 1.0, 2.0]


def _claim(count):
    """An edit that makes the header claim `count` float32s for `w`, consistently:
    the record's shape, the tensor's shape and its data offsets agree."""

    def edit(metadata, tensors):
        tensors["['w']"].update(shape=[count], data_offsets=[0, 4 * count])
        metadata["eqx_batch.leaves"] = metadata["eqx_batch.leaves"].replace(
            '"shape":[3]', f'"shape":[{count}]'
        )

    return edit


@pytest.mark.parametrize("count", [1, 10**9])
def test_consistent_size_lies_are_not_called_accidental_damage(tmp_path, count):
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"w": jnp.zeros(3), "lr": 0.5})
    _resign(path, _claim(count))
    with pytest.raises(BadFileError, match="crafted") as info:
        eb.load(path, like={"w": jnp.zeros(count), "lr": 0.5})
    message = str(info.value)
    assert f"describes {4 * count} bytes of tensor data but 12 follow it" in message
    assert "failing disk" not in message


@pytest.mark.parametrize(
    "offsets",
    [[0, 10**12], [0, 8], [4, 16]],
)
def test_sizes_that_disagree_with_each_other_say_not_written_by_save(tmp_path, offsets):
    path = tmp_path / "tree.safetensors"
    eb.save(path, {"w": jnp.zeros(3), "lr": 0.5})

    def move(metadata, tensors):
        tensors["['w']"].update(data_offsets=offsets)

    _resign(path, move)
    with pytest.raises(BadFileError, match="not written by `eb.save`") as info:
        eb.load(path, like={"w": jnp.zeros(3), "lr": 0.5})
    assert "failing disk" not in str(info.value)
