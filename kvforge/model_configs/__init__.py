"""Cache-relevant fields of published Hugging Face ``config.json`` files, shipped as package data.

Load one with :func:`kvforge.attn_backends.load_model_config` (by name, e.g.
``"deepseek-v4-flash"``) or build its backends with :func:`kvforge.attn_backends.from_hf_config`;
:func:`kvforge.attn_backends.bundled_models` lists the names. ``examples/configs`` is a link to
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
==========================  ===================================================================
"""
