"""Sparse mixture-of-experts: top-k routing and stacked experts (knows TP, knows nothing of LoRA).

``FusedMoE`` is the experts module (``mlp.experts`` in HF's transformers-5 paths); its parameters
mirror ``Qwen3MoeExperts`` / ``MixtralExperts``: ``gate_up_proj`` (E, 2I, H) rows [gate; up] per expert
(or interleaved [g0, u0, g1, u1, ...], GPT-OSS style; or (E, I, H) for non-gated experts) and
``down_proj`` (E, H, I). Under TP each rank holds a slice of I of every expert (gate and up sliced
on their own), the partial outputs are all-reduced after the experts are summed.

Routing follows each HF model's router exactly (transformers 5.24), chosen by ``RoutingConfig``:
logits = x W_g^T in the model dtype; p = softmax(logits in fp32); (w, ids) = topk(p) (torch.topk on
the same fp32 tensor, so ties break as HF's do); w /= sum(w) when ``renormalize``; w is cast back to
the logits dtype unless ``weights_fp32`` (Mixtral keeps fp32 weights and multiplies in fp32).

Two paths compute the experts (``backend``):
- torch (the CPU, and the reference): sort the (token, expert) assignments by expert, one matmul pair
  per expert that has tokens, each expert's weighted output added in expert order, as HF's eager
  experts do. An ``ExpertHook`` lets the LoRA wrapper add its per-(slot, expert) deltas inside each
  expert's computation (before the activation for w13, before the routing weight for w2).
- triton (CUDA, when triton is installed): ``layers/triton_moe.py``, a grouped GEMM over
  expert-aligned blocks, no host sync (CUDA-graph capturable); its hook sees all assignments at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.distributed.comm import tp_all_reduce
from loraserve.distributed.parallel_state import divide, get_tp_rank, get_tp_size
from loraserve.layers.linear import ReplicatedLinear
from loraserve.layers.triton_dispatch import on_triton

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class RoutingConfig:
    top_k: int
    renormalize: bool  # HF: norm_topk_prob (Qwen2/3-MoE, OLMoE); always for Mixtral
    # Mixtral: the top-k weights stay fp32; the others cast them to the logits dtype
    weights_fp32: bool = False




class ExpertHook(Protocol):
    """Called inside expert ``e``'s computation for its tokens ``tok`` (original indices, (n,))."""

    def w13(self, e: int, tok: torch.Tensor, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor: ...

    def w2(self, e: int, tok: torch.Tensor, a: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        activation: str = "silu",
        gated: bool = True,
        interleaved: bool = False,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"FusedMoE: activation {activation!r} is not supported; use one of {sorted(_ACTIVATIONS)}"
            )
        if interleaved and not gated:
            raise ValueError("FusedMoE: an interleaved w13 needs gated experts")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.routing = routing
        self.activation = activation
        self.act = _ACTIVATIONS[activation]
        self.gated = gated
        self.interleaved = interleaved
        self.reduce_results = reduce_results
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.intermediate_per_partition = divide(intermediate_size, self.tp_size)
        n13 = (2 if gated else 1) * self.intermediate_per_partition
        dtype = params_dtype or torch.get_default_dtype()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, n13, hidden_size, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.intermediate_per_partition, dtype=dtype),
            requires_grad=False,
        )
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader
        # what HF (and so checkpoints and PEFT's target_parameters) calls these two parameters
        self.hf_param_names = ("gate_up_proj" if gated else "up_proj", "down_proj")
        self.backend = "auto"  # "torch" | "triton" | "auto" (triton on CUDA when installed)

    def use_triton(self, x: torch.Tensor) -> bool:
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"FusedMoE.backend must be 'auto', 'torch' or 'triton', not {self.backend!r}")
        if self.backend == "auto":
            return on_triton(x)
        return self.backend == "triton"

    # ---- weights ----------------------------------------------------------------------------------
    def w13_rows(self, shard: int) -> torch.Tensor | slice:
        """This rank's rows of the packed w13 that hold slice ``shard`` (0 gate / 1 up; 0 = up if non-gated)."""
        n = self.intermediate_per_partition
        if self.interleaved:
            return slice(shard, 2 * n, 2)
        return slice(shard * n, (shard + 1) * n)

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        shard_id: int | None = None,
        expert_id: int | None = None,
    ) -> None:
        """HF's fused 3-D tensor (shard_id = expert_id = None) or one expert's 2-D piece:
        ``gate_proj``/``w1`` (shard 0), ``up_proj``/``w3`` (shard 1) or ``down_proj``/``w2`` (shard None)."""
        n, start = self.intermediate_per_partition, self.tp_rank * self.intermediate_per_partition
        if expert_id is None:
            assert loaded.dim() == 3 and loaded.shape[0] == self.num_experts, (
                f"{tuple(loaded.shape)} != (E, ., .)"
            )
            for e in range(self.num_experts):
                if param is self.down_proj:
                    self.weight_loader(param, loaded[e], None, e)
                elif self.gated:
                    full = self.intermediate_size
                    gate, up = (
                        (loaded[e, 0::2], loaded[e, 1::2])
                        if self.interleaved
                        else (loaded[e, :full], loaded[e, full:])
                    )
                    self.weight_loader(param, gate, 0, e)
                    self.weight_loader(param, up, 1, e)
                else:
                    self.weight_loader(param, loaded[e], 0, e)
            return
        if param is self.down_proj:
            assert loaded.shape == (self.hidden_size, self.intermediate_size), (
                f"down_proj: {tuple(loaded.shape)}"
            )
            param.data[expert_id].copy_(loaded.narrow(1, start, n))
            return
        assert loaded.shape == (self.intermediate_size, self.hidden_size), (
            f"gate_up_proj: {tuple(loaded.shape)}"
        )
        param.data[expert_id, self.w13_rows(shard_id)].copy_(loaded.narrow(0, start, n))

    # ---- forward ----------------------------------------------------------------------------------
    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (T, k), expert ids (T, k)), exactly as HF's TopKRouter computes them."""
        probs = torch.softmax(router_logits.float(), dim=-1)  # (T, E) fp32
        weights, ids = torch.topk(probs, self.routing.top_k, dim=-1)  # (T, k)
        if self.routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.routing.weights_fp32:
            weights = weights.to(router_logits.dtype)
        return weights, ids

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """w13 output (n, 2I or I) -> (n, I)."""
        if not self.gated:
            return self.act(h)
        if self.interleaved:
            return self.act(h[:, 0::2]) * h[:, 1::2]
        n = h.shape[-1] // 2
        return self.act(h[:, :n]) * h[:, n:]

    def experts_forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        hook: ExpertHook | None = None,
        order: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for every token: (T, H), this rank's partial sum.

        ``order``: a permutation of the T*k flat assignments that groups them by expert (stable), e.g.
        sorted by (expert, LoRA slot); default sorted by expert.
        """
        T, k = ids.shape
        flat = ids.reshape(-1)  # (T*k,)
        if order is None:
            order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tok_sorted = order // k  # (T*k,) token of each sorted assignment
        w_sorted = weights.reshape(-1)[order]  # (T*k,)
        out = torch.zeros_like(x)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            tok = tok_sorted[start : start + c]  # (n,)
            xe = x[tok]  # (n, H)
            h = F.linear(xe, self.gate_up_proj[e])  # (n, 2I)
            if hook is not None:
                h = hook.w13(e, tok, xe, h)
            a = self.activate(h)  # (n, I)
            y = F.linear(a, self.down_proj[e])  # (n, H)
            if hook is not None:
                y = hook.w2(e, tok, a, y)
            # NOTE: multiply in the weights' dtype (fp32 for Mixtral), then round, as HF's experts do. A token
            # appears once per expert, so this is HF's index_add_, which is ~100x slower on a busy CPU (OpenMP)
            out.index_put_((tok,), (y * w_sorted[start : start + c, None]).to(out.dtype), accumulate=True)
            start += c
        return out

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(partial) if self.reduce_results else partial

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.select_experts(router_logits)
        if self.use_triton(x):
            from loraserve.layers.triton_moe import fused_experts  # NOTE: lazy: CPU installs have no triton

            return self.finish(fused_experts(self, x, weights, ids))
        return self.finish(self.experts_forward(x, weights, ids))


class MoERouter(nn.Module):
    """HF's router weight (E, H): logits = x W^T, in the model dtype. Like HF's TopKRouter it is not a
    linear layer, so it carries no LoRA (an adapter naming it is refused)."""

    def __init__(self, num_experts: int, hidden_size: int, params_dtype: torch.dtype | None = None):
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """HF's ``*SparseMoeBlock``: router ``gate`` (E, H), ``experts``, and optionally a shared expert
    scaled by sigmoid(``shared_expert_gate``(x)) (Qwen2-MoE). Paths mirror HF's (``mlp.gate.weight``)."""

    def __init__(
        self,
        experts: FusedMoE,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: bool = False,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.gate = MoERouter(experts.num_experts, experts.hidden_size, params_dtype)
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            ReplicatedLinear(experts.hidden_size, 1, params_dtype=params_dtype)
            if shared_expert_gate
            else None
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.experts(h, self.gate(h))
        if self.shared_expert is not None:
            shared = self.shared_expert(h)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(h)) * shared
            out = out + shared
        return out


# HF's per-expert checkpoint keys (what transformers 5's save_pretrained writes, reverting its fusion):
# Qwen2/3-MoE, OLMoE `mlp.experts.N.{gate,up,down}_proj.weight`; Mixtral `block_sparse_moe.experts.N.w{1,3,2}.weight`
_EXPERT_KEY = re.compile(
    r"^(.*)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_PIECE = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}  # fmt: skip


def map_expert_checkpoint_name(name: str, gated: bool = True) -> tuple[str, tuple] | None:
    """A checkpoint key -> (our parameter, extra weight_loader args), for the keys a plain lookup misses:
    per-expert pieces and Mixtral's v4 ``block_sparse_moe`` prefix. None = load by name."""
    m = _EXPERT_KEY.match(name)
    if m is not None:
        prefix, _, expert, piece = m.groups()
        param, shard = _PIECE[piece]
        if not gated and shard is not None:
            shard = 0
        return f"{prefix}.mlp.experts.{param}", (shard, int(expert))
    if ".block_sparse_moe." in name:
        return name.replace(".block_sparse_moe.", ".mlp."), ()
    return None
