"""Tensor-parallel group state.

World size 1 needs no torch.distributed at all; ``init_tensor_parallel`` sets up a group over
torch.distributed (nccl on CUDA, gloo on CPU) for world size > 1. ``reset`` returns to world size 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _TPState:
    rank: int = 0
    size: int = 1
    group: object | None = None


_STATE = _TPState()


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def get_tp_group():
    return _STATE.group


def set_tp_state(rank: int, size: int, group=None) -> None:
    """Install the TP rank/size (the distributed launcher calls this after init_process_group)."""
    _STATE.rank, _STATE.size, _STATE.group = rank, size, group


def reset() -> None:
    set_tp_state(0, 1, None)


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator
