"""kvckpt's events as Prometheus metrics (the ``kvckpt[metrics]`` extra).

``kvckpt.metrics.serve(9400)`` in a training script serves, on ``http://HOST:9400/metrics``:

- ``kvckpt_phase_seconds`` (histogram): how long each phase took, by ``operation`` (save,
  copy, prefetch, restore), ``phase`` (plan, write, commit, copy, choose, read) and ``tier``;
- ``kvckpt_phase_bytes_total`` (counter): the bytes each phase moved, by the same labels;
- ``kvckpt_last_end_timestamp_seconds`` (gauge): when each operation's phase last ended, e.g.
  ``{operation="copy",phase="commit",tier="1"}`` is the time the shared tier last got a
  checkpoint: how fresh a replaced node's restore would be.

``Metrics(registry)`` alone adds them to a registry a trainer already serves. The names follow
Prometheus' conventions: seconds and bytes, ``_total`` on counters. ``tier`` is the store's
place in a ``Tiers`` (0: the first), or ``none`` outside one.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import start_http_server as _start_http_server

from . import events

#: Bucket bounds in seconds: from a metadata commit (milliseconds) to a restore (minutes).
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

_LABELS = ("operation", "phase", "tier")


class Metrics:
    """Prometheus metrics fed by every kvckpt event of this process, in ``registry``."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.seconds = Histogram(
            "kvckpt_phase_seconds",
            "Seconds each phase of a checkpoint operation took",
            _LABELS,
            buckets=BUCKETS,
            registry=registry,
        )
        self.nbytes = Counter(
            "kvckpt_phase_bytes",
            "Bytes of tensor data each phase of a checkpoint operation moved",
            _LABELS,
            registry=registry,
        )
        self.last_end = Gauge(
            "kvckpt_last_end_timestamp_seconds",
            "When a phase of a checkpoint operation last ended (Unix time)",
            _LABELS,
            registry=registry,
        )
        self._unsubscribe = events.subscribe(self.record)

    def record(self, event: events.Event) -> None:
        labels = (event.operation, event.phase, "none" if event.tier is None else str(event.tier))
        self.seconds.labels(*labels).observe(event.seconds)
        self.nbytes.labels(*labels).inc(event.nbytes)
        self.last_end.labels(*labels).set(event.ended_at)

    def close(self) -> None:
        """Stop recording events (the metrics keep their values)."""
        self._unsubscribe()


class Served(Metrics):
    """``Metrics`` with the HTTP server that serves them (``serve``)."""

    def __init__(self, port: int, addr: str, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self._server, self._thread = _start_http_server(port, addr, registry=registry)
        #: The port it listens on (the one the system chose, for ``port=0``)
        self.port: int = self._server.server_port

    def close(self) -> None:
        super().close()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve(port: int, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None) -> Served:
    """Serve kvckpt's metrics at ``http://ADDR:PORT/metrics`` from a background thread.
    ``port=0`` picks a free port (``.port`` says which). Without ``registry``, a registry of
    kvckpt's metrics alone, so two calls in one process (tests, restarts) do not collide."""
    return Served(port, addr, CollectorRegistry() if registry is None else registry)
