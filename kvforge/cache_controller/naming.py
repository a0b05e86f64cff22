"""Storage names: one template turns (role, layer, rank, device) into a stable string.

The default template is ``{role}_caches_{layer}_rank{rank}.device{device}``, where ``{role}``
is the role's storage stem. FastDeploy's plural stems are kept so its consumers find the
buffers they expect: ``key_caches``, ``value_caches``, ``key_cache_scales``,
``value_cache_scales``, ``indexer_caches``; any other role ``r`` becomes ``r_caches``.
"""

from __future__ import annotations

import string

__all__ = ["DEFAULT_NAME_TEMPLATE", "StorageNamer"]

DEFAULT_NAME_TEMPLATE = "{role}_caches_{layer}_rank{rank}.device{device}"
TEMPLATE_FIELDS = frozenset({"role", "layer", "rank", "device"})

# FastDeploy-compatible stems. The template adds "_caches", so "key" -> "key_caches" and the
# scale roles, whose FastDeploy names do not end in "_caches", carry their full name here.
_FASTDEPLOY_NAMES = {
    "key_scale": "key_cache_scales",
    "value_scale": "value_cache_scales",
}


class StorageNamer:
    """Names the buffers of one controller.

    Args:
        template: a ``str.format`` template using ``{role}``, ``{layer}``, ``{rank}`` and
            ``{device}``; it must contain ``{role}`` and ``{layer}`` so names are unique.
        rank: tensor-parallel rank.
        device_id: device ordinal.
    """

    def __init__(self, template: str = DEFAULT_NAME_TEMPLATE, rank: int = 0, device_id: int = 0):
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        unknown = fields - TEMPLATE_FIELDS
        if unknown:
            raise ValueError(
                f"name_template {template!r} uses unknown fields {sorted(unknown)}; "
                f"allowed: {sorted(TEMPLATE_FIELDS)}"
            )
        missing = {"role", "layer"} - fields
        if missing:
            raise ValueError(
                f"name_template {template!r} must contain {{role}} and {{layer}} so names are "
                f"unique; missing {sorted(missing)}"
            )
        self.template = template
        self.rank = rank
        self.device_id = device_id

    def name(self, role: str, layer: int) -> str:
        """The storage name of ``role`` in ``layer``."""
        return self._format(role, layer)

    def pattern(self, role: str) -> str:
        """The name with the layer left open, e.g. ``key_caches_{layer}_rank0.device0``."""
        return self._format(role, "{layer}")

    def _format(self, role: str, layer: int | str) -> str:
        if self.template == DEFAULT_NAME_TEMPLATE and role in _FASTDEPLOY_NAMES:
            return f"{_FASTDEPLOY_NAMES[role]}_{layer}_rank{self.rank}.device{self.device_id}"
        return self.template.format(role=role, layer=layer, rank=self.rank, device=self.device_id)
