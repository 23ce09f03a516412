"""`Problems`: each problem's steps, stops, draws and diagnostics, in a run of many
(`run_chains(..., data=data)`), held apart so that `Chains` keeps one problem's
shape."""

from typing import Any

import equinox as eqx
import numpy as np

from .._until._convergence import Diagnostics
from .._until._records import Stopped


class Problems(eqx.Module):
    """Each problem's values, in a run of many problems ([`eb.run_chains`][]`(...,
    data=data)`): [`eb.Chains`][]`.problems`.

    The rest of `Chains` is shaped as one problem's result, whatever the options;
    what differs between the problems is here, one entry per problem, and
    [`Chains.problem(p)`][eqx_batch.Chains.problem] is problem `p`'s result alone.

    **Fields:**

    - `count`: how many problems the chains ran (P).
    - `steps_done`: the steps each problem ran (NumPy `int64[P]`): `num_steps` for
        every problem without `until`; with it, each problem's own stop.
    - `stopped`: with `until`, each problem's [`eb.Stopped`][] (a tuple of P):
        each problem stops on its own. `None` without `until`.
    - `draws_made`: how many of the trace's draws each problem made (NumPy
        `int64[P]`). The trace holds the draws of the problem that ran longest: a
        problem's rows hold zeros after its own.
    - `diagnostics`: with `diagnostics=True` (or `until`), each problem's
        [`eb.Diagnostics`][]: every statistic with a leading axis of P, one entry
        per problem. `None` without.
    - `shared`: with `shared=`, each problem's final shared state: every array
        leaf with a leading axis of P. `None` without.

    !!! Example

        ```python
        def step(x, key, data):  # an AR(1) chain around its problem's centre
            return 0.5 * x + data["centre"] + jr.normal(key, x.shape)

        data = {"centre": jnp.array([0.0, 10.0, 20.0])}  # 3 problems
        result = eb.run_chains(
            step, jnp.zeros((3 * 4, 2)), jr.key(0), 100, data=data, diagnostics=True
        )
        result.problems.count  # 3
        result.problems.steps_done  # [100, 100, 100]
        result.problems.diagnostics.rhat.shape  # (3, 2)
        ```
    """

    count: int
    steps_done: np.ndarray
    stopped: tuple[Stopped, ...] | None
    draws_made: np.ndarray
    diagnostics: Diagnostics | None
    shared: Any = None
