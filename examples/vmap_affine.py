"""Batching an affine map and a linear classifier, and the errors along the way.

The question: I wrote `affine(x, w, b) = x @ w.T + b` for ONE example. How do I run
it on a batch, with weights shared by every example or with one set of weights per
example? And when I get the batching wrong, what does the error tell me?

This script shows, in order:

1. the raw shape error from calling the one-example function on a batch;
2. `eb.filter_vmap` with `in_axes=(0, None, None)` (shared weights) and with the
   default in_axes (every argument batched: per-example weights);
3. the error eqx_batch gives when `in_axes` is wrong, next to `jax.vmap`'s: it
   names the argument (and the leaf inside it, for a model) and suggests the
   `in_axes` that fixes it;
4. a small linear classifier (an `eqx.Module` with jaxtyping field annotations),
   fitted by least squares, applied to a batch, then as a bootstrap ensemble;
5. the errors `eb.Stacked` and `@eb.typecheck` give for wrong shapes.

    python examples/vmap_affine.py [--out DIR]

It writes nothing (`--out` is accepted for uniformity) and ends with one line
`RESULT {...}` in JSON, for scripts and tests to read.
"""

import argparse
import json
import pathlib
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Int

import eqx_batch as eb


def affine(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """ONE example: `x` has shape `[in]`, `w` `[out, in]`, `b` `[out]`."""
    return x @ w.T + b


def show_error(title: str, error: Exception) -> str:
    message = f"{type(error).__name__}: {error}"
    print(f"   {title}:")
    print(textwrap.indent(message, "   | "))
    return message


class LinearClassifier(eqx.Module):
    """Scores each class with an affine map; the highest score wins."""

    weight: Float[Array, "classes features"]
    bias: Float[Array, " classes"]

    def __call__(self, x: Float[Array, " features"]) -> Int[Array, ""]:
        return jnp.argmax(affine(x, self.weight, self.bias))


def fit_classifier(
    indices: Int[Array, " m"], x: Float[Array, "b features"], labels: Int[Array, " b"]
) -> LinearClassifier:
    """Least squares on one-hot targets, using the examples at `indices`."""
    x, labels = x[indices], labels[indices]
    design = jnp.concatenate([x, jnp.ones((x.shape[0], 1))], axis=1)
    targets = jax.nn.one_hot(labels, 3)
    coef, *_ = jnp.linalg.lstsq(design, targets)
    return LinearClassifier(weight=coef[:-1].T, bias=coef[-1])


@eb.typecheck
def ensemble_predict(
    models: eb.Stacked[LinearClassifier, " n"], x: Float[Array, "n b features"]
) -> Int[Array, "n b"]:
    """Each of `n` stacked classifiers labels its own batch of examples."""
    return eb.filter_vmap(lambda model, x: jax.vmap(model)(x))(models, x)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.parse_args()

    batch, n_in, n_out = 5, 3, 2
    x_key, w_key, b_key = jr.split(jr.key(0), 3)
    x = jr.normal(x_key, (batch, n_in))
    w = jr.normal(w_key, (n_out, n_in))
    b = jr.normal(b_key, (n_out,))
    ws = jr.normal(w_key, (batch, n_out, n_in))  # one weight matrix per example
    bs = jr.normal(b_key, (batch, n_out))

    # --- 1. The one-example function on a batch ---------------------------------------
    print(f"1. affine on one example: x {x[0].shape} -> {affine(x[0], w, b).shape}")
    # With shared weights `x @ w.T` happens to broadcast over a batch of x. With one
    # weight matrix per example it cannot: `.T` reverses all three axes of `ws`.
    try:
        affine(x, ws, bs)
        raw_error = ""
    except TypeError as e:
        raw_error = show_error("affine(x[5, 3], ws[5, 2, 3], bs[5, 2]) raises", e)

    # --- 2. Batched with eb.filter_vmap -----------------------------------------------
    shared = eb.filter_vmap(affine, in_axes=(0, None, None))(x, w, b)
    per_example = eb.filter_vmap(affine)(x, ws, bs)  # default: every argument batched
    loop_shared = jnp.stack([affine(x[i], w, b) for i in range(batch)])
    loop_per_example = jnp.stack([affine(x[i], ws[i], bs[i]) for i in range(batch)])
    shared_ok = bool(jnp.allclose(shared, loop_shared, atol=1e-6))
    per_example_ok = bool(jnp.allclose(per_example, loop_per_example, atol=1e-6))
    print("\n2. eb.filter_vmap:")
    print(
        f"   shared weights, in_axes=(0, None, None): {shared.shape}; "
        f"equals a Python loop: {shared_ok}"
    )
    print(
        f"   per-example weights, default in_axes:    {per_example.shape}; "
        f"equals a Python loop: {per_example_ok}"
    )

    # --- 3. The wrong in_axes ---------------------------------------------------------
    print("\n3. Shared weights, but in_axes says w is batched too:")
    try:
        jax.vmap(affine, in_axes=(0, 0, None))(x, w, b)
        jax_error = ""
    except ValueError as e:
        jax_error = show_error("jax.vmap(affine, in_axes=(0, 0, None)) raises", e)
    try:
        eb.filter_vmap(affine, in_axes=(0, 0, None))(x, w, b)
        eb_error = ""
    except eb.BatchError as e:
        eb_error = show_error("eb.filter_vmap(affine, in_axes=(0, 0, None)) raises", e)

    # --- 4. A linear classifier -------------------------------------------------------
    data_key, boot_key = jr.split(jr.key(1))
    centres = jnp.array([[-2.0, 0.0], [2.0, 0.0], [0.0, 2.5]])
    labels = jnp.repeat(jnp.arange(3), 40)
    points = centres[labels] + 0.7 * jr.normal(data_key, (labels.shape[0], 2))
    everything = jnp.arange(labels.shape[0])

    model = fit_classifier(everything, points, labels)
    predicted = eb.filter_vmap(model)(points)  # the model has no batch axis: one model
    accuracy = float(jnp.mean(predicted == labels))
    print(f"\n4. A linear classifier fitted to {labels.shape[0]} points in 3 classes:")
    print(f"   eb.filter_vmap(model)(points) -> labels {predicted.shape}")
    print(f"   training accuracy: {accuracy:.1%}")

    # A bootstrap ensemble: fit one classifier per resample, all in one call.
    members = 4
    resamples = jr.randint(boot_key, (members, labels.shape[0]), 0, labels.shape[0])
    ensemble = eb.filter_vmap(fit_classifier, in_axes=(0, None, None))(
        resamples, points, labels
    )
    member_x = jnp.broadcast_to(points, (members, *points.shape))
    votes = ensemble_predict(ensemble, member_x)
    member_accuracy = np.asarray(jnp.mean(votes == labels, axis=1))
    print(
        f"   bootstrap ensemble of {eb.batch_size(ensemble)}: weight "
        f"{ensemble.weight.shape}, accuracies {np.round(member_accuracy, 3)}"
    )

    # --- 5. Shape errors from eb.Stacked / @eb.typecheck ------------------------------
    print("\n5. ensemble_predict(models: Stacked[LinearClassifier, 'n'],")
    print("                    x: Float[Array, 'n b features']) with wrong shapes:")
    try:
        ensemble_predict(ensemble, member_x[:3])
        count_error = ""
    except TypeError as e:  # jaxtyping.TypeCheckError is a TypeError
        count_error = show_error("4 models but x for 3 of them", e)
    try:
        ensemble_predict(model, member_x)
        unstacked_error = ""
    except TypeError as e:
        unstacked_error = show_error("one (unstacked) model instead of a stack", e)

    result = {
        "raw_error": "dot_general" in raw_error,
        "shared_matches_loop": shared_ok,
        "per_example_matches_loop": per_example_ok,
        "jax_error_names_argument": "argument w" in jax_error,
        "batch_error_names_argument": "`w`" in eb_error,
        "batch_error_suggests_fix": "in_axes=(0, None, None)" in eb_error,
        "accuracy": accuracy,
        "member_accuracy": member_accuracy.tolist(),
        "typecheck_count_error": "n=4" in count_error,
        "typecheck_unstacked_error": "unstacked" in unstacked_error,
    }
    print("\nRESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
