"""CONTRIBUTING.md's example engine, run from the page itself, passes the engine contract that
LMDB and Redis pass (so the example cannot drift from the interface)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from kvckpt import KVStorageWriter, open_store
from kvckpt.testing.engine_checks import ENGINE_CHECKS

PAGE = Path(__file__).parent.parent / "CONTRIBUTING.md"


def example_code() -> str:
    text = PAGE.read_text().split("## Add an engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None, "CONTRIBUTING.md lost its example engine"
    return code.group(1)


def example_module() -> types.ModuleType:
    module = types.ModuleType("memory_engine_example")
    sys.modules[module.__name__] = module  # importable, as a real package's module is
    exec(compile(example_code(), str(PAGE), "exec"), module.__dict__)
    return module


EXAMPLE = example_module()


def test_the_example_stays_small() -> None:
    """A whole engine in about 30 lines of code (blank lines and comments aside)."""
    lines = [
        line
        for line in example_code().splitlines()
        if line.strip() and not line.strip().startswith(("#", '"""'))
    ]
    assert len(lines) <= 36, len(lines)


@pytest.mark.parametrize("check", ENGINE_CHECKS, ids=lambda c: c.__name__)
def test_the_example_engine_passes_the_contract(check, request) -> None:  # type: ignore[no-untyped-def]
    check(lambda: EXAMPLE.MemoryEngine(f"memory://{request.node.name}"))


def test_the_example_engine_is_a_store_for_the_writer() -> None:
    engine = EXAMPLE.MemoryEngine("memory://writer")
    assert open_store(engine) is engine
    assert "memory://writer" in repr(KVStorageWriter(engine))
