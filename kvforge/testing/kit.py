"""The kit's one entry point, :func:`check_backend`: builds a controller over the backend and
runs the checks of :data:`~kvforge.testing.results.CHECKS` in order, freeing every controller it
built before it returns or raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from kvforge.attn_backends.base import AttentionBackend
from kvforge.controller import CacheController
from kvforge.platform import get_platform
from kvforge.specs import SwapPurpose
from kvforge.testing.arguments import (
    as_mapping,
    default_tokens,
    device_blocks,
    parse_purposes,
    positive,
)
from kvforge.testing.buffers import check_bytes, check_controller_overlap
from kvforge.testing.declaration import KitLayout, backend_instances, check_declaration
from kvforge.testing.naming import check_naming_and_order
from kvforge.testing.results import (
    CheckResult,
    ConformanceReport,
    run_check,
)
from kvforge.testing.swaps import check_swaps


def check_backend(
    backend_or_mapping: AttentionBackend | Mapping[int, AttentionBackend],
    *,
    device: str | torch.device = "cpu",
    num_blocks: int | Mapping[str, int] | None = None,
    tokens: int | None = None,
    purposes: Iterable[SwapPurpose | str] = ("preempt", "prefix"),
) -> ConformanceReport:
    """Run every conformance check on a backend and report what was covered.

    Args:
        backend_or_mapping: one backend (checked serving layers 0 and 1) or ``layer id ->
            backend``, as given to :class:`~kvforge.CacheController`.
        device: where device caches live.
        num_blocks: device blocks per group, the null block included (an int for every group or
            group -> int). Default: what the round trip needs for ``tokens``.
        tokens: tokens of the round-trip request. Default: three blocks of every group and two
            blocks past every window, plus one.
        purposes: swap purposes to round-trip (``"preempt"``, ``"prefix"``).

    Returns:
        one :class:`CheckResult` per check of :data:`CHECKS`.

    Raises:
        ConformanceError: a check failed; ``.check`` names it.
        TypeError / ValueError: bad arguments (raised before any cache is allocated).
    """
    backends = as_mapping(backend_or_mapping)
    chosen = parse_purposes(purposes)
    if tokens is not None:
        positive("tokens", tokens, 1)
    platform = get_platform(device)  # an unknown device is bad input, not a finding
    instances = backend_instances(backends)
    buffers, roles_of, groups_of = check_declaration(instances)
    ctl = run_check(
        "declaration", "CacheController(...)", lambda: CacheController(backends, device)
    )
    try:
        layout = KitLayout(backends, roles_of, groups_of, ctl)
        groups = layout.groups
        n_tokens = tokens if tokens is not None else default_tokens(groups)
        blocks = device_blocks(num_blocks, groups, n_tokens)
        roles = sum(len(r) for r in roles_of.values())
        note = f"{len(instances)} backend(s) over {len(backends)} layer(s), {roles} role(s)"
        results = [
            CheckResult("declaration", buffers, 0, 0, f"{note}, {len(groups)} group(s)"),
            check_bytes(layout, instances, blocks, platform.device),
            check_naming_and_order(layout, backends, device),
            check_controller_overlap(layout),
            check_swaps(layout, blocks, n_tokens, chosen),
        ]
    finally:
        ctl.free()
    return ConformanceReport(
        layers=tuple(sorted(backends)),
        num_blocks=blocks,
        tokens=n_tokens,
        purposes=chosen,
        checks=tuple(results),
    )
