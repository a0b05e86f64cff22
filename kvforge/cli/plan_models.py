"""``kvforge plan --list-models``: the bundled configs and the supported model types.

Two tables: every bundled config (``--model NAME``) with its ``model_type``, layer count and
the group kinds it plans; then every registered ``model_type`` (plugins' included) with the
``architectures`` that stand for it, the builder that reads it and the bundled configs of that
type. A model type that is not listed is refused by ``--config`` with the plugin route
(``register_model_type``, ``examples/plugin/``).
"""

from __future__ import annotations

from typing import Any

from kvforge.cli.formatting import console, make_table

__all__ = ["bundled_rows", "model_type_rows", "print_models"]


def bundled_rows() -> list[dict[str, Any]]:
    """One row per bundled config: name, model_type (a wrapper's nested type beside it),
    cache layers and the group kinds of its plan, in group order."""
    from kvforge.core.layout import CacheLayout
    from kvforge.models.hf_config import from_hf_config
    from kvforge.models.reading import bundled_models, load_model_config

    rows = []
    for name in bundled_models():
        config = load_model_config(name)
        text = config.get("text_config")
        nested = text.get("model_type") if isinstance(text, dict) else None
        layout = CacheLayout(from_hf_config(config))
        kinds = [str(getattr(g.kind, "value", g.kind)) for g in layout.groups]
        rows.append(
            {
                "name": name,
                "model_type": config.get("model_type"),
                "text_model_type": nested,
                "num_layers": len(layout.layers),
                "kinds": list(dict.fromkeys(kinds)),
            }
        )
    return rows


def model_type_rows(bundled: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per registered model type: its architectures, builder, whether kvforge
    bundles it, and the bundled configs of that type (a wrapper's nested type counts)."""
    from kvforge.models.registry import registered_model_types

    rows = []
    for model_type, entry in registered_model_types().items():
        builder = getattr(entry.builder, "__qualname__", repr(entry.builder))
        configs = [
            b["name"] for b in bundled if model_type in (b["model_type"], b["text_model_type"])
        ]
        rows.append(
            {
                "model_type": model_type,
                "architectures": list(entry.architectures),
                "builder": f"{getattr(entry.builder, '__module__', '?')}.{builder}",
                "bundled": entry.bundled,
                "configs": configs,
            }
        )
    return rows


def print_models() -> None:
    """Print both tables."""
    out = console()
    bundled = bundled_rows()
    configs = make_table(
        "bundled configs (kvforge plan --model NAME)",
        ("name", "model_type", "layers", "group kinds"),
        left=("name", "model_type", "group kinds"),
    )
    for b in bundled:
        mt = b["model_type"] + (f" ({b['text_model_type']})" if b["text_model_type"] else "")
        configs.add_row(b["name"], mt, str(b["num_layers"]), ", ".join(b["kinds"]))
    out.print(configs)
    types = make_table(
        "supported model types (kvforge plan --config config.json)",
        ("model_type", "architectures", "bundled configs", "from"),
        left=("model_type", "architectures", "bundled configs", "from"),
    )
    for t in model_type_rows(bundled):
        source = "kvforge" if t["bundled"] else f"plugin: {t['builder']}"
        types.add_row(
            t["model_type"],
            ", ".join(t["architectures"]) or "-",
            ", ".join(t["configs"]) or "-",
            source,
        )
    out.print(types)
    out.print(
        "a model_type not listed here: register it with "
        "kvforge.models.register_model_type (worked example: examples/plugin/)"
    )
