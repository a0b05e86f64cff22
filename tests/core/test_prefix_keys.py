"""Prefix keys: the canonical encoding (re-derived here from the spec alone), tagged extra
keys, multimodal items by position, structured collisions (Thue–Morse), streaming, bad input
and reproducibility across processes."""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from kvforge.core.prefix_keys import (
    ExtraKeys,
    MultimodalKey,
    PrefixHasher,
    UnitRecords,
    as_extra_keys,
    prefix_keys,
    unit_of,
)

D1 = hashlib.sha256(b"image-1").digest()
D2 = hashlib.sha256(b"image-2").digest()

# --------------------------------------------------------------------------- the spec


def spec_value(v: object) -> bytes:
    if v is None:
        return b"\x00"
    if isinstance(v, bool):
        return b"\x01" + bytes([v])
    if isinstance(v, int):
        return b"\x02" + struct.pack("<q", v)
    if isinstance(v, str):
        raw = v.encode()
        return b"\x03" + struct.pack("<I", len(raw)) + raw
    return b"\x04" + struct.pack("<I", len(v)) + v


def spec_extra(salt=None, adapter=None, custom=()) -> bytes:
    fields = []
    if salt is not None:
        fields.append(b"\x01" + spec_value(salt))
    if adapter is not None:
        fields.append(b"\x02" + spec_value(adapter))
    for name, v in sorted(custom):
        fields.append(
            b"\x03" + struct.pack("<I", len(name.encode())) + name.encode() + spec_value(v)
        )
    return struct.pack("<I", len(fields)) + b"".join(fields)


def spec_keys(tokens, unit, extra: bytes, mm=(), h=lambda b: hashlib.sha256(b).digest()):
    """Keys per unit, written from docs/prefix_keys.md with struct and hashlib only."""
    key = h(b"kvforge-prefix-keys" + struct.pack("<I", 1) + extra)
    keys = []
    for j in range(len(tokens) // unit):
        lo, hi = j * unit, (j + 1) * unit
        items = sorted((s, e, d) for s, e, d in mm if s < hi and e > lo)
        payload = (
            struct.pack("<QI", lo, unit)
            + struct.pack(f"<{unit}I", *tokens[lo:hi])
            + struct.pack("<I", len(items))
            + b"".join(struct.pack("<QQI", s, e, len(d)) + d for s, e, d in items)
        )
        key = h(key + payload)
        keys.append(key)
    return keys


def test_the_worked_example_of_the_doc():
    h = PrefixHasher(ExtraKeys(cache_salt="tenant-a"), unit=16)
    keys = h.extend(list(range(16)))
    assert h.root.hex() == "fc1a6dc41c12e5583cbf8cdcb0429759004f0eb41402cea69759424b16b2661b"
    assert keys[0].hex() == "c6c84d2d8e035345f624df226c71f4aa186c17a74e6be3dbda80fc3e7f0e2d2c"
    # root preimage: 19 + 4 + (4 + 1 + 1 + 4 + 8) = 41 bytes; payload 8 + 4 + 64 + 4 = 80
    assert h.root_preimage == bytes.fromhex(
        "6b76666f7267652d7072656669782d6b657973 01000000 01000000 01 03 08000000 74656e616e742d61"
    )  # domain tag, version 1, N = 1, cache_salt tag, str type, length 8, "tenant-a"
    assert len(h.unit_records().payloads[0]) == 80
    assert keys == spec_keys(list(range(16)), 16, spec_extra(salt="tenant-a"))


@pytest.mark.parametrize("unit", [1, 3, 16, 64])
@pytest.mark.parametrize("algorithm", ["sha256", "blake2b"])
def test_keys_follow_the_spec_with_every_kind_of_key(unit, algorithm):
    h_spec = {
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "blake2b": lambda b: hashlib.blake2b(b, digest_size=32).digest(),
    }[algorithm]
    custom = (("tier", 3), ("region", "eu"), ("flag", True), ("blob", b"\x00\x01"), ("n", None))
    mm = [(5, 40, D1), (0, 2, D2), (5, 40, D1), (130, 131, D2)]
    tokens = np.random.default_rng(unit).integers(0, 2**32, 200, dtype=np.uint64)
    h = PrefixHasher(
        ExtraKeys(cache_salt="s", adapter="lora-7", custom=custom),
        [MultimodalKey(*m) for m in mm],
        unit=unit,
        algorithm=algorithm,
    )
    expect = spec_keys(tokens.tolist(), unit, spec_extra("s", "lora-7", custom), mm, h_spec)
    assert h.extend(tokens) == expect
    rec = h.unit_records()
    assert rec.keys == tuple(expect)
    for i, (k, p) in enumerate(zip(rec.keys, rec.payloads, strict=True)):
        parent = rec.parent if i == 0 else rec.keys[i - 1]
        assert h_spec(parent + p) == k


def test_hashing_costs_one_digest_per_unit():
    calls = []

    def counting(data: bytes) -> bytes:
        calls.append(len(data))
        return hashlib.sha256(data).digest()

    h = PrefixHasher(unit=16, algorithm=counting)
    assert len(h.extend(np.arange(2048))) == 128
    # the root, then 128 units of 32 + 80 bytes each: 2,048 / 16 digests, not 2,048
    assert len(calls) == 1 + 128 and set(calls[1:]) == {112}
    assert h.extend(np.arange(15)) == [] and len(calls) == 129  # pending: no digest yet
    assert len(h.extend([7])) == 1 and len(calls) == 130


# ------------------------------------------------------------------------ extra keys

EXTRA_VARIANTS = {
    "nothing": ExtraKeys(),
    "salt x": ExtraKeys(cache_salt="x"),
    "adapter x": ExtraKeys(adapter="x"),
    "custom x=x": ExtraKeys(custom=[("x", "x")]),
    "custom cache_salt=x": ExtraKeys(custom=[("cache_salt", "x")]),
    "salt and adapter x": ExtraKeys(cache_salt="x", adapter="x"),
    "salt 1": ExtraKeys(cache_salt="1"),
    "int 1": ExtraKeys(custom=[("k", 1)]),
    "str 1": ExtraKeys(custom=[("k", "1")]),
    "True": ExtraKeys(custom=[("k", True)]),
    "bytes 1": ExtraKeys(custom=[("k", b"1")]),
    "None": ExtraKeys(custom=[("k", None)]),
    "int 0": ExtraKeys(custom=[("k", 0)]),
    "False": ExtraKeys(custom=[("k", False)]),
    "empty str": ExtraKeys(custom=[("k", "")]),
    "empty bytes": ExtraKeys(custom=[("k", b"")]),
    "two fields": ExtraKeys(custom=[("k", 1), ("l", 1)]),
    "name kl": ExtraKeys(custom=[("kl", 1)]),
    "salt ab": ExtraKeys(cache_salt="ab"),
    "salt a, adapter b": ExtraKeys(cache_salt="a", adapter="b"),
    "int -1": ExtraKeys(custom=[("k", -1)]),
    "int 2**63-1": ExtraKeys(custom=[("k", 2**63 - 1)]),
}


def test_extra_keys_that_print_alike_give_different_roots_and_keys():
    roots, firsts = {}, {}
    for name, extra in EXTRA_VARIANTS.items():
        h = PrefixHasher(extra)
        roots.setdefault(h.root, []).append(name)
        firsts.setdefault(h.extend(np.arange(16))[0], []).append(name)
    assert len(roots) == len(EXTRA_VARIANTS), [v for v in roots.values() if len(v) > 1]
    assert len(firsts) == len(EXTRA_VARIANTS)


def test_no_extra_keys_is_the_empty_value_and_order_does_not_matter():
    assert PrefixHasher().root == PrefixHasher(ExtraKeys()).root
    assert PrefixHasher(ExtraKeys(cache_salt=None)).root == PrefixHasher().root
    a = ExtraKeys(custom={"b": 2, "a": 1})
    b = ExtraKeys(custom=[["a", 1], ("b", 2)])
    assert a == b and a.custom == (("a", 1), ("b", 2)) and a.encode() == b.encode()
    assert ExtraKeys().encode() == b"\x00\x00\x00\x00"


class Odd:
    pass


BAD_EXTRA = [
    (dict(cache_salt=1), TypeError, "ExtraKeys.cache_salt must be a str or None, got int"),
    (dict(cache_salt=b"x"), TypeError, "got bytes"),
    (dict(cache_salt=""), ValidationError, "non-empty"),
    (dict(adapter=3.0), TypeError, "ExtraKeys.adapter must be a str or None, got float"),
    (dict(adapter=""), ValidationError, "pass None for no adapter"),
    (dict(cache_salt="\ud800"), ValidationError, "not valid Unicode"),
    (dict(custom=[("t", 0.5)]), TypeError, "ExtraKeys.custom['t'] has type float (0.5)"),
    (dict(custom=[("t", [1])]), TypeError, "ExtraKeys.custom['t'] has type list"),
    (dict(custom=[("t", Odd())]), TypeError, "has type test_prefix_keys.Odd"),
    (dict(custom=[("t", object())]), TypeError, "has type object"),
    (dict(custom=[("t", np.arange(3))]), TypeError, "has type numpy.ndarray"),
    (dict(custom=[("t", np.int64(1))]), TypeError, "has type numpy.int64"),
    (dict(custom=[("t", (1,))]), TypeError, "has type tuple"),
    (dict(custom=[("t", bytearray(b"1"))]), TypeError, "has type bytearray"),
    (dict(custom=[("t", 2**63)]), ValidationError, "signed 64-bit"),
    (dict(custom=[("t", 1), ("t", 2)]), ValidationError, "names a field 't' twice"),
    (dict(custom={"t": 1, "u": 1.5}), TypeError, "ExtraKeys.custom['u']"),
    (dict(custom=[(1, 1)]), TypeError, "has a int name"),
    (dict(custom=[("", 1)]), ValidationError, "empty name"),
    (dict(custom=[("t",)]), TypeError, "(name, value) pair"),
    (dict(custom="t=1"), TypeError, "mapping or a sequence of (name, value) pairs"),
    (dict(tenant="a"), ValidationError, "tenant"),
]


@pytest.mark.parametrize(("kwargs", "exc", "fragment"), BAD_EXTRA)
def test_bad_extra_keys_are_refused_by_name(kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        ExtraKeys(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize("value", [("tenant-a",), ["tenant-a"], {"cache_salt": "a"}, "tenant-a"])
def test_a_plain_value_where_extra_keys_belong_is_a_type_error_that_says_what_to_pass(value):
    with pytest.raises(TypeError, match=r"must be an ExtraKeys .*ExtraKeys\(cache_salt="):
        PrefixHasher(value)
    with pytest.raises(TypeError, match=r"query\.extra_keys must be an ExtraKeys"):
        as_extra_keys(value, "query.extra_keys")
    assert as_extra_keys(None) == ExtraKeys()


def test_extra_keys_are_frozen_and_hashable():
    e = ExtraKeys(cache_salt="a")
    with pytest.raises(ValidationError):
        e.cache_salt = "b"  # type: ignore[misc]
    assert len({e, ExtraKeys(cache_salt="a"), ExtraKeys(adapter="a")}) == 2


# ------------------------------------------------------------------ multimodal keys


def keys_with(mm, n=64, unit=16):
    return PrefixHasher(mm_keys=[MultimodalKey(*m) for m in mm], unit=unit).extend(
        np.zeros(n, dtype=np.int64)
    )


def test_the_same_item_twice_does_not_cancel():
    none, once = keys_with([]), keys_with([(0, 4, D1)])
    twice_same_place = keys_with([(0, 4, D1), (0, 4, D1)])
    twice_apart = keys_with([(0, 4, D1), (20, 24, D1)])
    once_apart = keys_with([(20, 24, D1)])
    assert len({none[0], once[0], twice_same_place[0]}) == 3
    assert twice_apart[0] == once[0] and twice_apart[1] != once[1]  # unit 1 holds the 2nd
    assert len({twice_apart[1], once_apart[1], once[1], none[1]}) == 4


def test_overlapping_items_are_each_encoded():
    a = keys_with([(0, 20, D1), (10, 30, D2)])
    b = keys_with([(0, 20, D1)])
    c = keys_with([(10, 30, D2)])
    d = keys_with([(0, 20, D2), (10, 30, D1)])  # same ranges, digests swapped
    e = keys_with([(10, 30, D2), (0, 20, D1)])  # same items, other order: same keys
    assert a == e
    assert len({a[0], b[0], c[0], d[0]}) == 4 and len({a[1], b[1], c[1], d[1]}) == 4


@pytest.mark.parametrize(
    ("rng", "units"),
    [((15, 16), {0}), ((16, 17), {1}), ((0, 32), {0, 1}), ((31, 33), {1, 2}), ((0, 16), {0})],
)
def test_items_at_unit_edges_land_in_exactly_the_units_they_overlap(rng, units):
    h = PrefixHasher(mm_keys=[MultimodalKey(*rng, D1)], unit=16)
    plain = PrefixHasher(unit=16)
    h.extend(np.zeros(64, dtype=np.int64))
    plain.extend(np.zeros(64, dtype=np.int64))
    got, ref = h.unit_records().payloads, plain.unit_records().payloads
    item = struct.pack("<QQI", *rng, 32) + D1  # whole, with its absolute positions
    for j in range(4):
        if j in units:
            assert got[j] == ref[j][:-4] + struct.pack("<I", 1) + item
        else:
            assert got[j] == ref[j]
    first = min(units)
    assert h.unit_records().keys[:first] == plain.unit_records().keys[:first]
    assert all(
        a != b
        for a, b in zip(
            h.unit_records().keys[first:], plain.unit_records().keys[first:], strict=True
        )
    )


BAD_MM = [
    ((0, 4, D1[:31]), ValueError, "digest has 31 bytes"),
    ((0, 4, b""), ValueError, "digest has 0 bytes"),
    ((0, 4, D1.hex()), TypeError, "digest must be bytes, got str"),
    ((0, 4, bytearray(D1)), TypeError, "got bytearray"),
    ((4, 4, D1), ValueError, "start < end"),
    ((5, 4, D1), ValueError, "start=5, end=4"),
    ((-1, 4, D1), ValueError, "0 <= start"),
    ((0, 2**63, D1), ValueError, "2**63"),
    ((0.0, 4, D1), TypeError, "MultimodalKey.start must be an int, got float"),
    ((True, 4, D1), TypeError, "got bool"),
    ((0, "4", D1), TypeError, "MultimodalKey.end must be an int, got str"),
]


@pytest.mark.parametrize(("args", "exc", "fragment"), BAD_MM)
def test_bad_multimodal_keys_are_refused(args, exc, fragment):
    with pytest.raises(exc, match=None) as info:
        MultimodalKey(*args)
    assert fragment in str(info.value)


def test_multimodal_keys_take_numpy_positions_and_refuse_plain_tuples():
    assert MultimodalKey(np.int64(3), np.int32(9), D1) == MultimodalKey(3, 9, D1)
    with pytest.raises(TypeError, match=r"mm_keys\[1\] is a tuple .*MultimodalKey\(start, end"):
        PrefixHasher(mm_keys=[MultimodalKey(0, 1, D1), (0, 4, D1)])
    with pytest.raises(TypeError, match="sequence of MultimodalKey"):
        PrefixHasher(mm_keys=MultimodalKey(0, 1, D1))


# ------------------------------------------------------------ structured collisions


def thue_morse(n: int, a: int, b: int) -> np.ndarray:
    bits = np.array([bin(i).count("1") & 1 for i in range(n)])
    return np.where(bits == 0, a, b)


PAIRS = [(0, 1), (1, 2**31), (5, 131_071), (7, 2**32 - 1), (40_000, 40_001)]


@pytest.mark.parametrize("algorithm", ["sha256", "blake2b"])
@pytest.mark.parametrize("unit", [16, 64, 128, 256, 512, 1024])
@pytest.mark.parametrize("extra", [None, ExtraKeys(cache_salt="tenant-a")])
def test_thue_morse_pairs_never_share_a_key(algorithm, unit, extra):
    # the construction: 256 Thue–Morse tokens over (a, b), the swapped sequence,
    # then the same suffix on both (long enough for two units of the largest size)
    suffix = np.random.default_rng(0).integers(0, 131_072, 700 + 2 * unit)
    for a, b in PAIRS:
        one = np.concatenate([thue_morse(256, a, b), suffix])
        two = np.concatenate([thue_morse(256, b, a), suffix])
        k1 = prefix_keys(one, extra, unit=unit, algorithm=algorithm)
        k2 = prefix_keys(two, extra, unit=unit, algorithm=algorithm)
        assert len(k1) == len(k2) == len(one) // unit >= 2
        assert all(x != y for x, y in zip(k1, k2, strict=True))
        assert not set(k1) & set(k2)


# ----------------------------------------------------------------------- streaming


@pytest.mark.parametrize("unit", [1, 3, 16, 64])
def test_extend_in_pieces_gives_the_keys_of_extend_at_once(unit):
    rng = np.random.default_rng(unit)
    tokens = rng.integers(0, 2**32, 500, dtype=np.uint64)
    mm = [MultimodalKey(10, 90, D1), MultimodalKey(300, 301, D2)]
    whole = PrefixHasher(ExtraKeys(adapter="a"), mm, unit=unit)
    expect = whole.extend(tokens)
    for trial in range(5):
        cuts = np.sort(rng.choice(np.arange(1, 500), size=trial * 3 + 1, replace=False))
        h = PrefixHasher(ExtraKeys(adapter="a"), mm, unit=unit)
        got = []
        for piece in np.split(tokens, cuts):
            got += h.extend(piece.tolist() if trial % 2 else piece)
        assert got == expect and h.num_tokens == 500 and h.num_units == 500 // unit
        assert h.key == expect[-1]


def test_at_selects_the_keys_of_given_prefixes():
    h = PrefixHasher(unit=16)
    every = PrefixHasher(unit=16).extend(np.arange(200))
    assert h.extend(np.arange(10), at=[]) == []
    got = h.extend(np.arange(10, 200), at=np.array([16, 64, 64, 192]))
    assert got == [every[0], every[3], every[3], every[11]]


def test_at_prefix_then_continue_equals_direct():
    tokens = np.random.default_rng(1).integers(0, 50_000, 300)
    direct = prefix_keys(tokens, ExtraKeys(cache_salt="s"), unit=16)
    h = PrefixHasher(ExtraKeys(cache_salt="s"), unit=16)
    h.extend(tokens[:200])
    for n in (0, 48, 192, 200):
        g = h.at_prefix(n)
        assert g.num_tokens == n
        assert g.unit_records().end == (n // 16) * 16
        assert g.extend(tokens[n:]) == direct[n // 16 :]
    assert h.num_tokens == 200 and h.key == direct[11]  # the source did not move
    # records of a copy are its source's up to the copy's position
    assert h.at_prefix(64).unit_records() == h.unit_records().upto(64)


def test_at_prefix_within_an_extend_that_began_mid_unit():
    h = PrefixHasher(unit=16)
    h.extend(np.arange(20))  # unit [0, 16) done, 4 pending
    h.extend(np.arange(20, 70))  # completes units ending at 32, 48, 64
    rec = h.unit_records()
    assert (rec.start, rec.end) == (16, 64)
    assert h.at_prefix(16).key == PrefixHasher(unit=16).extend(np.arange(16))[0]
    for bad, fragment in [(8, "at_prefix(8)"), (50, "within the last extend [16, 64]"), (80, "80")]:
        with pytest.raises(ValueError) as info:
            h.at_prefix(bad)
        assert fragment in str(info.value)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        h.at_prefix(16.0)


def snapshot(h: PrefixHasher):
    return (h.num_tokens, h.num_units, h.key, h.unit_records(), h._pending.tolist())


BAD_TOKENS = [
    ([1, -1], ValueError, "tokens[1] = -1 is outside [0, 2**32)"),
    ([2**32], ValueError, "tokens[0] = 4294967296"),
    (np.array([0, 2**40], dtype=np.int64), ValueError, "tokens[1] = 1099511627776"),
    (np.array([2**63], dtype=np.uint64), ValueError, "tokens[0]"),
    ([2**70], ValueError, "2**32"),
    ([[1, 2]], ValueError, "1-D"),
    (np.array([1.0, 2.0]), TypeError, "integers, got an array of float64"),
    ([True, False], TypeError, "array of bool"),
    ("abc", ValueError, "1-D"),
    (["a"], TypeError, "<U1"),
]


@pytest.mark.parametrize(("tokens", "exc", "fragment"), BAD_TOKENS)
def test_token_ids_out_of_range_are_refused_and_nothing_changes(tokens, exc, fragment):
    h = PrefixHasher(unit=4)
    h.extend([1, 2, 3, 4, 5, 6])
    before = snapshot(h)
    with pytest.raises(exc) as info:
        h.extend(tokens)
    assert fragment in str(info.value)
    assert snapshot(h) == before


def test_token_id_limits_are_accepted():
    keys = PrefixHasher(unit=2).extend([0, 2**32 - 1])
    assert keys == spec_keys([0, 2**32 - 1], 2, spec_extra())


BAD_AT = [
    ([20], ValueError, "at[0] = 20 is not a multiple of the unit (16 tokens)"),
    ([16, 33], ValueError, "at[1] = 33"),
    ([16], ValueError, "at[0] = 16 is outside (16, 64]"),
    ([80], ValueError, "outside (16, 64]"),
    ([48, 32], ValueError, "ascending: at[1] = 32"),
    ([32.0], TypeError, "1-D sequence of ints"),
    ([[32]], TypeError, "1-D sequence of ints"),
]


@pytest.mark.parametrize(("at", "exc", "fragment"), BAD_AT)
def test_at_off_a_unit_boundary_is_refused_and_nothing_changes(at, exc, fragment):
    h = PrefixHasher(unit=16)
    h.extend(np.arange(16))
    before = snapshot(h)
    with pytest.raises(exc) as info:
        h.extend(np.arange(48), at=at)
    assert fragment in str(info.value)
    assert snapshot(h) == before


def test_bad_hasher_arguments():
    with pytest.raises(ValueError, match="algorithm must be 'sha256', 'blake2b'"):
        PrefixHasher(algorithm="poly128")  # the polynomial path is gone
    with pytest.raises(TypeError, match="algorithm must be"):
        PrefixHasher(algorithm=5)
    with pytest.raises(TypeError, match="not non-empty bytes"):
        PrefixHasher(algorithm=lambda b: 5)
    with pytest.raises(TypeError, match="unit must be an int"):
        PrefixHasher(unit=16.0)
    with pytest.raises(ValueError, match="unit must be >= 1"):
        PrefixHasher(unit=0)


def test_algorithms_differ_and_blake2b_is_blake2b_256():
    s = PrefixHasher(algorithm="sha256")
    b = PrefixHasher(algorithm="blake2b")
    assert s.root != b.root and len(b.root) == 32
    assert b.root == hashlib.blake2b(b.root_preimage, digest_size=32).digest()


def test_unit_records_refuse_inconsistent_fields():
    r = PrefixHasher().unit_records()
    with pytest.raises(ValueError, match="1 keys but 0 payloads"):
        UnitRecords(16, 0, r.root, r.root_preimage, r.root, (b"k",), ())
    with pytest.raises(ValueError, match="multiple of unit"):
        UnitRecords(16, 8, r.root, r.root_preimage, b"p", (), ())
    with pytest.raises(ValueError, match="not a unit boundary"):
        r.upto(16)


# ---------------------------------------------------------------------------- unit_of


def test_unit_of_is_the_gcd_of_block_sizes_and_snapshot_interval():
    assert unit_of([16]) == 16
    assert unit_of([64, 256, 4, 8]) == 4  # DeepSeek-V4: swa 64, compressed 256, states 4, 8
    assert unit_of([256, 64], snapshot_interval=96) == 32
    assert unit_of((np.int64(48), 32)) == 16


@pytest.mark.parametrize(
    ("args", "exc", "fragment"),
    [
        (([],), ValueError, "at least one"),
        (([16, 0],), ValueError, "block_sizes[1] must be >= 1"),
        (([16], -4), ValueError, "snapshot_interval must be >= 1"),
        (([16.0],), TypeError, "block_sizes[0] must be an int"),
        (([True],), TypeError, "got bool"),
        ((16,), TypeError, "sequence of ints"),
    ],
)
def test_unit_of_refuses_bad_sizes(args, exc, fragment):
    with pytest.raises(exc) as info:
        unit_of(*args)
    assert fragment in str(info.value)


# --------------------------------------------------------------------- reproducibility


SCRIPT = """
import numpy as np, hashlib
from kvforge.core.prefix_keys import ExtraKeys, MultimodalKey, PrefixHasher
h = PrefixHasher(ExtraKeys(cache_salt="t", adapter="a", custom={"n": 1, "b": b"x"}),
                 [MultimodalKey(3, 40, hashlib.sha256(b"img").digest())], unit=16,
                 algorithm="{algorithm}")
print(" ".join(k.hex() for k in h.extend(np.arange(100) * 7919)))
"""


@pytest.mark.parametrize("algorithm", ["sha256", "blake2b"])
def test_keys_are_the_same_in_another_process(algorithm):
    here = PrefixHasher(
        ExtraKeys(cache_salt="t", adapter="a", custom={"n": 1, "b": b"x"}),
        [MultimodalKey(3, 40, hashlib.sha256(b"img").digest())],
        unit=16,
        algorithm=algorithm,
    ).extend(np.arange(100) * 7919)
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT.replace("{algorithm}", algorithm)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert out.stdout.split() == [k.hex() for k in here]


def test_a_hasher_pickles_and_continues():
    h = PrefixHasher(ExtraKeys(cache_salt="s"), [MultimodalKey(0, 30, D1)], unit=16)
    h.extend(np.arange(40))
    g = pickle.loads(pickle.dumps(h))
    assert g.extend(np.arange(40, 100)) == h.extend(np.arange(40, 100))
