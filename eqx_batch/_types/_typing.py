"""`Stacked[Model, "n"]` annotations: stacked modules as types that `typecheck` checks.

`Stacked[Model, dims]` is a class whose metaclass implements `__instancecheck__` (and
the `__instancecheck_str__` message hook read by beartype and jaxtyping), as jaxtyping's
`Float[Array, "n"]` is. Its leading dims bind in jaxtyping's per-call memo, so they are
checked against every other annotation of the call. That memo has no public reader, so
the dims are bound the public way: by checking a jaxtyping array type,
`Shaped[Any, dims]`, against the leading shape, and jaxtyping binds or compares them.
"""

import dataclasses
import functools as ft
import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple, TYPE_CHECKING

import jaxtyping
from jaxtyping import AbstractArray, Shaped

from .._errors import BatchError, leaf_name, type_names
from .._tree import is_array
from ._leaf_annotations import Field, flatten_annotated, Instance, LeafAnnotations
from ._typecheck import CHECKED_ARGUMENTS


# ------------------------------------------------------------------------------------
# The check.


def _argument_name(obj: Any) -> str:
    # The checked value is one of the call's arguments unless it is a return value, or
    # is checked outside `typecheck`: then its class stands in.
    for name, value in (CHECKED_ARGUMENTS.get() or {}).items():
        if value is obj:
            return name
    return type(obj).__qualname__


class _MemberShape(NamedTuple):
    """A shape and dtype, as jaxtyping reads them from an array."""

    shape: tuple[int, ...]
    dtype: Any


@ft.cache
def _shape_only(array_type: type[AbstractArray]) -> type[AbstractArray]:
    """`array_type` with its array class relaxed to "anything with shape and dtype".

    It checks a `_MemberShape` rather than a slice of the leaf: slicing would cost a
    device operation per call outside `jit`.
    """
    return array_type.dtype[Any, array_type.dim_str]  # pyright: ignore


class _Dim(NamedTuple):
    name: str | None
    size: int | None


def _parse_dims(dims: str) -> tuple[_Dim, ...]:
    parsed = []
    for elem in dims.split():
        if elem.isidentifier():
            parsed.append(_Dim(elem, None))
        elif elem.isdigit():
            parsed.append(_Dim(None, int(elem)))
        else:
            raise BatchError(
                f"eb.Stacked dims {dims!r} contain {elem!r}; use names and sizes: "
                "'chains 4'."
            )
    if not parsed:
        raise BatchError(
            "eb.Stacked needs at least one leading dim, e.g. eb.Stacked[Model, 'n']."
        )
    return tuple(parsed)


class _StackedMeta(type):
    model: type
    dims: str
    parsed_dims: tuple[_Dim, ...]
    leading: type[AbstractArray]  # `Shaped[Any, dims]`: binds the dims in jaxtyping

    def __repr__(cls) -> str:
        return f"eqx_batch.Stacked[{cls.model.__qualname__}, {cls.dims!r}]"

    def __instancecheck__(cls, obj: Any) -> bool:
        return cls.__instancecheck_str__(obj) == ""

    def __instancecheck_str__(cls, obj: Any) -> str:
        """Empty if `obj` matches; else why not, naming the leaf and the dims."""
        argname = _argument_name(obj)
        if not isinstance(obj, cls.model):
            # Qualified by module when the names alone would read "Linear, not Linear".
            found, expected = type_names(type(obj), cls.model)
            return f"`{argname}` has type {found}, not {expected} as {cls!r} expects."
        leaves, annotations = flatten_annotated(obj)
        return _StackCheck(cls, argname, leaves, annotations).run()

    def unstacked_hint(cls) -> str:
        return (
            "Field shapes fit their annotations without the leading dims, so this "
            "looks like a single, unstacked model: stack the members (eb.stack) so "
            f"that every array leaf gains the leading dims {cls.dims!r}."
        )


@dataclasses.dataclass
class _StackCheck:
    """One check of a value against a `Stacked` annotation, and what its steps share.

    The steps, in order: every array leaf has the same leading shape, fitting the
    fixed sizes; each module instance's fields fit their annotations per member; and
    last, so that a failing check binds nothing, the leading shape binds (or is
    compared with) the call's dims in jaxtyping's memo.
    """

    annotation: _StackedMeta
    argname: str
    leaves: list[Any]
    annotations: LeafAnnotations
    # The leading shape, and the first array leaf, which set it.
    lead_shape: tuple[int, ...] | None = None
    lead_leaf: int = -1

    def run(self) -> str:
        message = self.check_leading()
        if message:
            fields = [
                f for instance in self.annotations.instances for f in instance.fields
            ]
            return self.with_hint(message, fields)
        if self.lead_shape is None:
            return ""  # No array leaf: nothing has leading dims.
        # Instances that have the same class and member shapes pass or fail together
        # (they start from the same bindings): a stack of 40 identical layers is
        # checked once.
        passed = set()
        for instance in self.annotations.instances:
            signature = (instance.cls,) + tuple(
                _member_signature(self.leaves[index], len(self.lead_shape))
                for index, _ in instance.fields
            )
            if signature in passed:
                continue
            message = self.check_instance(instance)
            if message:
                return self.with_hint(message, instance.fields)
            passed.add(signature)
        return self.check_call()

    def with_hint(self, message: str, fields: Sequence[Field]) -> str:
        if _looks_unstacked(self.leaves, fields):
            message += " " + self.annotation.unstacked_hint()
        return message

    def name(self, index: int) -> str:
        return leaf_name(self.argname, self.annotations.paths[index])

    def check_leading(self) -> str:
        """Every array leaf has at least the leading axes, and the same sizes there."""
        cls = self.annotation
        lead = len(cls.parsed_dims)
        for index, leaf in enumerate(self.leaves):
            if not is_array(leaf):
                continue
            shape = tuple(leaf.shape)
            if len(shape) < lead:
                return (
                    f"`{self.name(index)}` has shape {shape}, with fewer axes than the "
                    f"leading member dims {cls.dims!r} of {cls!r}: it looks unstacked. "
                    "Stack the members so that every array leaf gains those leading "
                    "axes (eb.stack)."
                )
            if self.lead_shape is None:
                self.lead_shape, self.lead_leaf = shape[:lead], index
            for axis, dim in enumerate(cls.parsed_dims):
                size = shape[axis]
                expected = dim.size if dim.name is None else self.lead_shape[axis]
                if size == expected:
                    continue
                message = (
                    f"`{self.name(index)}` has shape {shape}: axis {axis} is {size}, "
                    f"but {cls!r} expects "
                )
                if dim.name is None:
                    return message + f"it to be {expected}."
                return message + (
                    f"{dim.name}={expected}, as bound by "
                    f"`{self.name(self.lead_leaf)}`. Every array leaf of a stacked "
                    "model needs the same leading dims."
                )
        return ""

    def lead_member_shape(self) -> _MemberShape:
        return _MemberShape(self.lead_shape or (), self.leaves[self.lead_leaf].dtype)

    def check_call(self) -> str:
        """Binds the leading dims in the call's scope, or says how they disagree."""
        reason = self.annotation.leading.__instancecheck_str__(  # pyright: ignore
            self.lead_member_shape()
        )
        if not reason:
            return ""
        leaf = self.leaves[self.lead_leaf]
        message = (
            f"`{self.name(self.lead_leaf)}` has shape {tuple(leaf.shape)}, whose "
            f"leading dims {self.annotation.dims!r} disagree with the dims bound "
            f"earlier in the call: {reason}."
        )
        return self.with_hint(
            message,
            [f for instance in self.annotations.instances for f in instance.fields],
        )

    def check_instance(self, instance: Instance) -> str:
        """Checks per-member shapes against field annotations in one fresh scope.

        The scope starts from the leading dims, so a field dim named like one of them
        must agree with it. Field dims bind in this scope only, so each instance (each
        layer) binds its own, and none of them binds the call's.
        """
        lead = len(self.annotation.parsed_dims)
        with jaxtyping.jaxtyped("context"):
            # Binds the leading dims in the fresh scope, where nothing can disagree.
            isinstance(self.lead_member_shape(), self.annotation.leading)
            for index, field_types in instance.fields:
                leaf = self.leaves[index]
                if not is_array(leaf):
                    continue
                member = _MemberShape(tuple(leaf.shape[lead:]), leaf.dtype)
                reasons = []
                for array_type in field_types:
                    if array_type.array_type is not Any and not isinstance(
                        leaf, array_type.array_type
                    ):
                        reasons.append(
                            f"it has type {type(leaf).__qualname__}, not "
                            f"{array_type.array_type.__qualname__}"
                        )
                        continue
                    reason = _shape_only(array_type).__instancecheck_str__(member)  # pyright: ignore
                    if not reason:
                        break
                    reasons.append(reason)
                else:
                    return self.field_message(instance, index, field_types, reasons)
        return ""

    def field_message(
        self,
        instance: Instance,
        index: int,
        field_types: tuple[type[AbstractArray], ...],
        reasons: list[str],
    ) -> str:
        cls = self.annotation
        lead = len(cls.parsed_dims)
        leaf = self.leaves[index]
        field = self.annotations.paths[index][-1].name
        annotation = " | ".join(t.__name__ for t in field_types)
        owner = instance.cls.__qualname__
        bindings = ", ".join(
            f"{dim.name}={size}"
            for dim, size in zip(cls.parsed_dims, self.lead_shape or (), strict=True)
            if dim.name is not None
        )
        return (
            f"`{self.name(index)}` has shape {tuple(leaf.shape)}, so each member's "
            f"{field} has shape {tuple(leaf.shape[lead:])}, which does not match "
            f"{owner}.{field}: {annotation}: {'; '.join(reasons)}. This {owner} "
            f"instance (`{leaf_name(self.argname, instance.path)}`) is checked in a "
            f"scope of its own, starting from the leading dims ({bindings or 'none'})."
        )


def _member_signature(leaf: Any, lead: int) -> Any:
    if not is_array(leaf):
        return None
    return type(leaf), tuple(leaf.shape[lead:]), leaf.dtype


def _looks_unstacked(leaves: list[Any], fields: Sequence[Field]) -> bool:
    # A leaf whose whole shape has exactly the rank its field annotation asks for
    # carries no member axes.
    return any(
        is_array(leaves[index])
        and array_type.index_variadic is None
        and len(array_type.dims) == len(leaves[index].shape)
        for index, field_types in fields
        for array_type in field_types
    )


class _Stacked:
    """`Stacked[Model, "n"]`: a `Model` whose array leaves have leading member axes.

    A stacked model (an ensemble, a stack of layers, a batch of chains) is one `Model`
    instance whose every array leaf has extra leading axes. This annotation says so in
    a signature, and, with [`eb.typecheck`][] (or `jaxtyping.jaxtyped(typechecker=
    beartype)`, or jaxtyping's import hook), checks it: the class, the leading dims of
    every array leaf, and the per-member shape of every field annotated with a
    jaxtyping array type (`weight: Float[Array, "out in"]`). Leading dim names bind
    with the rest of the call, like the names in `Float[Array, "n b 4"]`.

    Fields are read from `eqx.Module`s, other dataclasses (such as those registered
    with `jax.tree_util.register_dataclass`) and NamedTuples; the leaves of other
    pytrees have their leading dims checked only. Each such instance in the tree is
    checked in a scope of its own, which starts from the leading dims: a field dim
    named like a leading dim must agree with it. The names an instance binds itself
    are forgotten when it is done: two layers of one class each bind their own `out`
    and `in`, and field dims neither bind nor see the call's other dims (`in` of a
    field is not compared with `in` of another argument).

    A stack of stacks, `Stacked[Stacked[Model, "n"], "m"]`, is the same annotation as
    `Stacked[Model, "m n"]`: a `Model` whose array leaves lead with `(m, n)`.

    An unstacked model is rejected wherever shapes can tell: when a field annotation
    leaves no room for the leading dims, or when another argument has bound them.
    Array leaves (JAX arrays, tracers, NumPy arrays) are checked directly, not through
    `jaxtyping.PyTree`; other leaves (activation functions, Python numbers) are left
    alone. Under `jit` all of this runs once per trace.

    Static type checkers read `Stacked[Model, "n"]` as `Model`, so a stacked model is
    accepted wherever a `Model` is. (For the same reason they reject
    `isinstance(x, eb.Stacked[...])`, which works at run time.)

    Checks only run under a typechecker. With jaxtyping's import hook, a module's
    `__init__` is checked against its field annotations too, so build stacked modules
    with `eb.stack` or by vmapping the constructor (`eqx.filter_vmap(Linear)(...)`).

    **Arguments** (as subscripts):

    - `Model`: the class of the stacked model: an `eqx.Module` subclass, `dict`,
        `tuple`, a NamedTuple, or any pytree class.
    - `dims`: the leading member dims, separated by spaces: names and fixed sizes,
        such as `"n"`, `"chains 4"` or `"m n"` (a grid).

    **Returns:**

    A class for use in annotations and `isinstance`.

    **Raises:**

    `eb.BatchError` if `Model` is not a class or `dims` is not a string of names and
    sizes. A value that does not match fails `isinstance`; under a typechecker the
    violation's message names the leaf path (under `eb.typecheck`, after the
    argument's name; elsewhere after the class's), its shape and the expected dims.

    !!! Example

        ```python
        from jaxtyping import Array, Float

        class Linear(eqx.Module):
            weight: Float[Array, "out in"]
            bias: Float[Array, "out"]

        @eb.typecheck
        def predict(
            models: eb.Stacked[Linear, "n"], x: Float[Array, "n b in"]
        ) -> Float[Array, "n b out"]:
            return jax.vmap(lambda m, x: x @ m.weight.T + m.bias[None])(models, x)

        models = Linear(jnp.ones((5, 2, 3)), jnp.zeros((5, 2)))
        predict(models, jnp.ones((5, 7, 3)))  # 5 members, each 3 -> 2
        # predict(models, jnp.ones((6, 7, 3))) raises: n is 5 for models, 6 for x.
        ```
    """

    def __class_getitem__(cls, item: tuple[type, str]) -> type:
        if not isinstance(item, tuple) or len(item) != 2:
            raise BatchError(
                f"eb.Stacked takes a class and a dims string, as in "
                f"eb.Stacked[Model, 'n']; got {item!r}."
            )
        model, dims = item
        if isinstance(model, _StackedMeta) and isinstance(dims, str):
            # A stack of stacks is one model with both dims, outer first: the leaves
            # of `Stacked[Stacked[Linear, "n"], "m"]` have leading axes (m, n).
            return _make_stacked(model.model, " ".join(dims.split() + [model.dims]))
        if not inspect.isclass(model):
            raise BatchError(f"eb.Stacked[{model!r}, ...]: the model must be a class.")
        if not isinstance(dims, str):
            raise BatchError(
                f"eb.Stacked[{model.__qualname__}, {dims!r}]: dims must be a string."
            )
        return _make_stacked(model, " ".join(dims.split()))


@ft.cache
def _make_stacked(model: type, dims: str) -> type:
    name = f"Stacked[{model.__qualname__}, {dims!r}]"
    return _StackedMeta(
        name,
        (),
        {
            "model": model,
            "dims": dims,
            "parsed_dims": _parse_dims(dims),
            "leading": Shaped[Any, dims],
            "__module__": "eqx_batch",
            "__doc__": f"An instance of {model.__qualname__} stacked along {dims!r}.",
        },
    )


_Stacked.__name__ = _Stacked.__qualname__ = "Stacked"
_Stacked.__module__ = "eqx_batch"

if TYPE_CHECKING:
    # Static checkers see `Stacked[Model, "n"]` as `Model`, as jaxtyping does for
    # `Float[Array, "n"]`; importing `Annotated` under a new name is what pyright
    # accepts (`Annotated` is a special form, so assigning it does not work).
    from typing import Annotated as Stacked
else:
    Stacked = _Stacked
