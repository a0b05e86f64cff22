"""The registries of attention backends and Hugging Face model types.

kvforge keeps two tables, filled through :func:`register_backend` and
:func:`register_model_type` by kvforge itself and by packages outside it (plugins, loaded by
:mod:`kvforge.models.plugins`):

- **backends**: a name (``"gqa"``, ``"deepseek-v4"``, ...) for an
  :class:`~kvforge.attn_backends.base.AttentionBackend` class, plus the callable the
  ``--backend NAME`` option of the CLI builds one layer's backend with. The builder's keyword
  parameters *are* its declaration of the command-line options it takes (``head_dim`` is set by
  ``--head-dim``, ``num_kv_heads`` by ``--num-kv-heads``, ...): the CLI refuses any other
  option given with ``--backend NAME``, and a parameter without a default is a required option.
- **model types**: a Hugging Face ``model_type`` (and the ``architectures`` names that stand
  for it) for a :data:`~kvforge.models.base.ModelBuilder`, which turns a parsed
  ``config.json`` into ``{layer id: backend}``.
  :func:`~kvforge.models.hf_config.from_hf_config` dispatches through it.

The tables are seeded from :mod:`kvforge.models.bundled` when this module is imported, so
they are never seen without kvforge's own entries, and a plugin can never register first a
name kvforge needs.

Invariants:

- Registering a name again with the same objects is a no-op. With different objects it is a
  ``ValueError`` that changes nothing, unless the caller passes ``replace=True`` on purpose;
  the message says when the name is one kvforge bundles.
- An architecture name stands for at most one ``model_type``.
- :func:`registered_backends` and :func:`registered_model_types` are sorted by name: nothing
  depends on the order in which plugins happened to register.
- :func:`transaction` undoes every registration made inside it when it ends in an exception,
  so a plugin that fails halfway leaves the tables as they were.
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvforge.attn_backends.base import AttentionBackend
from kvforge.models.base import ModelBuilder, short_repr
from kvforge.models.bundled import BUNDLED_BACKENDS, BUNDLED_MODEL_TYPES

__all__ = [
    "RegisteredBackend",
    "RegisteredModelType",
    "register_backend",
    "register_model_type",
    "registered_backends",
    "registered_model_types",
    "transaction",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

_lock = threading.RLock()


# ---------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RegisteredBackend:
    """One :func:`register_backend` entry.

    Attributes:
        name: the registered name (the CLI's ``--backend`` choice).
        cls: the backend class.
        cli_builder: what builds one backend from command-line options; ``None``: ``cls``.
        bundled: registered by kvforge itself (a plugin replaces it only with ``replace=True``).
    """

    name: str
    cls: type[AttentionBackend]
    cli_builder: Callable[..., AttentionBackend] | None
    bundled: bool = False

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
        builder: the :data:`~kvforge.models.base.ModelBuilder`.
        architectures: ``architectures`` names that stand for this model type when a config's
            ``model_type`` is absent or not registered.
        bundled: registered by kvforge itself (a plugin replaces it only with ``replace=True``).
    """

    model_type: str
    builder: ModelBuilder
    architectures: tuple[str, ...]
    bundled: bool = False


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


def _check_replace(what: str, replace: object) -> None:
    if not isinstance(replace, bool):
        raise TypeError(f"{what}: replace must be a bool, got {short_repr(replace)}")


def _qualname(obj: object) -> str:
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}" if module else name


def _taken(kind: str, name: str, old: str, new: str, bundled: bool, function: str) -> ValueError:
    owner = ", bundled with kvforge" if bundled else ""
    return ValueError(
        f"{kind} {name!r} is already registered to {old}{owner}; refusing {new}: pass "
        f"replace=True to {function} to replace it on purpose"
    )


# ---------------------------------------------------------------------------------- backends


def register_backend(
    name: str,
    cls: type[AttentionBackend],
    *,
    cli_builder: Callable[..., AttentionBackend] | None = None,
    replace: bool = False,
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
        replace: replace what ``name`` is registered to (a bundled backend included). Without
            it, a name taken by other objects is refused.

    Raises:
        ValueError: ``name`` is already registered with a different class or builder and
            ``replace`` is false (the same ones again are a no-op), or ``name`` is not a
            valid name.
        TypeError: ``cls`` is not an ``AttentionBackend`` subclass, ``cli_builder`` is not
            callable, a parameter of the builder cannot be passed by keyword, or ``replace``
            is not a bool.
    """
    _register_backend(name, cls, cli_builder, replace, bundled=False)


def _register_backend(
    name: str,
    cls: type[AttentionBackend],
    cli_builder: Callable[..., AttentionBackend] | None,
    replace: bool,
    bundled: bool,
) -> None:
    _check_name("backend name", name)
    _check_replace(f"backend {name!r}", replace)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(
            f"backend {name!r}: cls must be a subclass of AttentionBackend, got {short_repr(cls)}"
        )
    if cli_builder is not None and not callable(cli_builder):
        raise TypeError(
            f"backend {name!r}: cli_builder must be callable or None, got {short_repr(cli_builder)}"
        )
    entry = RegisteredBackend(name=name, cls=cls, cli_builder=cli_builder, bundled=bundled)
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
        if old is not None and not replace:
            if old.cls is cls and old.cli_builder is cli_builder:
                return
            raise _taken(
                "backend",
                name,
                f"{_qualname(old.cls)} (cli_builder "
                f"{_qualname(old.cli_builder) if old.cli_builder else None})",
                f"{_qualname(cls)} (cli_builder {_qualname(cli_builder) if cli_builder else None})",
                old.bundled,
                "register_backend",
            )
        _backends[name] = entry


def registered_backends() -> dict[str, RegisteredBackend]:
    """Every registered backend, sorted by name (a new dict: changing it changes nothing)."""
    with _lock:
        return {name: _backends[name] for name in sorted(_backends)}


# ---------------------------------------------------------------------------------- model types


def register_model_type(
    model_type: str,
    builder: ModelBuilder,
    *,
    architectures: Iterable[str] = (),
    replace: bool = False,
) -> None:
    """Register ``builder`` for the Hugging Face ``model_type``.

    Args:
        model_type: e.g. ``"llama"``, as in ``config.json``.
        builder: see :data:`~kvforge.models.base.ModelBuilder`.
        architectures: ``architectures`` names (e.g. ``"LlamaForCausalLM"``) that select this
            model type when a config's ``model_type`` is absent or not registered.
        replace: replace what ``model_type`` is registered to (a bundled model type included;
            its architectures go with it). Without it, a model type taken by other objects is
            refused.

    Raises:
        ValueError: ``model_type`` is already registered with a different builder or
            architectures and ``replace`` is false (the same ones again are a no-op), an
            architecture already stands for another model type, or a name is not valid.
        TypeError: ``builder`` is not callable, ``architectures`` is a string or holds a
            non-string, or ``replace`` is not a bool.
    """
    _register_model_type(model_type, builder, architectures, replace, bundled=False)


def _register_model_type(
    model_type: str,
    builder: ModelBuilder,
    architectures: Iterable[str],
    replace: bool,
    bundled: bool,
) -> None:
    _check_name("model_type", model_type)
    _check_replace(f"model_type {model_type!r}", replace)
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
        if old is not None and not replace:
            if old.builder is builder and old.architectures == archs:
                return
            raise _taken(
                "model_type",
                model_type,
                f"{_qualname(old.builder)} (architectures {list(old.architectures)})",
                f"{_qualname(builder)} (architectures {list(archs)})",
                old.bundled,
                "register_model_type",
            )
        for other in _model_types.values():
            if other.model_type == model_type:  # being replaced: its architectures go with it
                continue
            taken = sorted(set(archs) & set(other.architectures))
            if taken:
                raise ValueError(
                    f"model_type {model_type!r}: architecture {taken[0]!r} already stands for "
                    f"model_type {other.model_type!r}"
                )
        _model_types[model_type] = RegisteredModelType(
            model_type=model_type, builder=builder, architectures=archs, bundled=bundled
        )


def registered_model_types() -> dict[str, RegisteredModelType]:
    """Every registered model type, sorted by name (a new dict)."""
    with _lock:
        return {name: _model_types[name] for name in sorted(_model_types)}


# ---------------------------------------------------------------------------------- transactions


@contextmanager
def transaction() -> Iterator[None]:
    """Undo every registration made inside the ``with`` block when it raises (any
    exception, ``SystemExit`` and ``KeyboardInterrupt`` included), then re-raise.

    Plugin loading runs each plugin inside one, so a plugin that registers a backend and then
    fails leaves neither registered. Other threads' registrations wait until the block ends.
    """
    with _lock:
        backends, model_types = dict(_backends), dict(_model_types)
        try:
            yield
        except BaseException:
            _backends.clear()
            _backends.update(backends)
            _model_types.clear()
            _model_types.update(model_types)
            raise


# ---------------------------------------------------------------------------------- bundled
# Seeded at import, before any caller can register anything (see the module docstring).

for _name, _cls, _cli_builder in BUNDLED_BACKENDS:
    _register_backend(_name, _cls, _cli_builder, replace=False, bundled=True)
for _model_type, _builder, _arch in BUNDLED_MODEL_TYPES:
    _register_model_type(_model_type, _builder, (_arch,), replace=False, bundled=True)
del _name, _cls, _cli_builder, _model_type, _builder, _arch
