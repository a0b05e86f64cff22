"""The remote tier's settings: one pydantic-settings model read from arguments, the environment
(prefix ``KVFORGE_STORE_``) and optionally a TOML or JSON file, in that order of precedence.

Invariant: a :class:`StoreConfig` that exists is usable: every field is checked when it is
built, and a refusal is a ``pydantic.ValidationError`` (a ``ValueError``) that names the field
and the value. The default, ``backend="none"``, asks for no server at all.

>>> StoreConfig().backend
'none'
>>> StoreConfig(backend="redis", redis_port=6380).redis_port
6380
"""

from __future__ import annotations

import json
import os
import stat
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

__all__ = ["MOONCAKE_MIN_SEGMENT_BYTES", "REDIS_MAX_VALUE_BYTES", "StoreConfig"]

#: Redis refuses strings longer than 512 MiB
REDIS_MAX_VALUE_BYTES = 512 << 20
#: Mooncake's client refuses to mount a global segment under 16 MiB (``setup`` returns -600)
MOONCAKE_MIN_SEGMENT_BYTES = 16 << 20


#: the fields of the file ``StoreConfig.from_file`` is reading, while it builds the model
_FILE_DATA: ContextVar[dict[str, Any] | None] = ContextVar("_FILE_DATA", default=None)


#: nesting a store file may have: ``[kvforge.store]`` holding fields, one of them a list
_MAX_DEPTH = 4
#: a store config is a few hundred bytes
_MAX_FILE_BYTES = 1 << 20


class _MissingFile(ValueError, FileNotFoundError):
    """``StoreConfig.from_file`` of a path where nothing is: both kinds of error."""


def _read_file(file: Path) -> Any:
    """The data of a ``.toml`` or ``.json`` store file, or a ``ValueError`` naming the file
    and what is wrong with it (the line and column of a syntax error)."""
    where = f"StoreConfig.from_file: {str(file)!r}"
    if file.suffix not in (".json", ".toml"):
        raise ValueError(f"{where} must end in .toml or .json, got {file.suffix!r}")
    text = _read_text(file, where)
    data = _parse(text, file.suffix, where)
    _check_depth(data, where)
    return data


def _read_text(file: Path, where: str) -> str:
    """The file's UTF-8 text: a regular file of at most ``_MAX_FILE_BYTES`` bytes."""
    try:
        info = file.stat()
        if stat.S_ISDIR(info.st_mode):
            raise ValueError(f"{where} is a directory; give a .toml or .json file")
        if not stat.S_ISREG(info.st_mode):  # a pipe or a device would block or never end
            raise ValueError(f"{where} is not a regular file")
        if info.st_size > _MAX_FILE_BYTES:
            raise ValueError(
                f"{where} has {info.st_size:,} bytes; a store config has {_MAX_FILE_BYTES:,} "
                "at most"
            )
        raw = file.read_bytes()
    except FileNotFoundError:
        raise _MissingFile(f"{where}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{where} is not UTF-8 text: byte {exc.start} is {raw[exc.start : exc.start + 1]!r}"
        ) from None


def _parse(text: str, suffix: str, where: str) -> Any:
    """``text`` parsed as JSON or TOML; a syntax error names its line and column."""
    kind = suffix[1:].upper()
    try:
        if suffix == ".json":
            return json.loads(text)
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        return tomllib.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:  # both parsers recurse once per nesting level
        raise ValueError(
            f"{where} nests arrays or tables too deeply to be a store config "
            f"({_MAX_DEPTH} levels at most)"
        ) from None
    except ValueError as exc:  # TOMLDecodeError (it gives the line and column), huge integers
        message = " ".join(str(exc).split("; use sys.")[0].split())[:300]
        last = text.rsplit("\n", 1)[-1]
        end = f"at end of document: line {text.count(chr(10)) + 1}, column {len(last) + 1}"
        message = message.replace("at end of document", end)
        raise ValueError(f"{where} is not valid {kind}: {message}") from None


def _check_depth(data: Any, where: str) -> None:
    """Refuse nesting deeper than ``_MAX_DEPTH`` (within the parser's limit), walked without
    recursion."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, dict | list):
            continue
        children = value.values() if isinstance(value, dict) else value
        if depth > _MAX_DEPTH:
            raise ValueError(
                f"{where} nests arrays or tables {depth} levels deep; a store config nests "
                f"{_MAX_DEPTH} at most"
            )
        stack.extend((child, depth + 1) for child in children)


def _titled(exc: ValidationError, title: str) -> ValidationError:
    """``exc``'s errors under ``title`` (the file they came from); ``exc`` itself should
    pydantic not take an error back."""
    details: list[Any] = []
    for error in exc.errors():
        detail = {"type": error["type"], "loc": error["loc"], "input": error.get("input")}
        if "ctx" in error:
            detail["ctx"] = error["ctx"]
        details.append(detail)
    try:
        return ValidationError.from_exception_data(title, details)
    except (KeyError, TypeError, ValueError):
        return exc


class _FileSource(PydanticBaseSettingsSource):
    """The fields a TOML or JSON file sets (``StoreConfig.from_file``)."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


class StoreConfig(BaseSettings):
    """Where the remote tier is and how long the engine may wait for it.

    Each field is also read from ``KVFORGE_STORE_<FIELD>`` (case-insensitive), e.g.
    ``KVFORGE_STORE_BACKEND=redis``; arguments win over the environment, which wins over a
    file given to :meth:`from_file`.
    """

    model_config = SettingsConfigDict(
        env_prefix="KVFORGE_STORE_",
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    backend: Literal["none", "redis", "mooncake"] = "none"
    #: prefix of every key this engine writes, so fleets sharing a server stay apart
    namespace: str = Field("kvforge", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")

    redis_host: str = Field("127.0.0.1", min_length=1)
    redis_port: int = Field(6379, ge=1, le=65535)
    redis_db: int = Field(0, ge=0)
    redis_username: str | None = None
    redis_password: SecretStr | None = None

    #: the master's RPC address, ``host:port``
    mooncake_master: str = Field("127.0.0.1:50051", pattern=r"^[^:\s]+:\d{1,5}$")
    #: the address this client's transfer engine listens on (also ``MC_TCP_BIND_ADDRESS``)
    mooncake_local_hostname: str = Field("127.0.0.1", min_length=1)
    #: ``P2PHANDSHAKE`` needs no metadata server; else an etcd or HTTP metadata address
    mooncake_metadata_server: str = Field("P2PHANDSHAKE", min_length=1)
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_rdma_devices: str = ""
    #: memory this client lends to the distributed store (Mooncake's minimum is 16 MiB)
    mooncake_global_segment_bytes: int = Field(64 << 20, ge=0)
    mooncake_local_buffer_bytes: int = Field(16 << 20, ge=0)

    #: seconds to open a connection
    connect_timeout_s: float = Field(1.0, gt=0, le=300)
    #: seconds one batched operation may wait for the server (Redis socket timeout)
    op_timeout_s: float = Field(2.0, gt=0, le=300)
    #: seconds ``close()`` waits for queued puts before it drops them and returns
    close_timeout_s: float = Field(2.0, ge=0, le=300)
    #: after a client error, seconds during which calls are misses without asking the server
    retry_after_s: float = Field(1.0, ge=0, le=3600)
    #: values queued or being written by ``put_async`` at most (back-pressure: more are dropped)
    max_inflight_puts: int = Field(4096, ge=1, le=1 << 20)
    #: bytes of the values queued or being written at most (one value alone may be larger):
    #: the memory ``put_async`` holds, whatever the values' sizes
    max_inflight_put_bytes: int = Field(256 << 20, ge=1, le=1 << 40)
    #: keys sent in one round trip at most; larger batches are split
    max_batch_keys: int = Field(256, ge=1, le=1 << 16)
    #: payload bytes one round trip of ``batch_get_into`` reads at most (a larger value is read
    #: alone); None: the adapter's default (Redis 4 MiB, Mooncake no limit), see
    #: ``docs/tiered_store.md``
    max_get_batch_bytes: int | None = Field(None, ge=1, le=1 << 40)
    #: a value (header + payload) larger than this is not put (counted as ``too_large``)
    max_value_bytes: int = Field(64 << 20, ge=1)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        data = _FILE_DATA.get()
        if data is not None:
            sources.append(_FileSource(settings_cls, data))
        return tuple(sources)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> StoreConfig:
        """The settings a ``.toml`` or ``.json`` file gives (a flat table of fields, or the
        table ``[kvforge.store]`` / ``{"kvforge": {"store": {...}}}``), under the environment
        and ``overrides``. An unknown field or file type is refused by name.

        Raises:
            ValueError: naming the file: it is missing (also a ``FileNotFoundError``), a
                directory or unreadable, not UTF-8 (the byte), not TOML or JSON (the line and
                column), nested deeper than a table of fields, or sets an unknown field; a
                bad value is a ``pydantic.ValidationError`` naming the field, the value and
                the file."""
        file = Path(path)
        data = _read_file(file)
        if isinstance(data, dict) and isinstance(data.get("kvforge"), dict):
            data = data["kvforge"].get("store", data)
        if not isinstance(data, dict):
            raise ValueError(
                f"StoreConfig.from_file: {str(file)!r} must hold a table of fields, "
                f"got {type(data).__name__}"
            )
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            raise ValueError(
                f"StoreConfig.from_file: {str(file)!r} sets unknown field(s) {unknown}; "
                f"known: {sorted(cls.model_fields)}"
            )
        token = _FILE_DATA.set(data)
        try:
            return cls(**overrides)
        except ValidationError as exc:  # the same errors, titled with the file
            raise _titled(exc, f"StoreConfig from {str(file)!r}") from None
        finally:
            _FILE_DATA.reset(token)

    @field_validator("redis_host", "mooncake_local_hostname")
    @classmethod
    def _no_blank(cls, value: str) -> str:
        if value.strip() != value or not value:
            raise ValueError(f"must be a host name without spaces, got {value!r}")
        return value

    @model_validator(mode="after")
    def _fits_backend(self) -> StoreConfig:
        if self.backend == "redis" and self.max_value_bytes > REDIS_MAX_VALUE_BYTES:
            raise ValueError(
                f"max_value_bytes must be <= {REDIS_MAX_VALUE_BYTES} for backend 'redis' "
                f"(Redis strings hold at most 512 MiB), got {self.max_value_bytes}"
            )
        if (
            self.backend == "mooncake"
            and 0 < self.mooncake_global_segment_bytes < MOONCAKE_MIN_SEGMENT_BYTES
        ):
            raise ValueError(
                f"mooncake_global_segment_bytes must be 0 (lend nothing) or >= "
                f"{MOONCAKE_MIN_SEGMENT_BYTES} (Mooncake's minimum), got "
                f"{self.mooncake_global_segment_bytes}"
            )
        port = int(self.mooncake_master.rsplit(":", 1)[1])
        if not 1 <= port <= 65535:
            raise ValueError(f"mooncake_master's port must be in [1, 65535], got {port}")
        return self
