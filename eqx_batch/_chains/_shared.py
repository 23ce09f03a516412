"""A state the chains of a problem share: `run_chains(eb.all_chains(fn), ..., shared=S)`
with `fn(states, keys, count, shared[, data]) -> (states, shared[, outputs])`.

Adaptive samplers that pool a problem's chains (ChEES, MEADS) tune one step size or
trajectory length from all of them. The run carries the shared state as a copy beside
each chain's own state (`WithShared`): a row per chain moves with its chain through
everything that already moves chains (chunks, devices, padding, compaction's pieces,
checkpoints and resume on another layout, a job's agreement), so none of them learns
a new kind of row. Each step reads the copy of a problem's first chain and writes the
new shared state back to every chain of the problem; only the chains' own states are
recorded, diagnosed and returned as `final`. The copies cost a broadcast per step and
the shared state's size once per chain in memory and in the checkpoint: adaptation
states are a few numbers.

With `data`, the chains are grouped by problem (`M` consecutive chains each) and `fn`
is mapped over the problems, each given its chains, its row of `shared` and its row of
`data`, as a loop written by hand as a `vmap` over problems would.
"""

import dataclasses
import functools as ft
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import (
    BatchError,
    bullet_list,
    call_mismatch,
    describe,
    leaf_name,
    shown_signature,
)
from .._tree import is_array, owned, structs
from ._all_chains import AllChains, each_chain, MapChains, RunStep
from ._arguments import Init
from ._common import ManyProblems, OneProblem, ProblemForm, ProblemLayout
from ._problems import jax_dtypes, problem_step
from ._step import check_new_state, leaf_changes, pytree_step


_SHARED_IS = "(see docs/chains.md#a-state-the-chains-share)"


class WithShared(NamedTuple):
    """One chain's state as a run with `shared` carries it."""

    state: Any  # the chain's own state, as `init` gives it
    shared: Any  # a copy of its problem's shared state


class Packing(NamedTuple):
    """How a shared state is packed: one array per dtype, `[rows, K]`, each leaf
    flattened into its columns. A loop carries one buffer per dtype rather than one
    per leaf: on a CPU, nine leaves of an adaptation state cost its loop a third."""

    treedef: Any
    leaves: tuple  # (shape, dtype) of each leaf of one problem's shared state
    dtypes: tuple  # the dtype of each packed array, in order

    @classmethod
    def of(cls, shared: Any, drop: int) -> "Packing":
        """The packing of a problem's shared state: `shared`'s leaves (arrays or
        structs) without their first `drop` axes."""
        leaves, treedef = jtu.tree_flatten(shared)
        kinds = tuple((tuple(x.shape[drop:]), x.dtype) for x in leaves)
        dtypes = tuple(dict.fromkeys(dtype for _, dtype in kinds))
        return cls(treedef, kinds, dtypes)

    def pack(self, tree: Any) -> tuple:
        """`tree`'s leaves (each `[rows, *shape]`) as one `[rows, K]` per dtype."""
        leaves = jtu.tree_leaves(tree)
        rows = leaves[0].shape[0]
        return tuple(
            jnp.concatenate(
                [
                    x.reshape(rows, -1)
                    for x, (_, kind) in zip(leaves, self.leaves, strict=True)
                    if kind == dtype
                ],
                axis=1,
            )
            for dtype in self.dtypes
        )

    def unpack(self, packed: tuple) -> Any:
        """The tree of `packed`, each leaf `[rows, *shape]`."""
        start = dict.fromkeys(self.dtypes, 0)
        leaves = []
        for shape, dtype in self.leaves:
            size, first = math.prod(shape), start[dtype]
            array = packed[self.dtypes.index(dtype)]
            leaves.append(
                array[:, first : first + size].reshape(array.shape[0], *shape)
            )
            start[dtype] = first + size
        return self.treedef.unflatten(leaves)


# A frozen dataclass rather than an `eqx.Module`, as `ProblemStep` is: every call of
# `run_chains` with `shared` makes a few and asks them several methods, and each
# method asked of a Module makes a bound method, itself a Module.
@ft.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "mapping"],
    meta_fields=["chains_each", "with_output", "packing"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class SharedStep:
    """`fn(states, keys, count, shared[, data])` as a run calls it (`RunStep`): on
    every chain of each problem at once, its shared state carried beside them."""

    step: Callable
    mapping: "_Unmapped | _OverProblems"  # how `fn` is called on the problems
    chains_each: int  # M, the chains of a problem
    with_output: bool
    packing: Packing | None = None
    sees_every_chain: ClassVar[bool] = True  # (`RunStep`)

    def __call__(self, states: WithShared, keys: Any, count: Any) -> Any:
        """`fn` on every chain, of problems of `chains_each` chains in order."""
        num_chains = keys.shape[0]
        problem = jnp.arange(num_chains, dtype=jnp.int32) // self.chains_each
        return self.for_chains(problem, 1)[0](states, keys, count)

    @property
    def data(self) -> Any:
        """Each problem's row of `data` (`RunStep`); None without `data`."""
        return self.mapping.data

    def own_and_shared(self, states: Any) -> tuple[Any, Any]:
        """The chains' own states, and each problem's shared state (a row per
        problem), read from its first chain's copy."""
        assert self.packing is not None
        if states.shared[0] is None:  # the static leaves: the shared state has none
            return states.state, None
        return states.state, _first_rows(self.packing, self.chains_each, states.shared)

    def chunk_unit(self, num_chains: int) -> int:
        """A problem's chains: it sees them at once."""
        return self.chains_each

    def with_placed_data(self, data: Any) -> "SharedStep":
        """This step with `data`, its own placed on the devices."""
        return dataclasses.replace(self, mapping=self.mapping.with_placed_data(data))

    def for_chains(self, problem: Any, block: int) -> tuple[Callable, MapChains]:
        """The step on a segment's chains, whole problems of `chains_each` in
        order, each problem's row of `data` taken once, before the loop."""
        rows = self.mapping.rows(problem, self.chains_each)
        return ft.partial(self._on_problems, rows), each_chain

    def traced_call(
        self, states: Any, keys: jax.Array, one_key: jax.ShapeDtypeStruct
    ) -> tuple[Callable, tuple]:
        """Every chain's state, one key per chain, an `int32` count, and `data`
        (an argument, not a constant: the run's identity names it on its own)."""

        def call(s: Any, k: Any, count: Any, mapping: Any) -> Any:
            return dataclasses.replace(self, mapping=mapping)(s, k, count)

        keys_like = jax.ShapeDtypeStruct((keys.shape[0], *one_key.shape), one_key.dtype)
        count_like = jax.ShapeDtypeStruct((), jnp.int32)
        return call, (structs(states), keys_like, count_like, structs(self.mapping))

    def with_data(self, data: Any) -> "SharedStep":
        """This step given each problem's row of `data` (`carrying` checks that `fn`
        takes it)."""
        return dataclasses.replace(self, mapping=_OverProblems(jax_dtypes(data)))

    def _on_problems(self, rows: Any, states: WithShared, keys: Any, count: Any):
        """`fn` on each problem's chains, the new shared state copied to them all."""
        own, copies = states
        assert self.packing is not None
        num_chains = keys.shape[0]
        layout = ProblemLayout(num_chains, num_chains // self.chains_each)
        shared = self.packing.unpack(tuple(layout.blocks(x)[:, 0] for x in copies))

        def fn(states: Any, keys: Any, shared: Any, *row: Any) -> tuple:
            return self._parts(
                self.step(states, keys, count, shared, *row), states, shared
            )

        given = (own, keys, shared, rows)
        new, new_shared, output = self.mapping.call(fn, given, layout)
        # A shared state returned as it was given (a sampler's frozen values) is
        # carried through as it is, so that XLA sees it constant over the loop and
        # hoists what the step computes of it out of the loop.
        new_copies = (
            copies
            if _same_values(new_shared, shared)
            else tuple(
                jnp.broadcast_to(
                    x[:, None], (layout.num_problems, self.chains_each, x.shape[1])
                ).reshape(num_chains, x.shape[1])
                for x in self.packing.pack(new_shared)
            )
        )
        # The segment holds the new states behind one barrier (`_as_carried`), so
        # that the loop carries and the trace records one value: without it a
        # draw recorded on a CPU could differ from the state by an ulp (found by
        # tests/test_shared.py).
        carried = WithShared(new, new_copies)
        return (carried, output) if self.with_output else carried

    def _parts(self, result: Any, own: Any, shared: Any) -> tuple:
        """`fn`'s result as the new states, shared state and outputs (None without
        `with_output`), checked against the `own` states and `shared` state it was
        given, at trace time.

        **Raises:**

        `BatchError` if `fn` returned another number of parts, or changed the
        structure, shapes or dtypes of the states or of the shared state.
        """
        size = 3 if self.with_output else 2
        if not isinstance(result, tuple) or len(result) != size:
            parts = (
                "(states, shared, outputs)" if self.with_output else "(states, shared)"
            )
            raise BatchError(
                f"`step` with `shared` returns `{parts}`, but returned "
                f"{jtu.tree_structure(result)} {_SHARED_IS}."
            )
        new, new_shared = result[:2]
        check_new_state(structs(own), new, whole=True)
        _check_new_shared(structs(shared), new_shared)
        return new, new_shared, result[2] if self.with_output else None


# Frozen dataclasses rather than `eqx.Module`s: a Module's checks at construction cost
# 15-30 us, and every call of `run_chains` makes one of these (a short run's host time).
@ft.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class _Unmapped:
    """How a run of one problem calls `fn(states, keys, count, shared)`: once, on the
    stack as it is, with no map over problems (as a loop written by hand calls it)."""

    data: ClassVar[None] = None
    num_args: ClassVar[int] = 4
    # The problem axes of `shared` as the run is given it: it is one problem's.
    shared_axes: ClassVar[int] = 0

    def with_placed_data(self, data: None) -> "_Unmapped":
        """Itself: it holds no `data`."""
        return self

    def rows(self, problem: Any, chains_each: int) -> None:
        """What a segment's chains read of `data`: nothing."""
        return None

    def check_shared(self, shared: Any, num_problems: int) -> None:
        """`shared` is the one problem's, whatever its shapes."""

    def call(self, fn: Callable, given: tuple, layout: ProblemLayout) -> tuple:
        """`fn(own, keys, shared)` on the one problem's row of `shared`, of `given`
        `(own, keys, shared, rows)`; the new shared state as a row (`shared` itself,
        if `fn` returned it as given)."""
        own, keys, shared, _ = given
        one = jtu.tree_map(lambda x: x[0], shared)
        new, new_shared, output = fn(own, keys, one)
        if _same_values(new_shared, one):
            return new, shared, output
        return new, jtu.tree_map(lambda x: x[None], new_shared), output


@ft.partial(jax.tree_util.register_dataclass, data_fields=["data"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class _OverProblems:
    """How a run of many problems calls `fn(states, keys, count, shared, data)`:
    mapped over the problems, each given its chains, its row of `shared` and its row
    of `data`, as a loop written by hand as a `vmap` over problems would."""

    data: Any  # one row per problem
    num_args: ClassVar[int] = 5
    shared_axes: ClassVar[int] = 1

    def with_placed_data(self, data: Any) -> "_OverProblems":
        """Itself with `data`, its own placed on the devices."""
        return _OverProblems(data)

    def rows(self, problem: Any, chains_each: int) -> Any:
        """Each problem's row of `data`, for a segment's chains (their `problem`)."""
        first_chains = problem[::chains_each]
        return jtu.tree_map(lambda x: x[first_chains] if is_array(x) else x, self.data)

    def check_shared(self, shared: Any, num_problems: int) -> None:
        """Refuses a leaf of `shared` without one row per problem on axis 0."""
        wrong = [
            f"`{leaf_name('shared', path)}` is {describe(x)}"
            for path, x in jtu.tree_leaves_with_path(shared)
            if np.ndim(x) == 0 or np.shape(x)[0] != num_problems
        ]
        if wrong:
            raise BatchError(
                f"With `data`, `shared` holds one row per problem ({num_problems}) "
                "on axis 0, but:\n" + bullet_list(wrong)
            )

    def call(self, fn: Callable, given: tuple, layout: ProblemLayout) -> tuple:
        """`fn` mapped over the problems, of `given` `(own, keys, shared, rows)`, each
        problem given its chains (its block of `layout`) and its rows."""
        own, keys, shared, rows = given
        new, new_shared, output = jax.vmap(fn)(
            jtu.tree_map(layout.blocks, own), layout.blocks(keys), shared, rows
        )
        return _ungrouped(new), new_shared, _ungrouped(output)


# Each in one program: made eagerly, leaf by leaf, they cost a short run a millisecond
# or two of dispatches on every call.
@ft.partial(jax.jit, static_argnums=(0, 1, 2))
def _copied(packing: Packing, problems: int, each: int, shared: Any) -> tuple:
    """`shared` (a row per problem, or one problem's without the axis), packed and
    copied for each of a problem's `each` chains."""
    rows = [
        jnp.reshape(x, (problems, *shape))
        for x, (shape, _) in zip(jtu.tree_leaves(shared), packing.leaves, strict=True)
    ]
    packed = packing.pack(packing.treedef.unflatten(rows))
    return tuple(jnp.repeat(x, each, axis=0) for x in packed)


@ft.partial(jax.jit, static_argnums=(0, 1))
def _first_rows(packing: Packing, each: int, copies: tuple) -> Any:
    """Each problem's shared state, its first chain's copy of `copies`."""
    return packing.unpack(tuple(x[::each] for x in copies))


def _same_values(new: Any, given: Any) -> bool:
    """Whether `new` is `given` itself, leaf for leaf (the same traced values)."""
    return all(
        a is b
        for a, b in zip(jtu.tree_leaves(new), jtu.tree_leaves(given), strict=True)
    )


def _ungrouped(tree: Any) -> Any:
    return jtu.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


def _check_new_shared(given: Any, new: Any) -> None:
    """Refuses a new shared state whose structure, shapes or dtypes differ from
    `given`'s (the shared state of one problem), naming the leaves."""
    before = jtu.tree_flatten_with_path(given)
    after = jtu.tree_flatten_with_path(new)
    if before[1] != after[1]:
        raise BatchError(
            f"`step` changed the structure of `shared`: it was given {before[1]} and "
            f"returned {after[1]}."
        )
    changed = leaf_changes("shared", before[0], after[0])
    if changed:
        raise BatchError(
            "`step` changed the shape or dtype of `shared`:\n"
            + bullet_list(changed)
            + "\nReturn each leaf as it was given (cast with `.astype`)."
        )


def _check_signature(fn: Callable, num_args: int) -> None:
    reason = call_mismatch(fn, num_args)
    if reason is not None:
        called = ("fn(states, keys, count", ", shared", ", data")[: num_args - 2]
        raise BatchError(
            f"`step` is {shown_signature(fn)}, but "
            f"{'with' if num_args > 3 else 'without'} `shared` "
            f"it is called as `{''.join(called)})`: {reason}."
        )


def composed_step(
    step: Callable,
    init: Init,
    shared: Any,
    data: Any,
    *,
    with_output: bool,
    superchains: int | None,
) -> tuple[RunStep, Init, ProblemForm]:
    """The step a run calls, made of the user's `step` (`pytree_step`): carrying
    `shared` (with a copy beside each chain of `init`), and given each problem's row
    of `data` (`problem_step`); and the run's problems (one without `data`): the one
    place that asks whether there is `data`.

    **Raises:**

    As `pytree_step`, `shared_step`, `problem_step` and `carrying` do.
    """
    run_step = shared_step(owned(pytree_step(step)), shared, with_output)
    problems: ProblemForm = OneProblem(init.num_chains)
    if data is not None:
        run_step, num_problems = problem_step(
            run_step, data, init.num_chains, superchains
        )
        problems = ManyProblems(ProblemLayout(init.num_chains, num_problems))
    if shared is not None:
        run_step, init = carrying(run_step, init, shared, problems.layout)
    return run_step, init, problems


def shared_step(step: RunStep, shared: Any, with_output: bool) -> RunStep:
    """`step`, an `eb.all_chains` step, as a step carrying a `shared` state of one
    problem (`with_data` gives it many); without one, `step` itself.

    **Raises:**

    `BatchError` if `step` is not an `eb.all_chains` step; without `shared`, if an
    `eb.all_chains` step cannot be called as `fn(states, keys, count)`.
    """
    if shared is None:
        if isinstance(step, AllChains):
            _check_signature(step.step, 3)
        return step
    if not isinstance(step, AllChains):
        raise BatchError(
            "`shared` is given, but `step` is a step of one chain: mark "
            f"`fn(states, keys, count, shared)` with `eb.all_chains` {_SHARED_IS}."
        )
    return SharedStep(step.step, _Unmapped(), 0, with_output)


def carrying(
    step: RunStep, init: Init, shared: Any, layout: ProblemLayout
) -> tuple[SharedStep, Init]:
    """`step` and `init` with a copy of `shared` (of one problem, or one row per
    problem with `data`) beside each chain's state, the chains in `layout`'s
    problems.

    `shared`'s Python numbers become arrays of the dtypes JAX gives them, as its
    NumPy arrays do: the loop carries them.

    **Raises:**

    `BatchError` if `step` cannot be called with the shared state (and `data`), if
    `init` holds no chain, if `shared` holds no array or another leaf, or with
    `data` an array leaf without one row per problem.
    """
    assert isinstance(step, SharedStep)
    mapping = step.mapping
    _check_signature(step.step, mapping.num_args)
    if init.num_chains == 0:
        raise BatchError("`init` holds no chain, so none can share `shared`.")
    shared = jtu.tree_map(_as_array, shared)
    leaves = jtu.tree_leaves_with_path(shared)
    if not leaves:
        raise BatchError(
            f"`shared` is {describe(shared)}, with no array to carry {_SHARED_IS}."
        )
    others = [
        f"`{leaf_name('shared', path)}` is {describe(x)}"
        for path, x in leaves
        if not is_array(x)
    ]
    if others:
        raise BatchError(
            "`shared` holds arrays and numbers only (static values go in a "
            f"Module's static fields), but:\n{bullet_list(others)}"
        )
    mapping.check_shared(shared, layout.num_problems)
    packing = Packing.of(shared, drop=mapping.shared_axes)
    each = layout.chains_each
    copies = _copied(packing, layout.num_problems, each, shared)
    carried = Init(
        WithShared(init.whole, copies),
        WithShared(init.arrays, copies),
        WithShared(init.static, (None,) * len(copies)),
        init.num_chains,
    )
    return dataclasses.replace(step, chains_each=each, packing=packing), carried


def _as_array(x: Any) -> Any:
    """A Python number or NumPy array as a NumPy array of the dtype JAX gives it."""
    if isinstance(x, (bool, int, float, complex, np.ndarray, np.generic)):
        x = np.asarray(x)
        return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)
    return x
