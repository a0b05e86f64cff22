"""The remote tier's pieces behind vLLM's connector, without an engine: the scheduler side's
index (lookups never wait for the network; a hit needs every rank's shard), the request keys
(the canonical chain, never vLLM's block hashes), the per-rank fingerprint, the options and
the store's ``remove``."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

# kvforge.integrations.vllm's package imports the connector, which imports vLLM
pytest.importorskip("vllm", reason="the vLLM integration needs vLLM (pip install 'kvforge[vllm]')")

from kvforge._checks import ArgumentError
from kvforge.core.model_identity import ModelIdentity, config_digest
from kvforge.core.prefix_keys import ExtraKeys, PrefixHasher
from kvforge.integrations.vllm.config import MACHINE_RULES, MachineFacts, parse_options
from kvforge.integrations.vllm.pages import plan_host_pages
from kvforge.integrations.vllm.remote_index import HIT, MISS, RETRY, RemoteIndex
from kvforge.integrations.vllm.remote_keys import (
    RequestKeys,
    remote_fingerprint,
    request_keys,
    store_key,
)
from kvforge.integrations.vllm.remote_options import parse_remote

UNIT = 16


class FakeStore:
    """A store that holds ``keys``; ``exists_prefix`` waits on ``gate`` (a slow network)."""

    def __init__(self, keys=(), gate: threading.Event | None = None) -> None:
        self.keys = set(keys)
        self.gate = gate
        self.asked: list[bytes] = []
        self.closed = False

    def exists_prefix(self, keys):
        if self.gate is not None:
            self.gate.wait(10)
        self.asked.extend(keys)
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def close(self) -> None:
        self.closed = True


def request(tokens, salt=None, lora=None, **kw):
    fields = {"mm_features": None, **kw}
    return SimpleNamespace(all_token_ids=list(tokens), cache_salt=salt, lora_request=lora, **fields)


def key(tokens, end, group=0, salt=None) -> bytes:
    chain = PrefixHasher(ExtraKeys(cache_salt=salt), unit=UNIT).extend(np.asarray(tokens[:end]))
    return store_key(group, chain[end // UNIT - 1])


def wait_for(cond, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "not answered in time"
        time.sleep(0.005)


TOKENS = list(range(100, 164))


def test_a_lookup_never_waits_for_the_store():
    gate = threading.Event()
    store = FakeStore([key(TOKENS, 32)], gate)
    index = RemoteIndex([store], UNIT)
    try:
        index.add_request("r", request(TOKENS))
        t0 = time.perf_counter()
        assert index.lookup("r", 0, 32) == RETRY
        assert index.lookup("r", 0, 32) == RETRY  # asked once, still waiting
        assert time.perf_counter() - t0 < 0.5  # the store is blocked: nothing waited on it
        gate.set()
        wait_for(lambda: index.stats.asked == 1)
        assert index.lookup("r", 0, 32) == HIT
        assert store.asked == [key(TOKENS, 32)]
    finally:
        index.close()
    assert store.closed


def test_a_hit_needs_every_ranks_shard():
    k = key(TOKENS, 16)
    rank0, rank1 = FakeStore([k]), FakeStore()
    index = RemoteIndex([rank0, rank1], UNIT)
    try:
        index.add_request("r", request(TOKENS))
        assert index.lookup("r", 0, 16) == RETRY
        wait_for(lambda: index.stats.asked == 1)
        assert index.lookup("r", 0, 16) == MISS
        assert index.stats.missing == 1
        rank1.keys.add(k)
        index.add_request("s", request(TOKENS))  # a fresh request asks again
        assert index.lookup("s", 0, 16) == RETRY
        wait_for(lambda: index.stats.asked == 2)
        assert index.lookup("s", 0, 16) == HIT
    finally:
        index.close()


def test_answers_go_with_their_request_and_after_a_failed_load():
    store = FakeStore([key(TOKENS, 16)])
    index = RemoteIndex([store], UNIT)
    try:
        index.add_request("r", request(TOKENS))
        index.lookup("r", 0, 16)
        wait_for(lambda: index.stats.asked == 1)
        assert index.lookup("r", 0, 16) == HIT
        index.forget("r", 0, 16)  # its load failed: ask again
        assert index.stats.forgotten == 1
        assert index.lookup("r", 0, 16) == RETRY
        wait_for(lambda: index.stats.asked == 2)
        index.keep_requests({"other"})
        assert index.lookup("r", 0, 16) == MISS  # an unknown request has no keys
        assert index.key_of("r", 0, 16) is None
    finally:
        index.close()
    assert index.lookup("r", 0, 16) == MISS  # closed


@pytest.mark.parametrize(
    ("end", "why"),
    [(None, "no position"), (0, "empty"), (24, "not a key boundary"), (80, "past the tokens")],
)
def test_chunks_without_a_key_are_misses_never_asked(end, why):
    store = FakeStore()
    index = RemoteIndex([store], UNIT)
    try:
        index.add_request("r", request(TOKENS))
        assert index.lookup("r", 0, end) == MISS, why
        assert index.lookup("unknown", 0, 16) == MISS
        time.sleep(0.05)
        assert store.asked == []
    finally:
        index.close()


def test_request_keys_are_the_canonical_chain_with_salt_and_adapter():
    keys = request_keys(request(TOKENS), UNIT)
    assert keys is not None
    expected = PrefixHasher(ExtraKeys(), unit=UNIT).extend(np.asarray(TOKENS))
    assert [keys.at(16), keys.at(32), keys.at(64)] == [expected[0], expected[1], expected[3]]
    salted = request_keys(request(TOKENS, salt="tenant-b"), UNIT)
    adapted = request_keys(request(TOKENS, lora=SimpleNamespace(lora_name="sql")), UNIT)
    assert salted is not None and adapted is not None
    assert len({keys.at(16), salted.at(16), adapted.at(16)}) == 3
    assert request_keys(request(TOKENS, mm_features=[object()]), UNIT) is None
    assert request_keys(request(TOKENS, prompt_embeds=object()), UNIT) is None


def test_request_keys_follow_a_growing_request():
    tokens = list(TOKENS[:20])
    keys = RequestKeys(tokens, ExtraKeys(), UNIT)
    assert keys.at(32) is None  # 20 tokens so far
    first = keys.at(16)
    tokens.extend(TOKENS[20:40])
    assert keys.at(16) == first
    assert keys.at(32) == PrefixHasher(unit=UNIT).extend(np.asarray(TOKENS[:32]))[1]
    assert keys.at(16.0) is None  # a float position is no key


def test_each_rank_and_plan_has_its_own_fingerprint():
    model = ModelIdentity(name="tiny", config_digest=config_digest({"a": 1}), dtype="bfloat16")
    plan = plan_host_pages([0, 1], [4096, 1024], blocks_per_chunk=1, host_bytes=1 << 20)
    other = plan_host_pages([0, 1], [4096, 1024], blocks_per_chunk=2, host_bytes=1 << 20)
    prints = {
        remote_fingerprint(model, plan, UNIT),
        remote_fingerprint(model.model_copy(update={"tp_rank": 1, "tp_size": 2}), plan, UNIT),
        remote_fingerprint(model.model_copy(update={"pp_rank": 1, "pp_size": 2}), plan, UNIT),
        remote_fingerprint(model.model_copy(update={"revision": "b"}), plan, UNIT),
        remote_fingerprint(model, other, UNIT),
        remote_fingerprint(model, plan, 32),
        remote_fingerprint(model, plan, UNIT, "cache_dtype=fp8"),
    }
    assert len(prints) == 7


def test_roles_pick_load_and_publish():
    for role, loads, publishes in [
        ("kv_both", True, True),
        ("kv_producer", False, True),
        ("kv_consumer", True, False),
        (None, True, True),
    ]:
        s = parse_remote({"backend": "redis"}, role)
        assert s is not None and (s.loads, s.publishes) == (loads, publishes)
    assert parse_remote(None, "kv_both") is None
    assert parse_remote({"backend": "redis"}, "kv_producer", "fail") is not None  # never loads
    with pytest.raises(ArgumentError, match=r"^kv_role='kv_sender': kvforge knows 'kv_both'"):
        parse_remote({"backend": "redis"}, "kv_sender")


def test_a_remote_backend_needs_its_client_installed(monkeypatch):
    import importlib.util

    machine = MachineFacts("cpu", None, 1 << 40, ("torch",))
    assert MACHINE_RULES["remote"](None, machine) is None
    assert MACHINE_RULES["remote"]({"backend": "memcached"}, machine) is None  # named elsewhere
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    entry = {"backend": "redis", "redis_password": "hunter2"}
    with pytest.raises(ArgumentError) as err:
        parse_options({"kvforge": {"remote": entry}}, machine)
    assert str(err.value) == (
        "kvforge option 'remote.backend'='redis': backend 'redis' needs its client library, "
        "not installed on this machine: pip install 'kvforge[redis]'"
    )
    with pytest.raises(ArgumentError, match=r"^kvforge option 'remote'=\['redis'\]: must be an"):
        parse_options({"kvforge": {"remote": ["redis"]}}, machine)
