"""Developer tasks. Every session installs what it needs from pyproject.toml."""

import pathlib
import sys

import nox


nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests", "lint", "typecheck"]

ROOT = pathlib.Path(__file__).parent
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite (4 forced host CPU devices, warnings as errors)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "not examples", *session.posargs)


@nox.session(python=PYTHON)
def examples(session: nox.Session) -> None:
    """Run every script in examples/ and check what each one printed and wrote."""
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "examples", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site with --strict (a broken reference fails)."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """pyright on the package and the tests."""
    session.install("-e", ".[test]", "pyright")
    session.run("pyright", "eqx_batch", "tests")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: train an ensemble, unstack it, edit a member, restack, save."""
    session.install("-e", ".[test]")
    session.run("python", "examples/ensemble_regression.py", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run every benchmark and print one table of ratios against their baselines."""
    session.install("-e", ".[test]")
    session.run("python", "benchmarks/run.py", *session.posargs)
