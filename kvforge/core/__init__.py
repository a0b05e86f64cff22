"""Arithmetic both sides share, with no tensors: group-kind rules, layout, naming, memory plans,
and the plain values that cross between the scheduler side and the worker side.

Nothing here imports :mod:`kvforge.scheduler`, :mod:`kvforge.worker` or :mod:`kvforge.ops`.
"""
