"""Superchains: groups of chains started from the same point (Margossian et al.,
"Nested R-hat", 2024). With `superchains=K`, `init` holds one start per superchain and
`key` one key per chain; chain `c` belongs to superchain `c // M` and starts from
`init[c // M]`."""

import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, check_int, describe
from .._tree import is_array, is_key
from ._arguments import Init


def expand_superchains(init: Init, key: Any, superchains: Any) -> tuple[Init, Any]:
    """`init` (one start per superchain) repeated for each chain, and each chain's
    superchain id (`int64[chains]`).

    **Raises:**

    `BatchError` if `superchains` is not a positive integer, if `init` does not hold
    `superchains` members, if `key` is one key rather than one per chain, or if the
    number of keys is not a multiple of `superchains`.
    """
    superchains = check_int(
        superchains,
        "superchains",
        minimum=1,
        hint="It is how many superchains (groups of chains started from the same "
        "point) the chains form.",
    )
    if init.num_chains != superchains:
        raise BatchError(
            f"`init` has {init.num_chains} members but `superchains={superchains}`: "
            "pass one start per superchain (see docs/chains.md#superchains)."
        )
    num_keys = _key_count(key)
    if num_keys is None:
        raise BatchError(
            f"`key` is {describe(key)}, but `superchains={superchains}` needs one key "
            f"per chain: `jax.random.split(key, {superchains} * M)`."
        )
    if num_keys == 0 or num_keys % superchains:
        raise BatchError(
            f"`key` holds {num_keys} keys, which `superchains={superchains}` does not "
            f"divide: pass {superchains} * M."
        )
    per_superchain = num_keys // superchains
    ids = np.arange(num_keys) // per_superchain
    arrays = _repeated(init.arrays, per_superchain)
    expanded = Init(eqx.combine(arrays, init.static), arrays, init.static, num_keys)
    return expanded, ids.astype(np.int64)


# One program for every leaf, the starts repeated where they are: `eb.take` would
# send the indices to the devices and gather leaf by leaf, which a short run on a TPU
# pays for in dispatches (issue 34).
@ft.partial(jax.jit, static_argnums=1)
def _repeated(arrays: Any, times: int) -> Any:
    """Each start of `arrays`' leaves `times` times, in place: chain `c`'s is
    `arrays[c // times]`."""
    return jtu.tree_map(lambda x: jnp.repeat(x, times, axis=0), arrays)


def _key_count(key: Any) -> int | None:
    """How many keys `key` holds, if it is an array of keys (typed, or legacy
    `uint32[n, 2]` data); else None."""
    if isinstance(key, jax.Array) and is_key(key):
        return key.shape[0] if key.ndim == 1 else None
    if is_array(key) and np.ndim(key) == 2:
        return key.shape[0]
    return None
