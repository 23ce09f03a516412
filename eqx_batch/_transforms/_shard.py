"""Meshes of members, and `shard`: a stacked tree's members placed across devices.

The member axis is split over a 1-D mesh whose axis type is `Auto`, so that XLA's SPMD
partitioner decides how values between constrained inputs and outputs are split: that
is what lets a collective under `vmap` (a reduction over the member axis) become a
cross-device reduction.
"""

import functools as ft
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._errors import BatchError
from .._tree import axis_sizes, common_size, is_array, mapped_leaves


MEMBER_AXIS_NAME = "members"

# `jax.Device` is an alias pyright cannot use as a type (jaxlib ships no stub for it).
Device = Any


def member_mesh(devices: Sequence[Device] | None = None) -> Mesh:
    """A 1-D mesh over `devices` (all devices of all processes by default).

    Its axis type is `Auto`: XLA decides how values between the constrained inputs and
    outputs are split, which is what lets a collective under `vmap` (a reduction over
    the member axis) become a cross-device reduction.
    """
    return named_mesh(tuple(jax.devices() if devices is None else devices))


@ft.cache
def named_mesh(devices: tuple[Device, ...], name: str = MEMBER_AXIS_NAME) -> Mesh:
    """A 1-D `Auto` mesh over `devices` whose axis is `name`, made once per pair."""
    return Mesh(np.array(devices), (name,), axis_types=(AxisType.Auto,))


def with_auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` with every axis of type `Auto`: same devices, same names."""
    # Under `Explicit` mesh axes, JAX rejects collectives under `vmap` over a sharded
    # axis; under `Auto` ones the same program partitions.
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(
        mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim
    )


def member_spec(mesh: Mesh, axis: int | None) -> PartitionSpec:
    """Split along `axis` over all of `mesh`; replicated if `axis` is `None`."""
    if axis is None:
        return PartitionSpec()
    names = mesh.axis_names
    split = names[0] if len(names) == 1 else names
    return PartitionSpec(*([None] * axis), split)


# ---------------------------------------------------------------------------- shard


def shard(tree: Any, mesh: Mesh | None = None, *, axes: Any = eqx.if_array(0)) -> Any:
    """Places a stacked tree's members across devices, ready for `jax.jit`.

    With the member axis of every mapped leaf split over a mesh (and every other array
    leaf replicated on it), plain `jax.jit` over [`eb.filter_vmap`][] runs each
    device's members on that device: SPMD, with no pmap and no per-call transfer. The
    results stay split the same way, so the next step runs where the data already is.

    **Arguments:**

    - `tree`: a stacked pytree (e.g. an ensemble built by `eqx.filter_vmap`).
    - `mesh`: the devices to spread members over. Defaults to a 1-D mesh of all devices
        of all processes. The member axis is split over all of the mesh's axes; its
        axis types are taken as `Auto` so that collectives under `vmap` partition.
    - `axes`: the member axis of each leaf, as an axis-spec prefix of `tree` (`None`,
        an int, or a callable such as `eqx.if_array(0)`). Leaves with axis `None` are
        replicated on every device; non-array leaves are left as they are.

    **Returns:**

    `tree` with its array leaves placed on the mesh's devices.

    **Raises:**

    - `eb.BatchError` if the member count does not divide evenly over the mesh (the
        message names a leaf and says how many members to pad to), if mapped leaves
        disagree on the member count (naming each by its path in `tree`), if there is
        no mapped array leaf, if a mapped leaf is not an array or lacks its member axis,
        or if `axes` is not an axis-spec prefix of `tree`.

    !!! Example

        ```python
        keys = jr.split(jr.key(0), 8)
        ensemble = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 2, key=k))(keys)
        ensemble = eb.shard(ensemble)  # 8 members over the 4 devices: 2 each
        out = jax.jit(eb.filter_vmap(lambda m, x: m(x), in_axes=(0, None)))(
            ensemble, jnp.ones(3)
        )
        assert out.shape == (8, 2)
        ```
    """
    mesh = member_mesh() if mesh is None else with_auto_axes(mesh)
    leaves = mapped_leaves(tree, axes, "tree")
    sizes = axis_sizes(leaves, "tree")
    count = common_size(sizes)
    if count % mesh.size:
        padded = -(-count // mesh.size) * mesh.size
        raise BatchError(
            f"`{sizes[0][0]}` has {count} members, not a multiple of the mesh's "
            f"{mesh.size} devices: pad to {padded}, or use `eb.filter_pmap`."
        )
    placed = [leaf for _, leaf, _ in leaves]
    targets = [
        NamedSharding(mesh, member_spec(mesh, axis))
        for _, leaf, axis in leaves
        if is_array(leaf)
    ]
    arrays = jax.device_put([leaf for leaf in placed if is_array(leaf)], targets)
    moved = iter(arrays)
    placed = [next(moved) if is_array(leaf) else leaf for leaf in placed]
    return jtu.tree_unflatten(jtu.tree_structure(tree), placed)
