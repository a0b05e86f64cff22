"""The Redis adapter of the remote tier (redis-py): pipelined SET / GET / EXISTS, one round trip
per batch of up to ``max_batch_keys`` keys, every socket bounded by the config's timeouts.

Invariants: redis-py's own retries are off (one attempt, then a miss and ``retry_after_s`` of
back-off), so a down or frozen server costs at most ``op_timeout_s`` per back-off period, never a
hang; a value read is checked whole (``kvforge.store.value.decode``) before one byte reaches a
destination; ``redis`` is imported when a store is built, so ``kvforge.store`` imports without it.
"""

from __future__ import annotations

from typing import Any

from kvforge.store.base import Span, StoreBase
from kvforge.store.config import StoreConfig
from kvforge.store.value import MissReason, decode, encode_header

__all__ = ["RedisStore"]


class RedisStore(StoreBase):
    """A :class:`kvforge.store.protocol.RemoteStore` on one Redis server.

    Values are written with plain ``SET`` (no expiry: size the server with ``maxmemory`` and an
    eviction policy; with ``noeviction`` a full server refuses puts, which are counted).
    """

    backend = "redis"

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

    def _set_all(self, names: list[str], values: list[bytes]) -> list[bool]:
        pipe = self._pipeline()
        for name, value in zip(names, values, strict=True):
            pipe.set(name, value)
        replies = pipe.execute(raise_on_error=False)
        ok = [reply is True for reply in replies]
        refused = [reply for reply in replies if isinstance(reply, BaseException)]
        if refused:  # a live server said no (e.g. OOM under noeviction): no back-off
            self._note_error(
                f"put refused: {type(refused[0]).__name__}: {refused[0]}", trip=False
            )
        return ok

    def _put(self, items: list[tuple[str, bytes, Span]]) -> list[bool]:
        """``SET`` each value as its header and the payload in place: the commands are packed
        by hand so the payload goes to the socket from the caller's pages, without the copy a
        joined ``bytes`` value costs (which was most of a put's time on loopback)."""
        chunks: list[Any] = []
        for name, key, span in items:
            header = encode_header(key, self._fingerprint, span.view)
            raw = name.encode()
            chunks.append(
                b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                % (len(raw), raw, len(header) + span.nbytes)
            )
            chunks += [header, span.view, b"\r\n"]
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(chunks)
            replies: list[Any] = []
            for _ in items:
                try:
                    replies.append(conn.read_response())
                except self._response_error as exc:  # this value refused (e.g. OOM)
                    replies.append(exc)
        except BaseException:
            conn.disconnect()  # a half-written command must not reach the next caller
            raise
        finally:
            pool.release(conn)
        refused = [r for r in replies if isinstance(r, BaseException)]
        if refused:  # a live server said no (e.g. OOM under noeviction): no back-off
            self._note_error(
                f"put refused: {type(refused[0]).__name__}: {refused[0]}", trip=False
            )
        return [r == b"OK" for r in replies]

    def _write_encoded(self, items: list[tuple[str, bytes]]) -> list[bool]:
        return self._set_all([name for name, _ in items], [value for _, value in items])

    def _get(self, items: list[tuple[str, bytes, Span]]) -> list[MissReason | None]:
        pipe = self._pipeline()
        for name, _, _ in items:
            pipe.get(name)
        replies = pipe.execute(raise_on_error=False)
        reasons: list[MissReason | None] = []
        for (_, key, span), reply in zip(items, replies, strict=True):
            if reply is None:
                reasons.append(MissReason.ABSENT)
            elif isinstance(reply, BaseException):
                self._note_error(f"get refused: {type(reply).__name__}: {reply}", trip=False)
                reasons.append(MissReason.STORE_ERROR)
            else:
                payload = decode(reply, key, self._fingerprint, expected_length=span.nbytes)
                if isinstance(payload, MissReason):
                    reasons.append(payload)
                else:
                    span.view[:] = payload
                    reasons.append(None)
        return reasons

    def _interrupt(self) -> None:
        # closing the pool's sockets makes a write blocked on a frozen server fail at once
        self._client.connection_pool.disconnect(inuse_connections=True)

    def _close_client(self, writer_stuck: bool) -> None:
        self._client.close()
        self._client.connection_pool.disconnect(inuse_connections=True)
