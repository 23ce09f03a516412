"""`filter_vmap`: Equinox's `filter_vmap` with keyword arguments, chunking and errors
that name the user's own arguments.

The two building blocks, `bind_arguments` and `check_mapped_sizes`, and `bind_call`,
which joins them, are shared with `_pmap.py`: every mapped transform names arguments
and checks axis sizes the same way.
"""

import dataclasses
import functools as ft
import inspect
import re
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._errors import BatchError, bullet_list, describe, KeyPath, leaf_name
from ._tree import _is_int, is_array, mapped_leaves, resolve_axes


_DEFAULT_AXIS = eqx.if_array(0)


def _signature(fun: Callable[..., Any]) -> inspect.Signature | None:
    # `eqx.Partial` (what a decorated method becomes on an instance) hides the wrapped
    # signature behind `*args, **kwargs`; `functools.partial` exposes it properly.
    if isinstance(fun, eqx.Partial):
        fun = ft.partial(fun.func, *fun.args, **fun.keywords)
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):
        return None


def _argument_names(
    signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[str], dict[str, str]]:
    """The name of each argument in call order, and for each entry that lands in a
    `*args` or `**kwargs` parameter, that parameter's name."""
    if signature is None:
        names = [f"args[{i}]" for i in range(len(args))] + list(kwargs)
        return names, {}
    # Raises the same TypeError calling `fun` would, before any tracing.
    signature.bind(*args, **kwargs)
    params = list(signature.parameters.values())
    positional = [
        p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    var_positional = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), "")
    var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), "")
    keyword_names = {
        p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    names: list[str] = []
    owner: dict[str, str] = {}
    for i in range(len(args)):
        if i < len(positional):
            names.append(positional[i])
        else:
            name = f"{var_positional}[{i - len(positional)}]"
            names.append(name)
            owner[name] = var_positional
    for keyword in kwargs:
        if keyword in keyword_names:
            names.append(keyword)
            continue
        # A `**kwargs` entry may share its name with a positional-only parameter.
        name = keyword if keyword not in names else f"{var_keyword}[{keyword!r}]"
        names.append(name)
        owner[name] = var_keyword
    return names, owner


def bind_arguments(
    fun: Callable[..., Any],
    in_axes: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Names each argument of the call `fun(*args, **kwargs)` and gives it an axis spec.

    Mapped transforms report problems by the user's own parameter names, so the call is
    bound to `fun`'s signature (following bound methods, `functools.partial` and
    `eqx.Partial`). A `*args` parameter's entries are named `args[0]`, `args[1]`, ...;
    `**kwargs` entries by their keyword. Without an inspectable signature, positional
    arguments are named `args[0]`, ... too.

    `in_axes` is read as:

    - a `dict`: keys are parameter names (a `*args` or `**kwargs` parameter's name
        covers all its entries, a keyword covers its `**kwargs` entry); arguments not
        named get `eqx.if_array(0)`. Naming a parameter the call does not pass is
        allowed (its default is used as is, never mapped); naming anything else is an
        error.
    - a `tuple` or `list`: one spec per positional argument; keyword arguments get
        `eqx.if_array(0)`.
    - anything else (`None`, an int, a callable): one spec for every argument, keyword
        arguments included.

    **Arguments:**

    - `fun`: the function about to be called.
    - `in_axes`: the user's `in_axes`, as above.
    - `args`, `kwargs`: the call's positional and keyword arguments.

    **Returns:**

    `(arguments, axes)`: two dicts keyed by argument name in call order (positional
    arguments first, then keywords as passed); `axes[name]` is the axis-spec prefix of
    `arguments[name]`. The first `len(args)` entries are the positional arguments, so
    the call is rebuilt as `fun(*values[:len(args)], **dict(items[len(args):]))`.

    **Raises:**

    - `TypeError`: if the call does not fit `fun`'s signature, as calling it would.
    - `BatchError`: if a tuple `in_axes` does not have one entry per positional
        argument, or a dict `in_axes` names no parameter of `fun`.

    !!! Example

        ```python
        from eqx_batch._vmap import bind_arguments

        def affine(x, w, b, *, key=None):
            return x @ w + b

        arguments, axes = bind_arguments(
            affine, (0, None), (jnp.ones((8, 3)), jnp.ones((3, 2))), {"b": 1.0}
        )
        assert list(arguments) == ["x", "w", "b"]
        assert axes["w"] is None and axes["b"] == eqx.if_array(0)
        ```
    """
    signature = _signature(fun)
    names, owner = _argument_names(signature, args, kwargs)
    arguments = dict(zip(names, (*args, *kwargs.values()), strict=True))
    if isinstance(in_axes, dict):
        known = set(names) | set(owner.values())
        if signature is not None:
            known |= set(signature.parameters)
        unknown = [key for key in in_axes if key not in known]
        if unknown:
            raise BatchError(
                f"in_axes names {', '.join(f'`{k}`' for k in unknown)}, which "
                f"{'is' if len(unknown) == 1 else 'are'} not a parameter of "
                f"`{_name_of(fun)}` nor a keyword of this call. Parameters: "
                f"{', '.join(f'`{p}`' for p in _parameters(signature, names))}."
            )
        axes = {
            name: in_axes.get(name, in_axes.get(owner.get(name, ""), _DEFAULT_AXIS))
            for name in names
        }
    elif isinstance(in_axes, (tuple, list)):
        if len(in_axes) != len(args):
            passed = ", ".join(f"`{name}`" for name in names[: len(args)]) or "none"
            raise BatchError(
                f"in_axes is a {type(in_axes).__name__} of {len(in_axes)} specs, one "
                f"per positional argument, but the call passes {len(args)} positional "
                f"argument{'' if len(args) == 1 else 's'} ({passed}). Give one spec "
                "per positional argument (keyword arguments get eqx.if_array(0)), or "
                "a dict keyed by parameter name."
            )
        axes = dict(zip(names, in_axes, strict=False))
        axes.update((name, _DEFAULT_AXIS) for name in names[len(args) :])
    else:
        axes = dict.fromkeys(names, in_axes)
    return arguments, axes


def _name_of(fun: Callable[..., Any]) -> str:
    return getattr(fun, "__qualname__", None) or type(fun).__name__


def _parameters(signature: inspect.Signature | None, names: list[str]) -> list[str]:
    return list(signature.parameters) if signature is not None else names


_LeavesByArgument = dict[str, list[tuple[KeyPath, Any, int | None]]]


def _mapped(arguments: dict[str, Any], axes: dict[str, Any]) -> _LeavesByArgument:
    return {
        name: mapped_leaves(value, axes[name], name)
        for name, value in arguments.items()
    }


def _render_spec(spec: Any, value: Any) -> str | None:
    """How to write `spec` for `value` in a suggested `in_axes`, if it can be."""
    if spec is None or _is_int(spec):
        return repr(spec)
    if isinstance(spec, eqx.if_array):
        leaves = jtu.tree_leaves(value)
        if not any(is_array(leaf) for leaf in leaves):
            return "None"
        if len(leaves) == 1:
            return repr(spec.axis)
        return f"eqx.if_array({spec.axis})"
    return None


def _suggest_in_axes(
    arguments: dict[str, Any],
    axes: dict[str, Any],
    unmap: list[str],
    positional: int | None,
) -> str | None:
    """A full `in_axes` that maps as before except for `unmap`, if one can be."""
    rendered = {
        name: "None" if name in unmap else _render_spec(axes[name], value)
        for name, value in arguments.items()
    }
    if any(text is None for text in rendered.values()):
        return None
    names = list(arguments)
    if positional is not None and not set(unmap) & set(names[positional:]):
        default = {
            name: _render_spec(_DEFAULT_AXIS, arguments[name])
            for name in names[positional:]
        }
        if all(rendered[name] == default[name] for name in names[positional:]):
            specs = [str(rendered[name]) for name in names[:positional]]
            trailing = "," if len(specs) == 1 else ""
            return f"({', '.join(specs)}{trailing})"
    if any("[" in name for name in names):
        return None  # `*args` / `**kwargs` entries cannot be keyed one by one.
    return "{" + ", ".join(f"{name!r}: {rendered[name]}" for name in names) + "}"


def _own_sizes(mapped: _LeavesByArgument) -> dict[str, int]:
    """The size of each argument whose mapped leaves agree among themselves."""
    own = {}
    for name, triples in mapped.items():
        sizes = {leaf.shape[axis] for _, leaf, axis in triples if axis is not None}
        if len(sizes) == 1:
            own[name] = sizes.pop()
    return own


def _reference_size(
    mapped: _LeavesByArgument, own: dict[str, int], axis_size: int | None
) -> tuple[int, str]:
    """The size the others are checked against, and where it comes from: `axis_size`;
    else the one size that arguments agreeing among themselves have; else the size
    most mapped leaves have."""
    if axis_size is not None:
        return axis_size, f"axis_size={axis_size}"
    if own:
        name = next(iter(own))
        return own[name], f"the size of `{name}`"
    counts = Counter(
        leaf.shape[axis]
        for triples in mapped.values()
        for _, leaf, axis in triples
        if axis is not None
    )
    size = max(counts, key=counts.__getitem__)  # on a tie, the size seen first
    return size, "the size most mapped leaves have"


def check_mapped_sizes(
    arguments: dict[str, Any],
    axes: dict[str, Any],
    axis_size: int | None = None,
    *,
    positional: int | None = None,
) -> int | None:
    """The size of the mapped axis, checked across every mapped leaf before tracing.

    JAX and Equinox report a size mismatch with internal names
    (`_dynamic_args[0].layers[0].weight`) and without saying which leaf is wrong; this
    names every leaf that disagrees by the user's argument name and path, with its size,
    and suggests the `in_axes` that fixes the common mistake of mapping an argument that
    is shared by every member. It reads only shapes, so under `jax.jit` it runs once per
    trace and costs nothing per call.

    When one size is known to be right (`axis_size`, or the one size that arguments
    whose mapped leaves agree among themselves have), every leaf of another size is
    listed, and whole arguments without a leaf of the right size are suggested the axis
    spec `None`. When two or more arguments each agree among themselves but on
    different sizes (`f(model, x)` with an unstacked `eqx.nn.Linear` and a batch `x`),
    any of those sizes could be the number of members: the sizes are listed by
    argument, and every reading that maps the arguments of one size and broadcasts the
    rest is suggested, most likely first:

    1. the size more arguments agree on: separate arguments rarely share a size by
        accident, whereas within one argument sizes often agree by construction (a
        `Linear`'s weight and bias both start with `out_features`);
    2. then a reading that maps no 1-d leaf: it would give each member a scalar, and a
        single vector (a bias, one input) mistaken for a batch is the usual culprit;
    3. then the larger size;
    4. then the order of the arguments.

    **Arguments:**

    - `arguments`, `axes`: as returned by `bind_arguments`.
    - `axis_size`: the user's `axis_size`, if any; mapped leaves must then have it too.
    - `positional`: how many leading entries of `arguments` were passed positionally
        (`len(args)`); with it, the suggested fix can be written as a tuple `in_axes`.

    **Returns:**

    The common size of every mapped leaf; `axis_size` if no leaf is mapped (`None` if
    that is not given either).

    **Raises:**

    `BatchError` if an axis spec is not a prefix of its argument or is not an axis spec,
    if a mapped leaf is not an array, is 0-d, or lacks the axis, or if mapped leaves (or
    `axis_size`) disagree on the size.

    !!! Example

        ```python
        from eqx_batch._vmap import check_mapped_sizes

        arguments = {"x": jnp.ones((8, 3)), "w": jnp.ones((3, 2))}
        axes = {"x": 0, "w": None}
        assert check_mapped_sizes(arguments, axes) == 8
        ```
    """
    return _checked(arguments, axes, axis_size, positional)[0]


def _checked(
    arguments: dict[str, Any],
    axes: dict[str, Any],
    axis_size: int | None,
    positional: int | None,
) -> tuple[int | None, _LeavesByArgument]:
    mapped = _mapped(arguments, axes)
    sizes = [
        (name, path, leaf, axis)
        for name, triples in mapped.items()
        for path, leaf, axis in triples
        if axis is not None
    ]
    if not sizes:
        return axis_size, mapped
    own = _own_sizes(mapped)
    if axis_size is None and len(set(own.values())) > 1:
        raise BatchError(_ambiguous(arguments, axes, mapped, own, positional))
    size, source = _reference_size(mapped, own, axis_size)
    wrong = [
        (name, path, leaf, axis)
        for name, path, leaf, axis in sizes
        if leaf.shape[axis] != size
    ]
    if not wrong:
        return size, mapped
    message = (
        f"mapped leaves disagree on the size of the mapped axis. Taking {size} "
        f"({source}) as the number of members, these mapped leaves differ:\n"
        + bullet_list([_size_line(*leaf) for leaf in wrong])
    )
    # The fix is obvious when whole arguments have no mapped leaf of the right size:
    # they are most likely shared by every member and should not be mapped.
    wrong_names = list(dict.fromkeys(name for name, *_ in wrong))
    right_names = {name for name, path, leaf, axis in sizes if leaf.shape[axis] == size}
    unmap = [name for name in wrong_names if name not in right_names]
    if unmap == wrong_names:
        message += (
            f"\n{_arguments(unmap, 'Argument')} {_plural(unmap, 'has', 'have')} no "
            f"mapped leaf of size {size}; if shared by every member, give "
            f"{_plural(unmap, 'it', 'them')} the axis spec None"
        )
        suggestion = _suggest_in_axes(arguments, axes, unmap, positional)
        message += f": did you mean in_axes={suggestion}?" if suggestion else "."
    raise BatchError(message)


def _size_line(name: str, path: KeyPath, leaf: Any, axis: int) -> str:
    size = leaf.shape[axis]
    return f"`{leaf_name(name, path)}`: size {size} (axis {axis} of {describe(leaf)})"


def _arguments(names: list[str], noun: str = "argument") -> str:
    """``argument `x` `` or ``arguments `a`, `w` and `b` ``."""
    *rest, last = [f"`{name}`" for name in names]
    listed = f"{', '.join(rest)} and {last}" if rest else last
    return f"{_plural(names, noun, noun + 's')} {listed}"


def _plural(names: list[str], one: str, many: str) -> str:
    return one if len(names) == 1 else many


def _ambiguous(
    arguments: dict[str, Any],
    axes: dict[str, Any],
    mapped: _LeavesByArgument,
    own: dict[str, int],
    positional: int | None,
) -> str:
    """The message for arguments that each agree on a size of their own: the sizes by
    argument, and each reading that maps one size, in the order documented in
    `check_mapped_sizes`."""
    leaves = {
        name: [(path, leaf, axis) for path, leaf, axis in triples if axis is not None]
        for name, triples in mapped.items()
    }
    leaves = {name: triples for name, triples in leaves.items() if triples}
    lines = []
    for name, triples in leaves.items():
        if name in own and len(triples) > 1:
            path, leaf, axis = triples[0]
            lines.append(
                f"`{name}`: size {own[name]} (all {len(triples)} mapped leaves, such "
                f"as `{leaf_name(name, path)}`: axis {axis} of {describe(leaf)})"
            )
        else:
            lines.extend(_size_line(name, *triple) for triple in triples)
    message = (
        "mapped leaves disagree on the size of the mapped axis, and with no axis_size "
        "given, any of several sizes could be the number of members. Mapped sizes by "
        "argument:\n" + bullet_list(lines)
    )
    sizes = {
        name: {leaf.shape[axis] for _, leaf, axis in triples}
        for name, triples in leaves.items()
    }
    readings = []
    for size in dict.fromkeys(own.values()):
        kept = [name for name in own if own[name] == size]
        shared = [name for name in leaves if name not in kept]
        if any(size in sizes[name] for name in shared):
            continue  # it would map only part of an argument
        scalar = any(np.ndim(leaf) == 1 for name in kept for _, leaf, _ in leaves[name])
        readings.append(((-len(kept), scalar, -size), size, shared))
    readings.sort(key=lambda reading: reading[0])  # stable: then argument order
    if not readings:
        return message
    clauses = []
    for _, size, shared in readings:
        suggestion = _suggest_in_axes(arguments, axes, shared, positional)
        clause = f"{_arguments(shared)} shared ({size} members)"
        if not clauses:
            ask = f": did you mean in_axes={suggestion}?" if suggestion else "."
            clauses.append(f"With {clause}{ask}")
        else:
            fix = f": in_axes={suggestion}" if suggestion else ""
            clauses.append(f"with {clause}{fix}")
    message += (
        "\nMap the arguments of one size, and give the others, if shared by every "
        f"member, the axis spec None. {clauses[0]}"
    )
    if len(clauses) > 1:
        message += f" Otherwise, {'; '.join(clauses[1:])}."
    return message


class _Static(eqx.Module):
    # Carries the non-array parts of an output through `jax.vmap` / `lax.scan`, which
    # accept array leaves only.
    value: Any = eqx.field(static=True)


@dataclasses.dataclass(frozen=True)
class _Mapped:
    """One call, bound and checked: which leaves are mapped, and how to call `fun`."""

    leaves: list[Any]
    axes: list[int | None]
    treedef: Any
    keywords: tuple[str, ...]

    def dynamic(self) -> tuple[list[Any], list[int]]:
        """The mapped leaves and their member axes."""
        pairs = [
            (leaf, axis)
            for leaf, axis in zip(self.leaves, self.axes, strict=True)
            if axis is not None
        ]
        return [leaf for leaf, _ in pairs], [axis for _, axis in pairs]

    def call(self, fun: Callable[..., Any], dynamic: list[Any]) -> Any:
        """`fun` called with the mapped leaves replaced by `dynamic`."""
        members = iter(dynamic)
        leaves = [
            leaf if axis is None else next(members)
            for leaf, axis in zip(self.leaves, self.axes, strict=True)
        ]
        return self.invoke(fun, leaves)

    def invoke(self, fun: Callable[..., Any], leaves: list[Any]) -> Any:
        """`fun` called with `leaves` in place of the call's leaves."""
        values = jtu.tree_unflatten(self.treedef, leaves)
        positional = len(values) - len(self.keywords)
        return fun(
            *values[:positional],
            **dict(zip(self.keywords, values[positional:], strict=True)),
        )


def bind_call(
    fun: Callable[..., Any],
    in_axes: Any,
    axis_size: int | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[_Mapped, int | None]:
    """`bind_arguments` then `check_mapped_sizes`: the call as leaves with their member
    axes, and the size of the mapped axis."""
    arguments, axes = bind_arguments(fun, in_axes, args, kwargs)
    size, mapped = _checked(arguments, axes, axis_size, len(args))
    leaves, treedef = jtu.tree_flatten(list(arguments.values()))
    leaf_axes = [axis for triples in mapped.values() for _, _, axis in triples]
    return _Mapped(leaves, leaf_axes, treedef, tuple(kwargs)), size


def _split_output(out: Any, out_axes: Any) -> tuple[list[Any], list[Any], _Static]:
    """`(mapped arrays, unmapped arrays, everything else)` of one member's output."""
    resolved = resolve_axes(out, out_axes, "out")
    leaves, treedef = jtu.tree_flatten_with_path(out)
    axes = treedef.flatten_up_to(resolved)
    mapped, unmapped, layout = [], [], []
    for (path, leaf), axis in zip(leaves, axes, strict=True):
        if axis is None:
            if is_array(leaf):
                unmapped.append(leaf)
                layout.append(("unmapped", path))
            else:
                layout.append(("static", leaf))
            continue
        if not is_array(leaf):
            raise BatchError(
                f"output `{leaf_name('out', path)}` is {describe(leaf)}, not an array, "
                f"but out_axes asks for member axis {axis}. Give it out_axes None "
                "(`eqx.if_array(0)` does so for non-arrays)."
            )
        ndim = np.ndim(leaf) + 1
        if not -ndim <= axis < ndim:
            raise BatchError(
                f"output `{leaf_name('out', path)}` has {ndim} "
                f"{'axis' if ndim == 1 else 'axes'} once mapped "
                f"({describe(leaf)} per member) but out_axes asks for member axis "
                f"{axis}, which is out of range."
            )
        mapped.append(leaf)
        layout.append(("mapped", axis % ndim))
    return mapped, unmapped, _Static((treedef, layout))


def _join_output(mapped: list[Any], unmapped: list[Any], static: _Static) -> Any:
    """Inverse of `_split_output`, with each mapped array's member axis (at the front)
    moved to where out_axes asks."""
    treedef, layout = static.value
    mapped_iter, unmapped_iter = iter(mapped), iter(unmapped)
    leaves = []
    for kind, value in layout:
        if kind == "mapped":
            leaves.append(jnp.moveaxis(next(mapped_iter), 0, value))
        elif kind == "unmapped":
            leaves.append(next(unmapped_iter))
        else:
            leaves.append(value)
    return jtu.tree_unflatten(treedef, leaves)


class _VmapWrapper(eqx.Module):
    fun: Callable[..., Any]
    in_axes: Any
    out_axes: Any
    axis_name: Hashable | None
    axis_size: int | None
    chunk_size: int | None

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.fun

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        call, size = bind_call(self.fun, self.in_axes, self.axis_size, args, kwargs)
        if size is None:
            return self._unmapped(args, kwargs)
        if self.chunk_size is None or self.chunk_size >= size:
            return self._vmapped(call, size)
        if self.axis_name is not None:
            raise BatchError(
                f"axis_name={self.axis_name!r} with chunk_size={self.chunk_size} < "
                f"{size} members: a collective over `{self.axis_name}` inside a chunk "
                "would see only that chunk's members. Drop chunk_size, or compute the "
                "collective outside filter_vmap."
            )
        # Compile the loop over chunks so it is not bound by Python dispatch, and so
        # an eager `jax.grad` reuses it; under an outer `jax.jit` it is just traced.
        return _compiled_chunked(self, args, kwargs)

    def _unmapped(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self.fun(*args, **kwargs)
        mapped, _, _ = _split_output(out, self.out_axes)
        if mapped:
            raise BatchError(
                "no argument has a mapped array leaf and axis_size is not given, so "
                "the number of members is unknown, yet out_axes asks for a member "
                "axis in the output. Map an argument, pass axis_size=..., or give the "
                "output out_axes None."
            )
        return out

    def _vmap(
        self, call: _Mapped, size: int, in_axes: list[int]
    ) -> Callable[[list[Any]], Any]:
        layouts: list[_Static] = []

        def recorded(dynamic: list[Any]) -> tuple[list[Any], list[Any], _Static]:
            out = _split_output(call.call(self.fun, dynamic), self.out_axes)
            layouts.append(out[2])
            return out

        vmapped = jax.vmap(
            recorded,
            in_axes=(in_axes,),
            out_axes=(0, None, None),
            axis_name=self.axis_name,
            axis_size=size,
        )

        def run(dynamic: list[Any]) -> Any:
            try:
                return vmapped(dynamic)
            except ValueError as e:
                # JAX names the output by its place in our (mapped, unmapped, static)
                # triple; translate that to the user's output path.
                found = re.search(r"out_axes\[1\]\[(\d+)\]", str(e))
                if found is None or not layouts:
                    raise
                _, layout = layouts[-1].value
                paths = [path for kind, path in layout if kind == "unmapped"]
                name = leaf_name("out", paths[int(found[1])])
                raise BatchError(
                    f"output `{name}` has out_axes None but differs between members "
                    "(it depends on a mapped argument). Give it a member axis in "
                    "out_axes, or compute it from unmapped arguments only."
                ) from None

        return run

    def _vmapped(self, call: _Mapped, size: int) -> Any:
        dynamic, in_axes = call.dynamic()
        return _join_output(*self._vmap(call, size, in_axes)(dynamic))

    def _chunked(self, call: _Mapped, size: int) -> Any:
        assert self.chunk_size is not None
        chunk = self.chunk_size
        full, remainder = divmod(size, chunk)
        dynamic, in_axes = call.dynamic()
        fronts = [
            jnp.moveaxis(leaf, axis, 0)
            for leaf, axis in zip(dynamic, in_axes, strict=True)
        ]
        front_axes = [0] * len(fronts)
        chunks = [
            leaf[: full * chunk].reshape(full, chunk, *leaf.shape[1:])
            for leaf in fronts
        ]
        run_chunk = self._vmap(call, chunk, front_axes)
        _, (mapped, unmapped, static) = jax.lax.scan(
            lambda carry, xs: (carry, run_chunk(xs)), None, chunks, length=full
        )
        mapped = [out.reshape(full * chunk, *out.shape[2:]) for out in mapped]
        # Unmapped outputs cannot depend on the members (JAX rejects that), so every
        # chunk computed the same value.
        unmapped = [out[0] for out in unmapped]
        if remainder:
            rest = [leaf[full * chunk :] for leaf in fronts]
            rest_mapped, _, _ = self._vmap(call, remainder, front_axes)(rest)
            mapped = [
                jnp.concatenate([out, last])
                for out, last in zip(mapped, rest_mapped, strict=True)
            ]
        return _join_output(mapped, unmapped, static)

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


@eqx.filter_jit
def _compiled_chunked(
    wrapper: _VmapWrapper, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    call, size = bind_call(
        wrapper.fun, wrapper.in_axes, wrapper.axis_size, args, kwargs
    )
    assert size is not None
    return wrapper._chunked(call, size)


@overload
def filter_vmap(
    *,
    in_axes: Any = eqx.if_array(0),
    out_axes: Any = eqx.if_array(0),
    axis_name: Hashable | None = None,
    axis_size: int | None = None,
    chunk_size: int | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def filter_vmap(
    fun: Callable[..., Any],
    *,
    in_axes: Any = eqx.if_array(0),
    out_axes: Any = eqx.if_array(0),
    axis_name: Hashable | None = None,
    axis_size: int | None = None,
    chunk_size: int | None = None,
) -> Callable[..., Any]: ...


def filter_vmap(
    fun: Callable[..., Any] | None = None,
    *,
    in_axes: Any = eqx.if_array(0),
    out_axes: Any = eqx.if_array(0),
    axis_name: Hashable | None = None,
    axis_size: int | None = None,
    chunk_size: int | None = None,
) -> Any:
    """Vectorises a function over a member axis, like `eqx.filter_vmap`, with keyword
    arguments, chunking, and errors that name your own arguments.

    It gives the same results as `eqx.filter_vmap` for every call that accepts. On top
    of that: keyword arguments work at call time (Equinox rejects them, which bites
    every `key=` argument); `chunk_size` maps a few members at a time so peak memory
    follows the chunk, not the batch; and a mismatch in axis sizes is reported before
    tracing, naming every disagreeing leaf by argument name and path
    (`model.layers[0].weight`) with its size, and, where the fix is obvious, the
    `in_axes` that fixes it (one per possible size, the likeliest first, when several
    arguments each agree on a size of their own). The checks read only shapes, so
    under `eqx.filter_jit` they run once per compilation and cost nothing per call.

    **Arguments:**

    - `fun`: the function to vectorise. May be omitted to use `filter_vmap` as a
        decorator with arguments. Methods work too: decorated in a class body, `self` is
        an argument like any other (mapped by default).
    - `in_axes`: the member axis of each argument, as axis specs (`None` to broadcast,
        an int, or a callable `leaf -> int | None` such as `eqx.if_array(0)`) arranged
        as a pytree prefix. Either:
        - a tuple (or list), one entry per *positional* argument; keyword arguments
            get the default `eqx.if_array(0)`;
        - a dict keyed by parameter name (positional or keyword); arguments not named
            get `eqx.if_array(0)`. The name of a `*args` or `**kwargs` parameter covers
            all its entries. Naming a parameter that a call leaves at its default is
            fine: defaults are used as they are, never mapped;
        - a single spec, applied to every argument, keyword ones included.
        Negative axes count from the end.
    - `out_axes`: where the member axis goes in each output leaf, as a pytree prefix of
        axis specs for one member's output. `None` returns a leaf unbatched; non-array
        outputs are returned as they are under the default `eqx.if_array(0)`.
    - `axis_name`: a name for the mapped axis, for collectives such as `jax.lax.psum`.
    - `axis_size`: the number of members. Needed only when no argument is mapped;
        otherwise every mapped leaf must have it.
    - `chunk_size`: map this many members at a time, in a compiled loop over chunks (the
        remainder mapped once more at the end); `None` maps all at once. Results equal
        the unchunked ones: bitwise for elementwise programs when both are compiled,
        up to floating-point reassociation otherwise. Outside `jax.jit` the loop is
        compiled on first use, as `eqx.filter_jit` would (non-array arguments are
        static: a new value compiles anew).

    **Returns:**

    The vectorised `fun`: called like `fun`, it returns `fun`'s output with a member
    axis on every array leaf whose `out_axes` is not `None`.

    **Raises:**

    - `BatchError` (at the call, before tracing): if mapped leaves disagree on the
        number of members (or disagree with `axis_size`), listing each with its size and
        suggesting the `in_axes` that broadcasts the arguments that are most likely
        shared (with no `axis_size` and several arguments that each agree on a size of
        their own, one suggestion per size, as the guide's "Reading eqx_batch's error
        messages" explains); if a mapped leaf is not an array, is 0-d, or has no such
        axis; if `in_axes` is not a prefix of the arguments (a tuple needs one entry per
        positional argument, a dict may name only parameters); if `axis_name` is given
        with a `chunk_size` smaller than the number of members (a collective in a chunk
        cannot see the whole axis); if `out_axes` maps a non-array output or an axis out
        of range, or maps an output when nothing is mapped and `axis_size` is not given;
        if an output with `out_axes` `None` differs between members.
    - `BatchError` (at decoration): if `chunk_size` is not a positive int.
    - `TypeError`: if a call does not fit `fun`'s signature, as calling `fun` would.

    !!! Example

        ```python
        def affine(x, w, b, *, key):
            noise = 0.01 * jax.random.normal(key, b.shape)
            return x @ w + b + noise

        xs = jnp.ones((8, 3))
        w, b = jnp.ones((3, 2)), jnp.zeros(2)
        keys = jax.random.split(jax.random.key(0), 8)

        batched = eb.filter_vmap(affine, in_axes=(0, None, None))
        assert batched(xs, w, b, key=keys).shape == (8, 2)

        # The same, 3 members at a time (8 = 3 + 3 + 2).
        chunked = eb.filter_vmap(affine, in_axes=(0, None, None), chunk_size=3)
        assert jnp.allclose(chunked(xs, w, b, key=keys), batched(xs, w, b, key=keys))

        try:
            eb.filter_vmap(affine)(xs, w, b, key=keys)
        except eb.BatchError as e:
            print(e)  # ... did you mean in_axes=(0, None, None)?
        ```
    """
    if fun is None:
        return ft.partial(
            filter_vmap,
            in_axes=in_axes,
            out_axes=out_axes,
            axis_name=axis_name,
            axis_size=axis_size,
            chunk_size=chunk_size,
        )
    if chunk_size is not None and (not _is_int(chunk_size) or chunk_size < 1):
        raise BatchError(
            f"chunk_size={chunk_size!r}; it must be a positive int (members mapped at "
            "a time), or None to map all members at once."
        )
    wrapper = _VmapWrapper(fun, in_axes, out_axes, axis_name, axis_size, chunk_size)
    return eqx.module_update_wrapper(wrapper)
