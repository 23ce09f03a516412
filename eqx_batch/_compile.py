"""Compile plumbing: the static part of a pytree, `AsyncJit`, and lowered programs.

Every transform here hands JAX arrays only and keeps the rest of a pytree (its
structure, functions, Python numbers, axis specs) as a hashable static value, which
is part of a compiled program's identity. `partition` and `combine` are the one way to
take a pytree apart so and put it back together; `StaticPart` is what they carry.

`eqx.filter_jit` waits for every call to finish, so that `eqx.error_if` failures are
raised at the call. A loop that dispatches one compiled segment after another, or a
wrapper such as `eb.filter_pmap` whose caller decides when to wait, wants JAX's own
asynchronous dispatch instead: the next call is queued while this one runs. `AsyncJit`
gives that with `eqx.filter_jit`'s convention for arguments, and `Lowered`/`Compiled`
are its programs compiled ahead of time.
"""

import dataclasses
import inspect
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from ._errors import BatchError, describe, KeyPath, leaf_name
from ._memo import BoundedCache
from ._tree import is_array, is_tracer


# Marks where a dynamic leaf was taken out of a `StaticPart`.
DYNAMIC = object()


@jtu.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class StaticPart:
    """The static part of a pytree: its treedef and its leaves, with a marker where a
    dynamic leaf was taken out.

    Hashable, so it can be a `jax.jit` static argument; and a pytree with no leaves, so
    it passes as is through `jax.jit`'s outputs, `jax.vmap` and `lax.scan`, which carry
    arrays only. Two are equal when their treedefs are and their leaves are of the
    same types and equal, floats bit for bit (`_static_key`). Its key and hash are
    computed once: `jax.jit` hashes its static arguments on every call.
    """

    treedef: Any
    leaves: tuple[Any, ...]

    def key(self) -> tuple[Any, ...]:
        """What this static part is compared and hashed by."""
        try:
            return self.__dict__["_key"]
        except KeyError:
            value = (self.treedef, *map(_static_key, self.leaves))
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
        return self.key() == other.key()


def _static_key(leaf: Any) -> tuple[Any, ...]:
    """A static leaf as the identity of a compiled program sees it: its type and value,
    a float's (or complex's) value by its bits.

    `1 == 1.0 == True` and `0.0 == -0.0`, but they are traced to programs with other
    dtypes or other constants: `jax.jit` with any of them as a static argument compiles
    its own program. And `nan != nan`, which would compile anew on every call, where
    two NaNs of the same bits are one program.
    """
    if isinstance(leaf, float):
        return type(leaf), struct.pack("<d", leaf)
    if isinstance(leaf, complex):
        return type(leaf), struct.pack("<dd", leaf.real, leaf.imag)
    return type(leaf), leaf


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


class AsyncJit:
    """`fun` compiled by `jax.jit` per hashable static part of its arguments.

    Calling it returns as soon as the computation is queued; its results are arrays
    that JAX fills in when the work is done. Positional arguments only: array leaves
    are the program's arguments, every other leaf is part of its identity and must be
    hashable.

    A call flattens its arguments once and finds their static part by the identity of
    their non-array leaves; only arguments not seen before are partitioned and hashed.

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
        if found is not None:
            return found[0]
        statics, _ = self.split_args(args)
        try:
            plan = self._by_statics.get(statics)
        except TypeError:
            _check_hashable(args, name)
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
        self._by_identity.add(key, (plan, held))
        return plan

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
            _check_hashable(args, None)
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
    """Raises `BatchError` naming the first non-array leaf of `args` that cannot be
    hashed (and so cannot be part of a compiled program's identity)."""
    for path, leaf in jtu.tree_flatten_with_path(args)[0]:
        if is_array(leaf):
            continue
        try:
            hash(leaf)
        except TypeError:
            where = name(path) if name is not None else leaf_name("args", path)
            raise BatchError(
                f"`{where}` is {describe(leaf)}, a non-array value, which is held "
                "static (part of the compiled program's identity) and so must be "
                f"hashable; {type(leaf).__name__} is not. Pass it as a JAX or NumPy "
                "array to trace it, or as a hashable value (a tuple rather than a "
                "list, a frozenset rather than a set)."
            ) from None


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


# --------------------------------------------------------------- ahead of time

ArrayTypes = tuple[tuple[tuple[int, ...], Any], ...]


def array_types(arrays: Sequence[Any]) -> ArrayTypes:
    """The shape and dtype of each array: what a compiled program is fixed to."""
    return tuple((np.shape(array), array.dtype) for array in arrays)


class CallAdapter:
    """How a call to a compiled function becomes its `AsyncJit` program's arguments,
    what a refused call is told, and how the result is handed back.

    This default takes positional arguments as the program's own; a transform
    subclasses it to speak of its own arguments.
    """

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
        """The program's arguments (after those fixed at lowering) for this call."""
        if kwargs:
            raise TypeError("this compiled function takes positional arguments only.")
        return args

    def other_static(self) -> str:
        """The message for a call whose static part differs from the lowered one's."""
        return (
            "this compiled function was lowered for arguments with other non-array "
            "values or another tree structure than those it is now called with. Call "
            "`.lower(...)` again with these arguments."
        )

    def other_types(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], lowered: ArrayTypes
    ) -> str:
        """The message for a call whose arrays have other shapes or dtypes."""
        del args, kwargs
        return (
            "this compiled function is called with arrays of other shapes or dtypes "
            f"than it was lowered for ({lowered}). Call `.lower(...)` again with these "
            "arguments."
        )

    def returned(self, run: Callable[[], Any]) -> Any:
        """Runs the program (`run()` gives the function's output) for the caller."""
        return run()


class Lowered(eqx.Module):
    """An `AsyncJit` program lowered for one set of arguments.

    Unlike `jax.stages.Lowered`, its compiled form is called like the function (with
    pytrees, through its `CallAdapter`) and returns the function's output.
    """

    lowered: jax.stages.Lowered = eqx.field(static=True)
    statics: tuple[StaticPart, ...] = eqx.field(static=True)
    types: ArrayTypes = eqx.field(static=True)
    donated: tuple[int, ...] = eqx.field(static=True)
    fixed: tuple[list[Any], ...]
    adapter: CallAdapter

    @classmethod
    def of(
        cls,
        program: AsyncJit,
        fixed: tuple[Any, ...],
        args: tuple[Any, ...],
        adapter: CallAdapter,
    ) -> "Lowered":
        """`program` lowered for the arguments `(*fixed, *args)`: `fixed` stay as
        they are, `args` are what `adapter.arguments` gives for each call."""
        statics, arrays = AsyncJit.split_args(args)
        _, fixed_arrays = AsyncJit.split_args(fixed)
        types = array_types([a for argument in arrays for a in argument])
        lowered = program.lower(*fixed, *args)
        return cls(
            lowered, statics, types, program.donated, tuple(fixed_arrays), adapter
        )

    def as_text(self) -> str:
        """The lowered program (StableHLO) as text."""
        return self.lowered.as_text()

    def compile(
        self, /, compiler_options: dict[str, str | bool] | None = None
    ) -> "Compiled":
        """Compiles the lowered program; the result is called like the function."""
        return Compiled(
            self.lowered.compile(compiler_options=compiler_options),
            self.statics,
            self.types,
            self.donated,
            self.fixed,
            self.adapter,
        )


class Compiled(eqx.Module):
    """An `AsyncJit` program compiled ahead of time, called like the function.

    **Raises (when called):**

    `BatchError` if the call's static part, or its arrays' shapes and dtypes, differ
    from those it was lowered for (in the words of its `CallAdapter`).
    """

    compiled: jax.stages.Compiled = eqx.field(static=True)
    statics: tuple[StaticPart, ...] = eqx.field(static=True)
    types: ArrayTypes = eqx.field(static=True)
    donated: tuple[int, ...] = eqx.field(static=True)
    fixed: tuple[list[Any], ...]
    adapter: CallAdapter

    def as_text(self) -> str:
        """The compiled, partitioned program (HLO) as text."""
        text = self.compiled.as_text()
        assert text is not None
        return text

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        adapter = self.adapter
        statics, arrays = AsyncJit.split_args(adapter.arguments(args, kwargs))
        if statics != self.statics:
            raise BatchError(adapter.other_static())
        if array_types([a for argument in arrays for a in argument]) != self.types:
            raise BatchError(adapter.other_types(args, kwargs, self.types))
        arguments = donated_once([*self.fixed, *arrays], self.donated)
        compiled = self.compiled
        return adapter.returned(lambda: AsyncJit.finish(compiled(*arguments)))
