"""`filter_vmap`: Equinox's `filter_vmap` with keyword arguments, chunking and errors
that name the user's own arguments.

A call is bound to the function's signature and its mapped sizes are checked
(`_mapped_call.py`), and one member's output is split into what `jax.vmap` can carry
(`_outputs.py`), its static part checked for values traced inside
(`_static_tracers.py`).
"""

import functools as ft
import re
from collections.abc import Callable, Hashable
from typing import Any, overload

import equinox as eqx
import jax
import jax.numpy as jnp

from .._errors import BatchError, check_int, leaf_name
from ._mapped_call import bind_call, MappedCall
from ._outputs import join_output, OutputSkeleton, split_output
from ._sizes import check_axis_size
from ._static_tracers import check_output_static


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
                f"{size} members: drop chunk_size "
                "(see docs/transforms.md#what-is-refused)."
            )
        # Compile the loop over chunks so it is not bound by Python dispatch, and so
        # an eager `jax.grad` reuses it; under an outer `jax.jit` it is just traced.
        return _compiled_chunked(self, args, kwargs)

    def _unmapped(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self.fun(*args, **kwargs)
        mapped, _, _ = split_output(out, self.out_axes)
        if mapped:
            raise BatchError(
                "out_axes asks for a member axis but no argument is mapped: pass "
                "axis_size=..., or give the output out_axes None."
            )
        return out

    def _vmap(
        self, call: MappedCall, size: int, in_axes: list[int]
    ) -> Callable[[list[Any]], Any]:
        skeletons: list[OutputSkeleton] = []

        def recorded(
            dynamic: list[Any],
        ) -> tuple[list[Any], list[Any], OutputSkeleton]:
            out = split_output(call.call(self.fun, dynamic), self.out_axes)
            skeletons.append(out[2])
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
                out = vmapped(dynamic)
            except ValueError as e:
                # JAX names the output by its place in our (mapped, unmapped, static)
                # triple; translate that to the user's output path.
                found = re.search(r"out_axes\[1\]\[(\d+)\]", str(e))
                if found is None or not skeletons:
                    raise
                name = leaf_name("out", skeletons[-1].unmapped_paths[int(found[1])])
                raise BatchError(
                    f"output `{name}` has out_axes None but differs between members: "
                    "give it a member axis."
                ) from None
            check_output_static(out[2].static, "filter_vmap")
            return out

        return run

    def _vmapped(self, call: MappedCall, size: int) -> Any:
        dynamic, in_axes = call.dynamic()
        return join_output(*self._vmap(call, size, in_axes)(dynamic))

    def _chunked(self, call: MappedCall, size: int) -> Any:
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
        _, (mapped, unmapped, skeleton) = jax.lax.scan(
            lambda carry, xs: (carry, run_chunk(xs)), None, chunks, length=full
        )
        check_output_static(
            skeleton.static,
            "filter_vmap",
            compiled="With chunk_size, the chunks run in a compiled loop",
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
        return join_output(mapped, unmapped, skeleton)

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
            all its entries. As in Equinox, every name must be an argument the call
            passes: whether a default should be mapped would be a guess;
        - a single spec, applied to every argument, keyword ones included.
        Negative axes count from the end.
    - `out_axes`: where the member axis goes in each output leaf, as a pytree prefix of
        axis specs for one member's output. `None` returns a leaf unbatched; non-array
        outputs are returned as they are under the default `eqx.if_array(0)`, and a
        Python scalar (`1`, `0.5`, `True`) given an int becomes an array with a member
        axis, one copy per member, as with `eqx.filter_vmap`.
    - `axis_name`: a name for the mapped axis, for collectives such as `jax.lax.psum`.
    - `axis_size`: the number of members, a non-negative int. Needed only when no
        argument is mapped; otherwise every mapped leaf must have it.
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
        positional argument, a dict may name only arguments the call passes); if a
        Python list of members of one structure is passed where a stacked tree is
        expected (the message says so, and that `eb.stack` stacks it); if `axis_name`
        is given with a `chunk_size` smaller than the number of members (a collective
        in a chunk cannot see the whole axis); if `out_axes` maps an output that is
        neither an array nor a Python scalar, or an axis out of range, or maps an
        output when nothing is mapped and `axis_size` is not given; if an output with
        `out_axes` `None` differs between members.
    - `BatchError` (while tracing, so once per compilation under `jax.jit`): if a
        static part of the output (a field declared `eqx.field(static=True)`, as in
        equinox#312) holds a value traced inside `fun`, or, with `chunk_size`, any
        traced value. Static fields are not batched, so such a value has no member
        axis and would outlive its trace; the message names each by its path
        (`out.config.scale`). Equinox returns it, and its next use raises JAX's
        `UnexpectedTracerError`.
    - `BatchError` (at decoration): if `chunk_size` is not a positive int, or
        `axis_size` is neither `None` nor a non-negative int (bools are refused).
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
    if chunk_size is not None:
        chunk_size = check_int(
            chunk_size,
            "chunk_size",
            minimum=1,
            hint="It is the number of members mapped at a time; None maps all "
            "members at once.",
        )
    axis_size = check_axis_size(axis_size)
    wrapper = _VmapWrapper(fun, in_axes, out_axes, axis_name, axis_size, chunk_size)
    return eqx.module_update_wrapper(wrapper)
