"""The prefix-reuse part of ``kvforge demo``: multi-turn conversations over a shared system
prompt, with the prefix cache on, every reused byte verified.

Each turn's prompt is the conversation so far (system prompt, earlier user messages and
replies) plus a new user message. The turn looks its prompt up, starts at the matched
boundary sharing the cached blocks, prefills the rest in chunks and decodes its reply one
token a step, writing every token through the step's slots. Entry contents are seeded by the
key of the prefix up to each position (:func:`kvforge.verify.token_seeds`), so a block shared
from an earlier turn or another conversation holds exactly what recomputing it would write;
every live entry of every turn, reused ones included, is compared before the turn is freed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict

from kvforge.attn_backends.base import AttentionBackend
from kvforge.controller import CacheController
from kvforge.core.values import PrefixQuery
from kvforge.verify import EntryCheck, token_seeds, verify_request, write_step

__all__ = ["PrefixDemoResult", "run_prefix_demo"]

PREFILL_CHUNK = 256


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
    """

    model_config = ConfigDict(frozen=True)

    conversations: int
    turns: int
    prompt_tokens: int
    hit_tokens: int
    boundary: int
    entries_verified: int
    entries_mismatched: int

    @property
    def hit_rate(self) -> float:
        """Display only: ``hit_tokens / prompt_tokens``."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_prefix_demo(
    backends: Mapping[int, AttentionBackend],
    conversations: int,
    seed: int,
    device: str = "cpu",
) -> PrefixDemoResult:
    """Run ``conversations`` multi-turn conversations (2 to 4 turns, interleaved) through a
    controller with prefix caching, and verify every entry of every turn."""
    rng = random.Random(seed)
    ctl = CacheController(backends, device=device, enable_prefix_caching=True)
    try:
        boundary = _size(ctl)
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
        return PrefixDemoResult(
            conversations=conversations,
            turns=ran,
            prompt_tokens=prompt_tokens,
            hit_tokens=hit_tokens,
            boundary=boundary,
            entries_verified=verified,
            entries_mismatched=mismatched,
        )
    finally:
        ctl.free()


def _size(ctl: CacheController) -> int:
    """Pools that hold a few whole conversations; returns the reuse boundary (LCM)."""
    import math

    boundary = math.lcm(*(g.block_size for g in ctl.layout.groups if g.block_size > 1))
    longest = 24 * boundary
    blocks = {g.name: 4 * g.blocks_for(longest) + 2 for g in ctl.layout.groups}
    ctl.initialize_kv_cache(num_blocks=blocks, max_num_seqs=8, max_model_len=longest)
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
