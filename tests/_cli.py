"""Running the ``kvckpt`` command line as a user does: a child process of this interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvckpt ARGS`` from the repository root, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "kvckpt", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
