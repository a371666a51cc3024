"""Running the ``kvckpt`` command line as a user does.

``run`` invokes the command in this process through click's ``CliRunner``: the same parsing,
output, error mapping and exit codes, without a child interpreter importing torch for every
call (two seconds each on a 2-core VM, hundreds of calls across the suite). ``run_process``
runs ``python -m kvckpt`` as a child process, for what only a real process shows: the
entry point itself, and anything that depends on the process (its environment, its exit)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback

from click.testing import CliRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvckpt ARGS`` in this process, its output captured as text, as a
    ``CompletedProcess`` (``returncode``, ``stdout``, ``stderr``). An exception the command
    lets escape ends up in ``stderr`` with its traceback and returncode 1, as it would from
    a child process. Log records of WARNING and above go to ``stderr`` as Python's last-resort
    handler prints them from a process without logging set up."""
    from kvckpt.cli import main

    handler = _StderrHandler()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    finally:
        root.removeHandler(handler)
    stderr = result.stderr
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        stderr += "".join(traceback.format_exception(exc))
    return subprocess.CompletedProcess(
        ["kvckpt", *args], result.exit_code, result.stdout, stderr + handler.text
    )


def run_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvckpt ARGS`` from the repository root, a child process of this
    interpreter, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "kvckpt", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


class _StderrHandler(logging.Handler):
    """What a process without logging set up prints to stderr: records of WARNING and up,
    their message alone (``logging.lastResort``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record) + "\n")

    @property
    def text(self) -> str:
        return "".join(self.lines)
