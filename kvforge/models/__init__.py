"""Models: Hugging Face configs to layer -> backend maps, the registries, plugins, bundled configs.

:func:`from_hf_config` reads a ``config.json`` (or a bundled name such as
``"deepseek-v4-flash"``) and returns one backend per cache layer. A plugin registers its
backends and model types with :func:`register_backend` / :func:`register_model_type` and
writes its builders with :class:`ModelOptions`, :func:`parse_fields` and
:class:`ModelBackends`; the ``build_*`` functions of the bundled families can be registered
for other model types of the same shape. Names are loaded on first use.

Modules, bottom to top (imports only go down): ``base`` (the builder contract), ``reading``
(config files, dtype rules), ``engine_defaults`` (the configuration classes' defaults),
``families`` / ``deepseek`` / ``published_gqa`` / ``published_hybrid`` / ``mamba_hybrids``
(builders),
``bundled`` (what kvforge registers), ``registry`` (the tables, seeded on import),
``plugins``, ``hf_config`` (:func:`from_hf_config`).
"""

from __future__ import annotations

from kvforge._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "MAX_LAYERS": "kvforge.models.base",
    "LayerFields": "kvforge.models.base",
    "ModelBackends": "kvforge.models.base",
    "ModelBuilder": "kvforge.models.base",
    "ModelOptions": "kvforge.models.base",
    "parse_fields": "kvforge.models.base",
    "bundled_models": "kvforge.models.reading",
    "load_model_config": "kvforge.models.reading",
    "build_deepseek_v4": "kvforge.models.deepseek",
    "build_dsa": "kvforge.models.deepseek",
    "build_mla": "kvforge.models.deepseek",
    "build_glm4_moe_lite": "kvforge.models.mla_families",
    "build_glm_moe_dsa": "kvforge.models.mla_families",
    "build_kimi_k25": "kvforge.models.mla_families",
    "build_gemma2": "kvforge.models.families",
    "build_gemma3": "kvforge.models.families",
    "build_gpt_oss": "kvforge.models.families",
    "build_gqa": "kvforge.models.families",
    "build_llama4": "kvforge.models.families",
    "build_mistral": "kvforge.models.families",
    "build_qwen": "kvforge.models.families",
    "build_qwen3_next": "kvforge.models.families",
    "build_minimax_m2": "kvforge.models.published_gqa",
    "build_mistral3": "kvforge.models.published_gqa",
    "build_olmo2": "kvforge.models.published_gqa",
    "build_phi3": "kvforge.models.published_gqa",
    "build_qwen2_5_vl": "kvforge.models.published_gqa",
    "build_qwen3_vl": "kvforge.models.published_gqa",
    "build_qwen3_vl_moe": "kvforge.models.published_gqa",
    "build_step3p5": "kvforge.models.published_gqa",
    "build_qwen3_5": "kvforge.models.published_hybrid",
    "build_qwen3_5_moe": "kvforge.models.published_hybrid",
    "build_gemma3n": "kvforge.models.per_layer",
    "build_gemma4": "kvforge.models.per_layer",
    "build_mimo_v2": "kvforge.models.per_layer",
    "build_nemotron_nas": "kvforge.models.per_layer",
    "kv_sharing": "kvforge.models.per_layer",
    "build_falcon_h1": "kvforge.models.mamba_hybrids",
    "build_granite_hybrid": "kvforge.models.mamba_hybrids",
    "build_nemotron_h": "kvforge.models.mamba_hybrids",
    "register_backend": "kvforge.models.registry",
    "register_model_type": "kvforge.models.registry",
    "registered_backends": "kvforge.models.registry",
    "registered_model_types": "kvforge.models.registry",
    "PluginError": "kvforge.models.plugins",
    "load_plugins": "kvforge.models.plugins",
    "from_hf_config": "kvforge.models.hf_config",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("kvforge.models", globals(), _EXPORTS)
