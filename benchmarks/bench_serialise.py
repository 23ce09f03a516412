"""`eb.save` / `eb.load` of a 1000-member stacked MLP ensemble, against what a user
would write instead: `safetensors.numpy.save_file` / `load_file` of the tree's array
leaves, flattened and named by their paths, side by side in one run.

`eb.save` also writes atomically (temporary file, fsync, rename, fsync of the folder)
and records the tree's structure and CRC-32 checksums; `eb.load` also checks sizes
before reading, checks the checksums and validates every leaf against `like`. The
rows report what that costs. Usage: `python benchmarks/bench_serialise.py` (or through
`benchmarks/run.py serialise`).
"""

import pathlib
import tempfile
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import safetensors.numpy
from _report import interleaved, report

import eqx_batch as eb


MEMBERS = 1000


def save_leaves(path: pathlib.Path, tree: Any) -> None:
    """The user's save: every array leaf as a tensor named by its path."""
    leaves = jtu.tree_flatten_with_path(tree)[0]
    arrays = {jtu.keystr(p): np.asarray(x) for p, x in leaves if eqx.is_array(x)}
    safetensors.numpy.save_file(arrays, path)


def load_leaves(path: pathlib.Path, like: Any) -> Any:
    """The user's load: the tensors put back into `like` by path, as JAX arrays."""
    arrays = safetensors.numpy.load_file(path)
    leaves, treedef = jtu.tree_flatten_with_path(like)
    return jtu.tree_unflatten(
        treedef,
        [
            jnp.asarray(arrays[jtu.keystr(p)]) if eqx.is_array(x) else x
            for p, x in leaves
        ],
    )


def main() -> None:
    keys = jr.split(jr.key(0), MEMBERS)
    ensemble = eqx.filter_vmap(lambda k: eqx.nn.MLP(2, 2, 32, 2, key=k))(keys)
    ensemble = jax.block_until_ready(ensemble)
    with tempfile.TemporaryDirectory() as folder:
        ours_path = pathlib.Path(folder) / "ensemble.safetensors"
        base_path = pathlib.Path(folder) / "leaves.safetensors"
        ours, base = interleaved(
            lambda: eb.save(ours_path, ensemble),
            lambda: save_leaves(base_path, ensemble),
        )
        size = ours_path.stat().st_size
        report(
            f"eb.save, {MEMBERS}-member MLP ensemble vs safetensors save_file",
            ours / base,
            "report",
            True,
            f"{ours * 1e3:.1f} ms vs {base * 1e3:.1f} ms, {size / 1e6:.1f} MB",
        )
        ours, base = interleaved(
            lambda: jax.block_until_ready(eb.load(ours_path, like=ensemble)),
            lambda: jax.block_until_ready(load_leaves(base_path, ensemble)),
        )
        report(
            f"eb.load, {MEMBERS}-member MLP ensemble vs safetensors load_file",
            ours / base,
            "report",
            True,
            f"{ours * 1e3:.1f} ms vs {base * 1e3:.1f} ms",
        )


if __name__ == "__main__":
    main()
