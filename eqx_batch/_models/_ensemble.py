"""Building an ensemble: n members from one constructor, in one vectorised call."""

import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

from .._errors import BatchError, check_int, describe
from .._tree import is_key
from .._types._typing import Stacked


_Model = TypeVar("_Model")

# PRNG implementations whose bits for a key change when generated under `vmap`; every
# other built-in implementation (threefry, the default) gives each key the same bits
# batched or alone.
_VMAP_VARIANT_IMPLS = frozenset({"rbg", "unsafe_rbg"})


# The return annotation stays a string: `Stacked` takes a class, and `_Model` is only
# known to static checkers, which read `Stacked[_Model, "n"]` as `_Model`. Its 'n' is
# a dim name, not the forward reference ruff's F821 takes it for.
def ensemble(
    make: Callable[..., _Model], n: int, *, key: jax.Array, **kwargs: Any
) -> "Stacked[_Model, 'n']":  # noqa: F821
    """Builds a stacked module of `n` members by calling `make` once, vectorised.

    Initialising an ensemble member by member costs `n` Python calls and leaves `n`
    separate modules to stack. `ensemble` splits `key` into `n` keys and calls
    `make(**kwargs, key=k_i)` under `eqx.filter_vmap`, so every array leaf gains a
    leading member axis of size `n` while non-array fields (activation functions,
    ints, strings) appear once, as they would in a single member.

    Member `i` is bit for bit `make(**kwargs, key=jax.random.split(key, n)[i])`, called
    alone, under JAX's default PRNG (threefry). Under a PRNG implementation whose bits
    change under `vmap` (`rbg`, `unsafe_rbg`) the members are still independent draws,
    but differ from the ones built alone, and `ensemble` warns.

    **Arguments:**

    - `make`: a callable taking `key=` as a keyword argument and returning a pytree,
        typically an `eqx.Module` class or a function returning a module. It must be
        traceable under `jax.vmap`: no Python control flow on the key or on values
        drawn from it.
    - `n`: the number of members, a positive Python `int`.
    - `key`: one PRNG key, typed (`jax.random.key(seed)`) or legacy
        (`jax.random.PRNGKey(seed)`). It is split into `n` member keys of the same kind.
    - `**kwargs`: passed unchanged to every call of `make`; they are shared, not
        split across members.

    **Returns:**

    What `make` returns, with a leading member axis of size `n` on every array leaf:
    an instance of `eb.Stacked[Model, "n"]` for `Model` the class `make` builds.

    **Raises:**

    `BatchError` if `n` is not a positive `int` (a bool is refused); if `key` is not a
    single PRNG key (not a key at all, or already split into several); if `make` is not
    callable or does not accept `key=` alongside `kwargs`; or if `make` raises while
    building the members, with the original exception chained.

    !!! Example

        ```python
        import equinox as eqx
        import jax

        models = eb.ensemble(
            eqx.nn.MLP, 8, in_size=2, out_size=1, width_size=32, depth=2,
            key=jax.random.key(0),
        )
        models.layers[0].weight.shape  # (8, 32, 2)
        ```
    """
    n = check_int(
        n,
        "n",
        minimum=1,
        hint="It is the number of members, a Python int (under `jax.jit`, mark it "
        "static).",
    )
    _check_key(key)
    _check_make(make, kwargs)
    keys = jr.split(key, n)

    def build(member_key: Any) -> _Model:
        return make(**kwargs, key=member_key)

    try:
        return eqx.filter_vmap(build)(keys)
    except Exception as e:
        raise BatchError(
            f"`make` ({_name(make)}) raised {type(e).__name__} under vmap: {e}\n"
            "(see docs/ensembles.md#what-is-refused)"
        ) from e


def _check_key(key: Any) -> None:
    if not isinstance(key, jax.Array) or not (is_key(key) or key.dtype == jnp.uint32):
        raise BatchError(
            f"`key` is {describe(key)}, not a PRNG key. Pass `jax.random.key(seed)`."
        )
    typed = key
    if key.dtype == jnp.uint32:
        try:
            typed = jr.wrap_key_data(key)
        except TypeError:
            raise BatchError(
                f"`key` is {describe(key)}, not key data: pass `jax.random.key(seed)`."
            ) from None
    if typed.shape != ():
        raise BatchError(
            f"`key` is {describe(key)}, {typed.shape} keys: pass one key, unsplit."
        )
    impl = str(jr.key_impl(typed))
    if impl in _VMAP_VARIANT_IMPLS:
        warnings.warn(
            f"`key` uses the PRNG implementation {impl!r}, whose random bits change "
            "under vmap: member i of the ensemble will differ from "
            "`make(**kwargs, key=jax.random.split(key, n)[i])` built alone. Use the "
            "default implementation (threefry2x32) if members must be reproducible "
            "one at a time.",
            stacklevel=3,
        )


def _check_make(make: Any, kwargs: dict[str, Any]) -> None:
    if not callable(make):
        raise BatchError(
            f"`make` is {describe(make)}, not callable: pass a module class."
        )
    try:
        signature = inspect.signature(make)
    except (TypeError, ValueError):
        # Some callables (builtins, C extensions) have no signature to check; calling
        # them will tell.
        return
    try:
        signature.bind(**kwargs, key=None)
    except TypeError as e:
        raise BatchError(
            f"`make` ({_name(make)}) cannot be called as `make(**kwargs, key=...)` "
            f"with kwargs {sorted(kwargs)}: {e}."
        ) from None


def _name(make: Any) -> str:
    return getattr(make, "__qualname__", None) or repr(make)
