"""Tensor-parallel group state.

World size 1 needs no torch.distributed at all. ``init_distributed`` joins the process group for
world size > 1 (every rank is in the one TP group) and installs two groups over all ranks:

- the TP group (nccl on CUDA, gloo on CPU) that the layers' collectives use, with a short timeout
  (``ParallelConfig.distributed_timeout_s``): a dead or hung rank fails the step, never hangs it;
- the control group (gloo), through which rank 0 broadcasts each step's inputs
  as python objects. Its timeout is long (``control_timeout_s``) because workers wait on it while
  the engine idles; a rank that dies still breaks it at once (its sockets close).

The first collective failure is kept (``mark_failed``): the TP group is then unusable and the engine
reports it as dead. ``shutdown_distributed`` (or ``reset``) returns to world size 1.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank died, failed or did not answer in time: the engine cannot go on; restart it."""


@dataclass
class _TPState:
    rank: int = 0
    size: int = 1
    group: object | None = None
    control_group: object | None = None
    timeout_s: float | None = None
    failure: EngineDeadError | None = None
    owns_process_group: bool = False
    reporter: Callable[[], EngineDeadError | None] | None = (
        None  # rank 0: explains a failure (workers' errors)
    )


_STATE = _TPState()


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def get_tp_group():
    return _STATE.group


def get_control_group():
    return _STATE.control_group


def get_timeout_s() -> float | None:
    return _STATE.timeout_s


def set_tp_state(
    rank: int, size: int, group=None, control_group=None, timeout_s: float | None = None
) -> None:
    """Install the TP rank/size and groups (``init_distributed`` calls this after init_process_group)."""
    _STATE.rank, _STATE.size, _STATE.group = rank, size, group
    _STATE.control_group, _STATE.timeout_s, _STATE.failure = control_group, timeout_s, None


def mark_failed(err: EngineDeadError) -> None:
    """Keep the first collective failure: every later check reports the engine dead."""
    if _STATE.failure is None:
        _STATE.failure = err


def get_failure() -> EngineDeadError | None:
    return _STATE.failure


def set_failure_reporter(fn: Callable[[], EngineDeadError | None] | None) -> None:
    """Rank 0: ``fn()`` turns a failed collective into the error to raise (naming the dead worker and its error)."""
    _STATE.reporter = fn


def report_failure(err: EngineDeadError) -> EngineDeadError:
    """Record a collective failure; the error to raise (the reporter's fuller one when there is one)."""
    mark_failed(err)
    fuller = _STATE.reporter() if _STATE.reporter is not None else None
    return fuller or err


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str | None,
    backend: str,
    timeout_s: float = 60.0,
    control_timeout_s: float = 7 * 24 * 3600.0,
    join_timeout_s: float = 300.0,
    store=None,
) -> None:
    """Join the process group (every rank calls this) and install the TP and control groups.

    ``backend``: 'gloo' (CPU) or 'nccl' (CUDA) for the TP group; the control group is always gloo.
    ``init_method``: 'env://' under torchrun, 'tcp://HOST:PORT'; or None with a ``store`` (a TCPStore
    rank 0 serves for the workers it spawns). ``join_timeout_s`` bounds the rendezvous.
    """
    import torch.distributed as dist

    if _STATE.size != 1 or dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel group is already set up in this process; shut the other engine down "
            "(LLM.shutdown()) before starting a new one"
        )
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=join_timeout_s),
    )
    ranks = list(range(world_size))
    control = dist.new_group(ranks, timeout=datetime.timedelta(seconds=control_timeout_s), backend="gloo")
    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
    set_tp_state(rank, world_size, group, control, timeout_s)
    _STATE.owns_process_group = True


def shutdown_distributed() -> None:
    """Leave the process group (if we joined it) and return to world size 1."""
    import torch.distributed as dist

    if _STATE.owns_process_group and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may fail to tear down; the process state is reset anyway
            pass
    reset()


def reset() -> None:
    set_tp_state(0, 1, None)
    _STATE.owns_process_group = False
    _STATE.reporter = None


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator
