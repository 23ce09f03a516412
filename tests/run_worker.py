"""One chains workload run in a process of its own, its outputs saved.

    python run_worker.py OUT WORKLOAD NUM_CHAINS NUM_STEPS [CHECKPOINT EVERY [THIN]]

Runs `chains_workloads.run` (`WORKLOAD` is a name of its `WORKLOADS`) and saves
`final`, `trace` and `keys` to `OUT` (`eb.save`). The tests SIGKILL it once its
checkpoint appears, and run it with another device count (`XLA_FLAGS`, set by the
caller) to compare bits.
"""

import sys

from chains_workloads import outputs, run

import eqx_batch as eb


def named_run(argv: list[str]) -> eb.Chains:
    """The run `WORKLOAD NUM_CHAINS NUM_STEPS [CHECKPOINT EVERY [THIN]]` names."""
    workload, num_chains, num_steps, *checkpointed = argv
    return run(
        workload,
        int(num_chains),
        int(num_steps),
        checkpoint=checkpointed[0] if checkpointed else None,
        checkpoint_every=int(checkpointed[1]) if checkpointed else None,
        thin=int(checkpointed[2]) if len(checkpointed) > 2 else 1,
    )


def main(argv: list[str]) -> None:
    out, *run_arguments = argv
    eb.save(out, outputs(named_run(run_arguments)))


if __name__ == "__main__":
    main(sys.argv[1:])
