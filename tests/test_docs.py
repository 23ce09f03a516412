"""Every code example in the docs and in public docstrings runs."""

import inspect
import pathlib
import re
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_batch as eb


ROOT = pathlib.Path(__file__).parent.parent
FENCE = re.compile(
    r"^(?P<indent>[ ]*)```python\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)


def _blocks(text: str) -> list[str]:
    return [textwrap.dedent(m["body"]) for m in FENCE.finditer(textwrap.dedent(text))]


def _run(code: str, where: str) -> None:
    # Docstring examples, like Equinox's, assume the usual imports.
    namespace: dict = {
        "__name__": "docs_example",
        "eb": eb,
        "eqx": eqx,
        "jax": jax,
        "jnp": jnp,
        "jr": jr,
        "np": np,
        "optax": optax,
    }
    # Examples run as users run them: with JAX's default promotion rules, not the strict
    # ones the rest of the suite uses to catch our own mistakes (optax's Adam mixes an
    # int32 step count into float arithmetic, for one).
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        exec(compile(code, where, "exec"), namespace)


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PUBLIC = [name for name in eb.__all__ if inspect.getdoc(getattr(eb, name))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page: pathlib.Path, tmp_path, monkeypatch):
    # Pages are read top to bottom: later blocks may use names from earlier ones.
    monkeypatch.chdir(tmp_path)
    code = "\n".join(_blocks(page.read_text()))
    _run(code, str(page.relative_to(ROOT)))


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_examples_run(name: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = inspect.getdoc(getattr(eb, name)) or ""
    blocks = _blocks(doc)
    assert blocks, f"eb.{name} has no ```python example in its docstring"
    for i, block in enumerate(blocks):
        _run(block, f"eb.{name} example {i}")


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_sections(name: str):
    obj = getattr(eb, name)
    if not inspect.isfunction(obj):
        return  # classes and annotations document their use, not a call
    doc = inspect.getdoc(obj) or ""
    for section in ("**Arguments:**", "**Returns:**", "**Raises:**"):
        assert section in doc, f"eb.{name} docstring lacks {section}"
