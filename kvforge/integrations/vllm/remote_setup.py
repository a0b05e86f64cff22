"""From a ``VllmConfig`` to the remote tier's spec (:mod:`.remote`): the checked ``"remote"``
entry (:mod:`.remote_options`) for the engine's ``kv_role`` and ``kv_load_failure_policy``,
this shard's and every rank's :class:`~kvforge.ModelIdentity`, the key unit and what of the KV
cache goes in the store fingerprint (:func:`~.remote_keys.remote_fingerprint`).

Imported by :mod:`.connector`; :mod:`.remote` (which imports vLLM) is imported only when a
``"remote"`` entry is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvforge.integrations.vllm.identity import model_identity
from kvforge.integrations.vllm.remote_options import RemoteSettings, parse_remote

__all__ = ["remote_settings", "remote_spec"]


def remote_settings(vllm_config: Any, extra_config: Mapping[str, Any]) -> RemoteSettings | None:
    """The checked ``"remote"`` entry of ``extra_config["kvforge"]`` (``None``: none), for the
    ``kv_role`` and ``kv_load_failure_policy`` of ``vllm_config``'s ``kv_transfer_config``.

    Raises:
        ArgumentError: one line naming the key and the value (:func:`.remote_options.
            parse_remote`).
    """
    options = extra_config.get("kvforge")
    raw = options.get("remote") if isinstance(options, Mapping) else None
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    role = getattr(transfer, "kv_role", None)
    policy = getattr(transfer, "kv_load_failure_policy", "recompute")
    return parse_remote(raw, role, policy)


def remote_spec(
    vllm_config: Any,
    offloading_config: Any,
    block_bytes: Sequence[int],
    device_type: str | None,
    remote: RemoteSettings,
) -> Any:
    """The :class:`~.remote.RemoteOffloadingSpec` of an engine with a remote tier."""
    from kvforge.integrations.vllm.remote import RemoteOffloadingSpec

    identity = model_identity(vllm_config)
    ranks = [
        identity.model_copy(update={"tp_rank": t, "pp_rank": p})
        for p in range(identity.pp_size)
        for t in range(identity.tp_size)
    ]
    cache = getattr(offloading_config, "cache", None)
    unit = getattr(cache, "tokens_per_hash", None) or vllm_config.cache_config.block_size
    kv_cache = (
        f"cache_dtype={vllm_config.cache_config.cache_dtype}|device={device_type or 'default'}"
    )
    return RemoteOffloadingSpec(
        offloading_config,
        block_bytes,
        device_type,
        remote=remote,
        identity=identity,
        rank_identities=ranks,
        unit=int(unit),
        kv_cache=kv_cache,
    )
