"""One process of a job that makes `run_worker.py`'s run, and saves it gathered.

    python job_run_worker.py OUT WORKLOAD NUM_CHAINS NUM_STEPS [CHECKPOINT EVERY [THIN]]

Run only as a job (`multiprocess_launch`). Each process holds only its own chains'
rows; each gathers them all (`Chains.gathered`) and saves `final`, `trace` and `keys`
to `OUT.<process id>`. The tests compare them with one process's run, and SIGKILL the
job once it has checkpointed, to resume it in another.
"""

import sys

import jax
from chains_workloads import outputs
from multiprocess_launch import initialize
from run_worker import named_run

import eqx_batch as eb


def main(argv: list[str]) -> None:
    process_id, _ = initialize()
    out, *run_arguments = argv
    result = named_run(run_arguments).gathered()
    eb.save(f"{out}.{process_id}", outputs(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
