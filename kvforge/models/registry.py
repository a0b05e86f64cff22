"""Open registration of attention backends and Hugging Face model types, and plugin discovery.

kvforge keeps two registries, both filled through the public functions of this module, for
the bundled families exactly as for a package outside kvforge:

- **backends** (:func:`register_backend`): a name (``"gqa"``, ``"deepseek-v4"``, ...) for an
  :class:`~kvforge.attn_backends.base.AttentionBackend` class, plus the callable the
  ``--backend NAME`` option of the CLI builds one layer's backend with. The builder's keyword
  parameters *are* its declaration of the command-line options it takes (``head_dim`` is set by
  ``--head-dim``, ``num_kv_heads`` by ``--num-kv-heads``, ...): the CLI refuses any other
  option given with ``--backend NAME``, and a parameter without a default is a required option.
- **model types** (:func:`register_model_type`): a Hugging Face ``model_type`` (and the
  ``architectures`` names that stand for it) for a :data:`ModelBuilder`, which turns a parsed
  ``config.json`` into ``{layer id: backend}``.
  :func:`~kvforge.models.hf_config.from_hf_config` dispatches through it.

A plugin is a module that calls these functions when it is imported. :func:`load_plugins`
imports every entry point of the group ``kvforge.backends`` (the ``kvforge`` CLI calls it at
start); ``kvforge --plugin MODULE`` imports one module by name.

Invariants:

- A name maps to one registration for the life of the process: registering it again with the
  same objects is a no-op, with different objects a ``ValueError`` that changes nothing.
- An architecture name stands for at most one ``model_type``.
- :func:`registered_backends` and :func:`registered_model_types` are sorted by name: nothing
  depends on the order in which plugins happened to register.
- No registered model has more than :data:`MAX_LAYERS` cache layers, so a corrupt layer count
  is refused before anything is built for it.
"""

from __future__ import annotations

import importlib
import inspect
import re
import reprlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from kvforge.attn_backends.base import AttentionBackend

__all__ = [
    "ENTRY_POINT_GROUP",
    "MAX_LAYERS",
    "ModelBackends",
    "ModelBuilder",
    "ModelOptions",
    "PluginError",
    "RegisteredBackend",
    "RegisteredModelType",
    "load_plugin_module",
    "load_plugins",
    "parse_fields",
    "register_backend",
    "register_model_type",
    "registered_backends",
    "registered_model_types",
    "short_repr",
]

ENTRY_POINT_GROUP = "kvforge.backends"
"""The entry-point group :func:`load_plugins` imports."""

MAX_LAYERS = 4096
"""Most cache layers one model may have (main plus MTP layers). Published models have well
under 200; the cap turns a corrupt count such as ``10**9`` into an immediate error instead of
minutes of building a mapping that cannot fit in memory."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

_lock = threading.RLock()

PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]

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
        dtype: model / cache dtype (canonical name); ``None``: from the config.
        kv_cache_dtype: cache storage (family-specific names); ``None``: the family's default.
        tp_size: tensor-parallel ranks.
        num_speculative_tokens: draft tokens per step; MTP layers get caches only when > 0.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: PositiveInt | None = None
    dtype: StrictStr | None = None
    kv_cache_dtype: StrictStr | None = None
    tp_size: PositiveInt = 1
    num_speculative_tokens: NonNegativeInt = 0

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


# ---------------------------------------------------------------------------------- records

ModelBuilder = Callable[[Mapping[str, Any], str, ModelOptions], Mapping[int, AttentionBackend]]
"""``builder(config, model_type, options) -> {layer id: backend}``: ``config`` is the parsed
``config.json`` (read-only), ``model_type`` the registered name it is loaded as, ``options``
the validated :class:`ModelOptions`. Problems in the config are ``ValueError`` naming the
field and value (:func:`parse_fields` writes them). Return a :class:`ModelBackends` to state
``max_position_embeddings`` when the config spells it differently."""


@dataclass(frozen=True)
class RegisteredBackend:
    """One :func:`register_backend` entry.

    Attributes:
        name: the registered name (the CLI's ``--backend`` choice).
        cls: the backend class.
        cli_builder: what builds one backend from command-line options; ``None``: ``cls``.
    """

    name: str
    cls: type[AttentionBackend]
    cli_builder: Callable[..., AttentionBackend] | None

    @property
    def builder(self) -> Callable[..., AttentionBackend]:
        """What the CLI calls: ``cli_builder`` when given, else the class itself."""
        return self.cli_builder if self.cli_builder is not None else self.cls

    def parameters(self) -> dict[str, inspect.Parameter]:
        """The keyword parameters of :attr:`builder`, by name: the options it takes."""
        return {
            p.name: p
            for p in inspect.signature(self.builder).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }


@dataclass(frozen=True)
class RegisteredModelType:
    """One :func:`register_model_type` entry.

    Attributes:
        model_type: the Hugging Face ``model_type``.
        builder: the :data:`ModelBuilder`.
        architectures: ``architectures`` names that stand for this model type when a config's
            ``model_type`` is absent or not registered.
    """

    model_type: str
    builder: ModelBuilder
    architectures: tuple[str, ...]


_backends: dict[str, RegisteredBackend] = {}
_model_types: dict[str, RegisteredModelType] = {}


def _check_name(kind: str, name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{kind} must be a str, got {type(name).__name__} {short_repr(name)}")
    if not _NAME.match(name):
        raise ValueError(
            f"{kind} {name!r} is not a valid name: use letters, digits, '_', '.' and '-', "
            "starting with a letter or digit"
        )
    return name


def _qualname(obj: object) -> str:
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}" if module else name


def register_backend(
    name: str,
    cls: type[AttentionBackend],
    *,
    cli_builder: Callable[..., AttentionBackend] | None = None,
) -> None:
    """Register the backend class ``cls`` under ``name``.

    Args:
        name: the name, e.g. ``"gqa"``; it becomes a choice of the CLI's ``--backend``.
        cls: a subclass of :class:`~kvforge.attn_backends.base.AttentionBackend`.
        cli_builder: builds one layer's backend from command-line options, passed as keyword
            arguments named after them (``num_kv_heads``, ``head_dim``, ``block_size``,
            ``dtype``, ``kv_cache_quant``, ``kv_lora_rank``, ``qk_rope_head_dim``,
            ``index_head_dim``, ``kv_cache_dtype``, ``compress_ratio``); only the options the
            user gave are passed, so its defaults are the CLI's defaults. ``None``: ``cls``
            itself is called that way.

    Raises:
        ValueError: ``name`` is already registered with a different class or builder (the
            same ones again are a no-op), or ``name`` is not a valid name.
        TypeError: ``cls`` is not an ``AttentionBackend`` subclass, ``cli_builder`` is not
            callable, or a parameter of the builder cannot be passed by keyword.
    """
    _check_name("backend name", name)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(
            f"backend {name!r}: cls must be a subclass of AttentionBackend, got "
            f"{short_repr(cls)}"
        )
    if cli_builder is not None and not callable(cli_builder):
        raise TypeError(
            f"backend {name!r}: cli_builder must be callable or None, got "
            f"{short_repr(cli_builder)}"
        )
    entry = RegisteredBackend(name=name, cls=cls, cli_builder=cli_builder)
    try:
        signature = inspect.signature(entry.builder)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"backend {name!r}: cannot read the builder's signature: {exc}") from None
    for param in signature.parameters.values():
        if param.kind is param.POSITIONAL_ONLY:
            raise TypeError(
                f"backend {name!r}: builder parameter {param.name!r} is positional-only; the "
                "CLI passes options by keyword"
            )
    with _lock:
        old = _backends.get(name)
        if old is not None:
            if old.cls is cls and old.cli_builder is cli_builder:
                return
            raise ValueError(
                f"backend {name!r} is already registered to {_qualname(old.cls)} "
                f"(cli_builder {_qualname(old.cli_builder) if old.cli_builder else None}); "
                f"refusing {_qualname(cls)} "
                f"(cli_builder {_qualname(cli_builder) if cli_builder else None})"
            )
        _backends[name] = entry


def register_model_type(
    model_type: str, builder: ModelBuilder, *, architectures: Iterable[str] = ()
) -> None:
    """Register ``builder`` for the Hugging Face ``model_type``.

    Args:
        model_type: e.g. ``"llama"``, as in ``config.json``.
        builder: see :data:`ModelBuilder`.
        architectures: ``architectures`` names (e.g. ``"LlamaForCausalLM"``) that select this
            model type when a config's ``model_type`` is absent or not registered.

    Raises:
        ValueError: ``model_type`` is already registered with a different builder or
            architectures (the same ones again are a no-op), an architecture already stands
            for another model type, or a name is not valid.
        TypeError: ``builder`` is not callable, or ``architectures`` is a string or holds a
            non-string.
    """
    _check_name("model_type", model_type)
    if not callable(builder):
        raise TypeError(
            f"model_type {model_type!r}: builder must be callable, got {short_repr(builder)}"
        )
    if isinstance(architectures, str):
        raise TypeError(
            f"model_type {model_type!r}: architectures must be a sequence of names, not the "
            f"string {architectures!r}"
        )
    archs = tuple(_check_name("architecture", a) for a in architectures)
    if len(set(archs)) != len(archs):
        raise ValueError(f"model_type {model_type!r}: architectures {list(archs)} repeat a name")
    with _lock:
        old = _model_types.get(model_type)
        if old is not None:
            if old.builder is builder and old.architectures == archs:
                return
            raise ValueError(
                f"model_type {model_type!r} is already registered to {_qualname(old.builder)} "
                f"(architectures {list(old.architectures)}); refusing {_qualname(builder)} "
                f"(architectures {list(archs)})"
            )
        for other in _model_types.values():
            taken = sorted(set(archs) & set(other.architectures))
            if taken:
                raise ValueError(
                    f"model_type {model_type!r}: architecture {taken[0]!r} already stands for "
                    f"model_type {other.model_type!r}"
                )
        _model_types[model_type] = RegisteredModelType(
            model_type=model_type, builder=builder, architectures=archs
        )


def _bundled() -> None:
    """Register the bundled backends and model types (they register when their module is
    first imported; listing must not depend on whether someone imported it already)."""
    importlib.import_module("kvforge.models.hf_config")


def registered_backends() -> dict[str, RegisteredBackend]:
    """Every registered backend, sorted by name (a new dict: changing it changes nothing)."""
    _bundled()
    with _lock:
        return {name: _backends[name] for name in sorted(_backends)}


def registered_model_types() -> dict[str, RegisteredModelType]:
    """Every registered model type, sorted by name (a new dict)."""
    _bundled()
    with _lock:
        return {name: _model_types[name] for name in sorted(_model_types)}


# ---------------------------------------------------------------------------------- plugins


class PluginError(ImportError):
    """A plugin could not be imported or failed while registering. The message names the
    entry point or module; ``__cause__`` is the original exception."""


_loaded_entry_points: set[tuple[str, str, str]] = set()


def _describe(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    where = f"group {ENTRY_POINT_GROUP!r}"
    if dist is not None:
        where += f", distribution {dist.metadata['Name']!r} {dist.version}"
    return f"kvforge plugin entry point '{ep.name} = {ep.value}' ({where})"


def load_plugins() -> tuple[str, ...]:
    """Import every entry point of the group ``kvforge.backends`` that is not imported yet.

    An entry point names a module (importing it registers its backends and model types) or a
    function ``module:register`` (called once, with no arguments). Entry points are loaded in
    order of (name, value), so the result never depends on installation order.

    Returns:
        The names of the entry points this call loaded (empty when all were loaded before).

    Raises:
        PluginError: an entry point failed to import or to register; the message names it and
            the cause. Entry points loaded before it stay loaded; it is tried again next call.
    """
    loaded: list[str] = []
    with _lock:
        eps = sorted(
            metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)
        )
        for ep in eps:
            key = (ep.name, ep.value, ep.group)
            if key in _loaded_entry_points:
                continue
            try:
                obj = ep.load()
                if callable(obj) and not isinstance(obj, (ModuleType, type)):
                    obj()
            except Exception as exc:
                raise PluginError(
                    f"{_describe(ep)} failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            _loaded_entry_points.add(key)
            loaded.append(ep.name)
    return tuple(loaded)


def load_plugin_module(name: str) -> ModuleType:
    """Import the plugin module ``name`` (``kvforge --plugin NAME``), which registers things.

    Raises:
        PluginError: the module cannot be imported or fails while registering; the message
            names it and the cause.
        TypeError / ValueError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str):
        raise TypeError(f"plugin module name must be a str, got {type(name).__name__}")
    if not name.strip():
        raise ValueError("plugin module name is empty")
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise PluginError(
            f"cannot import plugin module {name!r}: {type(exc).__name__}: {exc}"
        ) from exc


# ---------------------------------------------------------------------------------- bundled
# The bundled backends register through the same function a plugin calls. MLA and DSA are
# built by their classes (every parameter has a default); GQA, MHA and DeepSeek-V4 have
# builders that fix the CLI's defaults (8 kv heads of 128) or leave out what the CLI does not
# set (V4's head_dim and window are those of the published model).


def _gqa_from_cli(
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: str = "bfloat16",
    kv_cache_quant: str | None = None,
) -> AttentionBackend:
    from kvforge.attn_backends.gqa import GQABackend

    return GQABackend(num_kv_heads, head_dim, block_size, dtype, kv_cache_quant)  # type: ignore[arg-type]


def _mha_from_cli(
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: str = "bfloat16",
    kv_cache_quant: str | None = None,
) -> AttentionBackend:
    from kvforge.attn_backends.gqa import MHABackend

    return MHABackend(num_kv_heads, head_dim, block_size, dtype, kv_cache_quant)  # type: ignore[arg-type]


def _v4_from_cli(
    compress_ratio: int = 4,
    qk_rope_head_dim: int = 64,
    index_head_dim: int = 128,
    kv_cache_dtype: str = "fp8",
) -> AttentionBackend:
    from kvforge.attn_backends.deepseek_v4 import DeepseekV4Backend

    return DeepseekV4Backend(
        compress_ratio,
        qk_rope_head_dim=qk_rope_head_dim,
        index_head_dim=index_head_dim,
        kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
    )


def _register_bundled_backends() -> None:
    from kvforge.attn_backends.deepseek_v4 import DeepseekV4Backend
    from kvforge.attn_backends.dsa import DSABackend
    from kvforge.attn_backends.gqa import GQABackend, MHABackend
    from kvforge.attn_backends.mla import MLABackend

    register_backend("gqa", GQABackend, cli_builder=_gqa_from_cli)
    register_backend("mha", MHABackend, cli_builder=_mha_from_cli)
    register_backend("mla", MLABackend)
    register_backend("dsa", DSABackend)
    register_backend("deepseek-v4", DeepseekV4Backend, cli_builder=_v4_from_cli)


_register_bundled_backends()
