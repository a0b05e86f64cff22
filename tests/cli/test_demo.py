"""``kvforge demo``: the serving loop preempts, swaps and verifies; seeds repeat; bad input exits 2.

Runs use a small load (8 requests, prompts 16..200, outputs 8..40 tokens) on the bundled
``deepseek-v4-tiny`` model so the whole file stays within seconds; the same code paths run in
the default demo, only with more requests.
"""

import json
import os
import re

import pytest
import torch
from pydantic import ValidationError

from kvforge import CacheController
from kvforge.cli.demo import (
    DemoConfig,
    SelfTestOutOfRange,
    _Loop,
    _make_requests,
    run_demo,
)
from kvforge.cli.demo_sizing import size_host
from kvforge.cli.main import main
from kvforge.models import from_hf_config, load_model_config

SMALL = {"requests": 8, "prompt_len": (16, 200), "output_len": (8, 40), "seed": 2, "device": "cpu"}
LAST_LINE = re.compile(r"^verified (\d+) entries, (\d+) mismatched$")


@pytest.fixture(scope="module")
def small_result():
    return run_demo(DemoConfig(**SMALL), progress=False)


def last_line(text):
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1]


@pytest.mark.slow
def test_small_run_preempts_swaps_in_and_verifies_everything(small_result):
    r = small_result
    assert r.requests_finished == r.requests_total == 8
    assert r.preemptions > 0 and r.swap_ins > 0
    assert r.recomputes == 0  # default host pools hold every request
    assert r.bytes_swapped_out > 0 and r.bytes_swapped_in == r.bytes_swapped_out
    assert r.verify_finished.entries > 0 and r.verify_swap_in.entries > 0
    assert r.entries_verified > 0 and r.entries_mismatched == 0 and r.ok
    assert r.summary_line() == f"verified {r.entries_verified} entries, 0 mismatched"
    # every group ran at (or next to) its limit at some point, and none past it
    for g in r.groups:
        assert 0 < g.peak_used_blocks <= g.usable_blocks
    assert {g.group for g in r.groups} == {"swa", "compressed", "c4_state", "c128_state"}
    assert any(g.host_peak_used_pages > 0 for g in r.groups)
    assert r.device_cache_bytes == r.device_memory_budget  # derived budget allocated exactly
    assert r.device == "cpu"


@pytest.mark.slow
def test_same_seed_same_counts_other_seed_other_counts(small_result):
    again = run_demo(DemoConfig(**SMALL), progress=False)
    assert again.counts() == small_result.counts()
    other = run_demo(DemoConfig(**{**SMALL, "seed": 4}), progress=False)
    assert other.counts() != small_result.counts()
    assert other.ok and other.preemptions > 0


def test_corrupted_entry_is_reported():
    r = run_demo(DemoConfig(**SMALL, corrupt_after_step=5), progress=False)
    assert r.corrupted
    assert r.entries_mismatched > 0 and not r.ok
    assert r.summary_line().endswith(f"{r.entries_mismatched} mismatched")


@pytest.mark.slow
def test_stopped_run_verifies_running_and_swapped_requests():
    r = run_demo(DemoConfig(**SMALL, max_steps=53), progress=True)
    assert r.steps == 53 and r.requests_finished < r.requests_total
    # what was live at the stop was checked: running requests as they were, the swapped one
    # after swapping it back in
    assert r.running_at_end > 0 and r.swapped_at_end > 0
    assert r.verify_end.entries > 0 and r.ok


def test_host_memory_too_small_for_one_request_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot hold one preempted request.*raise --host-memory"):
        run_demo(DemoConfig(**SMALL, host_memory=1024 * 1024), progress=False)


@pytest.mark.slow
def test_full_host_pool_falls_back_to_recompute():
    config = DemoConfig(
        requests=3, prompt_len=(100, 100), output_len=(12, 12), arrival_gap=(0, 0), device="cpu"
    )
    requests = _make_requests(config)
    ctl = CacheController(from_hf_config(load_model_config("deepseek-v4-tiny")), device="cpu")
    ctl.initialize_kv_cache(num_blocks=96)
    ctl.initialize_host_cache(num_pages=size_host(ctl.layout, 112, 1, None))  # one request
    loop = _Loop(ctl, config, requests)
    loop.step()  # all three arrive, are admitted and decode one token
    _, middle, newest = sorted(loop.running, key=lambda r: r.index)
    loop.preempt(newest)  # swapped out: the host pool is now full
    loop.preempt(middle)  # dropped, to be re-prefilled from its tokens so far
    assert (loop.preemptions, loop.recomputes) == (1, 1)
    assert (newest.state, middle.state, middle.generated) == ("swapped", "waiting", 1)
    assert loop.verify_finished.entries > 0  # what it held was checked before it was dropped
    while loop.busy:
        loop.step()
    loop.finish()
    assert [r.state for r in requests] == ["finished"] * 3
    assert loop.swap_ins == 1
    checks = (loop.verify_finished, loop.verify_swap_in, loop.verify_end)
    assert all(c.mismatched == 0 for c in checks) and loop.verify_swap_in.entries > 0
    ctl.free()


def test_too_small_device_memory_says_how_much_is_needed():
    with pytest.raises(ValueError) as info:
        run_demo(DemoConfig(**SMALL, device_memory=1024 * 1024), progress=False)
    message = str(info.value)
    assert "cannot hold even one request alone" in message
    assert "raise --device-memory to at least" in message
    least = int(re.search(r"\((\d+) bytes\)$", message).group(1))
    # the number in the message is enough: every request then runs, mostly alone
    small = {**SMALL, "requests": 3, "output_len": (8, 16)}
    r = run_demo(DemoConfig(**small, device_memory=least), progress=False)
    assert r.device_cache_bytes == least
    # the minimum is what the longest request (< 256 tokens) holds at its peak, per group:
    # prompts are prefilled in 16-token chunks and a window group holds the whole chunk plus
    # its window until the next step: c4_state (block 4, window 8) 16 / 4 + 8 / 4 = 6;
    # c128_state (block 8, window 128) 16 / 8 + 128 / 8 = 18; swa (block 64, window 128) 3
    assert {g.group: g.usable_blocks for g in r.groups} == {
        "swa": 3,
        "compressed": 1,
        "c4_state": 6,
        "c128_state": 18,
    }
    assert r.requests_finished == 3 and r.ok
    with pytest.raises(ValueError, match="cannot hold even one request alone"):
        run_demo(DemoConfig(**small, device_memory=least - 1), progress=False)


def test_peak_live_blocks_matches_a_request_growing_token_by_token():
    backends = from_hf_config(load_model_config("deepseek-v4-tiny"))
    ctl = CacheController(backends)
    ctl.initialize_kv_cache(num_blocks=64)
    groups = {g.name: g for g in ctl.layout.groups}
    peak = dict.fromkeys(groups, 0)
    for n in range(1, 301):
        ctl.allocate("r", n)
        for name in groups:
            peak[name] = max(peak[name], ctl.num_used_blocks(name))
    # swa: 64-token blocks, 128-token window: 3 blocks; compressed: ceil(300 / 256) = 2;
    # c4_state: 4-token blocks, 8-token window: 3; c128_state: 8-token blocks, 128 tokens: 17
    assert peak == {"swa": 3, "compressed": 2, "c4_state": 3, "c128_state": 17}
    assert {name: g.max_live_blocks(300) for name, g in groups.items()} == peak
    ctl.free()


def test_config_rejects_bad_ranges():
    with pytest.raises(ValidationError, match=r"prompt_len must be an inclusive range"):
        DemoConfig(prompt_len=(0, 10))
    with pytest.raises(ValidationError, match=r"output_len .* got \(9, 8\)"):
        DemoConfig(output_len=(9, 8))
    with pytest.raises(ValidationError):
        DemoConfig(requests=0)


# ---------------------------------------------------------------------------------- CLI


def test_cli_default_model_exit_0_last_line_and_json(capsys, tmp_path):
    out_json = tmp_path / "demo.json"
    args = ["demo", "--device", "cpu", "--requests", "2", "--seed", "3", "--no-progress"]
    code = main([*args, "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    assert "deepseek-v4-tiny" in out
    match = LAST_LINE.match(last_line(out))
    assert match and int(match.group(1)) > 0 and match.group(2) == "0"
    data = json.loads(out_json.read_text())
    assert data["model"] == "deepseek-v4-tiny" and data["requests_finished"] == 2
    assert data["entries_verified"] == int(match.group(1)) and data["entries_mismatched"] == 0
    assert data["ok"] is True


def test_cli_self_test_corruption_exits_1(capsys):
    args = "demo --device cpu --backend gqa --layers 2 --requests 4 --no-progress"
    args += " --self-test-corrupt 3"
    code = main(args.split())
    out = capsys.readouterr().out
    assert code == 1
    match = LAST_LINE.match(last_line(out))
    assert match and int(match.group(2)) > 0


def test_self_test_past_the_run_is_refused_and_its_last_step_works(capsys, tmp_path):
    small = {**SMALL, "requests": 2, "prefix_conversations": 0}
    with pytest.raises(SelfTestOutOfRange) as info:
        run_demo(DemoConfig(**small, corrupt_after_step=100_000), progress=False)
    err = info.value
    assert str(err).startswith(
        f"corrupt_after_step=100000 is past the run: it ran {err.steps} steps"
    )
    assert 0 < err.last_live <= err.steps
    assert str(err).endswith(f"give a step from 1 to {err.last_live}")
    # the last step the message offers is one the self-test can use: the run then fails
    r = run_demo(DemoConfig(**small, corrupt_after_step=err.last_live), progress=False)
    assert r.corrupted and not r.ok


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (
            ["--self-test-corrupt", "100000"],
            2,
            "kvforge demo: error: --self-test-corrupt 100000 is past the run: it ran ",
        ),
        (
            ["--self-test-corrupt", "0"],
            2,
            "kvforge demo: error: argument --self-test-corrupt: '0' must be a positive integer",
        ),
        (
            ["--self-test-corrupt", "-3"],
            2,
            "argument --self-test-corrupt: '-3' must be a positive integer",
        ),
        (
            ["--self-test-corrupt", "2.5"],
            2,
            "argument --self-test-corrupt: '2.5' is not an integer",
        ),
        (
            ["--dtype", "int64", "--backend", "gqa", "--layers", "2"],
            2,
            "kvforge demo: error: argument --dtype: 'int64' is not a cache dtype",
        ),
    ],
)
def test_cli_self_test_and_dtype_out_of_range_exit_2(capsys, tmp_path, argv, code, message):
    path = tmp_path / "demo.json"
    base = [
        "demo",
        "--device",
        "cpu",
        "--requests",
        "2",
        "--no-progress",
        "--prefix-conversations",
        "0",
    ]
    assert main([*base, "--json", str(path), *argv]) == code
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
    assert captured.out == "" and not path.exists()  # no summary, no result file


def test_config_refuses_a_self_test_after_max_steps():
    with pytest.raises(ValidationError, match=r"corrupt_after_step=9 is after max_steps=8"):
        DemoConfig(max_steps=8, corrupt_after_step=9)


def test_cli_bad_unit_exits_2_with_one_line(capsys):
    assert main(["demo", "--device-memory", "12XB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unknown unit 'XB'" in err


def test_cli_unwritable_json_path_exits_2_before_running(capsys, tmp_path):
    path = tmp_path / "missing" / "demo.json"
    assert main(["demo", "--device", "cpu", "--json", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().startswith("kvforge demo: error: cannot write --json")
    assert captured.out == ""


def test_cli_device_memory_too_small_exits_2_with_one_line(capsys):
    assert main(["demo", "--device", "cpu", "--device-memory", "1MiB", "--no-progress"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("kvforge demo: error: device memory 1.00 MiB cannot hold even one")
    assert "raise --device-memory to at least" in err
    assert "verified" not in captured.out


def test_cli_unknown_device_exits_2(capsys):
    assert main(["demo", "--device", "tpu"]) == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)
def test_cuda_run_matches_cpu_run(small_result):
    r = run_demo(DemoConfig(**{**SMALL, "device": "cuda"}), progress=False)
    assert r.device.startswith("cuda") and r.ok and r.preemptions > 0
    # same seed, same schedule and the same bytes checked, whichever device holds the caches
    assert {**r.counts(), "device": "cpu"} == small_result.counts()


def test_prefix_phase_reuses_and_verifies_every_byte(small_result):
    p = small_result.prefix
    assert p is not None and p.conversations == 4 and p.turns >= 8
    # the shared system prompt is 1.5 boundaries long, so every turn after the first one
    # of the run reuses at least one 256-token boundary
    assert p.boundary == 256 and p.hit_tokens >= (p.turns - 1) * 256
    assert p.hit_tokens % 256 == 0 and p.hit_tokens < p.prompt_tokens
    assert p.entries_verified > 0 and p.entries_mismatched == 0
    assert small_result.entries_verified >= p.entries_verified


@pytest.mark.slow
def test_prefix_phase_is_repeatable_and_can_be_skipped():
    from kvforge.cli.demo_prefix import run_prefix_demo

    backends = from_hf_config(load_model_config("deepseek-v4-tiny"))
    a = run_prefix_demo(backends, conversations=2, seed=5)
    assert a == run_prefix_demo(backends, conversations=2, seed=5)
    skipped = run_demo(DemoConfig(**{**SMALL, "prefix_conversations": 0}), progress=False)
    assert skipped.prefix is None


def test_cli_prefix_conversations(capsys):
    assert (
        main(
            [
                "demo",
                "--device",
                "cpu",
                "--no-progress",
                "--requests",
                "3",
                "--prefix-conversations",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "prefix reuse" in out and LAST_LINE.match(last_line(out))
    assert main(["demo", "--prefix-conversations", "-1"]) == 2
    assert "'-1' must be a non-negative integer" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["deepseek-v4-tiny", "gpt-oss-20b"])
@pytest.mark.slow
def test_cli_tier_host_serves_hits_from_host_pages_byte_for_byte(capsys, tmp_path, model):
    import json

    path = tmp_path / "demo.json"
    argv = ["demo", "--model", model, "--device", "cpu", "--no-progress", "--requests", "2"]
    assert main([*argv, "--tier", "host", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "of them from host tier pages" in out and LAST_LINE.match(last_line(out))
    prefix = json.loads(path.read_text())["prefix"]
    assert prefix["tier"] == "host" and prefix["entries_mismatched"] == 0
    # conversations evicted each other's prefixes into host pages, and later turns were
    # served from them, every reused entry verified
    assert prefix["host_demotions"] > 0 and prefix["host_blocks"] > 0
    assert 0 < prefix["host_hit_tokens"] <= prefix["hit_tokens"]


def test_run_prefix_demo_refuses_an_unknown_tier():
    from kvforge.cli.demo_prefix import run_prefix_demo
    from kvforge.models import from_hf_config

    with pytest.raises(ValueError, match=r"tier must be one of \['device', 'host', 'redis', "):
        run_prefix_demo(from_hf_config("llama-3-8b"), 1, 0, tier="disk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tier 'redis' needs the store's address"):
        run_prefix_demo(from_hf_config("llama-3-8b"), 1, 0, tier="redis")
