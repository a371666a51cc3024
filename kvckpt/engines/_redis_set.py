"""The writes of ``RedisEngine.put_many``: values framed by hand and pipelined, sent straight
from the caller's memory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import redis

from ._redis_replies import is_out_of_memory, no_such_key
from ._resp import command, command_header, retry
from .base import BytesLike, Hasher, ValueCallback, hashed_pieces

#: Values smaller than this are copied into one send buffer instead of sent on their own.
COALESCE_BELOW = 64 * 1024
#: Values per pipelined batch, at most.
MAX_PIPELINE_KEYS = 4096


class _Target(Protocol):
    """What the pipeline needs of its engine."""

    pipeline_bytes: int

    def _out_of_memory(
        self, error: redis.ResponseError, key: str | None, size: int | None = None
    ) -> Exception: ...


class SetPipeline:
    """The writes of ``RedisEngine.put_many`` on one connection, pipelined in batches of about
    ``pipeline_bytes``.

    Small values are framed together into one buffer; a large value is sent straight from the
    caller's memory (hashed piece by piece as it goes, where asked). A value whose spare exists
    (asked with ``EXISTS`` before each batch is framed) takes the spare over (``RENAME``,
    ``PERSIST``) and is written into its memory (``SETRANGE key 0``); a spare of another size
    is replaced by a ``SET``. Where there is no spare, a plain ``SET``: the server keeps the
    value's receive buffer as the value, while ``SETRANGE`` into a new key allocates, zeroes
    and copies. Every command here is idempotent, so a batch cut by a dropped connection is
    sent again whole."""

    def __init__(
        self,
        engine: _Target,
        conn: Any,
        on_value: ValueCallback | None,
        hasher: Callable[[], Hasher] | None,
    ) -> None:
        self.engine = engine
        self.conn = conn
        self.on_value = on_value
        self.hasher = hasher
        self.queued: list[tuple[int, str, memoryview, str | None]] = []
        self.queued_bytes = 0
        self._start_batch()

    def _start_batch(self) -> None:
        self.pieces: list[BytesLike] = []
        self.hashed: dict[int, int] = {}  # position in pieces -> value index, hashed as sent
        self.small = bytearray()
        self.sent: list[tuple[str, memoryview, bool]] = []  # key, value, whether a take-over

    def add(self, i: int, key: str, view: memoryview, spare: str | None) -> None:
        """Queue value ``i``, to take over ``spare`` where it exists (sending the batch once it
        is full)."""
        self.queued.append((i, key, view, spare))
        self.queued_bytes += view.nbytes
        if self.queued_bytes >= self.engine.pipeline_bytes or len(self.queued) >= MAX_PIPELINE_KEYS:
            self.flush()

    def _existing_spares(self) -> set[str]:
        """The queued values' spares that exist, in one round trip."""
        spares = [spare for _, _, _, spare in self.queued if spare is not None]
        if not spares:
            return set()

        def ask() -> set[str]:
            frames = b"".join(command(b"EXISTS", s.encode()) for s in spares)
            self.conn.send_packed_command([frames], check_health=False)
            return {s for s in spares if self.conn.read_response()}

        return retry(self.conn, ask)

    def _frame(self, i: int, key: str, view: memoryview, take_over: str | None) -> None:
        k = key.encode()
        if take_over is not None:
            self.small += command(b"RENAME", take_over.encode(), k) + command(b"PERSIST", k)
            self.small += command_header(b"SETRANGE", k, b"0", value_nbytes=view.nbytes)
        else:
            self.small += command_header(b"SET", k, value_nbytes=view.nbytes)
        hashing = self.on_value is not None and self.hasher is not None
        if view.nbytes < COALESCE_BELOW:
            self.small += view
            if hashing:
                h = self.hasher()  # type: ignore[misc]
                h.update(view)
                self.on_value(i, h.intdigest())  # type: ignore[misc]
        else:
            self.pieces.append(self.small)
            if hashing:
                self.hashed[len(self.pieces)] = i  # hashed piece by piece as it is sent
            self.pieces.append(view)  # sent straight from the caller's memory
            self.small = bytearray()
        self.small += b"\r\n"
        self.sent.append((key, view, take_over is not None))

    def flush(self) -> None:
        """Send the queued batch and read its replies."""
        if not self.queued:
            return
        existing = self._existing_spares()
        for i, key, view, spare in self.queued:
            self._frame(i, key, view, spare if spare in existing else None)
        if self.small:
            self.pieces.append(self.small)
        retry(self.conn, self._exchange)
        self.queued, self.queued_bytes = [], 0
        self._start_batch()

    def _stream(self) -> Iterator[BytesLike]:
        for p, piece in enumerate(self.pieces):
            i = self.hashed.get(p)
            if i is None:
                yield piece
            else:
                h = self.hasher()  # type: ignore[misc]
                yield from hashed_pieces(memoryview(piece), h)
                self.on_value(i, h.intdigest())  # type: ignore[misc]

    def _exchange(self) -> None:
        conn = self.conn
        if self.pieces:
            conn.send_packed_command(
                self._stream() if self.hashed else self.pieces, check_health=False
            )
        resend: list[tuple[str, memoryview]] = []
        for key, view, took_over in self.sent:
            if took_over:
                try:
                    conn.read_response()  # RENAME: "no such key" when there is no spare
                except redis.ResponseError as e:
                    if not no_such_key(e):
                        raise
                conn.read_response()  # PERSIST
                if self._reply(key, view.nbytes) != view.nbytes:  # SETRANGE: the new length
                    resend.append((key, view))  # the spare was longer
            else:
                self._reply(key, view.nbytes)
        for key, view in resend:
            header = command_header(b"SET", key.encode(), value_nbytes=view.nbytes)
            conn.send_packed_command([header, view, b"\r\n"], check_health=False)
            self._reply(key, view.nbytes)

    def _reply(self, key: str, size: int) -> Any:
        try:
            return self.conn.read_response()
        except redis.ResponseError as e:
            if is_out_of_memory(e):
                raise self.engine._out_of_memory(e, key, size) from None
            raise
