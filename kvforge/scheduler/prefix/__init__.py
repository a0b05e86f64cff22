"""The prefix cache of the scheduler side, split by concern. One piece per module:

- :mod:`.cache`: :class:`PrefixCache`, the one public class, composed of the parts below;
- :mod:`.index`: key <-> block of every group, waiting copies, events, the eviction hook;
- :mod:`.lookup`: the longest reusable prefix of a prompt on the device, checked exactly;
- :mod:`.seal`: the seal on every match a cache makes, checked before adoption;
- :mod:`.adopt`: sharing a match into a new request's row, and undoing it;
- :mod:`.commit`: choosing, keying and pinning what a step completes, registering it when the
  step ends;
- :mod:`.chains`: the requests' key chains and the unit records they hold;
- :mod:`.records`: the plain records (settings, counters, entries, a step's work);
- :mod:`.retention`: which completed window and state blocks are kept (``prefix_retention``);
- :mod:`.host_lookup`: lookups that bring back from the host tier what only it holds
  (:class:`PromptPlan`, shared with the remote tier).

The unit records behind the keys stay in :mod:`kvforge.scheduler.unit_records` (the host
tier's pages hold references on them too). Nothing here takes a lock:
:class:`~kvforge.scheduler.block_manager.BlockManager` calls in under its own.
"""

from kvforge.scheduler.prefix.cache import PrefixCache
from kvforge.scheduler.prefix.host_lookup import PromptPlan
from kvforge.scheduler.prefix.records import PrefixStats, StepWork
from kvforge.scheduler.prefix.retention import (
    DEFAULT_PREFIX_RETENTION,
    PREFIX_RETENTIONS,
    Retention,
    check_prefix_retention,
    checkpoints_of,
)

__all__ = [
    "DEFAULT_PREFIX_RETENTION",
    "PREFIX_RETENTIONS",
    "PrefixCache",
    "PrefixStats",
    "PromptPlan",
    "Retention",
    "StepWork",
    "check_prefix_retention",
    "checkpoints_of",
]
