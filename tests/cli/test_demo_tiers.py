"""``kvforge demo --tier redis|mooncake``: engine A publishes, engine B (a second controller in
the same process) reuses from its device, its host pages and the store, every entry verified;
servers are started by the command (and stopped by pid) or given by address; bad input and
missing servers are one line, exit 2, and leave no server running."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
from _optional import mooncake_missing, redis_missing

from kvforge.cli import demo, remotes
from kvforge.cli.main import main
from kvforge.store import servers

#: why each remote cannot run here (client, system library, server binary), or None
REDIS_MISSING, MOONCAKE_MISSING = redis_missing(), mooncake_missing()
HAVE_REDIS = REDIS_MISSING is None
HAVE_MOONCAKE = MOONCAKE_MISSING is None
ARGV = ["demo", "--device", "cpu", "--no-progress", "--requests", "2"]


@pytest.fixture
def started(monkeypatch):
    """Every server the command starts in this process, to check each was stopped."""
    seen: list[servers.LoopbackServer] = []
    real = servers.LoopbackServer.start

    def start(self, *args, **kwargs):
        seen.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(servers.LoopbackServer, "start", start)
    return seen


def all_stopped(seen: list[servers.LoopbackServer]) -> bool:
    return all(s.proc is None or s.proc.poll() is not None for s in seen)


def check_remote(prefix: dict, tier: str) -> None:
    assert prefix["tier"] == prefix["backend"] == tier and prefix["engines"] == 2
    assert prefix["entries_mismatched"] == 0 and prefix["entries_verified"] > 0
    # engine B's hits come from the store (fetched into host pages), from host pages it
    # already held, and from its device; every value asked for arrived whole
    assert prefix["remote_hit_tokens"] > 0 and prefix["remote_fetched"] > 0
    assert prefix["remote_fetch_misses"] == 0
    assert prefix["remote_hit_tokens"] <= prefix["host_hit_tokens"] <= prefix["hit_tokens"]
    assert prefix["remote_published"] == prefix["remote_stored"] > 0
    assert prefix["hit_tokens"] > prefix["writer_hit_tokens"] > 0


@pytest.mark.skipif(not HAVE_REDIS, reason=str(REDIS_MISSING))
@pytest.mark.slow
def test_tier_redis_started_by_the_command_serves_hits_from_the_store(capsys, tmp_path, started):
    path = tmp_path / "demo.json"
    assert main([*ARGV, "--tier", "redis", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "of them from the store" in out and "two controllers, one process" in out
    assert out.strip().splitlines()[-1].endswith(" 0 mismatched")
    report = json.loads(path.read_text())
    assert report["ok"] and report["entries_mismatched"] == 0
    check_remote(report["prefix"], "redis")
    assert report["prefix"]["server"] == "started"
    assert len(started) == 1 and all_stopped(started)


@pytest.mark.skipif(not HAVE_REDIS, reason=str(REDIS_MISSING))
@pytest.mark.slow
def test_tier_redis_at_a_given_address_leaves_that_server_running(capsys, tmp_path, started):
    path = tmp_path / "demo.json"
    with servers.RedisServer(servers.free_port()) as server:
        argv = [*ARGV, "--tier", "redis", "--redis", server.address, "--json", str(path)]
        assert main(argv) == 0
        assert server.proc.poll() is None  # not the demo's to stop
    capsys.readouterr()
    prefix = json.loads(path.read_text())["prefix"]
    check_remote(prefix, "redis")
    assert prefix["server"] == server.address and prefix["notes"] == []
    assert started == [server]  # the demo started none of its own


@pytest.mark.skipif(not HAVE_MOONCAKE, reason=str(MOONCAKE_MISSING))
def test_tier_mooncake_in_a_process_of_its_own(tmp_path):
    # Mooncake's client keeps process-wide state in the network namespace of the first client
    # (docs/tiered_store.md): a fresh process, so that no other test's namespace is in the way
    path, pids = tmp_path / "demo.json", tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import sys
        from kvforge.cli.main import main
        from kvforge.store import servers
        real = servers.LoopbackServer.start
        def start(self, *args, **kwargs):
            started = real(self, *args, **kwargs)
            with open({str(pids)!r}, "a") as fh:
                fh.write(f"{{self.pid}}\\n")
            return started
        servers.LoopbackServer.start = start
        sys.exit(main({[*ARGV, "--tier", "mooncake", "--json", str(path)]!r}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "of them from the store" in done.stdout
    prefix = json.loads(path.read_text())["prefix"]
    check_remote(prefix, "mooncake")
    assert prefix["server"] == "started"
    [pid] = [int(p) for p in pids.read_text().split()]
    with pytest.raises(ProcessLookupError):  # stopped and reaped by the command
        os.kill(pid, 0)


_find_spec = importlib.util.find_spec


def client_installed(name: str, package: str | None = None):
    """``find_spec`` on a machine where both remote clients are installed."""
    if name in remotes.REMOTES:
        return importlib.machinery.ModuleSpec(name, None)
    return _find_spec(name, package)


def _closed_port() -> str:
    return f"127.0.0.1:{servers.free_port()}"


@pytest.mark.parametrize(
    ("argv", "patch", "message"),
    [
        (["--tier", "redis", "--redis", "localhost"], None, "--redis must be HOST:PORT with a port in 1..65535, got 'localhost'"),
        (["--tier", "mooncake", "--mooncake-master", "h:70000"], None, "--mooncake-master must be HOST:PORT"),
        (["--tier", "redis", "--redis", ":6379"], None, "--redis must be HOST:PORT"),
        (["--tier", "host", "--redis", "127.0.0.1:6379"], None, "--redis applies with --tier redis, not --tier host"),
        (["--redis", "127.0.0.1:6379"], None, "--redis applies with --tier redis, not --tier device"),
        (["--tier", "redis", "--mooncake-master", "h:1"], None, "--mooncake-master applies with --tier mooncake, not --tier redis"),
        (["--tier", "mooncake", "--prefix-conversations", "0"], None, "--tier mooncake applies to the prefix-reuse phase, which --prefix-conversations 0 skips"),
        (["--tier", "redis", "--redis", "{closed}"], None, "--tier redis: nothing accepts a connection at {closed}"),
        (["--tier", "redis"], "no-binary", "--tier redis: redis-server is not installed (see docs/tiered_store.md)"),
        (["--tier", "mooncake"], "no-binary", "--tier mooncake: mooncake_master is not installed"),
        (["--tier", "redis"], "no-client", "--tier redis: the redis client is not installed (pip install 'kvforge[redis]')"),
        (["--tier", "redis", "--redis", "127.0.0.1:1"], "no-client", "--tier redis: the redis client is not installed"),
        (["--tier", "redis"], "no-start", "--tier redis: redis: its server did not start: refused on purpose"),
    ],
)  # fmt: skip
def test_bad_input_and_missing_servers_are_one_line_exit_2(
    capsys, monkeypatch, started, argv, patch, message
):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the demo ran before refusing its input")

    monkeypatch.setattr(demo, "_run", must_not_run)
    if patch == "no-binary":
        real_which = remotes.shutil.which
        absent = {"redis-server", "mooncake_master"}
        monkeypatch.setattr(
            remotes.shutil, "which", lambda n: None if n in absent else real_which(n)
        )
        # the clients present, installed or not: the check under test is the binary's
        monkeypatch.setattr(remotes.importlib.util, "find_spec", client_installed)
    elif patch == "no-client":
        monkeypatch.setattr(remotes.importlib.util, "find_spec", lambda name: None)
    elif patch == "no-start":
        if not HAVE_REDIS:
            pytest.skip(str(REDIS_MISSING))

        def refuse(self, *args, **kwargs):
            started.append(self)
            raise RuntimeError("refused on purpose")

        monkeypatch.setattr(servers.LoopbackServer, "start", refuse)
    closed = _closed_port()
    code = main(["demo", "--no-progress", *(a.format(closed=closed) for a in argv)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("kvforge demo: error: ")
    assert message.format(closed=closed) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert all_stopped(started)
