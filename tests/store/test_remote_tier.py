"""The remote tier behind the host tier (``kvforge.remote_tier``) on a real Redis server: two
controllers in two processes share a prefix byte for byte (GQA with a window, DeepSeek-V4
with MTP in its slab arena); a corrupted value, a server that is down and a store of another
layout cost hits, never bytes or state; bad calls are refused with nothing changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _remote_engine as engine
import pytest
from conftest import HAVE_REDIS

from kvforge import CacheController, GQABackend, ModelIdentity, config_digest
from kvforge._checks import ArgumentError
from kvforge.core.values import PrefixQuery
from kvforge.remote_tier import layout_fingerprint
from kvforge.store import StoreConfig, open_store
from kvforge.verify import token_seeds, verify_request

pytestmark = pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py missing")

HERE = Path(__file__).resolve().parent


def other_process(role: str, model: str, port: int) -> dict:
    """Run one engine in a fresh process (it inherits this thread's network namespace)."""
    out = subprocess.run(
        [sys.executable, str(HERE / "_remote_engine.py"), role, model, str(port)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("model", "longest"), [("gqa", 192), ("v4-mtp", 1280)], ids=["gqa-window", "deepseek-v4-mtp"]
)
@pytest.mark.slow
def test_two_processes_share_a_prefix_byte_for_byte(redis_server, model, longest):
    wrote = engine.main("write", model, redis_server.port)  # this process writes
    # every value queued and written, none dropped: else the reader's hit ends early
    assert engine.all_landed(wrote), f"the writer's values did not all land: {wrote}"
    read = other_process("read", model, redis_server.port)  # another process reads
    # served to the prompt's last boundary, all of it from the store, every entry verified
    assert engine.served_whole(read, longest), f"reader {read}; writer {wrote}"


def gqa_identity(**fields) -> ModelIdentity:
    """The identity of the GQA engine below; ``fields`` change it (another rank, revision)."""
    base = dict(name="/models/gqa-test", config_digest=config_digest({"layers": 4}), dtype="bf16")
    return ModelIdentity(**{**base, **fields})


def gqa_controller(port: int, model: ModelIdentity | None = None, **store) -> CacheController:
    """A GQA engine (a window and a full group) whose remote tier is Redis at ``port``;
    ``store``: fields of its StoreConfig other than the defaults here."""
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    ctl = CacheController({0: swa, 1: kv, 2: swa, 3: kv}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=32, max_num_seqs=2, max_model_len=512)
    ctl.initialize_host_tier(num_pages=64, policy="write_through")
    base = dict(op_timeout_s=1.0, retry_after_s=0.1, close_timeout_s=1.0)
    config = StoreConfig(backend="redis", redis_port=port, **{**base, **store})
    ctl.initialize_remote_tier(config, model=model or gqa_identity())
    return ctl


def write_prompt(ctl: CacheController, toks) -> None:
    engine.run(ctl, "a", toks, 64)
    ctl.free_request("a")
    assert ctl.remote_tier.store.flush(10.0)


def test_a_corrupted_value_is_a_miss_never_other_bytes(redis_server):
    import redis

    toks = list(range(1, 161))
    writer = gqa_controller(redis_server.port)
    try:
        write_prompt(writer, toks)
    finally:
        writer.free()
    client = redis.Redis(port=redis_server.port)
    names = sorted(client.keys("*"))
    assert names
    for name in names:  # flip one payload byte of every value
        value = bytearray(client.get(name))
        value[-1] ^= 0xFF
        client.set(name, bytes(value))
    reader = gqa_controller(redis_server.port)
    try:
        [match] = reader.lookup([PrefixQuery(toks)])
        stats = reader.remote_tier.stats
        assert match.num_tokens == 0 and stats.fetched == 0 and stats.fetch_misses > 0
        assert len(reader.host_tier) == 0  # the pages of the misses were forgotten
    finally:
        reader.free()


def test_a_store_that_is_down_costs_hits_only(redis_server):
    toks = list(range(1, 161))
    ctl = gqa_controller(redis_server.port)
    try:
        redis_server.stop()
        engine.run(ctl, "a", toks, 64)  # publishing fails quietly
        ctl.free_request("a")
        ctl.scheduler.reset_prefix_cache()
        [match] = ctl.lookup([PrefixQuery(toks)])
        assert match.num_tokens == 0
        assert not ctl.remote_tier.store.stats().available
    finally:
        ctl.free()


def test_a_writer_that_falls_behind_drops_pages_and_counts_them(redis_server):
    """What once failed the two-process test on a loaded machine: pages published while the
    writer's earlier puts have not landed fill the bounded queue, and ``put_async`` drops the
    rest. The steps never wait for the store; ``published`` counts only the queued pages and
    ``puts_dropped`` the others; a reader's hit ends before the first dropped page (512 of
    1,280 tokens there, the first chunk; here 64 of 144), with the writer's bytes."""
    toks = list(range(1, 161))
    whole = gqa_controller(redis_server.port, namespace="whole")  # nothing dropped
    try:
        write_prompt(whole, toks)
        assert whole.remote_tier.store.stats().puts_dropped == 0
        pages = whole.remote_tier.stats.published
    finally:
        whole.free()
    chunk = 64
    bound = 2 * chunk // 16  # the pages of the first chunk: 4 blocks in each of 2 groups
    writer = gqa_controller(
        redis_server.port, namespace="behind", max_inflight_puts=bound, op_timeout_s=60.0
    )
    try:
        redis_server.freeze()  # the writer takes its first value and waits on the server
        try:
            engine.run(writer, "a", toks, chunk)  # publishes chunk by chunk, never waits
            writer.free_request("a")
            behind = writer.remote_tier.store.stats()
        finally:
            redis_server.thaw()
        assert writer.remote_tier.store.flush(30)
        published = writer.remote_tier.stats.published
        stats = writer.remote_tier.store.stats()
        assert published == bound < pages, (published, pages, stats)
        assert behind.inflight_puts == bound and behind.puts_ok == 0, behind
        assert stats.puts_dropped == pages - bound and stats.puts_ok == bound, stats
    finally:
        writer.free()
    hits = {}
    for namespace in ("whole", "behind"):
        reader = gqa_controller(redis_server.port, namespace=namespace)
        try:
            [match] = reader.lookup([PrefixQuery(toks)])
            hits[namespace] = match.num_tokens
            engine.run(reader, "b", toks, chunk, match)  # reuses what the store gave
            check = verify_request(reader, "b", token_seeds(toks))
            assert check.entries > 0 and check.mismatched == 0, (namespace, check)
        finally:
            reader.free()
    # the first chunk's pages landed, the later ones were dropped: the hit ends there
    assert hits == {"whole": 144, "behind": chunk}, hits


def test_another_layouts_values_are_never_read(redis_server):
    toks = list(range(1, 161))
    other = gqa_identity(tp_rank=1, tp_size=2)  # another tensor-parallel rank
    writer = gqa_controller(redis_server.port, other)
    try:
        write_prompt(writer, toks)
    finally:
        writer.free()
    reader = gqa_controller(redis_server.port)
    try:
        [match] = reader.lookup([PrefixQuery(toks)])
        assert match.num_tokens == 0 and reader.remote_tier.stats.fetched == 0
    finally:
        reader.free()


def bare(**host) -> CacheController:
    ctl = CacheController({0: GQABackend(2, 8, block_size=16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=8, max_num_seqs=2, max_model_len=128)
    if host:
        ctl.initialize_host_tier(**host)
    return ctl


MODEL = {"model": gqa_identity()}
BAD = [
    ({}, StoreConfig(backend="redis"), MODEL, RuntimeError, "call initialize_host_tier first"),
    ({"num_pages": 4}, StoreConfig(), MODEL, ValueError, "backend is 'none'"),
    ({"num_pages": 4}, "fingerprint", MODEL, ValueError, "another layout fingerprint"),
    # no model identity: a clear error, never a shared default
    ({"num_pages": 4}, StoreConfig(backend="redis"), {}, ArgumentError, "model must be a Model"),
    ({"num_pages": 4}, StoreConfig(backend="redis"), {"model": None}, ArgumentError, "got NoneT"),
    ({"num_pages": 4}, StoreConfig(backend="redis"), {"model": "/models/x"}, ArgumentError, "str"),
    ({"num_pages": 4}, StoreConfig(backend="redis"), {"rank": 1}, TypeError, "rank"),
]


@pytest.mark.parametrize(("host", "store", "kw", "error", "message"), BAD)
def test_bad_remote_tiers_are_refused_with_nothing_changed(host, store, kw, error, message):
    ctl = bare(**host)
    try:
        if store == "fingerprint":
            store = open_store(StoreConfig(backend="redis", redis_port=1), b"x" * 32)
        with pytest.raises(error, match=message):
            ctl.initialize_remote_tier(store, **kw)
        assert ctl.remote_tier is None
    finally:
        ctl.free()


def test_a_second_remote_tier_is_refused(redis_server):
    ctl = gqa_controller(redis_server.port)
    try:
        with pytest.raises(RuntimeError, match="has a remote tier already"):
            ctl.initialize_remote_tier(StoreConfig(backend="redis", redis_port=redis_server.port))
        assert ctl.remote_tier.store.fingerprint == layout_fingerprint(ctl.layout, gqa_identity())
    finally:
        ctl.free()
