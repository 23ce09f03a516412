# Ruff reads jaxtyping dims strings as forward references; see typing_static.py.
# ruff: noqa: F722

import dataclasses
import functools as ft
import importlib
import importlib.metadata
import sys
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from beartype import beartype
from beartype.roar import BeartypeCallHintViolation
from helpers import tree_allclose
from jaxtyping import (
    Array,
    Float,
    install_import_hook,
    jaxtyped,
    PyTree,
    TypeCheckError,
)

import eqx_batch as eb
from eqx_batch._types import _typing


# Static checkers read `eb.Stacked[...]` as the model class, which `isinstance` and
# attribute access on the annotation itself do not type-check against; at run time it
# is a class with a checking metaclass.
Stacked: Any = eb.Stacked
vector_n: Any = Float[Array, " n"]
vector_k: Any = Float[Array, " k"]


class Linear(eqx.Module):
    weight: Float[Array, "out in"]
    bias: Float[Array, " out"]

    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        return self.weight @ x + self.bias


class MLP(eqx.Module):
    layers: list[Linear]
    activation: Callable = jax.nn.tanh
    depth: int = 2


class Pair(NamedTuple):
    a: Any
    b: Any


def make_linear(n: int | None, out: int, in_: int, start: float = 0.0) -> Linear:
    lead = () if n is None else (n,)
    size = int(np.prod(lead + (out, in_)))
    weight = jnp.arange(size, dtype=jnp.float32).reshape(lead + (out, in_)) / size
    return Linear(weight + start, jnp.full(lead + (out,), start, jnp.float32))


def make_mlp(n: int | None, sizes: tuple[int, ...] = (4, 8, 2)) -> MLP:
    pairs = zip(sizes[:-1], sizes[1:], strict=False)
    return MLP([make_linear(n, out, in_, i) for i, (in_, out) in enumerate(pairs)])


def apply_mlp(model: MLP, x: Float[Array, "b 4"]) -> Float[Array, "b 2"]:
    for layer in model.layers:
        x = model.activation(x @ layer.weight.T + layer.bias[None])
    return x


@eb.typecheck
def predict(
    models: eb.Stacked[MLP, " n"], x: Float[Array, "n b 4"]
) -> Float[Array, "n b 2"]:
    return eqx.filter_vmap(apply_mlp)(models, x)


@eb.typecheck
def predict_x_first(
    x: Float[Array, "n b 4"], models: eb.Stacked[MLP, " n"]
) -> Float[Array, "n b 2"]:
    return eqx.filter_vmap(apply_mlp)(models, x)


def reasons(error: BaseException) -> str:
    """The messages of `error` and of everything it was raised from."""
    texts = []
    current: BaseException | None = error
    while current is not None:
        texts.append(str(current))
        current = current.__cause__
    return "\n".join(texts)


# ------------------------------------------------------------------------------------
# Happy paths.


@pytest.mark.accelerator
def test_predict_matches_per_member_loop():
    models, x = make_mlp(5), jnp.linspace(-1, 1, 5 * 3 * 4).reshape(5, 3, 4)
    expected = jnp.stack([apply_mlp(eb.index(models, i), x[i]) for i in range(5)])
    assert tree_allclose(predict(models, x), expected)
    assert tree_allclose(eqx.filter_jit(predict)(models, x), expected)


@pytest.mark.parametrize(
    "model, stacked, other",
    [
        (MLP, make_mlp(3), make_linear(3, 2, 2)),
        (dict, {"w": jnp.ones((3, 2)), "b": np.zeros((3,))}, (jnp.ones((3, 2)),)),
        (tuple, (jnp.ones((3, 2)), jnp.ones((3, 4, 5))), {"w": jnp.ones((3,))}),
        (Pair, Pair(jnp.ones((3, 2)), {"c": jnp.ones((3,))}), (jnp.ones((3,)),)),
    ],
    ids=["module", "dict", "tuple", "namedtuple"],
)
def test_model_kinds(model, stacked, other):
    annotation = Stacked[model, " n"]
    with jaxtyped("context"):
        assert isinstance(stacked, annotation)
        # `n` is now bound to 3 for the rest of the scope, as any jaxtyping dim is.
        assert isinstance(jnp.ones(3), vector_n)
        assert not isinstance(jnp.ones(4), vector_n)
    assert not isinstance(other, annotation)
    assert f"has type {type(other).__qualname__}, not {model.__qualname__}" in (
        annotation.__instancecheck_str__(other)
    )


def test_fixed_and_several_dims():
    annotation = Stacked[dict, "chains 4"]
    assert isinstance({"x": jnp.ones((3, 4, 2)), "y": jnp.ones((3, 4))}, annotation)
    message = annotation.__instancecheck_str__({"x": jnp.ones((3, 5, 2))})
    assert "`dict['x']` has shape (3, 5, 2): axis 1 is 5" in message
    assert "expects it to be 4" in message
    message = annotation.__instancecheck_str__(
        {"x": jnp.ones((3, 4)), "y": np.ones((2, 4))}
    )
    assert "`dict['y']` has shape (2, 4): axis 0 is 2" in message
    assert "chains=3, as bound by `dict['x']`" in message
    message = annotation.__instancecheck_str__({"x": jnp.ones((3,))})
    assert "`dict['x']` has shape (3,), with fewer axes than" in message
    assert "'chains 4'" in message


def test_layers_of_one_class_bind_their_own_dims():
    # 4 -> 8 -> 2: layer 0 has out=8, in=4 and layer 1 has out=2, in=8.
    models = make_mlp(5, (4, 8, 2))
    assert isinstance(models, Stacked[MLP, " layers"])


def test_fields_of_one_instance_share_dims():
    models = make_mlp(5)
    bad = eqx.tree_at(lambda m: m.layers[1].bias, models, jnp.zeros((5, 3)))
    with pytest.raises(TypeCheckError) as info:
        predict(bad, jnp.ones((5, 3, 4)))
    message = str(info.value)
    assert "`models.layers[1].bias` has shape (5, 3)" in message
    assert "each member's bias has shape (3,)" in message
    assert "Linear.bias" in message
    assert "dimension out is 3 which does not equal the existing value of 2" in message
    assert "This Linear instance (`models.layers[1]`) is checked in a scope" in message
    assert "starting from the leading dims (n=5)" in message


def bindings(capsys) -> str:
    """The dims bound in the current jaxtyping scope, as its public printer says."""
    capsys.readouterr()
    jaxtyping.print_bindings()
    return capsys.readouterr().out


def test_field_bindings_stay_in_their_instance(capsys):
    seen = []

    @eb.typecheck
    def two(a: eb.Stacked[Linear, " n"], b: eb.Stacked[Linear, " n"]) -> None:
        seen.append(bindings(capsys))

    two(make_linear(3, 2, 5), make_linear(3, 7, 4))
    assert "n=3" in seen[0]
    assert "out=" not in seen[0] and "in=" not in seen[0]


def test_field_dims_are_not_compared_with_the_call_dims():
    # Field dims see the leading dims only: `in` of `x` and of the weight are
    # separate names.
    @eb.typecheck
    def apply(x: Float[Array, "n in"], models: eb.Stacked[Linear, " n"]) -> None:
        pass

    apply(jnp.ones((3, 4)), make_linear(3, 2, 4))
    apply(jnp.ones((3, 5)), make_linear(3, 2, 4))
    with pytest.raises(TypeCheckError) as info:
        apply(jnp.ones((4, 4)), make_linear(3, 2, 4))
    assert "`models.weight` has shape (3, 2, 4)" in str(info.value)


def test_field_dims_named_like_the_leading_dims_must_agree():
    class Square(eqx.Module):
        weight: Float[Array, "n n"]

    ok = Square(jnp.ones((3, 3, 3)))  # pyright: ignore[reportArgumentType]
    assert isinstance(ok, Stacked[Square, " n"])
    bad = Square(jnp.ones((2, 3, 3)))  # pyright: ignore[reportArgumentType]
    message = Stacked[Square, " n"].__instancecheck_str__(bad)
    assert "Square.weight` has shape (2, 3, 3)" in message
    assert "leading dims (n=2)" in message


def test_field_dtype_and_array_type_are_checked():
    ints = Linear(jnp.ones((3, 2, 4), jnp.int32), jnp.ones((3, 2)))  # pyright: ignore
    message = Stacked[Linear, " n"].__instancecheck_str__(ints)
    assert "`Linear.weight` has shape (3, 2, 4)" in message
    assert "dtype int32" in message
    numpy_weight = Linear(np.ones((3, 2, 4), np.float32), jnp.ones((3, 2)))  # pyright: ignore
    message = Stacked[Linear, " n"].__instancecheck_str__(numpy_weight)
    assert "`Linear.weight`" in message and "it has type ndarray, not " in message


@ft.partial(jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=[])
@dataclasses.dataclass
class DataclassLinear:
    w: Float[Array, "o i"]
    b: Float[Array, " o"]


class ModuleLinear(eqx.Module):
    w: Float[Array, "o i"]
    b: Float[Array, " o"]


@pytest.mark.parametrize("cls", [DataclassLinear, ModuleLinear])
def test_dataclass_fields_are_checked_as_a_modules(cls):
    # jaxtyping#242: a pytree dataclass's fields were not checked, only the leading
    # dims of its leaves.
    @eb.typecheck
    def apply(models: eb.Stacked[cls, " n"]) -> None:  # pyright: ignore
        pass

    apply(cls(jnp.ones((5, 3, 2)), jnp.ones((5, 3))))
    with pytest.raises(TypeCheckError) as info:
        apply(cls(jnp.ones((5, 3, 2)), jnp.ones((5, 4))))
    message = str(info.value)
    assert "`models.b` has shape (5, 4)" in message
    assert f"does not match {cls.__qualname__}.b: Float[Array, 'o']" in message
    assert "dimension o is 4 which does not equal the existing value of 3" in message


def test_dataclass_inside_a_module_is_checked():
    class Holder(eqx.Module):
        inner: DataclassLinear
        extra: dict

    ok = Holder(DataclassLinear(jnp.ones((2, 3, 4)), jnp.ones((2, 3))), {})
    assert isinstance(ok, Stacked[Holder, " n"])
    bad = Holder(DataclassLinear(jnp.ones((2, 3, 4)), jnp.ones((2, 5))), {})
    message = Stacked[Holder, " n"].__instancecheck_str__(bad)
    assert "Holder.inner.b` has shape (2, 5)" in message
    assert "DataclassLinear.b" in message
    assert "Holder.inner`) is checked in a scope of its own" in message


class MaybeBias(eqx.Module):
    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None
    scale: jax.Array


def test_optional_and_unannotated_fields():
    annotation = Stacked[MaybeBias, " n"]
    assert isinstance(
        MaybeBias(jnp.ones((3, 2, 4)), None, jnp.ones((3, 9, 9))), annotation
    )
    bad = MaybeBias(jnp.ones((3, 2, 4)), jnp.ones((3, 5)), jnp.ones((3,)))
    assert "`MaybeBias.bias` has shape (3, 5)" in annotation.__instancecheck_str__(bad)


def test_wrong_class_names_the_argument():
    with pytest.raises(TypeCheckError) as info:
        predict(make_linear(5, 2, 4), jnp.ones((5, 3, 4)))  # pyright: ignore
    assert "`models` has type Linear, not MLP" in str(info.value)


def test_typecheck_leaves_other_messages_alone():
    @eb.typecheck
    def use(models: eb.Stacked[dict, " n"]) -> None:
        pass

    # With this option jaxtyping drops the typechecker's exception, and with it the
    # reason; the error is then raised as jaxtyping made it.
    jaxtyping.config.update("jaxtyping_remove_typechecker_stack", True)
    try:
        with pytest.raises(TypeCheckError) as info:
            use({"w": jnp.ones(())})
    finally:
        jaxtyping.config.update("jaxtyping_remove_typechecker_stack", False)
    assert "parameter 'models'" in str(info.value)
    assert "Reason:" not in str(info.value)


def test_nested_checked_functions_add_the_reason_once():
    @eb.typecheck
    def outer(models: dict) -> None:
        inner(models)

    @eb.typecheck
    def inner(models: eb.Stacked[dict, " n"]) -> None:
        pass

    with pytest.raises(TypeCheckError) as info:
        outer({"w": jnp.ones(())})
    assert str(info.value).count("Reason:") == 1
    assert "`models['w']` has shape ()" in str(info.value)


def test_non_array_leaves_are_left_alone():
    tree = {"w": jnp.ones((3, 2)), "name": "abc", "lr": 0.1, "f": jax.nn.relu}
    assert isinstance(tree, Stacked[dict, " n"])
    assert isinstance(make_mlp(3), Stacked[MLP, " n"])  # activation, depth


# ------------------------------------------------------------------------------------
# Unstacked models and dims bound by the rest of the call.


def test_dims_bind_with_the_rest_of_the_call():
    with pytest.raises(TypeCheckError) as info:
        predict(make_mlp(5), jnp.ones((6, 3, 4)))
    assert "parameter 'x'" in str(info.value)
    assert "dimension n is 6 which does not equal the existing value of 5" in str(
        info.value
    )

    with pytest.raises(TypeCheckError) as info:
        predict_x_first(jnp.ones((6, 3, 4)), make_mlp(5))
    message = str(info.value)
    assert (
        "`models.layers[0].weight` has shape (5, 8, 4), whose leading dims" in message
    )
    assert "disagree with the dims bound earlier in the call" in message
    assert "dimension n is 5 which does not equal the existing value of 6" in message


def test_unstacked_module_is_rejected_by_its_field_annotations():
    single = make_linear(None, 3, 4)
    # The trap: a module is Callable, so a PyTree-of-union annotation accepts it.
    loose = PyTree[Float[Array, "n ..."] | Callable]
    assert callable(single) and isinstance(single, loose)

    @eb.typecheck
    def use(models: eb.Stacked[Linear, " n"]) -> None:
        pass

    with pytest.raises(TypeCheckError) as info:
        use(single)
    message = str(info.value)
    assert "`models.weight` has shape (3, 4)" in message
    assert "each member's weight has shape (4,)" in message
    assert "looks like a single, unstacked model" in message


@pytest.mark.accelerator
def test_unstacked_mlp_is_rejected():
    with pytest.raises(TypeCheckError) as info:
        predict_x_first(jnp.ones((8, 3, 4)), make_mlp(None))
    message = str(info.value)
    assert "`models.layers[1].weight` has shape (2, 8): axis 0 is 2" in message
    assert "unstacked" in message


def test_unstacked_model_is_rejected_by_dims_bound_elsewhere():
    @eb.typecheck
    def use(x: Float[Array, "n b"], models: eb.Stacked[dict, " n"]) -> None:
        pass

    use(jnp.ones((3, 2)), {"w": np.ones((3, 4))})
    with pytest.raises(TypeCheckError) as info:
        use(jnp.ones((5, 2)), {"w": np.ones((3, 4))})
    assert "`models['w']` has shape (3, 4), whose leading dims" in str(info.value)
    assert "the existing value of 5" in str(info.value)


def test_return_value_is_checked():
    @eb.typecheck
    def grow(models: eb.Stacked[dict, " n"]) -> eb.Stacked[dict, " n"]:
        return {"w": jnp.concatenate([models["w"], models["w"][:1]])}

    with pytest.raises(TypeCheckError) as info:
        grow({"w": jnp.ones((3, 2))})
    assert "checking the return value" in str(info.value)
    assert "`dict['w']` has shape (4, 2), whose leading dims" in str(info.value)
    assert "the existing value of 3" in str(info.value)


# ------------------------------------------------------------------------------------
# Other ways to turn checking on, and jit.


def test_jaxtyped_with_beartype_shows_the_reason_in_its_cause():
    @jaxtyped(typechecker=beartype)
    def use(x: Float[Array, " n"], models: eb.Stacked[dict, " n"]) -> None:
        pass

    with pytest.raises(TypeCheckError) as info:
        use(jnp.ones(5), {"w": jnp.ones((3, 4))})
    assert "parameter 'models'" in str(info.value)
    # Only `eb.typecheck` records argument names for `Stacked`; the class stands in.
    assert "`dict['w']` has shape (3, 4), whose leading dims" in reasons(info.value)


def test_beartype_alone_shows_the_reason():
    @beartype
    def use(models: eb.Stacked[MLP, " n"]) -> None:
        pass

    use(make_mlp(2))
    with pytest.raises(BeartypeCallHintViolation) as info:
        use(make_mlp(None))
    # Without jaxtyped there is no record of argument names: the class stands in.
    assert "`MLP.layers[1].weight` has shape (2, 8)" in str(info.value)


def test_import_hook(tmp_path, monkeypatch):
    source = """
        import equinox as eqx
        from jaxtyping import Array, Float

        import eqx_batch as eb


        class Linear(eqx.Module):
            weight: Float[Array, "out in"]


        def width(models: eb.Stacked[Linear, " n"], x: Float[Array, "n in"]) -> int:
            return models.weight.shape[2]
    """
    (tmp_path / "eb_hooked_module.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "eb_hooked_module", raising=False)
    with install_import_hook("eb_hooked_module", "beartype.beartype"):
        module = importlib.import_module("eb_hooked_module")
    # The hook checks `Linear.__init__` too, so a stacked model is built per member.
    stacked = eqx.filter_vmap(module.Linear)(jnp.ones((3, 2, 4)))
    assert module.width(stacked, jnp.ones((3, 4))) == 4
    with pytest.raises(TypeCheckError) as info:
        module.width(module.Linear(jnp.ones((2, 4))), jnp.ones((3, 4)))
    assert "`Linear.weight` has shape (2, 4)" in reasons(info.value)


def test_under_jit_checks_run_at_trace_time_only(monkeypatch):
    calls = []
    check = _typing._StackedMeta.__instancecheck_str__

    def counting(cls, obj):
        calls.append(cls)
        return check(cls, obj)

    monkeypatch.setattr(_typing._StackedMeta, "__instancecheck_str__", counting)
    # A function of its own, so that no earlier test has compiled it already.
    jitted = eqx.filter_jit(lambda models, x: predict(models, x))
    models = make_mlp(5)
    jitted(models, jnp.ones((5, 3, 4)))
    traced = len(calls)
    assert traced > 0
    jitted(models, jnp.full((5, 3, 4), 2.0, jnp.float32))
    assert len(calls) == traced
    # The leaves the check saw were tracers, and a mismatch is found while tracing.
    with pytest.raises(TypeCheckError) as info:
        jitted(models, jnp.ones((6, 3, 4)))
    assert "dimension n is 6" in str(info.value)


def test_typecheck_checks_module_init():
    @eb.typecheck
    class Ensemble(eqx.Module):
        members: eb.Stacked[Linear, " n"]
        weights: Float[Array, " n"]

    Ensemble(make_linear(4, 2, 3), jnp.ones(4))
    with pytest.raises(TypeCheckError) as info:
        Ensemble(make_linear(4, 2, 3), jnp.ones(5))
    assert "dimension n is 5 which does not equal the existing value of 4" in str(
        info.value
    )
    with pytest.raises(TypeCheckError) as info:
        Ensemble(make_linear(None, 2, 3), jnp.ones(2))
    assert "`members.weight` has shape (2, 3)" in str(info.value)


def test_static_typing_examples_run():
    import typing_static

    stacked = typing_static.make_stacked(4)
    assert typing_static.stacked_weight(stacked).shape == (4, 3, 2)
    assert typing_static.first_member(stacked).weight.shape == (3, 2)
    assert typing_static.as_affine.weight.shape == (4, 3, 2)


# ------------------------------------------------------------------------------------
# Bindings and the annotation itself.


def test_a_check_binds_only_when_it_passes():
    annotation = Stacked[dict, " n"]
    with jaxtyped("context"):
        assert not isinstance({"a": jnp.ones(3), "b": jnp.ones(4)}, annotation)
        assert isinstance(jnp.ones(5), vector_n)  # `n` was free; now 5
    with jaxtyped("context"):
        assert isinstance({"a": jnp.ones(3)}, annotation)
        assert not isinstance(jnp.ones(5), vector_n)
        assert isinstance(jnp.ones(3), vector_n)
    # Outside any scope the leaves of one value must still agree with each other.
    assert not isinstance({"a": jnp.ones(3), "b": jnp.ones(4)}, annotation)


def test_failing_fields_bind_nothing():
    annotation = Stacked[Linear, " n"]
    bad = Linear(jnp.ones((3, 2, 4)), jnp.ones((3, 5)))  # pyright: ignore
    with jaxtyped("context"):
        assert not isinstance(bad, annotation)
        assert isinstance(jnp.ones(7), vector_n)


def test_stack_of_stacks_is_one_grid():
    grid = eqx.filter_vmap(eqx.filter_vmap(lambda k: make_linear(None, 2, 3)))(
        jnp.zeros((3, 4))
    )
    assert grid.weight.shape == (3, 4, 2, 3)
    nested = Stacked[Stacked[Linear, " n"], " m"]
    assert nested is Stacked[Linear, "m n"]
    assert isinstance(grid, nested)
    assert not isinstance(make_linear(5, 2, 3), nested)

    @eb.typecheck
    def rows(
        models: eb.Stacked[eb.Stacked[Linear, " n"], " m"],  # pyright: ignore
        x: Float[Array, " n"],
    ) -> None:
        pass

    rows(grid, jnp.ones(4))
    with pytest.raises(TypeCheckError):
        rows(grid, jnp.ones(3))


@pytest.mark.accelerator
def test_grid_from_double_filter_vmap_and_stack_ndim_2():
    def make(start: Any) -> MLP:
        return MLP([make_linear(None, 8, 4, start), make_linear(None, 2, 8, start)])

    starts = jnp.arange(15.0).reshape(3, 5)
    grid = eqx.filter_vmap(eqx.filter_vmap(make))(starts)
    annotation = Stacked[MLP, "m n"]
    assert isinstance(grid, annotation)
    assert isinstance(grid, Stacked[MLP, "3 5"])
    assert not isinstance(grid, Stacked[MLP, "5 3"])
    assert not isinstance(eb.index(grid, 0), annotation)  # one row: too few axes
    rows = eb.unstack(grid, ndim=2)
    assert all(
        isinstance(row_stack, Stacked[MLP, " n"]) for row_stack in eb.unstack(grid)
    )
    assert isinstance(rows[2][4], MLP) and not isinstance(
        rows[2][4], Stacked[MLP, " n"]
    )
    assert isinstance(eb.stack(rows, ndim=2), annotation)

    @eb.typecheck
    def predict(
        models: eb.Stacked[MLP, "m n"], x: Float[Array, "m n b 4"]
    ) -> Float[Array, "m n b 2"]:
        over_members = eb.filter_vmap(apply_mlp)
        return eb.filter_vmap(over_members)(models, x)

    x = jnp.ones((3, 5, 7, 4))
    out = predict(grid, x)
    assert out.shape == (3, 5, 7, 2)
    assert tree_allclose(out[2, 4], apply_mlp(rows[2][4], x[2, 4]))
    with pytest.raises(TypeCheckError, match="m n"):
        predict(grid, jnp.ones((5, 3, 7, 4)))


def test_annotation_is_cached_and_named():
    assert Stacked[MLP, "n"] is Stacked[MLP, "  n "]
    assert Stacked[MLP, "n"] is not Stacked[MLP, "m"]
    assert repr(Stacked[MLP, "chains 4"]) == "eqx_batch.Stacked[MLP, 'chains 4']"


@pytest.mark.parametrize(
    "item, words",
    [
        ((dict,), "takes a class and a dims string"),
        ((dict[str, int], "n"), "must be a class"),
        ((dict, 3), "dims must be a string"),
        ((dict, "n-1"), "contain 'n-1'"),
        ((dict, "n ..."), "contain '...'"),
        ((dict, "  "), "at least one leading dim"),
    ],
)
def test_bad_annotations(item, words):
    with pytest.raises(eb.BatchError, match="eb.Stacked") as info:
        Stacked[item if len(item) != 1 else item[0]]
    assert words in str(info.value)


def test_a_model_of_another_class_of_the_same_name_is_named_by_module(getkey):
    class Linear(eqx.Module):
        weight: jax.Array

    ours: Any = Linear(jnp.ones((3, 2, 2)))  # deliberately not the annotated class

    @eb.typecheck
    def apply(models: eb.Stacked[eqx.nn.Linear, " n"]) -> None:
        del models

    with pytest.raises(TypeError) as info:
        apply(ours)
    message = str(info.value)
    assert "equinox" in message and "test_typing" in message
    assert "has type Linear, not Linear" not in message
