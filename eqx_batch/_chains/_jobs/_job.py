"""What the processes of a job tell each other about a checkpoint: whether each one
succeeded, and why not.

A check that fails in one process only (its folder, its disk) must stop every process:
the others would otherwise wait in the next collective for a peer that has raised. So
each such check ends with every process sharing its outcome, in the same order in every
process, on the main thread; every process then raises, naming the processes that
failed.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..._errors import BatchError


# A message travels as a fixed number of UTF-8 bytes: the collective needs one shape in
# every process. Longer messages are cut (the failing process raises the whole one).
_MESSAGE_BYTES = 1024


def _encoded(message: str | None) -> np.ndarray:
    buffer = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
    if message is not None:
        raw = message.encode()[:_MESSAGE_BYTES]
        buffer[0] = 1
        buffer[1 : 1 + len(raw)] = np.frombuffer(raw, np.uint8)
    return buffer


def _decoded(buffer: np.ndarray) -> str | None:
    if not buffer[0]:
        return None
    return bytes(buffer[1:]).rstrip(b"\0").decode(errors="replace")


def _identity(rows: jax.Array) -> jax.Array:
    return rows


def gathered_rows(local: np.ndarray) -> np.ndarray:
    """Every process's `local` (of one shape and dtype in every process), stacked in
    process order: a collective, which every process of a job must call, in the same
    order.

    It returns once the collective has finished on every device of this process.
    `multihost_utils.process_allgather` (and `broadcast_one_to_all`) wait for the
    first device's copy only: a process that raises right after can exit with the
    others still gathering, and its peer's, waiting for that process in gloo, then
    never ends (the interpreter waits for it at exit)."""
    # Row p of the mesh holds process p's devices: its row of the result is then
    # process p's `local`, whatever order `jax.devices()` lists them in.
    ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = np.array(ordered).reshape(jax.process_count(), -1)
    mesh = Mesh(devices, ("processes", "devices"))
    pieces = [jax.device_put(local[None], device) for device in jax.local_devices()]
    spread = jax.make_array_from_single_device_arrays(
        (jax.process_count(), *local.shape),
        NamedSharding(mesh, PartitionSpec("processes")),
        pieces,
    )
    whole = jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))
    rows = jax.block_until_ready(whole(spread))
    return np.asarray(rows.addressable_data(0))


def every_process(message: str | None) -> list[str | None]:
    """Every process's `message`, in process order. A collective in a job of several
    processes (every process must call it, in the same order); in one process, no
    communication."""
    if jax.process_count() == 1:
        return [message]
    return [_decoded(row) for row in gathered_rows(_encoded(message))]


def shared_failures(failure: str | None) -> dict[int, str]:
    """Every process's `failure` (None: it succeeded), by process index, for the
    processes that failed (a collective, as `every_process`)."""
    return {
        index: message
        for index, message in enumerate(every_process(failure))
        if message is not None
    }


def from_process_zero(message: str) -> str:
    """Process 0's `message`, in every process (a collective in a job)."""
    if jax.process_count() == 1:
        return message
    return _decoded(gathered_rows(_encoded(message))[0]) or ""


def raise_if_any_failed(failure: BatchError | None, summary: str, *, fix: str) -> None:
    """Raises in every process if `failure` (this process's error, or None) happened
    in any process: the failing process raises its own error, the others a
    `BatchError` that says `summary` (what failed), names the failing processes with
    their messages, and ends with `fix`. Does nothing if every process succeeded."""
    failures = shared_failures(None if failure is None else str(failure))
    if not failures:
        return
    if failure is not None:
        raise failure
    raise failed_elsewhere(failures, summary, fix=fix)


def failed_elsewhere(failures: dict[int, str], summary: str, *, fix: str) -> BatchError:
    """The error of a process whose peers failed (`failures`, their messages by
    process index): it says `summary` (what failed), names the failing processes with
    their messages, and ends with `fix`."""
    names = ", ".join(str(index) for index in sorted(failures))
    details = "\n".join(f"- process {i}: {m}" for i, m in sorted(failures.items()))
    return BatchError(
        f"{summary} failed in process{'es' if len(failures) > 1 else ''} {names} of "
        f"this job of {jax.process_count()}:\n{details}\n{fix}"
    )
