"""A chunk's rows by problem, and its running chains advanced in pieces: the host's side
of compaction, whose programs `_compaction.py` compiles.

With `until`, once few of a chunk's chains still run, a segment gathers them into
pieces of a fixed share of the chunk (`piece_rows`), runs each piece and writes it back
over the chunk's chains and trace. `ChunkRun.advance` (`_chunk.py`) asks
`running_rows` whether a segment runs in pieces, and if so hands it to `advance`.
"""

import functools as ft
from typing import Any, NamedTuple

import jax
import numpy as np

from ._checkpoints._recording import SegmentFiles
from ._common import ChainState
from ._compaction import batch_slots, piece_rows, pieces, run_piece, sliced_draws
from ._placement import Placement
from ._plan import RunPlan


class RunningRows(NamedTuple):
    """The rows of a chunk that a segment runs in pieces, and the rows of a piece."""

    rows: np.ndarray
    size: int


class ChunkPieces:
    """One chunk's rows by problem, in blocks of a problem's chains on each device, and
    its running chains advanced in pieces of whole blocks.

    **Arguments:**

    - `plan`: the run's plan.
    - `placement`: the chunk's chains over the devices.
    - `problem`: each chain's problem (`ChainState.problem`; None: a run without
        `data`, one problem).
    - `num_chains`: the chunk's chains.
    """

    def __init__(
        self, plan: RunPlan, placement: Placement, problem: Any, num_chains: int
    ):
        self.plan, self.placement = plan, placement
        if problem is None:
            self.problem_of_row = np.zeros(num_chains, np.intp)
        else:
            self.problem_of_row = np.asarray(problem)
        # A step that sees every chain of a problem runs the whole chunk, its stopped
        # problems frozen: its chunks sit on the devices that hold whole problems
        # (`RunPlan.placement`), which pieces, placed on every device, do not.
        self._in_pieces = not plan.step.sees_every_chain
        # Whether a step's time grows with the chains it runs (`piece_rows`).
        self._per_chain = all(d.platform == "cpu" for d in placement.mesh.devices.flat)
        # The last pieces placed on the devices, and what they run (`_pieces`).
        self._placed: tuple[Any, list[tuple[Any, Any]]] = (None, [])

    @ft.cached_property
    def block(self) -> int:
        """The chains that share a problem, in blocks of this many on a device: asked
        only of a run with `until`, or whose segments return their own draws."""
        return self.placement.block_size(self.problem_of_row)

    def running_rows(self, running: np.ndarray | None) -> RunningRows | None:
        """The rows of the problems of `running` (`bool[problems]`, on the host;
        None without `until`) and the size of their pieces, if a segment runs them in
        pieces; None if it runs the whole chunk."""
        if running is not None and self._in_pieces:
            rows = np.flatnonzero(running[self.problem_of_row])
            size = piece_rows(
                len(rows),
                self.placement.num_rows,
                # A piece of the running chains holds whole blocks on every device.
                self.block * self.placement.mesh.size,
                self._per_chain,
            )
            if size is not None:
                return RunningRows(rows, size)
        return None

    def advance(
        self,
        step: Any,
        chains: ChainState,
        trace: Any,
        start: int,
        stop: int,
        rows: RunningRows,
        live: Any,
        files: SegmentFiles | None,
    ) -> tuple[ChainState, Any, Any]:
        """Runs the chains of `rows.rows` only, from step `start` to `stop`, in
        pieces of `rows.size` rows: the others' problems have stopped, and
        their rows stay as they are.

        **Arguments:**

        - `step`: the chunk's step; `chains`, `trace`: its chains and trace buffer
            (None without one; donated).
        - `live`: whether each problem still runs, on the devices.
        - `files`: where the segment's draws go (`_chunk._files`), or None.

        **Returns:**

        The chains and the trace buffer after the segment, and its draws for the
        files (None without `files`).
        """
        plan = self.plan
        split = self.placement.split
        first, end = plan.draws.before(start), plan.draws.before(stop)
        # Where the pieces' draws go: the trace buffer, or the segment's own draws
        # of every chain, for the files (a stopped chain's are zeros, as in a trace
        # buffer); None if the segment records none.
        target, offset = trace, first
        own = plan.recording.own_draws(
            files,
            lambda emit: self.placement.zeros(
                plan.draws_like(self.placement.num_chains, emit)
            ),
        )
        if own is not None:
            target, offset = own, 0
        batch = plan.prepared.placement(rows.size, 0, pad=True)
        emit = plan.recording.most_in(plan.draws, stop - start) if end > first else 0
        own = None
        if emit:
            own = batch.zeros_to_make(plan.draws_like(batch.num_chains, emit))
        segment = plan.prepared.segment(
            plan.own_draws_segment, stop - start, emit, self.block
        )
        for rows_placed, slots_placed in self._pieces(rows):
            chains, written = run_piece(
                segment,
                step,
                plan.static,
                chains,
                target if emit else None,
                rows_placed,
                slots_placed,
                np.int32(start),
                live,
                np.int32(offset),
                np.int32(end - first),
                own,
                (batch.split, split),
            )
            if emit:
                target = written
        new_draws = None
        if trace is not None:
            trace = target
            if files is not None:
                new_draws = sliced_draws(trace, np.int32(first), files.emit)
        elif files is not None:
            new_draws = target
        return chains, trace, new_draws

    def _pieces(self, running: RunningRows) -> list[tuple[Any, Any]]:
        """The pieces that run the rows of `running`, each its rows and where each of
        the chunk's rows is in it (for the write-backs), on the devices: kept while the
        running rows stay the same (placing them costs at every segment)."""
        rows, size = running
        key = (size, rows.tobytes())
        if self._placed[0] != key:
            placed = []
            for piece in pieces(rows, size, self.block) if len(rows) else []:
                slots = batch_slots(piece, self.placement.num_rows)
                placed.append(jax.device_put((piece, slots), self.placement.everywhere))
            self._placed = (key, placed)
        return self._placed[1]
