"""Fixtures that start the real things: a redis-server process on a free port, LMDB in a tmp dir."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvckpt.engines._redis_spares import stop_ahead
from kvckpt.testing import RedisServer, free_port

__all__ = ["RedisServer", "free_port"]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    stop_ahead()  # an earlier test's spares in the making, waiting for a commit
    client = redis_server.client()
    client.flushall()
    client.close()
    return redis_server.url()


@pytest.fixture
def lmdb_url(tmp_path: Path) -> str:
    return f"lmdb://{tmp_path / 'store'}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Starts redis-servers of a test's own (``server("--maxmemory", "1mb")``), stopped after it."""
    started: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        srv = RedisServer(tmp_path / f"redis{len(started)}", *extra)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(params=["lmdb", "redis"])
def store_url(request: pytest.FixtureRequest) -> str:
    """Every test that takes this runs once against real LMDB and once against real Redis."""
    return request.getfixturevalue(f"{request.param}_url")


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
