"""The routes of a restore, and the steps of its exchange within a budget (``kvckpt.routes``)."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from kvckpt.routes import Route, plan_routes


def _job(
    hosts: int, per_host: int, items: int, lost: set[int], seed: int = 0
) -> tuple[list[str], dict[str, np.ndarray], list[set[int]], list[int]]:
    """A job whose hosts each hold a share of the items (and the replicated ones whole); the
    hosts in ``lost`` hold nothing. Every rank wants its own share and the replicated items."""
    rng = random.Random(seed)
    nodes = [f"host{r // per_host}" for r in range(hosts * per_host)]
    sizes = [rng.choice([1, 10, 100, 1000, 5000]) for _ in range(items)]
    replicated = set(range(0, items, 5))
    owner = {i: i % len(nodes) for i in range(items)}
    held = {}
    for h in range(hosts):
        bits = np.zeros(items, dtype=bool)
        if h not in lost:
            for i in range(items):
                bits[i] = i in replicated or nodes[owner[i]] == f"host{h}"
        held[f"host{h}"] = bits
    requests = [
        {i for i in range(items) if i in replicated or owner[i] == r} for r in range(len(nodes))
    ]
    return nodes, held, requests, sizes


def _held_per_step(routes: list[Route], sizes: list[int]) -> dict[tuple[int, int], int]:
    """(rank, step) -> the bytes the rank holds for the exchange in that step."""
    load: dict[tuple[int, int], int] = defaultdict(int)
    for rank, route in enumerate(routes):
        step_of = dict(route.step_of)
        items = {i for pairs in (route.send, route.receive, route.relayed) for i, _ in pairs}
        for item in items:
            load[rank, step_of[item]] += sizes[item]
    return load


@pytest.mark.parametrize("lost", [set(), {1}, {0, 3}, {0, 1, 2, 3}])
@pytest.mark.parametrize("budget", [None, 1, 2000, 8000])
def test_every_step_holds_at_most_the_budget_or_one_item(
    lost: set[int], budget: int | None
) -> None:
    nodes, held, requests, sizes = _job(hosts=4, per_host=2, items=60, lost=lost)
    routes = plan_routes(nodes, held, requests, sizes, budget)
    steps = {r.steps for r in routes}
    assert len(steps) == 1  # every rank takes every step
    for route in routes:
        step_of = dict(route.step_of)
        for pairs in (route.send, route.receive, route.relay, route.relayed):
            assert all(0 <= step_of[item] < route.steps for item, _ in pairs)
        # both ends of a transfer agree on its step
        for item, peer in route.send:
            assert dict(routes[peer].step_of)[item] == step_of[item]
    for (rank, step), nbytes in _held_per_step(routes, sizes).items():
        if budget is None:
            assert step == 0
        else:
            largest = max(sizes[i] for i, s in routes[rank].step_of if s == step)
            assert nbytes <= max(budget, largest), (rank, step)


def test_the_budget_changes_the_steps_not_the_routes() -> None:
    nodes, held, requests, sizes = _job(hosts=4, per_host=2, items=60, lost={2})
    whole = plan_routes(nodes, held, requests, sizes)
    stepped = plan_routes(nodes, held, requests, sizes, 2000)
    assert whole[0].steps == 1 and stepped[0].steps > 1
    for a, b in zip(whole, stepped, strict=True):
        assert (a.local, a.shared, a.send, a.receive, a.relay, a.relayed) == (
            b.local,
            b.shared,
            b.send,
            b.receive,
            b.relay,
            b.relayed,
        )


def test_nothing_to_exchange_takes_no_step() -> None:
    nodes, held, requests, sizes = _job(hosts=2, per_host=1, items=10, lost=set())
    requests = [{i for i in range(10) if held[nodes[r]][i]} for r in range(2)]
    assert {r.steps for r in plan_routes(nodes, held, requests, sizes, 100)} == {0}


def test_items_read_from_the_shared_tier_by_the_one_rank_that_wants_them_take_no_step() -> None:
    """Every store lost and each item wanted by one rank (FSDP shards): each rank reads its
    own from the shared tier; nothing travels between ranks, and no step is taken."""
    nodes, held, requests, sizes = _job(hosts=4, per_host=2, items=40, lost={0, 1, 2, 3})
    requests = [{i for i in range(40) if i % 8 == r} for r in range(8)]
    routes = plan_routes(nodes, held, requests, sizes, 100)
    assert {r.steps for r in routes} == {0}
    assert all(not r.send and not r.step_of for r in routes)
