"""`BatchError` and the helpers that make its messages name leaves and values the
user's way, and check the integer arguments of the public functions."""

import inspect
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np


class BatchError(ValueError):
    """Raised by eqx_batch for bad input.

    The message names the offending leaf by the user's argument name followed by its
    `jax.tree_util.keystr` path (`model.layers[1].weight`,
    `state['layer2']['weights']`), the values, shapes or dtypes that disagree, and,
    where the fix is obvious, the fix.

    It subclasses `ValueError`, so code that already catches `ValueError` keeps working.

    !!! Example

        ```python
        try:
            eb.stack([])
        except eb.BatchError as e:
            print(e)  # `trees` is empty: stack needs at least one member.
        ```
    """


KeyPath = tuple[Any, ...]


def leaf_name(argname: str, path: KeyPath) -> str:
    """`argname` followed by the `keystr` of `path`: `model.layers[0].weight`."""
    return f"{argname}{jtu.keystr(path)}"


def describe(x: Any) -> str:
    """A short description of a leaf for a message.

    Arrays, tracers and `jax.ShapeDtypeStruct`s as `float32[3,4]`; functions by name
    as `<function name>` (wrappers such as `jax.jit` hide the name in their repr);
    anything else by its `repr`, cut to 80 characters.
    """
    if isinstance(x, (np.ndarray, np.generic, jax.ShapeDtypeStruct)) or hasattr(
        x, "aval"
    ):
        shape = ",".join(str(d) for d in np.shape(x))
        return f"{getattr(x, 'dtype', None)}[{shape}]"
    name = getattr(x, "__qualname__", None) or getattr(x, "__name__", None)
    if callable(x) and not isinstance(x, type) and isinstance(name, str):
        return f"<function {name}>"
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def qualified_name(x: Any) -> str | None:
    """`module.qualname` of `x` if it has both as strings, else `None`.

    Functions, classes and wrappers such as `jax.custom_jvp` (`jax.nn.relu`) have
    both; their name is the same in every process, where their repr holds an address.
    """
    module = getattr(x, "__module__", None)
    qualname = getattr(x, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    return None


def type_names(a: type, b: type) -> tuple[str, str]:
    """The names of types `a` and `b` for a message: short, unless two different types
    share a short name, then `module.qualname` (`mylib.Linear`, `equinox.nn.Linear`)."""
    if a is not b and a.__name__ == b.__name__:
        return qualified_name(a) or a.__name__, qualified_name(b) or b.__name__
    return a.__qualname__, b.__qualname__


def check_int(
    value: Any,
    name: str,
    *,
    minimum: int = 0,
    maximum: int | None = None,
    hint: str = "",
) -> int:
    """`value`, an integer argument of a public function, as a Python `int`.

    One rule everywhere: Python ints and NumPy integers (anything `operator.index`
    takes) are integers, and bools are not, although Python counts `True` as 1.

    **Arguments:**

    - `value`: what the user passed.
    - `name`: the argument's name, for the message.
    - `minimum`, `maximum`: the range `value` must lie in (`maximum=None`: no upper
        bound).
    - `hint`: a sentence appended to the message, saying what the argument means.

    **Returns:**

    `int(value)`.

    **Raises:**

    `BatchError` if `value` is a bool, is not an integer, or is out of range.
    """
    try:
        number = None if is_bool(value) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        shown = describe(value) if getattr(value, "ndim", 0) else repr(value)
        if maximum is None:
            rule = f"an int >= {minimum}"
        else:
            rule = f"an int from {minimum} to {maximum}"
        message = f"`{name}` is {shown}; it must be {rule}."
        raise BatchError(message + (f" {hint}" if hint else ""))
    return number


def check_bool(value: Any, name: str) -> bool:
    """`value`, a flag of a public function, as a Python `bool`.

    One rule everywhere: Python's and NumPy's bools (and 0-d bool arrays) are flags;
    nothing else is, not even a string such as `"False"`, which Python counts as true.

    **Raises:**

    `BatchError` naming `name` if `value` is not a bool.
    """
    if not (is_bool(value) and getattr(value, "ndim", 0) == 0):
        shown = describe(value) if getattr(value, "ndim", 0) else repr(value)
        raise BatchError(f"`{name}` is {shown}; it must be True or False.")
    return bool(value)


def is_bool(x: Any) -> bool:
    """Whether `x` is a bool: Python's, NumPy's, or an array of bools."""
    return isinstance(x, (bool, np.bool_)) or getattr(x, "dtype", None) == np.bool_


def bullet_list(lines: Sequence[str], limit: int = 20) -> str:
    """Indented lines, at most `limit` of them, with a count of the rest."""
    shown = [f"  {line}" for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"  ... and {len(lines) - limit} more")
    return "\n".join(shown)


# What `call_mismatch` found of each callable, held weakly: reading a signature costs
# tens of microseconds, and a run asks it of the same step on every call.
_mismatches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def call_mismatch(step: Callable, num_args: int) -> str | None:
    """Why `step` cannot be called with `num_args` positional arguments, before it is
    traced: Python's reason. None if it can, or if it has no signature to read (some
    builtins: calling it will tell).

    Only the reason: a step that fits one of several calls is asked about each, on
    every run, and `shown_signature` describes it (arrays printed, for a `partial`)
    only for the message."""
    try:
        # Not for a step that cannot be hashed (a Module holding arrays) or weakly
        # referred to, or that equals another only as arrays do (ambiguously).
        known = _mismatches.setdefault(step, {})
    except (TypeError, ValueError):
        return _call_mismatch(step, num_args)
    if num_args not in known:
        known[num_args] = _call_mismatch(step, num_args)
    return known[num_args]


def _call_mismatch(step: Callable, num_args: int) -> str | None:
    try:
        signature = inspect.signature(step)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*[None] * num_args)
    except TypeError as e:
        return str(e)
    return None


def shown_signature(step: Callable) -> str:
    """`step`'s name and signature, for a message that refuses a call of it."""
    return f"{qualified_name(step) or describe(step)}{inspect.signature(step)}"
