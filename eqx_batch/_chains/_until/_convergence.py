"""Convergence diagnostics from each chain's running moments, computed on the devices
once the run ends: R-hat, split R-hat, nested R-hat and a cross-chain ESS estimate.

The formulas are ArviZ's (`arviz_stats`, `method="identity"` and `method="split"`),
written on the moments instead of the draws; the draws themselves are never needed, so
a run with `trace=False` is diagnosed too.
"""

import functools as ft
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ..._errors import BatchError
from .._common import ProblemLayout
from ._moments import bins, merge, Moments, Summary


class Worst(NamedTuple):
    """The worst element of one leaf of a statistic: its value and where it is in the
    leaf, an index (`()` for a scalar leaf)."""

    value: float
    element: tuple[int, ...]


_STATISTICS = ("rhat", "split_rhat", "nested_rhat", "ess")


class Diagnostics(eqx.Module):
    """Convergence diagnostics of [`eb.run_chains`][]'s chains, computed on the devices
    from running moments of the recorded draws (`diagnostics=True`).

    Each statistic is a pytree shaped like one chain's state: one value per element of
    every floating-point leaf, `None` for the other leaves (integers, bools, PRNG keys).
    Which of them equal ArviZ's is said field by field; an element whose draws never
    vary (in every chain) has a NaN R-hat, as in ArviZ.

    **Fields:**

    - `rhat`: the classic R-hat of Gelman and Rubin (1992), equal to
        `arviz_stats.rhat(data, method="identity")` on the same draws.
    - `split_rhat`: R-hat of the chains split in halves, equal to
        `arviz_stats.rhat(data, method="split")`: the first `draws // 2` draws of each
        chain against its last `draws // 2` (the middle draw of an odd number is left
        out of it, as ArviZ leaves it out).
    - `nested_rhat`: nested R-hat of Margossian et al. (2024), equal to
        `arviz_stats.rhat_nested(data, superchain_ids=..., method="identity")`;
        `None` without `superchains`.
    - `ess`: a cross-chain estimate of the effective sample size, from the chains'
        means alone: the number of chains times the estimated variance of the target
        over the variance of the chains' means (`chains * var_plus / var(means)`, with
        `var_plus` R-hat's estimate of the variance). It is an online approximation,
        not ArviZ's bulk ESS: it needs many chains (it is the batch-means estimator
        with a chain as a batch, as noisy as the variance of that many means), and is
        sound only once the chains have forgotten their start (before that it is
        small, which errs on the safe side). Use `arviz_stats.ess` on the stored draws
        for the final report.

    !!! Example

        ```python
        def step(state, key):  # an AR(1) chain on every leaf; stationary: N(0, 1)
            return jax.tree.map(
                lambda x: 0.9 * x + 0.44 * jr.normal(key, x.shape), state
            )

        init = {"w": jnp.array([[-3.0, 0.0], [3.0, 1.0]])}  # 2 superchains' starts
        keys = jr.split(jr.key(0), 2 * 64)  # 64 chains per superchain
        result = eb.run_chains(
            step, init, keys, 400, superchains=2, diagnostics=True, trace=False
        )
        result.diagnostics.nested_rhat  # {'w': f32[2]}, each near 1
        result.diagnostics.worst()  # {"['w']": Worst(value=1.00..., element=(0,))}
        ```
    """

    rhat: Any
    split_rhat: Any
    nested_rhat: Any
    ess: Any

    def worst(self, statistic: str | None = None) -> dict[str, Worst]:
        """The worst element of each leaf of one statistic, worst leaf first.

        Worst is the largest value of an R-hat and the smallest ESS. NaN elements (those
        whose draws never vary) are passed over, unless a whole leaf is NaN.

        **Arguments:**

        - `statistic`: `"rhat"`, `"split_rhat"`, `"nested_rhat"` or `"ess"`; `None`
            (the default) is `"nested_rhat"` with superchains and `"rhat"` without.

        **Returns:**

        A dict from each leaf's `jax.tree_util.keystr` path (`"['layer1']['weights']"`,
        which `Chains.to_arviz` names `layer1.weights`; a state that is one array is
        `"state"`) to its worst element's `Worst(value, element)`, ordered from the
        worst leaf to the best (NaN leaves last): `next(iter(d.items()))` is the worst
        element of the state.

        **Raises:**

        `eb.BatchError` if `statistic` is none of these, or is `"nested_rhat"` for a run
        without superchains.

        !!! Example

            ```python
            path, (value, element) = next(iter(result.diagnostics.worst().items()))
            print(f"worst R-hat {value:.3f} at {path}{list(element)}")
            ```
        """
        if statistic is None:
            statistic = "rhat" if self.nested_rhat is None else "nested_rhat"
        if statistic not in _STATISTICS:
            raise BatchError(
                f"`statistic` is {statistic!r}; pass one of "
                f"{', '.join(map(repr, _STATISTICS))}."
            )
        tree = getattr(self, statistic)
        if tree is None:
            raise BatchError(
                "`statistic` is 'nested_rhat', but the chains have no superchains: "
                "ask for 'rhat'."
            )
        largest = statistic != "ess"
        found = {}
        for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
            values = np.asarray(leaf)
            if values.size == 0:
                continue
            flat = 0
            if not np.all(np.isnan(values)):
                flat = int(np.nanargmax(values) if largest else np.nanargmin(values))
            element = tuple(int(i) for i in np.unravel_index(flat, values.shape))
            found[jtu.keystr(path) or "state"] = Worst(
                float(values.flat[flat]), element
            )

        def badness(item: tuple[str, Worst]) -> tuple[bool, float]:
            value = item[1].value
            return (np.isnan(value), -value if largest else value)

        return dict(sorted(found.items(), key=badness))


def diagnose(
    moments: Moments, num_superchains: int | None, layout: ProblemLayout | None = None
) -> Diagnostics:
    """The diagnostics of every chain's `moments` (the real chains only, in order), on
    a device, in one program: of each problem of `layout` (`data=`), stacked, each
    statistic with a leading axis of problems; of the chains as one problem, with no
    such axis, if it is None (chain `c` in superchain `c // M`).

    As BlackJAX's `rhat` takes batch axes, the problems are a batch axis: the chains
    of one problem are one block (`ProblemLayout`), and one program computes every
    block's statistics at once.

    The moments are first put on one device: a program over moments split across
    devices sums in another order, so the statistics (and a stopping rule's decision)
    would change in their last bits with the chunking or the device count.
    """
    moments = jtu.tree_map(on_one_device, moments)
    if layout is None:
        return _diagnose(moments, num_superchains)
    return _diagnose_each(moments, layout, layout.superchains_each(num_superchains))


# `jax.jit` rather than `eqx.filter_jit`: its arguments are arrays and an int, and
# Equinox's wrapper costs half a millisecond a call on a TPU's host (issue 34). The
# blocks are cut in the same program: eager reshapes compile one program each.
@ft.partial(jax.jit, static_argnums=(1, 2))
def _diagnose_each(
    moments: Moments, layout: ProblemLayout, num_superchains: int | None
) -> Diagnostics:
    return diagnose_traced(moments, layout, num_superchains)


def diagnose_traced(
    moments: Moments, layout: ProblemLayout | None, num_superchains: int | None
) -> Diagnostics:
    """`diagnose`'s statistics inside the program that calls it: of each problem of
    `layout` (`num_superchains` each), or of the chains as one problem (None), then
    with a leading axis of one."""
    if layout is None:
        one = _diagnose(moments, num_superchains)
        return jtu.tree_map(lambda x: x[None], one)
    blocks = jtu.tree_map(layout.blocks, moments)
    return jax.vmap(lambda m: _diagnose(m, num_superchains))(blocks)


def on_one_device(x: Any) -> Any:
    if not isinstance(x, jax.Array) or jax.device_count() == 1:
        # With one device in all, every array is on it (`device_put` would cost a
        # tenth of a millisecond a leaf, at every check).
        return x
    if not x.is_fully_addressable:
        # Replicated over the processes of a job: this process's whole copy.
        x = x.addressable_shards[0].data
    return jax.device_put(x, jax.local_devices()[0])


@ft.partial(jax.jit, static_argnums=1)
def _diagnose(moments: Moments, num_superchains: int | None) -> Diagnostics:

    def leaf(mean: jax.Array, m2: jax.Array) -> tuple:
        first, middle, second = bins(moments, mean, m2)
        whole = merge(merge(first, middle), second)
        halves = Summary(
            *(jnp.concatenate(pair) for pair in zip(first, second, strict=True))
        )
        nested = None
        if num_superchains is not None:
            nested = _nested_rhat(whole, num_superchains)
        return _rhat(whole), _rhat(halves), nested, _ess(whole)

    per_leaf = jtu.tree_map(leaf, moments.mean, moments.m2)
    outer = jtu.tree_structure(moments.mean)
    inner = jtu.tree_structure((0, 0, None if num_superchains is None else 0, 0))
    rhat, split_rhat, nested_rhat, ess = jtu.tree_transpose(outer, inner, per_leaf)
    return Diagnostics(
        rhat=rhat,
        split_rhat=split_rhat,
        nested_rhat=None if num_superchains is None else nested_rhat,
        ess=ess,
    )


def _chain_variances(chains: Summary) -> tuple[jax.Array, jax.Array]:
    """Each chain's sample variance (`ddof=1`; 0 for one draw, as ArviZ's nested R-hat
    takes it) and the number of draws per chain."""
    n = chains.count.astype(chains.mean.dtype)
    variance = jnp.where(n > 1, chains.m2 / jnp.maximum(n - 1, 1), 0)
    return variance, n[0]


def _rhat(chains: Summary) -> jax.Array:
    # ArviZ's `_rhat`: sqrt((B / W + n - 1) / n), with B = n var(chain means).
    variance, n = _chain_variances(chains)
    within = jnp.mean(variance, axis=0)
    between = n * jnp.var(chains.mean, axis=0, ddof=1)
    return jnp.sqrt((between / within + n - 1) / n)


def _nested_rhat(chains: Summary, num_superchains: int) -> jax.Array:
    # Margossian et al. (2024), equations 4 to 8, as ArviZ's `_rhat_nested` has them.
    variance, _ = _chain_variances(chains)
    per_superchain = chains.mean.shape[0] // num_superchains

    def grouped(x: jax.Array) -> jax.Array:
        return x.reshape(num_superchains, per_superchain, *x.shape[1:])

    means = grouped(chains.mean)
    between_chains = 0
    if per_superchain > 1:
        between_chains = jnp.var(means, axis=1, ddof=1)
    within_chains = jnp.mean(grouped(variance), axis=1)
    between = jnp.var(jnp.mean(means, axis=1), axis=0, ddof=1)
    within = jnp.mean(within_chains + between_chains, axis=0)
    return jnp.sqrt(1 + between / within)


def _ess(chains: Summary) -> jax.Array:
    # The variance of a chain's mean of n draws is about var * tau / n, so the number of
    # chains times var over the variance of the means estimates chains * n / tau.
    variance, n = _chain_variances(chains)
    of_means = jnp.var(chains.mean, axis=0, ddof=1)
    var_plus = (n - 1) / n * jnp.mean(variance, axis=0) + of_means
    return chains.mean.shape[0] * var_plus / of_means
