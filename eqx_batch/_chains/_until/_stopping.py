"""Stopping when converged: the rule (`eb.converged`) and a check's reason; the check
itself is decided on the devices (`_decision.py`), and what it finds is recorded in
`_records.py`.

A check reads the `Diagnostics` of the draws since the last check (a failed check
discards its window's moments, as Margossian et al.'s adaptive warmup discards a failed
window's draws) and compares each criterion's worst element with its threshold. It runs
between segments, in a program of its own, never inside the compiled loop.
"""

import functools as ft
import math
import operator
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from ..._errors import BatchError, check_int, describe, is_bool
from ._convergence import Diagnostics
from ._records import Check
from ._schedule import Criterion, NAMES, Schedule


# Nested R-hat's default threshold is sqrt(1 + min(K, FULL_K) / (FULL_K * M) + TAU):
# the paper's sqrt(1 + 1/M + TAU) (Margossian et al. 2024) from FULL_K superchains on,
# and a K / FULL_K share of its 1/M below, where the K superchain means agree by
# chance more often (`benchmarks/bench_stopping.py`: the paper's threshold stopped
# 16% of unmixed runs with K = M = 4, this one 4%, and 0.75% or less from K = 8 on).
TAU = 1e-4
FULL_K = 16
# Without superchains the default rule is classic R-hat below the usual 1.01 (Vehtari
# et al. 2021): nested R-hat's 1/M term, with M = 1, would allow R-hat up to 1.41.
RHAT_WITHOUT_SUPERCHAINS = 1.01
# Checks per run when `every` is None: each window is a tenth of the cap.
CHECKS_PER_RUN = 10


def _nested(value: Any, name: str = "nested_rhat") -> float | str | None:
    if isinstance(value, str):
        if value != "default":
            raise BatchError(
                f"`{name}` is {value!r}; pass a number >= 1, 'default' or None."
            )
        return value
    return _threshold(value, name, "R-hat")


def _every(value: Any, name: str = "every") -> int | None:
    if value is None:
        return None
    return check_int(value, name, minimum=1, hint="It is steps between checks.")


def _threshold(value: Any, name: str, kind: str) -> float | None:
    """`value`, a threshold of R-hat (`kind`) or ESS, as a float; None stays None."""
    if value is None:
        return None
    try:
        number = None if is_bool(value) else float(operator.index(value))
    except TypeError:
        number = float(value) if isinstance(value, float | np.floating) else None
    low = 1.0 if kind == "R-hat" else 0.0
    if number is None or not math.isfinite(number) or number < low or number == 0:
        shown = describe(value) if getattr(value, "ndim", 0) else repr(value)
        rule = "a number >= 1 (R-hat is 1 at best)" if low else "a number > 0"
        raise BatchError(f"`{name}` is {shown}; the {kind} threshold must be {rule}.")
    return number


class StoppingRule(eqx.Module):
    """When [`eb.run_chains`][] may stop before `num_steps`: made by
    [`eb.converged`][], passed as `until`. Every criterion that is not `None` must hold.

    **Fields:**

    - `nested_rhat`: the largest nested R-hat allowed, `"default"` (the calibrated
        threshold, see `eb.converged`) or `None` (not checked).
    - `rhat`: the largest classic R-hat allowed, or `None`.
    - `ess`: the smallest cross-chain ESS allowed, or `None`.
    - `every`: the steps between two checks; `None`: a tenth of `num_steps`.

    **Raises:**

    `eb.BatchError`, however the rule is built (by hand too), for the fields that
    `eb.converged` refuses.

    !!! Example

        ```python
        rule = eb.converged(rhat=1.05, every=100)
        rule.nested_rhat, rule.rhat  # ('default', 1.05)
        ```
    """

    # Checked and made floats and ints however the rule is built (`eb.converged`, or
    # by hand): a rule that `run_chains` would loop on forever is refused here.
    nested_rhat: float | str | None = eqx.field(converter=_nested)
    rhat: float | None = eqx.field(
        converter=ft.partial(_threshold, name="rhat", kind="R-hat")
    )
    ess: float | None = eqx.field(
        converter=ft.partial(_threshold, name="ess", kind="ESS")
    )
    every: int | None = eqx.field(converter=_every)

    def __check_init__(self) -> None:
        _check_criteria(self, "The stopping rule", "")

    def schedule(
        self, num_steps: int, superchains: int | None, num_chains: int
    ) -> "Schedule":
        """The criteria with their thresholds for this run, and the check interval."""
        nested = self.nested_rhat
        criteria = []
        if nested == "default":
            if superchains is not None:
                threshold = default_threshold(superchains, num_chains)
                criteria.append(Criterion("nested_rhat", threshold))
            elif self.rhat is None:
                # A classic R-hat the user gives replaces this one.
                criteria.append(Criterion("rhat", RHAT_WITHOUT_SUPERCHAINS))
        elif nested is not None:
            if superchains is None:
                raise BatchError(
                    f"`until` has nested_rhat={nested} but no `superchains`: pass "
                    "`superchains=K`, or `nested_rhat=None`."
                )
            criteria.append(Criterion("nested_rhat", float(nested)))
        if self.rhat is not None:
            criteria.append(Criterion("rhat", self.rhat))
        if self.ess is not None:
            criteria.append(Criterion("ess", self.ess))
        every = self.every or max(1, -(-num_steps // CHECKS_PER_RUN))
        return Schedule(tuple(criteria), every)


def _check_criteria(rule: StoppingRule, subject: str, prefix: str) -> None:
    """Refuses a rule with no criterion, naming it `subject` and its fields with
    `prefix` (`until.`)."""
    if rule.nested_rhat is None and rule.rhat is None and rule.ess is None:
        raise BatchError(
            f"{subject} has no criterion: pass `{prefix}nested_rhat`, `{prefix}rhat` "
            f"or `{prefix}ess`."
        )


def checked_until(until: Any, num_steps: Any) -> StoppingRule | None:
    """`until`, its fields checked however the rule was built (`checked_rule`).

    **Raises:**

    `BatchError` naming `until` (and its field) for an `until` that is not a rule
    `eb.converged` would make, or `until` without `num_steps` (its cap).
    """
    if until is None:
        return None
    until = checked_rule(until)
    if num_steps is None:
        raise BatchError(
            "`until` is given but `num_steps` is None: pass `num_steps`, the cap."
        )
    return until


def checked_rule(until: Any) -> StoppingRule:
    """`until`, a `StoppingRule`, with its fields checked as `eb.converged` checks
    them, however it was built.

    The fields' converters run when a rule is made, but `eqx.tree_at` sets fields
    without them: a rule edited so (`every=-5`) would never reach its checks, and the
    run would never return.

    **Raises:**

    `BatchError` naming `until` and the field (`until.every`), for what
    `eb.converged` refuses, and for an `until` that is no `StoppingRule`.
    """
    if not isinstance(until, StoppingRule):
        raise BatchError(
            f"`until` is {describe(until)}; pass a rule that `eb.converged` makes."
        )
    _check_criteria(until, "`until`", "until.")
    return StoppingRule(
        _nested(until.nested_rhat, "until.nested_rhat"),
        _threshold(until.rhat, "until.rhat", "R-hat"),
        _threshold(until.ess, "until.ess", "ESS"),
        _every(until.every, "until.every"),
    )


def default_threshold(superchains: int, num_chains: int) -> float:
    """Nested R-hat's default threshold for K superchains of M chains (see `FULL_K`)."""
    share = min(superchains, FULL_K) / (FULL_K * (num_chains // superchains))
    return math.sqrt(1 + share + TAU)


def converged(
    *,
    nested_rhat: float | str | None = "default",
    rhat: float | None = None,
    ess: float | None = None,
    every: int | None = None,
) -> StoppingRule:
    """A stopping rule for [`eb.run_chains`][]`(..., until=...)`: stop once the chains
    have converged, with `num_steps` as the cap.

    Many short chains on an accelerator converge at a step no one knows in advance.
    Every `every` steps (between segments, on the devices) the run computes the
    diagnostics of the draws recorded since the previous check and stops when every
    given criterion holds at every element of the state. A check that fails starts a
    new window: its draws' moments are discarded, as in the adaptive warmup of
    Margossian et al., "Nested R-hat" (arXiv 2110.13017), so the statistics that
    pass describe the last window's draws only.

    **Arguments:**

    - `nested_rhat`: the largest nested R-hat allowed (needs `superchains`).
        `"default"`, for K superchains of M chains, is sqrt(1 + min(K, 16) / (16 M)
        + 1e-4): the paper's sqrt(1 + 1/M + 1e-4) from 16 superchains on, tighter
        below, where the paper's stops runs that have not mixed too often (measured
        by `benchmarks/bench_stopping.py`; docs: "Stopping when converged").
        Without superchains, `"default"` checks classic R-hat <= 1.01 instead.
        `None` does not check it.
    - `rhat`: the largest classic R-hat allowed; `None` does not check it.
    - `ess`: the smallest cross-chain ESS (`Diagnostics.ess`) allowed at every
        element; `None` does not check it.
    - `every`: steps between checks, at steps `every`, `2 * every`, ... and at the
        cap; `None` checks ten times per run (every `ceil(num_steps / 10)` steps).

    **Returns:**

    A [`eb.StoppingRule`][], hashable; its criteria are part of a checkpointed run's
    identity.

    **Raises:**

    `eb.BatchError` if a threshold is not a finite number (a bool included), an
    R-hat threshold is below 1, `ess` is not positive, `every` is not an int >= 1, or
    no criterion is given. With `run_chains`: see its `until`.

    !!! Example

        ```python
        def step(x, key):  # an AR(1) chain; stationary: N(0, 1)
            return 0.9 * x + 0.44 * jr.normal(key, x.shape)

        starts = jnp.array([[-3.0], [-1.0], [1.0], [3.0]])  # 4 superchains
        keys = jr.split(jr.key(0), 4 * 32)
        result = eb.run_chains(
            step, starts, keys, 2000, superchains=4, until=eb.converged(every=50)
        )
        result.steps_done  # well before 2000
        result.stopped.reason  # which statistic passed, its worst value and leaf
        ```
    """
    return StoppingRule(nested_rhat, rhat, ess, every)


def check(
    schedule: Schedule, worst: list[tuple[str, float]], nonfinite: np.ndarray
) -> Check:
    """Whether one problem meets every criterion, and why (the failing one first),
    from `worst`, the path and value of its worst element of each criterion's
    statistic (`worst_each`).

    A check never passes while a chain in `nonfinite` (the indices of the chains whose
    state went NaN or infinite) is among those it covers: its statistics may skip
    their NaNs and look converged.
    """
    lines, passed, first = [], True, math.nan
    if len(nonfinite):
        lines.append(_nonfinite_text(nonfinite))
        passed = False
    for index, (criterion, (path, value)) in enumerate(
        zip(schedule.criteria, worst, strict=True)
    ):
        holds = criterion.holds(value)
        passed &= holds
        if index == 0:
            first = value
        text = (
            f"{NAMES[criterion.statistic]} {value:.6g} at {path} "
            f"{criterion.sign(holds)} "
            f"{criterion.threshold:.6g}"
        )
        lines.insert(len(lines) if holds else int(len(nonfinite) > 0), text)
    return Check(passed, first, "; ".join(lines))


def worst_each(
    diagnostics: Diagnostics, statistic: str, rows: np.ndarray
) -> list[tuple[str, float]]:
    """What `worst_of` finds in the diagnostics of each problem of `rows` (each
    statistic of `diagnostics` with a leading axis of problems): the path of its
    worst element (`['w'][3]`) and its value, for all of them at once in NumPy."""
    if not len(rows):
        return []
    largest = statistic != "ess"
    leaves = []  # per leaf: its path, and each row's worst value and element there
    for path, leaf in jtu.tree_flatten_with_path(getattr(diagnostics, statistic))[0]:
        values = np.asarray(leaf)[rows]
        flat = values.reshape(len(rows), -1)
        if flat.shape[1] == 0:
            continue
        filled = np.where(np.isnan(flat), -np.inf if largest else np.inf, flat)
        at = filled.argmax(axis=1) if largest else filled.argmin(axis=1)
        elements = np.zeros((len(rows), 0), np.intp)  # a scalar leaf: no index
        if values.ndim > 1:
            elements = np.stack(np.unravel_index(at, values.shape[1:]), axis=1)
        value = flat[np.arange(len(rows)), at]
        leaves.append((jtu.keystr(path) or "state", value, elements))
    values = np.stack([value for _, value, _ in leaves])  # [leaves, rows]
    nan = np.isnan(values)
    badness = np.where(nan, 0.0, -values if largest else values)
    # Each row's worst leaf, NaN last, the first of equals (a stable sort): as
    # `Diagnostics.worst` sorts. At once for every row: a check of hundreds of
    # problems took milliseconds of the host's time row by row (issue 42).
    chosen = np.lexsort((badness, nan), axis=0)[0].tolist()
    return [
        (
            leaves[c][0] + "".join(f"[{j}]" for j in leaves[c][2][i].tolist()),
            float(values[c, i]),
        )
        for i, c in enumerate(chosen)
    ]


def _nonfinite_text(nonfinite: np.ndarray) -> str:
    shown = ", ".join(map(str, nonfinite[:8])) + (", ..." if len(nonfinite) > 8 else "")
    return f"{len(nonfinite)} chains are NaN or infinite ({shown})"


def worst_of(diagnostics: Diagnostics, statistic: str) -> tuple[str, float]:
    """The path of the worst element of a statistic (`['w'][3]`) and its value."""
    path, (value, element) = next(iter(diagnostics.worst(statistic).items()))
    return path + "".join(f"[{i}]" for i in element), value


def postfix(diagnostics: Diagnostics, nonfinite: np.ndarray) -> str:
    """What the progress bar shows: the worst (nested) R-hat and smallest ESS, and
    the chains that went NaN or infinite, if any."""
    statistic = "rhat" if diagnostics.nested_rhat is None else "nested_rhat"
    rhat_at, rhat = worst_of(diagnostics, statistic)
    ess_at, ess = worst_of(diagnostics, "ess")
    text = f"{NAMES[statistic]} {rhat:.4g} at {rhat_at}, ESS {ess:.4g} at {ess_at}"
    return text if not len(nonfinite) else f"{text}; {_nonfinite_text(nonfinite)}"
