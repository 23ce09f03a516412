"""Compile plumbing: the static part of a pytree, `AsyncJit`, and lowered programs.

Every transform here hands JAX arrays only and keeps the rest of a pytree (its
structure, functions, Python numbers, axis specs) as a hashable static value, which
is part of a compiled program's identity. `partition` and `combine` are the one way to
take a pytree apart so and put it back together; `StaticPart` is what they carry.

`eqx.filter_jit` waits for every call to finish, so that `eqx.error_if` failures are
raised at the call. A loop that dispatches one compiled segment after another, or a
wrapper such as `eb.filter_pmap` whose caller decides when to wait, wants JAX's own
asynchronous dispatch instead: the next call is queued while this one runs. `AsyncJit`
gives that with `eqx.filter_jit`'s convention for arguments, and `Lowered`/`Compiled`
are its programs compiled ahead of time.
"""

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from ._errors import BatchError
from ._tree import is_array


# Marks where a dynamic leaf was taken out of a `StaticPart`.
DYNAMIC = object()


@jtu.register_static
@dataclasses.dataclass(frozen=True)
class StaticPart:
    """The static part of a pytree: its treedef and its leaves, with a marker where a
    dynamic leaf was taken out.

    Hashable, so it can be a `jax.jit` static argument; and a pytree with no leaves, so
    it passes as is through `jax.jit`'s outputs, `jax.vmap` and `lax.scan`, which carry
    arrays only.
    """

    treedef: Any
    leaves: tuple[Any, ...]


def partition(
    tree: Any,
    is_dynamic: Callable[[Any], bool] = is_array,
    is_leaf: Callable[[Any], bool] | None = None,
) -> tuple[list[Any], StaticPart]:
    """`tree`'s dynamic leaves (array leaves by default), and the rest of it.

    **Arguments:**

    - `tree`: any pytree; its leaves other than the dynamic ones must be hashable.
    - `is_dynamic`: which leaves to take out.
    - `is_leaf`: as for `jax.tree_util.tree_flatten`.

    **Returns:**

    `(dynamic leaves in flattening order, the rest as a StaticPart)`.
    """
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=is_leaf)
    dynamic = [leaf for leaf in leaves if is_dynamic(leaf)]
    others = tuple(DYNAMIC if is_dynamic(leaf) else leaf for leaf in leaves)
    return dynamic, StaticPart(treedef, others)


def combine(dynamic: Sequence[Any], static: StaticPart) -> Any:
    """The inverse of `partition`: `static` with `dynamic` put back in order."""
    remaining = iter(dynamic)
    leaves = [next(remaining) if leaf is DYNAMIC else leaf for leaf in static.leaves]
    return jtu.tree_unflatten(static.treedef, leaves)


def hold(tree: Any) -> StaticPart:
    """All of `tree` as a static value (`combine((), held)` gives it back).

    `None` counts as a leaf, so axis specs keep their `None`s.
    """
    return partition(tree, _never, _is_none)[1]


def _never(leaf: Any) -> bool:
    del leaf
    return False


def _is_none(leaf: Any) -> bool:
    return leaf is None


class AsyncJit:
    """`fun` compiled by `jax.jit` per hashable static part of its arguments.

    Calling it returns as soon as the computation is queued; its results are arrays
    that JAX fills in when the work is done. Positional arguments only: array leaves
    are the program's arguments, every other leaf is part of its identity and must be
    hashable.

    **Arguments:**

    - `fun`: any function of pytrees returning a pytree.
    - `donate`: the names of the parameters whose arrays the computation may reuse
        for its outputs (the caller must not use them afterwards).

    **Raises:**

    `TypeError` if `donate` names something that is not a parameter of `fun`.
    """

    def __init__(self, fun: Callable[..., Any], *, donate: Sequence[str] = ()):
        self.fun = fun
        parameters = list(inspect.signature(fun).parameters)
        unknown = [name for name in donate if name not in parameters]
        if unknown:
            raise TypeError(
                f"donate names {unknown}, which are not parameters of "
                f"{getattr(fun, '__qualname__', fun)}; it has {parameters}."
            )

        def run(statics: tuple[StaticPart, ...], *arrays: list[Any]) -> tuple:
            args = [combine(a, s) for a, s in zip(arrays, statics, strict=True)]
            return partition(fun(*args))

        # Argument 0 of `run` is the static parts; `fun`'s arrays follow.
        donated = tuple(1 + parameters.index(name) for name in donate)
        self._jitted = jax.jit(run, static_argnums=0, donate_argnums=donated)

    def __call__(self, *args: Any) -> Any:
        statics, arrays = self.split_args(args)
        return self.finish(self._jitted(statics, *arrays))

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The program for these arguments, lowered.

        Its `.compile()` is called with the arrays of `split_args(args)` only, and
        what it returns is made the function's output by `finish`.
        """
        statics, arrays = self.split_args(args)
        return self._jitted.lower(statics, *arrays)

    @staticmethod
    def split_args(args: tuple[Any, ...]) -> tuple[tuple[StaticPart, ...], list[list]]:
        """The static part of each argument (the program's identity: compare it before
        calling a compiled program with other arguments) and their arrays."""
        parts = [partition(arg) for arg in args]
        return tuple(s for _, s in parts), [a for a, _ in parts]

    @staticmethod
    def finish(out: tuple[list[Any], StaticPart]) -> Any:
        """The function's output, from what the compiled program returned."""
        return combine(*out)


# --------------------------------------------------------------- ahead of time

ArrayTypes = tuple[tuple[tuple[int, ...], Any], ...]


def array_types(arrays: Sequence[Any]) -> ArrayTypes:
    """The shape and dtype of each array: what a compiled program is fixed to."""
    return tuple((np.shape(array), array.dtype) for array in arrays)


class CallAdapter:
    """How a call to a compiled function becomes its `AsyncJit` program's arguments,
    what a refused call is told, and how the result is handed back.

    This default takes positional arguments as the program's own; a transform
    subclasses it to speak of its own arguments.
    """

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
        """The program's arguments (after those fixed at lowering) for this call."""
        if kwargs:
            raise TypeError("this compiled function takes positional arguments only.")
        return args

    def other_static(self) -> str:
        """The message for a call whose static part differs from the lowered one's."""
        return (
            "this compiled function was lowered for arguments with other non-array "
            "values or another tree structure than those it is now called with. Call "
            "`.lower(...)` again with these arguments."
        )

    def other_types(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], lowered: ArrayTypes
    ) -> str:
        """The message for a call whose arrays have other shapes or dtypes."""
        del args, kwargs
        return (
            "this compiled function is called with arrays of other shapes or dtypes "
            f"than it was lowered for ({lowered}). Call `.lower(...)` again with these "
            "arguments."
        )

    def returned(self, run: Callable[[], Any]) -> Any:
        """Runs the program (`run()` gives the function's output) for the caller."""
        return run()


class Lowered(eqx.Module):
    """An `AsyncJit` program lowered for one set of arguments.

    Unlike `jax.stages.Lowered`, its compiled form is called like the function (with
    pytrees, through its `CallAdapter`) and returns the function's output.
    """

    lowered: jax.stages.Lowered = eqx.field(static=True)
    statics: tuple[StaticPart, ...] = eqx.field(static=True)
    types: ArrayTypes = eqx.field(static=True)
    fixed: tuple[list[Any], ...]
    adapter: CallAdapter

    @classmethod
    def of(
        cls,
        program: AsyncJit,
        fixed: tuple[Any, ...],
        args: tuple[Any, ...],
        adapter: CallAdapter,
    ) -> "Lowered":
        """`program` lowered for the arguments `(*fixed, *args)`: `fixed` stay as
        they are, `args` are what `adapter.arguments` gives for each call."""
        statics, arrays = AsyncJit.split_args(args)
        _, fixed_arrays = AsyncJit.split_args(fixed)
        types = array_types([a for argument in arrays for a in argument])
        lowered = program.lower(*fixed, *args)
        return cls(lowered, statics, types, tuple(fixed_arrays), adapter)

    def as_text(self) -> str:
        """The lowered program (StableHLO) as text."""
        return self.lowered.as_text()

    def compile(
        self, /, compiler_options: dict[str, str | bool] | None = None
    ) -> "Compiled":
        """Compiles the lowered program; the result is called like the function."""
        return Compiled(
            self.lowered.compile(compiler_options=compiler_options),
            self.statics,
            self.types,
            self.fixed,
            self.adapter,
        )


class Compiled(eqx.Module):
    """An `AsyncJit` program compiled ahead of time, called like the function.

    **Raises (when called):**

    `BatchError` if the call's static part, or its arrays' shapes and dtypes, differ
    from those it was lowered for (in the words of its `CallAdapter`).
    """

    compiled: jax.stages.Compiled = eqx.field(static=True)
    statics: tuple[StaticPart, ...] = eqx.field(static=True)
    types: ArrayTypes = eqx.field(static=True)
    fixed: tuple[list[Any], ...]
    adapter: CallAdapter

    def as_text(self) -> str:
        """The compiled, partitioned program (HLO) as text."""
        text = self.compiled.as_text()
        assert text is not None
        return text

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        adapter = self.adapter
        statics, arrays = AsyncJit.split_args(adapter.arguments(args, kwargs))
        if statics != self.statics:
            raise BatchError(adapter.other_static())
        if array_types([a for argument in arrays for a in argument]) != self.types:
            raise BatchError(adapter.other_types(args, kwargs, self.types))
        compiled = self.compiled
        return adapter.returned(lambda: AsyncJit.finish(compiled(*self.fixed, *arrays)))
