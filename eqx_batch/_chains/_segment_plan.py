"""`TraceMode`, where a run's draws go, and `SegmentPlan`: what a compiled segment
fixes when it is traced.

Below the segment, so that what makes plans (`_plan.py`, `_prepared.py`) does not
import the compiled program to name them.
"""

import dataclasses
import enum
from typing import Any

from ._common import Draws


class TraceMode(enum.Enum):
    """Where a run's draws go, decided once from `trace=` (as Equinox's
    `while_loop(kind=...)` decides its kind): each value is `trace` as given."""

    MEMORY = True  # a trace buffer of the whole run, on the devices
    DISK = "disk"  # the checkpoint's draw files, written segment by segment
    NONE = False  # nowhere: the run records no draw


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """Everything about a segment that is fixed at trace time."""

    length: int
    draws: Draws
    with_output: bool
    writes_trace: bool  # whether the segment writes the run's trace buffer
    legacy: bool  # `step` takes legacy `uint32` keys rather than typed ones
    # The segment records its own draws only, `emit` of them from its first, and
    # returns them as `new_draws`: with the trace on disk (no trace buffer of the
    # run), or for a batch of the running problems' chains (`_compaction.py`).
    returns_own_draws: bool = False
    # How many draws from the segment's first one on to return a copy of, for the
    # checkpoint (the next segment takes over, donates, the trace buffer while they
    # are written). The most any segment of this length records, so that segments
    # that record fewer share the compiled loop; the slice then ends at the buffer's
    # end and starts before the segment's first draw.
    emit: int = 0
    # Consecutive chains that share a problem, in blocks that never cross a device:
    # the segment maps a problem's chains within a block over one row of `data`
    # (`ProblemStep.for_chains`). Found from the chains' problems (`block_size`).
    block: int = 1
    # Whether the draws hold the states: with `trace=False` and `with_output`, a run
    # records its step's outputs alone.
    records_states: bool = True
    # Whether the segment takes which problems still run and keeps the others' chains
    # as they are: with `until`.
    freezes: bool = False

    def recorded(self, states: Any, output: Any) -> Any:
        """What a step's draw records: the chains' states, or with `with_output` the
        states (None if not `records_states`) and the step's output."""
        if not self.with_output:
            return states
        return (states if self.records_states else None, output)
