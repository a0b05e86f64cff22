"""The pytest side of the real-engine tests (``_engines.py``), without an engine: why engines
are missing, and how a failed engine process is reported. Stand-in "pythons" are shell scripts
(``$1`` the runner, ``$2`` the request, ``$3`` the answer file)."""

from __future__ import annotations

import json
import os
import stat

import _engines
import pytest
from _engines import EngineError, generate, prompt, random_tokens, run_engine


def script(tmp_path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize(
    ("python", "message"),
    [
        (None, "KVFORGE_ENGINE_PYTHON is not set: it names the python of a virtualenv"),
        ("/nonexistent/bin/python", "KVFORGE_ENGINE_PYTHON='/nonexistent/bin/python' is not an"),
        ("echo False", "lacks vllm or kvforge"),
        ("echo True", None),
    ],
)
def test_engine_missing_names_the_reason(tmp_path, monkeypatch, python, message):
    if python is None:
        monkeypatch.delenv("KVFORGE_ENGINE_PYTHON", raising=False)
    elif python.startswith("echo"):
        monkeypatch.setenv("KVFORGE_ENGINE_PYTHON", script(tmp_path, python))
    else:
        monkeypatch.setenv("KVFORGE_ENGINE_PYTHON", python)
    why = _engines.engine_missing.__wrapped__()
    if message is None:
        assert why is None
    else:
        assert message in why


@pytest.mark.parametrize(
    ("body", "timeout", "message"),
    [
        ("exit 3", 60, "engine 'llama' failed: exit status 3"),
        ('echo \'{"error": "ValueError: family=1"}\' > "$3"; exit 1', 60, "ValueError: family=1"),
        ("echo '{}' > \"$3\"", 60, "engine 'llama' failed: exit status 0"),
        ("echo to-the-log; sleep 5", 0.5, "engine ran past 0.5 s"),
    ],
)
def test_a_failed_engine_process_is_an_engine_error(tmp_path, monkeypatch, body, timeout, message):
    monkeypatch.setenv("KVFORGE_ENGINE_PYTHON", script(tmp_path, body))
    monkeypatch.delenv("KVFORGE_ENGINE_LOCK", raising=False)
    with pytest.raises(EngineError) as err:
        run_engine({"family": "llama", "steps": []}, timeout=timeout)
    assert message in str(err.value)


def test_run_engine_hands_the_request_over_and_reads_the_answer(tmp_path, monkeypatch):
    # the stand-in copies the request into the answer's steps
    body = 'printf \'{"steps": [\' > "$3"; cat "$2" >> "$3"; printf "]}" >> "$3"'
    monkeypatch.setenv("KVFORGE_ENGINE_PYTHON", script(tmp_path, body))
    lock = tmp_path / "engine.lock"
    monkeypatch.setenv("KVFORGE_ENGINE_LOCK", str(lock))
    request = {"family": "qwen3", "steps": [generate([prompt([1, 2], "a")], max_tokens=3)]}
    answer = run_engine(request)
    assert answer == {"steps": [request]}
    assert os.path.exists(lock)  # taken around the process


def test_prompts_and_tokens():
    assert random_tokens(5, seed=3) == random_tokens(5, seed=3)
    assert random_tokens(5, seed=3) != random_tokens(5, seed=4)
    assert all(1 <= t < 512 for t in random_tokens(1000, seed=0))
    assert prompt([1, 2]) == {"tokens": [1, 2]}
    assert prompt((3,), "s") == {"tokens": [3], "cache_salt": "s"}
    step = generate([prompt([1])], max_tokens=4, logprobs=2)
    assert json.loads(json.dumps(step)) == {
        "op": "generate",
        "prompts": [{"tokens": [1]}],
        "max_tokens": 4,
        "logprobs": 2,
    }
