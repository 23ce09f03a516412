"""`Chains`, the result of `run_chains`."""

import dataclasses
import functools as ft
from collections.abc import Mapping, Sequence
from typing import Any, TYPE_CHECKING

import equinox as eqx
import jax
import jax.lax as lax
import jax.tree_util as jtu
import numpy as np

from ..._errors import BatchError, check_int, leaf_name
from ..._tree import is_array, is_key
from .._checkpoints._disk_trace import DiskArray
from .._common import ProblemLayout
from .._placement import whole_here
from .._until._convergence import Diagnostics
from .._until._records import Stopped
from ._arviz import trace_to_arviz
from ._nonfinite import NonFinite
from ._per_problem import Problems


if TYPE_CHECKING:
    import xarray


class Chains(eqx.Module):
    """The result of [`eb.run_chains`][]: final states, trace, keys and a NaN report.

    **Fields:**

    - `final`: the chains' states after the last step (`steps_done`), stacked like
        `init`.
    - `trace`: the recorded states, each array leaf `[chains, draws, ...]` (the
        draws made), non-array leaves as in `init`; `None` with `trace=False`, and
        `[chains, 0, ...]` for a run that makes no draw.
    - `outputs`: with `with_output=True`, the step's recorded outputs, shaped as
        `trace`; `None` without (with `trace=False`, they are recorded alone).
    - `keys`: each chain's PRNG key after the run, as it was given (typed or
        legacy): `final` and `keys` continue the chains exactly.
    - `nonfinite`: an [`eb.NonFinite`][] report of the chains whose state went NaN or
        infinite.
    - `superchain`: with `superchains=K`, each chain's superchain, `c // M` for chain
        `c` (NumPy `int64[chains]`); `None` without superchains.
    - `diagnostics`: with `diagnostics=True`, an [`eb.Diagnostics`][] (R-hat,
        nested R-hat, ESS) from running moments of the recorded draws; with `until`,
        of the last window's (`split_rhat` None). `None` without, and with `data`.
    - `steps_done`: the steps the chains ran: `num_steps`, or fewer when `until`
        stopped the run early. With many problems, the most that any problem ran:
        the trace's extent (each problem's are in `problems`).
    - `stopped`: with `until`, an [`eb.Stopped`][]: when the run stopped and why,
        and the checks made; `None` without `until`, and with many problems (each
        stops on its own: their stops are in `problems`).
    - `shared`: with `shared=`, the final shared state of the chains' problem (with
        `data`, `None`: each problem's is in `problems.shared`); `None` without.
    - `problems`: with `data`, an [`eb.Problems`][], each problem's values; `None`
        without. [`problem(p)`][eqx_batch.Chains.problem] is one problem's result.

    !!! Example

        ```python
        result = eb.run_chains(lambda x, key: x + 1.0, jnp.zeros(3), jr.key(0), 4)
        result.final  # [4., 4., 4.]
        result.trace.shape  # (3, 4)
        ```
    """

    final: Any
    trace: Any
    outputs: Any
    keys: jax.Array
    nonfinite: NonFinite
    superchain: np.ndarray | None = None
    diagnostics: Diagnostics | None = None
    steps_done: int = 0
    stopped: Stopped | None = None
    problems: Problems | None = None
    shared: Any = None

    def problem(self, p: int) -> "Chains":
        """Problem `p`'s chains alone, from a run of many problems (`data=`).

        Rows `p * M` to `(p + 1) * M` of every array (M chains a problem), laid out
        as if problem `p` had run alone: its `nonfinite` chains and `superchain`
        ids counted within it, its own `diagnostics`, `shared` and `to_arviz()`;
        with `until`, its own `steps_done`, `stopped` and draws. In a job, every
        process must call it (a program over every process's rows, as `gathered`);
        its arrays come out whole in every process. The guide: [Many problems in
        one run](../chains.md#many-problems-in-one-run).

        **Arguments:**

        - `p`: the problem, `0 <= p < problems.count`.

        **Returns:**

        A `Chains` of the problem's chains, with `problems=None`: its own
        `steps_done`, `stopped` and `diagnostics`.

        **Raises:**

        `eb.BatchError` if these chains ran without `data`, or `p` is out of range.

        !!! Example

            ```python
            def step(x, key, data):  # an AR(1) chain around its problem's centre
                return 0.5 * x + data["centre"] + jr.normal(key, x.shape)

            data = {"centre": jnp.array([0.0, 10.0, 20.0])}  # 3 problems
            init = jnp.zeros((3 * 4, 2))  # 4 chains a problem
            result = eb.run_chains(step, init, jr.key(0), 100, data=data)
            result.problem(2).trace.shape  # (4, 100, 2)
            ```
        """
        return _one_problem(self, p)

    def gathered(self) -> "Chains":
        """The chains with whole copies of their arrays in this process, for a job of
        several processes, where each holds only its own chains' rows (JAX's way
        with a compiled program's outputs: no host holds more than its share). A
        collective: every process of the job calls it, in the same order. In one
        process, the result itself ([What each process
        holds](../multi.md#what-each-process-holds)).

        **Returns:**

        A `Chains` whose arrays are whole and fully addressable, each on one of this
        process's devices (typed keys still typed).

        **Raises:**

        Nothing of its own: called by some processes of a job and not others, it
        waits for them (JAX's collectives have a timeout).

        !!! Example

            ```python
            result = eb.run_chains(lambda x, key: x + 1.0, jnp.zeros(8), jr.key(0), 4)
            whole = result.gathered()  # in a job: every process calls it
            whole.trace.is_fully_addressable  # True
            np.asarray(whole.trace).shape  # (8, 4)
            ```
        """
        return whole_here(self)

    def to_arviz(
        self,
        *,
        coords: Mapping[str, Any] | None = None,
        dims: Mapping[str, Sequence[str]] | None = None,
    ) -> "xarray.DataTree":
        """The trace as ArviZ data, for its convergence diagnostics and plots
        (`arviz_stats.summary`, `arviz_plots.plot_trace`), with the optional extra
        `pip install 'eqx_batch[arviz]'`.

        As BlackJAX and NumPyro users get it: the recorded states go in the group
        `posterior`, the step's outputs (`with_output=True`) in `sample_stats`. Each
        array leaf is a variable named by its path, entries joined with dots
        (`layer1.weights`, `layers.0.weight`; one array is `state` or `output`), with
        dimensions `chain`, `draw` and ArviZ's names for its own axes; with
        `superchains`, `chain` has the coordinate `superchain`. Floats narrower than
        float32 become float32, exactly; typed keys and non-array leaves are left out.
        The guide says how names are made and how to name outputs for ArviZ's
        checks: [Convergence diagnostics](../chains.md#convergence-diagnostics).

        **Arguments:**

        - `coords`: a dimension's labels, one per entry, by the dimension's name (one
            named in `dims`, one of ArviZ's, `chain` or `draw`).
        - `dims`: the names of a variable's axes after `chain` and `draw`, by the
            variable's name ([Labelling axes](../chains.md#labelling-axes)).

        **Returns:**

        An `xarray.DataTree` (ArviZ's `arviz-base`, its 0.8 series and 1.x alike)
        with `posterior` and, with outputs, `sample_stats`, each if it holds an array.

        **Raises:**

        `ImportError` without ArviZ, naming the extra. `eb.BatchError` for the chains
        of many problems (convert `result.problem(p)`), if nothing was recorded, in a
        job for an array this process holds only part of (call `gathered()` first),
        if two leaves would get one name or a leaf a name ArviZ reserves, or if
        `dims` or `coords` do not fit the data; each message names the entry and
        the fix.

        !!! Example

            ```python
            import arviz_stats

            def step(x, key):
                new = x + jr.normal(key, x.shape)
                return new, {"size": jnp.sum(new**2)}

            result = eb.run_chains(
                step, jnp.zeros((4, 3)), jr.key(0), 100, with_output=True
            )
            data = result.to_arviz()
            data["posterior"]["state"].dims  # ('chain', 'draw', 'state_dim_0')
            data["sample_stats"]["size"].dims  # ('chain', 'draw')
            arviz_stats.summary(data)  # state[0], state[1], state[2]: not converged

            labelled = result.to_arviz(
                dims={"state": ["axis"]}, coords={"axis": ["x", "y", "z"]}
            )
            labelled["posterior"]["state"].sel(axis="y").shape  # (4, 100)
            ```
        """
        if self.problems is not None:
            raise BatchError(
                f"these chains ran {self.problems.count} problems (`data`), each its "
                "own posterior, and ArviZ would pool them as the chains of one. "
                "Convert one problem at a time: `result.problem(p).to_arviz()`."
            )
        here = _held_here({"trace": self.trace, "outputs": self.outputs})
        return trace_to_arviz(
            here["trace"],
            here["outputs"],
            superchain_ids=self.superchain,
            coords=coords,
            dims=dims,
        )


def _one_problem(chains: Chains, p: int) -> Chains:
    """`Chains.problem(p)`: problem `p`'s rows of `chains`, as its run alone."""
    problems = chains.problems
    if problems is None:
        raise BatchError(
            "these chains ran without `data`, so they are one problem: use them "
            "as they are, or run many problems with `run_chains(..., data=data)`."
        )
    p = check_int(
        p,
        "p",
        maximum=problems.count - 1,
        hint=f"The chains ran {problems.count} problems.",
    )
    rows = ProblemLayout(chains.keys.shape[0], problems.count).chains_of(p)
    start, stop = rows.start, rows.stop
    # Without `until`, every problem made every draw of the trace.
    made = None if problems.stopped is None else int(problems.draws_made[p])
    final, keys, trace, outputs = _problem_rows(
        (chains.final, chains.keys, chains.trace, chains.outputs), start, stop, made
    )
    # Whole in every process (also in a job), so sliced apart from the global
    # arrays above.
    first_step = chains.nonfinite.first_step[start:stop]
    superchain = None
    if chains.superchain is not None:
        superchain = chains.superchain[start:stop] - chains.superchain[start]
    diagnostics = None
    if problems.diagnostics is not None:
        diagnostics = jtu.tree_map(lambda x: x[p], problems.diagnostics)
    return assembled(
        Chains,
        final=final,
        trace=trace,
        outputs=outputs,
        keys=keys,
        nonfinite=assembled(NonFinite, first_step=first_step),
        superchain=superchain,
        diagnostics=diagnostics,
        steps_done=int(problems.steps_done[p]),
        stopped=None if problems.stopped is None else problems.stopped[p],
        problems=None,
        shared=jtu.tree_map(lambda x: x[p] if eqx.is_array(x) else x, problems.shared),
    )


def _problem_rows(
    fields: tuple[Any, ...], start: int, stop: int, made: int | None
) -> tuple[Any, ...]:
    """Rows `start` to `stop` of every array of `fields` (`final`, `keys`, `trace`,
    `outputs`), and of the trace and outputs their first `made` draws (all if None).

    The `jax.Array`s are sliced in one compiled program. In a job of several
    processes, slicing a global array is a collective, and an eager slice per leaf,
    a few dozen of them in flight (a loop over the problems), hung the processes
    in JAX's CPU collectives.
    """
    final, keys, trace, outputs = fields
    rows, rows_def = jtu.tree_flatten((final, keys))
    drawn, drawn_def = jtu.tree_flatten(
        (trace, outputs), is_leaf=lambda x: isinstance(x, DiskArray)
    )
    device = [i for i, x in enumerate(rows) if isinstance(x, jax.Array)]
    device_drawn = [i for i, x in enumerate(drawn) if isinstance(x, jax.Array)]
    sliced, sliced_drawn = _sliced(
        [rows[i] for i in device],
        [drawn[i] for i in device_drawn],
        start,
        stop - start,
        made,
    )
    rows = [_rows_on_host(x, start, stop) for x in rows]
    drawn = [_rows_on_host(x, start, stop, made) for x in drawn]
    for i, x in zip(device, sliced, strict=True):
        rows[i] = x
    for i, x in zip(device_drawn, sliced_drawn, strict=True):
        drawn[i] = x
    final, keys = jtu.tree_unflatten(rows_def, rows)
    trace, outputs = jtu.tree_unflatten(drawn_def, drawn)
    return final, keys, trace, outputs


@ft.partial(jax.jit, static_argnums=(3, 4))
def _sliced(
    rows: list[jax.Array],
    drawn: list[jax.Array],
    start: int,
    size: int,
    made: int | None,
) -> tuple[list[jax.Array], list[jax.Array]]:
    # `start` is traced: one program for every problem of a run.
    cut = ft.partial(lax.dynamic_slice_in_dim, start_index=start, slice_size=size)
    return [cut(x) for x in rows], [cut(x)[:, :made] for x in drawn]


def _rows_on_host(x: Any, start: int, stop: int, made: int | None = None) -> Any:
    """Rows `start` to `stop` (and draws to `made`) of a leaf not on the devices: a
    `DiskArray` read lazily, a NumPy array, or a non-array, kept as it is."""
    if isinstance(x, DiskArray):
        x = x.chains(start, stop)
        return x if made is None else x.draws(0, made)
    if not is_array(x) or isinstance(x, jax.Array):
        return x
    return x[start:stop] if made is None else x[start:stop, :made]


def _held_here(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with each array over the devices of several processes made NumPy from
    this process's devices where they hold all of it (as they hold a problem's rows,
    `Chains.problem(p)`), with no collective; refused, naming which process holds which
    rows, where they hold only part of it (each process's own chains)."""

    def here(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
            return leaf
        if is_key(leaf):
            return leaf  # no variable of ArviZ's: `to_arviz` leaves keys out
        boxes = _boxes(leaf)
        if any(box not in boxes[jax.process_index()] for box in boxes[None]):
            name = leaf_name(f"chains.{path[0].key}", path[1:])
            raise BatchError(
                f"`{name}` is a global array over the devices of the "
                f"{jax.process_count()} processes of this job, of which this process "
                f"({jax.process_index()}) holds {_rows_held(leaf, boxes)}, and "
                "`to_arviz` does not gather them silently. Call "
                "`result.gathered().to_arviz()` on every process (gathering is a "
                "collective: all must call it)."
            )
        values = np.empty(leaf.shape, leaf.dtype)
        written = set()  # each block once, however many devices hold it
        for shard in leaf.addressable_shards:
            if (box := _box(shard.index, leaf.shape)) not in written:
                values[shard.index] = np.asarray(shard.data)
                written.add(box)
        return values

    return jtu.tree_map_with_path(here, fields)


# A block of an array held by a device: each axis's (start, stop).
_Box = tuple[tuple[int, int], ...]


def _boxes(x: jax.Array) -> dict[int | None, set[_Box]]:
    """The blocks of `x` that each process's devices hold, by process, and (under
    None) every block."""
    boxes: dict[int | None, set[_Box]] = {None: set()}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        box = _box(index, x.shape)
        boxes.setdefault(device.process_index, set()).add(box)
        boxes[None].add(box)
    return boxes


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> _Box:
    return tuple(i.indices(n)[:2] for i, n in zip(index, shape, strict=True))


def _rows_held(x: jax.Array, boxes: dict[int | None, set[_Box]]) -> str:
    """Which rows (axis 0) of `x` this process holds, and which each other process
    holds: `3 of its 6 rows (rows 0-2; process 1 holds rows 3-5)`."""
    rows = {
        process: sorted({r for box in held for r in range(*box[0])})
        for process, held in boxes.items()
        if process is not None
    }
    here = rows.pop(jax.process_index(), [])
    others = "; ".join(
        f"process {process} holds {_spans(held)}"
        for process, held in sorted(rows.items())
    )
    return f"{len(here)} of its {x.shape[0]} rows ({_spans(here)}; {others})"


def _spans(rows: list[int]) -> str:
    """Sorted row numbers as runs: `rows 0-2 and 6-8`, `row 4`, `no rows`."""
    if not rows:
        return "no rows"
    runs: list[list[int]] = []
    for row in rows:
        if runs and row == runs[-1][1] + 1:
            runs[-1][1] = row
        else:
            runs.append([row, row])
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    listed = text[0] if len(text) == 1 else ", ".join(text[:-1]) + f" and {text[-1]}"
    return f"row{'s' if len(rows) > 1 else ''} {listed}"


def assembled(cls: type[eqx.Module], **fields: Any) -> Any:
    """`cls(**fields)` for `Chains` or `NonFinite`, built as JAX rebuilds a module that
    passes through a transform (`jax.tree_util.tree_unflatten`).

    Equinox's constructor looks at every leaf of its arguments (for a JAX-transformed
    function stored by mistake), which on each call of a small run costs as much as
    its loop; these modules have no `__init__`, converter or `__check_init__` of their
    own for it to skip.
    """
    names, structure = _layout(cls)
    leaves = [fields.pop(name) for name in names]
    if fields:
        # As the constructor would: a field it does not have is a mistake, not dropped.
        raise TypeError(f"{cls.__name__} has no field {', '.join(fields)}")
    return jtu.tree_unflatten(structure, leaves)


@ft.cache
def _layout(cls: type[eqx.Module]) -> tuple[list[str], Any]:
    # A module whose every field is its own name: its leaves are the fields' names in
    # the order of its leaves. With no static field (whose value would be part of the
    # structure), its structure is that of every instance.
    names = [f.name for f in dataclasses.fields(cls)]
    leaves, structure = jtu.tree_flatten(cls(**{name: name for name in names}))
    assert sorted(leaves) == sorted(names), f"{cls.__name__} has a static field"
    return leaves, structure
