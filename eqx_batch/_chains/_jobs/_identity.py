"""A run's identity: what makes two calls of `run_chains` the same run.

It is what decides the run's results: `init`'s structure and values, the chains' keys,
the counts, what `step` computes (a digest of its traced program, the jaxpr, of the
values of its constants and of the code and closures of its host callbacks, never its
name), and what decides JAX's random bits (the versions of JAX and jaxlib and its PRNG
configuration). Every checkpoint file records it, and a
checkpoint of another run is refused, saying what differs.
"""

import dataclasses
import functools as ft
import hashlib
import importlib.metadata
import json
import re
import types
from collections.abc import Iterator, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from ..._compiling._compile import all_equations
from ..._errors import BatchError, describe, qualified_name
from ..._tree import host_array, is_array, is_key


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:16]


def _without_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _stable_name(x: Any) -> str:
    """A name of `x` that is the same in every process: no memory addresses."""
    # Functions, and wrappers such as `jax.custom_jvp` (`jax.nn.relu`), by name: their
    # repr would be an anonymous object at an address.
    return qualified_name(x) or _without_addresses(repr(x))


def _kind(like: Any) -> str:
    """The dtype of an array, or the implementation of typed PRNG keys."""
    if is_key(like):
        # JAX offers the implementation of arrays only.
        return str(jr.key_impl(jnp.zeros((0,), like.dtype)))
    return str(like.dtype)


def _values_digest(tree: Any) -> str:
    """A digest of the paths and values of `tree`'s leaves (typed PRNG keys by their
    implementation and raw data)."""
    parts = []
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        parts.append(jtu.keystr(path).encode())
        if is_array(leaf):
            data = np.ascontiguousarray(host_array(leaf))
            parts.append(f"{_kind(leaf)}{data.shape}".encode())
            parts.append(data.tobytes())
        else:
            parts.append(_stable_name(leaf).encode())
    return _digest(*parts)


def step_values(step: Any) -> str:
    """A digest of what `step` carries as a pytree: its structure (its function, a
    Module's static fields) and the paths and values of its leaves (a
    `functools.partial`'s arguments, a Module's fields). Its arrays are arguments of
    the compiled loop, its other leaves and its structure part of its program.

    An array split over the processes of a job (not fully addressable) is one array
    of the job, of which each process holds its own shards: it is named by its shape
    and dtype alone.
    """
    leaves = jtu.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype)
            if isinstance(x, jax.Array) and not x.is_fully_addressable
            else x
        ),
        step,
    )
    structure = _without_addresses(str(jtu.tree_structure(step)))
    return _digest(structure.encode(), _values_digest(leaves).encode())


class _Unidentifiable(Exception):
    """A host callback reaches a value whose identity cannot be written down."""


def _host_callbacks(jaxpr: jax.extend.core.Jaxpr) -> Iterator[tuple[str, Any]]:
    """`(primitive name, function)` of every host callback in `jaxpr`, nested ones
    included, whose result the program uses (`jax.debug.callback` returns nothing)."""
    for equation in all_equations(jaxpr):
        name = equation.primitive.name
        if name.endswith("callback") and name != "debug_callback":
            callback = equation.params.get("callback")
            # JAX wraps the user's function; its attribute is not public API, so a
            # JAX that names it otherwise gets the wrapper, which is refused below.
            yield name, getattr(callback, "callback_func", callback)


def _value_parts(x: Any, walking: frozenset[int]) -> Iterator[bytes]:
    """What identifies `x`, a host callback or a value it closes over: numbers,
    strings and arrays by value, containers of them item by item, modules, classes
    and builtins by name, functions by their own code, closure cells and defaults,
    and other objects by their repr when it holds no memory address. `walking` holds
    the ids of the values `x` is inside, to stop at cycles. Raises `_Unidentifiable`
    for any other value.

    A function's globals are not walked: they reach the whole program (its modules,
    their functions, their state), and a value there with no identity of its own
    would refuse any callback that merely reads it.
    """
    if id(x) in walking:
        yield b"(cycle)"
        return
    walking |= {id(x)}
    if x is None or isinstance(x, bool | int | float | complex | str | bytes):
        yield repr(x).encode()
    elif is_array(x):
        data = np.ascontiguousarray(host_array(x))
        yield f"{data.dtype}{data.shape}".encode() + data.tobytes()
    elif isinstance(x, tuple | list | dict):
        yield f"{type(x).__qualname__}[{len(x)}]".encode()
        items = x.items() if isinstance(x, dict) else enumerate(x)
        for key, value in items:
            yield repr(key).encode()
            yield from _value_parts(value, walking)
    elif isinstance(x, types.ModuleType):
        yield x.__name__.encode()
    elif isinstance(x, type | types.BuiltinFunctionType | np.ufunc):
        # Compiled code: its name says what it is.
        yield (qualified_name(x) or repr(x)).encode()
    elif isinstance(x, ft.partial):
        yield from _value_parts((x.func, x.args, x.keywords), walking)
    elif isinstance(x, types.MethodType):
        yield from _value_parts((x.__func__, x.__self__), walking)
    elif isinstance(x, types.FunctionType):
        yield from _code_parts(x.__code__)
        cells = [cell.cell_contents for cell in x.__closure__ or ()]
        yield from _value_parts((cells, x.__defaults__, x.__kwdefaults__), walking)
    elif " at 0x" not in repr(x):
        # A value that prints itself (a dtype, a config dataclass): its repr is it.
        yield f"{type(x).__qualname__}:{repr(x)}".encode()
    else:
        raise _Unidentifiable(f"{type(x).__qualname__} {_without_addresses(repr(x))}")


def _code_parts(code: types.CodeType) -> Iterator[bytes]:
    """A code object's bytecode, the names it looks up and its constants, the code
    objects of the functions it defines included."""
    yield code.co_code
    yield repr(code.co_names).encode()
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _code_parts(constant)
        else:
            yield repr(constant).encode()


def _callbacks_digest(program: jax.extend.core.ClosedJaxpr) -> str | None:
    """A digest of the code and closures of the step's host callbacks; None if it has
    none. The jaxpr names a callback by its function's name only, so an edited
    function would otherwise resume the run it no longer computes."""
    parts = []
    for primitive, function in _host_callbacks(program.jaxpr):
        parts.append(primitive.encode())
        try:
            parts.extend(_value_parts(function, frozenset()))
        except _Unidentifiable as e:
            raise BatchError(
                f"`step` calls `{primitive}` with "
                f"{qualified_name(function) or describe(function)}, which reaches a "
                f"value that cannot be identified ({e}): pass it as arrays "
                "(see docs/chains.md#what-is-refused)."
            ) from None
    return _digest(*parts) if parts else None


def _step_digests(program: jax.extend.core.ClosedJaxpr) -> dict[str, str]:
    """Digests of what a step computes: its traced program and its constants' values.

    The printed jaxpr names variables by position and functions by name, so it is the
    same in every process (once the addresses in reprs are dropped); the constants
    (arrays the step closes over, or is given through `functools.partial`) are
    compared by value.
    """
    text = _without_addresses(str(program.jaxpr))
    consts = list(program.consts)
    digests = {
        "step program": _digest(text.encode()),
        "step constants": _values_digest(consts),
    }
    callbacks = _callbacks_digest(program)
    if callbacks is not None:
        digests["step callbacks"] = callbacks
    return digests


def _jax_versions() -> dict[str, str]:
    """What decides JAX's random bits besides the keys: its version, and its PRNG
    configuration (`jax_threefry_partitionable` changed its default in JAX 0.5)."""
    config = jax.config.values
    return {
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "prng": (
            f"default {config['jax_default_prng_impl']}, threefry_partitionable="
            f"{config['jax_threefry_partitionable']}"
        ),
    }


_EXPLAINED = {
    "step program": "`step` computes something else (its traced program differs)",
    "step constants": (
        "`step`'s constants differ (arrays it closes over or is given through "
        "`functools.partial`)"
    ),
    "init values": "`init` holds other values",
    "data values": "`data` holds other values",
    "shared values": "`shared` holds other values",
    "keys": "the chains' keys differ (another `key`)",
    "step callbacks": (
        "the code or data of a host callback of `step` differs (an edited function)"
    ),
}
# Random bits may change with these, so a run must not continue across them.
_RANDOM_BITS = ("jax", "jaxlib", "prng")


class RunOptions(NamedTuple):
    """The arguments of `run_chains` besides `step`, `init` and `key` that change its
    results or where it stops."""

    num_steps: int
    thin: int
    burn_in: int
    with_output: bool
    trace: bool
    diagnostics: bool
    all_chains: bool  # whether `step` takes every chain at once
    superchains: int | None  # what `until`'s nested R-hat and the diagnostics group
    until: str | None  # the stopping rule's criteria and interval, if any


def identity_fields(
    init: Any,
    keys: jax.Array,
    options: RunOptions,
    data: Any = None,
    program: jax.extend.core.ClosedJaxpr | None = None,
    shared: Any = None,
) -> dict[str, str]:
    """`RunIdentity.fields` of a run from `init` and `keys` with `options` (and
    `data`); those of `step` only given `program`, its traced program (a run without
    a checkpoint does not trace it on every call)."""
    leaves, treedef = jtu.tree_flatten_with_path(init)
    fields = {
        "init structure": _without_addresses(str(treedef)),
        "init leaves": "; ".join(
            f"{jtu.keystr(path)}: "
            + (describe(leaf) if is_array(leaf) else _stable_name(leaf))
            for path, leaf in leaves
        ),
        "init values": _values_digest(init),
        "keys": _values_digest(keys),
        **{name: str(value) for name, value in options._asdict().items()},
        **({} if program is None else _step_digests(program)),
        **_jax_versions(),
    }
    if data is not None:
        # Only for runs of many problems: every other run keeps its identity.
        fields["data structure"] = _without_addresses(str(jtu.tree_structure(data)))
        fields["data values"] = _values_digest(data)
        # For messages: the other fields give no count of problems.
        rows = next(x for x in jtu.tree_leaves(data) if is_array(x))
        fields["data problems"] = str(np.shape(rows)[0])
    if shared is not None:
        # Each problem's shared state (`shared=`), as the run was given it.
        fields["shared structure"] = _without_addresses(str(jtu.tree_structure(shared)))
        fields["shared values"] = _values_digest(shared)
    return fields


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What makes two calls of `run_chains` the same run, as named strings."""

    fields: Mapping[str, str]
    # `trace` as this call gave it, for messages: the fields record only whether the
    # run records draws (`True` and `"disk"` are one run).
    trace_mode: bool | Literal["disk"] | None = dataclasses.field(
        default=None, compare=False
    )

    @classmethod
    def of(
        cls,
        program: jax.extend.core.ClosedJaxpr,
        init: Any,
        keys: jax.Array,
        options: RunOptions,
        data: Any = None,
        trace_mode: bool | Literal["disk"] | None = None,
        shared: Any = None,
    ) -> "RunIdentity":
        """The identity of a run of the traced step `program` from `init` (the whole
        state, non-array leaves included) and `keys`, with `options` (and `data`, of
        many problems; `trace_mode`, `trace` as given, names it in messages; `shared`,
        each problem's shared state, with `shared=`)."""
        return cls(
            identity_fields(init, keys, options, data, program, shared), trace_mode
        )

    @property
    def run_id(self) -> str:
        """A short digest of the whole identity: part of every file name of the run."""
        return _digest(json.dumps(dict(self.fields), sort_keys=True).encode())

    def differences(self, saved: Mapping[str, str]) -> list[str]:
        """What differs between this identity and `saved`, one line each."""
        lines, skipped = [], set()
        data = _data_difference(saved, self.fields)
        if data is not None:
            # A step given `data` is traced with its row: another program, for the
            # difference named here.
            lines, skipped = [data], {"step program", *_DATA_FIELDS}
        for name, value in self.fields.items():
            if saved.get(name) == value or name in skipped:
                continue
            if name == "trace":
                lines.append(_trace_difference(saved.get(name), value, self.trace_mode))
            elif name in _EXPLAINED:
                lines.append(f"{name}: {_EXPLAINED[name]}")
            elif name in _RANDOM_BITS:
                lines.append(
                    f"{name}: the checkpoint was written with "
                    f"{saved.get(name, 'an older eqx_batch that did not record it')}, "
                    f"this call runs {value}; JAX's random bits may differ between "
                    "them, so the run cannot continue bit for bit"
                )
            else:
                lines.append(
                    f"{name}: the checkpoint has {saved.get(name, '(nothing)')}, this "
                    f"call has {value}"
                )
        return lines


_DATA_FIELDS = ("data structure", "data values", "data problems")


def _data_difference(saved: Mapping[str, str], fields: Mapping[str, str]) -> str | None:
    """The line of `differences` for a run with `data` against one without, if
    either is; else None."""
    if ("data structure" in saved) == ("data structure" in fields):
        return None
    if "data structure" in saved:
        problems = saved.get("data problems", "an unrecorded number of")
        return (
            f"data: the checkpoint was written with `data=` ({problems} problems), "
            "this call has no `data`"
        )
    return (
        "data: the checkpoint was written without `data`, this call has `data=` "
        f"({fields['data problems']} problems)"
    )


# `trace` as the identity records it (`"disk"` records the draws that `True` does:
# one run), and as `run_chains` takes it.
_RECORDED_TRACE = {"True": '`trace=True` (or `trace="disk"`)', "False": "`trace=False`"}
_GIVEN_TRACE = {True: "`trace=True`", False: "`trace=False`", "disk": '`trace="disk"`'}


def _trace_difference(
    saved: str | None, value: str, trace_mode: bool | Literal["disk"] | None
) -> str:
    """The line of `differences` for `trace`, naming the modes as written."""
    was = _RECORDED_TRACE.get(saved or "", "(nothing)")
    now = _GIVEN_TRACE.get(trace_mode) if trace_mode is not None else None
    return (
        f"trace: the checkpoint was written with {was}, this call has "
        f"{now or _RECORDED_TRACE.get(value, value)}; a run that records draws and "
        "one that does not are different runs"
    )
