"""Traced values in the static part of a transform's output.

A static field (`eqx.field(static=True)`) is part of a pytree's structure, not one of
its leaves, so `jax.vmap` neither batches nor returns what it holds. A value traced
inside the transform and stored there (equinox#312: a Module built per member, with
its per-member numbers in a static field) outlives the trace that made it, and the
next use of the output raises JAX's `UnexpectedTracerError`, far from the cause.
`check_output_static` finds such a value where the output is built, and names it.
"""

import dataclasses
import functools as ft
import types
from collections.abc import Iterator
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .._compiling._compile import StaticPart
from .._compiling._static_key import read_nodes
from .._errors import BatchError, bullet_list, describe, KeyPath, leaf_name
from .._tree import is_tracer


def check_output_static(
    static: StaticPart, transform: str, *, compiled: str | None = None
) -> None:
    """Refuse an output whose static part holds a value traced inside `transform`.

    Called where a trace ends: after `jax.vmap` returns, a tracer it made has ended
    (JAX refuses to trace with it), while a tracer of an enclosing trace (a value
    closed over under `jax.jit`, stored as it is) is still valid and is left alone, as
    Equinox leaves it. A program's body (`lax.scan`'s, `jax.shard_map`'s) is traced
    to a program whose tracers JAX does not mark as ended, and even an unmapped
    argument is traced there: out of such a body (`compiled` names it), every tracer
    is refused.
    Reads the output's structure only, at trace time: nothing is added to the program.

    **Raises:**

    `BatchError` naming each such value by its path in the output (`out.config.a`).
    """
    if not _found(_tracers_in_nodes(static.treedef)):
        return
    tree = jtu.tree_unflatten(static.treedef, static.leaves)
    escaped = [
        f"`{leaf_name('out', path)}`: {describe(tracer)}"
        for path, tracer in _static_tracers(tree, (), in_static=False)
        if compiled is not None or _trace_ended(tracer)
    ]
    if not escaped:
        return
    cause = "" if compiled is None else f"{compiled}, where every array is traced. "
    raise BatchError(
        f"the output of {transform} holds traced values in static fields:"
        f"\n{bullet_list(escaped)}\n{cause}Drop static=True, or compute them outside "
        f"{transform} (see docs/transforms.md#what-is-refused)."
    )


def _found(tracers: Iterator[Any]) -> bool:
    """Whether `tracers` yields any (`any` would ask each tracer its truth value)."""
    return next(tracers, None) is not None


def _tracers_in_nodes(treedef: Any) -> Iterator[Any]:
    """The tracers in the data of `treedef`'s nodes, at any depth."""
    for node in read_nodes(treedef):
        data = node[2]
        if data is not None:
            yield from _tracers_in(data)


def _tracers_in(value: Any, depth: int = 0) -> Iterator[Any]:
    """The tracers in `value`: its leaves, the data of its nodes, the fields of a
    plain dataclass (as an older Equinox keeps a Module's static fields), and what a
    closure, a `functools.partial` or a plain object holds (`_held`)."""
    if type(value) is tuple:
        # A Module's node data: mostly numbers, strings and functions, which hold none.
        for item in value:
            if type(item) not in _ATOMS:
                yield from _tracers_in(item, depth)
            elif type(item) is types.FunctionType and item.__closure__:
                yield from _tracers_in(_held(item), depth + 1)
        return
    leaves, treedef = jtu.tree_flatten(value)
    for leaf in leaves:
        if is_tracer(leaf):
            yield leaf
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = dataclasses.fields(leaf)
            yield from _tracers_in(
                tuple(getattr(leaf, f.name, None) for f in fields), depth
            )
        elif depth < _DEPTH and not isinstance(leaf, _ATOM_TYPES):
            held = _held(leaf)
            if held:
                yield from _tracers_in(held, depth + 1)
    for node in read_nodes(treedef):
        # A static node (`jax.tree_util.register_static`) is its own data.
        if node[2] is not None and node[2] is not value:
            yield from _tracers_in(node[2], depth)


def _held(value: Any) -> tuple[Any, ...]:
    """What a closure (its cells), a `functools.partial` (its function and
    arguments) or a plain object (its attributes) holds; () for anything else."""
    if isinstance(value, types.FunctionType):
        return tuple(cell.cell_contents for cell in value.__closure__ or ())
    if isinstance(value, ft.partial):
        return (value.func, value.args, tuple(value.keywords.values()))
    if isinstance(value, (type, types.ModuleType)) or not hasattr(value, "__dict__"):
        return ()
    return tuple(vars(value).values())


# How deep `_tracers_in` looks into closures, partials and plain objects: a value
# held there may hold others, up to whole programs (a bound method's object).
_DEPTH = 3
# Types whose values hold no tracer, to skip without flattening (a function's
# closure is read apart).
_ATOMS = frozenset(
    {int, float, complex, bool, str, bytes, type(None)}
    | {types.FunctionType, types.BuiltinFunctionType}
)
_ATOM_TYPES = (int, float, complex, bool, str, bytes, type(None), np.ndarray)


def _static_tracers(
    node: Any, path: KeyPath, *, in_static: bool
) -> Iterator[tuple[KeyPath, Any]]:
    """The tracers in the static parts of the pytree `node`, with their paths: in a
    dataclass's fields that are not children (a Module's static fields), by the
    field's path; in another node's static data, by the node's path. `in_static`: all
    of `node` is inside a static part, its leaves too."""
    if is_tracer(node):
        if in_static:
            yield path, node
        return
    children, treedef = jtu.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    # A leaf has no node data; a node without children (a Module whose fields are all
    # static) has, and `treedef_is_leaf` would count it a leaf and skip its fields.
    if treedef.node_data() is None:
        if in_static:
            yield from ((path, tracer) for tracer in _tracers_in(node))
        return
    for key_path, child in children:
        yield from _static_tracers(child, (*path, *key_path), in_static=in_static)
    kind_and_data = treedef.node_data()
    data = None if kind_and_data is None else kind_and_data[1]
    if data is None or data is node or not _found(_tracers_in(data)):
        return
    if not dataclasses.is_dataclass(node):
        yield from ((path, tracer) for tracer in _tracers_in(data))
        return
    dynamic = {key.name for (key, *_), _ in children if isinstance(key, jtu.GetAttrKey)}
    for field in dataclasses.fields(node):
        if field.name not in dynamic:
            value = getattr(node, field.name, None)
            field_path = (*path, jtu.GetAttrKey(field.name))
            yield from _static_tracers(value, field_path, in_static=True)


def _trace_ended(tracer: Any) -> bool:
    """Whether `tracer`'s trace has ended: JAX then refuses to trace anything with it.

    `jax.eval_shape` traces without compiling or running, and takes a live tracer of
    an enclosing trace (closed over) as it would under `jax.jit`. It tells an ended
    `jax.vmap` trace, not an ended program trace (`lax.scan`'s body, `jax.jit`).
    """
    try:
        jax.eval_shape(lambda: jax.lax.optimization_barrier(tracer))
    except jax.errors.UnexpectedTracerError:
        return True
    return False
