"""New JAX arrays from host NumPy data, placed and typed like the arrays they came from.

Concrete arrays that live on the CPU are stacked and split through host NumPy (a view,
not a copy); this module turns the host results back into JAX arrays. A stacked leaf
is one array made with `jax.device_put`; a weakly typed one (stacked Python scalars)
becomes weak through `weak_scalar` or `make_weak`. The pieces of a split leaf come
from a small compiled identity program per row shape and dtype: it takes `_CHUNK` rows
(of any leaves of that shape) and returns them, so JAX's compiled-call path creates
the arrays in bulk. Its cache key is the row shape and dtype, never the number of
members or leaves, and compiling an identity is cheap.
"""

import functools as ft
from typing import Any, NamedTuple

import jax
import numpy as np

from ._tree import is_key, is_weak, make_weak, weak_scalar


def on_cpu(x: jax.Array) -> bool:
    """Whether a concrete JAX array can go through host NumPy without a transfer."""
    return x.is_fully_addressable and all(
        device.platform == "cpu" for device in x.sharding.device_set
    )


class Placement(NamedTuple):
    """Where new arrays derived from a concrete array go."""

    committed_to: jax.sharding.Sharding | None  # committed there, if not None
    device: Any  # else uncommitted, on this device (None: the default device)


def placement_of(x: jax.Array) -> Placement:
    """Where new arrays derived from the concrete array `x` go."""
    sharding = x.sharding
    if x.committed and isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return Placement(sharding, None)
    # Uncommitted arrays stay where they are; pieces of an array sharded over several
    # devices go, uncommitted, to the default device like `jnp` results.
    devices = sharding.device_set
    return Placement(None, next(iter(devices)) if len(devices) == 1 else None)


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


# Rows per call of a rows program. Its compile time grows with the number of arrays it
# returns, its per-call overhead shrinks with it; 16 rows keep a first call about as
# fast as a transfer per piece, and later calls faster.
_CHUNK = 16


def _rows_identity(rows: list[jax.Array], impl: Any) -> list[jax.Array]:
    # Traced: the rows arrive as the program's arguments.
    return (
        rows if impl is None else [jax.random.wrap_key_data(r, impl=impl) for r in rows]
    )


@ft.cache
def _rows_program(committed_to: jax.sharding.Sharding | None) -> Any:
    if committed_to is None:
        return jax.jit(_rows_identity, static_argnums=1)
    return jax.jit(_rows_identity, static_argnums=1, out_shardings=committed_to)


def _pieces(rows: list[np.ndarray], impl: Any, program: Any) -> list[jax.Array]:
    """`rows` (host arrays of one shape and dtype) as JAX arrays, `_CHUNK` a call."""
    # Padded with copies of row 0, so that every call runs the same program.
    padded = rows + rows[:1] * (-len(rows) % _CHUNK)
    pieces: list[jax.Array] = []
    for start in range(0, len(padded), _CHUNK):
        pieces.extend(program(padded[start : start + _CHUNK], impl))
    return pieces[: len(rows)]


def rows_as_arrays(
    hosts: list[np.ndarray], key_impls: tuple[Any, ...], placement: Placement
) -> list[list[jax.Array]]:
    """For each host array (member axis first), its rows as new JAX arrays.

    `jax.device_put` of a list spends most of its time in Python, deriving the abstract
    value and sharding of every piece. A compiled call takes its NumPy arguments and
    makes its results in C++, so an identity program over `_CHUNK` rows (wrapping key
    data into typed keys) creates the pieces in bulk. The rows of every leaf of one
    row shape, dtype and key implementation go through the same program, so a first
    call compiles one per distinct shape, whatever the number of leaves or members.
    """
    columns: list[list[jax.Array]] = [[] for _ in hosts]
    by_kind: dict[tuple[Any, ...], list[int]] = {}
    for position, (host, impl) in enumerate(zip(hosts, key_impls, strict=True)):
        kind = (host.shape[1:], host.dtype, impl)
        by_kind.setdefault(kind, []).append(position)
    program = _rows_program(placement.committed_to)
    with jax.default_device(placement.device):
        for (_, _, impl), positions in by_kind.items():
            rows = [row for position in positions for row in hosts[position]]
            if not rows:
                continue
            pieces = _pieces(rows, impl, program)
            start = 0
            for position in positions:
                end = start + len(hosts[position])
                columns[position] = pieces[start:end]
                start = end
    return columns
