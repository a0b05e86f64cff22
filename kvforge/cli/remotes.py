"""The remote tiers ``kvforge demo --tier`` and ``kvforge bench --tiers --remote`` take: one set
of rules and messages for both commands, checked before any work.

- A list of remote tiers (``--remote``) names each of :data:`REMOTES` at most once, or is
  ``none`` alone: an empty item, a name given twice, an unknown name, or ``none`` beside
  another is refused (:func:`parse_remotes`).
- A server address (``--redis``, ``--mooncake-master``) is ``HOST:PORT`` with a port in
  1..65535, and applies only when its tier is chosen (:func:`given_addresses`).
- A chosen tier must be usable here (:func:`check_available`): its client installed, and the
  address given accepting a connection within :data:`CONNECT_TIMEOUT_S`, or, with no address,
  its server binary installed, so that the command can start one.

A refusal of what was typed is a :class:`~kvforge.cli.formatting.UsageError`; a tier that
cannot run is a :class:`StoreUnavailable`, which the commands print the same way, after the
option that chose the tier (``--tier redis: ...``, ``--remote redis: ...``): one line on
stderr, exit code 2.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Mapping, Sequence

from kvforge.cli.formatting import UsageError

__all__ = [
    "ADDRESS_FLAGS",
    "CONNECT_TIMEOUT_S",
    "REMOTES",
    "StoreUnavailable",
    "check_available",
    "given_addresses",
    "missing",
    "parse_address",
    "parse_remotes",
]

#: the remote tiers, by the name of their client module
REMOTES: tuple[str, ...] = ("redis", "mooncake")
#: the flag that gives each remote tier's server address
ADDRESS_FLAGS = {"redis": "--redis", "mooncake": "--mooncake-master"}
#: how long a given address may take to accept a connection
CONNECT_TIMEOUT_S = 3.0
#: the server binary a command starts for each remote tier when no address is given
_BINARIES = {"redis": "redis-server", "mooncake": "mooncake_master"}


class StoreUnavailable(RuntimeError):
    """The store server of a remote tier did not answer (or its client is not installed).

    Attributes:
        remote: the tier (``"redis"`` or ``"mooncake"``), where known.
    """

    def __init__(self, message: str, remote: str | None = None) -> None:
        super().__init__(message)
        self.remote = remote


def _shown(text: str) -> str:
    """``repr(text)``, cut to a line's worth (a value typed may be megabytes)."""
    return repr(text) if len(text) <= 200 else f"{text[:200]!r}... ({len(text):,} characters)"


def parse_address(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` -> ``(host, port)``; :class:`UsageError` naming ``flag`` otherwise."""
    host, sep, port = text.rpartition(":")
    digits = port.isascii() and port.isdigit() and len(port) <= 5  # int() takes other scripts
    if not (sep and host and digits and 0 < int(port) < 65536):
        raise UsageError(f"{flag} must be HOST:PORT with a port in 1..65535, got {_shown(text)}")
    return host, int(port)


def parse_remotes(text: str, option: str = "--remote") -> tuple[str, ...]:
    """The remote tiers a comma list names, in its order (``"none"``: no remote tier).

    Raises:
        UsageError: an empty item, an unknown name, a name given twice, or ``none`` beside
            another name, naming ``option``, the list and the item.
    """

    def refuse(why: str) -> UsageError:
        return UsageError(
            f"{option} takes a comma list of {', '.join(REMOTES)} or none, got {_shown(text)}: "
            + why
        )

    items = text.split(",")
    seen: set[str] = set()
    for position, item in enumerate(items, 1):
        if not item:
            raise refuse(f"item {position} is empty")
        if item not in (*REMOTES, "none"):
            raise refuse(f"{_shown(item)} is not one of them")
        if item in seen:
            raise refuse(f"{item!r} is named twice")
        seen.add(item)
    if "none" in seen and len(items) > 1:
        raise refuse("none means no remote tier and stands alone")
    return tuple(item for item in items if item != "none")


def given_addresses(
    given: Mapping[str, str | None], chosen: Sequence[str], option: str, value: str
) -> dict[str, str]:
    """``{tier: "HOST:PORT"}`` of the addresses ``given`` (by tier; None: not given).

    ``chosen`` are the tiers the command will use, ``option`` and ``value`` what chose them
    (``"--tier", "host"``; ``"--remote", "mooncake"``), for the message.

    Raises:
        UsageError: an address for a tier that is not chosen, or not ``HOST:PORT``.
    """
    addresses: dict[str, str] = {}
    for remote, flag in ADDRESS_FLAGS.items():
        text = given.get(remote)
        if text is None:
            continue
        if remote not in chosen:
            raise UsageError(f"{flag} applies with {option} {remote}, not {option} {value}")
        host, port = parse_address(text, flag)
        addresses[remote] = f"{host}:{port}"
    return addresses


def missing(remote: str) -> str | None:
    """Why ``remote`` cannot run here (a client or server binary is missing), or None."""
    if remote not in _BINARIES:
        raise ValueError(f"remote must be one of {list(REMOTES)}, got {remote!r}")
    if importlib.util.find_spec(remote) is None:
        return f"the {remote} client is not installed (pip install 'kvforge[{remote}]')"
    if shutil.which(_BINARIES[remote]) is None:
        return f"{_BINARIES[remote]} is not installed (see docs/tiered_store.md)"
    return None


def check_available(remote: str, address: str | None) -> None:
    """Whether ``remote`` can run: its client installed, and ``address`` (``HOST:PORT``)
    accepting a connection, or with no address its server binary installed.

    Raises:
        StoreUnavailable: saying which of those is missing.
    """
    if address is None:
        why = missing(remote)
        if why:
            raise StoreUnavailable(why, remote)
        return
    if importlib.util.find_spec(remote) is None:
        raise StoreUnavailable(
            f"the {remote} client is not installed (pip install 'kvforge[{remote}]')", remote
        )
    from kvforge.store.servers import wait_for_port

    host, port = parse_address(address, ADDRESS_FLAGS[remote])
    if not wait_for_port(host, port, CONNECT_TIMEOUT_S):
        raise StoreUnavailable(
            f"nothing accepts a connection at {address} (waited {CONNECT_TIMEOUT_S:.0f} s)",
            remote,
        )
