"""The processes of a job agree on their call of `run_chains` before any step.

Every process of a job must make the same call. One with another `num_steps` runs
other collectives than its peers (gloo aborts them, or they wait for each other
forever); one with other values of `init`, `key` or `data` places them where its peers
place theirs (JAX refuses, naming no argument); one whose step carries other values
runs its own loop (the job returns chains of both); one with another `checkpoint`
writes elsewhere; one that refuses its arguments leaves its peers waiting. So once
each process has checked its arguments, and before anything is placed on the devices
or written, every process shares the outcome: its error, or its call's identity, each
field as a short digest with its value where that is short. It is one collective,
whose shape no argument changes. Where a process failed or a field differs, every
process raises, naming the process or the field and what each process has. A single
process shares nothing and computes nothing.
"""

import hashlib
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._errors import BatchError
from ._checkpoints._run_checkpoint import RunCheckpoint
from ._common import ChainState
from ._jobs._identity import identity_fields, step_values
from ._jobs._job import failed_elsewhere, gathered_rows
from ._plan import RunPlan


# The fields told with their values, by what a message calls them, in the order told.
_VALUED = {
    "num_steps": "`num_steps`",
    "thin": "`thin`",
    "burn_in": "`burn_in`",
    "with_output": "`with_output`",
    "trace": "`trace`",
    "diagnostics": "`diagnostics`",
    "until": "`until`",
    "superchains": "`superchains`",
    "all_chains": "whether `step` is an `eb.all_chains` step",
    "chunk_size": "`chunk_size`",
    "checkpoint": "`checkpoint` (its absolute path)",
    "checkpoint_every": "`checkpoint_every`",
    "progress": (
        "`progress` (the bar cuts the loop into segments, which every process must "
        "run alike; each process shows its own)"
    ),
    "init structure": "`init`'s structure",
    "init leaves": "`init`'s leaves",
    "data structure": "`data`'s structure",
    "data problems": "`data`'s number of problems",
    "jax": "the version of JAX",
    "jaxlib": "the version of jaxlib",
    "prng": "JAX's PRNG configuration",
}
# The fields that are digests: what differs when they do, and why it matters. One
# missing in some process (`step`'s program, traced only with a checkpoint; `data`'s)
# is told by another field.
_DIGESTS = {
    "init values": ("`init` holds other values", ""),
    "keys": ("`key` gives the chains other keys", ""),
    "data values": ("`data` holds other values", ""),
    "step values": (
        "`step` carries other values",
        " (arrays or numbers given through `functools.partial` or held as a Module's "
        "fields, or another function)",
    ),
    "step program": ("`step` computes something else", " (its traced program differs)"),
    "step constants": (
        "`step` closes over other values",
        " (arrays it closes over or is given through `functools.partial`)",
    ),
    "step callbacks": ("a host callback of `step` has other code or data", ""),
}
_ORDER = (*_VALUED, *_DIGESTS)
# Each field travels as a digest of its value, then the value's length plus one (0: not
# shown; two bytes, little-endian) and the value itself, where it fits: long enough for
# a checkpoint's path, and about 30 KB in all for each process.
_DIGEST_BYTES, _LENGTH_BYTES, _VALUE_BYTES = 8, 2, 1024
_SLOT_BYTES = _DIGEST_BYTES + _LENGTH_BYTES + _VALUE_BYTES


# A process whose checks of its arguments failed sends its message instead, cut to
# this many bytes (it raises the whole one itself).
_FAILURE_BYTES = 1024
_FIX = (
    "Nothing was run: every process must pass the same arguments "
    "(see docs/multi.md#several-processes)."
)


class CallAgreement:
    """The processes of a job agreeing on one call of `run_chains`: a context manager
    around the checks of its arguments, told the call once they pass (`on`).

    Leaving it, every process shares whether its checks passed and, if they did, its
    call: one collective of fixed shape, before any other, whatever the arguments. A
    process whose checks failed raises its own error; the others a `BatchError` naming
    it and its message. A process can therefore never wait for a peer that has raised.
    In a single process, nothing is shared or computed.
    """

    def __init__(self) -> None:
        self._fields: dict[str, str] | None = None

    def __enter__(self) -> "CallAgreement":
        return self

    def on(
        self,
        plan: RunPlan,
        start: ChainState,
        *,
        progress: bool,
        checkpoint: RunCheckpoint,
    ) -> None:
        """This process's call, its arguments checked: `plan`, from the chains
        `start`, with a progress bar or not, checkpointed at `checkpoint`."""
        if jax.process_count() > 1:
            self._fields = _call_fields(plan, start, checkpoint, progress)

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        """**Raises:** in every process but one that failed (which raises its own
        error), `BatchError` naming the processes whose checks failed, if any did; or
        naming each field that differs and what each process has, if any does."""
        # An interrupt ends this process at once (its peers then fail on their own).
        if jax.process_count() == 1 or not isinstance(error, Exception | None):
            return
        failure = None if error is None else _failure_message(error)
        assert failure is not None or self._fields is not None
        # A process that failed sends no fields: "None" and zeros, never read.
        shared = [_packed_failure(failure), _packed_fields(self._fields or {})]
        try:
            gathered = gathered_rows(np.concatenate(shared))
        except jax.errors.JaxRuntimeError as unanswered:
            if error is not None:
                return  # its own error says more than its peers' silence
            raise _not_answered(unanswered) from unanswered
        if error is not None:
            return  # raised as it is
        failures = {
            process: message
            for process, row in enumerate(gathered)
            if (message := _unpacked_failure(row)) is not None
        }
        if failures:
            raise failed_elsewhere(
                failures, "Checking `run_chains`' arguments", fix=_FIX
            )
        _raise_if_any_differs(gathered[:, 1 + _FAILURE_BYTES :])


def _not_answered(error: Exception) -> BatchError:
    """The error of a process whose peers did not all answer the agreement's
    collective (JAX's `error`): the ones that could be missing, and what to check."""
    others = [p for p in range(jax.process_count()) if p != jax.process_index()]
    missing = _processes(others) if len(others) == 1 else f"one of {_processes(others)}"
    return BatchError(
        f"Process {jax.process_index()} of this job of {jax.process_count()} waited "
        f"at `run_chains`' first collective, where the processes agree on the call, "
        f"and {missing} did not answer (JAX: {str(error).splitlines()[0]}).\n"
        f"Check the log of {_processes(others)}: a process that raised or exited "
        "before calling `run_chains`, or was killed, never answers; nor does one that "
        "calls it too late (on CPU, gloo waits about 30 s for a peer's first "
        "collective). Nothing was run: every process of a job must call `run_chains`, "
        "with the same arguments."
    )


def _failure_message(error: Exception) -> str:
    if isinstance(error, BatchError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _raise_if_any_differs(fields: np.ndarray) -> None:
    """Raises `BatchError` if the processes' fields (`_packed_fields`, one row per
    process) differ, naming each that does."""
    slots = fields.reshape(len(fields), len(_ORDER), _SLOT_BYTES)
    lines = [
        line
        for index, field in enumerate(_ORDER)
        if (line := _difference(field, slots[:, index])) is not None
    ]
    if lines:
        details = "\n".join(f"- {line}" for line in lines)
        raise BatchError(
            f"the {len(fields)} processes called `run_chains` with other arguments:"
            f"\n{details}\n{_FIX}"
        )


def _call_fields(
    plan: RunPlan,
    start: ChainState,
    checkpoint: RunCheckpoint,
    progress: bool,
) -> dict[str, str]:
    """The run's identity, with what else decides the collectives each process runs
    and what the compiled loop is given."""
    own, shared = plan.step.own_and_shared(eqx.combine(start.states, plan.static))
    fields = identity_fields(
        own, start.keys, plan.options, plan.data, plan.program, shared
    )
    return {
        **fields,
        # Compared in every job: the step is traced (for its program and constants)
        # only with a checkpoint, and without one each process would run its own.
        "step values": step_values(plan.step.step),
        "trace": repr(plan.trace.value),  # as given: "disk" writes, True does not
        "chunk_size": str(plan.chunk_size),
        # Where each process would write and lock, as an absolute path.
        "checkpoint": checkpoint.named(),
        "checkpoint_every": str(plan.checkpoint_every),
        "progress": str(progress),
    }


def _packed_failure(failure: str | None) -> np.ndarray:
    """Whether this process's checks failed, and why (cut to `_FAILURE_BYTES`)."""
    head = np.zeros(1 + _FAILURE_BYTES, np.uint8)
    if failure is not None:
        raw = failure.encode()[:_FAILURE_BYTES]
        head[0] = 1
        head[1 : 1 + len(raw)] = np.frombuffer(raw, np.uint8)
    return head


def _packed_fields(fields: Mapping[str, str]) -> np.ndarray:
    """`fields` as `_ORDER`'s slots: a value field missing as "None", a digest field
    missing as zeros."""
    slots = np.zeros((len(_ORDER), _SLOT_BYTES), np.uint8)
    for index, field in enumerate(_ORDER):
        value = fields.get(field, "None" if field in _VALUED else None)
        if value is None:
            continue
        raw = value.encode()
        digest = hashlib.sha256(raw).digest()[:_DIGEST_BYTES]
        slots[index, :_DIGEST_BYTES] = np.frombuffer(digest, np.uint8)
        if field in _VALUED and len(raw) <= _VALUE_BYTES:
            length = (len(raw) + 1).to_bytes(_LENGTH_BYTES, "little")
            start = _DIGEST_BYTES + _LENGTH_BYTES
            slots[index, _DIGEST_BYTES:start] = np.frombuffer(length, np.uint8)
            slots[index, start : start + len(raw)] = np.frombuffer(raw, np.uint8)
    return slots.reshape(-1)


def _unpacked_failure(row: np.ndarray) -> str | None:
    """The failure a process shared in `row` (`_packed_failure`'s), if it failed."""
    if not row[0]:
        return None
    return bytes(row[1 : 1 + _FAILURE_BYTES]).rstrip(b"\0").decode(errors="replace")


def _difference(field: str, slots: np.ndarray) -> str | None:
    """The line of the message for `field`, whose slot of each process is `slots`;
    None if every process has the same."""
    digests = [bytes(slot[:_DIGEST_BYTES]) for slot in slots]
    if len(set(digests)) == 1:
        return None
    groups: dict[bytes, list[int]] = {}
    for process, digest in enumerate(digests):
        groups.setdefault(digest, []).append(process)
    if field in _DIGESTS:
        if not all(any(digest) for digest in digests):
            return None
        others = [p for p in range(len(digests)) if p not in groups[digests[0]]]
        what, why = _DIGESTS[field]
        return (
            f"{what} in {_processes(others)} than in "
            f"{_processes(groups[digests[0]])}{why}"
        )
    values = [_shown(slots[group[0]]) for group in groups.values()]
    if any(value is None for value in values):
        held = ", ".join(
            f"{'another' if i else 'one'} in {_processes(group)}"
            for i, group in enumerate(groups.values())
        )
        return (
            f"{_VALUED[field]} differs between the processes of the job (its values "
            f"are too long to show here): {held}"
        )
    held = ", ".join(
        f"{_processes(group)} {'has' if len(group) == 1 else 'have'} {value}"
        for group, value in zip(groups.values(), values, strict=True)
    )
    return f"{_VALUED[field]} differs between the processes of the job: {held}"


def _shown(slot: np.ndarray) -> str | None:
    start = _DIGEST_BYTES + _LENGTH_BYTES
    length = int.from_bytes(bytes(slot[_DIGEST_BYTES:start]), "little")
    if length == 0:
        return None
    return bytes(slot[start : start + length - 1]).decode(errors="replace")


def _processes(indices: list[int]) -> str:
    if len(indices) == 1:
        return f"process {indices[0]}"
    return f"processes {', '.join(map(str, indices[:-1]))} and {indices[-1]}"
