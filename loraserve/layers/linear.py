"""Linear layers that know tensor parallelism (and nothing of LoRA).

Each layer owns its shard rule through ``weight_loader(param, loaded_weight[, shard_id])``, which
takes the full checkpoint tensor and copies this rank's shard. Weights are (out, in), as in HF.
Column layers return this rank's output shard; row layers all-reduce (``reduce_results``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.distributed.comm import tp_all_gather, tp_all_reduce
from loraserve.distributed.parallel_state import divide, get_tp_rank, get_tp_size
from loraserve.forward_context import get_forward_context_or_none
from loraserve.layers.triton_dispatch import decode_linear_kernels, on_triton


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; in a CUDA-graph forward at decode sizes, the Triton decode GEMM where it beats cuBLAS
    (``triton_decode_linear.prefer_over_cublas``: small layers, which cuBLAS leaves SMs idle on).

    NOTE: graph forwards only (the warm-up run before a capture too, which compiles the kernel outside
    the capture): a Triton launch costs more host time than cuBLAS's, which eager steps pay on every
    call and graph replays never do.
    """
    ctx = get_forward_context_or_none()
    if ctx is not None and ctx.cuda_graph and on_triton(x) and x.dim() == 2 and x.shape[0] <= 32:
        kernels = decode_linear_kernels()
        if kernels.prefer_over_cublas(x, weight):
            return kernels.decode_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _new_param(*shape: int, dtype: torch.dtype | None, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, params_dtype=None):
        super().__init__(input_size, output_size, params_dtype)
        self.weight = _new_param(output_size, input_size, dtype=self.params_dtype, loader=self.weight_loader)
        self.bias = _new_param(output_size, dtype=self.params_dtype, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        assert param.shape == loaded.shape, f"{param.shape} != {loaded.shape}"
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X A^T with A split by output rows across ranks: rank i holds rows [i*o/p, (i+1)*o/p)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        params_dtype=None,
    ):
        super().__init__(input_size, output_size, params_dtype)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.weight = _new_param(
            self.output_size_per_partition, input_size, dtype=self.params_dtype, loader=self.weight_loader
        )
        self.bias = (
            _new_param(self.output_size_per_partition, dtype=self.params_dtype, loader=self.weight_loader)
            if bias
            else None
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        return tp_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one weight (gate_up_proj); each is sharded on its own."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, params_dtype=None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, params_dtype=params_dtype)
        self.output_partition_sizes = [divide(s, self.tp_size) for s in self.output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # a checkpoint that stores the packed tensor
            offset = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded.narrow(0, offset, size), i)
                offset += size
            return
        size = self.output_partition_sizes[shard_id]
        offset = sum(self.output_partition_sizes[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))

    def forward_activated(self, x: torch.Tensor, act) -> torch.Tensor:
        """act(self(x)): a gated MLP's projection and its activation. The LoRA wrapper of gate_up fuses
        the two where that is faster (``MergedColumnParallelLinearWithLoRA.forward_activated``)."""
        return act(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q, k, v projections, sharded by heads. With fewer kv heads than ranks, kv heads are replicated."""

    # set by a model whose attention's rotary + KV-cache launch reads this layer's output directly (no q/k norm in
    # between): a LoRA'd wrapper may then leave its delta to that launch (row_delta; forward_context.defer_delta)
    output_feeds_rotary = False

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        params_dtype=None,
    ):
        tp_size = get_tp_size()
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias=bias, params_dtype=params_dtype)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # sizes of q, k, v on this rank, and in the full (unsharded) model
        self.output_partition_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.output_sizes = [total_num_heads * head_size, total_num_kv_heads * head_size, total_num_kv_heads * head_size]

    def shard_offset(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in this rank's packed output, size, start row in the full q/k/v tensor)."""
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank * self.q_size
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return offset, self.kv_size, kv_rank * self.kv_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:  # packed qkv checkpoint (Phi-3 style)
            q, k, _ = self.output_sizes
            for sid, start, size in (("q", 0, q), ("k", q, k), ("v", q + k, k)):
                self.weight_loader(param, loaded.narrow(0, start, size), sid)
            return
        offset, size, start = self.shard_offset(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Y = X A^T with A split by input columns; partial outputs are all-reduced, the bias added once after."""

    # set by a model whose RMSNorm reads this layer's output directly (its residual add): a LoRA'd wrapper may
    # then leave its delta to that norm (lora/ops/triton/row_delta.py; forward_context.defer_delta)
    output_feeds_norm = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        params_dtype=None,
    ):
        super().__init__(input_size, output_size, params_dtype)
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.reduce_results = reduce_results
        self.weight = _new_param(
            output_size, self.input_size_per_partition, dtype=self.params_dtype, loader=self.weight_loader
        )
        self.bias = _new_param(output_size, dtype=self.params_dtype, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias is not sharded
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, before the all-reduce and the bias."""
        return linear(x, self.weight)

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        """All-reduce the partial sums, then add the bias once."""
        y = tp_all_reduce(partial) if self.reduce_results else partial
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # one rounding of (Wx + b), as nn.Linear
            return linear(x, self.weight, self.bias)
        return self.finish(self.forward_partial(x))
