"""The soak's controller and its sizes, shared by the single-thread soak (:mod:`soak`) and
its threaded mode (:mod:`soak_threads`), so that neither imports the other's machinery.

DeepSeek-V4 layers of ratios 0, 4 and 128 and a GQA sliding-window layer (and, with
``share_pools``, a full GQA layer paired with it): full, sliding-window and state groups,
compress ratios 1, 4 and 128.
"""

from __future__ import annotations

from typing import Any

import soak_tiers

from kvforge import CacheController, DeepseekV4Backend, GQABackend

__all__ = [
    "HOST_PAGES",
    "MAX_MODEL_LEN",
    "MAX_SEQS",
    "NUM_BLOCKS",
    "PREFIX_NUM_BLOCKS",
    "PREFIX_SHARED_POOL_BLOCKS",
    "SHARED_HOST_PAGES",
    "SHARED_POOLS",
    "SHARED_POOL_BLOCKS",
    "TIER_PAGES",
    "VOCAB",
    "make_controller",
    "model_host_pages",
    "model_num_blocks",
    "num_blocks_for",
]

MAX_SEQS = 6
MAX_MODEL_LEN = 768
NUM_BLOCKS = {"swa": 20, "compressed": 9, "c4_state": 60, "c128_state": 90, "gqa_swa": 30}
#: with prefix caching: room for cached chains and the window tails a match needs
PREFIX_NUM_BLOCKS = {"swa": 30, "compressed": 12, "c4_state": 100, "c128_state": 100, "gqa_swa": 40}
#: with ``share_pools``: ``gqa_swa`` and ``gqa_full`` draw on one pool of these blocks (each
#: member names the pool's count). Small on purpose: 39 usable blocks of 16 tokens, so the two
#: groups' growth competes for it and it is the pool a step most often runs short of
SHARED_POOL_BLOCKS = 40
PREFIX_SHARED_POOL_BLOCKS = 100
#: the groups that share a pool with ``share_pools``, as the soak declares its layers (the
#: controller's ``layout.pool_sets`` must agree); every other group is a pool of its own
SHARED_POOLS = (("gqa_swa", "gqa_full"),)
HOST_PAGES = 40
#: host pages per group with ``share_pools`` (a swapped ``gqa_full`` request keeps up to 48)
SHARED_HOST_PAGES = 80
VOCAB = 500  # token ids of the prefix soak
#: host tier pages per group (``--host-tier`` on the default layout): fewer than the working
#: set, so the tier evicts too
TIER_PAGES = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_blocks_for(
    prefix: bool = False, share_pools: bool = False, scale: int = 1
) -> dict[str, int]:
    """Device blocks per group of the soak's controller (a shared pool's count for each of
    its groups); ``scale`` multiplies the usable blocks (the threaded mode's N threads)."""
    counts = dict(PREFIX_NUM_BLOCKS if prefix else NUM_BLOCKS)
    if share_pools:
        pool = PREFIX_SHARED_POOL_BLOCKS if prefix else SHARED_POOL_BLOCKS
        for members in SHARED_POOLS:
            counts.update(dict.fromkeys(members, pool))
    return {g: (n - 1) * scale + 1 for g, n in counts.items()}


def make_controller(
    prefix: bool = False,
    share_pools: bool = False,
    max_num_seqs: int = MAX_SEQS,
    scale: int = 1,
    arena: bool = False,
    model: str | None = None,
    host_tier: str | None = None,
) -> CacheController:
    """DeepSeek-V4 layers of ratios 0, 4 and 128 (small heads) and a GQA sliding-window layer:
    full, sliding-window and state groups, compress ratios 1, 4 and 128; ``prefix`` turns
    prefix caching on. ``share_pools`` adds a full GQA layer of the sliding-window layer's
    shapes (1 kv head of dim 8, 16-token blocks: 512 B pages in both groups) and shares one
    pool between the two groups. ``max_num_seqs`` and ``scale`` (usable device blocks and host
    pages multiplied) size it for the threaded mode; the model assumes the defaults.
    ``arena`` (threaded mode only) gives the same device bytes as a ``memory_budget``, so the
    groups whose pages differ draw on one slab arena and their slabs change hands as the
    threads load them. ``model`` (a name of :data:`soak_tiers.MODELS`) builds that bundled
    model at soak size instead, with its own pools; ``host_tier`` (a policy) attaches a host
    tier of the model's tier pages (prefix caching must be on)."""
    if model is not None:
        return _model_controller(model, prefix, max_num_seqs, scale, host_tier)
    backends: dict[int, Any] = {
        i: DeepseekV4Backend(r, head_dim=64, qk_rope_head_dim=16, index_head_dim=16)
        for i, r in enumerate((0, 4, 128))
    }
    backends[3] = GQABackend(1, 8, block_size=16, sliding_window=40, group="gqa_swa")
    if share_pools:
        backends[4] = GQABackend(1, 8, block_size=16, group="gqa_full")
    ctl = CacheController(backends, enable_prefix_caching=prefix, share_pools=share_pools or arena)
    blocks = num_blocks_for(prefix, share_pools, scale)
    if arena:
        budget = sum(n * ctl.layout.bytes_per_block(g) for g, n in blocks.items())
        plan = ctl.initialize_kv_cache(
            memory_budget=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=256,
        )
        assert plan.arena is not None, plan.describe()
    else:
        ctl.initialize_kv_cache(
            num_blocks=blocks, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN
        )
    host = SHARED_HOST_PAGES if share_pools else HOST_PAGES
    ctl.initialize_host_cache(num_pages=(host - 1) * scale + 1)
    if host_tier is not None:
        ctl.initialize_host_tier(num_pages=(TIER_PAGES - 1) * scale + 1, policy=host_tier)
    return ctl


def _scaled(counts: dict[str, int], scale: int) -> dict[str, int]:
    return {g: (n - 1) * scale + 1 for g, n in counts.items()}


def model_num_blocks(model: str, prefix: bool = False, scale: int = 1) -> dict[str, int]:
    """Device blocks per group of ``model`` at soak size."""
    size = soak_tiers.MODELS[model]
    return _scaled(size.prefix_blocks if prefix else size.num_blocks, scale)


def model_host_pages(model: str, scale: int = 1) -> dict[str, int]:
    """Swap pages per group of ``model`` at soak size."""
    return _scaled(soak_tiers.MODELS[model].host_pages, scale)


def _model_controller(
    model: str, prefix: bool, max_num_seqs: int, scale: int, host_tier: str | None
) -> CacheController:
    ctl = CacheController(soak_tiers.model_backends(model), enable_prefix_caching=prefix)
    ctl.initialize_kv_cache(
        num_blocks=model_num_blocks(model, prefix, scale),
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
    )
    ctl.initialize_host_cache(num_pages=model_host_pages(model, scale))
    if host_tier is not None:
        tier = soak_tiers.MODELS[model].tier_pages
        ctl.initialize_host_tier(num_pages=_scaled(tier, scale), policy=host_tier)
    return ctl
