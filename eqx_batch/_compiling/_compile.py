"""Compile plumbing: the static part of a pytree, `AsyncJit`, and lowered programs.

Every transform here hands JAX arrays only and keeps the rest of a pytree (its
structure, functions, Python numbers, axis specs) as a hashable static value, which
is part of a compiled program's identity. `partition` and `combine` are the one way to
take a pytree apart so and put it back together; `StaticPart` is what they carry.

`eqx.filter_jit` waits for every call to finish, so that `eqx.error_if` failures are
raised at the call. A loop that dispatches one compiled segment after another, or a
wrapper such as `eb.filter_pmap` whose caller decides when to wait, wants JAX's own
asynchronous dispatch instead: the next call is queued while this one runs. `AsyncJit`
gives that with `eqx.filter_jit`'s convention for arguments (`_lowered.py` holds its
programs compiled ahead of time, and `_static_key.py` the exact keys of static values).
"""

import dataclasses
import inspect
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu

from .._errors import BatchError, describe, KeyPath, leaf_name
from .._tree import is_array, is_tracer
from ._memo import BoundedCache
from ._static_key import SameNodeData, tree_key


# Marks where a dynamic leaf was taken out of a `StaticPart`.
DYNAMIC = object()


@jtu.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class StaticPart:
    """The static part of a pytree: its treedef and its leaves, with a marker where a
    dynamic leaf was taken out.

    Hashable, so it can be a `jax.jit` static argument; and a pytree with no leaves, so
    it passes as is through `jax.jit`'s outputs, `jax.vmap` and `lax.scan`, which carry
    arrays only. Two are equal when their treedefs are, and their leaves and the data
    of their treedefs' nodes (a static Module field's value, a dict's keys) are of the
    same types and equal, floats bit for bit (`_static_key.py`). Its key and hash are
    computed once: `jax.jit` hashes its static arguments on every call. Two that hold
    the same objects are found equal without their keys, as a compiled function's
    arguments on each call are to those it was lowered for.
    """

    treedef: Any
    leaves: tuple[Any, ...]

    def key(self) -> tuple[Any, ...]:
        """What this static part is compared and hashed by."""
        try:
            return self.__dict__["_key"]
        except KeyError:
            value = tree_key(self.treedef, self.leaves)
            object.__setattr__(self, "_key", value)
            return value

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash(self.key())
            object.__setattr__(self, "_hash", value)
            return value

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, StaticPart):
            return NotImplemented
        if (
            self.treedef == other.treedef
            and all(map(operator.is_, self.leaves, other.leaves))
            and self._same_node_data()(other.treedef)
        ):
            return True
        return self.key() == other.key()

    def _same_node_data(self) -> "SameNodeData":
        """The check that an equal treedef holds the same node data; made once, for
        the part on the left of `==` (the one kept, where a part is compared on each
        call with those it was made for)."""
        try:
            return self.__dict__["_same"]
        except KeyError:
            value = SameNodeData(self.treedef)
            object.__setattr__(self, "_same", value)
            return value


def partition(
    tree: Any,
    is_dynamic: Callable[[Any], bool] = is_array,
    is_leaf: Callable[[Any], bool] | None = None,
) -> tuple[list[Any], StaticPart]:
    """`tree`'s dynamic leaves (array leaves by default), and the rest of it.

    **Arguments:**

    - `tree`: any pytree; its leaves other than the dynamic ones must be hashable.
    - `is_dynamic`: which leaves to take out.
    - `is_leaf`: as for `jax.tree_util.tree_flatten`.

    **Returns:**

    `(dynamic leaves in flattening order, the rest as a StaticPart)`.
    """
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=is_leaf)
    dynamic = [leaf for leaf in leaves if is_dynamic(leaf)]
    others = tuple(DYNAMIC if is_dynamic(leaf) else leaf for leaf in leaves)
    return dynamic, StaticPart(treedef, others)


def combine(dynamic: Sequence[Any], static: StaticPart) -> Any:
    """The inverse of `partition`: `static` with `dynamic` put back in order."""
    remaining = iter(dynamic)
    leaves = [next(remaining) if leaf is DYNAMIC else leaf for leaf in static.leaves]
    return jtu.tree_unflatten(static.treedef, leaves)


def hold(tree: Any) -> StaticPart:
    """All of `tree` as a static value (`combine((), held)` gives it back).

    `None` counts as a leaf, so axis specs keep their `None`s.
    """
    return partition(tree, _never, _is_none)[1]


def _never(leaf: Any) -> bool:
    del leaf
    return False


def _is_none(leaf: Any) -> bool:
    return leaf is None


@dataclasses.dataclass
class CallPlan:
    """How `AsyncJit` calls its program for arguments of one static part: the static
    part of each argument, and where each argument's arrays are among the leaves of
    all arguments.

    `checks` is filled in by whoever first asks whether the program holds runtime
    checks (`AsyncJit.has_checks`); `None` until then.
    """

    statics: tuple[StaticPart, ...]
    positions: tuple[tuple[int, ...], ...]
    checks: bool | None = None

    def arrays(self, leaves: Sequence[Any]) -> list[list[Any]]:
        """Each argument's arrays, out of the leaves of all arguments."""
        return [[leaves[i] for i in where] for where in self.positions]


# Plans are looked up by the treedef and the identity of each non-array leaf, which is
# cheap to compute on every call (hashing each leaf's value is not). An entry keeps its
# leaves alive, so that no other object can take one of their ids while it is cached.
_PLANS_BY_IDENTITY = 256


class _SeenArguments(NamedTuple):
    """What `AsyncJit.plan` keeps of arguments it has seen: their plan, their non-array
    leaves (alive, so that their ids stay theirs), and the check that arguments with
    an equal treedef hold the same values in its nodes' data."""

    plan: CallPlan
    held: tuple[Any, ...]
    same_node_data: SameNodeData


class AsyncJit:
    """`fun` compiled by `jax.jit` per hashable static part of its arguments.

    Calling it returns as soon as the computation is queued; its results are arrays
    that JAX fills in when the work is done. Positional arguments only: array leaves
    are the program's arguments, every other leaf is part of its identity and must be
    hashable.

    A call flattens its arguments once and finds their static part by their treedef
    and the identity of their non-array leaves (and of the values in the treedef's node
    data, such as static Module fields: `SameNodeData`); only arguments not seen before
    are partitioned and hashed.

    **Arguments:**

    - `fun`: any function of pytrees returning a pytree.
    - `donate`: the names of the parameters whose arrays the computation may reuse
        for its outputs (the caller must not use them afterwards). An array passed
        again elsewhere in the same call is donated once, its other places getting a
        copy (`donated_once`).
    - `jit_kwargs`: passed on to `jax.jit` (`inline`, `keep_unused`, ...); not those
        saying which arguments are static or donated, which are decided here.

    **Raises:**

    `TypeError` if `donate` names something that is not a parameter of `fun`, or
    `jax.jit` refuses `jit_kwargs`.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        *,
        donate: Sequence[str] = (),
        **jit_kwargs: Any,
    ):
        self.fun = fun
        parameters = list(inspect.signature(fun).parameters)
        self._parameters = parameters
        unknown = [name for name in donate if name not in parameters]
        if unknown:
            raise TypeError(
                f"donate names {unknown}, which are not parameters of "
                f"{getattr(fun, '__qualname__', fun)}; it has {parameters}."
            )

        def run(statics: tuple[StaticPart, ...], *arrays: list[Any]) -> tuple:
            args = [combine(a, s) for a, s in zip(arrays, statics, strict=True)]
            return partition(fun(*args))

        self.donated = tuple(parameters.index(name) for name in donate)
        # Argument 0 of `run` is the static parts; `fun`'s arrays follow.
        self._jitted = jax.jit(
            run,
            static_argnums=0,
            donate_argnums=tuple(1 + i for i in self.donated),
            **jit_kwargs,
        )
        self._by_identity = BoundedCache(_PLANS_BY_IDENTITY)
        self._by_statics: dict[tuple[StaticPart, ...], CallPlan] = {}
        self._array_types: dict[type, bool] = {}

    def __call__(self, *args: Any) -> Any:
        leaves, treedef = jtu.tree_flatten(args)
        plan = self.plan(leaves, treedef, args)
        return self.finish(self.run(plan, plan.arrays(leaves)))

    def run(
        self, plan: CallPlan, arrays: list[list[Any]]
    ) -> tuple[list[Any], StaticPart]:
        """Queues the program of `plan` on each argument's arrays; `finish` makes what
        it returns the function's output."""
        return self._jitted(plan.statics, *donated_once(arrays, self.donated))

    def plan(
        self,
        leaves: list[Any],
        treedef: Any,
        args: tuple[Any, ...],
        name: Callable[[KeyPath], str] | None = None,
    ) -> CallPlan:
        """The plan for arguments `args`, flattened to `leaves` and `treedef`.

        **Arguments:**

        - `leaves`, `treedef`: `jax.tree_util.tree_flatten(args)`.
        - `args`: the arguments of `fun`.
        - `name`: the user's name of a leaf of `args` by its path, for messages;
            `args[i]...` by default.

        **Raises:**

        `BatchError` if a non-array leaf is not hashable, naming it.
        """
        kinds = self._array_types
        try:
            identity = [None if kinds[type(x)] else id(x) for x in leaves]
        except KeyError:
            kinds.update((type(x), is_array(x)) for x in leaves)
            identity = [None if kinds[type(x)] else id(x) for x in leaves]
        key = (treedef, *identity)
        found = self._by_identity.get(key)
        if found is not None and found.same_node_data(treedef):
            return found.plan
        statics, _ = self.split_args(args)
        try:
            plan = self._by_statics.get(statics)
        except TypeError:
            _check_hashable(args, name or self._name)
            raise
        if plan is None:
            positions, start = [], 0
            for static in statics:
                end = start + len(static.leaves)
                positions.append(
                    tuple(i for i in range(start, end) if identity[i] is None)
                )
                start = end
            plan = self._by_statics.setdefault(
                statics, CallPlan(statics, tuple(positions))
            )
        held = tuple(x for x, i in zip(leaves, identity, strict=True) if i is not None)
        self._by_identity.add(key, _SeenArguments(plan, held, SameNodeData(treedef)))
        return plan

    def _name(self, path: KeyPath) -> str:
        """A leaf's name by its path in the arguments: the parameter's, then the
        path within it (`step.scale`)."""
        first = path[0]
        if isinstance(first, jtu.SequenceKey) and first.idx < len(self._parameters):
            # A wrapper's own node (a flattened index, not the user's) is left out.
            within = [k for k in path[1:] if not isinstance(k, jtu.FlattenedIndexKey)]
            return leaf_name(self._parameters[first.idx], tuple(within))
        return leaf_name("args", path)

    def has_checks(self, plan: CallPlan, arrays: list[list[Any]]) -> bool:
        """Whether the program of `plan` holds host callbacks, such as the runtime
        checks of `eqx.error_if`, whose failures a caller may want to wait for.

        Traced once per plan, with `arrays` (concrete, not yet donated): the call that
        follows reuses this trace.
        """
        if plan.checks is None:
            traced = self._jitted.trace(plan.statics, *arrays)
            plan.checks = _has_callback(traced.jaxpr.jaxpr)
        return plan.checks

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The program for these arguments, lowered.

        Its `.compile()` is called with the arrays of `split_args(args)` only, and
        what it returns is made the function's output by `finish`.
        """
        statics, arrays = self.split_args(args)
        try:
            hash(statics)
        except TypeError:
            _check_hashable(args, self._name)
            raise
        return self._jitted.lower(statics, *arrays)

    @staticmethod
    def split_args(args: tuple[Any, ...]) -> tuple[tuple[StaticPart, ...], list[list]]:
        """The static part of each argument (the program's identity: compare it before
        calling a compiled program with other arguments) and their arrays."""
        parts = [partition(arg) for arg in args]
        return tuple(s for _, s in parts), [a for a, _ in parts]

    @staticmethod
    def finish(out: tuple[list[Any], StaticPart]) -> Any:
        """The function's output, from what the compiled program returned."""
        return combine(*out)


def _check_hashable(
    args: tuple[Any, ...], name: Callable[[KeyPath], str] | None
) -> None:
    """Raises `BatchError` naming the first non-array leaf of `args`, or static field
    (`eqx.field(static=True)`, or other static data of a pytree node), that cannot be
    hashed (and so cannot be part of a compiled program's identity)."""
    for path, leaf in jtu.tree_flatten_with_path(args)[0]:
        if is_array(leaf):
            continue
        try:
            hash(leaf)
        except TypeError:
            where = name(path) if name is not None else leaf_name("args", path)
            raise BatchError(
                f"`{where}` is {describe(leaf)} ({type(leaf).__name__}), static but "
                "not hashable: pass an array, a tuple or a frozenset "
                "(see docs/transforms.md#what-is-refused)."
            ) from None
    for path, value in unhashable_static(args, ()):
        where = name(path) if name is not None else leaf_name("args", path)
        raise BatchError(
            f"static field `{where}` is {describe(value)}, not hashable: use a tuple, "
            f"or drop static=True (see docs/transforms.md#what-is-refused)."
        )


def unhashable_static(node: Any, path: KeyPath) -> Iterator[tuple[KeyPath, Any]]:
    """The values in the static data of the pytree nodes of `node` that cannot be
    hashed, with their paths: a dataclass's (a Module's) static field by the field's
    path, another node's data by the node's."""
    children, treedef = jtu.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    kind_and_data = treedef.node_data()
    if kind_and_data is None:
        return  # a leaf
    for key_path, child in children:
        yield from unhashable_static(child, (*path, *key_path))
    data = kind_and_data[1]
    if isinstance(node, dict):
        return  # its node data is a list of its keys, which JAX compares itself
    try:
        hash(data)
    except TypeError:
        pass
    else:
        return
    if not dataclasses.is_dataclass(node):
        yield path, data
        return
    dynamic = {key.name for (key, *_), _ in children if isinstance(key, jtu.GetAttrKey)}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name, None)
        if field.name in dynamic:
            continue
        try:
            hash(value)
        except TypeError:
            yield (*path, jtu.GetAttrKey(field.name)), value


def donated_once(arguments: list[list[Any]], donated: Sequence[int]) -> list[list[Any]]:
    """Each argument's arrays, with no buffer both donated and passed again.

    XLA refuses a call that donates a buffer it also reads elsewhere in the same call
    (the same array passed twice, or one array at two leaves, as tied weights are),
    and on some versions the process dies of it. So an array of a donated argument
    whose buffer was already passed, in an argument that is not donated or earlier
    in a donated one, is replaced by a copy: the call computes what it would without
    donation, and each buffer is donated at most once.

    **Arguments:**

    - `arguments`: the arrays of each argument of a program, in order.
    - `donated`: the indices of the arguments whose buffers the program donates.

    **Returns:**

    `arguments` itself if no array is passed twice (the usual case), else new lists.
    """
    if not donated:
        return arguments
    ids = [id(x) for argument in arguments for x in argument]
    if len(set(ids)) == len(ids):
        return arguments
    seen = {
        id(x)
        for i, argument in enumerate(arguments)
        if i not in donated
        for x in argument
    }

    def once(x: Any) -> Any:
        # Tracers donate nothing (the outer program decides), and other arrays are
        # copied onto the devices anyway, each into its own buffer.
        if not isinstance(x, jax.Array) or is_tracer(x):
            return x
        if id(x) in seen:
            return x.copy()
        seen.add(id(x))
        return x

    return [
        [once(x) for x in argument] if i in donated else argument
        for i, argument in enumerate(arguments)
    ]


# The primitives of JAX's host callbacks (`jax.pure_callback`, `jax.debug.callback`,
# `io_callback`), by which `eqx.error_if` and its kin raise at run time.
_CALLBACKS = frozenset({"pure_callback", "debug_callback", "io_callback"})


def all_equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of `jaxpr` and of the jaxprs inside it (`cond` branches, `scan`
    bodies, nested `jit`s), depth first."""
    for equation in jaxpr.eqns:
        yield equation
        for param in equation.params.values():
            for inner in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's own
                if hasattr(inner, "eqns"):
                    yield from all_equations(inner)


def _has_callback(jaxpr: Any) -> bool:
    """Whether `jaxpr` or any jaxpr inside it calls back to the host."""
    return any(eqn.primitive.name in _CALLBACKS for eqn in all_equations(jaxpr))
