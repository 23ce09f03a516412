"""A tqdm progress bar driven from inside a compiled loop.

The host side is `ProgressBar`, a context manager that owns a `tqdm` bar. The traced
side is its `handle`, a `ProgressHandle` that a `lax.scan` or `fori_loop` body calls
with the number of steps done: `handle(t + 1)`. At most about `max_updates` times per
run, and on the last step, that call reaches the host through `jax.debug.callback` and
moves the bar. The cost is one `lax.cond` per step plus, per update, one host callback
(a fraction of a millisecond on CPU), so about 100 updates cost tens of milliseconds
whatever the length of the run.

Two rules keep this cheap and correct:

- **The step counter must be unbatched.** Scan over steps outside, `vmap` over chains
  inside the body, and call the handle from the body, outside the `vmap`: one bar for
  all chains, one callback per update. Under `vmap` the callback would be unrolled into
  one call per chain (`jax.debug.callback`'s batching rule), and `io_callback` fails
  under `vmap` of `lax.cond` altogether.
- **Pass the handle as an argument of the compiled function** (e.g. in the arguments of
  `eqx.filter_jit`), not as a closed-over constant. Its bar id is an array, so it is
  traced and one compiled loop serves every bar; `every` and `total` are static fields.

Callbacks are unordered, so they may reach the host out of order; the bar only ever
moves forward to the largest count reported, which makes the order irrelevant.
"""

import itertools
import math
import threading
from types import TracebackType
from typing import Any, TextIO

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ._errors import BatchError


_BARS: dict[int, "ProgressBar"] = {}
_NEXT_ID = itertools.count()
_LOCK = threading.Lock()


class ProgressHandle(eqx.Module):
    """The traced side of a `ProgressBar`: call it in a loop body with the steps done.

    **Fields:**

    - `bar_id`: an `int32` scalar naming the bar on the host; traced when the handle is
        an argument of a compiled function, so recompiling is not needed per bar.
    - `every`: the host is told of every `every`-th step (and of the last one).
    - `total`: the number of steps of the whole run.
    """

    bar_id: jax.Array
    every: int = eqx.field(static=True)
    total: int = eqx.field(static=True)

    def __call__(self, done: Any) -> None:
        """Reports from traced code that `done` steps of `total` are finished.

        `done` must be an unbatched integer scalar (see the module docstring). Only when
        `done` is a multiple of `every`, or equals `total`, does a `jax.debug.callback`
        run; otherwise the cost is one integer comparison and a `lax.cond`.
        """
        done = jnp.asarray(done, jnp.int32)
        report = (done % self.every == 0) | (done == self.total)
        lax.cond(report, _send, _skip, self.bar_id, done)


def _send(bar_id: jax.Array, done: jax.Array) -> None:
    jax.debug.callback(_receive, bar_id, done)


def _skip(bar_id: jax.Array, done: jax.Array) -> None:
    del bar_id, done


def _receive(bar_id: np.ndarray, done: np.ndarray) -> None:
    """On the host: moves bar `bar_id` forward to `done`, if it is still open."""
    with _LOCK:
        bar = _BARS.get(int(bar_id))
    if bar is not None:
        bar._advance_to(int(done))


class ProgressBar:
    """One tqdm bar for a compiled loop of `total` steps, updated at a bounded rate.

    Use it as a context manager around the call of the compiled function, and pass its
    `handle` to that function:

    ```python
    @eqx.filter_jit
    def run(states, progress):
        def body(carry, _):
            states, t = carry
            states = jax.vmap(step)(states)  # chains inside
            progress(t + 1)  # the counter outside the vmap
            return (states, t + 1), None

        (states, _), _ = lax.scan(body, (states, 0), None, length=progress.total)
        return states

    with ProgressBar(1000, "sampling") as bar:
        states = jax.block_until_ready(run(states, bar.handle))
    ```

    On exit it waits for pending callbacks (`jax.effects_barrier()`) and closes the bar,
    which then shows how far the loop got: `total` if it finished, less if it failed.

    **Arguments:**

    - `total`: the number of steps of the run.
    - `desc`: the text before the bar.
    - `max_updates`: the most times the compiled loop calls back to the host (plus one
        for the last step), so the overhead is bounded whatever `total` is.
    - `file`: where the bar is written; `sys.stderr` by default, as for `tqdm`.

    **Raises:**

    `BatchError` if `total` is negative or `max_updates` is not positive.
    """

    def __init__(
        self,
        total: int,
        desc: str = "",
        *,
        max_updates: int = 100,
        file: TextIO | None = None,
    ):
        if total < 0:
            raise BatchError(f"`total` is {total}; a run has zero or more steps.")
        if max_updates < 1:
            raise BatchError(
                f"`max_updates` is {max_updates}; the bar needs at least one update."
            )
        self.total = total
        self.every = max(1, math.ceil(total / max_updates))
        self.updates = 0
        self._desc = desc
        self._file = file
        self._bar: Any = None
        self._id = -1

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

    def _advance_to(self, done: int) -> None:
        with _LOCK:
            self.updates += 1
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)
