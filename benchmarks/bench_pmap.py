"""`eb.filter_pmap` vs `eqx.filter_pmap` on the same work over 4 forced CPU devices.

Each call runs an ensemble of MLPs on a shared batch, the members split over the
devices, with a collective over the members (the mean prediction). The parameters stay
where each transform keeps them (split over the devices), as in a training loop; the
batch is a fresh host-side array each call for both. Cases:

- `4 members`: one member per device, the only shape `eqx.filter_pmap` accepts as is.
- `8 members`: two per device; the baseline maps an `eqx.filter_vmap` over members
  reshaped to `(4, 2, ...)`, which is what one writes without eqx_batch.
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from _report import interleaved, report  # noqa: E402

import eqx_batch as eb  # noqa: E402


DEVICES = 4


def make_ensemble(members: int, width: int) -> eqx.nn.MLP:
    keys = jr.split(jr.key(0), members)
    make = eqx.filter_vmap(lambda k: eqx.nn.MLP(16, 1, width, 2, key=k))
    return eqx.filter_jit(make)(keys)


def predict(model: eqx.nn.MLP, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = jax.vmap(model)(x)
    return y, jax.lax.pmean(y, "members")


def per_device(tree, members_per_device: int):
    """The baseline's layout: members reshaped to (devices, members per device, ...)."""
    return jax.tree.map(
        lambda x: (
            x.reshape(DEVICES, members_per_device, *x.shape[1:])
            if eqx.is_array(x)
            else x
        ),
        tree,
    )


def case(members: int, width: int, batch: int) -> None:
    model = make_ensemble(members, width)
    x_host = np.random.default_rng(0).standard_normal((batch, 16), dtype=np.float32)

    ours_fn = eb.filter_pmap(
        predict, in_axes=(eqx.if_array(0), None), axis_name="members"
    )
    ours_model = eb.shard(model)

    per = members // DEVICES
    if per == 1:
        base_fn = eqx.filter_pmap(
            predict, in_axes=(eqx.if_array(0), None), axis_name="members"
        )
        base_model = eqx.filter_pmap(lambda m: m)(model)
    else:
        # Members within a device are vmapped; the collective spans both axes.
        def predict_nested(model, x):
            y = eqx.filter_vmap(lambda m: jax.vmap(m)(x))(model)
            return y, jax.lax.pmean(jnp.mean(y, axis=0), "members")

        base_fn = eqx.filter_pmap(
            predict_nested, in_axes=(eqx.if_array(0), None), axis_name="members"
        )
        base_model = eqx.filter_pmap(lambda m: m)(per_device(model, per))

    def ours():
        return jax.block_until_ready(ours_fn(ours_model, jnp.asarray(x_host)))

    def baseline():
        return jax.block_until_ready(base_fn(base_model, jnp.asarray(x_host)))

    # Same results (the baseline's up to its (4, 2) layout), then warm both.
    y_ours, mean_ours = ours()
    y_base, mean_base = baseline()
    np.testing.assert_allclose(
        np.asarray(y_ours),
        np.asarray(y_base).reshape(y_ours.shape),
        rtol=1e-5,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        np.asarray(mean_ours)[0], np.asarray(mean_base)[0], rtol=1e-5, atol=1e-5
    )

    number = 20 if width <= 64 else 3
    t_ours, t_base = interleaved(ours, baseline, repeat=7, number=number)
    ratio = t_ours / t_base
    report(
        f"filter_pmap {members} members, width {width}, batch {batch}",
        ratio,
        "<= 1.0",
        ratio <= 1.0,
        f"ours {t_ours * 1e3:.2f} ms, eqx.filter_pmap {t_base * 1e3:.2f} ms per call",
    )


if __name__ == "__main__":
    assert jax.device_count() == DEVICES
    case(members=4, width=32, batch=8)  # dispatch-bound
    case(members=4, width=256, batch=512)  # compute-bound
    case(members=8, width=256, batch=512)
