"""A chains trace as ArviZ data, for its convergence diagnostics (R-hat, ESS) and plots.

ArviZ is optional (`pip install eqx_batch[arviz]`) and imported only when a conversion
is asked for, so importing eqx_batch never pays for xarray and pandas.
"""

from typing import Any, TYPE_CHECKING

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, describe
from .._tree import is_array, is_key


if TYPE_CHECKING:
    import xarray


def trace_to_arviz(
    states: Any, outputs: Any = None, *, superchain_ids: np.ndarray | None = None
) -> "xarray.DataTree":
    """The recorded `states` (group `posterior`) and step `outputs` (group
    `sample_stats`), `[chains, draws, ...]` per leaf, as an ArviZ `DataTree`; see
    `Chains.to_arviz`.

    **Arguments:**

    - `states`: the recorded states, or None if there are none.
    - `outputs`: the recorded outputs of the step, or None.
    - `superchain_ids`: one integer per chain, its superchain: added to every group
        as the coordinate `superchain` of the `chain` dimension, for `ids =
        data.posterior.superchain.values` and
        `arviz_stats.rhat_nested(data, superchain_ids=ids)`.

    **Returns:**

    An `xarray.DataTree` with the groups that hold a variable.

    **Raises:**

    - `ImportError` if ArviZ is not installed, naming the extra to install.
    - `eb.BatchError` if there is nothing to convert (no trace, or no array in it),
        or `superchain_ids` does not hold one integer per chain.

    !!! Example

        ```python
        states = {"x": np.zeros((4, 10, 2))}
        data = trace_to_arviz(states, superchain_ids=np.array([0, 0, 1, 1]))
        data["posterior"].superchain.values  # array([0, 0, 1, 1])
        ```
    """
    try:
        import arviz_base
    except ImportError as error:
        raise ImportError(
            "`Chains.to_arviz` needs ArviZ, which eqx_batch installs as an optional "
            "extra: `pip install 'eqx_batch[arviz]'`."
        ) from error
    if states is None and outputs is None:
        raise BatchError(
            "These chains hold no trace to convert: they were run with `trace=False`. "
            "Run them with `trace=True` (the default) to diagnose their draws."
        )
    # The name of a trace that is one array, by what was recorded.
    groups = {
        group: variables
        for group, root, trace in [
            ("posterior", "state", states),
            ("sample_stats", "output", outputs),
        ]
        if (variables := _variables(trace, root))
    }
    if not groups:
        raise BatchError(
            "`chains.trace` (with `chains.outputs`) holds no array to convert: every "
            "leaf of the recorded states (and outputs) is a PRNG key or a non-array "
            "(static) value."
        )
    # One group at a time: ArviZ names dimensions by variable, and a state and an
    # output may hold leaves of one path and different shapes.
    first, *others = groups
    data = _as_group(arviz_base, first, groups[first])
    for group in others:
        data[group] = _as_group(arviz_base, group, groups[group])[group]
    if superchain_ids is not None:
        ids = _checked_superchain_ids(superchain_ids, data[first])
        for group in groups:
            data[group] = (
                data[group].to_dataset().assign_coords(superchain=("chain", ids))
            )
    return data


def _as_group(arviz_base: Any, group: str, variables: dict) -> "xarray.DataTree":
    """`variables` as the one group `group` of an ArviZ `DataTree`."""
    dims = {
        # ArviZ's own naming, spelled out so that it holds whatever its defaults.
        name: [f"{name}_dim_{axis}" for axis in range(values.ndim - 2)]
        for name, values in variables.items()
    }
    # Its check of the conventions warns of more chains than draws, which is no
    # misnamed dimension here (the names are ours) but a run of many short chains.
    return arviz_base.from_dict(
        {group: variables},
        dims=dims,
        sample_dims=["chain", "draw"],
        check_conventions=False,
    )


def _variables(trace: Any, root: str) -> dict[str, np.ndarray]:
    """The array leaves of `trace` that ArviZ can hold, by `keystr` path."""
    variables = {}
    for path, leaf in jtu.tree_flatten_with_path(trace)[0]:
        # A PRNG key in the state is no number to diagnose, and xarray cannot hold it.
        if not is_array(leaf) or is_key(leaf):
            continue
        values = np.asarray(leaf)
        if jnp.issubdtype(values.dtype, jnp.floating) and values.dtype.itemsize < 4:
            # NumPy and ArviZ compute in no float narrower than float32 (bfloat16 is
            # no NumPy dtype at all); every such float is exactly a float32.
            values = values.astype(np.float32)
        variables[jtu.keystr(path) or root] = values
    return variables


def _checked_superchain_ids(superchain_ids: Any, group: Any) -> np.ndarray:
    num_chains = group.sizes["chain"]
    ids = np.asarray(superchain_ids)
    if ids.shape != (num_chains,) or not np.issubdtype(ids.dtype, np.integer):
        raise BatchError(
            f"`superchain_ids` is {describe(superchain_ids)}, but the trace has "
            f"{num_chains} chains: pass one integer per chain, the id of its "
            f"superchain (int[{num_chains}])."
        )
    return ids
