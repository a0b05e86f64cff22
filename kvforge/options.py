"""Every option :class:`~kvforge.CacheController` takes, in one typed place: frozen pydantic
models, validated once, when they are built.

- :class:`CacheOptions`: the controller's own (``CacheController(..., options=...)``):
  prefix caching (on or off, the key algorithm, the snapshot interval, the retention of window
  and state blocks) and pool sharing;
- :class:`PlanOptions`: the concurrency a memory plan sizes for
  (``initialize_kv_cache(..., plan=...)``, ``plan_memory(..., plan=...)``);
- :class:`HostTierOptions`: the host tier's policies (``initialize_host_tier(..., options=...)``).

The remote tier's options are :class:`~kvforge.store.StoreConfig` (where the store is, its
budgets and timeouts) and :class:`~kvforge.ModelIdentity` (whose KV it holds), both typed and
validated where they are defined.

Today's keyword arguments build these objects (:func:`merge_keywords`), so a call with keywords
and a call with an options object are validated by the same code; giving a setting both ways
is refused. The scheduler side then receives values already valid: what it still checks is what
only it knows (a snapshot or retention interval against the groups' boundary, the LCM of their
block sizes, once the pools are sized).

Invariants (``tests/test_options.py``):

- a bad value raises :class:`~kvforge._checks.ArgumentError` (a ``TypeError`` and a
  ``ValueError``) naming the field and the value, in the words of the shared validator that
  also checks that setting elsewhere (``check_prefix_retention``, ``check_share_pools``, ...),
  and nothing else changes: options are built before any state is;
- an unknown field is refused with the fields the model has;
- an options object never changes after it was built (``model_copy`` validates its update).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from kvforge._checks import ArgumentError, check_bool, check_int
from kvforge.core.layout import check_share_pools
from kvforge.core.prefix_keys import Algorithm
from kvforge.scheduler.host_tier import (
    HostTierPolicy,
    SnapshotPolicy,
    check_host_tier_policy,
    check_snapshot_policy,
)
from kvforge.scheduler.prefix import (
    DEFAULT_PREFIX_RETENTION,
    Retention,
    check_prefix_retention,
)

__all__ = [
    "KEY_ALGORITHMS",
    "UNSET",
    "CacheOptions",
    "HostTierOptions",
    "OptionsModel",
    "PlanOptions",
    "Unset",
    "merge_keywords",
]

#: the digests a prefix key may use by name (a ``bytes -> bytes`` function is also accepted)
KEY_ALGORITHMS: tuple[str, ...] = ("sha256", "blake2b")

_POSITIVE = "{name} must be a positive int, got {value}"  # plan_memory's own wording

_O = TypeVar("_O", bound="OptionsModel")


class Unset(Enum):
    """The default of a keyword argument that an options object may carry instead: a keyword
    left :data:`UNSET` was not given (``None`` may be a value someone gives)."""

    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset.UNSET


def _argument_error(model: type[BaseModel], exc: ValidationError) -> ArgumentError:
    """The :class:`ArgumentError` for the first problem pydantic found: a shared validator's
    own error unchanged, else one that names the model, the field and the value."""
    err = exc.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ArgumentError):
        return cause
    where = ".".join(str(part) for part in err["loc"]) or model.__name__
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        fields = ", ".join(model.model_fields)
        return ArgumentError(
            f"{model.__name__} has no option {where!r} (given {value!r:.80}); its options are "
            f"{fields}"
        )
    return ArgumentError(f"{model.__name__}.{where}={value!r:.80} is invalid: {err['msg']}")


class OptionsModel(BaseModel):
    """The base of kvforge's options: frozen, unknown fields refused, and every refusal an
    :class:`~kvforge._checks.ArgumentError` naming the field and the value (never a
    ``pydantic.ValidationError``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _argument_error(type(self), exc) from None

    @classmethod
    def model_validate(cls: type[_O], obj: object, **kwargs: Any) -> _O:  # type: ignore[override]
        """Build from a mapping (or return an instance of this model as it is)."""
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, Mapping):
            raise ArgumentError(
                f"{cls.__name__} is built from a mapping of options, got {type(obj).__name__}"
            )
        return cls(**{str(k): v for k, v in obj.items()})

    def model_copy(  # type: ignore[override]
        self: _O, *, update: Mapping[str, object] | None = None, deep: bool = False
    ) -> _O:
        """A copy with ``update`` applied, validated as a new object is."""
        if not update:
            return self
        values = {name: getattr(self, name) for name in type(self).model_fields}
        return type(self)(**{**values, **update})


class CacheOptions(OptionsModel):
    """The options of :class:`~kvforge.CacheController` (and of the scheduler side it builds,
    :class:`~kvforge.BlockManager`).

    Attributes:
        enable_prefix_caching: keep the blocks of finished requests reusable by later requests
            with the same prefix (see ``CacheController.lookup``).
        key_algorithm: the digest of the prefix keys: ``"sha256"`` (default), ``"blake2b"``
            (BLAKE2b-256), or a ``bytes -> bytes`` function (a hit is confirmed against the
            tokens whatever the digest, see ``docs/prefix_caching.md``).
        snapshot_interval: tokens between snapshots of per-request state (linear attention);
            ``None``: the smallest multiple of the groups' boundary (the LCM of their block
            sizes) that is at least 512. A positive int, and a multiple of that boundary
            (checked when the pools are sized, where the boundary is known).
        prefix_retention: which completed sliding-window and state blocks stay reusable,
            ``"dense"`` (default) or ``"checkpoints"``
            (:func:`~kvforge.scheduler.prefix.check_prefix_retention`).
        prefix_retention_interval: with ``"checkpoints"``, also keep the tails at every
            multiple of this many tokens (a multiple of the boundary); ``None``: none.
        share_pools: groups whose pages pair up byte for byte draw on one block pool whose
            bytes are paid once (default ``True``; see ``CacheLayout.pool_sets``).
    """

    enable_prefix_caching: bool = False
    key_algorithm: Algorithm = "sha256"
    snapshot_interval: int | None = None
    prefix_retention: Retention = DEFAULT_PREFIX_RETENTION
    prefix_retention_interval: int | None = None
    share_pools: bool = True

    @model_validator(mode="before")
    @classmethod
    def _check_retention(cls, data: Any) -> Any:
        if isinstance(data, Mapping):  # the policy and its interval are checked together
            check_prefix_retention(
                data.get("prefix_retention", DEFAULT_PREFIX_RETENTION),
                data.get("prefix_retention_interval"),
            )
        return data

    @field_validator("enable_prefix_caching", mode="before")
    @classmethod
    def _check_enable(cls, value: object) -> bool:
        return check_bool("enable_prefix_caching", value)

    @field_validator("share_pools", mode="before")
    @classmethod
    def _check_share_pools(cls, value: object) -> bool:
        return check_share_pools(value)

    @field_validator("key_algorithm", mode="before")
    @classmethod
    def _check_key_algorithm(cls, value: object) -> object:
        if isinstance(value, str) and value in KEY_ALGORITHMS:
            return value
        if callable(value) and not isinstance(value, type):
            return value
        raise ArgumentError(
            f"key_algorithm must be 'sha256', 'blake2b' or a bytes -> bytes function, "
            f"got {value!r:.80}"
        )

    @field_validator("snapshot_interval", mode="before")
    @classmethod
    def _check_snapshot_interval(cls, value: object) -> int | None:
        return None if value is None else check_int("snapshot_interval", value, 1)


class PlanOptions(OptionsModel):
    """What a memory plan sizes for, besides its budget (``initialize_kv_cache``,
    ``plan_memory``; :func:`kvforge.core.memory_plan.plan_memory`). ``None`` leaves a value to
    its default.

    Attributes:
        max_num_seqs: block-table rows, the requests that run at once (default 256).
        max_model_len: the longest request in tokens (default: what the model says, else what
            the smallest full group holds; a memory plan with window groups needs it).
        max_num_batched_tokens: tokens scheduled in one step (default 8192): sizes the window
            groups' step allowance. Memory plans only: explicit block counts need no plan.
    """

    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None

    @field_validator("max_num_seqs", "max_model_len", "max_num_batched_tokens", mode="before")
    @classmethod
    def _check_positive(cls, value: object, info: Any) -> int | None:
        if value is None:
            return None
        return check_int(info.field_name, value, 1, type_message=_POSITIVE, range_message=_POSITIVE)


class HostTierOptions(OptionsModel):
    """The host tier's policies (``CacheController.initialize_host_tier``).

    Attributes:
        policy: when a device block goes to the tier: ``"eviction"`` (default, when the device
            evicts it) or ``"write_through"`` (as soon as the step that wrote it ended).
        snapshot_policy: what per-request (state snapshot) groups keep there: ``"skip"`` (no
            pages: a hit needing a snapshot the device lost is recomputed) or ``"aligned"``
            (pages for the snapshots taken at aligned boundaries); ``None``: what the backends
            declare.
    """

    policy: HostTierPolicy = "eviction"
    snapshot_policy: SnapshotPolicy | None = None

    @field_validator("policy", mode="before")
    @classmethod
    def _check_policy(cls, value: object) -> str:
        return check_host_tier_policy(value)

    @field_validator("snapshot_policy", mode="before")
    @classmethod
    def _check_snapshot_policy(cls, value: object) -> str | None:
        return None if value is None else check_snapshot_policy(value)


def merge_keywords(
    model: type[_O],
    options: object,
    keywords: Mapping[str, object],
    where: str,
    unset: object = UNSET,
) -> _O:
    """The ``model`` a call means: ``options`` itself, or one built from the ``keywords`` that
    were given (those not ``unset``).

    Raises:
        ArgumentError: ``options`` is not a ``model`` (or ``None``), a setting is given both as
            a keyword and in ``options``, or a keyword's value is bad (named).
    """
    given = {name: value for name, value in keywords.items() if value is not unset}
    if options is None:
        return model(**given)
    if not isinstance(options, model):
        raise ArgumentError(
            f"{where}: options must be a {model.__name__} or None, got {options!r:.80}"
        )
    if given:
        raise ArgumentError(
            f"{where}: {sorted(given)} given both as keywords and with a {model.__name__}: "
            f"set them in the {model.__name__} (options.model_copy(update={{...}}))"
        )
    return options
