"""Cache-relevant fields of published Hugging Face ``config.json`` files, shipped as package data.

Load one with :func:`kvforge.models.load_model_config` (by name, e.g.
``"deepseek-v4-flash"``) or build its backends with :func:`kvforge.models.from_hf_config`;
:func:`kvforge.models.bundled_models` lists the names. They ship in the wheel as package data
(``tests/cli/test_wheel.py`` checks every one is there). ``examples/configs`` is a link to
this directory.

Each file keeps only ``architectures``, ``model_type``, ``torch_dtype``, ``num_hidden_layers``
and the fields that size caches, with the numbers of the published config (no weights, no
tokenizer, no MoE routing fields):

==========================  ===================================================================
file                        source
==========================  ===================================================================
``llama-3-8b``              ``meta-llama/Meta-Llama-3-8B`` (no ``head_dim``: 4096 // 32 = 128)
``mistral-7b-v0.1``         ``mistralai/Mistral-7B-v0.1`` (``sliding_window`` 4096, all layers)
``qwen2.5-7b``              ``Qwen/Qwen2.5-7B`` (``sliding_window`` set but
                            ``use_sliding_window`` false: full attention)
``qwen3-8b``                ``Qwen/Qwen3-8B``
``deepseek-v2-lite``        ``deepseek-ai/DeepSeek-V2-Lite`` (MLA, 27 layers, no MTP)
``deepseek-v3``             ``deepseek-ai/DeepSeek-V3`` (MLA, 61 layers + 1 MTP layer)
``deepseek-v3.2``           ``deepseek-ai/DeepSeek-V3.2`` (DSA: V3 + indexer, 61 + 1 MTP)
``deepseek-v4-flash``       ``deepseek-ai/DeepSeek-V4-Flash`` (43 layers + 1 MTP layer;
                            ``compress_ratios`` = [0, 0] + [4, 128] * 20 + [4] + [0 for MTP])
``deepseek-v4-tiny``        not a published model: a 6-layer demo with V4-Flash's per-layer
                            dims, ratios [0, 0, 4, 128, 4, 128] and one MTP layer of ratio 0
``gemma-2-9b``              ``google/gemma-2-9b`` (42 layers, even layers slide over 4096
                            tokens; ``torch_dtype`` float32 as published)
``gemma-3-12b``             ``google/gemma-3-12b-it`` (``text_config``: 48 layers, window 1024;
                            as published, no ``head_dim`` and no pattern: the
                            ``Gemma3TextConfig`` defaults, 256 and every 6th layer global)
``gemma-3-4b``              ``google/gemma-3-4b-it`` (``text_config`` states only 34 layers,
                            ``hidden_size`` and window 1024: heads, kv heads and ``head_dim``
                            are the class defaults 8, 4 and 256)
``glm-4.5-air``             ``zai-org/GLM-4.5-Air`` (GQA, 46 layers + 1 MTP layer,
                            ``head_dim`` 128)
``gpt-oss-20b``             ``openai/gpt-oss-20b`` (24 layers, ``layer_types`` alternating
                            sliding window 128 and full from layer 0)
``llama-4-scout-17b-16e``   ``meta-llama/Llama-4-Scout-17B-16E`` (``text_config``: 48 layers,
                            chunked attention of 8192 tokens except every 4th layer)
``qwen3-next-80b-a3b``      ``Qwen/Qwen3-Next-80B-A3B-Instruct`` (48 layers: every 4th full
                            attention, the others Gated DeltaNet linear attention)
``falcon-h1-7b``            ``tiiuae/Falcon-H1-7B-Instruct`` (44 layers, each attention (2 kv
                            heads of 128) beside a Mamba2 mixer: 24 heads of 128, state 256)
``nemotron-nano-9b-v2``     ``nvidia/NVIDIA-Nemotron-Nano-9B-v2`` (``hybrid_override_pattern``
                            of 56: 27 Mamba2 mixers, 4 attention layers of 8 kv heads)
``granite-4.0-h-small``     ``ibm-granite/granite-4.0-h-small`` (40 layers: attention at 5,
                            15, 25, 35, the others Mamba2 mixers of 128 heads of 64)
``phi-4``                   ``microsoft/phi-4`` (``phi3``: 40 layers, 10 kv heads of 128,
                            ``sliding_window`` null)
``olmo-2-1124-7b``          ``allenai/OLMo-2-1124-7B`` (32 layers, 32 kv heads of 128,
                            ``torch_dtype`` float32 as published)
``minimax-m2``              ``MiniMaxAI/MiniMax-M2`` (62 layers, 8 kv heads of 128; its 3 MTP
                            modules are no cache layers in vLLM)
``mistral-small-3.1-24b``   ``mistralai/Mistral-Small-3.1-24B-Instruct-2503`` (``mistral3``,
                            ``text_config``: 40 layers, ``sliding_window`` null)
``qwen2.5-vl-7b``           ``Qwen/Qwen2.5-VL-7B-Instruct`` (top-level fields: 28 layers,
                            ``use_sliding_window`` false)
``qwen3-vl-8b``             ``Qwen/Qwen3-VL-8B-Instruct`` (``text_config``: 36 layers)
``qwen3-vl-30b-a3b``        ``Qwen/Qwen3-VL-30B-A3B-Instruct`` (``text_config``: 48 layers)
``qwen3.5-27b``             ``Qwen/Qwen3.5-27B`` (``text_config``: 64 layers, every 4th full
                            attention, ``mamba_ssm_dtype`` float32, 1 MTP layer)
``qwen3.5-35b-a3b``         ``Qwen/Qwen3.5-35B-A3B`` (``text_config``: 40 layers, every 4th
                            full attention, 1 MTP layer)
``step-3.5-flash``          ``stepfun-ai/Step-3.5-Flash`` (45 layers + 3 MTP layers padding
                            ``layer_types``: full every 4th from layer 0, the others a
                            512-token window; 8 ``num_attention_groups``)
``glm-4.7-flash``           ``zai-org/GLM-4.7-Flash`` (``glm4_moe_lite``: MLA, 47 layers + 1
                            MTP layer, ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64)
``glm-5``                   ``zai-org/GLM-5`` (``glm_moe_dsa``: DSA, 78 layers + 1 MTP layer,
                            indexer ``index_head_dim`` 128, no shared-index schedule)
``kimi-k2.5``               ``moonshotai/Kimi-K2.5`` (``kimi_k25``, ``text_config`` of type
                            ``kimi_k2``: DeepSeek-V3's MLA, 61 layers, no MTP layer)
==========================  ===================================================================

Configs whose layers differ in shape (:mod:`kvforge.models.per_layer`):
``llama-3.3-nemotron-super-49b`` (``nvidia/Llama-3_3-Nemotron-Super-49B-v1``, ``nemotron-nas``:
80 blocks, 31 with ``no_op`` attention, the others 64 // 8 = 8 kv heads of 128; only the
attention part of ``block_configs``), ``mimo-v2-flash`` (``XiaomiMiMo/MiMo-V2-Flash``: 48
layers, full on layer 0 and every sixth with 4 kv heads, the others a 128-token window
with 8; keys 192 and values 128 wide), ``gemma-4-31b`` (``google/gemma-4-31B-it``,
``text_config``: 60 layers, window 1024 with 16 kv heads of 256, every sixth full with 4
of 512, ``attention_k_eq_v``) and ``gemma-3n-e4b`` (``google/gemma-3n-E4B-it``,
``text_config``: 35 layers, every fifth full, window 512, 2 kv heads of 256, the last 15
layers share the cache of layers 18 and 19).

MTP layers are cache layers only with ``num_speculative_tokens`` (see
:func:`kvforge.attn_backends.from_hf_config`). ``docs/models.md`` gives the source of every
figure of the non-DeepSeek configs.
"""
