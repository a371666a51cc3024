"""Test kit for projects that use or extend kvckpt, shipped with the package.

- ``kvckpt.testing.engine_checks``: the engine contract as checks (``ENGINE_CHECKS``) that a
  new engine runs from its own tests, as LMDB and Redis do.
- Real servers on free ports, the way kvckpt's own tests and benchmarks use them:
  ``RedisServer``, ``RedisClusterProcesses``, ``DroppingProxy`` (a loopback proxy that drops
  connections), ``free_port`` and ``torchrun_command``.

Importing this package starts nothing and imports neither torch nor the engine checks.
"""

from .servers import (
    DroppingProxy,
    RedisClusterProcesses,
    RedisServer,
    free_port,
    torchrun_command,
)

__all__ = [
    "DroppingProxy",
    "RedisClusterProcesses",
    "RedisServer",
    "free_port",
    "torchrun_command",
]
