"""Helpers for tests and benchmarks: a real ``redis-server`` child process on a free port.

Shipped with the package so that projects using kvckpt can test against a real server the same
way kvckpt's own tests and benchmarks do.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process, started and stopped by the test suite."""

    def __init__(self, workdir: Path, *extra: str, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
        self.port = free_port() if port is None else port
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


def torchrun_command(
    script: str | Path, *script_args: str, nproc: int = 2, max_restarts: int = 0
) -> list[str]:
    """The command line that runs ``script`` under torchrun on this host (rendezvous on a free
    port, failures noticed within 0.1 s) with this interpreter."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.1",
        str(script),
        *script_args,
    ]


def _cluster_port() -> int:
    """A free port that a cluster node can use: its bus listens 10000 ports higher."""
    for _ in range(1000):
        port = free_port()
        if port <= 55535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterProcesses:
    """A real Redis Cluster on this host: ``masters`` primaries (and ``replicas`` replicas of
    each), made of redis-server processes on free ports and joined with
    ``redis-cli --cluster create``.

    With ``tls`` (paths of ``ca.crt``, ``server.crt``, ``server.key``, ``client.crt``,
    ``client.key``), every node also listens with TLS (client certificates required), the
    cluster bus runs over TLS, and ``url()`` is a ``rediss+cluster://`` URL to the TLS ports.
    """

    def __init__(
        self,
        workdir: Path,
        masters: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = 1000,
        tls: dict[str, Path] | None = None,
    ) -> None:
        self.tls = tls
        self.tls_ports: list[int] = []
        self.servers = []
        for i in range(masters * (1 + replicas)):
            extra: list[str] = []
            if tls is not None:
                self.tls_ports.append(_cluster_port())
                extra = [
                    "--tls-port",
                    str(self.tls_ports[-1]),
                    "--tls-cluster",
                    "yes",
                    "--tls-replication",
                    "yes",
                    "--tls-cert-file",
                    str(tls["server.crt"]),
                    "--tls-key-file",
                    str(tls["server.key"]),
                    "--tls-ca-cert-file",
                    str(tls["ca.crt"]),
                    "--tls-auth-clients",
                    "optional",  # the plain port (readiness checks) stays open on loopback
                ]
            self.servers.append(
                RedisServer(
                    workdir / f"node{i}",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(workdir / f"node{i}" / "nodes.conf"),
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                    *extra,
                    port=_cluster_port(),
                )
            )
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed: apt-get install redis-tools")
        if tls is None:
            nodes = [f"127.0.0.1:{s.port}" for s in self.servers]
            cli_tls: list[str] = []
        else:
            nodes = [f"127.0.0.1:{p}" for p in self.tls_ports]
            cli_tls = ["--tls", "--cacert", str(tls["ca.crt"]), "--cert", str(tls["client.crt"])]
            cli_tls += ["--key", str(tls["client.key"])]
        done = subprocess.run(
            [
                cli,
                *cli_tls,
                "--cluster",
                "create",
                *nodes,
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        self.wait_ok()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node reports cluster_state:ok and knows all slots."""
        deadline = time.monotonic() + timeout
        for server in self.servers:
            if server.proc is None or server.proc.poll() is not None:
                continue
            client = server.client()
            while True:
                info = client.cluster("info")
                if (
                    info.get("cluster_state") == "ok"
                    and int(info.get("cluster_slots_ok", 0)) == 16384
                ):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster not ok on port {server.port}: {info}")
                time.sleep(0.05)
            client.close()

    def primaries(self) -> list[RedisServer]:
        out = []
        for server in self.servers:
            if server.proc is None or server.proc.poll() is not None:
                continue
            client = server.client()
            if client.info("replication").get("role") == "master":
                out.append(server)
            client.close()
        return out

    def url(self, **query: object) -> str:
        if self.tls is not None:
            hosts = ",".join(f"localhost:{p}" for p in self.tls_ports[:3])
            base = f"rediss+cluster://{hosts}"
            query = {
                "ssl_ca_certs": self.tls["ca.crt"],
                "ssl_certfile": self.tls["client.crt"],
                "ssl_keyfile": self.tls["client.key"],
                **query,
            }
        else:
            hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.servers[:3])
            base = f"redis+cluster://{hosts}"
        if query:
            base += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        return base

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
