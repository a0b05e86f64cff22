"""``engine_runner.py`` for the remote tier's engine tests: the same script and request, plus
what two engines sharing a store need.

- ``"model_dir"`` (request key): build the tiny model in this directory, or reuse the one
  built there already. Engines in two processes then serve the same weights at the same path,
  so they have one :class:`~kvforge.ModelIdentity` (the path, and each weight file's size and
  modification time, are part of it) and may share; a model built per process never does.
- ``{"op": "remote_stats"}``: the remote tier's counters, summed over workers: ``published``,
  ``fetched``, ``fetch_misses``, ``removed`` (the worker's), and the store's ``gets_hit``,
  ``puts_ok``, ``misses`` (by reason).
- ``{"op": "flush", "timeout": 30}``: wait for every worker's queued puts to land.
- ``{"op": "kill", "pid": N}``: ``SIGKILL`` process ``N`` (the store's server), mid-run.
- ``{"op": "mooncake_corrupt", "tokens": [...], "blocks": 1}``: on Mooncake Store, replace the
  values of the first ``blocks`` published blocks (of ``block`` tokens, 32) of ``tokens`` (the worker's names: kvforge's
  chain, no salt) by the same bytes with one payload bit flipped (``remove`` + ``put``:
  Mooncake never overwrites); how many it replaced.

Usage: ``python remote_runner.py REQUEST.json OUT.json`` (imports nothing of kvforge before
the engine is up, as ``engine_runner.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_runner


def _remote_in_worker(worker: Any) -> dict[str, Any]:
    kv = engine_runner._kvforge_worker(worker)
    store = getattr(kv, "store", None)
    if store is None:
        return {}
    stats = store.stats()
    return {
        "published": int(kv.published),
        "fetched": int(kv.fetched),
        "fetch_misses": int(kv.fetch_misses),
        "removed": int(kv.removed),
        "gets_hit": int(stats.gets_hit),
        "puts_ok": int(stats.puts_ok),
        "misses": dict(stats.misses),
    }


def _flush_in_worker(worker: Any, timeout: float) -> bool:
    kv = engine_runner._kvforge_worker(worker)
    store = getattr(kv, "store", None)
    return True if store is None else bool(store.flush(timeout))


def _remote_stats(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    total: dict[str, Any] = {"misses": {}}
    for one in llm.collective_rpc(_remote_in_worker):
        for key, value in one.items():
            if key == "misses":
                for reason, n in value.items():
                    total["misses"][reason] = total["misses"].get(reason, 0) + n
            else:
                total[key] = total.get(key, 0) + value
    return total


def _corrupt_in_worker(worker: Any, tokens: list[int], blocks: int, unit: int) -> int:
    import numpy as np

    from kvforge.core.prefix_keys import PrefixHasher
    from kvforge.integrations.vllm.remote_keys import store_key
    from kvforge.store.base import server_key

    kv = engine_runner._kvforge_worker(worker)
    store = kv.store
    chain = PrefixHasher(unit=unit).extend(np.asarray(tokens[: blocks * unit]))
    client, done = store.raw_client, 0
    for key in chain:
        name = server_key(store.config.namespace, store.fingerprint, store_key(0, key))
        value = bytes(client.get(name))
        if not value:
            continue
        bad = value[:-7] + bytes([value[-7] ^ 1]) + value[-6:]
        if client.remove(name, True) == 0 and client.put(name, bad) == 0:
            done += 1
    return done


def _kill(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    os.kill(int(step["pid"]), signal.SIGKILL)
    return {"killed": int(step["pid"])}


engine_runner.STEPS.update(
    {
        "remote_stats": _remote_stats,
        "flush": lambda llm, step: {
            "flushed": all(
                llm.collective_rpc(_flush_in_worker, args=(float(step.get("timeout", 30)),))
            )
        },
        "kill": _kill,
        "mooncake_corrupt": lambda llm, step: {
            "replaced": sum(
                llm.collective_rpc(
                    _corrupt_in_worker,
                    args=(
                        list(step["tokens"]),
                        int(step.get("blocks", 1)),
                        int(step.get("block", 32)),
                    ),
                )
            )
        },
    }
)


class _SharedDir:
    """``tempfile`` for ``engine_runner.run``: its model directory is ``model_dir``."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    @contextlib.contextmanager
    def TemporaryDirectory(self, prefix: str = "") -> Iterator[str]:
        os.makedirs(self.model_dir, exist_ok=True)
        yield self.model_dir


def _build_once(build: Any) -> Any:
    def build_model(family: str, overrides: Any, seed: int, dtype: str, dest: str) -> int:
        if not os.path.exists(os.path.join(dest, "config.json")):
            return build(family, overrides, seed, dtype, dest)
        return sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest))

    return build_model


def main(argv: list[str]) -> int:
    import json

    if len(argv) == 2:
        with open(argv[0]) as f:
            model_dir = json.load(f).get("model_dir")
        if model_dir:
            engine_runner.tempfile = _SharedDir(model_dir)  # type: ignore[assignment]
            engine_runner.build_model = _build_once(engine_runner.build_model)
    return engine_runner.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
