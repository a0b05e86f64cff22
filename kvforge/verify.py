"""Deterministic cache contents, for checking that nothing is lost.

Every live entry of a request gets bytes derived from (request seed, layer, role, position), so
after any sequence of allocations, swaps and frees a reader can recompute what each entry must
hold and compare byte for byte. ``kvforge demo`` and the round-trip tests both use this.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvforge.cache_controller.controller import CacheController
from kvforge.cache_controller.layout import CacheEntry

__all__ = ["EntryCheck", "entry_bytes_for", "verify_request", "write_request"]


def entry_bytes_for(
    seed: int, entry: CacheEntry, positions: torch.Tensor, entry_bytes: int
) -> torch.Tensor:
    """The bytes entry ``(layer, role)`` holds for ``positions`` of a request with ``seed``.

    Returns:
        ``uint8 [len(positions), entry_bytes]``; distinct per seed, layer, role and position.
    """
    role_salt = sum(ord(c) * 131**i for i, c in enumerate(entry.role.name)) % 1_000_003
    base = (seed * 1_000_003 + entry.layer * 10_007 + role_salt) * 7_919
    x = base + positions.to(torch.int64)[:, None] * 2_654_435_761
    x = x + torch.arange(entry_bytes, dtype=torch.int64)[None, :] * 40_503
    x = x ^ (x >> 13)
    x = x * 0x5BD1E995
    return ((x ^ (x >> 15)) & 0xFF).to(torch.uint8)


def _flat(cache: torch.Tensor, entry_bytes: int) -> torch.Tensor:
    return cache.view(torch.uint8).view(-1, entry_bytes)


def _live_slots(
    ctl: CacheController, request_id: str, entry: CacheEntry, positions: Iterable[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.as_tensor(list(positions), dtype=torch.int64)
    slots = ctl.slot_mapping(request_id, entry.group.name, pos, entry.role.compress_ratio)
    keep = slots >= 0
    return pos[keep], slots[keep]


def write_request(
    ctl: CacheController,
    request_id: str,
    seed: int,
    positions: Iterable[int],
    groups: Iterable[str] | None = None,
) -> int:
    """Write the expected bytes of ``positions`` into every role (through the slot mappings).

    Returns:
        the number of entries written.
    """
    only = set(groups) if groups is not None else None
    positions = list(positions)
    caches = ctl.kv_caches
    written = 0
    for entry in ctl.layout.entries:
        if only is not None and entry.group.name not in only:
            continue
        pos, slots = _live_slots(ctl, request_id, entry, positions)
        if not len(slots):
            continue
        nbytes = entry.role.entry_bytes
        flat = _flat(caches[entry.index], nbytes)
        flat[slots.to(flat.device)] = entry_bytes_for(seed, entry, pos, nbytes).to(flat.device)
        written += len(slots)
    return written


@dataclass
class EntryCheck:
    """Result of :func:`verify_request`."""

    entries: int = 0
    mismatched: int = 0

    def __iadd__(self, other: EntryCheck) -> EntryCheck:
        self.entries += other.entries
        self.mismatched += other.mismatched
        return self


def verify_request(
    ctl: CacheController,
    request_id: str,
    seed: int,
    skip_groups: Iterable[str] = (),
) -> EntryCheck:
    """Compare every live entry of ``request_id`` with the bytes :func:`write_request` wrote."""
    skip = set(skip_groups)
    result = EntryCheck()
    caches = ctl.kv_caches
    positions = range(ctl.num_tokens(request_id))
    for entry in ctl.layout.entries:
        if entry.group.name in skip:
            continue
        pos, slots = _live_slots(ctl, request_id, entry, positions)
        if not len(slots):
            continue
        nbytes = entry.role.entry_bytes
        got = _flat(caches[entry.index], nbytes)[slots.to(caches[entry.index].device)].cpu()
        want = entry_bytes_for(seed, entry, pos, nbytes)
        result.entries += len(slots)
        result.mismatched += int((got != want).any(dim=1).sum())
    return result
