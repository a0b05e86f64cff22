"""Models: Hugging Face configs to layer -> backend maps, the registry, plugins, bundled configs.

:func:`from_hf_config` reads a ``config.json`` (or a bundled name such as
``"deepseek-v4-flash"``) and returns one backend per cache layer; :mod:`.registry` is where
backends and ``model_type`` builders are registered, by kvforge itself and by plugins.
Names are loaded on first use.
"""

from __future__ import annotations

from kvforge._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "MAX_LAYERS": "kvforge.models.registry",
    "ModelBackends": "kvforge.models.registry",
    "ModelOptions": "kvforge.models.registry",
    "PluginError": "kvforge.models.registry",
    "bundled_models": "kvforge.models.hf_config",
    "from_hf_config": "kvforge.models.hf_config",
    "load_model_config": "kvforge.models.hf_config",
    "load_plugins": "kvforge.models.registry",
    "register_backend": "kvforge.models.registry",
    "register_model_type": "kvforge.models.registry",
    "registered_backends": "kvforge.models.registry",
    "registered_model_types": "kvforge.models.registry",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("kvforge.models", globals(), _EXPORTS)
