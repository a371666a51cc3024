"""Moved to ``kvckpt.testing.engine_checks``: this name keeps old imports working.

The engine layer imports nothing above it; the checks, which save and load through the whole
package, live in the test kit. Importing a name from here imports it from there, with a
``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(
        "kvckpt.engines.contract moved to kvckpt.testing.engine_checks",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module("kvckpt.testing.engine_checks"), name)
