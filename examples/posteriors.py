"""Benchmark posteriors, shipped as code (nothing is downloaded): issue 44's models.

Each model is one `Posterior`, a frozen record of plain functions that any sampler can
use (eqx_batch's, BlackJAX's, one written by hand):

- `log_density(position, data)`: the log posterior density, up to a constant that
  depends on the data only, of ONE position, a flat `jax.Array` of shape `[D]` in
  unconstrained coordinates (positive parameters as their logarithm, the log
  Jacobian added), for ONE problem's `data`. Positions and data share the default
  float dtype (float32 unless x64 is on); constants take the position's dtype.
- `simulate(key)`: ONE problem's data, drawn from the model's generative process: a
  dict of arrays whose shapes are fixed, so that problems stack along a new axis 0
  (`simulate_problems`) and `jax.vmap(log_density)` runs over them. The three
  models without data (the Gaussian, the funnel, the banana) return the dummy
  `{"unused": 0.0}` (a 0-d array, stacked to `[P]`): `eb.run_chains(data=...)`
  needs an array per problem, and every problem is then the same posterior.
- `initial(key, n)`: `n` starting points `[n, D]`, over-dispersed with respect to
  the posterior (each model's docstring says how), drawn without the data.
- `moments(data)`: the posterior mean and variance of every coordinate of the
  position, `Moments(mean [D], variance [D])` in float64 NumPy, where known: in
  closed form for the Gaussian, the funnel and the banana; by one-dimensional
  quadrature over log tau for both eight schools (to 1e-7 relative or better, for
  any data); `None` for the two regressions, whose posteriors have no such form.
- `exact(key, n, data)`: `n` independent exact draws `[n, D]` where the posterior
  can be sampled directly (the Gaussian, the funnel, the banana), else `None`.
- `reference_data`: the data of problem 0 where the literature fixes one (the
  classic eight schools data), else `None`; `simulate_problems(posterior, key, P)`
  puts it in row 0 and simulates the others.

The models (`POSTERIORS`, by name):

- "eight schools, centred" and "eight schools, non-centred" (Rubin 1981; the priors
  of posteriordb's eight_schools and of `examples/many_short_chains.py`).
- "funnel" (Neal 2003), D = 10.
- "ill-conditioned Gaussian", D = 100, condition number 10^4, randomly rotated.
- "logistic regression", D = 25, N = 100 synthetic points.
- "hierarchical logistic regression", 8 groups, non-centred, D = 28.
- "banana", the twisted Gaussian of Haario et al. (1999) in 2 dimensions, b = 0.1.

Issue 44 runs each as 1 problem x 1024 chains and as 256 problems x 16 chains (the
same model, data resimulated per problem), against BlackJAX and the moments here.

    python examples/posteriors.py [--out DIR]

It prints a table of the models (dimension, data, which reference moments exist, the
log density and gradient at a few starting points, and for the models with an exact
sampler the largest error of 100000 exact draws' moments, in Monte-Carlo standard
errors). It writes nothing (`--out` is accepted for uniformity) and ends with one line
`RESULT {...}` in JSON, for scripts and tests to read.
"""

import argparse
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np


Data = dict[str, Any]


class Moments(NamedTuple):
    """The posterior mean and variance of every coordinate of the position."""

    mean: np.ndarray  # [D], float64
    variance: np.ndarray  # [D], float64


class Posterior(NamedTuple):
    """One benchmark model; see the module's docstring for each field's contract."""

    name: str
    dimension: int  # D
    coordinates: tuple[str, ...]  # the name of each of the D coordinates
    log_density: Callable[[jax.Array, Data], jax.Array]  # ([D], data) -> []
    simulate: Callable[[jax.Array], Data]  # key -> one problem's data
    initial: Callable[[jax.Array, int], jax.Array]  # (key, n) -> [n, D]
    moments: Callable[[Data], Moments] | None  # data -> mean, variance
    exact: Callable[[jax.Array, int, Data], jax.Array] | None  # -> [n, D]
    reference_data: Data | None  # problem 0's data, where the literature fixes it


def simulate_problems(posterior: Posterior, key: jax.Array, num_problems: int) -> Data:
    """`num_problems` problems' data, stacked along axis 0: row p is
    `posterior.simulate(jr.split(key, num_problems)[p])`, except row 0, which is
    `posterior.reference_data` where the model has one (eight schools' classic data).
    """
    data = jax.vmap(posterior.simulate)(jr.split(key, num_problems))
    if posterior.reference_data is not None:
        data = {
            name: rows.at[0].set(posterior.reference_data[name])
            for name, rows in data.items()
        }
    return data


def _no_data(key: jax.Array) -> Data:
    """The dummy data of a model without data: one 0-d zero, the same for every key."""
    del key
    return {"unused": jnp.zeros(())}


def _normals(key: jax.Array, *shape: int) -> jax.Array:
    """Standard normal draws of `shape`, drawn flat and reshaped: XLA compiles a flat
    draw several times faster on a CPU than one of shape `[n, 10]`, say. Each model
    makes one such draw per call (of `simulate`, `initial`, `exact`) and slices it."""
    return jr.normal(key, (math.prod(shape),)).reshape(shape)


def _const(value: np.ndarray, like: jax.Array) -> jax.Array:
    """A NumPy constant in the dtype of `like` (the position)."""
    return jnp.asarray(value, like.dtype)


# --- Eight schools --------------------------------------------------------------------

SCHOOLS = 8
SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], np.float32)
SCHOOLS_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], np.float32)
MU_SCALE = 5.0  # mu ~ N(0, 5^2)
TAU_SCALE = 5.0  # tau ~ half-Cauchy(0, 5)


def _log_prior_mu_log_tau(mu: jax.Array, log_tau: jax.Array) -> jax.Array:
    """log p(mu) + log p(tau) + log tau (the Jacobian of tau = exp(log tau)); the
    half-Cauchy's log(1 + tau^2 / 25) as a softplus, finite for any log tau."""
    return (
        -0.5 * (mu / MU_SCALE) ** 2
        - jax.nn.softplus(2.0 * log_tau - 2.0 * math.log(TAU_SCALE))
        + log_tau
    )


def eight_schools_centred_log_density(position: jax.Array, data: Data) -> jax.Array:
    """Eight schools, centred, in (mu, log tau, theta_1..8):

        mu ~ N(0, 5^2), tau ~ half-Cauchy(0, 5), theta_j ~ N(mu, tau^2),
        y_j ~ N(theta_j, sigma_j^2), j = 1..8,

    the log Jacobian log tau added. Its funnel between log tau and theta is what makes
    it hard for HMC with the classic data.
    """
    mu, log_tau, theta = position[0], position[1], position[2:]
    return (
        _log_prior_mu_log_tau(mu, log_tau)
        - 0.5 * jnp.sum(((theta - mu) * jnp.exp(-log_tau)) ** 2)
        - SCHOOLS * log_tau
        - 0.5 * jnp.sum(((data["y"] - theta) / data["sigma"]) ** 2)
    )


def eight_schools_non_centred_log_density(position: jax.Array, data: Data) -> jax.Array:
    """Eight schools, non-centred, in (mu, log tau, theta_tilde_1..8): the model of
    the centred one with theta_j = mu + tau * theta_tilde_j, theta_tilde_j ~ N(0, 1);
    the log Jacobian log tau added. The same posterior as the centred one: the
    densities differ by 8 log tau, the log Jacobian of theta_tilde -> theta."""
    mu, log_tau, theta_tilde = position[0], position[1], position[2:]
    theta = mu + jnp.exp(log_tau) * theta_tilde
    return (
        _log_prior_mu_log_tau(mu, log_tau)
        - 0.5 * jnp.sum(theta_tilde**2)
        - 0.5 * jnp.sum(((data["y"] - theta) / data["sigma"]) ** 2)
    )


def eight_schools_simulate(key: jax.Array) -> Data:
    """One dataset from the generative process, the classic sigma kept (a design
    value, as in `examples/sbc.py`): mu, tau, theta from the prior, then y. The
    half-Cauchy's tail makes some datasets' spread large (tau > 50 in 6% of them)."""
    z = _normals(key, 3 + 2 * SCHOOLS)
    mu = MU_SCALE * z[0]
    tau = TAU_SCALE * jnp.abs(z[1] / z[2])  # a ratio of normals is Cauchy
    theta = mu + tau * z[3 : 3 + SCHOOLS]
    sigma = _const(SCHOOLS_SIGMA, z)
    return {"y": theta + sigma * z[3 + SCHOOLS :], "sigma": sigma}


def _eight_schools_initial_non_centred(key: jax.Array, n: int) -> jax.Array:
    """mu ~ N(0, 10^2), log tau ~ N(1, 1.5^2), theta_tilde ~ N(0, 1): wider than the
    classic data's posterior in mu (sd 3.3) and log tau (sd 1.2), as the starts of
    `examples/many_short_chains.py` and `benchmarks/bench_problems.py`."""
    z = _normals(key, n, 2 + SCHOOLS)
    scale = np.array([10.0, 1.5] + [1.0] * SCHOOLS)[None, :]
    shift = np.array([0.0, 1.0] + [0.0] * SCHOOLS)[None, :]
    return _const(shift, z) + _const(scale, z) * z


def _eight_schools_initial_centred(key: jax.Array, n: int) -> jax.Array:
    """The non-centred starts of the same key mapped to (mu, log tau, theta): both
    parametrisations start at the same points of the posterior."""
    start = _eight_schools_initial_non_centred(key, n)
    mu, log_tau = start[:, :1], start[:, 1:2]
    theta = mu + jnp.exp(log_tau) * start[:, 2:]
    return jnp.concatenate([mu, log_tau, theta], axis=1)


def _eight_schools_moments(data: Data, centred: bool) -> Moments:
    """The posterior mean and variance of (mu, log tau, theta or theta_tilde), by
    quadrature over u = log tau (the other coordinates are Gaussian given tau).

    With d_j = sigma_j^2 + tau^2: mu | tau, y ~ N(m, v), 1/v = 1/25 + sum_j 1/d_j,
    m = v sum_j y_j / d_j; theta_j | tau, y has mean (tau^2 y_j + sigma_j^2 m) / d_j
    and variance sigma_j^2 tau^2 / d_j + (sigma_j^2 / d_j)^2 v; theta_tilde_j =
    (theta_j - mu) / tau has mean tau (y_j - m) / d_j and variance sigma_j^2 / d_j +
    tau^2 v / d_j^2. The density of u, with mu and theta integrated out, is known up
    to a constant: p(tau) tau prod_j N(y_j; 0, d_j) sqrt(v) exp(m^2 / 2v). It is
    integrated by the trapezoid rule on u in [-30, 16] (tau from 1e-13 to 9e6) with a
    spacing of 1e-3: its tails fall as e^u below and e^(-9u) above.
    """
    y = np.asarray(data["y"], np.float64)[None, :]
    sigma2 = np.asarray(data["sigma"], np.float64)[None, :] ** 2
    u = np.linspace(-30.0, 16.0, 46_001)[:, None]
    tau2 = np.exp(2.0 * u)
    d = sigma2 + tau2
    v = 1.0 / (1.0 / MU_SCALE**2 + np.sum(1.0 / d, axis=1, keepdims=True))
    m = v * np.sum(y / d, axis=1, keepdims=True)
    log_weight = (
        -np.log1p(tau2 / TAU_SCALE**2)
        + u
        - 0.5 * np.sum(np.log(d) + y**2 / d, axis=1, keepdims=True)
        + 0.5 * np.log(v)
        + 0.5 * m**2 / v
    )
    weight = np.exp(log_weight - log_weight.max())
    weight /= np.trapezoid(weight, u, axis=0)
    if centred:
        mean_rest = (tau2 * y + sigma2 * m) / d
        var_rest = sigma2 * tau2 / d + (sigma2 / d) ** 2 * v
    else:
        tau = np.sqrt(tau2)
        mean_rest = tau * (y - m) / d
        var_rest = sigma2 / d + tau2 * v / d**2
    mean_given = np.concatenate([m, u, mean_rest], axis=1)
    var_given = np.concatenate([v, 0.0 * u, var_rest], axis=1)
    mean = np.trapezoid(weight * mean_given, u, axis=0)
    second = np.trapezoid(weight * (var_given + mean_given**2), u, axis=0)
    return Moments(mean, second - mean**2)


_CLASSIC = {"y": SCHOOLS_Y, "sigma": SCHOOLS_SIGMA}

EIGHT_SCHOOLS_CENTRED = Posterior(
    name="eight schools, centred",
    dimension=2 + SCHOOLS,
    coordinates=("mu", "log_tau", *(f"theta[{j}]" for j in range(SCHOOLS))),
    log_density=eight_schools_centred_log_density,
    simulate=eight_schools_simulate,
    initial=_eight_schools_initial_centred,
    moments=lambda data: _eight_schools_moments(data, centred=True),
    exact=None,
    reference_data=_CLASSIC,
)

EIGHT_SCHOOLS_NON_CENTRED = Posterior(
    name="eight schools, non-centred",
    dimension=2 + SCHOOLS,
    coordinates=("mu", "log_tau", *(f"theta_tilde[{j}]" for j in range(SCHOOLS))),
    log_density=eight_schools_non_centred_log_density,
    simulate=eight_schools_simulate,
    initial=_eight_schools_initial_non_centred,
    moments=lambda data: _eight_schools_moments(data, centred=False),
    exact=None,
    reference_data=_CLASSIC,
)


# --- Neal's funnel --------------------------------------------------------------------

FUNNEL_DIMENSION = 10
FUNNEL_V_SCALE = 3.0  # v ~ N(0, 3^2)


def funnel_log_density(position: jax.Array, data: Data) -> jax.Array:
    """Neal's (2003, "Slice sampling", section 8) funnel in (v, x_1..x_9):

        v ~ N(0, 3^2), x_i | v ~ N(0, e^v), i = 1..9 (D = 10).

    Exact moments: v has mean 0 and variance 9; each x_i has mean 0 and variance
    E[e^v] = e^(9/2) (about 90.0), with heavy tails (its kurtosis is 3 e^9)."""
    del data
    v, x = position[0], position[1:]
    return (
        -0.5 * (v / FUNNEL_V_SCALE) ** 2
        - 0.5 * (FUNNEL_DIMENSION - 1) * v
        - 0.5 * jnp.sum(x**2) * jnp.exp(-v)
    )


def _funnel_draw(key: jax.Array, n: int, widen: float) -> jax.Array:
    """v ~ N(0, (3 widen)^2), then x_i ~ N(0, widen^2 e^v)."""
    z = _normals(key, n, FUNNEL_DIMENSION)
    v = widen * FUNNEL_V_SCALE * z[:, :1]
    return jnp.concatenate([v, widen * jnp.exp(0.5 * v) * z[:, 1:]], axis=1)


def _funnel_moments(data: Data) -> Moments:
    del data
    variance = np.full(FUNNEL_DIMENSION, math.exp(0.5 * FUNNEL_V_SCALE**2))
    variance[0] = FUNNEL_V_SCALE**2
    return Moments(np.zeros(FUNNEL_DIMENSION), variance)


FUNNEL = Posterior(
    name="funnel",
    dimension=FUNNEL_DIMENSION,
    coordinates=("v", *(f"x[{i}]" for i in range(FUNNEL_DIMENSION - 1))),
    log_density=funnel_log_density,
    simulate=_no_data,
    # The funnel's own process, every scale widened by 1.5: v ~ N(0, 4.5^2) and
    # x_i | v ~ N(0, 1.5^2 e^v), so that chains start in the neck and the mouth.
    initial=lambda key, n: _funnel_draw(key, n, widen=1.5),
    moments=_funnel_moments,
    exact=lambda key, n, data: _funnel_draw(key, n, widen=1.0),
    reference_data=None,
)


# --- Ill-conditioned Gaussian ---------------------------------------------------------

GAUSSIAN_DIMENSION = 100
GAUSSIAN_SEED = 44  # the rotation's, fixed
# The covariance's eigenvalues, log-spaced from 10^-2 to 10^2 (standard deviations
# 0.1 to 10 along the eigenvectors): a condition number of 10^4.
GAUSSIAN_EIGENVALUES = np.logspace(-2.0, 2.0, GAUSSIAN_DIMENSION)
GAUSSIAN_MEAN = np.linspace(-1.0, 1.0, GAUSSIAN_DIMENSION)


def _haar_rotation(dimension: int, seed: int) -> np.ndarray:
    """A uniformly random orthogonal matrix: the QR factor of a Gaussian matrix, each
    column's sign fixed by R's diagonal (Mezzadri 2007), so that it is Haar and
    unique whatever sign convention LAPACK takes."""
    gaussian = np.random.default_rng(seed).standard_normal((dimension, dimension))
    q, r = np.linalg.qr(gaussian)
    return q * np.sign(np.diag(r))[None, :]


# Column k is the eigenvector of eigenvalue k: Sigma = Q diag(lambda) Q^T.
GAUSSIAN_ROTATION = _haar_rotation(GAUSSIAN_DIMENSION, GAUSSIAN_SEED)


def gaussian_log_density(position: jax.Array, data: Data) -> jax.Array:
    """N(m, Sigma), Sigma = Q diag(lambda) Q^T, D = 100: lambda log-spaced from 10^-2
    to 10^2 (condition number 10^4), Q a Haar-random rotation (seed 44, fixed), m
    evenly spaced from -1 to 1. In Q's basis the coordinates are independent, but
    every coordinate of the position mixes all the scales.

    Exact moments: mean m, variance diag(Sigma)_i = sum_k Q_ik^2 lambda_k."""
    del data
    z = (position - _const(GAUSSIAN_MEAN, position)) @ _const(
        GAUSSIAN_ROTATION, position
    )
    return -0.5 * jnp.sum(z**2 / _const(GAUSSIAN_EIGENVALUES, position))


def _gaussian_draw(key: jax.Array, n: int, widen: float) -> jax.Array:
    """m + widen * Q diag(sqrt(lambda)) z, z ~ N(0, I)."""
    z = _normals(key, n, GAUSSIAN_DIMENSION)
    scales = widen * np.sqrt(GAUSSIAN_EIGENVALUES)[None, :]
    return _const(GAUSSIAN_MEAN[None, :], z) + (z * _const(scales, z)) @ _const(
        GAUSSIAN_ROTATION.T, z
    )


def _gaussian_moments(data: Data) -> Moments:
    del data
    variance = np.sum(GAUSSIAN_ROTATION**2 * GAUSSIAN_EIGENVALUES[None, :], axis=1)
    return Moments(GAUSSIAN_MEAN.copy(), variance)


GAUSSIAN = Posterior(
    name="ill-conditioned Gaussian",
    dimension=GAUSSIAN_DIMENSION,
    coordinates=tuple(f"x[{i}]" for i in range(GAUSSIAN_DIMENSION)),
    log_density=gaussian_log_density,
    simulate=_no_data,
    # N(m, 2^2 Sigma): twice the posterior's standard deviation in every direction.
    initial=lambda key, n: _gaussian_draw(key, n, widen=2.0),
    moments=_gaussian_moments,
    exact=lambda key, n, data: _gaussian_draw(key, n, widen=1.0),
    reference_data=None,
)


# --- Logistic regression --------------------------------------------------------------

LOGISTIC_FEATURES = 25  # D, the intercept included
LOGISTIC_POINTS = 100  # N


def _outcomes(logits: jax.Array, z: jax.Array) -> jax.Array:
    """Bernoulli(sigmoid(logits)) outcomes as 0.0 or 1.0, from standard normal draws
    `z` of the same shape: Phi(z) is uniform (one draw of normals serves all; see
    `_normals`)."""
    return (jax.scipy.special.ndtr(z) < jax.nn.sigmoid(logits)).astype(logits.dtype)


def _bernoulli_logit(y: jax.Array, logits: jax.Array) -> jax.Array:
    """sum log p(y | logits) of Bernoulli outcomes y in {0, 1}."""
    return jnp.sum(
        y * jax.nn.log_sigmoid(logits) + (1.0 - y) * jax.nn.log_sigmoid(-logits)
    )


def logistic_log_density(position: jax.Array, data: Data) -> jax.Array:
    """Bayesian logistic regression, D = 25 weights w (the first the intercept's):

        w ~ N(0, I_25), y_n ~ Bernoulli(sigmoid(x_n . w)), n = 1..100,

    x_n = (1, z_n) with z_n ~ N(0, I_24): the synthetic stand-in for the German credit
    regression (24 features and an intercept) of Hoffman and Gelman's NUTS paper and
    inference-gym, with N = 100 points. No closed-form moments."""
    return -0.5 * jnp.sum(position**2) + _bernoulli_logit(
        data["y"], data["x"] @ position
    )


def logistic_simulate(key: jax.Array) -> Data:
    """Weights from the prior (new for every problem), then the features and the
    outcomes: `{"x": [100, 25], "y": [100]}` (y as 0.0 or 1.0)."""
    n, d = LOGISTIC_POINTS, LOGISTIC_FEATURES
    z = _normals(key, n + 1, d + 1)
    weights = z[n, :d]
    x = jnp.concatenate([jnp.ones((n, 1), z.dtype), z[:n, 1:d]], axis=1)
    return {"x": x, "y": _outcomes(x @ weights, z[:n, 0])}


LOGISTIC = Posterior(
    name="logistic regression",
    dimension=LOGISTIC_FEATURES,
    coordinates=("intercept", *(f"w[{i}]" for i in range(1, LOGISTIC_FEATURES))),
    log_density=logistic_log_density,
    simulate=logistic_simulate,
    # N(0, 2^2 I): twice the prior's scale, wider still than the posterior.
    initial=lambda key, n: 2.0 * _normals(key, n, LOGISTIC_FEATURES),
    moments=None,
    exact=None,
    reference_data=None,
)


# --- Hierarchical logistic regression -------------------------------------------------

GROUPS = 8
PER_GROUP = 20  # points per group: N = 160
COEFFICIENTS = 3  # per group: intercept and 2 features
HIERARCHICAL_DIMENSION = COEFFICIENTS + 1 + GROUPS * COEFFICIENTS  # 28


def hierarchical_logistic_log_density(position: jax.Array, data: Data) -> jax.Array:
    """Hierarchical (varying-coefficient) logistic regression, non-centred
    (Betancourt and Girolami 2015), in (mu_1..3, log tau, z_1,1..z_8,3), D = 28:

        mu ~ N(0, I_3), tau ~ half-Normal(0, 1), z_g ~ N(0, I_3),
        beta_g = mu + tau z_g, y_gi ~ Bernoulli(sigmoid(x_gi . beta_g)),

    8 groups g of 20 points i, x_gi = (1, features ~ N(0, I_2)); one scale tau shared
    by the 3 coefficients; the log Jacobian log tau added; z row-major, group by
    group. No closed-form moments."""
    mu = position[:COEFFICIENTS]
    log_tau = position[COEFFICIENTS]
    z = position[COEFFICIENTS + 1 :].reshape(GROUPS, COEFFICIENTS)
    beta = mu[None, :] + jnp.exp(log_tau) * z
    logits = jnp.einsum("gik,gk->gi", data["x"], beta)
    return (
        -0.5 * jnp.sum(mu**2)
        - 0.5 * jnp.exp(2.0 * log_tau)
        + log_tau
        - 0.5 * jnp.sum(z**2)
        + _bernoulli_logit(data["y"], logits)
    )


def hierarchical_logistic_simulate(key: jax.Array) -> Data:
    """mu, tau, z from the prior, then the features and outcomes of every group:
    `{"x": [8, 20, 3], "y": [8, 20]}` (y as 0.0 or 1.0)."""
    # Per group: its z, then its points' features and the normals of their outcomes;
    # one more row for mu and tau.
    z = _normals(key, GROUPS + 1, COEFFICIENTS + PER_GROUP * COEFFICIENTS)
    mu = z[GROUPS, :COEFFICIENTS]
    tau = jnp.abs(z[GROUPS, COEFFICIENTS])
    beta = mu[None, :] + tau * z[:GROUPS, :COEFFICIENTS]
    points = z[:GROUPS, COEFFICIENTS:].reshape(GROUPS, PER_GROUP, COEFFICIENTS)
    x = jnp.concatenate([jnp.ones((GROUPS, PER_GROUP, 1), z.dtype), points[..., 1:]], 2)
    logits = jnp.einsum("gik,gk->gi", x, beta)
    return {"x": x, "y": _outcomes(logits, points[..., 0])}


def _hierarchical_logistic_initial(key: jax.Array, n: int) -> jax.Array:
    """mu ~ N(0, 2^2), log tau ~ N(0, 1.5^2), z ~ N(0, 2^2): twice the prior's scale
    in mu and z, and tau from about 0.05 to 20."""
    scale = np.full(HIERARCHICAL_DIMENSION, 2.0)
    scale[COEFFICIENTS] = 1.5
    z = _normals(key, n, HIERARCHICAL_DIMENSION)
    return _const(scale[None, :], z) * z


HIERARCHICAL_LOGISTIC = Posterior(
    name="hierarchical logistic regression",
    dimension=HIERARCHICAL_DIMENSION,
    coordinates=(
        *(f"mu[{k}]" for k in range(COEFFICIENTS)),
        "log_tau",
        *(f"z[{g},{k}]" for g in range(GROUPS) for k in range(COEFFICIENTS)),
    ),
    log_density=hierarchical_logistic_log_density,
    simulate=hierarchical_logistic_simulate,
    initial=_hierarchical_logistic_initial,
    moments=None,
    exact=None,
    reference_data=None,
)


# --- Banana ---------------------------------------------------------------------------

BANANA_CURVATURE = 0.1  # b: the larger of Haario et al.'s two twists, 0.03 and 0.1
BANANA_SCALE = 10.0  # the sd of y_1


def banana_log_density(position: jax.Array, data: Data) -> jax.Array:
    """The twisted Gaussian ("banana") of Haario, Saksman and Tamminen (1999, 2001)
    in 2 dimensions, in the form of inference-gym's `Banana`, with b = 0.1:

        y_1 ~ N(0, 10^2), y_2 | y_1 ~ N(b (y_1^2 - 100), 1).

    (Haario et al.'s bends the other way, y_2 | y_1 ~ N(-b (y_1^2 - 100), 1): a
    mirror image, with the same moments.) Exact moments: both means 0; Var y_1 =
    100, Var y_2 = 1 + b^2 Var(y_1^2) = 1 + 2 b^2 10^4 = 201. Its ridge bends by
    b (y_1^2 - 100), 30 at y_1 = 20."""
    del data
    y1, y2 = position[0], position[1]
    return (
        -0.5 * (y1 / BANANA_SCALE) ** 2
        - 0.5 * (y2 - BANANA_CURVATURE * (y1**2 - BANANA_SCALE**2)) ** 2
    )


def _banana_exact(key: jax.Array, n: int) -> jax.Array:
    z = _normals(key, n, 2)
    y1 = BANANA_SCALE * z[:, 0]
    y2 = BANANA_CURVATURE * (y1**2 - BANANA_SCALE**2) + z[:, 1]
    return jnp.stack([y1, y2], axis=1)


def _banana_moments(data: Data) -> Moments:
    del data
    variance_y2 = 1.0 + 2.0 * BANANA_CURVATURE**2 * BANANA_SCALE**4
    return Moments(np.zeros(2), np.array([BANANA_SCALE**2, variance_y2]))


def _banana_initial(key: jax.Array, n: int) -> jax.Array:
    """N(0, diag(4 * 100, 4 * 201)): twice each marginal sd, mostly off the ridge."""
    z = _normals(key, n, 2)
    return z * _const(2.0 * np.sqrt(_banana_moments({}).variance)[None, :], z)


BANANA = Posterior(
    name="banana",
    dimension=2,
    coordinates=("y1", "y2"),
    log_density=banana_log_density,
    simulate=_no_data,
    initial=_banana_initial,
    moments=_banana_moments,
    exact=lambda key, n, data: _banana_exact(key, n),
    reference_data=None,
)


POSTERIORS: dict[str, Posterior] = {
    p.name: p
    for p in (
        EIGHT_SCHOOLS_CENTRED,
        EIGHT_SCHOOLS_NON_CENTRED,
        FUNNEL,
        GAUSSIAN,
        LOGISTIC,
        HIERARCHICAL_LOGISTIC,
        BANANA,
    )
}


# --- The table ------------------------------------------------------------------------


def describe(
    posterior: Posterior, key: jax.Array, problems: int = 4, chains: int = 16
) -> dict:
    """One row of the table: the model's data shapes, its log density and gradient
    at `chains` starting points of each of `problems` problems (vmapped over both),
    and, where it has an exact sampler, the largest error of 100000 exact draws'
    means and variances, in Monte-Carlo standard errors (sd / sqrt(n), and
    sqrt((m4 - sd^4) / n) with m4 the draws' fourth central moment)."""
    data_key, start_key, exact_key = jr.split(key, 3)

    @jax.jit
    def evaluate(data_key: jax.Array, start_key: jax.Array) -> tuple:
        data = simulate_problems(posterior, data_key, problems)
        points = posterior.initial(start_key, problems * chains)
        points = points.reshape(problems, chains, posterior.dimension)
        per_chain = jax.vmap(jax.value_and_grad(posterior.log_density), (0, None))
        values, grads = jax.vmap(per_chain)(points, data)
        return data, points, values, grads

    stacked, points, values, grads = evaluate(data_key, start_key)
    data = jax.tree.map(lambda rows: rows[0], stacked)
    row: dict[str, Any] = {
        "dimension": posterior.dimension,
        "data": {name: list(np.shape(leaf)) for name, leaf in data.items()},
        "moments": (
            None
            if posterior.moments is None
            else "quadrature"
            if posterior.name.startswith("eight schools")
            else "closed form"
        ),
        "exact_sampler": posterior.exact is not None,
        "log_density_shape": list(values.shape),  # [problems, chains]
        "finite": bool(jnp.all(jnp.isfinite(values)) & jnp.all(jnp.isfinite(grads))),
        "median_log_density": float(jnp.median(values)),
    }
    if posterior.moments is not None and posterior.exact is not None:
        n = 100_000
        draws = np.asarray(posterior.exact(exact_key, n, data), np.float64)
        mean, variance = posterior.moments(data)
        sd = np.sqrt(variance)
        mean_error = np.abs(draws.mean(axis=0) - mean) / (sd / math.sqrt(n))
        fourth = np.mean((draws - draws.mean(axis=0)) ** 4, axis=0)
        var_error = np.abs(draws.var(axis=0) - variance) / np.sqrt(
            (fourth - variance**2) / n
        )
        row["exact_mean_error_se"] = float(mean_error.max())
        row["exact_variance_error_se"] = float(var_error.max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.parse_args()

    rows = {
        name: describe(posterior, jr.fold_in(jr.key(0), i))
        for i, (name, posterior) in enumerate(POSTERIORS.items())
    }
    header = f"{'model':34} {'D':>4}  {'data':28} {'moments':12} {'log p (median)':>15}"
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        data = ", ".join(f"{k} {tuple(s)}" for k, s in row["data"].items())
        print(
            f"{name:34} {row['dimension']:>4}  {data:28} {row['moments'] or '-':12}"
            f" {row['median_log_density']:>15.1f}"
        )
    print(
        "\nExact draws against the stated moments (100000 draws; the largest error "
        "over the coordinates, in Monte-Carlo standard errors):"
    )
    for name, row in rows.items():
        if "exact_mean_error_se" in row:
            print(
                f"  {name:28} mean {row['exact_mean_error_se']:5.2f}"
                f"   variance {row['exact_variance_error_se']:5.2f}"
            )
    print("\nRESULT " + json.dumps({"models": rows}))


if __name__ == "__main__":
    main()
