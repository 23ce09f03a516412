"""New JAX arrays from host NumPy data, placed and typed like the arrays they came from.

Concrete arrays that live on the CPU are stacked and split through host NumPy (a view,
not a copy); this module turns the host results back into JAX arrays. A stacked leaf
is one array made with `jax.device_put`; a weakly typed one (stacked Python scalars)
becomes weak through `weak_scalar` or `make_weak`. The pieces of a split leaf come
from a small compiled identity program per group of row shapes and dtypes: it takes
rows of each (of any leaves of that shape) and returns them, so JAX's compiled-call
path creates the arrays in bulk. Its cache key is the row shapes and dtypes and the
rough proportions of their rows, never the number of members or leaves, and compiling
an identity is cheap, a fixed cost per program more than per argument.
"""

import functools as ft
import math
from typing import Any, NamedTuple

import jax
import numpy as np

from .._tree import is_key, is_weak, make_weak, weak_scalar


def on_cpu(x: jax.Array) -> bool:
    """Whether a concrete JAX array can go through host NumPy without a transfer."""
    return x.is_fully_addressable and all(
        device.platform == "cpu" for device in x.sharding.device_set
    )


class Placement(NamedTuple):
    """Where new arrays derived from a concrete array go."""

    committed_to: jax.sharding.Sharding | None  # committed there, if not None
    device: Any  # else uncommitted, on this device (None: the default device)


def single_device_sharding(
    device: Any, memory_kind: str | None
) -> jax.sharding.Sharding:
    """The sharding that places a whole array, of any shape, on `device`."""
    # JAX 0.12.1 deprecates the `SingleDeviceSharding` class for this constructor.
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is None:
        return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    return make(device, memory_kind=memory_kind)


def placement_of(x: jax.Array) -> Placement:
    """Where new arrays derived from the concrete array `x` go."""
    sharding = x.sharding
    devices = sharding.device_set
    if len(devices) != 1:
        # Pieces of an array sharded over several devices go, uncommitted, to the
        # default device like `jnp` results.
        return Placement(None, None)
    (device,) = devices
    if x.committed:
        # Asked of the devices rather than of the sharding's class, which JAX is
        # replacing: an array committed to one device commits its pieces there.
        return Placement(single_device_sharding(device, sharding.memory_kind), None)
    return Placement(None, device)


def key_impl(x: Any) -> Any:
    """The PRNG implementation of `x` if it holds typed keys, else `None`."""
    return jax.random.key_impl(x) if is_key(x) else None


def put_like(host: np.ndarray, like: jax.Array) -> jax.Array:
    """A new JAX array holding `host`, placed and typed (weak, key) like `like`."""
    placement = placement_of(like)
    scalar = weak_scalar(host) if is_weak(like) else None
    # A 0-d weak leaf of a default dtype arrives weak as a Python scalar.
    source = host if scalar is None else scalar
    if placement.committed_to is not None:
        out = jax.device_put(source, placement.committed_to)
    else:
        with jax.default_device(placement.device):
            out = jax.device_put(source)
    if is_weak(like) and not is_weak(out):
        return make_weak([out])[0]
    impl = key_impl(like)
    return out if impl is None else jax.random.wrap_key_data(out, impl=impl)


# Rows of one kind per call of a rows program, at the least. Its compile time grows
# with the number of arrays it returns, its per-call overhead shrinks with it.
_CHUNK = 16
# A kind with this many times a group's rows per call, or more, starts a group of its
# own rather than padding the group's calls.
_MOST_PER_CALL = 8


class _Kind(NamedTuple):
    """A row's shape, dtype and key implementation: what a rows program takes."""

    shape: tuple[int, ...]
    dtype: np.dtype
    impl: Any


def _rows_identity(
    rows: list[list[jax.Array]], impls: tuple[Any, ...]
) -> list[list[jax.Array]]:
    # Traced: the rows arrive as the program's arguments.
    return [
        kind_rows
        if impl is None
        else [jax.random.wrap_key_data(r, impl=impl) for r in kind_rows]
        for kind_rows, impl in zip(rows, impls, strict=True)
    ]


@ft.cache
def _rows_program(committed_to: jax.sharding.Sharding | None, donate: bool) -> Any:
    # The rows arrive from NumPy as new buffers, which the program may keep as its
    # outputs (donated) rather than copy: a copy per piece saved. Key data becomes
    # typed keys, which cannot keep it, so those rows are not donated.
    donated = 0 if donate else ()
    if committed_to is None:
        return jax.jit(_rows_identity, static_argnums=1, donate_argnums=donated)
    return jax.jit(
        _rows_identity,
        static_argnums=1,
        donate_argnums=donated,
        out_shardings=committed_to,
    )


def _groups(counts: dict[_Kind, int]) -> list[list[tuple[_Kind, int]]]:
    """The kinds of `counts` (rows of each) grouped to share calls of one program,
    each with its rows per call.

    A kind gets `_CHUNK` rows per call times the power of two nearest to its rows over
    the group's fewest, so that the kinds of a group run out of rows together; a group
    is one program, so a tree of many leaf shapes compiles once or a few times, not
    once per shape. The groups and rows per call depend on the kinds and the rough
    ratios of their rows, not on the numbers of leaves or members, so another tree of
    the same shapes in like proportions compiles nothing.
    """
    groups: list[list[tuple[_Kind, int]]] = []
    fewest = 0
    for kind in sorted(counts, key=counts.__getitem__):
        ratio = 1 << round(math.log2(counts[kind] / fewest)) if groups else 0
        if not groups or ratio >= _MOST_PER_CALL:
            groups.append([])
            fewest, ratio = counts[kind], 1
        groups[-1].append((kind, _CHUNK * ratio))
    # In an order of their own, so that the program is the same whatever the order of
    # the leaves.
    return [sorted(group, key=repr) for group in groups]


def _pieces(
    rows: list[list[np.ndarray]],
    per_call: list[int],
    impls: tuple[Any, ...],
    program: Any,
) -> list[list[jax.Array]]:
    """`rows` (for each kind, host arrays of its shape and dtype) as JAX arrays, each
    kind `per_call` rows a call."""
    calls = max(-(-len(r) // n) for r, n in zip(rows, per_call, strict=True))
    # Padded with copies of row 0, so that every call runs the same program.
    padded = [
        r + r[:1] * (calls * n - len(r)) for r, n in zip(rows, per_call, strict=True)
    ]
    pieces: list[list[jax.Array]] = [[] for _ in rows]
    for call in range(calls):
        args = [
            r[call * n : (call + 1) * n] for r, n in zip(padded, per_call, strict=True)
        ]
        for kind_pieces, out in zip(pieces, program(args, impls), strict=True):
            kind_pieces.extend(out)
    return [p[: len(r)] for p, r in zip(pieces, rows, strict=True)]


def rows_as_arrays(
    hosts: list[np.ndarray], key_impls: tuple[Any, ...], placement: Placement
) -> list[list[jax.Array]]:
    """For each host array (member axis first), its rows as new JAX arrays.

    `jax.device_put` of a list spends most of its time in Python, deriving the abstract
    value and sharding of every piece. A compiled call takes its NumPy arguments and
    makes its results in C++, so an identity program over rows of several shapes
    (wrapping key data into typed keys) creates the pieces in bulk. The rows of every
    leaf of one row shape, dtype and key implementation (a kind) go through the same
    program, and kinds with like numbers of rows share one (`_groups`), so a first call
    compiles one program per group of kinds, whatever the number of leaves or members.
    """
    columns: list[list[jax.Array]] = [[] for _ in hosts]
    by_kind: dict[_Kind, list[int]] = {}
    for position, (host, impl) in enumerate(zip(hosts, key_impls, strict=True)):
        if len(host):
            kind = _Kind(host.shape[1:], host.dtype, impl)
            by_kind.setdefault(kind, []).append(position)
    rows = {
        kind: [row for position in positions for row in hosts[position]]
        for kind, positions in by_kind.items()
    }
    with jax.default_device(placement.device):
        for group in _groups({kind: len(r) for kind, r in rows.items()}):
            kinds = [kind for kind, _ in group]
            impls = tuple(kind.impl for kind in kinds)
            donate = all(impl is None for impl in impls)
            split = _pieces(
                [rows[kind] for kind in kinds],
                [per_call for _, per_call in group],
                impls,
                _rows_program(placement.committed_to, donate),
            )
            for kind, pieces in zip(kinds, split, strict=True):
                start = 0
                for position in by_kind[kind]:
                    end = start + len(hosts[position])
                    columns[position] = pieces[start:end]
                    start = end
    return columns
