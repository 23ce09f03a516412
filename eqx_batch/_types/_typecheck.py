"""`typecheck`: a function's annotations checked by beartype through jaxtyping, with the
reason of a violation (for `Stacked`, the leaf, its shape and the expected dims) added
to jaxtyping's message."""

import contextvars
import functools as ft
import inspect
from typing import Any, TypeVar

import jaxtyping
from beartype import beartype
from beartype.roar import BeartypeCallHintViolation
from jaxtyping import TypeCheckError


# The arguments of the innermost call checked by `typecheck`, by name, so that a
# message can name the argument a leaf belongs to. (jaxtyping records them too, but
# only where its private storage can read them.)
CHECKED_ARGUMENTS: contextvars.ContextVar[dict[str, Any] | None] = (
    contextvars.ContextVar("eqx_batch_typecheck_arguments", default=None)
)


_T = TypeVar("_T")


def typecheck(fn: _T) -> _T:
    """Checks a function's annotations, `Stacked` and jaxtyping shapes included.

    This is `jaxtyping.jaxtyped(typechecker=beartype.beartype)`, whose per-call dim
    scope makes `eb.Stacked[Model, "n"]` and `Float[Array, "n b"]` agree on `n`, with
    one addition: jaxtyping's own error says which argument failed but not why, so the
    violation's reason (for `Stacked`, the leaf path, its shape and the expected dims)
    is appended to the message. Put it *inside* `jax.jit`/`eqx.filter_jit`
    (`jax.jit(eb.typecheck(f))`): the checks then run once per trace and cost nothing
    per call.

    **Arguments:**

    - `fn`: a function, or a dataclass (such as an `eqx.Module` subclass), whose
        `__init__` is then checked.

    **Returns:**

    `fn`, checked.

    **Raises:**

    The decorated function raises `jaxtyping.TypeCheckError` (a `TypeError`) when an
    argument or the return value violates its annotation.

    !!! Example

        ```python
        from jaxtyping import Array, Float

        @eb.typecheck
        def mean_weight(models: eb.Stacked[dict, "n"]) -> Float[Array, "n"]:
            return models["w"].mean(axis=1)

        jax.jit(mean_weight)({"w": jnp.ones((3, 2))})  # checked once, at trace time
        ```
    """
    if inspect.isclass(fn):
        checked_cls = jaxtyping.jaxtyped(fn, typechecker=beartype)
        checked_cls.__init__ = _with_reason(checked_cls.__init__)
        return checked_cls
    return _with_reason(jaxtyping.jaxtyped(fn, typechecker=beartype))  # pyright: ignore


def _with_reason(checked: Any) -> Any:
    if not inspect.isfunction(checked):
        # A classmethod, staticmethod or property that jaxtyped wrapped in place.
        return checked
    signature = inspect.signature(checked)

    @ft.wraps(checked)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:
            arguments = {}  # jaxtyped reports the bad call.
        token = CHECKED_ARGUMENTS.set(arguments)
        try:
            return checked(*args, **kwargs)
        except TypeCheckError as e:
            reason = _violation_reason(e)
            # Nested checked functions: the inner one has already added the reason.
            if reason is None or reason in str(e):
                raise
            raise TypeCheckError(f"{e}\nReason: {reason}") from e
        finally:
            CHECKED_ARGUMENTS.reset(token)

    return wrapper


def _violation_reason(error: BaseException) -> str | None:
    # jaxtyping raises its summary `from` the typechecker's violation, which holds the
    # reason (our `__instancecheck_str__` text for `Stacked`).
    cause = error.__cause__
    while cause is not None:
        if isinstance(cause, BeartypeCallHintViolation):
            # beartype writes "... parameter x=<value> violates type hint <hint>, as
            # <reason>"; jaxtyping's summary already names the parameter and value.
            _, found, rest = str(cause).partition(" violates type hint ")
            _, found_reason, reason = rest.partition(", as ")
            return reason if found and found_reason else str(cause)
        cause = cause.__cause__
    return None
