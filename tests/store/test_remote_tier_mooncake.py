"""The remote tier on Mooncake Store: two controllers in two processes share a prefix byte for
byte through a real ``mooncake_master``. Both engines run in processes of their own (Mooncake's
client keeps process-wide state), the writer kept alive while the reader reads: a Mooncake
value lives in the segments its clients lend.

Issue 32, class 2: an engine of the same model path at another revision (equal layout, the
default namespace, the same master) reads nothing of the writer's; the same identity reads it
all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _remote_engine as engine
import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(
    ("model", "longest"), [("gqa", 192), ("v4-mtp", 1280)], ids=["gqa-window", "deepseek-v4-mtp"]
)
def test_two_processes_share_a_prefix_through_mooncake(mooncake_master, model, longest):
    address = f"mooncake:{mooncake_master.address}"
    engine_argv = [sys.executable, str(HERE / "_remote_engine.py")]
    writer = subprocess.Popen(
        [*engine_argv, "serve", model, address],
        cwd=HERE,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = writer.stdout.readline()
        assert line, writer.stderr.read()[-3000:] if writer.poll() is not None else "no output"
        wrote = json.loads(line)
        # every value queued and written, none dropped: else the reader's hit ends early
        assert engine.all_landed(wrote), f"the writer's values did not all land: {wrote}"

        def read(revision: str) -> dict:
            run = subprocess.run(
                [*engine_argv, "read", model, address, revision],
                cwd=HERE,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert run.returncode == 0, run.stderr[-3000:]
            return json.loads(run.stdout.strip().splitlines()[-1])

        if model == "gqa":  # another model (same path, other revision): nothing crosses
            other = read("rev-b")
            assert other["hit_tokens"] == other["fetched"] == other["fetch_misses"] == 0, other
            assert not other["store"]["misses"] and other["mismatched"] == 0, other
        got = read("rev-a")
        # served to the prompt's last boundary, all of it from the store, every entry verified
        assert engine.served_whole(got, longest), f"reader {got}; writer {wrote}"
    finally:
        writer.stdin.close()
        try:
            writer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
