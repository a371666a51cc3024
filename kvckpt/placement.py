"""Where the peer copies of each node's share of a checkpoint go (``Tiers(peers=K)``).

A job's nodes are numbered by their lowest rank: node 0 holds rank 0, and so on. Node ``i``'s
share (what its ranks wrote into its own store) is copied into the stores of the K nodes after
it on a ring: ``i + 1, ..., i + K`` (mod the node count). Every share then lives on K + 1
consecutive nodes, so any K lost nodes leave at least one copy of each: a lost set that held
all K + 1 copies of one share would have to be K + 1 nodes. Any node count above K works, even
or odd, with any number of ranks per node.

Each of a node's ranks sends what it wrote itself to one rank of each target node: the one at
the same position among that node's ranks (wrapping around where the target has fewer), so
the copies of a node with many ranks spread over the target's ranks instead of landing on one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Topology:
    """The job's nodes, as every rank sees them (``nodes[r]``: rank r's node id)."""

    nodes: tuple[str, ...]

    @cached_property
    def order(self) -> tuple[str, ...]:
        """The node ids by lowest rank: node ``i`` of the ring is ``order[i]``."""
        return tuple(dict.fromkeys(self.nodes))

    @cached_property
    def _place(self) -> dict[str, int]:
        return {node: i for i, node in enumerate(self.order)}

    @cached_property
    def _ranks(self) -> dict[str, list[int]]:
        ranks: dict[str, list[int]] = {node: [] for node in self.order}
        for rank, node in enumerate(self.nodes):
            ranks[node].append(rank)
        return ranks

    @cached_property
    def _position(self) -> list[int]:
        """Each rank's position among its node's ranks."""
        position = [0] * len(self.nodes)
        for ranks in self._ranks.values():
            for i, rank in enumerate(ranks):
                position[rank] = i
        return position

    def ranks_of(self, node: str) -> list[int]:
        return self._ranks[node]

    def targets(self, node: str, peers: int) -> list[str]:
        """The nodes that keep copies of ``node``'s share: the ``peers`` after it on the
        ring (fewer where the job has fewer other nodes)."""
        order = self.order
        i = self._place[node]
        count = min(peers, len(order) - 1)
        return [order[(i + j) % len(order)] for j in range(1, count + 1)]

    def sources(self, node: str, peers: int) -> list[str]:
        """The nodes whose shares ``node`` keeps copies of: the ``peers`` before it."""
        order = self.order
        i = self._place[node]
        count = min(peers, len(order) - 1)
        return [order[(i - j) % len(order)] for j in range(1, count + 1)]

    def receiver(self, rank: int, target: str) -> int:
        """The rank of ``target`` that receives what ``rank`` wrote."""
        theirs = self._ranks[target]
        return theirs[self._position[rank] % len(theirs)]

    def sends(self, rank: int, peers: int) -> list[int]:
        """The ranks ``rank`` sends its writes to, one per target node, ring order."""
        return [self.receiver(rank, t) for t in self.targets(self.nodes[rank], peers)]

    def receives(self, rank: int, peers: int) -> list[int]:
        """The ranks whose writes ``rank`` receives, nearest source node first."""
        node = self.nodes[rank]
        return [
            src
            for source in self.sources(node, peers)
            for src in self._ranks[source]
            if self.receiver(src, node) == rank
        ]


def holders(topology: Topology, peers: int) -> dict[str, set[str]]:
    """For each node, the nodes whose stores hold its share once the copies are done (its
    own and its targets')."""
    return {n: {n, *topology.targets(n, peers)} for n in topology.order}


def covered(topology: Topology, peers: int, lost: Sequence[str]) -> bool:
    """Whether every node's share survives the loss of the nodes ``lost``."""
    gone = set(lost)
    return all(held - gone for held in holders(topology, peers).values())
