"""Device detection, device and pinned host allocation, and streams/events.

Three platforms: ``npu`` (Ascend, only when ``torch_npu`` imports), ``cuda`` and ``cpu``.
``torch_npu`` is imported lazily and only when an NPU is asked for or detected, so importing
kvforge on a machine without it is silent. On CPU, streams and events are no-ops and "pinned"
host memory is plain host memory (there is no DMA engine to pin for).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch

__all__ = ["DEVICE_TYPES", "Platform", "detect_device_type", "get_platform"]

DEVICE_TYPES = ("cpu", "cuda", "npu")


@functools.cache
def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except Exception:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())  # pragma: no cover - needs an NPU


def detect_device_type() -> str:
    """The best device type on this machine: ``npu``, then ``cuda``, then ``cpu``."""
    if _npu_available():  # pragma: no cover - needs an NPU
        return "npu"
    if torch.cuda.is_available():  # pragma: no cover - needs a GPU
        return "cuda"
    return "cpu"


@dataclass(frozen=True)
class Platform:
    """Allocation and synchronisation for one device.

    Attributes:
        device: the torch device caches live on.
    """

    device: torch.device

    @property
    def type(self) -> str:
        return self.device.type

    @property
    def is_accelerator(self) -> bool:
        return self.device.type != "cpu"

    @property
    def _module(self) -> Any:  # pragma: no cover - accelerators only
        return getattr(torch, self.device.type)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new uninitialised device tensor."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def empty_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new uninitialised host tensor, pinned when the device can DMA from it."""
        pin = self.is_accelerator
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)

    def new_stream(self) -> Any:
        """A side stream for copies (``None`` on CPU)."""
        if not self.is_accelerator:
            return None
        return self._module.Stream(device=self.device)  # pragma: no cover - accelerators only

    def stream_context(self, stream: Any) -> Any:
        """Context manager that makes ``stream`` current (no-op on CPU)."""
        if stream is None:
            return nullcontext()
        return self._module.stream(stream)  # pragma: no cover - accelerators only

    def record_event(self, stream: Any = None) -> Any:
        """An event recorded on ``stream`` (current stream if ``None``); ``None`` on CPU."""
        if not self.is_accelerator:
            return None
        event = self._module.Event()  # pragma: no cover - accelerators only
        event.record(stream)  # pragma: no cover
        return event  # pragma: no cover

    def wait_stream(self, waiter: Any, waitee: Any = None) -> None:
        """Make ``waiter`` wait for work queued on ``waitee`` (current stream if ``None``)."""
        if waiter is None:
            return
        waitee = waitee or self._module.current_stream(self.device)  # pragma: no cover
        waiter.wait_stream(waitee)  # pragma: no cover

    def current_stream_wait(self, event: Any) -> None:
        """Make the current stream wait for ``event`` (no-op on CPU)."""
        if event is not None:  # pragma: no cover - accelerators only
            self._module.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        if self.is_accelerator:
            self._module.synchronize(self.device)  # pragma: no cover - accelerators only

    @contextmanager
    def side_stream(self, stream: Any) -> Iterator[None]:
        """Run the body on ``stream`` after everything already queued on the current stream."""
        self.wait_stream(stream)
        with self.stream_context(stream):
            yield


def get_platform(device: str | torch.device | None = None) -> Platform:
    """Resolve ``device`` (``None`` or ``"auto"`` = best available) into a :class:`Platform`.

    Raises:
        ValueError: if the device type is unknown or not available on this machine.
    """
    if device is None or device == "auto":
        device = detect_device_type()
    # torch only knows the "npu" device type once torch_npu has registered it.
    if str(device).startswith("npu") and not _npu_available():
        raise ValueError(
            f"device {str(device)!r} requested but torch_npu is not installed or sees no NPU"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {device!r} is not a device; use one of {list(DEVICE_TYPES)}"
        ) from None
    if dev.type not in DEVICE_TYPES:
        raise ValueError(f"device {str(dev)!r} is not supported; use one of {list(DEVICE_TYPES)}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    if dev.type != "cpu" and dev.index is None:  # pragma: no cover - accelerators only
        dev = torch.device(dev.type, 0)
    return Platform(device=dev)


MAX_ADDRESSABLE_BYTES = (1 << 63) - 1
"""No device addresses more: tensor sizes and the kernels' byte offsets are 64-bit."""


def device_memory_capacity(device: str | torch.device) -> int | None:
    """Total memory of ``device`` in bytes, or None where it cannot be known.

    CPU: this machine's physical memory. CUDA / NPU: the device's total memory (the NPU path
    needs ``torch_npu``, imported only when asked about an NPU).
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX hosts
            return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    if dev.type == "npu":  # pragma: no cover - Ascend only
        npu = getattr(torch, "npu", None)
        if npu is None:
            return None
        index = dev.index if dev.index is not None else npu.current_device()
        return int(npu.get_device_properties(index).total_memory)
    return None


def check_allocatable(nbytes: int, device: str | torch.device, what: str = "caches") -> None:
    """Refuse, before allocating, ``nbytes`` that cannot be allocated on ``device``.

    An allocator calls this with the bytes it is about to allocate (e.g. ``plan.total_bytes``
    before creating a plan's device caches, or the host pool size before pinning it). A plan
    for another machine stays legal; only allocating it here is refused.

    Raises:
        ValueError: ``nbytes`` is not an int >= 0, exceeds ``2**63 - 1`` bytes, or exceeds the
            total memory of ``device``; the message names what was asked and what there is.
    """
    if not isinstance(nbytes, Integral) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    nbytes = int(nbytes)
    if nbytes > MAX_ADDRESSABLE_BYTES:
        raise ValueError(
            f"cannot allocate {nbytes:,} bytes of {what}: more than any device can address "
            f"({MAX_ADDRESSABLE_BYTES:,} bytes, 2**63 - 1)"
        )
    capacity = device_memory_capacity(device)
    if capacity is not None and nbytes > capacity:
        raise ValueError(
            f"cannot allocate {nbytes:,} bytes of {what} on {torch.device(device)}: it has "
            f"{capacity:,} bytes of memory in total"
        )
