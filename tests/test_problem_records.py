"""The records of `until`'s checks of a run, one per problem (one without `data`):
which problems run and which checks failed at a step, where the run ends, the records
as a chunk that has run so far keeps them, and their two forms in a checkpoint's files
(`_chains/_until/_problem_records.py`)."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from eqx_batch._chains._common import ManyProblems, OneProblem, ProblemLayout
from eqx_batch._chains._until._problem_records import ProblemRecords
from eqx_batch._chains._until._records import Record


def checked(*steps: int) -> Record:
    """A problem's record whose checks at `steps` all failed: it runs on."""
    return Record(steps, (1.5,) * len(steps))


def converged(*steps: int) -> Record:
    """A problem's record whose checks at `steps` failed but the last, where it
    converged and stopped."""
    return Record(steps, (1.5,) * (len(steps) - 1) + (1.01,)).stop(
        steps[-1], True, "nested R-hat 1.01", burn_in=0
    )


def capped(*steps: int, cap: int) -> Record:
    """A problem's record whose checks at `steps` failed, stopped at the cap `cap`
    with no check there (no draw since its last check)."""
    return checked(*steps).stop(cap, False, "reached the cap", burn_in=0)


# Problem 0 converges at step 100, problem 1 runs on, problem 2 converges at step 50.
RECORDS = ProblemRecords.of((converged(50, 100), checked(50, 100), converged(50)))
# The two forms of a run's problems: without `data`, and with 3 problems of 2 chains.
ONE, MANY = OneProblem(2), ManyProblems(ProblemLayout(6, 3))


@pytest.mark.parametrize(
    "step, running, failed, decided",
    [
        (0, [True, True, True], [False, False, False], False),
        (49, [True, True, True], [False, False, False], False),
        (50, [True, True, False], [True, True, False], True),
        (75, [True, True, False], [False, False, False], False),
        (100, [False, True, False], [False, True, False], True),
        (150, [False, True, False], [False, False, False], False),
    ],
)
def test_running_failed_and_decided_at_each_step(step, running, failed, decided):
    np.testing.assert_array_equal(RECORDS.running(step), running)
    np.testing.assert_array_equal(RECORDS.failed(step), failed)
    assert RECORDS.decided(step) is decided


def test_no_check_yet_runs_every_problem_to_the_end():
    records = ProblemRecords.empty(3)
    assert records == ProblemRecords.of((Record(), Record(), Record()))
    np.testing.assert_array_equal(records.running(100), [True, True, True])
    np.testing.assert_array_equal(records.failed(100), [False, False, False])
    assert not records.decided(100)
    assert records.end(200) == 200
    assert records.as_of(100) == records


@pytest.mark.parametrize(
    "records, end",
    [
        # A problem running: the run goes on to `num_steps`.
        ((converged(50, 100), checked(50, 100), converged(50)), 200),
        ((checked(50),), 200),
        # Every problem stopped: the run ends at the last stop.
        ((converged(50, 100), converged(50)), 100),
        ((converged(50), converged(50, 100, 150), converged(50, 100)), 150),
        ((converged(50), capped(50, 100, 150, cap=200)), 200),
    ],
)
def test_the_run_ends_at_the_last_stop_once_every_problem_stopped(records, end):
    assert ProblemRecords.of(records).end(200) == end


@pytest.mark.parametrize(
    "step, kept",
    [
        (0, (Record(), Record(), Record())),
        (49, (Record(), Record(), Record())),
        (50, (checked(50), checked(50), converged(50))),
        (99, (checked(50), checked(50), converged(50))),
        (100, (converged(50, 100), checked(50, 100), converged(50))),
        (150, (converged(50, 100), checked(50, 100), converged(50))),
    ],
)
def test_as_of_a_step_keeps_the_checks_and_stops_up_to_it(step, kept):
    assert RECORDS.as_of(step) == ProblemRecords.of(kept)


def test_a_stop_at_the_cap_without_a_check_is_decided_not_failed():
    records = ProblemRecords.of((capped(50, 100, cap=120), checked(50, 100)))
    np.testing.assert_array_equal(records.running(119), [True, True])
    np.testing.assert_array_equal(records.running(120), [False, True])
    np.testing.assert_array_equal(records.failed(120), [False, False])
    assert records.decided(120)
    assert records.as_of(119) == ProblemRecords.of((checked(50, 100), checked(50, 100)))


@pytest.mark.parametrize(
    "records, stopped, steps",
    [
        # A problem running at the cap: no problem's `Stopped` is reported.
        ((converged(50), checked(50, 100)), None, [50, 200]),
        ((converged(50), capped(50, cap=200)), (50, 200), [50, 200]),
        # A run without `data` is one problem.
        ((converged(50, 100),), (100,), [100]),
        ((checked(50),), None, [200]),
    ],
)
def test_stops_reports_each_problem_once_every_one_stopped(records, stopped, steps):
    found, steps_done = ProblemRecords.of(records).stops(200)
    assert steps_done.dtype == np.int64
    np.testing.assert_array_equal(steps_done, steps)
    if stopped is None:
        assert found is None
    else:
        assert found is not None and tuple(s.step for s in found) == stopped


def test_one_problem_is_kept_in_the_form_of_a_run_without_data():
    records = ProblemRecords.of((converged(50, 100),))
    saved = records.to_json(ONE)
    assert saved == converged(50, 100).to_json()
    assert ProblemRecords.from_json(saved, 0, ONE) == records
    # Either form read as the other is malformed (`CheckpointReader` reports it).
    with pytest.raises(KeyError):
        ProblemRecords.from_json({"problems": [saved]}, 0, ONE)


def test_many_problems_are_kept_as_a_list_of_one_record_each():
    saved = RECORDS.to_json(MANY)
    assert saved == {"problems": [r.to_json() for r in RECORDS.records]}
    assert ProblemRecords.from_json(saved, 0, MANY) == RECORDS
    with pytest.raises(KeyError):
        ProblemRecords.from_json(RECORDS.records[0].to_json(), 0, MANY)


def test_a_disagreement_names_the_problem_only_with_many():
    one = ProblemRecords.of((converged(50),))
    assert one.disagreement(50, ONE) is None
    assert one.disagreement(100, ONE) == (
        "its record of `until`'s checks says the run stopped at step 50, but its "
        "progress says 100 steps were done"
    )
    # One of many problems stops before the others: no disagreement.
    assert one.disagreement(100, MANY) is None
    assert one.disagreement(40, MANY) == (
        "problem 0: its record of `until`'s checks has a check at step 50, but its "
        "progress says 40 steps were done"
    )


def test_checks_out_of_order_are_refused_when_read():
    saved = {"checks": [100, 50], "worst": [1.5, 1.4], "stopped": None}
    with pytest.raises(ValueError, match="out of order"):
        ProblemRecords.from_json(saved, 0, ONE)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["fail", "pass", "skip"]), min_size=3, max_size=3),
        max_size=6,
    ),
    st.integers(0, 120),
)
def test_checks_added_by_row_keep_what_one_record_per_problem_keeps(outcomes, burn_in):
    # Each boundary (every 50 steps) checks some of 3 problems still running: each
    # fails, passes (and stops) or is skipped (no draw to check). Added a row at a
    # time, the records equal those built one problem at a time.
    columns, records = ProblemRecords.empty(3), [Record()] * 3
    for index, row in enumerate(outcomes):
        step = 50 * (index + 1)
        running = columns.stop_steps < 0
        checked = np.array([o != "skip" for o in row]) & running
        worst = np.array([1.0 + index + p / 10 for p in range(3)])
        stopping = {
            p: (True, f"passed at {step}")
            for p in range(3)
            if checked[p] and row[p] == "pass"
        }
        for p in np.flatnonzero(checked):
            record = records[p]
            records[p] = Record(
                (*record.checks, step), (*record.worst, float(worst[p]))
            )
        for p, (is_converged, reason) in stopping.items():
            records[p] = records[p].stop(step, is_converged, reason, burn_in)
        columns = columns.with_checks(step, checked, worst, stopping, burn_in)
        assert columns == ProblemRecords.of(records)
        rebuilt = ProblemRecords.of(records)
        np.testing.assert_array_equal(columns.last_checks, rebuilt.last_checks)
        np.testing.assert_array_equal(columns.stop_steps, rebuilt.stop_steps)
    assert ProblemRecords.of(columns.records) == columns


def test_a_stop_before_any_check_has_no_checks():
    # At the cap with no draw ever checked (the records have no row yet).
    records = ProblemRecords.empty(3).with_checks(
        10, np.zeros(3, bool), np.full(3, np.nan), {1: (False, "no draw")}, burn_in=4
    )
    stopped = records.stopped[1]
    assert stopped is not None and stopped.step == 10 and not stopped.converged
    assert stopped.window_start == 4
    assert stopped.checks.shape == (0,) and stopped.checks.dtype == np.int64
    assert stopped.worst.shape == (0,) and stopped.worst.dtype == np.float64
    assert records.stopped[0] is None and records.stopped[2] is None
