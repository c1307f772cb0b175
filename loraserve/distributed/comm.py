"""Collectives over the TP group; identity at world size 1."""

from __future__ import annotations

import torch

from loraserve.distributed.parallel_state import get_tp_group, get_tp_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_size() == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=get_tp_group())
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    size = get_tp_size()
    if size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=get_tp_group())
    return torch.cat(parts, dim=dim)
