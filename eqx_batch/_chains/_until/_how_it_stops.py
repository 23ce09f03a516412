"""How a run stops, decided once: at its cap (`RunsToCap`, without `until`), or where
`until`'s rule holds for each problem (`StopsByRule`). The loop, the checkpoint and
the result call the one they are given and never ask which it is.

Without `until` no problem stops, so nothing is checked or recorded, and the chunks
take turns, each run to the end (one chunk's memory at a time). With it, the chunks
move together, boundary by boundary, so that each check sees every chain.
"""

import dataclasses
from typing import Any, ClassVar, TYPE_CHECKING, TypeVar

import numpy as np

from .._common import ProblemLayout
from ._convergence import Diagnostics
from ._problem_records import ProblemRecords
from ._records import Stopped
from ._schedule import Schedule


if TYPE_CHECKING:
    from ._stopping import StoppingRule


_Job = TypeVar("_Job")


@dataclasses.dataclass(frozen=True)
class _Stopping:
    """What both ways share: a run of `num_problems` problems with a cap of
    `num_steps`, and whether `until` is `checked`."""

    num_steps: int
    num_problems: int
    checked: ClassVar[bool]

    @property
    def freezes(self) -> bool:
        """Whether a segment freezes the chains of the problems that stopped."""
        return self.checked

    @property
    def keeps_record(self) -> bool:
        """Whether a checkpoint keeps the record of the checks."""
        return self.checked

    @property
    def discards_moments(self) -> bool:
        """Whether the moments are a window's, discarded at each failed check."""
        return self.checked

    def end(self, record: ProblemRecords) -> int:
        """The step the run ends at: the cap, or the step of the last problem's
        stop (`record`, empty without checks)."""
        return record.end(self.num_steps)

    def kept(self, record: ProblemRecords) -> ProblemRecords | None:
        """What a checkpoint keeps of `record`: with checks, `record` (written as of
        the checkpoint's step, in the background), from which a resumed run decides
        its next checks."""
        return record if self.keeps_record else None


@dataclasses.dataclass(frozen=True)
class RunsToCap(_Stopping):
    """Every problem runs `num_steps` steps: no check, and no record of one."""

    checked = False

    @property
    def rule(self) -> str | None:
        """The rule as the run's identity names it: none."""
        return None

    def diagnostics_asked_by(self, diagnostics: bool) -> str | None:
        """What asks for the chains' diagnostics (None: nothing does)."""
        return "`diagnostics=True`" if diagnostics else None

    def next_check(self, step: int) -> int:
        return self.num_steps

    def checked_at(self, step: int) -> Schedule | None:
        """The rule checked at `step`: none."""
        return None

    def turns(self, jobs: list[_Job]) -> list[list[_Job]]:
        """The chunks' `jobs` in the groups that run together: one at a time."""
        return [[job] for job in jobs]

    def steps_before(self, index: int) -> int:
        """The steps run (by the progress bar) before chunk `index` starts: those of
        the chunks before it, each run to the end."""
        return index * self.num_steps

    def no_checks(self) -> ProblemRecords:
        """The record before any check: one problem's, whatever their number, so
        that no boundary walks a record per problem for checks never made."""
        return ProblemRecords.empty(1)

    def running(self, record: ProblemRecords, step: int) -> np.ndarray | None:
        """Which problems still run after `step`: every one (None: none is masked)."""
        return None

    def end(self, record: ProblemRecords) -> int:
        """The step the run ends at: the cap (the record is empty)."""
        return self.num_steps

    def stops(self, record: ProblemRecords) -> tuple[tuple[Stopped, ...] | None, Any]:
        """No problem's `Stopped`, and the steps each ran (`int64[problems]`)."""
        return None, np.full(self.num_problems, self.num_steps, np.int64)

    def diagnosed(self, diagnostics: Diagnostics) -> Diagnostics:
        """The run's diagnostics as its result shows them: all of them."""
        return diagnostics


@dataclasses.dataclass(frozen=True)
class StopsByRule(_Stopping):
    """Each problem stops at the first check of `schedule` it passes, or at the cap,
    `num_steps`."""

    schedule: Schedule
    checked = True

    @property
    def rule(self) -> str | None:
        return str(self.schedule)

    def diagnostics_asked_by(self, diagnostics: bool) -> str | None:
        return "`until` reads the chains' diagnostics"

    def next_check(self, step: int) -> int:
        return self.schedule.next_check(step)

    def checked_at(self, step: int) -> Schedule | None:
        """The rule checked at `step`, if it is checked there."""
        return self.schedule if self.schedule.is_check(step, self.num_steps) else None

    def turns(self, jobs: list[_Job]) -> list[list[_Job]]:
        """Every chunk at once: a check sees every chain's moments, and a chunked run
        stops where the unchunked one does."""
        return [jobs]

    def steps_before(self, index: int) -> int:
        """None: the chunks move together, and the bar counts the run's steps."""
        return 0

    def no_checks(self) -> ProblemRecords:
        return ProblemRecords.empty(self.num_problems)

    def running(self, record: ProblemRecords, step: int) -> np.ndarray | None:
        return record.running(step)

    def stops(self, record: ProblemRecords) -> tuple[tuple[Stopped, ...] | None, Any]:
        """Each problem's `Stopped` (the cap stops those still running) and steps."""
        return record.stops(self.num_steps)

    def diagnosed(self, diagnostics: Diagnostics) -> Diagnostics:
        """Without split R-hat: its halves are those of the planned draws, which an
        early stop never makes."""
        return dataclasses.replace(diagnostics, split_rhat=None)


HowItStops = RunsToCap | StopsByRule


def how_it_stops(
    until: "StoppingRule | None",
    num_steps: int,
    layout: ProblemLayout,
    superchains: int | None,
) -> HowItStops:
    """`until` planned for this run; with `data`, for each problem's own superchains
    and chains, on which it is checked."""
    if until is None:
        return RunsToCap(num_steps, layout.num_problems)
    schedule = until.schedule(
        num_steps, layout.superchains_each(superchains), layout.chains_each
    )
    return StopsByRule(num_steps, layout.num_problems, schedule)
