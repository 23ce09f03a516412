"""`eb.unstack` / `eb.stack` against the usual recipes, 1000 members of an MLP.

Baselines, on the array part of the model (the common partition/combine idiom):

- unstack: `jax.tree.transpose(jax.tree.structure(t), None, jax.tree.map(list, t))`;
- stack: `jax.tree.map(lambda *xs: jnp.stack(xs), *members)`.

First calls are measured in fresh subprocesses, ours and the recipe alternately, since
that is where XLA compiles; steady state is measured side by side in this process.
Usage: `python benchmarks/bench_stack.py` (or through `benchmarks/run.py stack`).
"""

import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from _report import interleaved, report

import eqx_batch as eb


MEMBERS = 1000
FRESH_REPEATS = 2


def make_stacked(members: int) -> eqx.nn.MLP:
    keys = jr.split(jr.key(0), members)
    stacked = eqx.filter_vmap(lambda k: eqx.nn.MLP(4, 4, 8, 2, key=k))(keys)
    return jax.block_until_ready(stacked)


def make_members(stacked: eqx.nn.MLP) -> list[eqx.nn.MLP]:
    # Built without eqx_batch or any XLA slicing program, so that neither side of a
    # first-call measurement finds anything compiled or cached.
    params, static = eqx.partition(stacked, eqx.is_array)
    leaves, treedef = jax.tree.flatten(params)
    hosts = [np.asarray(leaf) for leaf in leaves]
    members = []
    for i in range(hosts[0].shape[0]):
        member = jax.device_put([host[i] for host in hosts])
        members.append(eqx.combine(jax.tree.unflatten(treedef, member), static))
    return jax.block_until_ready(members)


def recipe_unstack(stacked: eqx.nn.MLP) -> list[eqx.nn.MLP]:
    params, static = eqx.partition(stacked, eqx.is_array)
    lists = jax.tree.map(list, params)
    members = jax.tree.transpose(jax.tree.structure(params), None, lists)
    return [eqx.combine(member, static) for member in members]


def recipe_stack(members: list[eqx.nn.MLP]) -> eqx.nn.MLP:
    params = [eqx.filter(member, eqx.is_array) for member in members]
    static = eqx.filter(members[0], eqx.is_array, inverse=True)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params)
    return eqx.combine(stacked, static)


OPERATIONS = {
    ("unstack", "ours"): eb.unstack,
    ("unstack", "recipe"): recipe_unstack,
    ("stack", "ours"): eb.stack,
    ("stack", "recipe"): recipe_stack,
}


def first_call(operation: str, who: str) -> float:
    """Runs in a fresh subprocess: the time of the very first call."""
    stacked = make_stacked(MEMBERS)
    argument = stacked if operation == "unstack" else make_members(stacked)
    fn = OPERATIONS[operation, who]
    start = time.perf_counter()
    jax.block_until_ready(fn(argument))
    return time.perf_counter() - start


def fresh_first_call(operation: str, who: str) -> float:
    proc = subprocess.run(
        [sys.executable, __file__, "--first", operation, who],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    for operation, limit in (("unstack", 0.15), ("stack", 0.3)):
        # The recipe's first call is seconds of compilation, so one run of it is
        # enough; ours, a hundred times shorter, takes the best of a few to see
        # through the noise of a shared machine.
        base = fresh_first_call(operation, "recipe")
        ours = min(fresh_first_call(operation, "ours") for _ in range(FRESH_REPEATS))
        report(
            f"{operation} first call, fresh process",
            ours / base,
            f"<= {limit}s",
            ours <= limit,
            f"ours {ours * 1e3:.0f} ms, recipe {base * 1e3:.0f} ms, {MEMBERS} members",
        )

    stacked = make_stacked(MEMBERS)
    members = make_members(stacked)
    for operation, argument, target in (
        ("unstack", stacked, 1.0),
        ("stack", members, 1.0),
    ):
        ours_fn, base_fn = (
            OPERATIONS[operation, "ours"],
            OPERATIONS[operation, "recipe"],
        )
        # Warm both: steady state excludes the recipe's compilations.
        jax.block_until_ready(ours_fn(argument))
        jax.block_until_ready(base_fn(argument))
        ours, base = interleaved(
            lambda f=ours_fn, a=argument: jax.block_until_ready(f(a)),
            lambda f=base_fn, a=argument: jax.block_until_ready(f(a)),
        )
        report(
            f"{operation} steady",
            ours / base,
            f"<= {target}",
            ours / base <= target,
            f"ours {ours * 1e3:.1f} ms, recipe {base * 1e3:.1f} ms",
        )

    # Linear in members: twice the members, about twice the time.
    double = make_stacked(2 * MEMBERS)
    eb.unstack(double)
    big, small = interleaved(lambda: eb.unstack(double), lambda: eb.unstack(stacked))
    report(
        "unstack time, 2000 / 1000 members",
        big / small,
        "<= 2.5",
        big / small <= 2.5,
        f"{big * 1e3:.1f} ms / {small * 1e3:.1f} ms",
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--first":
        print(first_call(sys.argv[2], sys.argv[3]))
    else:
        main()
