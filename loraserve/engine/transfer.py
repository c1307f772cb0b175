"""Host <-> device copies that never wait for the device: what async scheduling depends on.

In PyTorch a host->device copy from pageable memory (``torch.tensor(list).to(cuda)``, or
``copy_(cpu_tensor)`` without ``non_blocking``) synchronizes the stream: it returns only once every
kernel queued before it ran. With a step in flight that is the very wait async scheduling hides, so
on CUDA host data goes up through pinned memory with ``non_blocking=True``, and results come down
into pinned memory followed by one CUDA event, which the reader waits on alone (``HostCopy``).

NOTE: fresh pinned tensors per copy, not a persistent double buffer. They come from PyTorch's caching
host allocator, and a non-blocking copy records an event on its host block
(``CachingHostAllocator_recordEvent`` in aten's cuda Copy.cu), so a block freed here is handed out
again only once the copy that reads (or writes) it ran: no buffer is overwritten while its copy is
in flight. After warm-up a copy costs an allocator lookup, not a ``cudaHostAlloc``.
On the CPU there is nothing to overlap: plain tensors, and nothing to wait for.
"""

from __future__ import annotations

import torch


def host_tensor(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` (nested lists) as a host tensor to copy to ``device``: pinned when that is a CUDA device."""
    return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` (nested lists) as a tensor on ``device``, without waiting for work queued there."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return host_tensor(data, dtype, device).to(device, non_blocking=True)


def copy_from_host(dst: torch.Tensor, data) -> None:
    """Fill the device tensor ``dst`` with ``data`` (nested lists of its shape), without waiting for
    work queued on its device. NOTE: the pinned source is contiguous and of ``dst``'s dtype, so even a
    strided ``dst`` gets it by one non-blocking copy (PyTorch stages it through a device temporary)."""
    dst.copy_(host_tensor(data, dst.dtype, dst.device), non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host.

    On CUDA each tensor is copied (non-blocking) into fresh pinned memory and one event is recorded
    after the copies; ``wait()`` blocks on that event only, so it waits for the work queued before the
    copies and not for what was queued on the stream after them (the next step, under async
    scheduling). ``None`` entries stay ``None``.
    """

    def __init__(self, *tensors: torch.Tensor | None):
        self._event: torch.cuda.Event | None = None
        dev = next((t.device for t in tensors if t is not None), None)
        if dev is None or dev.type != "cuda":
            self._host = list(tensors)
            return
        self._host = [
            None
            if t is None
            else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors
        ]
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(dev))

    def wait(self) -> list[torch.Tensor | None]:
        """The host tensors, once their copies are done."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
