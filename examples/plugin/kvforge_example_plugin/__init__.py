"""kvforge example plugin: a fused key/value cache backend and the ``gpt_bigcode`` model type.

Importing this module registers, through kvforge's public registry:

- backend ``fused-kv`` (:class:`FusedKVBackend`): ``kvforge plan --backend fused-kv
  --num-kv-heads 1 --head-dim 128``. It is registered without a CLI builder, so the CLI calls
  the class with the options named like its parameters; ``num_kv_heads`` and ``head_dim`` have
  no default, so their options are required.
- model type ``gpt_bigcode`` (architecture ``GPTBigCodeForCausalLM``):
  ``kvforge plan --config <a GPT-BigCode config.json>``; :data:`SAMPLE_CONFIG` is StarCoder's.

kvforge finds it through the entry point ``example`` of group ``kvforge.backends`` declared
in ``pyproject.toml``; without installing, ``kvforge ... --plugin kvforge_example_plugin``
imports it by name.
"""

from __future__ import annotations

from pathlib import Path

from kvforge.models import register_backend, register_model_type
from kvforge_example_plugin.fused_kv import FusedKVBackend, GPTBigCodeFields, build_gpt_bigcode

__all__ = ["SAMPLE_CONFIG", "FusedKVBackend", "GPTBigCodeFields", "build_gpt_bigcode"]

SAMPLE_CONFIG = Path(__file__).resolve().parent / "starcoder" / "config.json"
"""The cache-relevant part of ``bigcode/starcoder``'s ``config.json`` (StarCoder-15B: 40
layers, 48 heads of 128, multi-query, 8,192 positions)."""

register_backend("fused-kv", FusedKVBackend)
register_model_type("gpt_bigcode", build_gpt_bigcode, architectures=("GPTBigCodeForCausalLM",))
