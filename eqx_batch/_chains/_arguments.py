"""`run_chains`' arguments, checked: its counts, how many chains `init` holds, one key
for each, NumPy leaves read with the dtypes JAX gives them, and superchains expanded
(`until` is checked in `_until/_stopping.py`)."""

import functools as ft
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .._errors import BatchError, check_bool, check_int, describe, is_bool
from .._tree import axis_sizes, common_size, is_array, is_key, is_numpy, mapped_leaves


class Counts(NamedTuple):
    """`run_chains`' counts, checked."""

    num_steps: int
    thin: int
    burn_in: int
    checkpoint_every: int | None
    chunk_size: int | None


def checked_flags(**flags: Any) -> list[bool]:
    """Each flag as a Python bool, in order.

    **Raises:**

    `BatchError` naming the first flag that is not a bool (`"False"` is a string,
    which Python would count as true).
    """
    return [check_bool(value, name) for name, value in flags.items()]


def checked_trace(
    trace: Any, *, require_checkpoint: Callable[[str], None]
) -> bool | Literal["disk"]:
    """`trace` as `True`, `False` or `"disk"`.

    A bool is read as `checked_flags` reads one (NumPy's bools too); the one other
    choice is the exact string `"disk"`, which streams the draws to the checkpoint's
    files, so it needs one.

    **Raises:**

    `BatchError` naming `trace`, its value and the choices, for any other value
    (`"Disk"`, `1`, `"True"`); for `"disk"` without a checkpoint
    (`require_checkpoint` refuses it).
    """
    if isinstance(trace, str):
        if trace != "disk":
            raise BatchError(f"`trace` is {trace!r}; it must be True, False or 'disk'.")
        require_checkpoint(
            "`trace='disk'` but `checkpoint` is None: pass a `checkpoint` path, "
            "or `trace=True`."
        )
        return "disk"
    if not is_bool(trace) or getattr(trace, "ndim", 0) != 0:
        shown = describe(trace) if getattr(trace, "ndim", 0) else repr(trace)
        raise BatchError(f"`trace` is {shown}; it must be True, False or 'disk'.")
    return bool(trace)


def checked_counts(
    num_steps: Any,
    thin: Any,
    burn_in: Any,
    checkpoint_every: Any,
    chunk_size: Any,
    *,
    require_checkpoint: Callable[[str], None],
) -> Counts:
    """The counts of a run, each in its range (a bool is no count).

    **Raises:**

    `BatchError` naming the argument out of range, or `checkpoint_every` without a
    checkpoint (`require_checkpoint` refuses it).
    """
    num_steps = check_int(num_steps, "num_steps")
    thin = check_int(thin, "thin", minimum=1)
    burn_in = check_int(burn_in, "burn_in", maximum=num_steps)
    if checkpoint_every is not None:
        require_checkpoint(
            "`checkpoint_every` is set but `checkpoint` is None: pass a path."
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
    return Counts(num_steps, thin, burn_in, checkpoint_every, chunk_size)


class Init(NamedTuple):
    """`run_chains`' `init`, taken apart."""

    whole: Any  # `init`, its NumPy leaves with the dtypes JAX gives them
    arrays: Any  # its array leaves (others None)
    static: Any  # its other leaves, the same for every chain (arrays None)
    num_chains: int  # the size of axis 0 that its array leaves agree on


def split_init(init: Any) -> Init:
    """`init` taken apart in one pass over its leaves: a call of a short run costs
    little more than its loop, and `eqx.partition` and friends would each pass again.

    NumPy leaves get the dtypes JAX gives them, as `jax.vmap` reads them: a float64
    NumPy `init` is float32 unless 64-bit mode is on, like the step's results.

    **Raises:**

    `BatchError` if the array leaves disagree on the number of chains (naming each
    leaf) or there is none.
    """
    leaves, treedef = jtu.tree_flatten(init)
    leaves = [
        x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)
        if is_numpy(x)
        else x
        for x in leaves
    ]
    arrays = [x if is_array(x) else None for x in leaves]
    # Checked on the bare leaves first: naming every leaf by its path is for the
    # message when they disagree, and costs on every call of a large tree.
    sizes = {x.shape[0] if x.ndim else -1 for x in arrays if x is not None}
    arrays_tree = treedef.unflatten(arrays)
    if len(sizes) == 1 and min(sizes) >= 0:
        num_chains = sizes.pop()
    else:
        num_chains = common_size(
            axis_sizes(mapped_leaves(arrays_tree, 0, "init"), "init"),
            what="chain axis (axis 0)",
            fix="Every array leaf of `init` needs one entry per chain along axis 0.",
        )
    return Init(
        treedef.unflatten(leaves),
        arrays_tree,
        treedef.unflatten([None if is_array(x) else x for x in leaves]),
        int(num_chains),
    )


# One compiled program: called eagerly, `jr.split` dispatches several operations,
# which cost a short run a third of a millisecond on a TPU (issue 34).
_split = jax.jit(jr.split, static_argnums=1)


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
                f"`key` is {describe(key)}, not legacy keys: pass "
                f"uint32[{num_chains},{','.join(map(str, key_shape))}], or `jr.key`."
            ) from None
    else:
        raise BatchError(
            f"`key` is {describe(key)}; pass one PRNG key (`jr.key(0)`) or "
            f"{num_chains}, one per chain."
        )
    if key.ndim == 0:
        return _split(key, num_chains), legacy
    if key.shape != (num_chains,):
        raise BatchError(
            f"`key` holds {key.shape[0] if key.ndim == 1 else key.shape} keys but "
            f"`init` has {num_chains} chains: pass one key per chain, or one key."
        )
    return key, legacy


# Superchains: groups of chains started from the same point (Margossian et al.,
# "Nested R-hat", 2024). With `superchains=K`, `init` holds one start per superchain
# and `key` one key per chain; chain `c` belongs to superchain `c // M` and starts
# from `init[c // M]`.


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
    ids = np.repeat(np.arange(superchains, dtype=np.int64), per_superchain)
    arrays = _repeated(init.arrays, per_superchain)
    expanded = Init(eqx.combine(arrays, init.static), arrays, init.static, num_keys)
    return expanded, ids


# One program for every leaf, the starts repeated where they are: `eb.take` would
# send the indices to the devices and gather leaf by leaf, which a short run on a TPU
# pays for in dispatches (issue 34).
@ft.partial(jax.jit, static_argnums=1)
def _repeated(arrays: Any, times: int) -> Any:
    """Each start of `arrays`' leaves `times` times, in place: chain `c`'s is
    `arrays[c // times]`."""
    return jtu.tree_map(lambda x: jnp.repeat(x, times, axis=0), arrays)


class Starts(NamedTuple):
    """Every chain's start and key, from `run_chains`' `init`, `key` and
    `superchains`."""

    init: Init  # one start per chain (superchains expanded)
    keys: jax.Array  # one typed key per chain
    legacy: bool  # whether `key` was given as legacy `uint32` data
    superchains: int | None
    superchain_ids: np.ndarray | None  # each chain's superchain (`int64[chains]`)


def chain_starts(init: Any, key: Any, superchains: Any) -> Starts:
    """`init` taken apart, with one start and one key per chain (`split_init`,
    `expand_superchains`, `chain_keys`).

    **Raises:**

    `BatchError` as those do, naming the argument.
    """
    whole, ids = split_init(init), None
    if superchains is not None:
        whole, ids = expand_superchains(whole, key, superchains)
        superchains = int(superchains)
    keys, legacy = chain_keys(key, whole.num_chains)
    return Starts(whole, keys, legacy, superchains, ids)


def _key_count(key: Any) -> int | None:
    """How many keys `key` holds, if it is an array of keys (typed, or legacy
    `uint32[n, 2]` data); else None."""
    if isinstance(key, jax.Array) and is_key(key):
        return key.shape[0] if key.ndim == 1 else None
    if is_array(key) and np.ndim(key) == 2:
        return key.shape[0]
    return None
