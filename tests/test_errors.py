"""`BatchError` and the message helpers in `_errors.py`."""

import ast
import pathlib
import re
import statistics

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqx_batch as eb
from eqx_batch._errors import (
    bullet_list,
    call_mismatch,
    check_int,
    describe,
    leaf_name,
    qualified_name,
)


def test_batch_error_is_a_value_error():
    assert issubclass(eb.BatchError, ValueError)


def test_leaf_name_uses_keystr():
    tree = {"layer2": {"weights": 1}, "layers": [0, (1, 2)]}
    paths = [path for path, _ in jtu.tree_flatten_with_path(tree)[0]]
    names = [leaf_name("trees[3]", path) for path in paths]
    assert "trees[3]['layer2']['weights']" in names
    assert "trees[3]['layers'][1][0]" in names
    mlp_paths = jtu.tree_flatten_with_path(
        eqx.nn.Linear(2, 2, key=jnp.zeros(2, "uint32"))
    )
    assert leaf_name("model", mlp_paths[0][0][0]) == "model.weight"
    assert leaf_name("tree", ()) == "tree"


def test_describe():
    assert describe(jnp.zeros((3, 4))) == "float32[3,4]"
    assert describe(np.zeros((), np.int8)) == "int8[]"
    assert describe(np.float32(1.0)) == "float32[]"
    assert describe(jax.ShapeDtypeStruct((2, 5), jnp.bfloat16)) == "bfloat16[2,5]"
    assert describe("abc") == "'abc'"
    long = describe("x" * 200)
    assert len(long) == 80 and long.endswith("...")


def test_describe_names_functions():
    def relu_like(x):
        return x

    assert (
        describe(relu_like)
        == "<function test_describe_names_functions.<locals>.relu_like>"
    )
    # Wrappers whose repr hides the function's name.
    assert describe(jax.jit(relu_like)).startswith("<function test_describe_names")
    assert describe(jax.nn.relu) == "<function relu>"
    # A class is described by its repr, not as a function.
    assert describe(int) == "<class 'int'>"


def test_describe_traced_array():
    seen = []
    jax.jit(lambda x: seen.append(describe(x)))(jnp.zeros((2, 3), jnp.int8))
    assert seen == ["int8[2,3]"]


def test_qualified_name():
    # Wrappers such as `jax.custom_jvp` have a module and a qualname too.
    assert qualified_name(jax.nn.relu) == "jax._src.nn.functions.relu"
    assert qualified_name(eqx.nn.Linear) == "equinox.nn._linear.Linear"
    assert qualified_name(np.sum) == "numpy.sum"
    assert qualified_name(3) is None and qualified_name("relu") is None


@pytest.mark.parametrize("value", [3, np.int64(3), np.uint8(3), np.array(3)])
def test_check_int_accepts_integers(value):
    checked = check_int(value, "count")
    assert checked == 3 and type(checked) is int


@pytest.mark.parametrize(
    "value, shown",
    [
        (True, "True"),
        (np.bool_(False), "np.False_"),
        (2.0, "2.0"),
        ("3", "'3'"),
        (None, "None"),
        (np.arange(3), "int64[3]"),
        (-1, "-1"),
    ],
)
def test_check_int_refuses(value, shown):
    with pytest.raises(eb.BatchError) as info:
        check_int(value, "count", hint="It is the number of things.")
    assert str(info.value) == (
        f"`count` is {shown}; it must be an int >= 0. It is the number of things."
    )


def test_check_int_range():
    assert check_int(5, "n", minimum=1, maximum=5) == 5
    with pytest.raises(
        eb.BatchError, match=r"^`n` is 6; it must be an int from 1 to 5\.$"
    ):
        check_int(6, "n", minimum=1, maximum=5)
    with pytest.raises(eb.BatchError, match="must be an int >= 1"):
        check_int(0, "n", minimum=1)


class _ArraysStep(eqx.Module):
    scale: jax.Array

    def __call__(self, state, key):
        return state * self.scale


def test_call_mismatch_answers_each_step_for_itself():
    # Remembered per step (weakly): asked again, or of another step, the answer is
    # that step's own; a step that cannot be hashed is read every time.
    def two(state, key):
        return state

    def three(state, key, data):
        return state

    for _ in range(2):
        assert call_mismatch(two, 2) is None
        assert "positional argument" in (call_mismatch(two, 3) or "")
        assert call_mismatch(three, 3) is None
        assert "missing" in (call_mismatch(three, 2) or "")
    arrays = _ArraysStep(jnp.ones(3))
    with pytest.raises(TypeError):
        hash(arrays)
    assert call_mismatch(arrays, 2) is None
    assert "positional argument" in (call_mismatch(arrays, 3) or "")


def test_bullet_list():
    assert bullet_list(["a", "b"]) == "  a\n  b"
    text = bullet_list([str(i) for i in range(25)], limit=20)
    assert text.splitlines()[-1] == "  ... and 5 more"
    assert len(text.splitlines()) == 21


# ------------------------------------------------------------------------------------
# The messages themselves (issue 45): short, with the explanation in the docs.

_PACKAGE = pathlib.Path(eb.__file__).parent
_DOCS = _PACKAGE.parent / "docs"


def _message_length(node: ast.expr) -> int | None:
    """Characters of a message written as literals, f-strings and `+` of those, each
    `{...}` of an f-string counted as 8; None for a message built otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value)
    if isinstance(node, ast.JoinedStr):
        return sum(
            len(part.value)
            if isinstance(part, ast.Constant) and isinstance(part.value, str)
            else 8
            for part in node.values
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _message_length(node.left), _message_length(node.right)
        return None if left is None or right is None else left + right
    return None


def _raised_messages() -> list[tuple[str, int]]:
    """`(file:line, length)` of every `raise E(<message>, ...)` in the package whose
    message is written out."""
    found = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Raise)
                and isinstance(node.exc, ast.Call)
                and node.exc.args
            ):
                length = _message_length(node.exc.args[0])
                if length is not None:
                    where = f"{path.relative_to(_PACKAGE.parent)}:{node.lineno}"
                    found.append((where, length))
    return found


def test_messages_are_short():
    messages = _raised_messages()
    assert len(messages) > 100
    assert [where for where, length in messages if length == 0] == []
    assert statistics.median(length for _, length in messages) <= 90


def _anchor(heading: str) -> str:
    """The anchor MkDocs gives a heading: lower case, punctuation dropped, spaces
    as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).strip().replace(" ", "-")


def test_messages_point_to_existing_sections():
    pointers = set()
    for path in _PACKAGE.rglob("*.py"):
        pointers |= set(re.findall(r"see docs/(\w+\.md)#([\w-]+)", path.read_text()))
    assert pointers
    for page, anchor in sorted(pointers):
        text = re.sub(r"```.*?```", "", (_DOCS / page).read_text(), flags=re.DOTALL)
        headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
        assert anchor in {_anchor(h) for h in headings}, f"docs/{page}#{anchor}"
