"""Many Markov chains at once: `run_chains` and its result, `Chains`.

The compiled loop is a `lax.scan` over steps whose body `vmap`s one step over all
chains. Keeping the step counter outside the `vmap` leaves it unbatched, so the trace
write, the progress bar and the segment offsets are plain scalar logic, and nothing
about one chain depends on how many others run beside it.
"""

import contextlib
import dataclasses
import functools as ft
import os
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple, TYPE_CHECKING

import equinox as eqx
import jax
import jax.extend
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jax.sharding import PartitionSpec as P

from ._checkpoint import (
    as_key_data,
    as_keys_like,
    Checkpoint,
    chunk_path,
    DrawFile,
    job_lock,
    Restored,
    RunIdentity,
    Snapshot,
)
from ._compile import AsyncJit
from ._diagnostics import to_arviz
from ._errors import BatchError, bullet_list, describe, leaf_name
from ._pmap import member_mesh, shard
from ._progress import ProgressBar
from ._stack import take
from ._tree import axis_sizes, common_size, is_array, is_key, mapped_leaves


if TYPE_CHECKING:
    import xarray


class NonFinite(eqx.Module):
    """Which chains' states went NaN or infinite, and when.

    A chain whose state stops being finite keeps running (and usually stays non-finite);
    the other chains are unaffected. This report says which ones to discard or inspect.

    **Fields:**

    - `chains`: the indices of those chains, ascending (NumPy `int64`, possibly empty).
    - `steps`: for each of them, the first step, counted from 1, after which its state
        held a NaN or an infinity.

    !!! Example

        ```python
        step = lambda x, key: x * 10.0  # overflows float32 after a few dozen steps
        init = jnp.array([0.0, 1.0])
        result = eb.run_chains(step, init, jr.key(0), 50)
        result.nonfinite.chains  # array([1])
        result.nonfinite.steps  # array([39])
        ```
    """

    chains: np.ndarray
    steps: np.ndarray


class Chains(eqx.Module):
    """The result of [`eb.run_chains`][]: final states, trace, keys and a NaN report.

    **Fields:**

    - `final`: the chains' states after the last step, stacked like `init`.
    - `trace`: the recorded states (or the step's outputs with `with_output=True`),
        each array leaf shaped `[chains, draws, ...]`; non-array leaves of the state
        (an MLP's activation) are kept as in `init`. `None` with `trace=False`.
    - `keys`: each chain's PRNG key after the run, in the form it was given (typed or
        legacy). Passing `final` and `keys` to `run_chains` continues the chains
        exactly where they stopped.
    - `nonfinite`: an [`eb.NonFinite`][] report of the chains whose state went NaN or
        infinite.
    - `with_output`: whether `trace` holds the step's outputs (`with_output=True`)
        rather than the states.

    !!! Example

        ```python
        result = eb.run_chains(lambda x, key: x + 1.0, jnp.zeros(3), jr.key(0), 4)
        result.final  # [4., 4., 4.]
        result.trace.shape  # (3, 4)
        ```
    """

    final: Any
    trace: Any
    keys: jax.Array
    nonfinite: NonFinite
    with_output: bool = eqx.field(static=True, default=False)

    def to_arviz(self) -> "xarray.DataTree":
        """The trace as ArviZ data, for its convergence diagnostics and plots.

        NumPyro prints R-hat and the effective sample size after every run; here ArviZ
        computes them (`arviz_stats.rhat`, `arviz_stats.ess`, `arviz_stats.summary`)
        and draws the trace and rank plots (`arviz_plots.plot_trace`,
        `arviz_plots.plot_rank`) from this conversion. It needs the optional extra:
        `pip install 'eqx_batch[arviz]'`.

        Every array leaf of `trace` becomes one variable, named by its
        `jax.tree_util.keystr` path (`['layer1']['weights']`, `.layers[0].weight`; a
        trace that is one array is named `state`, or `output`), with dimensions
        `chain`, `draw`, then one per axis of the leaf, named as ArviZ names them
        (`['layer1']['weights']_dim_0`, ...). Non-array leaves and PRNG keys are left
        out. The draws go in the group `posterior`, where ArviZ's functions look by
        default; with `with_output=True` the step's outputs go in the group `outputs`
        instead (pass `group="outputs"` to ArviZ).

        **Returns:**

        An `xarray.DataTree` with one group, `posterior` or `outputs`: the data
        structure of ArviZ (`arviz-base`), in its 0.8 series (Python 3.11) and 1.x
        alike.

        **Raises:**

        - `ImportError` if ArviZ is not installed, naming the extra to install.
        - `eb.BatchError` if there is no trace (the chains ran with `trace=False`) or it
            holds no array.

        !!! Example

            ```python
            import arviz_stats

            def step(x, key):
                return x + jr.normal(key, x.shape)

            result = eb.run_chains(step, jnp.zeros((4, 3)), jr.key(0), 100)
            data = result.to_arviz()
            data["posterior"]["state"].dims  # ('chain', 'draw', 'state_dim_0')
            arviz_stats.rhat(data)  # a random walk: far above 1, not converged
            ```
        """
        return to_arviz(self)


# ------------------------------------------------------------------------------------
# Arguments.


def _check_counts(num_steps: int, thin: int, burn_in: int) -> None:
    for name, value, least in (("num_steps", num_steps, 0), ("thin", thin, 1)):
        if not isinstance(value, (int, np.integer)) or value < least:
            raise BatchError(f"`{name}` is {value!r}; it must be an int >= {least}.")
    if not isinstance(burn_in, (int, np.integer)) or not 0 <= burn_in <= num_steps:
        raise BatchError(
            f"`burn_in` is {burn_in!r}; it must be an int from 0 to `num_steps` "
            f"({num_steps})."
        )


def _chain_count(states: Any) -> int:
    return common_size(
        axis_sizes(mapped_leaves(states, 0, "init"), "init"),
        what="chain axis (axis 0)",
        fix="Every array leaf of `init` needs one entry per chain along axis 0.",
    )


def _chain_keys(key: Any, num_chains: int) -> tuple[jax.Array, bool]:
    """One typed key per chain, and whether `key` was given as legacy `uint32` data."""
    if isinstance(key, jax.Array) and is_key(key):
        legacy = False
    elif is_array(key) and key.dtype == np.uint32 and np.ndim(key) in (1, 2):
        legacy = True
        key = jr.wrap_key_data(jnp.asarray(key))
    else:
        raise BatchError(
            f"`key` is {describe(key)}; pass one PRNG key (`jr.key(0)`, or legacy "
            f"`jr.PRNGKey(0)`) or an array of {num_chains} keys, one per chain."
        )
    if key.ndim == 0:
        return jr.split(key, num_chains), legacy
    if key.shape != (num_chains,):
        raise BatchError(
            f"`key` holds {key.shape[0] if key.ndim == 1 else key.shape} keys but "
            f"`init` has {num_chains} chains. Pass one key per chain, or a single key "
            f"to be split with `jax.random.split(key, {num_chains})`."
        )
    return key, legacy


def _per_chain(states: Any) -> Any:
    """Shape-dtype structs of one chain's state."""
    return jtu.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if is_array(x) else x,
        states,
    )


class _TracedStep(NamedTuple):
    """`step` traced on one chain: its program (for the run's identity) and output."""

    program: jax.extend.core.ClosedJaxpr
    output: Any  # the structure of its second output with `with_output`, else None


def _trace_step(
    step: Callable, states: Any, key: jax.Array, legacy: bool, with_output: bool
) -> _TracedStep:
    """Traces `step` on one chain.

    Raises if the new state's structure, shapes or dtypes differ from the state's:
    `lax.scan` would refuse too, but naming neither the step nor the leaf.
    """
    one_key = jax.ShapeDtypeStruct(
        (2,) if legacy else (), jnp.uint32 if legacy else key.dtype
    )
    # Through a closure, so that the arrays of a partial are the program's constants.
    program, dynamic, static = eqx.filter_make_jaxpr(lambda s, k: step(s, k))(
        _per_chain(states), one_key
    )
    result = eqx.combine(dynamic, static)
    if with_output:
        if not isinstance(result, tuple) or len(result) != 2:
            raise BatchError(
                "`step` must return `(new_state, output)` when `with_output=True`, but "
                f"returned {jtu.tree_structure(result)}."
            )
        new, output = result
    else:
        new, output = result, None
    before = jtu.tree_flatten_with_path(_per_chain(states))
    after = jtu.tree_flatten_with_path(new)
    if before[1] != after[1]:
        raise BatchError(_structure_change(before, after))
    changed = [
        f"`{leaf_name('init', path)}` is {_spec(old)} per chain, but `step` returned "
        f"{_spec(new_leaf)}"
        for (path, old), (_, new_leaf) in zip(before[0], after[0], strict=True)
        if _spec(old) != _spec(new_leaf)
    ]
    if changed:
        raise BatchError(
            "`step` changed the shape or dtype of the state:\n"
            + bullet_list(changed)
            + "\nIt must return every leaf with the shape and dtype it was given "
            "(cast with `.astype`)."
        )
    return _TracedStep(program, output)


def _structure_change(before: tuple, after: tuple) -> str:
    old = {jtu.keystr(path) for path, _ in before[0]}
    new = {jtu.keystr(path) for path, _ in after[0]}
    lines = [f"`init{p}` is missing from the new state" for p in sorted(old - new)]
    lines += [f"`new_state{p}` is not in `init`" for p in sorted(new - old)]
    if not lines:
        lines = [f"init (per chain): {before[1]}", f"step returned:    {after[1]}"]
    return (
        "`step` changed the structure of the state:\n"
        + bullet_list(lines)
        + "\nIt must return a state with the same containers, keys and static fields."
    )


def _spec(x: Any) -> str:
    if isinstance(x, jax.ShapeDtypeStruct):
        return f"{x.dtype}[{','.join(map(str, x.shape))}]"
    return describe(x)


# ------------------------------------------------------------------------------------
# The compiled segment: `length` steps of every chain, starting at step `start`.


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Everything about a segment that is fixed at trace time."""

    length: int
    num_draws: int
    thin: int
    burn_in: int
    with_output: bool
    record: bool
    legacy: bool
    # How many draws from the segment's first one on to return a copy of, for the
    # checkpoint (the next segment takes over, donates, the trace buffer while they
    # are written). The most any segment of this length records, so that segments
    # that record fewer share the compiled loop; the slice then ends at the buffer's
    # end and starts before the segment's first draw.
    emit: int = 0


class _ChainState(NamedTuple):
    """Every chain between two steps: the array leaves of its state, key, NaN report."""

    # JAX arrays on the devices, or NumPy arrays on the host before they are placed.
    states: Any
    keys: Any
    first_bad: Any  # the first non-finite step, counted from 1; 0 while finite


def _all_finite(state: Any) -> jax.Array:
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jtu.tree_leaves(state)
        if is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return ft.reduce(jnp.logical_and, checks, jnp.array(True))


def _draws_before(step: int, burn_in: int, thin: int) -> int:
    """How many draws are recorded in the first `step` steps."""
    return max(0, -(-(step - burn_in) // thin))


def _segment(
    segment: _Segment,
    step: Callable,
    shared: Any,
    chains: _ChainState,
    start: jax.Array,
    progress: tuple | None,
    buffer: Any,
) -> tuple:
    """Runs one segment; returns the chains, the trace buffer, the due step of the next
    progress report (or None) and a copy of the draws around the segment's if
    `segment.emit` (else None; see `_Segment.emit`).

    `shared` holds the non-array leaves of the state; `progress` is None or a
    `ProgressHandle`, the step its next report is due, and the steps that earlier
    chunks of chains made (an `int32` scalar, so every chunk shares the program).
    """

    def one_chain(dynamic: Any, key: jax.Array) -> tuple:
        key, subkey = jr.split(key)
        result = step(
            eqx.combine(dynamic, shared),
            jr.key_data(subkey) if segment.legacy else subkey,
        )
        new, output = result if segment.with_output else (result, None)
        new = eqx.filter(new, is_array)
        return new, key, _all_finite(new), output

    def body(carry: tuple, _: None) -> tuple:
        (dynamic, keys, first_bad), buffer, t, due = carry
        dynamic, keys, finite, output = jax.vmap(one_chain)(dynamic, keys)
        first_bad = jnp.where((first_bad == 0) & ~finite, t + 1, first_bad)
        if segment.record:
            # A read-modify-write of one slot (clamped into range) rather than a
            # `lax.cond`, which XLA may turn into a copy of the whole buffer per step.
            keep = (t >= segment.burn_in) & ((t - segment.burn_in) % segment.thin == 0)
            slot = jnp.clip(
                (t - segment.burn_in) // segment.thin, 0, segment.num_draws - 1
            )

            def write(draws: jax.Array, x: jax.Array) -> jax.Array:
                old = lax.dynamic_index_in_dim(draws, slot, 1, keepdims=False)
                new = jnp.where(keep, x, old)
                return lax.dynamic_update_index_in_dim(draws, new, slot, 1)

            recorded = output if segment.with_output else dynamic
            buffer = jtu.tree_map(write, buffer, recorded)
        if progress is not None:
            # Counted over the whole run: chains run earlier (in chunks) included.
            due = progress[0](progress[2] + t + 1, due)
        return (_ChainState(dynamic, keys, first_bad), buffer, t + 1, due), None

    due = None if progress is None else progress[1]
    (chains, buffer, _, due), _ = lax.scan(
        body, (chains, buffer, start, due), None, length=segment.length
    )
    new_draws = None
    if segment.emit:
        # In the same program as the loop: no extra dispatch, and XLA can overlap it.
        first = jnp.maximum(0, -((segment.burn_in - start) // segment.thin))
        new_draws = jtu.tree_map(
            lambda b: lax.dynamic_slice_in_dim(b, first, segment.emit, 1), buffer
        )
    return chains, buffer, due, new_draws


# Dispatched without waiting: the next segment is queued while this one runs, and the
# checkpoint writer waits on the results it needs, not the loop. The trace buffer is
# donated and updated in place.
_run_segment = AsyncJit(_segment, donate=("buffer",))


@eqx.filter_jit(donate="all-except-first")
def _put_draws(draws: Any, buffer: Any) -> Any:
    """`buffer` with its first draws (along axis 1) replaced by `draws`."""
    return jtu.tree_map(
        lambda b, d: lax.dynamic_update_slice_in_dim(b, d, 0, 1), buffer, draws
    )


# ------------------------------------------------------------------------------------
# Placement: chains split over every device, padded to a multiple of the device count.


class _Placed:
    """Chains split over every device, padded to a multiple of the device count.

    The extra chains repeat chain 0: valid states whose results are dropped. Chains
    never interact, so they cannot change a real chain's bits. A chunk of a chunked run
    is padded to the size of the others (`at_least`), so that every chunk runs the same
    compiled program.
    """

    def __init__(self, num_chains: int, at_least: int = 0):
        self.num_chains = num_chains
        num_devices = member_mesh().size
        self.total = -(-max(num_chains, at_least) // num_devices) * num_devices

    def put(self, tree: Any, like: Any) -> Any:
        """`tree` (on the host or on devices) split over the devices.

        Typed PRNG keys travel as raw data (they cannot go to other processes'
        devices) and are keys again where `like` has keys.
        """
        tree = as_key_data(tree)
        if self.total != self.num_chains:
            extra = np.zeros(self.total - self.num_chains, int)
            tree = take(tree, np.r_[np.arange(self.num_chains), extra])
        if jax.process_count() > 1:
            # Only host data (the same in every process) can be placed on the devices
            # of other processes.
            tree = jtu.tree_map(lambda x: np.asarray(x) if is_array(x) else x, tree)
        return as_keys_like(shard(tree), like)

    def take(self, tree: Any) -> Any:
        """The real chains' rows, whole on every process."""
        if self.total != self.num_chains:
            tree = take(tree, np.arange(self.num_chains))
        if jax.process_count() > 1:
            # Each process would otherwise hold only its devices' chains; like
            # `eb.filter_pmap`, every process gets whole results.
            tree = self.whole(tree)
        return tree

    def whole(self, tree: Any) -> Any:
        """`tree` replicated: every process holds all of it (a collective)."""
        return _replicate(tree, jax.sharding.NamedSharding(member_mesh(), P()))

    def zeros(self, like: Any) -> Any:
        """Zeros shaped like `like` (one chain per row), created already split."""
        mesh = member_mesh()
        sharding = jax.sharding.NamedSharding(mesh, P(mesh.axis_names[0]))
        leaves, treedef = jtu.tree_flatten(as_key_data(like))
        specs = tuple(((self.total, *x.shape[1:]), x.dtype) for x in leaves)
        zeros = jtu.tree_unflatten(treedef, _sharded_zeros(specs, sharding))
        return as_keys_like(zeros, like)


@ft.partial(jax.jit, static_argnums=(1,))
def _replicate(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    return jtu.tree_map(lambda x: lax.with_sharding_constraint(x, sharding), tree)


@ft.partial(jax.jit, static_argnums=(0, 1))
def _sharded_zeros(specs: tuple, sharding: jax.sharding.Sharding) -> list[jax.Array]:
    # Made on the devices that hold them, rather than on one device and then moved.
    return [
        lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)
        for shape, dtype in specs
    ]


# ------------------------------------------------------------------------------------
# Where a run starts: from `init`, or from its checkpoint.


class _Start(NamedTuple):
    steps_done: int
    chains: _ChainState
    buffer: Any  # the trace buffer, with the draws already made; None without trace


def _start(
    placed: _Placed,
    init: _ChainState,
    trace_like: Any,
    restored: Restored | None,
) -> _Start:
    """The chains and trace buffer, placed, at the start or as checkpointed."""
    if restored is None:
        chains = placed.put(init, like=init)
        buffer = None if trace_like is None else placed.zeros(trace_like)
        return _Start(0, chains, buffer)
    saved = _ChainState(restored.states, restored.keys, restored.first_bad)
    chains = placed.put(saved, like=init)
    buffer = None
    if trace_like is not None:
        leaf = jtu.tree_leaves(restored.draws)[0]
        if leaf.shape[1] == jtu.tree_leaves(trace_like)[0].shape[1]:
            # A finished run: the draws are the whole trace, placed once.
            buffer = placed.put(restored.draws, like=trace_like)
        else:
            buffer = placed.zeros(trace_like)
            if leaf.shape[1]:
                draws = placed.put(restored.draws, like=trace_like)
                buffer = _put_draws(draws, buffer)
    return _Start(restored.steps_done, chains, buffer)


def _state_like(init: _ChainState) -> dict[str, Any]:
    """The structure of the run state that a checkpoint holds."""
    return {
        "states": jtu.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init.states
        ),
        "keys": jax.ShapeDtypeStruct(init.keys.shape, init.keys.dtype),
        "first_bad": jax.ShapeDtypeStruct(init.first_bad.shape, init.first_bad.dtype),
    }


# ------------------------------------------------------------------------------------


def run_chains(
    step: Callable,
    init: Any,
    key: Any,
    num_steps: int,
    *,
    thin: int = 1,
    burn_in: int = 0,
    with_output: bool = False,
    trace: bool = True,
    progress: bool = False,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    chunk_size: int | None = None,
) -> Chains:
    """Runs many independent Markov chains in parallel, from a step written for one.

    `step` advances one chain's state, a pytree such as a model's weights; `init`
    stacks many such states along axis 0. All chains run in one compiled loop, spread
    over every device of every process, and chain `i` gets the same result (bit for
    bit, when its step is elementwise) as running it alone with its own key: each
    step's key is split from the chain's own carried key, so the number of chains,
    devices, processes, thinning or checkpoint interval never changes a chain's
    random stream.

    A chain whose state goes NaN or infinite keeps running without disturbing the
    others and is reported in `nonfinite`.

    The trace is one buffer of its final size, written in place as the loop runs. When
    the number of chains does not divide evenly over the devices, the chains are
    padded with copies of chain 0 whose results are dropped (at the cost of one copy of
    the results when they are sliced off).

    **Arguments:**

    - `step`: `step(state, key) -> new_state` for ONE chain, or
        `step(state, key) -> (new_state, output)` with `with_output=True`. The new
        state must have the structure, shapes and dtypes of `state`. Pass data with
        `functools.partial` (its arrays become arguments of the compiled loop, so a
        new partial does not recompile) or by closure (compiled in as constants).
    - `init`: the chains' initial states, stacked along axis 0 of every array leaf (a
        dict of arrays, an Equinox module, ...). Non-array leaves are shared.
    - `key`: one PRNG key, split with `jax.random.split(key, chains)`, or an array of
        one key per chain. Typed (`jr.key`) and legacy (`jr.PRNGKey`) keys both work;
        `step` receives keys of the same kind.
    - `num_steps`: how many steps each chain takes.
    - `thin`, `burn_in`: the trace keeps the state after steps `burn_in + 1`,
        `burn_in + 1 + thin`, ... : the uninterrupted trace `[:, burn_in::thin]`.
    - `with_output`: record `step`'s second output in the trace instead of the state.
    - `trace`: whether to record a trace at all (memory: chains x draws x state).
    - `progress`: show one tqdm bar for all chains, updated from inside the compiled
        loop (each update is one host callback): at most about 100 times per run,
        and, once the loop's speed is known, about every 0.1 s (as often as tqdm
        redraws), so a short run makes only a few callbacks.
    - `checkpoint`: a file path. The run state is written there atomically, new
        draws to files named after it and the run in the same folder (all safetensors
        files), and a call of the same run resumes from it, bit for bit; if the run
        finished, its result is read back without recomputing. A run is identified by
        the structure, shapes, dtypes and values of `init`, the keys, `num_steps`,
        `thin`, `burn_in`, `with_output`, `trace`, and what `step` computes (a digest
        of its traced program and of its constants' values, not its name); every
        file records it, and a checkpoint of another run is refused. Before any step,
        the folder is checked by creating a file in it, and the process that writes
        takes a lock (`path.lock`, released by the operating system when the process
        ends, killed or not), so a second live run on the same path is refused. In a
        job of several processes, process 0 writes it and every process reads it (a
        folder they all see).
    - `checkpoint_every`: write the checkpoint after every this many steps (while the
        next steps run). `None` writes it once, at the end.
    - `chunk_size`: run this many chains at a time, for more chains than fit in memory
        at once: chains `0` to `chunk_size`, through every step, then the next
        `chunk_size`, and so on, each chunk spread over every device as a whole run
        is. Every chunk runs the same compiled program (the last one is padded with
        copies of its first chain, whose results are dropped) and every chain's
        results are bit for bit those of the unchunked run. Memory holds one chunk's
        states, working memory and trace at a time, plus the results of the chunks
        already run (the result holds every chain). With `checkpoint`, each chunk is
        checkpointed to its own files, `checkpoint.chains-A-B` for chains `A` to `B`
        (and its draw files), under the one lock of `checkpoint`; a finished chunk is
        read back when the run resumes. The progress bar counts the steps of every
        chunk. `None` (the default), or at least the number of chains, runs them all
        at once.

    **Returns:**

    A [`eb.Chains`][] with `final`, `trace` (`[chains, draws, ...]` per leaf), `keys`
    (to continue the run exactly) and `nonfinite`. Its arrays stay split over the
    devices; in a job of several processes, every process gets whole results.

    **Raises:**

    - `eb.BatchError` if `step` changes the state's structure, a leaf's shape or
        dtype (naming the leaf), or does not return a pair with `with_output=True`;
        if `key` does not hold one key or one key per chain; if the array leaves of
        `init` disagree on the number of chains; if `num_steps`, `thin`, `burn_in`,
        `checkpoint_every` or `chunk_size` are out of range. For `checkpoint`:
        before any step, if its folder is missing or cannot be written, or another
        live run holds it; if it holds a checkpoint of a different run (saying what
        differs), a file that is not a checkpoint, or a corrupt one; and, during the
        run, if writing it fails (a full disk: the last good checkpoint is kept, to
        resume from).

    !!! Example

        ```python
        def step(state, key):  # random-walk Metropolis on a standard normal
            proposal = state + 0.5 * jr.normal(key, state.shape)
            log_ratio = 0.5 * (jnp.sum(state**2) - jnp.sum(proposal**2))
            accept = jnp.log(jr.uniform(jr.fold_in(key, 1))) < log_ratio
            return jnp.where(accept, proposal, state)

        init = jnp.zeros((8, 3))  # 8 chains of a 3-d state
        result = eb.run_chains(step, init, jr.key(0), 200, burn_in=100, thin=2)
        result.trace.shape  # (8, 50, 3)
        ```
    """
    _check_counts(num_steps, thin, burn_in)
    _check_checkpoint_every(checkpoint, checkpoint_every)
    _check_chunk_size(chunk_size)
    init_arrays, shared = eqx.partition(init, is_array)
    num_chains = _chain_count(init_arrays)
    keys, legacy = _chain_keys(key, num_chains)
    if isinstance(step, ft.partial) and not isinstance(step, jtu.Partial):
        # As a pytree, a partial's arrays (the data) are arguments of the compiled loop
        # rather than constants baked into it, so a new partial does not recompile.
        step = jtu.Partial(step.func, *step.args, **step.keywords)
    traced = _trace_step(step, init, keys, legacy, with_output)
    num_draws = _draws_before(num_steps, burn_in, thin)
    run = _Run(
        step=step,
        shared=shared,
        segment=_Segment(
            length=0,
            num_draws=num_draws,
            thin=thin,
            burn_in=burn_in,
            with_output=with_output,
            record=trace and num_draws > 0,
            legacy=legacy,
        ),
        num_steps=num_steps,
        recorded=(
            None
            if not trace
            else traced.output
            if with_output
            else _per_chain(init_arrays)
        ),
        program=traced.program,
        counts={
            "num_steps": num_steps,
            "thin": thin,
            "burn_in": burn_in,
            "with_output": with_output,
            "trace": trace,
        },
        checkpoint_every=checkpoint_every,
    )
    size = max(1, num_chains if chunk_size is None else min(chunk_size, num_chains))
    bounds = [(a, min(a + size, num_chains)) for a in range(0, num_chains, size)]
    bounds = bounds or [(0, 0)]
    # In a job of several processes, process 0 writes checkpoints for all of them.
    writes = jax.process_index() == 0

    with contextlib.ExitStack() as stack:
        bar = None
        if progress:
            # One bar over every chunk's steps.
            total = num_steps * len(bounds)
            bar = stack.enter_context(ProgressBar(total, "run_chains")).handle
        path = None if checkpoint is None else pathlib.Path(checkpoint)
        if path is not None and len(bounds) > 1:
            stack.enter_context(job_lock(path, writes=writes))
        pieces = []
        for index, (first, stop) in enumerate(bounds):
            if len(bounds) == 1:
                block_init, block_keys, block_path = init_arrays, keys, path
            else:
                # Gathered (one program per chunk size), not sliced (one per chunk).
                rows = np.arange(first, stop)
                block_init = take(init_arrays, rows)
                block_keys = as_keys_like(take(as_key_data(keys), rows), keys)
                block_path = None if path is None else chunk_path(path, first, stop)
            pieces.append(
                run.block(
                    block_init,
                    block_keys,
                    rows=size if len(bounds) > 1 else 0,
                    checkpoint=block_path,
                    locks=len(bounds) == 1,
                    writes=writes,
                    progress=None if bar is None else (bar, index * num_steps),
                )
            )
            if len(bounds) > 1:
                # Segments are dispatched without waiting: left alone, every chunk would
                # be queued at once and, on a CPU, run side by side, with the working
                # memory of all of them. Each chunk finishes before the next starts.
                jax.block_until_ready(pieces[-1])

    if len(pieces) == 1:
        chains, recorded = pieces[0]
    else:
        # Joined at the end: until now, each piece was only as large as its chunk.
        def join(trees: list) -> Any:
            return jtu.tree_map(lambda *xs: jnp.concatenate(xs), *trees)

        chains = join([chains for chains, _ in pieces])
        traces = [trace for _, trace in pieces]
        recorded = None if traces[0] is None else join(traces)
    if recorded is not None and not with_output:
        # Non-array leaves (an MLP's activation) are shared, so the trace has them too.
        recorded = eqx.combine(recorded, shared)
    nonfinite_steps = np.asarray(chains.first_bad)
    bad_chains = np.flatnonzero(nonfinite_steps)
    return Chains(
        final=eqx.combine(chains.states, shared),
        trace=recorded,
        keys=jr.key_data(chains.keys) if legacy else chains.keys,
        nonfinite=NonFinite(
            chains=bad_chains.astype(np.int64),
            steps=nonfinite_steps[bad_chains].astype(np.int64),
        ),
        with_output=with_output,
    )


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every chunk of chains of one call of `run_chains` shares."""

    step: Callable
    shared: Any  # the non-array leaves of the state
    segment: _Segment  # with `length` 0: set per segment
    num_steps: int
    recorded: Any  # one chain's recorded leaves, as shape-dtype structs; None if none
    program: jax.extend.core.ClosedJaxpr  # `step`, traced: for the run's identity
    counts: dict[str, Any]  # the arguments that change results, for the identity
    checkpoint_every: int | None

    def block(
        self,
        init: Any,
        keys: jax.Array,
        *,
        rows: int,
        checkpoint: pathlib.Path | None,
        locks: bool,
        writes: bool,
        progress: tuple[Any, int] | None,
    ) -> tuple[_ChainState, Any]:
        """Runs the chains of `init` (array leaves) and `keys` through every step.

        They are padded to `rows` chains (and to a multiple of the device count), so
        that every chunk of a chunked run runs one program. `progress` is the bar's
        handle and the steps of the chunks before this one. Returns the chains and
        trace (None without one), whole on every process.
        """
        num_chains = keys.shape[0]
        trace_like = None
        if self.recorded is not None:
            draws = self.segment.num_draws
            trace_like = jtu.tree_map(
                lambda x: jax.ShapeDtypeStruct((num_chains, draws, *x.shape), x.dtype),
                self.recorded,
            )
        initial = _ChainState(init, keys, np.zeros(num_chains, np.int32))
        with contextlib.ExitStack() as stack:
            store = restored = None
            if checkpoint is not None:
                identity = RunIdentity.of(
                    self.program, eqx.combine(init, self.shared), keys, self.counts
                )
                store = Checkpoint(
                    checkpoint, identity, num_chains, writes=writes, locks=locks
                )
                stack.enter_context(store)
                restored = store.restore(_state_like(initial), trace_like)
            placed = _Placed(num_chains, at_least=rows)
            steps_done, chains, buffer = _start(placed, initial, trace_like, restored)
            bar = None
            if progress is not None:
                handle, before = progress
                bar = (handle, handle.start(before + steps_done), np.int32(before))
            num_steps = self.num_steps
            interval = self.checkpoint_every or max(num_steps - steps_done, 1)
            while steps_done < num_steps:
                window = _Window.of(
                    self.segment,
                    steps_done,
                    min(interval, num_steps - steps_done),
                    store,
                )
                chains, buffer, due, new_draws = _run_segment(
                    dataclasses.replace(
                        self.segment, length=window.length, emit=window.emit
                    ),
                    self.step,
                    self.shared,
                    chains,
                    np.int32(steps_done),
                    bar,
                    buffer,
                )
                if bar is not None:
                    bar = (bar[0], due, bar[2])
                steps_done += window.length
                if store is not None:
                    store.write(
                        _snapshot(placed, steps_done, chains, new_draws, window)
                    )
        return placed.take(chains), None if buffer is None else placed.take(buffer)


def _check_chunk_size(chunk_size: Any) -> None:
    if chunk_size is None:
        return
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, (int, np.integer))
        or chunk_size < 1
    ):
        raise BatchError(
            f"`chunk_size` is {chunk_size!r}; it must be an int >= 1 (how many chains "
            "to run at a time), or None to run every chain at once."
        )


def _check_checkpoint_every(checkpoint: Any, checkpoint_every: Any) -> None:
    if checkpoint_every is None:
        return
    if checkpoint is None:
        raise BatchError(
            "`checkpoint_every` is set but `checkpoint` is None: pass a file path as "
            "`checkpoint` to write checkpoints to."
        )
    if not isinstance(checkpoint_every, (int, np.integer)) or checkpoint_every < 1:
        raise BatchError(
            f"`checkpoint_every` is {checkpoint_every!r}; it must be an int >= 1."
        )


class _Window(NamedTuple):
    """One segment's steps and, when checkpointing, where its new draws lie."""

    length: int
    emit: int  # see `_Segment.emit`
    draw_file: DrawFile | None  # the file for the segment's draws, if it records any
    offset: int  # where they start in the emitted slice

    @classmethod
    def of(
        cls, segment: _Segment, start: int, length: int, store: Checkpoint | None
    ) -> "_Window":
        if store is None or not segment.record:
            return cls(length, 0, None, 0)
        first = _draws_before(start, segment.burn_in, segment.thin)
        stop = _draws_before(start + length, segment.burn_in, segment.thin)
        if stop == first:
            return cls(length, 0, None, 0)
        emit = min(-(-length // segment.thin), segment.num_draws)
        draw_file = DrawFile(store.draws_name(first, stop), first, stop)
        return cls(
            length, emit, draw_file, first - min(first, segment.num_draws - emit)
        )


def _snapshot(
    placed: _Placed,
    steps_done: int,
    chains: _ChainState,
    new_draws: Any,
    window: _Window,
) -> Snapshot:
    """What to checkpoint after `steps_done` steps."""
    if jax.process_count() > 1:
        # Every process takes part in gathering (a collective); process 0 writes.
        chains, new_draws = placed.whole((chains, new_draws))
    return Snapshot(
        steps_done,
        chains.states,
        chains.keys,
        chains.first_bad,
        draws=new_draws,
        draw_file=window.draw_file,
        offset=window.offset,
    )
