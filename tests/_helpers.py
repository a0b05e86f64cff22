"""Helpers shared by the tests."""

from __future__ import annotations


def grow(ctl, request_id: str, num_tokens: int, chunk: int = 64) -> None:
    """Grow a request to ``num_tokens`` tokens in prefill chunks of ``chunk`` tokens, one
    ``allocate`` per step, as an engine does; window groups then hold at most one chunk
    beyond their window (a single ``allocate`` of the whole prompt holds every token's
    block until the next step, by design)."""
    current = ctl.num_tokens(request_id) if request_id in ctl.requests else 0
    while current < num_tokens:
        current = min(num_tokens, current + chunk)
        ctl.allocate(request_id, current)
