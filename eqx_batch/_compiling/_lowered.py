"""Programs of `AsyncJit` lowered and compiled ahead of time, called like the
function they were made from (`Lowered`, `Compiled`), and how a transform adapts a call
to them (`CallAdapter`)."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._errors import BatchError
from ._compile import AsyncJit, donated_once, StaticPart


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
    donated: tuple[int, ...] = eqx.field(static=True)
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
        return cls(
            lowered, statics, types, program.donated, tuple(fixed_arrays), adapter
        )

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
            self.donated,
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
    donated: tuple[int, ...] = eqx.field(static=True)
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
        if self.statics != statics:
            raise BatchError(adapter.other_static())
        if array_types([a for argument in arrays for a in argument]) != self.types:
            raise BatchError(adapter.other_types(args, kwargs, self.types))
        arguments = donated_once([*self.fixed, *arrays], self.donated)
        compiled = self.compiled
        return adapter.returned(lambda: AsyncJit.finish(compiled(*arguments)))
