"""The exact key of a static value: what a compiled program's identity compares.

`==` finds `1 == 1.0 == True` and `0.0 == -0.0`, and `nan != nan`; a program traced
with one of them differs from one traced with another (dtypes, constants), and one
traced with NaN is the same program each time. Static values, and the data of a
treedef's nodes (a static Module field's value, a dict's keys), are keyed here by type
and bits instead. `_compile.StaticPart` compares and hashes by these keys.
"""

import dataclasses
import itertools as it
import operator
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.tree_util as jtu
import numpy as np


@jtu.register_static
class _Probe:
    """A static node, to check how this JAX pickles treedefs (`_choose_node_reader`)."""


def static_key(value: Any) -> Any:
    """A static value as the identity of a compiled program sees it: its type and
    value, a float's (or complex's, or NumPy scalar's) value by its bits, and a
    container's (a tuple, a Module, any pytree) by its structure and the key of each
    value inside it, a dataclass's by the keys of its compared fields.

    `1 == 1.0 == True` and `0.0 == -0.0`, but they are traced to programs with other
    dtypes or other constants: `jax.jit` with any of them as a static argument compiles
    its own program. So do `(1,)` and `(1.0,)`, or two Modules or dataclasses whose
    (static) fields hold them, though `==` finds those equal too. And `nan != nan`,
    which would compile anew on every call, where two NaNs of the same bits are one
    program.
    """
    kind = type(value)
    if kind in _BY_VALUE or kind.__eq__ is object.__eq__:
        # Equal only to an equal value of their own type, or to themselves.
        return kind, value
    if kind is tuple:
        return kind, *map(static_key, value)
    if isinstance(value, float):
        return kind, struct.pack("<d", value)
    if isinstance(value, complex):
        return kind, struct.pack("<dd", value.real, value.imag)
    if isinstance(value, np.generic):
        return kind, value.tobytes()
    if isinstance(value, frozenset):
        return kind, frozenset(map(static_key, value))
    leaves, treedef = jtu.tree_flatten(value)
    if treedef.num_nodes > 1 or treedef.num_leaves != 1:  # a container
        return tree_key(treedef, leaves, value)
    if dataclasses.is_dataclass(value):
        # Keyed by the fields that its `==` compares, each by its own key: frozen or
        # not, `==` finds `Frozen(0.0)` equal to `Frozen(-0.0)` as it finds `0.0`
        # equal to `-0.0`. (Node data that is a plain dataclass is how an older
        # Equinox keeps a Module's static fields.)
        return kind, *(
            static_key(getattr(value, field.name))
            for field in dataclasses.fields(value)
            if field.compare
        )
    return kind, value


# The types whose values `==` finds equal only to equal values of the same type.
_BY_VALUE = frozenset({int, bool, str, bytes, type(None)})


def tree_key(treedef: Any, leaves: Sequence[Any], tree: Any = None) -> tuple[Any, ...]:
    """The `static_key` of a pytree `tree` flattened to `leaves` and `treedef`.

    Not the treedef itself, which compares the data of its nodes by `==` (and so finds
    a Module with the static field `0.0` equal to one with `-0.0`, and one with `nan`
    unequal to itself), but the kind of each of its nodes and the key of their data.
    """
    nodes = read_nodes(treedef)
    data = tuple(
        # A static node (`jax.tree_util.register_static`) is its own data.
        (type(datum), datum) if datum is tree else static_key(datum)
        for datum in map(_DATA, nodes)
        if datum is not None
    )
    return tuple(map(_KIND, nodes)), data, *map(static_key, leaves)


_KIND = operator.itemgetter(0, 1, 3)
_DATA = operator.itemgetter(2)


def _pickled_nodes(treedef: Any) -> list[tuple[Any, ...]]:
    # The state by which a treedef is pickled: one call, where a walk makes a treedef of
    # each node. Its tuples go on with counts.
    return treedef.__getstate__()[1]


def _walked_nodes(treedef: Any) -> list[tuple[Any, ...]]:
    nodes = []

    def visit(node: Any) -> None:
        children = node.children()
        for child in children:
            visit(child)
        type_and_data = node.node_data()  # None for a leaf
        if type_and_data is None:
            nodes.append((None, 0, None, None))
        else:
            kind, data = type_and_data
            nodes.append((kind, len(children), data, None))

    visit(treedef)
    return nodes


def _choose_node_reader() -> Callable[[Any], list[tuple[Any, ...]]]:
    """`_pickled_nodes` if this JAX pickles treedefs as it does today, else the walk
    through `PyTreeDef`'s public methods.

    Checked on a treedef with one node of each kind: the same data and numbers of
    children as the walk finds, the custom node's type fourth, and a kind for each.
    """
    probe = jtu.tree_structure((1, [None], {"key": _Probe()}))
    try:
        pickled = _pickled_nodes(probe)
        walked = _walked_nodes(probe)
        if (
            [node[1:3] for node in pickled] == [node[1:3] for node in walked]
            and [node[3] for node in pickled]
            == [_Probe if node[0] is _Probe else None for node in walked]
            and len({node[0] for node in pickled}) == len(walked)
        ):
            return _pickled_nodes
    except Exception:  # noqa: BLE001 - another JAX's pickled form
        pass
    return _walked_nodes


# One tuple per node of a treedef, children before their parent: its kind, its number
# of children, its data (a custom node's auxiliary data, a dict's keys; `None` for a
# leaf, a tuple or a list), its type if it is a custom node.
read_nodes = _choose_node_reader()


class SameNodeData:
    """Whether a treedef equal to the one this was made from holds the same values in
    its nodes' data.

    Treedefs compare their node data by `==`, so a Module with the static field `0.0`
    has a treedef equal to that of one with `-0.0`. A call that finds its arguments
    among those seen before by their treedef (`AsyncJit.plan`) checks here that the
    values in its nodes' data are the same objects as before (or, if not, have the
    same `static_key`). Only values that `==` may find equal to another type or other
    bits are checked: a treedef whose nodes hold none (plain containers, string keys,
    functions) is not read at all.
    """

    def __init__(self, treedef: Any):
        nodes = read_nodes(treedef)
        checked = [i for i, node in enumerate(nodes) if _may_differ(node[2])]
        self._values = _values_at(
            [i for i in checked if type(nodes[i][2]) in _CONTAINERS],
            [i for i in checked if type(nodes[i][2]) not in _CONTAINERS],
        )
        self.values = tuple(self._values(nodes))
        self.key = static_key(self.values)

    def __call__(self, treedef: Any) -> bool:
        if not self.values:
            return True
        nodes = read_nodes(treedef)
        try:
            # As the treedefs are equal, so are the lengths of their containers.
            if all(map(operator.is_, self._values(nodes), self.values)):
                return True
            return static_key(tuple(self._values(nodes))) == self.key
        except TypeError:  # another kind of data where a container was
            return False


def _values_at(
    unpacked: list[int], whole: list[int]
) -> Callable[[list[tuple[Any, ...]]], Iterator[Any]]:
    """The values in the data of the nodes at `unpacked` (containers: their items) and
    at `whole` (the data itself), as a function of a treedef's nodes (`read_nodes`)."""
    containers = _picker(unpacked)
    if not whole:
        return lambda nodes: it.chain.from_iterable(map(_DATA, containers(nodes)))
    others = _picker(whole)
    return lambda nodes: it.chain(
        it.chain.from_iterable(map(_DATA, containers(nodes))),
        map(_DATA, others(nodes)),
    )


def _picker(positions: list[int]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """The items of a list at `positions`, as a tuple (`operator.itemgetter` gives one
    item alone, and takes no empty list)."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return lambda items: tuple(items[i] for i in positions)


_CONTAINERS = (tuple, list)


def _may_differ(value: Any) -> bool:
    """Whether `value` is or holds one that `==` may find equal to a value of another
    type or other bits.

    A string is taken to be equal only to a string (a NumPy string equal to it is
    taken for it): dicts are keyed by strings, and a dict built on every call from the
    same literal keys should not be read on every call.
    """
    kind = type(value)
    if value is None or kind is str or kind.__eq__ is object.__eq__:
        return False
    if kind in _CONTAINERS:
        return any(map(_may_differ, value))
    if kind is dict:
        return _may_differ(tuple(value.items()))
    return True
