"""One member's output split for `jax.vmap`, and the mapped result joined back.

`jax.vmap` returns only JAX values, each with a member axis in front or none. An output
is split into the values that get a member axis (`out_axes` an int), the arrays that do
not (`out_axes` `None`), and an `OutputLayout` holding everything else: the tree
structure, the non-array leaves, and where each member axis goes.
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._errors import BatchError, describe, KeyPath, leaf_name
from ._tree import is_array, resolve_axes


# Python scalars are JAX values: under a member axis `jax.vmap` broadcasts them to
# weakly typed arrays, as Equinox's `filter_vmap` does.
_SCALARS = (bool, int, float, complex)


class OutputLayout(eqx.Module):
    """The non-array parts of an output, carried as a static value through `jax.vmap`
    and `lax.scan`, which accept arrays only."""

    treedef: Any = eqx.field(static=True)
    # Per leaf: ("mapped", member axis), ("unmapped", path) or ("static", leaf).
    layout: tuple[tuple[str, Any], ...] = eqx.field(static=True)

    def unmapped_path(self, index: int) -> KeyPath:
        """The path of the `index`-th array whose out_axes is `None`."""
        paths = [value for kind, value in self.layout if kind == "unmapped"]
        return paths[index]


def split_output(out: Any, out_axes: Any) -> tuple[list[Any], list[Any], OutputLayout]:
    """`(mapped values, unmapped arrays, the rest)` of one member's output.

    **Raises:**

    `BatchError` if `out_axes` is not an axis-spec prefix of `out`, asks for a member
    axis on a leaf that is not a JAX value, or asks for one out of range.
    """
    resolved = resolve_axes(out, out_axes, "out")
    leaves, treedef = jtu.tree_flatten_with_path(out)
    axes = treedef.flatten_up_to(resolved)
    mapped, unmapped, layout = [], [], []
    for (path, leaf), axis in zip(leaves, axes, strict=True):
        if axis is None:
            if is_array(leaf):
                unmapped.append(leaf)
                layout.append(("unmapped", path))
            else:
                layout.append(("static", leaf))
            continue
        if not is_array(leaf) and not isinstance(leaf, _SCALARS):
            raise BatchError(
                f"output `{leaf_name('out', path)}` is {describe(leaf)}, not an array, "
                f"but out_axes asks for member axis {axis}. Give it out_axes None "
                "(`eqx.if_array(0)` does so for non-arrays)."
            )
        ndim = np.ndim(leaf) + 1
        if not -ndim <= axis < ndim:
            raise BatchError(
                f"output `{leaf_name('out', path)}` has {ndim} "
                f"{'axis' if ndim == 1 else 'axes'} once mapped "
                f"({describe(leaf)} per member) but out_axes asks for member axis "
                f"{axis}, which is out of range."
            )
        mapped.append(leaf)
        layout.append(("mapped", axis % ndim))
    return mapped, unmapped, OutputLayout(treedef, tuple(layout))


def join_output(mapped: list[Any], unmapped: list[Any], layout: OutputLayout) -> Any:
    """Inverse of `split_output`, with each mapped array's member axis (at the front)
    moved to where out_axes asks."""
    mapped_iter, unmapped_iter = iter(mapped), iter(unmapped)
    leaves = []
    for kind, value in layout.layout:
        if kind == "mapped":
            leaves.append(jnp.moveaxis(next(mapped_iter), 0, value))
        elif kind == "unmapped":
            leaves.append(next(unmapped_iter))
        else:
            leaves.append(value)
    return jtu.tree_unflatten(layout.treedef, leaves)
