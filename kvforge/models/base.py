"""The model-builder contract: what a ``model_type`` builder is given and what it returns.

A builder (:data:`ModelBuilder`) turns a parsed ``config.json`` into ``{layer id: backend}``.
This module holds what every builder shares, kvforge's own families and a plugin's alike:
the options it is handed (:class:`ModelOptions`), the result type that also carries
``max_position_embeddings`` (:class:`ModelBackends`), config-field validation with errors
that name the field and value (:func:`parse_fields`), and the layer cap (:data:`MAX_LAYERS`).
It sits at the bottom of :mod:`kvforge.models`: it imports no other module of the package.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from kvforge.attn_backends.base import AttentionBackend

__all__ = [
    "MAX_LAYERS",
    "LayerCount",
    "LayerFields",
    "MambaDType",
    "ModelBackends",
    "ModelBuilder",
    "ModelOptions",
    "NonNegativeInt",
    "PositiveInt",
    "parse_fields",
    "short_repr",
]

MAX_LAYERS = 4096
"""Most cache layers one model may have (main plus MTP layers). Published models have well
under 200; the cap turns a corrupt count such as ``10**9`` into an immediate error instead of
minutes of building a mapping that cannot fit in memory."""

PositiveInt = Annotated[StrictInt, Field(gt=0)]
MambaDType = Literal["auto", "float32", "float16", "bfloat16"]
"""A Mamba state dtype option, as vLLM's ``MambaDType`` (``vllm/config/cache.py``)."""
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
LayerCount = Annotated[StrictInt, Field(gt=0, le=MAX_LAYERS)]

_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxstring = 80
_repr.maxother = 80
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8


def short_repr(value: Any) -> str:
    """``repr`` bounded in depth and length, for error messages about arbitrary input (a
    deeply nested value must not turn the error message itself into a ``RecursionError``)."""
    return _repr.repr(value)


# ---------------------------------------------------------------------------------- results


class ModelBackends(dict[int, AttentionBackend]):
    """``{layer id: backend}`` of one model, plus what its config says about the model as a
    whole. It is a ``dict``: index it by layer id, iterate it, compare it with a plain dict.

    Attributes:
        model_type: the ``model_type`` the config was loaded as (``None`` when unknown).
        max_position_embeddings: the longest sequence the model was trained for, from the
            config (``None`` when the config does not say); memory plans use it as the
            default ``max_model_len``.
    """

    def __init__(
        self,
        backends: Mapping[int, AttentionBackend] | Iterable[tuple[int, AttentionBackend]] = (),
        *,
        model_type: str | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__(backends)
        self.model_type = model_type
        self.max_position_embeddings = max_position_embeddings

    def copy(self) -> ModelBackends:
        return ModelBackends(
            self,
            model_type=self.model_type,
            max_position_embeddings=self.max_position_embeddings,
        )


# ---------------------------------------------------------------------------------- options


class ModelOptions(BaseModel):
    """The options of :func:`~kvforge.models.hf_config.from_hf_config`, validated once
    and handed to every :data:`ModelBuilder`.

    A builder must use every option that is set or refuse it (:meth:`refuse`): an option is
    never silently ignored.

    Attributes:
        block_size: tokens per block; ``None``: the family's default.
        dtype: model / cache dtype (canonical name); ``None``: ``"auto"``, as the engines
            serve the config's dtype (:func:`~kvforge.models.reading.model_dtype`).
        kv_cache_dtype: cache storage (family-specific names); ``None``: the family's default.
        tp_size: tensor-parallel ranks.
        num_speculative_tokens: draft tokens per step; MTP layers get caches only when > 0.
        mamba_cache_dtype: the Mamba2 conv state's dtype, as vLLM's ``--mamba-cache-dtype``
            (``None`` / ``"auto"``: the model dtype).
        mamba_ssm_cache_dtype: the Mamba2 SSM state's dtype, as vLLM's
            ``--mamba-ssm-cache-dtype`` (``None`` / ``"auto"``: the family's engine default).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: PositiveInt | None = None
    dtype: StrictStr | None = None
    kv_cache_dtype: StrictStr | None = None
    tp_size: PositiveInt = 1
    num_speculative_tokens: NonNegativeInt = 0
    mamba_cache_dtype: MambaDType | None = None
    mamba_ssm_cache_dtype: MambaDType | None = None

    def is_set(self, name: str) -> bool:
        """Whether option ``name`` differs from its default."""
        fields = type(self).model_fields
        if name not in fields:
            raise KeyError(f"{name!r} is not a ModelOptions field; fields: {sorted(fields)}")
        return getattr(self, name) != fields[name].default

    def refuse(self, model_type: str, *names: str, why: str) -> None:
        """Raise ``ValueError`` when one of the options ``names`` is set.

        A builder calls this for the options its family does not use, so that e.g.
        ``dtype="float16"`` for a model whose cache dtype is fixed is an error, not a no-op.
        """
        for name in names:
            if self.is_set(name):
                raise ValueError(
                    f"{name}={getattr(self, name)!r} does not apply to model_type "
                    f"{model_type!r}: {why}"
                )

    def mtp_layer_ids(
        self, num_hidden_layers: int, num_nextn_predict_layers: int, model_type: str
    ) -> range:
        """The ids of the MTP / next-n layers that get caches.

        Engines (vLLM, SGLang) allocate caches for the MTP layers only when speculative
        decoding uses them, so they are ``num_hidden_layers .. + num_nextn_predict_layers - 1``
        when ``num_speculative_tokens > 0`` and none otherwise. All of them are cache layers
        whatever ``num_speculative_tokens`` is: engines run the same MTP layers again for
        further draft tokens.

        Raises:
            ValueError: ``num_speculative_tokens > 0`` but the model has no MTP layer.
        """
        if self.num_speculative_tokens == 0:
            return range(num_hidden_layers, num_hidden_layers)
        if num_nextn_predict_layers == 0:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} needs MTP layers, but "
                f"the config has num_nextn_predict_layers=0 (model_type {model_type!r})"
            )
        return range(num_hidden_layers, num_hidden_layers + num_nextn_predict_layers)


# ---------------------------------------------------------------------------------- fields

_F = TypeVar("_F", bound=BaseModel)


def _where(loc: tuple[int | str, ...]) -> str:
    text = str(loc[0]) if loc else "config"
    for part in loc[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def parse_fields(fields: type[_F], config: Mapping[str, Any], model_type: str) -> _F:
    """Validate the fields a builder reads from ``config`` with the pydantic model ``fields``.

    ``null`` in the config counts as absent. Errors are ``ValueError`` naming the field, its
    value and the model type: ``config is missing 'x' (needed for model_type 'm')`` or
    ``config field x = 'y' is invalid for model_type 'm': <reason>``.
    """
    for name, info in fields.model_fields.items():
        if info.is_required() and config.get(name) is None:
            state = "is missing" if name not in config else "has null for"
            raise ValueError(f"config {state} {name!r} (needed for model_type {model_type!r})")
    data = {k: v for k, v in config.items() if k in fields.model_fields and v is not None}
    try:
        return fields.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(
            f"config field {_where(err['loc'])} = {short_repr(err.get('input'))} is invalid "
            f"for model_type {model_type!r}: {err['msg']}"
        ) from None


class LayerFields(BaseModel):
    """Fields every family reads (subclass it to add a family's own). ``null`` in the config
    counts as absent."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    num_hidden_layers: LayerCount
    num_nextn_predict_layers: Annotated[StrictInt, Field(ge=0, le=MAX_LAYERS)] = 0


# ---------------------------------------------------------------------------------- builders

ModelBuilder = Callable[[Mapping[str, Any], str, ModelOptions], Mapping[int, AttentionBackend]]
"""``builder(config, model_type, options) -> {layer id: backend}``: ``config`` is the parsed
``config.json`` (read-only), ``model_type`` the registered name it is loaded as, ``options``
the validated :class:`ModelOptions`. Problems in the config are ``ValueError`` naming the
field and value (:func:`parse_fields` writes them). Return a :class:`ModelBackends` to state
``max_position_embeddings`` when the config spells it differently."""
