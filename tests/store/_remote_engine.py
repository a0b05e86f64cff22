"""One engine of the remote tier's tests, runnable in its own process: a controller with a host
tier and a remote tier (Redis, or Mooncake Store with ``--mooncake HOST:PORT``) that either
writes a prompt (``write``; ``serve`` also keeps its process, and so its share of Mooncake's
segments, alive until stdin closes) or looks it up, reuses what the store gives and verifies
every entry (``read``). Prints one JSON line: what the tests check, and the store's counters
(puts queued, dropped, failed; misses by reason), so a failed check says why.

The engine's :class:`~kvforge.ModelIdentity` is :func:`identity` of its ``revision`` (an
optional fourth argument, default ``"rev-a"``): engines of one model path at two revisions
have equal layouts and must never share bytes."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from kvforge import CacheController, ModelIdentity, config_digest
from kvforge.core.values import PrefixQuery
from kvforge.models import from_hf_config
from kvforge.store.config import StoreConfig
from kvforge.verify import token_seeds, verify_request, write_step

MODELS = {
    # name: (from_hf_config kwargs, memory budget, prompt length, chunk)
    "gqa": ({"config": "gpt-oss-20b"}, None, 200, 64),
    "v4-mtp": ({"config": "deepseek-v4-tiny", "num_speculative_tokens": 1}, 96 << 20, 1300, 512),
}
HOST_PAGES = 1024
#: seconds the writer waits for its queued puts to land
FLUSH_S = 60.0


def store_config(address: str) -> StoreConfig:
    """Redis at ``PORT``, or Mooncake Store's master at ``mooncake:HOST:PORT``.

    The put queue holds every host page (``max_inflight_puts=HOST_PAGES``): these tests check
    that every page the writer publishes reaches the reader, and ``put_async`` drops what a
    full queue has no room for. With the default bound (64) a writer thread one step behind
    on a loaded machine (DeepSeek-V4 publishes 42 values a chunk) dropped part of the second
    chunk, and the reader got 512 of 1,280 tokens. Back-pressure has tests of its own
    (``test_store_queue.py``, ``test_store_redis.py``, ``test_remote_tier.py``)."""
    if address.startswith("mooncake:"):
        return StoreConfig(
            backend="mooncake",
            mooncake_master=address.removeprefix("mooncake:"),
            mooncake_global_segment_bytes=64 << 20,
            mooncake_local_buffer_bytes=16 << 20,
            op_timeout_s=10.0,
            close_timeout_s=5.0,
            max_inflight_puts=HOST_PAGES,
        )
    return StoreConfig(
        backend="redis",
        redis_port=int(address),
        op_timeout_s=2.0,
        close_timeout_s=2.0,
        max_inflight_puts=HOST_PAGES,
    )


def identity(model: str, revision: str = "rev-a", **fields) -> ModelIdentity:
    """The identity of an engine serving ``model`` at ``revision``: one path for every
    revision (a path alone never identifies weights), the config's digest, bfloat16."""
    kw = MODELS[model][0]
    return ModelIdentity(
        **{
            "name": f"/models/{kw['config']}",
            "config_digest": config_digest(kw),
            "revision": revision,
            "dtype": "bfloat16",
            **fields,
        }
    )


def controller(model: str, port: int | str, revision: str = "rev-a") -> CacheController:
    kw, budget, _, _ = MODELS[model]
    backends = from_hf_config(kw["config"], **{k: v for k, v in kw.items() if k != "config"})
    ctl = CacheController(backends, enable_prefix_caching=True)
    if budget is None:
        ctl.initialize_kv_cache(num_blocks=64, max_num_seqs=2, max_model_len=1024)
    else:
        ctl.initialize_kv_cache(
            memory_budget=budget, max_num_seqs=2, max_model_len=4096, max_num_batched_tokens=512
        )
    ctl.initialize_host_tier(num_pages=HOST_PAGES, policy="write_through")
    ctl.initialize_remote_tier(store_config(str(port)), model=identity(model, revision))
    if not ctl.remote_tier.store.wait_ready(60.0):
        raise RuntimeError(f"the store is not ready: {ctl.remote_tier.store.stats()}")
    return ctl


def prompt(model: str) -> np.ndarray:
    return np.random.default_rng(7).integers(1, 30_000, MODELS[model][2])


def run(ctl: CacheController, rid: str, toks: np.ndarray, chunk: int, match=None) -> None:
    seeds = token_seeds(toks)
    done = match.num_tokens if match is not None else 0
    first = True
    while done < len(toks):
        n = min(chunk, len(toks) - done)
        step = ctl.schedule(
            [rid],
            [n],
            new_token_ids=[toks[done : done + n]],
            prefix_matches=[match] if match is not None and first else None,
        )
        assert not step.allocation.refused, step.allocation.refused
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        done += n
        first = False


def main(role: str, model: str, port: int | str, revision: str = "rev-a") -> dict:
    ctl = controller(model, port, revision)
    toks, chunk = prompt(model), MODELS[model][3]
    try:
        if role in ("write", "serve"):
            run(ctl, "a", toks, chunk)
            ctl.free_request("a")  # hands the last write-through offloads out, published
            flushed = ctl.remote_tier.store.flush(FLUSH_S)
            out = {
                "published": ctl.remote_tier.stats.published,
                "flushed": flushed,
                "store": dataclasses.asdict(ctl.remote_tier.store.stats()),
            }
            if role == "serve":  # the values live in this process's segment: stay up
                print(json.dumps(out), flush=True)
                sys.stdin.read()
            return out
        [match] = ctl.lookup([PrefixQuery(toks)])
        run(ctl, "b", toks, chunk, match)
        check = verify_request(ctl, "b", token_seeds(toks))
        r = ctl.remote_tier.stats
        return {
            "hit_tokens": match.num_tokens,
            "fetched": r.fetched,
            "fetch_misses": r.fetch_misses,
            "reach_tokens": r.reach_tokens,
            "entries": check.entries,
            "mismatched": check.mismatched,
            "store": dataclasses.asdict(ctl.remote_tier.store.stats()),
        }
    finally:
        ctl.free()


def all_landed(wrote: dict) -> bool:
    """Whether every value a writer's ``main`` queued was written, and none was dropped,
    failed or too large: what a reader that expects the whole prompt relies on."""
    store = wrote["store"]
    return (
        wrote["flushed"]
        and wrote["published"] > 0
        and store["puts_ok"] == wrote["published"]
        and store["puts_dropped"] == store["puts_failed"] == store["puts_too_large"] == 0
    )


def served_whole(read: dict, longest: int) -> bool:
    """Whether a reader's ``main`` was served to ``longest`` tokens, all of them fetched from
    the store without a miss, and every entry it verified held the writer's bytes."""
    return (
        read["hit_tokens"] == longest == read["reach_tokens"]
        and read["fetched"] > 0
        and read["fetch_misses"] == 0
        and not read["store"]["misses"]
        and read["entries"] > 0
        and read["mismatched"] == 0
    )


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
