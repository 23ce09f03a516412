"""stack, unstack, batch_size and concat."""

import functools as ft
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import (
    assert_members_identical,
    assert_trees_identical,
    raises,
    tree_allclose,
)
from hypothesis import given, settings

import eqx_batch as eb


FAST = settings(max_examples=25, deadline=None)


class Pair(NamedTuple):
    first: Any
    second: Any


class Block(eqx.Module):
    weight: Any
    scale: Any
    activation: Callable = eqx.field(static=True)
    name: str = eqx.field(static=True, default="block")


def _mlps(n: int, key=None, **kwargs) -> list[eqx.nn.MLP]:
    keys = jr.split(jr.key(0) if key is None else key, n)
    return [eqx.nn.MLP(4, 3, 5, 2, key=k, **kwargs) for k in keys]


# ------------------------------------------------------------------------------------
# Happy paths.


@pytest.mark.accelerator
def test_stack_mlps_and_back():
    members = _mlps(3)
    stacked = eb.stack(members)
    assert stacked.layers[0].weight.shape == (3, 5, 4)
    assert stacked.activation is members[0].activation
    assert eb.batch_size(stacked) == 3
    assert_members_identical(eb.unstack(stacked), members)


def test_unstack_filter_vmap_output():
    keys = jr.split(jr.key(1), 4)
    stacked = eqx.filter_vmap(lambda k: eqx.nn.MLP(2, 2, 8, 2, key=k))(keys)
    members = eb.unstack(stacked)
    assert len(members) == 4
    # Member 2 is row 2 of every array leaf, bit for bit; the MLP built alone with
    # its key agrees up to rounding (XLA may fuse the vmapped initialisation
    # differently, with FMA on some CPUs).
    row = jtu.tree_map(lambda x: x[2] if eqx.is_array(x) else x, stacked)
    assert_trees_identical(members[2], row)
    assert tree_allclose(members[2], eqx.nn.MLP(2, 2, 8, 2, key=keys[2]))
    assert_trees_identical(eb.stack(members), stacked)


def test_unstack_pmap_output():
    out = jax.pmap(lambda x: {"double": 2 * x, "square": x * x})(jnp.arange(4.0))
    members = eb.unstack(out)
    assert [float(m["double"]) for m in members] == [0.0, 2.0, 4.0, 6.0]
    assert [float(m["square"]) for m in members] == [0.0, 1.0, 4.0, 9.0]
    assert all(m["double"].shape == () for m in members)
    # Pieces of a leaf sharded over devices go to the default device, uncommitted.
    assert all(m["double"].devices() == {jax.devices()[0]} for m in members)
    assert not any(m["double"].committed for m in members)


def test_non_array_leaves_kept_once_and_given_to_every_member():
    members = [
        {"w": jnp.full(2, float(i)), "lr": 0.5, "tag": "x", "n": None} for i in range(3)
    ]
    stacked = eb.stack(members)
    assert stacked["lr"] == 0.5 and type(stacked["lr"]) is float
    assert stacked["tag"] == "x" and stacked["n"] is None
    back = eb.unstack(stacked)
    assert all(m["lr"] == 0.5 and m["tag"] == "x" for m in back)
    assert_members_identical(back, members)


def test_numpy_stays_numpy_and_jax_stays_jax():
    members = [
        {"np": np.full(3, i, np.int8), "jax": jnp.full(3, i, jnp.int8)}
        for i in range(2)
    ]
    stacked = eb.stack(members)
    assert type(stacked["np"]) is np.ndarray
    assert isinstance(stacked["jax"], jax.Array)
    assert_members_identical(eb.unstack(stacked), members)


def test_axes_int_and_none():
    shared = jnp.arange(3.0)
    members = [{"w": jnp.full((2, 3), float(i)), "shared": shared} for i in range(4)]
    stacked = eb.stack(members, axes={"w": 1, "shared": None})
    assert stacked["w"].shape == (2, 4, 3)
    assert stacked["shared"] is shared
    back = eb.unstack(stacked, axes={"w": 1, "shared": None})
    assert all(m["shared"] is shared for m in back)
    assert_members_identical(back, members)
    assert eb.batch_size(stacked, axes={"w": -2, "shared": None}) == 4


def test_concat():
    a = eb.stack(_mlps(2, jr.key(1)))
    b = eb.stack(_mlps(3, jr.key(2)))
    joined = eb.concat([a, b])
    assert eb.batch_size(joined) == 5
    assert_members_identical(eb.unstack(joined), eb.unstack(a) + eb.unstack(b))
    nested = {"w": jnp.zeros((2, 3)), "n": np.ones((3, 2))}
    joined = eb.concat([nested, nested], axes={"w": 0, "n": 1})
    assert joined["w"].shape == (4, 3) and joined["n"].shape == (3, 4)
    assert type(joined["n"]) is np.ndarray


def test_one_member_and_zero_size_leaves():
    members = [{"empty": jnp.zeros((0, 2)), "scalar": jnp.float32(3.0)}]
    stacked = eb.stack(members)
    assert stacked["empty"].shape == (1, 0, 2) and stacked["scalar"].shape == (1,)
    assert_members_identical(eb.unstack(stacked), members)


@pytest.mark.accelerator
def test_typed_and_legacy_keys():
    members = [{"key": jr.key(i), "legacy": jr.PRNGKey(i)} for i in range(3)]
    stacked = eb.stack(members)
    assert jnp.issubdtype(stacked["key"].dtype, jax.dtypes.prng_key)
    assert stacked["key"].shape == (3,) and stacked["legacy"].shape == (3, 2)
    assert_members_identical(eb.unstack(stacked), members)
    keys = jr.split(jr.key(5), 4)
    assert_trees_identical(eb.stack(eb.unstack(keys)), keys)
    assert_trees_identical(eb.index(keys, 2), keys[2])
    assert_trees_identical(eb.take(keys, [1, 2]), keys[1:3])


@pytest.mark.accelerator
def test_float64_under_x64():
    with jax.enable_x64(True):
        members = [jnp.array([i, -0.0, np.nan], dtype=jnp.float64) for i in range(3)]
        stacked = eb.stack(members)
        assert stacked.dtype == jnp.float64
        assert_members_identical(eb.unstack(stacked), members)


@pytest.mark.accelerator
def test_weak_type_round_trips():
    weak = jnp.full((2, 3), 1.5)
    assert weak.weak_type
    members = eb.unstack(weak)
    assert all(m.weak_type for m in members)
    assert eb.stack(members).weak_type
    assert_trees_identical(eb.stack(members), weak)
    assert eb.index(weak, 0).weak_type and eb.take(weak, [1]).weak_type


@pytest.mark.accelerator
def test_committed_device_is_kept():
    device = jax.devices()[-1]  # not the default device, where there are several
    stacked = jax.device_put(jnp.arange(6.0).reshape(3, 2), device)
    members = eb.unstack(stacked)
    assert all(m.devices() == {device} and m.committed for m in members)
    restacked = eb.stack(members)
    assert restacked.devices() == {device} and restacked.committed


@pytest.mark.accelerator
def test_inside_jit():
    stacked = eb.stack(_mlps(3))

    @eqx.filter_jit
    def roundtrip(tree, i, indices):
        return eb.stack(eb.unstack(tree)), eb.index(tree, i), eb.take(tree, indices)

    again, member, subset = roundtrip(stacked, 2, jnp.array([2, 0]))
    assert_trees_identical(again, stacked)
    assert_trees_identical(member, eb.index(stacked, 2))
    assert_trees_identical(subset, eb.take(stacked, [2, 0]))
    concatenated = eqx.filter_jit(lambda a, b: eb.concat([a, b]))(stacked, stacked)
    assert_trees_identical(concatenated, eb.concat([stacked, stacked]))


def test_result_of_stack_is_a_fresh_copy():
    host = np.zeros(3, np.float32)
    stacked = eb.stack([host, host])
    host[0] = 1.0
    assert stacked[0, 0] == 0.0
    members = eb.unstack(stacked)
    stacked[0, 1] = 5.0
    assert members[0][1] == 0.0


# ------------------------------------------------------------------------------------
# Compilations do not grow with the number of members.


class _CompileCounter:
    def __init__(self):
        self.count = 0

    def __call__(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def _compiles(fn: Callable[[], Any]) -> int:
    counter = _CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    return counter.count


@pytest.mark.parametrize("placement", ["default", "committed"])
def test_compilations_do_not_grow_with_members(placement):
    def fresh(n: int) -> Any:
        # A width unused elsewhere, so no earlier test has compiled for these shapes.
        tree = {
            "w": jnp.ones((n, 17, 3)),
            "b": jnp.ones((n, 17), jnp.int32),
            "k": jr.split(jr.key(0), n),
        }
        if placement == "committed":
            tree = jax.device_put(tree, jax.devices()[1])
        return jax.block_until_ready(tree)

    def count(tree: Any) -> tuple[int, ...]:
        n = eb.batch_size(tree)
        members = eb.unstack(tree)
        return (
            _compiles(lambda: eb.unstack(tree)),
            _compiles(lambda: eb.stack(members)),
            _compiles(lambda: [eb.index(tree, i) for i in range(n)]),
            _compiles(lambda: eb.take(tree, [n - 1, 0])),
            _compiles(lambda: eb.concat([tree, tree])),
        )

    # The first unstack compiles a rows program per group of row shapes and dtypes
    # (at most one per shape), whatever the member count; stacking, indexing and
    # concatenating CPU arrays compile nothing.
    first = fresh(40)
    assert _compiles(lambda: eb.unstack(first)) <= 3
    assert count(first) == (0, 0, 0, 0, 0)
    assert count(fresh(57)) == (0, 0, 0, 0, 0)
    assert count(fresh(9)) == (0, 0, 0, 0, 0)


def test_unstack_compiles_per_row_shape_not_per_tree():
    # Shapes unused elsewhere, so no earlier test has compiled for them.
    def wide(leaves: int, members: int) -> list[jax.Array]:
        shapes = [(members, 19), (members, 2, 19)]
        return jax.block_until_ready(
            [jnp.full(shapes[i % 2], float(i), jnp.float32) for i in range(leaves)]
        )

    tree = wide(50, 5)
    assert _compiles(lambda: eb.unstack(tree)) <= 2
    # Another tree of those row shapes, with other counts of leaves and members,
    # compiles nothing: the programs are per row shape, not per tree.
    other = wide(77, 23)
    members: list[Any] = []
    assert _compiles(lambda: members.extend(eb.unstack(other))) == 0
    for i, member in enumerate(members):
        assert_trees_identical(member, [leaf[i] for leaf in other])
        assert all(
            piece.devices() == leaf.devices()
            for piece, leaf in zip(member, other, strict=True)
        )


def test_unstack_compiles_one_program_for_several_row_shapes():
    # An MLP-like tree of five row shapes (unused elsewhere), one of them twice as
    # many rows as the others: one rows program for all of them, not one per shape.
    shapes = [(7, 5), (7,), (7, 7), (5, 7), (7,), (5,)]
    tree = jax.block_until_ready(
        [jnp.full((11, *shape), i, jnp.float32) + 0.5 for i, shape in enumerate(shapes)]
    )
    assert _compiles(lambda: eb.unstack(tree)) == 1
    # The same shapes in the same proportions, more members: nothing compiled.
    more = jax.block_until_ready([jnp.ones((30, *shape)) for shape in shapes])
    assert _compiles(lambda: eb.unstack(more)) == 0


def test_unstacked_pieces_own_their_memory():
    # The rows program keeps its donated inputs as its outputs; those inputs are
    # copies of the host rows, never the stacked array's own memory.
    stacked = jax.block_until_ready(jnp.arange(40.0).reshape(20, 2) + 0.5)
    start = stacked.unsafe_buffer_pointer()
    members = eb.unstack(stacked)
    for i, piece in enumerate(members):
        assert not start <= piece.unsafe_buffer_pointer() < start + stacked.nbytes
        assert_trees_identical(piece, stacked[i])
    del stacked
    assert float(members[19][1]) == 39.5


def test_weak_leaves_compile_per_shape_not_per_call():
    weak = jax.block_until_ready(jnp.full((5, 23), 2.0))
    members = eb.unstack(weak)
    eb.stack(members)
    assert _compiles(lambda: eb.unstack(weak)) == 0
    assert _compiles(lambda: eb.stack(members)) == 0
    assert _compiles(lambda: [eb.index(weak, i) for i in range(5)]) == 0


# ------------------------------------------------------------------------------------
# Lossless both ways, over generated pytrees.

DTYPES = [
    np.float32,
    np.float16,
    jnp.bfloat16,
    np.int8,
    np.uint32,
    np.bool_,
    np.complex64,
]


def _raw_array(rng: np.random.Generator, shape: tuple, dtype: Any) -> np.ndarray:
    """Arbitrary bits: NaN payloads, -0.0, infinities and subnormals all occur."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    raw = rng.integers(0, 256, math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)

array_leaf = st.tuples(
    st.just("array"),
    st.sampled_from(["numpy", "jax", "weak", "key", "legacy_key"]),
    st.sampled_from(DTYPES),
    shapes,
)

static_leaf = st.tuples(
    st.just("static"),
    st.sampled_from([1.5, -0.0, 3, True, "name", None, jax.nn.relu, (1, "a")]),
)


def _container(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
        st.tuples(children, children).map(lambda p: Pair(*p)),
        st.tuples(children, children).map(lambda p: ("block", p)),
    )


tree_specs = st.recursive(st.one_of(array_leaf, static_leaf), _container, max_leaves=6)


def _is_spec_leaf(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) > 0 and x[0] in ("array", "static")


def _build(spec: Any, rng: np.random.Generator, batch: tuple = ()) -> Any:
    """A pytree following `spec`, with fresh array values and `batch` leading axes."""
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "block":
        first, second = spec[1]
        return Block(_build(first, rng, batch), _build(second, rng, batch), jax.nn.relu)
    if _is_spec_leaf(spec):
        if spec[0] == "static":
            return spec[1]
        leaf_spec: Any = spec  # ("array", kind, dtype, shape)
        _, kind, dtype, shape = leaf_spec
        if kind == "key":
            data = _raw_array(rng, batch + shape + (2,), np.uint32)
            return jr.wrap_key_data(jnp.asarray(data), impl="threefry2x32")
        if kind == "legacy_key":
            return jnp.asarray(_raw_array(rng, batch + shape + (2,), np.uint32))
        data = _raw_array(rng, batch + shape, dtype)
        if kind == "numpy":
            return data
        if kind == "weak":
            # Only Python scalars make weak-typed arrays; the dtype is float32.
            return jnp.full(batch + shape, float(rng.standard_normal()))
        return jnp.asarray(data)
    if isinstance(spec, Pair):
        return Pair(_build(spec.first, rng, batch), _build(spec.second, rng, batch))
    if isinstance(spec, dict):
        return {k: _build(v, rng, batch) for k, v in spec.items()}
    children = [_build(c, rng, batch) for c in spec]
    return tuple(children) if isinstance(spec, tuple) else children


def _has_mapped_leaf(tree: Any) -> bool:
    return any(eqx.is_array(x) for x in jtu.tree_leaves(tree))


@FAST
@given(spec=tree_specs, n=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_unstack_of_stack_is_identity(spec, n, seed):
    rng = np.random.default_rng(seed)
    members = [_build(spec, rng) for _ in range(n)]
    stacked = eb.stack(members)
    if _has_mapped_leaf(stacked):
        assert eb.batch_size(stacked) == n
        assert_members_identical(eb.unstack(stacked), members)
        for i in (0, n - 1, -1):
            assert_trees_identical(eb.index(stacked, i), members[i])
    else:
        assert_trees_identical(stacked, members[0])


@FAST
@given(spec=tree_specs, n=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_stack_of_unstack_is_identity(spec, n, seed):
    stacked = _build(spec, np.random.default_rng(seed), batch=(n,))
    if not _has_mapped_leaf(stacked):
        with pytest.raises(eb.BatchError, match="no array leaf"):
            eb.unstack(stacked)
        return
    members = eb.unstack(stacked)
    assert len(members) == n
    assert_trees_identical(eb.stack(members), stacked)
    assert_trees_identical(eb.take(stacked, list(range(n))), stacked)
    assert_trees_identical(eb.concat([stacked]), stacked)
    halves = [eb.take(stacked, range(n // 2)), eb.take(stacked, range(n // 2, n))]
    assert_trees_identical(eb.concat(halves), stacked)


@FAST
@given(spec=tree_specs, n=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_unstack_under_jit_matches_eager(spec, n, seed):
    stacked = _build(spec, np.random.default_rng(seed), batch=(n,))
    if not _has_mapped_leaf(stacked):
        return
    # Under jit every array (NumPy too) becomes a JAX array.
    as_jax = jtu.tree_map(lambda x: jnp.asarray(x) if eqx.is_array(x) else x, stacked)
    eager = eb.unstack(as_jax)
    traced = eqx.filter_jit(eb.unstack)(as_jax)
    assert_members_identical(traced, eager)


# ------------------------------------------------------------------------------------
# Errors: each is a BatchError naming the leaf by argument name and path.


def test_stack_axis_out_of_range():
    a = {"w": jnp.zeros(2)}
    raises("out of range", lambda: eb.stack([a, a], axes=2), "trees[0]['w']")


def test_member_axis_sizes_disagree():
    tree = {
        "a": jnp.zeros(3),
        "b": jnp.zeros((4, 2)),
        "c": jnp.zeros(3),
        "d": np.zeros(5),
    }
    for fn in (
        eb.unstack,
        eb.batch_size,
        lambda t: eb.index(t, 0),
        lambda t: eb.take(t, [0]),
    ):
        message = raises("disagree", lambda fn=fn: fn(tree), "tree['b']", "tree['d']")
        assert "4" in message and "5" in message and "tree['a']" in message
    bad = {"w": jnp.zeros((2, 3)), "v": jnp.zeros((3, 3))}
    raises(
        "disagree",
        lambda: eb.concat([{"w": jnp.zeros((2, 3)), "v": jnp.zeros((2, 3))}, bad]),
        "trees[1]['v']",
    )


def test_zero_d_leaf():
    tree = {"w": jnp.zeros(3), "t": jnp.float32(1.0)}
    for fn in (
        eb.unstack,
        eb.batch_size,
        lambda t: eb.index(t, 0),
        lambda t: eb.take(t, [0]),
    ):
        raises("0-d", lambda fn=fn: fn(tree), "tree['t']", "None")
    raises("0-d", lambda: eb.concat([tree, tree]), "trees[0]['t']")


def test_no_array_leaf():
    for fn in (
        eb.unstack,
        eb.batch_size,
        lambda t: eb.index(t, 0),
        lambda t: eb.take(t, [0]),
    ):
        raises("no array leaf", lambda fn=fn: fn({"a": 1.0, "b": "x"}))
    raises("no array leaf", lambda: eb.unstack({"w": jnp.zeros(3)}, axes=None))


@pytest.mark.parametrize(
    "trees, words",
    [
        ({"w": jnp.ones(2)}, "a dict with keys ['w']"),
        (jnp.ones((3, 2)), "an array"),
        ("ab", "a str"),
        (Pair(jnp.ones(2), jnp.ones(2)), "list(trees)"),
        (eqx.nn.Linear(2, 2, key=jr.key(0)), "a Linear"),
        ({jnp.ones(2).tobytes()}, "a set"),
    ],
)
def test_stack_takes_a_sequence_of_members(trees, words):
    for fn, verb in ((eb.stack, "stack"), (eb.concat, "concat")):
        message = raises(f"{verb} takes a sequence", lambda fn=fn: fn(trees))
        assert words in message and "[trees]" in message


def test_stack_accepts_tuples_and_iterators():
    members = [{"w": jnp.full(2, float(i))} for i in range(3)]
    expected = eb.stack(members)
    assert_trees_identical(eb.stack(tuple(members)), expected)
    assert_trees_identical(eb.stack(iter(members)), expected)
    assert_trees_identical(eb.stack(m for m in members), expected)


def test_bad_axis_spec():
    raises("axis spec", lambda: eb.stack([{"w": jnp.zeros(2)}], axes="x"))
    raises("prefix", lambda: eb.unstack({"w": jnp.zeros(2)}, axes={"v": 0}))


@pytest.mark.parametrize(
    "call",
    [
        ft.partial(eb.stack, [{"w": jnp.zeros(2)}, {"w": 1.0}], axes=0),
        ft.partial(eb.unstack, {"w": 1.0}, axes=0),
    ],
)
def test_non_array_with_member_axis(call):
    raises("not an array", call, "['w']")


# ------------------------------------------------------------------------------------
# Grids: `ndim` member axes.


def _grid_of_mlps(m: int, n: int) -> tuple[eqx.nn.MLP, jax.Array]:
    """A grid of MLPs made by two nested `eqx.filter_vmap`s, and their keys."""
    keys = jr.split(jr.key(3), (m, n))
    make = ft.partial(eqx.nn.MLP, 4, 3, 5, 2)
    grid = eqx.filter_vmap(eqx.filter_vmap(lambda k: make(key=k)))(keys)
    return grid, keys


def test_grid_from_double_filter_vmap():
    grid, keys = _grid_of_mlps(3, 5)
    assert eb.batch_size(grid, ndim=2) == (3, 5)
    rows = eb.unstack(grid, ndim=2)
    assert type(rows) is list and len(rows) == 3
    assert all(type(row) is list and len(row) == 5 for row in rows)
    # Each member is the model that its own key makes.
    expected = [[eqx.nn.MLP(4, 3, 5, 2, key=k) for k in row] for row in keys]
    for row, expected_row in zip(rows, expected, strict=True):
        assert_members_identical(row, expected_row)
    assert_trees_identical(eb.stack(rows, ndim=2), grid)
    # ndim=1 still sees the rows: each a stacked model of 5 members.
    assert eb.batch_size(grid) == 3
    assert_trees_identical(eb.unstack(grid)[1], eb.stack(rows[1]))


def test_grid_of_three_axes_and_tuple_rows():
    tree = {"w": jnp.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5), "name": "x"}
    assert eb.batch_size(tree, ndim=3) == (2, 3, 4)
    cubes = eb.unstack(tree, ndim=3)
    assert [len(cubes), len(cubes[0]), len(cubes[0][0])] == [2, 3, 4]
    assert jnp.array_equal(cubes[1][2][3]["w"], tree["w"][1, 2, 3])
    assert cubes[1][2][3]["name"] == "x"
    as_tuples = tuple(tuple(tuple(plane) for plane in cube) for cube in cubes)
    assert_trees_identical(eb.stack(as_tuples, ndim=3), tree)
    assert eb.batch_size(tree, ndim=1) == 2


def test_grid_with_axes():
    # The spec picks the mapped leaves and the first member axis; the rest follow.
    tree = {"w": jnp.arange(7 * 2 * 3.0).reshape(7, 2, 3), "grid": np.arange(4.0)}
    axes = {"w": 1, "grid": None}
    assert eb.batch_size(tree, axes=axes, ndim=2) == (2, 3)
    rows = eb.unstack(tree, axes=axes, ndim=2)
    assert jnp.array_equal(rows[1][2]["w"], tree["w"][:, 1, 2])
    assert all(member["grid"] is tree["grid"] for row in rows for member in row)
    assert_trees_identical(eb.stack(rows, axes=axes, ndim=2), tree)
    # A negative axis counts from the end: -2 puts the two member axes last.
    last = eb.stack(rows, axes={"w": -2, "grid": None}, ndim=2)
    assert last["w"].shape == (7, 2, 3)
    assert jnp.array_equal(last["w"], tree["w"])
    members = [[jnp.full((7,), float(3 * r + c)) for c in range(3)] for r in range(2)]
    trailing = eb.stack(members, axes=-2, ndim=2)
    assert trailing.shape == (7, 2, 3)
    assert float(trailing[0, 1, 2]) == 5.0
    assert eb.batch_size(trailing, axes=-2, ndim=2) == (2, 3)


def test_grid_with_empty_rows():
    rows = eb.unstack({"w": jnp.zeros((3, 0, 2))}, ndim=2)
    assert rows == [[], [], []]
    assert eb.unstack({"w": jnp.zeros((0, 4, 2))}, ndim=2) == []
    assert eb.batch_size({"w": np.zeros((3, 0))}, ndim=2) == (3, 0)


def test_grid_under_jit_matches_eager():
    grid, _ = _grid_of_mlps(2, 3)
    unstack2 = ft.partial(eb.unstack, ndim=2)
    traced = eqx.filter_jit(unstack2)(grid)
    eager = unstack2(grid)
    for row, eager_row in zip(traced, eager, strict=True):
        assert_members_identical(row, eager_row)
    restacked = eqx.filter_jit(ft.partial(eb.stack, ndim=2))(eager)
    assert_trees_identical(restacked, grid)


def test_nested_filter_vmap_maps_a_grid():
    grid, _ = _grid_of_mlps(3, 4)
    x = jnp.linspace(-1.0, 1.0, 4)
    over_members = eb.filter_vmap(lambda m, x: m(x), in_axes=(eqx.if_array(0), None))
    over_grid = eb.filter_vmap(over_members, in_axes=(eqx.if_array(0), None))
    out = over_grid(grid, x)
    assert out.shape == (3, 4, 3)
    loop = [[member(x) for member in row] for row in eb.unstack(grid, ndim=2)]
    assert np.allclose(out, np.array(loop), rtol=1e-6, atol=1e-6)


@FAST
@given(
    spec=tree_specs,
    grid=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    seed=st.integers(0, 2**32 - 1),
)
def test_stack_of_unstack_is_identity_for_grids(spec, grid, seed):
    stacked = _build(spec, np.random.default_rng(seed), batch=grid)
    if not _has_mapped_leaf(stacked):
        with pytest.raises(eb.BatchError, match="no array leaf"):
            eb.unstack(stacked, ndim=2)
        return
    assert eb.batch_size(stacked, ndim=2) == grid
    rows = eb.unstack(stacked, ndim=2)
    assert [len(row) for row in rows] == [grid[1]] * grid[0]
    assert_trees_identical(eb.stack(rows, ndim=2), stacked)
    # Row r of the grid is member r of the outer axis.
    for r, row in enumerate(rows):
        assert_members_identical(row, eb.unstack(eb.index(stacked, r)))


@FAST
@given(
    spec=tree_specs,
    grid=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    seed=st.integers(0, 2**32 - 1),
)
def test_unstack_of_stack_is_identity_for_grids(spec, grid, seed):
    rng = np.random.default_rng(seed)
    rows = [[_build(spec, rng) for _ in range(grid[1])] for _ in range(grid[0])]
    stacked = eb.stack(rows, ndim=2)
    if not _has_mapped_leaf(stacked):
        assert_trees_identical(stacked, rows[0][0])
        return
    again = eb.unstack(stacked, ndim=2)
    assert len(again) == grid[0]
    for row, row_again in zip(rows, again, strict=True):
        assert_members_identical(row_again, row)


@pytest.mark.parametrize("ndim", [0, -1, True, np.bool_(True), 1.5, "2", None])
def test_bad_ndim(ndim):
    tree = {"w": jnp.zeros((2, 3))}
    for call in (eb.stack, eb.unstack, eb.batch_size):
        arg = [tree] if call is eb.stack else tree
        raises("`ndim`", lambda: call(arg, ndim=ndim))  # noqa: B023


@pytest.mark.parametrize("one, two", [(1, 2), (np.int64(1), np.int64(2))])
def test_ndim_takes_numpy_integers(one, two):
    tree = {"w": jnp.arange(6.0).reshape(2, 3)}
    assert eb.batch_size(tree, ndim=two) == (2, 3)
    assert len(eb.unstack(tree, ndim=two)) == 2
    assert_trees_identical(eb.stack([tree, tree], ndim=one), eb.stack([tree, tree]))


def test_grid_rows_of_different_lengths():
    row = [{"w": jnp.zeros(2)}] * 4
    message = raises(
        "to one length",
        lambda: eb.stack([row, row[:3]], ndim=2),
        "`trees[1]` has 3 members where `trees[0]` has 4",
    )
    assert "pad or trim" in message
    cube = [[row, row], [row, row[:3]]]
    raises("has 3 members where", lambda: eb.stack(cube, ndim=3), "`trees[1][1]`", "4")
    raises(
        "to one shape",
        lambda: eb.stack([[row, row], [row]], ndim=3),
        "`trees[1]` has shape (1, 4) where `trees[0]` has shape (2, 4)",
    )


def test_grid_rows_must_be_sequences():
    member = {"w": jnp.zeros(2)}
    raises(
        "must be a list or tuple",
        lambda: eb.stack([[member], member], ndim=2),
        "`trees[1]`",
    )
    raises("must be a list or tuple", lambda: eb.stack([member], ndim=2), "`trees[0]`")
    raises("sequence of members", lambda: eb.stack(member, ndim=2), "`trees`")
    raises("empty", lambda: eb.stack([[], []], ndim=2), "`trees`")


def test_grid_leaf_with_too_few_axes():
    tree = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(2)}
    message = raises("too few axes", lambda: eb.unstack(tree, ndim=2), "`tree['b']`")
    assert "(2,)" in message and "axis spec None" in message
    raises(
        "too few axes",
        lambda: eb.batch_size(tree, axes={"w": 1, "b": None}, ndim=2),
        "`tree['w']`",
    )
    raises("0-d", lambda: eb.unstack({"w": jnp.zeros(())}, ndim=2), "`tree['w']`")


def test_grid_sizes_disagree():
    tree = {"a": jnp.zeros((2, 3)), "b": jnp.zeros((2, 4)), "c": jnp.zeros((2, 3, 1))}
    message = raises("member axis 1 of 2", lambda: eb.unstack(tree, ndim=2))
    assert "`tree['b']`: 4" in message and "`tree['a']`: 3" in message


def test_grid_stack_axis_out_of_range():
    rows = [[jnp.zeros(2)] * 3] * 2
    raises("out of range", lambda: eb.stack(rows, axes=-1, ndim=2), "`trees[0][0]`")
    raises("out of range", lambda: eb.stack(rows, axes=2, ndim=2), "`trees[0][0]`")
