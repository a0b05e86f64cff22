"""Every constructor argument of every bundled backend is checked before anything is built.

One table: (backend, keyword arguments, exception, fragment of the message). A wrong type or a
value out of range raises :class:`~kvforge._checks.ArgumentError` (a ``TypeError`` and a
``ValueError``) whose message names the backend, the argument and the value; the table covers
every parameter of every constructor (checked below), with bools, floats, strings, ``None``,
zero and negative values for the sizes.
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch

from kvforge import (
    DeepseekV4Backend,
    DSABackend,
    GQABackend,
    LinearAttentionBackend,
    MHABackend,
    MLABackend,
)
from kvforge._checks import ArgumentError

A = ArgumentError

LINEAR = dict(
    num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=16, conv_kernel_size=4
)
GQA = dict(num_kv_heads=2, head_dim=8)
MHA = dict(num_heads=2, head_dim=8)

# (backend, kwargs, exception, message fragment)
ROWS = [
    # ------------------------------------------------------------------ MLA
    (MLABackend, dict(kv_lora_rank=-512), A, "MLABackend: kv_lora_rank must be a positive int, got -512"),
    (MLABackend, dict(kv_lora_rank=0), A, "kv_lora_rank must be a positive int, got 0"),
    (MLABackend, dict(kv_lora_rank=True), A, "kv_lora_rank must be an int, got True (bool)"),
    (MLABackend, dict(kv_lora_rank=512.0), A, "kv_lora_rank must be an int, got 512.0 (float)"),
    (MLABackend, dict(kv_lora_rank="512"), A, "kv_lora_rank must be an int, got '512' (str)"),
    (MLABackend, dict(kv_lora_rank=None), A, "kv_lora_rank must be an int, got None (NoneType)"),
    (MLABackend, dict(kv_lora_rank=2**40), A, "kv_lora_rank must be at most 2,147,483,647"),
    (MLABackend, dict(qk_rope_head_dim=-64), A, "qk_rope_head_dim must be a positive int, got -64"),
    (MLABackend, dict(qk_rope_head_dim=0), A, "qk_rope_head_dim must be a positive int, got 0"),
    (MLABackend, dict(qk_rope_head_dim=False), A, "qk_rope_head_dim must be an int, got False"),
    (MLABackend, dict(block_size=0), A, "block_size must be a positive number of tokens, got 0"),
    (MLABackend, dict(block_size=16.0), A, "block_size must be an int, got 16.0"),
    (MLABackend, dict(dtype="int4"), A, "MLABackend: dtype 'int4' is not supported"),
    (MLABackend, dict(dtype=None), A, "dtype must be a torch.dtype or a string, got None"),
    (MLABackend, dict(dtype=2), A, "dtype must be a torch.dtype or a string, got 2"),
    (MLABackend, dict(group=""), A, "group must be a non-empty str"),
    (MLABackend, dict(group=" kv"), A, "without surrounding whitespace (or None for the default 'kv'), got ' kv'"),
    (MLABackend, dict(group=3), A, "group must be a non-empty str"),
    (MLABackend, dict(block_alignment=0), A, "block_alignment must be a positive number of bytes, got 0"),
    (MLABackend, dict(block_alignment=-576), A, "block_alignment must be a positive number of bytes"),
    (MLABackend, dict(block_alignment="576"), A, "block_alignment must be an int, got '576' (str)"),
    (MLABackend, dict(block_alignment=7), ValueError, "block_alignment=7 of role 'key' gives a device block stride of 73731 bytes"),
    # ------------------------------------------------------------------ DSA
    (DSABackend, dict(kv_lora_rank=-1), A, "DSABackend: kv_lora_rank must be a positive int, got -1"),
    (DSABackend, dict(kv_lora_rank=1.5), A, "kv_lora_rank must be an int, got 1.5"),
    (DSABackend, dict(qk_rope_head_dim=-64), A, "qk_rope_head_dim must be a positive int, got -64"),
    (DSABackend, dict(qk_rope_head_dim=None), A, "qk_rope_head_dim must be an int, got None"),
    (DSABackend, dict(index_head_dim=0), A, "index_head_dim must be a positive int, got 0"),
    (DSABackend, dict(index_head_dim=-128), A, "index_head_dim must be a positive int, got -128"),
    (DSABackend, dict(index_head_dim=True), A, "index_head_dim must be an int, got True"),
    (DSABackend, dict(block_size=-64), A, "block_size must be a positive number of tokens"),
    (DSABackend, dict(block_size="64"), A, "block_size must be an int, got '64'"),
    (DSABackend, dict(kv_cache_dtype="int8"), A, "kv_cache_dtype must be 'fp8' or 'bf16', got 'int8'"),
    (DSABackend, dict(kv_cache_dtype=None), A, "kv_cache_dtype must be 'fp8' or 'bf16', got None"),
    (DSABackend, dict(kv_cache_dtype=["fp8"]), A, "kv_cache_dtype must be 'fp8' or 'bf16', got ['fp8']"),
    (DSABackend, dict(group=""), A, "DSABackend: group must be a non-empty str"),
    (DSABackend, dict(group=b"kv"), A, "got b'kv'"),
    (DSABackend, dict(block_alignment=0), A, "block_alignment must be a positive number of bytes"),
    (DSABackend, dict(block_alignment=576.0), A, "block_alignment must be an int, got 576.0"),
    (DSABackend, dict(indexer=1), A, "DSABackend: indexer must be a bool, got 1"),
    (DSABackend, dict(indexer="no"), A, "indexer must be a bool, got 'no'"),
    # ------------------------------------------------------------------ GQA
    (GQABackend, dict(GQA, num_kv_heads=0), A, "GQABackend: num_kv_heads must be a positive number of heads, got 0"),
    (GQABackend, dict(GQA, num_kv_heads=-8), A, "num_kv_heads must be a positive number of heads, got -8"),
    (GQABackend, dict(GQA, num_kv_heads=2.0), A, "num_kv_heads must be an int, got 2.0"),
    (GQABackend, dict(GQA, num_kv_heads=None), A, "num_kv_heads must be an int, got None"),
    (GQABackend, dict(GQA, head_dim=0), A, "head_dim must be a positive int, got 0"),
    (GQABackend, dict(GQA, head_dim=True), A, "head_dim must be an int, got True"),
    (GQABackend, dict(GQA, head_dim="128"), A, "head_dim must be an int, got '128'"),
    (GQABackend, dict(GQA, head_dim_v=0), A, "GQABackend: head_dim_v must be a positive int, got 0"),
    (GQABackend, dict(GQA, head_dim_v="8"), A, "head_dim_v must be an int, got '8'"),
    (GQABackend, dict(GQA, block_size=0), A, "block_size must be a positive number of tokens, got 0"),
    (GQABackend, dict(GQA, block_size=None), A, "block_size must be an int, got None"),
    (GQABackend, dict(GQA, dtype="int4"), A, "GQABackend: dtype 'int4' is not supported"),
    (GQABackend, dict(GQA, dtype=torch.complex64), A, "dtype torch.complex64 is not supported"),
    (GQABackend, dict(GQA, dtype=16), A, "dtype must be a torch.dtype or a string, got 16"),
    (GQABackend, dict(GQA, kv_cache_quant="int4"), A, "kv_cache_quant must be None or one of ['fp8', 'block_wise_fp8'], got 'int4'"),
    (GQABackend, dict(GQA, kv_cache_quant=""), A, "kv_cache_quant must be None or one of"),
    (GQABackend, dict(GQA, kv_cache_quant=8), A, "kv_cache_quant must be None or one of ['fp8', 'block_wise_fp8'], got 8"),
    (GQABackend, dict(GQA, sliding_window=0), A, "sliding_window must be a positive number of tokens, got 0"),
    (GQABackend, dict(GQA, sliding_window=-128), A, "sliding_window must be a positive number of tokens, got -128"),
    (GQABackend, dict(GQA, sliding_window=128.0), A, "sliding_window must be an int, got 128.0"),
    (GQABackend, dict(GQA, sliding_window=True), A, "sliding_window must be an int, got True"),
    (GQABackend, dict(GQA, group=""), A, "GQABackend: group must be a non-empty str without surrounding whitespace (or None for the default 'kv'), got ''"),
    (GQABackend, dict(GQA, group="", sliding_window=64), A, "(or None for the default 'swa'), got ''"),
    (GQABackend, dict(GQA, group="", attention_chunk_size=64), A, "(or None for the default 'chunked'), got ''"),
    (GQABackend, dict(GQA, group="  "), A, "group must be a non-empty str"),
    (GQABackend, dict(GQA, group=0), A, "group must be a non-empty str without surrounding whitespace (or None for the default 'kv'), got 0"),
    (GQABackend, dict(GQA, group=False), A, "got False"),
    (GQABackend, dict(GQA, attention_chunk_size=0), A, "attention_chunk_size must be a positive number of tokens, got 0"),
    (GQABackend, dict(GQA, attention_chunk_size="8192"), A, "attention_chunk_size must be an int, got '8192'"),
    (GQABackend, dict(GQA, sliding_window=64, attention_chunk_size=64), A, "give sliding_window or attention_chunk_size, not both (got 64 and 64)"),
    (GQABackend, dict(GQA, block_layout="HND"), A, "block_layout must be one of ['token_major', 'head_major'], got 'HND'"),
    (GQABackend, dict(GQA, block_layout=None), A, "block_layout must be one of ['token_major', 'head_major'], got None"),
    (GQABackend, dict(GQA, scale_dtype="bfloat16"), A, "scale_dtype='bfloat16' needs kv_cache_quant='block_wise_fp8'"),
    (GQABackend, dict(GQA, kv_cache_quant="block_wise_fp8", scale_dtype="float16"), A, "scale_dtype must be one of ['float32', 'bfloat16'], got 'float16'"),
    (GQABackend, dict(GQA, kv_cache_quant="block_wise_fp8", scale_dtype=torch.float32), A, "scale_dtype must be one of ['float32', 'bfloat16'], got torch.float32"),
    # ------------------------------------------------------------------ MHA
    (MHABackend, dict(MHA, num_heads=0), A, "MHABackend: num_heads must be a positive number of heads, got 0"),
    (MHABackend, dict(MHA, num_heads=4.0), A, "num_heads must be an int, got 4.0"),
    (MHABackend, dict(MHA, head_dim=-8), A, "MHABackend: head_dim must be a positive int, got -8"),
    (MHABackend, dict(MHA, block_size=False), A, "block_size must be an int, got False"),
    (MHABackend, dict(MHA, dtype="bf17"), A, "dtype 'bf17' is not supported"),
    (MHABackend, dict(MHA, kv_cache_quant="int8"), A, "kv_cache_quant must be None or one of"),
    (MHABackend, dict(MHA, block_layout="NHD"), A, "block_layout must be one of"),
    (MHABackend, dict(MHA, scale_dtype="float32"), A, "scale_dtype='float32' needs kv_cache_quant='block_wise_fp8'"),
    # ------------------------------------------------------------------ DeepSeek-V4
    (DeepseekV4Backend, dict(compress_ratio=8), A, "DeepseekV4Backend: compress_ratio must be one of [0, 4, 128], got 8"),
    (DeepseekV4Backend, dict(compress_ratio=-4), A, "compress_ratio must be one of [0, 4, 128], got -4"),
    (DeepseekV4Backend, dict(compress_ratio=4.0), A, "compress_ratio must be one of [0, 4, 128], got 4.0"),
    (DeepseekV4Backend, dict(compress_ratio=False), A, "compress_ratio must be one of [0, 4, 128], got False"),
    (DeepseekV4Backend, dict(compress_ratio=None), A, "compress_ratio must be one of [0, 4, 128], got None"),
    (DeepseekV4Backend, dict(compress_ratio="4"), A, "compress_ratio must be one of [0, 4, 128], got '4'"),
    (DeepseekV4Backend, dict(compress_ratio=4, head_dim=None), A, "DeepseekV4Backend: head_dim must be an int, got None (NoneType)"),
    (DeepseekV4Backend, dict(compress_ratio=4, head_dim=0), A, "head_dim must be >= 2, got 0"),
    (DeepseekV4Backend, dict(compress_ratio=4, head_dim=-512), A, "head_dim must be >= 2, got -512"),
    (DeepseekV4Backend, dict(compress_ratio=4, head_dim=512.0), A, "head_dim must be an int, got 512.0"),
    (DeepseekV4Backend, dict(compress_ratio=0, head_dim="512"), A, "head_dim must be an int, got '512'"),
    (DeepseekV4Backend, dict(compress_ratio=4, qk_rope_head_dim=None), A, "qk_rope_head_dim must be an int, got None"),
    (DeepseekV4Backend, dict(compress_ratio=4, qk_rope_head_dim=0), A, "qk_rope_head_dim must be a positive int, got 0"),
    (DeepseekV4Backend, dict(compress_ratio=4, qk_rope_head_dim=-64), A, "qk_rope_head_dim must be a positive int, got -64"),
    (DeepseekV4Backend, dict(compress_ratio=4, qk_rope_head_dim=512), A, "qk_rope_head_dim must be in (0, head_dim=512), got 512"),
    (DeepseekV4Backend, dict(compress_ratio=4, qk_rope_head_dim=True), A, "qk_rope_head_dim must be an int, got True"),
    (DeepseekV4Backend, dict(compress_ratio=4, index_head_dim=0), A, "index_head_dim must be a positive int, got 0"),
    (DeepseekV4Backend, dict(compress_ratio=4, index_head_dim=None), A, "index_head_dim must be an int, got None"),
    (DeepseekV4Backend, dict(compress_ratio=0, index_head_dim=-1), A, "index_head_dim must be a positive int, got -1"),
    (DeepseekV4Backend, dict(compress_ratio=4, sliding_window=0), A, "sliding_window must be a positive number of tokens, got 0"),
    (DeepseekV4Backend, dict(compress_ratio=4, sliding_window=None), A, "sliding_window must be an int, got None"),
    (DeepseekV4Backend, dict(compress_ratio=4, sliding_window=128.5), A, "sliding_window must be an int, got 128.5"),
    (DeepseekV4Backend, dict(compress_ratio=4, kv_cache_dtype="fp4"), A, "kv_cache_dtype must be 'fp8' or 'bf16', got 'fp4'"),
    (DeepseekV4Backend, dict(compress_ratio=4, kv_cache_dtype=None), A, "kv_cache_dtype must be 'fp8' or 'bf16', got None"),
    (DeepseekV4Backend, dict(compress_ratio=4, block_alignment=0), A, "block_alignment must be a positive number of bytes, got 0"),
    (DeepseekV4Backend, dict(compress_ratio=4, block_alignment=None), A, "block_alignment must be an int, got None"),
    (DeepseekV4Backend, dict(compress_ratio=4, block_alignment=True), A, "block_alignment must be an int, got True"),
    (DeepseekV4Backend, dict(compress_ratio=4, block_alignment=10), ValueError, "block_alignment=10 of role 'compressor_state' gives a device block"),
    # ------------------------------------------------------------------ linear attention
    (LinearAttentionBackend, dict(LINEAR, num_key_heads=0), A, "LinearAttentionBackend: num_key_heads must be a positive number of heads, got 0"),
    (LinearAttentionBackend, dict(LINEAR, num_key_heads=-2), A, "num_key_heads must be a positive number of heads, got -2"),
    (LinearAttentionBackend, dict(LINEAR, num_key_heads=True), A, "num_key_heads must be an int, got True"),
    (LinearAttentionBackend, dict(LINEAR, num_value_heads=2.0), A, "num_value_heads must be an int, got 2.0"),
    (LinearAttentionBackend, dict(LINEAR, num_value_heads=None), A, "num_value_heads must be an int, got None"),
    (LinearAttentionBackend, dict(LINEAR, key_head_dim=0), A, "key_head_dim must be a positive int, got 0"),
    (LinearAttentionBackend, dict(LINEAR, key_head_dim="8"), A, "key_head_dim must be an int, got '8'"),
    (LinearAttentionBackend, dict(LINEAR, value_head_dim=-16), A, "value_head_dim must be a positive int, got -16"),
    (LinearAttentionBackend, dict(LINEAR, value_head_dim=16.0), A, "value_head_dim must be an int, got 16.0"),
    (LinearAttentionBackend, dict(LINEAR, conv_kernel_size=1), A, "conv_kernel_size must be >= 2, got 1"),
    (LinearAttentionBackend, dict(LINEAR, conv_kernel_size=-4), A, "conv_kernel_size must be >= 2, got -4"),
    (LinearAttentionBackend, dict(LINEAR, conv_kernel_size=None), A, "conv_kernel_size must be an int, got None"),
    (LinearAttentionBackend, dict(LINEAR, tp_size=0), A, "tp_size must be a positive number of ranks, got 0"),
    (LinearAttentionBackend, dict(LINEAR, tp_size=True), A, "tp_size must be an int, got True"),
    (LinearAttentionBackend, dict(LINEAR, tp_size=4), A, "tp_size=4 does not divide num_key_heads=2"),
    (LinearAttentionBackend, dict(LINEAR, tp_size=2, num_value_heads=3), A, "tp_size=2 does not divide num_value_heads=3"),
    (LinearAttentionBackend, dict(LINEAR, conv_dtype="int4"), A, "LinearAttentionBackend: conv_dtype: dtype 'int4' is not supported"),
    (LinearAttentionBackend, dict(LINEAR, conv_dtype=None), A, "conv_dtype must be a torch.dtype or a string, got None"),
    (LinearAttentionBackend, dict(LINEAR, recurrent_dtype="float64"), A, "recurrent_dtype: dtype 'float64' is not supported"),
    (LinearAttentionBackend, dict(LINEAR, recurrent_dtype=4), A, "recurrent_dtype must be a torch.dtype or a string, got 4"),
    (LinearAttentionBackend, dict(LINEAR, num_speculative_tokens=-1), A, "num_speculative_tokens must be >= 0, got -1"),
    (LinearAttentionBackend, dict(LINEAR, num_speculative_tokens=1.0), A, "num_speculative_tokens must be an int, got 1.0"),
    # conv [96, 3] bf16 = 576 B + recurrent [4, 8, 16] f32 = 2,048 B: a 2,624-byte state
    (LinearAttentionBackend, dict(LINEAR, page_size_padded=2_623), A, "LinearAttentionBackend: page_size_padded=2623 is below the 2624 bytes of one request's conv and recurrent state"),
    (LinearAttentionBackend, dict(LINEAR, page_size_padded=0), A, "page_size_padded must be a positive int, got 0"),
    (LinearAttentionBackend, dict(LINEAR, page_size_padded="4096"), A, "page_size_padded must be an int, got '4096'"),
]  # fmt: skip

BACKENDS = (
    MLABackend,
    DSABackend,
    GQABackend,
    MHABackend,
    DeepseekV4Backend,
    LinearAttentionBackend,
)


def _id(row) -> str:
    backend, kwargs, _, _ = row
    return f"{backend.__name__}-" + ",".join(f"{k}={v!r}" for k, v in kwargs.items())


@pytest.mark.parametrize(("backend", "kwargs", "exc", "fragment"), ROWS, ids=map(_id, ROWS))
def test_bad_argument_is_refused_by_name(backend, kwargs, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)) as info:
        backend(**kwargs)
    if exc is ArgumentError:  # callers catching either kind keep working
        assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
        assert str(info.value).startswith(f"{backend.__name__}: ")


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_every_constructor_argument_has_rows(backend):
    params = [p for p in inspect.signature(backend.__init__).parameters if p != "self"]
    covered = {k for b, kwargs, _, _ in ROWS if b is backend for k in kwargs}
    assert sorted(set(params) - covered) == []
    # and refusals of every kind: a wrong type and a value out of range, for some argument
    fragments = [f for b, _, _, f in ROWS if b is backend]
    assert any("must be an int, got" in f or "must be one of" in f for f in fragments)
    assert len(fragments) >= 8


def test_group_none_means_the_default_and_a_name_is_kept():
    assert GQABackend(2, 8, group=None).cache_groups()[0].name == "kv"
    assert GQABackend(2, 8, sliding_window=64, group=None).cache_groups()[0].name == "swa"
    assert GQABackend(2, 8, attention_chunk_size=64).cache_groups()[0].name == "chunked"
    assert GQABackend(2, 8, group="local", sliding_window=64).cache_groups()[0].name == "local"
    assert MLABackend(group=None).cache_groups()[0].name == "kv"
    assert DSABackend(group="latent").cache_roles()[1].group == "latent"


def test_numpy_integers_are_ints():
    # sizes read from arrays (a config parsed with numpy) are accepted, as Python ints
    gqa = GQABackend(np.int64(2), np.int32(8), np.int64(16), sliding_window=np.int16(64))
    assert (gqa.num_kv_heads, gqa.head_dim, gqa.block_size, gqa.sliding_window) == (2, 8, 16, 64)
    assert type(gqa.num_kv_heads) is int and type(gqa.sliding_window) is int
    v4 = DeepseekV4Backend(np.int64(4), head_dim=np.int64(64), qk_rope_head_dim=16)
    assert v4.compress_ratio == 4 and type(v4.compress_ratio) is int
    assert MLABackend(np.uint16(512)).cache_roles()[0].entry_shape == (576,)
    linear = LinearAttentionBackend(*(np.int64(v) for v in LINEAR.values()))
    assert linear.conv_dim == 2 * 2 * 8 + 4 * 16


def test_a_refused_backend_leaves_the_class_as_it_was():
    # the declaration lives on the instance: a refused constructor changes no class state
    before = {b: (b._groups, b._roles) for b in BACKENDS}
    for backend, kwargs, exc, _ in ROWS:
        with pytest.raises(exc):
            backend(**kwargs)
    assert {b: (b._groups, b._roles) for b in BACKENDS} == before
    assert GQABackend(2, 8).cache_groups()[0].name == "kv"
