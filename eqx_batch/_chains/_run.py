"""`run_chains`: many Markov chains at once, from a step written for one.

The algorithm: check the arguments and trace the step on one chain (`_step.py`); turn
typed PRNG keys in the states into raw data, once; run each chunk of chains (all of
them, unless `chunk_size`) through every step (`_chunk.py`); finally join the chunks
and make the states' raw key data typed keys again, once. The chains' own keys stay
typed throughout (the compiled segments unwrap them).
"""

import contextlib
import dataclasses
import os
import pathlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.extend
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, check_int, describe
from .._progress import ProgressBar
from .._select import take
from .._tree import (
    as_key_data,
    as_keys_like,
)
from ._all_chains import AllChains, check_all_chains_run
from ._arguments import chain_keys, split_init
from ._checkpoint import (
    chunk_path,
    longest_file_name,
    warn_of_other_chunkings,
)
from ._chunk import RunPlan
from ._convergence import diagnose, Diagnostics
from ._lock import check_folder, refuse_if_in_use, WriteAccess
from ._moments import check_diagnostics, zeros
from ._result import assembled, Chains, NonFinite
from ._segment import (
    ChainState,
    draws_before,
    OneChain,
    seen_before,
    SegmentPlan,
)
from ._step import checked_layout, pytree_step, step_layout, trace_step
from ._stopping import StoppingRule
from ._superchains import expand_superchains
from ._turns import ChunkJob, joined, run_chunks, RunContext


def run_chains(
    step: Callable,
    init: Any,
    key: Any,
    num_steps: int,
    *,
    thin: int = 1,
    burn_in: int = 0,
    with_output: bool = False,
    trace: bool = True,
    progress: bool = False,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    chunk_size: int | None = None,
    superchains: int | None = None,
    diagnostics: bool = False,
    until: StoppingRule | None = None,
) -> Chains:
    """Runs many independent Markov chains in parallel, from a step written for one.

    `step` advances one chain's state, a pytree such as a model's weights; `init`
    stacks many such states along axis 0. All chains run in one compiled loop, spread
    over every device of every process, and chain `i` gets the same result (bit for
    bit, when its step is elementwise) as running it alone with its own key: each
    step's key is split from the chain's own carried key, so the number of chains,
    devices, processes, thinning or checkpoint interval never changes a chain's
    random stream (with JAX's default keys: under `vmap`, JAX does not draw the bits
    of `rbg` keys from each key alone).

    A chain whose state goes NaN or infinite keeps running without disturbing the
    others and is reported in `nonfinite`.

    A step that needs every chain at once (an ensemble sampler such as the emcee
    stretch move, or an adaptation that pools the chains) is marked with
    [`eb.all_chains`][] and gets the whole stack, one key per chain (split as a
    per-chain step's would be) and the step count.

    The trace is one buffer of its final size, written in place as the loop runs. When
    the number of chains does not divide evenly over the devices, the chains are
    padded with copies of chain 0 whose results are dropped (at the cost of one copy of
    the results when they are sliced off); the chains of an `eb.all_chains` step,
    which would see the padding, are instead placed on the most devices that they
    divide over evenly.

    **Arguments:**

    - `step`: `step(state, key) -> new_state` for ONE chain, or
        `step(state, key) -> (new_state, output)` with `with_output=True`. The new
        state must have the structure, shapes and dtypes of `state`. Pass data with
        `functools.partial` (its arrays become arguments of the compiled loop, so a
        new partial does not recompile) or by closure (compiled in as constants). Or
        `eb.all_chains(step)`, for `step(states, keys, count) -> new_states` on every
        chain at once (see [`eb.all_chains`][]).
    - `init`: the chains' initial states, stacked along axis 0 of every array leaf (a
        dict of arrays, an Equinox module, ...). Non-array leaves are shared. NumPy
        leaves take the dtype JAX gives them (`jnp.asarray`): a float64 NumPy `init`
        runs as float32 unless 64-bit mode is on, as `jax.vmap` reads it.
    - `key`: one PRNG key, split with `jax.random.split(key, chains)`, or an array of
        one key per chain. Typed (`jr.key`) and legacy (`jr.PRNGKey`) keys both work;
        `step` receives keys of the same kind.
    - `num_steps`: how many steps each chain takes; with `until`, the most (the cap).
    - `thin`, `burn_in`: the trace keeps the state after steps `burn_in + 1`,
        `burn_in + 1 + thin`, ... : the uninterrupted trace `[:, burn_in::thin]`.
    - `with_output`: record `step`'s second output (its acceptance, divergence,
        energy...) in `outputs`, beside the states in `trace` (which are the same
        with or without it).
    - `trace`: whether to record a trace at all (memory: chains x draws x state, plus
        the output with `with_output=True`).
    - `progress`: show one tqdm bar for all chains, updated from inside the compiled
        loop (each update is one host callback): at most about 100 times per run,
        and, once the loop's speed is known, about every 0.1 s (as often as tqdm
        redraws), so a short run makes only a few callbacks.
    - `checkpoint`: a file path. The run state is written there atomically, new
        draws to files named after it and the run in the same folder (all safetensors
        files), and a call of the same run resumes from it, bit for bit; if the run
        finished, its result is read back without recomputing or writing anything
        (read-only storage included). A run is identified by the structure, shapes,
        dtypes and values of `init`, the keys, `num_steps`, `thin`, `burn_in`,
        `with_output`, `trace`, whether `step` takes every chain, what `step` computes
        (a digest of its traced program, of its constants' values and of the code
        and data of its host callbacks, not its name), and the versions of JAX and
        jaxlib and their PRNG configuration; every file records it, and a
        checkpoint of another run is refused, saying what differs. Before the first
        step, the folder is checked by creating a file in it with the longest name
        the run will write, and the process that writes takes a lock (`path.lock`,
        never followed if it is a link, released by the operating system when the
        process ends, killed or not), so a second live run on the same path is
        refused. In a job of several processes, process 0 writes it and every
        process reads it (a folder they all see).
    - `checkpoint_every`: write the checkpoint after every this many steps (while the
        next steps run). `None` writes it once, at the end.
    - `chunk_size`: run this many chains at a time, for more chains than fit in memory
        at once: chains `0` to `chunk_size`, through every step, then the next
        `chunk_size`, and so on, each chunk spread over every device as a whole run
        is. Every chunk runs the same compiled program (the last one is padded with
        copies of its first chain, whose results are dropped) and every chain's
        results are bit for bit those of the unchunked run. Memory holds one chunk's
        states, working memory and trace at a time, plus the results of the chunks
        already run (the result holds every chain). With `checkpoint`, each chunk is
        checkpointed to its own files, `checkpoint.chains-A-B` for chains `A` to `B`
        (and its draw files), under the one lock of `checkpoint`; a finished chunk is
        read back when the run resumes. Checkpoints of the same path written with
        another `chunk_size` (or none) are not read, and a warning names it. The
        progress bar counts the steps of every chunk. `None` (the default), or at
        least the number of chains, runs them all at once. Refused with an
        `eb.all_chains` step, which must see every chain.
    - `superchains`: `K`, to run the chains in K superchains of M chains each, the
        chains of a superchain started from the same point (for nested R-hat,
        Margossian et al. 2024). `init` then holds K members, one start per
        superchain, and `key` K * M keys, one per chain (a single key is refused:
        the number of keys is what says M). Chain `c` belongs to superchain `c // M`
        and starts from `init[c // M]`. `Chains.superchain` holds each chain's
        superchain, and `Chains.to_arviz` gives it to ArviZ.
    - `diagnostics`: compute R-hat, split R-hat, nested R-hat (with `superchains`)
        and an effective sample size estimate while sampling, in memory that does not
        grow with the steps: each chain carries running moments (count, mean and
        second central moment; the two halves of its draws kept apart, for split
        R-hat) of the draws the trace records (after `burn_in`, every `thin`-th), of
        every floating-point leaf of the state (with `with_output=True` too). They
        are checkpointed with the chains, so a resumed, chunked or multi-device run
        reports the same statistics, and computed on the devices at the end, into
        `Chains.diagnostics` (an [`eb.Diagnostics`][]). It works with `trace=False`.
        Off (the default), the loop carries nothing more. With `progress`, the bar
        shows the worst R-hat (nested R-hat with `superchains`) and the smallest ESS,
        each with its leaf path, at every segment boundary (unchunked) or at the end.
    - `until`: a stopping rule, [`eb.converged`][]`(...)`: stop before `num_steps`
        once the chains have converged. It implies `diagnostics=True`. The rule is
        checked on the host between segments (never inside the compiled loop) at
        steps `every`, `2 * every`, ... and at `num_steps`, whatever
        `checkpoint_every` (segments end at both), `chunk_size` or the devices; each
        check reads the diagnostics of the draws recorded since the previous check,
        and a check that fails discards them (the moments start afresh), so the
        statistics that pass describe the last window only. With `chunk_size`, the
        chunks take turns window by window (every chunk's state and trace are then
        held at once) so that each check sees every chain and every chunk stops at
        the same step: the result is bit for bit the unchunked run's. The checks so
        far are checkpointed with the chains: a run killed and resumed stops at the
        same step, and one that stopped is read back. The rule's criteria are part of
        the run's identity. With `progress`, the bar shows each check's statistics.

    **Returns:**

    A [`eb.Chains`][] with `final`, `trace` (the states, `[chains, draws, ...]` per
    leaf), `outputs` (the step's, likewise, with `with_output=True`), `keys` (to
    continue the run exactly) and `nonfinite`, and `superchain` and `diagnostics`
    with those arguments; `steps_done`, the steps run (`num_steps` without `until`),
    and with `until`, `stopped` ([`eb.Stopped`][]: when and why), with `trace` and
    `outputs` holding only the draws made and `final` and `keys` the chains after
    `steps_done` steps (`diagnostics.split_rhat` is then `None`: its halves are those
    of the planned draws). Its arrays stay split over the devices; in a job of
    several processes, every process gets whole results.

    **Raises:**

    - `eb.BatchError` if `step` changes the state's structure, a leaf's shape or
        dtype (naming the leaf), or does not return a pair with `with_output=True`;
        if `key` does not hold one key or one key per chain; if the array leaves of
        `init` disagree on the number of chains; if `num_steps`, `thin`, `burn_in`,
        `checkpoint_every`, `chunk_size` or `superchains` are out of range (a bool
        is no count). With `superchains=K`: if `init` does not hold K members, if
        `key` is a single key, or if K does not divide the number of keys. With
        `diagnostics=True`: if the run records no draw (`burn_in == num_steps`) or
        the state has no floating-point leaf. With an `eb.all_chains` step: if
        `chunk_size` is given, if an array of its output has not one row per chain,
        or if the processes of a job do not divide the chains. With `until`: if it
        is not a rule of `eb.converged`, if `num_steps` is None (it is the cap), or
        if the rule checks nested R-hat explicitly and there are no superchains.
        For `checkpoint`: before any step, if its folder is missing or cannot be
        written (names too long included), another live run holds it, or its lock
        path holds a link or a file that is not a lock; if it holds a checkpoint of
        a different run (saying what differs), a file that is not a checkpoint, or a
        corrupt one; if `step` calls a host callback whose code or data cannot be
        identified; and, during the run, if writing it fails (a full disk: the last
        good checkpoint is kept, to resume from).

    !!! Example

        ```python
        def step(state, key):  # random-walk Metropolis on a standard normal
            proposal = state + 0.5 * jr.normal(key, state.shape)
            log_ratio = 0.5 * (jnp.sum(state**2) - jnp.sum(proposal**2))
            accept = jnp.log(jr.uniform(jr.fold_in(key, 1))) < log_ratio
            return jnp.where(accept, proposal, state)

        init = jnp.zeros((8, 3))  # 8 chains of a 3-d state
        result = eb.run_chains(step, init, jr.key(0), 200, burn_in=100, thin=2)
        result.trace.shape  # (8, 50, 3)

        # 4 superchains of 16 chains, diagnosed while sampling, no trace kept.
        starts = jnp.array([[-4.0] * 3, [-1.0] * 3, [1.0] * 3, [4.0] * 3])
        keys = jr.split(jr.key(1), 4 * 16)
        result = eb.run_chains(
            step, starts, keys, 500, superchains=4, diagnostics=True, trace=False
        )
        result.superchain  # [0 0 ... 3 3], 16 of each
        result.diagnostics.nested_rhat  # f32[3], near 1 once mixed

        # The same chains, stopped once nested R-hat says they have mixed.
        result = eb.run_chains(
            step, starts, keys, 5000, superchains=4, until=eb.converged(every=100)
        )
        result.steps_done, result.stopped.reason  # e.g. 200, 'nested R-hat 1.01...'
        ```
    """
    if until is not None:
        if not isinstance(until, StoppingRule):
            raise BatchError(
                f"`until` is {describe(until)}; pass a rule that `eb.converged` makes."
            )
        if num_steps is None:
            raise BatchError(
                "`until` is given but `num_steps` is None: `num_steps` is the cap, the "
                "most steps the chains run if the rule never holds. Pass one."
            )
        # The rule reads the diagnostics.
        diagnostics = True
    num_steps = check_int(num_steps, "num_steps")
    thin = check_int(thin, "thin", minimum=1)
    burn_in = check_int(burn_in, "burn_in", maximum=num_steps)
    if checkpoint_every is not None:
        if checkpoint is None:
            raise BatchError(
                "`checkpoint_every` is set but `checkpoint` is None: pass a file path "
                "as `checkpoint` to write checkpoints to."
            )
        checkpoint_every = check_int(checkpoint_every, "checkpoint_every", minimum=1)
    if chunk_size is not None:
        chunk_size = check_int(
            chunk_size,
            "chunk_size",
            minimum=1,
            hint="It is how many chains to run at a time; None runs every chain at "
            "once.",
        )
    init, init_arrays, shared, num_chains = split_init(init)
    superchain_ids = None
    if superchains is not None:
        init_arrays, superchain_ids = expand_superchains(
            init_arrays, num_chains, key, superchains
        )
        init, num_chains = eqx.combine(init_arrays, shared), len(superchain_ids)
    keys, legacy = chain_keys(key, num_chains)
    step = pytree_step(step)
    if isinstance(step, AllChains):
        check_all_chains_run(num_chains, chunk_size)
    # The program is traced afresh for a checkpoint's identity (its constants' values
    # are part of it); a run without one needs only the checks, which are cached.
    traced = None
    if checkpoint is not None:
        traced = trace_step(step, init, keys, legacy, with_output)
        layout = step_layout(init, keys, traced.output)
    else:
        layout = checked_layout(step, init, keys, legacy, with_output)
    num_draws = draws_before(num_steps, burn_in, thin)
    one_chain = OneChain(layout.state, layout.key)
    if traced is not None:
        # Equal structs seen before, so that the compiled loop finds its program by
        # their identity (a cached layout's are the same objects every call).
        one_chain = seen_before(one_chain)
    if diagnostics:
        check_diagnostics(one_chain.state, num_draws)
    counts = {
        "num_steps": num_steps,
        "thin": thin,
        "burn_in": burn_in,
        "with_output": with_output,
        "trace": trace,
    }
    if with_output:
        # Checkpoints of `with_output` runs once held the outputs alone: a different
        # layout of draws, so a different run (refused, saying so), while the runs
        # without outputs keep their identity.
        counts["recorded"] = "states and outputs"
    if diagnostics:
        # Only when on, so that the runs of before keep their identity.
        counts["diagnostics"] = True
    if isinstance(step, AllChains):
        # Its program is another kind (traced on the whole stack), and so is its run.
        counts["step takes"] = "all chains"
    schedule = None
    if until is not None:
        schedule = until.plan(num_steps, superchains, num_chains)
        counts["until"] = str(schedule)
    run = RunPlan(
        step=step,
        shared=shared,
        one_chain=one_chain,
        plan=SegmentPlan(
            length=0,
            num_draws=num_draws,
            thin=thin,
            burn_in=burn_in,
            with_output=with_output,
            record=trace and num_draws > 0,
            legacy=legacy,
        ),
        num_steps=num_steps,
        recorded=layout.recorded if trace else None,
        # The leaves of a draw that are the same in every draw (an MLP's activation):
        # the state's are those of `init`, as the caller passed them.
        recorded_static=(shared, layout.output_static) if with_output else shared,
        program=None if traced is None else traced.program,
        counts=counts,
        checkpoint_every=checkpoint_every,
        until=schedule,
    )
    # Typed PRNG keys in the states become raw data here, once, and keys again on the
    # way out: in between, chunks, placement and checkpoints handle plain arrays.
    chains = ChainState(
        as_key_data(init_arrays),
        keys,
        np.zeros(num_chains, np.int32),
        zeros(one_chain.state, num_chains) if diagnostics else None,
    )
    size = num_chains if chunk_size is None else min(chunk_size, num_chains)
    chunks = [
        range(first, min(first + size, num_chains))
        for first in range(0, num_chains, max(size, 1))
    ] or [range(0)]
    chunked = len(chunks) > 1
    # In a job of several processes, process 0 writes checkpoints for all of them.
    writes = jax.process_index() == 0

    with contextlib.ExitStack() as stack:
        bar = None
        if progress:
            # One bar over every chunk's steps; with `until`, the chunks take turns
            # and the bar counts the run's steps.
            total = num_steps * (1 if until is not None else len(chunks))
            bar = stack.enter_context(ProgressBar(total, "run_chains"))
        access = None
        if checkpoint is not None:
            path = pathlib.Path(checkpoint)
            check_folder(path)
            if writes:
                # The other processes of a job leave the lock to process 0.
                refuse_if_in_use(path)
            warn_of_other_chunkings(path, chunks if chunked else None)
            longest = longest_file_name(
                path,
                num_chains=num_chains,
                num_draws=num_draws if run.plan.record else 0,
                chunked=chunked,
            )
            access = stack.enter_context(WriteAccess(path, longest, writes=writes))
        jobs = []
        for chunk in chunks:
            chunk_chains, chunk_checkpoint = chains, None
            if access is not None:
                chunk_checkpoint = access.path
            if chunked:
                # Gathered (one program per chunk size), not sliced (one per chunk).
                chunk_chains = take(chains, np.asarray(chunk))
                if access is not None:
                    chunk_checkpoint = chunk_path(access.path, chunk.start, chunk.stop)
            jobs.append(ChunkJob(chunk_chains, chunk_checkpoint))
        results, record = run_chunks(
            run,
            jobs,
            RunContext(
                pad_to=size if chunked else 0,
                access=access,
                writes=writes,
                bar=bar,
                superchains=None if superchains is None else int(superchains),
            ),
        )

    chains = joined([chains for chains, _ in results])
    traces = [trace for _, trace in results]
    recorded = None if traces[0] is None else joined(traces)
    stopped = None if record is None else record.report(burn_in)
    steps_done = num_steps if stopped is None else stopped.step
    if recorded is not None:
        if steps_done < num_steps:
            # Only the draws made: the buffer was sized for the cap.
            made = draws_before(steps_done, burn_in, thin)
            recorded = jtu.tree_map(lambda x: x[:, :made], recorded)
        recorded = eqx.combine(
            as_keys_like(recorded, run.recorded), run.recorded_static
        )
    outputs = None
    if recorded is not None and with_output:
        # Recorded together, one pytree per draw: the states are the trace.
        recorded, outputs = recorded
    # Typed, as the segments return them; legacy keys are their raw data.
    end_keys = jr.key_data(chains.keys) if legacy else chains.keys
    final = eqx.combine(as_keys_like(chains.states, one_chain.state), shared)
    # Read last, as it waits for the loop: the work above is done while it runs.
    nonfinite_steps = np.asarray(chains.first_bad)
    bad_chains = np.flatnonzero(nonfinite_steps)
    return assembled(
        Chains,
        final=final,
        trace=recorded,
        outputs=outputs,
        keys=end_keys,
        nonfinite=assembled(
            NonFinite,
            chains=bad_chains.astype(np.int64),
            steps=nonfinite_steps[bad_chains].astype(np.int64),
        ),
        superchain=superchain_ids,
        diagnostics=None
        if not diagnostics
        else _diagnostics(chains.moments, superchains, until is not None),
        steps_done=steps_done,
        stopped=stopped,
    )


def _diagnostics(moments: Any, superchains: int | None, stopping: bool) -> Diagnostics:
    diagnostics = diagnose(moments, superchains)
    if stopping:
        # Its halves are those of the planned draws, which an early stop never makes.
        diagnostics = dataclasses.replace(diagnostics, split_rhat=None)
    return diagnostics
