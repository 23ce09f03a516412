"""A run's identity: what makes two calls of `run_chains` the same run.

It is what decides the run's results: `init`'s structure and values, the chains' keys,
the counts, and what `step` computes: a digest of its traced program (the jaxpr) and of
the values of its constants, never its name. Every checkpoint file records it, and a
checkpoint of another run is refused, saying what differs.
"""

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .._errors import describe, qualified_name
from .._tree import host_array, is_array, is_key


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:16]


def _without_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _stable_name(x: Any) -> str:
    """A name of `x` that is the same in every process: no memory addresses."""
    # Functions, and wrappers such as `jax.custom_jvp` (`jax.nn.relu`), by name: their
    # repr would be an anonymous object at an address.
    return qualified_name(x) or _without_addresses(repr(x))


def _kind(like: Any) -> str:
    """The dtype of an array, or the implementation of typed PRNG keys."""
    if is_key(like):
        # JAX offers the implementation of arrays only.
        return str(jr.key_impl(jnp.zeros((0,), like.dtype)))
    return str(like.dtype)


def _values_digest(tree: Any, like: Any) -> str:
    """A digest of the paths and values of `tree`'s leaves, whose typed PRNG keys are
    raw data where `like` (shape-dtype structs, or arrays) has keys."""
    parts = []
    leaves, treedef = jtu.tree_flatten_with_path(tree)
    for (path, leaf), like_leaf in zip(
        leaves, treedef.flatten_up_to(like), strict=True
    ):
        parts.append(jtu.keystr(path).encode())
        if is_array(leaf):
            data = np.ascontiguousarray(host_array(leaf))
            parts.append(f"{_kind(like_leaf)}{data.shape}".encode())
            parts.append(data.tobytes())
        else:
            parts.append(_stable_name(leaf).encode())
    return _digest(*parts)


def _step_digests(program: jax.extend.core.ClosedJaxpr) -> dict[str, str]:
    """Digests of what a step computes: its traced program and its constants' values.

    The printed jaxpr names variables by position and functions by name, so it is the
    same in every process (once the addresses in reprs are dropped); the constants
    (arrays the step closes over, or is given through `functools.partial`) are
    compared by value.
    """
    text = _without_addresses(str(program.jaxpr))
    consts = list(program.consts)
    return {
        "step program": _digest(text.encode()),
        "step constants": _values_digest(consts, consts),
    }


_EXPLAINED = {
    "step program": "`step` computes something else (its traced program differs)",
    "step constants": (
        "`step`'s constants differ (arrays it closes over or is given through "
        "`functools.partial`)"
    ),
    "init values": "`init` holds other values",
    "keys": "the chains' keys differ (another `key`)",
}


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What makes two calls of `run_chains` the same run, as named strings."""

    fields: Mapping[str, str]

    @classmethod
    def of(
        cls,
        program: jax.extend.core.ClosedJaxpr,
        init: Any,
        init_like: Any,
        keys: Any,
        keys_like: jax.ShapeDtypeStruct,
        counts: Mapping[str, Any],
    ) -> "RunIdentity":
        """The identity of a run of the traced step `program` from `init` and `keys`.

        `init` (the whole state, non-array leaves included) and `keys` hold raw key
        data where `init_like` and `keys_like`, their shape-dtype structs, hold typed
        keys. `counts` holds the other arguments that change results (`num_steps`,
        `thin`...).
        """
        leaves, treedef = jtu.tree_flatten_with_path(init)
        likes = treedef.flatten_up_to(init_like)
        fields = {
            "init structure": _without_addresses(str(treedef)),
            "init leaves": "; ".join(
                f"{jtu.keystr(path)}: "
                + (describe(like) if is_array(leaf) else _stable_name(leaf))
                for (path, leaf), like in zip(leaves, likes, strict=True)
            ),
            "init values": _values_digest(init, init_like),
            "keys": _values_digest(keys, keys_like),
            **{name: str(value) for name, value in counts.items()},
            **_step_digests(program),
        }
        return cls(fields)

    @property
    def run_id(self) -> str:
        """A short digest of the whole identity: part of every file name of the run."""
        return _digest(json.dumps(dict(self.fields), sort_keys=True).encode())

    def differences(self, saved: Mapping[str, str]) -> list[str]:
        """What differs between this identity and `saved`, one line each."""
        lines = []
        for name, value in self.fields.items():
            if saved.get(name) == value:
                continue
            if name in _EXPLAINED:
                lines.append(f"{name}: {_EXPLAINED[name]}")
            else:
                lines.append(
                    f"{name}: the checkpoint has {saved.get(name, '(nothing)')}, this "
                    f"call has {value}"
                )
        return lines
