"""The code passes the linter and the formatter as pyproject.toml configures them (issue 56 item 6):
`ruff check` (pyflakes, pycodestyle, import order, bugbear, pyupgrade) and `ruff format --check`,
over the package, its tests and its benchmarks, so one layout holds everywhere."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"]
)
def test_ruff_finds_nothing(args):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
