"""`kvforge bench --tiers`: records and their fields, bytes equal to the unpadded page sums,
restored bytes equal to the source, servers started (and stopped) by the command, missing
servers skipped with a note, and bad input refused as one line. Timings are never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from _optional import mooncake_missing, redis_missing

from kvforge.cli import bench, bench_tiers, remotes
from kvforge.cli.bench_tiers import TierCase, run_tiers
from kvforge.cli.main import main
from kvforge.controller import CacheController
from kvforge.models import from_hf_config

FIELDS = {
    "tier",
    "direction",
    "bytes",
    "gbps",
    "client_gbps",
    "ratio",
    "model",
    "blocks",
    "seconds",
}
# client, system library (Mooncake's libibverbs) and server binary (tests/_optional.py)
HAVE_REDIS = redis_missing() is None
HAVE_MOONCAKE = mooncake_missing() is None


def tiny_cases() -> list[TierCase]:
    llama = from_hf_config("llama-3-8b")
    return [
        TierCase("llama-2-layers", {i: llama[i] for i in range(2)}, target_bytes=1 << 20),
        TierCase("deepseek-v4-tiny", from_hf_config("deepseek-v4-tiny"), tokens=1024),
    ]


def page_bytes(case: TierCase) -> dict[str, int]:
    layout = CacheController(case.backends, share_pools=False).layout
    return {g.name: layout.host_page_bytes(g.name) for g in layout.groups}


def check_records(records: list[dict], remotes: tuple[str, ...]) -> None:
    llama, tiny = tiny_cases()
    expected = {("host", "put"), ("host", "get"), ("host", "restore")}
    expected |= {(r, d) for r in remotes for d in ("put", "get", "restore")}
    assert {(r["tier"], r["direction"]) for r in records} == expected
    kv = page_bytes(llama)["kv"]
    for r in records:
        assert set(r) >= FIELDS
        assert r["gbps"] > 0 and r["client_gbps"] > 0 and r["ratio"] > 0
        if r["direction"] == "restore":
            # V4-tiny at 1,024 tokens: the 4 blocks of the full group and the 2-block tail of
            # the 128-token window (64-token blocks); compressor state is recomputed, not moved
            pages = page_bytes(tiny)
            assert r["groups"] == {"compressed": 4, "swa": 2}
            assert r["bytes"] == 4 * pages["compressed"] + 2 * pages["swa"]
            assert r["bytes_per_token"] == r["page_bytes_per_token"] == r["bytes"] / 1024
            assert r["device_bytes_per_token"] >= r["page_bytes_per_token"]
            assert r["identical"] is True
        else:
            assert r["bytes"] == r["blocks"] * kv == (1 << 20) // kv * kv
        if r["tier"] != "host" and r["direction"] != "restore":
            assert r["checksum_gbps"] > 0 and r["checksum"] == "xxh3-128"
        if r["tier"] != "host" and r["direction"] == "put":  # the remote tier's publish too
            assert r["async_seconds"] > 0
            low, median, high = r["async_ratio_spread"]
            assert 0 < low <= median == r["async_ratio"] <= high
        # every ratio comes with its spread over the runs: never one sample
        low, median, high = r["ratio_spread"]
        assert 0 < low <= median == r["ratio"] <= high
        assert len(r["seconds_spread"]) == 3 and r["seconds_spread"][0] == round(r["seconds"], 6)


def test_run_tiers_host_only_records_and_restored_bytes():
    records = run_tiers(tiny_cases(), remotes=(), repeats=3, progress=False, device="cpu")
    check_records(records, ())


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py is not installed")
def test_run_tiers_starts_redis_and_stops_it(monkeypatch):
    from kvforge.store import servers

    started = []

    class Spy(servers.RedisServer):
        def start(self, timeout: float = 20.0):
            started.append(self)
            return super().start(timeout)

    monkeypatch.setattr(servers, "RedisServer", Spy)
    records = run_tiers(tiny_cases(), ("redis",), repeats=3, progress=False)
    check_records(records, ("redis",))
    [server] = started
    assert server.host == "127.0.0.1" and server.proc.poll() is not None  # stopped, reaped


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py is not installed")
def test_run_tiers_on_a_given_redis_server(tmp_path):
    from kvforge.store.servers import RedisServer, free_port, private_net

    with private_net() as why:
        server = RedisServer(6379 if not why else free_port(), tmp_path / "redis.log").start()
        try:
            notes: list[str] = []
            records = run_tiers(
                tiny_cases(), ("redis",), {"redis": server.address}, 3, progress=False, notes=notes
            )
        finally:
            server.stop()
    check_records(records, ("redis",))
    assert notes == []


def test_without_a_private_namespace_servers_run_on_loopback_with_a_note(monkeypatch):
    real_which = remotes.shutil.which
    monkeypatch.setattr(remotes.shutil, "which", lambda n: None if n == "ip" else real_which(n))
    notes: list[str] = []
    records = run_tiers(tiny_cases()[:1], ("redis",), repeats=3, progress=False, notes=notes)
    if HAVE_REDIS:
        assert {r["tier"] for r in records} == {"host", "redis"}
        assert notes == [
            "servers run on the host's 127.0.0.1, not a private namespace: iproute2 is not installed"
        ]
    else:  # pragma: no cover - CI installs redis
        assert notes[0].startswith("redis: skipped")


@pytest.mark.parametrize(
    ("absent", "note"),
    [
        (
            "redis-server",
            "redis: skipped, redis-server is not installed (see docs/tiered_store.md)",
        ),
        ("mooncake_master", "mooncake: skipped, mooncake_master is not installed"),
    ],
)
def test_a_missing_server_binary_skips_its_records_with_a_note(monkeypatch, absent, note):
    real_which = remotes.shutil.which
    monkeypatch.setattr(remotes.shutil, "which", lambda n: None if n == absent else real_which(n))
    monkeypatch.setattr(remotes.importlib.util, "find_spec", lambda name: object())
    notes: list[str] = []
    remote = "redis" if absent == "redis-server" else "mooncake"
    records = run_tiers(tiny_cases()[:1], (remote,), repeats=3, progress=False, notes=notes)
    assert {r["tier"] for r in records} == {"host"}
    assert notes[0].startswith(note)


def test_a_missing_client_is_named(monkeypatch):
    monkeypatch.setattr(remotes.importlib.util, "find_spec", lambda name: None)
    assert bench_tiers.missing("mooncake") == (
        "the mooncake client is not installed (pip install 'kvforge[mooncake]')"
    )


def test_identical_sees_one_changed_byte():
    model = bench_tiers._build(tiny_cases()[1], bench_tiers.get_platform("cpu"))
    model.tier.move(offloads=model.copies(model.src, True))  # each move numbered in turn
    model.tier.move(onloads=model.copies(model.dst, False))
    assert model.identical()
    plane = model.ctl.storage.planes("swa")[0]
    plane[int(model.dst["swa"][0]), 0] ^= 1
    assert not model.identical()
    model.ctl.free()


def test_cli_writes_json_and_prints_the_table(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_tiers, "default_cases", lambda quick: tiny_cases())
    path = tmp_path / "tiers.json"
    argv = ["bench", "--tiers", "--quick", "--repeats", "3", "--no-progress", "--json", path]
    remote = "redis" if HAVE_REDIS else "none"
    code = main([str(a) for a in [*argv, "--remote", remote]])
    out, _ = capsys.readouterr()
    assert code == 0
    report = json.loads(path.read_text())
    check_records(report["records"], ("redis",) if HAVE_REDIS else ())
    assert "kvforge tiers" in out and "restore from host" in out


@pytest.mark.skipif(not HAVE_MOONCAKE, reason=str(mooncake_missing()))
def test_cli_measures_mooncake_in_a_process_of_its_own(tmp_path):
    # Mooncake's client keeps process-wide state in the network namespace of the first client
    # (docs/tiered_store.md): a fresh process, so that no other test's namespace is in the way
    path = tmp_path / "tiers.json"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]
        from kvforge.cli import bench_tiers
        from kvforge.cli.main import main
        from test_bench_tiers import tiny_cases
        bench_tiers.default_cases = lambda quick: tiny_cases()
        sys.exit(main(["bench", "--tiers", "--quick", "--repeats", "3", "--no-progress",
                       "--remote", "mooncake", "--json", {str(path)!r}]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(path.read_text())
    check_records(report["records"], ("mooncake",))


# (argv, message): refused before anything runs, under demo's rules and messages
BAD_INPUT = [
    (["--tiers", "--step"], "--tiers does not take --step"),
    (["--tiers", "--prefix"], "--tiers does not take --prefix"),
    (["--tiers", "--warm-cache", "--step"], "--tiers does not take --step, --warm-cache"),
    (["--redis", "127.0.0.1:6379"], "--redis only applies with --tiers"),
    (["--remote", "redis", "--mooncake-master", "h:1"], "--mooncake-master, --remote only applies"),
    (["--tiers", "--redis", "localhost"], "--redis must be HOST:PORT with a port in 1..65535, got 'localhost'"),
    (["--tiers", "--mooncake-master", "h:70000"], "--mooncake-master must be HOST:PORT"),
    (["--tiers", "--redis", ":6379"], "--redis must be HOST:PORT"),
    (["--tiers", "--redis", "h:\u0661\u0662"], "--redis must be HOST:PORT with a port in 1..65535, got 'h:\u0661\u0662'"),
    (["--tiers", "--redis", "h:" + "9" * 5000], "got 'h:999"),
    (["--tiers", "--remote", "x" * 5000], "... (5,000 characters): "),
    (["--tiers", "--remote", "memcached"], "--remote takes a comma list of redis, mooncake or none, got 'memcached': 'memcached' is not one of them"),
    (["--tiers", "--remote", "Redis"], "got 'Redis': 'Redis' is not one of them"),
    (["--tiers", "--remote", " redis"], "got ' redis': ' redis' is not one of them"),
    # empty items, duplicates, none beside another name
    (["--tiers", "--remote", ","], "got ',': item 1 is empty"),
    (["--tiers", "--remote", ""], "got '': item 1 is empty"),
    (["--tiers", "--remote", "redis,"], "got 'redis,': item 2 is empty"),
    (["--tiers", "--remote", "redis,,redis"], "got 'redis,,redis': item 2 is empty"),
    (["--tiers", "--remote", "redis,redis"], "got 'redis,redis': 'redis' is named twice"),
    (["--tiers", "--remote", "none,none"], "'none' is named twice"),
    (["--tiers", "--remote", "none,redis"], "got 'none,redis': none means no remote tier and stands alone"),
    (["--tiers", "--remote", "mooncake,none"], "none means no remote tier and stands alone"),
    # an address or an option for a tier --remote leaves out: demo's "--redis applies with --tier redis"
    (["--tiers", "--remote", "mooncake", "--redis", "h:1"], "--redis applies with --remote redis, not --remote mooncake"),
    (["--tiers", "--remote", "none", "--mooncake-master", "h:1"], "--mooncake-master applies with --remote mooncake, not --remote none"),
    (["--tiers", "--remote", "redis", "--mooncake-segment", "here"], "--mooncake-segment applies with --remote mooncake, not --remote redis"),
    (["--tiers", "--remote", "none", "--mooncake-segment", "remote"], "--mooncake-segment applies with --remote mooncake, not --remote none"),
    (["--tiers", "--json", "/"], "cannot write --json '/'"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), BAD_INPUT)
def test_bad_input_is_one_line_exit_2_before_any_work(capsys, monkeypatch, argv, message):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the command ran before refusing its input")

    monkeypatch.setattr(bench_tiers, "run_tiers", must_not_run)
    monkeypatch.setattr(bench, "run_bench", must_not_run)
    monkeypatch.setattr(bench, "check_available", must_not_run)
    code = main(["bench", *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert message in err and err.startswith("kvforge bench: error: ")
    assert len(err.strip().splitlines()) == 1 and len(err) < 800


def _patch(monkeypatch, patch: str | None) -> None:
    if patch == "no-binary":
        real_which = remotes.shutil.which
        absent = {"redis-server", "mooncake_master"}
        monkeypatch.setattr(
            remotes.shutil, "which", lambda n: None if n in absent else real_which(n)
        )
        # the clients installed, whatever this machine has: the check under test is the binary's
        monkeypatch.setattr(remotes.importlib.util, "find_spec", lambda name: object())
    elif patch == "no-client":
        monkeypatch.setattr(remotes.importlib.util, "find_spec", lambda name: None)
    elif patch == "client":  # a client that is installed, whatever this machine has
        monkeypatch.setattr(remotes.importlib.util, "find_spec", lambda name: object())


def _closed_port() -> str:
    from kvforge.store.servers import free_port

    return f"127.0.0.1:{free_port()}"  # nothing listens there


# (argv, patch, message after "kvforge bench: error: "): a tier asked for that cannot run here
UNAVAILABLE = [
    (["--remote", "redis"], "no-binary", "--remote redis: redis-server is not installed (see docs/tiered_store.md)"),
    (["--remote", "mooncake"], "no-binary", "--remote mooncake: mooncake_master is not installed"),
    (["--remote", "redis,mooncake"], "no-binary", "--remote redis: redis-server is not installed"),
    (["--remote", "redis"], "no-client", "--remote redis: the redis client is not installed (pip install 'kvforge[redis]')"),
    (["--remote", "mooncake"], "no-client", "--remote mooncake: the mooncake client is not installed (pip install 'kvforge[mooncake]')"),
    (["--remote", "redis", "--redis", "127.0.0.1:1"], "no-client", "--remote redis: the redis client is not installed"),
    (["--remote", "redis", "--redis", "{closed}"], "client", "--remote redis: nothing accepts a connection at {closed} (waited 3 s)"),
    (["--remote", "mooncake", "--mooncake-master", "{closed}"], "client", "--remote mooncake: nothing accepts a connection at {closed}"),
    # no --remote: the tier given an address is asked for
    (["--redis", "{closed}"], "client", "--redis {closed}: nothing accepts a connection at {closed}"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "patch", "message"), UNAVAILABLE)
def test_a_tier_asked_for_that_cannot_run_is_one_line_exit_2(
    capsys, monkeypatch, tmp_path, argv, patch, message
):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the command ran before refusing its input")

    monkeypatch.setattr(bench_tiers, "run_tiers", must_not_run)
    _patch(monkeypatch, patch)
    closed = _closed_port()
    path = tmp_path / "tiers.json"
    argv = [a.format(closed=closed) for a in argv]
    code = main(["bench", "--tiers", "--no-progress", "--json", str(path), *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith(f"kvforge bench: error: {message.format(closed=closed)}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not path.exists()


@pytest.mark.parametrize(
    ("tier", "patch", "address"),
    [("redis", "no-binary", None), ("mooncake", "no-client", None), ("redis", "client", "closed")],
)
@pytest.mark.slow
def test_demo_and_bench_refuse_a_tier_with_the_same_words(
    capsys, monkeypatch, tier, patch, address
):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the command ran before refusing its input")

    from kvforge.cli import demo

    monkeypatch.setattr(bench_tiers, "run_tiers", must_not_run)
    monkeypatch.setattr(demo, "_run", must_not_run)
    _patch(monkeypatch, patch)
    extra = [] if address is None else [remotes.ADDRESS_FLAGS[tier], _closed_port()]
    code = main(["demo", "--no-progress", "--tier", tier, *extra])
    said_demo = capsys.readouterr().err
    code_bench = main(["bench", "--tiers", "--no-progress", "--remote", tier, *extra])
    said_bench = capsys.readouterr().err
    assert code == code_bench == 2
    why_demo = said_demo.removeprefix(f"kvforge demo: error: --tier {tier}: ")
    why_bench = said_bench.removeprefix(f"kvforge bench: error: --remote {tier}: ")
    assert why_demo == why_bench and why_demo != said_demo and why_bench != said_bench


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py is not installed")
def test_a_tier_asked_for_whose_server_does_not_start_is_exit_2_and_measures_nothing(
    capsys, monkeypatch, tmp_path
):
    from kvforge.store import servers

    started: list[servers.LoopbackServer] = []

    def refuse(self, *args, **kwargs):
        started.append(self)
        raise RuntimeError("refused on purpose")

    def must_not_measure(*args, **kwargs):
        raise AssertionError("a case was measured")

    monkeypatch.setattr(servers.LoopbackServer, "start", refuse)
    monkeypatch.setattr(bench_tiers, "_measure", must_not_measure)
    path = tmp_path / "tiers.json"
    argv = ["bench", "--tiers", "--quick", "--no-progress", "--remote", "redis", "--json", path]
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == (
        "kvforge bench: error: --remote redis: redis: its server did not start: refused on purpose\n"
    )
    assert not path.exists()
    assert started and all(s.proc is None or s.proc.poll() is not None for s in started)


def test_without_remote_the_tiers_that_cannot_run_are_notes(capsys, monkeypatch, tmp_path):
    # the default asks for no tier by name: it measures what can run, and says what did not
    monkeypatch.setattr(bench_tiers, "default_cases", lambda quick: tiny_cases()[:1])
    _patch(monkeypatch, "no-binary")
    path = tmp_path / "tiers.json"
    argv = ["bench", "--tiers", "--quick", "--repeats", "3", "--no-progress", "--json", path]
    assert main([str(a) for a in argv]) == 0
    report = json.loads(path.read_text())
    assert {r["tier"] for r in report["records"]} == {"host"}
    assert [n.split(",")[0] for n in report["notes"]] == ["redis: skipped", "mooncake: skipped"]


def test_run_tiers_refuses_a_required_tier_it_is_not_given():
    with pytest.raises(
        ValueError, match=r"required must name remotes of \['redis'\], got \['mooncake'\]"
    ):
        run_tiers(tiny_cases()[:1], ("redis",), required=("mooncake",), progress=False)


@pytest.mark.parametrize(
    ("text", "remotes_named"),
    [("redis", ("redis",)), ("mooncake,redis", ("mooncake", "redis")), ("none", ())],
)
def test_parse_remotes_keeps_the_order_given(text, remotes_named):
    assert remotes.parse_remotes(text) == remotes_named


def test_default_cases_are_the_issues_shapes():
    full, quick = bench_tiers.default_cases(False), bench_tiers.default_cases(True)
    assert [(c.name, c.target_bytes, c.tokens) for c in full] == [
        ("llama-3-8b", 64 << 20, 0),
        ("deepseek-v4-flash", 64 << 20, 0),
        ("deepseek-v4-flash", 0, 16384),
    ]
    assert [(c.name, c.target_bytes, c.tokens) for c in quick] == [
        ("llama-3-8b", 16 << 20, 0),
        ("deepseek-v4-flash", 0, 4096),
    ]
    assert len(full[2].backends) == 43


def test_progress_bar_run(capsys):
    records = run_tiers(tiny_cases()[:1], remotes=(), repeats=3, progress=True)
    assert {(r["tier"], r["direction"]) for r in records} == {("host", "put"), ("host", "get")}


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py is not installed")
def test_a_server_that_does_not_start_is_a_note(monkeypatch):
    from kvforge.store import servers

    def refuse(self, timeout=20.0):
        raise RuntimeError("did not listen")

    monkeypatch.setattr(servers.RedisServer, "start", refuse)
    notes: list[str] = []
    records = run_tiers(tiny_cases()[:1], ("redis",), repeats=3, progress=False, notes=notes)
    assert {r["tier"] for r in records} == {"host"}
    assert notes == ["redis: skipped, its server did not start: did not listen"]


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py is not installed")
def test_a_given_server_that_does_not_answer_is_a_note(monkeypatch):
    from kvforge.store.servers import free_port

    monkeypatch.setattr(bench_tiers, "READY_TIMEOUT_S", 0.5)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    notes: list[str] = []
    records = run_tiers(
        tiny_cases()[:1], ("redis",), {"redis": address}, 3, progress=False, notes=notes
    )
    assert {r["tier"] for r in records} == {"host"}
    assert notes[0].startswith(f"redis: skipped, redis at {address} did not answer")


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py is not installed")
@pytest.mark.parametrize(
    ("call", "reply", "note"),
    [
        ("batch_put", lambda keys, sources: [False] * len(keys), "redis: a put was refused"),
        ("batch_get_into", lambda keys, dests: [None] * len(keys), "redis: a get missed"),
        ("put_async", lambda keys, sources: len(keys) - 1, "redis: put_async dropped"),
    ],
)
def test_a_refused_put_or_a_miss_is_a_note_not_a_traceback(monkeypatch, call, reply, note):
    from kvforge.store.redis_store import RedisStore

    monkeypatch.setattr(RedisStore, call, lambda self, *args: reply(*args))
    notes: list[str] = []
    records = run_tiers(tiny_cases()[:1], ("redis",), repeats=3, progress=False, notes=notes)
    assert {r["tier"] for r in records} == {"host"}
    assert notes[0].startswith(f"redis: llama-2-layers not measured: {note}")
