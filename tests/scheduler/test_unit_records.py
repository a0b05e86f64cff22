"""The exact check: unit records hold, release, cascade and confirm; a key collision forced
through an injected digest becomes a mismatch (a miss), never a hit; memory per cached token."""

from __future__ import annotations

import gc
import hashlib
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.core.prefix_keys import ExtraKeys, PrefixHasher, UnitRecords
from kvforge.scheduler.unit_records import Held, UnitRecordStore


def hashed(tokens, unit=4, extra=None, algorithm="sha256") -> PrefixHasher:
    h = PrefixHasher(extra, unit=unit, algorithm=algorithm)
    h.extend(np.asarray(tokens, dtype=np.int64))
    return h


def state(store: UnitRecordStore):
    """Everything observable: records with their counts, roots with theirs."""
    return (
        {k: (n.parent.key, n.payload, n.count) for k, n in store._records.items()},
        {k: (n.payload, n.count) for k, n in store._roots.items()},
        store.nbytes,
    )


# --------------------------------------------------------------------------- basics


def test_hold_then_confirm_an_exact_match():
    store = UnitRecordStore()
    h = hashed(range(16))  # 4 units of 4
    held = store.hold(h.unit_records())
    assert held == Held([], h.key) and store.num_records == 4 and store.num_roots == 1
    assert store.confirm(h) == 4 and store.confirm(h.unit_records(), 2) == 2
    # a prompt that agrees on 9 tokens shares 2 whole units
    assert store.confirm(hashed([*range(9), 99, 10, 11, 12, 13, 14, 15])) == 2
    assert store.confirm(hashed(range(16), extra=ExtraKeys(cache_salt="b"))) == 0
    assert store.confirm(hashed(range(16), extra=ExtraKeys(adapter="a"))) == 0
    assert store.confirm(hashed(range(16), algorithm="blake2b")) == 0
    assert store.confirm(hashed(range(16), unit=8)) == 0  # other payload layout
    assert store.confirm(hashed(range(40))) == 4  # a longer query: the stored 4 units


def test_refcounts_are_references_plus_children():
    store = UnitRecordStore()
    a = hashed([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])  # units A0 A1 A2
    b = hashed([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])  # units A0 A1 B2
    ka, kb = a.unit_records().keys, b.unit_records().keys
    ha = store.hold(a.unit_records(), at=[4, 12])
    hb = store.hold(b.unit_records(), at=[8, 8])
    assert ha.keys == [ka[0], ka[2]] and hb.keys == [kb[1], kb[1]]
    assert [store.refcount(k) for k in ka] == [1 + 1, 2 + 2, 1 + 1]  # refs + children
    assert ka[1] == kb[1] and store.refcount(kb[2]) == 1  # B2: its cursor only
    assert store.release(ha.cursor) == 0  # A2 keeps its block reference
    assert store.release(ka[2]) == 1  # A2 goes; A1 keeps B2 and its two refs
    assert store.release(hb.cursor) == 1  # B2 goes
    assert store.num_records == 2
    assert store.release(kb[1]) == 0 and store.release(kb[1]) == 1  # A1 last ref: it goes
    assert store.release(ka[0]) == 1  # cascade ends at the root
    assert store.num_records == 0 and store.num_roots == 0
    assert store._object_bytes == 0  # only the (never shrinking) dict tables are left


def test_release_cascades_to_the_first_record_still_needed():
    store = UnitRecordStore()
    h = hashed(range(40))  # 10 units
    held = store.hold(h.unit_records(), at=[8, 24])
    assert store.release(held.cursor) == 4  # units ending 28..40 go
    assert store.num_records == 6
    assert store.confirm(h) == 6  # the window tail ending at 24 still proves 0..24
    store.release(h.unit_records().keys[5])  # evict the block ending at 24
    assert store.num_records == 2 and store.confirm(h) == 2
    store.release(h.unit_records().keys[1])
    assert store.num_records == 0 and store.confirm(h) == 0


def test_a_request_streams_its_chain_through_its_cursor():
    tokens = np.random.default_rng(0).integers(0, 1000, 100)
    store = UnitRecordStore()
    h = PrefixHasher(unit=4)
    cursor = None
    blocks = []
    for lo in range(0, 100, 7):  # steps of 7 tokens, blocks of 8
        before = h.num_tokens
        h.extend(tokens[lo : lo + 7])
        ends = [e for e in range(8, h.num_tokens + 1, 8) if e > before]
        held = store.hold(h.unit_records(), at=ends, cursor=cursor)
        assert None not in held.keys
        blocks += held.keys
        cursor = held.cursor
    assert cursor == h.key and store.confirm(prefix_records(tokens)) == 25
    store.release(cursor)  # the request ends: the last unit (96..100) is no block's end
    assert store.num_records == 24
    for k in blocks:
        store.release(k)
    assert store.num_records == 0 and store.num_roots == 0


def prefix_records(tokens, unit=4, extra=None, algorithm="sha256") -> UnitRecords:
    return hashed(tokens, unit, extra, algorithm).unit_records()


def test_a_hit_is_adopted_by_holding_its_chain_from_the_root():
    store = UnitRecordStore()
    first = hashed(range(32))
    store.release(store.hold(first.unit_records(), at=[32]).cursor)
    # lookup of a longer prompt: hash, find L = 32, confirm, then adopt at L
    query = hashed(range(50))
    assert store.confirm(query.unit_records(), 8) == 8
    at_hit = query.at_prefix(32)
    adopt = store.hold(at_hit.unit_records())
    assert adopt.cursor == at_hit.key and store.refcount(at_hit.key) == 2
    at_hit.extend(range(32, 50))
    step = store.hold(at_hit.unit_records(), at=[32, 48], cursor=adopt.cursor)
    assert step.keys == [adopt.cursor, at_hit.unit_records().keys[3]]
    assert store.refcount(adopt.cursor) == 1 + 1 + 1  # the first block, the new one, a child


# ------------------------------------------------------- forced collisions (weak digest)


def ignores_tokens(data: bytes) -> bytes:
    """A broken key function: it hashes the parent key and the unit's offset only, so every
    prompt of a length has the same keys."""
    return hashlib.sha256(data[:44]).digest()


def test_a_forced_collision_is_a_mismatch_not_a_hit():
    store = UnitRecordStore()
    a = hashed(range(16), algorithm=ignores_tokens)
    b = hashed(range(100, 116), algorithm=ignores_tokens)
    assert a.unit_records().keys == b.unit_records().keys  # a key-only cache would serve B
    store.hold(a.unit_records(), at=[16])
    before = state(store)
    assert store.confirm(b) == 0  # the exact check: a counted miss
    held = store.hold(b.unit_records(), at=[8, 16])
    assert held == Held([None, None], None)  # B holds nothing: its blocks are not cached
    assert state(store) == before and store.confirm(a) == 4
    # and a request whose chain conflicted cannot continue it later
    b.extend(range(116, 124))
    with pytest.raises(ValueError, match="pass the cursor"):
        store.hold(b.unit_records(), at=[20], cursor=None)
    assert state(store) == before


def only_offset_4_is_weak(data: bytes) -> bytes:
    """Collides the unit at token offset 4 (whatever its tokens); sound everywhere else."""
    if data[32:40] == (4).to_bytes(8, "little"):
        return hashlib.sha256(data[:44]).digest()
    return hashlib.sha256(data).digest()


def test_a_collision_deep_in_the_chain_stops_at_the_unit_that_differs():
    store = UnitRecordStore()
    a = hashed(range(16), algorithm=only_offset_4_is_weak)
    b = hashed([0, 1, 2, 3, 9, 9, 9, 9, *range(8, 16)], algorithm=only_offset_4_is_weak)
    ka, kb = a.unit_records().keys, b.unit_records().keys
    assert ka == kb  # every key agrees: units 2 and 3 even hash the same bytes
    store.hold(a.unit_records(), at=[4, 8, 12, 16])
    assert store.confirm(b) == 1  # unit 0 is exact, unit 1 is not: a hit ends at 4 at most
    before = state(store)
    held = store.hold(b.unit_records(), at=[4, 8, 12, 16])
    assert held == Held([ka[0], None, None, None], None)
    assert store.refcount(ka[0]) == before[0][ka[0]][2] + 1
    store.release(ka[0])
    assert state(store) == before


def one_byte(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:1]


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), max_size=12), min_size=1, max_size=12),
    queries=st.lists(st.lists(st.integers(0, 2), max_size=12), max_size=12),
    salts=st.lists(st.sampled_from([None, "a"]), min_size=12, max_size=12),
)
def test_with_a_one_byte_key_every_confirmed_unit_is_exact(prompts, queries, salts):
    unit = 2
    store = UnitRecordStore()
    held_prefixes = []
    for i, p in enumerate(prompts):
        extra = ExtraKeys(cache_salt=salts[i]) if salts[i] else None
        h = hashed(p, unit, extra, one_byte)
        ends = list(range(unit, len(p) // unit * unit + 1, unit))
        held = store.hold(h.unit_records(), at=ends)
        n = next((j for j, k in enumerate(held.keys) if k is None), len(held.keys))
        held_prefixes.append((salts[i], tuple(p[: n * unit])))
    for i, q in enumerate([*prompts, *queries]):
        salt = salts[i % len(salts)]
        n = store.confirm(
            prefix_records(q, unit, ExtraKeys(cache_salt=salt) if salt else None, one_byte)
        )
        if n:
            want = (salt, tuple(q[: n * unit]))
            assert any(s == want[0] and p[: n * unit] == want[1] for s, p in held_prefixes)


# ------------------------------------------------------------- refcounts vs a model


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), max_size=10), min_size=1, max_size=5),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 999), st.integers(0, 999)), max_size=25),
)
def test_refcounts_match_a_reference_model(prompts, ops):
    from kvforge.scheduler.unit_records import _NODE_FIXED

    unit = 2
    store = UnitRecordStore()
    parent: dict[bytes, bytes] = {}
    roots: set[bytes] = set()
    refs: list[bytes] = []
    for is_hold, i, j in ops:
        if is_hold:
            rec = prefix_records(prompts[i % len(prompts)], unit)
            roots.add(rec.root)
            for k, par in zip(rec.keys, (rec.parent, *rec.keys), strict=False):
                parent[k] = par
            ends = [e for e in range(unit, rec.end + 1, unit) if (j >> (e // unit)) & 1]
            held = store.hold(rec, at=ends)
            assert None not in held.keys
            refs += held.keys + ([held.cursor] if held.cursor else [])
        elif refs:
            store.release(refs.pop(j % len(refs)))
        # the model: what the references need, and each record's count
        live = set()
        for k in refs:
            while k not in roots and k not in live:
                live.add(k)
                k = parent[k]
        assert set(store._records) == live
        for k in live:
            children = sum(1 for c in live if parent[c] == k)
            assert store.refcount(k) == refs.count(k) + children
        live_roots = {parent[k] for k in live if parent[k] in roots}
        assert set(store._roots) == live_roots
        for r in live_roots:
            assert store._roots[r].count == sum(1 for k in live if parent[k] == r)
        nodes = [*store._records.values(), *store._roots.values()]
        assert store._object_bytes == sum(_NODE_FIXED + len(n.key) + len(n.payload) for n in nodes)
        # the links a lookup walks are exactly the stored children
        for n in nodes:
            kids = (
                n.kids
                if isinstance(n.kids, dict)
                else {}
                if n.kids is None
                else {n.kids.payload: n.kids}
            )
            assert {c.key for c in kids.values()} == {c for c in live if parent[c] == n.key}
            assert all(c.payload == pay and c.parent is n for pay, c in kids.items())


# ------------------------------------------------------------- known keys (lookups)


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), max_size=12), min_size=1, max_size=6),
    query=st.lists(st.integers(0, 2), max_size=14),
    salt=st.sampled_from([None, "a"]),
    drop=st.integers(0, 5),
)
def test_known_keys_are_the_stored_prefix_of_the_hashers_keys(prompts, query, salt, drop):
    """Walking the stored records gives the keys the hasher computes, for exactly the units
    whose prefix is stored (same extra keys, same tokens), before and after a release."""
    unit = 2
    store = UnitRecordStore()
    cursors = []
    for i, p in enumerate(prompts):
        extra = ExtraKeys(cache_salt="a") if i % 2 else None
        cursors.append(store.hold(prefix_records(p, unit, extra)).cursor)
    if cursors[drop % len(cursors)] is not None:
        store.release(cursors[drop % len(cursors)])
    extra = ExtraKeys(cache_salt=salt) if salt else None
    rec = prefix_records(query, unit, extra)
    known = store.known_keys(rec.root, rec.payloads, rec.root_preimage)
    assert known == list(rec.keys[: len(known)])
    assert len(known) == store.confirm(rec)  # exactly the units the exact check confirms
    # the hasher given the hook returns the same keys, whatever it knew
    h = PrefixHasher(extra, unit=unit)
    assert h.extend(np.asarray(query, dtype=np.int64), known=store.known_keys) == list(rec.keys)
    assert h.unit_records() == rec


def test_known_keys_follow_branches_and_stop_where_the_store_does():
    store = UnitRecordStore()
    a, b = hashed([1, 2, 3, 4, 5, 6, 7, 8]), hashed([1, 2, 3, 4, 9, 9, 9, 9])
    ca = store.hold(a.unit_records()).cursor
    cb = store.hold(b.unit_records()).cursor
    ra, rb = a.unit_records(), b.unit_records()
    assert store.known_keys(ra.root, ra.payloads, ra.root_preimage) == list(ra.keys)
    assert store.known_keys(rb.root, rb.payloads, rb.root_preimage) == list(rb.keys)
    assert store.known_keys(ra.keys[0], ra.payloads[1:]) == [ra.keys[1]]  # from a record
    assert store.known_keys(ra.root, ra.payloads, b"other preimage") == []  # a root mismatch
    assert store.known_keys(b"\0" * 32, ra.payloads) == []  # no such record
    store.release(cb)  # b's second unit goes; the shared first unit stays
    assert store.known_keys(rb.root, rb.payloads, rb.root_preimage) == [rb.keys[0]]
    assert store._records[ra.keys[0]].kids is store._records[ra.keys[1]]
    store.release(ca)
    assert store.known_keys(ra.root, ra.payloads, ra.root_preimage) == []
    assert store.num_records == 0 and store.num_roots == 0


# ------------------------------------------------------------------------ bad input


def test_bad_arguments_are_refused_and_nothing_changes():
    store = UnitRecordStore()
    h = hashed(range(16))
    other = hashed(range(100, 116))
    c0 = store.hold(h.unit_records(), at=[8]).cursor
    c1 = store.hold(other.unit_records()).cursor
    rec0 = h.unit_records()
    h.extend(range(16, 24))
    later = h.unit_records()
    cases = [
        (lambda: store.hold("x"), TypeError, "must be UnitRecords"),
        (lambda: store.hold(rec0, cursor=c0), ValueError, "pass cursor=None"),
        (lambda: store.hold(later), ValueError, "pass the cursor the previous hold"),
        (lambda: store.hold(later, cursor=b"\0" * 32), ValueError, "is not held"),
        (lambda: store.hold(later, cursor=c1), ValueError, "out of step"),
        (lambda: store.hold(later, cursor="ab"), TypeError, "cursor must be bytes"),
        (lambda: store.hold(rec0, at=[5]), ValueError, "at[0] = 5 is not a unit boundary"),
        (lambda: store.hold(rec0, at=[0]), ValueError, "in [4, 16]"),
        (lambda: store.hold(rec0, at=[4, 20]), ValueError, "at[1] = 20"),
        (lambda: store.hold(later, at=[12], cursor=c0), ValueError, "in [16, 24]"),
        (lambda: store.hold(rec0, at=[4.0]), TypeError, "1-D sequence of ints"),
        (lambda: store.confirm(later), ValueError, "chain from unit 0"),
        (lambda: store.confirm(rec0, 5), ValueError, "num_units must be an int in [0, 4]"),
        (lambda: store.confirm(rec0, True), ValueError, "num_units"),
        (lambda: store.confirm([rec0]), TypeError, "got list"),
        (lambda: store.release(b"zz"), KeyError, "no such record"),
        (lambda: store.release("x"), KeyError, "no such record"),
    ]
    before = state(store)
    for call, exc, fragment in cases:
        with pytest.raises(exc) as info:
            call()
        assert fragment in str(info.value), (fragment, info.value)
        assert state(store) == before, fragment
    held = store.hold(later, at=[16, 24], cursor=c0)  # the right cursor continues the chain
    assert held.keys == [c0, h.key] and held.cursor == h.key


def test_clear_forgets_everything():
    store = UnitRecordStore()
    h = hashed(range(64))
    store.hold(h.unit_records(), at=[16])
    store.clear()
    assert store.num_records == store.num_roots == len(store) == 0
    assert store.confirm(h) == 0 and h.key not in store
    assert store.nbytes == UnitRecordStore().nbytes


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize(("unit", "low", "high"), [(16, 12.0, 24.0), (256, 4.2, 6.0)])
def test_memory_per_cached_token(unit, low, high):
    # per unit: a record (64 B), its key (33 + 32 B), its payload (33 + 16 + 4 * unit B) and
    # a dict slot: about 17.4 B per token at unit 16 and 4.85 at unit 256 (4 are token ids)
    rng = np.random.default_rng(unit)
    prompts = [rng.integers(0, 2**17, 2048) for _ in range(16)]
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        store = UnitRecordStore()
        for p in prompts:
            h = PrefixHasher(ExtraKeys(cache_salt="t"), unit=unit)
            h.extend(p)
            store.hold(h.unit_records(), at=[len(p)])
            del h
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    tokens = 16 * 2048
    assert store.num_records == tokens // unit
    per_token = store.nbytes / tokens
    assert low <= per_token <= high
    assert abs(traced - store.nbytes) / traced < 0.15  # nbytes is what the process holds
    assert per_token > 4  # more than the token ids themselves
