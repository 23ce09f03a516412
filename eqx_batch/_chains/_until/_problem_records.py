"""The record of `until`'s checks of a run, kept by column: one row of every problem's
outcome per check, a run without `data=` being one problem.

Every problem still running is at the same step: the problems start together and move
together, and one that stops leaves the compiled batch (`_chains/_chunk.py` compacts it
out). So a check is made at one step for every running problem, and each problem's
record is the record its run alone would keep. A check adds one row of NumPy arrays,
whatever the number of problems: per-problem records, rebuilt at every check, cost a
TPU's host more than the segment they followed at 256 problems (issue 42).

A checkpoint keeps the record as JSON, in the form the run's files have always had:
one problem's record (`Record`) as it is without `data`, a list of one per problem
with `data`: the run's `ProblemForm` says which.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._common import ProblemForm
from ._records import Record, Stopped


class ProblemRecords:
    """Every problem's checks so far, in rows (one per step where any problem was
    checked), and its `Stopped` once it stops."""

    def __init__(
        self,
        steps: tuple[int, ...],
        checked: tuple[np.ndarray, ...],
        worst: tuple[np.ndarray, ...],
        stopped: tuple[Stopped | None, ...],
        last_checks: np.ndarray | None = None,
        stop_steps: np.ndarray | None = None,
    ):
        self.steps = steps  # the steps of the rows, in order
        self.checked = checked  # per row, `bool[problems]`: which were checked
        self.worst = worst  # per row, `float64[problems]`: their first statistic
        self.stopped = stopped
        # Each problem's last check (0 before any) and stop (-1 while it runs): given
        # by `with_checks`, so that a check costs the same however many problems and
        # checks came before.
        if last_checks is None:
            last_checks = np.zeros(len(stopped), np.int64)
            for step, rows in zip(steps, checked, strict=True):
                last_checks[rows] = step
        if stop_steps is None:
            stop_steps = np.array([-1 if s is None else s.step for s in stopped])
        self.last_checks = last_checks
        self.stop_steps = stop_steps.astype(np.int64)

    @classmethod
    def empty(cls, num_problems: int) -> "ProblemRecords":
        return cls((), (), (), (None,) * num_problems)

    @classmethod
    def of(cls, records: Sequence[Record]) -> "ProblemRecords":
        """The records of the problems, one `Record` each. Raises `ValueError` if a
        record's checks are out of order."""
        for record in records:
            if list(record.checks) != sorted(set(record.checks)):
                raise ValueError(
                    f"its record of `until`'s checks is out of order ({record.checks})"
                )
        steps = tuple(sorted({step for r in records for step in r.checks}))
        row_of = {step: row for row, step in enumerate(steps)}
        checked = np.zeros((len(steps), len(records)), bool)
        worst = np.full((len(steps), len(records)), np.nan)
        for p, record in enumerate(records):
            rows = [row_of[step] for step in record.checks]
            checked[rows, p] = True
            worst[rows, p] = record.worst
        stopped = tuple(r.stopped for r in records)
        return cls(steps, tuple(checked), tuple(worst), stopped)

    @property
    def records(self) -> tuple[Record, ...]:
        """Each problem's `Record`."""
        num_problems = len(self.stopped)
        checked = np.zeros((0, num_problems), bool)
        worst = np.zeros((0, num_problems))
        if self.steps:
            checked, worst = np.stack(self.checked), np.stack(self.worst)
        steps = np.asarray(self.steps, np.int64)
        return tuple(
            Record(
                tuple(steps[checked[:, p]].tolist()),
                tuple(worst[checked[:, p], p].tolist()),
                stopped,
            )
            for p, stopped in enumerate(self.stopped)
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProblemRecords) and self.records == other.records

    def __repr__(self) -> str:
        return f"ProblemRecords({self.records!r})"

    def to_json(self, problems: ProblemForm) -> Any:
        """The records as a checkpoint of a run of `problems` keeps them."""
        return problems.file_records([record.to_json() for record in self.records])

    @classmethod
    def from_json(
        cls, saved: Any, burn_in: int, problems: ProblemForm
    ) -> "ProblemRecords":
        """The records `to_json` wrote. Raises `ValueError`, `TypeError` or
        `KeyError` if `saved` is malformed."""
        return cls.of(
            [Record.from_json(r, burn_in) for r in problems.records_in_file(saved)]
        )

    def disagreement(self, steps_done: int, problems: ProblemForm) -> str | None:
        """What contradicts a progress of `steps_done` steps in any problem's record:
        a check or a stop after them, a stop before its last check; where a stop
        ends the run (`problems.stops_last`), a stop elsewhere than at
        `steps_done`."""
        for p, record in enumerate(self.records):
            problem = record.disagreement(steps_done, stops_last=problems.stops_last)
            if problem is not None:
                return problems.named(p, problem)
        return None

    def with_checks(
        self,
        step: int,
        checked: np.ndarray,
        worst: np.ndarray,
        stopping: Mapping[int, tuple[bool, str]],
        burn_in: int,
    ) -> "ProblemRecords":
        """The records with the checks at `step` of the problems `checked`
        (`bool[problems]`), whose first statistic is `worst`, added; the problems of
        `stopping` (`{problem: (converged, reason)}`) stop there, checked or not (at
        the cap, with no draw to check). A window starts after `burn_in` at the
        earliest."""
        steps, rows, values = self.steps, self.checked, self.worst
        if checked.any():
            steps, rows = (*steps, step), (*rows, checked)
            values = (*values, np.where(checked, worst, np.nan).astype(np.float64))
        stopped, stop_steps = list(self.stopped), self.stop_steps.copy()
        if stopping:
            # The rows as tables, made once: a stop then costs two lookups, not a
            # pass over the rows per problem.
            at = np.asarray(steps, np.int64)
            shape = (len(rows), len(stop_steps))  # also with no row yet
            table = np.array(rows, bool).reshape(shape)
            worsts = np.array(values, np.float64).reshape(shape)
            window_starts = np.maximum(self.last_checks, burn_in).tolist()
            for p, (is_converged, reason) in stopping.items():
                stop_steps[p] = step
                mine = table[:, p]
                stopped[p] = Stopped(
                    step=step,
                    converged=is_converged,
                    reason=reason,
                    window_start=window_starts[p],
                    checks=at[mine],
                    worst=worsts[mine, p],
                )
        last_checks = np.where(checked, step, self.last_checks)
        return ProblemRecords(
            steps, rows, values, tuple(stopped), last_checks, stop_steps
        )

    def running(self, step: int) -> np.ndarray:
        """Whether each problem still runs after step `step` (`bool[problems]`)."""
        return (self.stop_steps < 0) | (self.stop_steps > step)

    def end(self, num_steps: int) -> int:
        """The step the run ends at: `num_steps`, or the last problem's stop."""
        if (self.stop_steps < 0).any():
            return num_steps
        return int(self.stop_steps.max())

    def decided(self, step: int) -> bool:
        """Whether the checks at `step` were made (by a chunk further on)."""
        return step in self.steps or bool((self.stop_steps == step).any())

    def failed(self, step: int) -> np.ndarray:
        """Which problems' checks at `step` failed (`bool[problems]`): their windows
        are discarded."""
        if step not in self.steps:
            return np.zeros(len(self.stopped), bool)
        return self.checked[self.steps.index(step)] & (self.stop_steps != step)

    def as_of(self, step: int) -> "ProblemRecords":
        kept = sum(1 for s in self.steps if s <= step)
        stopped = tuple(
            None if s is not None and s.step > step else s for s in self.stopped
        )
        return ProblemRecords(
            self.steps[:kept], self.checked[:kept], self.worst[:kept], stopped
        )

    @property
    def progress(self) -> tuple[int, int]:
        """How far these records have come: checks made, problems stopped (to pick
        the furthest of the chunks' records on resume)."""
        checks = sum(int(rows.sum()) for rows in self.checked)
        return checks, int((self.stop_steps >= 0).sum())

    def stops(self, num_steps: int) -> tuple[tuple[Stopped, ...] | None, np.ndarray]:
        """Each problem's `Stopped` (None unless every problem stopped: the cap stops
        those still running) and the steps it ran (`int64[problems]`), of a run with
        the cap `num_steps` that ended with these records."""
        steps = np.where(self.stop_steps < 0, num_steps, self.stop_steps)
        stopped = tuple(s for s in self.stopped if s is not None)
        return (stopped if len(stopped) == len(self.stopped) else None), steps
