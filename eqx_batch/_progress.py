"""A tqdm progress bar for work queued on the devices, moved from the host as each
piece of it finishes.

The bar has no part in the compiled program. A host callback inside a compiled loop
(`io_callback` behind a `lax.cond`) costs on a TPU even when it is never called: a
loop of 16,384 chains took 25 ms with one against 20 ms without (issue 34). So the
caller cuts the work into pieces (`run_chains` cuts its loop into segments, which it
does anyway for checkpoints) and tells the bar, as it queues each piece, the count
that piece reaches and an array it computes (`follow`). The host waits for the piece
before, not the one just queued, so the devices always have the next piece while the
bar moves.
"""

from types import TracebackType
from typing import Any, TextIO

import jax
from tqdm.auto import tqdm

from ._errors import BatchError


class ProgressBar:
    """One tqdm bar over `total` steps of work queued on the devices.

    Use it as a context manager around the loop that queues the pieces, and call
    `follow` after queuing each:

    ```python
    with ProgressBar(1000, "sampling") as bar:
        for start in range(0, 1000, 100):
            states = segment(states, start, 100)  # dispatched without waiting
            bar.follow(start + 100, states)
    ```

    On exit without an error it waits for the last piece followed and moves the bar
    to its count; on an error it closes the bar where the pieces finished so far left
    it.

    **Arguments:**

    - `total`: the number of steps of the run.
    - `desc`: the text before the bar.
    - `file`: where the bar is written; `sys.stderr` by default, as for `tqdm`.

    **Raises:**

    `BatchError` if `total` is negative.
    """

    def __init__(self, total: int, desc: str = "", *, file: TextIO | None = None):
        if total < 0:
            raise BatchError(f"`total` is {total}; a run has zero or more steps.")
        self.total = total
        self._desc = desc
        self._file = file
        self._bar: Any = None
        # The count the last piece followed reaches, and an array it computes.
        self._pending: tuple[int, Any] | None = None

    @property
    def n(self) -> int:
        """The number of steps the bar shows as done."""
        return 0 if self._bar is None else self._bar.n

    def follow(self, done: int, computed: Any) -> None:
        """Says that the piece just queued reaches `done` steps once `computed` (any
        pytree of its arrays) is ready: the bar moves to the piece before's count
        once that piece is finished, waiting for it, and to this one's at the next
        call or on exit."""
        self._catch_up()
        self._pending = (done, computed)

    def show(self, done: int, postfix: str | None = None) -> None:
        """Moves the bar forward to `done` now (never back), and shows `postfix`
        after it if given: for the host's own news between pieces (a check's
        result), which it read from finished work."""
        if self._bar is None:
            return
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)
        if postfix is not None:
            self._bar.set_postfix_str(postfix)

    def _catch_up(self) -> None:
        if self._pending is not None:
            done, computed = self._pending
            self._pending = None
            jax.block_until_ready(computed)
            self.show(done)

    def __enter__(self) -> "ProgressBar":
        self._bar = tqdm(
            total=self.total, desc=self._desc, file=self._file, unit="step"
        )
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self._catch_up()
        self._pending = None
        self._bar.close()
