"""Attention backends: each variant declares its caches; see :class:`AttentionBackend`.

Backends and Hugging Face model types are registered in :mod:`.registry` (the bundled ones
as well as those of plugins); :func:`from_hf_config` dispatches through it.

Names are loaded on first use: importing the contract (:mod:`.base`) or this package loads
no concrete backend, so the controller's modules, which need only the contract, stay free
of every variant.
"""

from __future__ import annotations

from kvforge._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "AttentionBackend": "kvforge.attn_backends.base",
    "DSABackend": "kvforge.attn_backends.dsa",
    "DeclaredBackend": "kvforge.attn_backends.base",
    "DeepseekV4Backend": "kvforge.attn_backends.deepseek_v4",
    "GQABackend": "kvforge.attn_backends.gqa",
    "MAX_LAYERS": "kvforge.attn_backends.registry",
    "MHABackend": "kvforge.attn_backends.gqa",
    "LINEAR_STATE_GROUP": "kvforge.attn_backends.linear_attention",
    "LinearAttentionBackend": "kvforge.attn_backends.linear_attention",
    "MLABackend": "kvforge.attn_backends.mla",
    "ModelBackends": "kvforge.attn_backends.registry",
    "ModelOptions": "kvforge.attn_backends.registry",
    "PluginError": "kvforge.attn_backends.registry",
    "SwapContext": "kvforge.attn_backends.base",
    "bundled_models": "kvforge.attn_backends.hf_config",
    "from_hf_config": "kvforge.attn_backends.hf_config",
    "load_model_config": "kvforge.attn_backends.hf_config",
    "load_plugins": "kvforge.attn_backends.registry",
    "register_backend": "kvforge.attn_backends.registry",
    "register_model_type": "kvforge.attn_backends.registry",
    "registered_backends": "kvforge.attn_backends.registry",
    "registered_model_types": "kvforge.attn_backends.registry",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("kvforge.attn_backends", globals(), _EXPORTS)
