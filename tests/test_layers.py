"""The package's layers, read from the source: no import runs upward.

The engine layer is the ground floor. It imports nothing of kvckpt above it but the two
modules below everything (``errors``, ``urls``), and no torch, so that a new engine is written
and tested against a small, torch-free interface. The test kit (``kvckpt.testing``) sits above
the whole package, which never imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvckpt

PACKAGE = Path(kvckpt.__file__).parent
#: kept so that ``from kvckpt.engines.contract import ...`` still works (with a warning)
REEXPORTS = {"engines/contract.py"}


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions too), as absolute names."""
    package = ".".join(("kvckpt", *path.relative_to(PACKAGE).parent.parts))
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
                found.update([name] if node.module else [f"{name}.{a.name}" for a in node.names])
            else:
                found.add(node.module or "")
    return found


def kvckpt_imports(path: Path) -> set[str]:
    return {m for m in imports(path) if m == "kvckpt" or m.startswith("kvckpt.")}


def test_the_engine_layer_imports_nothing_above_it() -> None:
    below = {"kvckpt.errors", "kvckpt.urls"}
    for path in sorted((PACKAGE / "engines").glob("*.py")):
        if str(path.relative_to(PACKAGE)) in REEXPORTS:
            continue
        upward = {
            m for m in kvckpt_imports(path) if not m.startswith("kvckpt.engines") and m not in below
        }
        assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)}"
    assert kvckpt_imports(PACKAGE / "errors.py") == set()
    assert kvckpt_imports(PACKAGE / "urls.py") <= {"kvckpt.errors"}


def test_the_engine_layer_needs_no_torch() -> None:
    for path in sorted((PACKAGE / "engines").glob("*.py")):
        torch = {m for m in imports(path) if m.split(".")[0] == "torch"}
        assert not torch, f"{path.relative_to(PACKAGE)} imports {sorted(torch)}"


def test_the_package_never_imports_its_test_kit() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "testing" or str(relative) in REEXPORTS:
            continue
        kit = {m for m in kvckpt_imports(path) if m.startswith("kvckpt.testing")}
        assert not kit, f"{relative} imports {sorted(kit)}"


def test_old_contract_imports_still_work() -> None:
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n"
        "    from kvckpt.engines.contract import ENGINE_CHECKS\n"
        "except DeprecationWarning as e:\n"
        "    assert 'kvckpt.testing.engine_checks' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no warning')\n"
        "warnings.simplefilter('ignore')\n"
        "from kvckpt.engines.contract import ENGINE_CHECKS\n"
        "from kvckpt.testing.engine_checks import ENGINE_CHECKS as NEW\n"
        "assert ENGINE_CHECKS is NEW\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
