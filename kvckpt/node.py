"""What counts as a node: the machine whose node-local store (LMDB on ``/dev/shm``) a rank shares.

Ranks with the same node id share a node-local store. The id is the host name, unless the
environment variable ``KVCKPT_NODE`` says otherwise: containers that share a host name on
different machines set it to tell their nodes apart, and tests set it to simulate many hosts
on one machine.
"""

from __future__ import annotations

import os
import socket

#: The environment variable that overrides a process's node id.
NODE_ENV = "KVCKPT_NODE"


def node_id() -> str:
    """This process's node id: ``$KVCKPT_NODE`` if set, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()
