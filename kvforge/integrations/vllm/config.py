"""kvforge's options inside vLLM's ``kv_connector_extra_config``: one ``"kvforge"`` object,
validated here; vLLM's own keys (``spec_name``, ``blocks_per_chunk``, ...) pass through to vLLM
untouched.

Example ``--kv-transfer-config``::

    {"kv_connector": "KVForgeConnector",
     "kv_connector_module_path": "kvforge.integrations.vllm",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"kvforge": {"host_bytes": 8589934592}}}

This module imports no vLLM code, so the options are checked (and documented) without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvforge._checks import ArgumentError

__all__ = ["DEFAULT_HOST_BYTES", "KVForgeOffloadOptions", "parse_options"]

#: the host budget when neither ``kvforge.host_bytes`` nor vLLM's ``cpu_bytes_to_use`` is given
DEFAULT_HOST_BYTES = 4 << 30


class KVForgeOffloadOptions(BaseModel):
    """The ``"kvforge"`` object of ``kv_connector_extra_config``; unknown keys are refused.

    Attributes:
        host_bytes: bytes of host pages, over every offloaded group (the pages of every group
            together never exceed it). ``None``: vLLM's ``cpu_bytes_to_use`` when given, else
            :data:`DEFAULT_HOST_BYTES` (4 GiB).
        gather_impl: the gather/scatter implementation for the worker's copies
            (:func:`kvforge.ops.resolve_impl`): ``"auto"`` (Triton on CUDA and Ascend, numba
            on CPU when installed, else torch), ``"torch"``, ``"cpu"`` or ``"triton"``.
        pin_memory: page-lock the host pages (default: exactly when CUDA is available; it
            makes device <-> host copies asynchronous).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    host_bytes: int | None = Field(default=None, gt=0, strict=True)
    gather_impl: str = Field(default="auto", pattern="^(auto|torch|cpu|triton)$")
    pin_memory: bool | None = Field(default=None, strict=True)


def parse_options(extra_config: Mapping[str, Any]) -> tuple[KVForgeOffloadOptions, int]:
    """``(options, host_bytes)`` from vLLM's ``kv_connector_extra_config``.

    Raises:
        ArgumentError: ``extra_config["kvforge"]`` is not an object, has an unknown key or a
            bad value (the message names the key and the value), or ``cpu_bytes_to_use`` is not
            a positive int.
    """
    raw = extra_config.get("kvforge", {})
    if not isinstance(raw, Mapping):
        raise ArgumentError(
            f"kv_connector_extra_config['kvforge'] must be an object, got {raw!r}"
        )
    try:
        options = KVForgeOffloadOptions.model_validate(dict(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        value = err.get("input")
        raise ArgumentError(
            f"kv_connector_extra_config['kvforge']['{key}']: {err['msg']} (got {value!r})"
        ) from None
    host_bytes = options.host_bytes
    if host_bytes is None:
        cpu_bytes = extra_config.get("cpu_bytes_to_use")
        if cpu_bytes is None:
            host_bytes = DEFAULT_HOST_BYTES
        elif isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int | float) or (
            int(cpu_bytes) != cpu_bytes or cpu_bytes <= 0
        ):
            raise ArgumentError(
                f"kv_connector_extra_config['cpu_bytes_to_use'] must be a positive int, "
                f"got {cpu_bytes!r}"
            )
        else:
            host_bytes = int(cpu_bytes)
    return options, host_bytes
