"""The ``"remote"`` entry of kvforge's connector options: a remote tier (Redis or Mooncake Store)
behind the host pages, with the same :class:`~kvforge.store.config.StoreConfig` as
``CacheController``'s remote tier, and what vLLM's ``kv_role`` lets the engine do with it.

``kv_role`` (vLLM's ``KVTransferConfig``): ``"kv_producer"`` publishes stored pages and never
loads from the store, ``"kv_consumer"`` loads from the store and never publishes, ``"kv_both"``
does both. The host pages serve every role alike.

Checked once, at engine start (:func:`parse_remote`); a refusal is one
:class:`~kvforge._checks.ArgumentError` line naming the key and the value:

- ``remote`` not an object, a field ``StoreConfig`` does not have, a value it refuses (an
  unknown ``backend`` included), or ``backend`` ``"none"`` (a remote tier with no server);
- a ``kv_role`` the options contradict: ``"kv_producer"`` or ``"kv_consumer"`` with no
  ``remote`` entry (the role names a direction to a store there is not);
- a remote tier that loads (``kv_consumer``, ``kv_both``) under
  ``kv_load_failure_policy="fail"``: a value evicted between lookup and load must cost a
  recompute, not the request.

Secrets never reach a message or a log: ``redis_password`` is a ``SecretStr`` and is shown as
``'**********'``.

This module imports no vLLM code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvforge._checks import ArgumentError

__all__ = ["ROLES", "RemoteSettings", "parse_remote"]

#: vLLM's kv_role values: role -> (loads from the store, publishes to it)
ROLES: dict[str, tuple[bool, bool]] = {
    "kv_both": (True, True),
    "kv_producer": (False, True),
    "kv_consumer": (True, False),
}
_SECRET_FIELDS = ("redis_password",)


@dataclass(frozen=True)
class RemoteSettings:
    """A checked ``"remote"`` entry.

    Attributes:
        store: the store's settings.
        kv_role: vLLM's ``kv_role``.
        loads: whether the engine loads pages from the store (``kv_consumer``, ``kv_both``).
        publishes: whether it publishes the pages it stores (``kv_producer``, ``kv_both``).
    """

    store: Any  # StoreConfig (imported lazily: it needs pydantic-settings)
    kv_role: str
    loads: bool
    publishes: bool


def _shown(field: str, value: object) -> str:
    return "'**********'" if field in _SECRET_FIELDS and value is not None else repr(value)


def _store_config(raw: Mapping[str, Any]) -> Any:
    from pydantic import ValidationError

    from kvforge.store.config import StoreConfig

    for field in raw:
        if field not in StoreConfig.model_fields:
            raise ArgumentError(
                f"kvforge option 'remote.{field}'={_shown(str(field), raw[field])}: no such "
                "store field; the fields are StoreConfig's (backend, namespace, redis_host, "
                "redis_port, mooncake_master, ...: docs/tiered_store.md)"
            )
    try:
        return StoreConfig(**dict(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "backend"
        value = raw.get(field, err.get("input"))
        why = str(err["msg"]).removeprefix("Value error, ")
        if field == "backend":
            why = "must be 'redis' or 'mooncake' (the stores kvforge's remote tier runs on)"
        raise ArgumentError(
            f"kvforge option 'remote.{field}'={_shown(field, value)}: {why}"
        ) from None


def parse_remote(
    raw: object, kv_role: object, load_failure_policy: object = "recompute"
) -> RemoteSettings | None:
    """The checked ``"remote"`` entry of kvforge's options (``raw``; ``None``: none) for an
    engine of ``kv_role`` and ``kv_load_failure_policy`` (module docstring).

    Raises:
        ArgumentError: one line naming the key and the value (module docstring).
    """
    role = "kv_both" if kv_role is None else kv_role
    if role not in ROLES:
        raise ArgumentError(
            f"kv_role={kv_role!r}: kvforge knows {', '.join(repr(r) for r in ROLES)}"
        )
    if raw is None:
        if role != "kv_both":
            raise ArgumentError(
                f"kv_role={role!r}: contradicts kvforge's options: there is no 'remote' "
                "entry to "
                + ("load from" if role == "kv_consumer" else "publish to")
                + " (add one, or use kv_role 'kv_both')"
            )
        return None
    if not isinstance(raw, Mapping):
        raise ArgumentError(
            f"kvforge option 'remote'={type(raw).__name__}: must be an object of StoreConfig "
            'fields, e.g. {"backend": "redis", "redis_host": "10.0.0.5"}'
        )
    store = _store_config(raw)
    if store.backend == "none":
        raise ArgumentError(
            f"kvforge option 'remote.backend'={store.backend!r}: a remote tier needs a server: "
            "'redis' or 'mooncake' (leave 'remote' out for none)"
        )
    loads, publishes = ROLES[role]
    if loads and load_failure_policy != "recompute":
        raise ArgumentError(
            f"kv_load_failure_policy={load_failure_policy!r}: kvforge's remote tier loads for "
            f"kv_role {role!r}, and a value evicted between lookup and load must be recomputed: "
            "set 'recompute' (or kv_role 'kv_producer')"
        )
    return RemoteSettings(store, role, loads, publishes)
