"""Prefix keys: a stable 128-bit key for every prefix ``tokens[0:t]`` of a request.

A block's key covers its parent's tokens and its own, so the key of "block ``i`` of a group
with block size ``B``" is simply the key of the prefix of ``(i + 1) * B`` tokens: one chain
serves every group, whatever its block size. Keys are computed with numpy, vectorized over
tokens, and never with Python's ``hash()``: they are the same in every process and on every
machine.

The construction, per 64-bit lane ``k`` (two lanes, independent multipliers):

- each token becomes ``x_j = mix(token_j XOR salt_k XOR token_key_j)``, where ``mix`` is the
  SplitMix64 finalizer, ``salt_k`` comes from the request's extra keys (namespace, adapter,
  ...) and ``token_key_j`` from per-token keys (multimodal content hashes over placeholder
  tokens);
- the prefix value is the polynomial ``H_t = sum_{j < t} x_j * P_k^(t - 1 - j)`` mod 2**64,
  computed for all ``t`` at once as ``P^(t-1) * cumsum(x_j * P^-j)`` (``P`` is odd, so it has
  an inverse mod 2**64);
- the key is ``mix(H_t XOR t * C)`` of both lanes joined: 128 bits.

Collision trade-off: for inputs that are not chosen adversarially two different prefixes share
a key with probability about 2**-128 per pair, far below hardware error rates. The hash is
not cryptographic: a tenant who can choose prompts could construct a collision with a prefix
of another tenant that shares its salt. Give each tenant its own ``extra_keys`` (salt), or use
``PrefixHasher(..., algorithm="sha256")``, which chains SHA-256 over blocks (the choice of
vLLM's default; about 10x slower here).

>>> a = PrefixHasher()
>>> keys = a.extend([1, 2, 3, 4])
>>> b = PrefixHasher()
>>> _ = b.extend([1, 2])
>>> b.extend([3, 4]).tolist() == keys[2:].tolist()    # streaming gives the same keys
True
>>> PrefixHasher(extra_keys=("tenant-a",)).extend([1, 2, 3, 4])[3] == keys[3]
False
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import numpy as np

__all__ = ["PrefixHasher", "prefix_keys"]

_MASK = (1 << 64) - 1
_P = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)  # odd multipliers of the two lanes
_P_INV = tuple(pow(p, -1, 1 << 64) for p in _P)
_LEN_C = np.uint64(0xD6E8FEB86659FD93)
_TABLE_CHUNK = 1 << 14


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer, vectorized (uint64 arithmetic wraps mod 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class _Powers:
    """``P^k`` and ``P^-k`` mod 2**64 for ``k < len``, per lane, grown on demand."""

    def __init__(self) -> None:
        self.pos = np.ones((2, 1), dtype=np.uint64)
        self.neg = np.ones((2, 1), dtype=np.uint64)

    def upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        have = self.pos.shape[1]
        if n > have:
            grow = max(n - have, _TABLE_CHUNK)
            pos = np.empty((2, grow), dtype=np.uint64)
            neg = np.empty((2, grow), dtype=np.uint64)
            for lane in range(2):
                pos[lane] = np.full(grow, _P[lane], dtype=np.uint64)
                neg[lane] = np.full(grow, _P_INV[lane], dtype=np.uint64)
                pos[lane, 0] = self.pos[lane, -1] * np.uint64(_P[lane])
                neg[lane, 0] = self.neg[lane, -1] * np.uint64(_P_INV[lane])
            self.pos = np.concatenate([self.pos, np.cumprod(pos, axis=1, dtype=np.uint64)], 1)
            self.neg = np.concatenate([self.neg, np.cumprod(neg, axis=1, dtype=np.uint64)], 1)
        return self.pos, self.neg


_POWERS = _Powers()


def _salt(extra_keys: Sequence[object]) -> tuple[int, int]:
    if not extra_keys:
        return (0, 0)
    digest = hashlib.sha256(repr(tuple(extra_keys)).encode()).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little")


class PrefixHasher:
    """The running key chain of one request's tokens.

    Args:
        extra_keys: request-level keys that must match for two prefixes to be shared: a
            namespace or cache salt, a LoRA adapter id, ... (any ``repr``-stable values).
        algorithm: ``"poly128"`` (default, vectorized) or ``"sha256"`` (a SHA-256 chain over
            tokens, for prompts from untrusted tenants sharing one salt).
    """

    __slots__ = (
        "_algorithm",
        "_digest",
        "_last",
        "_num_tokens",
        "_salt",
        "_sums",
        "token_keys",
    )

    def __init__(
        self,
        extra_keys: Sequence[object] = (),
        algorithm: Literal["poly128", "sha256"] = "poly128",
        token_keys: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        if algorithm not in ("poly128", "sha256"):
            raise ValueError(f"algorithm must be 'poly128' or 'sha256', got {algorithm!r}")
        for item in token_keys:
            if len(item) != 3 or not all(isinstance(v, int) for v in item) or item[0] > item[1]:
                raise ValueError(
                    f"token_keys must hold (start, end, key) int triples, got {item!r}"
                )
        self._algorithm = algorithm
        self._salt = _salt(extra_keys)
        self._num_tokens = 0
        self._sums = [0, 0]  # sum_j x_j * P^-j per lane
        self._digest = hashlib.sha256(repr(tuple(extra_keys)).encode()).digest()
        self.token_keys = tuple(token_keys)
        self._last: tuple[int, list] | None = None  # (start, per-lane sums or digests)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def extend(
        self,
        tokens: Sequence[int] | np.ndarray,
        at: np.ndarray | None = None,
    ) -> np.ndarray:
        """Append tokens; return the keys of the prefixes they complete.

        Args:
            tokens: the new token ids (ints >= 0).
            at: prefix lengths (ascending, within ``(num_tokens_before, num_tokens_after]``)
                whose keys to return; default every new one. Block boundaries are all a
                cache needs, and turning keys into Python ints is most of the cost.

        Returns:
            ``object [len(at)]`` of Python ints: the key of the prefix of ``at[i]`` tokens
            (by default ``at = num_tokens_before + 1 .. num_tokens_after``).
        """
        tok = np.asarray(tokens, dtype=np.int64)
        n = len(tok)
        start = self._num_tokens
        if n == 0:
            return np.zeros(0, dtype=object)
        if tok.min() < 0:
            raise ValueError(f"token ids must be >= 0, got {int(tok.min())}")
        if self._algorithm == "sha256":
            keys_all = self._extend_sha256(tok)
            return keys_all if at is None else keys_all[np.asarray(at) - start - 1]
        x0 = tok.astype(np.uint64)
        for lo, hi, key in self.token_keys:
            a, b = max(lo, start) - start, min(hi, start + n) - start
            if a < b:
                x0[a:b] ^= np.uint64(key & _MASK)
        pos, neg = _POWERS.upto(start + n + 1)
        idx = None if at is None else np.asarray(at, dtype=np.int64) - start - 1
        lengths = (
            np.arange(start + 1, start + n + 1, dtype=np.uint64)
            if idx is None
            else (idx + start + 1).astype(np.uint64)
        ) * _LEN_C
        keys = []
        sums: list[np.ndarray] = []
        for lane in range(2):
            x = _mix(x0 ^ np.uint64(self._salt[lane]))
            acc = np.cumsum(x * neg[lane, start : start + n], dtype=np.uint64)
            acc += np.uint64(self._sums[lane])
            self._sums[lane] = int(acc[-1])
            sums.append(acc)
            # H_t = P^(t-1) * sum_{j<t} x_j P^-j, for t = start+1 .. start+n
            if idx is None:
                h = acc * pos[lane, start : start + n]
            else:
                h = acc[idx] * pos[lane, idx + start]
            keys.append(_mix(h ^ lengths))
        self._num_tokens = start + n
        self._last = (start, sums)
        hi_lane, lo_lane = keys[0].tolist(), keys[1].tolist()
        out = np.empty(len(hi_lane), dtype=object)
        out[:] = [(a << 64) | b for a, b in zip(hi_lane, lo_lane, strict=True)]
        return out

    def _extend_sha256(self, tok: np.ndarray) -> np.ndarray:
        out = np.empty(len(tok), dtype=object)
        digests = []
        digest = self._digest
        start = self._num_tokens
        for i, t in enumerate(tok.tolist()):
            key = 0
            for lo, hi, k in self.token_keys:
                if lo <= start + i < hi:
                    key ^= k & _MASK
            digest = hashlib.sha256(
                digest + t.to_bytes(8, "little") + key.to_bytes(8, "little")
            ).digest()
            digests.append(digest)
            out[i] = int.from_bytes(digest[:16], "little")
        self._digest = digest
        self._last = (start, digests)
        self._num_tokens += len(tok)
        return out

    def at_prefix(self, num_tokens: int) -> PrefixHasher:
        """A hasher whose state is the prefix of ``num_tokens`` tokens, which must lie within
        the last :meth:`extend` call (or equal the tokens before it)."""
        other = PrefixHasher.__new__(PrefixHasher)
        other._algorithm = self._algorithm
        other._salt = self._salt
        other.token_keys = self.token_keys
        other._last = None
        other._num_tokens = num_tokens
        other._sums = list(self._sums)
        other._digest = self._digest
        if num_tokens == self._num_tokens:
            return other
        if self._last is None:
            raise ValueError(f"no state for a prefix of {num_tokens} tokens")
        start, saved = self._last
        if not start <= num_tokens <= self._num_tokens:
            raise ValueError(
                f"a prefix of {num_tokens} tokens is outside the last extend "
                f"({start}..{self._num_tokens})"
            )
        if num_tokens == start:
            raise ValueError("rewinding to before the last extend is not kept")
        i = num_tokens - start - 1
        if self._algorithm == "sha256":
            other._digest = saved[i]
        else:
            other._sums = [int(saved[0][i]), int(saved[1][i])]
        return other


def prefix_keys(
    tokens: Sequence[int] | np.ndarray, extra_keys: Sequence[object] = ()
) -> np.ndarray:
    """Keys of every prefix of ``tokens`` (element ``i`` covers ``tokens[: i + 1]``)."""
    return PrefixHasher(extra_keys).extend(tokens)
