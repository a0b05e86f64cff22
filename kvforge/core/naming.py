"""Storage names: one template turns (role, layer, rank, device) into a stable string.

The default template is ``{role}_caches_{layer}_rank{rank}.device{device}``, where ``{role}``
is the role's storage stem. FastDeploy's plural stems are kept so its consumers find the
buffers they expect: ``key_caches``, ``value_caches``, ``key_cache_scales``,
``value_cache_scales``, ``indexer_caches``; any other role ``r`` becomes ``r_caches``.

Invariant: two buffers never share a storage name. A template must name ``{role}`` and
``{layer}``, but that alone does not make names unique (``{role}{layer}`` maps
``("k", 11)`` and ``("k1", 1)`` to ``k11``), so :meth:`StorageNamer.check_unique` checks the
actual buffers and the controller calls it once when it names them.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

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
        if not isinstance(template, str):
            raise ValueError(f"name_template must be a str, got {template!r}")
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        except ValueError as exc:
            raise ValueError(
                f"name_template {template!r} is not a valid format string: {exc}"
            ) from None
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
        try:  # a format spec such as {layer:q} fails only when used: fail here instead
            template.format(role="key", layer=0, rank=rank, device=device_id)
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            raise ValueError(f"name_template {template!r} cannot format a name: {exc}") from None
        self.template = template
        self.rank = rank
        self.device_id = device_id

    def name(self, role: str, layer: int) -> str:
        """The storage name of ``role`` in ``layer``."""
        return self._format(role, layer)

    def check_unique(self, keys: Iterable[tuple[str, int]]) -> list[str]:
        """The storage names of ``keys`` (``(role, layer)`` buffers), in order, all distinct.

        Raises:
            ValueError: two buffers map to one name (the message names both and the name), or
                a buffer is listed twice.
        """
        names: list[str] = []
        owner: dict[str, tuple[str, int]] = {}
        for role, layer in keys:
            name = self.name(role, layer)
            first = owner.setdefault(name, (role, layer))
            if len(names) + 1 != len(owner):
                if first == (role, layer):
                    raise ValueError(f"buffer {first} is listed twice (storage name {name!r})")
                raise ValueError(
                    f"name_template {self.template!r} gives buffers {first} and "
                    f"{(role, layer)} the same storage name {name!r}; every buffer needs its "
                    "own name"
                )
            names.append(name)
        return names

    def pattern(self, role: str) -> str:
        """The name with the layer left open, e.g. ``key_caches_{layer}_rank0.device0``."""
        return self._format(role, "{layer}")

    def _format(self, role: str, layer: int | str) -> str:
        if self.template == DEFAULT_NAME_TEMPLATE and role in _FASTDEPLOY_NAMES:
            return f"{_FASTDEPLOY_NAMES[role]}_{layer}_rank{self.rank}.device{self.device_id}"
        return self.template.format(role=role, layer=layer, rank=self.rank, device=self.device_id)
