"""eqx_batch: batched models in JAX, built on Equinox.

`import eqx_batch as eb` is the whole interface.
"""

from ._errors import BatchError as BatchError


__version__ = "0.1.0"

__all__ = [
    "BatchError",
]
