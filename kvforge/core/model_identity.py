"""The model identity of a cache: what, besides the cache layout, makes two engines' KV bytes
differ. Two engines whose caches have one layout (same groups, roles, dtypes, block sizes)
still write different bytes for one prompt when they serve other weights, another revision,
another dtype or quantization, or another tensor- or pipeline-parallel shard. The remote tier
puts :attr:`ModelIdentity.digest` into the fingerprint every server key and every value header
carries (:func:`kvforge.remote_tier.layout_fingerprint`), so such engines never share bytes.

A path alone is never an identity: the same path can hold other weights tomorrow. The
identity therefore needs a digest of the effective model config (the config after the
engine's overrides, :func:`config_digest`), and takes the revision (a pinned commit) or a
digest of the weights' index when the caller has them; the engine integration fills them
(:func:`kvforge.integrations.vllm.identity.model_identity` from vLLM's ``ModelConfig``).

Canonical encoding (version 1): ``digest = SHA-256(b"kvforge-model-identity" ‖ u32 1 ‖ J)``
with ``J`` the UTF-8 JSON of every field (:meth:`ModelIdentity.canonical`: keys sorted, no
spaces, ASCII escapes), so every process and machine computes the same digest.

>>> a = ModelIdentity(name="llama-3-8b", config_digest=config_digest({"hidden_size": 4096}),
...                   dtype="bfloat16")
>>> b = a.model_copy(update={"quantization": "fp8"})
>>> len(a.digest), a.digest == b.digest
(32, False)
>>> try:
...     ModelIdentity(name="llama-3-8b", config_digest="x", dtype="bfloat16")
... except ValueError as e:
...     print(str(e).splitlines()[2][:60])
  Value error, config_digest must be 32 to 128 lowercase hex
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
import struct
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

__all__ = ["IDENTITY_VERSION", "ModelIdentity", "config_digest"]

IDENTITY_VERSION = 1
_DOMAIN = b"kvforge-model-identity"
_HEX = re.compile(r"[0-9a-f]{32,128}")
_MAX_DEPTH = 64


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """``value`` as plain JSON data (dicts with str keys, lists, str, int, float, bool, None),
    or a :class:`TypeError` naming ``where``. Objects with ``to_dict()`` (Hugging Face
    configs) or ``model_dump()`` (pydantic) are read through them; enums by value, paths and
    ``torch.dtype`` by their text."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where} nests deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} = {value!r}: a config digest needs finite numbers")
        return float(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value, where, depth + 1)
    if isinstance(value, PurePath):
        return str(value)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str | int) or isinstance(k, bool):
                raise TypeError(f"{where} has a key of type {type(k).__name__} ({k!r:.40})")
            out[str(k)] = _plain(v, f"{where}[{k!r}]", depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, set | frozenset):
        items = [_plain(v, f"{where} item", depth + 1) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    for method in ("to_dict", "model_dump"):
        fn = getattr(value, method, None)
        if callable(fn):
            return _plain(fn(), where, depth + 1)
    raise TypeError(
        f"{where} is a {type(value).__name__}: a config digest takes JSON-like data (mappings, "
        "sequences, str, int, finite float, bool, None) or objects with to_dict()"
    )


def config_digest(config: Any) -> str:
    """SHA-256 (hex) of a model config's canonical JSON: ``config`` is a mapping (or an object
    with ``to_dict()``, such as a Hugging Face ``PretrainedConfig``, or a pydantic model),
    read recursively; keys are sorted, so equal configs give one digest in every process.

    Raises:
        TypeError, ValueError: a value that has no canonical JSON form (named by its path).

    >>> config_digest({"b": 1, "a": [1.5, None]}) == config_digest({"a": [1.5, None], "b": 1})
    True
    """
    data = _plain(config, "config")
    if not isinstance(data, dict):
        raise TypeError(f"config must be a mapping or a config object, got {type(config).__name__}")
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


class ModelIdentity(BaseModel):
    """What identifies the model whose KV a cache holds, beyond the cache layout.

    Attributes:
        name: the model's name or path (informative: it never identifies weights alone).
        config_digest: a digest (32 to 128 lowercase hex digits) of the effective model
            config, after the engine's overrides (:func:`config_digest`).
        revision: the weights' pinned revision (a commit), when known.
        weights_digest: a digest of the weights' index or files (hex), when known.
        dtype: the dtype the model computes in (``"bfloat16"``, ...).
        quantization: the quantization method (``"fp8"``, ``"awq"``, ...), ``None`` for none.
        tp_rank, tp_size: this shard's tensor-parallel rank and the tensor-parallel size.
        pp_rank, pp_size: its pipeline-parallel rank and the pipeline-parallel size.

    Raises:
        pydantic.ValidationError (a ``ValueError``): a missing or empty field, a wrong type
            (strict: ``True`` is not a rank), a rank outside ``[0, size)``, a digest that is
            not hex; the message names the field and the value.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str
    config_digest: str
    revision: str | None = None
    weights_digest: str | None = None
    dtype: str
    quantization: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @field_validator("name", "dtype", "revision", "quantization")
    @classmethod
    def _text(cls, value: str | None, info: Any) -> str | None:
        if value is not None and (not value.strip() or len(value) > 4096):
            raise ValueError(
                f"{info.field_name} must be non-empty text of at most 4096 characters, "
                f"got {value!r:.60}"
            )
        return value

    @field_validator("config_digest", "weights_digest")
    @classmethod
    def _hex(cls, value: str | None, info: Any) -> str | None:
        if value is not None and not _HEX.fullmatch(value):
            what = (
                "a digest of the effective model config, config_digest(...)"
                if info.field_name == "config_digest"
                else "a digest of the weights' index or files"
            )
            raise ValueError(
                f"{info.field_name} must be 32 to 128 lowercase hex digits ({what}), "
                f"got {value!r:.60}"
            )
        return value

    @model_validator(mode="after")
    def _ranks(self) -> ModelIdentity:
        for axis in ("tp", "pp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if size < 1:
                raise ValueError(f"{axis}_size must be >= 1, got {size}")
            if not 0 <= rank < size:
                raise ValueError(f"{axis}_rank must be in [0, {axis}_size={size}), got {rank}")
        return self

    def canonical(self) -> bytes:
        """The bytes :attr:`digest` hashes (module docstring)."""
        text = json.dumps(
            self.model_dump(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        )
        return _DOMAIN + struct.pack("<I", IDENTITY_VERSION) + text.encode()

    @property
    def digest(self) -> bytes:
        """SHA-256 of :meth:`canonical`: 32 bytes, equal in every process for equal fields."""
        return hashlib.sha256(self.canonical()).digest()

    def __str__(self) -> str:
        pinned = self.revision or (self.weights_digest or "")[:12] or "unpinned"
        quant = f", {self.quantization}" if self.quantization else ""
        return (
            f"{self.name}@{pinned} ({self.dtype}{quant}, tp {self.tp_rank}/{self.tp_size}, "
            f"pp {self.pp_rank}/{self.pp_size}, config {self.config_digest[:12]})"
        )
