"""``kvforge`` exports every type the facade takes, returns or raises: a walk over
:class:`CacheController`'s public methods and properties (and its constructor), their
annotations, the fields of the kvforge values they return, and the ``Raises:`` sections of
their docstrings. A name of kvforge's own that a user meets there must be importable as
``from kvforge import Name``, as the very object the facade uses."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

import kvforge
from kvforge import controller
from kvforge.controller import CacheController

#: names an annotation may use that are not kvforge's (builtins, typing, torch, numpy)
FOREIGN_MODULES = ("typing", "collections", "torch", "numpy", "np", "builtins")
#: where the exceptions a docstring names are defined, when the facade does not import them
ERROR_MODULES = ("kvforge.errors", "kvforge._checks")


def imported_names(path: Path) -> dict[str, str]:
    """Name -> the module it is imported from, for every ``from m import name`` of the module
    at ``path`` (``TYPE_CHECKING`` blocks and function bodies included)."""
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name] = alias.name
    return names


IMPORTS = imported_names(Path(controller.__file__))


def resolve(name: str) -> object | None:
    """The kvforge object ``name`` means in ``kvforge.controller``; ``None`` when it is not
    kvforge's (a builtin, ``typing``, torch or numpy)."""
    head = name.split(".")[0]
    if hasattr(builtins, name) or head in FOREIGN_MODULES:
        return None
    if name in vars(controller) and name not in IMPORTS:
        obj = vars(controller)[name]
        return obj if getattr(obj, "__module__", "").startswith("kvforge") else None
    module = IMPORTS.get(head) or next(
        (m for m in ERROR_MODULES if hasattr(importlib.import_module(m), name)), None
    )
    assert module is not None, (
        f"{name!r} is neither imported nor defined in kvforge.controller, nor an error of "
        f"{ERROR_MODULES}"
    )
    if not module.startswith("kvforge"):
        return None
    return getattr(importlib.import_module(module), name)


def public_members() -> list[tuple[str, object]]:
    members = [("CacheController", CacheController), ("__init__", CacheController.__init__)]
    for name, member in vars(CacheController).items():
        if name.startswith("_"):
            continue
        func = member.fget if isinstance(member, property) else member
        if callable(func):
            members.append((name, func))
    return members


def annotation_names(func: object) -> set[str]:
    if not callable(func) or isinstance(func, type):
        return set()
    found: set[str] = set()
    for text in inspect.get_annotations(func).values():
        found.update(re.findall(r"[A-Za-z_][\w.]*", str(text)))
    return found - {"None"}


def raised_names(func: object) -> set[str]:
    """Exception names of the ``Raises:`` section of ``func``'s docstring."""
    doc = inspect.getdoc(func) or ""
    if "Raises:" not in doc:
        return set()
    section = doc.split("Raises:", 1)[1]
    section = re.split(r"\n(?:Returns|Args|Yields|Attributes|Example)s?:", section)[0]
    entries = [line.split(":", 1)[0] for line in section.splitlines() if re.match(r"^ {4}\S", line)]
    return {n for entry in entries for n in re.findall(r"\b[A-Z]\w*(?:Error|Exception)\b", entry)}


def facade_types() -> dict[str, tuple[str, object]]:
    """Name -> (where it is met, the object) for every kvforge type of the facade."""
    found: dict[str, tuple[str, object]] = {}
    for where, func in public_members():
        for name in annotation_names(func) | raised_names(func):
            obj = resolve(name)
            if obj is not None:
                found.setdefault(name.split(".")[-1], (where, obj))
    for name, (where, obj) in list(found.items()):  # the fields of returned values
        if dataclasses.is_dataclass(obj) and isinstance(obj, type) and name == "ScheduledStep":
            for field in dataclasses.fields(obj):
                owner = importlib.import_module(obj.__module__)
                hint = str(field.type)
                value = getattr(owner, hint, None)
                if value is not None:
                    found.setdefault(hint, (f"{where} -> {name}.{field.name}", value))
    return found


def test_the_walk_sees_what_the_issue_named():
    found = facade_types()
    # the facade returns ScheduledStep (whose inputs are StepInputs) and raises ArgumentError
    assert {"ScheduledStep", "StepInputs", "ArgumentError", "CacheOptions", "PlanOptions"} <= set(
        found
    )
    assert "int" not in found and "Tensor" not in found


@pytest.mark.parametrize("name", sorted(facade_types()))
def test_every_facade_type_is_exported(name):
    where, obj = facade_types()[name]
    assert name in kvforge.__all__, f"{name} (met in CacheController.{where}) is not exported"
    assert getattr(kvforge, name) is obj


def test_the_raises_reader_reads_a_section():
    def f() -> None:
        """Do it.

        Raises:
            ArgumentError (a ``TypeError`` and a ``ValueError``): bad input.
            OutOfBlocksError / RequestStateError: no blocks, or the wrong state: the
                ValueError words on a continuation line are not entries.
        """

    assert raised_names(f) == {
        "ArgumentError",
        "TypeError",
        "ValueError",
        "OutOfBlocksError",
        "RequestStateError",
    }
