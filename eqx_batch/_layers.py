"""Applying a stack of identical layers in sequence with one `jax.lax.scan`."""

from collections.abc import Callable
from typing import Any, Literal, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._errors import BatchError, bullet_list, describe, leaf_name
from ._tree import axis_sizes, common_size, mapped_leaves


_Carry = TypeVar("_Carry")


@overload
def scan_layers(
    layers: Any,
    x: _Carry,
    *,
    fn: Callable[..., Any] | None = None,
    xs: Any = None,
    outputs: Literal[False] = False,
    unroll: int | bool = 1,
    remat: bool = False,
) -> _Carry: ...


@overload
def scan_layers(
    layers: Any,
    x: _Carry,
    *,
    fn: Callable[..., Any] | None = None,
    xs: Any = None,
    outputs: Literal[True],
    unroll: int | bool = 1,
    remat: bool = False,
) -> tuple[_Carry, Any]: ...


def scan_layers(
    layers: Any,
    x: _Carry,
    *,
    fn: Callable[..., Any] | None = None,
    xs: Any = None,
    outputs: bool = False,
    unroll: int | bool = 1,
    remat: bool = False,
) -> _Carry | tuple[_Carry, Any]:
    """Applies a stacked module of identical layers in sequence, with `jax.lax.scan`.

    A Python loop over `d` layers is traced and compiled `d` times over, so compile time
    grows with depth. Stacking the layers (one leading layer axis on every array leaf)
    and scanning over them traces one layer once: compile time stays flat while the
    compiled loop runs as fast as the unrolled one. The non-array parts of `layers`
    (activation functions, sizes) are shared by every layer and closed over.

    The result equals `for layer in eb.unstack(layers): x = fn(layer, x)`, forward and
    gradient, up to floating-point reassociation.

    **Arguments:**

    - `layers`: a pytree (typically an `eqx.Module`) whose array leaves all have a
        leading layer axis of the same size, e.g. from `eb.stack` or `eb.ensemble`.
    - `x`: the input to the first layer; the carry, a pytree of arrays. Each layer
        must return a carry of the same structure, shapes and dtypes.
    - `fn`: how one layer is applied. Called as `fn(layer, x)`, or as
        `fn(layer, x, extra)` when `xs` is given. Defaults to `layer(x)`.
    - `xs`: per-layer extra inputs: a pytree whose array leaves have the same leading
        layer axis as `layers`; layer `i` receives its slice `i` as `extra`. Non-array
        leaves are passed to every layer unchanged.
    - `outputs`: if `True`, `fn` returns `(x, y)` and the per-layer outputs `y` are
        stacked along a new leading layer axis, as in `jax.lax.scan`.
    - `unroll`: how many layers each scan iteration runs; passed to `jax.lax.scan`.
    - `remat`: if `True`, each layer's activations are recomputed in the backward pass
        instead of stored (`jax.checkpoint`), trading compute for memory.

    **Returns:**

    The output of the last layer; with `outputs=True`, a pair `(x, ys)`.

    **Raises:**

    `BatchError` if the array leaves of `layers` and `xs` disagree on the size of the
    layer axis (each such leaf is named), if a leaf is 0-d and so has no layer axis, if
    `layers` has no array leaf, if `xs` is given without `fn`, or if `fn` returns a
    carry whose structure, shape or dtype differs from `x` (the leaf is named). All
    checks run at trace time, so a jitted call pays nothing for them.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        keys = jax.random.split(jax.random.key(0), 16)
        layers = eb.stack([eqx.nn.Linear(8, 8, key=k) for k in keys])
        y = eb.scan_layers(layers, jnp.ones(8))

        # Per-layer extra inputs and per-layer outputs:
        scales = jnp.linspace(0.5, 1.5, 16)
        y, norms = eb.scan_layers(
            layers, jnp.ones(8), xs=scales, outputs=True,
            fn=lambda layer, x, s: (s * jax.nn.tanh(layer(x)), jnp.linalg.norm(x)),
        )
        norms.shape  # (16,)
        ```
    """
    dynamic, static = eqx.partition(layers, eqx.is_array)
    dynamic_xs, static_xs = eqx.partition(xs, eqx.is_array)
    sizes = [
        size
        for argname, tree in (("layers", dynamic), ("xs", dynamic_xs))
        for size in axis_sizes(mapped_leaves(tree, 0, argname), argname)
    ]
    common_size(
        sizes,
        what="layer axis",
        fix="Every array leaf of `layers` and `xs` needs a leading axis with one "
        "entry per layer; stack the layers with `eb.stack`.",
    )
    if fn is None and xs is not None:
        raise BatchError(
            "`xs` is given but `fn` is not: the default `fn` calls `layer(x)` and has "
            "nowhere to put the extra input. Pass `fn=lambda layer, x, extra: ...`."
        )
    apply: Callable[..., Any] = _call_layer if fn is None else fn

    def body(carry: Any, sliced: tuple[Any, Any]) -> tuple[Any, Any]:
        layer = eqx.combine(sliced[0], static)
        if xs is None:
            result = apply(layer, carry)
        else:
            result = apply(layer, carry, eqx.combine(sliced[1], static_xs))
        if outputs:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise BatchError(
                    "with `outputs=True`, `fn` must return a pair `(x, y)`, but it "
                    f"returned {describe(result)}."
                )
            new_carry, y = result
        else:
            new_carry, y = result, None
        _check_carry(carry, new_carry)
        return new_carry, y

    if remat:
        # Inside a scan the loop itself keeps recomputation from being merged away, so
        # CSE prevention is unnecessary and would only block optimisations.
        body = jax.checkpoint(body, prevent_cse=False)
    final, ys = jax.lax.scan(body, x, (dynamic, dynamic_xs), unroll=unroll)
    return (final, ys) if outputs else final


def _call_layer(layer: Any, x: Any) -> Any:
    return layer(x)


def _check_carry(before: Any, after: Any) -> None:
    # `lax.scan` would reject a changed carry too, but without naming the leaf.
    before_leaves, before_def = jtu.tree_flatten_with_path(before)
    after_leaves, after_def = jtu.tree_flatten_with_path(after)
    if before_def != after_def:
        raise BatchError(
            f"a layer returned a carry of structure {after_def}, but `x` has structure "
            f"{before_def}. Each layer must return what it takes; with per-layer "
            "outputs, return `(x, y)` and pass `outputs=True`."
        )
    mismatched = [
        f"`{leaf_name('x', path)}`: {describe(old)} in, {describe(new)} out"
        for (path, old), (_, new) in zip(before_leaves, after_leaves, strict=True)
        if jnp.shape(old) != jnp.shape(new)
        or jnp.result_type(old) != jnp.result_type(new)
    ]
    if mismatched:
        raise BatchError(
            "a layer changed the shape or dtype of the carry; each layer must return "
            "arrays shaped like its input:\n" + bullet_list(mismatched)
        )
