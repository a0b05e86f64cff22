"""The :class:`~kvforge.ModelIdentity` of a vLLM engine, from its ``VllmConfig``: what a remote
tier puts in every key and value header so engines serving other weights never share bytes
(``docs/tiered_store.md``, "What is in the key").

- ``name``: ``ModelConfig.model`` (a hub id or a path: informative, never enough alone);
- ``config_digest``: the effective Hugging Face config (``ModelConfig.hf_config``, after
  ``hf_overrides``; its path and ``transformers_version`` left out) and vLLM's own hash of the
  model config (``ModelConfig.compute_hash()``: architecture, dtype, quantization, ...);
- ``revision``: ``ModelConfig.revision`` when set;
- ``weights_digest``: for a local directory, its weight files (``*.safetensors``, ``*.bin``,
  ``*.pt``, ``*.pth``, ``*.gguf`` and their index): each file's name and size, and the blob it
  links to in a Hugging Face cache (named by its content's SHA-256) or else its modification
  time, so replaced weights at the same path get another identity. A hub id without a
  ``revision`` has none: pin a revision to share across machines safely;
- ``dtype``, ``quantization``: ``ModelConfig.dtype`` and ``ModelConfig.quantization``;
- ``tp_rank``/``tp_size``, ``pp_rank``/``pp_size``: from ``ParallelConfig`` (vLLM orders
  global ranks tensor-parallel innermost, then prefill context parallel, then pipeline).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kvforge._checks import ArgumentError
from kvforge.core.model_identity import ModelIdentity, config_digest

__all__ = ["model_identity", "weights_digest"]

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json")
_NOT_IDENTITY = ("_name_or_path", "transformers_version")


def weights_digest(model: str) -> str | None:
    """A SHA-256 (hex) over the weight files of the local directory ``model`` (module
    docstring), or ``None`` when ``model`` is not a directory or holds no weight files."""
    directory = Path(model)
    if not directory.is_dir():
        return None
    h = hashlib.sha256(b"kvforge-weights-v1\n")
    found = 0
    for path in sorted(directory.rglob("*")):
        if not path.name.endswith(_WEIGHTS) or not path.is_file():
            continue
        rel = path.relative_to(directory).as_posix()
        stat = path.stat()
        if path.is_symlink():  # a Hugging Face cache: the blob's name is its content digest
            what = os.path.basename(os.path.realpath(path))
        else:
            what = f"mtime_ns={stat.st_mtime_ns}"
        h.update(f"{rel}\0{stat.st_size}\0{what}\n".encode())
        found += 1
    return h.hexdigest() if found else None


def model_identity(vllm_config: Any) -> ModelIdentity:
    """The identity of the engine (this process's shard) that ``vllm_config`` describes.

    Raises:
        ArgumentError: ``vllm_config`` has no ``model_config`` or ``parallel_config``.
    """
    model_config = getattr(vllm_config, "model_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    if model_config is None or parallel is None:
        raise ArgumentError(
            "model_identity needs a VllmConfig with model_config and parallel_config, got "
            f"{type(vllm_config).__name__}"
        )
    hf = model_config.hf_config.to_dict()
    for key in _NOT_IDENTITY:
        hf.pop(key, None)
    digest = config_digest({"hf_config": hf, "vllm_model_config": model_config.compute_hash()})
    tp = int(parallel.tensor_parallel_size)
    pp = int(parallel.pipeline_parallel_size)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    rank = int(parallel.rank)
    quantization = model_config.quantization
    return ModelIdentity(
        name=str(model_config.model),
        config_digest=digest,
        revision=model_config.revision or None,
        weights_digest=weights_digest(str(model_config.model)),
        dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=str(quantization) if quantization else None,
        tp_rank=rank % tp,
        tp_size=tp,
        pp_rank=rank // (tp * pcp) % pp,
        pp_size=pp,
    )
