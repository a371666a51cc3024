"""Fixtures that start the real things: a redis-server process on a free port, LMDB in a tmp dir."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process, started and stopped by the test suite."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: apt-get install redis-server")
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            str(workdir / "redis.log"),
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start: {self.args}") from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def url(self, db: int = 0, **query: object) -> str:
        base = f"redis://127.0.0.1:{self.port}/{db}"
        if query:
            base += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        return base

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    client = redis_server.client()
    client.flushall()
    client.close()
    return redis_server.url()


@pytest.fixture
def lmdb_url(tmp_path: Path) -> str:
    return f"lmdb://{tmp_path / 'store'}"


@pytest.fixture(params=["lmdb", "redis"])
def store_url(request: pytest.FixtureRequest) -> str:
    """Every test that takes this runs once against real LMDB and once against real Redis."""
    return request.getfixturevalue(f"{request.param}_url")


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
