"""A tqdm progress bar driven from inside a compiled loop.

The host side is `ProgressBar`, a context manager that owns a `tqdm` bar. The traced
side is its `handle`, a `ProgressHandle` that a `lax.scan` or `fori_loop` body calls
with the number of steps done and the step at which the next report is due, carried
through the loop: `due = handle(t + 1, due)`, starting from `due = handle.start(t0)`.
When a report is due, that call reaches the host through `io_callback`, moves the bar
and returns the step of the next report. Until the bar reaches `total` (or closes), no
due step is past `total`, so the last step always reports.

Each host call stops the compiled loop for a fraction of a millisecond (about 0.2 ms
for a loop that keeps two CPU cores busy), so the host decides how far apart they are:
`every` steps at least (at most about `max_updates` calls per run), and further once
the loop's speed is known, so that calls come no more often than every `min_interval`
seconds, the rate at which tqdm redraws a bar. A short run makes a handful of calls; a
long one keeps its bar moving `min_interval` apart. (tqdm itself does the same on the
host with `miniters`.) Between reports the cost is one integer comparison and a
`lax.cond` per step.

Two rules keep this cheap and correct:

- **The step counter must be unbatched.** Scan over steps outside, `vmap` over chains
  inside the body, and call the handle from the body, outside the `vmap`: one bar for
  all chains, one host call per report (`io_callback` cannot run under `vmap` of a
  `lax.cond` with a batched predicate).
- **Pass the handle as an argument of the compiled function** (e.g. in the arguments of
  `jax.jit`), not as a closed-over constant. Its bar id is an array, so it is traced
  and one compiled loop serves every bar; `every` and `total` are static fields.

The bar only ever moves forward to the largest count reported, so reports that reach
the host out of order cannot move it back.
"""

import itertools
import math
import threading
import time
from types import TracebackType
from typing import Any, TextIO

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from tqdm.auto import tqdm

from ._errors import BatchError


_BARS: dict[int, "ProgressBar"] = {}
_NEXT_ID = itertools.count()
_LOCK = threading.Lock()
# The due step that never comes: for a bar that is closed or done.
_NEVER = np.iinfo(np.int32).max


class ProgressHandle(eqx.Module):
    """The traced side of a `ProgressBar`: call it in a loop body with the steps done.

    **Fields:**

    - `bar_id`: an `int32` scalar naming the bar on the host; traced when the handle is
        an argument of a compiled function, so recompiling is not needed per bar.
    - `every`: the fewest steps between two reports (except the last one).
    - `total`: the number of steps of the whole run.
    """

    bar_id: jax.Array
    every: int = eqx.field(static=True)
    total: int = eqx.field(static=True)

    def start(self, done: Any) -> jax.Array:
        """The first step at which to report, in a loop that starts after `done` steps.

        Carry it through the loop and pass it to each call of the handle.
        """
        done = jnp.asarray(done, jnp.int32)
        return jnp.minimum(done + self.every, self.total)

    def __call__(self, done: Any, due: Any) -> jax.Array:
        """Reports from traced code that `done` steps of `total` are finished, if due.

        `done` must be an unbatched integer scalar (see the module docstring), `due`
        what `start` or the previous call returned (at most `total`, so the last step
        reports). Only when `done` reaches `due` does the host get called; otherwise
        the cost is one integer comparison and a `lax.cond`.

        **Returns:**

        The step at which the next report is due: the carry for the next call.
        """
        done = jnp.asarray(done, jnp.int32)
        due = jnp.asarray(due, jnp.int32)
        return lax.cond(done >= due, _send, _wait, self.bar_id, done, due)


def _send(bar_id: jax.Array, done: jax.Array, due: jax.Array) -> jax.Array:
    del due
    shape = jax.ShapeDtypeStruct((), jnp.int32)
    return io_callback(_receive, shape, bar_id, done, ordered=False)


def _wait(bar_id: jax.Array, done: jax.Array, due: jax.Array) -> jax.Array:
    del bar_id, done
    return due


def _receive(bar_id: Any, done: Any) -> np.ndarray:
    """On the host: moves bar `bar_id` forward to `done` (if it is still open), and
    returns the step at which the next report is due."""
    with _LOCK:
        bar = _BARS.get(int(bar_id))
    due = _NEVER if bar is None else bar._advance_to(int(done))
    return np.asarray(due, np.int32)


class ProgressBar:
    """One tqdm bar for a compiled loop of `total` steps, updated at a bounded rate.

    Use it as a context manager around the call of the compiled function, and pass its
    `handle` to that function, which carries the step of the next report through its
    loop:

    ```python
    @jax.jit
    def run(states, progress):
        def body(carry, _):
            states, t, due = carry
            states = jax.vmap(step)(states)  # chains inside
            due = progress(t + 1, due)  # the counter outside the vmap
            return (states, t + 1, due), None

        carry = (states, 0, progress.start(0))
        (states, _, _), _ = lax.scan(body, carry, None, length=progress.total)
        return states

    with ProgressBar(1000, "sampling") as bar:
        states = jax.block_until_ready(run(states, bar.handle))
    ```

    On exit it waits for pending callbacks (`jax.effects_barrier()`) and closes the bar,
    which then shows how far the loop got as of its last report: `total` if it
    finished, less if it stopped early.

    **Arguments:**

    - `total`: the number of steps of the run.
    - `desc`: the text before the bar.
    - `max_updates`: the most times the compiled loop calls back to the host (plus one
        for the last step), so the overhead is bounded whatever `total` is.
    - `min_interval`: once the loop's speed is known, reports are spaced to come about
        this many seconds apart (tqdm redraws a bar at most every 0.1 s), or `every`
        steps apart if that is further.
    - `file`: where the bar is written; `sys.stderr` by default, as for `tqdm`.

    **Raises:**

    `BatchError` if `total` is negative, `max_updates` is not positive or
    `min_interval` is negative.
    """

    def __init__(
        self,
        total: int,
        desc: str = "",
        *,
        max_updates: int = 100,
        min_interval: float = 0.1,
        file: TextIO | None = None,
    ):
        if total < 0:
            raise BatchError(f"`total` is {total}; a run has zero or more steps.")
        if max_updates < 1:
            raise BatchError(
                f"`max_updates` is {max_updates}; the bar needs at least one update."
            )
        if not min_interval >= 0:
            raise BatchError(
                f"`min_interval` is {min_interval}; it must be zero or more seconds."
            )
        self.total = total
        self.every = max(1, math.ceil(total / max_updates))
        self.min_interval = min_interval
        self.updates = 0
        self._desc = desc
        self._file = file
        self._bar: Any = None
        self._id = -1
        self._last: tuple[float, int] | None = None

    @property
    def handle(self) -> ProgressHandle:
        """The `ProgressHandle` to pass into the compiled loop."""
        if self._bar is None:
            raise BatchError(
                "the progress bar is not open: use its `handle` inside "
                "`with ProgressBar(...) as bar:`."
            )
        return ProgressHandle(jnp.asarray(self._id, jnp.int32), self.every, self.total)

    @property
    def n(self) -> int:
        """The number of steps the bar shows as done."""
        return 0 if self._bar is None else self._bar.n

    def show(self, done: int, postfix: str) -> None:
        """From the host, between compiled loops: moves the bar forward to `done` (a
        report from the loop may not have come since) and shows `postfix` after it."""
        if self._bar is not None:
            with _LOCK:
                if done > self._bar.n:
                    self._bar.update(done - self._bar.n)
                self._bar.set_postfix_str(postfix)

    def __enter__(self) -> "ProgressBar":
        self._bar = tqdm(
            total=self.total, desc=self._desc, file=self._file, unit="step"
        )
        with _LOCK:
            self._id = next(_NEXT_ID)
            _BARS[self._id] = self
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Callbacks may still be queued behind the computation; let them land first.
        jax.effects_barrier()
        with _LOCK:
            _BARS.pop(self._id, None)
        self._bar.close()

    def _advance_to(self, done: int) -> int:
        """Moves the bar forward to `done`; returns the step of the next report."""
        now = time.monotonic()
        with _LOCK:
            self.updates += 1
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)
            ahead = self.every
            if self._last is not None and now > self._last[0] and done > self._last[1]:
                # Steps per second since the last report, times the interval wanted.
                rate = (done - self._last[1]) / (now - self._last[0])
                ahead = max(ahead, int(rate * self.min_interval))
            self._last = (now, done)
        if done >= self.total:
            return _NEVER
        return min(done + ahead, self.total)
