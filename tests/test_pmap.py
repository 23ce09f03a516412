"""`eb.filter_pmap` and `eb.shard` over the 4 forced CPU devices."""

import enum
import re
import subprocess
import sys
import warnings
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_trees_identical, tree_allclose
from hypothesis import given, settings
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_batch as eb


class Layer(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.weight @ x + self.bias)


def stacked(members: int, seed: int = 0) -> Layer:
    rng = np.random.default_rng(seed)
    return Layer(
        jnp.asarray(rng.standard_normal((members, 2, 3), dtype=np.float32)),
        jnp.asarray(rng.standard_normal((members, 2), dtype=np.float32)),
    )


def apply(model: Layer, x: jax.Array) -> jax.Array:
    return model(x)


def with_collectives(x: jax.Array) -> dict[str, jax.Array]:
    return {
        "x": x,
        "sum": jax.lax.psum(x, "i"),
        "mean": jax.lax.pmean(x, "i"),
        "max": jax.lax.pmax(x, "i"),
        "min": jax.lax.pmin(x, "i"),
        "count": jax.lax.psum(jnp.ones((), jnp.int32), "i"),
        "index": jax.lax.axis_index("i"),
        "gathered": jax.lax.all_gather(x, "i"),
    }


def sharding_spec(x: jax.Array) -> P:
    sharding = x.sharding
    assert isinstance(sharding, NamedSharding)
    return sharding.spec


# ----------------------------------------------------------------------- filter_pmap


@settings(max_examples=12, deadline=None)
@given(members=st.integers(1, 9))
def test_any_member_count_equals_filter_vmap(members):
    check_collectives(members)


def test_one_member_per_device_equals_filter_vmap():
    # Exactly one member per device runs `fun` unbatched under shard_map.
    check_collectives(4)


def check_collectives(members):
    x = jnp.arange(members * 2, dtype=jnp.float32).reshape(members, 2) - 3.0
    ours = eb.filter_pmap(with_collectives, axis_name="i")(x)
    expected = eb.filter_vmap(with_collectives, axis_name="i")(x)
    assert ours["x"].shape == (members, 2)
    assert tree_allclose(ours, expected)
    # Padding members are never seen by a collective: these are exact.
    assert_trees_identical(ours["count"], expected["count"])
    assert_trees_identical(ours["index"], expected["index"])
    assert_trees_identical(ours["gathered"], expected["gathered"])
    assert_trees_identical(ours["max"], expected["max"])
    assert_trees_identical(ours["min"], expected["min"])


@pytest.mark.accelerator
@pytest.mark.parametrize("members", [3, 4, 6])
def test_module_results_equal_filter_vmap(members):
    model = stacked(members)
    x = jnp.linspace(-1.0, 1.0, 3)
    ours = eb.filter_pmap(apply, in_axes=(eqx.if_array(0), None))(model, x)
    expected = eb.filter_vmap(apply, in_axes=(eqx.if_array(0), None))(model, x)
    assert ours.shape == (members, 2)
    assert tree_allclose(ours, expected)


@pytest.mark.parametrize("members", [3, 4, 5])
def test_random_streams_are_each_members_own(members):
    keys = jr.split(jr.key(0), members)

    def draw(key):
        return jr.normal(key, (4,)), jr.split(key)

    ours = eb.filter_pmap(draw)(keys)
    expected = eb.filter_vmap(draw)(keys)
    # Each member sees exactly its own key, padding or not: bit for bit.
    assert_trees_identical(ours, expected)
    for member in range(members):
        assert_trees_identical(ours[0][member], jr.normal(keys[member], (4,)))


def test_results_split_over_devices_when_even_and_replicated_otherwise():
    f = eb.filter_pmap(lambda x: 2 * x)
    even = f(jnp.arange(8.0))
    assert sharding_spec(even) == P("members")
    assert len(even.sharding.device_set) == 4
    uneven = f(jnp.arange(6.0))
    assert sharding_spec(uneven) == P()
    assert uneven.sharding.is_fully_replicated
    moved = eb.filter_pmap(lambda x: jnp.stack([x, x]), out_axes=1)(jnp.ones((4, 3)))
    assert moved.shape == (2, 4, 3)
    assert sharding_spec(moved) == P(None, "members")


@pytest.mark.accelerator
@pytest.mark.needs_devices(4)
def test_work_is_partitioned_over_every_device():
    f = eb.filter_pmap(apply, in_axes=(eqx.if_array(0), None))
    model = stacked(8)
    compiled = f.lower(model, jnp.ones(3)).compile()
    text = compiled.as_text()
    assert re.search(r"num_partitions=4\b", text)
    # Each device's program handles 2 of the 8 members.
    assert re.search(r"f32\[2,2,3\]", text)
    assert not re.search(r"f32\[8,2,3\]", text)


def test_matches_eqx_filter_pmap():
    model = stacked(4)
    x = jnp.linspace(-1.0, 1.0, 3)

    def fun(model, x, scale, flag):
        y = model(x) * scale
        total = jax.lax.psum(y, "i")
        return y, total, flag, jnp.stack([y, y])

    in_axes = (eqx.if_array(0), None, None, None)
    out_axes = (0, 0, None, 1)
    ours = eb.filter_pmap(fun, in_axes=in_axes, out_axes=out_axes, axis_name="i")(
        model, x, jnp.float32(2.0), "static"
    )
    theirs = eqx.filter_pmap(fun, in_axes=in_axes, out_axes=out_axes, axis_name="i")(
        model, x, jnp.float32(2.0), "static"
    )
    assert ours[2] == theirs[2] == "static"
    assert tree_allclose(ours, theirs)


def test_dict_in_axes_and_keyword_arguments():
    model = stacked(5)
    keys = jr.split(jr.key(1), 5)

    def fun(model, x, *, key):
        return model(x + jr.normal(key, x.shape))

    ours = eb.filter_pmap(fun, in_axes={"x": None})(model, jnp.ones(3), key=keys)
    expected = eb.filter_vmap(fun, in_axes={"x": None})(model, jnp.ones(3), key=keys)
    assert ours.shape == (5, 2)
    assert tree_allclose(ours, expected)


@pytest.mark.parametrize("axis_size", [6, np.int64(6)])
def test_axis_size_without_mapped_arguments(axis_size):
    f = eb.filter_pmap(
        lambda x: x + jax.lax.axis_index("i").astype(jnp.float32),
        in_axes=None,
        axis_name="i",
        axis_size=axis_size,
    )
    out = f(jnp.float32(1.0))
    assert_trees_identical(out, jnp.arange(1.0, 7.0, dtype=jnp.float32))


@pytest.mark.parametrize("members", [4, 5])
def test_unmapped_output(members):
    f = eb.filter_pmap(
        lambda x: (x, jax.lax.psum(x, "i")), out_axes=(0, None), axis_name="i"
    )
    mapped, total = f(jnp.arange(float(members)))
    assert mapped.shape == (members,)
    assert total.shape == ()
    assert float(total) == sum(range(members))


def _scan_from_unmapped(x, init):
    def body(carry, xi):
        carry = carry + xi
        return carry, carry

    return jax.lax.scan(body, init, x)


@pytest.mark.parametrize("members", [jax.device_count(), 2 * jax.device_count()])
def test_scan_carry_from_unmapped_input(members):
    # Issue 43 (weathernext#108): with one member per device, `shard_map`'s vma check
    # typed the unmapped `init` invariant and the carry after a step varying, and
    # `lax.scan` refused the carry.
    x = jnp.arange(members * 5 * 3, dtype=jnp.float32).reshape(members, 5, 3)
    init = jnp.full(3, 0.5, jnp.float32)
    ours = eb.filter_pmap(_scan_from_unmapped, in_axes=(0, None))(x, init)
    assert_trees_identical(
        ours, jax.vmap(_scan_from_unmapped, in_axes=(0, None))(x, init)
    )


@pytest.mark.parametrize("members", [jax.device_count(), 2 * jax.device_count()])
def test_gradient_through_collective_equals_filter_vmap(members):
    def fun(x):
        return jax.grad(lambda v: jax.lax.psum(v, "i"))(x)

    x = jnp.arange(float(members))
    ours = eb.filter_pmap(fun, axis_name="i")(x)
    assert_trees_identical(ours, eb.filter_vmap(fun, axis_name="i")(x))


@pytest.mark.parametrize("members", [jax.device_count(), jax.device_count() + 1])
def test_unmapped_output_that_varies_is_refused(members):
    f = eb.filter_pmap(lambda x, y: (x, x * y), in_axes=(0, None), out_axes=(0, None))
    with pytest.raises(
        eb.BatchError, match=r"`out\[1\]` has out_axes None but differs"
    ):
        f(jnp.arange(float(members)), jnp.float32(2.0))
    # One computed from unmapped inputs alone is not refused.
    g = eb.filter_pmap(lambda x, y: (x, y * y), in_axes=(0, None), out_axes=(0, None))
    assert_trees_identical(
        g(jnp.arange(float(members)), jnp.float32(2.0))[1], jnp.float32(4.0)
    )


class AxisName(enum.Enum):
    MEMBERS = enum.auto()


def test_axis_name_that_is_not_a_string():
    # Mesh axes are named by strings, so this one takes the partitioned-vmap route
    # even with one member per device.
    name = AxisName.MEMBERS
    f = eb.filter_pmap(lambda x: x - jax.lax.pmean(x, name), axis_name=name)
    assert tree_allclose(f(jnp.arange(4.0)), jnp.arange(4.0) - 1.5)


def test_decorator_forms_and_methods():
    @eb.filter_pmap
    def bare(x):
        return x + 1

    @eb.filter_pmap(in_axes=(0, None))
    def with_args(x, y):
        return x * y

    assert_trees_identical(bare(jnp.arange(3.0)), jnp.arange(1.0, 4.0))
    assert_trees_identical(
        with_args(jnp.arange(3.0), jnp.float32(2.0)), jnp.arange(0.0, 6.0, 2.0)
    )

    class Scaled(eqx.Module):
        scale: jax.Array

        @eb.filter_pmap(in_axes=(None, 0))
        def __call__(self, x):
            return self.scale * x

    out = Scaled(jnp.float32(3.0))(jnp.arange(5.0))
    assert_trees_identical(out, 3.0 * jnp.arange(5.0))
    assert bare.__name__ == "bare"


def test_devices_argument():
    devices = jax.devices()[:2]
    f = eb.filter_pmap(lambda x: x * 2, devices=devices)
    out = f(jnp.arange(4.0))
    assert out.sharding.device_set == set(devices)
    assert_trees_identical(out, jnp.arange(0.0, 8.0, 2.0))
    one_each = f(jnp.arange(2.0))
    assert one_each.sharding.device_set == set(devices)
    assert_trees_identical(one_each, jnp.arange(0.0, 4.0, 2.0))


@pytest.mark.parametrize("members", [4, 6])
def test_traced_once_per_compilation(members):
    traces = []

    def fun(x):
        traces.append(x.shape)
        return 2 * x

    f = eb.filter_pmap(fun)
    for offset in range(3):
        f(jnp.arange(float(members)) + offset)
    # The checks and the tracing ran once; later calls only dispatch.
    assert traces == [()]
    f(jnp.arange(float(members + 1)))
    assert len(traces) == 2


@pytest.mark.parametrize("members", [4, 6])
def test_inside_jit_and_grad(members):
    model = stacked(members)
    x = jnp.ones(3)
    f = eb.filter_pmap(apply, in_axes=(eqx.if_array(0), None))
    g = eb.filter_vmap(apply, in_axes=(eqx.if_array(0), None))

    @eqx.filter_jit
    @eqx.filter_grad
    def grad_ours(model):
        return jnp.sum(f(model, x) ** 2)

    @eqx.filter_jit
    @eqx.filter_grad
    def grad_vmap(model):
        return jnp.sum(g(model, x) ** 2)

    grads = grad_ours(model)
    assert tree_allclose(grads, grad_vmap(model))
    if members % 4:
        # An uneven split never reaches the outer jit's outputs (some JAX versions
        # cannot express it there): gradients come back replicated, like results.
        assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(grads))


@pytest.mark.parametrize("donate", ["all", "warn"])
def test_donate(donate):
    double = eb.filter_pmap(lambda x: x * 2, donate=donate)
    # Donation reuses buffers already split over the devices, e.g. a previous result.
    x = eb.filter_pmap(lambda x: x + 1)(jnp.arange(8.0))
    out = double(x)
    assert x.is_deleted()
    assert_trees_identical(out, 2 * (jnp.arange(8.0) + 1))
    kept = eb.filter_pmap(lambda x: x + 1)(jnp.arange(8.0))
    eb.filter_pmap(lambda x: x * 2)(kept)
    assert not kept.is_deleted()


def test_donate_all_silences_unusable_buffer_warnings():
    x = jnp.arange(4, dtype=jnp.int32)
    # The int32 input buffer cannot hold the float32 output: donation is unusable.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eb.filter_pmap(lambda x: x.astype(jnp.float32), donate="all")(x)


@pytest.mark.accelerator
def test_lower_compile():
    f = eb.filter_pmap(with_collectives, axis_name="i")
    x = jnp.arange(6.0).reshape(3, 2)
    lowered = f.lower(x)
    assert "stablehlo" in lowered.as_text() or "func" in lowered.as_text()
    compiled = lowered.compile()
    assert_trees_identical(compiled(x), f(x))
    assert_trees_identical(compiled(x + 1), f(x + 1))


def test_compiled_rejects_other_static_arguments():
    f = eb.filter_pmap(lambda x, scale: x * scale, in_axes=(0, None))
    compiled = f.lower(jnp.arange(4.0), 2.0).compile()
    assert_trees_identical(compiled(jnp.arange(4.0), 2.0), jnp.arange(0.0, 8.0, 2.0))
    with pytest.raises(eb.BatchError, match="lower"):
        compiled(jnp.arange(4.0), 3.0)


def test_compiled_refuses_another_member_count_naming_the_argument():
    f = eb.filter_pmap(lambda x, scale: x * scale, in_axes=(0, None))
    compiled = f.lower(jnp.arange(5.0), jnp.ones(())).compile()
    with pytest.raises(
        eb.BatchError, match=r"`x`: lowered for float32\[5\], called with float32\[6\]"
    ):
        compiled(jnp.arange(6.0), jnp.ones(()))
    with pytest.raises(eb.BatchError, match=r"`scale`: lowered for float32\[\]"):
        compiled(jnp.arange(5.0), jnp.ones((), jnp.int32))
    # The wrapped function itself compiles anew.
    assert_trees_identical(f(jnp.arange(6.0), jnp.ones(())), jnp.arange(6.0))


@pytest.mark.parametrize("members", [3, 4, 6])
def test_python_scalar_output_is_broadcast_as_filter_vmap(members):
    # 4 members run one per device under `shard_map`, the others under `vmap`.
    def fun(x):
        return x, 1, 0.5

    ours = eb.filter_pmap(fun, out_axes=0)(jnp.arange(float(members)))
    theirs = eqx.filter_vmap(fun, out_axes=0)(jnp.arange(float(members)))
    assert_trees_identical(ours, theirs)
    ours = eb.filter_pmap(lambda: 1, out_axes=0, axis_size=members)()
    theirs = eqx.filter_vmap(lambda: 1, out_axes=0, axis_size=members)()
    assert_trees_identical(ours, theirs)


def test_dict_naming_a_parameter_left_at_its_default_is_refused():
    def fun(x, y=1.0):
        return x * y

    with pytest.raises(eb.BatchError, match="`y`, which this call"):
        eb.filter_pmap(fun, in_axes={"y": 0})(jnp.arange(4.0))
    with pytest.raises(ValueError):
        eqx.filter_pmap(fun, in_axes={"y": 0})(jnp.arange(4.0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"devices": []}, "devices is empty"),
        ({"axis_size": -1}, "`axis_size` is -1"),
        ({"axis_size": 2.0}, "`axis_size` is 2.0"),
        ({"axis_size": True}, "`axis_size` is True"),
    ],
)
def test_error_bad_devices_or_axis_size(kwargs, message):
    with pytest.raises(eb.BatchError, match=message):
        eb.filter_pmap(lambda x: x, **kwargs)


def test_error_sizes_disagree_names_path():
    model = stacked(4)
    with pytest.raises(eb.BatchError, match=r"model\.bias") as info:
        eb.filter_pmap(apply)(
            Layer(model.weight, jnp.ones((5, 2), jnp.float32)), jnp.ones((4, 3))
        )
    assert isinstance(info.value, ValueError)


def test_error_shared_argument_mapped_suggests_in_axes():
    with pytest.raises(
        eb.BatchError, match=r"`x`.*in_axes=\(eqx\.if_array\(0\), None\)"
    ):
        eb.filter_pmap(apply)(stacked(4), jnp.ones(3))


def test_error_axis_size_disagrees():
    with pytest.raises(eb.BatchError, match=r"(?s)axis_size=3.*x\['a'\]"):
        eb.filter_pmap(lambda x: x, axis_size=3)({"a": jnp.ones(4)})


def test_error_in_axes_tuple_length():
    with pytest.raises(eb.BatchError, match="in_axes"):
        eb.filter_pmap(apply, in_axes=(0,))(stacked(4), jnp.ones(3))


def test_error_mapped_leaf_not_an_array():
    with pytest.raises(eb.BatchError, match=r"x\[1\]"):
        eb.filter_pmap(lambda x: x, in_axes=0)((jnp.ones(4), "text"))


def test_error_bad_donate():
    with pytest.raises(eb.BatchError, match="donate"):
        eb.filter_pmap(lambda x: x, donate="some")  # pyright: ignore[reportArgumentType]


# ----------------------------------------------------------------------------- shard


@pytest.mark.accelerator
def test_shard_places_members_and_jit_runs_spmd():
    model = stacked(8)
    placed = eb.shard(model)
    assert sharding_spec(placed.weight) == P("members")
    assert len(placed.weight.sharding.device_set) == jax.device_count()
    assert_trees_identical(placed, model)
    run = eqx.filter_jit(eb.filter_vmap(apply, in_axes=(eqx.if_array(0), None)))
    out = run(placed, jnp.ones(3))
    # Split as the members are (on one device, whatever its spec says).
    assert out.sharding.is_equivalent_to(placed.weight.sharding, out.ndim)
    assert tree_allclose(out, run(model, jnp.ones(3)))


def test_shard_axes_and_unmapped_and_static_leaves():
    tree = {"a": jnp.ones((2, 8)), "b": jnp.ones(3), "c": "name"}
    placed = eb.shard(tree, axes={"a": 1, "b": None, "c": None})
    assert sharding_spec(placed["a"]) == P(None, "members")
    assert placed["b"].sharding.is_fully_replicated
    assert len(placed["b"].sharding.device_set) == 4
    assert placed["c"] == "name"


def test_shard_with_user_mesh_and_collectives():
    # Explicit axes: JAX 0.9's default, and 0.8 warns when none is given.
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=explicit)
    x = jnp.arange(8.0)
    placed = eb.shard(x, mesh)
    assert placed.sharding.device_set == set(mesh.devices.flat)
    assert sharding_spec(placed) == P(("x", "y"))
    centre = eb.filter_vmap(lambda v: v - jax.lax.pmean(v, "i"), axis_name="i")
    out = jax.jit(centre)(placed)
    assert tree_allclose(out, x - 3.5)


def test_shard_error_uneven_says_how_to_pad():
    with pytest.raises(
        eb.BatchError, match=r"tree\.weight.*6 members.*pad to 8"
    ) as info:
        eb.shard(stacked(6))
    assert "tree.weight" in str(info.value)


def test_shard_error_member_counts_disagree():
    with pytest.raises(eb.BatchError, match=r"tree\['b'\]"):
        eb.shard({"a": jnp.ones(8), "b": jnp.ones((4, 8)), "c": jnp.ones(8)})


def test_shard_error_no_mapped_leaf():
    with pytest.raises(eb.BatchError, match="member axis"):
        eb.shard({"a": "text"})


_DONATED_TWICE = """
import jax, jax.numpy as jnp
import eqx_batch as eb
x = eb.shard(jnp.arange(8.0))
expected = 2 * jnp.arange(8.0)
add = eb.filter_pmap(lambda a, b: a + b, donate="all")
assert jnp.array_equal(add(x, x), expected)
y = eb.shard(jnp.arange(8.0))
compiled = add.lower(y, y).compile()
assert jnp.array_equal(compiled(y, y), expected)
print("ok")
"""


def test_an_array_passed_twice_is_donated_once():
    # Donating one buffer twice crashes XLA (a segfault on several CPU devices), so
    # the call runs in its own process; the devices are those of the suite.
    result = subprocess.run(
        [sys.executable, "-c", _DONATED_TWICE], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


class _Scale(eqx.Module):
    weight: jax.Array
    scale: Any = eqx.field(static=True)


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static:UserWarning")
@pytest.mark.parametrize("members", [jax.device_count(), 2 * jax.device_count()])
def test_error_static_field_holds_member_value(members):
    # One member per device runs `jax.shard_map`, more run `filter_vmap`: both name
    # the field, where Equinox's next use raises JAX's UnexpectedTracerError.
    def build(weight):
        return _Scale(weight, weight.sum())

    with pytest.raises(eb.BatchError, match=r"`out\.scale`: float32\[\]") as info:
        eb.filter_pmap(build)(jnp.ones((members, 3)))
    assert "Drop static=True" in str(info.value)
