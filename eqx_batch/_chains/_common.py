"""The vocabulary every part of `run_chains` shares: the chains between two steps, one
chain's layout, which steps are draws, and which problem each chain is in.

Nothing here runs or writes anything; the drivers above it do.
"""

from typing import Any, NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np


class ChainState(NamedTuple):
    """Every chain between two steps, one row per chain in each array.

    Typed PRNG keys stay typed here, in the states as in `keys`: only checkpoint files
    and the run's identity see their raw data.
    """

    # JAX arrays on the devices, or NumPy arrays on the host before they are placed.
    states: Any  # the array leaves of the state (others None)
    keys: Any  # each chain's carried key
    first_bad: Any  # the first non-finite step, counted from 1; 0 while finite
    # The running moments of the recorded draws (`_until/_moments.py`) with
    # `diagnostics=True`; else None.
    moments: Any = None
    # With `data`, each chain's problem (`int32`, `_problems.py`); else None.
    problem: Any = None


class OneChain(NamedTuple):
    """One chain's state (array leaves) and key, as shape-dtype structs."""

    state: Any
    key: jax.ShapeDtypeStruct


class Draws(NamedTuple):
    """Which steps the trace records: after `burn_in`, every `thin`-th, `total` in all.

    The one answer to "is step `t` a draw?", for the host and inside the compiled
    loop. Steps are counted from 0: step `t` makes the state after `t + 1` steps,
    which is a draw when `t >= burn_in` and `(t - burn_in) % thin == 0`.
    """

    burn_in: int
    thin: int
    total: int  # the draws of the whole run

    @classmethod
    def of(cls, num_steps: int, burn_in: int, thin: int) -> "Draws":
        return cls(burn_in, thin, cls(burn_in, thin, 0).before(num_steps))

    def before(self, step: Any) -> Any:
        """How many draws the first `step` steps record: an int, a NumPy array of
        them (one per problem), or traced."""
        made = -(-(step - self.burn_in) // self.thin)
        if isinstance(made, int):
            return max(0, made)
        on_host = isinstance(made, np.ndarray | np.generic)
        return (np if on_host else jnp).maximum(0, made)

    def is_draw(self, t: jax.Array) -> jax.Array:
        """Inside the loop: whether step `t` makes a draw."""
        return (t >= self.burn_in) & ((t - self.burn_in) % self.thin == 0)

    def slot(self, t: jax.Array) -> jax.Array:
        """Inside the loop: the trace slot of step `t`'s draw, if it makes one.

        Truncated, not floored: equal to the draw's index from `burn_in` on, and 0 or
        below before it (a write there is clamped to slot 0 by XLA).
        """
        slot = t - self.burn_in
        if self.thin == 1:
            return slot
        return lax.div(slot, slot.dtype.type(self.thin))

    def most_in(self, length: int) -> int:
        """The most draws that any `length` consecutive steps record."""
        return min(-(-length // self.thin), self.total)


class ProblemLayout(NamedTuple):
    """Which problem each chain is in: `num_problems` blocks of `chains_each` chains,
    in order. A run without `data` is one problem.

    The one answer to "which problem is chain `c`", for the host and inside a
    program: chain `c` of `C` belongs to problem `c // (C // P)`, and superchain `s`
    of `K` to problem `s // (K // P)`.
    """

    num_chains: int
    num_problems: int

    @property
    def chains_each(self) -> int:
        """The chains of each problem."""
        return self.num_chains // self.num_problems

    def superchains_each(self, superchains: int | None) -> int | None:
        """The superchains of each problem, of `superchains` in all (None: none)."""
        return None if superchains is None else superchains // self.num_problems

    def problem_of(self, chain: Any) -> Any:
        """The problem of chain `chain` (an int, or an array of chain indices)."""
        return chain // self.chains_each

    def chains_of(self, problem: int) -> range:
        """The chains of problem `problem`."""
        first = problem * self.chains_each
        return range(first, first + self.chains_each)

    def own(self, chains: np.ndarray, problem: int) -> np.ndarray:
        """Those of `chains` (indices) that are `problem`'s, counted from its first."""
        return chains[self.problem_of(chains) == problem] - problem * self.chains_each

    def ids(self) -> np.ndarray:
        """Each chain's problem, `int32[chains]`."""
        return self.problem_of(np.arange(self.num_chains)).astype(np.int32)

    def blocks(self, x: Any) -> Any:
        """`x`, one row per chain, as one block per problem: `[problems, chains_each,
        ...]`."""
        return x.reshape(self.num_problems, self.chains_each, *x.shape[1:])
