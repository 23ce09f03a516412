"""`NonFinite`, the report of chains whose state went NaN or infinite."""

from typing import Any

import equinox as eqx
import numpy as np


class NonFinite(eqx.Module):
    """Which chains' states went NaN or infinite, and when.

    A chain whose state stops being finite keeps running (and usually stays non-finite);
    the other chains are unaffected. This report says which ones to discard or inspect.

    **Fields:**

    - `first_step`: for every chain, the first step, counted from 1, after which its
        state held a NaN or an infinity; 0 for a chain that stayed finite
        (`int32[chains]`). `run_chains` leaves it on the devices, as it leaves `final`:
        it returns without waiting for the loop, and the report is read when asked
        for.

    **Properties:**

    - `chains`: the indices of the chains that went non-finite, ascending (NumPy
        `int64`, possibly empty).
    - `steps`: for each of them, its `first_step` (NumPy `int64`).

    !!! Example

        ```python
        step = lambda x, key: x * 10.0  # overflows float32 after a few dozen steps
        init = jnp.array([0.0, 1.0])
        result = eb.run_chains(step, init, jr.key(0), 50)
        result.nonfinite.chains  # array([1])
        result.nonfinite.steps  # array([39])
        ```
    """

    first_step: Any

    @property
    def chains(self) -> np.ndarray:
        return np.flatnonzero(np.asarray(self.first_step)).astype(np.int64)

    @property
    def steps(self) -> np.ndarray:
        first_step = np.asarray(self.first_step)
        return first_step[first_step != 0].astype(np.int64)
