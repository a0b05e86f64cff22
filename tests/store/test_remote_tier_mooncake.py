"""The remote tier on Mooncake Store: two controllers in two processes share a prefix byte for
byte through a real ``mooncake_master``. Both engines run in processes of their own (Mooncake's
client keeps process-wide state), the writer kept alive while the reader reads: a Mooncake
value lives in the segments its clients lend."""

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
        read = subprocess.run(
            [*engine_argv, "read", model, address],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert read.returncode == 0, read.stderr[-3000:]
        got = json.loads(read.stdout.strip().splitlines()[-1])
        # served to the prompt's last boundary, all of it from the store, every entry verified
        assert engine.served_whole(got, longest), f"reader {got}; writer {wrote}"
    finally:
        writer.stdin.close()
        try:
            writer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
