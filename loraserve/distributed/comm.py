"""Collectives over the TP group (identity at world size 1) and rank 0's broadcast of python objects.

A failing collective (a rank died: its sockets closed; or it hung past the group's timeout) raises
``EngineDeadError`` naming what failed, and is remembered, so the engine reports itself dead after it.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable

import torch

from loraserve.distributed.parallel_state import (
    EngineDeadError,
    get_control_group,
    get_failure,
    get_timeout_s,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    report_failure,
)


def _guarded(what: str, fn: Callable[[], object]):
    failure = get_failure()
    if failure is not None:  # a broken group would only time out again
        raise failure
    try:
        return fn()
    except Exception as e:
        err = EngineDeadError(
            f"tensor-parallel {what} failed on rank {get_tp_rank()}: a rank died or did not answer within "
            f"{get_timeout_s()}s ({type(e).__name__}: {e}); the engine cannot continue, restart it"
        )
        raise report_failure(err) from e


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks, in place."""
    if get_tp_size() == 1:
        return x
    import torch.distributed as dist

    _guarded("all_reduce", lambda: dist.all_reduce(x, group=get_tp_group()))
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` (equal shapes) along ``dim``, in rank order."""
    size = get_tp_size()
    if size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    _guarded("all_gather", lambda: dist.all_gather(parts, x, group=get_tp_group()))
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: object = None, src: int = 0, timeout_s: float | None = None) -> object:
    """Rank ``src`` sends ``obj`` (picklable) over the control group; every rank returns it.

    The sender waits at most ``timeout_s`` (default: the TP timeout) for every rank to take it: a gloo
    broadcast does not complete before the receivers do, so a hung worker must not block rank 0 for
    the control group's long timeout. Receivers wait as long as the engine idles.
    """
    if get_tp_size() == 1:
        return obj
    import torch.distributed as dist

    sender = get_tp_rank() == src
    group = get_control_group()
    wait = datetime.timedelta(seconds=timeout_s or get_timeout_s()) if sender else None

    def run() -> object:
        if sender:
            data = pickle.dumps(obj)
            size = torch.tensor([len(data)], dtype=torch.long)
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            size = torch.zeros(1, dtype=torch.long)
        dist.broadcast(size, src, group=group, async_op=True).wait(*([wait] if wait else []))
        if not sender:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src, group=group, async_op=True).wait(*([wait] if wait else []))
        return obj if sender else pickle.loads(payload.numpy().tobytes())

    return _guarded("broadcast of the step", run)
