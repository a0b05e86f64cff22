"""The options objects (``kvforge/options.py``): every option the facade takes, validated once,
refused with an :class:`ArgumentError` that names the field and the value, leaving nothing
changed; today's keywords build the same objects; a setting given two ways is refused; and
the options reach the scheduler side (key algorithm, snapshot interval)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest

from kvforge import (
    ArgumentError,
    CacheController,
    CacheOptions,
    GQABackend,
    HostTierOptions,
    LinearAttentionBackend,
    PlanOptions,
    PrefixQuery,
)


def gqa() -> dict[int, GQABackend]:
    return {0: GQABackend(1, 8, 16)}


# ------------------------------------------------------------------ bad values, per model

BAD_OPTIONS: list[tuple[type, dict[str, Any], str]] = [
    (CacheOptions, {"enable_prefix_caching": 1}, "enable_prefix_caching must be a bool, got 1"),
    (
        CacheOptions,
        {"enable_prefix_caching": "yes"},
        "enable_prefix_caching must be a bool, got 'yes'",
    ),
    (CacheOptions, {"share_pools": "yes"}, "share_pools must be a bool, got 'yes'"),
    (CacheOptions, {"share_pools": None}, "share_pools must be a bool, got None"),
    (
        CacheOptions,
        {"key_algorithm": "md5"},
        "key_algorithm must be 'sha256', 'blake2b' or a bytes -> bytes function, got 'md5'",
    ),
    (
        CacheOptions,
        {"key_algorithm": 3},
        "key_algorithm must be 'sha256', 'blake2b' or a bytes -> bytes function, got 3",
    ),
    (CacheOptions, {"snapshot_interval": 0}, "snapshot_interval must be an int >= 1, got 0"),
    (CacheOptions, {"snapshot_interval": 64.0}, "snapshot_interval must be an int >= 1, got 64.0"),
    (CacheOptions, {"snapshot_interval": True}, "snapshot_interval must be an int >= 1, got True"),
    (
        CacheOptions,
        {"prefix_retention": "sparse"},
        "prefix_retention must be 'dense' or 'checkpoints', got 'sparse'",
    ),
    (
        CacheOptions,
        {"prefix_retention_interval": 256},
        "prefix_retention_interval applies to prefix_retention='checkpoints', got 256 with "
        "prefix_retention='dense'",
    ),
    (
        CacheOptions,
        {"prefix_retention": "checkpoints", "prefix_retention_interval": -16},
        "prefix_retention_interval must be None or a positive int, got -16",
    ),
    (
        CacheOptions,
        {"enable_prefix_cache": True},
        "CacheOptions has no option 'enable_prefix_cache' (given True); its options are "
        "enable_prefix_caching, key_algorithm",
    ),
    (PlanOptions, {"max_num_seqs": 0}, "max_num_seqs must be a positive int, got 0"),
    (PlanOptions, {"max_model_len": -1}, "max_model_len must be a positive int, got -1"),
    (PlanOptions, {"max_model_len": 4096.0}, "max_model_len must be a positive int, got 4096.0"),
    (
        PlanOptions,
        {"max_num_batched_tokens": "512"},
        "max_num_batched_tokens must be a positive int, got '512'",
    ),
    (PlanOptions, {"host": True}, "PlanOptions has no option 'host' (given True)"),
    (
        HostTierOptions,
        {"policy": "lru"},
        "host_tier_policy must be 'eviction' or 'write_through', got 'lru'",
    ),
    (
        HostTierOptions,
        {"policy": None},
        "host_tier_policy must be 'eviction' or 'write_through', got None",
    ),
    (
        HostTierOptions,
        {"snapshot_policy": "all"},
        "snapshot_policy must be 'skip' or 'aligned', got 'all'",
    ),
]


@pytest.mark.parametrize(("model", "fields", "message"), BAD_OPTIONS)
def test_a_bad_option_is_an_argument_error_naming_field_and_value(model, fields, message):
    with pytest.raises(ArgumentError) as err:
        model(**fields)
    assert str(err.value).startswith(message)
    assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)
    with pytest.raises(ArgumentError) as again:  # a mapping is checked by the same code
        model.model_validate(fields)
    assert str(again.value) == str(err.value)


@pytest.mark.parametrize("model", [CacheOptions, PlanOptions, HostTierOptions])
def test_options_are_frozen_and_a_copy_is_validated(model):
    options = model()
    name = next(iter(model.model_fields))
    with pytest.raises(ValueError, match="frozen"):
        setattr(options, name, getattr(options, name))
    bad = {"CacheOptions": "yes", "PlanOptions": 0, "HostTierOptions": "lru"}[model.__name__]
    field = {"CacheOptions": "share_pools", "PlanOptions": "max_num_seqs"}.get(
        model.__name__, "policy"
    )
    with pytest.raises(ArgumentError, match=repr(bad)):
        options.model_copy(update={field: bad})
    assert options == model()  # the original is unchanged
    with pytest.raises(ArgumentError, match="built from a mapping of options, got list"):
        model.model_validate([("a", 1)])


def test_the_defaults_are_todays():
    assert CacheOptions().model_dump() == {
        "enable_prefix_caching": False,
        "key_algorithm": "sha256",
        "snapshot_interval": None,
        "prefix_retention": "dense",
        "prefix_retention_interval": None,
        "share_pools": True,
    }
    assert PlanOptions().model_dump() == dict.fromkeys(
        ["max_num_seqs", "max_model_len", "max_num_batched_tokens"]
    )
    assert HostTierOptions().model_dump() == {"policy": "eviction", "snapshot_policy": None}
    numpy = pytest.importorskip("numpy")
    assert PlanOptions(max_num_seqs=numpy.int64(4)).max_num_seqs == 4
    assert type(PlanOptions(max_num_seqs=numpy.int64(4)).max_num_seqs) is int


# ------------------------------------------------------------------ through the facade

FACADE: list[tuple[str, Callable[[], object], str]] = [
    (
        "keyword",
        lambda: CacheController(gqa(), share_pools="yes"),
        "share_pools must be a bool, got 'yes'",
    ),
    (
        "options_of_another_type",
        lambda: CacheController(gqa(), options={"share_pools": False}),
        "CacheController: options must be a CacheOptions or None, got {'share_pools': False}",
    ),
    (
        "both_ways",
        lambda: CacheController(
            gqa(), enable_prefix_caching=True, options=CacheOptions(share_pools=False)
        ),
        "CacheController: ['enable_prefix_caching'] given both as keywords and with a CacheOptions",
    ),
    (
        "both_ways_even_when_equal",
        lambda: CacheController(gqa(), share_pools=True, options=CacheOptions()),
        "CacheController: ['share_pools'] given both as keywords and with a CacheOptions",
    ),
]


@pytest.mark.parametrize(("name", "call", "message"), FACADE, ids=[r[0] for r in FACADE])
def test_the_controller_refuses_bad_options_before_it_builds_anything(name, call, message):
    with pytest.raises(ArgumentError) as err:
        call()
    assert str(err.value).startswith(message)
    # nothing was made: the same backends build a working controller afterwards
    ctl = CacheController(gqa())
    ctl.initialize_kv_cache(num_blocks=4)
    assert ctl.device_bytes == 4 * 2 * 16 * 1 * 8 * 2
    ctl.free()


BAD_PLANS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    (
        "seqs_zero",
        {"memory_budget": 1 << 20, "max_num_seqs": 0},
        ArgumentError,
        "max_num_seqs must be a positive int, got 0",
    ),
    (
        "len_float",
        {"num_blocks": 4, "max_model_len": 64.0},
        ArgumentError,
        "max_model_len must be a positive int, got 64.0",
    ),
    (
        "batched_with_blocks",
        {"num_blocks": 4, "max_num_batched_tokens": 64},
        ValueError,
        "['max_num_batched_tokens'] go with memory_budget, not num_blocks",
    ),
    (
        "plan_and_keyword",
        {"memory_budget": 1 << 20, "max_num_seqs": 2, "plan": PlanOptions(max_model_len=64)},
        ArgumentError,
        "plan options: ['max_num_seqs'] given both as keywords and with a PlanOptions",
    ),
    (
        "plan_not_options",
        {"memory_budget": 1 << 20, "plan": {"max_num_seqs": 2}},
        ArgumentError,
        "plan options: options must be a PlanOptions or None",
    ),
]


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "message"), BAD_PLANS, ids=[r[0] for r in BAD_PLANS]
)
def test_bad_plan_options_leave_the_controller_uninitialized(name, kwargs, error, message):
    ctl = CacheController(gqa())
    with pytest.raises(error) as err:
        ctl.initialize_kv_cache(**kwargs)
    assert str(err.value).startswith(message)
    assert ctl.device_bytes == 0 and not ctl.storage.ready
    with pytest.raises(RuntimeError, match="call initialize_kv_cache"):
        _ = ctl.scheduler
    ctl.initialize_kv_cache(num_blocks=4, max_num_seqs=2, max_model_len=64)  # still possible
    assert ctl.scheduler.max_num_seqs == 2


def test_plan_options_and_keywords_plan_alike():
    ctl = CacheController(gqa())
    by_keywords = ctl.plan_memory(1 << 20, max_num_seqs=4, max_model_len=256)
    by_options = ctl.plan_memory(1 << 20, plan=PlanOptions(max_num_seqs=4, max_model_len=256))
    assert by_keywords == by_options
    got = ctl.initialize_kv_cache(
        memory_budget=1 << 20, plan=PlanOptions(max_num_seqs=4, max_model_len=256)
    )
    assert got == by_keywords
    assert (ctl.scheduler.max_num_seqs, ctl.scheduler.max_model_len) == (4, 256)


def test_keywords_and_options_build_the_same_controller():
    by_keywords = CacheController(gqa(), enable_prefix_caching=True, share_pools=False)
    by_options = CacheController(
        gqa(), options=CacheOptions(enable_prefix_caching=True, share_pools=False)
    )
    assert by_keywords.options == by_options.options
    assert by_options.enable_prefix_caching and not by_options.share_pools
    assert by_options.prefix_retention == "dense" and by_options.prefix_retention_interval is None


def test_the_key_algorithm_reaches_the_prefix_keys():
    calls: list[int] = []

    def digest(data: bytes) -> bytes:
        calls.append(len(data))
        return hashlib.sha256(data).digest()

    ctl = CacheController(
        gqa(), options=CacheOptions(enable_prefix_caching=True, key_algorithm=digest)
    )
    ctl.initialize_kv_cache(num_blocks=16, max_num_seqs=2, max_model_len=128)
    tokens = list(range(40))
    step = ctl.schedule(["a"], [40], [tokens])
    ctl.end_step(step)
    assert calls  # the controller's prefix keys are this function's
    ctl.free_request("a")
    match = ctl.lookup([PrefixQuery(tokens)])[0]
    assert match.num_tokens == 32  # two whole blocks of 16 are reused


def test_the_snapshot_interval_reaches_the_scheduler_and_is_checked_against_the_boundary():
    def backends() -> dict[int, Any]:
        return {0: LinearAttentionBackend(2, 2, 8, 8, 4), 1: GQABackend(1, 8, 16)}

    sizes = {"num_blocks": {"linear_state": 5, "kv": 16}, "max_num_seqs": 2, "max_model_len": 256}
    ctl = CacheController(
        backends(), options=CacheOptions(enable_prefix_caching=True, snapshot_interval=64)
    )
    ctl.initialize_kv_cache(**sizes)
    assert ctl.scheduler.snapshot_interval == 64
    default = CacheController(backends(), enable_prefix_caching=True)
    default.initialize_kv_cache(**sizes)
    assert default.scheduler.snapshot_interval == 512  # the default: >= 512, on the boundary
    off = CacheController(backends(), options=CacheOptions(snapshot_interval=24))
    with pytest.raises(ValueError, match=r"snapshot_interval must be a positive multiple of 16"):
        off.initialize_kv_cache(**sizes)  # the boundary is known once the pools are sized
    assert off.device_bytes == 0 and not off.storage.ready


def test_host_tier_options_and_keywords():
    def ready() -> CacheController:
        ctl = CacheController(gqa(), enable_prefix_caching=True)
        ctl.initialize_kv_cache(num_blocks=8, max_num_seqs=2, max_model_len=64)
        return ctl

    ctl = ready()
    with pytest.raises(
        ArgumentError, match="host_tier_policy must be 'eviction' or 'write_through', got 'lru'"
    ):
        ctl.initialize_host_tier(4, policy="lru")
    with pytest.raises(
        ArgumentError, match=r"\['policy'\] given both as keywords and with a HostTierOptions"
    ):
        ctl.initialize_host_tier(4, policy="eviction", options=HostTierOptions())
    assert ctl.host_tier is None and ctl.host_bytes == 0  # nothing was attached or allocated
    assert ctl.initialize_host_tier(4, options=HostTierOptions(policy="write_through")) == {"kv": 4}
    assert ctl.host_tier is not None and ctl.host_bytes > 0
    other = ready()
    assert other.initialize_host_tier(4, "write_through") == {"kv": 4}
    assert other.host_bytes == ctl.host_bytes
