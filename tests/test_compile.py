"""The compile plumbing in `_compiling/_compile.py`: the static part of a pytree and
`AsyncJit`."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest

from eqx_batch._compiling import _static_key
from eqx_batch._compiling._compile import (
    AsyncJit,
    combine,
    donated_once,
    hold,
    partition,
)


def test_partition_takes_out_arrays_and_combine_puts_them_back():
    tree = {"w": jnp.ones(2), "act": jax.nn.relu, "n": 3}
    arrays, static = partition(tree)
    assert len(arrays) == 1 and arrays[0] is tree["w"]
    assert hash(static) == hash(partition(tree)[1])
    assert static == partition({"w": jnp.zeros(2), "act": jax.nn.relu, "n": 3})[1]
    assert static != partition({"w": jnp.ones(2), "act": jax.nn.relu, "n": 4})[1]
    assert combine(arrays, static) == tree


class StaticConfig(eqx.Module):
    value: Any = eqx.field(static=True)


# Where this JAX pickles treedefs as expected their nodes are read from that; the walk
# through `PyTreeDef`'s public methods is the fallback, and must key them the same.
@pytest.mark.parametrize("read_nodes", ["pickled", "walked"])
def test_static_parts_are_equal_for_static_fields_of_one_type_and_bits(
    monkeypatch, read_nodes
):
    if read_nodes == "walked":
        monkeypatch.setattr(_static_key, "read_nodes", _static_key._walked_nodes)

    def static(value):
        return partition({"config": StaticConfig((value,)), "x": jnp.ones(2)})[1]

    assert static(0.0) == static(0.0) and hash(static(0.0)) == hash(static(0.0))
    assert static(0.0) != static(-0.0)
    assert static(1) != static(1.0) and static(1) != static(True)
    assert static(math.nan) == static(float("nan"))
    assert hash(static(math.nan)) == hash(static(float("nan")))
    assert static(math.nan) != static(math.copysign(math.nan, -1.0))


def test_static_part_passes_through_jit_vmap_and_scan():
    _, static = partition((jnp.ones(2), "label"))
    assert jtu.tree_leaves(static) == []
    out = jax.jit(lambda x: (x, static))(jnp.ones(2))
    assert out[1] is static
    assert jax.vmap(lambda x: (x, static), out_axes=(0, None))(jnp.ones(2))[1] is static


def test_hold_keeps_a_whole_axis_spec_with_its_nones():
    spec = (0, None, {"a": None, "b": 1})
    assert combine((), hold(spec)) == spec
    assert hold(spec) == hold((0, None, {"a": None, "b": 1}))


def test_async_jit_donates_by_parameter_name():
    def step(scale, buffer):
        return buffer * scale

    donating = AsyncJit(step, donate=("buffer",))
    buffer = jnp.ones(3)
    assert jnp.array_equal(donating(2.0, buffer), jnp.full(3, 2.0))
    lowered = donating.lower(2.0, jnp.ones(3))
    assert "jax.buffer_donor" in lowered.as_text() or "tf.aliasing_output" in (
        lowered.as_text()
    )


def test_async_jit_refuses_an_unknown_name():
    with pytest.raises(TypeError, match="buffers"):
        AsyncJit(lambda buffer: buffer, donate=("buffers",))


def test_donated_once_copies_a_donated_array_passed_elsewhere():
    x, y = jnp.ones(2), jnp.zeros(2)
    kept, donated = donated_once([[x], [x, y, y]], donated=(1,))
    assert kept[0] is x and donated[1] is y
    assert donated[0] is not x and donated[2] is not y
    assert jnp.array_equal(donated[0], x) and jnp.array_equal(donated[2], y)
    for arguments, donating in ([[x], [y]], (0, 1)), ([[x], [x]], ()):
        assert donated_once(arguments, donated=donating) is arguments
