"""A second failure while kvforge undoes a first is noted on the first (``kvforge.errors.
add_note``), on every Python kvforge supports: 3.11 on through ``BaseException.add_note``,
3.10 through the same ``__notes__`` list by hand (it has no method there)."""

from __future__ import annotations

import types

import pytest

from kvforge import DeepseekV4Backend, GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.errors import add_note
from kvforge.scheduler import BlockManager
from kvforge.scheduler.block_pool import BlockPool
from kvforge.scheduler.tables import RequestTables


def test_a_note_goes_on_the_exception_through_its_method():
    exc = RuntimeError("first")
    add_note(exc, "one")
    add_note(exc, "two")
    assert exc.__notes__ == ["one", "two"]


@pytest.mark.parametrize(
    ("notes", "expected"),
    [(None, ["undo"]), (["kept"], ["kept", "undo"]), ("not a list", ["undo"])],
)
def test_without_the_method_the_notes_list_is_written_by_hand(notes, expected):
    """An exception without ``add_note`` (Python 3.10's) gets the list 3.11 would build."""
    old = types.SimpleNamespace() if notes is None else types.SimpleNamespace(__notes__=notes)
    add_note(old, "undo")  # type: ignore[arg-type]
    assert old.__notes__ == expected


def test_a_failed_put_back_of_a_released_row_is_noted_on_the_first_failure(monkeypatch):
    layout = CacheLayout({0: GQABackend(2, 8, 16), 1: DeepseekV4Backend(0)})
    m = BlockManager(layout, dict.fromkeys((g.name for g in layout.groups), 40), 2, 2048)
    m.end_step(m.schedule(["a"], [100]))

    def boom(self, block_ids):
        raise RuntimeError("release failed")

    def broken(self, *args):
        raise OSError("put back failed")

    monkeypatch.setattr(BlockPool, "release_few", boom)
    monkeypatch.setattr(RequestTables, "_restore_row", broken)
    with pytest.raises(RuntimeError, match="release failed") as caught:
        m.finish(["a"])
    assert caught.value.__notes__ == [
        "kvforge: putting a released row back failed: OSError('put back failed')"
    ]
