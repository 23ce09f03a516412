import os


# Must happen before JAX initialises its backends. The suite runs on 4 CPU devices,
# unless XLA_FLAGS names a device count already: `-m accelerator` runs on the devices
# it finds, and `--xla_force_host_platform_device_count=1` makes the CPU one chip.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (
        _flags + " --xla_force_host_platform_device_count=4"
    ).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skips a test marked `needs_devices(n)` where the default backend has fewer than
    `n` devices (one accelerator chip, say), saying so."""
    for marker in item.iter_markers("needs_devices"):
        (needed,) = marker.args
        found = jax.device_count()
        if found < needed:
            pytest.skip(
                f"needs {needed} devices; the default backend "
                f"({jax.default_backend()}) has {found}"
            )


@pytest.fixture
def getkey():
    """Returns a function that hands out a fresh PRNG key on each call."""
    state = {"key": jr.key(0)}

    def _getkey():
        state["key"], subkey = jr.split(state["key"])
        return subkey

    return _getkey
