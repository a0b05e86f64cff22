"""Malformed arguments are the one thing a store raises for: ArgumentError naming the argument
and the value, with nothing changed. Also: ``kvforge.store`` imports without either client."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from kvforge._checks import ArgumentError
from kvforge.store.base import span_of
from kvforge.store.config import StoreConfig
from kvforge.store.redis_store import RedisStore
from kvforge.store.servers import free_port

pytest.importorskip("redis")

LAYOUT = b"layout"


@pytest.fixture
def store():
    # nothing listens on the port: every refusal below happens before a connection is tried
    s = RedisStore(StoreConfig(backend="redis", redis_port=free_port(), retry_after_s=0), LAYOUT)
    yield s
    s.close()


HOST = np.zeros(4096, dtype=np.uint8)
OTHER = np.zeros(64, dtype=np.uint8)  # never registered
K = b"k" * 32

# (call, args, message fragments)
BAD_CALLS = [
    ("exists_prefix", (b"abc",), ["keys must be a sequence of bytes", "bytes"]),
    ("exists_prefix", ("abc",), ["keys must be a sequence of bytes", "str"]),
    ("exists_prefix", ([K, "x"],), ["keys[1] must be non-empty bytes", "'x'"]),
    ("exists_prefix", ([b""],), ["keys[0] must be non-empty bytes", "b''"]),
    ("batch_put", ([K], []), ["1 keys but 0 sources"]),
    ("batch_put", ([K], HOST), ["sources must be a sequence", "ndarray"]),
    ("batch_put", ([K], [OTHER]), ["sources[0]", "outside every registered buffer"]),
    ("batch_put", ([K], [HOST[:0]]), ["sources[0] must hold at least one byte"]),
    ("batch_put", ([K], [HOST[::2]]), ["sources[0] must be contiguous"]),
    ("batch_put", ([K], [42]), ["sources[0] must be a memoryview", "int"]),
    (
        "batch_put",
        ([K], [torch.zeros(4, dtype=torch.float32)]),
        ["sources[0]", "torch.uint8", "float32"],
    ),
    ("put_async", ([K, K], [HOST[:8]]), ["2 keys but 1 sources"]),
    ("batch_get_into", ([K], [bytes(8)]), ["destinations[0] must be writable"]),
    ("batch_get_into", ([K], [OTHER]), ["destinations[0]", "outside every registered buffer"]),
    ("unregister_buffer", (OTHER,), ["never registered"]),
    ("unregister_buffer", (HOST[:100],), ["never registered"]),
    ("register_buffer", (HOST[100:200],), ["overlaps a registered buffer"]),
    ("register_buffer", (HOST[:0],), ["at least one byte"]),
    ("register_buffer", ("text",), ["memoryview", "str"]),
]


@pytest.mark.parametrize(
    ("call", "args", "named"), BAD_CALLS, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(BAD_CALLS)]
)
def test_a_malformed_call_is_refused_and_changes_nothing(store, call, args, named):
    store.register_buffer(HOST)
    before = store.stats()
    with pytest.raises(ArgumentError) as info:
        getattr(store, call)(*args)
    for fragment in named:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert store.stats() == before
    assert store._registered() == [span_of(HOST, "HOST")]


# (constructor arguments, exception, fragments)
BAD_STORES = [
    ((StoreConfig(backend="redis"), b""), ["fingerprint must be non-empty bytes"]),
    ((StoreConfig(backend="redis"), "layout"), ["fingerprint must be non-empty bytes", "'layout'"]),
    ((StoreConfig(backend="mooncake"), b"x"), ["config.backend must be 'redis'", "'mooncake'"]),
    (({"backend": "redis"}, b"x"), ["config must be a StoreConfig", "dict"]),
]


@pytest.mark.parametrize(("args", "named"), BAD_STORES, ids=[n[0] for _, n in BAD_STORES])
def test_a_malformed_store_is_refused(args, named):
    with pytest.raises(ArgumentError) as info:
        RedisStore(*args)
    for fragment in named:
        assert fragment in str(info.value)


def test_register_and_unregister_round_trip(store):
    t = torch.zeros(1024, dtype=torch.uint8)
    store.register_buffer(t)
    store.register_buffer(memoryview(bytearray(10)))
    assert len(store._registered()) == 2
    store.unregister_buffer(t)
    assert [s.nbytes for s in store._registered()] == [10]
    store.close()
    with pytest.raises(ArgumentError, match="closed"):
        store.register_buffer(t)


def test_a_value_over_max_value_bytes_is_not_sent():
    s = RedisStore(
        StoreConfig(backend="redis", redis_port=free_port(), max_value_bytes=1000), LAYOUT
    )
    try:
        s.register_buffer(HOST)
        assert s.batch_put([K], [HOST[:1000]]) == [False]
        assert s.put_async([K], [HOST[:2000]]) == 0
        stats = s.stats()
        assert (stats.puts_too_large, stats.errors, stats.puts_failed) == (2, 0, 0)
    finally:
        s.close()


def test_the_package_imports_without_either_client():
    code = (
        "import sys\n"
        "sys.modules['redis'] = None; sys.modules['mooncake'] = None\n"
        "import kvforge.store, kvforge.store.value, kvforge.store.redis_store\n"
        "import kvforge.store.mooncake_store\n"
        "from kvforge.store import StoreConfig, open_store\n"
        "assert open_store(StoreConfig(), b'x') is None\n"
        "for backend in ('redis', 'mooncake'):\n"
        "    try:\n"
        "        open_store(StoreConfig(backend=backend), b'x')\n"
        "    except ModuleNotFoundError as exc:\n"
        "        print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert "kvforge[redis]" in lines[0] and "kvforge[mooncake]" in lines[1]
