"""The wheel works: built from the package sources, installed outside the checkout, the
``kvforge`` command runs, finds its bundled configs, and ships no research harness.

The wheel is built without build isolation (no network) from a copy of ``pyproject.toml``,
``README.md`` and ``kvforge/`` in a temporary directory (so the checkout gets no ``build/``),
installed with ``pip install --target`` into another, and run from there with only that
directory on ``PYTHONPATH``. The whole file takes a few seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _setuptools_version() -> tuple[int, ...]:
    try:
        import setuptools
    except ImportError:
        return (0,)
    return tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())


pytestmark = pytest.mark.skipif(
    _setuptools_version() < (77,),
    reason="building the wheel without network needs setuptools >= 77 installed",
)


def pip(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "-q"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(wheel, site)``: the built wheel and the directory it is installed in."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(
        REPO / "kvforge", src / "kvforge", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    pip("wheel", "--no-build-isolation", str(src), "-w", str(root / "dist"), cwd=root)
    [wheel] = (root / "dist").glob("kvforge-*.whl")
    pip("install", "--target", str(root / "site"), str(wheel), cwd=root)
    return wheel, root / "site"


def kvforge(site: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy, nothing of the checkout
    return subprocess.run(
        [sys.executable, str(site / "bin" / "kvforge"), *argv],
        cwd=site.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_wheel_holds_every_bundled_config_and_no_research_harness(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    configs = sorted(p.name for p in (REPO / "kvforge" / "models" / "configs").glob("*.json"))
    assert configs and all(f"kvforge/models/configs/{c}" in names for c in configs)
    assert all(n.startswith(("kvforge/", "kvforge-0.1.0.dist-info/")) for n in names)
    assert not [n for n in names if "benchmarks" in n or n.startswith("tests/")]
    entry_points = zipfile.ZipFile(wheel).read("kvforge-0.1.0.dist-info/entry_points.txt")
    assert "kvforge = kvforge.cli.main:main" in entry_points.decode()


@pytest.mark.slow
def test_the_installed_command_runs_from_outside_the_checkout(installed):
    _, site = installed
    where = subprocess.run(
        [sys.executable, "-c", "import kvforge.cli.main as m; print(m.__file__)"],
        cwd=site.parent,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert where.stdout.strip().startswith(str(site))

    done = kvforge(site, "--help")
    assert done.returncode == 0 and "usage: kvforge" in done.stdout and done.stderr == ""

    done = kvforge(
        site,
        "plan",
        "--model",
        "deepseek-v4-flash",
        "--device-memory",
        "60GiB",
        "--max-model-len",
        "65536",
        "--max-num-seqs",
        "16",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    # 43 main layers (the MTP layer only with --num-speculative-tokens), four groups
    assert (report["model"], report["num_layers"]) == ("deepseek-v4-flash", 43)
    assert {g["group"] for g in report["groups"]} == {"swa", "compressed", "c4_state", "c128_state"}
    assert report["total_bytes"] <= 60 * 1024**3

    for flag, script in (
        ("--step", "benchmarks/bench_step.py"),
        ("--prefix", "benchmarks/bench_prefix.py"),
    ):
        done = kvforge(site, "bench", flag)
        assert (done.returncode, done.stdout) == (2, "")
        assert len(done.stderr.strip().splitlines()) == 1 and f"python {script}" in done.stderr
