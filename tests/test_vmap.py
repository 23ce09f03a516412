import functools as ft
import inspect
import math
import re
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

import eqx_batch as eb
from eqx_batch._transforms._bind import bind_arguments
from eqx_batch._transforms._sizes import check_mapped_sizes


def _arange(*shape: int) -> jax.Array:
    return jnp.arange(float(np.prod(shape)), dtype=jnp.float32).reshape(shape) / 7


class Layer(eqx.Module):
    weight: jax.Array
    bias: jax.Array


class Model(eqx.Module):
    layers: list[Layer]
    activation: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = self.activation(layer.weight @ x + layer.bias)
        return x


def _model(members: int) -> Model:
    return Model(
        [
            Layer(_arange(members, 3, 2), _arange(members, 3)),
            Layer(_arange(members, 2, 3), _arange(members, 2)),
        ],
        jax.nn.tanh,
    )


# --- Same results as Equinox on what Equinox accepts ------------------------------


def _affine(x, w, b):
    return x @ w + b


def _tuple_out(x, y):
    return x * y, jnp.sum(y), "label"


def _centre(x):
    return x - jax.lax.pmean(x, "members")


def _model_call(model, x):
    return model(x)


def _nested_in(pair, scale):
    a, b = pair
    return a * scale + b


# (name, fun, args, filter_vmap keyword arguments)
EQUINOX_CASES = [
    ("default", _affine, (_arange(4, 3), _arange(4, 3, 2), _arange(4, 2)), {}),
    (
        "tuple in_axes",
        _affine,
        (_arange(4, 3), _arange(3, 2), _arange(2)),
        {"in_axes": (0, None, None)},
    ),
    (
        "negative axes",
        _affine,
        (_arange(3, 4), _arange(3, 2), _arange(2)),
        {"in_axes": (-1, None, None)},
    ),
    (
        "axis 1",
        _affine,
        (_arange(2, 5), _arange(2, 5, 3), _arange(3)),
        {"in_axes": (1, 1, None)},
    ),
    (
        "callable in_axes",
        _affine,
        (_arange(3, 5), _arange(3, 2, 5), _arange(2, 5)),
        {"in_axes": eqx.if_array(-1)},
    ),
    (
        "pytree prefix",
        _nested_in,
        ((_arange(4, 2), _arange(2, 4)), 2.0),
        {"in_axes": ((0, 1), None)},
    ),
    (
        "dict in_axes",
        _affine,
        (_arange(4, 3), _arange(3, 2), _arange(4, 2)),
        {"in_axes": {"w": None}},
    ),
    (
        "out_axes 1",
        _affine,
        (_arange(4, 3), _arange(3, 2), _arange(2)),
        {"in_axes": (0, None, None), "out_axes": 1},
    ),
    (
        "out_axes -1",
        _affine,
        (_arange(4, 3), _arange(3, 2), _arange(2)),
        {"in_axes": (0, None, None), "out_axes": -1},
    ),
    (
        "unmapped and non-array outputs",
        _tuple_out,
        (_arange(3, 2), _arange(2)),
        {"in_axes": (0, None), "out_axes": (0, None, None)},
    ),
    ("non-array output leaf", _tuple_out, (_arange(3, 2), _arange(3, 2)), {}),
    ("axis_name", _centre, (_arange(5, 2),), {"axis_name": "members"}),
    (
        "axis_size, nothing mapped",
        lambda c: jnp.full(2, c),
        (1.5,),
        {"axis_size": 3},
    ),
    ("nothing mapped, non-array output", lambda c: (c, "x"), (1.5,), {}),
    (
        "module argument",
        _model_call,
        (_model(4), _arange(2)),
        {"in_axes": (eqx.if_array(0), None)},
    ),
    ("module and data mapped", _model_call, (_model(4), _arange(4, 2)), {}),
    ("module as fun", _model(1).layers[0].__class__, (_arange(3, 2), _arange(3)), {}),
    # Python scalars are JAX values: a member axis broadcasts them, one per member.
    (
        "python scalar output, mapped",
        lambda c: c,
        (1,),
        {"out_axes": 0, "axis_size": 5},
    ),
    (
        "python scalars beside arrays",
        lambda x: (x, 2.5, True, 1j),
        (_arange(3, 2),),
        {"out_axes": 0},
    ),
]


@pytest.mark.parametrize(
    "fun, args, kwargs",
    [case[1:] for case in EQUINOX_CASES],
    ids=[case[0] for case in EQUINOX_CASES],
)
def test_same_as_equinox(fun, args, kwargs):
    ours = eb.filter_vmap(fun, **kwargs)(*args)
    theirs = eqx.filter_vmap(fun, **kwargs)(*args)
    assert_trees_identical(ours, theirs)
    jit_ours = eqx.filter_jit(eb.filter_vmap(fun, **kwargs))(*args)
    jit_theirs = eqx.filter_jit(eqx.filter_vmap(fun, **kwargs))(*args)
    assert_trees_identical(jit_ours, jit_theirs)


@pytest.mark.parametrize(
    "fun, args, kwargs",
    [case[1:] for case in EQUINOX_CASES],
    ids=[case[0] for case in EQUINOX_CASES],
)
def test_same_program_as_equinox(fun, args, kwargs):
    # The checks run while tracing and leave nothing behind: the compiled program is
    # Equinox's, so under jit there is no per-call cost.
    ours = eqx.filter_make_jaxpr(eb.filter_vmap(fun, **kwargs))(*args)[0]
    theirs = eqx.filter_make_jaxpr(eqx.filter_vmap(fun, **kwargs))(*args)[0]
    assert str(ours) == str(theirs)


def _three(a, b, c):
    return {"sum": a[..., :1] * b[..., :1] + c[..., :1], "b": b}


@settings(max_examples=25, deadline=None)
@given(
    members=st.sampled_from([1, 3]),
    specs=st.lists(
        st.sampled_from([0, 1, -1, None, "if_array"]), min_size=3, max_size=3
    ),
    out_axis=st.sampled_from([0, 1, -1, None]),
    as_dict=st.booleans(),
)
def test_same_as_equinox_property(members, specs, out_axis, as_dict):
    # Whatever each argument's spec, both map the same leaves the same way.
    specs = [eqx.if_array(1) if spec == "if_array" else spec for spec in specs]
    args = []
    for spec in specs:
        shape = [2, 3]
        if spec is not None:
            axis = spec.axis if isinstance(spec, eqx.if_array) else spec
            shape.insert(axis % 3 if axis < 0 else axis, members)
        args.append(_arange(*shape))
    in_axes = dict(zip("abc", specs, strict=True)) if as_dict else tuple(specs)
    out_axes = {"sum": eqx.if_array(0), "b": out_axis}
    if out_axis is None and specs[1] is not None:
        out_axes["b"] = 0
    if all(spec is None for spec in specs):
        kwargs = {"in_axes": in_axes, "out_axes": out_axes, "axis_size": members}
    else:
        kwargs = {"in_axes": in_axes, "out_axes": out_axes}
    ours = eb.filter_vmap(_three, **kwargs)(*args)
    theirs = eqx.filter_vmap(_three, **kwargs)(*args)
    assert_trees_identical(ours, theirs)


def test_decorator_forms():
    @eb.filter_vmap
    def bare(x, y):
        return x * y

    @eb.filter_vmap(in_axes=(0, None))
    def with_args(x, y):
        return x * y

    x, y = _arange(3, 2), _arange(2)
    assert_trees_identical(bare(x, x), x * x)
    assert_trees_identical(with_args(x, y), x * y[None])
    assert bare.__name__ == "bare"
    assert list(inspect.signature(bare).parameters) == ["x", "y"]


def test_methods_and_bound_methods():
    class Scaled(eqx.Module):
        scale: jax.Array

        @eb.filter_vmap
        def apply(self, x):
            return self.scale * x

        @eqx.filter_vmap
        def apply_eqx(self, x):
            return self.scale * x

        def plain(self, x):
            return self.scale * x

    module = Scaled(_arange(3))
    x = _arange(3, 2)
    assert_trees_identical(module.apply(x), module.apply_eqx(x))
    # A bound method as `fun`: `self` is closed over, not mapped.
    single = Scaled(jnp.array(2.0))
    assert_trees_identical(
        eb.filter_vmap(single.plain)(x), eqx.filter_vmap(single.plain)(x)
    )
    # Errors name `self` like any other argument.
    named = r"(?s)`self\.scale`: size 5.*\n  `x`: size 3.*argument `self` shared"
    with pytest.raises(eb.BatchError, match=named):
        Scaled(_arange(5)).apply(x)


@pytest.mark.accelerator
def test_nested():
    x = _arange(2, 3, 4)
    ours = eb.filter_vmap(eb.filter_vmap(jnp.sum))(x)
    theirs = eqx.filter_vmap(eqx.filter_vmap(jnp.sum))(x)
    assert_trees_identical(ours, theirs)


@pytest.mark.accelerator
def test_filter_grad():
    def loss(model, x):
        return jnp.sum(
            eb.filter_vmap(_model_call, in_axes=(eqx.if_array(0), None))(model, x)
        )

    def loss_eqx(model, x):
        return jnp.sum(
            eqx.filter_vmap(_model_call, in_axes=(eqx.if_array(0), None))(model, x)
        )

    model, x = _model(3), _arange(2)
    assert_trees_identical(
        eqx.filter_grad(loss)(model, x), eqx.filter_grad(loss_eqx)(model, x)
    )


def test_inside_filter_pmap():
    def inner(x, y):
        return jnp.sin(x) * y

    x, y = _arange(4, 3, 2), _arange(2)
    ours = eb.filter_pmap(lambda x: eb.filter_vmap(inner, in_axes=(0, None))(x, y))(x)
    theirs = eqx.filter_pmap(lambda x: eqx.filter_vmap(inner, in_axes=(0, None))(x, y))(
        x
    )
    assert tree_allclose(ours, theirs)


# --- Keyword arguments --------------------------------------------------------------


def _noisy(x, scale, *, key):
    return x * scale + jr.normal(key, x.shape)


def test_keyword_arguments_default_mapped(getkey):
    keys = jr.split(getkey(), 4)
    x = _arange(4, 3)
    ours = eb.filter_vmap(_noisy, in_axes=(0, None))(x, 2.0, key=keys)
    expected = eqx.filter_vmap(
        lambda x, scale, key: _noisy(x, scale, key=key), in_axes=(0, None, 0)
    )(x, 2.0, keys)
    assert_trees_identical(ours, expected)


def test_keyword_arguments_dict(getkey):
    key = getkey()
    x = _arange(4, 3)
    ours = eb.filter_vmap(_noisy, in_axes={"key": None})(x, scale=_arange(4), key=key)
    expected = jnp.stack([_noisy(x[i], _arange(4)[i], key=key) for i in range(4)])
    assert tree_allclose(ours, expected)


def test_keyword_arguments_single_spec():
    def f(x, *, y):
        return x + y

    x = _arange(3, 4)
    # A single spec applies to keyword arguments too.
    assert_trees_identical(eb.filter_vmap(f, in_axes=1)(x, y=x), (x + x).T)
    assert_trees_identical(
        eb.filter_vmap(f, in_axes=None, axis_size=2)(x, y=x), jnp.stack([x + x] * 2)
    )


def test_var_positional_and_var_keyword():
    def f(x, *rest, **extra):
        return x + sum(rest) + sum(extra.values())

    x = _arange(3, 2)
    out = eb.filter_vmap(f, in_axes={"rest": None, "c": None})(
        x, x[0], x[1], c=x[2], d=x
    )
    assert tree_allclose(out, x + x[None, 0] + x[None, 1] + x[None, 2] + x)
    arguments, axes = bind_arguments(f, (0, None, 1), (x, x, x), {"c": x})
    assert list(arguments) == ["x", "rest[0]", "rest[1]", "c"]
    assert axes == {"x": 0, "rest[0]": None, "rest[1]": 1, "c": eqx.if_array(0)}
    with pytest.raises(eb.BatchError, match=r"`rest\[1\]`"):
        eb.filter_vmap(f)(x, x, x[:2])


def test_dict_naming_a_parameter_left_at_its_default_is_refused():
    def f(x, key=None):
        return x if key is None else x + 1

    x = _arange(3)
    # As Equinox: whether the default would be mapped is ambiguous.
    with pytest.raises(eb.BatchError, match=r"`key`, which this call to .* not pass"):
        eb.filter_vmap(f, in_axes={"key": None})(x)
    with pytest.raises(ValueError):
        eqx.filter_vmap(f, in_axes={"key": None})(x)
    # Passed, by position or keyword, it may be named.
    assert_trees_identical(eb.filter_vmap(f, in_axes={"key": None})(x, None), x)
    assert_trees_identical(eb.filter_vmap(f, in_axes={"key": None})(x, key=1.0), x + 1)
    # A `*args` name with no entries in this call is refused the same way.
    with pytest.raises(eb.BatchError, match="`rest`"):
        eb.filter_vmap(lambda x, *rest: x, in_axes={"rest": None})(x)


def test_python_scalar_output_chunked_is_broadcast():
    ours = eb.filter_vmap(lambda x: (x, 1), chunk_size=2)(_arange(5))
    assert_trees_identical(ours, eqx.filter_vmap(lambda x: (x, 1))(_arange(5)))


@pytest.mark.parametrize("axis_size", [3, np.int64(3), 0])
def test_axis_size_accepts_what_equinox_accepts(axis_size):
    fun = lambda x: 2 * x  # noqa: E731
    ours = eb.filter_vmap(fun, in_axes=None, axis_size=axis_size)(_arange(2))
    theirs = eqx.filter_vmap(fun, in_axes=None, axis_size=axis_size)(_arange(2))
    assert_trees_identical(ours, theirs)


def test_call_that_does_not_fit_signature():
    with pytest.raises(TypeError, match="missing a required argument"):
        eb.filter_vmap(_affine)(_arange(3, 2))


# --- Errors -------------------------------------------------------------------------


def _message(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "_dynamic_args" not in message
    return message


def test_error_affine_suggests_in_axes():
    x, w, b = _arange(8, 3), _arange(3, 2), _arange(2)
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(_affine)(x, w, b)
    message = _message(excinfo)
    # Each argument agrees with itself, so no size is taken as the number of members.
    assert "Taking" not in message
    assert "`x`: size 8" in message
    assert "`w`: size 3" in message
    assert "`b`: size 2" in message
    assert "arguments `w` and `b` shared (8 members): did you mean " in message
    assert "did you mean in_axes=(0, None, None)?" in message
    # Every other reading follows, by size: `b` alone would make each member a scalar.
    assert message.endswith(
        "Otherwise, with arguments `x` and `b` shared (3 members): "
        "in_axes=(None, 0, None); with arguments `x` and `w` shared (2 members): "
        "in_axes=(None, None, 0)."
    )
    # With `b` passed by keyword, the fix is keyed by name.
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(_affine)(x, w, b=b)
    assert "did you mean in_axes={'x': 0, 'w': None, 'b': None}?" in _message(excinfo)


def test_error_ambiguous_unstacked_model_suggests_mapping_the_data():
    # An unstacked Linear agrees with itself (weight rows and bias are both 2) just as
    # the batch does; mapping it would make each member's bias a scalar.
    linear = eqx.nn.Linear(3, 2, key=jr.key(0))
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(_model_call)(linear, _arange(32, 3))
    message = _message(excinfo)
    assert "Taking" not in message
    assert "`model`: size 2 (all 2 mapped leaves, such as `model.weight`" in message
    assert "`x`: size 32 (axis 0 of float32[32,3])" in message
    assert message.endswith(
        "With argument `model` shared (32 members): did you mean in_axes=(None, 0)? "
        "Otherwise, with argument `x` shared (2 members): "
        "in_axes=(eqx.if_array(0), None)."
    )


def test_error_ambiguous_prefers_the_size_more_arguments_share():
    def loss(x, y, w):
        return (x @ w - y[..., None]) ** 2

    # `y` would be a scalar per member, but `x` and `y` agreeing outweighs that.
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(loss)(_arange(8, 3), _arange(8), _arange(3, 2))
    message = _message(excinfo)
    first = "With argument `w` shared (8 members): did you mean in_axes=(0, 0, None)?"
    assert first in message
    assert message.endswith(
        "with arguments `x` and `y` shared (3 members): in_axes=(None, None, 0)."
    )


def test_error_ambiguous_with_an_argument_that_disagrees_with_itself():
    def first(a, pair, b):
        return a

    # `pair` disagrees with itself; each reading shares it whole.
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(first)(_arange(4, 2), (_arange(6), _arange(7)), _arange(5, 2))
    message = _message(excinfo)
    assert "`pair[0]`: size 6" in message and "`pair[1]`: size 7" in message
    assert "With arguments `a` and `pair` shared (5 members): did you mean " in message
    assert "in_axes=(None, None, 0)?" in message
    # A reading that would map only part of `pair` is no reading: none is left here.
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(first)(_arange(4, 2), (_arange(4), _arange(5)), _arange(5, 2))
    message = _message(excinfo)
    assert "`pair[0]`: size 4" in message and "`pair[1]`: size 5" in message
    assert "did you mean" not in message and "shared" not in message


def test_error_names_leaf_path_and_every_disagreeing_leaf():
    model = _model(4)
    model = eqx.tree_at(lambda m: m.layers[0].weight, model, _arange(5, 3, 2))
    model = eqx.tree_at(lambda m: m.layers[1].bias, model, _arange(3, 2))
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(_model_call)(model, _arange(4, 2))
    message = _message(excinfo)
    assert "`model.layers[0].weight`: size 5" in message
    assert "`model.layers[1].bias`: size 3" in message
    assert "model.layers[0].bias" not in message
    assert "did you mean" not in message  # `model` is partly right: no obvious fix


def test_error_with_module_argument_suggests_if_array():
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(_model_call)(_model(4), _arange(3, 2))
    assert "did you mean in_axes=(eqx.if_array(0), None)?" in _message(excinfo)


def test_error_under_jit_is_the_same():
    x, w, b = _arange(8, 3), _arange(3, 2), _arange(2)
    with pytest.raises(eb.BatchError) as eager:
        eb.filter_vmap(_affine)(x, w, b)
    with pytest.raises(eb.BatchError) as jitted:
        eqx.filter_jit(eb.filter_vmap(_affine))(x, w, b)
    assert str(eager.value) == str(jitted.value)


def test_error_axis_size_disagrees():
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(_affine, in_axes=(0, None, None), axis_size=5)(
            _arange(4, 3), _arange(3, 2), _arange(2)
        )
    message = _message(excinfo)
    assert "axis_size=5" in message and "`x`: size 4" in message


def test_error_zero_d_mapped():
    with pytest.raises(eb.BatchError, match=r"`state\['step'\]` is a 0-d array"):
        eb.filter_vmap(lambda state: state["step"] + 1, in_axes=0)(
            {"step": jnp.array(1.0)}
        )


def test_error_axis_out_of_range():
    with pytest.raises(eb.BatchError, match=r"`x` has shape \(3, 2\).*axis 2"):
        eb.filter_vmap(_affine, in_axes=(2, None, None))(
            _arange(3, 2), _arange(2, 2), _arange(2)
        )


def test_error_non_array_mapped():
    with pytest.raises(eb.BatchError, match=r"`model\.activation`.*not an array"):
        eb.filter_vmap(_model_call, in_axes=(0, None))(_model(3), _arange(2))


def test_error_tuple_in_axes_length():
    with pytest.raises(eb.BatchError, match=r"2 specs.*3 positional.*`x`, `w`, `b`"):
        eb.filter_vmap(_affine, in_axes=(0, None))(_arange(3), _arange(3), _arange(3))


def test_error_dict_in_axes_unknown_name():
    with pytest.raises(
        eb.BatchError, match=r"`weight`, not a parameter .*\(`x`, `w`, `b`\)"
    ):
        eb.filter_vmap(_affine, in_axes={"weight": None})(
            _arange(3), _arange(3), _arange(3)
        )


def test_error_in_axes_not_prefix():
    with pytest.raises(eb.BatchError, match=r"`pair`"):
        eb.filter_vmap(_nested_in, in_axes=((0, 1, 2), None))(
            (_arange(2), _arange(2)), 1.0
        )


def test_error_out_axes():
    with pytest.raises(eb.BatchError, match=r"`out\[2\]` is 'label', not an array"):
        eb.filter_vmap(_tuple_out, out_axes=0)(_arange(3, 2), _arange(3, 2))
    with pytest.raises(
        eb.BatchError, match=r"`out` has 1 axis once mapped: out_axes 2"
    ):
        eb.filter_vmap(jnp.sin, out_axes=2)(_arange(3))
    with pytest.raises(eb.BatchError, match="axis_size"):
        eb.filter_vmap(lambda c: jnp.full(2, c))(1.5)


def test_error_unmapped_output_differs_between_members():
    def f(x):
        return x, {"total": x * 2}

    for chunk_size in (None, 2):
        vmapped = eb.filter_vmap(f, out_axes=(0, None), chunk_size=chunk_size)
        with pytest.raises(eb.BatchError, match=r"`out\[1\]\['total'\]`"):
            vmapped(_arange(3))


# Equinox warns when an array is set in a static field; the user's code runs on.
_STATIC_ARRAY_WARNING = "ignore:A JAX array is being set as static:UserWarning"


class _Constants(eqx.Module):
    a: Any
    b: Any


class _WithStatic(eqx.Module):
    weight: jax.Array
    constants: Any = eqx.field(static=True)


def _with_static(weight, constants):
    # equinox#312: a Module built per member, its per-member numbers kept static.
    return _WithStatic(weight, _Constants(constants[0], constants[1]))


@pytest.mark.filterwarnings(_STATIC_ARRAY_WARNING)
@pytest.mark.parametrize("chunk_size", [None, 2, 3])
@pytest.mark.parametrize("jit", [None, jax.jit, eqx.filter_jit])
def test_error_static_field_holds_member_value(chunk_size, jit):
    # Equinox returns the output, and its next use raises JAX's UnexpectedTracerError.
    vmapped = eb.filter_vmap(_with_static, chunk_size=chunk_size)
    if jit is not None:
        vmapped = jit(vmapped)
    with pytest.raises(eb.BatchError) as excinfo:
        vmapped(_arange(4, 3), _arange(4, 2))
    message = _message(excinfo)
    assert "static fields" in message
    assert "`out.constants.a`: float32[]" in message
    assert "`out.constants.b`: float32[]" in message
    assert "Drop static=True" in message


@pytest.mark.filterwarnings(_STATIC_ARRAY_WARNING)
def test_error_static_field_names_its_path_in_the_output(getkey):
    def keyed(key):
        return jnp.zeros(2), {"model": _WithStatic(jnp.zeros(()), (1, key))}

    with pytest.raises(
        eb.BatchError, match=r"`out\[1\]\['model'\]\.constants\[1\]`: key"
    ):
        eb.filter_vmap(keyed)(jr.split(getkey(), 3))


@pytest.mark.filterwarnings(_STATIC_ARRAY_WARNING)
def test_error_chunked_static_field_holds_unmapped_argument():
    # The chunks run in a compiled loop, where an unmapped array is traced too.
    def scaled(weight, scale):
        return _WithStatic(weight * scale, scale)

    weights, scale = _arange(5, 2), jnp.array(2.0)
    unchunked = eb.filter_vmap(scaled, in_axes=(0, None))(weights, scale)
    assert unchunked.constants is scale
    chunked = eb.filter_vmap(scaled, in_axes=(0, None), chunk_size=2)
    with pytest.raises(eb.BatchError, match=r"(?s)`out\.constants`.*compiled loop"):
        chunked(weights, scale)


class _AllStatic(eqx.Module):
    # No array field: the Module flattens to a node without children.
    value: Any = eqx.field(static=True)


class _HoldsAllStatic(eqx.Module):
    inner: _AllStatic
    weight: jax.Array


@pytest.mark.filterwarnings(_STATIC_ARRAY_WARNING)
@pytest.mark.parametrize(
    ("build", "path"),
    [
        (_AllStatic, "out.value"),
        (lambda w: (w, _AllStatic(w)), "out[1].value"),
        (lambda w: _HoldsAllStatic(_AllStatic(w), w), "out.inner.value"),
    ],
    ids=["alone", "in_tuple", "nested"],
)
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_error_static_field_of_a_module_without_array_fields(build, path, chunk_size):
    # A Module whose fields are all static has no children, and was taken for a leaf.
    vmapped = eb.filter_vmap(build, chunk_size=chunk_size)
    with pytest.raises(eb.BatchError, match=rf"(?s)`{re.escape(path)}`.*static=True"):
        vmapped(_arange(3, 2))


class _Holder:
    """A plain object, not a pytree: what a static field may hold."""

    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize(
    "held",
    [
        lambda w: lambda: w * 2,
        lambda w: ft.partial(jnp.add, w),
        _Holder,
        lambda w: _Holder(_Holder(w)),
    ],
    ids=["closure", "partial", "plain_object", "nested_plain_objects"],
)
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_error_static_field_holds_member_value_out_of_sight(held, chunk_size):
    # Issue 43, ST07-ST09: a closure's cell, a partial's argument or a plain object's
    # attribute was not looked into, and the traced value escaped.
    vmapped = eb.filter_vmap(lambda w: _WithStatic(w, held(w)), chunk_size=chunk_size)
    with pytest.raises(eb.BatchError, match=r"(?s)`out\.constants`.*static=True"):
        vmapped(_arange(3, 2))


def test_static_field_holding_a_closure_of_no_traced_value_is_accepted():
    scale = 3.0
    out = eb.filter_vmap(lambda w: _WithStatic(w, lambda: scale))(_arange(3, 2))
    assert out.constants() == 3.0


@pytest.mark.filterwarnings(_STATIC_ARRAY_WARNING)
def test_error_chunked_module_without_array_fields_holds_unmapped_argument():
    def scaled(weight, scale):
        return _HoldsAllStatic(_AllStatic(scale), weight * scale)

    weights, scale = _arange(5, 2), jnp.array(2.0)
    unchunked = eb.filter_vmap(scaled, in_axes=(0, None))(weights, scale)
    assert unchunked.inner.value is scale
    chunked = eb.filter_vmap(scaled, in_axes=(0, None), chunk_size=2)
    with pytest.raises(eb.BatchError, match=r"(?s)`out\.inner\.value`.*compiled loop"):
        chunked(weights, scale)
    # Static data that is not traced is the output's structure, as ever.
    out = eb.filter_vmap(lambda w: _HoldsAllStatic(_AllStatic(1), w), chunk_size=2)(
        weights
    )
    assert out.inner == _AllStatic(1)


@pytest.mark.filterwarnings(_STATIC_ARRAY_WARNING)
def test_static_field_holding_a_value_of_an_enclosing_trace_as_equinox_does():
    # A traced value of the enclosing jit, not of the members, is valid where the
    # output is used: accepted, as Equinox accepts it.
    def program(vmap, weights, scale):
        out = vmap(lambda w: _WithStatic(w, scale))(weights)
        return out.weight * out.constants

    weights = _arange(4, 2)
    ours = jax.jit(ft.partial(program, eb.filter_vmap))(weights, 3.0)
    theirs = jax.jit(ft.partial(program, eqx.filter_vmap))(weights, 3.0)
    assert_trees_identical(ours, theirs)

    def nested(x):
        inner = eb.filter_vmap(lambda z: _WithStatic(z, x))(_arange(2))
        return inner.weight * inner.constants

    assert_trees_identical(
        eb.filter_vmap(nested)(_arange(3)), eqx.filter_vmap(nested)(_arange(3))
    )


def test_error_axis_name_with_chunk():
    with pytest.raises(eb.BatchError, match=r"axis_name='members'.*chunk_size=2 < 5"):
        eb.filter_vmap(_centre, axis_name="members", chunk_size=2)(_arange(5, 2))
    # A chunk that holds every member is no chunking at all.
    ours = eb.filter_vmap(_centre, axis_name="members", chunk_size=5)(_arange(5, 2))
    assert_trees_identical(
        ours, eb.filter_vmap(_centre, axis_name="members")(_arange(5, 2))
    )


@pytest.mark.parametrize("axis_size", [-1, 2.0, "3", True])
def test_error_bad_axis_size(axis_size):
    # Refused when decorating, naming the argument, not deep inside JAX at the call.
    # Equinox reads `True` as 1; a bool is no member count here.
    with pytest.raises(eb.BatchError, match=rf"`axis_size` is {axis_size!r}.*>= 0"):
        eb.filter_vmap(jnp.sin, in_axes=None, axis_size=axis_size)


def test_error_list_of_members_says_to_stack():
    mlps = [eqx.nn.MLP(4, 4, 16, 2, key=jr.key(i)) for i in range(8)]
    xs = _arange(8, 4)
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(lambda model, x: model(x))(mlps, xs)
    message = _message(excinfo)
    assert "`model` is a list of 8 members of one structure (MLP)" in message
    assert "`eb.stack(model)` makes it one stacked MLP" in message
    # Sharing the list would fail in `fun` ('list' object is not callable): no such
    # advice, and the advice given works.
    assert "in_axes" not in message
    out = eb.filter_vmap(lambda model, x: model(x))(eb.stack(mlps), xs)
    assert out.shape == (8, 4)
    # A list whose members each agree on a size of their own (an ambiguous call).
    linears = [eqx.nn.Linear(3, 3, key=jr.key(i)) for i in range(8)]
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(lambda model, x: model(x))(linears, _arange(8, 3))
    message = _message(excinfo)
    assert "`model` is a list of 8 members of one structure (Linear)" in message
    assert "did you mean" not in message
    # A tuple of unrelated arrays is no list of members.
    with pytest.raises(eb.BatchError) as excinfo:
        eb.filter_vmap(lambda pair, x: x)((_arange(6), _arange(7, 2)), _arange(5))
    assert "members of one structure" not in _message(excinfo)


@pytest.mark.parametrize("chunk_size", [0, -1, True, np.bool_(True), 2.0])
def test_error_bad_chunk_size(chunk_size):
    with pytest.raises(eb.BatchError, match="`chunk_size` is"):
        eb.filter_vmap(jnp.sin, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [2, np.int64(2)])
def test_chunk_size_takes_numpy_integers(chunk_size):
    ours = eb.filter_vmap(jnp.sin, chunk_size=chunk_size)(_arange(5))
    assert_trees_identical(ours, eb.filter_vmap(jnp.sin)(_arange(5)))


def test_check_mapped_sizes():
    arguments = {"x": _arange(8, 3), "w": _arange(3, 2)}
    assert check_mapped_sizes(arguments, {"x": 0, "w": None}) == 8
    assert check_mapped_sizes(arguments, {"x": None, "w": None}) is None
    assert check_mapped_sizes(arguments, {"x": None, "w": None}, axis_size=4) == 4
    with pytest.raises(eb.BatchError, match="in_axes={'x': 0, 'w': None}"):
        check_mapped_sizes(arguments, {"x": 0, "w": 0})
    with pytest.raises(eb.BatchError, match=r"in_axes=\(0, None\)"):
        check_mapped_sizes(arguments, {"x": 0, "w": 0}, positional=2)


# --- Chunking -----------------------------------------------------------------------


def _elementwise(x, y, label):
    return {"out": jnp.sin(x) * y + 1.0, "label": label, "shared": jnp.cos(y)}


@settings(max_examples=20, deadline=None)
@given(
    members=st.integers(1, 9),
    chunk_size=st.integers(1, 10),
    feature_axis_first=st.booleans(),
)
def test_chunked_bitwise_equals_unchunked(members, chunk_size, feature_axis_first):
    axis = 1 if feature_axis_first else 0
    x = jnp.moveaxis(_arange(members, 3), 0, axis)
    y = _arange(3)
    kwargs = {
        "in_axes": (axis, None, None),
        "out_axes": {"out": -1, "label": None, "shared": None},
    }
    unchunked = eqx.filter_jit(eb.filter_vmap(_elementwise, **kwargs))(x, y, "a")
    chunked = eb.filter_vmap(_elementwise, chunk_size=chunk_size, **kwargs)(x, y, "a")
    if chunk_size < members:
        # Outside jit the loop over chunks is compiled on its own.
        assert_trees_identical(chunked, unchunked)
    else:
        assert_trees_identical(
            chunked, eb.filter_vmap(_elementwise, **kwargs)(x, y, "a")
        )


@pytest.mark.accelerator
def test_chunked_under_jit_bitwise():
    x, y = _arange(7, 3), _arange(3)
    in_axes = (0, None, None)
    chunked = eqx.filter_jit(
        eb.filter_vmap(_elementwise, in_axes=in_axes, chunk_size=3)
    )
    unchunked = eqx.filter_jit(eb.filter_vmap(_elementwise, in_axes=in_axes))
    assert_trees_identical(chunked(x, y, "a"), unchunked(x, y, "a"))


@pytest.mark.accelerator
def test_chunked_module_and_keywords(getkey):
    model, x = _model(7), _arange(7, 2)
    keys = jr.split(getkey(), 7)

    def noisy_call(model, x, *, key):
        return model(x) + jr.normal(key, (2,))

    chunked = eb.filter_vmap(noisy_call, chunk_size=3)(model, x, key=keys)
    unchunked = eb.filter_vmap(noisy_call)(model, x, key=keys)
    assert tree_allclose(chunked, unchunked)


def test_chunked_module_output():
    # Non-array leaves in the output (the activation) come back as they are.
    def make(weight):
        return Layer(weight, jnp.zeros(2)), jax.nn.relu

    chunked = eb.filter_vmap(make, chunk_size=2)(_arange(5, 2))
    assert_trees_identical(chunked, eb.filter_vmap(make)(_arange(5, 2)))


def test_chunked_axis_size_nothing_mapped():
    out = eb.filter_vmap(lambda c: jnp.full(2, c), axis_size=5, chunk_size=2)(1.5)
    assert_trees_identical(out, jnp.full((5, 2), 1.5))


def test_chunked_grad():
    def loss(model, x, chunk_size):
        vmapped = eb.filter_vmap(_model_call, chunk_size=chunk_size)
        return jnp.sum(vmapped(model, x) ** 2)

    model, x = _model(5), _arange(5, 2)
    chunked = eqx.filter_grad(loss)(model, x, 2)
    unchunked = eqx.filter_grad(loss)(model, x, None)
    assert tree_allclose(chunked, unchunked)
    jitted = eqx.filter_jit(eqx.filter_grad(loss))(model, x, 2)
    assert tree_allclose(jitted, unchunked)


def test_chunked_closure_over_tracer():
    @jax.jit
    def outer(x, scale):
        return eb.filter_vmap(lambda x: x * scale, chunk_size=2)(x)

    # `x` is an argument, not computed in the trace, where XLA may fold `/ 7 * 2`.
    assert_trees_identical(outer(_arange(5), jnp.array(2.0)), _arange(5) * 2.0)


def test_chunked_memory_follows_chunk():
    # The per-member intermediate (a 64x64 matrix) exists for one chunk at a time: the
    # largest array of the program XLA compiled holds one chunk of them. (XLA's count
    # of scratch memory, `memory_analysis().temp_size_in_bytes`, reads 0 on JAX 0.12's
    # CPU backend, so it cannot tell the two programs apart there.)
    def heavy(v):
        matrix = jnp.sin(jnp.outer(v, v))
        return jnp.tanh(matrix @ matrix).sum(0)

    v = _arange(32, 64) / 100

    def largest_array(chunk_size):
        compiled = (
            jax.jit(eb.filter_vmap(heavy, chunk_size=chunk_size)).lower(v).compile()
        )
        program = compiled.as_text()
        assert program is not None
        shapes = re.findall(r"f32\[(\d+(?:,\d+)*)\]", program)
        return max(math.prod(map(int, shape.split(","))) for shape in shapes)

    assert largest_array(4) * 4 <= largest_array(None)
