"""Where a chunk's draws go, decided once from `trace=` and the draws a run makes:
nowhere (`NoDraws`), into the run's trace buffer on the devices (`DrawsInBuffer`), or,
with `trace="disk"`, segment by segment into the checkpoint's draw files
(`DrawsOnDisk`). A chunk calls the one its plan holds and never asks which it is.
Each segment's new draws are written to the checkpoint's files as `SegmentFiles` says.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from .._common import Draws
from ._draw_buffers import DrawBuffers


class SegmentFiles(NamedTuple):
    """Where a segment's new draws go: draws `first` to `stop`, and where they lie
    in the `emit` draws the segment returns (see `SegmentPlan.emit`)."""

    first: int
    stop: int
    emit: int
    offset: int  # of the first draw, along axis 1 of what the segment returns


def segment_files(draws: Draws, start: int, stop: int) -> SegmentFiles | None:
    """Where the draws of the segment from step `start` to `stop` go; None if it makes
    none."""
    first, end = draws.before(start), draws.before(stop)
    if first == end:
        return None
    emit = draws.most_in(stop - start)
    # The segment returns the `emit` draws from its first on, or, near the end of the
    # buffer, the last `emit` of the trace.
    offset = first - min(first, draws.total - emit)
    return SegmentFiles(first, end, emit, offset)


@dataclasses.dataclass(frozen=True)
class Recording:
    """Where a chunk's draws go. As it is, nowhere: each method does nothing, and
    each kind overrides what it does."""

    def like(self, draws_like: Callable[[], Any]) -> Any:
        """The shape-dtype structs of the draws recorded, as `draws_like` makes
        them: none."""
        return None

    def num_draws(self, draws: Draws) -> int:
        """The draws the run records, of those `draws` plans: none."""
        return 0

    def most_in(self, draws: Draws, steps: int) -> int:
        """The most draws a segment of `steps` steps records: none."""
        return 0

    def segment_files(self, draws: Draws, start: int, stop: int) -> SegmentFiles | None:
        """Where the draws of the segment from `start` to `stop` go: nowhere."""
        return None

    def own_draws(
        self, files: SegmentFiles | None, buffers: Callable[[int], Any]
    ) -> Any:
        """The buffer a segment writes its own draws into (`buffers(emit)` makes it):
        none, as its draws go in the trace buffer, or nowhere."""
        return None

    def handed_over(self, buffers: DrawBuffers, new_draws: Any) -> None:
        """Notes a segment's `new_draws` handed to the checkpoint to write."""

    def listing(self, listed: Callable[[], Any]) -> Any:
        """The chunk's trace as files (`listed()` reads their listing): none."""
        return None


@dataclasses.dataclass(frozen=True)
class NoDraws(Recording):
    """No draw is recorded: `trace=False` without `with_output`, or a run that makes
    none (`num_steps=0`, or `burn_in=num_steps`)."""


@dataclasses.dataclass(frozen=True)
class DrawsInBuffer(Recording):
    """Every draw written into the run's trace buffer, on the devices; a checkpoint
    writes each segment's new ones, sliced from it."""

    def like(self, draws_like: Callable[[], Any]) -> Any:
        return draws_like()

    def num_draws(self, draws: Draws) -> int:
        return draws.total

    def most_in(self, draws: Draws, steps: int) -> int:
        return draws.most_in(steps)

    def segment_files(self, draws: Draws, start: int, stop: int) -> SegmentFiles | None:
        """The draws around the segment's, sliced from the trace buffer (None if it
        makes none)."""
        return segment_files(draws, start, stop)


@dataclasses.dataclass(frozen=True)
class DrawsOnDisk(DrawsInBuffer):
    """`trace="disk"`: each segment returns its own draws, which the checkpoint writes
    to a draw file; no trace buffer is held."""

    def segment_files(self, draws: Draws, start: int, stop: int) -> SegmentFiles | None:
        """The segment's own draws, the first at offset 0 (None if it makes none)."""
        files = segment_files(draws, start, stop)
        return None if files is None else files._replace(offset=0)

    def own_draws(
        self, files: SegmentFiles | None, buffers: Callable[[int], Any]
    ) -> Any:
        """A buffer of the segment's `emit` draws, if it makes any."""
        return None if files is None else buffers(files.emit)

    def handed_over(self, buffers: DrawBuffers, new_draws: Any) -> None:
        """Their buffer is free for a later segment once they are written."""
        if new_draws is not None:
            buffers.handed_over(new_draws)

    def listing(self, listed: Callable[[], Any]) -> Any:
        return listed()
