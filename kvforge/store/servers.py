"""Loopback store servers that kvforge starts itself (tests, demos): ``redis-server`` and
``mooncake_master``, each a child process bound to 127.0.0.1 and stopped by its own pid.

Invariants: a server object owns exactly one process and signals only that pid (never a name);
``stop()`` is idempotent and returns once the process is reaped; nothing here persists data
(Redis runs with ``--save '' --appendonly no``). Start servers inside :func:`private_net` when
they must not be reachable from outside (``tests/store/conftest.py`` and ``kvforge bench
--tiers`` do).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "LoopbackServer",
    "MooncakeMaster",
    "MooncakeSegmentHost",
    "RedisServer",
    "free_port",
    "joined_net",
    "private_net",
    "wait_for_port",
]

#: ``unshare`` / ``setns`` flag of a network namespace (``<sched.h>``)
CLONE_NEWNET = 0x40000000


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def private_net() -> Iterator[str]:
    """Run the calling thread in a new network namespace with ``lo`` up, and return it to its
    own namespace on exit. Yields ``""`` inside the new namespace, or why there is none (then
    nothing changed: the thread stays where it was).

    Servers started from the thread inside, and threads it creates there, live in a network of
    their own: nothing outside can reach them, whatever interfaces they bind (some of
    Mooncake's listeners bind all of them). Needs ``unshare(CLONE_NEWNET)`` (root or
    ``CAP_SYS_ADMIN``) and iproute2's ``ip``. Only this thread moves; other threads of the
    process stay in the original namespace.

    >>> with private_net() as why:  # doctest: +SKIP
    ...     server = RedisServer(6379 if not why else free_port()).start()
    """
    if shutil.which("ip") is None:
        yield "iproute2 is not installed"
        return
    libc = _libc()
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            yield f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
            return
        try:
            up = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
            why = "" if up.returncode == 0 else f"ip link set lo up failed: {up.stderr.strip()}"
        except BaseException:
            _setns(libc, original)
            raise
        if why:
            _setns(libc, original)
            yield why
            return
        try:
            yield ""
        finally:
            _setns(libc, original)
    finally:
        os.close(original)


@contextlib.contextmanager
def joined_net(namespace: int) -> Iterator[None]:
    """Run the calling thread in the network namespace that the open file ``namespace`` names
    (a ``/proc/<pid>/ns/net`` opened inside it), and return it to its own namespace on exit.

    With :func:`private_net` this lets several phases of one process share one private
    network: keep ``os.open("/proc/thread-self/ns/net", os.O_RDONLY)`` from inside it (the open
    file keeps the namespace alive) and join it again later. Mooncake's client needs that: it
    keeps process-wide listeners in the namespace of its first client, and a client set up
    from another namespace cannot reach them.
    """
    libc = _libc()
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.setns(namespace, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns into the shared network namespace failed")
        try:
            yield
        finally:
            _setns(libc, original)
    finally:
        os.close(original)


def _setns(libc: ctypes.CDLL, original: int) -> None:
    if libc.setns(original, CLONE_NEWNET) != 0:  # pragma: no cover - never seen
        raise OSError(ctypes.get_errno(), "setns back to the original network namespace failed")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` accepts a connection within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


class LoopbackServer:
    """One server process: :meth:`start` runs ``argv`` and waits for its port, :meth:`stop`
    kills it by pid; :meth:`freeze` / :meth:`thaw` stop and resume it (a slow server)."""

    name = "server"

    def __init__(
        self,
        argv: list[str],
        port: int,
        log: Path | None,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
    ):
        self.argv, self.host, self.port, self.log = argv, host, port, log
        #: variables set for the process on top of this process's environment
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not started")
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> LoopbackServer:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} already runs as pid {self.proc.pid}")
        if shutil.which(self.argv[0]) is None:
            raise FileNotFoundError(f"{self.argv[0]} is not installed (see docs/tiered_store.md)")
        out = open(self.log, "ab") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env} if self.env else None,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        if not wait_for_port(self.host, self.port, timeout):
            code = self.proc.poll()
            self.stop()
            raise RuntimeError(
                f"{self.name} ({' '.join(self.argv)}) did not listen on {self.address} within "
                f"{timeout}s (exit code {code}; log {self.log})"
            )
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the process (a crash, not a shutdown) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """Terminate the process by pid (SIGCONT first, in case it is frozen), reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.thaw()
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(LoopbackServer):
    """``redis-server --bind 127.0.0.1 --port PORT --save '' --appendonly no``."""

    name = "redis-server"

    def __init__(self, port: int, log: Path | None = None, *, maxmemory: int | None = None):
        argv = [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ]
        if maxmemory is not None:
            argv += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "noeviction"]
        super().__init__(argv, port, log)


class MooncakeMaster(LoopbackServer):
    """``mooncake_master`` on 127.0.0.1 with its HTTP metadata server off (clients use
    ``P2PHANDSHAKE``) and its metrics server on 127.0.0.1 too."""

    name = "mooncake_master"

    def __init__(
        self, port: int, metrics_port: int, log: Path | None = None, *, lease_ms: int = 10000
    ):
        argv = [
            "mooncake_master",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics_port}",
            "--enable_http_metadata_server=false",
            f"--default_kv_lease_ttl={lease_ms}",
        ]
        super().__init__(argv, port, log)


class MooncakeSegmentHost(LoopbackServer):
    """Mooncake's standalone client (``mooncake_client``, the wheel's binary) lending
    ``segment_bytes`` of its memory to the master at ``master`` over TCP: another process
    holding the store's bytes, as another machine would. Its RPC service listens on
    127.0.0.1:``port``; its transfer engine binds 127.0.0.1 too (``MC_TCP_BIND_ADDRESS``). The
    wheel's ``mooncake_client`` script ``exec``s the binary, so :attr:`pid` is the binary's."""

    name = "mooncake_client"

    def __init__(self, port: int, master: str, segment_bytes: int, log: Path | None = None):
        argv = [
            "mooncake_client",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--master_server_address={master}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            f"--global_segment_size={segment_bytes}",
        ]
        super().__init__(argv, port, log, env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"})
