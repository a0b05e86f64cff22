"""The conformance kit's arguments: what :func:`~kvforge.testing.check_backend` accepts,
checked before anything is built (a ``TypeError`` / ``ValueError`` naming the argument), and
the defaults it derives from the declarations (tokens and blocks a round trip needs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvforge._checks import check_int
from kvforge.attn_backends.base import AttentionBackend
from kvforge.core.memory_plan import blocks_per_group
from kvforge.specs import CacheGroup, SwapPurpose


def as_mapping(backend_or_mapping: object) -> dict[int, AttentionBackend]:
    if isinstance(backend_or_mapping, AttentionBackend):
        # One instance serving two layers: the usual wiring, and it exercises layer-major order.
        return {0: backend_or_mapping, 1: backend_or_mapping}
    if not isinstance(backend_or_mapping, Mapping):
        raise TypeError(
            "backend_or_mapping must be an AttentionBackend or a mapping of layer id -> "
            f"AttentionBackend, got {type(backend_or_mapping).__name__}"
        )
    if not backend_or_mapping:
        raise ValueError("backend_or_mapping is an empty mapping: give at least one layer")
    checked: dict[int, AttentionBackend] = {}
    for layer, backend in backend_or_mapping.items():
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"backend_or_mapping has layer id {layer!r}; layer ids are ints >= 0")
        if not isinstance(backend, AttentionBackend):
            raise TypeError(
                f"backend_or_mapping[{layer}] is a {type(backend).__name__}, not an "
                "AttentionBackend"
            )
        checked[layer] = backend
    return checked


def parse_purposes(purposes: object) -> tuple[SwapPurpose, ...]:
    if isinstance(purposes, (str, SwapPurpose)) or not isinstance(purposes, Iterable):
        raise TypeError(f"purposes must be a sequence of swap purposes, got {purposes!r}")
    result: list[SwapPurpose] = []
    for p in purposes:
        try:
            purpose = SwapPurpose(p)
        except ValueError:
            raise ValueError(
                f"purposes has {p!r}; each must be one of {[x.value for x in SwapPurpose]}"
            ) from None
        if purpose in result:
            raise ValueError(f"purposes lists {purpose.value!r} twice")
        result.append(purpose)
    return tuple(result)


_AT_LEAST = "{name} must be >= {minimum}, got {value}"


def positive(name: str, value: object, minimum: int) -> int:
    wording = {"type_message": "{name} must be an int, got {value}"}
    return check_int(name, value, minimum, **wording, range_message=_AT_LEAST)


def default_tokens(groups: Mapping[str, CacheGroup]) -> int:
    # Three blocks of every group and two blocks past every window, plus one token so the last
    # block is partial: windows slide, blocks leave them, and compressed entries complete.
    span = max(max(3 * g.block_size, (g.window or 0) + 2 * g.block_size) for g in groups.values())
    return span + 1


def blocks_held(group: CacheGroup, tokens: int) -> int:
    """Blocks a request of ``tokens`` tokens holds in ``group`` (those its live tokens touch)."""
    live = group.live_token_range(tokens)
    return (live.end - 1) // group.block_size - live.start // group.block_size + 1


def device_blocks(
    num_blocks: object, groups: Mapping[str, CacheGroup], tokens: int
) -> dict[str, int]:
    # A request's first step writes every one of its tokens, so allocating it may take a block
    # for each before a window lets the oldest go; then a one-token blocker takes a block while
    # the request is out, and the null block is reserved: blocks_for(tokens) + 2 always fits.
    need = {name: g.blocks_for(tokens) + 2 for name, g in groups.items()}
    if num_blocks is None:
        return need
    blocks = blocks_per_group(list(groups), num_blocks)
    for name, count in blocks.items():
        if count < need[name]:
            raise ValueError(
                f"num_blocks[{name!r}] = {count} is too small for tokens={tokens}: the round "
                f"trip may hold {need[name] - 2} blocks of the request, 1 of a second request "
                f"and the null block, so it needs at least {need[name]}"
            )
    return blocks
