"""A chains trace as ArviZ data, for its convergence diagnostics (R-hat, ESS) and plots.

ArviZ is optional (`pip install eqx_batch[arviz]`) and imported only when a conversion
is asked for, so importing eqx_batch never pays for xarray and pandas.
"""

from typing import Any, NamedTuple, TYPE_CHECKING

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, describe, leaf_name
from .._tree import is_array, is_key
from ._disk_trace import DiskArray


if TYPE_CHECKING:
    import xarray


class _Group(NamedTuple):
    """A group of the ArviZ data, and the field of `Chains` it is made from."""

    name: str
    # The field as messages name it, before a leaf's path.
    field: str
    # The name of its one variable when the field is one array (its path is empty).
    root: str


# The dimensions of every variable, before its own.
_SAMPLE_DIMS = ("chain", "draw")
_GROUPS = (
    _Group("posterior", "chains.trace", "state"),
    _Group("sample_stats", "chains.outputs", "output"),
)


class _Variable(NamedTuple):
    """One array leaf as ArviZ holds it: its values (or xarray's lazy array of a
    `trace="disk"` leaf) and the names of its axes after `chain` and `draw`."""

    values: Any
    dims: list[str]


def _lazy(leaf: DiskArray) -> Any:
    """`leaf` as xarray's lazily indexed array, which xarray keeps unread (through
    selections) until values are asked for, through its public backend API."""
    from xarray.backends import BackendArray
    from xarray.core import indexing

    class Backend(BackendArray):
        def __init__(self, leaf: DiskArray):
            self.leaf, self.shape, self.dtype = leaf, leaf.shape, leaf.dtype

        def __getitem__(self, key: Any) -> np.ndarray:
            # Integers and slices, which `DiskArray` reads in part; xarray applies
            # any other index to what they read.
            return indexing.explicit_indexing_adapter(
                key, self.shape, indexing.IndexingSupport.BASIC, self.leaf.__getitem__
            )

    return indexing.LazilyIndexedArray(Backend(leaf))


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
        `superchain_ids` does not hold one integer per chain, or two leaves of one
        group would get the same name (or one a name ArviZ gives itself, `chain`,
        `draw` or `superchain`), naming both paths, or a name with `/`, which
        ArviZ's data cannot hold.

    !!! Example

        ```python
        states = {"x": np.zeros((4, 10, 2))}
        data = trace_to_arviz(states, superchain_ids=np.array([0, 0, 1, 1]))
        data["posterior"].superchain.values  # array([0, 0, 1, 1])
        data["posterior"]["x"].dims  # ('chain', 'draw', 'x_dim_0')
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
    # What ArviZ names itself, in every group: no variable or axis may take it.
    reserved = {name: f"ArviZ's dimension `{name}`" for name in _SAMPLE_DIMS}
    if superchain_ids is not None:
        reserved["superchain"] = "the coordinate `superchain` of the chains"
    groups = {
        group.name: variables
        for group, trace in zip(_GROUPS, [states, outputs], strict=True)
        if (variables := _variables(trace, group, reserved))
    }
    if not groups:
        raise BatchError(
            "`chains.trace` (with `chains.outputs`) holds no array to convert: every "
            "leaf of the recorded states (and outputs) is a PRNG key or a non-array "
            "(static) value."
        )
    # One group at a time: each group has its own dimensions, so a state and an
    # output may hold leaves of one name and different shapes.
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


def _as_group(
    arviz_base: Any, group: str, variables: dict[str, _Variable]
) -> "xarray.DataTree":
    """`variables` as the one group `group` of an ArviZ `DataTree`."""
    # Its check of the conventions warns of more chains than draws, which is no
    # misnamed dimension here (the names are ours) but a run of many short chains.
    return arviz_base.from_dict(
        {group: {name: variable.values for name, variable in variables.items()}},
        dims={name: variable.dims for name, variable in variables.items()},
        sample_dims=list(_SAMPLE_DIMS),
        check_conventions=False,
    )


def _variables(
    trace: Any, group: _Group, reserved: dict[str, str]
) -> dict[str, _Variable]:
    """The array leaves of `trace` that ArviZ can hold, by name.

    xarray keeps one of two variables of one name, or of a variable and a dimension,
    without a word (and a variable named `draw` replaces the draws' coordinate), so
    every name is checked against those the group has given.
    """
    variables = {}
    # Each name given so far, with what it names, for the message of a collision.
    given = dict(reserved)
    for path, leaf in jtu.tree_flatten_with_path(trace)[0]:
        # A PRNG key in the state is no number to diagnose, and xarray cannot hold it.
        if isinstance(leaf, DiskArray):
            if leaf.holds_keys:
                continue
            values = leaf
        elif not is_array(leaf) or is_key(leaf):
            continue
        else:
            values = np.asarray(leaf)
        if jnp.issubdtype(values.dtype, jnp.floating) and values.dtype.itemsize < 4:
            # NumPy and ArviZ compute in no float narrower than float32 (bfloat16 is
            # no NumPy dtype at all); every such float is exactly a float32.
            values = values.astype(np.float32)
        if isinstance(values, DiskArray):
            values = _lazy(values)
        where = f"`{leaf_name(group.field, path)}`"
        # Each entry of the path written plainly, joined with dots, as PyTorch's
        # `state_dict` and Flax name parameters: names users can type.
        name = jtu.keystr(path, simple=True, separator=".") or group.root
        # ArviZ's own naming of axes, spelled out so that it holds whatever its
        # defaults.
        dims = [f"{name}_dim_{axis}" for axis in range(values.ndim - 2)]
        for taken, taker in [
            (name, where),
            *((d, f"a dimension of {where}") for d in dims),
        ]:
            _check_name(taken, taker, given, group.name)
            given[taken] = taker
        variables[name] = _Variable(values, dims)
    return variables


def _check_name(name: str, taker: str, given: dict[str, str], group: str) -> None:
    """Refuses to give `name` to `taker` (a leaf or an axis) in `group` if ArviZ
    cannot hold it or `given` holds it already."""
    if "/" in name:
        raise BatchError(
            f"{taker} would be named `{name}` in the group `{group}` of `to_arviz()`, "
            "and ArviZ's data (an `xarray.DataTree`) cannot hold a name with `/`: "
            "rename that key."
        )
    if name in given:
        raise BatchError(
            f"{taker} and {given[name]} would both be named `{name}` in the group "
            f"`{group}` of `to_arviz()`, which names a variable by its path joined "
            "with dots (`.layers[0].weight` is `layers.0.weight`) and its axes "
            "`<name>_dim_0`, `<name>_dim_1`, ...: rename a dict key or field on a "
            "path so that the names differ."
        )


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
