"""A chains trace as ArviZ data, for its convergence diagnostics (R-hat, ESS) and plots.

ArviZ is optional (`pip install eqx_batch[arviz]`) and imported only when a conversion
is asked for, so importing eqx_batch never pays for xarray and pandas.
"""

from typing import Any, TYPE_CHECKING

import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError
from .._tree import is_array, is_key


if TYPE_CHECKING:
    import xarray


def trace_to_arviz(
    trace: Any, *, with_output: bool, superchain_ids: np.ndarray | None = None
) -> "xarray.DataTree":
    """`trace` (`[chains, draws, ...]` per leaf) as an ArviZ `DataTree`; see
    `Chains.to_arviz`. `with_output` says it holds the step's outputs, not states;
    `superchain_ids`, each chain's superchain, become the coordinate `superchain`."""
    try:
        import arviz_base
    except ImportError as error:
        raise ImportError(
            "`Chains.to_arviz` needs ArviZ, which eqx_batch installs as an optional "
            "extra: `pip install 'eqx_batch[arviz]'`."
        ) from error
    if trace is None:
        raise BatchError(
            "These chains hold no trace to convert: they were run with `trace=False`. "
            "Run them with `trace=True` (the default) to diagnose their draws."
        )
    # The group and the name of a trace that is one array, by what was recorded.
    group, root = ("outputs", "output") if with_output else ("posterior", "state")
    variables, dims = {}, {}
    for path, leaf in jtu.tree_flatten_with_path(trace)[0]:
        # A PRNG key in the state is no number to diagnose, and xarray cannot hold it.
        if not is_array(leaf) or is_key(leaf):
            continue
        name = jtu.keystr(path) or root
        variables[name] = np.asarray(leaf)
        # ArviZ's own naming, spelled out so that it holds whatever its defaults.
        dims[name] = [f"{name}_dim_{axis}" for axis in range(np.ndim(leaf) - 2)]
    if not variables:
        raise BatchError(
            "`chains.trace` holds no array to convert: every leaf of the recorded "
            f"{root} is a PRNG key or a non-array (static) value."
        )
    data = arviz_base.from_dict(
        {group: variables}, dims=dims, sample_dims=["chain", "draw"]
    )
    if superchain_ids is not None:
        node = data[group]
        node.dataset = node.to_dataset().assign_coords(
            superchain=("chain", superchain_ids)
        )
    return data
