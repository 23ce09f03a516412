"""The records of `until`'s checks: a check's outcome (`Check`), one problem's checks
so far (`Record`; a run's are one per problem, `_problem_records.py`) and its report
once it stops (`eb.Stopped`).

Plain data, kept apart from the rule and the statistics that make them (`_stopping.py`,
`_convergence.py`): the checkpoint files keep records as JSON, and read them back
without the statistics.
"""

import dataclasses
import functools as ft
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np


class Check(NamedTuple):
    """The outcome of one check of `until`'s rule (`_stopping.check`)."""

    passed: bool
    worst: float  # of the first criterion's statistic
    reason: str


# A frozen dataclass rather than an `eqx.Module`: a run of many problems makes one
# per problem, and a Module's checks at construction cost 15-30 us each, against 1
# here: at 256 problems stopping at one check, a third of the host's time for it on
# a TPU machine (issue 42). Still a pytree, compared and shown as a Module would be.
@ft.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "converged", "reason", "window_start", "checks", "worst"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Stopped:
    """When and why [`eb.run_chains`][]`(..., until=...)` stopped.

    **Fields:**

    - `step`: the steps run (`Chains.steps_done`).
    - `converged`: whether the rule held; `False` when the run reached the cap,
        `num_steps`, without it holding.
    - `reason`: the statistics of the last check, each with its worst value, the leaf
        path and element where it is, and its threshold (a failing one first), or
        why no check was made.
    - `window_start`: the step the last window began at: its draws (those the
        statistics of the last check describe) are the states recorded after steps
        `window_start + 1` to `step`.
    - `checks`: the steps at which the rule was checked (NumPy `int64`).
    - `worst`: the worst value of the rule's first statistic at each check (NumPy
        `float64`), to plot against `checks`.

    !!! Example

        ```python
        import matplotlib.pyplot as plt

        def step(x, key):  # an AR(1) chain; stationary: N(0, 1)
            return 0.9 * x + 0.44 * jr.normal(key, x.shape)

        starts, keys = jnp.array([[-3.0], [3.0]]), jr.split(jr.key(0), 2 * 32)
        result = eb.run_chains(
            step, starts, keys, 1000, superchains=2, until=eb.converged(every=50)
        )
        stopped = result.stopped  # e.g. Stopped(step=100, converged=True, ...)
        plt.plot(stopped.checks, stopped.worst)  # nested R-hat at each check
        ```
    """

    step: int
    converged: bool
    reason: str
    window_start: int
    checks: np.ndarray
    worst: np.ndarray

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stopped):
            return NotImplemented
        return (
            (self.step, self.converged, self.reason, self.window_start)
            == (other.step, other.converged, other.reason, other.window_start)
            and np.array_equal(self.checks, other.checks)
            and np.array_equal(self.worst, other.worst, equal_nan=True)
        )

    __hash__ = None  # type: ignore[assignment]  # equal by value, and mutable arrays

    def __repr__(self) -> str:
        return eqx.tree_pformat(self)


class Record(NamedTuple):
    """The checks of one problem so far, and its `Stopped` once it stops, as a
    checkpoint keeps them (JSON)."""

    checks: tuple[int, ...] = ()
    worst: tuple[float, ...] = ()
    stopped: Stopped | None = None

    def to_json(self) -> dict:
        stopped = self.stopped
        return {
            "checks": list(self.checks),
            "worst": list(self.worst),
            "stopped": None
            if stopped is None
            else [stopped.step, stopped.converged, stopped.reason],
        }

    @classmethod
    def from_json(cls, saved: Any, burn_in: int) -> "Record":
        """Raises `ValueError`, `TypeError` or `KeyError` if `saved` is malformed."""
        checks = tuple(int(step) for step in saved["checks"])
        worst = tuple(float(value) for value in saved["worst"])
        if len(checks) != len(worst):
            raise ValueError("as many checks as worst values")
        record = cls(checks, worst)
        if saved["stopped"] is not None:
            step, is_converged, reason = saved["stopped"]
            record = record.stop(int(step), bool(is_converged), str(reason), burn_in)
        return record

    def disagreement(self, steps_done: int, *, stops_last: bool = True) -> str | None:
        """What in this record contradicts a progress of `steps_done` steps, if
        anything: a check after them, or a stop elsewhere than at `steps_done` (with
        `stops_last=False`, one of many problems', after them or before its last
        check). Checks out of order are refused when read (`ProblemRecords.of`)."""
        if self.checks and self.checks[-1] > steps_done:
            return (
                f"its record of `until`'s checks has a check at step "
                f"{self.checks[-1]}, but its progress says {steps_done} steps were done"
            )
        stopped = self.stopped
        if stopped is not None and not stops_last:
            if stopped.step > steps_done or stopped.step < max(self.checks, default=0):
                return (
                    f"its record of `until`'s checks says it stopped at step "
                    f"{stopped.step}, after its progress ({steps_done} steps) or "
                    "before its last check"
                )
        elif stopped is not None and stopped.step != steps_done:
            return (
                f"its record of `until`'s checks says the run stopped at step "
                f"{stopped.step}, but its progress says {steps_done} steps were "
                "done"
            )
        return None

    def window_start(self, step: int) -> int:
        """Where the window of draws that ends at `step` began."""
        if self.checks and self.checks[-1] < step:
            return self.checks[-1]  # the checks are in order: the last is the one
        return max((c for c in self.checks if c < step), default=0)

    def stop(
        self, step: int, is_converged: bool, reason: str, burn_in: int
    ) -> "Record":
        """The record of a run that stops at `step`."""
        stopped = Stopped(
            step=step,
            converged=is_converged,
            reason=reason,
            window_start=max(self.window_start(step), burn_in),
            checks=np.asarray(self.checks, np.int64),
            worst=np.asarray(self.worst, np.float64),
        )
        return self._replace(stopped=stopped)
