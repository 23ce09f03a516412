"""`AsyncJit`: `jax.jit` over pytrees that returns as soon as the work is queued.

`eqx.filter_jit` waits for every call to finish, so that `eqx.error_if` failures are
raised at the call. A loop that dispatches one compiled segment after another, or a
wrapper such as `eb.filter_pmap` whose caller decides when to wait, wants JAX's own
asynchronous dispatch instead: the next call is queued while this one runs. `AsyncJit`
gives that with `eqx.filter_jit`'s convention for arguments: array leaves are the
program's arguments, every other leaf (functions, Python numbers, plans) is part of the
compiled program's identity and must be hashable.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from ._tree import is_array


_ARRAY = object()  # marks where an array leaf was taken out of a `Frozen` tree


@dataclasses.dataclass(frozen=True)
class Frozen:
    """The non-array part of a pytree, hashable: its treedef and its other leaves."""

    treedef: Any
    leaves: tuple[Any, ...]


def split(tree: Any) -> tuple[list[Any], Frozen]:
    """`tree`'s array leaves, and the rest of it as a hashable `Frozen`."""
    leaves, treedef = jtu.tree_flatten(tree)
    arrays = [leaf for leaf in leaves if is_array(leaf)]
    others = tuple(_ARRAY if is_array(leaf) else leaf for leaf in leaves)
    return arrays, Frozen(treedef, others)


def join(arrays: Sequence[Any], frozen: Frozen) -> Any:
    """The inverse of `split`."""
    remaining = iter(arrays)
    leaves = [next(remaining) if leaf is _ARRAY else leaf for leaf in frozen.leaves]
    return jtu.tree_unflatten(frozen.treedef, leaves)


class _Carried(eqx.Module):
    # Carries the non-array part of an output out of `jax.jit`, which returns arrays.
    value: Frozen = eqx.field(static=True)


class AsyncJit:
    """`fun` compiled by `jax.jit` per hashable non-array part of its arguments.

    Calling it returns as soon as the computation is queued; its results are arrays
    that JAX fills in when the work is done. Positional arguments only.

    **Arguments:**

    - `fun`: any function of pytrees returning a pytree.
    - `donate`: the positions of the arguments whose arrays the computation may reuse
        for its outputs (the caller must not use them afterwards).
    """

    def __init__(self, fun: Callable[..., Any], *, donate: Sequence[int] = ()):
        self.fun = fun

        def run(frozen: tuple[Frozen, ...], *arrays: list[Any]) -> tuple:
            args = [join(a, f) for a, f in zip(arrays, frozen, strict=True)]
            out_arrays, out_frozen = split(fun(*args))
            return out_arrays, _Carried(out_frozen)

        self._jitted = jax.jit(
            run, static_argnums=0, donate_argnums=tuple(1 + i for i in donate)
        )

    def __call__(self, *args: Any) -> Any:
        frozen, arrays = self.split_args(args)
        return self.finish(self._jitted(frozen, *arrays))

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The program for these arguments, lowered.

        Its `.compile()` is called with the arrays of `split_args(args)` only, and
        what it returns is made the function's output by `finish`.
        """
        frozen, arrays = self.split_args(args)
        return self._jitted.lower(frozen, *arrays)

    @staticmethod
    def split_args(args: tuple[Any, ...]) -> tuple[tuple[Frozen, ...], list[list]]:
        """The non-array part of each argument (the program's identity: compare it
        before calling a compiled program with other arguments) and their arrays."""
        parts = [split(arg) for arg in args]
        return tuple(f for _, f in parts), [a for a, _ in parts]

    @staticmethod
    def finish(out: tuple[list[Any], _Carried]) -> Any:
        """The function's output, from what the compiled program returned."""
        out_arrays, carried = out
        return join(out_arrays, carried.value)
