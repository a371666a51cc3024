"""The routes of a restore: where each rank reads each item, and the steps its exchange takes.

``TieredStorageReader`` restores each byte from the nearest place that holds it, once. Every
rank reports its node and which items its node's store holds whole (``Holdings``); the
coordinator sees every rank's requests at once and gives each rank its ``Route``
(``plan_routes``). The routes are plain data, so every rank follows the same schedule without
talking again:

- an item a rank's node holds, it reads from its own store;
- an item another node holds, one rank there reads and sends; it crosses into a node once, to
  one rank, which passes it on to the others there (a second round);
- an item no surviving node holds, one rank reads from the shared tiers and sends on.

**The exchange in steps, within a budget.** Host memory is what users run out of: a replaced
node may need a whole node's share from its peers. The items exchanged are spread over steps,
so that the bytes a rank holds for the exchange in any one step (what it read to send, what it
receives into a buffer of its own) stay within ``budget_bytes``, or are one item, where an item
is larger than the budget. Every rank takes the steps together; an item is sent, received and
passed on within its step, and its buffers go before the next.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Holdings:
    """A rank's local plan's ``storage_data``: its node, the save it found, and which of the
    checkpoint's items (by position in the metadata) its node's store holds whole."""

    node: str
    save_id: str
    held: bytes  # numpy.packbits over the items


@dataclass(frozen=True)
class Route:
    """A rank's part of a restore, decided by the coordinator (its global plan's
    ``storage_data``). Items are positions in the checkpoint's metadata."""

    #: items this rank reads from its own node's store (for itself, or to send)
    local: tuple[int, ...] = ()
    #: items it reads from the shared tiers (for itself, or to send)
    shared: tuple[int, ...] = ()
    #: (item, rank) pairs: the items it sends, and where
    send: tuple[tuple[int, int], ...] = ()
    #: (item, rank) pairs: the items it receives, and from where
    receive: tuple[tuple[int, int], ...] = ()
    #: (item, rank) pairs: items it received for its node, and the ranks of its node it passes
    #: them on to (a second round), so that an item crosses into a node once, not once per rank
    relay: tuple[tuple[int, int], ...] = ()
    #: (item, rank) pairs: the items it receives in the second round, and from which rank
    relayed: tuple[tuple[int, int], ...] = ()
    #: bytes it receives from ranks of other nodes (the network, on a real cluster)
    from_other_nodes: int = 0
    #: (item, step) pairs: the step of the exchange in which each item this rank sends,
    #: receives or passes on travels
    step_of: tuple[tuple[int, int], ...] = ()
    #: the steps of the exchange, the same on every rank (each rank takes every step)
    steps: int = 0


def plan_routes(
    nodes: Sequence[str],
    held: dict[str, np.ndarray],
    requests: Sequence[set[int]],
    sizes: Sequence[int],
    budget_bytes: int | None = None,
) -> list[Route]:
    """Route every requested item from its nearest source, reading each from storage once.

    ``nodes[r]`` is rank r's node, ``held[node]`` a boolean array over the items (what that
    node's store holds whole), ``requests[r]`` the items rank r reads, ``sizes`` each item's
    bytes. Sends are spread over the ranks that can serve an item, fewest bytes first. The
    exchange takes as many steps as keep each rank's bytes in a step within ``budget_bytes``
    (None: one step).
    """
    world = len(nodes)
    local: list[set[int]] = [set() for _ in range(world)]
    shared: list[set[int]] = [set() for _ in range(world)]
    send: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    receive: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    relay: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    relayed: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    remote = [0] * world  # bytes each rank receives from other nodes
    served = [0] * world  # bytes each rank sends
    schedule = _Schedule(budget_bytes)
    step_of: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    wanted: dict[int, list[int]] = defaultdict(list)
    for rank, items in enumerate(requests):
        for item in items:
            wanted[item].append(rank)
    no_items = np.zeros(len(sizes), dtype=bool)

    def deliver(item: int, source: int, to: int) -> None:
        send[source].append((item, to))
        receive[to].append((item, source))
        served[source] += sizes[item]
        if nodes[to] != nodes[source]:
            remote[to] += sizes[item]

    for item in sorted(wanted):
        ranks = wanted[item]
        holders = {n for n in set(nodes) if held.get(n, no_items)[item]}
        near = [r for r in ranks if nodes[r] in holders]
        far = [r for r in ranks if nodes[r] not in holders]
        for r in near:
            local[r].add(item)
        if not far:
            continue
        if holders:
            # a rank that reads it locally anyway, else any rank of a node that holds it
            candidates = near or [r for r in range(world) if nodes[r] in holders]
            source = min(candidates, key=lambda r: (served[r], r))
            local[source].add(item)
        else:
            source = min(far, key=lambda r: (served[r], r))
            shared[source].add(item)
            far.remove(source)
        by_node: dict[str, list[int]] = defaultdict(list)
        for r in far:
            by_node[nodes[r]].append(r)
        holding = [source]  # the ranks that hold a buffer of the item during its step
        for node, there in by_node.items():
            if node == nodes[source]:
                for r in there:
                    deliver(item, source, r)
                holding += there
                continue
            # one rank of the node receives it, and passes it on to the others there
            landing = min(there, key=lambda r: (remote[r], r))
            deliver(item, source, landing)
            for r in there:
                if r != landing:
                    relay[landing].append((item, r))
                    relayed[r].append((item, landing))
            holding += there
        if len(holding) == 1:
            continue  # read from a shared tier by the one rank that wants it: no transfer
        step = schedule.place(holding, sizes[item])
        for r in holding:
            step_of[r].append((item, step))
    return [
        Route(
            tuple(sorted(local[r])),
            tuple(sorted(shared[r])),
            tuple(send[r]),
            tuple(receive[r]),
            tuple(relay[r]),
            tuple(relayed[r]),
            remote[r],
            tuple(step_of[r]),
            schedule.steps,
        )
        for r in range(world)
    ]


class _Schedule:
    """Steps of the exchange, filled in item order: an item goes to the first step, from the
    latest its ranks have reached, where each of them still has room for it in the budget (a
    rank with nothing yet in a step takes any one item)."""

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget = budget_bytes
        self.steps = 0
        self._load: dict[tuple[int, int], int] = defaultdict(int)  # (rank, step) -> bytes
        self._reached: dict[int, int] = defaultdict(int)  # rank -> the step it has reached

    def place(self, ranks: list[int], nbytes: int) -> int:
        if self.budget is None:
            self.steps = 1
            return 0
        step = max(self._reached[r] for r in ranks)
        while not all(self._fits(r, step, nbytes) for r in ranks):
            step += 1
        for r in ranks:
            self._load[r, step] += nbytes
            self._reached[r] = step
        self.steps = max(self.steps, step + 1)
        return step

    def _fits(self, rank: int, step: int, nbytes: int) -> bool:
        load = self._load.get((rank, step), 0)
        return load == 0 or load + nbytes <= self.budget  # type: ignore[operator]


@dataclass
class StepPairs:
    """A route's (item, rank) pairs of one step of the exchange."""

    send: list[tuple[int, int]] = field(default_factory=list)
    receive: list[tuple[int, int]] = field(default_factory=list)
    relay: list[tuple[int, int]] = field(default_factory=list)
    relayed: list[tuple[int, int]] = field(default_factory=list)


class Steps:
    """A route's pairs grouped by step, once."""

    def __init__(self, route: Route) -> None:
        step_of = dict(route.step_of)
        self._steps: dict[int, StepPairs] = defaultdict(StepPairs)
        for name in ("send", "receive", "relay", "relayed"):
            for item, peer in getattr(route, name):
                getattr(self._steps[step_of[item]], name).append((item, peer))
        #: the items this rank receives into memory of its own, unless their target takes them
        self.landing = {item for item, _ in (*route.receive, *route.relayed)}

    def of(self, step: int) -> StepPairs:
        return self._steps.get(step, StepPairs())
