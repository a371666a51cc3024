"""What each save, copy, prefetch and restore did, as structured events.

Every phase of a checkpoint operation reports one ``Event`` when it ends: what it was, which
checkpoint, which store (its URL, password masked) and tier, how many bytes, how long. Events
go two ways:

- to Python ``logging``, on the ``kvckpt.events`` logger at DEBUG, each with the event's fields
  in the record's ``kvckpt_event`` attribute (a formatter or handler can send them on as JSON);
- to every function passed to ``subscribe``, called on the thread that did the work (a save's
  background copy reports from the copy's thread). A trainer forwards them to its own metrics
  or traces; ``kvckpt.metrics`` turns them into Prometheus metrics.

A subscriber must be quick and must not raise: an exception is logged and dropped, so a
broken subscriber never fails a save.

Operations and their phases:

=============  ===================================================================
``save``       ``plan`` (the coordinator's global plan), ``write`` (a rank's values
               into the store), ``commit`` (the metadata, last)
``copy``       ``write`` (a rank's values into a further tier), ``commit`` (the
               copy's metadata there): ``Tiers``' background copies
``prefetch``   ``copy`` (this node's share from a shared tier into the first)
``restore``    ``choose`` (which checkpoint and tier), ``read`` (a rank's values)
=============  ===================================================================
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """One phase of a checkpoint operation, reported when it ends."""

    #: ``save``, ``copy``, ``peer`` (a copy into other nodes' stores), ``prefetch`` or
    #: ``restore``
    operation: str
    #: ``plan``, ``write``, ``commit``, ``copy``, ``choose`` or ``read``; ``failed`` for a
    #: peer copy that failed (it never fails the save)
    phase: str
    checkpoint_id: str
    #: The store's URL, its password masked
    store: str
    seconds: float
    #: Bytes of tensor data the phase moved (0 for a phase that moves none)
    nbytes: int = 0
    #: The store's place in a ``Tiers`` (0: the first), or None outside one
    tier: int | None = None
    #: The rank that reported it, or None outside a process group
    rank: int | None = None
    #: Wall-clock time the phase ended (``time.time()``)
    ended_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Subscriber = Callable[[Event], None]

_subscribers: list[Subscriber] = []
_lock = threading.Lock()


def subscribe(fn: Subscriber) -> Callable[[], None]:
    """Call ``fn`` with every event from now on; returns a function that stops it."""
    with _lock:
        _subscribers.append(fn)

    def unsubscribe() -> None:
        with _lock:
            if fn in _subscribers:
                _subscribers.remove(fn)

    return unsubscribe


def emit(
    operation: str,
    phase: str,
    checkpoint_id: str,
    store: str,
    seconds: float,
    *,
    nbytes: int = 0,
    tier: int | None = None,
    rank: int | None = None,
) -> None:
    """Report one phase that just ended, to the log and to every subscriber."""
    with _lock:
        subscribers = list(_subscribers)
    if not subscribers and not logger.isEnabledFor(logging.DEBUG):
        return
    event = Event(operation, phase, checkpoint_id, store, seconds, nbytes, tier, rank)
    logger.debug(
        "kvckpt %s %s %r in %s: %d bytes in %.3f s",
        operation,
        phase,
        checkpoint_id,
        store,
        nbytes,
        seconds,
        extra={"kvckpt_event": event.to_dict()},
    )
    for fn in subscribers:
        try:
            fn(event)
        except Exception:  # a subscriber never fails the save that reported
            logger.exception("kvckpt event subscriber %r failed", fn)


class Phase:
    """A phase being timed from its creation: ``end(nbytes)`` reports it, once. As a context
    manager it ends with the block, unless the block raised (a failed phase reports nothing)."""

    def __init__(
        self,
        operation: str,
        phase: str,
        checkpoint_id: str,
        store: str,
        *,
        tier: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.operation, self.phase, self.checkpoint_id = operation, phase, checkpoint_id
        self.store, self.tier, self.rank = store, tier, rank
        self.nbytes = 0
        self._start: float | None = time.perf_counter()

    def end(self, nbytes: int | None = None) -> None:
        if self._start is None:
            return
        seconds, self._start = time.perf_counter() - self._start, None
        emit(
            self.operation,
            self.phase,
            self.checkpoint_id,
            self.store,
            seconds,
            nbytes=self.nbytes if nbytes is None else nbytes,
            tier=self.tier,
            rank=self.rank,
        )

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self.end()
