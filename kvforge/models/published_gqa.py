"""Readers of published GQA-shaped families: Phi-3 / Phi-4, OLMo-2, MiniMax-M2,
Mistral-Small-3.x, Qwen2.5-VL, Qwen3-VL and Step-3.5.

Their caches are the ones :mod:`kvforge.models.families` already builds (a key and a value per
kv head, full or sliding-window); what differs is how their configs say it. Each reader takes
the language model's fields (``text_config`` of a multimodal wrapper, or the config itself),
fills what the config leaves out with the defaults of its Hugging Face configuration class
(:mod:`kvforge.models.engine_defaults`), and hands the result to a ``build_*`` of
:mod:`kvforge.models.families` under the rule vLLM's model code follows for the family:

- **vLLM's model-level window** (Phi-3 / Phi-4, OLMo-2, MiniMax-M2, Mistral-Small-3.x,
  Qwen3-VL): ``layer_types`` when present; otherwise, when ``sliding_window`` is set, every
  layer slides. vLLM's ``EngineArgs.create_engine_config`` (``vllm/engine/arg_utils.py``) puts
  the text config's ``sliding_window`` into ``CacheConfig.sliding_window`` when ``layer_types``
  is absent (or all sliding), and ``Attention.__init__``
  (``vllm/model_executor/layers/attention/attention.py``) uses it for every layer that states
  no window of its own; these families' attention classes state none. A window of 0 means
  none (:func:`~kvforge.models.engine_defaults.engine_window`). Phi-4-mini's published window
  (262,144) is wider than its context (131,072): vLLM still declares sliding-window layers,
  and so does kvforge.
- **Qwen's rule** (Qwen2.5-VL, whose language model is vLLM's ``Qwen2Model``): layers
  ``>= max_window_layers`` slide only with ``use_sliding_window``.
- **No window** (Qwen3-VL-MoE: ``Qwen3VLMoeTextConfig.__post_init__`` sets
  ``sliding_window`` to ``None``): only ``layer_types`` could make a layer slide.
- **Step-3.5** (:func:`build_step3p5`): ``layer_types`` with its ``sliding_window`` (512 in
  the published Step-3.5-Flash); kv heads are ``num_attention_groups``.

MiniMax-M2's ``num_mtp_modules`` are no cache layers: vLLM's ``MiniMaxM2ForCausalLM``
(``vllm/model_executor/models/minimax_m2.py``) skips their weights and declares no layer for
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import StrictStr

from kvforge.attn_backends.base import AttentionBackend
from kvforge.models.base import LayerFields, ModelBackends, ModelBuilder, ModelOptions, parse_fields
from kvforge.models.engine_defaults import (
    MINIMAX_M2,
    MINISTRAL3,
    MISTRAL,
    MISTRAL3_TEXT,
    OLMO2,
    PHI3,
    QWEN2_5_VL_TEXT,
    QWEN3_VL_MOE_TEXT,
    QWEN3_VL_TEXT,
    STEP3P5_TEXT,
    Defaults,
    engine_window,
    with_defaults,
)
from kvforge.models.families import build_gqa, build_mistral, build_qwen
from kvforge.models.reading import max_position_embeddings, nested_errors, text_config

__all__ = [
    "Step3p5Fields",
    "build_minimax_m2",
    "build_mistral3",
    "build_olmo2",
    "build_phi3",
    "build_qwen2_5_vl",
    "build_qwen3_vl",
    "build_qwen3_vl_moe",
    "build_step3p5",
    "read_language_model",
]


def read_language_model(
    config: Mapping[str, Any],
    model_type: str,
    options: ModelOptions,
    defaults: Defaults,
    builder: ModelBuilder,
    overrides: Mapping[str, Any] | None = None,
) -> ModelBackends:
    """``builder`` applied to the language model's fields with the class's ``defaults``.

    The fields are ``text_config`` when the config has one (errors then name
    ``text_config.<field>``), else the config itself; ``overrides`` replace fields whatever
    the config says (what a configuration class forces). The result carries the text
    config's ``max_position_embeddings`` (its default included).
    """
    text = text_config(config, model_type)
    try:
        fields = engine_window(with_defaults(text, defaults))
        fields.update(overrides or {})
        backends = builder(fields, model_type, options)
        max_len = max_position_embeddings(fields, model_type)
    except ValueError as exc:
        raise nested_errors(config, exc) from None
    return ModelBackends(backends, model_type=model_type, max_position_embeddings=max_len)


def build_phi3(config: Mapping[str, Any], model_type: str, options: ModelOptions) -> ModelBackends:
    """Phi-3 / Phi-4 (``phi3``): vLLM's model-level window (Phi-3-mini's 2,047 on every layer;
    Phi-4's ``null``: full attention)."""
    return read_language_model(config, model_type, options, PHI3, build_mistral)


def build_olmo2(config: Mapping[str, Any], model_type: str, options: ModelOptions) -> ModelBackends:
    """OLMo-2 (``olmo2``): full attention unless the config states a window."""
    return read_language_model(config, model_type, options, OLMO2, build_mistral)


def build_minimax_m2(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """MiniMax-M2.x (``minimax_m2``): full attention unless the config states a window."""
    return read_language_model(config, model_type, options, MINIMAX_M2, build_mistral)


_MISTRAL3_TEXT_TYPES: dict[str, Defaults] = {"mistral": MISTRAL, "ministral3": MINISTRAL3}


def build_mistral3(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Mistral-Small-3.x (``mistral3``): the ``text_config``'s own model type picks the class
    whose defaults apply (``"mistral"``, the default, or ``"ministral3"``); a wrapper with no
    ``text_config`` is the 24B default of ``Mistral3Config``. vLLM's model-level window."""
    text = config.get("text_config")
    if text is None:
        defaults = MISTRAL3_TEXT
    else:
        inner = text.get("model_type", "mistral") if isinstance(text, Mapping) else "mistral"
        if inner not in _MISTRAL3_TEXT_TYPES:
            raise ValueError(
                f"config field text_config.model_type = {inner!r} is not supported for "
                f"model_type {model_type!r}: use one of {sorted(_MISTRAL3_TEXT_TYPES)}"
            )
        defaults = _MISTRAL3_TEXT_TYPES[inner]
    return read_language_model(config, model_type, options, defaults, build_mistral)


def build_qwen2_5_vl(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Qwen2.5-VL (``qwen2_5_vl``): ``text_config`` (newer saves) or the top-level fields
    (the published configs), Qwen's sliding rule."""
    return read_language_model(config, model_type, options, QWEN2_5_VL_TEXT, build_qwen)


def build_qwen3_vl(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Qwen3-VL (``qwen3_vl``): its ``text_config``, vLLM's model-level window (published
    configs state none: full attention)."""
    return read_language_model(config, model_type, options, QWEN3_VL_TEXT, build_mistral)


def build_qwen3_vl_moe(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Qwen3-VL-MoE (``qwen3_vl_moe``): its ``text_config``; no window, whatever the config
    says (the configuration class drops it)."""
    return read_language_model(
        config, model_type, options, QWEN3_VL_MOE_TEXT, build_gqa, {"sliding_window": None}
    )


class Step3p5Fields(LayerFields):
    """Step-3.5's layer lists: ``layer_types`` (legacy saves pad it with one entry per MTP
    layer) and ``mtp_layer_types`` (newer saves)."""

    layer_types: list[StrictStr] | None = None
    mtp_layer_types: list[StrictStr] | None = None


def _step_layer_types(f: Step3p5Fields, model_type: str) -> tuple[list[str], list[str] | None]:
    """The main layers' types and the MTP layers' (``None``: the config does not say).

    As ``Step3p7TextConfig.__post_init__`` splits them: a ``layer_types`` of
    ``num_hidden_layers + num_nextn_predict_layers`` entries ends with the MTP layers'; an
    absent one is full attention everywhere, MTP layers included.
    """
    n, m = f.num_hidden_layers, f.num_nextn_predict_layers
    if f.layer_types is None:
        return ["full_attention"] * n, f.mtp_layer_types or ["full_attention"] * m
    if m and len(f.layer_types) == n + m:
        return list(f.layer_types[:n]), list(f.layer_types[n:])
    if len(f.layer_types) != n:
        raise ValueError(
            f"layer_types has {len(f.layer_types)} entries but num_hidden_layers={n} "
            f"(or {n} + num_nextn_predict_layers={m}) (model_type {model_type!r})"
        )
    return list(f.layer_types), f.mtp_layer_types


def _step_kv_heads(text: dict[str, Any], model_type: str) -> None:
    """``num_attention_groups`` is the kv head count (``Step3p7TextConfig.attribute_map``);
    a config that states both names must agree."""
    groups, heads = text.get("num_attention_groups"), text.get("num_key_value_heads")
    if groups is None:
        return
    if heads is not None and heads != groups:
        raise ValueError(
            f"config fields num_attention_groups = {groups!r} and num_key_value_heads = "
            f"{heads!r} disagree (model_type {model_type!r}): both name the kv head count"
        )
    text["num_key_value_heads"] = groups


def _step3p5_layers(
    text: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    fields = dict(text)
    _step_kv_heads(fields, model_type)
    fields = with_defaults(fields, STEP3P5_TEXT)
    f = parse_fields(Step3p5Fields, fields, model_type)
    mtp_ids = options.mtp_layer_ids(f.num_hidden_layers, f.num_nextn_predict_layers, model_type)
    main, mtp = _step_layer_types(f, model_type)
    if len(mtp_ids):
        if mtp is None or len(mtp) != len(mtp_ids):
            raise ValueError(
                f"mtp_layer_types = {mtp!r} does not give one type per MTP layer "
                f"(num_nextn_predict_layers={f.num_nextn_predict_layers}, model_type "
                f"{model_type!r}); vLLM reads the MTP layers' types from it"
            )
        main = main + mtp
    # one GQA model of main + MTP layers: vLLM's Step3p5MTP builds each MTP layer as a
    # Step3p5DecoderLayer of its own type (step3p5_mtp.py, step3p5.py: _get_layer_type)
    fields.update(layer_types=main, num_hidden_layers=len(main), num_nextn_predict_layers=0)
    return build_gqa(fields, model_type, options.model_copy(update={"num_speculative_tokens": 0}))


def build_step3p5(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Step-3.5 (``step3p5``; ``step3p7`` wraps it in a ``text_config``).

    What vLLM's ``Step3p5DecoderLayer`` (``vllm/model_executor/models/step3p5.py``) reads for
    the cache: ``num_attention_groups`` kv heads of ``head_dim``; ``layer_types`` (plus
    ``mtp_layer_types``), ``"sliding_attention"`` layers with window ``sliding_window``; it
    clears the model-level window, so nothing else slides. MTP layers
    (``num_nextn_predict_layers``, only with ``num_speculative_tokens``) take their own type
    from those lists, sliding ones included. ``num_sliding_attention_heads`` changes query
    heads only.
    """
    return read_language_model(config, model_type, options, {}, _step3p5_layers)
