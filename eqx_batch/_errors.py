"""`BatchError` and the helpers that make its messages name leaves the user's way."""

from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu
import numpy as np


class BatchError(ValueError):
    """Raised by eqx_batch for bad input.

    The message names the offending leaf by the user's argument name followed by its
    `jax.tree_util.keystr` path (`model.layers[1].weight`,
    `state['layer2']['weights']`), the values, shapes or dtypes that disagree, and,
    where the fix is obvious, the fix.

    It subclasses `ValueError`, so code that already catches `ValueError` keeps working.

    !!! Example

        ```python
        try:
            eb.stack([])
        except eb.BatchError as e:
            print(e)  # `trees` is empty: stack needs at least one member.
        ```
    """


KeyPath = tuple[Any, ...]


def leaf_name(argname: str, path: KeyPath) -> str:
    """`argname` followed by the `keystr` of `path`: `model.layers[0].weight`."""
    return f"{argname}{jtu.keystr(path)}"


def describe(x: Any) -> str:
    """A short description of a leaf: `float32[3,4]` for arrays, `repr` otherwise."""
    if isinstance(x, (np.ndarray, np.generic)) or hasattr(x, "aval") or type(x).__name__ == "ShapeDtypeStruct":
        dtype = getattr(x, "dtype", None)
        shape = ",".join(str(d) for d in np.shape(x))
        return f"{dtype}[{shape}]"
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def bullet_list(lines: Sequence[str], limit: int = 20) -> str:
    """Indented lines, at most `limit` of them, with a count of the rest."""
    shown = [f"  {line}" for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"  ... and {len(lines) - limit} more")
    return "\n".join(shown)


# TEMPORARY until the bottom branch lands.
def check_int(value, name, *, minimum=0, maximum=None, hint=""):
    import numpy as np
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not ok or value < minimum or (maximum is not None and value > maximum):
        rng = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise BatchError(f"`{name}` is {value!r}; it must be an int {rng}{hint}.")
    return int(value)


def qualified_name(x):
    module = getattr(x, "__module__", None)
    qualname = getattr(x, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    return None
