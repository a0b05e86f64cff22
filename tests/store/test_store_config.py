"""StoreConfig: defaults, the environment (``KVFORGE_STORE_*``), files, their precedence, and
bad settings refused with a message that names the field and the value."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from kvforge.store import open_store
from kvforge.store.config import StoreConfig


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("KVFORGE_STORE_"):
            monkeypatch.delenv(name)


def test_the_default_asks_for_no_server():
    config = StoreConfig()
    assert config.backend == "none"
    assert open_store(config, b"layout") is None
    assert config.max_inflight_puts >= 1 and config.close_timeout_s >= 0


def test_the_environment_sets_fields(monkeypatch):
    monkeypatch.setenv("KVFORGE_STORE_BACKEND", "redis")
    monkeypatch.setenv("KVFORGE_STORE_REDIS_PORT", "6390")
    monkeypatch.setenv("kvforge_store_op_timeout_s", "0.5")
    config = StoreConfig()
    assert (config.backend, config.redis_port, config.op_timeout_s) == ("redis", 6390, 0.5)
    assert config.max_get_batch_bytes is None  # the adapter's default
    monkeypatch.setenv("KVFORGE_STORE_MAX_GET_BATCH_BYTES", "1048576")
    assert StoreConfig().max_get_batch_bytes == 1 << 20


def test_arguments_beat_the_environment_which_beats_a_file(tmp_path, monkeypatch):
    path = tmp_path / "store.toml"
    path.write_text(
        '[kvforge.store]\nbackend = "mooncake"\nmooncake_master = "10.0.0.1:50051"\n'
        "redis_port = 7000\nmax_inflight_puts = 8\n"
    )
    monkeypatch.setenv("KVFORGE_STORE_REDIS_PORT", "7001")
    config = StoreConfig.from_file(path, max_inflight_puts=9)
    assert config.backend == "mooncake" and config.mooncake_master == "10.0.0.1:50051"
    assert (config.redis_port, config.max_inflight_puts) == (7001, 9)
    assert type(config) is StoreConfig


def test_a_flat_json_file(tmp_path):
    path = tmp_path / "store.json"
    path.write_text(json.dumps({"backend": "redis", "redis_host": "cache.local"}))
    config = StoreConfig.from_file(path)
    assert (config.backend, config.redis_host) == ("redis", "cache.local")
    # the file is read for that call only
    assert StoreConfig().backend == "none"


# (fields, what the message must name)
BAD = [
    ({"backend": "memcached"}, ["backend", "memcached"]),
    ({"redis_port": 0}, ["redis_port", "input_value=0"]),
    ({"redis_port": 70000}, ["redis_port", "70000"]),
    ({"max_inflight_puts": 0}, ["max_inflight_puts", "input_value=0"]),
    ({"max_inflight_put_bytes": 0}, ["max_inflight_put_bytes", "input_value=0"]),
    ({"max_inflight_put_bytes": 1 << 41}, ["max_inflight_put_bytes", str(1 << 41)]),
    ({"max_batch_keys": -1}, ["max_batch_keys", "-1"]),
    ({"op_timeout_s": 0}, ["op_timeout_s", "input_value=0"]),
    ({"connect_timeout_s": -1.0}, ["connect_timeout_s", "-1.0"]),
    ({"max_value_bytes": 0}, ["max_value_bytes", "input_value=0"]),
    ({"max_get_batch_bytes": 0}, ["max_get_batch_bytes", "input_value=0"]),
    ({"max_get_batch_bytes": -4096}, ["max_get_batch_bytes", "-4096"]),
    ({"max_get_batch_bytes": 1 << 41}, ["max_get_batch_bytes", str(1 << 41)]),
    ({"max_get_batch_bytes": "2MiB"}, ["max_get_batch_bytes", "2MiB"]),
    ({"namespace": "a b"}, ["namespace", "a b"]),
    ({"namespace": ""}, ["namespace"]),
    ({"redis_host": " host"}, ["redis_host", "' host'"]),
    ({"mooncake_master": "nohostport"}, ["mooncake_master", "nohostport"]),
    ({"mooncake_master": "h:99999"}, ["mooncake_master", "99999"]),
    ({"mooncake_protocol": "udp"}, ["mooncake_protocol", "udp"]),
    ({"backend": "redis", "max_value_bytes": 1 << 30}, ["max_value_bytes", "redis", str(1 << 30)]),
    (
        {"backend": "mooncake", "mooncake_global_segment_bytes": 1 << 20},
        ["mooncake_global_segment_bytes", str(1 << 20), "16777216"],
    ),
    ({"unknown_field": 1}, ["unknown_field"]),
]


@pytest.mark.parametrize(("fields", "named"), BAD, ids=[str(sorted(b[0])) for b in BAD])
def test_a_bad_setting_is_refused_by_name(fields, named):
    with pytest.raises(ValidationError) as info:
        StoreConfig(**fields)
    assert isinstance(info.value, ValueError)
    for text in named:
        assert text in str(info.value), (text, str(info.value))


def test_a_bad_environment_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KVFORGE_STORE_BACKEND", "memcached")
    with pytest.raises(ValidationError, match="backend") as info:
        StoreConfig()
    assert "memcached" in str(info.value)


def test_a_config_is_frozen():
    config = StoreConfig()
    with pytest.raises(ValidationError, match="frozen"):
        config.backend = "redis"  # type: ignore[misc]


# (file name, content: str or bytes, exception, message fragments); every message also names
# the file
BAD_FILES = [
    ("store.yaml", "backend: redis", ValueError, [".toml or .json", "'.yaml'"]),
    ("store.json", "[1, 2]", ValueError, ["table of fields", "list"]),
    ("store.json", '{"backend": "redis", "port": 1}', ValueError, ["unknown field", "port"]),
    ("store.json", '{"kvforge": {"store": 5}}', ValueError, ["table of fields", "int"]),
    ("store.toml", 'backend = "x"', ValidationError, ["backend", "'x'"]),
    ("store.toml", "redis_port = 99999999999999999999999", ValidationError, ["redis_port", "99999999999999999999999"]),
    ("store.json", '{"connect_timeout_s": NaN}', ValidationError, ["connect_timeout_s", "nan"]),
    ("store.toml", "connect_timeout_s = inf", ValidationError, ["connect_timeout_s", "inf"]),
    ("store.toml", 'backend = "mooncake"\nmooncake_global_segment_bytes = 1024', ValidationError, ["mooncake_global_segment_bytes", "1024"]),
    # syntax errors: the line and the column
    ("store.toml", "backend = ", ValueError, ["is not valid TOML: Invalid value (at end of document: line 1, column 11)"]),
    ("store.toml", 'backend = "redis"\nredis_port = \n', ValueError, ["is not valid TOML", "line 2, column 14"]),
    ("store.toml", "[kvforge.store\n", ValueError, ["is not valid TOML", "line 1"]),
    ("store.json", '{"backend": "redis",\n "redis_port": }', ValueError, ["is not valid JSON: Expecting value at line 2 column 16"]),
    ("store.json", "", ValueError, ["is not valid JSON: Expecting value at line 1 column 1"]),
    ("store.json", "\ufeff{}", ValueError, ["is not valid JSON: Unexpected UTF-8 BOM"]),
    # bytes that are not UTF-8: the offset
    ("store.toml", b'backend = "r\xffedis"\n', ValueError, ["is not UTF-8 text: byte 12 is b'\\xff'"]),
    ("store.json", b"\xff\xfe{}", ValueError, ["is not UTF-8 text: byte 0"]),
    # nesting: past the parsers' recursion, and within it but deeper than a config
    ("store.json", "[" * 100_000 + "]" * 100_000, ValueError, ["nests arrays or tables too deeply"]),
    ("store.toml", "a = " + "[" * 100_000 + "]" * 100_000, ValueError, ["nests arrays or tables too deeply"]),
    ("store.json", json.dumps({"backend": [[[["redis"]]]]}), ValueError, ["nests arrays or tables 5 levels deep"]),
    ("store.toml", "a = " + "[" * 300 + "]" * 300, ValueError, ["nests arrays or tables"]),
    # numbers past Python's digit limit for int()
    ("store.json", '{"redis_port": ' + "9" * 5000 + "}", ValueError, ["is not valid JSON", "4300 digits"]),
    ("store.toml", "redis_port = " + "9" * 5000, ValueError, ["is not valid TOML", "4300 digits"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "text", "kind", "named"), BAD_FILES, ids=[repr(b[1])[:40] for b in BAD_FILES]
)
def test_a_bad_file_is_refused_by_name(tmp_path, monkeypatch, name, text, kind, named):
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    with pytest.raises(kind) as info:
        StoreConfig.from_file(path)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert repr(str(path)) in message, message
    assert "Traceback" not in message and len(message) < 1000
    if kind is ValueError:
        assert type(info.value) is ValueError  # the parser's own error does not leak
        assert len(message.splitlines()) == 1
    for fragment in named:
        assert fragment in message, (fragment, message)
    # a refused file changes nothing: the next config is built as if it was never read
    assert StoreConfig().backend == "none"


def test_paths_that_are_not_a_store_file(tmp_path):
    directory = tmp_path / "store.toml"
    directory.mkdir()
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # reading would block
    big = tmp_path / "big.toml"
    with open(big, "wb") as fh:
        fh.truncate((1 << 20) + 1)
    for path, fragment in [
        (directory, "is a directory; give a .toml or .json file"),
        (fifo, "is not a regular file"),
        (big, "has 1,048,577 bytes; a store config has 1,048,576 at most"),
    ]:
        with pytest.raises(ValueError) as info:
            StoreConfig.from_file(path)
        assert type(info.value) is ValueError
        assert str(info.value) == f"StoreConfig.from_file: {str(path)!r} {fragment}"


def test_a_missing_file_is_refused():
    with pytest.raises(FileNotFoundError) as info:  # also a ValueError, as every bad file
        StoreConfig.from_file("/nonexistent/store.toml")
    assert isinstance(info.value, ValueError)
    assert str(info.value) == "StoreConfig.from_file: '/nonexistent/store.toml': no such file"
