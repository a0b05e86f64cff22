"""The per-token arrays of a step on the worker side: :func:`kvforge.ops.token_positions` and
each token's table row, with the decode step (one token per request) in a few array
operations instead of the general expansion's dozen."""

from __future__ import annotations

import numpy as np

from kvforge import ops
from kvforge.core.values import StepAllocation, StepEffects

__all__ = ["step_tokens"]

_SMALL = 40  # up to this many requests, a Python set of the counts beats two reductions


def step_tokens(step: StepAllocation | StepEffects) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(request_index, positions, rows)`` of every token of ``step``, request-major: the
    arrays :func:`kvforge.ops.token_positions` gives (``int64``), and ``rows[t]`` the table row
    of token ``t`` (``step.rows`` itself when each request has one token: read, never written).

    >>> import numpy as np
    >>> step = StepAllocation(("a", "b"), np.array([3, 5], dtype=np.int32),
    ...                       np.array([7, 0]), np.array([1, 1]), (), ())
    >>> [a.tolist() for a in step_tokens(step)]
    [[0, 1], [7, 0], [3, 5]]
    """
    num_new, n = step.num_new, len(step.num_new)
    if (
        n
        and type(num_new) is np.ndarray
        and num_new.dtype.kind in "iu"
        and (
            set(num_new.tolist()) == {1}
            if n <= _SMALL
            else np.minimum.reduce(num_new) == 1 == np.maximum.reduce(num_new)
        )
    ):
        index = np.arange(n, dtype=np.int64)
        return index, step.num_computed.astype(np.int64), step.rows
    index, positions = ops.token_positions(step.num_computed, num_new, check=False)
    return index, positions, step.rows[index]
