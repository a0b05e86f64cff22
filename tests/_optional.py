"""What the optional remote-tier tests need, and why each skips where it is missing.

The README's test command installs the ``test`` extra only: the Redis client comes with it,
but not ``redis-server``, Mooncake Store's client (``mooncake-transfer-engine-non-cuda``, the
``mooncake`` extra), the ``libibverbs`` its native modules load, nor its ``mooncake_master``.
``.ci/run`` installs them all. A test that needs one of them skips, naming what is missing,
instead of failing on a fresh machine (``tests/test_repository.py`` and
``tests/cli/test_demo_tiers.py`` check these checks with the pieces hidden).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import shutil


def redis_missing() -> str | None:
    """Why the Redis tests cannot run here, or None."""
    if importlib.util.find_spec("redis") is None:
        return "the redis client is not installed (pip install 'kvforge[redis]')"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server; .ci/run does)"
    return None


def mooncake_missing() -> str | None:
    """Why the Mooncake tests cannot run here, or None: its client, the system library its
    native modules load (``libibverbs``, even for the TCP transport) and its master."""
    if importlib.util.find_spec("mooncake") is None:
        return (
            "the mooncake client is not installed "
            "(pip install 'kvforge[mooncake]'; .ci/run installs it)"
        )
    if ctypes.util.find_library("ibverbs") is None:
        return (
            "Mooncake's client needs libibverbs, which is not installed "
            "(apt-get install libibverbs1 ibverbs-providers)"
        )
    if shutil.which("mooncake_master") is None:
        return "mooncake_master is not installed (it comes with the mooncake client's wheel)"
    return None
