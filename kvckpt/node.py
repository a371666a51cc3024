"""What counts as a node: the machine whose node-local store (LMDB on ``/dev/shm``) a rank shares.

Ranks with the same node id share a node-local store. The id is the host name, unless the
environment variable ``KVCKPT_NODE`` says otherwise: containers that share a host name on
different machines set it to tell their nodes apart, and tests set it to simulate many hosts
on one machine.
"""

from __future__ import annotations

import os
import socket
import threading

#: The environment variable that overrides a process's node id.
NODE_ENV = "KVCKPT_NODE"


def node_id() -> str:
    """This process's node id: ``$KVCKPT_NODE`` if set, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


#: How much lower than training a background thread of kvckpt runs (``nice`` steps);
#: ``$KVCKPT_BACKGROUND_NICENESS`` overrides it (0: as training).
BACKGROUND_NICENESS = int(os.environ.get("KVCKPT_BACKGROUND_NICENESS", "10"))


def spare_cores(ranks_on_node: int | None = None) -> int:
    """The cores of this node that its training ranks leave free: the cores this process may
    run on, less one per rank on the node (``ranks_on_node``, by default torchrun's
    ``LOCAL_WORLD_SIZE``, else 1). A GPU node has many; a node whose ranks train on the CPU
    has none, and there work in the background takes training time."""
    if ranks_on_node is None:
        ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(0, cores - ranks_on_node)


def run_in_background() -> None:
    """Lower the calling thread's scheduling priority below training's (Linux: a thread has a
    priority of its own), so that where cores are busy a background copy waits for the
    training steps instead of slowing them. Where cores are idle it changes nothing."""
    if BACKGROUND_NICENESS == 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICENESS
        )
    except (AttributeError, OSError):  # not Linux, or not allowed: run as it is
        pass
