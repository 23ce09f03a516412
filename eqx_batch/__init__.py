"""eqx_batch: batched models in JAX, built on Equinox.

`import eqx_batch as eb` is the whole interface.
"""

from ._chains import (
    all_chains as all_chains,
    AllChains as AllChains,
    Chains as Chains,
    converged as converged,
    Diagnostics as Diagnostics,
    DiskArray as DiskArray,
    NonFinite as NonFinite,
    Problems as Problems,
    run_chains as run_chains,
    Stopped as Stopped,
    StoppingRule as StoppingRule,
)
from ._ensemble import ensemble as ensemble
from ._errors import BatchError as BatchError
from ._jit import filter_jit as filter_jit
from ._layers import scan_layers as scan_layers
from ._per_member import per_member as per_member
from ._pmap import filter_pmap as filter_pmap
from ._select import index as index, take as take
from ._serialise import load as load, save as save
from ._shard import shard as shard
from ._stack import (
    batch_size as batch_size,
    concat as concat,
    stack as stack,
    unstack as unstack,
)
from ._typecheck import typecheck as typecheck
from ._typing import Stacked as Stacked
from ._vmap import filter_vmap as filter_vmap


__version__ = "0.1.0"

__all__ = [
    "AllChains",
    "BatchError",
    "Chains",
    "Diagnostics",
    "DiskArray",
    "NonFinite",
    "Problems",
    "Stacked",
    "Stopped",
    "StoppingRule",
    "all_chains",
    "batch_size",
    "concat",
    "converged",
    "ensemble",
    "filter_jit",
    "filter_pmap",
    "filter_vmap",
    "index",
    "load",
    "per_member",
    "run_chains",
    "save",
    "scan_layers",
    "shard",
    "stack",
    "take",
    "typecheck",
    "unstack",
]
