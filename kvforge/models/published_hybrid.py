"""Readers of published Gated DeltaNet hybrids built like Qwen3-Next: Qwen3.5 dense and MoE.

Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``: multimodal wrappers whose ``text_config`` is a
``qwen3_5_text`` / ``qwen3_5_moe_text``; text-only saves carry those types at the top)
interleaves full-attention layers with Gated DeltaNet layers exactly as Qwen3-Next does:
vLLM's ``Qwen3_5DecoderLayer`` subclasses ``Qwen3NextDecoderLayer`` and its state shapes are
``MambaStateShapeCalculator.gated_delta_net_state_shape`` of the same fields
(``vllm/model_executor/models/qwen3_5.py``, ``get_mamba_state_shape_from_config``). The
reader fills what the text config leaves out with its configuration class's defaults
(:data:`~kvforge.models.engine_defaults.QWEN3_5_TEXT`,
:data:`~kvforge.models.engine_defaults.QWEN3_5_MOE_TEXT`: ``full_attention_interval`` 4,
head_dim 256, ...) and builds with :func:`~kvforge.models.families.gated_deltanet_layers`.

Where Qwen3.5 differs from Qwen3-Next:

- **MTP layers** are counted by ``mtp_num_hidden_layers`` (vLLM's ``SpeculativeConfig``
  reads it for ``qwen3_5*``, ``vllm/config/speculative.py``); they are full attention.
- **Recurrent state dtype**: an ``"auto"`` ``mamba_ssm_cache_dtype`` (the default) takes
  the text config's ``mamba_ssm_dtype``
  (``Qwen3_5ForConditionalGenerationConfig.verify_and_update_config`` in
  ``vllm/model_executor/models/config.py``; the published configs say ``"float32"``), and
  without one the conv state's dtype (``MambaStateDtypeCalculator._mamba_state_dtype``); an
  explicit ``mamba_ssm_cache_dtype`` wins over the config, as in vLLM. The conv state takes
  ``mamba_cache_dtype`` (``"auto"``: the model dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvforge.attn_backends.base import AttentionBackend
from kvforge.models.base import ModelBackends, ModelOptions, short_repr
from kvforge.models.engine_defaults import QWEN3_5_MOE_TEXT, QWEN3_5_TEXT
from kvforge.models.families import gated_deltanet_layers
from kvforge.models.published_gqa import read_language_model
from kvforge.models.reading import MODEL_DTYPES
from kvforge.specs import canonical_dtype

__all__ = ["build_qwen3_5", "build_qwen3_5_moe"]


def _recurrent_auto(text: Mapping[str, Any], model_type: str) -> str | None:
    """The config's ``mamba_ssm_dtype`` (what vLLM's ``"auto"`` recurrent dtype becomes for
    Qwen3.5), or ``None`` when it states none (then the conv state's dtype, vLLM's rule)."""
    value = text.get("mamba_ssm_dtype")
    if value is None:
        return None
    try:
        name = canonical_dtype(value) if isinstance(value, str) else ""
    except ValueError:
        name = ""
    if name not in MODEL_DTYPES:
        raise ValueError(
            f"config field mamba_ssm_dtype = {short_repr(value)} is invalid for model_type "
            f"{model_type!r}: use one of {list(MODEL_DTYPES)}"
        )
    return name


def _qwen3_5_layers(
    text: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    fields = dict(text)
    if fields.get("num_nextn_predict_layers") is None:
        fields["num_nextn_predict_layers"] = fields.get("mtp_num_hidden_layers") or 0
    recurrent = _recurrent_auto(fields, model_type)
    return gated_deltanet_layers(fields, model_type, options, recurrent_auto=recurrent)


def build_qwen3_5(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Qwen3.5 dense (``qwen3_5`` with ``text_config``, or ``qwen3_5_text``)."""
    return read_language_model(config, model_type, options, QWEN3_5_TEXT, _qwen3_5_layers)


def build_qwen3_5_moe(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Qwen3.5 MoE (``qwen3_5_moe`` with ``text_config``, or ``qwen3_5_moe_text``)."""
    return read_language_model(config, model_type, options, QWEN3_5_MOE_TEXT, _qwen3_5_layers)
