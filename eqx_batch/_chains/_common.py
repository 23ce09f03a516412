"""The vocabulary every part of `run_chains` shares: the chains between two steps, one
chain's layout, which steps are draws, and which problem each chain is in: a run's
problems are decided once, as one (`OneProblem`, without `data`, its results with no
axis of problems) or many (`ManyProblems`, with `data`, each result with a leading
axis of P), and code below the plan asks the one it is given, never `data`.

Nothing here runs or writes anything; the drivers above it do.
"""

import dataclasses
import functools as ft
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
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
        """Each chain's problem, `int32[chains]`, read-only: the same array for the
        same layout, made once (at 65,536 chains, a tenth of a millisecond of the
        host's work before the loop, on every call)."""
        return _problem_ids(self.num_chains, self.num_problems)

    def blocks(self, x: Any) -> Any:
        """`x`, one row per chain, as one block per problem: `[problems, chains_each,
        ...]`."""
        return x.reshape(self.num_problems, self.chains_each, *x.shape[1:])


@ft.lru_cache(maxsize=16)
def _problem_ids(num_chains: int, num_problems: int) -> np.ndarray:
    ids = np.repeat(np.arange(num_problems, dtype=np.int32), num_chains // num_problems)
    ids.setflags(write=False)
    return ids


class CheckTexts(NamedTuple):
    """What the bar may show after checks of `until` (`checks_label`)."""

    running: np.ndarray  # `bool[problems]`: those still running
    statistics: Callable[[], str]  # the one problem's statistics (without `data`)
    worst: Callable[[list[int]], str]  # the worst of these problems, and its reason


# The chains a chunk of a given number holds a multiple of (`RunStep.chunk_unit`).
ChunkUnit = Callable[[int], int]


_T = TypeVar("_T")

# One program: sliced eagerly, each leaf would be a dispatch of its own.
_first_row = jax.jit(ft.partial(jtu.tree_map, lambda x: x[0]))


@dataclasses.dataclass(frozen=True)
class OneProblem:
    """The chains of a run without `data`: one problem."""

    num_chains: int

    # A stop of the one problem is the run's end, wherever the run stopped.
    stops_last = True

    @property
    def layout(self) -> ProblemLayout:
        return ProblemLayout(self.num_chains, 1)

    @property
    def blocks(self) -> ProblemLayout | None:
        """The problems as a batch axis of the diagnostics and checks: none."""
        return None

    def chain_ids(self) -> np.ndarray | None:
        """Each chain's problem, as `ChainState.problem` carries it: not carried."""
        return None

    def device_unit(self, num_chains: int, sizes: list[int], unit: ChunkUnit) -> int:
        """The chains of a chunk of `num_chains` that must share a device: one."""
        return 1

    def rows(self, per_problem: Any) -> Any:
        """A value with a row per problem, as the result shows it: the one row."""
        return _first_row(per_problem)

    def label(self, text: str) -> str:
        """`text` of statistics, as the progress bar shows it."""
        return text

    def checks_label(self, checked: list[int], texts: "CheckTexts") -> str | None:
        """The bar after the problems `checked` by `until`: the one problem's
        statistics, if it was checked; else nothing new to show."""
        return texts.statistics() if checked else None

    def of_problems(
        self, fields: dict[str, Any], make: Callable[..., _T]
    ) -> tuple[_T | None, dict[str, Any]]:
        """The result's `fields` that differ between problems, as a field of their
        own (`make(count=P, **fields)`), and the result's own `fields`: of one
        problem, all of them, and no field of problems."""
        return None, fields

    def file_records(self, records: list[Any]) -> Any:
        """The problems' records of checks as a checkpoint keeps them: the one
        problem's, as a run without `data` always kept it."""
        (record,) = records
        return record

    def records_in_file(self, saved: Any) -> list[Any]:
        """The problems' records that `file_records` wrote."""
        return [saved]

    def named(self, problem: int, text: str) -> str:
        """`text` about `problem`, as a message names it: the one problem is the
        run."""
        return text


@dataclasses.dataclass(frozen=True)
class ManyProblems:
    """The chains of a run with `data`, in `layout`'s blocks, one per problem."""

    layout: ProblemLayout

    # Each problem stops at a check of its own; the run goes on for the others.
    stops_last = False

    @property
    def blocks(self) -> ProblemLayout | None:
        """The problems as a batch axis of the diagnostics and checks."""
        return self.layout

    def chain_ids(self) -> np.ndarray | None:
        return self.layout.ids()

    def device_unit(self, num_chains: int, sizes: list[int], unit: ChunkUnit) -> int:
        """The chains of a chunk of `num_chains` that must share a device, for a step
        that sees `unit(num_chains)` of them at once (`RunStep.chunk_unit`): whole
        problems on each device, so that what it computes across them does not
        depend on the devices, and as many on each device in every chunk of `sizes`
        (the chunks share their devices, as their results are joined)."""
        each = unit(num_chains)
        common = math.gcd(*(size // each for size in sizes))
        return num_chains // common

    def rows(self, per_problem: Any) -> Any:
        return per_problem

    def label(self, text: str) -> str:
        return f"{self.layout.num_problems} problems, at [problem, ...]: {text}"

    def checks_label(self, checked: list[int], texts: "CheckTexts") -> str | None:
        """The problems still running and, of those `checked`, the worst."""
        running = texts.running
        text = f"{int(running.sum())} of {self.layout.num_problems} problems running"
        still = [p for p in checked if running[p]]
        return f"{text}; worst: {texts.worst(still)}" if still else text

    def of_problems(
        self, fields: dict[str, Any], make: Callable[..., _T]
    ) -> tuple[_T | None, dict[str, Any]]:
        problems = make(count=self.layout.num_problems, **fields)
        return problems, dict.fromkeys(fields)

    def file_records(self, records: list[Any]) -> Any:
        return {"problems": records}

    def records_in_file(self, saved: Any) -> list[Any]:
        if not isinstance(saved, dict) or not isinstance(saved["problems"], list):
            raise ValueError("a list of one record per problem")
        return saved["problems"]

    def named(self, problem: int, text: str) -> str:
        return f"problem {problem}: {text}"


ProblemForm = OneProblem | ManyProblems
