"""Issue 32, classes 2 and 3, on a real Redis server (Mooncake Store:
``test_remote_tier_mooncake.py``): remote store keys name the model, and a remote hit is exact.

- Class 2: engines with equal cache layouts but another model identity (revision, weights,
  config, dtype, quantization, tensor- or pipeline-parallel shard, or only another path) on
  the default namespace of one store never read each other's values; equal identities share,
  in one process and across two.
- Class 3: with every key algorithm offered (``sha256``, ``blake2b`` and an injected digest),
  a forced collision (a key function that ignores token ids, so two prompts of one length get
  equal keys) finds the other prompt's value, whose content proof differs: a counted miss
  (``other_content``), its pages forgotten, not one wrong byte on a device block. Values in
  the older format (no proof) are counted misses (``old_format``).

Each table row checks the state afterwards: the store's contents, the counters, host pages.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import _remote_engine as engine
import pytest
from _store_helpers import as_version_2
from conftest import HAVE_REDIS
from pydantic import ValidationError

from kvforge import CacheController, ModelIdentity, config_digest
from kvforge.core import prefix_keys
from kvforge.core.values import PrefixMatch, PrefixQuery
from kvforge.remote_tier import layout_fingerprint
from kvforge.scheduler.block_manager import BlockManager
from kvforge.verify import token_seeds, verify_request

HERE = Path(__file__).resolve().parent
CONFIG = config_digest({"layers": 4})
BASE = dict(name="/models/gqa-test", config_digest=CONFIG, dtype="bf16")
P1 = list(range(1, 161))  # 160 tokens: a hit reaches 144 (the last boundary before the end)
P2 = list(range(1001, 1161))  # as long as P1, every token other


def identity(**fields) -> ModelIdentity:
    return ModelIdentity(**{**BASE, **fields})


# -- the identity itself: bad input is refused naming the field ------------------------------

MISSING = object()
BAD_IDENTITIES = [
    ({"config_digest": MISSING}, "config_digest\n  Field required"),
    ({"config_digest": "abc"}, "config_digest must be 32 to 128 lowercase hex digits"),
    ({"config_digest": CONFIG.upper()}, "config_digest must be 32 to 128 lowercase hex digits"),
    ({"weights_digest": "not-hex" * 8}, "weights_digest must be 32 to 128 lowercase hex"),
    ({"name": ""}, "name must be non-empty text"),
    ({"dtype": "  "}, "dtype must be non-empty text"),
    ({"revision": ""}, "revision must be non-empty text"),
    ({"quantization": ""}, "quantization must be non-empty text"),
    ({"tp_rank": 2, "tp_size": 2}, "tp_rank must be in [0, tp_size=2), got 2"),
    ({"tp_rank": -1}, "tp_rank must be in [0, tp_size=1), got -1"),
    ({"pp_size": 0}, "pp_size must be >= 1, got 0"),
    ({"pp_rank": 1}, "pp_rank must be in [0, pp_size=1), got 1"),
    ({"tp_rank": True}, "tp_rank\n  Input should be a valid integer"),
    ({"tp_size": 2.0}, "tp_size\n  Input should be a valid integer"),
    ({"dtype": None}, "dtype\n  Input should be a valid string"),
    ({"path": "/models/x"}, "path\n  Extra inputs are not permitted"),
]


@pytest.mark.parametrize(
    ("fields", "message"),
    BAD_IDENTITIES,
    ids=[str(f).replace(str(MISSING), "missing") for f, _ in BAD_IDENTITIES],
)
def test_a_bad_model_identity_is_refused_naming_the_field(fields, message):
    kw = {**BASE, **fields}
    kw = {k: v for k, v in kw.items() if v is not MISSING}
    with pytest.raises(ValidationError) as err:
        ModelIdentity(**kw)
    assert message in str(err.value), str(err.value)
    assert isinstance(err.value, ValueError)


def test_an_identity_is_frozen_and_a_path_alone_is_none():
    m = identity()
    with pytest.raises(ValidationError, match="frozen"):
        m.tp_rank = 1  # type: ignore[misc]
    with pytest.raises(ValidationError, match="config_digest"):
        ModelIdentity(name="/models/gqa-test", dtype="bf16")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda: config_digest({"x": float("nan")}), "config['x'] = nan"),
        (lambda: config_digest({"x": object()}), "config['x'] is a object"),
        (lambda: config_digest({(1, 2): 1}), "has a key of type tuple"),
        (lambda: config_digest([1, 2]), "config must be a mapping"),
    ],
)
def test_a_config_without_a_canonical_form_is_refused(bad, message):
    with pytest.raises(
        (TypeError, ValueError), match=message.replace("[", r"\[").replace("(", r"\(")
    ):
        bad()


# What is in the key: each row changes one thing that makes bytes differ
VARIANTS = {
    "revision": {"revision": "0123abcd"},
    "weights": {"weights_digest": "ab" * 32},
    "config": {"config_digest": config_digest({"layers": 4, "rope_theta": 1e6})},
    "dtype": {"dtype": "fp16"},
    "quantization": {"quantization": "fp8"},
    "tp rank": {"tp_rank": 1, "tp_size": 2},
    "tp size": {"tp_size": 2},
    "pp rank": {"pp_rank": 1, "pp_size": 2},
    "pp size": {"pp_size": 2},
    "path": {"name": "/models/other-path"},
}


def test_every_field_of_the_identity_is_in_the_fingerprint():
    ctl = CacheController({0: engine_backend()}, enable_prefix_caching=True)
    try:
        base = layout_fingerprint(ctl.layout, identity())
        prints = {
            name: layout_fingerprint(ctl.layout, identity(**f)) for name, f in VARIANTS.items()
        }
        assert base == layout_fingerprint(ctl.layout, identity())  # equal identities share
        assert len({base, *prints.values()}) == len(VARIANTS) + 1  # all different
    finally:
        ctl.free()


def test_another_process_computes_the_same_identity_digest():
    code = (
        "import json, sys; from kvforge import ModelIdentity, config_digest; "
        "m = ModelIdentity(**json.loads(sys.argv[1])); print(m.digest.hex(), "
        "config_digest({'b': [1, 2.5, None], 'a': {'y': True}}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(BASE)], capture_output=True, text=True, check=True
    )
    digest, config = out.stdout.split()
    assert digest == identity().digest.hex()
    assert config == config_digest({"a": {"y": True}, "b": [1, 2.5, None]})


def engine_backend():
    from kvforge import GQABackend

    return GQABackend(2, 8, block_size=16)


# -- class 2 on a real server ---------------------------------------------------------------

redis_only = pytest.mark.skipif(not HAVE_REDIS, reason="redis-server or redis-py missing")


def gqa(port: int, model: ModelIdentity, **store) -> CacheController:
    from test_remote_tier import gqa_controller

    return gqa_controller(port, model, **store)


def contents(port: int) -> dict[bytes, bytes]:
    """Every value in the server, by name, as a digest of its bytes."""
    import redis

    client = redis.Redis(port=port)
    return {k: hashlib.sha256(client.get(k)).digest() for k in client.keys("*")}


def write(port: int, model: ModelIdentity, tokens=P1) -> dict[bytes, bytes]:
    from test_remote_tier import write_prompt

    writer = gqa(port, model)
    try:
        write_prompt(writer, tokens)
    finally:
        writer.free()
    stored = contents(port)
    assert stored, "the writer published nothing"
    return stored


def read(port: int, model: ModelIdentity, tokens=P1) -> tuple[CacheController, PrefixMatch]:
    reader = gqa(port, model)
    [match] = reader.lookup([PrefixQuery(tokens)])
    return reader, match


@redis_only
@pytest.mark.parametrize(
    ("variant", "hit"),
    [("same", 144), *((name, 0) for name in VARIANTS)],
    ids=["same", *VARIANTS],
)
def test_engines_of_other_models_never_read_each_others_values(redis_server, variant, hit):
    stored = write(redis_server.port, identity())
    reader, match = read(redis_server.port, identity(**VARIANTS.get(variant, {})))
    try:
        stats, store = reader.remote_tier.stats, reader.remote_tier.store.stats()
        assert match.num_tokens == hit
        assert contents(redis_server.port) == stored  # a lookup writes nothing
        if hit:
            engine.run(reader, "b", P1, 64, match)
            check = verify_request(reader, "b", token_seeds(P1))
            assert check.entries > 0 and check.mismatched == 0
        else:  # never even read: another model's values have other names
            assert (stats.fetched, stats.fetch_misses, store.gets_hit, store.misses) == (
                0,
                0,
                0,
                {},
            )
            assert len(reader.host_tier) == 0
    finally:
        reader.free()


def other_process(role: str, model: str, port: int, revision: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / "_remote_engine.py"), role, model, str(port), revision],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@redis_only
@pytest.mark.slow
def test_two_models_in_two_processes_share_one_redis_without_crossing(redis_server):
    """One path at two revisions, equal layouts, the default namespace: 0 hits across
    models; the same identity in another process is served the whole prompt."""
    wrote = engine.main("write", "gqa", redis_server.port, "rev-a")
    assert engine.all_landed(wrote), wrote
    stored = contents(redis_server.port)
    other = other_process("read", "gqa", redis_server.port, "rev-b")
    assert other["hit_tokens"] == other["fetched"] == other["reach_tokens"] == 0, other
    assert other["fetch_misses"] == 0 and not other["store"]["misses"], other
    assert other["entries"] > 0 and other["mismatched"] == 0, other  # recomputed, its own
    same = other_process("read", "gqa", redis_server.port, "rev-a")
    assert engine.served_whole(same, 192), same
    # the rev-b reader published its own values under its own names, beside rev-a's
    after = contents(redis_server.port)
    assert all(after[k] == v for k, v in stored.items())
    assert len(after) > len(stored)


# -- class 3: a remote hit is exact under every key algorithm --------------------------------


def ignores_tokens(data: bytes) -> bytes:
    """A key digest that reads the parent key, offset and count only (the first 44 bytes of a
    unit or tail preimage), so two prompts of one length get equal keys at every block."""
    return hashlib.sha256(data[:44]).digest()


ALGORITHMS = ["sha256", "blake2b", "injected"]


def collide(monkeypatch, algorithm: str) -> None:
    """Make ``algorithm`` (as an engine would name it) collide on every prompt of one length:
    the named digests are replaced in the registry the hasher reads, the injected one is
    passed to every BlockManager the controllers build."""
    if algorithm == "injected":
        chosen: object = ignores_tokens
    else:
        monkeypatch.setitem(prefix_keys._ALGORITHMS, algorithm, ignores_tokens)
        chosen = algorithm
    init = BlockManager.__init__

    def with_algorithm(self, *args, **kw):
        kw["key_algorithm"] = chosen  # the controller passes its options' algorithm
        init(self, *args, **kw)

    monkeypatch.setattr(BlockManager, "__init__", with_algorithm)


@redis_only
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_forced_collision_is_a_counted_miss_on_the_remote_path(
    redis_server, monkeypatch, algorithm
):
    collide(monkeypatch, algorithm)
    port, model = redis_server.port, identity()
    stored = write(port, model, P1)
    # P2 has P1's keys: the store says it holds them, and the values carry P1's proof
    reader, match = read(port, model, P2)
    try:
        stats, store = reader.remote_tier.stats, reader.remote_tier.store.stats()
        assert match.num_tokens == 0
        assert stats.fetched == 0 and stats.fetch_misses > 0, stats
        assert store.misses == {"other_content": stats.fetch_misses}, store
        assert store.gets_hit == 0 and store.errors == 0
        assert len(reader.host_tier) == 0  # the reserved pages were forgotten, never served
        assert contents(port) == stored  # nothing written by the lookup
        # the same store still serves P1 to an engine that asks for P1, byte for byte
        control, hit = read(port, model, P1)
        try:
            assert hit.num_tokens == 144
            engine.run(control, "c", P1, 64, hit)
            check = verify_request(control, "c", token_seeds(P1))
            assert check.entries > 0 and check.mismatched == 0
        finally:
            control.free()
        # P2 computed from scratch: every entry on its device blocks is P2's own
        engine.run(reader, "b", P2, 64, match)
        check = verify_request(reader, "b", token_seeds(P2))
        assert check.entries > 0 and check.mismatched == 0
    finally:
        reader.free()


@redis_only
def test_values_written_without_a_proof_are_counted_old_format_misses(redis_server):
    import redis

    port, model = redis_server.port, identity()
    write(port, model, P1)
    client = redis.Redis(port=port)
    for name in client.keys("*"):
        client.set(name, as_version_2(client.get(name)))
    stored = contents(port)
    reader, match = read(port, model, P1)
    try:
        stats, store = reader.remote_tier.stats, reader.remote_tier.store.stats()
        assert match.num_tokens == 0 and stats.fetched == 0 and stats.fetch_misses > 0
        assert store.misses == {"old_format": stats.fetch_misses}, store
        assert len(reader.host_tier) == 0 and contents(port) == stored
    finally:
        reader.free()


# -- the writer's proof: the SHA-256 chain of the stored records -----------------------------


@pytest.mark.parametrize("algorithm", ["sha256", "blake2b", ignores_tokens])
def test_a_records_sha256_chain_is_the_sha256_key_of_its_content(algorithm):
    import numpy as np

    from kvforge.core.prefix_keys import ExtraKeys, PrefixHasher
    from kvforge.scheduler.unit_records import UnitRecordStore

    store = UnitRecordStore()
    tokens = np.arange(5, 69)  # 4 units of 16
    h = PrefixHasher(ExtraKeys(cache_salt="t"), unit=16, algorithm=algorithm)
    keys = h.extend(tokens)
    held = store.hold(h.unit_records(), at=[32, 64])
    want = PrefixHasher(ExtraKeys(cache_salt="t"), unit=16).extend(tokens)  # real SHA-256
    before = store.nbytes
    assert [store.sha256_chain(k) for k in keys] == want
    assert store.nbytes > before  # the digests kept with the records are counted
    # a record made again under the same key with other content is hashed anew, never from
    # what its predecessor kept (a weak digest gives other tokens the same keys)
    twin = UnitRecordStore()  # the same records, no digests computed
    twin_held = twin.hold(h.unit_records(), at=[32, 64])
    for key in (*held.keys, held.cursor):
        store.release(key)
        twin.release(key)
    assert twin_held == held
    assert store.num_records == 0 and store.nbytes == twin.nbytes  # the digests went too
    other = PrefixHasher(ExtraKeys(cache_salt="t"), unit=16, algorithm=algorithm)
    other_keys = other.extend(tokens + 1000)
    store.hold(other.unit_records(), at=[64])
    fresh = PrefixHasher(ExtraKeys(cache_salt="t"), unit=16).extend(tokens + 1000)
    assert store.sha256_chain(other_keys[-1]) == fresh[-1] != want[-1]
    assert (other_keys == keys) == (algorithm is ignores_tokens)
    with pytest.raises(KeyError, match="no such record is held"):
        store.sha256_chain(b"\0" * 32)
