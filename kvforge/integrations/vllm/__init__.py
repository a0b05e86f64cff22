"""kvforge inside vLLM 0.32 and 0.33 (and vllm-ascend, which keeps vLLM's offloading connector
and spec factory): an offloading backend whose host pages are kvforge's per-group compact pages.

- :class:`KVForgeConnector` (:mod:`.connector`): the connector to name in
  ``--kv-transfer-config`` (``"kv_connector": "KVForgeConnector"``,
  ``"kv_connector_module_path": "kvforge.integrations.vllm"``).
- :class:`KVForgeOffloadingSpec` (:mod:`.spec`), its manager (:mod:`.manager`, on kvforge's
  host tier) and worker (:mod:`.worker`, kvforge's gather/scatter).
- :func:`model_identity` (:mod:`.identity`): the engine's :class:`~kvforge.ModelIdentity`
  from its ``VllmConfig`` (also ``KVForgeConnector.model_identity``), for a remote tier.
- :class:`KVForgeOffloadOptions` (:mod:`.config`): the ``"kvforge"`` object of
  ``kv_connector_extra_config``.
- :func:`to_vllm_specs` / :func:`from_vllm_specs` (:mod:`.specs`): kvforge backends described
  to vLLM as ``KVCacheSpec``s, and a vLLM model's specs as kvforge backends
  (``kvforge plan --vllm-specs``), bytes per block equal both ways.

Importing this package imports vLLM (install the extra: ``pip install 'kvforge[vllm]'``, or on
CPU the recipe in docs/integrations/vllm.md). Guide: docs/integrations/vllm.md.
"""

from kvforge.integrations.vllm.config import KVForgeOffloadOptions
from kvforge.integrations.vllm.connector import KVForgeConnector
from kvforge.integrations.vllm.identity import model_identity
from kvforge.integrations.vllm.manager import KVForgeOffloadingManager
from kvforge.integrations.vllm.pages import HostPagePlan, plan_host_pages
from kvforge.integrations.vllm.spec import KVForgeOffloadingSpec
from kvforge.integrations.vllm.specs import (
    VllmSpecBackend,
    VllmSpecBackends,
    dump_vllm_specs,
    from_vllm_specs,
    layer_page_bytes,
    load_vllm_specs,
    to_vllm_specs,
)
from kvforge.integrations.vllm.worker import KVForgeOffloadingWorker

__all__ = [
    "HostPagePlan",
    "KVForgeConnector",
    "KVForgeOffloadOptions",
    "KVForgeOffloadingManager",
    "KVForgeOffloadingSpec",
    "KVForgeOffloadingWorker",
    "VllmSpecBackend",
    "VllmSpecBackends",
    "dump_vllm_specs",
    "from_vllm_specs",
    "layer_page_bytes",
    "load_vllm_specs",
    "model_identity",
    "plan_host_pages",
    "to_vllm_specs",
]
