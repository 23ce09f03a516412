"""What a tree structure says about its leaves: their paths, and the jaxtyping array
annotations of the fields that hold them (for `Stacked`'s check).

Fields are read from the classes that declare them: `eqx.Module`s, other dataclasses
(such as those registered with `jax.tree_util.register_dataclass`) and NamedTuples. A
field's annotation applies to a leaf that the class's flattening keys by the field's
name; the leaves of other pytrees have no annotations here."""

import dataclasses
import functools as ft
import inspect
import types
import typing
from typing import Any, NamedTuple

import jax.tree_util as jtu
from jaxtyping import AbstractArray

from .._errors import KeyPath


# The leaf index of an annotated field holding a leaf directly, and the field's types
# (any of which may match).
Field = tuple[int, tuple[type[AbstractArray], ...]]


class Instance(NamedTuple):
    """A module, dataclass or NamedTuple in the tree with array-annotated fields."""

    path: KeyPath
    cls: type
    fields: tuple[Field, ...]


class LeafAnnotations(NamedTuple):
    """Where a tree structure's leaves are and which fields annotate them.

    Computed once per treedef: everything a `Stacked` check needs from the structure.
    """

    paths: tuple[KeyPath, ...]  # per leaf, in `tree_flatten` order
    instances: tuple[Instance, ...]


# Annotations by treedef. A check that runs (each trace, or each eager call) then costs
# one C flatten plus a few operations per array leaf, rather than a Python walk of the
# tree.
_ANNOTATIONS: dict[Any, LeafAnnotations] = {}
_MAX_ANNOTATIONS = 1024


def flatten_annotated(obj: Any) -> tuple[list[Any], LeafAnnotations]:
    leaves, treedef = jtu.tree_flatten(obj)
    try:
        annotations = _ANNOTATIONS.get(treedef)
    except TypeError:
        # A static field holds something unhashable: annotate without caching.
        return leaves, _annotate(obj)
    if annotations is None:
        if len(_ANNOTATIONS) >= _MAX_ANNOTATIONS:
            _ANNOTATIONS.clear()
        annotations = _ANNOTATIONS[treedef] = _annotate(obj)
    return leaves, annotations


def _annotate(obj: Any) -> LeafAnnotations:
    paths: list[KeyPath] = []
    instances: list[Instance] = []

    def walk(node: Any, path: KeyPath) -> None:
        annotated = _field_array_types(type(node)) if _has_fields(type(node)) else {}
        own = []

        def is_child(x: Any) -> bool:
            return x is not node and _has_fields(type(x))

        # Stopping at child modules keeps `tree_flatten`'s leaf order while telling
        # which module each leaf belongs to.
        for sub_path, leaf in jtu.tree_flatten_with_path(node, is_leaf=is_child)[0]:
            if is_child(leaf):
                walk(leaf, path + sub_path)
                continue
            types_ = ()
            if len(sub_path) == 1 and isinstance(sub_path[0], jtu.GetAttrKey):
                types_ = annotated.get(sub_path[0].name, ())
            if types_:
                own.append((len(paths), types_))
            paths.append(path + sub_path)
        if own:
            instances.append(Instance(path, type(node), tuple(own)))

    walk(obj, ())
    return LeafAnnotations(tuple(paths), tuple(instances))


@ft.cache
def _has_fields(cls: type) -> bool:
    # Every `eqx.Module` is a dataclass. A dataclass that is not a pytree is a leaf,
    # with no fields below it to annotate.
    return dataclasses.is_dataclass(cls) or (
        issubclass(cls, tuple) and hasattr(cls, "_fields")
    )


@ft.cache
def _field_array_types(cls: type) -> dict[str, tuple[type[AbstractArray], ...]]:
    """For each field of `cls` annotated with jaxtyping array types, those types.

    A field annotated with a union counts only if every member of the union other than
    `None` is a jaxtyping array type: a union with, say, `jax.Array` in it accepts any
    array, so it constrains nothing.
    """
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        # Unresolvable forward references: use the annotations that are already
        # objects rather than fail the check over annotations we cannot read.
        hints = {}
        for base in reversed(cls.__mro__):
            for name, hint in vars(base).get("__annotations__", {}).items():
                if not isinstance(hint, str):
                    hints[name] = hint
    if dataclasses.is_dataclass(cls):
        names = [field.name for field in dataclasses.fields(cls)]
    else:
        names = list(getattr(cls, "_fields", ()))
    out = {}
    for name in names:
        hint = hints.get(name)
        if hint is None:
            continue
        members = typing.get_args(hint) if _is_union(hint) else (hint,)
        members = tuple(m for m in members if m is not type(None))
        if members and all(_is_array_type(m) for m in members):
            out[name] = members
    return out


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _is_array_type(hint: Any) -> bool:
    return inspect.isclass(hint) and issubclass(hint, AbstractArray)
