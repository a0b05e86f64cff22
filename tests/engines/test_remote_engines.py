"""Two real vLLM engines in two processes sharing a prefix through kvforge's remote tier: a real
``redis-server`` on loopback in a private network namespace (the engine processes inherit it),
tiny random Llama models built once in a shared directory (``remote_runner.py``: engines of
one model path and weights have one identity), each engine a fresh process of the engine
virtualenv (``_engines.run_engine``).

What a user relies on:

- engine 2 serves engine 1's prefix from the store: vLLM counts the prompt's 9 full blocks as
  cached, the store's hit counters say they came from it, and the token ids and top logprobs
  equal engine 1's cold computation;
- killing the store mid-run makes engine 2 recompute, with equal output, and keep serving;
- a value with a valid checksum but a scrambled payload (written by a test producer that
  follows the documented value format) changes engine 2's output: the engine reads the
  store's bytes; corrupted and truncated values cost misses, and the output stays equal;
- an engine serving other weights (same layout) never loads another model's values.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _engines
import numpy as np
import pytest
from _engines import engine_missing, generate, prompt, random_tokens, run_engine

MISSING = engine_missing()
pytestmark = [pytest.mark.engine, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _optional
from _optional import redis_missing  # noqa: E402

REDIS_MISSING = redis_missing()


def _engine_lacks_store_client() -> str | None:
    """Why the engine virtualenv cannot reach Redis (its client, xxhash), or None."""
    import subprocess

    python = _engines.engine_python()
    if python is None:
        return None  # engine_missing() says why
    probe = "import redis, xxhash, pydantic_settings"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    if done.returncode:
        return (
            "the engine virtualenv lacks the remote tier's client: pip install redis xxhash "
            f"pydantic-settings ({done.stderr.strip().splitlines()[-1]})"
        )
    return None


ENGINE_CLIENT_MISSING = _engine_lacks_store_client() if MISSING is None else None
pytestmark.append(
    pytest.mark.skipif(ENGINE_CLIENT_MISSING is not None, reason=ENGINE_CLIENT_MISSING or "")
)

BLOCK = 32
MAX_TOKENS = 8
DTYPE = "float32"
REMOTE_RUNNER = Path(__file__).resolve().parent / "remote_runner.py"
STATS = {"op": "remote_stats"}
FLUSH = {"op": "flush", "timeout": 30}


def tokens(seed: int) -> list[int]:
    """9 full blocks and 12 tokens: the 9 blocks are published, and loaded."""
    return random_tokens(9 * BLOCK + 12, seed=seed)


@pytest.fixture
def redis(tmp_path) -> Iterator[Any]:
    if REDIS_MISSING is not None:
        pytest.skip(f"{REDIS_MISSING} (.ci/run installs it)")
    from kvforge.store.servers import RedisServer, free_port, private_net

    with private_net() as why:  # the engine processes started from here inherit it
        server = RedisServer(6379 if not why else free_port(), tmp_path / "redis.log")
        server.start()
        try:
            yield server
        finally:
            server.stop()


def engine(
    server: Any, model_dir: Path, steps: list[dict], seed: int = 0, **request: Any
) -> dict[str, Any]:
    """One engine process with the remote tier on ``server``; its answer's steps."""
    remote = {"backend": "redis", "redis_port": server.port, "connect_timeout_s": 5.0}
    old = _engines.RUNNER
    _engines.RUNNER = REMOTE_RUNNER
    try:
        answer = run_engine(
            {
                "family": "llama",
                "dtype": DTYPE,
                "seed": seed,
                "model_dir": str(model_dir),
                "kvforge": {"host_bytes": 64 << 20, "remote": remote},
                "steps": steps,
                **request,
            }
        )
    finally:
        _engines.RUNNER = old
    return answer["steps"]


def only(step: dict[str, Any]) -> dict[str, Any]:
    (out,) = step["outputs"]
    return out


def same_output(a: dict[str, Any], b: dict[str, Any], tol: float = 0.0) -> None:
    """Equal token ids and top logprobs (tokens equal, values within ``tol``)."""
    assert a["token_ids"] == b["token_ids"]
    if tol == 0.0:
        assert a["logprobs"] == b["logprobs"]
        return
    for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
        assert [t for t, _ in x] == [t for t, _ in y]
        assert np.allclose([v for _, v in x], [v for _, v in y], rtol=0, atol=tol)


def names_of(server: Any, prompt_tokens: list[int]) -> list[bytes]:
    """The server names of a prompt's 9 published blocks: the key another process computes
    from the tokens alone (kvforge's canonical chain, no salt), whatever the fingerprint."""
    import redis as redis_client

    from kvforge.core.prefix_keys import PrefixHasher
    from kvforge.integrations.vllm.remote_keys import store_key

    chain = PrefixHasher(unit=BLOCK).extend(np.asarray(prompt_tokens[: 9 * BLOCK]))
    suffixes = {store_key(0, k).hex() for k in chain}
    client = redis_client.Redis(port=server.port)
    found = [n for n in client.keys("kvforge/*") if n.decode().rsplit("/", 1)[1] in suffixes]
    client.close()
    return found


def rewrite(server: Any, names: list[bytes], change: Any) -> None:
    import redis as redis_client

    client = redis_client.Redis(port=server.port)
    for name in names:
        client.set(name, change(client.get(name)))
    client.close()


def valid_scramble(value: bytes) -> bytes:
    """The value's header with another payload (its float32 words in reverse order: other
    KV, valid numbers) and the checksum the documented format gives it: XXH3-128 of header
    bytes [0, 96), then the payload (``kvforge.store.value``)."""
    import xxhash

    head = value[:96]
    payload = np.frombuffer(value[112:], dtype=np.float32)[::-1].tobytes()
    return head + xxhash.xxh3_128(head + payload).digest() + payload


def corrupt(value: bytes) -> bytes:
    return value[:-7] + bytes([value[-7] ^ 1]) + value[-6:]


def truncate(value: bytes) -> bytes:
    return value[:-1]


def test_engine_2_serves_engine_1s_prefix_and_recomputes_once_the_store_dies(redis, tmp_path):
    model = tmp_path / "llama"
    p, q = tokens(1), tokens(2)
    one = engine(
        redis, model, [generate([prompt(p)], MAX_TOKENS), generate([prompt(q)], MAX_TOKENS), FLUSH]
    )
    assert one[2] == {"flushed": True}
    assert len(names_of(redis, p)) == 9 and len(names_of(redis, q)) == 9
    two = engine(
        redis,
        model,
        [
            generate([prompt(p)], MAX_TOKENS),
            STATS,
            {"op": "kill", "pid": redis.pid},
            generate([prompt(q)], MAX_TOKENS),
            generate([prompt(tokens(3))], MAX_TOKENS),
            STATS,
        ],
    )
    served, stats, _, after_kill, still, stats_after = two
    assert only(served)["num_cached_tokens"] == 9 * BLOCK  # from kvforge, out of the store
    assert stats["gets_hit"] == 9 and stats["fetched"] == 9 and stats["fetch_misses"] == 0
    same_output(only(served), only(one[0]))
    # the store is gone: q (published by engine 1) is recomputed, and the engine serves on
    assert only(after_kill)["num_cached_tokens"] == 0
    same_output(only(after_kill), only(one[1]))
    assert len(only(still)["token_ids"]) == MAX_TOKENS
    assert stats_after["fetched"] == 9


def test_bad_values_change_or_cost_and_other_models_never_share(redis, tmp_path):
    model = tmp_path / "llama"
    scrambled, corrupted, truncated = tokens(4), tokens(5), tokens(6)
    prompts = [scrambled, corrupted, truncated]
    one = engine(redis, model, [generate([prompt(t)], MAX_TOKENS) for t in prompts] + [FLUSH])
    for t, change in zip(prompts, [valid_scramble, corrupt, truncate], strict=True):
        names = names_of(redis, t)
        assert len(names) == 9
        rewrite(redis, names[:1] if change is not valid_scramble else names, change)
    two = engine(
        redis, model, [generate([prompt(t)], MAX_TOKENS) for t in prompts] + [STATS, FLUSH]
    )
    negative, bad, short, stats, _ = two
    # a valid checksum over a scrambled payload: served, and the output changes
    assert only(negative)["num_cached_tokens"] == 9 * BLOCK
    assert only(negative)["token_ids"] != only(one[0])["token_ids"] or (
        only(negative)["logprobs"] != only(one[0])["logprobs"]
    )
    # a corrupted or truncated value: a miss, recomputed, the output equal (the first token's
    # logprobs bit for bit; later ones within float32 rounding, 1e-6 seen: the load failed
    # mid-request and vLLM's recompute runs in other batch shapes than engine 1's cold run)
    same_output(only(bad), only(one[1]), tol=1e-4)
    same_output(only(short), only(one[2]), tol=1e-4)
    assert only(bad)["logprobs"][0] == only(one[1])["logprobs"][0]
    assert stats["misses"].get("corrupted") == 1 and stats["misses"].get("truncated") == 1
    assert stats["removed"] == 2
    # other weights, same layout: never a value of this model
    other = engine(
        redis, tmp_path / "llama-seed-1", [generate([prompt(corrupted)], MAX_TOKENS), STATS], 1
    )
    assert only(other[0])["num_cached_tokens"] == 0
    assert other[1]["gets_hit"] == 0 and other[1]["fetched"] == 0
    assert os.path.isdir(tmp_path / "llama-seed-1")
