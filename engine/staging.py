"""Host ↔ device copies that do not make the host wait on the device, for the overlapped step loop.

A plain ``torch.tensor(values, device=cuda)`` or a ``copy_`` from pageable memory blocks the host until every
kernel queued before it has run (GPU finding 4: 0.72 ms of a 1.28 ms decode step). :func:`to_device` and
:func:`copy_in` go through pinned memory instead and are queued in stream order; :class:`Readback` starts a
step's one device → host copy when the step is launched and waits for it only when asked — after the next
step has been launched. Off CUDA all three are plain synchronous copies.
"""

from __future__ import annotations

import torch


def pinned(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (host list or tensor) as a host tensor, pinned when it is bound for CUDA. PyTorch's caching host
    allocator records the stream on every asynchronous copy out of it, so a pinned block is reused only after
    the copy ran."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a new tensor on ``device``, copied asynchronously in stream order."""
    return pinned(values, dtype, device).to(device, non_blocking=True)


def copy_in(buffer: torch.Tensor, values) -> None:
    """Copies host ``values`` into the device ``buffer`` (a static step's input), asynchronously."""
    buffer.copy_(pinned(values, buffer.dtype, buffer.device), non_blocking=True)


class Readback:
    """Device tensors copied once to pinned host memory, queued when built (right after the step's last kernel);
    :meth:`lists` waits for that copy alone (an event), not for work queued later."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.event = None
        if tensors[0].is_cuda:  # a step's outputs share one device
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensors

    def lists(self) -> list[list]:
        if self.event is not None:
            self.event.synchronize()
        return [t.tolist() for t in self.host]
