"""A chains trace as ArviZ data, for its convergence diagnostics (R-hat, ESS) and plots.

ArviZ is optional (`pip install eqx_batch[arviz]`) and imported only when a conversion
is asked for, so importing eqx_batch never pays for xarray and pandas.
"""

from collections.abc import Mapping, Sequence
from numbers import Number
from typing import Any, NamedTuple, TYPE_CHECKING

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ..._errors import BatchError, describe, leaf_name
from ..._tree import is_array, is_key
from .._checkpoints._disk_trace import DiskArray


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
# How a message shows the form of `dims`.
_DIMS_FORM = "`dims={'theta': ['school']}`"


class _Variable(NamedTuple):
    """One array leaf as ArviZ holds it: its values (or xarray's lazy array of a
    `trace="disk"` leaf), the names of its axes after `chain` and `draw`, and the leaf
    as messages name it."""

    values: Any
    dims: list[str]
    where: str


class _Dimension(NamedTuple):
    """A dimension of a group: its size, and what has it, for messages."""

    size: int
    owner: str


def trace_to_arviz(
    states: Any,
    outputs: Any = None,
    *,
    superchain_ids: np.ndarray | None = None,
    coords: Mapping[str, Any] | None = None,
    dims: Mapping[str, Any] | None = None,
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
    - `coords`: the labels of a dimension's entries, by its name, as ArviZ's
        `from_dict` takes them. Each label keeps its type: `[1, "2"]` is an int and
        a string (an array of objects), and tuples label one entry each.
    - `dims`: the names of a variable's axes after `chain` and `draw`, by the
        variable's name, as ArviZ's `from_dict` takes them; a variable it does not
        name keeps ArviZ's names, `<name>_dim_0`, ....

    **Returns:**

    An `xarray.DataTree` with the groups that hold a variable.

    **Raises:**

    - `ImportError` if ArviZ is not installed, naming the extra to install.
    - `eb.BatchError` if there is nothing to convert (no trace, or no array in it),
        `superchain_ids` does not hold one integer per chain, or two leaves of one
        group would get the same name (or one a name ArviZ gives itself, `chain`,
        `draw` or `superchain`), naming both paths, or a name with `/`, which
        ArviZ's data cannot hold; or if `dims` names no variable, or not one name
        per axis, or one name for two axes of a variable, or gives one dimension
        two sizes, or `coords` labels no dimension, or not one label per entry.

    !!! Example

        ```python
        states = {"x": np.zeros((4, 10, 2))}
        data = trace_to_arviz(states, superchain_ids=np.array([0, 0, 1, 1]))
        data["posterior"].superchain.values  # array([0, 0, 1, 1])
        data["posterior"]["x"].dims  # ('chain', 'draw', 'x_dim_0')
        labelled = trace_to_arviz(
            states, dims={"x": ["side"]}, coords={"side": ["left", "right"]}
        )
        labelled["posterior"]["x"].sel(side="right").shape  # (4, 10)
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
            "these chains hold no trace to convert: run them with `trace=True`."
        )
    dims = _checked_dims(dims)
    # What ArviZ names itself, in every group: no variable or axis may take it.
    reserved = {name: f"ArviZ's dimension `{name}`" for name in _SAMPLE_DIMS}
    if superchain_ids is not None:
        reserved["superchain"] = "the coordinate `superchain` of the chains"
    groups = {
        group.name: variables
        for group, trace in zip(_GROUPS, [states, outputs], strict=True)
        if (variables := _variables(trace, group, reserved, dims))
    }
    if not groups:
        raise BatchError(
            "`chains.trace` and `chains.outputs` hold no array to convert, only keys "
            "or static values."
        )
    _check_dims_known(dims, groups)
    coords = _checked_coords(coords, groups)
    # One group at a time: each group has its own dimensions, so a state and an
    # output may hold leaves of one name and different shapes.
    first, *others = groups
    data = _as_group(arviz_base, first, groups[first], coords)
    for group in others:
        data[group] = _as_group(arviz_base, group, groups[group], coords)[group]
    if superchain_ids is not None:
        ids = _checked_superchain_ids(superchain_ids, data[first])
        for group in groups:
            data[group] = (
                data[group].to_dataset().assign_coords(superchain=("chain", ids))
            )
    return data


def _as_group(
    arviz_base: Any,
    group: str,
    variables: dict[str, _Variable],
    coords: dict[str, np.ndarray],
) -> "xarray.DataTree":
    """`variables` as the one group `group` of an ArviZ `DataTree`, with the labels of
    `coords` of its dimensions."""
    own = set(_SAMPLE_DIMS).union(*(variable.dims for variable in variables.values()))
    # Its check of the conventions warns of more chains than draws, which is no
    # misnamed dimension here (the names are ours) but a run of many short chains.
    return arviz_base.from_dict(
        {group: {name: variable.values for name, variable in variables.items()}},
        dims={name: variable.dims for name, variable in variables.items()},
        coords={dim: labels for dim, labels in coords.items() if dim in own},
        sample_dims=list(_SAMPLE_DIMS),
        check_conventions=False,
    )


def _variables(
    trace: Any, group: _Group, reserved: dict[str, str], dims: dict[str, list[str]]
) -> dict[str, _Variable]:
    """The array leaves of `trace` that ArviZ can hold, by name, their axes named as
    `dims` names them (or as ArviZ does).

    xarray keeps one of two variables of one name, or of a variable and a dimension,
    without a word (and a variable named `draw` replaces the draws' coordinate), so
    every name is checked against those the group has given.
    """
    variables = {}
    # Each name given so far, with what it names, for the message of a collision.
    given = dict(reserved)
    # The group's dimensions so far: a dimension `dims` gives several variables has
    # one size.
    sizes: dict[str, _Dimension] = {}
    for path, leaf in jtu.tree_flatten_with_path(trace)[0]:
        values = _convertible(leaf)
        if values is None:
            continue
        where = f"`{leaf_name(group.field, path)}`"
        # Each entry of the path written plainly, joined with dots, as PyTorch's
        # `state_dict` and Flax name parameters: names users can type.
        name = jtu.keystr(path, simple=True, separator=".") or group.root
        _check_name(name, where, given, group.name)
        given[name] = where
        axes = _axes(name, where, values.shape[2:], dims, group.name)
        for dim, size in zip(axes, values.shape[2:], strict=True):
            taker = f"a dimension of {where}"
            if dim in sizes:
                _check_size(dim, _Dimension(size, taker), sizes[dim], group.name)
                continue
            _check_name(dim, taker, given, group.name, named_by_user=name in dims)
            given[dim] = taker
            sizes[dim] = _Dimension(size, taker)
        variables[name] = _Variable(values, axes, where)
    return variables


def _convertible(leaf: Any) -> Any:
    """`leaf` as values ArviZ can hold, or None for a leaf it cannot (a PRNG key,
    which is no number to diagnose, or a non-array)."""
    if isinstance(leaf, DiskArray):
        if leaf.holds_keys:
            return None
        values = leaf
    elif not is_array(leaf) or is_key(leaf):
        return None
    else:
        values = np.asarray(leaf)
    if jnp.issubdtype(values.dtype, jnp.floating) and values.dtype.itemsize < 4:
        # NumPy and ArviZ compute in no float narrower than float32 (bfloat16 is
        # no NumPy dtype at all); every such float is exactly a float32.
        values = values.astype(np.float32)
    return _lazy(values) if isinstance(values, DiskArray) else values


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


def _check_name(
    name: str,
    taker: str,
    given: dict[str, str],
    group: str,
    named_by_user: bool = False,
) -> None:
    """Refuses to give `name` to `taker` (a leaf or an axis, `named_by_user` in
    `dims`) in `group` if ArviZ cannot hold it or `given` holds it already."""
    if "/" in name:
        where = "that name in `dims`" if named_by_user else "that key"
        raise BatchError(
            f"{taker} would be named `{name}` in `{group}`, and ArviZ refuses `/`: "
            f"rename {where}."
        )
    if name in given:
        fix = "rename that axis in `dims`" if named_by_user else "rename a key"
        raise BatchError(
            f"{taker} and {given[name]} would both be named `{name}` in `{group}`: "
            f"{fix} (see docs/chains.md#how-variables-are-named)."
        )


def _check_size(dim: str, new: _Dimension, old: _Dimension, group: str) -> None:
    """Refuses two sizes for the dimension `dim` of `group`: xarray gives a dimension
    one size."""
    if new.size != old.size:
        raise BatchError(
            f"{old.owner} (of size {old.size}) and {new.owner} (of size {new.size}) "
            f"would both be the dimension `{dim}` of `{group}`: name them apart in "
            "`dims`."
        )


def _checked_dims(dims: Any) -> dict[str, list[str]]:
    """`dims` as a dict of lists of names, or refused naming what is not."""
    if dims is None:
        return {}
    if not isinstance(dims, Mapping):
        raise BatchError(
            f"`dims` is {describe(dims)}: pass a dict from a variable's name to the "
            f"names of its axes after `chain` and `draw`, as {_DIMS_FORM}."
        )
    checked = {}
    for name, axes in dims.items():
        if isinstance(axes, str) or not (
            isinstance(axes, (list, tuple)) and all(isinstance(a, str) for a in axes)
        ):
            raise BatchError(
                f"`dims{jtu.keystr((jtu.DictKey(name),))}` is {describe(axes)}: pass "
                "a list of names, one for each axis of the variable after `chain` "
                f"and `draw`, as {_DIMS_FORM}."
            )
        repeated = next((a for i, a in enumerate(axes) if a in axes[:i]), None)
        if repeated is not None:
            # xarray only warns of it, and then fails to reduce over that name.
            raise BatchError(
                f"`dims{jtu.keystr((jtu.DictKey(name),))}` names two axes "
                f"`{repeated}`: give each axis of `{name}` its own name."
            )
        checked[name] = list(axes)
    return checked


def _axes(
    name: str,
    where: str,
    shape: tuple[int, ...],
    dims: dict[str, list[str]],
    group: str,
) -> list[str]:
    """The names of the axes, `shape`, of the variable `name` (the leaf `where`) after
    `chain` and `draw`: those `dims` gives it, or ArviZ's own naming, spelled out so
    that it holds whatever its defaults."""
    if name not in dims:
        return [f"{name}_dim_{axis}" for axis in range(len(shape))]
    axes = dims[name]
    if len(axes) != len(shape):
        raise BatchError(
            f"`dims{jtu.keystr((jtu.DictKey(name),))}` names {_axes_count(len(axes))} "
            f"({axes}), but {where} (`{name}` of `{group}`) has draws of shape "
            f"{shape}: name each axis but `chain` and `draw`."
        )
    return axes


def _axes_count(count: int) -> str:
    return f"{count} axis" if count == 1 else f"{count} axes"


def _check_dims_known(
    dims: dict[str, list[str]], groups: dict[str, dict[str, _Variable]]
) -> None:
    """Refuses a name of `dims` that is no variable of any group (a typo, or a path
    written otherwise), which ArviZ would ignore without a word."""
    unknown = [name for name in dims if not any(name in g for g in groups.values())]
    if unknown:
        known = " and ".join(
            ", ".join(f"`{name}`" for name in variables) + f" (group `{group}`)"
            for group, variables in groups.items()
        )
        raise BatchError(
            f"`dims` names `{unknown[0]}`, not a variable of these chains: {known} "
            "(see docs/chains.md#how-variables-are-named)."
        )


def _checked_coords(
    coords: Any, groups: dict[str, dict[str, _Variable]]
) -> dict[str, np.ndarray]:
    """`coords` as 1-D arrays of labels, each of a dimension of the data and one per
    entry, or refused naming the dimension and its size."""
    if coords is None:
        return {}
    if not isinstance(coords, Mapping):
        raise BatchError(
            f"`coords` is {describe(coords)}: pass a dict such as "
            "`coords={'school': ['A', 'B', ...]}`."
        )
    sizes = _dimensions(groups)
    checked = {}
    for dim, labels in coords.items():
        where = f"`coords{jtu.keystr((jtu.DictKey(dim),))}`"
        if dim not in sizes:
            names = ", ".join(f"`{name}`" for name in sizes)
            raise BatchError(
                f"{where} labels `{dim}`, not a dimension of these chains ({names}): "
                "name it in `dims` first."
            )
        array = _label_array(labels)
        for size in sizes[dim]:
            if array is None or len(array) != size.size:
                held = (
                    f"holds {len(array)} labels"
                    if array is not None
                    else f"is {describe(labels)}, not a sequence of labels"
                )
                raise BatchError(
                    f"{where} {held}, but the dimension `{dim}` ({size.owner}) has "
                    f"{size.size} entries: give one label per entry, {size.size} "
                    "in all."
                )
        checked[dim] = array
    return checked


def _label_array(labels: Any) -> np.ndarray | None:
    """`labels` as a 1-D array that holds each label as it was given, or None if they
    are no sequence of labels (a label is hashable: a string, a number, a tuple).

    NumPy makes a list of labels of one kind (strings, numbers) an array of that
    kind, as xarray does. Labels of several kinds stay themselves in an array of
    objects, where NumPy would make `[1, "2"]` two strings (and `.sel(x=1)` find
    nothing), and tuples stay tuples, where it would make `[(0, 1), (1, 2)]` one
    [2, 2] array.
    """
    if hasattr(labels, "__array__"):
        # An array, an index of pandas: its dtype is already chosen.
        array = np.asarray(labels)
        return array if array.ndim == 1 else None
    if isinstance(labels, (str, bytes)) or not isinstance(labels, Sequence):
        return None
    entries = list(labels)
    kinds = {_label_kind(entry) for entry in entries}
    if len(kinds) == 1 and None not in kinds:
        return np.asarray(entries)
    if not all(_hashable(entry) for entry in entries):
        return None
    # Entry by entry: NumPy would read equal tuples as rows of a 2-D array.
    array = np.empty(len(entries), dtype=object)
    for index, entry in enumerate(entries):
        array[index] = entry
    return array


def _hashable(label: Any) -> bool:
    try:
        hash(label)
    except TypeError:
        return False
    return True


def _label_kind(label: Any) -> type | None:
    """The kind of array NumPy makes of labels like `label` without changing them,
    or None for a label that NumPy would change (a tuple) or keep as an object."""
    for kind in (bool, np.bool_, str, bytes, np.datetime64, np.timedelta64):
        if isinstance(label, kind):
            return bool if kind is np.bool_ else kind
    # Ints and floats together are floats, as pandas makes them, and label alike.
    return Number if isinstance(label, Number) else None


def _dimensions(groups: dict[str, dict[str, _Variable]]) -> dict[str, list[_Dimension]]:
    """Every dimension of the data, with its size in each group that has it."""
    dimensions: dict[str, dict[str, _Dimension]] = {}
    for group, variables in groups.items():
        for variable in variables.values():
            shape = variable.values.shape
            for dim, size in zip(_SAMPLE_DIMS, shape[:2], strict=True):
                owner = f"the {dim}s of the group `{group}`"
                dimensions.setdefault(dim, {})[group] = _Dimension(size, owner)
            for dim, size in zip(variable.dims, shape[2:], strict=True):
                owner = f"an axis of {variable.where}, in the group `{group}`"
                dimensions.setdefault(dim, {}).setdefault(
                    group, _Dimension(size, owner)
                )
    return {dim: list(by_group.values()) for dim, by_group in dimensions.items()}


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
