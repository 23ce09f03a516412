"""index and take: selecting members of a stacked pytree by position."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_identical, raises

import eqx_batch as eb


def test_index_and_take():
    stacked = {"w": jnp.arange(12.0).reshape(4, 3), "b": np.arange(4), "s": "k"}
    member = eb.index(stacked, 1)
    assert_trees_identical(
        member, {"w": jnp.arange(3.0, 6.0), "b": np.array(1), "s": "k"}
    )
    assert_trees_identical(eb.index(stacked, -1), eb.unstack(stacked)[-1])
    subset = eb.take(stacked, [3, -4, 3])
    assert_trees_identical(subset, eb.stack([eb.index(stacked, i) for i in (3, 0, 3)]))
    assert type(subset["b"]) is np.ndarray
    empty = eb.take(stacked, np.zeros(0, np.int32))
    assert empty["w"].shape == (0, 3)


def test_traced_negative_indices_count_from_the_end():
    tree = {"w": jnp.arange(4.0)}
    assert jax.jit(eb.take)(tree, jnp.array([-1]))["w"].tolist() == [3.0]
    assert jax.jit(eb.take)(tree, jnp.array([-4, -1, 2]))["w"].tolist() == [0, 3, 2]
    assert jax.jit(eb.index)(tree, jnp.array(-1))["w"] == 3.0
    assert jax.jit(eb.index)(tree, jnp.array(-4))["w"] == 0.0
    # Eagerly the same, on CPU, NumPy and weakly typed leaves.
    for leaf in (jnp.arange(4.0), np.arange(4.0), jnp.full(4, 3.0)):
        assert eb.take({"w": leaf}, jnp.array([-1]))["w"].tolist() == [leaf[-1]]
        assert eb.index({"w": leaf}, -1)["w"] == leaf[-1]


def test_uint64_indices_are_range_checked_before_casting():
    tree = {"w": jnp.arange(3.0)}
    huge = np.array([2**64 - 1], np.uint64)  # -1 if cast to int64 first
    raises("out of range", lambda: eb.take(tree, huge), str(2**64 - 1))
    raises("out of range", lambda: eb.take(tree, [2**63 + 5]))
    index: Any = eb.index  # NumPy integers are accepted, though not `int`s
    raises("out of range", lambda: index(tree, np.uint64(2**64 - 1)))
    assert eb.take(tree, np.array([2], np.uint64))["w"].tolist() == [2.0]
    assert index(tree, np.uint64(1))["w"] == 1.0


@pytest.mark.parametrize("index", [True, False, np.bool_(True), np.array(True)])
def test_bools_are_refused_as_indices(index):
    tree = {"w": jnp.arange(3.0)}
    raises("bool", lambda: eb.index(tree, index))
    raises("integers", lambda: eb.take(tree, [index]))
    raises("integers", lambda: eb.take(tree, [1, index]))
    with pytest.raises(eb.BatchError, match="integer"):
        jax.jit(eb.index)(tree, jnp.asarray(index))


def test_index_out_of_range():
    tree = {"w": jnp.zeros((3, 2))}
    raises("out of range", lambda: eb.index(tree, 3), "3 members", "-3 to 2")
    raises("out of range", lambda: eb.index(tree, -4), "-4")
    raises("integer", lambda: eb.index(tree, 1.0))  # pyright: ignore[reportArgumentType]
    raises("out of range", lambda: eb.take(tree, [0, 3, -5]), "[3, -5]")
    raises("1-d", lambda: eb.take(tree, 1))
    raises("1-d", lambda: eb.take(tree, [0.5]))
    raises("1-d", lambda: eqx.filter_jit(eb.take)(tree, jnp.array(1)))
    assert eb.take(tree, [])["w"].shape == (0, 2)


def test_traced_index_below_minus_n_is_clamped_like_take():
    # Issue 15, item 7: -5 of 4 members wrapped twice, to the last member.
    tree = {"w": jnp.arange(4.0)}
    for i, member in ((-5, 0.0), (-100, 0.0), (4, 3.0), (100, 3.0)):
        assert jax.jit(eb.index)(tree, jnp.array(i))["w"] == member
        assert jax.jit(eb.take)(tree, jnp.array([i]))["w"].tolist() == [member]
        assert jax.jit(lambda w, i: w[i])(tree["w"], i) == member
