"""The user's step, traced on one chain (or, for an `eb.all_chains` step, on the whole
stack) and checked before anything runs."""

import functools as ft
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import jax.tree_util as jtu

from .._errors import BatchError, bullet_list, describe, leaf_name
from .._tree import is_struct, structs
from ._all_chains import AllChains, each_chain, MapChains, RunStep
from ._problems import ProblemStep


@jtu.register_pytree_node_class
class PerChain:
    """A step of one chain, `step(state, key)`, as a run calls it (`RunStep`): mapped
    over the chains, which may be padded.

    A pytree whose one child is the step. Not an `eqx.Module`: it is made on every
    call of `run_chains`, and a Module costs tens of microseconds to make and to ask.
    """

    __slots__ = ("step",)
    sees_every_chain: ClassVar[bool] = False

    def __init__(self, step: Callable):
        self.step = step

    def tree_flatten(self) -> tuple[tuple[Callable], None]:
        return (self.step,), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple) -> "PerChain":
        return cls(*children)

    def __call__(self, state: Any, key: Any) -> Any:
        return self.step(state, key)

    def own_and_shared(self, states: Any) -> tuple[Any, None]:
        """The states as they are: it carries no shared state."""
        return states, None

    def chunk_unit(self, num_chains: int) -> int:
        """One chain: it sees no other."""
        return 1

    @property
    def data(self) -> None:
        """None: it reads no `data`."""
        return None

    def with_placed_data(self, data: None) -> "PerChain":
        """Itself: it holds no `data`."""
        return self

    def for_chains(self, problem: Any, block: int) -> tuple[Callable, MapChains]:
        """Its step, mapped over the chains given nothing beside state and key."""
        return self.step, each_chain

    def traced_call(
        self, states: Any, keys: jax.Array, one_key: jax.ShapeDtypeStruct
    ) -> tuple[Callable, tuple]:
        """One chain's state and key."""
        return (lambda s, k: self.step(s, k)), (structs(states, drop=1), one_key)

    def with_data(self, data: Any) -> ProblemStep:
        """Its step given its chain's problem's row of `data` (`ProblemStep.of`)."""
        return ProblemStep.of(self.step, data)


def pytree_step(step: Callable) -> RunStep:
    """`step` as a run calls it: an `eb.all_chains` step as marked, any other as a
    per-chain step (`PerChain`), a `functools.partial` made a `jax.tree_util.Partial`.

    The one place that asks which kind of step the user gave. As a pytree, a
    partial's arrays (the data) are arguments of the compiled loop rather than
    constants baked into it, so a new partial does not recompile.
    """
    if isinstance(step, AllChains):
        return AllChains(_as_pytree(step.step))
    return PerChain(_as_pytree(step))


def _as_pytree(step: Callable) -> Callable:
    if isinstance(step, ft.partial) and not isinstance(step, jtu.Partial):
        return jtu.Partial(step.func, *step.args, **step.keywords)
    return step


def step_key_like(key: jax.Array, legacy: bool) -> jax.ShapeDtypeStruct:
    """The shape-dtype struct of the key one chain's step gets (legacy keys as their
    `uint32` data)."""
    return jax.ShapeDtypeStruct(
        (2,) if legacy else (), jnp.uint32 if legacy else key.dtype
    )


# Python numbers in an output are JAX values that happen to start as numbers, as in
# the outputs of `lax.scan`: they are recorded as arrays.
_NUMBERS = (bool, int, float, complex)


def numbers_as_arrays(tree: Any) -> Any:
    """`tree` with its Python numbers as JAX arrays."""
    return jtu.tree_map(
        lambda x: jnp.asarray(x) if isinstance(x, _NUMBERS) else x, tree
    )


class TracedStep(NamedTuple):
    """`step` traced: its program (for the run's identity) and output."""

    program: jax.extend.core.ClosedJaxpr
    # With `with_output`, one chain's second output: shape-dtype structs of its arrays
    # and numbers (see `numbers_as_arrays`), its other leaves as they are. Else None.
    output: Any


def trace_step(
    step: RunStep, states: Any, key: jax.Array, legacy: bool, with_output: bool
) -> TracedStep:
    """Traces `step` on one chain of `states` with one of `key`'s keys (and an `int32`
    problem, for a `ProblemStep`); an `eb.all_chains` step on all of them, with all the
    keys and an `int32` count.

    **Raises:**

    `BatchError` if the new state's structure, shapes or dtypes differ from the
    state's (`lax.scan` would refuse too, but naming neither the step nor the leaf), if
    `step` does not return a pair with `with_output`, or if an all-chains step's output
    has not one row per chain.
    """
    whole = step.sees_every_chain
    like, program, result = _traced(step, states, key, legacy)
    new, output = _new_state_and_output(result, with_output)
    if whole and with_output:
        output = _output_per_chain(output, key.shape[0])
    check_new_state(like, new, whole)
    return TracedStep(program, output)


def _traced(
    step: RunStep, states: Any, key: jax.Array, legacy: bool
) -> tuple[Any, jax.extend.core.ClosedJaxpr, Any]:
    """What `step` was given (shape-dtype structs of one chain's state, or of every
    chain's for an all-chains step), its program, and what it returned."""
    # Through a closure, so that the arrays of a partial are the program's constants.
    call, given = step.traced_call(states, key, step_key_like(key, legacy))
    program, dynamic, static = eqx.filter_make_jaxpr(call)(*given)
    return given[0], program, eqx.combine(dynamic, static)


def _new_state_and_output(result: Any, with_output: bool) -> tuple[Any, Any]:
    """What `step` returned, as the new state and the output: with `with_output`, the
    second of a pair, its Python numbers as shape-dtype structs; else None.

    **Raises:**

    `BatchError` if `step` does not return a pair with `with_output`.
    """
    if not with_output:
        return result, None
    if not isinstance(result, tuple) or len(result) != 2:
        raise BatchError(
            "`step` must return `(new_state, output)` when `with_output=True`, but "
            f"returned {jtu.tree_structure(result)}."
        )
    new, output = result
    output = jtu.tree_map(
        lambda x: jax.eval_shape(jnp.asarray, x) if isinstance(x, _NUMBERS) else x,
        output,
    )
    return new, output


def check_new_state(like: Any, new: Any, whole: bool) -> None:
    """Checks that `step` returned the state it was given, `like`, in structure,
    shapes and dtypes (`whole`: of every chain at once).

    **Raises:**

    `BatchError` naming the leaves that changed.
    """
    before = jtu.tree_flatten_with_path(like)
    after = jtu.tree_flatten_with_path(new)
    if before[1] != after[1]:
        raise BatchError(_structure_change(before, after))
    given = " for every chain" if whole else " per chain"
    changed = leaf_changes("init", before[0], after[0], given)
    if changed:
        raise BatchError(
            "`step` changed the shape or dtype of the state:\n"
            + bullet_list(changed)
            + "\nIt must return every leaf with the shape and dtype it was given "
            "(cast with `.astype`)"
            + (
                ", every chain's state stacked on axis 0 as it was given."
                if whole
                else "."
            )
        )


def leaf_changes(name: str, before: list, after: list, given: str = "") -> list[str]:
    """One line for each leaf of `before` (`(path, leaf)` pairs) whose shape or dtype
    `after` (the step's, in the same structure) changed, named `name` and its path."""
    return [
        f"`{leaf_name(name, path)}` is {describe(old)}{given}, but `step` returned "
        f"{describe(new)}"
        for (path, old), (_, new) in zip(before, after, strict=True)
        if describe(old) != describe(new)
    ]


def _output_per_chain(output: Any, num_chains: int) -> Any:
    """The output of an all-chains step (shape-dtype structs) as one chain's.

    **Raises:**

    `BatchError` if an array leaf has not one row per chain on axis 0.
    """

    leaves = jtu.tree_leaves_with_path(output)
    wrong = [
        f"`{leaf_name('output', path)}` is {describe(x)}"
        for path, x in leaves
        if is_struct(x) and (x.ndim == 0 or x.shape[0] != num_chains)
    ]
    if wrong:
        raise BatchError(
            "`step` is an `eb.all_chains` step, so each array of its output holds "
            f"one row per chain on axis 0 ({num_chains} chains), but:\n"
            + bullet_list(wrong)
            + "\nReturn one value per chain (a statistic of the whole ensemble can be "
            f"repeated with `jnp.broadcast_to(x, ({num_chains}, *x.shape))`)."
        )
    return structs(output, drop=1)


class StepLayout(NamedTuple):
    """One chain as a run lays it out, from `step` and the kind of state alone.

    `PreparedRun` keeps one per step and kind of state, so that every call that meets
    them again passes the same structs, and the compiled loop finds its program by
    their identity.
    """

    state: Any  # one chain's array leaves, as shape-dtype structs (others None)
    key: jax.ShapeDtypeStruct  # one chain's key, typed keys as keys
    # What a draw records: the state's structs (and, with `with_output`, the output's,
    # as a pair), None elsewhere.
    recorded: Any
    # With `with_output`, the output's leaves that are the same in every draw (None
    # where `recorded` has a struct); else None.
    output_static: Any


def step_layout(states: Any, key: jax.Array, output: Any) -> StepLayout:
    """The layout of one chain of `states`, given the output `trace_step` found (None
    without `with_output`)."""
    state = eqx.filter(structs(states, drop=1), is_struct)
    one_key = jax.ShapeDtypeStruct((), key.dtype)
    if output is None:
        return StepLayout(state, one_key, state, None)
    output_structs, output_static = eqx.partition(output, is_struct)
    return StepLayout(state, one_key, (state, output_structs), output_static)


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
