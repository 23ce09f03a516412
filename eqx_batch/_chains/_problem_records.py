"""The record of `until`'s checks of a run: one `Record` per problem, a run without
`data=` being one problem.

Every problem still running is at the same step: the problems start together and move
together, and one that stops leaves the compiled batch (`_chunk.py` compacts it out).
So a check is made at one step for every running problem, and each problem's record
is the record its run alone would keep.

A checkpoint keeps the record as JSON, in the form the run's files have always had:
one problem's record as it is without `data`, a list of one per problem with `data`.
The form is chosen only here, at the file boundary (`one_problem`).
"""

from typing import Any, NamedTuple

import numpy as np

from ._records import Record, Stopped


class ProblemRecords(NamedTuple):
    """One `Record` per problem, in the order of the problems."""

    records: tuple[Record, ...]

    @classmethod
    def empty(cls, num_problems: int) -> "ProblemRecords":
        return cls((Record(),) * num_problems)

    def to_json(self, *, one_problem: bool = False) -> dict:
        """The records as a checkpoint keeps them: with `one_problem` (a run without
        `data`), the one problem's record as it is."""
        if one_problem:
            (record,) = self.records
            return record.to_json()
        return {"problems": [record.to_json() for record in self.records]}

    @classmethod
    def from_json(
        cls, saved: Any, burn_in: int, *, one_problem: bool = False
    ) -> "ProblemRecords":
        """The records `to_json` wrote. Raises `ValueError`, `TypeError` or
        `KeyError` if `saved` is malformed."""
        if one_problem:
            return cls((Record.from_json(saved, burn_in),))
        if not isinstance(saved, dict) or not isinstance(saved["problems"], list):
            raise ValueError("a list of one record per problem")
        return cls(tuple(Record.from_json(r, burn_in) for r in saved["problems"]))

    def disagreement(self, steps_done: int, *, one_problem: bool = False) -> str | None:
        """What contradicts a progress of `steps_done` steps in any problem's record:
        checks out of order, a check or a stop after them, a stop before its last
        check; with `one_problem` (a run without `data`), a stop elsewhere than at
        `steps_done`."""
        if one_problem:
            (record,) = self.records
            return record.disagreement(steps_done)
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

    def stops(self, num_steps: int) -> tuple[tuple[Stopped, ...] | None, np.ndarray]:
        """Each problem's `Stopped` (None unless every problem stopped: the cap stops
        those still running) and the steps it ran (`int64[problems]`), of a run with
        the cap `num_steps` that ended with these records."""
        steps = np.array([r.end(num_steps) for r in self.records], np.int64)
        stopped = tuple(r.stopped for r in self.records if r.stopped is not None)
        return (stopped if len(stopped) == len(self.records) else None), steps
