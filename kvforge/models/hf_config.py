"""Build the ``layer id -> AttentionBackend`` mapping of a model from its Hugging Face config.

:func:`from_hf_config` reads the cache-relevant fields of a ``config.json`` (a dict, a path, or
the name of a config bundled under :mod:`kvforge.models.configs`) and returns one backend per
cache layer, as a :class:`~kvforge.models.base.ModelBackends` (a ``dict`` that also
carries the config's ``max_position_embeddings``). Layers of the same kind share one backend
instance. This is the top of :mod:`kvforge.models`; imports only go down from here:

- :mod:`~kvforge.models.base`: the builder contract (options, result, field validation);
- :mod:`~kvforge.models.reading`: config files, bundled names, nested text configs, dtypes;
- :mod:`~kvforge.models.families`, :mod:`~kvforge.models.deepseek`: the ``build_*`` builders;
- :mod:`~kvforge.models.bundled`: what kvforge registers; :mod:`~kvforge.models.registry`:
  the tables, seeded with it on import; :mod:`~kvforge.models.plugins`: loading plugins.

Dispatch goes through :mod:`kvforge.models.registry`: ``model_type`` selects a
registered builder; ``architectures`` is the fallback when the ``model_type`` is absent or not
registered. The bundled families register there like any plugin:

=======================================================  =====================================
``model_type`` (builder)                                 backend
=======================================================  =====================================
``llama`` (:func:`build_gqa`), ``mistral``, ``mixtral``  :class:`GQABackend` (MHA when
(:func:`build_mistral`), ``qwen2``, ``qwen2_moe``,       ``num_key_value_heads`` is absent)
``qwen3``, ``qwen3_moe`` (:func:`build_qwen`)
``deepseek_v2``, ``deepseek_v3`` (:func:`build_mla`)     :class:`MLABackend`
``deepseek_v32`` (:func:`build_dsa`; or V2/V3 with       :class:`DSABackend`
``index_head_dim``)
``deepseek_v4`` (:func:`build_deepseek_v4`)              :class:`DeepseekV4Backend`, one per
                                                         compress ratio in ``compress_ratios``
``glm4_moe_lite`` (``build_glm4_moe_lite``),             :class:`MLABackend` (GLM-5:
``glm_moe_dsa`` (``build_glm_moe_dsa``),                 :class:`DSABackend`); readers in
``kimi_k25`` (``build_kimi_k25``: its                    :mod:`~kvforge.models.mla_families`
``text_config``); Kimi-K2 (``kimi_k2``) plans by         (engines' defaults filled in)
its architecture, as ``deepseek_v3``
``falcon_h1``, ``nemotron_h``, ``granitemoehybrid``       :class:`GQABackend` and
(:mod:`~kvforge.models.mamba_hybrids`)                   :class:`Mamba2Backend`
``phi3``, ``olmo2``, ``minimax_m2``, ``mistral3``,       :class:`GQABackend`: readers in
``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe``,          :mod:`~kvforge.models.published_gqa`
``step3p5`` (``build_phi3``, ...)                        (engines' defaults filled in)
``qwen3_5``, ``qwen3_5_moe`` (and their ``_text``        :class:`GQABackend` and
types; ``build_qwen3_5``, ``build_qwen3_5_moe``)         :class:`LinearAttentionBackend`, as
                                                         Qwen3-Next
=======================================================  =====================================

The ``build_*`` functions are public so a plugin can register one of them for another
``model_type`` of the same shape (``register_model_type("internlm3", build_gqa, ...)``).

Rules a reader can check against the code:

- **Layer ids.** Main layers are ``0 .. num_hidden_layers - 1``. MTP / next-n layers
  (``num_nextn_predict_layers``, default 0) are cache layers only with
  ``num_speculative_tokens > 0`` (as in vLLM and SGLang, which allocate 61 cache layers for
  DeepSeek-V3 unless speculative decoding is on); they then have ids
  ``num_hidden_layers .. num_hidden_layers + n - 1``. GQA, MLA and DSA MTP layers use the main
  (full-attention) backend. A DeepSeek-V4 MTP layer ``k`` takes its ratio from
  ``compress_ratios[num_hidden_layers + k]`` when the list is that long, else ratio 0.
  Entries past the last cache layer are ignored (a published V4-Flash variant pads the list).
  A model has at most :data:`~kvforge.models.base.MAX_LAYERS` (4096) cache layers.
- **DSA indexers.** A DSA layer (``deepseek_v32``, ``glm_moe_dsa``) plans an indexer key
  beside its latent, except a main layer that reuses another layer's top-k
  (``index_topk_freq`` > 1 or an ``index_topk_pattern`` with ``"S"``, as GLM-5.2 publishes;
  :func:`~kvforge.models.deepseek.index_sharing_layers`): vLLM builds no indexer there, so
  it gets ``DSABackend(indexer=False)``, the latent only, in the same group.
- **GQA head counts.** ``num_key_value_heads`` defaults to ``num_attention_heads`` (MHA);
  ``head_dim`` defaults to ``hidden_size // num_attention_heads``. With tensor parallelism the
  cache holds ``max(1, num_key_value_heads // tp_size)`` kv heads per rank: ``tp_size`` must
  divide ``num_key_value_heads``, or (replication) ``num_key_value_heads`` must divide
  ``tp_size``. MLA, DSA and V4 caches hold one latent per token on every rank, whatever
  ``tp_size`` is.
- **Sliding windows (GQA).** When ``layer_types`` is present it decides per layer
  (``"full_attention"`` / ``"sliding_attention"``, the latter with window ``sliding_window``).
  Otherwise: Mistral / Mixtral slide on every layer when ``sliding_window`` is not null;
  Qwen2 / Qwen3 slide only when ``use_sliding_window`` is true, on layers
  ``>= max_window_layers`` (Hugging Face's rule); Llama never slides. A sliding layer gets a
  :class:`GQABackend` with ``sliding_window=W`` (group ``swa``), a full layer the plain one
  (group ``kv``).
- **Engine defaults.** A field a published config leaves out takes its Hugging Face
  configuration class's default, as the engines load it (Gemma-3's ``head_dim`` 256, not
  ``hidden_size // num_attention_heads``): :mod:`~kvforge.models.engine_defaults` copies them
  for Gemma-3 and the families of :mod:`~kvforge.models.published_gqa` and
  :mod:`~kvforge.models.published_hybrid`, whose docstrings give each family's window rule
  as vLLM's model code applies it (Phi-3, OLMo-2, MiniMax-M2, Mistral-Small-3.x, Qwen3-VL:
  every layer slides when ``sliding_window`` is set and there is no ``layer_types``; Step-3.5:
  ``layer_types`` only, its MTP layers keeping their own type).
- **Dtypes.** ``dtype="auto"`` (the default; ``None`` means the same) serves the model as the
  engines do (vLLM's ``_resolve_auto_dtype`` in ``vllm/config/model.py``, "Downcast for
  float32 models"): a ``float16`` or ``bfloat16`` ``torch_dtype`` (or ``dtype``) is kept, a
  ``float32``, missing or unknown one becomes ``"bfloat16"`` (Gemma-2-9B's published config
  says float32), and Gemma-2 / Gemma-3 / GLM-4, which vLLM never runs in float16, get
  ``"bfloat16"`` for a ``float16`` config too. An explicit ``dtype`` (``"float16"``,
  ``"bfloat16"``, ``"float32"`` or an alias) wins: ``dtype="float32"`` plans float32 on
  purpose. The model dtype is the cache dtype of GQA and MLA unless ``kv_cache_dtype`` says
  otherwise. ``kv_cache_dtype`` for GQA: ``None`` /
  ``"auto"`` (model dtype), a float dtype, ``"fp8"`` or ``"block_wise_fp8"``; for MLA: ``None``
  / ``"auto"``, a float dtype or ``"fp8"`` (576 fp8 values per token); for DSA and V4:
  ``"fp8"`` (default) or ``"bf16"``, and ``dtype`` does not apply (it is an error to set it).
- **DeepSeek-V4 ratios.** ``compress_ratios`` entries are 0, 4 or 128; an entry 1 (no
  compression, as some configs write it, e.g. vllm-ascend's ``[1, 1, 4, 128]``) loads as 0.
- **Per-layer shapes** (:mod:`~kvforge.models.per_layer`): ``nemotron-nas`` gives each
  layer its own kv heads and leaves out layers whose attention is ``no_op``; MiMo-V2
  (``mimo_v2_flash``, ``mimo_v2``) has window and full layers with their own kv heads and
  values narrower than keys (``GQABackend(head_dim_v=...)``); Gemma-4 full layers take
  ``global_head_dim``; the last ``num_kv_shared_layers`` layers of Gemma-3n and Gemma-4
  read an earlier layer's cache and own none (``kv_sharing``), so layer ids may have gaps.
- **Block sizes.** ``block_size`` defaults to 16 for GQA and 64 for MLA / DSA. DeepSeek-V4
  block sizes are fixed by its groups, so passing ``block_size`` for V4 is an error.
- **Mamba2 hybrids** (:mod:`~kvforge.models.mamba_hybrids`). A Mamba2 mixer keeps a conv and
  an SSM state per request (group ``mamba_state``, ``1 + num_speculative_tokens`` slots).
  Falcon-H1's layer ``i`` runs attention (cache layer ``i``) and a mixer (cache layer
  ``num_hidden_layers + i``, vLLM's numbering) in parallel; Nemotron-H's layer ``i`` is the
  ``i``-th entry of ``hybrid_override_pattern`` (``M`` mixer, ``*`` attention, MLP / MoE
  entries no cache layer); Granite-4.0-H's ``layer_types`` says ``mamba`` or ``attention``.
  ``mamba_cache_dtype`` / ``mamba_ssm_cache_dtype`` are vLLM's options: ``"auto"`` is the
  model dtype for the conv state and, for the SSM state, the conv dtype (Nemotron-H: the
  config's ``mamba_ssm_cache_dtype``, else float32). Draft layers are not planned for these
  families yet.
- **Gated DeltaNet state dtypes** (Qwen3-Next, Qwen3.5): the same two options, as vLLM's
  ``gated_delta_net_state_dtype``: the conv state takes ``mamba_cache_dtype`` (``"auto"``:
  the model dtype), the recurrent state ``mamba_ssm_cache_dtype`` (``"auto"``: Qwen3.5's
  config ``mamba_ssm_dtype`` when it states one, else the conv state's dtype). So by default
  Qwen3-Next keeps its recurrent state in the model dtype, as vLLM does; SGLang's float32 is
  ``mamba_ssm_cache_dtype="float32"`` (:func:`~kvforge.models.families.build_qwen3_next`).
  Either option is an error for a model without Mamba2 or linear-attention layers.

Every problem is a ``ValueError`` (or ``FileNotFoundError`` / ``TypeError``) whose message
names the field, its value and the model type. A builder that returns something other than
``{int >= 0: AttentionBackend}`` is a bug in that builder: ``TypeError``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.attn_backends.mamba import Mamba2Backend
from kvforge.models.base import MAX_LAYERS, ModelBackends, ModelOptions, short_repr
from kvforge.models.reading import (
    AUTO_DTYPE,
    MODEL_DTYPES,
    bundled_models,
    load_model_config,
    max_position_embeddings,
)
from kvforge.models.registry import RegisteredModelType, registered_model_types
from kvforge.specs import canonical_dtype

__all__ = ["ConfigSource", "bundled_models", "from_hf_config", "load_model_config"]

ConfigSource = Mapping[str, Any] | str | os.PathLike
"""What :func:`from_hf_config` reads: a parsed config, a path, or a bundled name."""

# ---------------------------------------------------------------------------------- dispatch


def _registration(config: Mapping[str, Any]) -> RegisteredModelType:
    types = registered_model_types()
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in types:
        return types[model_type]
    architectures = config.get("architectures")
    if isinstance(architectures, (list, tuple)):
        for arch in architectures:
            for entry in types.values():
                if isinstance(arch, str) and arch in entry.architectures:
                    return entry
    raise ValueError(
        f"unsupported model_type {short_repr(model_type)} (architectures "
        f"{short_repr(architectures)}); registered model_type values: {', '.join(types)}. "
        "To plan another, register a builder for it with "
        "kvforge.models.register_model_type (a plugin module loaded with kvforge --plugin, "
        "or an entry point of group kvforge.backends); worked example: examples/plugin/ in "
        "the kvforge repository"
    )


def _check_layer_counts(config: Mapping[str, Any]) -> None:
    """Refuse an absurd layer count before any builder loops over it."""
    for key in ("num_hidden_layers", "num_nextn_predict_layers"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LAYERS:
            raise ValueError(
                f"config field {key} = {short_repr(value)} is out of range: kvforge supports "
                f"at most {MAX_LAYERS} cache layers per model (MAX_LAYERS)"
            )


def _checked_result(result: object, entry: RegisteredModelType) -> dict[int, AttentionBackend]:
    """What a builder returned, checked: a builder that breaks its contract is a bug."""
    where = f"the builder of model_type {entry.model_type!r} ({entry.builder!r})"
    if not isinstance(result, Mapping):
        raise TypeError(f"{where} returned {type(result).__name__}, not a mapping")
    if not result:
        raise TypeError(f"{where} returned no layers")
    for layer, backend in result.items():
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise TypeError(f"{where} returned layer id {short_repr(layer)}; ids are ints >= 0")
        if not isinstance(backend, AttentionBackend):
            raise TypeError(
                f"{where} returned {type(backend).__name__} for layer {layer}, not an "
                "AttentionBackend"
            )
    if len(result) > MAX_LAYERS:
        raise ValueError(
            f"model_type {entry.model_type!r} has {len(result)} cache layers; kvforge supports "
            f"at most {MAX_LAYERS} (MAX_LAYERS)"
        )
    return {layer: result[layer] for layer in sorted(result)}


def _options(**kwargs: Any) -> ModelOptions:
    try:
        opts = ModelOptions(**kwargs)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(part) for part in err["loc"])
        raise ValueError(
            f"{field}={short_repr(err.get('input'))} is invalid: {err['msg']}"
        ) from None
    if opts.dtype == AUTO_DTYPE:
        # "auto" is the default: builders see None, so DSA / V4 (whose dtype is fixed) do
        # not refuse it and plugins written before "auto" keep working
        return opts.model_copy(update={"dtype": None})
    if opts.dtype is not None:
        try:
            name = canonical_dtype(opts.dtype)
        except ValueError:
            name = ""
        if name not in MODEL_DTYPES:
            raise ValueError(
                f"dtype={opts.dtype!r} is not a model dtype; use one of {list(MODEL_DTYPES)} "
                f"or {AUTO_DTYPE!r} (the default: as the engines serve the config's dtype)"
            )
        opts = opts.model_copy(update={"dtype": name})
    return opts


def from_hf_config(
    config: ConfigSource,
    *,
    block_size: int | None = None,
    dtype: str | None = AUTO_DTYPE,
    kv_cache_dtype: str | None = None,
    tp_size: int = 1,
    num_speculative_tokens: int = 0,
    mamba_cache_dtype: str | None = None,
    mamba_ssm_cache_dtype: str | None = None,
) -> ModelBackends:
    """The ``layer id -> backend`` mapping of a model, from its Hugging Face config.

    Args:
        config: the parsed ``config.json`` (a mapping), a path to it (or to the directory
            holding it), or the name of a bundled config (see :func:`bundled_models`).
        block_size: tokens per block; default 16 for GQA, 64 for MLA / DSA. Not allowed for
            DeepSeek-V4, whose groups fix their block sizes.
        dtype: model / cache dtype for GQA and MLA. ``"auto"`` (default; ``None`` too): as
            the engines serve the config's ``torch_dtype``, float32 downcast to
            ``"bfloat16"`` (vLLM's ``_resolve_auto_dtype``; see the module docstring). A
            dtype (``"float32"`` included) is used as given. Only ``"auto"`` is allowed for
            DSA and V4.
        kv_cache_dtype: cache storage (see the module docstring); default: the model dtype for
            GQA / MLA, ``"fp8"`` for DSA / V4.
        tp_size: tensor-parallel ranks; GQA caches hold ``max(1, kv_heads // tp_size)`` heads.
        num_speculative_tokens: draft tokens per step; the MTP layers
            (``num_nextn_predict_layers``) get caches only when it is > 0, and then the model
            must have some.
        mamba_cache_dtype, mamba_ssm_cache_dtype: Mamba2 / Gated DeltaNet state dtypes.

    Returns:
        A :class:`~kvforge.models.base.ModelBackends`: ``{layer_id: backend}``
        with ascending ids, main layers first, then MTP layers; layers of the same kind share
        one backend instance. It is a ``dict`` subclass (index it by layer id as before) that
        also carries ``model_type`` and the config's ``max_position_embeddings`` (``None``
        when absent), the default ``max_model_len`` of a memory plan.

    Raises:
        ValueError: an unsupported ``model_type``, a missing, null or invalid field, more than
            :data:`~kvforge.models.base.MAX_LAYERS` layers, an inconsistent config,
            or bad options (also one that does not apply to the model); the message names the
            field and the value.
        FileNotFoundError: ``config`` is a path or name that does not exist.
        TypeError: ``config`` is not a mapping, string or path; or a registered builder
            returned something other than ``{int >= 0: AttentionBackend}``.
    """
    config = _config_mapping(config)
    opts = _options(
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        tp_size=tp_size,
        num_speculative_tokens=num_speculative_tokens,
        mamba_cache_dtype=mamba_cache_dtype,
        mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
    )
    entry = _registration(config)
    _check_layer_counts(config)
    return _build(entry, config, opts)


def _check_mamba_options(result: object, model_type: str, opts: ModelOptions) -> None:
    """A Mamba state dtype option for a model without state layers (Mamba2 or linear
    attention) is an error, not a no-op."""
    state = (Mamba2Backend, LinearAttentionBackend)
    if isinstance(result, Mapping) and any(isinstance(b, state) for b in result.values()):
        return
    opts.refuse(
        model_type,
        "mamba_cache_dtype",
        "mamba_ssm_cache_dtype",
        why="the model has no Mamba2 or linear-attention layer",
    )


def _config_mapping(config: ConfigSource) -> Mapping[str, Any]:
    """``config`` as a parsed ``config.json``: a path or bundled name is loaded."""
    if isinstance(config, (str, os.PathLike)):
        return load_model_config(config)
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a mapping (a parsed config.json), a path or a bundled model "
            f"name, got {type(config).__name__}"
        )
    return config


def _build(
    entry: RegisteredModelType, config: Mapping[str, Any], opts: ModelOptions
) -> ModelBackends:
    """The registered builder's backends, checked, with the model's default length (the
    builder's own when it gives one)."""
    max_len = max_position_embeddings(config, entry.model_type)
    result = entry.builder(config, entry.model_type, opts)
    _check_mamba_options(result, entry.model_type, opts)
    if isinstance(result, ModelBackends) and result.max_position_embeddings is not None:
        max_len = result.max_position_embeddings
    return ModelBackends(
        _checked_result(result, entry), model_type=entry.model_type, max_position_embeddings=max_len
    )
