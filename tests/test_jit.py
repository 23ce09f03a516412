"""`eb.filter_jit`: `eqx.filter_jit`'s results, donation, methods, ahead-of-time
compilation, runtime checks, and errors that name the argument."""

import dataclasses
import functools as ft
import logging
import math
import subprocess
import sys
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import assert_trees_identical, raises

import eqx_batch as eb


@pytest.mark.accelerator
def test_results_equal_eqx_filter_jit_on_a_training_step(getkey):
    keys = jr.split(getkey(), 4)
    model = eqx.filter_vmap(lambda k: eqx.nn.MLP(2, 1, 8, 2, key=k))(keys)
    optimiser = eb.per_member(optax.adam(1e-2))
    state = optimiser.init(eqx.filter(model, eqx.is_array))
    x = jr.normal(getkey(), (16, 2))

    def step(model, state, x):
        def loss(model):
            return jnp.sum(eqx.filter_vmap(lambda m: jnp.mean(jax.vmap(m)(x)))(model))

        grads = eqx.filter_grad(loss)(model)
        params = eqx.filter(model, eqx.is_array)
        updates, state = optimiser.update(grads, state, params)
        return eqx.apply_updates(model, updates), state

    # optax's Adam computes `decay ** count` from a Python float and an int32 count,
    # which the suite's strict dtype promotion rejects; users run with the default.
    with jax.numpy_dtype_promotion("standard"):
        ours = eb.filter_jit(step)(model, state, x)
        theirs = eqx.filter_jit(step)(model, state, x)
    assert_trees_identical(ours, theirs)


def test_python_scalars_are_static_and_arrays_traced():
    traces = []

    @eb.filter_jit
    def scale(x, factor):
        traces.append(factor)
        return x * factor, factor

    out, factor = scale(jnp.ones(2), 2.0)
    assert jnp.array_equal(out, jnp.full(2, 2.0)) and factor == 2.0
    assert type(factor) is float
    scale(jnp.zeros(2), 2.0)
    assert traces == [2.0]
    scale(jnp.zeros(2), 3.0)
    assert traces == [2.0, 3.0]
    scale(jnp.zeros(2), jnp.asarray(4.0))
    scale(jnp.zeros(2), jnp.asarray(5.0))
    assert len(traces) == 3


@pytest.mark.parametrize("first, second", [(1, 1.0), (1, True), (0.0, -0.0)])
def test_an_equal_static_of_another_type_or_sign_compiles_anew(first, second):
    def as_array(value):
        return jnp.asarray(value)

    ours = eb.filter_jit(as_array)
    for value in (first, second):
        # A fresh function for each value: `jax.jit` shares one cache between the
        # wrappers of a function, in which -0.0 would find 0.0's program.
        fresh = jax.jit(lambda value: as_array(value), static_argnums=0)
        assert_trees_identical(ours(value), fresh(value))


def test_a_float_static_is_keyed_on_its_bits():
    traces = []

    @eb.filter_jit
    def as_array(value):
        traces.append(value)
        return jnp.asarray(value)

    as_array(float("nan"))
    as_array(float("nan"))  # another object, the same bits: the same program
    assert len(traces) == 1
    as_array(math.copysign(math.nan, -1.0))  # a sign bit apart
    assert len(traces) == 2


class Config(eqx.Module):
    value: Any


class StaticConfig(eqx.Module):
    value: Any = eqx.field(static=True)


def _as_array_by_jax_jit(value):
    # A fresh function for each value, as above: `jax.jit`'s own program for it.
    return jax.jit(lambda value: jnp.asarray(value), static_argnums=0)(value)


@pytest.mark.parametrize("config", [Config, StaticConfig])
@pytest.mark.parametrize("first, second", [(1, 1.0), (1, True), (0.0, -0.0)])
def test_an_equal_module_field_of_another_type_or_sign_compiles_anew(
    config, first, second
):
    as_array = eb.filter_jit(lambda config: jnp.asarray(config.value))

    # Identical: of the same dtype and bits, so -0.0 is not 0.0.
    assert_trees_identical(as_array(config(first)), _as_array_by_jax_jit(first))
    assert_trees_identical(as_array(config(second)), _as_array_by_jax_jit(second))


@pytest.mark.parametrize(
    "wrap, unwrap",
    [
        (lambda v: {"config": StaticConfig(v)}, lambda t: t["config"].value),
        (lambda v: [Config(StaticConfig(v))], lambda t: t[0].value.value),
        (lambda v: StaticConfig((v, "label")), lambda t: t.value[0]),
        (lambda v: StaticConfig(Config(v)), lambda t: t.value.value),
        (lambda v: StaticConfig(StaticConfig((v,))), lambda t: t.value.value[0]),
    ],
    ids=[
        "in-a-dict",
        "in-a-module-in-a-list",
        "a-tuple-in-a-static-field",
        "a-module-in-a-static-field",
        "nested-static-fields",
    ],
)
@pytest.mark.parametrize("first, second", [(1, 1.0), (0.0, -0.0)])
def test_an_equal_static_nested_in_modules_tuples_and_dicts_compiles_anew(
    wrap, unwrap, first, second
):
    as_array = eb.filter_jit(lambda tree: jnp.asarray(unwrap(tree)))

    assert_trees_identical(as_array(wrap(first)), _as_array_by_jax_jit(first))
    assert_trees_identical(as_array(wrap(second)), _as_array_by_jax_jit(second))


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: Any


@dataclasses.dataclass
class Plain:
    value: Any


# A dataclass is equal to another of equal fields, frozen (and hashable) or not, as a
# Module is: keyed by its fields, it compiles its own program for `Frozen(-0.0)`.
@pytest.mark.parametrize(
    "wrap, unwrap",
    [
        (lambda v: Frozen(v), lambda t: t.value),
        (lambda v: StaticConfig(Frozen(v)), lambda t: t.value.value),
        (lambda v: Frozen(Frozen((v, "label"))), lambda t: t.value.value[0]),
        (lambda v: StaticConfig(Frozen(Frozen(v))), lambda t: t.value.value.value),
        (lambda v: StaticConfig(Plain(Frozen(v))), lambda t: t.value.value.value),
    ],
    ids=[
        "frozen",
        "frozen-in-a-static-field",
        "nested-frozen",
        "nested-frozen-in-a-static-field",
        "frozen-in-a-plain-one",
    ],
)
@pytest.mark.parametrize("first, second", [(1, 1.0), (1, True), (0.0, -0.0)])
def test_an_equal_dataclass_of_another_type_or_sign_compiles_anew(
    wrap, unwrap, first, second
):
    as_array = eb.filter_jit(lambda tree: jnp.asarray(unwrap(tree)))

    assert wrap(first) == wrap(second)
    assert_trees_identical(as_array(wrap(first)), _as_array_by_jax_jit(first))
    assert_trees_identical(as_array(wrap(second)), _as_array_by_jax_jit(second))


def test_a_frozen_dataclass_is_keyed_on_its_fields_not_its_object():
    traces = []

    @eb.filter_jit
    def sign(x, config):
        traces.append(config)
        return jnp.copysign(x, config.value.value.value)

    def config(value):
        return StaticConfig(Frozen(Frozen(value)))

    for _ in range(3):
        assert sign(jnp.ones(()), config(float("2.5"))) == 1.0  # new objects each time
    assert len(traces) == 1
    assert sign(jnp.ones(()), config(-0.0)) == -1.0
    assert sign(jnp.ones(()), config(0.0)) == 1.0
    assert len(traces) == 3
    sign(jnp.ones(()), config(float("nan")))
    sign(jnp.ones(()), config(float("nan")))  # another NaN of the same bits
    assert len(traces) == 4
    sign(jnp.ones(()), config(math.copysign(math.nan, -1.0)))  # a sign bit apart
    assert len(traces) == 5


def test_a_static_field_is_keyed_on_its_value_not_its_object():
    traces = []

    @eb.filter_jit
    def as_array(config):
        traces.append(config.value)
        return jnp.asarray(config.value)

    for _ in range(3):
        as_array(StaticConfig(float("2.5")))  # a new float object each time
    as_array(StaticConfig(float("nan")))
    as_array(StaticConfig(float("nan")))  # another NaN of the same bits
    assert len(traces) == 2
    as_array(StaticConfig(math.copysign(math.nan, -1.0)))  # a sign bit apart
    assert len(traces) == 3


def test_a_compiled_function_refuses_an_equal_static_field_of_another_sign():
    as_array = eb.filter_jit(lambda config: jnp.asarray(config.value))
    compiled = as_array.lower(StaticConfig(0.0)).compile()  # pyright: ignore

    assert_trees_identical(compiled(StaticConfig(0.0)), _as_array_by_jax_jit(0.0))
    raises("other non-array values", lambda: compiled(StaticConfig(-0.0)))


def test_keywords_bind_to_positions_as_eqx_does():
    traces = 0

    @eb.filter_jit
    def add(x, y: jax.Array | float = 1.0):
        nonlocal traces
        traces += 1
        return x + y

    assert add(jnp.ones(()), y=jnp.ones(())) == 2.0
    assert add(jnp.ones(()), jnp.ones(())) == 2.0
    assert traces == 1
    with pytest.raises(TypeError):
        add(jnp.ones(()), z=1)  # pyright: ignore[reportCallIssue]


def test_a_module_with_arrays_as_the_function(getkey):
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=getkey())
    x = jnp.ones(2)
    assert jnp.array_equal(eb.filter_jit(mlp)(x), eqx.filter_jit(mlp)(x))


def test_methods_see_the_instance_as_the_first_argument():
    class Counter(eqx.Module):
        step: jax.Array

        @eb.filter_jit(donate="all-except-first")
        def advance(self, total):
            return total + self.step

    counter = Counter(jnp.asarray(2.0))
    total = jnp.asarray(1.0)
    assert counter.advance(total) == 3.0
    assert total.is_deleted() and not counter.step.is_deleted()


@pytest.mark.accelerator
def test_donate_all_reuses_buffers_quietly():
    @eb.filter_jit(donate="all")
    def add_one(x, unusable):
        return x + jnp.sum(unusable)

    x, unusable = jnp.zeros(3), jnp.zeros(5)
    pointer = x.unsafe_buffer_pointer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = add_one(x, unusable)
    assert x.is_deleted() and out.unsafe_buffer_pointer() == pointer


# A buffer passed at two places of a donating call, over the suite's 4 devices. XLA
# refuses a buffer donated twice, and on some versions the process dies of it, so each
# pattern runs in its own process: a crash fails the test rather than ending pytest.
_SHARDED_X = """
import jax.numpy as jnp
import numpy as np
import eqx_batch as eb

def check(out, expected):
    assert jnp.array_equal(out, expected), (out, expected)

values = jnp.arange(8.0)
x = eb.shard(values)
assert len(x.sharding.device_set) == 4
"""
_DONATED_TWICE = {
    "all": """
add = eb.filter_jit(lambda a, b: a + b, donate="all")
check(add(x, x), 2 * values)
y = eb.shard(values)
check(add.lower(y, y).compile()(y, y), 2 * values)
""",
    "all-except-first": """
add = eb.filter_jit(lambda a, b, c: a + b + c, donate="all-except-first")
check(add(x, x, x), 3 * values)
check(x, values)  # the first argument is not donated: still usable
""",
    "tied weights": """
tied = eb.filter_jit(lambda tree: tree["a"] * tree["b"], donate="all")
check(tied({"a": x, "b": x}), values**2)
""",
}


@pytest.mark.parametrize("pattern", sorted(_DONATED_TWICE))
def test_a_buffer_passed_twice_to_a_donating_call_is_donated_once(pattern):
    script = _SHARDED_X + _DONATED_TWICE[pattern] + 'print("ok")\n'
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_donate_warn_keeps_the_warning():
    @eb.filter_jit(donate="warn")
    def add_one(x, unusable):
        return x + jnp.sum(unusable)

    with pytest.warns(UserWarning, match="Some donated buffers were not usable"):
        add_one(jnp.zeros(3), jnp.zeros(5))


def test_nested_in_jit_grad_and_vmap():
    @eb.filter_jit
    def square(x):
        return x**2

    assert jax.jit(jax.grad(square))(3.0) == 6.0
    assert jnp.array_equal(
        eb.filter_jit(jax.vmap(square))(jnp.arange(3.0)), jnp.array([0.0, 1.0, 4.0])
    )
    assert eb.filter_jit(eqx.filter_grad(square))(jnp.asarray(2.0)) == 4.0


@pytest.mark.accelerator
def test_lower_and_compile_call_like_the_function():
    def affine(x, shift, scale=2):
        return scale * x + shift

    x = jnp.arange(3.0)
    jitted = eb.filter_jit(affine)
    lowered = jitted.lower(x, jnp.ones(()), scale=3)  # pyright: ignore
    compiled = lowered.compile()
    assert jnp.array_equal(compiled(x, jnp.ones(()), scale=3), 3 * x + 1)
    assert "add" in compiled.as_text()


def test_a_compiled_call_with_other_shapes_names_the_argument():
    jitted = eb.filter_jit(lambda x, shift: x + shift)
    compiled = jitted.lower(jnp.ones(3), 1).compile()  # pyright: ignore
    raises(
        "other shapes or dtypes",
        lambda: compiled(jnp.ones(4), 1),
        "`x`",
        "float32[3]",
        "float32[4]",
    )
    raises("other non-array values", lambda: compiled(jnp.ones(3), 2))


def test_an_unhashable_static_leaf_is_named_by_argument_and_path():
    @eb.filter_jit
    def f(x, config):
        return x

    raises(
        "not hashable",
        lambda: f(jnp.ones(2), {"layers": [1, {2, 3}]}),
        "`config['layers'][1]`",
        "set",
    )


def _calls_a_nested_program(fun):
    """Whether `jax.jit(fun)`, lowered, calls a program of its own for a nested one
    rather than holding its operations inline."""
    lowered = jax.jit(fun).lower(jnp.asarray(1.0))
    return "call @" in lowered.as_text()


def test_other_keywords_are_passed_on_to_jax_jit():
    @eb.filter_jit(inline=True)
    def double(x):
        return x * 2

    assert double(jnp.asarray(3.0)) == 6.0
    compiled = double.lower(jnp.asarray(3.0)).compile()  # pyright: ignore
    assert compiled(jnp.asarray(3.0)) == 6.0
    assert not _calls_a_nested_program(lambda x: double(x))
    assert _calls_a_nested_program(lambda x: eb.filter_jit(lambda y: y * 2)(x))
    with pytest.raises(TypeError, match="not_a_keyword"):
        eb.filter_jit(not_a_keyword=True)


@pytest.mark.parametrize(
    "keyword", ["static_argnums", "donate_argnums", "in_shardings"]
)
def test_keywords_that_filter_jit_decides_are_refused(keyword):
    jit_kwargs: dict[str, Any] = {keyword: 0}
    raises(keyword, lambda: eb.filter_jit(lambda x: x, **jit_kwargs))


def test_an_unhashable_keyword_for_jax_jit_is_refused():
    options = {"xla_flag": {1, 2}}
    raises("not hashable", lambda: eb.filter_jit(compiler_options=options), "set")


def test_a_bad_donate_is_refused():
    raises("donate='some'", lambda: eb.filter_jit(lambda x: x, donate="some"))  # type: ignore[arg-type]


@pytest.mark.accelerator
def test_error_if_is_raised_at_the_call():
    @eb.filter_jit
    def positive(x):
        return eqx.error_if(x, x <= 0, "x must be positive")

    assert positive(jnp.asarray(1.0)) == 1.0
    with pytest.raises(eqx.EquinoxRuntimeError, match="x must be positive"):
        positive(jnp.asarray(-1.0))


def test_a_failed_check_logs_no_advice_to_use_eqx_filter_jit(caplog):
    @eb.filter_jit
    def positive(x):
        return eqx.error_if(x, x <= 0, "x must be positive")

    compiled = positive.lower(jnp.asarray(1.0)).compile()  # pyright: ignore
    for call in (positive, compiled):
        with pytest.raises(eqx.EquinoxRuntimeError, match="x must be positive"):
            call(jnp.asarray(-1.0))
    assert "equinox.filter_jit" not in caplog.text
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_failing_callback_of_ones_own_is_still_logged(caplog):
    def fail(x):
        raise RuntimeError("the callback's own failure")

    @eb.filter_jit
    def call_back(x):
        return jax.pure_callback(fail, jax.ShapeDtypeStruct((), jnp.float32), x)

    with pytest.raises(jax.errors.JaxRuntimeError):
        call_back(jnp.asarray(1.0))
    assert "the callback's own failure" in caplog.text


def test_a_fresh_wrapper_of_an_equal_function_reuses_the_compilation():
    traces = 0

    def f(x):
        nonlocal traces
        traces += 1
        return x + 1

    eb.filter_jit(eqx.filter_grad(f))(jnp.asarray(1.0))
    eb.filter_jit(eqx.filter_grad(f))(jnp.asarray(2.0))
    assert traces == 1


class _Static(eqx.Module):
    weight: jax.Array
    held: Any = eqx.field(static=True)


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static:UserWarning")
@pytest.mark.parametrize(
    "held", [np.ones(3), jnp.ones(3)], ids=["numpy_array", "jax_array"]
)
def test_an_unhashable_static_field_is_named_by_argument_and_field(held):
    # Issue 43, ST24-ST27: JAX's raw "unhashable type" error named nothing.
    f = eb.filter_jit(lambda model, x: model.weight * x)
    raises("static field", lambda: f(_Static(jnp.ones(3), held), 2.0), "`model.held`")


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static:UserWarning")
@pytest.mark.parametrize(
    "held", [[1, 2], {"a": [1]}, np.ones(2)], ids=["list", "dict", "numpy_array"]
)
def test_an_output_whose_static_field_is_unhashable_is_refused(held):
    # JAX compared the outputs' structures and raised "Cache keys should be
    # comparable", naming nothing.
    f = eb.filter_jit(lambda x: _Static(x, held))
    raises("not hashable", lambda: f(jnp.ones(3)), "`out.held`", "tuple")


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static:UserWarning")
@pytest.mark.parametrize(
    "held",
    [lambda x: x, lambda x: lambda: x, lambda x: ft.partial(jnp.add, x)],
    ids=["array", "closure", "partial"],
)
def test_a_traced_value_in_an_output_static_field_is_refused(held):
    # Issue 43, ST13: the tracer outlived the program, and every later call returned it.
    f = eb.filter_jit(lambda x: _Static(x, held(x)))
    raises("traced values in static fields", lambda: f(jnp.ones(3)), "`out.held`")


def test_an_output_static_field_of_hashable_values_is_returned():
    f = eb.filter_jit(lambda x: _Static(x, (1, "a")))
    assert f(jnp.ones(3)).held == (1, "a")
    assert f(jnp.zeros(3)).held == (1, "a")
    # A dict's keys are its node's data, a list: JAX compares them itself.
    g = eb.filter_jit(lambda x: {"b": x, "a": _Static(x, None)})
    assert sorted(g(jnp.ones(3))) == ["a", "b"]
