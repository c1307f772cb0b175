"""The device the Triton kernel tests run on: CUDA, or the CPU under ``TRITON_INTERPRET=1``; else skip.

Call ``triton_device()`` at module level, before importing anything that imports triton.
"""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> torch.device:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)


def skip_interpreted_bf16(*dtypes: torch.dtype) -> None:
    """Skip a case with any bf16 operand under the Triton interpreter (the CUDA device runs it).

    NOTE: the interpreter's tl.dot on bf16 returns garbage (numpy has no bf16), so such a case would
    test the interpreter, not the kernel.
    """
    if not torch.cuda.is_available() and torch.bfloat16 in dtypes:
        pytest.skip("bf16 dots need CUDA (the Triton interpreter computes them wrong)")
