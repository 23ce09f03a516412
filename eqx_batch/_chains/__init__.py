"""Many Markov chains in parallel: `run_chains` and its result, `Chains`.

From the top down:

- `_run.py`: `run_chains`, the algorithm: checked arguments, the plan, the checkpoint,
    the chunks, the result;
- `_loop.py`: the chunks through their steps, one after another or, with `until`,
    boundary by boundary;
- `_chunk.py`: one chunk: placed, resumed, advanced a segment at a time, checkpointed;
- `_plan.py`: `RunPlan`, what the chunks of one call share;
- `_agreement.py`: the processes of a job agreeing on the call before any step;
- `_prepared.py`: the memo of a run prepared once per step and kind of state;
- `_arguments.py`: the counts, the chains `init` holds and one key for each, checked;
- `_checkpoint.py`, `_checkpoint_files.py`, `_checkpoint_rows.py`, `_lock.py`,
    `_job.py`, `_identity.py`: the checkpoint (its reading and writing, its file names,
    each process's rows), the lock, what the processes of a job agree on, and what
    makes two calls one run;
- `_segment.py`: the compiled segment, which knows nothing about files;
- `_step.py`: the user's step, traced on one chain and checked;
- `_placement.py`: chains padded and split over the devices;
- `_stopping.py`, `_convergence.py`, `_moments.py`: `until`'s rule and checks, the
    diagnostics, and the running moments they read;
- `_result.py`, `_arviz.py`: `Chains` and `NonFinite`, and the trace as ArviZ data;
- `_disk_trace.py`: `DiskArray`, a `trace="disk"` trace read lazily from its files;
- `_all_chains.py`, `_superchains.py`: steps that see every chain, and superchains;
- `_common.py`: the shared vocabulary: `ChainState`, `OneChain`, `Draws` (which steps
    are draws) and `structs` (shape-dtype structs).
"""

from ._all_chains import all_chains as all_chains, AllChains as AllChains
from ._convergence import Diagnostics as Diagnostics
from ._disk_trace import DiskArray as DiskArray
from ._result import Chains as Chains, NonFinite as NonFinite
from ._run import run_chains as run_chains
from ._stopping import (
    converged as converged,
    Stopped as Stopped,
    StoppingRule as StoppingRule,
)
