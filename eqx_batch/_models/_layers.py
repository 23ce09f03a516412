"""Applying a stack of identical layers in sequence with one `jax.lax.scan`."""

from collections.abc import Callable
from typing import Any, Literal, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._errors import BatchError, bullet_list, describe, KeyPath, leaf_name
from .._tree import axis_sizes, common_size, is_array, is_weak, mapped_leaves


_Carry = TypeVar("_Carry")


@overload
def scan_layers(
    layers: Any,
    x: _Carry,
    *,
    fn: Callable[..., Any] | None = None,
    xs: Any = None,
    state: None = None,
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
    state: None = None,
    outputs: Literal[True],
    unroll: int | bool = 1,
    remat: bool = False,
) -> tuple[_Carry, Any]: ...


@overload
def scan_layers(
    layers: Any,
    x: _Carry,
    *,
    fn: Callable[..., Any] | None = None,
    xs: Any = None,
    state: eqx.nn.State,
    outputs: Literal[False] = False,
    unroll: int | bool = 1,
    remat: bool = False,
) -> tuple[_Carry, eqx.nn.State]: ...


@overload
def scan_layers(
    layers: Any,
    x: _Carry,
    *,
    fn: Callable[..., Any] | None = None,
    xs: Any = None,
    state: eqx.nn.State,
    outputs: Literal[True],
    unroll: int | bool = 1,
    remat: bool = False,
) -> tuple[_Carry, eqx.nn.State, Any]: ...


def scan_layers(
    layers: Any,
    x: Any,
    *,
    fn: Callable[..., Any] | None = None,
    xs: Any = None,
    state: eqx.nn.State | None = None,
    outputs: bool = False,
    unroll: int | bool = 1,
    remat: bool = False,
) -> Any:
    """Applies a stacked module of identical layers in sequence, with `jax.lax.scan`.

    A Python loop over `d` layers is traced and compiled `d` times over, so compile time
    grows with depth. Stacking the layers (one leading layer axis on every array leaf)
    and scanning over them traces one layer once: compile time stays flat while the
    compiled loop runs as fast as the unrolled one. The non-array parts of `layers`
    (activation functions, sizes) are shared by every layer and closed over; so are
    those of the carry `x` (other than Python numbers), which may therefore hold whole
    modules.

    Stateful layers (holding an `eqx.nn.StateIndex`, such as `eqx.nn.BatchNorm` or a
    KV cache) built stacked, e.g. with `eb.ensemble(eqx.nn.make_with_state(Layer),
    ...)`, come with a state whose every array has the same leading layer axis. Pass it
    as `state`: each layer receives its own slice of it and the slices it returns are
    stacked into the new state.

    The result equals `for layer in eb.unstack(layers): x = fn(layer, x)` (with `state`:
    each layer called with its own slice of the state), forward and gradient, up to
    floating-point reassociation.

    **Arguments:**

    - `layers`: a pytree (typically an `eqx.Module`) whose array leaves all have a
        leading layer axis of the same size, e.g. from `eb.stack` or `eb.ensemble`.
    - `x`: the input to the first layer; the carry, any pytree. As in `jax.lax.scan`,
        a Python number in it (`0.0` to start a running total) is an array that
        starts as that number, and comes back as an array. Each layer must return a
        carry of the same structure, with array leaves of the same shapes and dtypes
        (a weakly typed one, from a Python number, may take the dtype the layer
        returns, as `jax.lax.scan` allows) and other leaves (functions, strings)
        unchanged.
    - `fn`: how one layer is applied. Called as `fn(layer, x)`, with `state` as
        `fn(layer, x, state)`, and with `xs` given with `extra` appended as a last
        argument. Defaults to `layer(x)`, or `layer(x, state)` with `state`.
    - `xs`: per-layer extra inputs: a pytree whose array leaves have the same leading
        layer axis as `layers`; layer `i` receives its slice `i` as `extra`. Non-array
        leaves are passed to every layer unchanged.
    - `state`: an `eqx.nn.State` holding the state of every `eqx.nn.StateIndex` in
        `layers`, each array with the leading layer axis (the state
        `eqx.nn.make_with_state` returned alongside the stacked layers). It may hold
        other entries too, such as those of the rest of a model; they are passed
        through. `fn` then returns `(x, state)` with the layer's new state.
    - `outputs`: if `True`, `fn` returns `(x, y)` (with `state`: `(x, state, y)`) and
        the per-layer outputs `y` are stacked along a new leading layer axis, as in
        `jax.lax.scan`; non-array leaves of `y` are returned as they are.
    - `unroll`: how many layers each scan iteration runs; passed to `jax.lax.scan`.
    - `remat`: if `True`, each layer's activations are recomputed in the backward pass
        instead of stored (`jax.checkpoint`), trading compute for memory.

    **Returns:**

    The output of the last layer; with `outputs=True`, a pair `(x, ys)`. With `state`,
    the new state follows `x`: `(x, state)` or `(x, state, ys)`. As with a stateful
    layer's own call, the `state` passed in is used up: carry on with the one returned.

    **Raises:**

    `BatchError` if the array leaves of `layers`, `xs` and `state` disagree on the size
    of the layer axis (each such leaf is named), if a leaf is 0-d and so has no layer
    axis, if `layers` has no array leaf, if `xs` is given without `fn`, if `fn` returns
    a carry whose structure, shape or dtype differs from `x` or changes a non-array
    leaf of it (the leaf is named), if `state` is not an `eqx.nn.State` or holds no
    entry for a state index of `layers`, or if `fn` returns a state that differs from
    the one it was given in structure, shape or dtype. Where `layers` looks like one
    layer rather than a stack, or like a list of layers, the message says so. All
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

        Stateful layers, built stacked with their state:

        ```python
        class Counted(eqx.Module):
            linear: eqx.nn.Linear
            calls: eqx.nn.StateIndex

            def __init__(self, *, key):
                self.linear = eqx.nn.Linear(8, 8, key=key)
                self.calls = eqx.nn.StateIndex(jnp.array(0))

            def __call__(self, x, state):
                state = state.set(self.calls, state.get(self.calls) + 1)
                return jax.nn.tanh(self.linear(x)), state

        layers, state = eb.ensemble(
            eqx.nn.make_with_state(Counted), 16, key=jax.random.key(1)
        )
        y, state = eb.scan_layers(layers, jnp.ones(8), state=state)
        state.get(layers.calls)  # [1 1 ... 1]: one call per layer
        ```
    """
    if fn is None and xs is not None:
        raise BatchError(
            "`xs` is given but `fn` is not: pass `fn=lambda layer, x, extra: ...`."
        )
    # A Python number in the carry is an array that starts as that number, as in
    # `jax.lax.scan`; only the other non-array leaves are closed over.
    x = _numbers_as_arrays(x)
    scan = _Scan(
        apply=_call_layer if fn is None else fn,
        layers=layers,
        xs=xs,
        layer_state=None if state is None else _layer_state(layers, state),
        outputs=outputs,
    )
    try:
        final, new_layer_state, ys = scan(x, unroll, remat)
    except Exception as error:
        hint = scan.diagnose(x, default_fn=fn is None)
        if not hint:
            raise
        if isinstance(error, BatchError):
            raise BatchError(f"{error}\n{hint}") from None
        raise BatchError(
            f"applying one layer raised {type(error).__name__}: {error}\n{hint}"
        ) from error
    if state is None:
        return (final, ys) if outputs else final
    new_state = state.update(new_layer_state)
    return (final, new_state, ys) if outputs else (final, new_state)


def _call_layer(layer: Any, *inputs: Any) -> Any:
    return layer(*inputs)


class _Scan:
    """One scan over stacked layers: what is scanned, how a layer is applied, checks."""

    def __init__(
        self,
        apply: Callable[..., Any],
        layers: Any,
        xs: Any,
        layer_state: eqx.nn.State | None,
        outputs: bool,
    ):
        self.apply = apply
        self.layers = layers
        self.xs = xs
        self.layer_state = layer_state
        self.outputs = outputs
        self.indices = _state_indices(layers)

    def __call__(self, x: Any, unroll: int | bool, remat: bool) -> tuple[Any, Any, Any]:
        layer_arrays, layer_static = eqx.partition(self.layers, is_array)
        xs_arrays, xs_static = eqx.partition(self.xs, is_array)
        carry, carry_static = eqx.partition(x, is_array)
        self._check_layer_axis(layer_arrays, xs_arrays)
        # The per-layer outputs' non-array parts, seen while tracing the body.
        y_static: list[Any] = [None]

        def body(carry: Any, sliced: tuple[Any, Any, Any]) -> tuple[Any, Any]:
            layer_slice, extra_slice, state_slice = sliced
            layer = eqx.combine(layer_slice, layer_static)
            x = eqx.combine(carry, carry_static)
            inputs = [x]
            if state_slice is not None:
                inputs.append(state_slice)
            if self.xs is not None:
                inputs.append(eqx.combine(extra_slice, xs_static))
            # Read before the call: a layer's `state.set` uses its state up.
            state_before = (
                None if state_slice is None else self._state_values(state_slice)
            )
            new_x, new_state, y = self._unpack(self.apply(layer, *inputs))
            new_x = _numbers_as_arrays(new_x)
            _check_unchanged("x", x, new_x, "the carry")
            if state_before is not None:
                self._check_state(state_before, new_state)
            y_arrays, y_static[0] = eqx.partition(y, is_array)
            return eqx.filter(new_x, is_array), (new_state, y_arrays)

        if remat:
            # Inside a scan the loop itself keeps recomputation from being merged
            # away, so CSE prevention is unnecessary and would only block
            # optimisations.
            body = jax.checkpoint(body, prevent_cse=False)
        final, (new_state, ys) = jax.lax.scan(
            body, carry, (layer_arrays, xs_arrays, self.layer_state), unroll=unroll
        )
        return eqx.combine(final, carry_static), new_state, eqx.combine(ys, y_static[0])

    def _check_layer_axis(self, layer_arrays: Any, xs_arrays: Any) -> None:
        sizes = [
            size
            for argname, tree in (("layers", layer_arrays), ("xs", xs_arrays))
            for size in axis_sizes(mapped_leaves(tree, 0, argname), argname)
        ]
        if self.layer_state is not None:
            for name, value in self._state_values(self.layer_state):
                sizes += axis_sizes(mapped_leaves(value, 0, name), name)
        common_size(
            sizes,
            what="layer axis",
            fix="Every array leaf of `layers`, `xs` and `state` needs a leading axis "
            "with one entry per layer; stack the layers with `eb.stack`.",
        )

    def _state_values(self, state: eqx.nn.State) -> list[tuple[str, Any]]:
        """`(name, value)` of each state index of the layers, named as it is read."""
        return [
            (f"state.get({leaf_name('layers', path)})", state.get(index))
            for path, index in self.indices
        ]

    def _unpack(self, result: Any) -> tuple[Any, Any, Any]:
        """`fn`'s result as `(x, state, y)`, with `None` for what it does not return."""
        stateful = self.layer_state is not None
        if not stateful and not self.outputs:
            return result, None, None
        names = ["x"] + ["state"] * stateful + ["y"] * self.outputs
        if not (isinstance(result, tuple) and len(result) == len(names)):
            given = " and ".join(
                ["`state`"] * stateful + ["`outputs=True`"] * self.outputs
            )
            kind = "pair" if len(names) == 2 else "triple"
            raise BatchError(
                f"with {given}, `fn` must return a {kind} `({', '.join(names)})`, "
                f"but it returned {describe(result)}."
            )
        return (
            result[0],
            result[1] if stateful else None,
            result[-1] if self.outputs else None,
        )

    def _check_state(self, before: list[tuple[str, Any]], new_state: Any) -> None:
        if not isinstance(new_state, eqx.nn.State):
            raise BatchError(
                f"`fn` returned {describe(new_state)} after `x`, not an `eqx.nn.State`."
            )
        if jtu.tree_structure(new_state) != jtu.tree_structure(self.layer_state):
            raise BatchError(
                "a layer returned a state with other entries: return the one "
                "`x, state = layer(x, state)` gives."
            )
        for (name, old), (_, new) in zip(
            before, self._state_values(new_state), strict=True
        ):
            _check_unchanged(name, old, new, "its state")

    def diagnose(self, x: Any, default_fn: bool) -> str:
        """What the failure probably means when `layers` is not a stack, or ''."""
        layers = self.layers
        if (
            default_fn
            and isinstance(layers, (list, tuple))
            and layers
            and len({jtu.tree_structure(layer) for layer in layers}) == 1
        ):
            return (
                f"`layers` is a {type(layers).__name__} of {len(layers)} layers, but "
                "`scan_layers` takes them stacked into one, every array leaf with a "
                "leading layer axis: pass `eb.stack(layers)`."
            )
        if default_fn and self.indices and self.layer_state is None:
            return (
                "`layers` holds stateful layers (an `eqx.nn.StateIndex` at "
                f"`{leaf_name('layers', self.indices[0][0])}`), but no `state` is "
                "given: pass the state `eqx.nn.make_with_state` returned with the "
                "layers, `x, state = eb.scan_layers(layers, x, state=state)`."
            )
        if self._works_as_one_layer(x):
            return (
                "`layers` looks like one layer, not a stack of layers: applied whole, "
                "it maps `x` to a carry like `x`. `scan_layers` takes the first axis "
                "of every array leaf of `layers` as the layer axis and applies one "
                "slice of it per layer. Stack the layers first: build them stacked "
                "with `eb.ensemble(make_layer, depth, key=key)` or "
                "`eqx.filter_vmap(make_layer)(keys)`, or stack built layers with "
                "`eb.stack([layer_0, layer_1, ...])`."
            )
        return ""

    def _works_as_one_layer(self, x: Any) -> bool:
        def apply_whole(layers: Any, x: Any, state: Any, xs: Any) -> None:
            inputs = [x] if state is None else [x, state]
            if xs is not None:
                inputs.append(jax.tree.map(_first, xs))
            new_x = _numbers_as_arrays(self._unpack(self.apply(layers, *inputs))[0])
            _check_unchanged("x", x, new_x, "the carry")

        try:
            eqx.filter_eval_shape(
                apply_whole, self.layers, x, self.layer_state, self.xs
            )
        # Only a diagnosis: whatever stops the whole `layers` from acting as one layer
        # means it is not one, and the original error stands.
        except Exception:
            return False
        return True


def _numbers_as_arrays(tree: Any) -> Any:
    """`tree` with its Python numbers (bools included) as JAX arrays, weakly typed as
    `jax.lax.scan` makes them."""

    def as_array(leaf: Any) -> Any:
        return jnp.asarray(leaf) if isinstance(leaf, (int, float, complex)) else leaf

    return jtu.tree_map(as_array, tree)


def _first(leaf: Any) -> Any:
    return leaf[0] if is_array(leaf) and leaf.ndim else leaf


def _state_indices(tree: Any) -> list[tuple[KeyPath, eqx.nn.StateIndex]]:
    """`(path, index)` of every `eqx.nn.StateIndex` in `tree`."""

    def is_index(node: Any) -> bool:
        return isinstance(node, eqx.nn.StateIndex)

    return [
        (path, node)
        for path, node in jtu.tree_flatten_with_path(tree, is_leaf=is_index)[0]
        if is_index(node)
    ]


def _layer_state(layers: Any, state: Any) -> eqx.nn.State:
    """The part of `state` that belongs to `layers`, checked to be readable."""
    if not isinstance(state, eqx.nn.State):
        raise BatchError(f"`state` is a {type(state).__name__}, not an `eqx.nn.State`.")
    indices = _state_indices(layers)
    if not indices:
        raise BatchError(
            "`state` is given, but `layers` holds no `eqx.nn.StateIndex`: drop it."
        )
    missing = []
    for path, index in indices:
        try:
            state.get(index)
        except KeyError:
            missing.append(f"`{leaf_name('layers', path)}`")
        except ValueError as error:
            # Equinox refuses a state that a later `set` or `update` replaced.
            raise BatchError(f"`state` cannot be read: {error}") from None
    if missing:
        raise BatchError(
            "`state` holds no entry for these state indices of `layers`:\n"
            + bullet_list(missing)
            + "\nPass the state made together with these layers, by "
            "`eqx.nn.make_with_state` under `eb.ensemble` or `eqx.filter_vmap`."
        )
    return state.substate(layers)


def _check_unchanged(argname: str, before: Any, after: Any, what: str) -> None:
    """Raises unless `after` has the structure, array shapes and dtypes and non-array
    leaves of `before`: what a layer must keep of what it is given."""
    before_leaves, before_def = jtu.tree_flatten_with_path(before)
    after_leaves, after_def = jtu.tree_flatten_with_path(after)
    if before_def != after_def:
        advice = (
            " With per-layer outputs, return `(x, y)` and pass `outputs=True`."
            if argname == "x"
            else ""
        )
        raise BatchError(
            f"a layer returned {what} of structure {after_def}, but `{argname}` has "
            f"structure {before_def}.{advice}"
        )
    reshaped = []
    replaced = []
    for (path, old), (_, new) in zip(before_leaves, after_leaves, strict=True):
        name = f"`{leaf_name(argname, path)}`: {describe(old)} in, {describe(new)} out"
        if is_array(old) and is_array(new):
            # `jax.lax.scan` promotes a weakly typed carry (a Python number's) to the
            # dtype the layer returns, and raises itself if it cannot.
            promoted = argname == "x" and is_weak(old)
            if old.shape != new.shape or (old.dtype != new.dtype and not promoted):
                reshaped.append(name)
        elif not _same(old, new):
            replaced.append(name)
    if reshaped:
        raise BatchError(
            f"a layer changed the shape or dtype of {what}; each layer must return "
            "arrays shaped like its input:\n" + bullet_list(reshaped)
        )
    if replaced:
        raise BatchError(
            f"a layer changed a non-array leaf of {what}. Non-array leaves (functions, "
            "strings, other objects) are fixed for the whole scan, shared by every "
            "layer; only arrays (and Python numbers, which become arrays) can change "
            "from layer to layer:\n"
            + bullet_list(replaced)
            + "\nReturn the one the layer was given."
        )


def _same(old: Any, new: Any) -> bool:
    if old is new:
        return True
    try:
        return bool(old == new)
    # An `__eq__` that returns something without a truth value (or raises) cannot
    # vouch for equality.
    except Exception:
        return False
