"""The remote tier on Mooncake Store: two controllers in two processes share a prefix byte for
byte through a real ``mooncake_master``. Both engines run in processes of their own (Mooncake's
client keeps process-wide state), the writer kept alive while the reader reads: a Mooncake
value lives in the segments its clients lend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(
    ("model", "longest"), [("gqa", 192), ("v4-mtp", 1280)], ids=["gqa-window", "deepseek-v4-mtp"]
)
def test_two_processes_share_a_prefix_through_mooncake(mooncake_master, model, longest):
    address = f"mooncake:{mooncake_master.address}"
    engine = [sys.executable, str(HERE / "_remote_engine.py")]
    writer = subprocess.Popen(
        [*engine, "serve", model, address], cwd=HERE, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        line = writer.stdout.readline()
        assert line, writer.stderr.read()[-3000:] if writer.poll() is not None else "no output"
        wrote = json.loads(line)
        assert wrote["published"] > 0 and wrote["puts_ok"] == wrote["published"]
        read = subprocess.run(
            [*engine, "read", model, address], cwd=HERE, capture_output=True, text=True,
            timeout=300,
        )
        assert read.returncode == 0, read.stderr[-3000:]
        got = json.loads(read.stdout.strip().splitlines()[-1])
        assert got["hit_tokens"] == longest == got["reach_tokens"]
        assert got["fetched"] > 0 and got["fetch_misses"] == 0
        assert got["entries"] > 0 and got["mismatched"] == 0
    finally:
        writer.stdin.close()
        try:
            writer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
