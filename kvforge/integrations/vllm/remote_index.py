"""The scheduler side's view of the remote store: which of a request's chunks every rank's
shard holds, asked off the scheduler's thread.

vLLM's offloading scheduler asks its manager per chunk (``lookup``) while it schedules, and
takes ``RETRY`` for "ask again next step" (``_maximal_prefix_lookup`` and
``_sliding_window_lookup`` in ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/
scheduler.py`` keep scanning past a ``RETRY`` and defer the request: ``get_num_new_matched_tokens``
answers ``None``). So :meth:`RemoteIndex.lookup` never waits for the network: a chunk asked
for the first time is queued for a background thread and answered :data:`RETRY`; once the
thread has asked every rank's store (``exists_prefix`` under each rank's fingerprint), the
answer is :data:`HIT` (every shard is there) or :data:`MISS`. A store that is down answers
misses at once (the store's back-off), so requests recompute and the engine keeps serving.

An answer is kept per request until the request goes (:meth:`drop_request`) or a load of
that chunk failed (:meth:`forget`): "there" is a hint; a value evicted between the answer and
the load is a failed load, which vLLM recomputes.

Thread safety: every public method may be called from any thread; one lock guards the
requests, answers and the queue; the store calls run on the index's own thread without it.

This module imports no vLLM code.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvforge.integrations.vllm.remote_keys import RequestKeys, request_keys, store_key

__all__ = ["HIT", "MISS", "RETRY", "RemoteIndex", "RemoteIndexStats"]

logger = logging.getLogger(__name__)

HIT, MISS, RETRY = "hit", "miss", "retry"


@dataclass
class RemoteIndexStats:
    """Counters of one index: chunks asked of the stores, found on every rank, missing on
    some rank, and answers forgotten after a failed load."""

    asked: int = 0
    found: int = 0
    missing: int = 0
    forgotten: int = 0


@dataclass
class _Request:
    keys: RequestKeys | None
    #: store key -> whether every rank holds it (absent: not asked yet)
    answers: dict[bytes, bool] = field(default_factory=dict)
    asking: set[bytes] = field(default_factory=set)


class RemoteIndex:
    """Which chunks the store holds for every rank (module docstring).

    Args:
        stores: one open store per rank (its fingerprint that rank's shard's).
        unit: tokens per prefix key (:class:`RequestKeys`).
    """

    def __init__(self, stores: Sequence[Any], unit: int) -> None:
        self.stores = list(stores)
        self.unit = unit
        self.stats = RemoteIndexStats()
        self._lock = threading.Condition()
        self._requests: dict[str, _Request] = {}
        self._queue: deque[tuple[str, bytes]] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvforge-remote-index", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests

    def add_request(self, req_id: str, request: Any) -> None:
        """Start keeping answers for ``request`` (a vLLM ``Request``)."""
        keys = request_keys(request, self.unit)
        with self._lock:
            self._requests[req_id] = _Request(keys)

    def drop_request(self, req_id: str) -> None:
        with self._lock:
            self._requests.pop(req_id, None)

    def keep_requests(self, req_ids: Collection[str]) -> None:
        """Drop every request not in ``req_ids`` (those vLLM's scheduler still tracks)."""
        with self._lock:
            for req_id in [r for r in self._requests if r not in req_ids]:
                del self._requests[req_id]

    def key_of(self, req_id: str, group_id: int, end: int | None) -> tuple[bytes, bytes] | None:
        """``(store key, content proof)`` of ``req_id``'s chunk of group ``group_id`` ending at
        token ``end``, or ``None`` (an unknown request, one without remote keys, an end that
        is not a key boundary)."""
        with self._lock:
            state = self._requests.get(req_id)
            prefix = None if state is None or state.keys is None else state.keys.at(end)
        if prefix is None:
            return None
        return store_key(group_id, prefix), prefix

    # ------------------------------------------------------------------ lookups

    def lookup(self, req_id: str, group_id: int, end: int | None) -> str:
        """:data:`HIT`, :data:`MISS` or :data:`RETRY` (asked now, answered on a later call)."""
        key = self.key_of(req_id, group_id, end)
        if key is None:
            return MISS
        skey = key[0]
        with self._lock:
            state = self._requests.get(req_id)
            if state is None or self._closed:
                return MISS
            answer = state.answers.get(skey)
            if answer is not None:
                return HIT if answer else MISS
            if skey not in state.asking:
                state.asking.add(skey)
                self._queue.append((req_id, skey))
                self._lock.notify()
            return RETRY

    def forget(self, req_id: str, group_id: int, end: int | None) -> None:
        """Drop the answer for a chunk whose load failed: the next lookup asks again."""
        key = self.key_of(req_id, group_id, end)
        with self._lock:
            state = self._requests.get(req_id)
            if key is not None and state is not None and state.answers.pop(key[0], None):
                self.stats.forgotten += 1

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                batch = list(self._queue)
                self._queue.clear()
            found = {skey: self._everywhere(skey) for skey in dict.fromkeys(k for _, k in batch)}
            with self._lock:
                for req_id, skey in batch:
                    state = self._requests.get(req_id)
                    if state is None:
                        continue
                    state.asking.discard(skey)
                    state.answers[skey] = found[skey]
                self.stats.asked += len(found)
                self.stats.found += sum(found.values())
                self.stats.missing += len(found) - sum(found.values())

    def _everywhere(self, skey: bytes) -> bool:
        """Whether every rank's store holds ``skey`` (a store error is a miss; no store,
        none)."""
        if not self.stores:
            return False
        try:
            return all(store.exists_prefix([skey]) == 1 for store in self.stores)
        except Exception as exc:  # never expected: stores answer misses, not errors
            logger.warning("kvforge remote tier: a lookup failed: %s", type(exc).__name__)
            return False

    def close(self) -> None:
        """Stop the thread and close every store (queued lookups are dropped)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=10)
        for store in self.stores:
            store.close()
