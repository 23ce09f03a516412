import os


# Must happen before JAX initialises its backends: every test sees 4 CPU devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """Returns a function that hands out a fresh PRNG key on each call."""
    state = {"key": jr.key(0)}

    def _getkey():
        state["key"], subkey = jr.split(state["key"])
        return subkey

    return _getkey
