"""`BoundedCache`: the memo of the per-call paths, which forgets its oldest entry.

A compiled loop or program is found on every call by what its arguments are (a step
and the shapes of a state, say), so the work of finding it is done once and kept here.
A long-lived process can make such keys without end (a new step per call), and each
entry keeps its key and value alive, so every such memo holds a bounded number.
"""

from collections.abc import Callable
from typing import Any, TypeVar


V = TypeVar("V")


class BoundedCache(dict[Any, Any]):
    """A `dict` of at most `size` entries; adding one more forgets the oldest.

    **Arguments:**

    - `size`: the most entries held.

    !!! Example

        ```python
        cache = BoundedCache(2)
        cache.add("a", 1); cache.add("b", 2); cache.add("c", 3)
        list(cache)  # ['b', 'c']
        cache.get_or_make("d", lambda: 4)  # 4, made and stored: ['c', 'd']
        ```
    """

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def add(self, key: Any, value: V) -> V:
        """Stores `value` under `key` and returns it."""
        if key not in self and len(self) >= self.size:
            # `pop` with a default: another thread may have just forgotten it.
            self.pop(next(iter(self), None), None)
        self[key] = value
        return value

    def get_or_make(self, key: Any, make: Callable[[], V]) -> V:
        """The value stored under `key`, or `make()`, stored under it."""
        found = self.get(key)
        return self.add(key, make()) if found is None else found
