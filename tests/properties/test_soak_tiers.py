"""The soak with bundled models and tiers attached (``benchmarks/soak.py --model``,
``--host-tier``, ``--remote``; ``benchmarks/soak_tiers.py``) at CI size.

Each combination runs a few hundred operations on a soak-sized DeepSeek-V4, gpt-oss or
Qwen3-Next with a host tier, and a real Redis or Mooncake server on loopback behind it whose
client calls fail at random (timeouts, errors, stale existence hints, torn reads, lost,
corrupted and truncated puts, Redis restarts). Every byte a hit brings back (device, host
pages, the store) is verified, a per-request state snapshot is compared right after it is
restored, a fault may cost only a miss or a dropped publish, and the tier's and the store's
counters must add up. Mooncake runs go through the command line in a process of their own:
Mooncake's client keeps process-wide state in the network namespace of its first client.
A failure names the seed, so it replays with the command in the test's id.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soak
import soak_threads
import soak_tiers
import torch

from kvforge import CacheController, PrefixQuery
from kvforge.verify import read_entries, token_seeds, write_entries

ROOT = Path(__file__).resolve().parents[2]
NO_REDIS = soak_tiers.missing("redis")
NO_MOONCAKE = soak_tiers.missing("mooncake")
needs_redis = pytest.mark.skipif(NO_REDIS is not None, reason=f"--remote redis: {NO_REDIS}")
needs_mooncake = pytest.mark.skipif(
    NO_MOONCAKE is not None, reason=f"--remote mooncake: {NO_MOONCAKE}"
)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _clean_end(report) -> None:
    assert report.final_open_steps == []
    assert report.final_used_blocks and not any(report.final_used_blocks.values())
    assert report.final_host_pages and not any(report.final_host_pages.values())


def _remote_adds_up(remote: dict, faults) -> None:
    assert remote["published"] > 0
    assert remote["puts_ok"] + remote["puts_failed"] == remote["published"]
    assert remote["fetched"] == remote["gets_hit"]
    assert remote["fetch_misses"] == sum(remote["misses"].values())
    assert sum(faults.values()) > 0, faults


SINGLE = [
    # (id, run_soak keywords)
    ("default-write_through", {"host_tier": "write_through"}),
    ("gpt-oss-eviction-redis-restarts", {"model": "gpt-oss", "host_tier": "eviction",
                                         "remote": "redis", "restart_every": 80}),
    ("qwen3-next-write_through-redis", {"model": "qwen3-next", "host_tier": "write_through",
                                        "remote": "redis"}),
    ("deepseek-v4-write_through-redis", {"model": "deepseek-v4", "host_tier": "write_through",
                                         "remote": "redis"}),
    ("gpt-oss-async-write_through-redis", {"model": "gpt-oss", "host_tier": "write_through",
                                           "remote": "redis", "async_steps": True}),
    ("deepseek-v4-async-eviction-redis", {"model": "deepseek-v4", "host_tier": "eviction",
                                          "remote": "redis", "async_steps": True}),
]  # fmt: skip


@pytest.mark.soak
@pytest.mark.parametrize(("name", "flags"), SINGLE, ids=[c[0] for c in SINGLE])
def test_soak_with_tiers(name: str, flags: dict) -> None:
    if flags.get("remote") == "redis" and NO_REDIS:
        pytest.skip(f"--remote redis: {NO_REDIS}")
    report = soak.run_soak(250, 7, prefix=True, fault_rate=0.1, **flags)
    assert sum(report.ops.values()) == 250
    assert report.entries_verified > 0 and report.ops["prefix_admit"] > 0
    assert report.host_tier["demotions"], report.host_tier  # the tier took evicted blocks
    _clean_end(report)
    if flags.get("remote"):
        _remote_adds_up(report.remote, report.faults)
    if flags.get("restart_every"):
        assert report.restarts == 250 // flags["restart_every"]


def test_the_models_keep_their_group_kinds() -> None:
    kinds = {}
    for name in soak_tiers.MODELS:
        ctl = CacheController(soak_tiers.model_backends(name))
        kinds[name] = {g: ctl.layout.group(g).kind.value for g in ctl.groups}
    assert kinds == {
        "deepseek-v4": {
            "swa": "sliding_window",
            "compressed": "full",
            "c4_state": "state",
            "c128_state": "state",
        },
        "gpt-oss": {"swa": "sliding_window", "kv": "full"},
        "qwen3-next": {"linear_state": "per_request", "kv": "full"},
    }


@pytest.mark.soak
@pytest.mark.parametrize("model", ["gpt-oss", "qwen3-next", "deepseek-v4"])
def test_models_without_tiers(model: str) -> None:
    """The soak's model predicts every step and swap of the bundled layouts too (a shared
    pool for gpt-oss's paired pages, a fixed slot per request for Qwen3-Next's state)."""
    report = soak.run_soak(200, 3, model=model)
    assert report.refused > 0 and report.entries_verified > 0
    _clean_end(report)


@pytest.mark.soak
@needs_redis
@pytest.mark.parametrize(
    ("model", "policy"), [("qwen3-next", "write_through"), ("deepseek-v4", "eviction")]
)
def test_threads_with_tiers(model: str, policy: str) -> None:
    report = soak_threads.run_threads(
        200, 5, 2, model=model, host_tier=policy, remote="redis", fault_rate=0.1
    )
    assert report.ops == 200 and report.total("mismatches") == 0
    assert report.total("prefix_hits") > 0 and report.total("entries_verified") > 0
    assert not any(report.final_used_blocks.values())
    _remote_adds_up(report.remote, report.faults)


@needs_redis
def test_every_store_call_failing_costs_misses_only() -> None:
    """At fault rate 1 every client call fails one way or another: lookups and steps still
    never raise, every byte still verifies, and the counters still add up."""
    report = soak.run_soak(
        200, 9, prefix=True, model="gpt-oss", host_tier="eviction", remote="redis", fault_rate=1.0
    )
    assert report.faults["exists_raised"] + report.faults["exists_lied"] > 0
    assert report.faults["puts_raised"] + report.faults["values_corrupted"] > 0
    _remote_adds_up(report.remote, report.faults)
    _clean_end(report)


@needs_redis
def test_remote_hits_are_served_and_verified() -> None:
    """Without faults the store serves hits (resets leave the device and the host empty),
    every one verified byte for byte, and no client call fails."""
    report = soak.run_soak(
        250, 7, prefix=True, model="gpt-oss", host_tier="eviction", remote="redis", fault_rate=0.0
    )
    assert report.remote["fetched"] > 0 and report.hit_tokens["remote"] > 0, report.remote
    assert report.hits_by_tier["remote"] > 0
    assert report.remote["real_errors"] == 0, report.remote["last_real_error"]
    assert sum(report.faults.values()) == 0
    _remote_adds_up(report.remote, {"none": 1})
    _clean_end(report)


MOONCAKE_RUNS = [
    ["--model", "deepseek-v4", "--host-tier", "eviction", "--remote", "mooncake"],
    ["--model", "gpt-oss", "--host-tier", "write_through", "--remote", "mooncake",
     "--async-steps"],
    ["--model", "qwen3-next", "--host-tier", "eviction", "--remote", "mooncake",
     "--threads", "2"],
]  # fmt: skip


@pytest.mark.soak
@needs_mooncake
@pytest.mark.parametrize("flags", MOONCAKE_RUNS, ids=["deepseek-v4", "gpt-oss-async", "threads"])
def test_mooncake_runs_in_a_process_of_its_own(flags: list[str]) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks/soak.py"), "--ops", "200", "--seed", "8"]
    out = subprocess.run(
        [*cmd, "--fault-rate", "0.1", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "remote tier: published" in out.stdout and "mismatches: 0" in out.stdout


BAD_FLAGS = [
    ("remote_alone", ["--remote", "redis"], "--remote redis sits behind a host tier"),
    ("remote_word", ["--host-tier", "eviction", "--remote", "s3"], "invalid choice: 's3'"),
    ("policy_word", ["--host-tier", "lru"], "invalid choice: 'lru'"),
    ("model_word", ["--model", "llama"], "argument --model: must be one of deepseek-v4"),
    ("fault_rate", ["--host-tier", "eviction", "--fault-rate", "2"], "--fault-rate must be"),
    ("restart_negative", ["--restart-every", "-1"], "--restart-every must be >= 0, got -1"),
    (
        "restart_mooncake",
        ["--host-tier", "eviction", "--remote", "mooncake", "--restart-every", "5"],
        "--restart-every restarts a Redis server",
    ),
    ("model_shared", ["--model", "gpt-oss", "--share-pools"], "--share-pools pairs"),
]


@pytest.mark.parametrize(
    ("argv", "fragment"), [c[1:] for c in BAD_FLAGS], ids=[c[0] for c in BAD_FLAGS]
)
def test_bad_flags_exit_2_naming_the_flag(argv, fragment, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        soak.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_bundled_names_are_accepted() -> None:
    args = soak.parse_args(["--model", "deepseek-v4-tiny", "--host-tier", "write_through"])
    assert args.model == "deepseek-v4" and args.prefix


def test_a_wrong_state_byte_is_detected() -> None:
    """The per-request state check is live: one flipped byte in a Qwen3-Next state slot
    fails the next verify."""
    run = soak.Soak(5, prefix=True, model="qwen3-next")
    toks = list(range(1, 41))
    step = run.ctl.schedule(["x"], [40], new_token_ids=[toks])
    run.model.apply_step("x", 40, 11)
    run.model.resident["x"].tokens = toks
    run.write("x", 0, 40)
    run.ctl.end_step(step)
    run.verify("x")
    [entry] = [e for e in run.ctl.layout.buffers if e.group.name == "linear_state"][:1]
    slots = torch.as_tensor(np.asarray(run.ctl.slot_mapping("x", "linear_state", [0])))
    cache = run.ctl.kv_caches[entry.index]
    write_entries(cache, entry, slots, read_entries(cache, entry, slots) ^ 1)
    with pytest.raises(AssertionError, match="entries differ"):
        run.verify("x")


def _qwen(max_num_seqs: int = 4) -> CacheController:
    ctl = CacheController(soak_tiers.model_backends("qwen3-next"), enable_prefix_caching=True)
    ctl.initialize_kv_cache(
        num_blocks={"linear_state": 24, "kv": 140}, max_num_seqs=max_num_seqs, max_model_len=768
    )
    return ctl


def test_a_restored_snapshot_is_checked_before_the_step_writes() -> None:
    """Synchronous order: the snapshot at 512 holds the state after token 511, and
    ``check_snapshots`` accepts it; a snapshot of other content is refused."""
    ctl = _qwen()
    toks = np.random.default_rng(0).integers(0, 500, 600).tolist()
    seeds = token_seeds(toks)
    step = ctl.schedule(["a"], [512], new_token_ids=[toks[:512]])
    soak_tiers.write_state(ctl, "a", seeds, 511)
    ctl.end_step(step)
    ctl.free_request("a")
    [m] = ctl.lookup([PrefixQuery(toks[:520])])
    assert m.num_tokens == 512
    ctl.schedule(["b"], [1], new_token_ids=[toks[512:513]], prefix_matches=[m])
    assert soak_tiers.check_snapshots(ctl, "b", 512, seeds) == 4
    soak_tiers.write_state(ctl, "b", seeds, 400)  # not the snapshot
    with pytest.raises(AssertionError, match="restored at 512 are not the prompt's snapshot"):
        soak_tiers.check_snapshots(ctl, "b", 512, seeds)


def test_a_snapshot_in_asynchronous_order_is_the_state_at_its_boundary() -> None:
    ctl = _qwen()
    toks = np.random.default_rng(0).integers(0, 500, 600).tolist()
    seeds = token_seeds(toks)
    first = ctl.schedule(["a"], [512], new_token_ids=[toks[:512]])
    soak_tiers.write_state(ctl, "a", seeds, 511)  # step N's kernels
    second = ctl.schedule(["a"], [10], new_token_ids=[toks[512:522]])
    soak_tiers.write_state(ctl, "a", seeds, 521)  # step N + 1's, scheduled before N ended
    ctl.end_step(first)
    ctl.end_step(second)
    ctl.free_request("a")
    [m] = ctl.lookup([PrefixQuery(toks[:520])])
    assert m.num_tokens == 512
    ctl.schedule(["b"], [1], new_token_ids=[toks[512:513]], prefix_matches=[m])
    soak_tiers.check_snapshots(ctl, "b", 512, seeds)


@needs_redis
def test_float_token_ids_name_the_field_with_a_remote_tier() -> None:
    with soak_tiers.remote_run("redis", 0.0, 1) as run:
        ctl = _qwen()
        ctl.initialize_host_tier(num_pages=16, policy="eviction")
        run.attach(ctl, "qwen3-next")
        try:
            with pytest.raises(ValueError, match=r"queries\[0\]\.token_ids must be"):
                ctl.lookup([PrefixQuery([1.5, 2.0])])
        finally:
            ctl.free()
