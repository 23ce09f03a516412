"""One process of the 2-process `filter_pmap` test (`test_multiprocess.py`).

`python multiprocess_worker.py OUT_DIR` joins the job `multiprocess_launch.launch` set
up, runs `computation()` and saves its results to `OUT_DIR/process<id>.npz`. The test
runs the same `computation()` in its own single process over 4 devices and compares.
"""

import pathlib
import re
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.experimental import multihost_utils

import eqx_batch as eb


MEMBERS = 6  # not a multiple of the 4 devices: padding is exercised


class Layer(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.weight @ x + self.bias)


def stacked_layers(members: int, seed: int) -> Layer:
    # NumPy rather than eqx.nn initialisers: compiling those takes seconds per process.
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((members, 2, 3), dtype=np.float32)
    bias = rng.standard_normal((members, 2), dtype=np.float32)
    return Layer(jnp.asarray(weight), jnp.asarray(bias))


def computation() -> dict[str, Any]:
    """Everything the multi-process test checks, as host arrays by name."""
    ensemble = stacked_layers(MEMBERS, seed=0)
    noise_keys = jr.split(jr.key(1), MEMBERS)

    # Collectives chosen to be exact in any order of reduction (a max, an integer
    # sum), so different collective backends must agree bit for bit.
    @eb.filter_pmap(in_axes=(eqx.if_array(0), None, 0), axis_name="members")
    def apply(model, x, key):
        y = model(x + jr.normal(key, x.shape))
        return {
            "y": y,
            "max": jax.lax.pmax(y, "members"),
            # 1 + 2 + ... + 6 = 21 exactly if padding members are left out.
            "count": jax.lax.psum(jax.lax.axis_index("members") + 1, "members"),
        }

    x = jnp.linspace(-1.0, 1.0, 3)
    out = apply(ensemble, x, noise_keys)
    # One member per device takes another route (shard_map): check it too.
    out_four = apply(stacked_layers(4, seed=3), x, noise_keys[:4])
    compiled = apply.lower(ensemble, x, noise_keys).compile()
    out_compiled = compiled(ensemble, x, noise_keys)

    # eb.shard + plain jit: results stay split over all processes' devices, so they
    # are gathered explicitly here.
    sharded = eb.shard(stacked_layers(8, seed=2))
    vmapped = eb.filter_vmap(lambda model, x: model(x), in_axes=(eqx.if_array(0), None))
    out_shard = eqx.filter_jit(vmapped)(sharded, x)
    gathered = multihost_utils.process_allgather(out_shard, tiled=True)

    leaves = jax.tree.leaves((out, out_compiled, out_four))
    results = {f"out_{key}": np.asarray(value) for key, value in out.items()}
    results.update(
        {f"compiled_{key}": np.asarray(value) for key, value in out_compiled.items()}
    )
    results.update(
        {f"four_{key}": np.asarray(value) for key, value in out_four.items()}
    )
    results["shard"] = np.asarray(gathered)
    results["fully_addressable"] = np.array(
        [leaf.is_fully_addressable for leaf in leaves]
    )
    results["device_count"] = np.array(jax.device_count())
    # The program is split over every device of the job, not run on each process's.
    partitions = re.search(r"num_partitions=(\d+)", compiled.as_text())
    results["num_partitions"] = np.array(int(partitions[1]) if partitions else 1)
    return results


if __name__ == "__main__":
    from multiprocess_launch import initialize

    process_id, _ = initialize()
    results = computation()
    np.savez(pathlib.Path(sys.argv[1]) / f"process{process_id}.npz", **results)
    jax.distributed.shutdown()
