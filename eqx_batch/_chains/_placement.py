"""Chains placed on the devices: split over every device of every process, padded to a
multiple of the device count (or, for a step that sees every chain, unpadded on the
most devices they divide over).

Only host data, the same in every process, can be placed on the devices of other
processes, and typed PRNG keys cannot go there: they go as their raw data and are made
keys again on the devices.

In a job of several processes, results stay where they were computed: global arrays
split by chain (`chain_layout`), each process holding its own chains' rows. Only what
is asked for whole (`whole_here`: small statistics, or `Chains.gathered`) is gathered.
"""

import functools as ft
import math
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._compiling._memo import BoundedCache
from .._errors import BatchError
from .._stacking._select import take
from .._transforms._shard import Device, member_mesh, named_mesh
from .._tree import as_keys_like, host_array, is_array, is_key, with_leaves_replaced


class Placement:
    """Where a run's chains live: split over every device, padded to a multiple of
    the device count.

    The padding chains repeat chain 0: valid states whose results are dropped. Chains
    never interact, so they cannot change a real chain's bits. A chunk of a chunked run
    is padded to the size of the others (`pad_to`), so that every chunk runs the same
    compiled program.

    With `pad=False` (a step that sees every chain, which would see the padding), the
    chains are not padded but placed on the devices of `chain_devices`, whole blocks
    of `unit` chains on each.
    """

    def __init__(
        self, num_chains: int, pad_to: int = 0, *, pad: bool = True, unit: int = 1
    ):
        self.num_chains = num_chains
        self.mesh = member_mesh(None if pad else chain_devices(num_chains, unit))
        size = self.mesh.size
        self.num_rows = -(-max(num_chains, pad_to) // size) * size
        # Every leaf placed here is split along its axis 0, one row per chain.
        self.split = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names[0]))
        # A whole copy on each of those devices, for what every chain reads.
        self.everywhere = NamedSharding(self.mesh, PartitionSpec())
        # With one device in all, every array on the devices is where it would go.
        self._one_device = jax.device_count() == 1
        # A run asks for the zeros of the same few structs on every call.
        self._made = BoundedCache(16)

    def put(self, tree: Any, replicated: Any = None) -> tuple[Any, Any]:
        """`tree` (on the host or on devices, one row per chain) split over the
        devices, padded; and `replicated` (a step's `data`) whole on each of them.
        Both in one call: placing arrays costs per call as well as per leaf."""
        if self.num_rows != self.num_chains and tree is not None:
            padding = np.zeros(self.num_rows - self.num_chains, int)
            tree = take(tree, np.r_[np.arange(self.num_chains), padding])
        if jax.process_count() > 1:
            # Only host data (the same in every process) can be placed on the devices
            # of other processes: typed keys go as their raw data, wrapped again there.
            host = jtu.tree_map(lambda x: host_array(x) if is_array(x) else x, tree)
            placed, _ = self._placed(host, None)
            return as_keys_like(placed, tree), self._replicated_from_host(replicated)
        return self._placed(tree, replicated)

    def _placed(self, tree: Any, replicated: Any) -> tuple[Any, Any]:
        # In one call, without `eb.shard`'s checks (which are for a user's tree), and
        # only the leaves not already placed so (`device_put` costs even then).
        split_leaves, split_def = jtu.tree_flatten(tree)
        whole_leaves, whole_def = jtu.tree_flatten(replicated)
        leaves = split_leaves + whole_leaves
        num_split = len(split_leaves)
        targets = [self.split] * num_split + [self.everywhere] * len(whole_leaves)
        picked = [
            i
            for i, (x, sharding) in enumerate(zip(leaves, targets, strict=True))
            if is_array(x) and not self._is_placed(x, sharding)
        ]
        if not picked:
            return tree, replicated
        placed = _put_on([leaves[i] for i in picked], [targets[i] for i in picked])
        for i, x in zip(picked, placed, strict=True):
            leaves[i] = x
        return (
            jtu.tree_unflatten(split_def, leaves[:num_split]),
            jtu.tree_unflatten(whole_def, leaves[num_split:]),
        )

    def _replicated_from_host(self, replicated: Any) -> Any:
        """`replicated`'s arrays whole on every device of the job, from the host, so
        that every process places the same values."""
        return with_leaves_replaced(
            replicated,
            is_array,
            lambda leaves: jax.device_put(
                [host_array(x) for x in leaves], self.everywhere
            ),
        )

    def _is_placed(self, x: Any, sharding: NamedSharding) -> bool:
        # An uncommitted array (a fresh result of uncommitted inputs) is moved too:
        # the loop's program is compiled for its inputs' placement, and its outputs
        # come back committed, so one left uncommitted compiles the loop twice.
        return (
            isinstance(x, jax.Array)
            and x.committed
            and (
                # Asked of a typed key array, `sharding` costs tens of microseconds.
                self._one_device or x.sharding.is_equivalent_to(sharding, x.ndim)
            )
        )

    def block_size(self, problem_of_row: np.ndarray) -> int:
        """The most consecutive rows that share a problem, in blocks that divide each
        device's rows, for chains of the problems `problem_of_row` (one per chain,
        padded here as `put` pads them: the padding repeats chain 0's problem).

        A block starts at a multiple of its size, so it holds one problem exactly when
        every row where the problem changes is such a multiple: the size is the
        greatest common divisor of those rows and of each device's row count.
        """
        problems = np.asarray(problem_of_row)
        if len(problems) < self.num_rows:
            padding = np.full(self.num_rows - len(problems), problems[0])
            problems = np.concatenate([problems, padding])
        changes = np.flatnonzero(problems[1:] != problems[:-1]) + 1
        per_device = self.num_rows // self.mesh.size
        return int(np.gcd.reduce(changes, initial=per_device))

    def real_chains(self, tree: Any) -> Any:
        """The rows of the real chains (padding dropped).

        In a job of several processes, global arrays split by chain as
        `chain_layout` lays them out: each process holds only its chains' rows.
        """
        if self.num_rows == self.num_chains:
            # Already split by chain, over every device (or `chain_devices`).
            return tree
        if jax.process_count() == 1:
            return take(tree, np.arange(self.num_chains))
        return _laid_out(tree, self.num_chains, chain_layout(self.num_chains))

    def whole_real_chains(self, tree: Any) -> Any:
        """The rows of the real chains, whole in every process: a collective in a
        job, for the small statistics that need every chain (moments, NaN report)."""
        if jax.process_count() == 1:
            return self.real_chains(tree)
        # Gathered as they are (one program for any count of real chains), then cut
        # on this process's own device.
        return take(whole_here(tree), np.arange(self.num_chains))

    def zeros(self, like: Any) -> Any:
        """Zeros shaped like `like` (one row per chain), created already split."""
        structs, treedef = jtu.tree_flatten(self.zeros_to_make(like))
        return jtu.tree_unflatten(treedef, _sharded_zeros(tuple(structs)))

    def zeros_to_make(self, like: Any) -> Any:
        """What `zeros(like)` would make, as shape-dtype structs split as it splits
        them, for a program to make them itself (`made_zeros`). The same objects for
        an equal `like` (of shape-dtype structs) as on earlier calls."""
        leaves, treedef = jtu.tree_flatten(like)
        return self._made.get_or_make(
            (treedef, *leaves),
            lambda: jtu.tree_map(
                lambda x: jax.ShapeDtypeStruct(
                    (self.num_rows, *x.shape[1:]), x.dtype, sharding=self.split
                ),
                like,
            ),
        )


def made_zeros(tree: Any) -> Any:
    """Inside a program: `tree` with each of its shape-dtype structs (made by
    `Placement.zeros_to_make`) replaced by zeros of that shape, dtype and split."""

    def make(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        return lax.with_sharding_constraint(jnp.zeros(x.shape, x.dtype), x.sharding)

    return jtu.tree_map(make, tree)


def chain_devices(num_chains: int, unit: int = 1) -> list[Device]:
    """The most devices that `num_chains` chains split over evenly, in whole blocks of
    `unit` chains, as many of each process: the first `k` devices of every process,
    `k` the largest count of devices per process for which the processes' devices
    divide the blocks.

    **Raises:**

    `BatchError` if the number of processes does not divide the blocks.
    """
    per_process = _devices_per_process(num_chains // unit)
    if per_process == 0:
        processes = jax.process_count()
        raise BatchError(
            f"{num_chains} chains do not split over {processes} processes: run a "
            "multiple (see docs/chains.md#what-is-refused)."
        )
    chosen = {device for devices in _by_process() for device in devices[:per_process]}
    return [device for device in jax.devices() if device in chosen]


@ft.cache
def chain_layout(num_chains: int) -> NamedSharding:
    """How the results of `num_chains` chains lie in a job of several processes:
    split by chain over as many groups of devices as the chains divide over evenly (a
    `jax.Array` cannot be split unevenly), each group holding its block of rows on each
    of its devices.

    Every device of the job is in a group, so results and the run's arrays share one
    set of devices (one program can take both). When the processes divide the chains,
    the groups are `chain_devices`' devices, each with the process's other devices
    (each process holds only its own chains, which `without_copies` then keeps once).
    Else the devices, in order, in `gcd(num_chains, device count)` groups, some of
    which span processes: 5 chains on 4 devices are one group, whole everywhere.
    """
    per_process = _devices_per_process(num_chains)
    if per_process:
        # Group `j` of a process: its devices `j`, `j + k`, ...: the first of each
        # group is one of its first `k` devices, `chain_devices`' own.
        groups = [
            devices[j::per_process]
            for devices in _by_process()
            for j in range(per_process)
        ]
    else:
        devices = jax.devices()
        count = math.gcd(num_chains, len(devices))
        size = len(devices) // count
        groups = [devices[i * size : (i + 1) * size] for i in range(count)]
    mesh = Mesh(np.array(groups), ("chains", "copies"), axis_types=(AxisType.Auto,) * 2)
    return NamedSharding(mesh, PartitionSpec("chains"))


def _devices_per_process(num_chains: int) -> int:
    """The most devices of each process over which all processes' divide the chains
    evenly; 0 if the processes do not divide them."""
    processes = jax.process_count()
    local = jax.local_device_count()
    return next(
        (k for k in range(local, 0, -1) if num_chains % (processes * k) == 0), 0
    )


def _by_process() -> list[list[Device]]:
    """Every process's devices, in the order of the processes and of `jax.devices()`."""
    devices: dict[int, list[Device]] = {}
    for device in jax.devices():
        devices.setdefault(device.process_index, []).append(device)
    return [devices[index] for index in sorted(devices)]


def joined(trees: list[Any]) -> Any:
    """Trees of whole arrays (one row per chain), as one, in the order of the
    chains."""
    if len(trees) == 1:
        return trees[0]
    return jtu.tree_map(_concatenated, *trees)


def _concatenated(*xs: jax.Array) -> jax.Array:
    if not is_key(xs[0]):
        return jnp.concatenate(xs)
    # Typed keys are joined as their raw data: JAX 0.8 gave the eager concatenation
    # of chunks' keys, from the third chunked run of a process on, a sharding that
    # splits each key's own axis, which `key_data` then refused.
    raw = jnp.concatenate([jr.key_data(x) for x in xs])
    return jr.wrap_key_data(raw, impl=jr.key_impl(xs[0]))


def joined_chains(trees: list[Any]) -> Any:
    """The chunks' results (one row per chain, from `Placement.real_chains`) as one,
    in the order of the chains; in a job of several processes, split by chain as
    `chain_layout` lays them out, never gathered."""
    if len(trees) == 1 or jax.process_count() == 1:
        return joined(trees)
    counts = [jtu.tree_leaves(tree)[0].shape[0] for tree in trees]
    sharding = chain_layout(sum(counts))
    # Written chunk by chunk into the joined arrays: a program that concatenates
    # chunks laid out on different groups of devices would gather all of them on
    # every device first (XLA's partitioner cannot move such rows otherwise).
    structs = [
        jax.ShapeDtypeStruct((sum(counts), *x.shape[1:]), x.dtype, sharding=sharding)
        for x in jtu.tree_leaves(trees[0])
    ]
    joined_tree = jtu.tree_unflatten(
        jtu.tree_structure(trees[0]), _sharded_zeros(tuple(structs))
    )
    start = 0
    for tree, count in zip(trees, counts, strict=True):
        joined_tree = _put_rows(joined_tree, tree, start, sharding)
        start += count
    return joined_tree


def without_copies(tree: Any) -> Any:
    """`tree` with the arrays that `chain_layout` lays out over groups of one
    process's devices kept on the first device of each group only: the other copies
    of their rows are let go (nothing moves, nothing is computed).

    Results then sit on `chain_devices`, each process holding one copy of its own
    chains' rows, as an unpadded run leaves them. Groups that span processes (when
    the processes do not divide the chains) keep their copies: each process needs
    its own.
    """

    def one_copy(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        sharding = x.sharding
        if not (
            isinstance(sharding, NamedSharding)
            and sharding.mesh.axis_names == ("chains", "copies")
            and sharding.mesh.shape["copies"] > 1
        ):
            return x
        groups = np.asarray(sharding.mesh.devices)
        if any(len({d.process_index for d in group}) > 1 for group in groups):
            return x
        firsts = tuple(groups[:, 0])
        kept = NamedSharding(named_mesh(firsts, "chains"), PartitionSpec("chains"))
        shards = [s.data for s in x.addressable_shards if s.device in firsts]
        return jax.make_array_from_single_device_arrays(x.shape, kept, shards)

    if jax.process_count() == 1:
        return tree  # `chain_layout` is for jobs only
    return jtu.tree_map(one_copy, tree)


def whole_here(tree: Any) -> Any:
    """`tree` with every array that this process holds only part of (or holds on the
    devices of other processes too) made whole on one of its own devices: fully
    addressable, as in one process. A collective in a job of several processes, which
    every process must call; in one process, `tree` itself.
    """
    leaves, treedef = jtu.tree_flatten(tree)
    elsewhere = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and not x.is_fully_addressable
    ]
    if not elsewhere:
        return tree
    split = [i for i in elsewhere if not leaves[i].is_fully_replicated]
    if split:
        shardings = tuple(_replicated_like(leaves[i]) for i in split)
        everywhere = _replicate_each([leaves[i] for i in split], shardings)
        # Finished before anything else is queued: with gloo (CPU), two programs of
        # collectives in flight at once can pair one process's gather with another's
        # next one, and the job aborts ("Received data size doesn't match"). Seen
        # once `run_chains` returned without waiting for its own gather.
        jax.block_until_ready(everywhere)
        for i, x in zip(split, everywhere, strict=True):
            leaves[i] = x
    # A replicated array is whole on each of this process's devices: one copy is kept.
    for i in elsewhere:
        leaves[i] = leaves[i].addressable_data(0)
    return jtu.tree_unflatten(treedef, leaves)


def _replicated_like(x: jax.Array) -> NamedSharding:
    """Replicated on the devices that hold `x`, so that one program can take both."""
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    return NamedSharding(member_mesh(devices), PartitionSpec())


@ft.partial(jax.jit, static_argnums=(1, 2))
def _laid_out(tree: Any, num_chains: int, sharding: NamedSharding) -> Any:
    return jtu.tree_map(
        lambda x: lax.with_sharding_constraint(x[:num_chains], sharding), tree
    )


@ft.partial(jax.jit, static_argnums=3, donate_argnums=0)
def _put_rows(joined: Any, tree: Any, start: int, sharding: NamedSharding) -> Any:
    return jtu.tree_map(
        lambda j, x: lax.with_sharding_constraint(
            lax.dynamic_update_slice_in_dim(j, x, start, 0), sharding
        ),
        joined,
        tree,
    )


@ft.partial(jax.jit, static_argnums=1)
def _replicate_each(
    leaves: list[jax.Array], shardings: tuple[NamedSharding, ...]
) -> list[jax.Array]:
    return [
        lax.with_sharding_constraint(x, s)
        for x, s in zip(leaves, shardings, strict=True)
    ]


@ft.partial(jax.jit, static_argnums=0)
def _sharded_zeros(structs: tuple[jax.ShapeDtypeStruct, ...]) -> list[jax.Array]:
    # Made on the devices that hold them, rather than on one device and then moved.
    return made_zeros(list(structs))


# `device_put` costs the host a fixed few hundred microseconds a call (tens a leaf, a
# typed key's more), on every call of a run; one program copying the leaves costs one
# dispatch, and the devices a pass over the bytes. On a CPU that pass is the host's own
# work, dearer than `device_put` past about a MiB (measured); an accelerator makes it
# at hundreds of GB/s (64 MiB at a TPU v5e's 819 GB/s: about 80 us), less than
# `device_put`'s host time, which the devices would wait out idle before the loop.
# Past that, `device_put`, which aliases an array already on its device instead of
# holding it twice.
_COPIED_BELOW = {"cpu": 1 << 20}  # bytes, of all the leaves, by the devices' platform
_COPIED_BELOW_ON_ACCELERATORS = 64 << 20


def _put_on(leaves: list[Any], shardings: list[NamedSharding]) -> list[Any]:
    """`leaves` (arrays, on the host or on devices), each committed to its sharding:
    copied there by one program if they are small for their devices and none is
    committed elsewhere (a program runs on its inputs' devices), else by
    `jax.device_put`."""
    committed = any(isinstance(x, jax.Array) and x.committed for x in leaves)
    platform = next(iter(shardings[0].device_set)).platform
    below = _COPIED_BELOW.get(platform, _COPIED_BELOW_ON_ACCELERATORS)
    if not committed and sum(x.nbytes for x in leaves) < below:
        return _copier(tuple(shardings))(leaves)
    return jax.device_put(leaves, shardings)


@ft.lru_cache(maxsize=64)
def _copier(shardings: tuple[NamedSharding, ...]) -> Any:
    return jax.jit(lambda leaves: leaves, out_shardings=list(shardings))
