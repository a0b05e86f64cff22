"""Real-engine tests: each engine runs in a fresh process of the engine virtualenv
(``_engines.py``, ``engine_runner.py``); this folder's helpers are importable by name."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
