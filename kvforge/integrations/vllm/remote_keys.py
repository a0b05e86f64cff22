"""What a vLLM engine's remote tier names its values by: the store fingerprint of one rank's
shard, and the key and content proof of one offload chunk of one request.

The format is the one of kvforge's remote tier (:mod:`kvforge.remote_tier`,
``docs/tiered_store.md``): a value of group ``g`` ending at token ``end`` is stored under
``b"group<g>/" + prefix_key`` (the server name adds the namespace and the fingerprint's
digest: :func:`kvforge.store.base.server_key`), where ``prefix_key`` is the SHA-256 chain of
:class:`~kvforge.core.prefix_keys.PrefixHasher` over the request's first ``end`` tokens, its
``cache_salt`` and its LoRA adapter, in the canonical encoding of ``docs/prefix_keys.md``:
never vLLM's block hashes, whose algorithm, seed (``PYTHONHASHSEED``) and encoding differ
between engines and versions. Every value carries the same chain as its content proof
(:mod:`kvforge.store.value`), which the reader computes from its own prompt.

The fingerprint (:func:`remote_fingerprint`) covers what makes page bytes differ besides the
tokens: the :class:`~kvforge.ModelIdentity` of the shard (config digest, revision or weights
digest, dtype, quantization, tensor- and pipeline-parallel rank and size), the host page plan
(offloaded groups, bytes per block, blocks per chunk), the KV cache dtype and layout, and the
key unit. Each rank publishes and loads its own shard under its own fingerprint.

A request with multimodal inputs or prompt embeddings has no remote keys (its chunks stay on
this engine's host pages).

This module imports no vLLM code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvforge.core.model_identity import ModelIdentity
from kvforge.core.prefix_keys import ExtraKeys, PrefixHasher
from kvforge.integrations.vllm.pages import HostPagePlan

__all__ = ["RequestKeys", "remote_fingerprint", "request_keys", "store_key"]


def remote_fingerprint(
    model: ModelIdentity, plan: HostPagePlan, unit: int, kv_cache: str = ""
) -> bytes:
    """The store fingerprint of one rank's shard (module docstring), BLAKE2b-256.

    >>> from kvforge.core.model_identity import config_digest
    >>> from kvforge.integrations.vllm.pages import plan_host_pages
    >>> m = ModelIdentity(name="tiny", config_digest=config_digest({}), dtype="bfloat16")
    >>> plan = plan_host_pages([0], [4096], blocks_per_chunk=2, host_bytes=1 << 20)
    >>> a = remote_fingerprint(m, plan, 16)
    >>> b = remote_fingerprint(m.model_copy(update={"tp_rank": 1, "tp_size": 2}), plan, 16)
    >>> len(a), a == b, a == remote_fingerprint(m, plan, 16)
    (32, False, True)
    """
    h = hashlib.blake2b(digest_size=32, person=b"kvforge-layout")
    h.update(b"model=" + model.digest + b"\n")
    h.update(
        f"vllm-offload|groups={list(plan.group_ids)}|block_bytes={list(plan.block_bytes)}|"
        f"blocks_per_chunk={plan.blocks_per_chunk}|unit={int(unit)}|kv_cache={kv_cache}\n".encode()
    )
    return h.digest()


def store_key(group_id: int, prefix_key: bytes) -> bytes:
    """The store key of group ``group_id``'s chunk under ``prefix_key``: ``group/prefix-key``,
    as :class:`kvforge.remote_tier.RemoteTier` names its values."""
    return f"group{int(group_id)}".encode() + b"/" + prefix_key


class RequestKeys:
    """The prefix keys of one request's tokens, extended as the request grows.

    Args:
        tokens: the request's token ids (vLLM's ``Request.all_token_ids``: a list that grows
            as tokens are sampled; read, never copied whole).
        extra: the request's :class:`ExtraKeys` (``cache_salt``, adapter).
        unit: tokens per key (vLLM's tokens per block hash: every chunk ends at a multiple).
    """

    def __init__(self, tokens: Sequence[int], extra: ExtraKeys, unit: int) -> None:
        self._tokens = tokens
        self._hasher = PrefixHasher(extra, unit=unit)
        self._keys: list[bytes] = []
        self.unit = unit

    def at(self, end: object) -> bytes | None:
        """The key of the prefix ``[0, end)``, or ``None`` when ``end`` is not a positive
        multiple of the unit or the request has fewer tokens."""
        if type(end) is not int or end <= 0 or end % self.unit:
            return None
        n = end // self.unit
        if n > len(self._keys):
            if len(self._tokens) < end:
                return None
            start = self._hasher.num_tokens
            chunk = np.asarray(list(self._tokens[start:end]), dtype=np.int64)
            self._keys.extend(self._hasher.extend(chunk))
        return self._keys[n - 1]


def request_keys(request: Any, unit: int) -> RequestKeys | None:
    """The keys of a vLLM ``Request`` (its ``all_token_ids``, ``cache_salt`` and LoRA name),
    or ``None`` for one with multimodal inputs or prompt embeddings (no remote keys)."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    adapter = None if lora is None else str(getattr(lora, "lora_name", lora))
    salt = getattr(request, "cache_salt", None)
    extra = ExtraKeys(cache_salt=salt if salt else None, adapter=adapter)
    return RequestKeys(request.all_token_ids, extra, unit)
