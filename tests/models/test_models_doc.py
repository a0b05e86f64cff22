"""docs/models.md ends with the table of supported model types, held to the registry.

Every registered ``model_type`` has exactly one row; no row names a type kvforge does not
register; a bundled example is a config of that very type, and the group kinds its plan has
are named in the row's "layer kinds" cell. The table must be the last thing in the file, so
that rows added for a new family land in it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvforge.core.layout import CacheLayout
from kvforge.models import from_hf_config
from kvforge.models.reading import bundled_models, load_model_config
from kvforge.models.registry import registered_model_types

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
HEADER = "| model_type | layer kinds | example |"
TICKED = re.compile(r"`([^`]+)`")


def _table(text: str) -> list[list[str]]:
    """The cells of the rows of the last table of ``text``, which must end the file."""
    lines = text.rstrip("\n").splitlines()
    assert lines[-1].startswith("|"), "docs/models.md must end with the model_type table"
    start = len(lines) - 1
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    assert lines[start] == HEADER, f"the last table's header is {lines[start]!r}, not {HEADER!r}"
    assert lines[start + 1] == "| --- | --- | --- |"
    rows = []
    for line in lines[start + 2 :]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"a row of the model_type table has {len(cells)} cells: {line!r}"
        rows.append(cells)
    return rows


def _rows() -> dict[str, list[list[str]]]:
    by_type: dict[str, list[list[str]]] = {}
    for cells in _table(DOC.read_text(encoding="utf-8")):
        match = re.fullmatch(r"`([a-z0-9_-]+)`", cells[0])
        assert match, f"the first cell names one model_type in backticks, got {cells[0]!r}"
        by_type.setdefault(match.group(1), []).append(cells)
    return by_type


def _bundled_types() -> list[str]:
    return [name for name, entry in registered_model_types().items() if entry.bundled]


def test_every_registered_model_type_has_exactly_one_row():
    rows = _rows()
    registered = _bundled_types()
    missing = [t for t in registered if t not in rows]
    twice = [t for t, found in rows.items() if len(found) > 1]
    unknown = [t for t in rows if t not in registered]
    assert (missing, twice, unknown) == ([], [], [])


def test_the_table_reader_refuses_what_the_rule_forbids():
    good = f"intro\n\n{HEADER}\n| --- | --- | --- |\n| `llama` | full | `llama-3-8b` |\n"
    assert _table(good) == [["`llama`", "full", "`llama-3-8b`"]]
    for bad in (good + "\nA paragraph after the table.\n", good.replace("| full |", "| full")):
        with pytest.raises(AssertionError):
            _table(bad)


def _example_cases() -> list[tuple[str, str, str]]:
    cases = []
    for model_type, found in sorted(_rows().items()):
        kinds, example = found[0][1], found[0][2]
        names = TICKED.findall(example)
        assert names, f"the example of {model_type} names no model: {example!r}"
        cases += [(model_type, kinds, n) for n in names if "/" not in n]
        if not any("/" not in n for n in names):
            assert all(re.fullmatch(r"[\w.-]+/[\w.-]+", n) for n in names), example
    return cases


@pytest.mark.parametrize(("model_type", "kinds", "example"), _example_cases())
def test_a_bundled_example_is_of_its_type_and_plans_the_named_kinds(model_type, kinds, example):
    assert example in bundled_models()
    config = load_model_config(example)
    types = {config.get("model_type"), (config.get("text_config") or {}).get("model_type")}
    assert model_type in types
    layout = CacheLayout(from_hf_config(example))
    planned = {getattr(g.kind, "value", g.kind) for g in layout.groups}
    named = set(re.findall(r"[a-z_]+", kinds))
    assert planned <= named, f"{example} plans {sorted(planned)}; the row names {kinds!r}"
