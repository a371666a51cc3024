"""Helpers for tests and benchmarks: a real ``redis-server`` child process on a free port.

Shipped with the package so that projects using kvckpt can test against a real server the same
way kvckpt's own tests and benchmarks do.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis

#: The lowest port ``free_port`` picks from: above the well-known and common service ports.
_LOWEST_PORT = 10000
#: The OS's randomness: forked processes would share the ``random`` module's state.
_RANDOM = random.SystemRandom()


def _lowest_ephemeral_port() -> int:
    """The bottom of the range the kernel takes outgoing connections' local ports from."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that no socket is bound to now, for a server about to start.

    Chosen at random below the kernel's ephemeral range, not by binding port 0: a port from
    that range can be taken, between this call and the server's bind, by any process's
    outgoing connection (gloo opens one per pair of ranks), and the server would then fail
    with EADDRINUSE. Below the range only another explicit bind can take it."""
    low = _lowest_ephemeral_port()
    if low - _LOWEST_PORT >= 1000:
        for _ in range(100):
            port = _RANDOM.randrange(_LOWEST_PORT, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server child process, started and stopped by the test suite."""

    def __init__(
        self,
        workdir: Path,
        *extra: str,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
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
        #: Variables set for the server on top of this process's environment
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env} if self.env else None,
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


class DroppingProxy:
    """A loopback TCP proxy in front of a server that drops connections on cue: the fault a
    flaky network or a ``CLIENT KILL`` causes, placed at an exact moment of a protocol.

    ``drop_on(b"EXEC")`` arms it: the next time a client sends a chunk containing that command,
    the proxy forwards it, waits until the server has answered (so the server *did* run it),
    throws the answer away and closes the client's connection. The client sees a dropped
    connection with its command applied: a lost reply. ``drop_on(..., before=True)`` closes
    the connection without forwarding the command instead (the command never ran), and
    ``skip=n`` lets the first ``n`` sends of the command through, and ``containing`` picks the
    sends whose chunk also holds those bytes (a key).
    """

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        #: [command, bytes the chunk must also hold, before, sends still to let through]
        self._armed: list[list[Any]] = []
        self._sockets: set[socket.socket] = set()
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def drop_on(
        self, command: bytes, *, containing: bytes = b"", before: bool = False, skip: int = 0
    ) -> None:
        """Drop the connection that sends ``command`` after ``skip`` sends of it."""
        with self._lock:
            self._armed.append([command, containing, before, skip])

    def armed(self) -> int:
        with self._lock:
            return len(self._armed)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for s in list(self._sockets):
                _close(s)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            link = _Link(client, socket.create_connection(self.target))
            with self._lock:
                self._sockets |= {client, link.server}
            threading.Thread(target=self._pump_down, args=(link,), daemon=True).start()
            threading.Thread(target=self._pump_up, args=(link,), daemon=True).start()

    def _trigger(self, chunk: bytes) -> tuple[bytes, bool] | None:
        with self._lock:
            for n, armed in enumerate(self._armed):
                command, containing, before, skip = armed
                if b"\r\n" + command + b"\r\n" not in chunk or containing not in chunk:
                    continue
                if skip:
                    armed[3] -= 1
                    continue
                del self._armed[n]
                self.dropped += 1
                return command, before
        return None

    def _pump_up(self, link: _Link) -> None:
        """Client to server; where armed, the drop."""
        try:
            while chunk := link.client.recv(1 << 16):
                hit = self._trigger(chunk)
                if hit is None:
                    link.server.sendall(chunk)
                    continue
                link.hold.set()  # the reply is read here, not relayed
                link.down_stopped.wait(10)
                if not hit[1]:
                    link.server.sendall(chunk)
                    link.server.settimeout(10)
                    link.server.recv(1 << 16)  # the server ran it and answered
                break
        except OSError:
            pass
        link.close()

    def _pump_down(self, link: _Link) -> None:
        """Server to client, until the connection ends or a drop holds the replies back."""
        link.server.settimeout(0.02)
        try:
            while not link.hold.is_set():
                try:
                    chunk = link.server.recv(1 << 16)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                link.client.sendall(chunk)
        except OSError:
            pass
        link.down_stopped.set()
        if not link.hold.is_set():
            link.close()


class _Link:
    """One proxied connection."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.hold = threading.Event()
        self.down_stopped = threading.Event()

    def close(self) -> None:
        _close(self.client)
        _close(self.server)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()


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
