"""The Redis adapter of the remote tier (redis-py): pipelined SET / GET / EXISTS, one round trip
per batch of up to ``max_batch_keys`` keys (a GET batch also up to ``max_get_batch_bytes`` of
payload), every socket bounded by the config's timeouts. SET and GET are packed by hand, and
GET's replies are read off the socket by the adapter, so payloads move in place.

Invariants: redis-py's own retries are off (one attempt, then a miss and ``retry_after_s`` of
back-off), so a down or frozen server costs at most ``op_timeout_s`` per back-off period, never a
hang; a value read is a hit only once its header and checksum are checked against the bytes in
the destination (``kvforge.store.value.check``; after a miss the destination's bytes are
unspecified, as the protocol says); a connection whose replies were not all read is dropped,
never returned to the pool; ``redis`` is imported when a store is built, so ``kvforge.store``
imports without it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Sequence
from typing import Any

from kvforge.store.base import PlaneSpan, Span, StoreBase
from kvforge.store.config import StoreConfig
from kvforge.store.value import (
    HEADER_SIZE,
    MissReason,
    check,
    decode,
    encode_header,
    encode_header_of_parts,
)

__all__ = ["RedisStore"]


class RedisStore(StoreBase):
    """A :class:`kvforge.store.protocol.RemoteStore` on one Redis server.

    Values are written with plain ``SET`` (no expiry: size the server with ``maxmemory`` and an
    eviction policy; with ``noeviction`` a full server refuses puts, which are counted).
    """

    backend = "redis"
    #: a get's replies 4 MiB at a time: 64 MiB of values came back in 35-37 ms here in round
    #: trips of 2-8 MiB, 42-60 ms in one (``docs/performance.md``, Tiers)
    default_get_batch_bytes = 4 << 20

    def __init__(self, config: StoreConfig, fingerprint: bytes) -> None:
        super().__init__(config, fingerprint)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ModuleNotFoundError as exc:  # pragma: no cover - the extra is installed in CI
            raise ModuleNotFoundError(
                "the Redis tier needs redis-py: pip install 'kvforge[redis]'"
            ) from exc
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._response_error: type[BaseException] = redis.ResponseError
        password = config.redis_password.get_secret_value() if config.redis_password else None
        self._client = redis.Redis(
            host=config.redis_host,
            port=config.redis_port,
            db=config.redis_db,
            username=config.redis_username,
            password=password,
            socket_timeout=config.op_timeout_s,
            socket_connect_timeout=config.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            client_name="kvforge",
        )

    def _pipeline(self) -> Any:
        return self._client.pipeline(transaction=False)

    @property
    def raw_client(self) -> Any:
        """The ``redis.Redis`` client this store talks through, for a benchmark's baseline
        (``kvforge bench --tiers`` times it on the same values). A call on it bypasses the
        store: no header, checksum, counter or back-off, and its errors reach the caller."""
        return self._client

    def wait_ready(self, timeout: float) -> bool:
        """Ping until the server answers or ``timeout`` seconds pass; an answer ends the
        back-off after an error."""
        import time

        deadline = time.monotonic() + timeout
        while not self._closed:
            try:
                if self._client.ping():
                    self._recovered()
                    return True
            except self._errors:
                pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return False

    def _exists(self, names: list[str]) -> list[bool]:
        pipe = self._pipeline()
        for name in names:
            pipe.exists(name)
        return [flag == 1 for flag in pipe.execute(raise_on_error=False)]

    def _remove(self, names: list[str]) -> int:
        return int(self._client.delete(*names))

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Any]:
        """A pooled connection (the pool checked it has nothing left unread) for commands
        packed and read by hand; dropped, not returned, when anything fails: a half-written
        command or unread replies must not reach the next caller."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            yield conn
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _put(self, items: list[tuple[str, bytes, bytes, Span]]) -> list[bool]:
        """``SET`` each value as its header and the payload in place: the commands are packed
        by hand so the payload goes to the socket from the caller's pages, without the copy a
        joined ``bytes`` value costs (which was most of a put's time on loopback)."""
        chunks: list[Any] = []
        for name, key, proof, span in items:
            header = encode_header(key, self._fingerprint, span.view, proof)
            chunks += [_set_head(name, HEADER_SIZE + span.nbytes), header, span.view, b"\r\n"]
        return self._send_sets(chunks, len(items))

    def _put_blocks(
        self, items: list[tuple[str, bytes, bytes, int]], planes: list[PlaneSpan]
    ) -> list[bool]:
        """``SET`` each value as its header, then its block of every plane in place, one value
        at a time: the checksum reads a value's blocks just before they are sent, so the send
        finds them in the CPU cache, and the server reads value i while the next is hashed."""
        with self._connection() as conn:
            sock = conn._sock
            for name, key, proof, block in items:
                parts = [plane.view(block) for plane in planes]
                header = encode_header_of_parts(key, self._fingerprint, parts, proof)
                head = _set_head(name, HEADER_SIZE + sum(map(len, parts)))
                _send_all(sock, [head + header, *parts, b"\r\n"])
            replies = self._read_set_replies(conn, len(items))
        return self._set_outcome(replies)

    def _write_encoded(self, items: list[tuple[str, Any]]) -> list[bool]:
        chunks: list[Any] = []
        for name, value in items:
            chunks += [_set_head(name, value.nbytes), memoryview(value), b"\r\n"]
        return self._send_sets(chunks, len(items))

    def _send_sets(self, chunks: list[Any], n: int) -> list[bool]:
        """Send ``n`` packed ``SET`` commands (``chunks``, payloads in place), read the replies."""
        with self._connection() as conn:
            conn.send_packed_command(chunks)
            replies = self._read_set_replies(conn, n)
        return self._set_outcome(replies)

    def _read_set_replies(self, conn: Any, n: int) -> list[Any]:
        replies: list[Any] = []
        for _ in range(n):
            try:
                replies.append(conn.read_response())
            except self._response_error as exc:  # this value refused (e.g. OOM)
                replies.append(exc)
        return replies

    def _set_outcome(self, replies: list[Any]) -> list[bool]:
        refused = [r for r in replies if isinstance(r, BaseException)]
        if refused:  # a live server said no (e.g. OOM under noeviction): no back-off
            self._note_error(f"put refused: {type(refused[0]).__name__}: {refused[0]}", trip=False)
        return [r == b"OK" for r in replies]

    def _get(self, items: list[tuple[str, bytes, bytes, Span]]) -> list[MissReason | None]:
        """``GET`` each value, packed by hand, and read the replies off the socket without
        redis-py's reply parser: a value of the expected size goes header-first straight into
        the destination (``recv_into``, no copy), then is checked in place; any other value
        is read whole and decoded, so it is the miss it was before. redis-py's parser read a
        2 MiB value in 64 KiB pieces through a growing buffer and copied it three times, most
        of a get's time (``docs/performance.md``, Tiers)."""
        commands = []
        for name, _, _, _ in items:
            raw = name.encode()
            commands.append(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(raw), raw))
        with self._connection() as conn:
            conn.send_packed_command([b"".join(commands)])
            replies = _Replies(conn._sock)
            return [self._read_value(replies, key, proof, span) for _, key, proof, span in items]

    def _read_value(
        self, replies: _Replies, key: bytes, proof: bytes, span: Span
    ) -> MissReason | None:
        """Read one ``GET`` reply: ``None`` once the value is in ``span`` and checked."""
        line = replies.line()  # RESP2 or RESP3, whichever the connection speaks
        if line.startswith((b"-", b"!")):  # an error, e.g. WRONGTYPE: the server said no
            if line.startswith(b"!"):  # RESP3's bulk error: its text follows
                text = bytearray(int(line[1:]))
                replies.read_into(memoryview(text))
                replies.end()
                line = b"!" + bytes(text)
            self._note_error(f"get refused: {line[1:].decode(errors='replace')}", trip=False)
            return MissReason.STORE_ERROR
        if line == b"_":  # RESP3's null
            return MissReason.ABSENT
        if not line.startswith(b"$"):
            raise ConnectionError(f"unexpected reply to GET: {line[:40]!r}")
        length = int(line[1:])
        if length < 0:  # RESP2's null
            return MissReason.ABSENT
        if length == HEADER_SIZE + span.nbytes:
            header = bytearray(HEADER_SIZE)
            replies.read_into(memoryview(header))
            replies.read_into(span.view)
            replies.end()
            return check(header, span.view, key, self._fingerprint, proof)
        blob = bytearray(length)  # not this destination's size: a miss, as decode says why
        replies.read_into(memoryview(blob))
        replies.end()
        reason = decode(blob, key, self._fingerprint, expected_length=span.nbytes, proof=proof)
        return reason if isinstance(reason, MissReason) else MissReason.OTHER_LENGTH

    def _interrupt(self) -> None:
        # closing the pool's sockets makes a write blocked on a frozen server fail at once
        self._client.connection_pool.disconnect(inuse_connections=True)

    def _close_client(self, writer_stuck: bool) -> None:
        self._client.close()
        self._client.connection_pool.disconnect(inuse_connections=True)


def _set_head(name: str, size: int) -> bytes:
    """A ``SET`` command packed by hand up to its value, which is ``size`` bytes."""
    raw = name.encode()
    return b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(raw), raw, size)


#: buffers per ``sendmsg`` call at most (Linux's ``IOV_MAX``)
_IOV_MAX = 1024


def _send_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Send every buffer in order with vectored writes (``sendmsg``), none joined or copied
    here; partial sends resume where they stopped. The socket's timeout bounds each wait."""
    views = [memoryview(b) for b in buffers]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_MAX])
        while i < len(views) and sent >= len(views[i]):
            sent -= len(views[i])
            i += 1
        if sent:
            views[i] = views[i][sent:]


class _Replies:
    """RESP2 replies read straight off a socket: lines through a small buffer, bulk payloads
    into the caller's memory with ``recv_into`` (bytes already buffered are copied first)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._pending = bytearray()

    def _more(self) -> None:
        chunk = self._sock.recv(256)  # a reply line is short; the rest stays for read_into
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self._pending += chunk

    def line(self) -> bytes:
        """The next line, without its CRLF."""
        while (at := self._pending.find(b"\r\n")) < 0:
            self._more()
        line = bytes(self._pending[:at])
        del self._pending[: at + 2]
        return line

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` with the next ``len(view)`` bytes."""
        got = min(len(self._pending), view.nbytes)
        view[:got] = self._pending[:got]
        del self._pending[:got]
        while got < view.nbytes:
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the server closed the connection")
            got += n

    def end(self) -> None:
        """Consume the CRLF that ends a bulk reply."""
        crlf = bytearray(2)
        self.read_into(memoryview(crlf))
        if crlf != b"\r\n":
            raise ConnectionError(f"a bulk reply did not end with CRLF: {bytes(crlf)!r}")
