"""One private network namespace for every Mooncake client a test process creates.

Mooncake's client keeps process-wide state (its transfer engine's listeners) in the network
namespace of the thread that created the first client; a client set up from another namespace
cannot reach it (setup retries for about 90 s, then fails). So every module that starts Mooncake
clients in the test process joins the same namespace: made once per session
(``mooncake_session_net`` in ``tests/conftest.py``), kept alive by an open file, joined with
``setns`` for a module and left again after it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

from kvforge.store.servers import joined_net, private_net


@dataclass(frozen=True)
class SharedNet:
    """The session's private namespace (an open ``/proc/.../ns/net``), or why there is none."""

    namespace: int | None
    why: str = ""

    @contextlib.contextmanager
    def entered(self) -> Iterator[str]:
        """Run the calling thread in the shared namespace; yields ``""``, or why there is none
        (then the thread stays where it is)."""
        if self.namespace is None:
            yield self.why
            return
        with joined_net(self.namespace):
            yield ""


@contextlib.contextmanager
def shared_private_net() -> Iterator[SharedNet]:
    """Make the namespace, come back out of it, and keep it open until the end."""
    with private_net() as why:
        namespace = None if why else os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        yield SharedNet(namespace, why)
    finally:
        if namespace is not None:
            os.close(namespace)


_ports = iter(range(50051, 60000, 2))


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_pair() -> int:
    """The next master port whose metrics port (``port + 1``) is free too, in the calling
    thread's namespace: the clients of earlier tests keep listeners on ports of their own
    choosing in the same namespace, and some are left open on purpose (MooncakeStore.close)."""
    for port in _ports:
        if _bindable(port) and _bindable(port + 1):
            return port
    raise RuntimeError("no free pair of ports left in 50051..60000")
