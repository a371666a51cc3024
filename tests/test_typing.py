"""kvckpt/ type-checks clean with mypy (configured in pyproject.toml); py.typed ships."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_py_typed_marker_ships() -> None:
    assert (ROOT / "kvckpt" / "py.typed").exists()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()


def test_mypy_is_clean_on_kvckpt() -> None:
    pytest.importorskip("mypy", reason="the [test] extra is not installed")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
