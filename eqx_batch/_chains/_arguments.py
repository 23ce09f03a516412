"""The chains of `run_chains`' arguments: how many `init` holds, one key for each,
and NumPy leaves read with the dtypes JAX gives them."""

from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, describe
from .._tree import axis_sizes, common_size, is_array, is_key, is_numpy, mapped_leaves


def with_jax_dtype(x: Any) -> Any:
    """A NumPy leaf with the dtype JAX gives it, as `jax.vmap` reads it (float64 is
    float32 unless 64-bit mode is on); other leaves as they are."""
    if is_numpy(x):
        return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)
    return x


def chain_count(states: Any) -> int:
    """The chains the array leaves of `init` agree on (their axis 0)."""
    # Checked on the bare leaves first: naming every leaf by its path is for the
    # message when they disagree, and costs on every call of a large tree.
    sizes = {np.shape(x)[0] if np.ndim(x) else -1 for x in jtu.tree_leaves(states)}
    if len(sizes) == 1 and min(sizes) >= 0:
        return int(sizes.pop())
    return common_size(
        axis_sizes(mapped_leaves(states, 0, "init"), "init"),
        what="chain axis (axis 0)",
        fix="Every array leaf of `init` needs one entry per chain along axis 0.",
    )


def chain_keys(key: Any, num_chains: int) -> tuple[jax.Array, bool]:
    """One typed key per chain, and whether `key` was given as legacy `uint32` data."""
    if isinstance(key, jax.Array) and is_key(key):
        legacy = False
    elif is_array(key) and key.dtype == np.uint32 and np.ndim(key) in (1, 2):
        legacy = True
        try:
            key = jr.wrap_key_data(jnp.asarray(key))
        except TypeError:
            # Legacy keys are raw data of the default implementation's key shape.
            key_shape = jr.key_data(jr.key(0)).shape
            raise BatchError(
                f"`key` is {describe(key)}, which is not legacy key data: each legacy "
                f"key (`jr.PRNGKey(0)`) is uint32{list(key_shape)}, so one key per "
                f"chain is uint32[{num_chains},{','.join(map(str, key_shape))}]. Pass "
                "such keys, or typed keys (`jr.key(0)`)."
            ) from None
    else:
        raise BatchError(
            f"`key` is {describe(key)}; pass one PRNG key (`jr.key(0)`, or legacy "
            f"`jr.PRNGKey(0)`) or an array of {num_chains} keys, one per chain."
        )
    if key.ndim == 0:
        return jr.split(key, num_chains), legacy
    if key.shape != (num_chains,):
        raise BatchError(
            f"`key` holds {key.shape[0] if key.ndim == 1 else key.shape} keys but "
            f"`init` has {num_chains} chains. Pass one key per chain, or a single key "
            f"to be split with `jax.random.split(key, {num_chains})`."
        )
    return key, legacy
