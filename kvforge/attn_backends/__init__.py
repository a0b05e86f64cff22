"""Attention backends: each variant declares its caches; see :class:`AttentionBackend`.

This package holds declarations only. Hugging Face configs, the registry of backends and model
types, and plugins live one floor up, in :mod:`kvforge.models`.

Names are loaded on first use: importing the contract (:mod:`.base`) or this package loads
no concrete backend, so the modules that need only the contract stay free of every variant.
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
    "MHABackend": "kvforge.attn_backends.gqa",
    "LINEAR_STATE_GROUP": "kvforge.attn_backends.linear_attention",
    "LinearAttentionBackend": "kvforge.attn_backends.linear_attention",
    "MAMBA_STATE_GROUP": "kvforge.attn_backends.mamba",
    "Mamba2Backend": "kvforge.attn_backends.mamba",
    "MLABackend": "kvforge.attn_backends.mla",
    "SwapContext": "kvforge.attn_backends.base",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("kvforge.attn_backends", globals(), _EXPORTS)
