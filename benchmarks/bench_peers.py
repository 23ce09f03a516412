"""eqx_batch against its peers' own recipes: BlackJAX, NumPyro and Flax NNX.

Each row times what a user of the peer writes against the same job done with
eqx_batch, side by side in one run, both compiled before timing (except where a
peer's compile is part of every run, which is what its row measures). Outputs are
checked once, before timing: bit for bit where both compute the same thing, else
against the posterior's moments (or, for the ensemble, the members' losses).

- BlackJAX random walk: `jax.vmap` of BlackJAX's per-chain `inference_loop` (its
    multiple-chains how-to) over its normal random walk, against `eb.run_chains` with
    the same `step`: the loop's overhead only. 1000 chains x 1000 steps on the chains
    benchmark's nested-dict state, a standard normal.
- NumPyro: `MCMC(HMC(model), chain_method="vectorized")` on a small Bayesian linear
    regression, against `eb.run_chains` of NumPyro's own HMC kernel of the same model
    (`numpyro.infer.hmc.hmc`), bit for bit. Wall time (NumPyro traces and compiles its
    loop on every `run`), and that less the tracing and compiling JAX reports in it.
- BlackJAX HMC (fixed step size and integration steps) on the same regression, the
    how-to's recipe against `eb.run_chains` with the same step: time per draw.
- Flax NNX: the ensemble step of `benchmarks/bench_jit.py` (8 MLPs of width 32, 64
    points, per-member Adam), written as NNX's docs write an ensemble (`nnx.split_rngs`
    and `nnx.vmap` to create it, `nnx.vmap` over members in the loss, `nnx.Optimizer`
    with `optax.adam`, the step under `nnx.jit`), with and without `nnx.cached_partial`,
    against `eb.filter_jit` of bench_jit's step. NNX starts from the same weights.

A peer that cannot be imported gets rows that say so (`peer unavailable: <reason>`)
rather than failing the whole run. Install the peers with `pip install
'eqx_batch[bench]'` (`nox -s bench` does). Usage: `python benchmarks/bench_peers.py`
(or through `benchmarks/run.py peers`).
"""

import importlib
import pathlib
import sys
import time
from types import ModuleType

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from _report import interleaved, report

import eqx_batch as eb


# The chains workload and the ensemble step are the other benchmarks', written once.
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
from bench_jit import MEMBERS, OPTIMISER, step as ensemble_step  # noqa: E402
from chains_workloads import log_density  # noqa: E402


def optional(module: str) -> tuple[ModuleType | None, str]:
    """The peer `module`, or None and why it could not be imported."""
    try:
        return importlib.import_module(module), ""
    except Exception as error:  # a peer broken by a newer JAX fails in many ways
        return None, f"{type(error).__name__}: {error}"


def compare(name: str, ours: float, theirs: float, bound: float, detail: str) -> None:
    """Reports `ours / theirs` against the target `<= bound`."""
    ratio = ours / theirs
    report(name, ratio, f"<= {bound}", ratio <= bound, detail)


def check_moments(
    name: str, draws: jax.Array, mean: np.ndarray, cov: np.ndarray, tol: float
) -> None:
    """Checks that `draws` (`[chains, draws, dim]`) have the posterior's mean and
    covariance, within `tol` standard deviations of the posterior."""
    flat = np.asarray(draws, dtype=np.float64).reshape(-1, mean.shape[0])
    scale = np.sqrt(np.diag(cov))
    mean_error = np.max(np.abs(flat.mean(0) - mean) / scale)
    cov_error = np.max(
        np.abs(np.cov(flat, rowvar=False) - cov) / np.outer(scale, scale)
    )
    if mean_error > tol or cov_error > tol:
        raise AssertionError(
            f"{name}: draws off the posterior: mean by {mean_error:.3f}, covariance by "
            f"{cov_error:.3f} posterior standard deviations (tolerance {tol})"
        )


# -- BlackJAX's multiple-chains recipe, random walk --------------------------------

CHAINS = 1000
STEPS = 1000


def inference_loop(rng_key, kernel, initial_state, num_samples):
    """BlackJAX's per-chain loop, as its docs write it."""

    @jax.jit
    def one_step(state, rng_key):
        state, _ = kernel(rng_key, state)
        return state, state

    keys = jax.random.split(rng_key, num_samples)
    _, states = jax.lax.scan(one_step, initial_state, keys)
    return states


def blackjax_sides(kernel, initial_states, keys, steps):
    """BlackJAX's multi-chain recipe (`vmap` of `inference_loop`) and `run_chains` of
    the same kernel: each a function that returns the trace, ready."""

    @jax.jit
    def recipe(keys, initial_states):
        return jax.vmap(lambda key, state: inference_loop(key, kernel, state, steps))(
            keys, initial_states
        )

    def step(state, key):
        return kernel(key, state)[0]

    def ours():
        return jax.block_until_ready(
            eb.run_chains(step, initial_states, keys, steps).trace
        )

    def theirs():
        return jax.block_until_ready(recipe(keys, initial_states))

    return ours, theirs


RANDOM_WALK = f"BlackJAX vmap(inference_loop) random walk ({CHAINS} chains x {STEPS})"
RANDOM_WALK_ROWS = [(f"{RANDOM_WALK}: run_chains / recipe", 1.05)]


def blackjax_random_walk(blackjax: ModuleType) -> None:
    random_walk = blackjax.additive_step_random_walk.normal_random_walk(
        log_density, 0.5
    )
    # Started from the target itself, so that every draw has its moments.
    start = jr.normal(jr.key(1), (2, CHAINS, 3, 3))
    positions = {"layer1": {"weights": start[0]}, "layer2": {"weights": start[1]}}
    initial_states = jax.vmap(random_walk.init)(positions)
    keys = jr.split(jr.key(0), CHAINS)
    ours, theirs = blackjax_sides(random_walk.step, initial_states, keys, STEPS)

    # Different key schedules (BlackJAX splits a chain's key into one per step up
    # front; run_chains splits the carried key each step): the same target's moments,
    # to 0.1 standard deviations since a random walk's draws are strongly correlated
    # (a wrong proposal scale or acceptance would be off by more).
    for side, trace in (("ours", ours()), ("BlackJAX", theirs())):
        draws = jnp.concatenate(
            [
                trace.position[layer]["weights"].reshape(CHAINS, STEPS, 9)
                for layer in ("layer1", "layer2")
            ],
            axis=-1,
        )
        check_moments(f"{RANDOM_WALK}, {side}", draws, np.zeros(18), np.eye(18), 0.1)
    t_ours, t_theirs = interleaved(ours, theirs, repeat=3)
    ((row, bound),) = RANDOM_WALK_ROWS
    compare(
        row,
        t_ours,
        t_theirs,
        bound,
        f"{t_ours:.3f}s vs {t_theirs:.3f}s, same step, loop overhead only",
    )


# -- A small model for HMC: Bayesian linear regression ------------------------------

POINTS, FEATURES, NOISE = 100, 3, 0.5
x_data = jr.normal(jr.key(1), (POINTS, FEATURES))
y_data = x_data @ jnp.array([1.0, -2.0, 0.5]) + NOISE * jr.normal(jr.key(2), (POINTS,))
# The exact posterior of `w ~ N(0, I)`, `y ~ N(x w, NOISE^2)`.
_x, _y = np.asarray(x_data, np.float64), np.asarray(y_data, np.float64)
POSTERIOR_COV = np.linalg.inv(_x.T @ _x / NOISE**2 + np.eye(FEATURES))
POSTERIOR_MEAN = POSTERIOR_COV @ _x.T @ _y / NOISE**2
STEP_SIZE, INTEGRATION_STEPS = 0.05, 10


def posterior_draws(key: jax.Array, chains: int) -> jax.Array:
    """Exact posterior draws: chains started on the target, so every draw has its
    moments from the first step on."""
    root = np.linalg.cholesky(POSTERIOR_COV)
    noise = np.asarray(jr.normal(key, (chains, FEATURES)), np.float64)
    return jnp.asarray(POSTERIOR_MEAN + noise @ root.T, jnp.float32)


def regression_log_density(w: jax.Array) -> jax.Array:
    residual = y_data - x_data @ w
    return -0.5 * jnp.sum(w**2) - 0.5 * jnp.sum(residual**2) / NOISE**2


HMC_CHAINS, HMC_STEPS = 1000, 200
HMC = (
    f"BlackJAX vmap(inference_loop) HMC ({HMC_CHAINS} chains x {HMC_STEPS}, "
    f"{INTEGRATION_STEPS} leapfrog steps)"
)
HMC_ROWS = [(f"{HMC}: run_chains / recipe, per draw", 1.05)]


def blackjax_hmc(blackjax: ModuleType) -> None:
    hmc = blackjax.hmc(
        regression_log_density, STEP_SIZE, jnp.ones(FEATURES), INTEGRATION_STEPS
    )
    initial_states = jax.vmap(hmc.init)(posterior_draws(jr.key(3), HMC_CHAINS))
    keys = jr.split(jr.key(4), HMC_CHAINS)
    ours, theirs = blackjax_sides(hmc.step, initial_states, keys, HMC_STEPS)

    for side, trace in (("ours", ours()), ("BlackJAX", theirs())):
        check_moments(
            f"{HMC}, {side}", trace.position, POSTERIOR_MEAN, POSTERIOR_COV, 0.03
        )
    t_ours, t_theirs = interleaved(ours, theirs, repeat=5)
    per_draw = 1e6 / (HMC_CHAINS * HMC_STEPS)
    ((row, bound),) = HMC_ROWS
    compare(
        row,
        t_ours,
        t_theirs,
        bound,
        f"{t_ours * per_draw:.2f} us vs {t_theirs * per_draw:.2f} us per draw, "
        "same step",
    )


# -- NumPyro's vectorized chains --------------------------------------------------

NUMPYRO_CHAINS, NUMPYRO_STEPS = 256, 200
NUMPYRO = (
    f"NumPyro MCMC(chain_method='vectorized') HMC ({NUMPYRO_CHAINS} chains x "
    f"{NUMPYRO_STEPS}, {INTEGRATION_STEPS} leapfrog steps)"
)
NUMPYRO_ROWS = [
    (f"{NUMPYRO}: run_chains / MCMC.run, wall", 1.0),
    (f"{NUMPYRO}: run_chains / MCMC.run less its recompile", 1.05),
]


def numpyro_vectorized(numpyro: ModuleType) -> None:
    import numpyro.distributions as dist
    from numpyro.infer import HMC, MCMC
    from numpyro.infer.hmc import hmc
    from numpyro.infer.util import initialize_model

    def model(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([FEATURES]).to_event(1))
        numpyro.sample("y", dist.Normal(x @ w, NOISE), obs=y)

    # Fixed step size and number of steps, no warmup: the kernel eqx_batch runs too.
    settings = dict(
        step_size=STEP_SIZE,
        num_steps=INTEGRATION_STEPS,
        trajectory_length=None,
        adapt_step_size=False,
        adapt_mass_matrix=False,
    )
    mcmc = MCMC(
        HMC(model, **settings),
        num_warmup=0,
        num_samples=NUMPYRO_STEPS,
        num_chains=NUMPYRO_CHAINS,
        chain_method="vectorized",
        progress_bar=False,
    )
    init_params = {"w": posterior_draws(jr.key(5), NUMPYRO_CHAINS)}
    key = jr.key(6)

    def theirs():
        mcmc.run(key, x_data, y_data, init_params=init_params)
        return jax.block_until_ready(
            mcmc.get_samples(group_by_chain=True)
            | mcmc.get_extra_fields(group_by_chain=True)
        )

    # NumPyro's own HMC kernel of the same model, as its functional API runs it; a
    # chain's randomness is the key in its state, split by the kernel every step, as
    # in MCMC, so the draws are MCMC's bit for bit (run_chains' keys go unused).
    _, potential_fn_gen, _, _ = initialize_model(
        key, model, model_args=(x_data, y_data), dynamic_args=True
    )
    init_kernel, sample_kernel = hmc(potential_fn_gen=potential_fn_gen, algo="HMC")

    @jax.jit
    def initial_states(key, init_params):
        # The keys MCMC gives its chains: split per chain, then each split in two.
        chain_keys = jax.vmap(jr.split)(jr.split(key, NUMPYRO_CHAINS))[:, 0]
        return jax.vmap(
            lambda params, key: init_kernel(
                params,
                0,
                dense_mass=[],
                model_args=(x_data, y_data),
                rng_key=key,
                **settings,
            )
        )(init_params, chain_keys)

    def step(state, key):
        del key
        state = sample_kernel(state, model_args=(x_data, y_data))
        # The kernel returns its fixed number of leapfrog steps as a Python int, which
        # `lax.fori_loop` in MCMC takes as it comes; a state's leaves keep their
        # dtype in run_chains, so it is cast back to the int32 `init_kernel` gave.
        state = state._replace(num_steps=jnp.asarray(state.num_steps, jnp.int32))
        return state, {"w": state.z["w"], "diverging": state.diverging}

    def ours():
        states = initial_states(key, init_params)
        return jax.block_until_ready(
            eb.run_chains(
                step,
                states,
                jr.split(key, NUMPYRO_CHAINS),
                NUMPYRO_STEPS,
                with_output=True,
            ).outputs
        )

    got, expected = ours(), theirs()
    for leaf in ("w", "diverging"):
        np.testing.assert_array_equal(np.asarray(got[leaf]), np.asarray(expected[leaf]))

    # NumPyro traces and compiles its loop in every `run`; JAX reports how long.
    compiling = [0.0]

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event.startswith("/jax/core/compile/"):
            compiling[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    t_ours = t_theirs = t_theirs_compiled = float("inf")
    # Few repeats: every NumPyro run compiles, for seconds.
    for _ in range(2):
        start = time.perf_counter()
        ours()
        t_ours = min(t_ours, time.perf_counter() - start)
        compiling[0] = 0.0
        start = time.perf_counter()
        theirs()
        wall = time.perf_counter() - start
        t_theirs = min(t_theirs, wall)
        t_theirs_compiled = min(t_theirs_compiled, wall - compiling[0])
    jax.monitoring.unregister_event_duration_listener(listen)
    (wall_row, wall_bound), (loop_row, loop_bound) = NUMPYRO_ROWS
    compare(
        wall_row,
        t_ours,
        t_theirs,
        wall_bound,
        f"{t_ours:.3f}s vs {t_theirs:.3f}s, bit for bit; NumPyro recompiles each run",
    )
    compare(
        loop_row,
        t_ours,
        t_theirs_compiled,
        loop_bound,
        f"{t_ours:.3f}s vs {t_theirs_compiled:.3f}s (NumPyro's wall less the "
        "tracing, lowering and compiling JAX reports during it)",
    )


# -- Flax NNX's ensemble step ------------------------------------------------------

WIDTH, ENSEMBLE_POINTS, ENSEMBLE_STEPS = 32, 64, 200
NNX = (
    f"Flax NNX ensemble step ({MEMBERS} MLPs, width {WIDTH}, {ENSEMBLE_POINTS} "
    "points, Adam)"
)
NNX_ROWS = [
    (f"{NNX}: eb.filter_jit / nnx.jit", 1.0),
    (f"{NNX}: eb.filter_jit / nnx.jit + nnx.cached_partial", 1.0),
]


def nnx_ensemble(flax: ModuleType) -> None:
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        """`eqx.nn.MLP(1, 1, WIDTH, 2)` in NNX: ReLU between three linear layers."""

        def __init__(self, rngs: nnx.Rngs):
            self.layers = nnx.List(
                [
                    nnx.Linear(1, WIDTH, rngs=rngs),
                    nnx.Linear(WIDTH, WIDTH, rngs=rngs),
                    nnx.Linear(WIDTH, 1, rngs=rngs),
                ]
            )

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = nnx.relu(layer(x))
            return self.layers[-1](x)

    @nnx.split_rngs(splits=MEMBERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_ensemble(rngs: nnx.Rngs) -> MLP:
        return MLP(rngs)

    @nnx.jit
    def nnx_step(model, optimizer, x, y):
        def loss(model):
            @nnx.vmap(in_axes=0)
            def member_loss(member):
                return jnp.mean((member(x) - y) ** 2)

            losses = member_loss(model)
            return jnp.sum(losses), losses

        grads, losses = nnx.grad(loss, has_aux=True)(model)
        optimizer.update(model, grads)
        return losses

    keys = jr.split(jr.key(0), MEMBERS)
    model = eqx.filter_vmap(lambda key: eqx.nn.MLP(1, 1, WIDTH, 2, key=key))(keys)
    opt_state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    x = jr.normal(jr.key(1), (ENSEMBLE_POINTS, 1))
    y = jnp.sin(3 * x)

    def nnx_copy():
        """NNX's ensemble with our ensemble's weights (NNX's kernels are transposed)."""
        ensemble = create_ensemble(nnx.Rngs(0))
        for theirs, ours in zip(ensemble.layers, model.layers, strict=True):
            theirs.kernel.value = jnp.swapaxes(ours.weight, 1, 2)
            theirs.bias.value = ours.bias
        return ensemble, nnx.Optimizer(ensemble, optax.adam(1e-3), wrt=nnx.Param)

    ours_step = eb.filter_jit(ensemble_step)

    def ours():
        state = (model, opt_state)
        for _ in range(ENSEMBLE_STEPS):
            *state, losses = ours_step(*state, x, y)
        return jax.block_until_ready(losses)

    def nnx_loop(one_step):
        def run():
            for _ in range(ENSEMBLE_STEPS):
                losses = one_step(x, y)
            return jax.block_until_ready(losses)

        return run

    # The same training, up to the order of floating-point sums (NNX multiplies
    # `x @ kernel`, Equinox `weight @ x`): the members' losses agree closely.
    check_model, check_optimizer = nnx_copy()
    expected = np.asarray(ours())
    got = np.asarray(
        nnx_loop(lambda x, y: nnx_step(check_model, check_optimizer, x, y))()
    )
    np.testing.assert_allclose(got, expected, rtol=1e-4)

    nnx_model, nnx_optimizer = nnx_copy()
    plain = nnx_loop(lambda x, y: nnx_step(nnx_model, nnx_optimizer, x, y))
    cached = nnx_loop(nnx.cached_partial(nnx_step, nnx_model, nnx_optimizer))
    plain()
    cached()
    per_step = 1e6 / ENSEMBLE_STEPS
    for (row, bound), theirs in zip(NNX_ROWS, (plain, cached), strict=True):
        t_ours, t_theirs = interleaved(ours, theirs, repeat=5)
        compare(
            row,
            t_ours,
            t_theirs,
            bound,
            f"ours {t_ours * per_step:.0f} us, NNX {t_theirs * per_step:.0f} us per "
            "step",
        )


# Each peer: its module, the functions that measure against it, and their rows.
PEERS = [
    ("blackjax", [blackjax_random_walk, blackjax_hmc], RANDOM_WALK_ROWS + HMC_ROWS),
    ("numpyro", [numpyro_vectorized], NUMPYRO_ROWS),
    ("flax.nnx", [nnx_ensemble], NNX_ROWS),
]


if __name__ == "__main__":
    for module_name, measures, rows in PEERS:
        module, why_not = optional(module_name)
        if module is None:
            for row, bound in rows:
                detail = f"peer unavailable: {why_not}"
                report(row, float("nan"), f"<= {bound}", False, detail)
        else:
            for measure in measures:
                measure(module)
