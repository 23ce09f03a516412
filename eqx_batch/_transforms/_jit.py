"""`filter_jit`: `eqx.filter_jit`'s interface on `AsyncJit`'s dispatch.

Two costs separate `eqx.filter_jit` from `jax.jit` on the arrays alone: it waits for
every call to finish, and it partitions and hashes every argument in Python on every
call. Here a call flattens its arguments once, finds their compiled program by the
identity of their non-array leaves (`AsyncJit.plan`), and returns as soon as the work
is queued. It waits only for programs that call back to the host, as `eqx.error_if`'s
checks do, so that their failures are still raised at the call.
"""

import functools as ft
import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any, Literal, overload, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from .._compiling._compile import AsyncJit, CallPlan, hold, partition, unhashable_static
from .._compiling._lowered import ArrayTypes, CallAdapter, Lowered
from .._compiling._memo import BoundedCache
from .._errors import BatchError, bullet_list, describe, KeyPath, leaf_name
from .._tree import is_array, is_tracer
from ._static_tracers import check_output_static


_P = ParamSpec("_P")
_T = TypeVar("_T")

Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]


def _call_fun(first: tuple[Any, ...], rest: tuple[Any, tuple, dict]) -> Any:
    """The traced program: the first argument (if any) apart, so that donation can
    leave it out. Its output's static part is checked here, where it is traced (once
    per program): it is returned as it is by every call."""
    fun, rest_args, kwargs = rest
    out = fun(*first, *rest_args, **kwargs)
    _check_output_static(out)
    return out


def _check_output_static(out: Any) -> None:
    """Refuses an output whose static fields hold a traced value (it would outlive
    the program, and be returned by later calls too) or a value that cannot be
    hashed (JAX compares the outputs' structures).

    **Raises:**

    `BatchError` naming the field by its path in the output (`out.config`).
    """
    check_output_static(
        partition(out)[1], "`eb.filter_jit`", compiled="`jax.jit`'s program"
    )
    for path, value in unhashable_static(out, ()):
        raise BatchError(
            f"output static field `{leaf_name('out', path)}` is {describe(value)}, "
            "not hashable: use a tuple, or drop static=True "
            "(see docs/transforms.md#what-is-refused)."
        )


# Which parameters of `_call_fun` each value of `donate` donates.
_DONATED = {
    "all": ("first", "rest"),
    "warn": ("first", "rest"),
    "all-except-first": ("rest",),
    "warn-except-first": ("rest",),
    "none": (),
}
_QUIET = ("all", "all-except-first")
# `jax.jit`'s keywords for which arguments are static, donated or placed where: the
# wrapper decides those from the arguments themselves, as `eqx.filter_jit` does.
_DECIDED_HERE = (
    "static_argnums",
    "static_argnames",
    "donate_argnums",
    "donate_argnames",
    "in_shardings",
    "out_shardings",
)
# One program per donation pattern and `jax.jit` keywords, shared by every wrapper
# that has them, so that equal functions (a new `eqx.filter_grad(f)` each call, say)
# share their compilations.
_PROGRAMS = BoundedCache(64)


def _program(donate: str, jit_kwargs: dict[str, Any]) -> AsyncJit:
    """The program of `_call_fun` for `donate` and `jax.jit`'s `jit_kwargs`."""
    for name in _DECIDED_HERE:
        if name in jit_kwargs:
            raise BatchError(
                f"`{name}` is decided by `eb.filter_jit`, not passed to `jax.jit`: "
                f"drop it (see docs/transforms.md#what-is-refused)."
            )
    for (name, *path), leaf in jtu.tree_flatten_with_path(jit_kwargs)[0]:
        try:
            hash(leaf)
        except TypeError:
            raise BatchError(
                f"`{leaf_name(name.key, tuple(path))}` is {describe(leaf)} "
                f"({type(leaf).__name__}), not hashable: pass a tuple or frozenset."
            ) from None
    key = (donate, hold(jit_kwargs))
    return _PROGRAMS.get_or_make(
        key, lambda: AsyncJit(_call_fun, donate=_DONATED[donate], **jit_kwargs)
    )


# How JAX's error text names the exception by which a failed `eqx.error_if` check
# leaves its host callback (Equinox's own `filter_jit` looks for the same name).
_EQUINOX_ERROR_TYPE = "_EquinoxRuntimeError"
_EQUINOX_ERROR = f"{_EQUINOX_ERROR_TYPE}: "


class _JitWrapper(eqx.Module):
    _fun: Callable[..., Any]
    _signature: inspect.Signature = eqx.field(static=True, repr=False)
    _donate: str = eqx.field(static=True)
    _program: AsyncJit = eqx.field(static=True, repr=False)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._fun

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return _call(self, args, kwargs)

    def lower(self, /, *args: Any, **kwargs: Any) -> Lowered:
        """Traces and lowers for these arguments: ahead-of-time compilation.

        `.compile()` on the result gives a callable taking the same arguments.
        """
        inputs = _inputs(self, args, kwargs)
        return Lowered.of(self._program, (), inputs, _JitCall(self))

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


# Module-level functions rather than methods: Equinox wraps each method access in a
# new bound method object, which costs microseconds on every call.
def _inputs(
    wrapper: _JitWrapper, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], tuple[Any, tuple, dict]]:
    """The program's arguments: the first argument apart from the rest, keywords
    bound to their positions as `eqx.filter_jit` binds them."""
    if kwargs:
        bound = wrapper._signature.bind(*args, **kwargs)
        args, kwargs = bound.args, bound.kwargs
    return args[:1], (wrapper._fun, args[1:], kwargs)


def _call(wrapper: _JitWrapper, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    inputs = _inputs(wrapper, args, kwargs)
    program = wrapper._program
    leaves, treedef = jtu.tree_flatten(inputs)
    plan = program.plan(leaves, treedef, inputs, ft.partial(_leaf_name, wrapper))
    arrays = plan.arrays(leaves)
    checks = program.has_checks(plan, arrays)
    return _returned(wrapper, lambda: _run(program, plan, arrays, checks), checks)


def _run(
    program: AsyncJit, plan: CallPlan, arrays: list[list[Any]], checks: bool
) -> Any:
    out_arrays, out_static = program.run(plan, arrays)
    if checks and not any(is_tracer(x) for x in out_arrays):
        # A failed check is raised by the host callback: wait for it, so that it is
        # raised here as it is by `eqx.filter_jit`.
        jax.block_until_ready(out_arrays)
    return AsyncJit.finish((out_arrays, out_static))


def _returned(wrapper: _JitWrapper, run: Callable[[], Any], checks: bool) -> Any:
    """`run()`, with the warnings about donated buffers silenced if the wrapper
    donates quietly, and `eqx.error_if`'s failures raised as `eqx.EquinoxRuntimeError`
    (and, if the program holds `checks`, not logged)."""
    if checks:
        run = ft.partial(_checks_unlogged, run)
    try:
        if wrapper._donate not in _QUIET:
            return run()
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="Some donated buffers were not usable"
            )
            return run()
    except (jax.errors.JaxRuntimeError, ValueError) as error:
        text = str(error)
        if _EQUINOX_ERROR not in text:
            raise
        message = text.split(_EQUINOX_ERROR, 1)[1].split("\n\n\n", 1)[0].strip()
        raise eqx.EquinoxRuntimeError(message) from None


class _FailedCheckFilter(logging.Filter):
    """Drops JAX's log of a host callback that failed an `eqx.error_if` check."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return type(error).__name__ != _EQUINOX_ERROR_TYPE


def _checks_unlogged(run: Callable[[], Any]) -> Any:
    """`run()`, with JAX's log of a failed `eqx.error_if` check filtered out.

    JAX logs a failed callback at ERROR, with a traceback that carries Equinox's
    banner: "you do not appear to be using `equinox.filter_jit` ... Please wrap your
    program with `equinox.filter_jit`". The call raises the error itself, so the log
    is noise, and its advice would undo `eb.filter_jit`; `eqx.filter_jit` filters it
    too. Other callbacks' failures are still logged.
    """
    loggers = _callback_loggers()
    # A filter of its own per call: calls may overlap (in threads, or nested), and
    # each removes only its own.
    own = _FailedCheckFilter()
    for logger in loggers:
        logger.addFilter(own)
    try:
        return run()
    finally:
        for logger in loggers:
            logger.removeFilter(own)


@ft.cache
def _callback_loggers() -> tuple[logging.Logger, ...]:
    """The loggers on which JAX logs, with its traceback, a host callback that failed.

    No public API names them: JAX logs from a module of its own, on a logger named
    after it (`...callback` in the `jax` namespace). They are found among the loggers
    JAX has made (once: JAX makes them when it is imported), so that a JAX that names
    them otherwise gets no filter (its log is then shown, and nothing else changes)
    rather than an error.
    """
    return tuple(
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("jax.") and name.endswith(".callback")
    )


def _leaf_name(wrapper: _JitWrapper, path: KeyPath) -> str:
    """The user's name of a leaf of the program's arguments (`_inputs`), by its path:
    the parameter it was passed as, then its path inside that argument."""
    part, *rest = path
    if part.idx == 0:  # the first argument
        return leaf_name(_parameter(wrapper._signature, 0), tuple(rest[1:]))
    where, *inner = rest
    if where.idx == 0:
        return leaf_name("fun", tuple(inner))
    key, *inner = inner
    if where.idx == 1:
        return leaf_name(_parameter(wrapper._signature, key.idx + 1), tuple(inner))
    return leaf_name(key.key, tuple(inner))


def _parameter(signature: inspect.Signature, index: int) -> str:
    """The name of the parameter taking positional argument `index`."""
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    for i, parameter in enumerate(positional):
        if parameter.kind == parameter.VAR_POSITIONAL:
            return f"{parameter.name}[{index - i}]"
        if i == index:
            return parameter.name
    return f"args[{index}]"


class _JitCall(CallAdapter):
    """A compiled `filter_jit` call: the wrapper's arguments, named as the user's."""

    def __init__(self, wrapper: _JitWrapper):
        self.wrapper = wrapper

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
        return _inputs(self.wrapper, args, kwargs)

    def other_static(self) -> str:
        return (
            "this compiled function was lowered for arguments with other non-array "
            "values or another tree structure than those it is now called with. "
            "Call `.lower(...)` again with these arguments, or call the "
            "`eb.filter_jit`-wrapped function, which compiles as needed."
        )

    def other_types(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], lowered: ArrayTypes
    ) -> str:
        leaves = jtu.tree_flatten_with_path(self.arguments(args, kwargs))[0]
        arrays = [(path, leaf) for path, leaf in leaves if is_array(leaf)]
        lines = []
        for (path, leaf), (shape, dtype) in zip(arrays, lowered, strict=True):
            if (np.shape(leaf), leaf.dtype) != (shape, dtype):
                name = _leaf_name(self.wrapper, path)
                was = f"{dtype}[{','.join(map(str, shape))}]"
                now = describe(leaf)
                lines.append(f"`{name}`: lowered for {was}, called with {now}")
        return (
            "this compiled function is called with arrays of other shapes or dtypes "
            "than it was lowered for:\n"
            + bullet_list(lines)
            + "\nCall `.lower(...)` again with these arguments, or call the "
            "`eb.filter_jit`-wrapped function, which compiles as needed."
        )

    def returned(self, run: Callable[[], Any]) -> Any:
        # Whether the program holds checks is not known here: filter as if it does.
        return _returned(self.wrapper, run, checks=True)


@overload
def filter_jit(
    *, donate: Donate = "none", **jit_kwargs: Any
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


@overload
def filter_jit(
    fun: Callable[_P, _T], *, donate: Donate = "none", **jit_kwargs: Any
) -> Callable[_P, _T]: ...


def filter_jit(
    fun: Callable[..., Any] | None = None,
    *,
    donate: Donate = "none",
    **jit_kwargs: Any,
) -> Any:
    """`eqx.filter_jit` at `jax.jit`'s speed: a drop-in with the same arguments and
    results.

    Every JAX and NumPy array (`eqx.is_array`) in the arguments, and in `fun` itself,
    is traced; everything else, Python numbers included, is static: a new value
    compiles anew. A value is new if its type differs, or for a float its bits:
    `1`, `1.0` and `True` give three programs (int32, float32 and bool, as `jax.jit`
    types them as static arguments), `0.0` and `-0.0` two, and two NaNs of the same
    bits one; wherever the value is: an argument, an item of a tuple or dict, or a
    field of a Module, `eqx.field(static=True)` or not. (`eqx.filter_jit` reuses
    `1`'s program for `1.0` and `True`, and `0.0`'s for `-0.0`, and compiles anew for
    every NaN.)

    Works as a decorator bare or with arguments, on functions, on methods (through
    `__get__`, the instance being the first argument), and on callable Modules; nests
    inside and around `jax.jit`, `eqx.filter_grad` and `eqx.filter_vmap`.

    Those statics aside, it differs from `eqx.filter_jit` in what a call costs, not in
    what it computes:

    - A call returns as soon as the work is queued, as `jax.jit`'s does;
        `eqx.filter_jit` waits for every call to finish. Programs that call back to
        the host (`eqx.error_if`'s checks, `jax.debug.print`) are waited for, so a
        failed check is still raised at the call, as `eqx.EquinoxRuntimeError`;
        as `eqx.filter_jit` does, it filters out JAX's ERROR log of the failed
        check, whose advice is to use `eqx.filter_jit`. Any other runtime failure
        surfaces when a result is first used.
    - A call flattens its arguments once and finds its compiled program by their tree
        structure and the identity of their non-array leaves and static fields'
        values; only arguments not seen before are partitioned and hashed, as
        `eqx.filter_jit` does on every call.
        So a static value that is mutated in place between calls is not noticed (with
        either, a static value should be immutable).

    **Arguments:**

    - `fun`: the pure function to compile.
    - `donate`: which arrays' buffers the computation may reuse for its outputs (a
        donated array cannot be used again):
        - `"all"`: every array, of the arguments and of `fun`; the warnings about
            buffers that could not be reused are silenced;
        - `"all-except-first"`: all but those of the first argument, silenced;
        - `"warn"`, `"warn-except-first"`: as those, keeping the warnings;
        - `"none"` (the default): none.

        An array passed at two places of a call (`f(x, x)`, or tied weights
        `{"a": x, "b": x}`), one of them donated, is donated once: its other donated
        places get a copy (a buffer donated twice would crash the program).
    - `**jit_kwargs`: any other keyword is passed on to `jax.jit`, as
        `eqx.filter_jit` passes it (`inline=True`, `keep_unused=True`, ...): not
        those saying which arguments are static, donated or placed where, which
        `filter_jit` decides. Wrappers with equal keywords share their compilations.

    **Returns:**

    The compiled function. Its `.lower(*args, **kwargs)` lowers it ahead of time for
    those arguments; `.compile()` on that gives a callable taking the same arguments.

    **Raises:**

    - `eb.BatchError` (when wrapping) if `donate` is not one of the five above, if
        a keyword is one `filter_jit` decides (`static_argnums`, `static_argnames`,
        `donate_argnums`, `donate_argnames`, `in_shardings`, `out_shardings`), or if
        a keyword's value is not hashable.
    - `eb.BatchError` (when called) if a non-array leaf of an argument is not hashable
        (naming the argument and the leaf's path); (when calling a compiled function)
        if its non-array arguments differ from those it was lowered with, or its
        arrays have other shapes or dtypes, naming each such array.
    - `TypeError` (when wrapping) if `jax.jit` does not take a keyword; (when
        called) if a call does not fit `fun`'s signature, as calling `fun` would.
    - `eqx.EquinoxRuntimeError` (when called) if an `eqx.error_if` check fails.

    !!! Example

        ```python
        @eb.filter_jit
        def predict(model, x, scale):  # model's and x's arrays traced, scale static
            return jax.vmap(model)(x) * scale

        model = eqx.nn.MLP(2, 1, 8, 2, key=jr.key(0))
        x = jnp.ones((4, 2))
        y = predict(model, x, 2.0)  # compiles
        y = predict(model, x + 1, 2.0)  # reuses the compilation
        compiled = predict.lower(model, x, 2.0).compile()
        assert jnp.array_equal(compiled(model, x, 2.0), predict(model, x, 2.0))
        ```
    """
    if donate not in _DONATED:
        raise BatchError(
            f"donate={donate!r} is not one of 'all', 'all-except-first', 'warn', "
            "'warn-except-first' and 'none'."
        )
    # Made before `fun` is known, so that a bad keyword is refused where it is written.
    program = _program(donate, jit_kwargs)
    if fun is None:
        return ft.partial(filter_jit, donate=donate, **jit_kwargs)
    wrapper = _JitWrapper(
        _fun=fun,
        _signature=inspect.signature(fun),
        _donate=donate,
        _program=program,
    )
    return eqx.module_update_wrapper(wrapper)
