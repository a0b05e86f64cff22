"""``kvforge.store.servers.private_net``: the calling thread runs in a network namespace of its
own with ``lo`` up, comes back to its own on exit, and where that cannot be done says why and
changes nothing; ``joined_net`` enters such a namespace again later, from an open file of it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading

import pytest

from kvforge.store import servers
from kvforge.store.servers import free_port, joined_net, private_net, wait_for_port


def _netns() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _netns_of_a_thread(started: threading.Event | None = None) -> tuple[threading.Thread, list]:
    """A thread that reports its namespace once ``started`` is set (now if None)."""
    seen: list[int] = []
    go = started or threading.Event()

    def report():
        go.wait(10)
        seen.append(_netns())

    thread = threading.Thread(target=report)
    thread.start()
    if started is None:
        go.set()
    return thread, seen


def test_private_net_moves_this_thread_and_brings_it_back():
    before, fds = _netns(), _fds()
    go = threading.Event()
    old_thread, old_seen = _netns_of_a_thread(go)  # created outside: stays outside
    try:
        with private_net() as why:
            if why:
                pytest.skip(f"no private network namespace here: {why}")
            inside = _netns()
            assert inside != before
            go.set()
            new_thread, new_seen = _netns_of_a_thread()  # created inside: lives inside
            new_thread.join()
            assert new_seen == [inside]
            # lo is up: a listener on 127.0.0.1 answers inside
            with socket.socket() as listener:
                listener.bind(("127.0.0.1", 0))
                listener.listen()
                assert wait_for_port("127.0.0.1", listener.getsockname()[1], 2.0)
    finally:
        go.set()
        old_thread.join()
    assert old_seen == [before]
    assert _netns() == before and _fds() == fds


def test_private_net_comes_back_when_the_body_raises():
    before = _netns()
    with pytest.raises(RuntimeError, match="body"), private_net():
        raise RuntimeError("body")
    assert _netns() == before


class _Libc:
    """Stands in for libc: ``unshare`` refused (EPERM) or accepted without moving anything."""

    def __init__(self, unshare: int):
        self.result, self.calls = unshare, []

    def unshare(self, flags):
        self.calls.append(("unshare", flags))
        return self.result

    def setns(self, fd, flags):
        self.calls.append(("setns", flags))
        return 0


def test_private_net_says_why_when_unshare_is_refused(monkeypatch):
    libc = _Libc(unshare=-1)
    monkeypatch.setattr(servers, "_libc", lambda: libc)
    before, fds = _netns(), _fds()
    with private_net() as why:
        assert why.startswith("unshare(CLONE_NEWNET) failed: ")
        assert _netns() == before
    assert libc.calls == [("unshare", servers.CLONE_NEWNET)]
    assert _fds() == fds


def test_private_net_says_why_without_iproute2(monkeypatch):
    monkeypatch.setattr(servers.shutil, "which", lambda name: None)
    with private_net() as why:
        assert why == "iproute2 is not installed"


def test_private_net_goes_back_when_lo_cannot_come_up(monkeypatch):
    libc = _Libc(unshare=0)
    monkeypatch.setattr(servers, "_libc", lambda: libc)
    failed = subprocess.CompletedProcess([], 2, "", "RTNETLINK answers: Operation not permitted\n")
    monkeypatch.setattr(servers.subprocess, "run", lambda *a, **k: failed)
    with private_net() as why:
        assert why == "ip link set lo up failed: RTNETLINK answers: Operation not permitted"
        # already back in the original namespace while the caller runs its fallback
        assert libc.calls == [("unshare", servers.CLONE_NEWNET), ("setns", servers.CLONE_NEWNET)]
    assert len(libc.calls) == 2


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 is not installed")
def test_private_net_goes_back_when_ip_cannot_run(monkeypatch):
    libc = _Libc(unshare=0)
    monkeypatch.setattr(servers, "_libc", lambda: libc)

    def broken(*args, **kwargs):
        raise OSError("ip vanished")

    monkeypatch.setattr(servers.subprocess, "run", broken)
    with pytest.raises(OSError, match="ip vanished"), private_net():
        pass
    assert [c[0] for c in libc.calls] == ["unshare", "setns"]


def test_joined_net_enters_a_kept_namespace_again_and_sees_its_listeners():
    """A listener opened in a private namespace is reachable from a later visit to it (the
    open file keeps the namespace alive), and never from the original namespace."""
    before, fds = _netns(), _fds()
    with private_net() as why:
        if why:
            pytest.skip(f"no private network namespace here: {why}")
        inside = _netns()
        kept = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
    try:
        assert _netns() == before
        with joined_net(kept):
            assert _netns() == inside
            assert wait_for_port("127.0.0.1", port, 2.0)
        assert _netns() == before
        with pytest.raises(RuntimeError, match="body"), joined_net(kept):
            raise RuntimeError("body")
        assert _netns() == before
    finally:
        listener.close()
        os.close(kept)
    assert _fds() == fds


def test_joined_net_refuses_a_file_that_is_no_namespace(tmp_path):
    before, fds = _netns(), _fds()
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        failed = "setns into the shared network namespace failed"
        with pytest.raises(OSError, match=failed), joined_net(fd):
            pass
    finally:
        os.close(fd)
    assert _netns() == before and _fds() == fds


def test_free_port_is_free():
    port = free_port()
    assert not wait_for_port("127.0.0.1", port, 0.0)
