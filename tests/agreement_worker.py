"""One process of a job of `eb.run_chains` whose process 1 passes another argument.

    python agreement_worker.py OUT ARGUMENT [CHECKPOINT]

Every process runs `agreement_run` (8 chains of a random walk, with `data=` of 2
problems, its step a `functools.partial` given a drift); process 1 changes `ARGUMENT`
(`_changes`: `num_steps`, `init`, `key`, `data`, `step`, `checkpoint`, ...; `refused`:
an `init` that its checks refuse), or never calls it (`raised`: it raises before;
`killed`: it is killed before). A `BatchError` is saved to
`OUT.<process id>.error` and the process exits cleanly; a run that returns writes
`OUT.<process id>.done`. Run only as a job (`multiprocess_launch`).
"""

import functools as ft
import os
import pathlib
import signal
import sys
from typing import Any

import jax
import jax.random as jr
import numpy as np

import eqx_batch as eb


def walk(state: jax.Array, key: jax.Array, data: dict, given: dict) -> jax.Array:
    return state + given["drift"] + data["scale"] * jr.normal(key, state.shape)


def agreement_run(checkpoint: str | None = None, **changed: Any) -> eb.Chains:
    """The job's run, with `changed` arguments in place of its own."""
    arguments = {
        # A number given through `functools.partial`: part of what the loop runs.
        "step": ft.partial(walk, given={"drift": 0.0}),
        # NumPy, as a job places it: the same host data in every process.
        "init": np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(8, 2),
        "key": jr.key(0),
        "num_steps": 40,
        "data": {"scale": np.array([0.5, 1.0], np.float32)},
        "checkpoint": checkpoint,
        "checkpoint_every": None if checkpoint is None else 10,
        **changed,
    }
    return eb.run_chains(**arguments)


def _changes(checkpoint: str | None) -> dict[str, dict[str, Any]]:
    """What process 1 changes, by `ARGUMENT`; the job's `checkpoint`, if any."""
    init = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(8, 2)
    init[5, 1] = 7.0  # one value of one chain
    return {
        "num_steps": {"num_steps": 20},
        "init": {"init": init},
        "key": {"key": jr.key(1)},
        "data": {"data": {"scale": np.array([0.5, 2.0], np.float32)}},
        "step": {"step": ft.partial(walk, given={"drift": 1.0})},
        # Another file in the same folder.
        "checkpoint": {
            "checkpoint": str(pathlib.Path(str(checkpoint)).with_name("other.ckpt"))
        },
        "data_dtype": {"data": {"scale": np.array([0.5, 1.0], np.float16)}},
        "chunk_size": {"chunk_size": 4},
        "trace": {"trace": False},
        "progress": {"progress": True},
        # 9 chains, which the 2 problems of `data` do not divide: refused here only.
        "refused": {"init": np.zeros((9, 2), np.float32)},
    }


def _leave(argument: str) -> None:
    """Process 1 never calls `run_chains`: it raises, or is killed, before (its
    backend started, as a script's that built its arguments)."""
    jax.devices()
    if argument == "raised":
        raise RuntimeError("process 1 failed before calling run_chains")
    if argument == "killed":
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    from multiprocess_launch import initialize

    process_id, _ = initialize()
    out, argument, *rest = argv
    checkpoint = rest[0] if rest else None
    if process_id == 1 and argument in ("raised", "killed"):
        _leave(argument)
    changed = _changes(checkpoint)[argument] if process_id == 1 else {}
    try:
        agreement_run(**{"checkpoint": checkpoint, **changed})
    except eb.BatchError as e:
        pathlib.Path(f"{out}.{process_id}.error").write_text(str(e))
    else:
        pathlib.Path(f"{out}.{process_id}.done").write_text("")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
