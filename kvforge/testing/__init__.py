"""Conformance kit for backend authors: ``check_backend`` runs every check in one call.

An author of an attention backend calls :func:`check_backend` from their own test suite::

    from kvforge.testing import check_backend

    def test_my_backend():
        report = check_backend(MyBackend(...))
        assert report.check("swap_round_trip").entries > 0

It builds a :class:`~kvforge.CacheController` over the backend (or a ``layer -> backend``
mapping) and runs, in order, the checks named in :data:`CHECKS`:

- ``declaration``: ``validate()`` passes, ``cache_roles()`` / ``cache_groups()`` return the same
  lists on every call, role names are unique, every role's group is declared, and the
  controller accepts the declarations together;
- ``bytes``: every tensor ``create_kv_cache`` returns (called directly, then through the
  controller's ``initialize_kv_cache(num_blocks=...)``) belongs to a declared role, has the
  declared dtype and device, ``num_blocks`` blocks in dim 0, exactly the declared shape, and a
  block that is one run of ``role.block_bytes(group)`` bytes;
- ``naming_and_order``: the cache list is layer-major and follows ``cache_roles()`` in each
  layer, ``index_of`` and ``get`` agree with it, storage names are unique, and a controller built
  from the same mapping in another insertion order gives the same names and order;
- ``no_overlap``: no two ``(role, layer)`` buffers share a byte (decided exactly by
  :func:`kvforge.worker.overlap.find_overlap`, whatever the controller itself enforces);
- ``swap_round_trip``: per purpose, unique bytes go into every live entry of a request, it is
  swapped out, the device blocks it held are overwritten with the complement of their bytes,
  another request takes the lowest free blocks, the request is swapped back in, and every entry
  its backend's ``offload_selection`` promises to keep for that purpose is compared byte for byte.

A failed check raises :class:`ConformanceError` (an ``AssertionError``, so test runners show it
as a failure) whose ``check`` attribute names the check and whose message says what was expected
and what was found. Bad arguments to :func:`check_backend` itself raise ``TypeError`` /
``ValueError`` before anything is built.

Invariants: the kit uses only the controller's public API and the backend's public methods;
every controller it builds is freed before it returns or raises.

The kit is one module per concern: :mod:`~kvforge.testing.results` (the report and the failure),
:mod:`~kvforge.testing.arguments`, :mod:`~kvforge.testing.declaration` (and the expected
buffers), :mod:`~kvforge.testing.buffers` (``bytes``, ``no_overlap``),
:mod:`~kvforge.testing.naming`, :mod:`~kvforge.testing.swaps` and :mod:`~kvforge.testing.kit`
(:func:`check_backend`). Import from ``kvforge.testing``.
"""

from __future__ import annotations

from kvforge.testing.kit import check_backend
from kvforge.testing.results import CHECKS, CheckResult, ConformanceError, ConformanceReport

__all__ = [
    "CHECKS",
    "CheckResult",
    "ConformanceError",
    "ConformanceReport",
    "check_backend",
]
