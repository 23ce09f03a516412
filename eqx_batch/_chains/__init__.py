"""Many Markov chains in parallel: `run_chains` and its result, `Chains`.

The driver's files sit here, above four rooms, which import only each other (downward,
in the order listed) and this folder's lower files (`_placement.py`, `_common.py`),
never the driver. Every file, from the top down:

- `_run.py`: `run_chains`, the algorithm: checked arguments, the plan, the checkpoint,
    the chunks, the result;
- `_start.py`, `_assembly.py`: what a run starts from (its chains, the progress bar
    and the right to write the checkpoint, each chunk's job), and its result assembled
    from the chunks;
- `_loop.py`: the chunks through their steps, one after another or, with `until`,
    boundary by boundary;
- `_chunk.py`: one chunk: placed, resumed, advanced a segment at a time, checkpointed;
- `_chunk_pieces.py`: a chunk's rows by problem, and its running chains run in pieces;
- `_compaction.py`: once some problems have stopped, a segment of the chains of those
    still running only, gathered into a smaller batch and written back;
- `_agreement.py`: the processes of a job agreeing on the call before any step;
- `_plan.py`: `RunPlan`, what the chunks of one call share;
- `_prepared.py`: the memo of a run prepared once per step and kind of state;
- `_arguments.py`: the counts, the chains `init` holds and one key
    for each, checked; and superchains, the chains started from one point;
- `_segment.py`, `_segment_plan.py`: the compiled segment, which knows nothing about
    files, and `SegmentPlan`, what it fixes when it is traced;
- `_step.py`: the user's step, traced on one chain and checked;
- `_shared.py`: a state the chains of a problem share (`shared=`), carried as a copy
    beside each chain's state;
- `_problems.py`: many problems in one run (`data=`), each chain with its problem's row;
- `_results/`: what a run returns:
    - `_result.py`, `_per_problem.py`, `_nonfinite.py`, `_arviz.py`: `Chains`,
        `Problems` (each problem's values, in a run of many), `NonFinite`, and the
        trace as ArviZ data;
- `_checkpoints/`: a run's checkpoint:
    - `_run_checkpoint.py`: the run's checkpoint, decided once: none, or the files
        at a path, handed down from the driver;
    - `_recording.py`: where a chunk's draws go: nowhere, the trace buffer, or the
        draw files;
    - `_checkpoint.py`: one chunk's checkpoint, read back once, then written;
    - `_checkpoint_reader.py`, `_checkpoint_writer.py`: the checkpoint read back (the
        run as checkpointed, and the draw files of a `trace="disk"` trace), and
        written in the background (the writer thread, the write in flight, the files
        it makes), apart;
    - `_checkpoint_rows.py`: the rows (chains) each process writes, and reads back
        onto any layout of processes and devices;
    - `_checkpoint_metadata.py`: what every file of a checkpoint says of its run,
        checked when read;
    - `_lock.py`: the lock;
    - `_disk_trace.py`: `DiskArray`, a `trace="disk"` trace read lazily from its files;
    - `_draw_buffers.py`: the device buffers of a `trace="disk"` chunk's new draws;
    - `_checkpoint_files.py`: the names of a checkpoint's files, and which of them make
        its newest complete step;
- `_until/`: `until`, below the checkpoints that keep its records:
    - `_how_it_stops.py`: how a run stops, decided once: at its cap, or by the rule;
    - `_decision.py`: a check decided on the devices;
    - `_schedule.py`: the rule planned for one run, its criteria and interval;
    - `_stopping.py`, `_convergence.py`, `_moments.py`: `until`'s rule (checked) and
        checks, the diagnostics, and the running moments they read;
    - `_problem_records.py`, `_records.py`: the records of `until`'s checks, one per
        problem with `data`; a check's outcome, one run's checks and `Stopped`: plain
        data that the checkpoint keeps, below the statistics that make it;
- `_jobs/`: the processes of a job, below the checkpoints and the driver:
    - `_job.py`, `_identity.py`: what the processes of a job tell each other, and what
        makes two calls one run;
- `_all_chains.py`: steps that see every chain;
- `_placement.py`: chains padded and split over the devices;
- `_common.py`: the shared vocabulary: `ChainState`, `OneChain`, `Draws` (which steps
    are draws), `ProblemLayout` (which problem each chain is in) and a run's problems,
    `OneProblem` or `ManyProblems`; shape-dtype
    `structs` are `eqx_batch/_tree.py`'s.
"""

from ._all_chains import all_chains as all_chains, AllChains as AllChains
from ._checkpoints._disk_trace import DiskArray as DiskArray
from ._results._nonfinite import NonFinite as NonFinite
from ._results._per_problem import Problems as Problems
from ._results._result import Chains as Chains
from ._run import run_chains as run_chains
from ._until._convergence import Diagnostics as Diagnostics
from ._until._records import Stopped as Stopped
from ._until._stopping import converged as converged, StoppingRule as StoppingRule
