"""Run a function on N gloo ranks (spawned processes) and collect what each returns."""

from __future__ import annotations

import socket
from pathlib import Path

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, init_method: str, fn, out_dir: str) -> None:
    from loraserve.distributed.parallel_state import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world_size, init_method, "gloo", timeout_s=60.0)
    try:
        torch.save(fn(), Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown_distributed()


def run_on_ranks(fn, world_size: int, out_dir: Path) -> list:
    """fn() (importable, no arguments) on every rank of a fresh gloo TP group; its results by rank."""
    import torch.multiprocessing as mp

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(
        _entry,
        args=(world_size, init_method, fn, str(out_dir)),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]
