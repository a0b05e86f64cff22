"""kvforge backends and vLLM 0.33's per-layer ``KVCacheSpec`` objects, mapped both ways.

:func:`to_vllm_specs` describes a kvforge model to vLLM, one spec per vLLM layer name;
:func:`from_vllm_specs` turns a vLLM model's specs into kvforge backends that ``CacheLayout``
and ``kvforge plan`` take; :func:`dump_vllm_specs` / :func:`load_vllm_specs` carry specs as
JSON (``kvforge plan --vllm-specs PATH``). Bytes agree per vLLM layer, in both directions.

This module holds the translation both ways; beside it, one concern each:
:mod:`~kvforge.integrations.vllm.spec_kinds` (what each group kind is to vLLM, one table),
:mod:`~kvforge.integrations.vllm.spec_backend` (:class:`VllmSpecBackend`, one vLLM layer as a
declaration) and :mod:`~kvforge.integrations.vllm.spec_files` (the JSON form). Every name is
importable from here as before.

The byte invariant: for every vLLM layer, vLLM's ``page_size_bytes`` (its padded page) is the
sum of kvforge's ``device_block_bytes`` over the roles behind that layer, and vLLM's
``real_page_size_bytes`` (unpadded) is the sum of their ``block_bytes`` (a host page's share).
Where kvforge has no vLLM equivalent, :class:`~kvforge._checks.ArgumentError` names the group
and role and says why (block-wise fp8 with bfloat16 scales, a role beside key / value that
vLLM's attention spec cannot hold, a single-vector cache in a chunked group).

Layer names (``to_vllm_specs``): ``f"{prefix}{layer}.{module}"`` (``prefix`` default
``"model.layers."``), ``module`` as vLLM's model code names that cache, so a bundled model's
names are vLLM's own: GQA / MHA ``self_attn.attn`` (key, value and scales in one spec); MLA
``self_attn.attn``; DSA that and ``self_attn.indexer.k_cache``; DeepSeek-V4 ``attn.swa_cache``,
``attn`` (compressed_kv), ``attn.compressor.state_cache``, ``attn.indexer.k_cache``,
``attn.indexer.compressor.state_cache``; linear attention ``linear_attn`` (a ``MambaSpec``);
Mamba2 ``mixer`` (a ``MambaSpec``, as Nemotron-H and Granite-4.0-H name it; Falcon-H1's vLLM
names are ``model.{N + i}.mixer`` and ``model.layers.{i}.attn``, and Nemotron-H's attention is
``mixer.attn``: the specs agree layer by layer, the names by that map);
any other backend ``{group}.kv`` (key + value), else ``{group}.{role}``. gpt-oss names its
attention ``attn.attn``, not ``self_attn.attn`` (:data:`_KV_MODULES`, read from the
``model_type`` that :func:`~kvforge.models.from_hf_config` records). A mapping from
:func:`from_vllm_specs` keeps vLLM's names (its ``layer_names``).

Worked example: one Llama-3-8B layer, 16-token blocks of 8 kv heads of 128 in bf16. vLLM's
page is ``block_size * num_kv_heads * (head_size + head_size_v) * 2 B`` and kvforge's block is
its ``key`` and ``value`` roles, ``16 * 8 * 128 * 2 B`` each:

>>> from kvforge.attn_backends import GQABackend
>>> spec = to_vllm_specs({0: GQABackend(num_kv_heads=8, head_dim=128, block_size=16)})[
...     "model.layers.0.self_attn.attn"]
>>> spec.block_size * spec.num_kv_heads * (spec.head_size + spec.head_size_v) * 2
65536
>>> spec.page_size_bytes == 2 * (16 * 8 * 128 * 2) == 65_536
True
>>> layout = CacheLayout(from_vllm_specs({"model.layers.0.self_attn.attn": spec}))
>>> sum(b.device_block_bytes for b in layout.buffers)
65536
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

from kvforge._checks import ArgumentError, check_int
from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.deepseek_v4 import DeepseekV4Backend
from kvforge.attn_backends.dsa import DSABackend
from kvforge.attn_backends.gqa import GQABackend
from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.attn_backends.mamba import Mamba2Backend
from kvforge.attn_backends.mla import MLABackend
from kvforge.core.layout import CacheLayout
from kvforge.integrations.vllm.spec_backend import SUPPORTED_SPECS, VllmSpecBackend
from kvforge.integrations.vllm.spec_files import SPECS_FORMAT, dump_vllm_specs, load_vllm_specs
from kvforge.integrations.vllm.spec_kinds import vllm_kind
from kvforge.specs import (
    CacheGroup,
    CacheRole,
    canonical_dtype,
)

__all__ = [
    "SPECS_FORMAT",
    "SUPPORTED_SPECS",
    "VllmSpecBackend",
    "VllmSpecBackends",
    "dump_vllm_specs",
    "from_vllm_specs",
    "layer_page_bytes",
    "load_vllm_specs",
    "to_vllm_specs",
]


_FP8 = ("float8_e4m3fn", "float8_e5m2")
_MAMBA_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(MambaSpec))
# MambaSpec fields of vLLM versions whose Mamba layers export prefill checkpoints
_MAMBA_CHECKPOINT_FIELDS = frozenset(
    {"num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment"}
)
_MAMBA_CACHE_MODES = ("none", "align")  # vLLM's MambaCacheMode (vllm/config/cache.py)
_SCALE_BYTES = 4  # vLLM's per-token-head scales are float32, inline after each head's data
# model_type -> vLLM's module of a key / value cache, where it is not ``self_attn.attn``: gpt-oss's
# decoder layer holds ``attn`` (OAIAttention), whose Attention is ``attn`` again
# (vllm/model_executor/models/gpt_oss.py: TransformerBlock.__init__, OAIAttention.__init__)
_KV_MODULES = {"gpt_oss": "attn.attn"}
_DSV4_MODULES = {
    "swa_kv": "attn.swa_cache",
    "compressed_kv": "attn",
    "compressor_state": "attn.compressor.state_cache",
    "indexer": "attn.indexer.k_cache",
    "indexer_compressor_state": "attn.indexer.compressor.state_cache",
}


# ---------------------------------------------------------------------------- kvforge -> vLLM


@dataclass(frozen=True)
class _Unit:
    """One vLLM layer: the roles of one kvforge layer behind one spec."""

    name: str
    layer: int
    roles: tuple[CacheRole, ...]
    group: CacheGroup
    spec: KVCacheSpec


def _layout(backends: Mapping[int, AttentionBackend] | CacheLayout) -> CacheLayout:
    if isinstance(backends, CacheLayout):
        return backends
    try:
        return CacheLayout(backends)
    except (TypeError, ValueError) as exc:
        raise ArgumentError(f"backends: {exc}") from None


def _modules(backend: AttentionBackend) -> list[tuple[str, list[CacheRole]]]:
    """(vLLM module, its roles) of one layer of ``backend``, in vLLM's order."""
    roles = backend.cache_roles()
    if isinstance(backend, GQABackend | LinearAttentionBackend | VllmSpecBackend | Mamba2Backend):
        module = "linear_attn" if isinstance(backend, LinearAttentionBackend) else "self_attn.attn"
        module = "mixer" if isinstance(backend, Mamba2Backend) else module
        return [(module, roles)]
    if isinstance(backend, MLABackend | DSABackend):
        names = {"key": "self_attn.attn", "indexer": "self_attn.indexer.k_cache"}
        return [(names[r.name], [r]) for r in roles]
    if isinstance(backend, DeepseekV4Backend):
        order = list(_DSV4_MODULES)
        ordered = sorted(roles, key=lambda r: order.index(r.name))
        return [(_DSV4_MODULES[r.name], [r]) for r in ordered]
    out: list[tuple[str, list[CacheRole]]] = []
    for group in backend.cache_groups():
        members = [r for r in roles if r.group == group.name]
        names = {r.name for r in members}
        if vllm_kind(group).per_request:
            out.append((f"{group.name}.state", members))
        elif {"key", "value"} <= names:
            out.append((f"{group.name}.kv", members))
        else:
            out += [(f"{group.name}.{r.name}", [r]) for r in members]
    return out


def _follows_engine_block(backend: AttentionBackend, group: CacheGroup) -> bool:
    """Whether vLLM sizes ``group`` by its ``cache_config.block_size`` (``--block-size``)."""
    if isinstance(backend, VllmSpecBackend):
        return False
    if isinstance(backend, DeepseekV4Backend):  # its SWA (64) and state blocks are fixed
        return group.name == "compressed"
    return vllm_kind(group).follows_engine_block


def _where(backend: AttentionBackend, group: CacheGroup, roles: Sequence[CacheRole]) -> str:
    return f"{backend!r}: group {group.name!r}, role {'/'.join(r.name for r in roles)}"


def _padding(roles: Sequence[CacheRole], group: CacheGroup) -> int | None:
    device = sum(r.device_block_bytes(group) for r in roles)
    return device if device != sum(r.block_bytes(group) for r in roles) else None


def _kv_spec(
    backend: AttentionBackend, group: CacheGroup, roles: Sequence[CacheRole]
) -> KVCacheSpec:
    by_name = {r.name: r for r in roles}
    key, value = by_name["key"], by_name["value"]
    where = _where(backend, group, roles)
    extra = sorted(set(by_name) - {"key", "value", "key_scale", "value_scale"})
    if extra:
        raise ArgumentError(
            f"{where}: vLLM's attention spec holds key and value (and per-token-head scales) "
            f"only, not role {extra[0]!r}"
        )
    if (
        len(key.entry_shape) != 2
        or key.entry_shape[0] != value.entry_shape[0]
        or (key.dtype != value.dtype)
    ):
        raise ArgumentError(
            f"{where}: vLLM needs key and value of one dtype, each (num_kv_heads, head_size); "
            f"got key {key.entry_shape} {key.dtype}, value {value.entry_shape} {value.dtype}"
        )
    if len({r.compress_ratio for r in roles}) != 1:
        raise ArgumentError(f"{where}: vLLM needs one tokens_per_state for key and value")
    heads, head_size, head_size_v = key.entry_shape[0], key.entry_shape[1], value.entry_shape[-1]
    kwargs: dict[str, Any] = {
        "block_size": group.block_size,
        "num_kv_heads": heads,
        "head_size": head_size,
        "head_size_v": head_size_v,
        "dtype": key.torch_dtype,
        "kv_quant_mode": KVQuantMode.NONE,
    }
    scales = [by_name[n] for n in ("key_scale", "value_scale") if n in by_name]
    if scales:
        for scale in scales:
            if scale.dtype != "float32" or math.prod(scale.entry_shape) != heads:
                raise ArgumentError(
                    f"{where}: role {scale.name!r} is {scale.dtype} {scale.entry_shape}; vLLM's "
                    f"per-token-head scales are one float32 per kv head (fp8_per_token_head), "
                    "so only scale_dtype='float32' has a vLLM equivalent"
                )
        if len(scales) != 2 or key.itemsize != 1:
            raise ArgumentError(
                f"{where}: vLLM's fp8_per_token_head needs one-byte key / value and both "
                "key_scale and value_scale"
            )
        kwargs |= {
            "dtype": torch.uint8,
            "kv_quant_mode": KVQuantMode.FP8_PER_TOKEN_HEAD,
            "state_content_bytes": head_size + head_size_v + 2 * _SCALE_BYTES,
        }
    elif key.dtype in _FP8:
        kwargs |= {"dtype": torch.uint8, "kv_quant_mode": KVQuantMode.FP8_PER_TENSOR}
    ratio = key.compress_ratio
    if ratio != 1:
        kwargs["tokens_per_state"] = ratio
    padded = _padding(roles, group)
    if padded is not None:
        kwargs["page_size_padded"] = padded
    return vllm_kind(group).kv(group, where, **kwargs)


def _latent_spec(backend: AttentionBackend, group: CacheGroup, role: CacheRole) -> KVCacheSpec:
    """A single-vector cache (MLA family, DeepSeek-V4's caches and states)."""
    where = _where(backend, group, [role])
    kwargs: dict[str, Any] = {
        "block_size": group.block_size,
        "num_kv_heads": 1,
        "head_size": math.prod(role.entry_shape),
        "dtype": role.torch_dtype,
    }
    if role.dtype in _FP8:
        kwargs |= {
            "dtype": torch.uint8,
            "kv_quant_mode": KVQuantMode.FP8_PER_TENSOR,
            "cache_dtype_str": "fp8",
        }
    if role.compress_ratio != 1:
        kwargs["tokens_per_state"] = role.compress_ratio
    if role.block_alignment != 1:  # vLLM rounds the page up to `alignment` as kvforge does
        kwargs["alignment"] = role.block_alignment
    if isinstance(backend, MLABackend | DSABackend | DeepseekV4Backend):
        kwargs["max_tp_shards"] = 1
    if isinstance(backend, MLABackend) or (isinstance(backend, DSABackend) and role.name == "key"):
        kwargs.setdefault("cache_dtype_str", "auto")
    if isinstance(backend, DSABackend):
        if role.name == "indexer":
            kwargs["cache_role"] = SparseCacheRole.INDEXER
        elif backend.kv_cache_dtype == "fp8":
            kwargs |= _ds_mla(backend.kv_lora_rank + backend.qk_rope_head_dim, role)
    if isinstance(backend, DeepseekV4Backend) and role.name in ("swa_kv", "compressed_kv"):
        kwargs["model_version"] = "deepseek_v4"
        if backend.kv_cache_dtype == "fp8":
            kwargs |= _ds_mla(backend.head_dim, role)
        else:
            kwargs["cache_dtype_str"] = "bfloat16"
    return vllm_kind(group).latent(group, where, **kwargs)


def _ds_mla(head_size: int, role: CacheRole) -> dict[str, Any]:
    """vLLM's fp8_ds_mla fields: a packed entry of ``role.entry_bytes`` for ``head_size``."""
    return {
        "head_size": head_size,
        "dtype": torch.uint8,
        "kv_quant_mode": KVQuantMode.FP8_PER_TENSOR,
        "cache_dtype_str": "fp8_ds_mla",
        "state_content_bytes": role.entry_bytes,
    }


def _vllm_shape(backend: AttentionBackend, role: CacheRole) -> tuple[int, ...]:
    """A state role's shape as vLLM declares it. vLLM stores a Gated DeltaNet conv state state
    length first, channels innermost (its default "SD" layout: ``gated_delta_net_state_shape``
    and ``get_conv_state_layout`` in ``vllm/model_executor/layers/mamba/mamba_utils.py``);
    kvforge's ``conv_state`` role is ``[conv_dim, state_len]``: the same bytes, transposed."""
    if isinstance(backend, LinearAttentionBackend) and role.name == "conv_state":
        return tuple(reversed(role.entry_shape))
    return role.entry_shape


def _state_spec(
    backend: AttentionBackend,
    group: CacheGroup,
    roles: Sequence[CacheRole],
    block_size: int | None,
    mamba_cache_mode: str = "none",
) -> KVCacheSpec:
    if block_size is None:
        raise ArgumentError(
            f"{_where(backend, group, roles)}: vLLM's MambaSpec needs a token block size "
            "(its cache_config.mamba_block_size): pass mamba_block_size, or give the layout "
            "a max_model_len"
        )
    kwargs: dict[str, Any] = {
        "shapes": tuple(_vllm_shape(backend, r) for r in roles),
        "dtypes": tuple(r.torch_dtype for r in roles),
        "block_size": block_size,
        "num_speculative_blocks": group.slots_per_request - 1,
        "page_size_padded": _padding(roles, group),
        "mamba_cache_mode": mamba_cache_mode,
    }
    if isinstance(backend, LinearAttentionBackend):
        kwargs["mamba_type"] = MambaAttentionBackendEnum.GDN_ATTN
    elif isinstance(backend, Mamba2Backend) and _MAMBA_CHECKPOINT_FIELDS <= _MAMBA_SPEC_FIELDS:
        # vLLM's MambaMixer2.get_kv_cache_spec (vllm/model_executor/layers/mamba/
        # mamba_mixer2.py, 0.32 and 0.33) exports the block-boundary state from inside a
        # prefill: one checkpoint block per request, at any token position
        kwargs |= {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}
    return MambaSpec(**kwargs)


def _units(
    backends: Mapping[int, AttentionBackend] | CacheLayout,
    block_size: int | None,
    mamba_block_size: int | None,
    prefix: str,
    mamba_cache_mode: str = "none",
) -> list[_Unit]:
    layout = _layout(backends)
    if mamba_cache_mode not in _MAMBA_CACHE_MODES:
        raise ArgumentError(
            f"mamba_cache_mode must be one of {list(_MAMBA_CACHE_MODES)} (vLLM's "
            f"cache_config.mamba_cache_mode), got {mamba_cache_mode!r}"
        )
    if block_size is not None:
        block_size = check_int("block_size", block_size, minimum=1)
    if mamba_block_size is not None:
        mamba_block_size = check_int("mamba_block_size", mamba_block_size, minimum=1)
    else:
        mamba_block_size = layout.max_model_len
    if not isinstance(prefix, str):
        raise ArgumentError(f"prefix must be a str, got {prefix!r}")
    names = getattr(backends, "layer_names", None)
    kv_module = _KV_MODULES.get(str(getattr(backends, "model_type", None)), "self_attn.attn")
    units: list[_Unit] = []
    for layer in layout.layers:
        backend = layout.backends[layer]
        groups = backend.groups_by_name()
        modules = _modules(backend)
        if kv_module != "self_attn.attn":
            modules = [(kv_module if m == "self_attn.attn" else m, r) for m, r in modules]
        for module, roles in modules:
            group = groups[roles[0].group]
            if block_size is not None and _follows_engine_block(backend, group):
                try:
                    group = CacheGroup(**(group.model_dump() | {"block_size": block_size}))
                    for role in roles:
                        role.block_bytes(group)  # checks compress_ratio divides block_size
                except ValueError as exc:
                    raise ArgumentError(f"block_size={block_size}: {exc}") from None
            if isinstance(backend, VllmSpecBackend):
                spec = backend.spec
            elif vllm_kind(group).per_request:
                spec = _state_spec(backend, group, roles, mamba_block_size, mamba_cache_mode)
            elif {"key", "value"} <= {r.name for r in roles}:
                spec = _kv_spec(backend, group, roles)
            elif len(roles) == 1:
                spec = _latent_spec(backend, group, roles[0])
            else:  # pragma: no cover - _modules gives single roles otherwise
                raise ArgumentError(f"{_where(backend, group, roles)}: no vLLM equivalent")
            if names is not None and len(modules) == 1 and layer < len(names):
                name = names[layer]
            else:
                name = f"{prefix}{layer}.{module}"
            units.append(_Unit(name, layer, tuple(roles), group, spec))
    return units


def to_vllm_specs(
    backends: Mapping[int, AttentionBackend] | CacheLayout,
    block_size: int | None = None,
    *,
    mamba_block_size: int | None = None,
    prefix: str = "model.layers.",
    mamba_cache_mode: str = "none",
) -> dict[str, KVCacheSpec]:
    """vLLM's per-layer specs of a kvforge model (``{layer id: backend}`` or a layout).

    Args:
        backends: the model's declaration.
        block_size: vLLM's ``cache_config.block_size``. When given, it replaces the block size
            of every group vLLM sizes by it (full, sliding-window and chunked groups; of
            DeepSeek-V4 only ``compressed``, whose SWA and state pages are fixed): the specs
            are those of the declaration with that block size. ``None``: the declared sizes.
        mamba_block_size: the token block of a linear-attention or Mamba2 ``MambaSpec``
            (``cache_config.mamba_block_size``); default the layout's ``max_model_len``.
        prefix: what each layer name starts with (see the module for the names).
        mamba_cache_mode: vLLM's ``cache_config.mamba_cache_mode`` (``"none"``, or
            ``"align"`` with prefix caching), carried by every ``MambaSpec``. Page padding
            and the block sizes vLLM picks for a hybrid model:
            :func:`~kvforge.integrations.vllm.hybrid_sizes.vllm_hybrid_sizes`.

    Returns:
        ``{vLLM layer name: spec}``, layer-major; each spec's ``page_size_bytes`` equals the
        kvforge device block bytes of the roles behind it, ``real_page_size_bytes`` their
        meaningful bytes (:func:`layer_page_bytes`).

    Raises:
        ArgumentError: a declaration vLLM cannot express, naming group, role and why; a
            ``block_size`` a role's compress ratio does not divide; bad backends.
    """
    units = _units(backends, block_size, mamba_block_size, prefix, mamba_cache_mode)
    return {u.name: u.spec for u in units}


def layer_page_bytes(
    backends: Mapping[int, AttentionBackend] | CacheLayout,
    block_size: int | None = None,
    *,
    mamba_block_size: int | None = None,
    prefix: str = "model.layers.",
    mamba_cache_mode: str = "none",
) -> dict[str, tuple[int, int]]:
    """kvforge's side of :func:`to_vllm_specs`: per vLLM layer name, ``(device bytes,
    meaningful bytes)`` of one block of the roles behind it (vLLM's ``page_size_bytes`` and
    ``real_page_size_bytes``). Same arguments, same errors."""
    return {
        u.name: (
            sum(r.device_block_bytes(u.group) for r in u.roles),
            sum(r.block_bytes(u.group) for r in u.roles),
        )
        for u in _units(backends, block_size, mamba_block_size, prefix, mamba_cache_mode)
    }


# ---------------------------------------------------------------------------- vLLM -> kvforge


def _native(spec: KVCacheSpec, group: str) -> AttentionBackend | None:
    """A :class:`GQABackend` where one declares exactly this plain K/V spec."""
    if type(spec) not in (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec):
        return None
    assert isinstance(spec, AttentionSpec)
    if (
        spec.page_size_padded is not None
        or spec.num_head_slots is not None
        or spec.tokens_per_state != 1
        or spec.block_stride_alignment is not None
        or getattr(spec, "extra_retained_tokens", 0)
    ):
        return None
    mode, itemsize = spec.kv_quant_mode, torch.empty(0, dtype=spec.dtype).element_size()
    kwargs: dict[str, Any] = {}
    if (
        mode is KVQuantMode.NONE
        and spec.state_content_bytes is None
        and spec.dtype.is_floating_point
    ):
        kwargs["dtype"] = canonical_dtype(spec.dtype)
    elif mode is KVQuantMode.FP8_PER_TENSOR and spec.state_content_bytes is None and itemsize == 1:
        kwargs["kv_cache_quant"] = "fp8"
    elif (
        mode is KVQuantMode.FP8_PER_TOKEN_HEAD
        and itemsize == 1
        and spec.state_content_bytes == spec.head_size + spec.head_size_v + 2 * _SCALE_BYTES
    ):
        kwargs["kv_cache_quant"] = "block_wise_fp8"
    else:
        return None
    if isinstance(spec, SlidingWindowSpec):
        kwargs["sliding_window"] = spec.sliding_window
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        kwargs["attention_chunk_size"] = spec.attention_chunk_size
    if spec.head_size_v != spec.head_size:  # key and value widths differ (MiMo-V2-Flash)
        kwargs["head_dim_v"] = spec.head_size_v
    backend = GQABackend(spec.num_kv_heads, spec.head_size, spec.block_size, group=group, **kwargs)
    if to_vllm_specs({0: backend})["model.layers.0.self_attn.attn"] != spec:
        return None  # a field GQABackend does not carry: keep the spec itself
    return backend


class VllmSpecBackends(dict[int, AttentionBackend]):
    """``{kvforge layer id: backend}`` from :func:`from_vllm_specs`; layer ``i`` is vLLM's
    ``layer_names[i]`` and ``specs[i]`` its spec."""

    def __init__(
        self,
        backends: Mapping[int, AttentionBackend],
        layer_names: Sequence[str],
        specs: Sequence[KVCacheSpec],
    ) -> None:
        super().__init__(backends)
        self.layer_names: tuple[str, ...] = tuple(layer_names)
        self.specs: tuple[KVCacheSpec, ...] = tuple(specs)
        self.max_model_len: int | None = None


def from_vllm_specs(specs: Mapping[str, KVCacheSpec]) -> VllmSpecBackends:
    """kvforge backends for a vLLM model's per-layer specs (``{layer name: spec}``, what
    ``model_runner.get_kv_cache_spec()`` returns).

    Layer ``i`` of the result is the ``i``-th name of ``specs``. Layers whose specs are equal
    share one backend and one group, as vLLM groups them; groups are named by spec type
    (``full``, ``swa``, ``chunked``, ``mla``, ``swa_mla``, ``mamba``), ``_1``, ``_2``, ... for
    further distinct specs of a type. A plain K/V spec becomes a :class:`GQABackend`, any other
    a :class:`VllmSpecBackend`. Per layer, the kvforge device block bytes equal the spec's
    ``page_size_bytes`` and the meaningful bytes its ``real_page_size_bytes``.

    Raises:
        ArgumentError: ``specs`` is not a non-empty mapping of str to a spec; a layer's spec
            type is not one of :data:`SUPPORTED_SPECS` (naming the layer and the type); a
            spec kvforge cannot declare (fractional ``tokens_per_state``, a dtype kvforge does
            not store), naming the layer.
    """
    if not isinstance(specs, Mapping):
        raise ArgumentError(
            f"specs must be a mapping of vLLM layer name -> KVCacheSpec, got {type(specs).__name__}"
        )
    if not specs:
        raise ArgumentError("specs is empty: give at least one vLLM layer name -> KVCacheSpec")
    distinct: list[tuple[KVCacheSpec, AttentionBackend]] = []
    used: dict[str, int] = {}
    backends: dict[int, AttentionBackend] = {}
    for layer, (name, spec) in enumerate(specs.items()):
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"vLLM layer names must be non-empty strs, got {name!r}")
        if isinstance(spec, UniformTypeKVCacheSpecs):
            raise ArgumentError(
                f"layer {name!r}: a UniformTypeKVCacheSpecs holds a whole group's specs; pass "
                "the per-layer specs it holds (its kv_cache_specs)"
            )
        if type(spec) not in SUPPORTED_SPECS:
            what = type(spec).__name__
            raise ArgumentError(
                f"layer {name!r}: kvforge cannot plan a {what}"
                + ("" if isinstance(spec, KVCacheSpec) else " (not a vLLM KVCacheSpec)")
                + f"; it plans {', '.join(t.__name__ for t in SUPPORTED_SPECS)}"
            )
        backend = next((b for s, b in distinct if s == spec and type(s) is type(spec)), None)
        if backend is None:
            label = SUPPORTED_SPECS[type(spec)]
            n = used.get(label, 0)
            used[label] = n + 1
            group = label if n == 0 else f"{label}_{n}"
            try:
                backend = _native(spec, group)
            except ValueError:  # not a plain K/V spec after all: keep the spec itself
                backend = None
            backend = backend or VllmSpecBackend(spec, group, name)
            distinct.append((spec, backend))
        backends[layer] = backend
    return VllmSpecBackends(backends, list(specs), list(specs.values()))
