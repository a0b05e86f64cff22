"""Engine integrations: kvforge's pieces wired into an engine's own plug-in points.

- :mod:`kvforge.integrations.vllm`: an offloading backend for vLLM 0.33 (and vllm-ascend,
  which keeps vLLM's offloading spec factory), per-group compact host pages on kvforge's host
  tier; needs the optional extra ``vllm``.

Nothing here is imported by ``import kvforge``: each integration imports its engine.
"""
