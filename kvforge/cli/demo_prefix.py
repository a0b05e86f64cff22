"""The prefix-reuse part of ``kvforge demo``: multi-turn conversations over a shared system
prompt, with the prefix cache on, every reused byte verified.

Each turn's prompt is the conversation so far (system prompt, earlier user messages and
replies) plus a new user message. The turn looks its prompt up, starts at the matched
boundary sharing the cached blocks, prefills the rest in chunks and decodes its reply one
token a step, writing every token through the step's slots. Entry contents are seeded by the
key of the prefix up to each position (:func:`kvforge.verify.token_seeds`), so a block shared
from an earlier turn or another conversation holds exactly what recomputing it would write;
every live entry of every turn, reused ones included, is compared before the turn is freed.

With ``tier="host"`` the device pools hold about one conversation, so conversations evict
each other's prefixes, and a host tier (:meth:`CacheController.initialize_host_tier`) keeps
what the device evicts: later turns are served partly from host pages, brought back byte for
byte before they are read, and verified like every other entry.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from kvforge.attn_backends.base import AttentionBackend
from kvforge.controller import CacheController
from kvforge.core.values import PrefixQuery
from kvforge.verify import EntryCheck, token_seeds, verify_request, write_step

__all__ = ["TIERS", "PrefixDemoResult", "run_prefix_demo"]

PREFILL_CHUNK = 256
#: where cached prefixes may live in the demo: the device alone, or the device and host pages
TIERS: tuple[str, ...] = ("device", "host")


class PrefixDemoResult(BaseModel):
    """What the prefix-reuse phase measured.

    Attributes:
        conversations: conversations run.
        turns: turns (requests) run.
        prompt_tokens: prompt tokens of every turn.
        hit_tokens: prompt tokens served from cache.
        boundary: the alignment of every reusable prefix (LCM of the groups' block sizes).
        entries_verified: live entries compared at the end of every turn.
        entries_mismatched: of those, entries whose bytes differ (0 when nothing is lost).
        tier: ``"device"`` or ``"host"`` (a host tier behind a device that holds about one
            conversation).
        host_hit_tokens: of ``hit_tokens``, those served past what the device held alone
            (brought back from host pages).
        host_blocks: blocks brought back from host pages.
        host_demotions: device blocks kept in host pages when the device evicted them.
    """

    model_config = ConfigDict(frozen=True)

    conversations: int
    turns: int
    prompt_tokens: int
    hit_tokens: int
    boundary: int
    entries_verified: int
    entries_mismatched: int
    tier: str = "device"
    host_hit_tokens: int = 0
    host_blocks: int = 0
    host_demotions: int = 0

    @property
    def hit_rate(self) -> float:
        """Display only: ``hit_tokens / prompt_tokens``."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_prefix_demo(
    backends: Mapping[int, AttentionBackend],
    conversations: int,
    seed: int,
    device: str = "cpu",
    tier: Literal["device", "host"] = "device",
) -> PrefixDemoResult:
    """Run ``conversations`` multi-turn conversations (2 to 4 turns, interleaved) through a
    controller with prefix caching, and verify every entry of every turn.

    Raises:
        ValueError: ``tier`` is not one of :data:`TIERS`.
    """
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {list(TIERS)}, got {tier!r}")
    rng = random.Random(seed)
    ctl = CacheController(backends, device=device, enable_prefix_caching=True)
    try:
        boundary = _size(ctl, tier)
        system = _tokens(rng, 3 * boundary // 2)
        history = {c: list(system) for c in range(conversations)}
        turns = {c: rng.randint(2, 4) for c in range(conversations)}
        prompt_tokens = hit_tokens = verified = mismatched = ran = 0
        while any(turns.values()):
            for c in range(conversations):
                if not turns[c]:
                    continue
                turns[c] -= 1
                prompt = history[c] + _tokens(rng, rng.randint(boundary // 8, boundary))
                reply = _tokens(rng, rng.randint(8, 48))
                rid = f"conv{c}-turn{ran}"
                hits, check = _turn(ctl, rid, prompt, reply)
                prompt_tokens += len(prompt)
                hit_tokens += hits
                verified += check.entries
                mismatched += check.mismatched
                history[c] = prompt + reply
                ran += 1
        stats = ctl.host_tier.stats if ctl.host_tier is not None else None
        return PrefixDemoResult(
            conversations=conversations,
            turns=ran,
            prompt_tokens=prompt_tokens,
            hit_tokens=hit_tokens,
            boundary=boundary,
            entries_verified=verified,
            entries_mismatched=mismatched,
            tier=tier,
            host_hit_tokens=stats.hit_tokens if stats else 0,
            host_blocks=sum(stats.hits.values()) if stats else 0,
            host_demotions=sum(stats.demotions.values()) if stats else 0,
        )
    finally:
        ctl.free()


def _size(ctl: CacheController, tier: str = "device") -> int:
    """Pools that hold a few whole conversations (``tier="device"``), or about one, with a
    host tier of a few conversations behind them (``"host"``); returns the reuse boundary
    (LCM)."""
    import math

    boundary = math.lcm(*(g.block_size for g in ctl.layout.groups if g.block_size > 1))
    longest = 24 * boundary
    # with a host tier, room for about one conversation (a turn's prompt reaches about 6
    # boundaries), so conversations evict each other's prefixes into host pages
    if tier == "device":
        blocks = {g.name: 4 * g.blocks_for(longest) + 2 for g in ctl.layout.groups}
    else:
        # the longest turn (a system prompt, 4 messages of at most a boundary, 4 replies of
        # at most 48 tokens) and a few blocks: conversations evict each other's prefixes
        turn = 3 * boundary // 2 + 4 * (boundary + 48)
        layout = ctl.layout
        blocks = {}
        for members in layout.pool_sets:  # groups whose pages pair up draw on one pool
            n = sum(layout.group(m).blocks_for(turn) for m in members) + 1
            blocks.update(dict.fromkeys(members, n))
    ctl.initialize_kv_cache(num_blocks=blocks, max_num_seqs=8, max_model_len=longest)
    if tier == "host":
        pages = {g.name: 4 * g.blocks_for(longest) + 2 for g in ctl.layout.groups}
        ctl.initialize_host_tier(num_pages=pages)
    return boundary


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def _turn(
    ctl: CacheController, rid: str, prompt: list[int], reply: list[int]
) -> tuple[int, EntryCheck]:
    """One turn: look up, prefill from the match, decode the reply, verify, free."""
    [match] = ctl.lookup([PrefixQuery(prompt)])
    sequence = np.array(prompt + reply, dtype=np.int64)
    seeds = token_seeds(sequence)
    done, first = match.num_tokens, True
    while done < len(sequence):
        n = min(PREFILL_CHUNK, len(prompt) - done) if done < len(prompt) else 1
        step = ctl.schedule(
            [rid],
            [n],
            new_token_ids=[sequence[done : done + n]],
            prefix_matches=[match] if first else None,
        )
        if step.allocation.refused:
            raise RuntimeError(step.allocation.refused[0].message)
        n = int(step.allocation.num_new[0])
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        done += n
        first = False
    check = verify_request(ctl, rid, seeds)
    ctl.free_request(rid)
    return match.num_tokens, check
