"""One process of a job that reports what it holds of each run of `held_runs`.

    python held_worker.py OUT

Run only as a job (`multiprocess_launch`). Each process saves, for every run, the rows
and bytes it holds of `final`, `trace` and `keys` and what `to_arviz()` says of them
(`held_here`), as JSON in `OUT.<process id>.json`, and the run gathered
(`chains_workloads.everything`) to `OUT.<run>.<process id>` (`eb.save`).
"""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from chains_workloads import everything, make_init, metropolis
from multiprocess_launch import initialize

import eqx_batch as eb


def held_runs() -> dict[str, eb.Chains]:
    """The runs whose layout a job's test inspects: 6 chains, which 4 devices split
    only with padding, one of them infinite from the start, with diagnostics; and 8
    chains in chunks of 3, checked by `until`."""
    init = make_init(6)
    init["layer1"]["weights"] = init["layer1"]["weights"].at[4].set(jnp.inf)
    return {
        "padded": eb.run_chains(metropolis, init, jr.key(0), 20, diagnostics=True),
        "chunked": eb.run_chains(
            metropolis,
            make_init(8),
            jr.key(1),
            40,
            chunk_size=3,
            until=eb.converged(every=10),
        ),
    }


def held_here(result: eb.Chains) -> dict:
    """What this process holds of `final`, `trace` and `keys`: each array's distinct
    rows and the bytes on its devices, beside the whole array's."""
    arrays = {
        "final": result.final["layer1"]["weights"],
        "trace": result.trace["layer1"]["weights"],
        "keys": result.keys,
    }
    held = {}
    for name, x in arrays.items():
        rows: set[int] = set()
        nbytes = 0
        for shard in x.addressable_shards:
            rows.update(range(*shard.index[0].indices(x.shape[0])))
            data = shard.data
            nbytes += (
                jr.key_data(data)
                if jnp.issubdtype(data.dtype, jax.dtypes.prng_key)
                else data
            ).nbytes
        whole = jax.eval_shape(jr.key_data, x) if name == "keys" else x
        held[name] = {
            "rows": sorted(rows),
            "bytes": nbytes,
            "whole_bytes": int(np.prod(whole.shape)) * whole.dtype.itemsize,
            "fully_addressable": x.is_fully_addressable,
        }
    try:
        result.to_arviz()
        held["to_arviz"] = "converted"
    except eb.BatchError as error:
        held["to_arviz"] = str(error)
    return held


def main(argv: list[str]) -> None:
    process_id, _ = initialize()
    (out,) = argv
    held = {}
    for name, result in held_runs().items():
        held[name] = held_here(result)
        eb.save(f"{out}.{name}.{process_id}", everything(result.gathered()))
    pathlib.Path(f"{out}.{process_id}.json").write_text(json.dumps(held))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
