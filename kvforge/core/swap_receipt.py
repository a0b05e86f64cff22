"""Execution receipts of swap plans: how the scheduler side knows the worker ran a plan.

Each :class:`~kvforge.core.values.SwapPlan` carries a random ``token`` that only the scheduler
side that issued it and the worker it was sent to have seen. The worker answers a plan it
executed with :func:`plan_receipt`: a digest of everything the plan says (its id, direction,
every request's groups, block indices, device blocks and host pages, and the page releases it
carries), keyed by the token. The scheduler side accepts a successful
:class:`~kvforge.core.values.SwapResult` only when its receipt equals the receipt of the plan
it issued (:func:`check_receipt`), so:

- a result made up for a plan the worker never executed (``SwapResult(plan_id)``) is refused;
- a result of a plan executed in another form (its direction flipped, a move changed) carries
  another digest and is refused too.

A failed result needs no receipt: settling a plan as failed only gives back what it reserved.

>>> import numpy as np
>>> from kvforge.core.values import RequestMove, SwapPlan, SwapResult
>>> move = RequestMove("a", 16, "preempt", {"kv": np.array([0])}, {"kv": np.array([3])},
...                    {"kv": np.array([1])})
>>> plan = SwapPlan(1, "out", (move,), ("kv",), token=b"0123456789abcdef")
>>> check_receipt(plan, SwapResult(1, receipt=plan_receipt(plan)))
>>> flipped = SwapPlan(1, "in", (move,), ("kv",), token=plan.token)
>>> plan_receipt(flipped) == plan_receipt(plan)
False
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import numpy as np

from kvforge.core.values import SwapPlan, SwapResult
from kvforge.errors import SwapReceiptError

__all__ = ["check_receipt", "new_token", "plan_receipt"]

TOKEN_BYTES = 16


def new_token() -> bytes:
    """A fresh random plan token."""
    return secrets.token_bytes(TOKEN_BYTES)


def _ints(h: hashlib.blake2b, arr: object) -> None:
    a = np.ascontiguousarray(np.asarray(arr), dtype=np.int64).reshape(-1)
    h.update(len(a).to_bytes(8, "little"))
    h.update(a.tobytes())


def _text(h: hashlib.blake2b, value: object) -> None:
    raw = str(value).encode()
    h.update(len(raw).to_bytes(8, "little"))
    h.update(raw)


def plan_receipt(plan: SwapPlan) -> bytes:
    """The receipt of ``plan``: a 16-byte digest of what it says, keyed by its token."""
    token = plan.token if isinstance(plan.token, bytes) else b""
    h = hashlib.blake2b(key=token[:64], digest_size=16, person=b"kvforge-swap")
    _text(h, plan.plan_id)
    _text(h, plan.direction)
    _text(h, ",".join(map(str, plan.groups)))
    for move in plan.requests:
        _text(h, move.request_id)
        _text(h, move.num_tokens)
        _text(h, getattr(move.purpose, "value", move.purpose))
        for g in sorted(move.device_blocks):
            _text(h, g)
            _ints(h, move.block_indices.get(g, ()))
            _ints(h, move.device_blocks[g])
            _ints(h, move.host_pages.get(g, ()))
    for release in plan.released:
        _text(h, release.seq)
        _text(h, release.request_id)
        for g in sorted(release.host_pages):
            _text(h, g)
            _ints(h, release.host_pages[g])
    return h.digest()


def check_receipt(plan: SwapPlan, result: SwapResult) -> None:
    """Refuse a successful ``result`` unless it carries ``plan``'s receipt.

    Raises:
        SwapReceiptError: the receipt is missing or is not that of ``plan`` (the worker never
            executed it, or executed something else under its id).
    """
    receipt = result.receipt
    if not isinstance(receipt, bytes) or not receipt:
        raise SwapReceiptError(
            plan.plan_id,
            "has a successful result without a receipt: the worker did not report executing "
            "it (hand the worker's own SwapResult to complete_swap)",
        )
    if not hmac.compare_digest(receipt, plan_receipt(plan)):
        raise SwapReceiptError(
            plan.plan_id,
            f"has a successful result whose receipt is not that of the {plan.direction!r} "
            "plan issued under this id: the worker executed another plan, or none",
        )
