"""Host <-> device copies that never make the host wait for the device's queue.

``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronizes the
stream: the host would wait for every queued kernel, which defeats the pipelined steps
(``engine.router``). These helpers stage through pinned memory and copy asynchronously;
PyTorch's pinned-memory cache keeps each staging buffer alive until its copy has run.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A device tensor of ``values`` (a list), copied without waiting for the device."""
    if torch.device(device).type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def start_to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A pinned host copy of ``t``, started but not awaited: read it after an event that follows it."""
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
