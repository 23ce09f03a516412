"""Making any optax transformation treat each member of a stacked model on its own."""

import functools as ft
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax

from .._errors import BatchError, bullet_list, describe, KeyPath, leaf_name
from .._tree import axis_sizes, common_size, mapped_leaves


def per_member(
    tx: optax.GradientTransformation | optax.MultiSteps,
    *,
    axes: Any = eqx.if_array(0),
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation so that each ensemble member is its own model.

    Applied to stacked parameters, a plain optax transformation sees one big model:
    `optax.clip_by_global_norm` clips by the norm of the whole ensemble, so one
    diverging member shrinks every other member's step. `per_member(tx)` vmaps
    `tx.init` and `tx.update` over the member axis instead, so every statistic `tx`
    keeps (global norms, step counts of schedules, the mini-step counter of
    `optax.MultiSteps`) is computed per member, and training the stack equals training
    each member alone.

    The state holds one copy of `tx`'s state per member (every array leaf gains a
    leading member axis), so it must be created with `per_member(tx).init`. Non-array
    leaves of `params` and `updates` (activation functions; the `None`s that
    `eqx.filter_grad` leaves for them) are dropped, so a whole `eqx.Module` can be
    passed as `params`.

    Hyperparameters can differ between members: give a numeric hyperparameter of
    `optax.inject_hyperparams` one value per member, an array of shape `(n,)`, and
    member `i` trains with value `i`, as if alone with it (a learning-rate sweep
    trained as one stacked model). Like every injected hyperparameter it lives in the
    state, there of shape `(n,)`, where it can be changed between steps; one value set
    there (shape `()`) is given to every member. Give such values as an array, not a
    Python list, which `optax.inject_hyperparams` does not inject.

    On a grid (`m` rows of `n` members, two member axes), nest it:
    `per_member(per_member(tx))`. A hyperparameter then holds one value per cell,
    shape `(m, n)`, or any shape that broadcasts to it (`(n,)`: the same values in
    every row), and cell `(i, j)` trains as if alone with its value.

    **Arguments:**

    - `tx`: any optax `GradientTransformation` (with or without extra-args support), or
        an `optax.MultiSteps`.
    - `axes`: the member axis of each array leaf of the parameters and updates, as an
        axis spec (a pytree prefix of `params` of ints or callables such as
        `eqx.if_array(0)`, the default: axis 0 of every array). Every array leaf must
        have one.

    **Returns:**

    An `optax.GradientTransformationExtraArgs`. Its `update(updates, state,
    params=None, **extra_args)` maps array extra arguments over their leading axis, so
    per-member values go in with one entry per member (e.g. `value=losses` of shape
    `(n,)` for `optax.contrib.reduce_on_plateau`).

    **Raises:**

    `BatchError` if `tx` is not an optax transformation. From `init` and `update`, at
    trace time (so a jitted step pays nothing for them): `BatchError` if array leaves
    of `params`, `updates`, `state` or the extra arguments disagree on the number of
    members (each such leaf is named), if an array leaf has no member axis, or if
    `state` was not made by `per_member(tx).init`; from `init`, if an injected
    hyperparameter is neither one value nor one value per member (per cell of a
    nested grid; it is named, with its shape and the number of members), or is a
    schedule returning several values; from `init` or `update`, if `tx` fails on a
    hyperparameter given as a Python list or tuple.

    !!! Example

        A full ensemble training loop: one loss per member, summed, so that the gradient
        of the sum holds each member's own gradient.

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax

        n = 4
        models = eb.ensemble(
            eqx.nn.MLP, n, in_size=1, out_size=1, width_size=16, depth=2,
            key=jax.random.key(0),
        )
        x = jnp.linspace(-1, 1, 32)[:, None]
        y = jnp.sin(3 * x)

        def member_loss(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        @eqx.filter_value_and_grad(has_aux=True)
        def total_loss(models):
            losses = eqx.filter_vmap(member_loss)(models)
            return jnp.sum(losses), losses

        optim = eb.per_member(
            optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9))
        )
        opt_state = optim.init(eqx.filter(models, eqx.is_array))

        @eqx.filter_jit
        def step(models, opt_state):
            (_, losses), grads = total_loss(models)
            updates, opt_state = optim.update(grads, opt_state, models)
            return eqx.apply_updates(models, updates), opt_state, losses

        for _ in range(100):
            models, opt_state, losses = step(models, opt_state)
        losses.shape  # (4,): one loss per member
        ```
    """
    inner = _with_extra_args(tx)

    def init(params: Any) -> Any:
        return _init(inner, axes, params)

    # The extra arguments travel on as one dict: as keywords, one named `axes` would
    # meet `_update`'s own.
    def update(
        updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        return _update(inner, axes, updates, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


def _init(inner: Any, axes: Any, params: Any) -> Any:
    """`per_member(tx).init`, for `inner`, `tx` with extra-args support."""
    # Here and in `_update`, the checks resolve `axes` only to validate it and name
    # leaves; the vmaps take the spec itself, which Equinox resolves the same way.
    arrays = eqx.filter(params, eqx.is_array)
    n = common_size(_member_sizes(arrays, axes, "params"), fix=_FIX)
    enclosing = _RUNNING.get()
    grid = (() if enclosing is None else enclosing.grid) + (n,)
    level = _Level(grid, whole=set(), handled=set())
    token = _RUNNING.set(level)
    try:
        shapes = eqx.filter_eval_shape(
            eqx.filter_vmap(inner.init, in_axes=(axes,), out_axes=eqx.if_array(0)),
            arrays,
        )
        found, seen = _per_cell_hyperparams(shapes, level)
        whole = found | level.whole
        state = _naming_list_hyperparameters(
            eqx.filter_vmap(
                inner.init, in_axes=(axes,), out_axes=_state_axes(shapes, whole)
            )
        )(arrays)
    finally:
        _RUNNING.reset(token)
    if enclosing is not None:
        enclosing.whole.update(whole)
        enclosing.handled.update(seen | level.handled)
    return jtu.tree_map_with_path(
        lambda path, leaf: (
            jnp.broadcast_to(leaf, level.grid) if path in found else leaf
        ),
        state,
    )


def _update(
    inner: Any,
    axes: Any,
    updates: Any,
    state: Any,
    params: Any,
    extra_args: dict[str, Any],
) -> tuple[Any, Any]:
    """`per_member(tx).update`, for `inner`, `tx` with extra-args support."""
    update_arrays = eqx.filter(updates, eqx.is_array)
    params_arrays = eqx.filter(params, eqx.is_array)
    sizes = _member_sizes(update_arrays, axes, "updates")
    if params is not None:
        sizes += _member_sizes(params_arrays, axes, "params")
    for name, value in extra_args.items():
        sizes += _member_sizes(eqx.filter(value, eqx.is_array), eqx.if_array(0), name)
    n = common_size(sizes, fix=_FIX)
    state = _shared_hyperparams_per_member(state, n)
    common_size(sizes + _state_sizes(state), fix=_FIX)
    params_axes = None if params is None else axes

    def member_update(
        member_updates: Any,
        member_state: Any,
        member_params: Any,
        member_extra: dict[str, Any],
    ) -> tuple[Any, Any]:
        return inner.update(member_updates, member_state, member_params, **member_extra)

    return _naming_list_hyperparameters(
        eqx.filter_vmap(
            member_update,
            in_axes=(axes, eqx.if_array(0), params_axes, eqx.if_array(0)),
            out_axes=(axes, eqx.if_array(0)),
        )
    )(update_arrays, state, params_arrays, extra_args)


_FIX = (
    "Every array leaf of the parameters, updates and optimiser state needs a member "
    "axis with one entry per member."
)


def _with_extra_args(
    tx: optax.GradientTransformation | optax.MultiSteps,
) -> Any:
    if isinstance(tx, optax.GradientTransformation):
        return optax.with_extra_args_support(tx)
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        # `optax.MultiSteps` and similar wrappers: `update` already takes extra args.
        return tx
    raise BatchError(f"`tx` is {describe(tx)}, not an `optax.GradientTransformation`.")


def _member_sizes(tree: Any, axes: Any, argname: str) -> list[tuple[str, int]]:
    """The member-axis size of every leaf of `tree`, a tree of arrays only, by name."""
    leaves = mapped_leaves(tree, axes, argname)
    unmapped = [leaf_name(argname, path) for path, _, axis in leaves if axis is None]
    if unmapped:
        raise BatchError(
            "per_member needs a member axis on every array leaf, but `axes` gives "
            "these none:\n"
            + bullet_list([f"`{name}`" for name in unmapped])
            + "\nA parameter shared by all members cannot take per-member updates; "
            "give it a member axis."
        )
    return axis_sizes(leaves, argname)


def _state_sizes(state: Any) -> list[tuple[str, int]]:
    arrays: list[tuple[KeyPath, Any]] = [
        (path, leaf)
        for path, leaf in jtu.tree_flatten_with_path(state)[0]
        if eqx.is_array(leaf)
    ]
    scalars = [leaf_name("state", path) for path, leaf in arrays if leaf.ndim == 0]
    if scalars:
        raise BatchError(
            "`state` has 0-d array leaves, so it holds no member axis:\n"
            + bullet_list([f"`{name}`" for name in scalars])
            + "\nCreate the state with `per_member(tx).init(params)`, not "
            "`tx.init(params)`."
        )
    return [(leaf_name("state", path), leaf.shape[0]) for path, leaf in arrays]


class _Level(NamedTuple):
    """A `per_member` level whose `init` is running.

    `grid` holds the member counts of this level and of every level enclosing it,
    outermost first: `(m, n)` for the inner level of a seeds x learning-rates grid.
    `handled` collects the state paths of the injected hyperparameters that levels
    nested inside this one have already read, and `whole` those of them that they
    returned whole, per cell, already of the grid's full shape; the others they
    returned with one value per member of theirs.
    """

    grid: tuple[int, ...]
    whole: set[KeyPath]
    handled: set[KeyPath]


# An outer level's `init` traces the inner level's, so the inner level reads here the
# grid it is part of, and tells the outer one which hyperparameters it returned whole.
_RUNNING: ContextVar[_Level | None] = ContextVar("per_member_level", default=None)


def _state_axes(shapes: Any, whole: set[KeyPath]) -> Any:
    """The member axis of each leaf of the state `init` makes, from its shapes.

    Every leaf gains a leading member axis, except the hyperparameters of
    `optax.inject_hyperparams` given one value per member (or per cell of a grid):
    init closes over those, so they come out whole, and are then the member axes
    themselves.
    """
    return jtu.tree_map_with_path(
        lambda path, _: None if path in whole else eqx.if_array(0), shapes
    )


def _per_cell_hyperparams(
    shapes: Any, level: _Level
) -> tuple[set[KeyPath], set[KeyPath]]:
    """Paths of the injected hyperparameters in `shapes` that hold one value per
    member, or per cell of the grid this level is part of (any shape that broadcasts
    to it), and of all injected hyperparameters read; raises for those that hold
    neither that nor one shared value.

    Those that a nested `per_member` level has read are its business.
    """
    grid = level.grid
    if len(grid) == 1:
        per = f"one value per member, shape {grid}"
    else:
        per = (
            f"one value per cell of the grid of shape {grid} (or a shape that "
            f"broadcasts to it, such as {grid[1:]} for one value per column)"
        )
    found, seen = set(), set()
    for path, node in jtu.tree_flatten_with_path(shapes, is_leaf=_is_injected)[0]:
        if not _is_injected(node):
            continue
        scheduled = getattr(node, "hyperparams_states", {})
        for name, value in node.hyperparams.items():
            leaf_path = (*path, _HYPERPARAMS, jtu.DictKey(name))
            # `shapes` comes from the vmapped init: a leading member axis, then the
            # hyperparameter's own shape.
            shape = tuple(value.shape[1:])
            if leaf_path in level.handled:
                continue
            seen.add(leaf_path)
            if not shape:
                continue
            where = f"hyperparameter `{name}` (`{leaf_name('state', leaf_path)}`)"
            if name in scheduled:
                raise BatchError(
                    f"{where} is a schedule returning shape {shape}, not one value: "
                    f"give {per} as an array."
                )
            if not _broadcasts_to(shape, grid):
                if len(grid) == 1 and len(shape) == 1:
                    what = (
                        f"has {shape[0]} values, one per member, but `params` has "
                        f"{grid[0]} members. Give {per}"
                    )
                else:
                    what = f"has shape {shape}, but a hyperparameter holds {per}"
                raise BatchError(
                    f"{where} {what}, or one value shared by all members, shape ()."
                )
            found.add(leaf_path)
    return found, seen


def _broadcasts_to(shape: tuple[int, ...], grid: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, grid) == grid
    except ValueError:
        return False


def _shared_hyperparams_per_member(state: Any, n: int) -> Any:
    """`state` with every 0-d injected hyperparameter given to each of `n` members:
    what a user sets between steps (`state.hyperparams["learning_rate"] = 0.05`)."""

    def per_member(node: Any) -> Any:
        if not _is_injected(node):
            return node
        hyperparams = {
            name: jnp.broadcast_to(value, (n,)) if np.ndim(value) == 0 else value
            for name, value in node.hyperparams.items()
        }
        return node._replace(hyperparams=hyperparams)

    return jtu.tree_map(per_member, state, is_leaf=_is_injected)


def _naming_list_hyperparameters(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, raising a `BatchError` where optax fails on a hyperparameter given as a
    Python list or tuple.

    `optax.inject_hyperparams` injects numbers and arrays only; a list reaches the
    optimiser unchanged and fails in its arithmetic, with a message that names no
    hyperparameter (nor can we: optax keeps it out of the state).
    """

    @ft.wraps(fn)
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except TypeError as error:
            if "'list'" not in str(error) and "'tuple'" not in str(error):
                raise
            raise BatchError(
                f"`tx` raised TypeError: {error}. Give per-member values as an array, "
                "not a list (see docs/ensembles.md#what-is-refused)."
            ) from error

    return call


_HYPERPARAMS = jtu.GetAttrKey("hyperparams")


def _is_injected(node: Any) -> bool:
    return isinstance(
        node, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    )
