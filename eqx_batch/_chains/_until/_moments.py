"""Running moments of each chain's recorded draws: count, mean and second central
moment, updated one draw at a time (Welford) and merged exactly (Chan et al.).

They are what `diagnostics=True` carries through the compiled loop, so that R-hat and
ESS can be computed at the end without keeping the draws: memory is three times two
states per chain (the two halves of the draws and the middle draw between them, for
split R-hat), whatever the number of steps.

Only the floating-point leaves of the state have moments; every other leaf (integers,
bools, PRNG key data) is `None`. Moments are kept in at least float32, so that bfloat16
and float16 states do not lose their sums.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ..._errors import BatchError
from .._common import Draws


# The bins of a chain's draws: the first half, the middle draw (when the number of
# draws is odd) and the second half, as ArviZ's split R-hat splits them.
NUM_BINS = 3


class Moments(NamedTuple):
    """Running moments of each chain, per bin (see `NUM_BINS`).

    Every array has the chains on axis 0 and the bins on axis 1; `mean` and `m2` are
    pytrees shaped like the state (`None` for leaves without moments).
    """

    count: Any  # `int32[chains, bins]`: the draws seen
    mean: Any  # `[chains, bins, ...]` per float leaf
    m2: Any  # the sum of squared deviations from `mean`


def has_moments(leaf: Any) -> bool:
    """Whether a leaf of the state gets moments: a real floating-point array."""
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)


def moments_dtype(dtype: Any) -> np.dtype:
    """The dtype moments of a `dtype` leaf are kept in: at least float32."""
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype(np.float32)


def check_diagnostics(states: Any, num_draws: int, asked_by: str) -> None:
    """Refuses diagnostics for a run with nothing to diagnose.

    `states` is one chain's state as shape-dtype structs; `asked_by` the argument
    that asked for them, for the message (`diagnostics=True`, or `until`, which reads
    them).
    """
    if num_draws == 0:
        raise BatchError(
            f"{asked_by}, but the run records no draw (`burn_in` is `num_steps`): "
            "lower `burn_in` or run more steps."
        )
    if not any(has_moments(x) for x in jtu.tree_leaves(states)):
        raise BatchError(
            f"{asked_by}, but `init` has no floating-point array leaf to diagnose "
            "(integers, bools and PRNG keys have no R-hat)."
        )


def zeros(states: Any, num_chains: int) -> Moments:
    """Moments of no draws, on the host, for `states` given as one chain's shape-dtype
    structs."""

    def empty(x: Any) -> np.ndarray | None:
        if not has_moments(x):
            return None
        return np.zeros((num_chains, NUM_BINS, *x.shape), moments_dtype(x.dtype))

    mean = jtu.tree_map(empty, states)
    m2 = jtu.tree_map(empty, states)
    return Moments(np.zeros((num_chains, NUM_BINS), np.int32), mean, m2)


class Packed(NamedTuple):
    """`Moments` as a segment's loop carries them: the leaves of each moments dtype in
    one array, so that a step updates one array per dtype, not two per leaf (on a TPU
    v5e each update is a kernel of its own, and the loop's steps are a few
    microseconds: `pack`)."""

    count: Any  # `int32[chains, bins]`
    # Per moments dtype: `[chains, bins, 2, size]`, the means then the `m2`s of its
    # leaves, each flattened, in the order of the state's leaves.
    stats: tuple[jax.Array, ...]


def _groups(mean_leaves: list) -> dict[np.dtype, list[int]]:
    """The leaves with moments (their indices among `mean_leaves`), by dtype."""
    groups: dict[np.dtype, list[int]] = {}
    for index, mean in enumerate(mean_leaves):
        if mean is not None:
            groups.setdefault(np.dtype(mean.dtype), []).append(index)
    return groups


def pack(moments: Moments | None) -> Packed | None:
    """`moments` as one array per dtype (`Packed`); `None` stays `None`."""
    if moments is None:
        return None
    means = jtu.tree_leaves(moments.mean, is_leaf=_is_none)
    m2s = jtu.tree_leaves(moments.m2, is_leaf=_is_none)
    count = moments.count

    def flat(x: jax.Array) -> jax.Array:
        return x.reshape(*count.shape, -1)

    return Packed(
        count,
        tuple(
            jnp.concatenate(
                [jnp.stack([flat(means[i]), flat(m2s[i])], axis=2) for i in indices],
                axis=3,
            )
            for indices in _groups(means).values()
        ),
    )


def unpack(packed: Packed | None, like: Moments | None) -> Moments | None:
    """The `Moments` of `packed`, shaped as `like` (those that were packed)."""
    if packed is None or like is None:
        return None
    mean_leaves, treedef = jtu.tree_flatten(like.mean, is_leaf=_is_none)
    means: list = [None] * len(mean_leaves)
    m2s: list = [None] * len(mean_leaves)
    for stats, indices in zip(packed.stats, _groups(mean_leaves).values(), strict=True):
        at = 0
        for i in indices:
            shape = mean_leaves[i].shape
            size = math.prod(shape[2:])
            piece = stats[..., at : at + size]
            means[i] = piece[:, :, 0].reshape(shape)
            m2s[i] = piece[:, :, 1].reshape(shape)
            at += size
    return Moments(packed.count, treedef.unflatten(means), treedef.unflatten(m2s))


def add_draw(
    packed: Packed | None, states: Any, t: jax.Array, draws: Draws
) -> Packed | None:
    """`packed` with every chain's state after step `t` (counted from 0) added, if
    that step makes a draw; `None` stays `None`.

    One bin is read, updated and written back (rather than all three updated under a
    mask): the cost per step is one state's worth of arithmetic.
    """
    if packed is None:
        return None
    keep = draws.is_draw(t)
    draw = draws.slot(t)
    half = draws.total // 2
    which = (draw >= half).astype(jnp.int32) + (draw >= draws.total - half).astype(
        jnp.int32
    )
    count = lax.dynamic_index_in_dim(packed.count, which, 1, keepdims=False)
    new_count = count + keep.astype(count.dtype)
    leaves = [x for x in jtu.tree_leaves(states) if has_moments(x)]
    by_dtype: dict[np.dtype, list[jax.Array]] = {}
    for x in leaves:
        by_dtype.setdefault(moments_dtype(x.dtype), []).append(x)

    def update(stats: jax.Array, xs: list[jax.Array]) -> jax.Array:
        x = jnp.concatenate(
            [x.reshape(x.shape[0], -1).astype(stats.dtype) for x in xs], axis=1
        )
        old = lax.dynamic_index_in_dim(stats, which, 1, keepdims=False)
        old_mean, old_m2 = old[:, 0], old[:, 1]
        n = jnp.maximum(new_count, 1).astype(stats.dtype)[:, None]
        delta = x - old_mean
        new_mean = jnp.where(keep, old_mean + delta / n, old_mean)
        new_m2 = jnp.where(keep, old_m2 + delta * (x - new_mean), old_m2)
        new = jnp.stack([new_mean, new_m2], axis=1)
        return lax.dynamic_update_index_in_dim(stats, new, which, 1)

    return Packed(
        lax.dynamic_update_index_in_dim(packed.count, new_count, which, 1),
        tuple(
            update(stats, xs)
            for stats, xs in zip(packed.stats, by_dtype.values(), strict=True)
        ),
    )


class Summary(NamedTuple):
    """The moments of one group of draws of one leaf: `count` (an integer array that
    broadcasts against `mean`), `mean` and `m2`."""

    count: Any
    mean: Any
    m2: Any


def merge(a: Summary, b: Summary) -> Summary:
    """The moments of the draws of `a` and of `b` together, as if seen in one pass.

    Chan, Golub and LeVeque's pairwise update: exact in real arithmetic, and stable,
    whatever the sizes of the two groups (an empty group leaves the other unchanged).
    """
    count = a.count + b.count
    n = jnp.maximum(count, 1).astype(a.mean.dtype)
    delta = b.mean - a.mean
    weight_b = b.count.astype(a.mean.dtype) / n
    mean = a.mean + delta * weight_b
    m2 = a.m2 + b.m2 + delta**2 * a.count.astype(a.mean.dtype) * weight_b
    return Summary(count, mean, m2)


def bins(moments: Moments, mean: jax.Array, m2: jax.Array) -> list[Summary]:
    """The three bins of one leaf, each with a count that broadcasts to its mean."""
    return [
        Summary(
            _per_chain(moments.count[:, index], mean[:, index]),
            mean[:, index],
            m2[:, index],
        )
        for index in range(NUM_BINS)
    ]


def _per_chain(values: jax.Array, like: jax.Array) -> jax.Array:
    """`values` (one per chain) shaped to broadcast against `like` (`[chains, ...]`),
    rank promotion being explicit."""
    return values.reshape(values.shape + (1,) * (like.ndim - 1))


def _is_none(x: Any) -> bool:
    return x is None
