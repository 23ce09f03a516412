"""Chains placed on the devices: split over every device of every process, padded to a
multiple of the device count (or, for a step that sees every chain, unpadded on the
most devices they divide over).

Only host data, the same in every process, can be placed on the devices of other
processes, and typed PRNG keys cannot go there: they go as their raw data and are made
keys again on the devices.
"""

import functools as ft
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._errors import BatchError
from .._memo import BoundedCache
from .._select import take
from .._shard import Device, member_mesh
from .._tree import as_keys_like, host_array, is_array


class Placement:
    """Where a run's chains live: split over every device, padded to a multiple of
    the device count.

    The padding chains repeat chain 0: valid states whose results are dropped. Chains
    never interact, so they cannot change a real chain's bits. A chunk of a chunked run
    is padded to the size of the others (`pad_to`), so that every chunk runs the same
    compiled program.

    With `pad=False` (a step that sees every chain, which would see the padding), the
    chains are not padded but placed on the devices of `chain_devices`.
    """

    def __init__(self, num_chains: int, pad_to: int = 0, *, pad: bool = True):
        self.num_chains = num_chains
        self.mesh = member_mesh(None if pad else chain_devices(num_chains))
        size = self.mesh.size
        self.num_rows = -(-max(num_chains, pad_to) // size) * size
        # Every leaf placed here is split along its axis 0, one row per chain.
        self.split = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names[0]))
        # With one device in all, every array on the devices is where it would go.
        self._one_device = jax.device_count() == 1
        # A run asks for the zeros of the same few structs on every call.
        self._made = BoundedCache(16)

    def put(self, tree: Any) -> Any:
        """`tree` (on the host or on devices, one row per chain) split over the
        devices, padded."""
        if self.num_rows != self.num_chains:
            padding = np.zeros(self.num_rows - self.num_chains, int)
            tree = take(tree, np.r_[np.arange(self.num_chains), padding])
        if jax.process_count() > 1:
            # Only host data (the same in every process) can be placed on the devices
            # of other processes: typed keys go as their raw data, wrapped again there.
            host = jtu.tree_map(lambda x: host_array(x) if is_array(x) else x, tree)
            return as_keys_like(self._placed(host), tree)
        return self._placed(tree)

    def _placed(self, tree: Any) -> Any:
        # In one call, without `eb.shard`'s checks (which are for a user's tree), and
        # only the leaves not already split so (`device_put` costs even then).
        leaves, treedef = jtu.tree_flatten(tree)
        moving = [i for i, x in enumerate(leaves) if not self._is_split(x)]
        if not moving:
            return tree
        moved = jax.device_put([leaves[i] for i in moving], self.split)
        for i, x in zip(moving, moved, strict=True):
            leaves[i] = x
        return jtu.tree_unflatten(treedef, leaves)

    def _is_split(self, x: Any) -> bool:
        return isinstance(x, jax.Array) and (
            # Asked of a typed key array, `sharding` costs tens of microseconds.
            self._one_device or x.sharding.is_equivalent_to(self.split, x.ndim)
        )

    def real_chains(self, tree: Any) -> Any:
        """The rows of the real chains (padding dropped), whole on every process."""
        if self.num_rows != self.num_chains:
            tree = take(tree, np.arange(self.num_chains))
        if jax.process_count() > 1:
            # Each process would otherwise hold only its devices' chains; like
            # `eb.filter_pmap`, every process gets whole results.
            tree = self.replicated(tree)
        return tree

    def replicated(self, tree: Any) -> Any:
        """`tree` replicated: every process holds all of it (a collective)."""
        return _replicate(tree, NamedSharding(self.mesh, PartitionSpec()))

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


def chain_devices(num_chains: int) -> list[Device]:
    """The most devices that `num_chains` chains split over evenly, as many of each
    process: the first `k` devices of every process, `k` the largest count of devices
    per process for which the processes' devices divide the chains.

    **Raises:**

    `BatchError` if the number of processes does not divide the chains.
    """
    processes = jax.process_count()
    local = jax.local_device_count()
    per_process = next(
        (k for k in range(local, 0, -1) if num_chains % (processes * k) == 0), 0
    )
    if per_process == 0:
        raise BatchError(
            f"{num_chains} chains cannot be split evenly over the {processes} "
            "processes of this job, and an `eb.all_chains` step sees every chain, so "
            "none can be padding. Run a multiple of "
            f"{processes} chains (one or more per process)."
        )
    taken: dict[int, int] = {}
    devices = []
    for device in jax.devices():
        if taken.get(device.process_index, 0) < per_process:
            taken[device.process_index] = taken.get(device.process_index, 0) + 1
            devices.append(device)
    return devices


@ft.partial(jax.jit, static_argnums=(1,))
def _replicate(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    return jtu.tree_map(lambda x: lax.with_sharding_constraint(x, sharding), tree)


@ft.partial(jax.jit, static_argnums=0)
def _sharded_zeros(structs: tuple[jax.ShapeDtypeStruct, ...]) -> list[jax.Array]:
    # Made on the devices that hold them, rather than on one device and then moved.
    return made_zeros(list(structs))
