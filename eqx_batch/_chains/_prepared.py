"""A run prepared once per step and kind of state, and kept for the calls that meet
them again.

The compiled segment finds its program at once when the non-array leaves of its
arguments are the very objects of an earlier call (else it partitions and hashes them).
So every call of `run_chains` with the same step and kind of state must pass the same
shape-dtype structs, segment plans and placement: this memo is the one place that keeps
that promise. It also saves the trace of the step that checks it: calling `run_chains`
again costs no trace, as the compiled loop costs no compile.
"""

import dataclasses
from typing import Any

import jax

from .._compiling._compile import partition
from .._compiling._lowered import array_types
from .._compiling._memo import BoundedCache
from .._tree import structs
from ._all_chains import RunStep
from ._common import OneChain
from ._placement import Placement
from ._segment_plan import SegmentPlan
from ._step import step_layout, StepLayout, trace_step, TracedStep


class PreparedRun:
    """What every call of `run_chains` with one step and kind of state shares: one
    chain's layout, and the segment plans, placements and trace structs made for it.

    Each is made the first time it is asked for and then returned as the same object.
    """

    def __init__(self, layout: StepLayout):
        self.layout = layout
        self.one_chain = OneChain(layout.state, layout.key)
        # Bounded: a long-lived process may ask for ever new lengths or chain counts.
        self._made = BoundedCache(256)

    def segment(
        self, plan: SegmentPlan, length: int, emit: int, block: int
    ) -> SegmentPlan:
        """`plan` for a segment of `length` steps that emits `emit` draws, its chains
        in blocks of `block` that share a problem."""
        return self._made.get_or_make(
            ("segment", plan, length, emit, block),
            lambda: dataclasses.replace(plan, length=length, emit=emit, block=block),
        )

    def placement(
        self, num_chains: int, pad_to: int, *, pad: bool, unit: int = 1
    ) -> Placement:
        """`Placement(num_chains, pad_to, pad=pad, unit=unit)` on the current
        devices."""
        return self._made.get_or_make(
            ("placement", num_chains, pad_to, pad, unit, *jax.devices()),
            lambda: Placement(num_chains, pad_to, pad=pad, unit=unit),
        )

    def trace_like(self, num_chains: int, num_draws: int, states: bool) -> Any:
        """The trace buffer's shape-dtype structs: `[chains, draws, ...]` per leaf;
        without the `states` (None in their place), the step's outputs alone."""
        recorded = self.layout.recorded
        if not states:
            recorded = (None, recorded[1])
        return self._made.get_or_make(
            ("trace", num_chains, num_draws, states),
            lambda: structs(recorded, add=(num_chains, num_draws)),
        )


# Looked up by the static part of `step` and of the state, and the shapes and dtypes
# of their arrays: what the compiled loop's cache keys on too. An entry keeps its step
# alive (as `jax.jit`'s cache does), so the memo is bounded.
_prepared: BoundedCache = BoundedCache(256)


def prepared_run(
    step: RunStep,
    states: Any,
    keys: jax.Array,
    legacy: bool,
    with_output: bool,
    traced: TracedStep | None = None,
) -> PreparedRun:
    """The run of `step` on `states` and `keys`, prepared (`step` traced and checked)
    the first time it meets states and keys of these shapes and dtypes.

    `traced` is `step` traced already (a checkpointed run traces it on every call,
    for its identity), used if the run is new.

    **Raises:**

    As `trace_step`, when `step` is traced.
    """
    step_arrays, step_static = partition(step)
    state_arrays, state_static = partition(states)
    # An all-chains step is traced on every chain: their number matters to it.
    per_chain = 0 if step.sees_every_chain else 1
    signature = (
        step_static,
        array_types(step_arrays),
        state_static,
        tuple((x.shape[per_chain:], x.dtype) for x in state_arrays),
        keys.dtype,
        legacy,
        with_output,
    )
    try:
        found = _prepared.get(signature)
    except TypeError:
        # A non-array leaf that cannot be hashed: prepared every time (and refused, by
        # name, when the loop is compiled).
        signature, found = None, None
    if found is not None:
        return found
    if traced is None:
        traced = trace_step(step, states, keys, legacy, with_output)
    own, _ = step.own_and_shared(states)
    run = PreparedRun(step_layout(own, keys, traced.output))
    return run if signature is None else _prepared.add(signature, run)
