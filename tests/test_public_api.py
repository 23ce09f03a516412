"""eqx_batch uses only the public API of its dependencies.

A private module or underscore name (`jax._src`, `jaxtyping._storage`, `from jax.lax
import _helper`, `getattr(jax, "_x")`) can change in any release; depending on none of
them is what lets eqx_batch install without upper version caps. Every module of the
package is read as source, with its import aliases followed, so that `import jax.numpy
as jnp` followed by `jnp._x` is caught as well as `jax._src`.
"""

import ast
import pathlib
import re

import pytest


PACKAGE = pathlib.Path(__file__).parent.parent / "eqx_batch"
DEPENDENCIES = ("jax", "jaxlib", "jaxtyping", "equinox", "beartype", "optax")
# A dotted name with a private part: `_x`, but not a dunder such as `__version__`.
PRIVATE_PART = re.compile(r"(^|\.)_(?!_)")
PRIVATE_STRING = re.compile(rf"\b(?:{'|'.join(DEPENDENCIES)})(?:\.\w+)*\._(?!_)\w*")


def _is_dependency(module: str) -> bool:
    return module.split(".")[0] in DEPENDENCIES


def _attribute_chain(node: ast.expr) -> list[str] | None:
    """`['jax', 'numpy', '_x']` for `jax.numpy._x`; None unless rooted at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses(source: str) -> list[tuple[int, str]]:
    """`(line, text)` of every private access to a dependency in `source`."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> the dependency module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_dependency(alias.name):
                    if PRIVATE_PART.search(alias.name):
                        found.append((node.lineno, f"import {alias.name}"))
                    local = alias.asname or alias.name.split(".")[0]
                    aliases[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not _is_dependency(node.module):
                continue
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if PRIVATE_PART.search(name):
                    found.append(
                        (node.lineno, f"from {node.module} import {alias.name}")
                    )
                aliases[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            if (
                chain
                and chain[0] in aliases
                and PRIVATE_PART.search(".".join(chain[1:]))
            ):
                if not isinstance(node.value, ast.Attribute) or not PRIVATE_PART.search(
                    ".".join(_attribute_chain(node.value) or [])[1:]
                ):
                    found.append((node.lineno, ".".join(chain)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
        ):
            target, name = node.args[0], node.args[1]
            chain = _attribute_chain(target) if isinstance(target, ast.expr) else None
            if (
                chain
                and chain[0] in aliases
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and PRIVATE_PART.search("." + name.value)
            ):
                found.append((node.lineno, f"{node.func.id}({'.'.join(chain)}, ...)"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # `importlib.import_module("jax._src...")` and the like.
            match = PRIVATE_STRING.search(node.value)
            if match:
                found.append((node.lineno, repr(match.group())))
    return sorted(set(found))


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "from jax._src.lib import xla_client",
            ["from jax._src.lib import xla_client"],
        ),
        ("import jax._src.lax.lax as lax_internal", ["import jax._src.lax.lax"]),
        ("from jax.lax import _private", ["from jax.lax import _private"]),
        (
            "import jaxtyping\njaxtyping._storage.get_shape_memo()",
            ["jaxtyping._storage"],
        ),
        ("import jax.numpy as jnp\njnp._helper(1)", ["jnp._helper"]),
        ("import equinox as eqx\neqx._module.x", ["eqx._module"]),
        ('import jax\ngetattr(jax, "_src")', ["getattr(jax, ...)"]),
        ('import importlib\nimportlib.import_module("jax._src.api")', ["'jax._src'"]),
        ("import jax\njax.__version__\njax.numpy.sum", []),
        ("import numpy as np\nnp._core", []),
        ("from ._tree import _is_int", []),
    ],
)
def test_the_checker_finds_private_uses(source, expected):
    assert [text for _, text in private_uses(source)] == expected


def test_no_private_api_of_any_dependency():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        # Subpackages (`_chains/`) included.
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in private_uses(path.read_text())
    ]
    assert not offenders, (
        "eqx_batch reaches into private APIs of its dependencies:\n"
        + "\n".join(offenders)
    )


def test_every_public_name_has_its_entry_in_the_api_reference():
    # `eqx_batch/__init__.py`'s `__all__` is the public surface, and each of its names
    # has an anchor in docs/api, where docstrings link it as `[`eb.name`][]`.
    import eqx_batch as eb

    reference = "".join(
        page.read_text() for page in (PACKAGE.parent / "docs" / "api").glob("*.md")
    )
    anchored = set(re.findall(r"\[\]\(\)\{#eb\.(\w+)\}", reference))
    assert sorted(set(eb.__all__) - anchored) == []
    assert {"all_chains", "AllChains", "run_chains"} <= set(eb.__all__)
