"""The model identity of a vLLM engine (``kvforge.integrations.vllm.identity``), from a real
``ModelConfig`` (vLLM reads the bundled ``config.json`` of a temporary directory): every thing
that makes the engine's KV bytes differ changes it, equal engines agree, and a path alone is
never enough (the weight files at the path are in it)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import DeviceConfig, ModelConfig, VllmConfig
from vllm_harness import _model_dir

from kvforge._checks import ArgumentError
from kvforge.integrations.vllm import model_identity
from kvforge.integrations.vllm.identity import weights_digest


def model_config(path: str, **kw) -> ModelConfig:
    return ModelConfig(model=path, skip_tokenizer_init=True, max_model_len=256, **kw)


def parallel(tp: int = 1, pp: int = 1, rank: int = 0, pcp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        prefill_context_parallel_size=pcp,
        rank=rank,
    )


def ident(mc: ModelConfig, **par):
    return model_identity(SimpleNamespace(model_config=mc, parallel_config=parallel(**par)))


@pytest.fixture(scope="module")
def llama() -> str:
    return _model_dir("llama-3-8b")


def test_the_identity_is_filled_from_the_model_config(llama):
    cfg = VllmConfig(
        model_config=model_config(llama, dtype="auto"), device_config=DeviceConfig(device="cpu")
    )
    m = model_identity(cfg)
    assert m.name == llama and m.dtype == "bfloat16" and m.quantization is None
    assert m.revision is None and m.weights_digest is None  # a config.json only
    assert (m.tp_rank, m.tp_size, m.pp_rank, m.pp_size) == (0, 1, 0, 1)
    # another process, or the same engine built twice, computes the same identity
    assert ident(model_config(llama, dtype="auto")) == m


def test_what_changes_the_bytes_changes_the_identity(llama):
    base = ident(model_config(llama, dtype="auto"))
    others = {
        "dtype": ident(model_config(llama, dtype="float16")),
        "override": ident(model_config(llama, dtype="auto", hf_overrides={"rope_theta": 1e6})),
        "revision": ident(model_config(llama, dtype="auto", revision="0123abcd")),
        "tp rank": ident(model_config(llama, dtype="auto"), tp=2, rank=1),
        "pp rank": ident(model_config(llama, dtype="auto"), tp=2, pp=2, rank=2),
    }
    assert len({base.digest, *(m.digest for m in others.values())}) == len(others) + 1
    assert others["override"].config_digest != base.config_digest
    assert (others["tp rank"].tp_rank, others["tp rank"].pp_rank) == (1, 0)
    # vLLM's rank order: tensor parallel innermost, then prefill context parallel, then pipeline
    assert (others["pp rank"].tp_rank, others["pp rank"].pp_rank) == (0, 1)
    m = ident(model_config(llama, dtype="auto"), tp=2, pp=2, pcp=2, rank=5)
    assert (m.tp_rank, m.pp_rank) == (1, 1)


def test_the_weights_at_a_path_are_in_the_identity(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert weights_digest(str(tmp_path)) is None
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"a" * 64)
    os.utime(shard, ns=(1, 1_000))
    first = weights_digest(str(tmp_path))
    assert first is not None and weights_digest(str(tmp_path)) == first
    shard.write_bytes(b"b" * 64)  # other weights at the same path, the same size
    os.utime(shard, ns=(1, 2_000))
    assert weights_digest(str(tmp_path)) not in (None, first)
    # a Hugging Face cache: the shard links to a blob named by its content's digest
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shard.unlink()
    (blobs / ("a" * 64)).write_bytes(b"x" * 64)
    shard.symlink_to(blobs / ("a" * 64))
    linked = weights_digest(str(tmp_path))
    (blobs / ("b" * 64)).write_bytes(b"x" * 64)
    shard.unlink()
    shard.symlink_to(blobs / ("b" * 64))
    assert weights_digest(str(tmp_path)) != linked
    assert weights_digest("org/a-hub-id") is None


def test_a_config_without_model_or_parallel_config_is_refused():
    with pytest.raises(ArgumentError, match="model_identity needs a VllmConfig"):
        model_identity(SimpleNamespace(model_config=None, parallel_config=parallel()))
