"""pmap gave me one dict of stacked arrays; I want a list of per-task dicts.

The question: a function run with `jax.pmap` over several tasks (one per device)
returns a nested dict, but not one dict per task. Every leaf of the dict holds all the
tasks' values stacked along a leading axis. How do I get a list with one ordinary
dict per task, or just task 2's dict, and how do I go back again?

The answer is `eb.unstack` (one stacked pytree -> a list of pytrees), `eb.index` (one
member, without building the others) and `eb.stack` (the list -> one stacked pytree).
The round trip is exact, bit for bit, dtypes and all. At the end the same task is run
with `eb.filter_pmap`, which also takes task counts that do not divide evenly over the
devices.

This script forces 4 CPU devices, so it runs anywhere:

    python examples/pmap_outputs_to_list.py [--out DIR]

It writes `DIR/per_task.json` (default `examples/out/`) and ends with one line
`RESULT {...}` in JSON, for scripts and tests to read.
"""

import os


# Must be set before JAX starts: pretend this machine has 4 devices.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402

import eqx_batch as eb  # noqa: E402


DEFAULT_OUT = pathlib.Path(__file__).parent / "out"


def fit_task(key: jax.Array, noise: jax.Array) -> dict:
    """One task: fit a least-squares line to noisy data and report how it went.

    Returns a nested dict of arrays of different shapes and dtypes, as real code does.
    """
    x = jnp.linspace(-1.0, 1.0, 32)
    slope = jr.uniform(key, minval=-2.0, maxval=2.0)
    y = slope * x + 0.5 + noise * jr.normal(jr.fold_in(key, 1), x.shape)
    design = jnp.stack([x, jnp.ones_like(x)], axis=1)
    coef, *_ = jnp.linalg.lstsq(design, y)
    residual = y - design @ coef
    return {
        "params": {"slope": coef[0], "intercept": coef[1]},
        "metrics": {
            "mse": jnp.mean(residual**2),
            "worst_points": jnp.argsort(-jnp.abs(residual))[:3],  # int32, shape (3,)
        },
        "true_slope": slope,
    }


def show_shapes(tree: dict) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        print(f"   {jax.tree_util.keystr(path):28s} {leaf.dtype}{list(leaf.shape)}")


def exactly_equal(a: dict, b: dict) -> bool:
    """Same structure, and every leaf the same dtype, shape and bytes."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def to_python(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x).tolist(), tree)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    num_tasks = jax.device_count()
    print(f"Devices: {num_tasks} ({jax.devices()[0].platform})\n")

    # --- 1. pmap: one task per device -------------------------------------------------
    keys = jr.split(jr.key(0), num_tasks)
    noise = jnp.linspace(0.1, 0.4, num_tasks)
    stacked = jax.pmap(fit_task)(keys, noise)

    print("1. jax.pmap returned ONE dict; every leaf has a leading task axis:")
    show_shapes(stacked)
    print()

    # --- 2. one dict per task ---------------------------------------------------------
    per_task = eb.unstack(stacked)
    print(f"2. eb.unstack -> a list of {len(per_task)} dicts, one per task:")
    for i, task in enumerate(per_task):
        print(
            f"   task {i}: slope {float(task['params']['slope']):+.3f} "
            f"(true {float(task['true_slope']):+.3f}), "
            f"mse {float(task['metrics']['mse']):.4f}, "
            f"worst points {task['metrics']['worst_points'].tolist()}"
        )
    print("   each one an ordinary dict of per-task arrays:")
    show_shapes(per_task[0])
    print()

    # --- 3. just one task's dict ------------------------------------------------------
    task2 = eb.index(stacked, 2)
    same_as_list = exactly_equal(task2, per_task[2])
    print("3. eb.index(stacked, 2) gives task 2 alone, without building the others:")
    print(f"   equal to per_task[2], bit for bit: {same_as_list}\n")

    # --- 4. and back ------------------------------------------------------------------
    restacked = eb.stack(per_task)
    round_trip = exactly_equal(restacked, stacked)
    print("4. eb.stack(per_task) -> one dict of stacked arrays again.")
    print(f"   identical to pmap's output (structure, dtypes, bits): {round_trip}\n")

    json_file = args.out / "per_task.json"
    json_file.write_text(json.dumps(to_python(per_task), indent=2))
    print(f"   the list of dicts, as JSON: {json_file}\n")

    # --- 5. the same with eb.filter_pmap, for any number of tasks ---------------------
    # jax.pmap needs exactly one task per device; eb.filter_pmap spreads any number
    # of tasks over the devices (here 6 over 4) and gives the same per-task results.
    many = 6
    keys6 = jr.split(jr.key(0), many)
    noise6 = jnp.linspace(0.1, 0.4, many)
    stacked6 = eb.filter_pmap(fit_task)(keys6, noise6)
    tasks6 = eb.unstack(stacked6)
    alone = fit_task(keys6[5], noise6[5])
    close = all(
        np.allclose(a, b, atol=1e-5)
        for a, b in zip(jax.tree.leaves(tasks6[5]), jax.tree.leaves(alone), strict=True)
    )
    print(f"5. eb.filter_pmap over {many} tasks on {num_tasks} devices:")
    print(f"   eb.batch_size(result) = {eb.batch_size(stacked6)}")
    print(f"   task 5 equals fit_task run alone on its inputs: {close}\n")

    result = {
        "devices": num_tasks,
        "num_tasks": len(per_task),
        "index_matches_unstack": same_as_list,
        "round_trip_exact": round_trip,
        "filter_pmap_tasks": len(tasks6),
        "filter_pmap_matches_single": close,
        "slopes": [float(t["params"]["slope"]) for t in per_task],
        "true_slopes": [float(t["true_slope"]) for t in per_task],
        "json": str(json_file),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
