"""Argument checks of the scheduler side's batch calls: request ids, token counts and ids,
prefix matches, swap purposes. Each runs before anything changes and names the argument."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.core.values import PrefixMatch, check_request_id
from kvforge.specs import SwapPurpose

__all__ = [
    "batch_ids",
    "check_matches",
    "check_token_ids",
    "new_token_counts",
    "swap_purpose",
    "token_array",
]


_STR = {str}


def batch_ids(request_ids: object) -> list[str]:
    if type(request_ids) is list and len(request_ids) == 1:  # one request: the engine's call
        rid = request_ids[0]
        if type(rid) is str and rid:
            return [rid]  # a fresh list, as below (the caller's list is never kept)
    if isinstance(request_ids, str) or not isinstance(request_ids, Sequence):
        raise TypeError(
            f"request_ids must be a sequence of request ids, got {type(request_ids).__name__}"
        )
    ids = list(request_ids)
    if not set(map(type, ids)) <= _STR:  # every id a str: one type pass, no call per id
        ids = [check_request_id(r) for r in ids]
    uniq = set(ids)
    if "" in uniq:
        check_request_id("")  # raises, as the per-id check does for the first bad id
    if len(uniq) != len(ids):
        seen: set[str] = set()
        for r in ids:
            if r in seen:
                raise ValueError(f"request_ids lists {r!r} twice")
            seen.add(r)
    return ids


def swap_purpose(purpose: object) -> SwapPurpose:
    try:
        return SwapPurpose(purpose)
    except ValueError:
        raise ValueError(
            f"purpose must be one of {[p.value for p in SwapPurpose]}, got {purpose!r}"
        ) from None


def new_token_counts(values: object, n: int) -> np.ndarray:
    if isinstance(values, np.ndarray):
        arr = values
    elif isinstance(values, Sequence) and not isinstance(values, str):
        for v in values:
            if not isinstance(v, int | np.integer) or isinstance(v, bool):
                raise ValueError(f"num_new_tokens must hold ints, got {v!r}")
        arr = np.asarray(values, dtype=np.int64)
    else:
        raise TypeError(f"num_new_tokens must be a sequence of ints, got {type(values).__name__}")
    if arr.dtype.kind not in "iu" or arr.dtype == bool:
        raise ValueError(f"num_new_tokens must be integers, got dtype {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"num_new_tokens has shape {arr.shape}, expected ({n},) like request_ids")
    if n and int(np.minimum.reduce(arr)) < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {int(arr.min())}")
    return arr.astype(np.int64, copy=False)


def check_token_ids(token_ids: Sequence[Sequence[int]], new: np.ndarray) -> None:
    if len(token_ids) != len(new):
        raise ValueError(f"new_token_ids has {len(token_ids)} entries for {len(new)} requests")
    for i, (ids, n) in enumerate(zip(token_ids, new, strict=True)):
        if len(ids) != int(n):
            raise ValueError(
                f"new_token_ids[{i}] has {len(ids)} token ids but num_new_tokens[{i}] is {int(n)}"
            )
        token_array(ids, f"new_token_ids[{i}]")  # checked before anything changes


def check_matches(matches: object, n: int) -> None:
    if isinstance(matches, str) or not isinstance(matches, Sequence) or len(matches) != n:
        raise ValueError(
            f"prefix_matches must be a sequence of {n} PrefixMatch or None, got {matches!r:.80}"
        )
    for i, m in enumerate(matches):
        if m is not None and not isinstance(m, PrefixMatch):
            raise TypeError(f"prefix_matches[{i}] is a {type(m).__name__}, not a PrefixMatch")


def token_array(tokens: object, name: str) -> np.ndarray:
    """``tokens`` as ``int64``, refused unless every id is an int in ``[0, 2**32)`` (what the
    prefix keys encode): checked before any counter or table moves."""
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError, TypeError):
        raise ValueError(
            f"{name} must be a 1-d sequence of int token ids, got {tokens!r:.80}"
        ) from None
    if arr.ndim != 1 or (arr.size and (arr.dtype == bool or arr.dtype.kind not in "iuO")):
        raise ValueError(f"{name} must be a 1-d sequence of int token ids, got {tokens!r:.80}")
    if arr.dtype.kind == "O" and any(  # ints beyond int64, or mixed objects
        isinstance(v, bool) or not isinstance(v, int) for v in arr.tolist()
    ):
        raise ValueError(f"{name} must be a 1-d sequence of int token ids, got {tokens!r:.80}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= TOKEN_LIMIT:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds token id {bad}, outside [0, 2**32)")
    return arr.astype(np.int64, copy=False)


TOKEN_LIMIT = 1 << 32
"""Token ids are encoded as unsigned 32-bit integers in the prefix keys."""
