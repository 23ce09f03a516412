"""Steps that see every chain: `eb.all_chains` marks a step that takes the whole stack.

Ensemble samplers (the emcee stretch move) and adaptation schemes (ChEES, MEADS) move
each chain with the help of the others, so their step cannot be written for one chain
and mapped. Marking such a step, rather than adding a flag to `run_chains`, keeps the
kind of step with the step: whatever runs it asks the step what it takes.

`RunStep` is what the driver asks of every kind of step (this one, a per-chain step,
a step given `data`), so that it never asks which kind it has: as BlackJAX's driver
only calls a `SamplingAlgorithm`'s `init` and `step`.
"""

from collections.abc import Callable
from typing import Any, ClassVar, NoReturn, Protocol

import equinox as eqx
import jax
import jax.numpy as jnp

from .._errors import BatchError, call_mismatch, describe, shown_signature
from .._tree import structs


# How a segment maps `one_chain(state, key, *given)` over `(states, keys)`, every
# chain's, giving each what its step reads beside its state and key.
MapChains = Callable[[Callable, Any, Any], Any]


def each_chain(one_chain: Callable, states: Any, keys: Any) -> Any:
    """`one_chain` mapped over every chain, given nothing beside its state and key."""
    return jax.vmap(one_chain)(states, keys)


class RunStep(Protocol):
    """A step as a run calls it: `PerChain`, `AllChains` or `ProblemStep`, each
    answering the driver's questions for itself."""

    # Whether it takes every chain at once: its chains are never padded (it would see
    # the padding), and each segment calls it once on the whole stack.
    sees_every_chain: ClassVar[bool]

    @property
    def step(self) -> Callable:
        """The user's step, as a pytree: its leaves (a `functools.partial`'s
        arguments, a Module's fields) are, beside `data`'s, what the compiled loop is
        given."""
        ...

    @property
    def data(self) -> Any:
        """What it reads of `data` (one row per problem, for the run's identity); None
        without `data`."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def own_and_shared(self, states: Any) -> tuple[Any, Any]:
        """The chains' own states (what is recorded, diagnosed and returned), and
        each problem's shared state carried beside them (None: none is)."""
        ...

    def chunk_unit(self, num_chains: int) -> int:
        """The chains a chunk of `num_chains` holds a multiple of: those it sees at
        once."""
        ...

    def with_placed_data(self, data: Any) -> "RunStep":
        """This step with `data`, its own placed on the devices (`Placement.put`),
        in place of its own."""
        ...

    def for_chains(self, problem: Any, block: int) -> tuple[Callable, MapChains]:
        """One chain's step, and how a segment maps a function of one chain over
        every chain: made once per segment, before its loop, from each chain's
        `problem` (None without `data`), the chains of a problem in blocks of
        `block` rows."""
        ...

    def traced_call(
        self, states: Any, keys: jax.Array, one_key: jax.ShapeDtypeStruct
    ) -> tuple[Callable, tuple]:
        """What tracing it calls, and the shape-dtype structs it is called with, the
        state's first (of one chain, or of every chain), from every chain's `states`
        and `keys` and the struct of the key one chain's step gets."""
        ...

    def with_data(self, data: Any) -> "RunStep":
        """This step given its chain's problem's row of `data`.

        **Raises:**

        `BatchError` if it cannot take `data`.
        """
        ...


class AllChains(eqx.Module):
    """A step that takes every chain at once, as [`eb.all_chains`][] makes it.

    It is a pytree whose leaves are the step's (the arrays of a `jax.tree_util.Partial`
    are arguments of `run_chains`' compiled loop, as a per-chain step's are), and it
    calls the step it wraps.

    !!! Example

        ```python
        def step(states, keys, count):
            return states + jax.vmap(jr.normal)(keys)

        marked = eb.all_chains(step)
        assert isinstance(marked, eb.AllChains) and marked.step is step
        ```
    """

    step: Callable
    # What a run asks of it (`RunStep`).
    sees_every_chain: ClassVar[bool] = True

    def __call__(self, states: Any, keys: Any, count: Any) -> Any:
        return self.step(states, keys, count)

    def own_and_shared(self, states: Any) -> tuple[Any, None]:
        """The states as they are: it carries no shared state."""
        return states, None

    def chunk_unit(self, num_chains: int) -> int:
        """Every chain: it sees them all at once."""
        return num_chains

    @property
    def data(self) -> None:
        """None: it reads no `data`."""
        return None

    def with_placed_data(self, data: None) -> "AllChains":
        """Itself: it holds no `data`."""
        return self

    def for_chains(self, problem: Any, block: int) -> tuple[Callable, MapChains]:
        """Itself, given nothing more: each segment calls it on the whole stack."""
        return self, each_chain

    def traced_call(
        self, states: Any, keys: jax.Array, one_key: jax.ShapeDtypeStruct
    ) -> tuple[Callable, tuple]:
        """Every chain's state, one key per chain and an `int32` count."""
        return (lambda s, k, count: self(s, k, count)), (
            structs(states),
            jax.ShapeDtypeStruct((*keys.shape, *one_key.shape), one_key.dtype),
            jax.ShapeDtypeStruct((), jnp.int32),
        )

    def with_data(self, data: Any) -> NoReturn:
        """Refused: there is no one problem to give a step of every chain the row of.

        **Raises:**

        `BatchError`, always.
        """
        raise BatchError(
            "`data` is given with an `eb.all_chains` step and no `shared`: pass it "
            "with `functools.partial` (see docs/chains.md#what-is-refused)."
        )


def all_chains(step: Callable) -> AllChains:
    """Marks `step` as a step that takes every chain at once, for [`eb.run_chains`][].

    A per-chain step is mapped over the chains, so no chain can see another. Ensemble
    samplers (the emcee stretch move, NumPyro's AIES and ESS), and adaptations that
    pool every chain (ChEES, MEADS) need one step over the stacked state of all chains.
    `run_chains(eb.all_chains(step), init, key, num_steps)` runs such a step with
    everything a per-chain step gets: checkpoints and resume, progress, diagnostics,
    `with_output`, superchains and several devices.

    Each chain's key for a step is split from its carried key exactly as for a
    per-chain step, so `step` gets, stacked, the keys that a per-chain step would get
    one by one: a per-chain step wrapped as `lambda s, k, count: jax.vmap(f)(s, k)`
    gives the draws of `f` bit for bit.

    **Arguments:**

    - `step`: `step(states, keys, count) -> new_states`, or `(new_states, outputs)`
        with `with_output=True`; with `run_chains(..., shared=S)`, `step(states,
        keys, count, shared) -> (new_states, new_shared)` (and `data` after
        `shared`, called per problem: [A state the chains
        share](../chains.md#a-state-the-chains-share)). `states` is every chain's
        state stacked on axis 0
        (the shape of `init`, after `superchains` expands it); `keys` one key per
        chain (typed `[chains]`, or legacy `uint32[chains, 2]` if `run_chains` was
        given legacy keys); `count` the step's number, counted from 0 over the whole
        run (a resumed run goes on counting), an `int32` scalar. `new_states` has the
        structure, shapes and dtypes of `states`; every array leaf of `outputs` has
        one row per chain on axis 0.

    **Returns:**

    An [`eb.AllChains`][] that calls `step`.

    **Raises:**

    `eb.BatchError` if `step` is not callable, or cannot be called with three
    arguments (nor four or five, for a shared state).

    The chains of an all-chains step are never padded: `run_chains` places them on
    the most devices that they divide over evenly (in a job of several processes, as
    many devices of each process), as padding chains would be seen by the step. A
    `chunk_size` is refused, as a chunk holds only some of the chains.

    !!! Example

        ```python
        @eb.all_chains
        def step(states, keys, count):  # each chain pulled to the ensemble's mean
            noise = jax.vmap(lambda k: jr.normal(k, (2,)))(keys)
            return 0.5 * (states + states.mean(axis=0)) + 0.1 * noise

        result = eb.run_chains(step, jnp.arange(16.0).reshape(8, 2), jr.key(0), 50)
        result.trace.shape  # (8, 50, 2)
        ```
    """
    if isinstance(step, AllChains):
        return step
    if not callable(step):
        raise BatchError(
            f"`step` is {describe(step)}, not a function `step(states, keys, count)`."
        )
    _check_signature(step)
    return AllChains(step)


def _check_signature(step: Callable) -> None:
    """Refuses a step that cannot be called as `step(states, keys, count)`, such as a
    per-chain `step(state, key)` marked by mistake, before it is traced; or with a
    shared state (and `data`) after them: `run_chains` checks which it is given."""
    reason = call_mismatch(step, 3)
    if reason is not None and all(call_mismatch(step, n) for n in (4, 5)):
        raise BatchError(
            f"`step` is {shown_signature(step)}, but an `eb.all_chains` step is "
            f"called as `step(states, keys, count)`: {reason}."
        )
