"""kvforge's remote tier behind vLLM's connector on Mooncake Store: harness engines
(tests/integrations/vllm_harness.py, vLLM 0.33's real ``Scheduler``) sharing one real
``mooncake_master`` on loopback in the session's one private network namespace for Mooncake
(``tests/_mooncake_net.py``: its client keeps process-wide listeners in the namespace of its
first client, so every module's clients must live in the same one).

Mooncake keeps the first writer's value (its ``put`` never overwrites): a bad value found by a
reader must be removed, or the chunk would miss for good. Shutdown unregisters the host pages
and closes every store (releasing the segment each worker lent).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install 'kvforge[vllm]' (docs/integrations/vllm.md)"
)
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from _mooncake_net import free_pair
from _optional import mooncake_missing
from test_vllm_remote import BLOCK, BLOCKS, MAX_LEN, parts, prompt, run
from vllm_harness import build_offload_engine

from kvforge.store.servers import MooncakeMaster

MOONCAKE_MISSING = mooncake_missing()


@pytest.fixture(scope="module")
def master(mooncake_session_net, tmp_path_factory) -> Iterator[MooncakeMaster]:
    if MOONCAKE_MISSING is not None:
        pytest.skip(MOONCAKE_MISSING)
    with mooncake_session_net.entered() as why:
        if why:
            pytest.skip(f"Mooncake's listeners need a private network namespace: {why}")
        port = free_pair()
        server = MooncakeMaster(port, port + 1, tmp_path_factory.mktemp("mc") / "master.log")
        server.start()
        try:
            yield server
        finally:
            server.stop()


def engine(master: MooncakeMaster, namespace: str):
    remote = {
        "backend": "mooncake",
        "mooncake_master": master.address,
        "mooncake_global_segment_bytes": 32 << 20,
        "mooncake_local_buffer_bytes": 16 << 20,
        "op_timeout_s": 5.0,
        "retry_after_s": 0.2,
        "close_timeout_s": 5.0,
        "connect_timeout_s": 5.0,
        "namespace": namespace,
    }
    return build_offload_engine(
        "llama",
        num_gpu_blocks=BLOCKS,
        kv_connector="KVForgeConnector",
        kv_connector_module_path="kvforge.integrations.vllm",
        extra_config={"kvforge": {"host_bytes": 16 << 20, "remote": remote}},
        max_model_len=MAX_LEN,
    )


def test_mooncake_serves_a_prefix_and_a_bad_value_is_removed_and_replaced(master):
    tokens = prompt(seed=11)
    a, b, c = (engine(master, "mc-a") for _ in range(3))
    try:
        out_a = run(a, "A", tokens)
        _, worker_a = parts(a)
        assert worker_a.store.flush(20.0) and worker_a.published == 4
        # a bad first value under one key: Mooncake would keep it against every later put
        client = worker_a.store.raw_client
        names = _names(worker_a, tokens)
        assert client.batch_is_exist(names) == [1, 1, 1, 1]
        assert client.remove(names[0], True) == 0
        assert client.put(names[0], bytes(64)) == 0  # 64 zero bytes: no kvforge value
        out_b = run(b, "B", tokens)
        manager_b, worker_b = parts(b)
        assert out_b == out_a
        assert worker_b.fetch_misses == 1 and worker_b.removed == 1
        assert manager_b.remote_load_failures >= 1
        assert worker_b.store.flush(20.0)  # B's recompute published a good value in its place
        assert run(c, "C", tokens) == out_a
        _, worker_c = parts(c)
        assert worker_c.fetched == 4 and worker_c.fetch_misses == 0
        assert c.num_external_computed_tokens["C"] == 4 * BLOCK
    finally:
        for eng in (a, b, c):
            eng.shutdown()
    for eng in (a, b, c):
        manager, worker = parts(eng)
        assert worker.store.stats().closed
        assert all(store.stats().closed for store in manager.index.stores)


def _names(worker, tokens: list[int]) -> list[str]:
    """The server names of the prompt's 4 chunks: kvforge's chain over its tokens (no salt),
    under the worker's namespace and fingerprint."""
    from kvforge.core.prefix_keys import PrefixHasher
    from kvforge.integrations.vllm.remote_keys import store_key
    from kvforge.store.base import server_key

    store = worker.store
    chain = PrefixHasher(unit=BLOCK).extend(np.asarray(tokens[: 4 * BLOCK]))
    return [server_key(store.config.namespace, store.fingerprint, store_key(0, k)) for k in chain]


def test_an_engine_starts_in_bounded_time_with_no_master_and_serves():
    """Mooncake's own setup retries an absent master for about 90 s holding the GIL; the
    store asks it only once the master's port answers, and the engine waits at most
    ``connect_timeout_s`` for its stores at start."""
    if MOONCAKE_MISSING is not None:
        pytest.skip(MOONCAKE_MISSING)
    from kvforge.store.servers import free_port

    master = MooncakeMaster(free_port(), free_port())  # never started
    t0 = time.monotonic()
    eng = engine(master, "mc-none")
    try:
        started = time.monotonic() - t0
        out = run(eng, "A", prompt(seed=12))
        manager, worker = parts(eng)
        assert started < 30.0  # 5 s of connect_timeout_s per store, two stores, and vLLM
        assert len(out) == 4 and manager.remote_loads == 0 and worker.fetched == 0
        assert not worker.store.stats().available
    finally:
        eng.shutdown()
