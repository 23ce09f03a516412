"""The device buffers of a `trace="disk"` chunk's new draws, reused once their file is
written.

A segment of a `trace="disk"` run returns its own draws, which the checkpoint writes to
a draw file in the background. Each segment writes them over a buffer whose draws are
already in their file, rather than over one allocated for it: the allocator fragments
buffers allocated segment after segment until resident memory grows with the steps.
"""

from typing import Any

import jax.tree_util as jtu

from .._placement import Placement


class DrawBuffers:
    """The draws being written by the checkpoint, and those written, of one chunk.

    **Arguments:**

    - `placement`: the chunk's chains over the devices, where buffers are made.
    """

    def __init__(self, placement: Placement):
        self._placement = placement
        self._writing: Any = None
        self._spare: Any = None

    def take(self, like: Any) -> Any:
        """A buffer for the draws of `like` (shape-dtype structs, `[chains, emit,
        ...]`): the spare one if it has their shapes, else zeros made now. Slots past
        a segment's draws are not written out, so the spare one's old draws may stay.
        """
        spare, self._spare = self._spare, None
        if spare is None or _shapes(spare) != _shapes(
            self._placement.zeros_to_make(like)
        ):
            spare = self._placement.zeros(like)
        return spare

    def handed_over(self, draws: Any) -> None:
        """Notes `draws` handed to the checkpoint to write: `Checkpoint.write` waited
        for the write before, whose draws are free for a later segment to write over.
        """
        self._spare, self._writing = self._writing, draws


def _shapes(tree: Any) -> list[tuple[int, ...]]:
    return [x.shape for x in jtu.tree_leaves(tree)]
