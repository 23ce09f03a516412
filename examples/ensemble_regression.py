"""Train an ensemble of MLPs, plot its uncertainty, edit one member, save it.

The question: how do I train a deep ensemble in JAX as ONE stacked model (one
compiled step for all members), then treat its members as ordinary models: look at
each one, replace one of them, put them back together, and save and load the
ensemble either stacked or as a list?

The steps:

1. `eb.ensemble` builds 8 MLPs in one vectorised call: one `eqx.nn.MLP` whose every
   array has a leading member axis.
2. Train them together: each member's loss is computed with `eqx.filter_vmap`, the
   losses are summed (so the gradient of the sum holds each member's own gradient),
   and `eb.per_member(optax.adam(...))` keeps Adam's statistics per member, so this
   equals training each member alone.
3. Plot the data, every member, and the ensemble mean +- 2 standard deviations. The
   training data covers [-1, 1] with a gap in the middle: the members agree on the
   data and disagree in the gap and beyond its ends, which is the uncertainty an
   ensemble gives you.
4. `eb.unstack` gives 8 plain MLPs. The worst one is replaced by a new MLP trained
   alone (an ordinary single-model optax loop), and `eb.stack` puts the 8 back
   together.
5. `eb.save` / `eb.load` the ensemble stacked and as a list of members. A file loads
   as it was saved; `eb.unstack` / `eb.stack` after `eb.load` give the other one.

    python examples/ensemble_regression.py [--out DIR]     # or: nox -s demo

It writes `DIR/ensemble_regression.png` and two checkpoints (default
`examples/out/`), and ends with one line `RESULT {...}` in JSON, for scripts and
tests to read.
"""

import argparse
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import matplotlib
import numpy as np
import optax


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import eqx_batch as eb  # noqa: E402


DEFAULT_OUT = pathlib.Path(__file__).parent / "out"
MEMBERS = 8
STEPS = 2000
LEARNING_RATE = 3e-3


def truth(x: jax.Array) -> jax.Array:
    return jnp.sin(3 * x) + 0.3 * x


def make_data(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Noisy samples of `truth` on [-1, 1], with no data in (-0.35, 0.35)."""
    x_key, noise_key = jr.split(key)
    x = jr.uniform(x_key, (80,), minval=-1.0, maxval=1.0)
    x = x[jnp.abs(x) > 0.35]
    return x, truth(x) + 0.1 * jr.normal(noise_key, x.shape)


def mse(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """One model's mean squared error (the MLP maps a scalar to a scalar)."""
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def train_ensemble(
    models: eqx.nn.MLP, x: jax.Array, y: jax.Array, steps: int
) -> tuple[eqx.nn.MLP, jax.Array]:
    """Trains every member of a stacked model on the same data; also returns losses."""

    @eqx.filter_value_and_grad(has_aux=True)
    def total_loss(models: eqx.nn.MLP) -> tuple[jax.Array, jax.Array]:
        losses = eqx.filter_vmap(mse, in_axes=(eqx.if_array(0), None, None))(
            models, x, y
        )
        return jnp.sum(losses), losses

    optim = eb.per_member(optax.adam(LEARNING_RATE))
    opt_state = optim.init(eqx.filter(models, eqx.is_array))

    # `eb.filter_jit` is `eqx.filter_jit` at `jax.jit`'s speed: it returns as soon as
    # the step is queued, so the loop runs ahead of the devices.
    @eb.filter_jit
    def step(models: eqx.nn.MLP, opt_state: optax.OptState):
        (_, losses), grads = total_loss(models)
        updates, opt_state = optim.update(grads, opt_state, models)
        return eqx.apply_updates(models, updates), opt_state, losses

    losses = jnp.zeros(MEMBERS)
    for i in range(steps):
        models, opt_state, losses = step(models, opt_state)
        if i % 500 == 0 or i == steps - 1:
            print(f"   step {i:4d}: member losses {np.round(np.asarray(losses), 4)}")
    return models, losses


def train_alone(
    model: eqx.nn.MLP, x: jax.Array, y: jax.Array, steps: int
) -> eqx.nn.MLP:
    """An ordinary single-model training loop: nothing here knows about ensembles."""
    optim = optax.adam(LEARNING_RATE)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model: eqx.nn.MLP, opt_state: optax.OptState):
        grads = eqx.filter_grad(mse)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state

    for _ in range(steps):
        model, opt_state = step(model, opt_state)
    return model


def same_bits(a, b) -> bool:
    leaves_a = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    leaves_b = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    return len(leaves_a) == len(leaves_b) and all(
        u.dtype == v.dtype and np.asarray(u).tobytes() == np.asarray(v).tobytes()
        for u, v in zip(leaves_a, leaves_b, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    data_key, model_key, replacement_key = jr.split(jr.key(0), 3)
    x, y = make_data(data_key)
    # The gap and beyond the data's ends, where the members have to extrapolate.
    x_test = jnp.linspace(-1.4, 1.4, 281)
    y_test = truth(x_test)

    # --- 1. Build the ensemble --------------------------------------------------------
    models = eb.ensemble(
        eqx.nn.MLP,
        MEMBERS,
        in_size="scalar",
        out_size="scalar",
        width_size=32,
        depth=2,
        activation=jnp.tanh,
        key=model_key,
    )
    print(
        f"1. eb.ensemble built {eb.batch_size(models)} MLPs as one: first layer "
        f"weight {models.layers[0].weight.shape}"
    )

    # --- 2. Train all members at once -------------------------------------------------
    print(f"\n2. Training on {x.shape[0]} points, {STEPS} Adam steps per member:")
    models, _ = train_ensemble(models, x, y, STEPS)

    predict = eb.filter_jit(
        eqx.filter_vmap(
            lambda model, x: jax.vmap(model)(x), in_axes=(eqx.if_array(0), None)
        )
    )

    def report(models: eqx.nn.MLP) -> tuple[np.ndarray, float]:
        """Each member's test MSE, and the ensemble mean's."""
        predictions = predict(models, x_test)
        member_errors = np.asarray(jnp.mean((predictions - y_test) ** 2, axis=1))
        ensemble_error = float(jnp.mean((predictions.mean(axis=0) - y_test) ** 2))
        return member_errors, ensemble_error

    member_errors, ensemble_error = report(models)
    print("\n   test MSE against the true function on [-1.4, 1.4]:")
    for i, error in enumerate(member_errors):
        print(f"   member {i}: {error:.4f}")
    print(f"   ensemble mean: {ensemble_error:.4f}")
    print(
        f"   best member {member_errors.min():.4f}, median member "
        f"{np.median(member_errors):.4f}"
    )

    # --- 3. Plot ----------------------------------------------------------------------
    predictions = np.asarray(predict(models, x_test))
    mean, std = predictions.mean(axis=0), predictions.std(axis=0)
    fig, ax = plt.subplots(figsize=(7, 4))
    lower, upper = mean - 2 * std, mean + 2 * std
    ax.fill_between(x_test, lower, upper, alpha=0.25, label="ensemble mean ± 2 std")
    for i, member in enumerate(predictions):
        label = "members" if i == 0 else None
        ax.plot(x_test, member, color="C1", lw=0.7, alpha=0.7, label=label)
    ax.plot(x_test, mean, color="C0", lw=2, label="ensemble mean")
    ax.plot(x_test, y_test, "k--", lw=1, label="true function")
    ax.scatter(x, y, s=12, color="k", zorder=3, label="training data")
    ax.set(
        xlabel="x",
        ylabel="y",
        title=f"{MEMBERS} MLPs trained as one: they disagree where data is missing",
    )
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    png = args.out / "ensemble_regression.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"\n3. Plot: {png}")

    # --- 4. Unstack, replace the worst member, restack --------------------------------
    members = eb.unstack(models)
    worst = int(np.argmax(member_errors))
    print(f"\n4. eb.unstack -> {len(members)} {type(members[0]).__name__}s.")
    print(
        f"   Replacing member {worst} (the worst) with a new MLP, built from a fresh "
        f"key and trained alone for {STEPS} steps..."
    )
    replacement = eqx.nn.MLP(
        "scalar", "scalar", 32, 2, activation=jnp.tanh, key=replacement_key
    )
    members[worst] = train_alone(replacement, x, y, STEPS)
    edited = eb.stack(members)
    new_errors, new_ensemble_error = report(edited)
    others_kept = all(
        same_bits(eb.index(edited, i), eb.index(models, i))
        for i in range(MEMBERS)
        if i != worst
    )
    print(
        f"   member {worst}: test MSE {member_errors[worst]:.4f} (old) -> "
        f"{new_errors[worst]:.4f} (new)"
    )
    print("   eb.stack -> the ensemble again.")
    print(f"   the other members are unchanged, bit for bit: {others_kept}")
    print(f"   ensemble test MSE: {ensemble_error:.4f} -> {new_ensemble_error:.4f}")

    # --- 5. Save and load, stacked and as a list --------------------------------------
    stacked_file = args.out / "ensemble.eqx"
    list_file = args.out / "members.eqx"
    eb.save(stacked_file, edited)
    eb.save(list_file, members)
    loaded_stacked = eb.load(stacked_file, like=edited)
    loaded_list = eb.load(list_file, like=members)
    stacked_ok = same_bits(loaded_stacked, edited)
    list_ok = len(loaded_list) == MEMBERS and all(
        same_bits(a, b) for a, b in zip(loaded_list, members, strict=True)
    )
    restacked_ok = same_bits(eb.stack(loaded_list), edited)
    print("\n5. Checkpoints:")
    for what, file in (("stacked", stacked_file), ("list", list_file)):
        print(f"   eb.save({what}) -> {file} ({file.stat().st_size} bytes)")
    print(f"   load stacked file as stacked, identical:         {stacked_ok}")
    print(f"   load list file as a list of {MEMBERS}, identical:     {list_ok}")
    print(f"   eb.stack of the loaded list, identical to stacked: {restacked_ok}")

    result = {
        "members": MEMBERS,
        "member_mse": [float(e) for e in member_errors],
        "ensemble_mse": ensemble_error,
        "median_member_mse": float(np.median(member_errors)),
        "best_member_mse": float(member_errors.min()),
        "edited_member": worst,
        "edited_member_mse": [float(member_errors[worst]), float(new_errors[worst])],
        "edited_ensemble_mse": new_ensemble_error,
        "others_unchanged": others_kept,
        "load_stacked_ok": stacked_ok,
        "load_list_ok": list_ok,
        "restack_loaded_list_ok": restacked_ok,
        "png": str(png),
        "checkpoints": [str(stacked_file), str(list_file)],
    }
    print("\nRESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
