"""The documentation site builds from the sources with warnings as errors (mkdocs --strict):
a renamed argument, a missing docstring target or a broken link fails here, not in the docs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the [docs] extra is not installed")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the [docs] extra is not installed")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "reference" / "writer" / "index.html").exists()
    page = (tmp_path / "reference" / "writer" / "index.html").read_text()
    assert "get_ready" in page  # the reference is generated from the docstrings
