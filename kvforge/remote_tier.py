"""The remote tier behind the host tier, for the one-process controller: host tier pages are
published to a remote store (Redis, Mooncake Store) and fetched back into host pages when a
prompt's prefix is on neither the device nor the host, so engines in other processes or on
other machines reuse each other's prefixes.

:class:`RemoteTier` sits above both sides (it reads the scheduler's host tier index and the
worker's host pages), as :class:`~kvforge.controller.CacheController` does:

- **publish**: after a batch's offloads ran (device blocks copied into host pages), each
  page goes to the store under ``group/prefix-key`` (``put_async``: encoded at once, written
  in the background, bounded; a full queue drops values, never blocks). With the host tier's
  ``policy="write_through"`` a block is published when it completes, so another engine can
  reuse it while this one still serves it; with ``"eviction"`` when the device evicts it.
- **fetch**: before the lookup, the boundaries past what the device and the host hold are
  asked of the store (``exists_prefix``: a full group's chain, a window group's tail at the
  boundary, a per-request group's snapshot at it where the host tier's ``snapshot_policy`` is
  ``"aligned"``); the blocks found get host pages (:meth:`HostTier.reserve`), the unit records of
  this prompt's tokens and their tail proofs, and are read into the pages
  (``batch_get_into``) with this prompt's content proofs. A value that does not arrive whole
  (down, corrupted, truncated, another layout or model) or whose proof names other content
  (a key collision) is a miss: its page is forgotten before anything reads it. The host
  tier's lookup then brings the rest to the device (:mod:`kvforge.scheduler.prefix.host_lookup`).

What makes bytes differ is in the key: the prefix key (token ids, multimodal items, the
request's extra keys: salt, adapter), the group, and the store's fingerprint
(:func:`layout_fingerprint`: every buffer's role, entry shape, dtype, order, block size and
group, plus the :class:`~kvforge.core.model_identity.ModelIdentity`: the effective model
config's digest, revision or weights digest, dtype, quantization, tensor- and
pipeline-parallel rank and size), which every value's header repeats and every read checks
(:mod:`kvforge.store.value`).

A remote hit is exact under every key algorithm, as a local one: each value carries its
block's content proof (:func:`content_proofs`: the SHA-256 chain over the block's prefix, its
tokens and extra keys, in the canonical encoding of ``docs/prefix_keys.md``), computed by the
writer from the unit records its page keeps, and the reader compares it with the proof of its
own prompt before the page is indexed as filled. The proof is hashed with ``hashlib``'s SHA-256
on both sides whatever digest the prefix keys use (``blake2b``, an injected fast one), so a key
collision is a counted miss (``other_content``), never another prompt's KV.

Invariants (``tests/store/test_remote_tier.py``, ``tests/store/test_remote_identity.py``): a
fetched block is indexed only once its value arrived whole with this prompt's proof; a store
that fails costs hits, never device or host state; nothing here holds the controller's lock
while waiting for the network except the synchronous fetch.

Seams and locks: the remote tier reads the scheduler side only through the block manager's
declared seams (``host_tier``, ``prefix_caching``, ``prompt_plan``, each taking the manager's
lock for its call) and the host tier's public methods (``holds``, ``page_key``, ``entry``,
``reserve``, ``take_released``, ``filled``). It takes no lock itself: the controller calls
:meth:`RemoteTier.publish` and :meth:`RemoteTier.fetch` under its own lock, which serialises
every call that reaches the manager or the tier through the controller. A page
:meth:`HostTier.reserve` pins for a fetch stays pinned until :meth:`HostTier.filled`, in the
same :meth:`RemoteTier.fetch`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvforge._checks import ArgumentError
from kvforge.core.layout import CacheLayout
from kvforge.core.model_identity import ModelIdentity
from kvforge.core.prefix_keys import PrefixHasher
from kvforge.core.values import PageCopy, PrefixQuery, page_owner
from kvforge.scheduler.args import token_array
from kvforge.scheduler.block_manager import BlockManager
from kvforge.scheduler.prefix import PromptPlan
from kvforge.scheduler.unit_records import UnitRecordStore

if TYPE_CHECKING:
    from kvforge.store.protocol import RemoteStore

__all__ = ["RemoteTier", "RemoteTierStats", "check_model_identity", "layout_fingerprint"]


def check_model_identity(model: object, call: str) -> ModelIdentity:
    """``model`` itself, or an :class:`ArgumentError` that says a remote tier needs one:
    there is no shared default identity."""
    if not isinstance(model, ModelIdentity):
        raise ArgumentError(
            f"{call}: model must be a ModelIdentity (the model's name, config digest, "
            "revision or weights digest, dtype, quantization and parallel ranks: what makes "
            "its KV bytes differ; kvforge.ModelIdentity, or "
            "kvforge.integrations.vllm.identity.model_identity(vllm_config) in vLLM), got "
            f"{type(model).__name__} {model!r:.60}"
        )
    return model


def layout_fingerprint(layout: CacheLayout, model: ModelIdentity) -> bytes:
    """What makes two engines' page bytes comparable: per buffer its group (kind, block size,
    window), role (entry shape, dtype, head- or token-major order, scale), layer and bytes,
    and the ``model``'s identity (:attr:`ModelIdentity.digest <kvforge.core.model_identity.
    ModelIdentity.digest>`: config digest, revision or weights digest, dtype, quantization,
    tensor- and pipeline-parallel rank and size), hashed (BLAKE2b-256). A missing identity
    is an :class:`ArgumentError`: there is no shared default.

    >>> from kvforge.models import from_hf_config
    >>> from kvforge.core.model_identity import config_digest
    >>> m = ModelIdentity(name="llama-3-8b", config_digest=config_digest({}), dtype="bfloat16")
    >>> layout = CacheLayout(from_hf_config("llama-3-8b"))
    >>> a = layout_fingerprint(layout, m)
    >>> b = layout_fingerprint(layout, m.model_copy(update={"tp_rank": 1, "tp_size": 2}))
    >>> c = layout_fingerprint(layout, m.model_copy(update={"revision": "0123abc"}))
    >>> len(a), a == b, a == c
    (32, False, False)
    """
    model = check_model_identity(model, "layout_fingerprint")
    h = hashlib.blake2b(digest_size=32, person=b"kvforge-layout")
    h.update(b"model=" + model.digest + b"\n")
    for e in layout.buffers:
        g, r = e.group, e.role
        h.update(
            f"{g.name}|{g.kind.value}|{g.block_size}|{g.window}|{r.name}|{r!r}|{e.layer}|"
            f"{e.block_bytes}\n".encode()
        )
    return h.digest()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class _PageProofs:
    """The content proofs of host pages, from the unit records they keep: the SHA-256 chain
    over the canonical encoding up to each page's end, hashed with ``hashlib`` whatever digest
    the prefix keys use (:meth:`UnitRecordStore.sha256_chain
    <kvforge.scheduler.unit_records.UnitRecordStore.sha256_chain>`, kept on each record while it
    lives, so a chain is hashed once however many of its blocks are published)."""

    def __init__(self, records: UnitRecordStore) -> None:
        self._records = records

    def of(self, ref: bytes | None, tail: Any) -> bytes | None:
        """The proof of a page that keeps the record ``ref`` and the tail proof ``tail``
        (``(parent, payload, root preimage or b"")``, ``None`` on a unit end), or ``None``
        when nothing it keeps proves its content (it is then never published)."""
        try:
            if tail is None:
                return None if ref is None else self._records.sha256_chain(ref)
            _, payload, root_preimage = tail
            if root_preimage:
                base = _sha256(root_preimage)
            elif ref is not None:
                base = self._records.sha256_chain(ref)
            else:
                return None
        except KeyError:  # its record went (never expected: the page holds it)
            return None
        return _sha256(base + payload)


class _PromptProofs:
    """The content proofs of one prompt's blocks, what the values the reader asks for must
    carry: the SHA-256 chain of its own tokens, extra keys and multimodal items, hashed with
    ``hashlib`` whatever digest the prefix keys use."""

    def __init__(self, plan: PromptPlan, tokens: np.ndarray) -> None:
        h = plan.hasher
        self._unit = plan.unit
        self._hasher = PrefixHasher(h.extra_keys, h.mm_keys, h.unit, _sha256)
        self._keys = self._hasher.extend(tokens[: plan.top])

    def at(self, end: int) -> bytes:
        """The proof of the block that ends at token ``end``."""
        if end % self._unit == 0:
            return self._keys[end // self._unit - 1]
        return self._hasher.tail_key(end)[0]


class RemoteTierStats:
    """Counters of one remote tier: pages published (queued), blocks fetched into host pages,
    fetches that missed (value gone, corrupted, or the store down), and the prompt tokens the
    fetches reached past what the device and host held."""

    def __init__(self) -> None:
        self.published = 0
        self.fetched = 0
        self.fetch_misses = 0
        self.reach_tokens = 0

    def __repr__(self) -> str:
        return (
            f"RemoteTierStats(published={self.published}, fetched={self.fetched}, "
            f"fetch_misses={self.fetch_misses}, reach_tokens={self.reach_tokens})"
        )


class RemoteTier:
    """A remote store behind one controller's host tier.

    Args:
        manager: the controller's scheduler side, with a host tier attached.
        pages: the worker's :class:`~kvforge.worker.tier_pages.HostTierPages`.
        store: an open :class:`~kvforge.store.protocol.RemoteStore` whose fingerprint is
            :func:`layout_fingerprint` of this layout and ``model`` (the caller opens it).
        model: the :class:`~kvforge.core.model_identity.ModelIdentity` of the engine.
    """

    def __init__(
        self, manager: BlockManager, pages: Any, store: RemoteStore, model: ModelIdentity
    ) -> None:
        self.model = check_model_identity(model, "RemoteTier")
        self.manager, self.pages, self.store = manager, pages, store
        self.stats = RemoteTierStats()
        for g in pages.groups.values():
            store.register_buffer(g.pages)

    @staticmethod
    def _key(group: str, key: bytes) -> bytes:
        return group.encode() + b"/" + key

    def publish(self, offloads: Sequence[PageCopy]) -> None:
        """Queue the pages ``offloads`` just filled (call after the worker ran them)."""
        tier = self.manager.host_tier
        if tier is None:  # (never expected: a remote tier is built behind a host tier)
            return
        proofs = _PageProofs(tier.records)
        for copy in offloads:
            name = copy.group
            pages = self.pages.groups[name].pages
            keys, sources, proved = [], [], []
            for page in np.asarray(copy.host_pages).tolist():
                key = tier.page_key(name, page)
                entry = None if key is None else tier.entry(name, key)
                proof = None if entry is None else proofs.of(entry[1], entry[2])
                if proof is not None:
                    keys.append(self._key(name, key))
                    sources.append(pages[page])
                    proved.append(proof)
            if keys:
                self.stats.published += self.store.put_async(keys, sources, proved)

    def fetch(self, queries: Sequence[PrefixQuery]) -> None:
        """Read into host pages what each prompt's longest prefix needs past the device and
        the host, where the store holds it (the caller holds the controller's lock)."""
        if not self.manager.prefix_caching or isinstance(queries, PrefixQuery):
            return
        for i, q in enumerate(queries):
            if isinstance(q, PrefixQuery):
                self._fetch_one(q, i)

    def _fetch_one(self, query: PrefixQuery, index: int) -> None:
        store, tier = self.store, self.manager.host_tier
        tokens = token_array(query.token_ids, f"queries[{index}].token_ids")
        plan = self.manager.prompt_plan(tokens, query)
        if plan.top == 0 or tier is None:
            return
        host = set(tier.groups)

        def local(g: Any, key: bytes) -> bool:
            return plan.on_device(g, key) or tier.holds(g.spec.name, key)

        here = plan.reach(local)
        remote: set[tuple[str, bytes]] = set()  # (group, key) the store said it holds
        for g in plan.groups:  # a full group's chain past what is here, in one call
            name = g.spec.name
            if not g.history or name not in host:
                continue
            r = g.block_size // plan.unit
            chain = [k for k in plan.keys[r - 1 :: r] if not local(g, k)]
            found = store.exists_prefix([self._key(name, k) for k in chain])
            remote.update((name, k) for k in chain[:found])

        def chained(g: Any, key: bytes) -> bool:  # window tails are asked below, per boundary
            return not g.history or local(g, key) or (g.spec.name, key) in remote

        length = plan.reach(chained)
        # window tails at the chosen boundary, asked once per boundary tried
        while length > here:
            need = plan.needed(length)
            if need is None:
                length -= plan.step
                continue
            tails = [
                (g.spec.name, k)
                for _, g, ks in need
                if not g.history
                for k, _ in ks
                if not local(g, k) and (g.spec.name, k) not in remote
            ]
            if all(n in host for n, _ in tails) and store.exists_prefix(
                [self._key(n, k) for n, k in tails]
            ) == len(tails):
                remote.update(tails)
                break
            length -= plan.step
        if length <= here:
            return
        wanted = [
            (g.spec.name, k, end)
            for _, g, ks in plan.needed(length) or ()
            for k, end in ks
            if not local(g, k)
        ]
        if self._read(plan, wanted, _PromptProofs(plan, tokens)):
            self.stats.reach_tokens += length - here

    def _read(
        self, plan: PromptPlan, wanted: list[tuple[str, bytes, int]], proofs: _PromptProofs
    ) -> bool:
        """Reserve host pages for ``wanted`` (group, key, end), read them with this prompt's
        content ``proofs``, keep what arrived (a value of other content is a miss)."""
        tier, unit = self.manager.host_tier, plan.unit
        assert tier is not None  # _fetch_one checked it
        records = tier.records  # the prefix cache's own (attach_host_tier checks it)
        # the unit records this prompt's tokens make, referenced where each block ends
        with_ref = [w for w in wanted if w[2] >= unit]
        held = records.hold(
            plan.hasher.unit_records(), at=[e // unit * unit for _, _, e in with_ref]
        )
        refs = dict(zip(((n, k) for n, k, _ in with_ref), held.keys, strict=True))
        if held.cursor is not None:
            records.release(held.cursor)
        reserved: dict[str, list[tuple[bytes, int, int]]] = {}
        for name, key, end in wanted:
            ref = refs.get((name, key))
            if end >= unit and ref is None:
                continue  # the held chain names other content: never fetched
            page = tier.reserve(name, key, end, ref, plan.proof(end))
            if page is not None:
                reserved.setdefault(name, []).append((key, page, end))
        complete = True
        for name, got in reserved.items():
            pages = self.pages.groups[name].pages
            # the worker's record of its pages: these hold their keys from now on (a page
            # whose bytes do not arrive is evicted below, and released in the next copy)
            self.pages.claim(
                name,
                tier.take_released(name),
                [p for _, p, _ in got],
                [page_owner(k) for k, _, _ in got],
            )
            sizes = self.store.batch_get_into(
                [self._key(name, k) for k, _, _ in got],
                [pages[p] for _, p, _ in got],
                [proofs.at(e) for _, _, e in got],
            )
            arrived = [s is not None for s in sizes]
            tier.filled(name, [p for _, p, _ in got], arrived)
            self.stats.fetched += sum(arrived)
            self.stats.fetch_misses += len(arrived) - sum(arrived)
            complete = complete and all(arrived)
        return complete and len(reserved) > 0
