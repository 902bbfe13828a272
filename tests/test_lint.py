"""The code passes the linter, the formatter and the type checker as pyproject.toml configures
them (issue 56 item 6): `ruff check` (pyflakes, pycodestyle, import order, bugbear, pyupgrade)
and `ruff format --check` over the package, its tests and its benchmarks, so one layout holds
everywhere; mypy over engines/ and runs/ and the static check that every registered engine is
an Engine (tests/engines/registered_engines.py), which names exactly the registry's engines."""

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from trace_replay.engines.registry import engine_specs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"]
)
def test_ruff_finds_nothing(args):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing():
    """mypy, configured by pyproject.toml's [tool.mypy], reports no error: the engines, the
    runs and every registered engine against the Engine protocol. A cold run (no
    .mypy_cache/, as in CI) takes about 80 s of CPU, a warm one a few seconds."""
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _static_factories() -> dict[str, str]:
    """registered_engines.FACTORIES as ``{name: "module:attribute"}``, read from its source."""
    tree = ast.parse((ROOT / "tests" / "engines" / "registered_engines.py").read_text())
    imported = {
        alias.asname or alias.name: f"{node.module}:{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    (table,) = (
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "FACTORIES"
    )
    assert isinstance(table, ast.Dict)
    return {
        key.value: imported.get(value.id, value.id)
        for key, value in zip(table.keys, table.values)
        if isinstance(key, ast.Constant) and isinstance(value, ast.Name)
    }


def test_every_registered_engine_is_checked_against_the_protocol():
    """The static check names each registered engine once, by the factory its spec names, and
    each factory that is a function declares what it returns (an unannotated one returns Any,
    which mypy would accept as an Engine unchecked)."""
    specs = {spec.name: spec.factory for spec in engine_specs()}
    assert _static_factories() == specs
    for spec in engine_specs():
        factory = spec.load()
        if not inspect.isclass(factory):
            returns = inspect.signature(factory).return_annotation
            assert returns is not inspect.Signature.empty, f"{spec.name}: {spec.factory}"
