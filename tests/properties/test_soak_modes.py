"""The soak's two further modes at CI size: ``--async-steps`` (one step always in flight, an
asynchronous engine's order) and ``--threads N`` (N threads on one controller).

Async mode: ``schedule(N + 1)`` comes before ``end_step(N)``; a truncation or swap out of a
request in the open step must be refused with the scheduler's exact ``RequestStateError`` and
change nothing; every check of the synchronous soak still holds after every operation, also
with prefix caching (the open step's references to the blocks it completed are the only ones
the model allows beyond its own) and shared pools. Threaded mode: each thread verifies every
byte of its own requests after every operation. A failure names the seed (and the thread),
so it replays with ``python benchmarks/soak.py --ops N --seed S --async-steps`` or
``--threads 2``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import soak
import soak_threads
import torch

from kvforge.errors import RequestStateError
from kvforge.verify import read_entries, write_entries


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The soak's tensors are small: one intra-op thread keeps these runs several times
    faster on a busy 2-core machine (the CLI does the same)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ASYNC_MODES = [
    ("plain", {}),
    ("prefix", {"prefix": True}),
    ("prefix_shared_pools", {"prefix": True, "share_pools": True}),
]


@pytest.mark.soak
@pytest.mark.parametrize("seed", [3, 11])
@pytest.mark.parametrize(("mode", "flags"), ASYNC_MODES, ids=[m[0] for m in ASYNC_MODES])
def test_async_soak(mode: str, flags: dict, seed: int) -> None:
    report = soak.run_soak(200, seed, async_steps=True, **flags)
    assert sum(report.ops[name] for name, _, _ in soak.OPERATIONS) == 200
    # one step was in flight: most steps ended after the next one was scheduled
    assert report.steps_ended_late > 0
    # truncations and swap outs of a request in the open step were tried and refused
    assert sum(report.in_flight_refused.values()) > 0, report.in_flight_refused
    assert report.entries_verified > 0 and report.bytes_verified > 0
    assert sum(report.bad_calls.values()) > 0
    if flags.get("prefix"):
        assert report.ops["prefix_admit"] > 0
    # the end: nothing open, no device block and no host page in use
    assert report.final_open_steps == []
    assert report.final_used_blocks and not any(report.final_used_blocks.values())
    assert report.final_host_pages and not any(report.final_host_pages.values())


def test_async_soak_refuses_both_verbs_and_frees_in_flight() -> None:
    reports = [soak.run_soak(200, s, async_steps=True) for s in (3, 11)]
    refused = sum((r.in_flight_refused for r in reports), start=Counter())
    assert refused["truncated"] > 0 and refused["swapped out"] > 0, refused
    assert sum(r.freed_in_flight for r in reports) > 0
    assert sum(r.steps_ended_early for r in reports) > 0


def _one_request_in_flight(prefix: bool = False) -> soak.Soak:
    """An async soak with request ``x`` in its open step (300 tokens with prefix caching,
    past the 256-token boundary, so the step completes blocks it registers; 200 without,
    what the small pools hold in one step), its bytes written."""
    run = soak.Soak(5, prefix=prefix, async_steps=True)
    n = 300 if prefix else 200
    tokens = list(range(n)) if prefix else None
    step = run.ctl.schedule(["x"], [n], new_token_ids=None if tokens is None else [tokens])
    assert step.allocation.request_ids == ("x",)
    run.model.apply_step("x", n, 11)
    run.model.resident["x"].tokens = tokens
    run.write("x", 0, n)
    run.advance(step, {"x": (0, n)})
    assert run.ctl.scheduler.open_steps == [step.allocation.step_id]
    run.check()
    return run


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "prefix"])
def test_truncate_and_swap_out_in_flight_are_refused_exactly(prefix: bool) -> None:
    run = _one_request_in_flight(prefix)
    n = run.open_step.allocation.step_id
    last = run.ctl.num_tokens("x")
    for verb, call in [
        ("truncated", lambda: run.ctl.truncate("x", last - 1)),
        ("swapped out", lambda: run.ctl.swap_out_many(["x"])),
    ]:
        message = (
            f"request 'x' is in step {n}, which has not ended; end_step({n}) before it is {verb}"
        )
        assert run.in_flight_message("x", verb) == message
        run.expect_refused(call, RequestStateError, message)
    run.check()
    run.verify("x")
    run.end_open_step()
    run.ctl.truncate("x", last - 1)  # once the step ended, both go through
    run.ctl.swap_out_many(["x"])


def test_a_request_freed_in_flight_leaves_its_step_to_end() -> None:
    run = _one_request_in_flight(prefix=True)
    run.ctl.free_requests(["x"])
    run.model.resident.pop("x")
    run.check()  # the open step's references to the blocks it completed are allowed
    pinned = sum(run.ctl.num_used_blocks(g) for g in run.ctl.groups)
    assert pinned > 0  # held by the step until it ends
    run.end_open_step()
    run.check()
    assert sum(run.ctl.num_used_blocks(g) for g in run.ctl.groups) == 0


def test_async_soak_detects_a_lost_byte() -> None:
    """The verification is live in async mode: one byte flipped in an entry the open step
    wrote fails the next verify."""
    run = _one_request_in_flight()
    run.verify("x")
    slot = int(run.ctl.slot_mapping("x", "gqa_swa", [199])[0])
    entry = run.ctl.layout.entry("key", 3)
    cache = run.ctl.kv_caches[entry.index]
    slots = torch.tensor([slot])
    write_entries(cache, entry, slots, read_entries(cache, entry, slots) ^ 1)
    with pytest.raises(AssertionError, match="entries differ"):
        run.verify("x")


@pytest.mark.soak
@pytest.mark.parametrize("seed", [0, 1])
def test_two_threads(seed: int) -> None:
    report = soak_threads.run_threads(240, seed, 2)
    assert report.ops == 240 and [t.ops.total() for t in report.threads] == [120, 120]
    assert report.total("mismatches") == 0
    assert report.total("entries_verified") > 0 and report.total("bytes_verified") > 0
    assert report.total("prefix_hits") > 0  # prompts share heads across threads
    assert report.total("steps_ended_late") > 0
    assert report.total("in_flight_refused") > 0
    assert report.final_open_steps == []
    assert report.final_used_blocks and not any(report.final_used_blocks.values())
    assert report.final_host_pages and not any(report.final_host_pages.values())


def test_a_thread_detects_a_lost_byte() -> None:
    ctl = soak_threads.make_threads_controller(2)
    worker = soak_threads.Worker(ctl, 0, 3, 0)
    for _ in range(5):
        worker.op_admit()
        if worker.tokens:
            break
    worker.check()
    [rid] = worker.tokens
    entry = ctl.layout.entry("key", 3)
    slot = int(ctl.slot_mapping(rid, "gqa_swa", [len(worker.tokens[rid]) - 1])[0])
    cache = ctl.kv_caches[entry.index]
    slots = torch.tensor([slot])
    write_entries(cache, entry, slots, read_entries(cache, entry, slots) ^ 1)
    with pytest.raises(AssertionError, match="entries differ"):
        worker.check()
    assert worker.report.mismatches == 1


def test_a_match_gone_stale_between_lookup_and_step_is_tolerated(monkeypatch) -> None:
    """Another thread may evict a matched block between a thread's lookup and its step (the
    two are separate calls): the step refuses the match as stale, which the thread takes as
    an answer (an engine looks the prompt up again)."""
    ctl = soak_threads.make_threads_controller(2)
    head = soak_threads.HEADS[0][:300]
    step = ctl.schedule(["other"], [300], new_token_ids=[head])
    ctl.end_step(step)
    ctl.free_request("other")  # its blocks stay cached
    worker = soak_threads.Worker(ctl, 1, 0, 0)
    lookup = ctl.lookup

    def lookup_then_evict(queries):
        matches = lookup(queries)
        assert matches[0].num_tokens == 256
        ctl.scheduler.reset_prefix_cache()  # what another thread's step may cause
        return matches

    monkeypatch.setattr(ctl, "lookup", lookup_then_evict)
    monkeypatch.setattr(worker, "new_prompt", lambda: [*head[:256], 1, 2, 3])
    worker.op_admit()
    assert worker.report.tolerated == Counter({"step stale_prefix": 1})
    assert not worker.tokens and worker.report.prefix_hits == 0


def test_a_failing_thread_stops_the_run_and_is_named(monkeypatch) -> None:
    check = soak_threads.Worker.check

    def failing(self) -> None:
        check(self)
        if self.index == 1 and self.report.ops.total() == 5:
            raise AssertionError("planted")

    monkeypatch.setattr(soak_threads.Worker, "check", failing)
    with pytest.raises(AssertionError, match=r"thread 1, operation 5 \(\w+\): planted"):
        soak_threads.run_threads(4_000, 0, 2)


BAD_FLAGS = [
    ("threads_one", ["--threads", "1"], "argument --threads: must be an int from 2 to 8"),
    ("threads_zero", ["--threads", "0"], "got '0'"),
    ("threads_negative", ["--threads", "-2"], "argument --threads: must be an int"),
    ("threads_word", ["--threads", "x"], "argument --threads: must be an int from 2 to 8, got 'x'"),
    ("threads_float", ["--threads", "2.5"], "got '2.5'"),
    ("threads_too_many", ["--threads", "9"], "got '9' (each thread keeps up to two steps"),
    ("threads_async", ["--threads", "2", "--async-steps"], "--async-steps does not combine"),
    ("threads_few_ops", ["--threads", "4", "--ops", "3"], "--ops must be >= --threads (4), got 3"),
    ("ops_zero", ["--async-steps", "--ops", "0"], "--ops must be >= 1, got 0"),
    ("ops_word", ["--ops", "many"], "argument --ops: invalid int value: 'many'"),
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


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--ops", "30", "--seed", "2", "--async-steps"], ["steps ended one step late"]),
        (["--ops", "20", "--seed", "2", "--threads", "2"], ["thread 1", "mismatches: 0"]),
    ],
    ids=["async_steps", "threads"],
)
def test_cli_runs_the_modes(argv, fragments, capsys) -> None:
    assert soak.main(argv) == 0
    out = capsys.readouterr().out
    assert all(f in out for f in fragments), out


def test_two_threads_on_a_slab_arena() -> None:
    report = soak_threads.run_threads(240, 5, 2, arena=True)
    assert report.ops == 240
    assert report.total("prefix_hits") > 0
    assert not any(report.final_used_blocks.values())


def test_two_threads_on_an_arena_that_moves_cached_blocks(monkeypatch) -> None:
    """Every step's takes move cached blocks (as they do once slabs run short): every byte of
    every request, prefix hits on moved blocks included, reads back as written."""
    arenas = []
    build = soak_threads.make_threads_controller

    def packing(*args, **kwargs):
        ctl = build(*args, **kwargs)
        arena = ctl._manager.arena
        arena.pack_below = arena.geometry.num_slabs + 1
        arenas.append(arena)
        return ctl

    monkeypatch.setattr(soak_threads, "make_threads_controller", packing)
    report = soak_threads.run_threads(240, 5, 2, arena=True)
    assert report.ops == 240 and report.total("mismatches") == 0
    assert report.total("prefix_hits") > 0 and report.total("entries_verified") > 0
    assert arenas[0].moved_blocks > 0
    assert not any(report.final_used_blocks.values())


def test_arena_needs_threads() -> None:
    with pytest.raises(SystemExit):
        soak.parse_args(["--arena"])
