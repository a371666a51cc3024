"""The Redis protocol (RESP) as the Redis engine speaks it on a redis-py connection: command
frames, pipelined GETs a window ahead of the replies, replies read straight into the caller's
buffers, and the retry of an idempotent exchange over a dropped connection.

redis-py frames and parses every reply as Python objects; for checkpoint values that costs a
copy per value. These pieces send values from the caller's memory and read them into it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from .base import Hasher

T = TypeVar("T")


def command(*args: bytes) -> bytes:
    """One command, every argument in the frame."""
    out = b"*%d\r\n" % len(args)
    for arg in args:
        out += b"$%d\r\n%s\r\n" % (len(arg), arg)
    return out


def command_header(*args: bytes, value_nbytes: int) -> bytes:
    """A command whose last argument is a value of ``value_nbytes`` sent after this header
    (from the caller's memory), then ``b"\\r\\n"``."""
    out = b"*%d\r\n" % (len(args) + 1)
    for arg in args:
        out += b"$%d\r\n%s\r\n" % (len(arg), arg)
    return out + b"$%d\r\n" % value_nbytes


class GetRequests:
    """Pipelined GETs sent a window ahead of the reply being read.

    Keeps at most ``window`` bytes of expected replies outstanding (but always the next two
    values, so a value larger than the window still overlaps with the next request), and sends
    requests in groups once an eighth of the window is free, so 10,000 tiny values still cost
    a few sends rather than one per key.
    """

    def __init__(
        self, conn: Any, keys: Sequence[str], expected: Callable[[int], int], window: int
    ) -> None:
        self.conn = conn
        self.keys = keys
        self.expected = expected
        self.window = window
        self.sent = 0  # requests sent: keys[:sent]
        self.sizes: dict[int, int] = {}  # expected size of each request sent, not yet received
        self.outstanding = 0

    def send_ahead_of(self, i: int) -> None:
        """Make sure value ``i`` is requested, and enough after it to fill the window."""
        if self.sent > i + 1 and self.window - self.outstanding < max(1, self.window // 8):
            return
        packed = bytearray()
        while self.sent < len(self.keys):
            size = self.expected(self.sent)
            if self.sent > i + 1 and self.outstanding + size > self.window:
                break
            packed += command(b"GET", self.keys[self.sent].encode())
            self.sizes[self.sent] = size
            self.outstanding += size
            self.sent += 1
        if packed:
            self.conn.send_packed_command([packed], check_health=False)

    def received(self, i: int) -> None:
        self.outstanding -= self.sizes.pop(i)


#: Transient connection errors (a dropped connection, a server restarting) are retried this
#: many times, with exponential backoff; anything else fails at once.
RETRIES = 3
BACKOFF_S = 0.2


def retry(conn: Any, attempt: Callable[[], T]) -> T:
    """Run an idempotent pipelined exchange, reconnecting and retrying on connection errors."""
    for n in range(RETRIES + 1):
        try:
            if conn._sock is None:
                conn.connect()
            return attempt()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            if n == RETRIES:
                raise
            conn.disconnect()
            time.sleep(BACKOFF_S * 2**n)
    raise AssertionError("unreachable")


class BulkReader:
    """Reads RESP bulk-string replies straight into caller buffers with ``recv_into``.

    redis-py (and hiredis) would first build a ``bytes`` object per reply and the caller would
    copy it again; this reads each value's bytes from the socket into the destination tensor
    once. Used on a pooled redis-py connection whose earlier replies are fully consumed.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(64 * 1024)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    def buffered(self) -> int:
        return self.end - self.start

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            self.buf[: self.end - self.start] = self.buf[self.start : self.end]
            self.end -= self.start
            self.start = 0
        n = self.sock.recv_into(self.view[self.end :])
        if n == 0:
            raise redis.ConnectionError("Redis closed the connection")
        self.end += n

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.buf[self.start : i])
                self.start = i + 2
                return line
            if self.end - self.start > 1024:
                raise redis.ConnectionError("malformed reply from Redis")
            self._fill()

    def _read_into(self, dest: memoryview, hasher: Hasher | None = None) -> None:
        """Fill ``dest`` from the socket, feeding ``hasher`` each piece as it lands (it is
        still in the CPU cache then: -1% to 11% of a loopback load where hashing each value
        afterwards, on another thread, cost 40%)."""
        have = min(self.end - self.start, dest.nbytes)
        dest[:have] = self.view[self.start : self.start + have]
        self.start += have
        if hasher is not None and have:
            hasher.update(dest[:have])
        pos = have
        while pos < dest.nbytes:
            n = self.sock.recv_into(dest[pos:])
            if n == 0:
                raise redis.ConnectionError("Redis closed the connection")
            if hasher is not None:
                hasher.update(dest[pos : pos + n])
            pos += n

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            step = min(n, scratch.nbytes)
            self._read_into(scratch[:step])
            n -= step

    def read_bulk_into(self, dest: memoryview, hasher: Hasher | None = None) -> int | None:
        """Read one GET reply into ``dest`` if it has ``dest``'s size (else skip it); returns
        the value's size, None for a missing key."""
        line = self._line()
        if line == b"_":  # RESP3 null (redis-py may negotiate protocol 3)
            return None
        if line.startswith(b"-"):
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        if line.startswith(b"!"):  # RESP3 blob error
            n = int(line[1:])
            message = bytearray(n)
            self._read_into(memoryview(message))
            self._skip(2)
            raise redis.ResponseError(message.decode(errors="replace"))
        if not line.startswith(b"$"):
            raise redis.ConnectionError(f"unexpected reply from Redis: {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        if n == dest.nbytes:
            self._read_into(dest, hasher)
        else:
            self._skip(n)
        self._skip(2)  # the CRLF after the value
        return n
