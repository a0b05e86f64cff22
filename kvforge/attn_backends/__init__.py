"""Attention backends: each variant declares its caches; see :class:`AttentionBackend`."""

from kvforge.attn_backends.base import AttentionBackend, DeclaredBackend, SwapContext
from kvforge.attn_backends.deepseek_v4 import DeepseekV4Backend
from kvforge.attn_backends.dsa import DSABackend
from kvforge.attn_backends.gqa import GQABackend, MHABackend
from kvforge.attn_backends.hf_config import bundled_models, from_hf_config, load_model_config
from kvforge.attn_backends.mla import MLABackend

__all__ = [
    "AttentionBackend",
    "DSABackend",
    "DeclaredBackend",
    "DeepseekV4Backend",
    "GQABackend",
    "MHABackend",
    "MLABackend",
    "SwapContext",
    "bundled_models",
    "from_hf_config",
    "load_model_config",
]
