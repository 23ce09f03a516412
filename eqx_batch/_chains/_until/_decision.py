"""A check of `until`, decided on the devices: which problems pass, which still run
and whose window is discarded, in one program queued after the segment it checks.

Decided there, the next segment can be queued at once with the new `running` mask,
and the host reads the decision while that segment runs (`_chains/_loop.py`): a TPU's
loop no longer waits for the host at every check (issue 42 measured 62 ms a boundary).
The host builds each stopped problem's reason from the same diagnostics, so the
record and the mask cannot disagree.
"""

import functools as ft
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._common import ProblemLayout
from ._convergence import diagnose_traced, Diagnostics, on_one_device
from ._schedule import Criterion, Schedule


class Decision(NamedTuple):
    """A check of every problem at one step, on a device until read."""

    diagnostics: Diagnostics  # each statistic with a leading axis of problems
    # Every leaf of `diagnostics`, raveled into one array in their widest dtype: read
    # to the host in one transfer rather than one per leaf (`read_details`).
    flat: jax.Array
    first_bad: jax.Array  # every real chain's NaN report, in order
    passed: jax.Array  # bool[problems]: every criterion holds, and no chain is NaN
    worst: jax.Array  # each problem's worst value of the first criterion
    # bool[problems]: still running after the check. Each failed it: their windows'
    # moments are discarded (a problem with no draw to check has none to discard).
    running: jax.Array


def decide(
    schedule: Schedule,
    moments: Any,
    first_bad: jax.Array,
    running: jax.Array,
    layout: ProblemLayout | None,
    superchains: int | None,
    at_cap: bool,
) -> Decision:
    """The check of every problem's `moments` (of the real chains, in order) that
    still runs (`running`), with `first_bad` their NaN report: a problem stops if it
    passes, every one at the cap (`at_cap`). `layout` says which problem each chain
    is in (`data=`); None: the chains are one problem.

    The moments are on one device first, as `diagnose` puts them: the statistics
    must not change with the chunking or the device count.
    """
    moments, first_bad = jtu.tree_map(on_one_device, (moments, first_bad))
    decision = _decided(
        moments,
        first_bad,
        on_one_device(running),
        tuple(schedule.criteria),
        layout,
        superchains if layout is None else layout.superchains_each(superchains),
        np.bool_(at_cap),
    )
    # The host reads these at every check, and the details wherever a problem stops:
    # sent as soon as they are made, they wait there rather than the host waiting a
    # transfer for them (on a TPU, a boundary's host work then fits in its segment).
    for x in (decision.passed, decision.worst, decision.flat, decision.first_bad):
        if x.is_fully_addressable:
            x.copy_to_host_async()
    return decision


@ft.partial(jax.jit, static_argnums=(3, 4, 5))
def _decided(
    moments: Any,
    first_bad: jax.Array,
    running: jax.Array,
    criteria: tuple[Criterion, ...],
    layout: ProblemLayout | None,
    superchains_each: int | None,
    at_cap: jax.Array,
) -> Decision:
    diagnostics = diagnose_traced(moments, layout, superchains_each)
    bad = first_bad != 0
    nonfinite = bad.any()[None] if layout is None else layout.blocks(bad).any(axis=1)
    passed, first = ~nonfinite, jnp.full(nonfinite.shape, jnp.nan)
    for index, criterion in enumerate(criteria):
        value = _worst_each(diagnostics, criterion.statistic)
        passed = passed & _holds(criterion, value)
        if index == 0:
            first = value
    stops = passed | at_cap
    leaves = jtu.tree_leaves(diagnostics)
    dtype = jnp.result_type(*leaves)
    flat = jnp.concatenate([x.ravel().astype(dtype) for x in leaves])
    return Decision(diagnostics, flat, first_bad, passed, first, running & ~stops)


def read_details(decision: Decision) -> tuple[Diagnostics, np.ndarray]:
    """`decision.diagnostics` and `first_bad` on the host, in one transfer: each
    leaf of the diagnostics as it was (its values widened and narrowed back, which
    changes no bit)."""
    leaves, treedef = jtu.tree_flatten(decision.diagnostics)
    flat, first_bad = jax.device_get((decision.flat, decision.first_bad))
    sizes = np.cumsum([x.size for x in leaves])[:-1]
    read = [
        part.reshape(x.shape).astype(x.dtype)
        for part, x in zip(np.split(flat, sizes), leaves, strict=True)
    ]
    return jtu.tree_unflatten(treedef, read), first_bad


def _holds(criterion: Criterion, value: jax.Array) -> jax.Array:
    """`criterion.holds(value)` as the host decides it, comparing the threshold (a
    Python float) with a value of lower precision exactly: against the nearest
    value of that precision on the threshold's safe side."""
    dtype = np.dtype(value.dtype)
    bound = dtype.type(criterion.threshold)
    # Compared as Python floats: NumPy would compare a float32 with a Python float
    # in float32, where they are equal.
    if criterion.statistic == "ess":
        if float(bound) < criterion.threshold:
            bound = np.nextafter(bound, dtype.type(math.inf))
        return value >= bound
    if float(bound) > criterion.threshold:
        bound = np.nextafter(bound, dtype.type(-math.inf))
    return value <= bound


def _worst_each(diagnostics: Diagnostics, statistic: str) -> jax.Array:
    """Each problem's worst value of a statistic, as `Diagnostics.worst` reads it:
    over every element of every leaf, NaNs passed over unless all are NaN."""
    largest = statistic != "ess"
    per_leaf = []
    for leaf in jtu.tree_leaves(getattr(diagnostics, statistic)):
        flat = leaf.reshape(leaf.shape[0], -1)
        if flat.shape[1]:
            per_leaf.append(_nan_extreme(flat, largest))
    return _nan_extreme(jnp.stack(per_leaf, axis=1), largest)


def _nan_extreme(x: jax.Array, largest: bool) -> jax.Array:
    """The largest (or smallest) of each row of `x` that is not NaN; NaN for a row
    of NaNs."""
    filled = jnp.where(jnp.isnan(x), -jnp.inf if largest else jnp.inf, x)
    extreme = filled.max(axis=1) if largest else filled.min(axis=1)
    return jnp.where(jnp.isnan(x).all(axis=1), jnp.nan, extreme)
