"""Binding a call to its function's signature: every argument by its parameter name,
with the axis spec `in_axes` gives it.

Mapped transforms report problems by the user's own parameter names, and accept keyword
arguments, so a call is first bound here (`_mapped_call.py` then sizes it).
"""

import functools as ft
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx

from .._errors import BatchError, KeyPath


DEFAULT_AXIS = eqx.if_array(0)

# `(path, leaf, member axis or None)` of every leaf, keyed by argument name.
LeavesByArgument = dict[str, list[tuple[KeyPath, Any, int | None]]]


def bind_arguments(
    fun: Callable[..., Any],
    in_axes: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Names each argument of the call `fun(*args, **kwargs)` and gives it an axis spec.

    The call is bound to `fun`'s signature (following bound methods, `functools.partial`
    and `eqx.Partial`). A `*args` parameter's entries are named `args[0]`, `args[1]`,
    ...; `**kwargs` entries by their keyword. Without an inspectable signature,
    positional arguments are named `args[0]`, ... too.

    `in_axes` is read as:

    - a `dict`: keys are parameter names (a `*args` or `**kwargs` parameter's name
        covers all its entries, a keyword covers its `**kwargs` entry); arguments not
        named get `eqx.if_array(0)`. Every key must name an argument this call passes:
        as in Equinox, a parameter left at its default cannot be given an axis, since
        whether its default should be mapped is ambiguous.
    - a `tuple` or `list`: one spec per positional argument; keyword arguments get
        `eqx.if_array(0)`.
    - anything else (`None`, an int, a callable): one spec for every argument, keyword
        arguments included.

    **Arguments:**

    - `fun`: the function about to be called.
    - `in_axes`: the user's `in_axes`, as above.
    - `args`, `kwargs`: the call's positional and keyword arguments.

    **Returns:**

    `(arguments, axes)`: two dicts keyed by argument name in call order (positional
    arguments first, then keywords as passed); `axes[name]` is the axis-spec prefix of
    `arguments[name]`.

    **Raises:**

    - `TypeError`: if the call does not fit `fun`'s signature, as calling it would.
    - `BatchError`: if a tuple `in_axes` does not have one entry per positional
        argument, or a dict `in_axes` names a parameter the call does not pass, or
        no parameter of `fun` at all.

    !!! Example

        ```python
        from eqx_batch._transforms._bind import bind_arguments

        def affine(x, w, b, *, key=None):
            return x @ w + b

        arguments, axes = bind_arguments(
            affine, (0, None), (jnp.ones((8, 3)), jnp.ones((3, 2))), {"b": 1.0}
        )
        assert list(arguments) == ["x", "w", "b"]
        assert axes["w"] is None and axes["b"] == eqx.if_array(0)
        ```
    """
    signature = _signature(fun)
    names, owner = _argument_names(signature, args, kwargs)
    arguments = dict(zip(names, (*args, *kwargs.values()), strict=True))
    if isinstance(in_axes, dict):
        _check_dict_keys(fun, signature, in_axes, names, owner)
        axes = {
            name: in_axes.get(name, in_axes.get(owner.get(name, ""), DEFAULT_AXIS))
            for name in names
        }
    elif isinstance(in_axes, (tuple, list)):
        if len(in_axes) != len(args):
            passed = ", ".join(f"`{name}`" for name in names[: len(args)]) or "none"
            raise BatchError(
                f"in_axes is a {type(in_axes).__name__} of {len(in_axes)} specs but "
                f"the call passes {len(args)} positional "
                f"argument{'' if len(args) == 1 else 's'} ({passed})."
            )
        axes = dict(zip(names, in_axes, strict=False))
        axes.update((name, DEFAULT_AXIS) for name in names[len(args) :])
    else:
        axes = dict.fromkeys(names, in_axes)
    return arguments, axes


def _signature(fun: Callable[..., Any]) -> inspect.Signature | None:
    # `eqx.Partial` (what a decorated method becomes on an instance) hides the wrapped
    # signature behind `*args, **kwargs`; `functools.partial` exposes it properly.
    if isinstance(fun, eqx.Partial):
        fun = ft.partial(fun.func, *fun.args, **fun.keywords)
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):
        return None


def _argument_names(
    signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[str], dict[str, str]]:
    """The name of each argument in call order, and for each entry that lands in a
    `*args` or `**kwargs` parameter, that parameter's name."""
    if signature is None:
        names = [f"args[{i}]" for i in range(len(args))] + list(kwargs)
        return names, {}
    # Raises the same TypeError calling `fun` would, before any tracing.
    signature.bind(*args, **kwargs)
    params = list(signature.parameters.values())
    positional = [
        p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    var_positional = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), "")
    var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), "")
    keyword_names = {
        p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    names: list[str] = []
    owner: dict[str, str] = {}
    for i in range(len(args)):
        if i < len(positional):
            names.append(positional[i])
        else:
            name = f"{var_positional}[{i - len(positional)}]"
            names.append(name)
            owner[name] = var_positional
    for keyword in kwargs:
        if keyword in keyword_names:
            names.append(keyword)
            continue
        # A `**kwargs` entry may share its name with a positional-only parameter.
        name = keyword if keyword not in names else f"{var_keyword}[{keyword!r}]"
        names.append(name)
        owner[name] = var_keyword
    return names, owner


def _check_dict_keys(
    fun: Callable[..., Any],
    signature: inspect.Signature | None,
    in_axes: dict[Any, Any],
    names: list[str],
    owner: dict[str, str],
) -> None:
    passed = set(names) | set(owner.values())
    parameters = list(signature.parameters) if signature is not None else names
    unknown = [key for key in in_axes if key not in passed and key not in parameters]
    if unknown:
        raise BatchError(
            f"in_axes names {_listed(unknown)}, not a parameter of "
            f"`{function_name(fun)}` ({_listed(parameters)})."
        )
    # Equinox refuses these too: a default is not the caller's, so whether it is
    # mapped would be a guess.
    unpassed = [key for key in in_axes if key not in passed]
    if unpassed:
        raise BatchError(
            f"in_axes names {_listed(unpassed)}, which this call to "
            f"`{function_name(fun)}` does not pass: pass it, or drop the entry "
            f"(see docs/transforms.md#what-is-refused)."
        )


def _listed(names: list[Any]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def function_name(fun: Callable[..., Any]) -> str:
    """How a message names `fun`: its qualified name, else its type's name."""
    return getattr(fun, "__qualname__", None) or type(fun).__name__
