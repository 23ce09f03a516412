"""eqx_batch: batched models in JAX, built on Equinox.

`import eqx_batch as eb` is the whole interface.

The modules sit in rooms. Each imports only the rooms below it and the modules here:
`_errors.py` (`BatchError`, messages) and `_tree.py` (leaves, axis specs), at the
bottom, and `_progress.py` (the bar of `run_chains`). From the top down:

- `_chains/`: `run_chains` and what it returns, in rooms of its own;
- `_models/`: `ensemble`, `scan_layers`, `per_member` (above `_types/`);
- `_transforms/`: `filter_vmap`, `filter_pmap`, `filter_jit` and `shard`;
- `_types/`: `Stacked` and `typecheck`;
- `_stacking/`: `stack`, `unstack`, `concat`, `batch_size`, `index` and `take`;
- `_files/`: `save` and `load`, the file format, atomic writes;
- `_compiling/`: the static part of a pytree, `AsyncJit`, lowered programs, memos.
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
from ._errors import BatchError as BatchError
from ._files._serialise import load as load, save as save
from ._models._ensemble import ensemble as ensemble
from ._models._layers import scan_layers as scan_layers
from ._models._per_member import per_member as per_member
from ._stacking._select import index as index, take as take
from ._stacking._stack import (
    batch_size as batch_size,
    concat as concat,
    stack as stack,
    unstack as unstack,
)
from ._transforms._jit import filter_jit as filter_jit
from ._transforms._pmap import filter_pmap as filter_pmap
from ._transforms._shard import shard as shard
from ._transforms._vmap import filter_vmap as filter_vmap
from ._types._typecheck import typecheck as typecheck
from ._types._typing import Stacked as Stacked


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
