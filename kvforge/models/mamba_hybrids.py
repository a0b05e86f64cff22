"""Builders of the Mamba2 hybrids: Falcon-H1, Nemotron-H and Granite-4.0-H.

Their attention layers cache keys and values as any GQA model (:class:`GQABackend`, group
``kv``, built by :func:`~kvforge.models.families.build_gqa` from the attention fields); their
Mamba2 mixers keep a conv and an SSM state per request (:class:`Mamba2Backend`, group
``mamba_state``). They differ in where the mixers sit:

- ``falcon_h1``: every decoder layer runs attention **and** a mixer in parallel. vLLM keeps
  them as two cache layers: layer ``i``'s attention and, as ``model.{N + i}.mixer``, its
  mixer (``FalconH1ParallelHybrid`` in ``vllm/model_executor/models/falcon_h1.py``: "all
  attention/ssm layers must have different index", ``ssm_layer_idx = num_hidden_layers +
  layer_idx``). kvforge numbers them the same way: attention ``0 .. N-1``, mixers
  ``N .. 2N-1``;
- ``nemotron_h``: ``hybrid_override_pattern`` (``M`` mixer, ``*`` attention, ``-`` MLP,
  ``E`` MoE), or the list ``layers_block_type`` of newer saves (``linear_attention`` /
  ``mamba``, ``full_attention`` / ``attention``, ``mlp``, ``moe``); layer ``i`` is the
  pattern's ``i``-th entry and only ``M`` / ``*`` entries are cache layers (``NemotronHModel``
  in ``vllm/model_executor/models/nemotron_h.py``);
- ``granitemoehybrid``: ``layer_types`` (alias ``layers_block_type``) of ``mamba`` /
  ``linear_attention`` and ``attention`` / ``full_attention`` entries, all mixers when absent
  (``GraniteMoeHybridConfig``).

Fields a config leaves out take the defaults of the ``transformers`` 5.x configuration class
that the engines load it through (``configuration_falcon_h1.py``,
``configuration_nemotron_h.py``, ``configuration_granitemoehybrid.py``); the state shapes are
those of each vLLM model's ``get_mamba_state_shape_from_config``:

============  ==========================  =============================================
model_type    mixer width (conv ``x``)     attention head_dim
============  ==========================  =============================================
falcon_h1     ``mamba_d_ssm`` (null:       ``head_dim``, else ``hidden_size //
              ``mamba_expand * hidden``)   num_attention_heads``
nemotron_h    ``mamba_num_heads *          ``head_dim`` (class default 128)
              mamba_head_dim``
granite...    ``mamba_expand * hidden``    ``hidden_size // num_attention_heads`` always
============  ==========================  =============================================

State dtypes, as vLLM resolves them: the conv state takes ``mamba_cache_dtype`` (``"auto"``:
the model dtype), the SSM state ``mamba_ssm_cache_dtype``, whose ``"auto"`` is the conv
state's dtype for Falcon-H1 and Granite (``MambaStateDtypeCalculator.mamba2_state_dtype``)
and, for Nemotron-H, the config's ``mamba_ssm_cache_dtype`` or float32
(``NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype`` in
``vllm/model_executor/models/config.py``: "Only float32 is known to have no accuracy issues").
``kv_cache_dtype`` applies to the attention layers only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, StrictStr

from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.mamba import Mamba2Backend
from kvforge.models.base import (
    LayerFields,
    ModelOptions,
    PositiveInt,
    parse_fields,
    short_repr,
)
from kvforge.models.families import build_gqa
from kvforge.models.reading import model_dtype
from kvforge.specs import canonical_dtype

__all__ = [
    "FalconH1Fields",
    "GraniteHybridFields",
    "NemotronHFields",
    "build_falcon_h1",
    "build_granite_hybrid",
    "build_nemotron_h",
    "mamba_state_dtypes",
]

_Kernel = Annotated[StrictInt, Field(ge=2)]
_Auto = PositiveInt | Literal["auto"]

MAMBA_ENTRIES = ("M", "mamba", "linear_attention", "mamba2")
ATTENTION_ENTRIES = ("*", "attention", "full_attention")
OTHER_ENTRIES = ("-", "E", "mlp", "moe")


class _AttentionFields(LayerFields):
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None
    hidden_size: PositiveInt
    head_dim: PositiveInt | None = None


class FalconH1Fields(_AttentionFields):
    """Falcon-H1's cache fields, with ``FalconH1Config``'s defaults."""

    num_hidden_layers: Annotated[StrictInt, Field(gt=0, le=2048)]
    num_key_value_heads: PositiveInt | None = 8
    mamba_d_ssm: PositiveInt = 1024
    mamba_n_heads: PositiveInt = 128
    mamba_d_head: _Auto = "auto"
    mamba_n_groups: PositiveInt = 1
    mamba_d_state: PositiveInt = 256
    mamba_d_conv: _Kernel = 4
    mamba_expand: PositiveInt = 2


class NemotronHFields(_AttentionFields):
    """Nemotron-H's cache fields, with ``NemotronHConfig``'s defaults (the pattern, not
    ``num_hidden_layers``, gives the layer count)."""

    num_hidden_layers: PositiveInt | None = None  # type: ignore[assignment]
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt | None = 8
    hidden_size: PositiveInt = 4096
    head_dim: PositiveInt | None = 128
    hybrid_override_pattern: StrictStr | None = None
    layers_block_type: list[StrictStr] | None = None
    mamba_num_heads: PositiveInt = 128
    mamba_head_dim: PositiveInt = 64
    ssm_state_size: PositiveInt = 128
    n_groups: PositiveInt = 8
    conv_kernel: _Kernel = 4
    mamba_ssm_cache_dtype: StrictStr = "float32"


class GraniteHybridFields(_AttentionFields):
    """Granite-4.0-H's cache fields, with ``GraniteMoeHybridConfig``'s defaults."""

    layer_types: list[StrictStr] | None = None
    layers_block_type: list[StrictStr] | None = None
    mamba_n_heads: PositiveInt = 128
    mamba_n_groups: PositiveInt = 1
    mamba_d_state: PositiveInt = 256
    mamba_d_head: _Auto = "auto"
    mamba_d_conv: _Kernel = 4
    mamba_expand: PositiveInt = 2


# ---------------------------------------------------------------------------------- shared


def mamba_state_dtypes(
    config: Mapping[str, Any], model_type: str, options: ModelOptions, ssm_auto: str | None = None
) -> tuple[str, str]:
    """``(conv dtype, ssm dtype)`` as vLLM resolves ``mamba_cache_dtype`` and
    ``mamba_ssm_cache_dtype``; ``ssm_auto`` is what the family makes of an ``"auto"`` SSM
    dtype (``None``: the conv state's dtype)."""
    conv = options.mamba_cache_dtype
    conv = model_dtype(config, options.dtype, model_type) if conv in (None, "auto") else conv
    ssm = options.mamba_ssm_cache_dtype
    if ssm in (None, "auto"):
        ssm = conv if ssm_auto in (None, "auto") else ssm_auto
    try:
        return canonical_dtype(conv), canonical_dtype(ssm)
    except ValueError as exc:
        raise ValueError(
            f"config field mamba_ssm_cache_dtype = {short_repr(ssm)} is invalid for model_type "
            f"{model_type!r}: {exc}"
        ) from None


def _attention(
    config: Mapping[str, Any], model_type: str, options: ModelOptions, **fields: Any
) -> AttentionBackend:
    """The GQA backend of the attention layers: :func:`build_gqa` of one layer with the
    family's resolved head fields (``None`` drops a field: ``hidden // heads``)."""
    one = {**config, "num_hidden_layers": 1, "layer_types": None, "sliding_window": None}
    one.update(fields)
    one["num_nextn_predict_layers"] = 0
    return build_gqa(one, model_type, options.model_copy(update={"num_speculative_tokens": 0}))[0]


def _mixer(
    config: Mapping[str, Any],
    model_type: str,
    options: ModelOptions,
    ssm_auto: str | None = None,
    **shape: Any,
) -> Mamba2Backend:
    conv, ssm = mamba_state_dtypes(config, model_type, options, ssm_auto)
    try:
        return Mamba2Backend(
            **shape,
            tp_size=options.tp_size,
            conv_dtype=conv,
            ssm_dtype=ssm,
            num_speculative_tokens=options.num_speculative_tokens,
        )
    except ValueError as exc:
        raise ValueError(f"{exc} (model_type {model_type!r})") from None


def _auto_head(value: int | str, inner: int, heads: int, name: str, model_type: str) -> int:
    """``mamba_d_head``: ``"auto"`` is ``inner // heads`` (the class's ``__post_init__``)."""
    if value != "auto":
        return int(value)
    if inner % heads:
        raise ValueError(
            f"config field {name} = 'auto' cannot be derived for model_type {model_type!r}: "
            f"the mixer width {inner} is not divisible by {heads} heads"
        )
    return inner // heads


def _no_mtp(options: ModelOptions, model_type: str) -> None:
    options.refuse(
        model_type,
        "num_speculative_tokens",
        why="kvforge plans no MTP / draft layers for this family yet",
    )


def _kinds(entries: Sequence[str], field: str, model_type: str) -> list[str]:
    """Each entry as ``"mamba"``, ``"attention"`` or ``"none"`` (errors name the entry)."""
    kinds: list[str] = []
    for i, entry in enumerate(entries):
        if entry in MAMBA_ENTRIES:
            kinds.append("mamba")
        elif entry in ATTENTION_ENTRIES:
            kinds.append("attention")
        elif entry in OTHER_ENTRIES:
            kinds.append("none")
        else:
            allowed = [*MAMBA_ENTRIES, *ATTENTION_ENTRIES, *OTHER_ENTRIES]
            raise ValueError(
                f"config field {field}[{i}] = {short_repr(entry)} is invalid for model_type "
                f"{model_type!r}: not one of {allowed}"
            )
    return kinds


def _by_kind(
    kinds: Sequence[str], attention: AttentionBackend | None, mixer: Mamba2Backend | None
) -> dict[int, AttentionBackend]:
    backends: dict[int, AttentionBackend] = {}
    for i, kind in enumerate(kinds):
        if kind == "attention" and attention is not None:
            backends[i] = attention
        elif kind == "mamba" and mixer is not None:
            backends[i] = mixer
    return backends


# ---------------------------------------------------------------------------------- families


def build_falcon_h1(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """Falcon-H1: layer ``i``'s attention is cache layer ``i`` (group ``kv``), its parallel
    Mamba2 mixer cache layer ``num_hidden_layers + i`` (group ``mamba_state``)."""
    _no_mtp(options, model_type)
    f = parse_fields(FalconH1Fields, config, model_type)
    # FalconH1Config: an absent mamba_d_ssm is 1024, a null one means expand * hidden
    explicit_null = "mamba_d_ssm" in config and config["mamba_d_ssm"] is None
    inner = f.mamba_expand * f.hidden_size if explicit_null else f.mamba_d_ssm
    attention = _attention(
        config,
        model_type,
        options,
        num_key_value_heads=f.num_key_value_heads,
        head_dim=f.head_dim,
    )
    mixer = _mixer(
        config,
        model_type,
        options,
        num_heads=f.mamba_n_heads,
        head_dim=_auto_head(f.mamba_d_head, inner, f.mamba_n_heads, "mamba_d_head", model_type),
        state_size=f.mamba_d_state,
        conv_kernel_size=f.mamba_d_conv,
        n_groups=f.mamba_n_groups,
        intermediate_size=inner,
    )
    n = f.num_hidden_layers
    backends: dict[int, AttentionBackend] = dict.fromkeys(range(n), attention)
    backends.update(dict.fromkeys(range(n, 2 * n), mixer))
    return backends


def _nemotron_kinds(f: NemotronHFields, model_type: str) -> list[str]:
    if f.layers_block_type is not None:
        kinds = _kinds(f.layers_block_type, "layers_block_type", model_type)
    elif f.hybrid_override_pattern is not None:
        kinds = _kinds(list(f.hybrid_override_pattern), "hybrid_override_pattern", model_type)
    else:
        raise ValueError(
            f"config is missing 'hybrid_override_pattern' (needed for model_type "
            f"{model_type!r}, or 'layers_block_type')"
        )
    if not kinds or len(kinds) > 4096:
        raise ValueError(
            f"config field hybrid_override_pattern has {len(kinds)} layers for model_type "
            f"{model_type!r}; a model has 1 to 4096"
        )
    return kinds


def build_nemotron_h(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """Nemotron-H: layer ``i`` is the pattern's ``i``-th entry; ``M`` entries get a
    :class:`Mamba2Backend`, ``*`` entries a :class:`GQABackend`, MLP / MoE entries no cache."""
    _no_mtp(options, model_type)
    f = parse_fields(NemotronHFields, config, model_type)
    kinds = _nemotron_kinds(f, model_type)
    attention = None
    if "attention" in kinds:
        attention = _attention(
            config,
            model_type,
            options,
            num_attention_heads=f.num_attention_heads,
            num_key_value_heads=f.num_key_value_heads,
            hidden_size=f.hidden_size,
            head_dim=f.head_dim,
        )
    mixer = None
    if "mamba" in kinds:
        mixer = _mixer(
            config,
            model_type,
            options,
            ssm_auto=f.mamba_ssm_cache_dtype,
            num_heads=f.mamba_num_heads,
            head_dim=f.mamba_head_dim,
            state_size=f.ssm_state_size,
            conv_kernel_size=f.conv_kernel,
            n_groups=f.n_groups,
        )
    backends = _by_kind(kinds, attention, mixer)
    if not backends:
        raise ValueError(
            f"config field hybrid_override_pattern has no 'M' or '*' layer for model_type "
            f"{model_type!r}: the model caches nothing"
        )
    return backends


def build_granite_hybrid(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """Granite-4.0-H: ``layer_types`` picks a :class:`Mamba2Backend` (``mamba``) or a
    :class:`GQABackend` (``attention``, head_dim ``hidden_size // num_attention_heads`` as
    vLLM's ``GraniteMoeHybridAttention`` has it) per layer."""
    _no_mtp(options, model_type)
    f = parse_fields(GraniteHybridFields, config, model_type)
    n = f.num_hidden_layers
    entries = f.layer_types if f.layer_types is not None else f.layers_block_type
    field = "layer_types" if f.layer_types is not None else "layers_block_type"
    kinds = ["mamba"] * n if entries is None else _kinds(entries, field, model_type)
    if len(kinds) != n or "none" in kinds:
        raise ValueError(
            f"config field {field} = {short_repr(entries)} is invalid for model_type "
            f"{model_type!r}: it needs one 'mamba' or 'attention' entry per layer "
            f"(num_hidden_layers={n})"
        )
    attention = None
    if "attention" in kinds:
        attention = _attention(config, model_type, options, head_dim=None)
    inner = f.mamba_expand * f.hidden_size
    mixer = None
    if "mamba" in kinds:
        mixer = _mixer(
            config,
            model_type,
            options,
            num_heads=f.mamba_n_heads,
            head_dim=_auto_head(f.mamba_d_head, inner, f.mamba_n_heads, "mamba_d_head", model_type),
            state_size=f.mamba_d_state,
            conv_kernel_size=f.mamba_d_conv,
            n_groups=f.mamba_n_groups,
            intermediate_size=inner,
        )
    return _by_kind(kinds, attention, mixer)
