"""``batch_put_blocks`` on the Mooncake adapter and a segment lent by another process: the
cases are in ``_put_blocks_mooncake_cases.py``, run here with pytest in a process of their own
(Mooncake's client keeps process-wide state in the network namespace of its first client, so
they cannot share a process with ``test_store_mooncake.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# ImportError, not only ModuleNotFoundError: the wheel without the libibverbs it loads skips too
pytest.importorskip(
    "mooncake.store",
    reason="Mooncake Store's client does not load: pip install 'kvforge[mooncake]' and apt-get install libibverbs1 ibverbs-providers",
    exc_type=ImportError,
)

CASES = os.path.join(os.path.dirname(__file__), "_put_blocks_mooncake_cases.py")


def test_the_mooncake_cases_pass_in_a_process_of_their_own():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", CASES],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout[-4000:]
    assert done.returncode == 0, out + done.stderr[-2000:]
    if "skipped" in out:
        pytest.skip(out.strip().splitlines()[-1])
    assert "5 passed" in out, out
