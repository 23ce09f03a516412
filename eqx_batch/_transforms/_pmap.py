"""`filter_pmap`: members spread over devices with `jax.jit` and shardings.

`jax.pmap` is in maintenance mode (JAX 0.10 removed its C++ implementation), so nothing
here uses it. `filter_pmap` compiles one program over *all* members with `jax.jit` on a
1-D mesh of devices, in one of two ways:

- In general, `filter_vmap` over all members, each mapped input and output constrained
    to be split along its member axis, and XLA's SPMD partitioner giving each device its
    slice of members. When the member count does not divide evenly, the partitioner pads
    the last slices internally, but the program it partitions is still the one over
    exactly the real members: padding never reaches results, collectives over
    `axis_name` (reductions over the mapped axis, which the partitioner turns into
    cross-device ones), or random streams. This is exact by construction, where masking
    padded members by hand would have to be right for every collective.
- With exactly one member per device (and a string `axis_name`, as mesh axes need),
    `jax.shard_map` calls the function unbatched on each device's member, as `pmap`
    does, with `axis_name` naming the mesh axis. There is no padding to hide, and it
    avoids the size-1 batch axis that slows XLA's CPU kernels under `vmap`.

Across processes, the mesh holds every process's devices and the outputs are
replicated, so each process holds the whole result.
"""

import dataclasses
import functools as ft
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._compiling._compile import AsyncJit, combine, hold, StaticPart
from .._compiling._lowered import ArrayTypes, CallAdapter, Lowered
from .._errors import BatchError, bullet_list, describe, leaf_name
from .._tree import (
    is_array,
    is_tracer,
    resolve_axes,
)
from ._bind import bind_arguments
from ._mapped_call import bind_call, MappedCall
from ._outputs import join_output, OutputSkeleton, split_output
from ._shard import (
    Device,
    MEMBER_AXIS_NAME,
    member_mesh,
    member_spec,
    named_mesh,
)
from ._sizes import check_axis_size
from ._static_tracers import check_output_static
from ._vmap import filter_vmap


# ---------------------------------------------------------------------- filter_pmap


@dataclasses.dataclass(frozen=True)
class _MeshMapping:
    """How a `filter_pmap` call maps members onto devices, fixed at trace time: the
    axis specs, the axis name and size, and the mesh."""

    in_axes: StaticPart  # held whole by `hold`
    out_axes: StaticPart
    axis_name: Hashable
    axis_size: int | None
    mesh: Mesh


def _one_per_device(
    fun: Callable[..., Any], call: MappedCall, mapping: _MeshMapping, mesh: Mesh
) -> Any:
    """`fun` per member with `jax.shard_map`, for exactly one member per device.

    Each device calls `fun` on its member as is, like `jax.pmap`: `vmap` over the one
    local member would leave a size-1 batch axis that makes XLA's CPU kernels markedly
    slower. The mesh axis carries the user's `axis_name`, so collectives are the
    mesh's own, over exactly the members.

    `check_vma=False`, as `jax.pmap` runs `shard_map`: with the check, an unmapped
    input is typed invariant over the mesh axis and a member's values varying, so a
    `lax.scan` (or `while_loop`) whose carry starts from an unmapped input and takes
    in a member's values fails its carry type check, and a gradient through a
    collective differs from `filter_vmap`'s (`grad` of `psum` transposes to a
    `pvary`, where `vmap` and `pmap` transpose it to a `psum`). Without it,
    `shard_map` no longer refuses an unmapped output that varies over the members,
    so those are checked by tracing `filter_vmap`.
    """
    out_axes = combine((), mapping.out_axes)
    arrays = [i for i, leaf in enumerate(call.leaves) if is_array(leaf)]
    specs = tuple(member_spec(mesh, call.axes[i]) for i in arrays)
    skeletons: list[OutputSkeleton] = []

    def per_device(*local: Any) -> tuple[list[Any], list[Any]]:
        own = list(call.leaves)
        for i, array in zip(arrays, local, strict=True):
            axis = call.axes[i]
            own[i] = array if axis is None else jnp.squeeze(array, axis)
        mapped, unmapped, skeleton = split_output(call.invoke(fun, own), out_axes)
        skeletons.append(skeleton)
        return [jnp.expand_dims(leaf, 0) for leaf in mapped], unmapped

    mapped, unmapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=specs,
        out_specs=(member_spec(mesh, 0), PartitionSpec()),
        check_vma=False,
    )(*[call.leaves[i] for i in arrays])
    if skeletons[0].unmapped_paths:
        # Each device computes an unmapped output and one device's is taken unchecked:
        # tracing `filter_vmap` (never run) raises its error for one that depends on a
        # member, as more members than devices do.
        jax.eval_shape(lambda: _vmapped(fun, call, mapping, uneven=False))
    check_output_static(
        skeletons[0].static,
        "filter_pmap",
        compiled="With one member per device, each device runs `fun` in a compiled "
        "program (`jax.shard_map`)",
    )
    return join_output(mapped, unmapped, skeletons[0])


def _vmapped(
    fun: Callable[..., Any], call: MappedCall, mapping: _MeshMapping, uneven: bool
) -> Any:
    """`eb.filter_vmap(fun)` over all members, each device computing its own."""
    mesh = mapping.mesh
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(leaf: Any, axis: int | None) -> Any:
        if axis is None:
            return leaf
        # Pinning each mapped input to "split along its member axis" is what makes
        # the partitioner give each device its own members rather than replicate
        # the work.
        split = NamedSharding(mesh, member_spec(mesh, axis))
        if uneven:
            # Under `jax.grad` a constraint also applies to the cotangent. Pinning an
            # uneven input to "replicated" first leaves its gradient replicated: an
            # uneven split must not reach an outer `jax.jit`'s outputs, whose
            # shardings some JAX versions cannot express and refuse.
            leaf = jax.lax.with_sharding_constraint(leaf, replicated)
        return jax.lax.with_sharding_constraint(leaf, split)

    placed = [place(*pair) for pair in zip(call.leaves, call.axes, strict=True)]
    vmapped = filter_vmap(
        fun,
        in_axes=combine((), mapping.in_axes),
        out_axes=combine((), mapping.out_axes),
        axis_name=mapping.axis_name,
        axis_size=mapping.axis_size,
    )
    return call.invoke(vmapped, placed)


def _over_mesh(
    mapping: _MeshMapping, inputs: tuple[Callable[..., Any], tuple, dict]
) -> Any:
    """The program of one `filter_pmap` call: `fun(*args, **kwargs)` for every member,
    the members split over `mapping.mesh`."""
    fun, args, kwargs = inputs
    in_axes, out_axes = combine((), mapping.in_axes), combine((), mapping.out_axes)
    call, size = bind_call(fun, in_axes, mapping.axis_size, args, kwargs)
    mesh = mapping.mesh
    uneven = (size or 0) % mesh.size != 0
    if size == mesh.size and isinstance(mapping.axis_name, str | None):
        mesh = named_mesh(
            tuple(mesh.devices.flat), mapping.axis_name or MEMBER_AXIS_NAME
        )
        out = _one_per_device(fun, call, mapping, mesh)
    else:
        out = _vmapped(fun, call, mapping, uneven)
    # A jax.Array cannot be split unevenly, and every process must receive every
    # result: in both cases outputs are gathered onto every device instead.
    replicate = jax.process_count() > 1 or uneven
    out_leaves, out_treedef = jtu.tree_flatten(out)
    resolved = resolve_axes(out, out_axes, "out")
    leaf_axes = out_treedef.flatten_up_to(resolved)

    def place(leaf: Any, axis: int | None) -> Any:
        if not is_array(leaf):
            return leaf
        axis = None if axis is None or replicate else axis % np.ndim(leaf)
        spec = member_spec(mesh, axis)
        return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))

    return jtu.tree_unflatten(out_treedef, map(place, out_leaves, leaf_axes))


_PROGRAM = AsyncJit(_over_mesh)
_PROGRAM_DONATING = AsyncJit(_over_mesh, donate=("inputs",))


def _process_local(result: Any) -> Any:
    if jax.process_count() == 1:
        return result

    # Every device holds the whole (replicated) result; handing each process its local
    # copy makes the result usable there without any further collective.
    def local(leaf: Any) -> Any:
        if is_tracer(leaf):
            return leaf
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return leaf.addressable_data(0)
        return leaf

    return jtu.tree_map(local, result)


class _PmapWrapper(eqx.Module):
    _fun: Callable[..., Any]
    _in_axes: StaticPart = eqx.field(static=True)
    _out_axes: StaticPart = eqx.field(static=True)
    _axis_name: Hashable = eqx.field(static=True)
    _axis_size: int | None = eqx.field(static=True)
    _donate: str = eqx.field(static=True)
    _devices: tuple[Device, ...] | None = eqx.field(static=True)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._fun

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        program, mapping, inputs = _prepare(self, args, kwargs)
        return _run(self, lambda: program(mapping, inputs))

    def lower(self, /, *args: Any, **kwargs: Any) -> Lowered:
        """Traces and lowers for these arguments: ahead-of-time compilation.

        `.compile()` on the result gives a callable taking the same arguments.
        """
        program, mapping, inputs = _prepare(self, args, kwargs)
        return Lowered.of(program, (mapping,), (inputs,), _PmapCall(self))

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


# Module-level rather than methods: Equinox wraps each method access in a new bound
# method object, which costs microseconds on every call.
def _prepare(
    wrapper: _PmapWrapper, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[AsyncJit, _MeshMapping, tuple[Callable[..., Any], tuple, dict]]:
    # The mesh is looked up per call, not at decoration time: a function may be
    # decorated before `jax.distributed.initialize` makes other processes' devices
    # visible.
    mapping = _MeshMapping(
        in_axes=wrapper._in_axes,
        out_axes=wrapper._out_axes,
        axis_name=wrapper._axis_name,
        axis_size=wrapper._axis_size,
        mesh=member_mesh(wrapper._devices),
    )
    program = _PROGRAM if wrapper._donate == "none" else _PROGRAM_DONATING
    return program, mapping, (wrapper._fun, args, kwargs)


def _run(wrapper: _PmapWrapper, program: Callable[[], Any]) -> Any:
    """`program()`'s result, as this process's copy, with the warnings about donated
    buffers silenced if the wrapper donates "all"."""
    if wrapper._donate != "all":
        return _process_local(program())
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Some donated buffers were not usable"
        )
        return _process_local(program())


class _PmapCall(CallAdapter):
    """A compiled `filter_pmap` call: the mesh mapping was fixed when it was lowered,
    so a call gives only the program's inputs."""

    def __init__(self, wrapper: _PmapWrapper):
        self.wrapper = wrapper

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
        return ((self.wrapper._fun, args, kwargs),)

    def other_static(self) -> str:
        return (
            "this compiled function was lowered for arguments with other non-array "
            "values or another tree structure than those it is now called with. "
            "Call `.lower(...)` again with these arguments, or call the "
            "`eb.filter_pmap`-wrapped function, which compiles as needed."
        )

    def other_types(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], lowered: ArrayTypes
    ) -> str:
        return _retyped(self.wrapper._fun, args, kwargs, lowered)

    def returned(self, run: Callable[[], Any]) -> Any:
        return _run(self.wrapper, run)


def _retyped(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lowered: ArrayTypes,
) -> str:
    """The message for a compiled function called with arrays of other shapes or
    dtypes than it was lowered for, naming each by argument and path."""
    names = list(bind_arguments(fun, None, args, kwargs)[0])
    lines = []
    leaves = jtu.tree_flatten_with_path((fun, args, kwargs))[0]
    arrays = [(path, leaf) for path, leaf in leaves if is_array(leaf)]
    for (path, leaf), (shape, dtype) in zip(arrays, lowered, strict=True):
        if (np.shape(leaf), leaf.dtype) == (shape, dtype):
            continue
        where, key, *rest = path
        if where.idx == 0:
            name = leaf_name("fun", (key, *rest))
        elif where.idx == 1:
            name = leaf_name(names[key.idx], tuple(rest))
        else:
            name = leaf_name(key.key, tuple(rest))
        was = f"{dtype}[{','.join(map(str, shape))}]"
        lines.append(f"`{name}`: lowered for {was}, called with {describe(leaf)}")
    return (
        "this compiled function is called with arrays of other shapes or dtypes than "
        "it was lowered for (a compiled program is fixed to its member count and "
        "shapes):\n"
        + bullet_list(lines)
        + "\nCall `.lower(...)` again with these arguments, or call the "
        "`eb.filter_pmap`-wrapped function, which compiles as needed."
    )


@overload
def filter_pmap(
    *,
    in_axes: Any = eqx.if_array(0),
    out_axes: Any = eqx.if_array(0),
    axis_name: Hashable = None,
    axis_size: int | None = None,
    donate: Literal["all", "warn", "none"] = "none",
    devices: Sequence[Device] | None = None,
) -> Callable[[Callable[..., Any]], "_PmapWrapper"]: ...


@overload
def filter_pmap(
    fun: Callable[..., Any],
    *,
    in_axes: Any = eqx.if_array(0),
    out_axes: Any = eqx.if_array(0),
    axis_name: Hashable = None,
    axis_size: int | None = None,
    donate: Literal["all", "warn", "none"] = "none",
    devices: Sequence[Device] | None = None,
) -> "_PmapWrapper": ...


def filter_pmap(
    fun: Callable[..., Any] | None = None,
    *,
    in_axes: Any = eqx.if_array(0),
    out_axes: Any = eqx.if_array(0),
    axis_name: Hashable = None,
    axis_size: int | None = None,
    donate: Literal["all", "warn", "none"] = "none",
    devices: Sequence[Device] | None = None,
) -> Any:
    """Runs a function over many members, spread evenly over devices and processes.

    `eqx.filter_pmap` needs one member per device and goes through `jax.pmap`, which is
    in maintenance mode. This takes `eqx.filter_pmap`'s arguments and gives the same
    results for what it accepts, but compiles [`eb.filter_vmap`][] over all members
    with `jax.jit`, each mapped input split along its member axis over a 1-D mesh of
    `devices` (with exactly one member per device, it calls `fun` per device under
    `jax.shard_map` instead, as `pmap` does). So any member count works: N members
    over D devices put about N / D on each, padded internally when D does not divide
    N, and the results are exactly the program over the N real members: padding never
    reaches results, collectives over `axis_name` (`jax.lax.psum(x, axis_name)` sums
    over the N members) or random streams (each member receives exactly its own
    inputs). Results have leading axis N and equal `eb.filter_vmap`'s, up to the order
    in which a collective adds across devices.

    In a program started as several processes with `jax.distributed.initialize`, call
    it on every process with the same global inputs: the program is partitioned over
    every process's devices, and each process receives the whole result as arrays on
    its own devices, usable without further collectives.

    In one process, results are split over the devices along their member axis when D
    divides N (so the next call, or a donation, finds them in place), and replicated on
    every device otherwise. Non-array arguments are static (a new value compiles
    anew), as with `eqx.filter_pmap`. All checks run while tracing, once per
    compilation; a call that hits the cache pays only for `jax.jit`'s dispatch.

    **Arguments:**

    - `fun`: the function to run per member. May take keyword arguments.
    - `in_axes`: the member axis of each argument, as for [`eb.filter_vmap`][]: an axis
        spec (`None`, an int, or a callable such as `eqx.if_array(0)`) applied to every
        argument, a tuple of specs per positional argument, or a dict keyed by
        parameter name.
    - `out_axes`: where the member axis goes in each output, an axis-spec prefix of the
        output. Arrays with spec `None` must be the same for every member.
    - `axis_name`: a name for the member axis, for collectives such as
        `jax.lax.psum(x, axis_name)` inside `fun`.
    - `axis_size`: the member count, a non-negative int; needed only if no argument is
        mapped.
    - `donate`: `"all"` donates every array argument's buffer (and silences warnings
        about the ones that could not be reused), `"warn"` does the same but keeps the
        warnings, `"none"` (the default) donates nothing. Only buffers already placed
        as the program wants them (e.g. a previous result, or `eb.shard`'s) can be
        reused; others are copied onto the devices first. An array passed more than
        once is donated once: its other places get a copy (a buffer donated twice
        would crash the program).
    - `devices`: the devices to spread members over, in order (at least one).
        Defaults to all devices of all processes.

    **Returns:**

    The wrapped function. Its `.lower(*args, **kwargs)` lowers it ahead of time for
    those arguments; `.compile()` on that gives a callable taking the same arguments.

    **Raises:**

    - `eb.BatchError` (when called) if mapped leaves disagree on the member count or
        with `axis_size` (naming each leaf by argument name and path, and suggesting
        the `in_axes` that fixes the usual mistake), if `in_axes` does not fit the
        arguments, if a mapped leaf is not an array or lacks the member axis, or if
        `out_axes` maps a non-array output.
    - `eb.BatchError` (when wrapping) if `donate` is not one of `"all"`, `"warn"` and
        `"none"`, if `axis_size` is neither `None` nor a non-negative int, or if
        `devices` is empty; (when calling a compiled function) if its non-array
        arguments differ from those it was lowered with, or its arrays have other
        shapes or dtypes (another member count), naming each such argument.
    - `TypeError` if a call does not fit `fun`'s signature, as calling `fun` would.

    !!! Example

        ```python
        @eb.filter_pmap(axis_name="members")
        def centre(x):
            return x - jax.lax.pmean(x, "members")

        x = jnp.arange(6.0)  # 6 members over 4 devices
        assert jnp.allclose(centre(x), x - 2.5)
        compiled = centre.lower(x).compile()
        assert jnp.allclose(compiled(x), x - 2.5)
        ```
    """
    if donate not in ("all", "warn", "none"):
        raise BatchError(f"donate={donate!r} is not one of 'all', 'warn' and 'none'.")
    axis_size = check_axis_size(axis_size)
    if devices is not None and len(devices) == 0:
        raise BatchError(
            "devices is empty: pass at least one device, or devices=None for all."
        )
    if fun is None:
        return ft.partial(
            filter_pmap,
            in_axes=in_axes,
            out_axes=out_axes,
            axis_name=axis_name,
            axis_size=axis_size,
            donate=donate,
            devices=devices,
        )
    wrapper = _PmapWrapper(
        _fun=fun,
        _in_axes=hold(in_axes),
        _out_axes=hold(out_axes),
        _axis_name=axis_name,
        _axis_size=axis_size,
        _donate=donate,
        _devices=None if devices is None else tuple(devices),
    )
    return eqx.module_update_wrapper(wrapper)
