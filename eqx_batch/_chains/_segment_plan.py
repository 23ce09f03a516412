"""`SegmentPlan`: what a compiled segment fixes when it is traced.

Below the segment, so that what makes plans (`_plan.py`, `_prepared.py`) does not
import the compiled program to name them.
"""

import dataclasses

from ._common import Draws


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """Everything about a segment that is fixed at trace time."""

    length: int
    draws: Draws
    with_output: bool
    keep_trace: bool  # whether the run keeps a trace buffer
    legacy: bool  # `step` takes legacy `uint32` keys rather than typed ones
    # `trace="disk"`: no trace buffer of the run; the segment records its own draws
    # only, `emit` of them from its first, and returns them as `new_draws`.
    streams: bool = False
    # How many draws from the segment's first one on to return a copy of, for the
    # checkpoint (the next segment takes over, donates, the trace buffer while they
    # are written). The most any segment of this length records, so that segments
    # that record fewer share the compiled loop; the slice then ends at the buffer's
    # end and starts before the segment's first draw.
    emit: int = 0
