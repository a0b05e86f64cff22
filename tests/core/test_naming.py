"""StorageNamer: the default FastDeploy-compatible names, templates, and unique names."""

import pytest

from kvforge.core.naming import DEFAULT_NAME_TEMPLATE, StorageNamer


def test_default_names_follow_fastdeploy():
    namer = StorageNamer(rank=1, device_id=3)
    assert namer.template == DEFAULT_NAME_TEMPLATE
    assert namer.name("key", 2) == "key_caches_2_rank1.device3"
    assert namer.name("value", 0) == "value_caches_0_rank1.device3"
    assert namer.name("key_scale", 5) == "key_cache_scales_5_rank1.device3"
    assert namer.name("value_scale", 5) == "value_cache_scales_5_rank1.device3"
    assert namer.name("indexer", 7) == "indexer_caches_7_rank1.device3"
    assert namer.name("swa_kv", 7) == "swa_kv_caches_7_rank1.device3"
    assert namer.pattern("key_scale") == "key_cache_scales_{layer}_rank1.device3"


def test_check_unique_returns_names_in_order():
    namer = StorageNamer()
    keys = [("key", 0), ("value", 0), ("key", 1), ("value", 1)]
    assert namer.check_unique(keys) == [
        "key_caches_0_rank0.device0",
        "value_caches_0_rank0.device0",
        "key_caches_1_rank0.device0",
        "value_caches_1_rank0.device0",
    ]
    assert namer.check_unique([]) == []


@pytest.mark.parametrize(
    ("template", "keys", "message"),
    [
        (
            "{role}{layer}",
            [("k", 11), ("k1", 1)],
            r"name_template '\{role\}\{layer\}' gives buffers \('k', 11\) and \('k1', 1\) the "
            r"same storage name 'k11'",
        ),
        (
            "L{layer}{role}_rank{rank}",
            [("k", 1), ("1k", 1), ("k", 11)],
            r"gives buffers \('1k', 1\) and \('k', 11\) the same storage name 'L11k_rank0'",
        ),
        (
            "{role}.{layer}",
            [("key", 0), ("key", 0)],
            r"buffer \('key', 0\) is listed twice \(storage name 'key.0'\)",
        ),
    ],
)
def test_check_unique_names_both_buffers_and_the_name(template, keys, message):
    namer = StorageNamer(template)
    with pytest.raises(ValueError, match=message):
        namer.check_unique(keys)
    assert namer.template == template  # nothing changed


def test_distinct_names_pass_with_a_custom_template():
    namer = StorageNamer("{role}/{layer}")
    assert namer.check_unique([("a_1", 2), ("a", 12)]) == ["a_1/2", "a/12"]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{role}_{layer}_{stage}", r"uses unknown fields \['stage'\]"),
        ("{role}_rank{rank}", r"must contain \{role\} and \{layer\} .* missing \['layer'\]"),
        ("{role}_{layer", "is not a valid format string"),
        ("{role}_{layer:q}", r"name_template '\{role\}_\{layer:q\}' cannot format a name"),
        ("{}_{role}_{layer}", r"uses unknown fields \[''\]"),
        (5, "name_template must be a str, got 5"),
    ],
)
def test_bad_templates(template, message):
    with pytest.raises(ValueError, match=message):
        StorageNamer(template)
