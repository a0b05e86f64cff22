"""Real vLLM engines in separate processes sharing a prefix through Mooncake Store: a real
``mooncake_master`` and a ``mooncake_client`` lending the store's memory (another process
holding the bytes, as another machine would), both on loopback in a private network namespace
that the engine processes inherit; tiny random Llama models built once in a shared directory
(``remote_runner.py``), each engine a fresh process of the engine virtualenv.

What a user relies on:

- engine 2 serves engine 1's prefix from Mooncake: vLLM counts the prompt's 9 full blocks as
  cached, the store's hit counters say they came from it, and the token ids and top logprobs
  equal engine 1's cold computation;
- a corrupted value (one payload bit flipped) costs a miss, is removed (Mooncake never
  overwrites a key on its own), and the output stays equal;
- an engine that lent Mooncake a segment gives it back when it shuts down: the master counts
  one unmount and its capacity is the segment host's again, at once (not after a lease);
- the master killed mid-run makes requests recompute, with equal output, and the engine keeps
  serving.
"""

from __future__ import annotations

import re
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _engines
import pytest
from _engines import engine_missing, generate, prompt, run_engine
from test_remote_engines import (
    BLOCK,
    DTYPE,
    ENGINE_CLIENT_MISSING,
    FLUSH,
    MAX_TOKENS,
    REMOTE_RUNNER,
    STATS,
    only,
    same_output,
    tokens,
)

MISSING = engine_missing()
pytestmark = [pytest.mark.engine, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _optional
from _optional import mooncake_missing  # noqa: E402

MOONCAKE_MISSING = mooncake_missing()
SEGMENT_HOST_BYTES = 64 << 20


def _engine_lacks_mooncake() -> str | None:
    """Why the engine virtualenv cannot reach Mooncake Store (its client), or None."""
    import subprocess

    python = _engines.engine_python()
    if python is None or MISSING is not None:
        return None  # engine_missing() says why
    done = subprocess.run(
        [python, "-c", "import mooncake.store"], capture_output=True, text=True, check=False
    )
    if done.returncode:
        return (
            "the engine virtualenv lacks Mooncake Store's client: pip install "
            f"mooncake-transfer-engine-non-cuda ({done.stderr.strip().splitlines()[-1]})"
        )
    return None


ENGINE_MOONCAKE_MISSING = ENGINE_CLIENT_MISSING or _engine_lacks_mooncake()
pytestmark.append(
    pytest.mark.skipif(ENGINE_MOONCAKE_MISSING is not None, reason=ENGINE_MOONCAKE_MISSING or "")
)


class Mooncake:
    """The master and the segment host, and the master's metrics."""

    def __init__(self, master: Any, metrics_port: int) -> None:
        self.master = master
        self.metrics_port = metrics_port
        self.port = master.port
        self.pid = master.pid

    def metrics(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        found = re.findall(r"^(master_[a-z_]+) ([0-9.e+]+)$", text, flags=re.M)
        return {name: float(value) for name, value in found}


@pytest.fixture
def mooncake(tmp_path) -> Iterator[Mooncake]:
    if MOONCAKE_MISSING is not None:
        pytest.skip(f"{MOONCAKE_MISSING} (.ci/run installs it)")
    from kvforge.store.servers import MooncakeMaster, MooncakeSegmentHost, free_port, private_net

    with private_net() as why:  # the engine processes started from here inherit it
        if why:
            pytest.skip(f"Mooncake's listeners need a private network namespace: {why}")
        master = MooncakeMaster(50051, 50052, tmp_path / "master.log")
        master.start()
        host = MooncakeSegmentHost(
            free_port(), master.address, SEGMENT_HOST_BYTES, tmp_path / "segment.log"
        )
        try:
            host.start()
            yield Mooncake(master, 50052)
        finally:
            host.stop()
            master.stop()


def engine(
    server: Mooncake, model_dir: Path, steps: list[dict], segment_bytes: int = 0
) -> list[dict[str, Any]]:
    """One engine process with the remote tier on Mooncake; ``segment_bytes`` it lends."""
    remote = {
        "backend": "mooncake",
        "mooncake_master": server.master.address,
        "mooncake_global_segment_bytes": segment_bytes,
        "mooncake_local_buffer_bytes": 16 << 20,
        "connect_timeout_s": 5.0,
        "op_timeout_s": 5.0,
        "retry_after_s": 0.2,
        "close_timeout_s": 5.0,
    }
    old = _engines.RUNNER
    _engines.RUNNER = REMOTE_RUNNER
    try:
        answer = run_engine(
            {
                "family": "llama",
                "dtype": DTYPE,
                "seed": 0,
                "model_dir": str(model_dir),
                "kvforge": {"host_bytes": 64 << 20, "remote": remote},
                "steps": steps,
            }
        )
    finally:
        _engines.RUNNER = old
    return answer["steps"]


def test_engines_share_a_prefix_through_mooncake_and_survive_its_faults(mooncake, tmp_path):
    model = tmp_path / "llama"
    p, bad, q = tokens(1), tokens(5), tokens(2)
    one = engine(
        mooncake,
        model,
        [generate([prompt(t)], MAX_TOKENS) for t in (p, bad, q)]
        + [FLUSH, STATS, {"op": "mooncake_corrupt", "tokens": bad, "blocks": 1}],
    )
    assert one[3] == {"flushed": True}
    assert one[4]["published"] == 27 and one[4]["puts_ok"] == 27
    assert one[5] == {"replaced": 1}
    before = mooncake.metrics()
    two = engine(
        mooncake,
        model,
        [generate([prompt(p)], MAX_TOKENS), generate([prompt(bad)], MAX_TOKENS), STATS, FLUSH],
        segment_bytes=16 << 20,
    )
    served, recomputed, stats, _ = two
    assert only(served)["num_cached_tokens"] == 9 * BLOCK  # from kvforge, out of the store
    same_output(only(served), only(one[0]))
    # the corrupted first block: a miss, removed, recomputed to the cold output
    assert only(recomputed)["num_cached_tokens"] == 0
    same_output(only(recomputed), only(one[1]), tol=1e-4)
    assert stats["misses"] == {"corrupted": 1} and stats["removed"] == 1
    # p's 9 blocks, and the 8 good blocks of the load that failed as a whole
    assert stats["fetched"] == 17 and stats["fetch_misses"] == 1
    assert stats["gets_hit"] == 17, stats
    # engine 2 lent a segment and gave it back when it shut down
    after = mooncake.metrics()
    assert after["master_unmount_segment_requests_total"] == (
        before["master_unmount_segment_requests_total"] + 1
    )
    assert after["master_total_capacity_bytes"] == SEGMENT_HOST_BYTES
    three = engine(
        mooncake,
        model,
        [
            {"op": "kill", "pid": mooncake.pid},
            generate([prompt(q)], MAX_TOKENS),
            generate([prompt(tokens(3))], MAX_TOKENS),
            STATS,
        ],
    )
    _, after_kill, still, stats_after = three
    # the master is gone: q (published by engine 1) is recomputed, and the engine serves on
    assert only(after_kill)["num_cached_tokens"] == 0
    same_output(only(after_kill), only(one[2]))
    assert len(only(still)["token_ids"]) == MAX_TOKENS
    assert stats_after["fetched"] == 0 and stats_after["gets_hit"] == 0
