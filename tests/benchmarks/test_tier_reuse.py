"""The tier reuse benchmark (``benchmarks/tier_reuse.py``): device only and with a host tier on
the same conversations, the JSON it writes, and its bad arguments. No timing is asserted."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import tier_reuse
from prefix_sim import PrefixWorkload


@pytest.mark.slow
def test_a_host_tier_serves_at_least_the_device_alone_and_at_most_the_oracle():
    wl = PrefixWorkload(num_conversations=12, concurrency=6, max_num_seqs=4)
    [r] = tier_reuse.run(wl, ["llama-3-8b"], Fraction(1, 8), Fraction(1, 2))
    assert r.model == "llama-3-8b" and (r.device_fraction, r.host_fraction) == ("1/8", "1/2")
    assert r.device_tokens < r.tiered_tokens <= r.oracle_tokens <= r.prompt_tokens
    # every token the tier served past the device alone came from host pages
    assert r.host_hit_tokens > 0 and r.host_demotions > 0
    assert r.tiered_vs_oracle == r.tiered_tokens / r.oracle_tokens
    assert r.host_bytes > 0 and r.device_bytes > 0


@pytest.mark.slow
def test_cli_writes_json(tmp_path):
    path = tmp_path / "t.json"
    argv = ["--quick", "--models", "llama-3-8b", "--fraction", "1/8", "--json", str(path)]
    assert tier_reuse.main(argv) == 0
    data = json.loads(path.read_text())
    [run] = data["runs"]
    assert run["model"] == "llama-3-8b" and run["device_fraction"] == "1/8"
    assert run["tiered_vs_oracle"] == run["tiered_tokens"] / run["oracle_tokens"]
    assert run["device_vs_oracle"] == run["device_tokens"] / run["oracle_tokens"]
    assert max(run["tiered_tokens"], run["device_tokens"]) <= run["oracle_tokens"]
    assert data["environment"]["workload"]["num_conversations"] == 16


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", "nope"], "--models: ['nope'] are not of"),
        (["--fraction", "0"], "--fraction and --host must be > 0, got 0, 1/2"),
        (["--fraction", "x"], "argument --fraction: invalid Fraction value: 'x'"),
        (["--host=-1/2"], "--fraction and --host must be > 0, got 1/4, -1/2"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        tier_reuse.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
