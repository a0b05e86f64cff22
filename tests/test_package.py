"""Importing kvforge pulls in no optional dependency and prints nothing."""

import subprocess
import sys


def test_import_is_lean_and_silent():
    code = (
        "import sys, kvforge\n"
        "print(sorted(m for m in ('triton', 'numba', 'torch_npu', 'rich') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    assert done.stderr == ""
