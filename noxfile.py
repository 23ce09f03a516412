"""Developer tasks. Every session installs what it needs from pyproject.toml."""

import os
import pathlib
import shutil
import subprocess
import sys

import nox


nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests", "lint", "typecheck"]

ROOT = pathlib.Path(__file__).parent
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
# The supported Pythons, newest first; the last is pyproject's requires-python.
SUPPORTED = ("3.13", "3.12", "3.11")


def find_python(version: str) -> str | None:
    """The path of a working `python<version>` on PATH or under pyenv, or None.

    pyenv keeps every installed version under `$PYENV_ROOT/versions/` but puts only the
    selected ones on PATH; its shim for any other version is on PATH and exits with an
    error, so each candidate is run once before it is chosen.
    """
    name = f"python{version}"
    pyenv_root = pathlib.Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser()
    installed = sorted(
        pyenv_root.glob(f"versions/{version}.*/bin/{name}"),
        key=lambda exe: [int(n) for n in exe.parts[-3].split(".") if n.isdigit()],
        reverse=True,
    )
    for exe in [shutil.which(name), *map(str, installed)]:
        if exe and subprocess.run([exe, "-c", ""], capture_output=True).returncode == 0:
            return exe
    return None


# `tests` runs on the newest supported Python this machine has (nox's own if it has
# none of them), so that `nox -s tests` always runs the suite; `tests_lowest` needs the
# oldest, and a machine without it reports a missing interpreter.
NEWEST = next(filter(None, map(find_python, SUPPORTED)), sys.executable)
OLDEST = find_python(SUPPORTED[-1]) or SUPPORTED[-1]
# Both test sessions print what they installed, so that a log shows what was tested.
TESTED = ("jax", "jaxlib", "equinox", "jaxtyping", "beartype", "optax", "numpy")
TESTED += ("safetensors", "tqdm", "pytest", "pytest-xdist", "hypothesis", "matplotlib")
# pytest-xdist runs the tests on every core, up to 4 (each worker holds its own JAX and
# compile cache, and some tests start 2-process jobs of their own). In the suite a
# file's tests stay on one worker, so that its module fixtures and compiled functions
# are made once; each example is a script of its own and goes wherever a core is free.
WORKERS = ("--numprocesses=auto", "--maxprocesses=4")
SUITE = ("-m", "not examples", *WORKERS, "--dist=loadfile", "--durations=25")
VERSIONS = (
    "import importlib.metadata as m, platform; print('Python '"
    f" + platform.python_version(), *(f'{{d}} {{m.version(d)}}' for d in {TESTED!r}),"
    " sep=', ')"
)


@nox.session(python=NEWEST)
def tests(session: nox.Session) -> None:
    """The test suite on the newest Python and newest versions of every dependency."""
    session.install("-e", ".[test]")
    session.run("python", "-c", VERSIONS, silent=False)
    session.run("pytest", *SUITE, *session.posargs)


@nox.session(python=OLDEST, venv_backend="uv")
def tests_lowest(session: nox.Session) -> None:
    """The test suite on the oldest Python, every dependency at its lower bound.

    uv resolves the lowest versions (`pip install uv`); pip has no such resolution.
    """
    session.install("--resolution", "lowest-direct", "-e", ".[test]")
    session.run("python", "-c", VERSIONS, silent=False)
    session.run("pytest", *SUITE, *session.posargs)


@nox.session(python=PYTHON)
def examples(session: nox.Session) -> None:
    """Run every script in examples/ and check what each one printed and wrote."""
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "examples", *WORKERS, *session.posargs)


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


# On the newest Python, as `tests`: the newest JAX (0.12 and later need Python 3.12)
# and the newest peers are what a benchmark should measure.
@nox.session(python=NEWEST)
def bench(session: nox.Session) -> None:
    """Run every benchmark and print one table of ratios against their baselines.

    The `bench` extra brings the peers that `benchmarks/bench_peers.py` compares with.
    """
    session.install("-e", ".[test,bench]")
    session.run("python", "benchmarks/run.py", *session.posargs)
