"""Window and state retention as a policy (``prefix_retention``).

``"dense"`` keeps every completed sliding-window / state block that the tail of some boundary
needs; ``"checkpoints"`` (vLLM 0.33's default rule) keeps only the tails where a later prompt
can end: the request's replay boundary (its prompt's last token rounded down to the
boundary), the junction its lookup found (where the full-attention chain it shares with a
cached prompt ends), and, with ``prefix_retention_interval``, every multiple of the interval.
Full-attention groups stay dense. Blocks not kept go back to the free list.

The tables below spell out, per policy, the block ends each group registers for one request
and the hit a later prompt gets, for gpt-oss-20b (``swa`` W 128 and ``kv``, both B 16:
boundary 16), Mistral-7B (only ``swa``, W 4096, B 16) and DeepSeek-V4-tiny (``swa`` B 64
W 128, ``compressed`` B 256, ``c4_state`` B 4 W 8, ``c128_state`` B 8 W 128: boundary 256).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvforge import BlockManager, CacheController, CacheLayout, GQABackend, PrefixQuery
from kvforge.models import from_hf_config
from kvforge.scheduler.prefix import DEFAULT_PREFIX_RETENTION, PREFIX_RETENTIONS

DENSE = ("dense", None)
CHECKPOINTS = ("checkpoints", None)
EVERY_256 = ("checkpoints", 256)
POLICIES = {"dense": DENSE, "checkpoints": CHECKPOINTS, "checkpoints/256": EVERY_256}


def manager(model: str, policy: tuple[str, int | None], blocks: int = 3000) -> BlockManager:
    layout = CacheLayout(from_hf_config(model))
    retention, interval = policy
    return BlockManager(
        layout,
        {g.name: blocks for g in layout.groups},
        max_num_seqs=4,
        max_model_len=4096,
        enable_prefix_caching=True,
        prefix_retention=retention,
        prefix_retention_interval=interval,
    )


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30_000, n).tolist()


def serve(bm: BlockManager, rid: str, prompt: list[int], decode: int = 0, match=...) -> int:
    """Look ``prompt`` up, prefill it after the hit in one step, decode ``decode`` tokens one
    step each, finish. Returns the hit."""
    if match is ...:
        [match] = bm.lookup([PrefixQuery(prompt)])
    hit = match.num_tokens if match is not None else 0
    step = bm.schedule(
        [rid], [len(prompt) - hit], new_token_ids=[prompt[hit:]], prefix_matches=[match]
    )
    assert not step.refused
    bm.end_step(step)
    for t in range(decode):
        step = bm.schedule([rid], [1], new_token_ids=[[t]])
        assert not step.refused
        bm.end_step(step)
    bm.finish([rid])
    return hit


def registered(bm: BlockManager, group: str) -> list[int]:
    """The token ends of the blocks ``group`` registered (a shared pool's other groups left
    out)."""
    return sorted(end for _, end, g in bm.registered_blocks(group).values() if g == group)


def hit(bm: BlockManager, prompt: list[int]) -> int:
    [match] = bm.lookup([PrefixQuery(prompt)])
    return match.num_tokens


def span(first: int, last: int, step: int) -> list[int]:
    return list(range(first, last + 1, step))


# ------------------------------------------------------------------ which blocks are kept

# gpt-oss: a 600-token prompt then 40 decode tokens. The replay boundary is 592 (599 rounded
# down to 16); its tail reads tokens 465..591: blocks 29..36, ending 480..592. Every 256
# tokens adds the tails at 256 (ends 144..256) and 512 (ends 400..512). kv keeps all 40.
GPT_OSS_SWA = {
    "dense": span(16, 640, 16),
    "checkpoints": span(480, 592, 16),
    "checkpoints/256": span(144, 256, 16) + span(400, 592, 16),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_gpt_oss_keeps_window_blocks_per_policy_and_history_densely(policy: str) -> None:
    bm = manager("gpt-oss-20b", POLICIES[policy])
    serve(bm, "a", tokens(600, 0), decode=40)
    assert registered(bm, "swa") == GPT_OSS_SWA[policy]
    assert registered(bm, "kv") == span(16, 640, 16)
    # blocks not kept went back to the free list: what is left is exactly what is registered
    pool = bm.pool("swa")
    kept = len(GPT_OSS_SWA[policy]) + 40
    assert pool.num_evictable == kept and pool.num_used == 0
    assert pool.num_free - pool.num_evictable == 3000 - 1 - kept  # the free stack


# Mistral: one window of 4,096 tokens, so the tail at the replay boundary 592 reaches back to
# token 0: checkpoints keep the prompt's 37 blocks and drop the decode blocks (608..640),
# which the checkpoint at 768 of the 256-token interval keeps.
MISTRAL_SWA = {
    "dense": span(16, 640, 16),
    "checkpoints": span(16, 592, 16),
    "checkpoints/256": span(16, 640, 16),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_mistral_drops_decode_blocks_under_checkpoints(policy: str) -> None:
    bm = manager("mistral-7b-v0.1", POLICIES[policy])
    serve(bm, "a", tokens(600, 0), decode=40)
    assert registered(bm, "swa") == MISTRAL_SWA[policy]


# DeepSeek-V4-tiny: a 1,000-token prompt, boundary 256, replay boundary 768. Dense keeps the
# tail of every multiple of 256 a block can reach (1,024 included for the blocks after 768);
# checkpoints keep the tail at 768 only: swa blocks 10, 11; c4_state 190, 191; c128_state
# 80..95.
V4_TINY = {
    "dense": {
        "compressed": [256, 512, 768],
        "swa": [192, 256, 448, 512, 704, 768, 960],
        "c4_state": [252, 256, 508, 512, 764, 768],
        "c128_state": span(136, 256, 8)
        + span(392, 512, 8)
        + span(648, 768, 8)
        + span(904, 1000, 8),
    },
    "checkpoints": {
        "compressed": [256, 512, 768],
        "swa": [704, 768],
        "c4_state": [764, 768],
        "c128_state": span(648, 768, 8),
    },
    "checkpoints/256": {  # every 256 is every boundary: dense up to the replay boundary
        "compressed": [256, 512, 768],
        "swa": [192, 256, 448, 512, 704, 768, 960],
        "c4_state": [252, 256, 508, 512, 764, 768],
        "c128_state": span(136, 256, 8)
        + span(392, 512, 8)
        + span(648, 768, 8)
        + span(904, 1000, 8),
    },
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_deepseek_v4_tiny_keeps_state_and_window_tails_per_policy(policy: str) -> None:
    bm = manager("deepseek-v4-tiny", POLICIES[policy])
    serve(bm, "a", tokens(1000, 0))
    for group, ends in V4_TINY[policy].items():
        assert registered(bm, group) == ends, group


# ------------------------------------------------------------------ the hits later prompts get

# gpt-oss, in order (each served after its lookup, so later rows see what earlier ones kept):
#   A: a 600-token prompt, B: A's first 300 tokens then its own, C: A's first 300 then others,
#   D: A's first 160 then its own. Expected hit per policy.
GPT_OSS_HITS = [
    # name, prompt,                        dense, checkpoints, checkpoints/256
    ("A", lambda a: a, 0, 0, 0),
    ("resend A", lambda a: a, 592, 592, 592),  # the prompt end: its replay boundary
    ("A + 50", lambda a: a + tokens(50, 9), 592, 592, 592),
    # diverges at 300: the chain reaches 288, no kept tail there under checkpoints, 256 with
    # the interval; B's lookup reports the junction 288, and B keeps the tail there
    ("B", lambda a: a[:300] + tokens(300, 1), 288, 0, 256),
    ("C", lambda a: a[:300] + tokens(300, 2), 288, 288, 288),  # the junction B kept
    ("D", lambda a: a[:160] + tokens(200, 3), 160, 0, 0),  # between checkpoints
]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_gpt_oss_hits_at_prompt_ends_and_junctions(policy: str) -> None:
    bm = manager("gpt-oss-20b", POLICIES[policy])
    a = tokens(600, 0)
    column = list(POLICIES).index(policy) + 2
    got = {}
    for i, row in enumerate(GPT_OSS_HITS):
        got[row[0]] = serve(bm, f"r{i}", row[1](a))
    assert got == {row[0]: row[column] for row in GPT_OSS_HITS}


def test_a_lookup_reports_its_prompt_length_and_junction() -> None:
    bm = manager("gpt-oss-20b", CHECKPOINTS)
    a = tokens(600, 0)
    serve(bm, "a", a)
    [match] = bm.lookup([PrefixQuery(a[:300] + tokens(300, 1))])
    assert (match.num_tokens, match.num_prompt_tokens, match.junction) == (0, 600, 288)
    [match] = bm.lookup([PrefixQuery([*a, 1])])
    assert (match.num_tokens, match.num_prompt_tokens, match.junction) == (592, 601, 0)


def test_mistral_hits_a_decoded_continuation_only_at_the_prompt_end_under_checkpoints() -> None:
    a = tokens(600, 0)
    decoded = list(range(40))  # what serve() decodes
    follow_up = a + decoded + tokens(30, 5)  # the next turn: prompt, answer, a new message
    hits = {}
    for policy in ("dense", "checkpoints"):
        bm = manager("mistral-7b-v0.1", POLICIES[policy])
        serve(bm, "a", a, decode=40)
        hits[policy] = hit(bm, follow_up)
        # a sibling diverging inside the window: every policy keeps the whole window behind
        # the replay boundary, so it hits where the chain diverges (no junction needed)
        assert hit(bm, a[:300] + tokens(300, 1)) == 288
    assert hits == {"dense": 640, "checkpoints": 592}


# DeepSeek-V4-tiny: A 1,000 tokens; B shares A's first 600 (the chain reaches 512); C too.
V4_HITS = [
    ("A", lambda a: a, 0, 0),
    ("A + 200", lambda a: a + tokens(200, 9), 768, 768),
    ("B", lambda a: a[:600] + tokens(400, 1), 512, 0),
    ("C", lambda a: a[:600] + tokens(400, 2), 512, 512),
]


@pytest.mark.parametrize("policy", ["dense", "checkpoints"])
def test_deepseek_v4_tiny_hits_at_prompt_ends_and_junctions(policy: str) -> None:
    bm = manager("deepseek-v4-tiny", POLICIES[policy])
    a = tokens(1000, 0)
    column = 2 if policy == "dense" else 3
    got = {row[0]: serve(bm, f"r{i}", row[1](a)) for i, row in enumerate(V4_HITS)}
    assert got == {row[0]: row[column] for row in V4_HITS}


def test_a_request_scheduled_without_a_match_keeps_its_blocks_densely() -> None:
    # its prompt's end is unknown (no lookup): checkpoints cannot tell where a later prompt
    # ends, so nothing that dense keeps is dropped
    bm = manager("gpt-oss-20b", CHECKPOINTS)
    serve(bm, "a", tokens(600, 0), decode=40, match=None)
    assert registered(bm, "swa") == GPT_OSS_SWA["dense"]


def test_a_match_whose_reported_prompt_or_junction_was_altered_is_refused() -> None:
    bm = manager("gpt-oss-20b", CHECKPOINTS)
    a = tokens(600, 0)
    serve(bm, "a", a)
    [match] = bm.lookup([PrefixQuery([*a, 1])])
    for change in ({"num_prompt_tokens": 5000}, {"junction": 64}):
        forged = dataclasses.replace(match, **change)
        step = bm.schedule(["b"], [9], new_token_ids=[[*a, 1][592:]], prefix_matches=[forged])
        assert [r.reason for r in step.refused] == ["stale_prefix"]
        bm.end_step(step)
    assert bm.requests == []


def test_the_default_is_the_measured_one_and_every_policy_is_listed() -> None:
    assert PREFIX_RETENTIONS == ("dense", "checkpoints")
    assert DEFAULT_PREFIX_RETENTION in PREFIX_RETENTIONS
    bm = manager("gpt-oss-20b", (DEFAULT_PREFIX_RETENTION, None))
    assert bm._prefix.retention == DEFAULT_PREFIX_RETENTION
    ctl = CacheController({0: GQABackend(1, 8, 16)})
    assert ctl.prefix_retention == DEFAULT_PREFIX_RETENTION
    assert ctl.prefix_retention_interval is None


# ------------------------------------------------------------------ bad values

BAD = [
    ({"prefix_retention": "x"}, "prefix_retention must be 'dense' or 'checkpoints', got 'x'"),
    (
        {"prefix_retention": "Dense"},
        "prefix_retention must be 'dense' or 'checkpoints', got 'Dense'",
    ),
    ({"prefix_retention": None}, "prefix_retention must be 'dense' or 'checkpoints', got None"),
    ({"prefix_retention": 0}, "prefix_retention must be 'dense' or 'checkpoints', got 0"),
    (
        {"prefix_retention": "dense", "prefix_retention_interval": 256},
        "prefix_retention_interval applies to prefix_retention='checkpoints', got 256 with "
        "prefix_retention='dense'",
    ),
    (
        {"prefix_retention": "checkpoints", "prefix_retention_interval": 0},
        "prefix_retention_interval must be None or a positive int, got 0",
    ),
    (
        {"prefix_retention": "checkpoints", "prefix_retention_interval": True},
        "prefix_retention_interval must be None or a positive int, got True",
    ),
    (
        {"prefix_retention": "checkpoints", "prefix_retention_interval": 256.0},
        "prefix_retention_interval must be None or a positive int, got 256.0",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_bad_values_are_refused_by_the_manager_and_the_controller(kwargs, message) -> None:
    layout = CacheLayout(from_hf_config("gpt-oss-20b"))
    blocks = {g.name: 64 for g in layout.groups}
    with pytest.raises(ValueError) as err:
        BlockManager(layout, blocks, enable_prefix_caching=True, **kwargs)
    assert str(err.value) == message
    assert isinstance(err.value, TypeError)  # ArgumentError: both, as every argument check
    backends = {0: GQABackend(1, 8, 16, sliding_window=128), 1: GQABackend(1, 8, 16)}
    with pytest.raises(ValueError) as err:
        CacheController(backends, enable_prefix_caching=True, **kwargs)
    assert str(err.value) == message
    # nothing changed: the same backends build a controller and a manager afterwards
    ctl = CacheController(backends, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=32, max_num_seqs=2, max_model_len=256)
    assert ctl.scheduler.prefix_caching
    BlockManager(layout, blocks, enable_prefix_caching=True)


def test_an_interval_off_the_boundary_is_refused_before_anything_is_allocated() -> None:
    message = (
        "prefix_retention_interval must be a multiple of 256 (the LCM of the groups' block "
        "sizes, where prefix hits end), got 128"
    )
    layout = CacheLayout(from_hf_config("deepseek-v4-tiny"))
    with pytest.raises(ValueError) as err:
        BlockManager(
            layout,
            {g.name: 64 for g in layout.groups},
            enable_prefix_caching=True,
            prefix_retention="checkpoints",
            prefix_retention_interval=128,
        )
    assert str(err.value) == message
    # the controller knows the boundary once it sizes the pools: refused there, nothing made
    ctl = CacheController(
        {0: GQABackend(1, 8, 16, sliding_window=32), 1: GQABackend(1, 8, 16)},
        enable_prefix_caching=True,
        prefix_retention="checkpoints",
        prefix_retention_interval=24,
    )
    with pytest.raises(ValueError, match=r"must be a multiple of 16 .* got 24"):
        ctl.initialize_kv_cache(num_blocks=32, max_num_seqs=2, max_model_len=256)
    assert not ctl.storage.ready
    with pytest.raises(RuntimeError):
        ctl.scheduler  # noqa: B018


@pytest.mark.parametrize("retention", PREFIX_RETENTIONS)
def test_a_model_without_window_groups_is_unaffected(retention: str) -> None:
    layout = CacheLayout(from_hf_config("llama-3-8b"))
    bm = BlockManager(
        layout,
        {g.name: 200 for g in layout.groups},
        max_model_len=2048,
        enable_prefix_caching=True,
        prefix_retention=retention,
    )
    a = tokens(600, 0)
    serve(bm, "a", a, decode=40)
    assert hit(bm, a[:300] + tokens(300, 1)) == 288
    assert len(bm.registered_blocks(bm.groups[0])) == 40
