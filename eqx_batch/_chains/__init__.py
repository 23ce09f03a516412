"""Many Markov chains in parallel: `run_chains` and its result, `Chains`.

- `_run.py`: the driver (arguments, chunks of chains, results);
- `_arguments.py`: the chains `init` and `key` hold, read and checked;
- `_chunk.py`: one chunk through every step: placed, resumed, run segment by segment,
    checkpointed;
- `_step.py`: the user's step, traced on one chain and checked;
- `_all_chains.py`: `all_chains`, which marks a step that takes every chain at once;
- `_segment.py`: the compiled segment, which knows nothing about files;
- `_placement.py`: chains padded and split over the devices;
- `_result.py`: `Chains` and `NonFinite`; `_arviz.py`: the trace as ArviZ data;
- `_superchains.py`: chains grouped in superchains that share a start;
- `_moments.py`: running moments of each chain's draws, updated in the loop;
- `_convergence.py`: `Diagnostics` (R-hat, nested R-hat, ESS) from those moments;
- `_stopping.py`: `converged`, the rule of `until=`, its checks and `Stopped`;
- `_turns.py`: the chunks through their steps, in turns window by window with `until`;
- `_identity.py`: what makes two calls one run;
- `_checkpoint.py`: the checkpoint files, read back and written in the background;
- `_lock.py`: the lock and the writability check, before any work.
"""

from ._all_chains import all_chains as all_chains, AllChains as AllChains
from ._convergence import Diagnostics as Diagnostics
from ._result import Chains as Chains, NonFinite as NonFinite
from ._run import run_chains as run_chains
from ._stopping import (
    converged as converged,
    Stopped as Stopped,
    StoppingRule as StoppingRule,
)
