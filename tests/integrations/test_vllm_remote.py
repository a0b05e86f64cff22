"""kvforge's remote tier behind vLLM's connector, with vLLM 0.33's real ``Scheduler``
(tests/integrations/vllm_harness.py, a fake model that reads every context byte): two engines
in one process share one real ``redis-server`` on loopback in a private network namespace.

Engine A computes a prompt and publishes its pages; engine B, which never saw it, loads the
prefix from the store (vLLM's scheduler takes external tokens, the store's counters say
hits) and generates what a recompute generates. A value with a valid checksum and a scrambled
payload changes B's tokens (B really reads the store's bytes); corrupted, truncated, evicted
values and a store that is down cost misses, and the tokens stay equal; roles and models
keep apart what they must.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install 'kvforge[vllm]' (docs/integrations/vllm.md)"
)
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from _optional import redis_missing
from vllm_harness import build_offload_engine

from kvforge._checks import ArgumentError
from kvforge.integrations.vllm import KVForgeConnector
from kvforge.integrations.vllm.remote import (
    RemoteOffloadingManager,
    RemoteOffloadingWorker,
)
from kvforge.store.base import server_key
from kvforge.store.servers import RedisServer, free_port, private_net
from kvforge.store.value import HEADER_SIZE, encode

BLOCK, BLOCKS, MAX_LEN = 16, 64, 256
REDIS_MISSING = redis_missing()


@pytest.fixture
def redis(tmp_path) -> Iterator[RedisServer]:
    if REDIS_MISSING is not None:
        pytest.skip(f"{REDIS_MISSING} (.ci/run installs it)")
    with private_net() as why:
        server = RedisServer(6379 if not why else free_port(), tmp_path / "redis.log")
        server.start()
        try:
            yield server
        finally:
            server.stop()


def remote(server: RedisServer, **fields) -> dict:
    return {
        "backend": "redis",
        "redis_port": server.port,
        "op_timeout_s": 2.0,
        "retry_after_s": 0.2,
        **fields,
    }


def engine(server: RedisServer | None, model: str = "llama", role: str = "kv_both", **kw):
    options = {"host_bytes": 16 << 20}
    if server is not None:
        options["remote"] = remote(server, **kw.pop("store", {}))
    return build_offload_engine(
        model,
        num_gpu_blocks=BLOCKS,
        kv_connector="KVForgeConnector",
        kv_connector_module_path="kvforge.integrations.vllm",
        extra_config={"kvforge": options},
        max_model_len=MAX_LEN,
        kv_role=role,
        **kw,
    )


def prompt(blocks: int = 4, seed: int = 0) -> list[int]:
    return [(i * 7 + 3 + seed * 101) % 997 for i in range(BLOCK * blocks + 5)]


def parts(eng) -> tuple[RemoteOffloadingManager, RemoteOffloadingWorker]:
    connector = eng.scheduler_connector
    assert isinstance(connector, KVForgeConnector)
    manager = connector.connector_scheduler.manager
    worker = eng.worker_connector.connector_worker.worker
    assert isinstance(manager, RemoteOffloadingManager)
    assert isinstance(worker, RemoteOffloadingWorker)
    return manager, worker


def run(eng, req_id: str, tokens: list[int], n: int = 4) -> list[int]:
    eng.add_request(req_id, tokens, n)
    return eng.run_until_done()[req_id]


def publish(eng, req_id: str, tokens: list[int]) -> list[int]:
    """Run ``tokens`` on ``eng`` and wait until its pages are in the store."""
    out = run(eng, req_id, tokens)
    _, worker = parts(eng)
    assert worker.store.flush(10.0)
    assert worker.published > 0
    return out


def recompute(tokens: list[int]) -> list[int]:
    eng = engine(None)
    try:
        return run(eng, "R", tokens)
    finally:
        eng.shutdown()


def server_names(eng) -> list[str]:
    """The names the engine's worker published under, on the server."""
    _, worker = parts(eng)
    client = worker.store.raw_client
    prefix = server_key(worker.store.config.namespace, worker.store.fingerprint, b"")
    return sorted(n.decode() for n in client.keys(prefix + "*"))


def test_engine_b_serves_engine_a_prefix_from_the_store(redis):
    tokens = prompt()
    a = engine(redis)
    b = engine(redis)
    try:
        out_a = publish(a, "A", tokens)
        out_b = run(b, "B", tokens)
        manager, worker = parts(b)
        # vLLM's scheduler took the 4 full blocks (one chunk each) from kvforge, out of the store
        assert b.num_external_computed_tokens["B"] == 4 * BLOCK
        assert manager.remote_loads == 4 and manager.remote_load_failures == 0
        assert worker.fetched == 4 and worker.fetch_misses == 0
        stats = worker.store.stats()
        assert stats.gets_hit == 4 and stats.gets_missed == 0
        assert manager.index.stats.found >= 4
        assert out_b == out_a == recompute(tokens)
        # B's own host pages now hold the prefix: a third request hits locally
        before = worker.fetched
        assert b.reset_prefix_cache()
        assert run(b, "C", tokens) == out_a
        assert worker.fetched == before
    finally:
        a.shutdown()
        b.shutdown()


def rewrite(eng, change) -> int:
    """Replace every value ``eng`` published by ``change(name, value)`` (bytes, or ``None``
    to leave it); how many were replaced."""
    _, worker = parts(eng)
    client = worker.store.raw_client
    n = 0
    for name in server_names(eng):
        new = change(name, client.get(name))
        if new is not None:
            client.set(name, new)
            n += 1
    return n


def scrambler(fingerprint: bytes):
    """A value with a valid header and checksum whose payload is not the block's bytes: what a
    store serving wrong bytes would hand back (the negative control)."""

    def change(name: str, value: bytes) -> bytes:
        key = bytes.fromhex(name.rsplit("/", 1)[1])
        proof = value[56:88]  # the header's content proof (kvforge.store.value)
        payload = bytes(b ^ 0x5A for b in value[HEADER_SIZE:])
        return encode(key, fingerprint, payload, proof)

    return change


def test_a_scrambled_payload_with_a_valid_checksum_changes_the_output(redis):
    tokens = prompt(seed=1)
    a, b = engine(redis), engine(redis)
    try:
        out_a = publish(a, "A", tokens)
        assert rewrite(a, scrambler(parts(a)[1].store.fingerprint)) == 4
        out_b = run(b, "B", tokens)
        _, worker = parts(b)
        assert worker.fetched == 4 and worker.fetch_misses == 0  # read whole, checksum valid
        assert b.num_external_computed_tokens["B"] == 4 * BLOCK
        assert out_b != out_a  # B generated from the store's bytes
    finally:
        a.shutdown()
        b.shutdown()


def _flip(name: str, value: bytes) -> bytes:
    return value[:-3] + bytes([value[-3] ^ 1]) + value[-2:]


def _cut(name: str, value: bytes) -> bytes:
    return value[:-1]


@pytest.mark.parametrize("change", [_flip, _cut], ids=["corrupted", "truncated"])
def test_bad_values_cost_misses_are_removed_and_replaced(redis, change):
    tokens = prompt(seed=2)
    a, b, c = engine(redis), engine(redis), engine(redis)
    try:
        out_a = publish(a, "A", tokens)
        assert rewrite(
            a, lambda n, v: change(n, v) if n.endswith(server_names(a)[0][-8:]) else None
        )
        out_b = run(b, "B", tokens)
        manager, worker = parts(b)
        assert out_b == out_a
        assert worker.fetch_misses == 1 and manager.remote_load_failures >= 1
        reason = "corrupted" if change is _flip else "truncated"
        assert worker.store.stats().misses.get(reason) == 1
        assert worker.removed == 1  # the bad value is gone from the store ...
        assert worker.store.flush(10.0)
        # ... and B's recompute published a good one: C loads every chunk
        assert run(c, "C", tokens) == out_a
        assert parts(c)[1].fetched == 4 and parts(c)[1].fetch_misses == 0
    finally:
        for eng in (a, b, c):
            eng.shutdown()


def test_a_value_evicted_between_lookup_and_load_is_recomputed(redis):
    tokens = prompt(seed=3)
    a, b = engine(redis), engine(redis)
    try:
        out_a = publish(a, "A", tokens)
        b.add_request("B", tokens, 4)
        manager, worker = parts(b)
        b.step()  # the lookup asks the store (RETRY) ...
        deadline = time.monotonic() + 10
        while manager.index.stats.found < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.index.stats.found >= 4  # ... every chunk is there
        worker.store.raw_client.flushall()  # evicted before the load
        out_b = b.run_until_done()["B"]
        assert out_b == out_a
        assert manager.remote_load_failures >= 1 and worker.fetch_misses >= 1
    finally:
        a.shutdown()
        b.shutdown()


def test_a_store_killed_mid_run_costs_misses_and_the_engine_keeps_serving(redis):
    first, second = prompt(seed=4), prompt(seed=5)
    a, b = engine(redis), engine(redis)
    try:
        out_first = publish(a, "A1", first)
        out_second = publish(a, "A2", second)
        assert run(b, "B1", first) == out_first
        manager, worker = parts(b)
        assert worker.fetched == 4
        redis.stop()
        t0 = time.monotonic()
        assert run(b, "B2", second) == out_second  # recomputed
        assert run(b, "B3", prompt(seed=6)) == recompute(prompt(seed=6))
        assert time.monotonic() - t0 < 60
        assert worker.fetched == 4 and b.num_external_computed_tokens["B2"] == 0
        assert manager.index.stats.missing >= 1  # the down store answered misses
    finally:
        a.shutdown()
        b.shutdown()


def test_kv_producer_only_publishes_and_kv_consumer_only_loads(redis):
    tokens = prompt(seed=7)
    producer, consumer = engine(redis, role="kv_producer"), engine(redis, role="kv_consumer")
    other_producer = engine(redis, role="kv_producer")
    try:
        out = publish(producer, "P", tokens)
        # a producer never asks the store: it recomputes what another producer published
        assert run(other_producer, "Q", tokens) == out
        manager, _ = parts(other_producer)
        assert manager.index.stats.asked == 0 and manager.remote_loads == 0
        assert manager.index.stores == []  # its scheduler opened no store client
        assert other_producer.num_external_computed_tokens["Q"] == 0
        # a consumer loads, and publishes nothing of its own
        names = server_names(producer)
        assert run(consumer, "C", tokens) == out
        manager, worker = parts(consumer)
        assert worker.fetched == 4 and manager.published == 0 and worker.published == 0
        run(consumer, "D", prompt(seed=8))  # a prompt only the consumer computed
        assert worker.store.flush(10.0)
        assert server_names(consumer) == names
    finally:
        for eng in (producer, consumer, other_producer):
            eng.shutdown()


def test_engines_serving_other_models_never_share(redis):
    tokens = prompt(seed=9)
    a = engine(redis)
    b = engine(redis, hf_overrides={"rope_theta": 1234.0})  # same layout, other model
    try:
        publish(a, "A", tokens)
        run(b, "B", tokens)
        manager, worker = parts(b)
        assert parts(a)[1].store.fingerprint != worker.store.fingerprint
        assert manager.index.stats.asked > 0 and manager.index.stats.found == 0
        assert worker.fetched == 0 and b.num_external_computed_tokens["B"] == 0
    finally:
        a.shutdown()
        b.shutdown()


BAD_OPTIONS = [
    # (remote entry, kv_role, kv_load_failure_policy, message)
    (
        {"backend": "none"},
        "kv_both",
        "recompute",
        r"^kvforge option 'remote.backend'='none': a remote tier needs a server: 'redis' or "
        r"'mooncake' \(leave 'remote' out for none\)$",
    ),
    ({}, "kv_both", "recompute", r"^kvforge option 'remote.backend'='none': a remote tier"),
    (
        {"backend": "memcached"},
        "kv_both",
        "recompute",
        r"^kvforge option 'remote.backend'='memcached': must be 'redis' or 'mooncake'",
    ),
    (
        {"backend": "redis", "redis_prot": 6379},
        "kv_both",
        "recompute",
        r"^kvforge option 'remote.redis_prot'=6379: no such store field",
    ),
    (
        {"backend": "redis", "redis_port": 0},
        "kv_both",
        "recompute",
        r"^kvforge option 'remote.redis_port'=0: Input should be greater than or equal to 1$",
    ),
    ("redis", "kv_both", "recompute", r"^kvforge option 'remote'=str: must be an object"),
    (
        None,
        "kv_consumer",
        "recompute",
        r"^kv_role='kv_consumer': contradicts kvforge's options: there is no 'remote' entry "
        r"to load from",
    ),
    (
        None,
        "kv_producer",
        "recompute",
        r"^kv_role='kv_producer': contradicts kvforge's options: there is no 'remote' entry "
        r"to publish to",
    ),
    (
        {"backend": "redis"},
        "kv_consumer",
        "fail",
        r"^kv_load_failure_policy='fail': kvforge's remote tier loads for kv_role "
        r"'kv_consumer'",
    ),
    (
        {"backend": "redis", "redis_password": 12345},
        "kv_both",
        "recompute",
        r"^kvforge option 'remote.redis_password'='\*\*\*\*\*\*\*\*\*\*': Input should be a "
        r"valid string$",
    ),
]


@pytest.mark.parametrize(("entry", "role", "policy", "message"), BAD_OPTIONS)
def test_bad_remote_options_are_refused_at_engine_start(entry, role, policy, message):
    options: dict = {"host_bytes": 16 << 20}
    if entry is not None:
        options["remote"] = entry
    with pytest.raises(ArgumentError, match=message) as err:
        build_offload_engine(
            "llama",
            num_gpu_blocks=BLOCKS,
            kv_connector="KVForgeConnector",
            kv_connector_module_path="kvforge.integrations.vllm",
            extra_config={"kvforge": options},
            max_model_len=MAX_LEN,
            kv_role=role,
            kv_load_failure_policy=policy,
        )
    assert "\n" not in str(err.value) and "12345" not in str(err.value)


def test_a_password_is_never_logged_nor_shown(caplog):
    secret = "s3cr3t-pa55"
    port = free_port()  # nothing listens: the store does not answer at start
    caplog.set_level("DEBUG")
    eng = build_offload_engine(
        "llama",
        num_gpu_blocks=BLOCKS,
        kv_connector="KVForgeConnector",
        kv_connector_module_path="kvforge.integrations.vllm",
        extra_config={
            "kvforge": {
                "host_bytes": 16 << 20,
                "remote": {
                    "backend": "redis",
                    "redis_port": port,
                    "redis_password": secret,
                    "connect_timeout_s": 0.2,
                },
            }
        },
        max_model_len=MAX_LEN,
    )
    try:
        tokens = prompt(seed=10)
        assert run(eng, "A", tokens) == recompute(tokens)
        manager, worker = parts(eng)
        shown = [
            caplog.text,
            repr(manager),
            repr(worker.store),
            repr(worker.store.stats()),
            repr(manager.settings),
        ]
        assert "did not answer" in caplog.text  # the bounded wait at start said so
        assert all(secret not in text for text in shown)
    finally:
        eng.shutdown()


def test_remove_deletes_values_and_counts_them(redis):
    from kvforge.store import open_store
    from kvforge.store.config import StoreConfig

    store = open_store(StoreConfig(**remote(redis)), b"fingerprint")
    try:
        assert store.wait_ready(5.0)
        page = bytearray(b"x" * 64)
        store.register_buffer(page)
        assert store.batch_put([b"k1", b"k2"], [memoryview(page)[:32], memoryview(page)[32:]])
        assert store.remove([b"k1", b"k3"]) == 1
        assert store.exists_prefix([b"k1"]) == 0 and store.exists_prefix([b"k2"]) == 1
        assert store.stats().removed == 1
        with pytest.raises(ArgumentError, match=r"^remove: keys\[0\] must be non-empty bytes"):
            store.remove([b""])
        redis.stop()
        assert store.remove([b"k2"]) == 0  # a store that is down removes nothing, raises nothing
    finally:
        store.close()
