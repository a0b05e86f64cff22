"""Reading Hugging Face configs: files and bundled names, nested text configs, dtype rules.

What every family builder needs before it looks at its own fields: :func:`load_model_config`
reads a ``config.json`` (a path, a directory holding one, or the name of a config bundled
under :mod:`kvforge.models.configs`), :func:`text_config` finds the language model's fields
inside a multimodal wrapper, and the dtype rules turn a config's ``torch_dtype`` and the
``dtype`` / ``kv_cache_dtype`` options into cache dtypes:

- the model dtype is ``dtype`` when given (an explicit ``"float32"`` stays float32), else
  (``"auto"``, the default) the engines' rule, vLLM's ``_resolve_auto_dtype`` in
  ``vllm/config/model.py``: the config's ``torch_dtype`` (or ``dtype``) when it is a 16-bit
  dtype, with a float32, absent or unknown one downcast to ``"bfloat16"``, and ``"float16"``
  also served as ``"bfloat16"`` for the model types that refuse float16
  (:data:`FLOAT16_UNSUPPORTED`: Gemma-2, Gemma-3, GLM-4);
- a float ``kv_cache_dtype`` must be one of :data:`MODEL_DTYPES`; ``"fp8"`` spellings are
  :data:`FP8_NAMES`;
- latent caches (DSA, DeepSeek-V4) store ``"fp8"`` (default) or ``"bf16"``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from kvforge.models.base import short_repr
from kvforge.specs import canonical_dtype

__all__ = [
    "AUTO_DTYPE",
    "BF16_NAMES",
    "FLOAT16_UNSUPPORTED",
    "FP8_NAMES",
    "LATENT_DTYPE",
    "MODEL_DTYPES",
    "bundled_models",
    "float_cache_dtype",
    "latent_cache_dtype",
    "load_model_config",
    "max_position_embeddings",
    "model_dtype",
    "nested_errors",
    "text_config",
]

_BUNDLE_PACKAGE = "kvforge.models.configs"

MODEL_DTYPES = ("float16", "bfloat16", "float32")
"""Dtypes a model (and a float cache) may have."""
AUTO_DTYPE = "auto"
"""The ``dtype`` option that means "as the engines choose" (the default): see
:func:`model_dtype`."""
FLOAT16_UNSUPPORTED = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})
"""Model types vLLM does not run in float16 (``_FLOAT16_NOT_SUPPORTED_MODELS`` in
``vllm/config/model.py``, "Numerical instability"): ``"auto"`` serves them in bfloat16 even
when their config says float16."""
FP8_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn")
"""Spellings of ``kv_cache_dtype`` that mean an fp8 (e4m3) cache."""
BF16_NAMES = ("bf16", "bfloat16")
LATENT_DTYPE = "its cache dtype is set by kv_cache_dtype ('fp8' or 'bf16')"
"""Why ``dtype`` does not apply to DSA and DeepSeek-V4 (see :meth:`ModelOptions.refuse`)."""

# ---------------------------------------------------------------------------------- files


def bundled_models() -> list[str]:
    """Sorted names of the configs bundled with kvforge (file stems, e.g. ``"llama-3-8b"``)."""
    root = resources.files(_BUNDLE_PACKAGE)
    return sorted(
        entry.name.removesuffix(".json")
        for entry in root.iterdir()
        if entry.is_file() and entry.name.endswith(".json")
    )


def _read_json(text: str, origin: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{origin} is not valid JSON: {exc}") from None
    except RecursionError:
        # json's decoder recurses once per nesting level; no config nests more than a few.
        raise ValueError(
            f"{origin} nests JSON arrays or objects too deeply to be a model config"
        ) from None
    except ValueError as exc:  # e.g. an integer literal past Python's digit limit
        raise ValueError(f"{origin} is not a usable JSON config: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{origin} must hold a JSON object (a Hugging Face config), got {type(data).__name__}"
        )
    return data


def load_model_config(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """Read a model config: a path to a ``config.json`` (or to a directory holding one), or
    the name of a bundled config (see :func:`bundled_models`).

    An existing path wins over a bundled name.

    Raises:
        FileNotFoundError: nothing exists at the path and no bundled config has that name.
        ValueError: the file is not valid JSON, nests too deeply, or does not hold a JSON
            object.
        TypeError: the argument is neither a string nor a path.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"name_or_path must be a str or os.PathLike, got {type(name_or_path).__name__}"
        )
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"directory {str(name_or_path)!r} holds no config.json")
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: {exc}") from None
        return _read_json(text, f"config file {str(path)!r}")
    name = str(name_or_path)
    if isinstance(name_or_path, str) and name in bundled_models():
        text = resources.files(_BUNDLE_PACKAGE).joinpath(f"{name}.json").read_text("utf-8")
        return _read_json(text, f"bundled config {name!r}")
    raise FileNotFoundError(
        f"no config file at {name!r} and no bundled model config named {name!r}; "
        f"bundled: {bundled_models()}"
    )


# ---------------------------------------------------------------------------------- dtypes


def model_dtype(config: Mapping[str, Any], dtype: str | None, model_type: str = "") -> str:
    """The model dtype, as the engines serve the model.

    ``dtype`` (the option, already checked by ``from_hf_config``) wins when it names a dtype:
    an explicit ``"float32"`` stays float32. ``None`` or ``"auto"`` follows vLLM's
    ``_resolve_auto_dtype`` (``vllm/config/model.py``) on a platform with bfloat16 (its
    ``Platform.supported_dtypes`` lists bfloat16 first; CUDA from compute capability 8.0,
    x86 and aarch64 CPUs):

    - the config's ``torch_dtype`` / ``dtype`` (read as vLLM's ``get_torch_dtype`` does: a
      missing one counts as float32) is kept when it is ``float16`` or ``bfloat16``;
    - "Downcast for float32 models": float32 becomes the platform's first supported dtype,
      ``"bfloat16"``; so does a missing or unknown one;
    - ``float16`` becomes ``"bfloat16"`` for :data:`FLOAT16_UNSUPPORTED` (Gemma-2, Gemma-3,
      GLM-4), which vLLM filters out of the supported dtypes of those model types.

    vLLM prefers float16 for pooling models only; kvforge plans generative ones.
    """
    if dtype is not None and dtype != AUTO_DTYPE:
        return dtype
    name = _config_dtype(config)
    if name == "float16" and model_type not in FLOAT16_UNSUPPORTED:
        return name
    if name == "bfloat16":
        return name
    return "bfloat16"  # "Downcast for float32 models" (and for a missing or unknown dtype)


def _config_dtype(config: Mapping[str, Any]) -> str:
    """The config's ``torch_dtype`` (or ``dtype``, newer transformers) when it is one of
    :data:`MODEL_DTYPES`, else ``"float32"`` (vLLM's ``get_torch_dtype`` default)."""
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str):
            try:
                name = canonical_dtype(value)
            except ValueError:
                continue
            if name in MODEL_DTYPES:
                return name
    return "float32"


def latent_cache_dtype(kv_cache_dtype: str | None, model_type: str) -> Literal["fp8", "bf16"]:
    """DSA / V4: ``"fp8"`` or ``"bf16"``."""
    if kv_cache_dtype is None or kv_cache_dtype in FP8_NAMES:
        return "fp8"
    if kv_cache_dtype in BF16_NAMES:
        return "bf16"
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported for model_type {model_type!r}; "
        "use 'fp8' or 'bf16'"
    )


def float_cache_dtype(kv_cache_dtype: str, model_type: str, allowed: str) -> str:
    """The canonical name of a float ``kv_cache_dtype``; ``allowed`` lists, for the error,
    every value the family takes."""
    try:
        name = canonical_dtype(kv_cache_dtype)
    except ValueError:
        name = ""
    if name not in MODEL_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported for model_type "
            f"{model_type!r}; use {allowed}"
        )
    return name


# ---------------------------------------------------------------------------------- nesting
# Multimodal configs (``gemma3``, ``llama4``) nest the language model's fields under
# ``text_config``; the builders read them there and name the fields there in their errors.

_TEXT_PREFIXES = (
    ("config is missing ", "config.text_config is missing "),
    ("config has null for ", "config.text_config has null for "),
    ("config field ", "config field text_config."),
)


def text_config(config: Mapping[str, Any], model_type: str) -> Mapping[str, Any]:
    """The language model's fields: ``text_config`` when the config has one (multimodal
    wrappers), else the config itself. The wrapper's ``torch_dtype`` / ``dtype`` applies when
    ``text_config`` states none (published Gemma-3 and Llama-4 configs keep it outside)."""
    text = config.get("text_config")
    if text is None:
        return config
    if not isinstance(text, Mapping):
        raise ValueError(
            f"config field text_config = {short_repr(text)} is invalid for model_type "
            f"{model_type!r}: it must be a JSON object"
        )
    merged = dict(text)
    if merged.get("torch_dtype") is None and merged.get("dtype") is None:
        for key in ("torch_dtype", "dtype"):
            if config.get(key) is not None:
                merged[key] = config[key]
    return merged


def nested_errors(config: Mapping[str, Any], error: ValueError) -> ValueError:
    """``error`` with the field named inside ``text_config`` when the fields came from there."""
    message = str(error)
    if config.get("text_config") is not None:
        for old, new in _TEXT_PREFIXES:
            if message.startswith(old):
                return ValueError(new + message[len(old) :])
    return ValueError(message)


def max_position_embeddings(config: Mapping[str, Any], model_type: str) -> int | None:
    """The config's ``max_position_embeddings`` (``None`` when absent), checked."""
    value = config.get("max_position_embeddings")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"config field max_position_embeddings = {short_repr(value)} is invalid for "
            f"model_type {model_type!r}: it must be a positive integer"
        )
    return value
