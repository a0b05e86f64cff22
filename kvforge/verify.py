"""Deterministic cache contents, for checking that nothing is lost.

Every live entry of a request gets bytes derived from (request seed, layer, role, position), so
after any sequence of allocations, swaps and frees a reader can recompute what each entry must
hold and compare byte for byte. ``kvforge demo`` and the round-trip tests both use this.

Entries are written and read through each role's declared block layout, never through a flat
view of the buffer: slot ``s`` of a role with ``E`` entries per block is entry ``s % E`` of
block ``s // E``, which is ``cache[block, entry]`` for a token-major role and
``cache[block, :, entry]`` for a head-major one. So a head-major cache, whose one entry is
scattered over the block, and a padded (strided) cache are checked exactly as an attention
kernel would address them. An entry's bytes are its elements in ``entry_shape`` order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvforge.controller import CacheController
from kvforge.core.layout import CacheBuffer
from kvforge.core.prefix_keys import ExtraKeys, PrefixHasher
from kvforge.kinds import live_start

__all__ = [
    "EntryCheck",
    "entry_bytes_for",
    "read_entries",
    "token_seeds",
    "verify_request",
    "write_entries",
    "write_request",
    "write_step",
]


Seed = int | Sequence[int] | torch.Tensor


def token_seeds(token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> torch.Tensor:
    """Per-position seeds that depend on the tokens up to each position (62 bits of the
    position's prefix key, hashed per token): content written with them is what recomputing
    that prefix would write, so a block reused from another request with the same prefix must
    hold exactly it. ``int64 [len(token_ids)]``."""
    keys = PrefixHasher(extra_keys, unit=1).extend(token_ids)
    mask = (1 << 62) - 1
    return torch.tensor([int.from_bytes(k[:8], "little") & mask for k in keys], dtype=torch.int64)


def _seed_at(seed: Seed, positions: torch.Tensor) -> torch.Tensor | int:
    """``seed`` for each of ``positions``: one int for every position, or per-position seeds
    indexed by position."""
    if isinstance(seed, int):
        return seed
    table = torch.as_tensor(seed, dtype=torch.int64)
    return table[positions.to(torch.int64)][:, None]


def entry_bytes_for(
    seed: Seed, entry: CacheBuffer, positions: torch.Tensor, entry_bytes: int
) -> torch.Tensor:
    """The bytes entry ``(layer, role)`` holds for ``positions`` of a request with ``seed``
    (an int, or per-position seeds such as :func:`token_seeds`, indexed by position).

    Returns:
        ``uint8 [len(positions), entry_bytes]``; distinct per seed, layer, role and position.
    """
    role_salt = sum(ord(c) * 131**i for i, c in enumerate(entry.role.name)) % 1_000_003
    seeds = _seed_at(seed, positions)
    base = (seeds * 1_000_003 + entry.layer * 10_007 + role_salt) * 7_919
    x = base + positions.to(torch.int64)[:, None] * 2_654_435_761
    x = x + torch.arange(entry_bytes, dtype=torch.int64)[None, :] * 40_503
    x = x ^ (x >> 13)
    x = x * 0x5BD1E995
    return ((x ^ (x >> 15)) & 0xFF).to(torch.uint8)


def _entry_index(
    cache: torch.Tensor, entry: CacheBuffer, slots: Any
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """A byte view of ``cache`` and the index that selects the entries at ``slots``.

    The view keeps the cache's strides (padding is never addressed); its last dim is widened
    to bytes, so ``view[index]`` is ``[len(slots), *entry_shape[:-1], entry_shape[-1] *
    itemsize]`` for both layouts.
    """
    per_block = entry.role.entries_per_block(entry.group)
    slots = torch.as_tensor(slots, dtype=torch.int64).to(cache.device)
    blocks, within = slots // per_block, slots % per_block
    raw = cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)
    if entry.role.block_layout == "head_major":
        return raw, (blocks, slice(None), within)
    return raw, (blocks, within)


def read_entries(cache: torch.Tensor, entry: CacheBuffer, slots: torch.Tensor) -> torch.Tensor:
    """The bytes of the entries at ``slots`` of ``cache`` (buffer ``entry``), read through the
    role's block layout: ``uint8 [len(slots), entry_bytes]`` (a copy)."""
    raw, index = _entry_index(cache, entry, slots)
    return raw[index].reshape(len(slots), entry.role.entry_bytes)


def write_entries(
    cache: torch.Tensor, entry: CacheBuffer, slots: torch.Tensor, data: torch.Tensor
) -> None:
    """Store ``data`` (``uint8 [len(slots), entry_bytes]``) into the entries at ``slots`` of
    ``cache``, through the role's block layout (what an attention kernel's cache write does)."""
    raw, index = _entry_index(cache, entry, slots)
    # the indexed shape: entry_shape with its last dim counted in bytes
    shape = (*entry.role.entry_shape[:-1], entry.role.entry_shape[-1] * entry.role.itemsize)
    raw[index] = data.to(cache.device).view(len(slots), *shape)


def _live_slots(
    ctl: CacheController, request_id: str, entry: CacheBuffer, positions: Iterable[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.as_tensor(list(positions), dtype=torch.int64)
    slots = ctl.slot_mapping(request_id, entry.group.name, pos, entry.role.compress_ratio)
    # what is live between steps, which is what a swap keeps: the latest step's tokens behind
    # a window have slots until the request's next step releases their blocks
    keep = (slots >= 0) & (pos >= live_start(entry.group, ctl.num_tokens(request_id)))
    return pos[keep], slots[keep]


def write_request(
    ctl: CacheController,
    request_id: str,
    seed: Seed,
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
    for entry in ctl.layout.buffers:
        if only is not None and entry.group.name not in only:
            continue
        pos, slots = _live_slots(ctl, request_id, entry, positions)
        if not len(slots):
            continue
        data = entry_bytes_for(seed, entry, pos, entry.role.entry_bytes)
        write_entries(caches[entry.index], entry, slots, data)
        written += len(slots)
    return written


def write_step(ctl: CacheController, step: Any, seeds: Mapping[str, Seed]) -> int:
    """Write the bytes of every token a step scheduled, through the step's slot mappings (what
    the step's kernels do): ``step`` is what :meth:`CacheController.schedule` returned,
    ``seeds`` maps each scheduled request to its seed. Returns the entries written."""
    caches = ctl.kv_caches
    inputs, alloc = step.inputs, step.allocation
    index = torch.from_numpy(inputs.request_index)
    positions = torch.from_numpy(inputs.positions)
    written = 0
    for i, rid in enumerate(alloc.request_ids):
        mine = index == i
        pos = positions[mine]
        for entry in ctl.layout.buffers:
            slots = torch.from_numpy(
                inputs.slot_mappings[(entry.group.name, entry.role.compress_ratio)]
            )[mine]
            keep = slots >= 0
            if not bool(keep.any()):
                continue
            data = entry_bytes_for(seeds[rid], entry, pos[keep], entry.role.entry_bytes)
            write_entries(caches[entry.index], entry, slots[keep], data)
            written += int(keep.sum())
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
    seed: Seed,
    skip_groups: Iterable[str] = (),
) -> EntryCheck:
    """Compare every live entry of ``request_id`` with the bytes :func:`write_request` wrote."""
    skip = set(skip_groups)
    result = EntryCheck()
    caches = ctl.kv_caches
    positions = range(ctl.num_tokens(request_id))
    for entry in ctl.layout.buffers:
        if entry.group.name in skip:
            continue
        pos, slots = _live_slots(ctl, request_id, entry, positions)
        if not len(slots):
            continue
        got = read_entries(caches[entry.index], entry, slots).cpu()
        want = entry_bytes_for(seed, entry, pos, entry.role.entry_bytes)
        result.entries += len(slots)
        result.mismatched += int((got != want).any(dim=1).sum())
    return result
