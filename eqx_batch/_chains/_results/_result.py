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
    - `trace`: the recorded states, each array leaf shaped `[chains, draws, ...]`
        (only the draws made, with `until`), the same with or without
        `with_output`; non-array leaves of the state (an MLP's activation) are kept
        as in `init`. `None` with `trace=False`; a run that makes no draw
        (`num_steps=0`, or `burn_in=num_steps`) has an empty trace, `[chains, 0,
        ...]`, and `outputs` likewise.
    - `outputs`: with `with_output=True`, the step's recorded outputs (its
        acceptance, divergence, energy...), each array leaf shaped as `trace`'s
        (`[chains, draws, ...]`, the same draws); non-array leaves of the output are
        kept as the step returned them. `None` without `with_output`; with
        `trace=False`, the outputs alone are recorded (`trace` is then `None`).
    - `keys`: each chain's PRNG key after the run, in the form it was given (typed or
        legacy). Passing `final` and `keys` to `run_chains` continues the chains
        exactly where they stopped.
    - `nonfinite`: an [`eb.NonFinite`][] report of the chains whose state went NaN or
        infinite.
    - `superchain`: with `superchains=K`, each chain's superchain, `c // M` for chain
        `c` (NumPy `int64[chains]`); `None` without superchains.
    - `diagnostics`: with `diagnostics=True`, an [`eb.Diagnostics`][] of the chains
        (R-hat, split R-hat, nested R-hat with superchains, ESS), computed on the
        devices from running moments of the recorded draws; `None` without, and
        with many problems (`data`: each problem's are in `problems`). With `until`,
        of the last window's draws (a failed check discards its window), and
        `split_rhat` is `None`.
    - `steps_done`: the steps the chains ran: `num_steps`, or fewer when `until`
        stopped the run early. With many problems, the most that any problem ran:
        the trace's extent (each problem's are in `problems`).
    - `stopped`: with `until`, an [`eb.Stopped`][]: when the run stopped and why,
        and the checks made; `None` without `until`, and with many problems (each
        stops on its own: their stops are in `problems`).
    - `shared`: with `shared=`, the final shared state of the chains' problem (with
        `data`, `None`: each problem's is in `problems.shared`); `None` without.
    - `problems`: with `data`, an [`eb.Problems`][]: how many problems the chains
        ran, and each problem's steps, stop, draws and diagnostics, one entry per
        problem; `None` without `data`. [`problem(p)`][eqx_batch.Chains.problem] is
        one problem's result alone. The trace holds the draws of the problem that
        ran longest.

    !!! Example

        ```python
        result = eb.run_chains(lambda x, key: x + 1.0, jnp.zeros(3), jr.key(0), 4)
        result.final  # [4., 4., 4.]
        result.trace.shape  # (3, 4)

        def step(x, key):  # a step that also says how far it moved
            new = x + jr.normal(key, x.shape)
            return new, {"jump": jnp.abs(new - x)}

        result = eb.run_chains(step, jnp.zeros(3), jr.key(0), 4, with_output=True)
        result.trace.shape  # (3, 4): the states, as without `with_output`
        result.outputs["jump"].shape  # (3, 4)
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

        Its chains are rows `p * M` to `(p + 1) * M` of every array (M chains a
        problem), laid out as if problem `p` had run alone: its `nonfinite` chains
        and `superchain` ids counted within it, its own `diagnostics`, and
        `to_arviz()`; with `until`, its own `steps_done` and `stopped`, and only the
        draws it made. For a step elementwise over chains, the numbers are bit for
        bit its run alone with its row given as an argument
        (`functools.partial(step, data=row)`); a row closed over as a constant may
        round otherwise (see the guide's "Many problems in one run").
        In a job of several processes, slicing the global arrays is a program over
        every process's rows: every process must call it, as for `gathered`. Its
        arrays come out whole in every process, so its `to_arviz()` needs no
        gathering.

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
        problems = self.problems
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
        rows = ProblemLayout(self.keys.shape[0], problems.count).chains_of(p)
        start, stop = rows.start, rows.stop
        # Without `until`, every problem made every draw of the trace.
        made = None if problems.stopped is None else int(problems.draws_made[p])
        final, keys, trace, outputs = _problem_rows(
            (self.final, self.keys, self.trace, self.outputs), start, stop, made
        )
        # Whole in every process (also in a job), so sliced apart from the global
        # arrays above.
        first_step = self.nonfinite.first_step[start:stop]
        superchain = None
        if self.superchain is not None:
            superchain = self.superchain[start:stop] - self.superchain[start]
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
            shared=jtu.tree_map(
                lambda x: x[p] if eqx.is_array(x) else x, problems.shared
            ),
        )

    def gathered(self) -> "Chains":
        """The chains with whole copies of their arrays in this process: for a job
        of several processes, where each process holds only its own chains' rows.

        `run_chains` leaves its results where they were computed, split by chain over
        the devices of every process (JAX's convention for a compiled program's
        outputs), so that no host holds more than its share. Where one process needs
        every chain (to save, plot or convert them with `to_arviz`), this gathers
        them: a collective, so every process of the job must call it, in the same
        order. In one process, every array is already whole, and the result itself
        is returned.

        **Returns:**

        A `Chains` whose arrays (`final`, `trace`, `outputs`, `keys`) are whole and
        fully addressable: each on one of this process's devices, typed PRNG keys
        still typed. `np.asarray` makes any of them NumPy.

        **Raises:**

        Nothing of its own. Called by some processes of a job and not others, it
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
        """The trace as ArviZ data, for its convergence diagnostics and plots.

        NumPyro prints R-hat and the effective sample size after every run; here ArviZ
        computes them (`arviz_stats.rhat`, `arviz_stats.ess`, `arviz_stats.summary`)
        and draws the trace and rank plots (`arviz_plots.plot_trace`,
        `arviz_plots.plot_rank`) from this conversion. It needs the optional extra:
        `pip install 'eqx_batch[arviz]'`.

        The layout is the one BlackJAX and NumPyro users get: the recorded states
        (`trace`) go in the group `posterior`, where ArviZ's functions look by default,
        and the step's outputs (`outputs`, with `with_output=True`: its acceptance,
        divergence, energy...) go in the group `sample_stats`, so
        `arviz_stats.summary(data)` summarises the posterior alone.

        Every array leaf becomes one variable, named by its path with each entry (dict
        key, attribute, index) written plainly and joined with dots, as PyTorch's
        `state_dict` and Flax name parameters, so that `var_names=`, summary tables and
        plot titles carry names users can type: `{"layer1": {"weights": w}}` gives
        `layer1.weights`, an MLP's `.layers[0].weight` gives `layers.0.weight`, an
        output `{"accept": a}` gives `accept`. A state that is one array is named
        `state`, an output that is one array `output`. The dimensions are `chain`,
        `draw`, then one per axis of the leaf, named as ArviZ names them
        (`layer1.weights_dim_0`, ...). A state and an output may share a name: they
        are in different groups. Outputs named as ArviZ names a sampler's statistics
        (`diverging`, `energy`, `lp`, `acceptance_rate`) are found where its checks and
        plots look for them; see [Naming outputs for
        ArviZ](../chains.md#naming-outputs-for-arviz), which maps BlackJAX's `info`.

        Floats narrower than float32 (bfloat16, float16), which NumPy and ArviZ cannot
        compute in, become float32, exactly. Non-array leaves and typed PRNG keys
        (`jr.key`) are left out; legacy keys (`jr.PRNGKey`, `uint32` data) cannot be
        told from data and become variables: keep keys in the state typed. With
        `superchains`, the `chain` dimension has a coordinate `superchain` holding each
        chain's superchain, for `arviz_stats.rhat_nested(data,
        superchain_ids=data.posterior.superchain.values)`.

        `dims` and `coords` label the axes, as ArviZ's own converters
        (`arviz_base.from_dict`, `from_numpyro`) take them: `dims={"theta":
        ["school"]}` names the axis of the variable `theta` after `chain` and `draw`
        `school` (variables that share a dimension name it alike), and
        `coords={"school": names}` gives its entries labels, for
        `data.posterior.theta.sel(school="Choate")` and labelled summary rows and
        plot titles (`theta[Choate]`).

        **Arguments:**

        - `coords`: a dimension's labels, one per entry, by the dimension's name: one
            named in `dims`, one of ArviZ's (`theta_dim_0`), or `chain` or `draw`.
        - `dims`: the names of a variable's axes after `chain` and `draw`, one per
            axis, by the variable's name (as above: `layer1.weights`, `state`); a
            variable it does not name keeps ArviZ's names.

        **Returns:**

        An `xarray.DataTree` with the group `posterior` and, with `outputs`
        (`with_output=True`), `sample_stats`, each only if it holds an array: the data
        structure of ArviZ (`arviz-base`), in its 0.8 series (Python 3.11) and 1.x
        alike.

        **Raises:**

        - `ImportError` if ArviZ is not installed, naming the extra to install.
        - `eb.BatchError` for the chains of many problems (`data=`): convert each
            with `result.problem(p).to_arviz()`.
        - `eb.BatchError` if nothing was recorded (`trace=False` without
            `with_output`; with it, the outputs alone are `sample_stats`) or it holds
            no array.
        - `eb.BatchError` in a job of several processes, for an array this process
            holds only part of (each process holds only its own chains' rows): it
            never gathers them silently, and the message says which process holds
            which rows. Call `result.gathered().to_arviz()` on every process
            (gathering is a collective). One problem's chains, `problem(p)`, are
            held whole in every process, and convert as they are.
        - `eb.BatchError` if two leaves of one group would get one name (`{"a.b": x,
            "a": {"b": y}}`, or a leaf `a_dim_0` beside a vector `a`, whose axis is
            named so), or a leaf would take a name ArviZ gives itself (`chain`,
            `draw`, and `superchain` with superchains) or cannot hold (one with `/`).
            The message names both paths and the name: rename a dict key or field.
        - `eb.BatchError` if `dims` names a variable the chains do not have (the
            message lists theirs), or not one name per axis after `chain` and
            `draw`, or gives one name to axes of different sizes (or to a variable's
            name); or if `coords` labels a dimension the data do not have (the
            message lists theirs), or not one label per entry. Each message names
            the entry of `dims` or `coords`, and the sizes that disagree.

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
