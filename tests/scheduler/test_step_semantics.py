"""Step semantics real kernels rely on: a prefill chunk gets a slot for every token even
through a window; blocks that slide out go back at the request's next step; speculative
decoding rolls back (truncate) and re-grows with every byte intact."""

from __future__ import annotations

import numpy as np
import torch

from kvforge import CacheController, DeepseekV4Backend, GQABackend
from kvforge.models import from_hf_config
from kvforge.verify import token_seeds, verify_request, write_step


def test_a_512_token_chunk_of_v4_flash_gets_512_valid_swa_slots():
    backends = from_hf_config("deepseek-v4-flash")
    layers = {i: backends[i] for i in (0, 2, 3)}  # ratios 0, 4, 128: every group
    ctl = CacheController(layers)
    ctl.initialize_kv_cache(num_blocks=260)
    step = ctl.schedule(["r"], [512])
    slots = step.inputs.slot_mappings
    # swa: block 64, window 128; the kernel writes all 512 tokens, then reads them back
    assert (slots[("swa", 1)] >= 0).sum() == 512
    assert len(set(slots[("swa", 1)].tolist())) == 512
    assert ctl.num_used_blocks("swa") == 8  # 512 / 64, none released within the step
    # compressed entries complete every 4th / 128th token: 128 and 4 valid slots
    assert (slots[("compressed", 4)] >= 0).sum() == 128
    assert (slots[("compressed", 128)] >= 0).sum() == 4
    # c4_state (block 4, window 8) and c128_state (block 8, window 128): one per token
    assert (slots[("c4_state", 1)] >= 0).sum() == 512
    assert (slots[("c128_state", 1)] >= 0).sum() == 512
    # the next step (a decode from token 512 reads tokens 385..512) releases the rest:
    # swa keeps blocks 6..8 (tokens 384..575), c4_state keeps blocks 126..128 (505..515),
    # c128_state keeps blocks 48..64 (384..519)
    ctl.schedule(["r"], [1])
    assert ctl.num_used_blocks("swa") == 3
    assert ctl.num_used_blocks("c4_state") == 3
    assert ctl.num_used_blocks("c128_state") == 17


def test_truncate_and_regrow_round_trip():
    # speculative decoding: 4 draft tokens scheduled, 2 rejected, then decoding goes on
    ctl = CacheController(
        {0: DeepseekV4Backend(0), 1: DeepseekV4Backend(4), 2: GQABackend(1, 8, 16)}
    )
    ctl.initialize_kv_cache(num_blocks={"swa": 40, "compressed": 8, "c4_state": 200, "kv": 80})
    ctl.initialize_host_cache(num_pages=40)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 700)
    seeds = token_seeds(tokens)
    done = 0
    while done < 600:
        step = ctl.schedule(["r"], [100])
        write_step(ctl, step, {"r": seeds})
        ctl.end_step(step)
        done += 100
    for _ in range(5):
        draft = ctl.schedule(["r"], [4])  # the target model verifies 4 draft tokens
        write_step(ctl, draft, {"r": seeds})
        ctl.end_step(draft)
        ctl.truncate("r", ctl.num_tokens("r") - 2)  # 2 of them are rejected
    assert ctl.num_tokens("r") == 610
    assert verify_request(ctl, "r", seeds).mismatched == 0
    # the rejected positions are written again by the next steps with the accepted tokens
    step = ctl.schedule(["r"], [3])
    write_step(ctl, step, {"r": seeds})
    ctl.end_step(step)
    ctl.swap_out("r")
    for cache in ctl.kv_caches:
        cache.view(torch.uint8).fill_(0x5A)
    ctl.swap_in("r")
    check = verify_request(ctl, "r", seeds)
    assert check.mismatched == 0 and check.entries > 0
    ctl.free_request("r")
    assert all(ctl.num_used_blocks(g) == 0 for g in ctl.groups)
