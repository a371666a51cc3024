"""Helpers for tests and benchmarks: a real ``redis-server`` child process on a free port.

Shipped with the package so that projects using kvckpt can test against a real server the same
way kvckpt's own tests and benchmarks do.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

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
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
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
