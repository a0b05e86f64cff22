"""kvforge's options inside vLLM's ``kv_connector_extra_config``: one ``"kvforge"`` object,
validated here for type and against the machine; vLLM's own keys (``spec_name``,
``blocks_per_chunk``, ...) pass through to vLLM untouched.

Example ``--kv-transfer-config``::

    {"kv_connector": "KVForgeConnector",
     "kv_connector_module_path": "kvforge.integrations.vllm",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"kvforge": {"host_bytes": 8589934592}}}

Every option is checked once, at engine start (the spec's construction), for its type and
against this machine (:class:`MachineFacts`: where the KV caches live, whether an accelerator
is present, the host memory, the gather implementations that run here). A bad value is one
:class:`~kvforge._checks.ArgumentError` of the form
``kvforge option 'pin_memory'=True: this machine has no accelerator; ...``: the key, the value
and what this machine supports. Each option's machine rule is a row of :data:`MACHINE_RULES`
(a test checks that every option has one).

This module imports no vLLM code, so the options are checked (and documented) without vLLM.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvforge._checks import ArgumentError
from kvforge.ops import available_impls, resolve_impl
from kvforge.platform import DEVICE_TYPES, detect_device_type, device_memory_capacity

__all__ = [
    "DEFAULT_HOST_BYTES",
    "MACHINE_RULES",
    "KVForgeOffloadOptions",
    "MachineFacts",
    "check_gather_impl",
    "option_error",
    "parse_options",
]

#: the host budget when neither ``kvforge.host_bytes`` nor vLLM's ``cpu_bytes_to_use`` is given
DEFAULT_HOST_BYTES = 4 << 30


class KVForgeOffloadOptions(BaseModel):
    """The ``"kvforge"`` object of ``kv_connector_extra_config``; unknown keys are refused.

    Attributes:
        host_bytes: bytes of host pages, over every offloaded group (the pages of every group
            together never exceed it), allocated by each worker process. ``None``: vLLM's
            ``cpu_bytes_to_use`` when given, else :data:`DEFAULT_HOST_BYTES` (4 GiB). At most
            this machine's memory.
        gather_impl: the gather/scatter implementation for the worker's copies
            (:func:`kvforge.ops.resolve_impl`): ``"auto"`` (Triton on CUDA and Ascend, numba
            on CPU when installed, else torch), ``"torch"``, ``"cpu"`` or ``"triton"``; an
            explicit name must run where the KV caches live.
        pin_memory: page-lock the host pages (default: exactly when the KV caches live on an
            accelerator; it makes device <-> host copies asynchronous). ``True`` needs CUDA or
            an Ascend NPU on this machine.
        remote: a remote tier behind the host pages: the fields of
            :class:`~kvforge.store.config.StoreConfig` (``backend`` ``"redis"`` or
            ``"mooncake"``, ...), checked with vLLM's ``kv_role`` by
            :mod:`~kvforge.integrations.vllm.remote_options`; its client library must be
            installed here. ``None``: host pages only.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    host_bytes: int | None = Field(default=None, gt=0, strict=True)
    gather_impl: str = Field(default="auto", pattern="^(auto|torch|cpu|triton)$")
    pin_memory: bool | None = Field(default=None, strict=True)
    remote: dict[str, Any] | None = Field(default=None, strict=True)


#: what each option's value must be, said when its type or form is wrong
_TYPE_RULES = {
    "host_bytes": "must be a positive int (bytes) or null",
    "gather_impl": "must be one of 'auto', 'torch', 'cpu', 'triton'",
    "pin_memory": "must be true, false or null",
    "remote": "must be an object of StoreConfig fields or null",
}


@dataclass(frozen=True)
class MachineFacts:
    """What this machine offers the options (from :mod:`kvforge.platform` and
    :mod:`kvforge.ops`).

    Attributes:
        device_type: where the engine's KV caches live: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        accelerator: ``"cuda"`` or ``"npu"`` when this machine has one, else ``None``.
        host_memory: this machine's memory in bytes (``None``: unknown).
        gather_impls: the gather/scatter implementations that run on ``device_type`` here.
    """

    device_type: str
    accelerator: str | None
    host_memory: int | None
    gather_impls: tuple[str, ...]

    @classmethod
    def detect(cls, device_type: str | None = None) -> MachineFacts:
        """This machine's facts for KV caches on ``device_type`` (``None``: the best device
        here, :func:`kvforge.platform.detect_device_type`)."""
        best = detect_device_type()
        device_type = device_type if device_type in DEVICE_TYPES else best
        return cls(
            device_type=device_type,
            accelerator=None if best == "cpu" else best,
            host_memory=device_memory_capacity("cpu"),
            gather_impls=tuple(available_impls(torch.device(device_type))),
        )


def option_error(key: str, value: object, why: str, default: bool = False) -> ArgumentError:
    """The one error an option gets: ``kvforge option 'key'=value: why``."""
    shown = f"{value!r} (the default)" if default else repr(value)
    return ArgumentError(f"kvforge option {key!r}={shown}: {why}")


def _host_bytes_rule(value: int, machine: MachineFacts) -> str | None:
    if machine.host_memory is not None and value > machine.host_memory:
        return (
            f"this machine has {machine.host_memory:,} bytes of memory; each worker process "
            f"allocates its host pages in it: set a smaller budget"
        )
    return None


def check_gather_impl(value: str, device: torch.device | str) -> str:
    """The concrete implementation ``value`` means for KV caches on ``device`` (a worker's
    caches, at its initialization).

    Raises:
        ArgumentError: ``value`` cannot run on ``device`` on this machine (the message lists
            what does).
    """
    try:
        return resolve_impl(value, device)
    except (TypeError, ValueError, RuntimeError) as exc:
        runs = ", ".join(repr(i) for i in available_impls(device)) or "none"
        raise option_error(
            "gather_impl",
            value,
            f"the KV caches are on {torch.device(device).type}, where this machine runs "
            f"{runs} ('auto' picks the fastest): {exc}",
        ) from None


def _gather_impl_rule(value: str, machine: MachineFacts) -> str | None:
    if value == "auto" or value in machine.gather_impls:
        return None
    runs = ", ".join(repr(i) for i in machine.gather_impls) or "none"
    detail = ""
    try:
        resolve_impl(value, machine.device_type)
    except (TypeError, ValueError, RuntimeError) as exc:
        detail = f": {exc}"
    return (
        f"the KV caches are on {machine.device_type}, where this machine runs {runs} ('auto' "
        f"picks the fastest){detail}"
    )


def _pin_memory_rule(value: bool | None, machine: MachineFacts) -> str | None:
    if value is True and machine.accelerator is None:
        return (
            "this machine has no accelerator; pinned host memory needs CUDA or an Ascend NPU "
            "(leave it unset: kvforge pins exactly when the KV caches are on one)"
        )
    return None


#: the client library each remote backend needs (pip extra, import name)
_REMOTE_CLIENTS = {"redis": ("redis", "redis"), "mooncake": ("mooncake", "mooncake.store")}


def _remote_rule(value: Mapping[str, Any] | None, machine: MachineFacts) -> str | None:
    backend = value.get("backend") if isinstance(value, Mapping) else None
    if not isinstance(backend, str) or backend not in _REMOTE_CLIENTS:
        return None  # no remote tier, or a backend remote_options refuses by name
    extra, module = _REMOTE_CLIENTS[backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return (
            f"backend {backend!r} needs its client library, not installed on this machine: "
            f"pip install 'kvforge[{extra}]'"
        )
    return None


#: option -> its rule against the machine: the reason a value cannot run here, or ``None``
MACHINE_RULES: dict[str, Callable[[Any, MachineFacts], str | None]] = {
    "host_bytes": _host_bytes_rule,
    "gather_impl": _gather_impl_rule,
    "pin_memory": _pin_memory_rule,
    "remote": _remote_rule,
}


def _validate(raw: Mapping[str, Any]) -> KVForgeOffloadOptions:
    for key in raw:
        if key not in KVForgeOffloadOptions.model_fields:
            names = ", ".join(repr(k) for k in KVForgeOffloadOptions.model_fields)
            raise option_error(str(key), raw[key], f"no such option; kvforge's options are {names}")
    try:
        return KVForgeOffloadOptions.model_validate(dict(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0])
        raise option_error(key, raw[key], _TYPE_RULES[key]) from None


def _cpu_bytes(value: object) -> int:
    ok = (
        isinstance(value, Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
        and (isinstance(value, Integral) or float(value).is_integer())
    )
    if not ok:
        raise ArgumentError(
            f"kv_connector_extra_config option 'cpu_bytes_to_use'={value!r}: must be a positive "
            "whole number of bytes (kvforge's host budget when 'kvforge.host_bytes' is not set)"
        )
    return int(value)  # type: ignore[arg-type]


def parse_options(
    extra_config: Mapping[str, Any], machine: MachineFacts | None = None
) -> tuple[KVForgeOffloadOptions, int]:
    """``(options, host_bytes)`` from vLLM's ``kv_connector_extra_config``, every option
    checked for type and against ``machine`` (``None``: :meth:`MachineFacts.detect`).

    Raises:
        ArgumentError: ``extra_config["kvforge"]`` is not an object, has an unknown key, a
            value of the wrong type or form, or one this machine cannot run (the message names
            the key, the value and what the machine supports); or ``cpu_bytes_to_use`` is not
            a positive whole number (NaN and infinity included).
    """
    raw = extra_config.get("kvforge", {})
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ArgumentError(f"kv_connector_extra_config['kvforge'] must be an object, got {raw!r}")
    options = _validate(raw)
    machine = machine or MachineFacts.detect()
    host_bytes = options.host_bytes
    default = False
    if host_bytes is None:
        cpu_bytes = extra_config.get("cpu_bytes_to_use")
        if cpu_bytes is None:
            host_bytes, default = DEFAULT_HOST_BYTES, True
        else:
            host_bytes = _cpu_bytes(cpu_bytes)
            why = _host_bytes_rule(host_bytes, machine)
            if why is not None:
                raise ArgumentError(
                    f"kv_connector_extra_config option 'cpu_bytes_to_use'={cpu_bytes!r}: {why}"
                )
    values = {**options.model_dump(), "host_bytes": host_bytes}
    for key, rule in MACHINE_RULES.items():
        if key == "host_bytes" and options.host_bytes is None and not default:
            continue  # cpu_bytes_to_use, checked above under its own name
        why = rule(values[key], machine)
        if why is not None and key == "remote":  # name the field: the entry holds secrets
            raise option_error("remote.backend", values[key]["backend"], why)
        if why is not None:
            raise option_error(key, values[key], why, default=key == "host_bytes" and default)
    return options, host_bytes
