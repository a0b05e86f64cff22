"""Per-request state snapshots through the remote tier, on a real Redis server: under the host
tier's ``snapshot_policy="aligned"`` (what linear attention declares) one controller publishes a
linear-attention snapshot with its full-attention blocks, and a second controller that never
saw the prompt fetches both and hits at the aligned boundary, its restored state and every
other entry equal to the writer's byte for byte; under ``"skip"`` nothing at the boundary can
be reused (the snapshot is recomputed).

The model is Qwen3-Next-like: two linear-attention layers (``linear_state``, one slot per
request) and two full-attention layers (``kv``, block 16): boundary 16, a snapshot every 512.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import HAVE_REDIS

from kvforge import CacheController, GQABackend, ModelIdentity, config_digest
from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.core.values import PrefixQuery
from kvforge.store import StoreConfig
from kvforge.verify import (
    entry_bytes_for,
    read_entries,
    token_seeds,
    verify_request,
    write_entries,
    write_step,
)

pytestmark = pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py missing")

INTERVAL = 512


def hybrid(port: int, snapshot_policy: str | None) -> CacheController:
    linear = LinearAttentionBackend(2, 2, 8, 8, 4)
    kv = GQABackend(1, 8, 16)
    ctl = CacheController({0: linear, 1: kv, 2: linear, 3: kv}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(
        num_blocks={"linear_state": 8, "kv": 64}, max_num_seqs=2, max_model_len=768
    )
    ctl.initialize_host_tier(num_pages=128, policy="write_through", snapshot_policy=snapshot_policy)
    ctl.initialize_remote_tier(
        StoreConfig(
            backend="redis",
            redis_port=port,
            op_timeout_s=2.0,
            retry_after_s=0.1,
            close_timeout_s=1.0,
        ),
        model=ModelIdentity(
            name="/models/qwen3-next-like",
            config_digest=config_digest({"linear": 2, "full": 2}),
            dtype="bfloat16",
        ),
    )
    return ctl


def state_entries(ctl: CacheController) -> list:
    return [e for e in ctl.layout.buffers if e.group.name == "linear_state"]


def read_state(ctl: CacheController, rid: str) -> list[torch.Tensor]:
    slot = torch.tensor(ctl.block_table(rid, "linear_state"))
    return [read_entries(ctl.get(e.role.name, e.layer), e, slot) for e in state_entries(ctl)]


def write_prompt(ctl: CacheController, toks: np.ndarray) -> list[torch.Tensor]:
    """Prefill ``toks`` as request ``a`` (chunks of 128), its state after each step a function
    of the prefix; returns the state at the snapshot boundary."""
    seeds, done, at_boundary = token_seeds(toks), 0, []
    while done < len(toks):
        step = ctl.schedule(["a"], [min(128, len(toks) - done)], [toks[done : done + 128]])
        write_step(ctl, step, {"a": seeds})
        done += int(step.allocation.num_new[0])
        slot = torch.tensor(ctl.block_table("a", "linear_state"))
        for e in state_entries(ctl):
            data = entry_bytes_for(seeds, e, torch.tensor([done - 1]), e.role.entry_bytes)
            write_entries(ctl.get(e.role.name, e.layer), e, slot, data)
        if done == INTERVAL:
            at_boundary = read_state(ctl, "a")
        ctl.end_step(step)  # the snapshot copy runs; write-through demotes it
    ctl.free_request("a")
    assert ctl.remote_tier.store.flush(10.0)
    return at_boundary


@pytest.mark.parametrize(("policy", "hit"), [(None, INTERVAL), ("skip", 0)])
def test_a_snapshot_travels_through_the_store_byte_for_byte(redis_server, policy, hit):
    a = np.random.default_rng(0).integers(1, 30_000, 600)
    b = np.concatenate([a, np.random.default_rng(2).integers(1, 30_000, 100)])
    writer = hybrid(redis_server.port, policy)
    try:
        at_512 = write_prompt(writer, a)
        published = writer.remote_tier.stats.published
    finally:
        writer.free()
    reader = hybrid(redis_server.port, policy)  # another engine: nothing cached, nothing held
    try:
        [match] = reader.lookup([PrefixQuery(b)])
        remote, tier = reader.remote_tier.stats, reader.host_tier
        assert match.num_tokens == hit == remote.reach_tokens
        if not hit:  # "skip": the writer kept no snapshot, so no boundary is reusable
            assert "linear_state" not in tier.groups and remote.fetched == 0
            return
        # the snapshot and the 32 kv blocks of [0, 512), all fetched whole
        assert published >= 33 and remote.fetched == 33 and remote.fetch_misses == 0
        assert tier.stats.hits == {"linear_state": 1, "kv": 32}
        step = reader.schedule(["b"], [64], [b[512:576]], prefix_matches=[match])
        got = read_state(reader, "b")  # onloaded, then restored before the kernels
        assert all(torch.equal(x, y) for x, y in zip(got, at_512, strict=True))
        write_step(reader, step, {"b": token_seeds(b)})
        check = verify_request(reader, "b", token_seeds(b), skip_groups=("linear_state",))
        assert check.entries > 0 and check.mismatched == 0
        reader.end_step(step)
    finally:
        reader.free()
