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

from kvforge import CacheController, GQABackend
from kvforge.core.values import PrefixQuery
from kvforge.remote_tier import layout_fingerprint
from kvforge.store import StoreConfig, open_store

pytestmark = pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py missing")

HERE = Path(__file__).resolve().parent


def other_process(role: str, model: str, port: int) -> dict:
    """Run one engine in a fresh process (it inherits this thread's network namespace)."""
    out = subprocess.run(
        [sys.executable, str(HERE / "_remote_engine.py"), role, model, str(port)],
        capture_output=True, text=True, timeout=300, cwd=HERE,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("model", "longest"), [("gqa", 192), ("v4-mtp", 1280)], ids=["gqa-window", "deepseek-v4-mtp"]
)
def test_two_processes_share_a_prefix_byte_for_byte(redis_server, model, longest):
    wrote = engine.main("write", model, redis_server.port)  # this process writes
    assert wrote["published"] > 0 and wrote["puts_ok"] == wrote["published"]
    read = other_process("read", model, redis_server.port)  # another process reads
    # served to the prompt's last boundary, all of it from the store, every entry verified
    assert read["hit_tokens"] == longest == read["reach_tokens"]
    assert read["fetched"] > 0 and read["fetch_misses"] == 0
    assert read["entries"] > 0 and read["mismatched"] == 0


def gqa_controller(port: int, **remote) -> CacheController:
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    ctl = CacheController({0: swa, 1: kv, 2: swa, 3: kv}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=32, max_num_seqs=2, max_model_len=512)
    ctl.initialize_host_tier(num_pages=64, policy="write_through")
    ctl.initialize_remote_tier(
        StoreConfig(backend="redis", redis_port=port, op_timeout_s=1.0, retry_after_s=0.1,
                    close_timeout_s=1.0), **remote
    )
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


def test_another_layouts_values_are_never_read(redis_server):
    toks = list(range(1, 161))
    writer = gqa_controller(redis_server.port, rank=1)  # another tensor-parallel rank
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


BAD = [
    ({}, StoreConfig(backend="redis"), {}, RuntimeError, "call initialize_host_tier first"),
    ({"num_pages": 4}, StoreConfig(), {}, ValueError, "backend is 'none'"),
    ({"num_pages": 4}, StoreConfig(backend="redis"), {"rank": -1}, ValueError, "rank"),
    ({"num_pages": 4}, "fingerprint", {}, ValueError, "another layout fingerprint"),
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
        assert ctl.remote_tier.store.fingerprint == layout_fingerprint(ctl.layout)
    finally:
        ctl.free()
