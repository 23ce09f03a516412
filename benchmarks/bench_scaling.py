"""Costs that grow linearly with the tree: `stack`, `unstack`, `save`, `load` and the
first `run_chains` call, per leaf from 100 to 10 000 leaves and per member from 1000
to 10 000 members.

Real models have thousands of leaves; the other benchmarks use trees of 2-6. Every
call here is a *first* call, measured in a fresh process (so it includes whatever is
compiled for it), after one unrelated compiled call that pays XLA's one-off start-up.
A row reports the time per leaf (or member) at the largest size over that at the
smallest: a first call whose compile grows faster than linearly shows up as a ratio
above 1.5. Steady-state times are in the detail.

- The wide tree: a list of `n` leaves of shapes `(3,)`, `(2, 2)` and `()` in turn,
  stacked over 4 members.
- The long tree: `n` tiny members `{"w": f32[2], "b": f32[]}` stacked.

Two targets of their own:

- the first `eb.load` of 5000 weakly typed leaves (shapes `()`, `(3,)`, `(2, 2)`) over
  that of the same tree with strongly typed leaves, each in a fresh process;
- `eb.unstack` of 10 000 tiny members over the tree-transpose recipe,
  `jax.tree.transpose(jax.tree.structure(t), None, jax.tree.map(list, t))`, steady,
  side by side in this process.

Usage: `python benchmarks/bench_scaling.py` (or through `benchmarks/run.py scaling`).
"""

import json
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from _report import best_of, interleaved, measure_in_child, report

import eqx_batch as eb


LEAF_COUNTS = (100, 1000, 10_000)
MEMBER_COUNTS = (1000, 10_000)
WIDE_MEMBERS = 4
WIDE_SHAPES = ((3,), (2, 2), ())
CHAIN_STEPS = 10
# XLA's compile of the chains loop grows faster than linearly with the leaves of the
# state (about 1.2 s at 30 leaves and 4.5-5 s at 100 on this machine; the hand-written
# loop's 1.0 s and 3.2-4.1 s, with the same fusions but our finiteness check's two), so
# its row over leaves stops at 30. Packing the carried leaves into one array per chain
# does not help: the growth is in compiling the step's body.
CHAIN_LEAF_COUNTS = (10, 30)
WEAK_LEAVES = 5000
OPERATIONS = ("stack", "unstack", "save", "load", "run_chains")


def wide_members(leaves: int) -> list[list[jax.Array]]:
    """`WIDE_MEMBERS` members, each a list of `leaves` arrays of a few shapes."""
    rng = np.random.default_rng(0)
    hosts = [
        rng.standard_normal(WIDE_SHAPES[i % len(WIDE_SHAPES)]).astype(np.float32)
        for i in range(leaves)
    ]
    # Placed without eqx_batch, so that nothing of ours is compiled or cached.
    return [jax.device_put([h + m for h in hosts]) for m in range(WIDE_MEMBERS)]


def tiny_members(members: int) -> list[dict[str, jax.Array]]:
    """`members` members `{"w": f32[2], "b": f32[]}`."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((members, 2)).astype(np.float32)
    b = rng.standard_normal(members).astype(np.float32)
    placed = jax.device_put([[w[i], b[i]] for i in range(members)])
    return [{"w": pair[0], "b": pair[1]} for pair in placed]


def step(state: Any, key: jax.Array) -> Any:
    del key
    return jax.tree.map(lambda x: 0.5 * x + 1.0, state)


def recipe_chains(states: Any, keys: jax.Array) -> Any:
    """What users write instead of `run_chains`: `lax.scan` over `jax.vmap(step)`, each
    chain's key split every step, every state recorded."""

    def body(carry: tuple, _: None) -> tuple:
        states, keys = carry
        pairs = jax.vmap(jr.split)(keys)
        states = jax.vmap(step)(states, pairs[:, 1])
        return (states, pairs[:, 0]), states

    return jax.lax.scan(body, (states, keys), None, length=CHAIN_STEPS)


def first_and_steady(fn: Callable[[], object]) -> dict[str, float]:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    steady = best_of(lambda: jax.block_until_ready(fn()), 3)
    return {"first": first, "steady": steady}


def scaling_child(
    kind: str, size: int, operations: list[str]
) -> dict[str, dict[str, float]]:
    """In a fresh process: first and steady times of `operations`, in their order."""
    members = wide_members(size) if kind == "leaves" else tiny_members(size)
    jax.block_until_ready(members)
    # XLA's start-up (the first compile of the process) is not per leaf.
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.ones(3)))
    # `stack` compiles nothing on the CPU; the others get it stacked this way.
    stacked = jax.device_put(jax.tree.map(lambda *xs: np.stack(xs), *members))
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "tree.safetensors"
        if "save" not in operations:
            eb.save(path, stacked)
        calls = {
            "stack": lambda: eb.stack(members),
            "unstack": lambda: eb.unstack(stacked),
            "save": lambda: eb.save(path, stacked),
            "load": lambda: eb.load(path, like=stacked),
            "run_chains": lambda: (
                eb.run_chains(step, stacked, jr.key(0), CHAIN_STEPS).final
            ),
            "recipe": lambda: jax.jit(recipe_chains)(
                stacked, jr.split(jr.key(0), WIDE_MEMBERS)
            ),
        }
        return {name: first_and_steady(calls[name]) for name in operations}


def weak_load_child(weak: bool) -> dict[str, float]:
    """In a fresh process: the first `eb.load` of `WEAK_LEAVES` weak or strong
    leaves."""
    tree = [
        jnp.full(WIDE_SHAPES[i % len(WIDE_SHAPES)], float(i) if weak else np.float32(i))
        for i in range(WEAK_LEAVES)
    ]
    assert tree[0].weak_type == weak
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "tree.safetensors"
        eb.save(path, tree)
        start = time.perf_counter()
        loaded = jax.block_until_ready(eb.load(path, like=tree))
        seconds = time.perf_counter() - start
    assert loaded[1].weak_type == weak
    return {"seconds": seconds}


def child(argument: dict) -> None:
    if argument["mode"] == "weak_load":
        result: Any = weak_load_child(argument["weak"])
    else:
        result = scaling_child(
            argument["kind"], argument["size"], argument["operations"]
        )
    print(json.dumps(result))


def report_scaling(
    kind: str, sizes: tuple[int, ...], operations: tuple[str, ...]
) -> None:
    def measure(size: int, operations: tuple[str, ...]) -> dict:
        argument = {"mode": "scaling", "kind": kind, "size": size}
        return measure_in_child(__file__, {**argument, "operations": operations})

    if "recipe" in operations:
        # Each in its own process, so that neither finds the other's compiles cached
        # (splitting the keys, say).
        results = {
            size: {op: measure(size, (op,))[op] for op in operations} for size in sizes
        }
    else:
        results = {size: measure(size, operations) for size in sizes}
    unit = "leaf" if kind == "leaves" else "member"
    small, large = sizes[0], sizes[-1]
    for operation in operations:
        if operation == "recipe":
            continue
        per = {
            size: {k: v / size for k, v in results[size][operation].items()}
            for size in sizes
        }
        ratio = per[large]["first"] / per[small]["first"]
        firsts = ", ".join(f"{per[s]['first'] * 1e6:.0f}" for s in sizes)
        steadies = ", ".join(f"{per[s]['steady'] * 1e6:.0f}" for s in sizes)
        steady_ratio = per[large]["steady"] / per[small]["steady"]
        report(
            f"{operation} first call per {unit}, {large} / {small} {kind}",
            ratio,
            "<= 1.5",
            ratio <= 1.5,
            f"µs per {unit} at {sizes}: first {firsts}; steady {steadies} "
            f"(ratio {steady_ratio:.2f})"
            + (
                "; XLA's compile of the chains loop grows faster than its HLO, "
                "which grows linearly with the leaves"
                if operation == "run_chains" and kind == "leaves" and ratio > 1.5
                else ""
            ),
        )
    if "recipe" in operations:
        ours, recipe = results[large]["run_chains"], results[large]["recipe"]
        growth = (recipe["first"] / large) / (results[small]["recipe"]["first"] / small)
        ratio = ours["first"] / recipe["first"]
        report(
            f"run_chains first call / jit(scan(vmap(step))) recipe's, {large} {kind}",
            ratio,
            "<= 1.2",
            ratio <= 1.2,
            f"{ours['first']:.1f} s vs {recipe['first']:.1f} s; the recipe's first "
            f"call per {unit} grows {growth:.2f}x from {small} to {large} {kind}",
        )


def report_weak_load() -> None:
    strong = weak = float("inf")
    for _ in range(2):
        strong = min(
            strong,
            measure_in_child(__file__, {"mode": "weak_load", "weak": False})["seconds"],
        )
        weak = min(
            weak,
            measure_in_child(__file__, {"mode": "weak_load", "weak": True})["seconds"],
        )
    report(
        f"first load, {WEAK_LEAVES} weak / strong leaves, fresh process",
        weak / strong,
        "<= 1.5",
        weak / strong <= 1.5,
        f"weak {weak * 1e3:.0f} ms, strong {strong * 1e3:.0f} ms",
    )


def recipe_unstack(tree: Any) -> list[Any]:
    return jax.tree.transpose(jax.tree.structure(tree), None, jax.tree.map(list, tree))


def report_tiny_unstack() -> None:
    members = MEMBER_COUNTS[-1]
    stacked = eb.stack(tiny_members(members))
    jax.block_until_ready(eb.unstack(stacked))
    jax.block_until_ready(recipe_unstack(stacked))
    ours, base = interleaved(
        lambda: jax.block_until_ready(eb.unstack(stacked)),
        lambda: jax.block_until_ready(recipe_unstack(stacked)),
    )
    report(
        f"unstack steady, {members} tiny members / tree-transpose recipe",
        ours / base,
        "<= 0.8",
        ours / base <= 0.8,
        f"ours {ours * 1e3:.0f} ms, recipe {base * 1e3:.0f} ms"
        + (
            ""
            if ours / base <= 0.8
            else "; each piece is one argument of a compiled identity call, "
            f"{ours / (2 * members) * 1e6:.0f} µs per piece"
        ),
    )


def main() -> None:
    report_weak_load()
    report_tiny_unstack()
    report_scaling("leaves", LEAF_COUNTS, OPERATIONS[:-1])
    report_scaling("leaves", CHAIN_LEAF_COUNTS, ("run_chains", "recipe"))
    report_scaling("members", MEMBER_COUNTS, OPERATIONS)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        child(json.loads(sys.argv[2]))
    else:
        main()
