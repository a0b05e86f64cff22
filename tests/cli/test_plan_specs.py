"""`kvforge plan --vllm-specs FILE`: any malformed specs file is exit code 2 and one line on
stderr naming the file (and the layer, field and value where there is one), never a
traceback, and nothing is written (not even the --json output).

Files that are refused before vLLM is imported (unreadable, not UTF-8, not JSON, too deep,
out-of-range numbers, too many layers) are checked without vLLM; layers vLLM builds are
checked when it is installed."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.cli import specs_file
from kvforge.cli.main import main

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
LAYER = "model.layers.0.self_attn.attn"
GOOD = {
    "type": "FullAttentionSpec",
    "block_size": 16,
    "num_kv_heads": 8,
    "head_size": 128,
    "dtype": "bfloat16",
}


def dump(**fields) -> str:
    return json.dumps({"format": "kvforge.vllm_specs/1", "layers": {LAYER: GOOD | fields}})


def layer(**fields) -> str:
    """One layer of exactly ``fields`` (no defaults from GOOD)."""
    return json.dumps({"format": "kvforge.vllm_specs/1", "layers": {"a": fields}})


def refused(capsys, tmp_path: Path, specs: Path, *extra: str) -> str:
    """Run plan on ``specs``; assert exit 2, one line, no traceback, nothing written."""
    out_json = tmp_path / "out" / "plan.json"
    out_json.parent.mkdir(exist_ok=True)
    argv = ["plan", "--vllm-specs", str(specs), "--json", str(out_json), *extra]
    code = main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err.startswith("kvforge plan: error: --vllm-specs ")
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and len(err) < 1200
    assert not out_json.exists()
    return err


# (file name, content: str or bytes, message fragments) refused before vLLM is imported
FILE_LEVEL = [
    ("empty.json", "", ["is not JSON: Expecting value at line 1 column 1"]),
    ("syntax.json", '{"layers": {\n  "a": }', ["is not JSON", "line 2 column 8"]),
    ("text.json", "hello", ["is not JSON"]),
    ("latin1.json", b'{"layers": {"\xe9": {}}}', ["is not UTF-8 text: byte 13 is b'\\xe9'"]),
    ("bom16.json", b"\xff\xfe{}", ["is not UTF-8 text: byte 0"]),
    ("deep.json", "[" * 100_000 + "]" * 100_000, ["nests JSON arrays or objects too deeply"]),
    (
        "deep_field.json",
        '{"layers": {"a": {"block_size": ' + "[" * 50_000 + "]" * 50_000 + "}}}",
        ["nests JSON arrays or objects too deeply"],
    ),
    (
        "nested.json",
        json.dumps({"layers": {"a": {"shapes": [[[[1]]]]}}}),
        ["nests JSON arrays or objects 6 levels deep at ['layers']['a']['shapes'][0][0]"],
    ),
    ("huge_int.json", dump(block_size=10**30), ["the integer 1000000000000000000000000000000 is out of range"]),
    (
        "digits.json",
        dump(block_size=0).replace(": 0", ": " + "9" * 5000),
        ["the integer 99999999999999999999...(5000 digits) is out of range"],
    ),
    ("padded_huge.json", dump(page_size_padded=2**63), [f"the integer {2**63} is out of range"]),
    ("negative_huge.json", dump(sliding_window=-(2**64)), ["is out of range"]),
    ("float_huge.json", dump(block_size=0).replace(": 0", ": 1e999"), ["the number 1e999 is out of range"]),
    ("nan.json", dump(block_size=0).replace(": 0", ": NaN"), ["NaN is not a JSON number"]),
    ("inf.json", dump(block_size=0).replace(": 0", ": -Infinity"), ["-Infinity is not a JSON number"]),
    (
        "many.json",
        json.dumps({"layers": {f"l{i}": GOOD for i in range(4097)}}),
        ["4,097 layers; kvforge plans at most 4096 cache layers"],
    ),
    (
        "long_name.json",
        json.dumps({"layers": {"x" * 600: GOOD}}),
        ["has 600 characters; vLLM layer names have at most 512"],
    ),
    (
        "ratio.json",
        dump(tokens_per_state="1/0"),
        [f"layer '{LAYER}': field 'tokens_per_state' must be a positive int or a fraction", "'1/0'"],
    ),
    ("ratio_exp.json", dump(tokens_per_state="1e999"), ["field 'tokens_per_state'", "'1e999'"]),
    ("ratio_neg.json", dump(tokens_per_state="-4"), ["field 'tokens_per_state'", "'-4'"]),
    (
        "multiple_of.json",
        dump(block_stride_alignment={"multiple_of": 0}),
        ["field 'block_stride_alignment' must be a positive int", "{'multiple_of': 0}"],
    ),
    (
        "mamba_lengths.json",
        layer(type="MambaSpec", block_size=16, shapes=[[4, 8]], dtypes=["bfloat16", "float32"]),
        ["layer 'a': fields 'shapes' and 'dtypes' must have one entry per state tensor, got 1"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "named"), FILE_LEVEL, ids=[f[0] for f in FILE_LEVEL])
def test_a_malformed_file_is_one_line_exit_2(capsys, tmp_path, monkeypatch, name, content, named):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)

    def must_not_load(*args, **kwargs):
        raise AssertionError("the file was read past its refusal")

    monkeypatch.setattr(specs_file, "_check_pages", must_not_load)
    err = refused(capsys, tmp_path, path)
    assert repr(str(path)) in err
    for fragment in named:
        assert fragment in err, (fragment, err)


def test_paths_that_are_not_a_specs_file(capsys, tmp_path):
    directory = tmp_path / "specs"
    directory.mkdir()
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # a reader would block forever
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(specs_file.MAX_FILE_BYTES + 1)  # sparse: no bytes written
    for path, fragment in [
        (tmp_path / "nope.json", "no such file"),
        (directory, "it is a directory"),
        (fifo, "not a regular file"),
        (Path("/dev/zero"), "not a regular file"),
        (big, f"{specs_file.MAX_FILE_BYTES + 1:,} bytes is more than a specs dump"),
    ]:
        err = refused(capsys, tmp_path, path)
        assert f"--vllm-specs {str(path)!r}: " in err and fragment in err, err


def test_an_unreadable_file(capsys, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = tmp_path / "specs.json"
    path.write_text(dump())
    path.chmod(0)
    err = refused(capsys, tmp_path, path)
    assert "cannot read it: Permission denied" in err


# ------------------------------------------------------------------ layers vLLM builds

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")

# (content, message fragments)
LAYER_LEVEL = [
    # vLLM's page_size_bytes asserts padded >= real: an AssertionError before
    (dump(page_size_padded=100), [f"layer '{LAYER}': field 'page_size_padded' must be at least the layer's real page of 65,536 bytes, got 100"]),
    (layer(type="MLAAttentionSpec", block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16", page_size_padded=10),
     ["layer 'a': field 'page_size_padded' must be at least the layer's real page of 73,728 bytes, got 10"]),
    (layer(type="MambaSpec", block_size=16, shapes=[[4, 8]], dtypes=["float32"], page_size_padded=64),
     ["layer 'a': field 'page_size_padded' must be at least the layer's real page of 128 bytes, got 64"]),
    (dump(page_size_padded=-5), ["field 'page_size_padded' must be an int >= 0, got -5"]),
    # every count fits int64, their product does not
    (dump(num_kv_heads=2**62), ["its page of", "bytes is more than a 64-bit byte count holds"]),
    (layer(type="MambaSpec", block_size=16, shapes=[[2**40, 2**40]], dtypes=["float32"]),
     ["layer 'a': its page of 4,835,703,278,458,516,698,824,704 bytes is more than a 64-bit"]),
    # wrong types, missing and unknown fields, negative and zero sizes
    (dump(block_size="16"), ["field 'block_size' must be an int >= 0, got '16'"]),
    (dump(block_size=16.5), ["field 'block_size' must be an int >= 0, got 16.5"]),
    (dump(block_size=True), ["field 'block_size' must be an int >= 0, got True"]),
    (dump(block_size=-16), ["field 'block_size' must be an int >= 0, got -16"]),
    (dump(block_size=0), ["block_size must be a positive number of tokens, got 0"]),
    (dump(num_kv_heads=0), ["entry_shape[0] must be a positive int, got 0"]),
    (dump(dtype="int7"), ["field 'dtype' must be a dtype name such as 'bfloat16', got 'int7'"]),
    (dump(heads=8), ["FullAttentionSpec has no field 'heads'"]),
    (layer(type="FullAttentionSpec", block_size=16), ["missing 3 required keyword-only arguments"]),
    (dump(type="SlidingWindowSpec", sliding_window=0), ["window must be a positive number of tokens, got 0"]),
    (dump(tokens_per_state=0), ["compress_ratio must be >= 1, got 0"]),
    (dump(block_stride_alignment=0), ["block_stride_alignment must be positive"]),
    (layer(type="MambaSpec", block_size=16, shapes=[], dtypes=[]), ["declares no cache roles"]),
    (layer(type="SlidingWindowMLASpec", block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16", sliding_window=128, model_version="v9"),
     ["vLLM refuses this SlidingWindowMLASpec: Unsupported model version: v9"]),
    (json.dumps({"layers": {"": GOOD}}), ["vLLM layer names must be non-empty strs, got ''"]),
    (json.dumps({"format": "other/2", "layers": {"a": GOOD}}), ["format must be 'kvforge.vllm_specs/1'"]),
    (json.dumps([GOOD]), ["vLLM specs must be a JSON object, got list"]),
]  # fmt: skip


@needs_vllm
@pytest.mark.parametrize(("content", "named"), LAYER_LEVEL)
def test_a_malformed_layer_is_one_line_exit_2(capsys, tmp_path, content, named):
    path = tmp_path / "specs.json"
    path.write_text(content)
    err = refused(capsys, tmp_path, path)
    assert repr(str(path)) in err
    assert "For further information" not in err and "[type=" not in err  # pydantic's noise
    for fragment in named:
        assert fragment in err, (fragment, err)


@needs_vllm
def test_a_good_file_still_plans(capsys, tmp_path):
    path = tmp_path / "specs.json"
    path.write_text(dump(page_size_padded=65_536 + 64))
    assert main(["plan", "--vllm-specs", str(path), "--num-blocks", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_layers"] == 1
    assert sum(g["device_stride"] for g in report["groups"]) == 65_536 + 64


_VALUES = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, 16, 2**31, 2**62, 2**63 - 1, 1.5, -0.0, True, None]),
    st.sampled_from(["", "x", "1/4", "1/0", "bfloat16", "int7", "NONE", "FP8_PER_TENSOR"]),
    st.sampled_from([[], {}, [[1]], [[0, 2]], {"multiple_of": 0}, {"multiple_of": 3}, ["f"]]),
)
_FIELDS = st.sampled_from(
    [
        "type", "block_size", "num_kv_heads", "head_size", "head_size_v", "dtype",
        "page_size_padded", "num_head_slots", "state_content_bytes", "tokens_per_state",
        "block_stride_alignment", "sliding_window", "attention_chunk_size", "kv_quant_mode",
        "shapes", "dtypes", "num_speculative_blocks", "alignment", "model_version",
    ]
)  # fmt: skip
_TYPES = st.sampled_from(
    [
        "FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec",
        "MLAAttentionSpec", "SlidingWindowMLASpec", "MambaSpec",
    ]
)  # fmt: skip


@needs_vllm
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    edits=st.lists(st.tuples(_FIELDS, _VALUES, _TYPES), min_size=1, max_size=3),
    mla=st.booleans(),
)
def test_any_edit_of_a_good_dump_plans_or_is_one_line(capsys, tmp_path, edits, mla):
    base = (
        {"type": "MLAAttentionSpec", "block_size": 64, "num_kv_heads": 1, "head_size": 576,
         "dtype": "bfloat16"}
        if mla
        else dict(GOOD)
    )  # fmt: skip
    for field, value, kind in edits:
        base[field] = kind if field == "type" else value
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps({"layers": {"a": base, "b": GOOD}}))
    code = main(["plan", "--vllm-specs", str(path), "--num-blocks", "4", "--json"])
    out, err = capsys.readouterr()
    if code == 0:
        assert json.loads(out)["num_layers"] == 2
    else:
        assert (code, out) == (2, "") and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize(("command", "option"), [("plan", "--vllm-specs"), ("bench", "--remote")])
def test_help_still_works(capsys, command, option):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvforge {command}") and option in out
