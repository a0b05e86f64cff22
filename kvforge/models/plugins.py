"""Plugins: packages outside kvforge that register backends and model types when imported.

:func:`load_plugins` imports every entry point of the group ``kvforge.backends`` (the
``kvforge`` CLI calls it at start); :func:`load_plugin_module` imports one module by name
(``kvforge --plugin MODULE``). Both run each plugin inside a registry
:func:`~kvforge.models.registry.transaction`, and turn *any* failure while it loads (an import
error, a refused registration, a bug in the plugin, even ``sys.exit()``) into one
:class:`PluginError` that names the plugin and the cause: a broken plugin never leaves half
its registrations behind, and never takes the tool down with a traceback.
"""

from __future__ import annotations

import importlib
import threading
from importlib import metadata
from types import ModuleType

from kvforge.models.registry import transaction

__all__ = ["ENTRY_POINT_GROUP", "PluginError", "load_plugin_module", "load_plugins"]

ENTRY_POINT_GROUP = "kvforge.backends"
"""The entry-point group :func:`load_plugins` imports."""


class PluginError(ImportError):
    """A plugin could not be imported or failed while registering. The message names the
    entry point or module and the cause, on one line; ``__cause__`` is the original
    exception."""


def _cause(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        # a plugin must not decide the exit status of the program that imports it
        return f"it called sys.exit({exc.code!r}) while loading"
    text = " ".join(str(exc).split())  # one line, whatever the plugin put in its message
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_loaded_entry_points: set[tuple[str, str, str]] = set()
_lock = threading.Lock()


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
        PluginError: an entry point failed to import or to register, or exited; the message
            names it and the cause. What it registered before failing is undone; entry points
            loaded before it stay loaded; it is tried again next call.
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
                with transaction():
                    obj = ep.load()
                    if callable(obj) and not isinstance(obj, (ModuleType, type)):
                        obj()
            except (Exception, SystemExit) as exc:
                raise PluginError(f"{_describe(ep)} failed to load: {_cause(exc)}") from exc
            _loaded_entry_points.add(key)
            loaded.append(ep.name)
    return tuple(loaded)


def load_plugin_module(name: str) -> ModuleType:
    """Import the plugin module ``name`` (``kvforge --plugin NAME``), which registers things.

    Raises:
        PluginError: the module cannot be imported, fails while registering, or exits; the
            message names it and the cause. What it registered before failing is undone.
        TypeError / ValueError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str):
        raise TypeError(f"plugin module name must be a str, got {type(name).__name__}")
    if not name.strip():
        raise ValueError(f"plugin module name {name!r} is empty")
    try:
        with transaction():
            # The one import of a module named at run time: the name comes from the user
            # (--plugin), not from kvforge, so it is exempt from the rule that kvforge's own
            # import_module strings only point down the layers.
            return importlib.import_module(name)
    except (Exception, SystemExit) as exc:
        raise PluginError(f"cannot import plugin module {name!r}: {_cause(exc)}") from exc
