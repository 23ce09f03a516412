"""`until`'s rule planned for one run (`Schedule`): its criteria (`Criterion`), each a
statistic and a threshold, and the interval between checks. Plain data, below the
rule that makes it (`_stopping.py`) and the checks that read it."""

from typing import Any, NamedTuple


# How a reason names each statistic.
NAMES = {"nested_rhat": "nested R-hat", "rhat": "R-hat", "ess": "ESS"}


class Criterion(NamedTuple):
    """One statistic of `Diagnostics` and its threshold."""

    statistic: str  # "nested_rhat", "rhat" or "ess"
    threshold: float

    def holds(self, value: Any) -> Any:
        """Whether `value` (a float, or an array of them) meets the threshold: an ESS
        at least it, an R-hat at most it. NaN (no element with varying draws) holds
        nothing."""
        if self.statistic == "ess":
            return value >= self.threshold
        return value <= self.threshold

    def sign(self, holds: bool) -> str:
        """The comparison a value makes with the threshold, as a reason shows it."""
        if self.statistic == "ess":
            return ">=" if holds else "<"
        return "<=" if holds else ">"

    def __str__(self) -> str:
        return f"{NAMES[self.statistic]} {self.sign(True)} {self.threshold:.6g}"


class Schedule(NamedTuple):
    """A rule planned for one run: its criteria, thresholds resolved, and interval."""

    criteria: tuple[Criterion, ...]
    every: int

    def __str__(self) -> str:
        return f"{' and '.join(map(str, self.criteria))}, checked every {self.every}"

    def is_check(self, step: int, num_steps: int) -> bool:
        return step % self.every == 0 or step == num_steps

    def next_check(self, step: int) -> int:
        return (step // self.every + 1) * self.every
