"""A call bound to its function's signature and sized: each leaf with its member axis.

`filter_vmap` and `filter_pmap` both start a call here. Binding (`_bind.py`) names every
argument and gives it an axis spec; the size check (`_sizes.py`) finds each mapped
leaf's member axis and the number of members. `MappedCall` is the result: what
`jax.vmap` maps, and how to call the function again with other leaves.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu

from ._bind import bind_arguments, LeavesByArgument
from ._sizes import mapped_size


@dataclasses.dataclass(frozen=True)
class MappedCall:
    """One call, bound and with each leaf's member axis: which leaves are mapped, and
    how to call `fun` with other leaves in their place."""

    leaves: list[Any]
    axes: list[int | None]
    treedef: Any
    keywords: tuple[str, ...]

    @classmethod
    def of(
        cls,
        arguments: dict[str, Any],
        mapped: LeavesByArgument,
        keywords: tuple[str, ...],
    ) -> "MappedCall":
        """The call whose arguments (keyword ones last, named by `keywords`) have the
        member axes in `mapped`, as the size check returns them."""
        leaves, treedef = jtu.tree_flatten(list(arguments.values()))
        axes = [axis for triples in mapped.values() for _, _, axis in triples]
        return cls(leaves, axes, treedef, keywords)

    def dynamic(self) -> tuple[list[Any], list[int]]:
        """The mapped leaves and their member axes."""
        pairs = [
            (leaf, axis)
            for leaf, axis in zip(self.leaves, self.axes, strict=True)
            if axis is not None
        ]
        return [leaf for leaf, _ in pairs], [axis for _, axis in pairs]

    def call(self, fun: Callable[..., Any], dynamic: list[Any]) -> Any:
        """`fun` called with the mapped leaves replaced by `dynamic`."""
        members = iter(dynamic)
        leaves = [
            leaf if axis is None else next(members)
            for leaf, axis in zip(self.leaves, self.axes, strict=True)
        ]
        return self.invoke(fun, leaves)

    def invoke(self, fun: Callable[..., Any], leaves: list[Any]) -> Any:
        """`fun` called with `leaves` in place of the call's leaves."""
        values = jtu.tree_unflatten(self.treedef, leaves)
        positional = len(values) - len(self.keywords)
        return fun(
            *values[:positional],
            **dict(zip(self.keywords, values[positional:], strict=True)),
        )


def bind_call(
    fun: Callable[..., Any],
    in_axes: Any,
    axis_size: int | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[MappedCall, int | None]:
    """The call `fun(*args, **kwargs)` bound and checked: its leaves with their member
    axes, and the number of members (`None` if nothing is mapped and `axis_size` is
    not given).

    **Raises:**

    `TypeError` if the call does not fit `fun`'s signature; `BatchError` as
    `bind_arguments` and `check_mapped_sizes` do.
    """
    arguments, axes = bind_arguments(fun, in_axes, args, kwargs)
    size, mapped = mapped_size(arguments, axes, axis_size, len(args))
    return MappedCall.of(arguments, mapped, tuple(kwargs)), size
