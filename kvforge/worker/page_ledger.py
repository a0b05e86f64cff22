"""What one worker knows about its host tier pages: which prefix key each page holds, and how
far it ran its tier's sequence of page copies.

The scheduler side's tier index is not visible here, so the worker mirrors the part of it that
decides whether a copy may run: the copies themselves carry it (``PageCopy.released``,
``owners`` and ``seq``), and :class:`PageLedger` refuses a copy that its record contradicts.

Invariants (``tests/worker/test_page_ledger.py``):

- page copies run in their tier's sequence, each once: a repeat, a gap or a copy never
  handed out (``seq == -1``) is refused, whatever it carries;
- an offload writes only a released page (one that holds no key): a cached prompt's page is
  never overwritten by a replayed or forged offload;
- an onload reads only a page that holds the key the onload names;
- a refused batch changes nothing: the ledger is updated only after the whole batch passed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvforge.core.values import PageCopy
from kvforge.errors import PageOwnershipError, StepOrderError, WorkerRefusedError

__all__ = ["PageLedger"]

_ACTION = "HostTierPages.move"


class PageLedger:
    """Per group, the owner tag of each host tier page (``0``: released), and the next
    ``PageCopy.seq``.

    Args:
        num_pages: group -> pages, the null page 0 included.

    >>> ledger = PageLedger({"full": 4})
    >>> out = PageCopy("full", np.array([7], np.int32), np.array([2], np.int32),
    ...                owners=np.array([99], np.int64), seq=0)
    >>> ledger.check([out], ()); ledger.record([out], ())
    >>> ledger.owner("full", 2), ledger.next_seq
    (99, 1)
    """

    def __init__(self, num_pages: Mapping[str, int]) -> None:
        self.owners: dict[str, np.ndarray] = {
            g: np.zeros(int(n), dtype=np.int64) for g, n in num_pages.items()
        }
        self.next_seq = 0
        self._pending: tuple[dict[str, np.ndarray], int] = ({}, 0)

    def owner(self, group: str, page: int) -> int:
        """The tag of the key ``page`` holds (``0``: none)."""
        return int(self.owners[group][page])

    def check(self, offloads: Sequence[PageCopy], onloads: Sequence[PageCopy]) -> None:
        """Refuse the batch unless its copies continue the sequence and every page it writes
        is released and every page it reads holds the named key; nothing changes here.

        Call after :func:`kvforge.worker.guard.check_page_copies` (types and ranges)."""
        expected = self.next_seq
        # the record as the batch leaves it, built on copies of the touched groups only
        after: dict[str, np.ndarray] = {}
        for kind, copies in (("offload", offloads), ("onload", onloads)):
            for copy in copies:
                seq = copy.seq
                if type(seq) is not int or seq != expected:
                    raise StepOrderError(
                        _ACTION, f"{kind} of group {copy.group!r}", expected, seq, "page copy"
                    )
                expected += 1
                group = copy.group
                owners = after.get(group)
                if owners is None:
                    owners = after[group] = self.owners[group].copy()
                _released(copy, owners, kind)
                tags = _tags(copy, kind)
                pages = np.asarray(copy.host_pages, dtype=np.int64)
                if kind == "offload":
                    held = owners[pages] != 0
                    if held.any():
                        i = int(np.flatnonzero(held)[0])
                        raise PageOwnershipError(
                            f"{_ACTION}: offload (seq {seq}) writes host page {int(pages[i])} of "
                            f"group {group!r}, which holds key tag {int(owners[pages[i]])} and "
                            "was not released: a cached prompt's page is read-only; nothing "
                            "moved",
                            group,
                            int(pages[i]),
                        )
                    if len(np.unique(pages)) != len(pages):
                        raise WorkerRefusedError(
                            f"{_ACTION}: offload (seq {seq}) of group {group!r} writes a host "
                            f"page twice ({pages.tolist()}); nothing moved"
                        )
                    owners[pages] = tags
                else:
                    wrong = owners[pages] != tags
                    if wrong.any():
                        i = int(np.flatnonzero(wrong)[0])
                        holds = int(owners[pages[i]])
                        what = f"holds key tag {holds}" if holds else "holds no key"
                        raise PageOwnershipError(
                            f"{_ACTION}: onload (seq {seq}) reads host page {int(pages[i])} of "
                            f"group {group!r} for key tag {int(tags[i])}, but the page {what}; "
                            "nothing moved",
                            group,
                            int(pages[i]),
                        )
        self._pending = (after, expected)

    def record(self, offloads: Sequence[PageCopy], onloads: Sequence[PageCopy]) -> None:
        """The batch :meth:`check` passed runs now: keep the record it leaves."""
        after, expected = self._pending
        self.owners.update(after)
        self.next_seq = expected
        self._pending = ({}, expected)

    def claim(self, group: str, released: np.ndarray, pages: np.ndarray, tags: np.ndarray) -> None:
        """Pages a remote tier fills in place (not by a copy): ``released`` first, then each
        of ``pages`` must hold no key, and holds ``tags[i]`` from now on. All or nothing.

        Raises:
            PageOwnershipError: a page that holds a key.
        """
        if group not in self.owners:
            raise WorkerRefusedError(
                f"HostTierPages.claim: group {group!r} has no host tier pages; nothing changed"
            )
        owners = self.owners[group].copy()
        released = np.asarray(released, dtype=np.int64)
        pages, tags = np.asarray(pages, dtype=np.int64), np.asarray(tags, dtype=np.int64)
        n = len(owners)
        for what, ids in (("released page", released), ("page", pages)):
            if len(ids) and (int(ids.min()) < 1 or int(ids.max()) >= n):
                raise WorkerRefusedError(
                    f"HostTierPages.claim: a {what} of group {group!r} is outside [1, {n}) "
                    f"({ids.tolist()[:8]}); nothing changed"
                )
        if len(tags) != len(pages) or (len(tags) and not tags.all()):
            raise WorkerRefusedError(
                f"HostTierPages.claim: {len(pages)} pages of group {group!r} need as many "
                f"non-zero key tags, got {tags.tolist()[:8]}; nothing changed"
            )
        owners[released] = 0
        held = owners[pages] != 0
        if held.any() or len(np.unique(pages)) != len(pages):
            page = int(pages[np.flatnonzero(held)[0]]) if held.any() else int(pages[0])
            raise PageOwnershipError(
                f"HostTierPages.claim: host page {page} of group {group!r} holds a key or is "
                "named twice; a fill writes only released pages; nothing changed",
                group,
                page,
            )
        owners[pages] = tags
        self.owners[group] = owners


def _released(copy: PageCopy, owners: np.ndarray, kind: str) -> None:
    released = np.asarray(copy.released)
    if not len(released):
        return
    if released.ndim != 1 or released.dtype.kind not in "iu":
        raise WorkerRefusedError(
            f"{_ACTION}: {kind} of group {copy.group!r}: released must be a 1-d integer "
            f"array, got {released.dtype} of shape {released.shape}; nothing moved"
        )
    if int(released.min()) < 1 or int(released.max()) >= len(owners):
        bad = released[(released < 1) | (released >= len(owners))]
        raise WorkerRefusedError(
            f"{_ACTION}: {kind} of group {copy.group!r} releases host page {int(bad[0])}, "
            f"outside [1, {len(owners)}); nothing moved"
        )
    owners[released.astype(np.int64)] = 0


def _tags(copy: PageCopy, kind: str) -> np.ndarray:
    tags = np.asarray(copy.owners)
    n = len(copy.host_pages)
    if tags.ndim != 1 or (n and tags.dtype.kind not in "iu") or len(tags) != n:
        raise WorkerRefusedError(
            f"{_ACTION}: {kind} of group {copy.group!r} names {len(copy.host_pages)} host "
            f"pages and owners of shape {tags.shape} ({tags.dtype}); every page needs the tag "
            "of the key it holds; nothing moved"
        )
    tags = tags.astype(np.int64, copy=False)
    if n and not tags.all():
        raise WorkerRefusedError(
            f"{_ACTION}: {kind} of group {copy.group!r} names owner tag 0 (released) for a "
            "page it copies; nothing moved"
        )
    return tags
