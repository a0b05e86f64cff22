"""Attention backends: each variant declares its caches; see :class:`AttentionBackend`.

Backends and Hugging Face model types are registered in :mod:`.registry` (the bundled ones
as well as those of plugins); :func:`from_hf_config` dispatches through it.
"""

from kvforge.attn_backends.base import AttentionBackend, DeclaredBackend, SwapContext
from kvforge.attn_backends.deepseek_v4 import DeepseekV4Backend
from kvforge.attn_backends.dsa import DSABackend
from kvforge.attn_backends.gqa import GQABackend, MHABackend
from kvforge.attn_backends.hf_config import bundled_models, from_hf_config, load_model_config
from kvforge.attn_backends.mla import MLABackend
from kvforge.attn_backends.registry import (
    MAX_LAYERS,
    ModelBackends,
    ModelOptions,
    PluginError,
    load_plugins,
    register_backend,
    register_model_type,
    registered_backends,
    registered_model_types,
)

__all__ = [
    "MAX_LAYERS",
    "AttentionBackend",
    "DSABackend",
    "DeclaredBackend",
    "DeepseekV4Backend",
    "GQABackend",
    "MHABackend",
    "MLABackend",
    "ModelBackends",
    "ModelOptions",
    "PluginError",
    "SwapContext",
    "bundled_models",
    "from_hf_config",
    "load_model_config",
    "load_plugins",
    "register_backend",
    "register_model_type",
    "registered_backends",
    "registered_model_types",
]
