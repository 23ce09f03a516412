"""One process of a job of many problems, that saves every problem and problem 1.

    python problems_worker.py OUT RUN

Run only as a job (`multiprocess_launch`). `RUN` is `fixed` (`problems_run`) or
`until` (`stopping_problems_run`). Each process saves the run gathered to
`OUT.<process id>`, its problem 1 gathered to `OUT.one.<process id>`
(`chains_workloads.everything`), and that problem's `to_arviz()` posterior, converted
with no gathering, to `OUT.arviz.<process id>` (`eb.save`).
"""

import sys

import jax
from chains_workloads import everything
from multiprocess_launch import initialize
from problems_workloads import (
    posterior,
    problems_run,
    SCHOOL_LABELS,
    stopping_problems_run,
)

import eqx_batch as eb


# Each run, and the labels its `to_arviz()` is given.
RUNS = {"fixed": (problems_run, SCHOOL_LABELS), "until": (stopping_problems_run, {})}


def main(argv: list[str]) -> None:
    process_id, _ = initialize()
    out, name = argv
    make, labels = RUNS[name]
    result = make()
    # Every problem, thrice, before any is read, as a user's loop over them slices:
    # many collectives in flight.
    one = [[result.problem(p) for p in range(6)] for _ in range(3)][-1][1]
    # A problem's rows are whole in every process: converted with no gathering.
    eb.save(f"{out}.arviz.{process_id}", posterior(one.to_arviz(**labels)))
    eb.save(f"{out}.{process_id}", everything(result.gathered()))
    eb.save(f"{out}.one.{process_id}", everything(one.gathered()))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
