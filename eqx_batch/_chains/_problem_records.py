"""Each problem stopping on its own: the records of `until`'s checks of a run of many
problems (`data=` with `until=`), one `Record` per problem.

Every problem still running is at the same step: the problems start together and move
together, and one that stops leaves the compiled batch (`_chunk.py` compacts it out).
So a check is made at one step for every running problem, and each problem's record
is the record its run alone would keep.
"""

from typing import Any, NamedTuple

import numpy as np

from ._records import Record


class ProblemRecords(NamedTuple):
    """One `Record` per problem, as a checkpoint keeps them (JSON)."""

    records: tuple[Record, ...]

    @classmethod
    def empty(cls, num_problems: int) -> "ProblemRecords":
        return cls((Record(),) * num_problems)

    def to_json(self) -> dict:
        return {"problems": [record.to_json() for record in self.records]}

    @classmethod
    def from_json(cls, saved: Any, burn_in: int) -> "ProblemRecords":
        """Raises `ValueError`, `TypeError` or `KeyError` if `saved` is malformed."""
        if not isinstance(saved, dict) or not isinstance(saved["problems"], list):
            raise ValueError("a list of one record per problem")
        return cls(tuple(Record.from_json(r, burn_in) for r in saved["problems"]))

    def disagreement(self, steps_done: int) -> str | None:
        """What contradicts a progress of `steps_done` steps in any problem's record:
        checks out of order, a check or a stop after them, a stop before its last
        check."""
        for p, record in enumerate(self.records):
            problem = record.disagreement(steps_done, stops_last=False)
            if problem is not None:
                return f"problem {p}: {problem}"
        return None

    def running(self, step: int) -> np.ndarray:
        """Whether each problem still runs after step `step` (`bool[problems]`)."""
        return np.array(
            [r.stopped is None or r.stopped.step > step for r in self.records]
        )

    def end(self, num_steps: int) -> int:
        """The step the run ends at: `num_steps`, or the last problem's stop."""
        if any(r.stopped is None for r in self.records):
            return num_steps
        return max(r.stopped.step for r in self.records if r.stopped is not None)

    def decided(self, step: int) -> bool:
        """Whether the checks at `step` were made (by a chunk further on)."""
        return any(r.decided(step) for r in self.records)

    def failed(self, step: int) -> np.ndarray:
        """Which problems' checks at `step` failed (`bool[problems]`): their windows
        are discarded."""
        return np.array([r.failed(step) for r in self.records])

    def as_of(self, step: int) -> "ProblemRecords":
        return ProblemRecords(tuple(r.as_of(step) for r in self.records))

    @property
    def progress(self) -> tuple[int, int]:
        """How far these records have come: checks made, problems stopped (to pick
        the furthest of the chunks' records on resume)."""
        return (
            sum(len(r.checks) for r in self.records),
            sum(r.stopped is not None for r in self.records),
        )

    @property
    def steps_done(self) -> np.ndarray:
        """Each problem's steps (`int64[problems]`): its stop, once it stopped."""
        return np.array(
            [-1 if r.stopped is None else r.stopped.step for r in self.records],
            np.int64,
        )
