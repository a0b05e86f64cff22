"""Seals on the matches a prefix cache makes: a MAC, under a secret of that cache, of
everything a :class:`~kvforge.core.values.PrefixMatch` claims (its length, its columns, blocks
and keys per group, the key chain it continues, the prompt length and junction it reports).

A lookup seals what it found (:meth:`MatchSealer.sealed`); :mod:`.adopt` adopts a match only
when :meth:`MatchSealer.verify` finds its seal intact, so a forged, altered or another cache's
match is refused without reading its blocks.

Invariants (``tests/test_isolation.py``, the forged-match tables): any change to a field a
match claims changes its seal; a seal from another :class:`MatchSealer` never verifies; a
value that cannot be sealed (not a hasher, a negative or huge count) seals to ``b""``, which
no match made here carries.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from numbers import Integral

import numpy as np

from kvforge.core.prefix_keys import PrefixHasher
from kvforge.core.values import PrefixMatch

__all__ = ["MatchSealer"]


class MatchSealer:
    """Seals and verifies matches under a secret of its own (32 random bytes)."""

    def __init__(self) -> None:
        self._secret = os.urandom(32)  # seals the matches this cache makes

    def seal(
        self,
        num_tokens: int,
        first: dict[str, int],
        blocks: dict[str, np.ndarray],
        keys: dict[str, tuple[bytes, ...]],
        hasher: object,
        num_prompt_tokens: object = 0,
        junction: object = 0,
    ) -> bytes:
        """A MAC, under this sealer's secret, of everything a match claims: its length, its
        columns, blocks and keys per group, the key chain it continues, and the prompt length
        and junction it reports."""
        if not isinstance(hasher, PrefixHasher):
            return b""
        if not all(
            isinstance(v, Integral) and not isinstance(v, bool) and 0 <= v < 1 << 62
            for v in (num_prompt_tokens, junction)
        ):
            return b""
        mac = hashlib.blake2b(key=self._secret, digest_size=16)
        mac.update(struct.pack("<qqq", num_tokens, hasher.num_tokens, hasher.unit))
        mac.update(struct.pack("<qq", int(num_prompt_tokens), int(junction)))  # type: ignore[call-overload]
        mac.update(hasher.key + hasher.root)
        for name in sorted(set(first) | set(blocks) | set(keys)):
            ids = np.asarray(blocks.get(name, ()), dtype=np.int64)
            mac.update(name.encode() + struct.pack("<qq", first.get(name, -1), len(ids)))
            mac.update(ids.tobytes() + b"".join(keys.get(name, ())))
        return mac.digest()

    def sealed(
        self,
        num_tokens: int,
        first: dict[str, int],
        blocks: dict[str, np.ndarray],
        keys: dict[str, tuple[bytes, ...]],
        hasher: PrefixHasher,
        num_prompt_tokens: int = 0,
        junction: int = 0,
    ) -> PrefixMatch:
        """The match these fields make, sealed."""
        seal = self.seal(num_tokens, first, blocks, keys, hasher, num_prompt_tokens, junction)
        return PrefixMatch(
            num_tokens, first, blocks, keys, hasher, seal, num_prompt_tokens, junction
        )

    def verify(self, match: PrefixMatch) -> bool:
        """Whether ``match`` carries the seal this sealer gives what it claims."""
        m = match
        seal = self.seal(
            m.num_tokens,
            m.first_col,
            m.blocks,
            m.keys,
            m.hasher,
            m.num_prompt_tokens,
            m.junction,
        )
        return hmac.compare_digest(m.seal, seal)
