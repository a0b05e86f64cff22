"""Swap-out / swap-in throughput against a contiguous copy and a per-block loop.

Usage::

    python benchmarks/bench_offload.py [--quick] [--device cpu|cuda] [--json PATH]

Same as ``kvforge bench``; see ``kvforge/cli/bench.py`` for what is measured and
``docs/performance.md`` for recorded figures.
"""

from __future__ import annotations

import sys

from kvforge.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
