"""pytest configuration shared by every test module.

``TRITON_INTERPRET=1`` must be in the environment before any Triton kernel is *decorated*
(``@triton.jit`` checks it at decoration time), so it is set here, at conftest import, before any
test module imports a kernel module. It lets the Triton kernels run on CPU tensors (interpreter).
An explicit ``TRITON_INTERPRET`` in the environment wins.

Hypothesis draws fresh examples on every run, so a developer's runs keep exploring. CI sets
``KVFORGE_HYPOTHESIS_PROFILE=ci``: the same examples for the same code (``derandomize``), so
a red CI is reproducible by anyone from the commit alone, and a green one is not luck.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("KVFORGE_HYPOTHESIS_PROFILE", "explore"))

# Tests live in one folder per package (core/, scheduler/, ...); their shared helpers
# (``_helpers``, ``_two_sides``) sit here, and the research harnesses they check sit in the
# checkout's ``benchmarks/`` (they are not shipped in the package).
_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parent / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


@pytest.fixture(scope="session")
def mooncake_session_net():
    """The one private network namespace every in-process Mooncake client of the session
    lives in (``tests/_mooncake_net.py`` says why there must be one)."""
    from _mooncake_net import shared_private_net

    with shared_private_net() as net:
        yield net
