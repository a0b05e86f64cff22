"""The ``swap_round_trip`` check: per purpose, unique bytes go into every live entry of a
request, it is swapped out, the blocks it held are overwritten with their complement, another
request takes the lowest free blocks, the request is swapped back in, and every entry the
backend's ``offload_selection`` promises to keep is compared byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvforge.scheduler.block_pool import NULL_BLOCK
from kvforge.specs import CacheGroup, CacheRole, SwapPurpose, TokenRange
from kvforge.testing.arguments import blocks_held
from kvforge.testing.buffers import byte_rows
from kvforge.testing.declaration import KitLayout
from kvforge.testing.results import BLOCKER, CheckResult, fail, run_check
from kvforge.verify import entry_bytes_for, write_request
from kvforge.worker.overlap import plane_extent


def _promised(
    layout: KitLayout, tokens: int, purpose: SwapPurpose
) -> list[tuple[str, int, CacheRole, CacheGroup, TokenRange]]:
    """Per offloaded buffer, the token range its backend promises to keep for ``purpose``."""
    promised = []
    for role_name, layer in layout.keys:
        role, group = layout.spec(role_name, layer)
        if not role.offload:
            continue  # never moves: nothing is promised
        backend = layout.backends[layer]
        kept = run_check(
            "swap_round_trip",
            f"{backend!r}.offload_selection({role_name!r}, {tokens}, {purpose.value!r})",
            lambda b=backend, r=role: b.offload_selection(r, tokens, purpose),
        )
        if not isinstance(kept, TokenRange) or kept.end > tokens:
            raise fail(
                "swap_round_trip",
                f"{backend!r}.offload_selection({role_name!r}, {tokens}, {purpose.value!r}) "
                f"returned {kept!r}; expected a TokenRange within [0, {tokens}]",
            )
        if not kept.empty:
            promised.append((role_name, layer, role, group, kept))
    return promised


def check_swaps(
    layout: KitLayout, blocks: Mapping[str, int], tokens: int, purposes: tuple[SwapPurpose, ...]
) -> CheckResult:
    ctl = layout.ctl
    roles = [layout.spec(*k)[0] for k in layout.keys]
    if not purposes or not any(r.offload for r in roles):
        why = "no purpose was asked for" if not purposes else "no role is offloaded"
        return CheckResult("swap_round_trip", 0, 0, 0, f"nothing to swap: {why}")
    # Host pages: what the request holds, plus the null page.
    pages = {g: blocks_held(spec, tokens) + 1 for g, spec in layout.groups.items()}
    run_check(
        "swap_round_trip",
        f"CacheController.initialize_host_cache(num_pages={pages})",
        lambda: ctl.initialize_host_cache(num_pages=pages),
    )
    buffers: set[tuple[str, int]] = set()
    entries = nbytes = 0
    notes = []
    for seed, purpose in enumerate(purposes, start=1):
        rid = f"conformance-{purpose.value}"
        compared, compared_bytes, touched = _round_trip(layout, rid, seed, tokens, purpose)
        buffers |= touched
        entries += compared
        nbytes += compared_bytes
        notes.append(f"{purpose.value}: {compared} entries")
    return CheckResult(
        "swap_round_trip",
        len(buffers),
        entries,
        nbytes,
        f"{tokens} tokens; " + ", ".join(notes) + " compared byte for byte after swap in",
    )


def _round_trip(
    layout: KitLayout, rid: str, seed: int, tokens: int, purpose: SwapPurpose
) -> tuple[int, int, set[tuple[str, int]]]:
    ctl = layout.ctl
    check = "swap_round_trip"
    run_check(check, f"allocate({rid!r}, {tokens})", lambda: ctl.allocate(rid, tokens))
    run_check(
        check,
        f"kvforge.verify.write_request({rid!r})",
        lambda: write_request(ctl, rid, seed, range(tokens)),
    )
    promised = _promised(layout, tokens, purpose)
    held = {g: [b for b in ctl.block_table(rid, g) if b != NULL_BLOCK] for g in layout.groups}
    run_check(
        check,
        f"swap_out({rid!r}, {purpose.value!r})",
        lambda: ctl.swap_out(rid, purpose).wait(),
    )
    # Every byte of the blocks the request held changes, so nothing stale can pass for kept.
    for role_name, layer in layout.keys:
        _, group = layout.spec(role_name, layer)
        tensor = ctl.get(role_name, layer)
        rows = byte_rows(tensor, plane_extent("scribble", tensor))
        ids = torch.tensor(held[group.name], dtype=torch.int64, device=tensor.device)
        if len(ids):
            rows[ids] = torch.bitwise_not(rows[ids])
    run_check(check, f"allocate({BLOCKER!r}, 1)", lambda: ctl.allocate(BLOCKER, 1))
    run_check(check, f"swap_in({rid!r})", lambda: ctl.swap_in(rid).wait())

    compared, compared_bytes, mismatched, first_bad, touched = _compare_kept(
        layout, rid, seed, promised
    )
    if mismatched:
        raise fail(
            check,
            f"purpose {purpose.value!r}: {mismatched} of {compared} entries that "
            f"offload_selection promises to keep differ after swap out, overwrite and swap in; "
            f"first: {first_bad}",
        )
    ctl.free_request(rid)
    ctl.free_request(BLOCKER)
    return compared, compared_bytes, touched


def _compare_kept(
    layout: KitLayout, rid: str, seed: int, promised: list
) -> tuple[int, int, int, str, set[tuple[str, int]]]:
    """Every promised entry of ``rid`` against the bytes written for it: (entries compared,
    their bytes, entries that differ, the first difference, the buffers touched)."""
    ctl = layout.ctl
    compared = compared_bytes = mismatched = 0
    first_bad = ""
    touched: set[tuple[str, int]] = set()
    for role_name, layer, role, group, kept in promised:
        positions = torch.arange(kept.start, kept.end, dtype=torch.int64)
        slots = ctl.slot_mapping(rid, group.name, positions, role.compress_ratio).cpu()
        live = slots >= 0
        positions, slots = positions[live], slots[live]
        if not len(slots):
            continue
        tensor = ctl.get(role_name, layer)
        rows = byte_rows(tensor, plane_extent("read", tensor))
        per_block, eb = role.entries_per_block(group), role.entry_bytes
        at = slots.to(tensor.device)
        got = rows.view(-1, per_block, eb)[at // per_block, at % per_block].cpu()
        want = entry_bytes_for(seed, layout.ctl.layout.entry(role_name, layer), positions, eb)
        bad = (got != want).any(dim=1)
        touched.add((role_name, layer))
        compared += len(slots)
        compared_bytes += len(slots) * eb
        if bool(bad.any()):
            mismatched += int(bad.sum())
            if not first_bad:
                k = int(bad.nonzero()[0, 0])
                first_bad = (
                    f"{layout.name(role_name, layer)} position {int(positions[k])} (slot "
                    f"{int(slots[k])}): expected bytes {want[k, :8].tolist()}..., found "
                    f"{got[k, :8].tolist()}..."
                )
    return compared, compared_bytes, mismatched, first_bad, touched
