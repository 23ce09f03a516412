"""One member's output split for `jax.vmap`, and the mapped result joined back.

`jax.vmap` returns only JAX values, each with a member axis in front or none. An output
is split into the values that get a member axis (`out_axes` an int), the arrays that do
not (`out_axes` `None`), and an `OutputSkeleton` holding everything else: the output's
static part and where each member axis goes.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._compiling._compile import combine, DYNAMIC, StaticPart
from .._errors import BatchError, describe, KeyPath, leaf_name
from .._tree import is_array, resolve_axes


# Python scalars are JAX values: under a member axis `jax.vmap` broadcasts them to
# weakly typed arrays, as Equinox's `filter_vmap` does.
_SCALARS = (bool, int, float, complex)


@jtu.register_static
@dataclasses.dataclass(frozen=True)
class OutputSkeleton:
    """One member's output without its JAX values, carried as a static value through
    `jax.vmap` and `lax.scan`, which accept arrays only.

    Not a bare `StaticPart`: joining needs each value's member axis, an error its path.
    """

    static: StaticPart
    axes: tuple[int | None, ...]  # per value: its member axis, or None if unmapped
    unmapped_paths: tuple[KeyPath, ...]  # of the values whose axis is None


def split_output(
    out: Any, out_axes: Any
) -> tuple[list[Any], list[Any], OutputSkeleton]:
    """`(mapped values, unmapped arrays, the rest)` of one member's output.

    **Raises:**

    `BatchError` if `out_axes` is not an axis-spec prefix of `out`, asks for a member
    axis on a leaf that is not a JAX value, or asks for one out of range.
    """
    resolved = resolve_axes(out, out_axes, "out")
    leaves, treedef = jtu.tree_flatten_with_path(out)
    member_axes = treedef.flatten_up_to(resolved)
    mapped, unmapped, unmapped_paths, axes, static = [], [], [], [], []
    for (path, leaf), axis in zip(leaves, member_axes, strict=True):
        if axis is None:
            if is_array(leaf):
                unmapped.append(leaf)
                unmapped_paths.append(path)
                axes.append(None)
                static.append(DYNAMIC)
            else:
                static.append(leaf)
            continue
        if not is_array(leaf) and not isinstance(leaf, _SCALARS):
            raise BatchError(
                f"output `{leaf_name('out', path)}` is {describe(leaf)}, not an array, "
                f"but has out_axes {axis}: give it out_axes None."
            )
        ndim = np.ndim(leaf) + 1
        if not -ndim <= axis < ndim:
            raise BatchError(
                f"output `{leaf_name('out', path)}` has {ndim} "
                f"{'axis' if ndim == 1 else 'axes'} once mapped: out_axes {axis} is "
                "out of range."
            )
        mapped.append(leaf)
        axes.append(axis % ndim)
        static.append(DYNAMIC)
    skeleton = OutputSkeleton(
        StaticPart(treedef, tuple(static)), tuple(axes), tuple(unmapped_paths)
    )
    return mapped, unmapped, skeleton


def join_output(
    mapped: list[Any], unmapped: list[Any], skeleton: OutputSkeleton
) -> Any:
    """Inverse of `split_output`, with each mapped array's member axis (at the front)
    moved to where out_axes asks."""
    mapped_iter, unmapped_iter = iter(mapped), iter(unmapped)
    values = [
        next(unmapped_iter)
        if axis is None
        else jnp.moveaxis(next(mapped_iter), 0, axis)
        for axis in skeleton.axes
    ]
    return combine(values, skeleton.static)
