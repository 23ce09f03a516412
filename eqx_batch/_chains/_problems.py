"""Many problems in one run: `run_chains(..., data=data)` gives each block of chains a
row of `data`, its problem's, so that one compiled loop fits one model to many datasets.

Chain `c` of `C` belongs to problem `c // (C // P)` (`ProblemLayout`). Each chain
carries its problem's index (`ChainState.problem`), so chunks, devices, padding and
checkpoints move it with the chain. `data` is held once (one row per problem, on
every device of the run).

The loop's layout is `[problems, chains of a problem]`, and a segment maps a step over
it in one of two ways, by the size of a problem's row (`ROW_COPIED`, measured):

- a small row is copied once per chain before the loop, and each chain reads its own
    copy: an elementwise model on a row of tens of numbers runs as one flat `vmap`;
- a larger row is given once per problem, as a loop written by hand as a nested
    `vmap` gives it: the outer map over problems gives each its row, the inner over a
    problem's chains gives them the row unbatched, so that a problem's `X @ w` is one
    matrix product over its chains and each step reads a problem's data once, not
    once per chain. The chains are viewed as blocks of consecutive chains of one
    problem, never across a device (`Placement.block_size`): a chunk or a batch of
    running problems that splits a problem has smaller blocks.

Either copy is made once, before the loop, and read as a loop invariant. A row read by
index in every step is a gather per step, which XLA hoists out of the loop on a CPU but
not on a TPU, where it cost 3 to 10 times the copied rows (docs/benchmarks.md). Past
`COPY_LIMIT` bytes of copies, each step reads its row by index, with the data held
once. The choice depends on a problem's row alone, not on how many problems share the
run, so that a problem runs the same program in a batch of one.
"""

import dataclasses
import functools as ft
import math
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, call_mismatch, describe, leaf_name, shown_signature
from .._tree import common_size, is_array, structs
from ._all_chains import MapChains, RunStep


# The most bytes of `data`'s rows that a segment copies (see the module's docstring):
# 1.6% of a 16 GiB accelerator's memory, the size of the largest copy measured.
COPY_LIMIT = 256 * 2**20
# The largest row (bytes of one problem's `data`) copied once per chain rather than
# mapped in two levels, by platform ("" for any other), where the two cross over in
# `benchmarks/bench_logistic.py` (docs/benchmarks.md): on a TPU v5e, rows of 512
# bytes ran 2 to 5 times faster copied, rows of 2 KiB 1.5 times faster in two levels
# (its matrix unit pays for small products); on a CPU, copies won up to 8 KiB rows.
ROW_COPIED = {"": 1024, "cpu": 8 * 2**10}


# A frozen dataclass rather than an `eqx.Module`: every call of `run_chains` with `data`
# makes two and asks them a few things, and a Module costs tens of microseconds to
# make and as much for each method asked of it (a bound method, made on every ask).
@ft.partial(jtu.register_dataclass, data_fields=["step", "data"], meta_fields=[])
@dataclasses.dataclass(frozen=True, eq=False)
class ProblemStep:
    """A step of one chain given its problem's row of `data`.

    A pytree whose leaves are the step's and `data`'s: `data`'s arrays are arguments of
    the compiled loop, so new datasets of the same shapes do not recompile it.
    """

    step: Callable
    data: Any
    sees_every_chain: ClassVar[bool] = False  # (`RunStep`)

    @classmethod
    def of(cls, step: Callable, data: Any) -> "ProblemStep":
        """`step` given its chain's row of `data`, `data`'s NumPy leaves with the
        dtypes JAX gives them, as `init`'s get.

        **Raises:**

        `BatchError` if `step` cannot be called as `step(state, key, data)`.
        """
        _check_signature(step)
        return cls(step, jax_dtypes(data))

    def __call__(self, state: Any, key: Any, problem: Any) -> Any:
        """One chain's step, given its problem's index."""
        return self.step(state, key, _rows(self.data, problem))

    def own_and_shared(self, states: Any) -> tuple[Any, None]:
        """The states as they are: it carries no shared state."""
        return states, None

    def chunk_unit(self, num_chains: int) -> int:
        """One chain: it sees no other."""
        return 1

    def for_chains(self, problem: jax.Array, block: int) -> tuple[Callable, MapChains]:
        """One chain's step given its row, and how the segment maps it: rows up to
        `ROW_COPIED` bytes copied once per chain, larger rows in two levels, over
        blocks of `block` chains of one problem, each block given its problem's row,
        then over a block's chains, each given the row unbatched (as a run of one
        problem given its row through `functools.partial`). Either copy is made once,
        before the loop.

        While the copy takes at most `COPY_LIMIT` bytes; past it, each chain's step
        reads its row by index, with the data held once.
        """
        rows, static = eqx.partition(self.data, is_array)
        row_bytes = sum(
            math.prod(x.shape[1:]) * x.dtype.itemsize for x in jtu.tree_leaves(rows)
        )
        per_chain = row_bytes <= ROW_COPIED.get(jax.default_backend(), ROW_COPIED[""])
        copies = problem.shape[0] if per_chain else problem.shape[0] // block
        if copies * row_bytes > COPY_LIMIT:
            return self, lambda one_chain, states, keys: jax.vmap(one_chain)(
                states, keys, problem
            )
        step = self.step

        def on_row(state: Any, key: Any, row: Any) -> Any:
            return step(state, key, eqx.combine(row, static))

        if per_chain:
            chain_rows = _rows(rows, problem)
            return on_row, lambda one_chain, states, keys: jax.vmap(one_chain)(
                states, keys, chain_rows
            )
        return on_row, _in_blocks(_rows(rows, problem[::block]), block)

    def with_placed_data(self, data: Any) -> "ProblemStep":
        """This step with `data`, its own placed on the devices."""
        return ProblemStep(self.step, data)

    def traced_call(
        self, states: Any, keys: jax.Array, one_key: jax.ShapeDtypeStruct
    ) -> tuple[Callable, tuple]:
        """One chain's state and key, and its problem, whose row of the data the step
        gets. The data is an argument, not a constant of the program: the run's
        identity names it on its own (`RunIdentity.of`)."""
        step = self.step
        return (lambda s, k, p, d: ProblemStep(step, d)(s, k, p)), (
            structs(states, drop=1),
            one_key,
            jax.ShapeDtypeStruct((), jnp.int32),
            structs(self.data),
        )

    def with_data(self, data: Any) -> "ProblemStep":
        """Its step given the rows of `data` instead (as `ProblemStep.of`)."""
        return ProblemStep.of(self.step, data)


def jax_dtypes(data: Any) -> Any:
    """`data` with its NumPy leaves of the dtypes JAX gives them, as `init`'s get."""
    return jtu.tree_map(
        lambda x: (
            np.asarray(x, jax.dtypes.canonicalize_dtype(x.dtype))
            if isinstance(x, np.ndarray)
            else x
        ),
        data,
    )


def _in_blocks(block_rows: Any, block: int) -> MapChains:
    """The chains mapped in two levels, over blocks of `block` consecutive chains,
    each given its row of `block_rows`, then over a block's chains."""

    def map_chains(one_chain: Callable, states: Any, keys: Any) -> Any:
        num_blocks = keys.shape[0] // block
        in_blocks = jtu.tree_map(
            lambda x: x.reshape(num_blocks, block, *x.shape[1:]), (states, keys)
        )
        of_block = jax.vmap(one_chain, in_axes=(0, 0, None))
        mapped = jax.vmap(of_block)(*in_blocks, block_rows)
        return jtu.tree_map(
            lambda x: x.reshape(num_blocks * block, *x.shape[2:]), mapped
        )

    return map_chains


def _rows(data: Any, problem: Any) -> Any:
    """The `problem` rows of `data`'s arrays; its other leaves as they are."""
    return jtu.tree_map(lambda x: x[problem] if is_array(x) else x, data)


def problem_step(
    step: RunStep, data: Any, num_chains: int, superchains: int | None
) -> tuple[RunStep, int]:
    """`step` given its chain's row of `data`, and the number of problems P.

    `data`'s NumPy leaves get the dtypes JAX gives them, as `init`'s do.

    **Raises:**

    `BatchError` if `data` is not a pytree of arrays with one row per problem (as
    `_num_problems` says), if P does not divide the chains (or the superchains), if
    `step` is an `eb.all_chains` step, or if `step` cannot be called as
    `step(state, key, data)`.
    """
    given = step.with_data(data)
    num_problems = _num_problems(given.data)
    if superchains is not None and superchains % num_problems:
        raise BatchError(
            f"`data` holds {num_problems} problems, which do not divide "
            f"`superchains={superchains}`: pass {num_problems} * K."
        )
    if num_chains % num_problems:
        raise BatchError(
            f"`data` holds {num_problems} problems, which do not divide the "
            f"{num_chains} chains: pass {num_problems} * M."
        )
    return given, int(num_problems)


_DATA_IS = "(see docs/chains.md#many-problems-in-one-run)"


def _num_problems(data: Any) -> int:
    """P, the size of axis 0 that `data`'s array leaves agree on.

    **Raises:**

    `BatchError` naming `data` (and the leaf) if it holds no array (a list of Python
    numbers, `{}`), a 0-d array, leaves that disagree on P, or no problem (P = 0).
    """
    arrays = [
        (leaf_name("data", path), x)
        for path, x in jtu.tree_flatten_with_path(data)[0]
        if is_array(x)
    ]
    if not arrays:
        raise BatchError(
            f"`data` is {describe(data)}, with no array: stack each problem's row "
            f"along axis 0 {_DATA_IS}."
        )
    for name, x in arrays:
        if np.ndim(x) == 0:
            raise BatchError(
                f"`{name}` is a 0-d array ({describe(x)}), with no row per problem "
                f"{_DATA_IS}."
            )
    num_problems = common_size(
        [(name, np.shape(x)[0]) for name, x in arrays],
        what="problem axis (axis 0)",
        fix="Every array leaf of `data` holds one row per problem along axis 0.",
    )
    if num_problems == 0:
        name, x = arrays[0]
        raise BatchError(f"`data` holds no problem: `{name}` is {describe(x)}.")
    return int(num_problems)


def _check_signature(step: Callable) -> None:
    """Refuses, before tracing, a step that cannot be called as `step(state, key,
    data)`: most often a step written for one problem, `step(state, key)`."""
    reason = call_mismatch(step, 3)
    if reason is not None:
        raise BatchError(
            f"`step` is {shown_signature(step)}, but with `data` it is called as "
            f"`step(state, key, data)`: {reason}."
        )
