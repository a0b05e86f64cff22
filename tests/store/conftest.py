"""Fixtures for the remote tier's tests: a private network namespace per test, real loopback
servers (``redis-server``, ``mooncake_master``) started in it and stopped by their own pids,
and stores that are closed before the servers stop.

The namespace (:func:`kvforge.store.servers.private_net`): the test's thread calls
``unshare(CLONE_NEWNET)`` and brings ``lo`` up, so the servers it starts and the client threads
it creates live in a network of their own (nothing outside can reach them, whatever interfaces
they bind); teardown returns the thread to the original namespace with ``setns``. Where ``unshare`` is refused (not root), Redis tests run on
plain 127.0.0.1 with a free port (``--bind`` is honoured) and Mooncake tests are skipped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

# Mooncake logs every call through glog; keep its warnings and errors only
os.environ.setdefault("GLOG_minloglevel", "1")

from _mooncake_net import SharedNet, free_pair
from _optional import mooncake_missing, redis_missing

from kvforge.store.servers import MooncakeMaster, RedisServer, free_port, private_net

#: Why the Redis / Mooncake tests cannot run here (None: they can); a fixture that needs one
#: skips with it (``tests/_optional.py``: client, system library, server binary).
REDIS_MISSING = redis_missing()
MOONCAKE_MISSING = mooncake_missing()
HAVE_REDIS = REDIS_MISSING is None
HAVE_MOONCAKE = MOONCAKE_MISSING is None


@dataclass
class Net:
    """Where a test's servers listen: a private namespace (fixed ports) or the host's loopback."""

    private: bool
    why: str = ""

    def port(self, fixed: int) -> int:
        return fixed if self.private else free_port()


@contextlib.contextmanager
def _private_net() -> Iterator[Net]:
    with private_net() as why:
        yield Net(private=not why, why=why)


@pytest.fixture
def net() -> Iterator[Net]:
    with _private_net() as net:
        yield net


@pytest.fixture
def redis_server(net: Net, tmp_path) -> Iterator[RedisServer]:
    if not HAVE_REDIS:
        pytest.skip(f"{REDIS_MISSING} (.ci/run installs it)")
    server = RedisServer(net.port(6379), tmp_path / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mooncake_net(mooncake_session_net: SharedNet) -> Iterator[Net]:
    """The session's one Mooncake namespace, joined for the module (``tests/_mooncake_net.py``:
    Mooncake's client keeps process-wide listeners in the namespace of its first client)."""
    with mooncake_session_net.entered() as why:
        yield Net(private=not why, why=why)


@pytest.fixture
def mooncake_master(mooncake_net: Net, tmp_path) -> Iterator[MooncakeMaster]:
    """A fresh master per test, on a port no earlier test's clients (some are left open on
    purpose, see MooncakeStore.close) know about."""
    if not HAVE_MOONCAKE:
        pytest.skip(MOONCAKE_MISSING)
    if not mooncake_net.private:
        pytest.skip(f"Mooncake's listeners need a private network namespace: {mooncake_net.why}")
    port = free_pair()
    master = MooncakeMaster(port, port + 1, tmp_path / "master.log")
    master.start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def stores() -> Iterator[Callable]:
    """``stores(store)`` registers a store to close at teardown (before its server stops)."""
    made: list = []

    def keep(store):
        made.append(store)
        return store

    yield keep
    for store in reversed(made):
        store.close()
