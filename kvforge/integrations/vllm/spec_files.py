"""vLLM specs as JSON (``kvforge plan --vllm-specs PATH``): :func:`dump_vllm_specs` writes a
model's per-layer specs as plain data of format :data:`SPECS_FORMAT`, :func:`load_vllm_specs`
reads them back, refusing (naming the layer and field) a type kvforge does not plan, a field of
the wrong kind, or a spec vLLM itself refuses. ``tests/integrations/test_vllm_specs.py`` round
trips every bundled model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    KVCacheSpec,
    KVQuantMode,
    SparseCacheRole,
)

from kvforge._checks import ArgumentError
from kvforge.integrations.vllm.spec_backend import SUPPORTED_SPECS
from kvforge.specs import (
    canonical_dtype,
    torch_dtype,
)

SPECS_FORMAT = "kvforge.vllm_specs/1"
"""The ``format`` of :func:`dump_vllm_specs`'s dict."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, SparseCacheRole):
        return value.value
    if isinstance(value, KVQuantMode | MambaAttentionBackendEnum):
        return value.name
    if isinstance(value, Fraction):
        return str(value) if value.denominator != 1 else int(value)
    if isinstance(value, MultipleOf):
        return {"multiple_of": value.base}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def dump_vllm_specs(specs: Mapping[str, KVCacheSpec]) -> dict[str, Any]:
    """``specs`` as a JSON-ready dict, for :func:`load_vllm_specs` and
    ``kvforge plan --vllm-specs``. From a running engine, one call::

        json.dump(dump_vllm_specs(llm.llm_engine.model_executor.driver_worker.worker
                                  .model_runner.get_kv_cache_spec()), open("specs.json", "w"))

    Format: ``{"format": SPECS_FORMAT, "layers": {name: {"type": class name, field:
    value, ...}}}`` with each spec's constructor fields that differ from their defaults;
    dtypes as names (``"bfloat16"``), ``kv_quant_mode`` / ``mamba_type`` by member name,
    ``cache_role`` by value, a fractional ``tokens_per_state`` as ``"1/4"``.

    Raises:
        ArgumentError: a layer whose spec type is not one of :data:`SUPPORTED_SPECS`.
    """
    if not isinstance(specs, Mapping):
        raise ArgumentError(f"specs must be a mapping, got {type(specs).__name__}")
    layers: dict[str, Any] = {}
    for name, spec in specs.items():
        if type(spec) not in SUPPORTED_SPECS:
            raise ArgumentError(
                f"layer {name!r}: cannot dump a {type(spec).__name__}; kvforge reads "
                f"{', '.join(t.__name__ for t in SUPPORTED_SPECS)}"
            )
        entry: dict[str, Any] = {"type": type(spec).__name__}
        for f in dataclasses.fields(spec):
            if not f.init or f.name == "is_draft":
                continue
            value = getattr(spec, f.name)
            if (
                f.default is not dataclasses.MISSING
                and value == f.default
                and (type(value) is type(f.default))
            ):
                continue
            entry[f.name] = _jsonable(value)
        layers[str(name)] = entry
    return {"format": SPECS_FORMAT, "layers": layers}


_ENUMS: dict[str, Any] = {
    "kv_quant_mode": lambda v: KVQuantMode[v],
    "mamba_type": lambda v: MambaAttentionBackendEnum[v],
    "cache_role": SparseCacheRole,
}


def _field_value(where: str, field: str, annotation: str, value: Any) -> Any:
    """``value`` of a dumped spec field as the constructor takes it, or one error line."""

    def bad(expected: str) -> ArgumentError:
        return ArgumentError(f"{where}: field {field!r} must be {expected}, got {value!r}")

    if value is None:
        if "None" not in annotation:
            raise bad("given (not null)")
        return None
    if field in ("dtype", "dtypes"):
        names = value if field == "dtypes" and isinstance(value, list) else [value]
        try:
            dtypes = tuple(torch_dtype(canonical_dtype(v)) for v in names)
        except ValueError:
            what = "a list of dtype names" if field == "dtypes" else "a dtype name"
            raise bad(what + " such as 'bfloat16'") from None
        return dtypes if field == "dtypes" else dtypes[0]
    if field == "shapes":
        if not isinstance(value, list) or not all(
            isinstance(s, list) and all(type(d) is int and d >= 0 for d in s) for s in value
        ):
            raise bad("a list of shapes (lists of ints >= 0)")
        return tuple(tuple(s) for s in value)
    if field in _ENUMS:
        try:
            return _ENUMS[field](value)
        except (KeyError, ValueError, TypeError):
            raise bad(
                "a member name such as 'NONE'"
                if field != "cache_role"
                else f"one of {[r.value for r in SparseCacheRole]}"
            ) from None
    if field == "tokens_per_state" and isinstance(value, str):
        try:
            number = Fraction(value)
        except ValueError:
            raise bad("an int or a fraction string such as '1/4'") from None
        return int(number) if number.denominator == 1 else number
    if field == "block_stride_alignment" and isinstance(value, dict):
        if set(value) != {"multiple_of"} or type(value["multiple_of"]) is not int:
            raise bad('an int or {"multiple_of": int}')
        return MultipleOf(value["multiple_of"])
    if annotation.startswith("bool") and not isinstance(value, bool):
        raise bad("true or false")
    if annotation.startswith("int") and (type(value) is not int or value < 0):
        raise bad("an int >= 0")
    if annotation.startswith("str") and not isinstance(value, str):
        raise bad("a string")
    return value


def load_vllm_specs(data: Mapping[str, Any]) -> dict[str, KVCacheSpec]:
    """The specs :func:`dump_vllm_specs` wrote: ``{layer name: spec}``.

    Raises:
        ArgumentError: one line naming the layer, the field and the value: not a dump (no
            ``layers``, another ``format``), an unknown spec type or field, a value of the
            wrong kind, or a spec vLLM itself refuses.
    """
    if not isinstance(data, Mapping):
        raise ArgumentError(f"vLLM specs must be a JSON object, got {type(data).__name__}")
    if data.get("format", SPECS_FORMAT) != SPECS_FORMAT:
        raise ArgumentError(f"format must be {SPECS_FORMAT!r}, got {data['format']!r}")
    layers = data.get("layers")
    if not isinstance(layers, Mapping) or not layers:
        raise ArgumentError(
            f"vLLM specs need a non-empty object 'layers' of layer name -> spec fields, got "
            f"{layers!r}"[:200]
        )
    types = {t.__name__: t for t in SUPPORTED_SPECS}
    out: dict[str, KVCacheSpec] = {}
    for name, entry in layers.items():
        where = f"layer {name!r}"
        if not isinstance(entry, Mapping):
            raise ArgumentError(f"{where}: must be an object of spec fields, got {entry!r}")
        kind = entry.get("type")
        if kind not in types:
            raise ArgumentError(
                f"{where}: field 'type' must be one of {sorted(types)}, got {kind!r}"
            )
        cls = types[kind]
        init = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "is_draft"}
        kwargs: dict[str, Any] = {}
        for field, value in entry.items():
            if field == "type":
                continue
            if field not in init:
                raise ArgumentError(
                    f"{where}: {kind} has no field {field!r} (fields: {', '.join(init)})"
                )
            kwargs[field] = _field_value(where, field, str(init[field].type), value)
        try:
            out[name] = cls(**kwargs)
        except (TypeError, ValueError, AssertionError, KeyError) as exc:
            message = str(exc).strip() or type(exc).__name__
            raise ArgumentError(f"{where}: vLLM refuses this {kind}: {message}") from None
    return out
