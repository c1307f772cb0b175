"""Every TP base layer and LoRA layer family, built the same way at any TP size.

Weights, adapters and inputs are full-size tensors drawn from a per-case seed; each rank loads its
shard through the layers' own ``weight_loader`` / ``set_lora`` (slice_lora_a/b), exactly as the
engine does. ``run_all()`` returns each case's output on this rank; ``reassemble`` turns the
per-rank outputs of a column-parallel layer back into the full output (q/k/v heads, replicated kv
heads counted once) so that it can be compared with the single-process result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loraserve.config import LoRAConfig
from loraserve.distributed.comm import tp_all_gather
from loraserve.distributed.parallel_state import get_tp_rank, get_tp_size
from loraserve.forward_context import forward_context
from loraserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from loraserve.layers.vocab import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from loraserve.lora.layers import LORA_LAYER_CLASSES, LogitsProcessorWithLoRA
from loraserve.lora.punica import LoRAMapping, PunicaWrapper

MAX_LORAS, MAX_RANK = 4, 8
H, V, T = 32, 251, 20  # V odd: the vocab shards are padded at TP=2
HEAD = 8
CPU = torch.device("cpu")
# slots 0, 1, 3 hold adapters, slot 2 stays empty, -1 = base
SLOT_POOL = [-1, -1, -1, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, -1, 0, 1]
SLOT_RANKS = {  # per slice count: per slot the rank of each slice (None = no LoRA there); 1, 3, 5 are odd
    1: {0: [1], 1: [MAX_RANK], 3: [3]},
    2: {0: [1, 3], 1: [MAX_RANK, None], 3: [None, 5]},
    3: {0: [1, 2, 3], 1: [MAX_RANK, None, 4], 3: [None, 5, None]},
}


@dataclass
class Case:
    name: str
    make: Callable[[], torch.nn.Module]
    weights: list[tuple[str, object, tuple[int, ...]]]  # (param, shard id or None, full shape)
    kind: str  # linear | embedding | logits
    packed: list[str]
    in_size: int
    slices: list[int]  # full output size of each LoRA slice
    layout: Callable[
        [int], list[tuple[int, int]] | None
    ]  # tp -> output chunks (full size, kv replicas); None = whole
    split_input: bool = False  # row-parallel: this rank gets its columns of x
    lora_bias: bool = False  # slot 1 also carries a lora_B.bias
    sharded_cls: str | None = None  # the class --fully-sharded-loras must pick
    extra: dict = field(default_factory=dict)


def _qkv_layout(kv_heads: int):
    q, kv = 4 * HEAD, kv_heads * HEAD
    return lambda tp: [(q, 1), (kv, max(1, tp // kv_heads)), (kv, max(1, tp // kv_heads))]


def _qkv_weights(kv_heads: int):
    return [
        ("weight", "q", (4 * HEAD, H)),
        ("weight", "k", (kv_heads * HEAD, H)),
        ("weight", "v", (kv_heads * HEAD, H)),
        ("bias", "q", (4 * HEAD,)),
        ("bias", "k", (kv_heads * HEAD,)),
        ("bias", "v", (kv_heads * HEAD,)),
    ]


CASES = [
    Case(
        "replicated",
        lambda: ReplicatedLinear(H, 24, bias=True),
        [("weight", None, (24, H)), ("bias", None, (24,))],
        "linear",
        ["fc"],
        H,
        [24],
        lambda tp: None,
    ),
    Case(
        "column",
        lambda: ColumnParallelLinear(H, 24, bias=True),
        [("weight", None, (24, H)), ("bias", None, (24,))],
        "linear",
        ["up"],
        H,
        [24],
        lambda tp: [(24, 1)],
        lora_bias=True,
        sharded_cls="ColumnParallelLinearWithShardedLoRA",
    ),
    Case(
        "column_gather",
        lambda: ColumnParallelLinear(H, 24, gather_output=True),
        [("weight", None, (24, H))],
        "linear",
        ["up"],
        H,
        [24],
        lambda tp: None,
        sharded_cls="ColumnParallelLinearWithShardedLoRA",
    ),
    Case(
        "merged_2",
        lambda: MergedColumnParallelLinear(H, [16, 24], bias=True),
        [("weight", 0, (16, H)), ("weight", 1, (24, H)), ("bias", 0, (16,)), ("bias", 1, (24,))],
        "linear",
        ["gate_proj", "up_proj"],
        H,
        [16, 24],
        lambda tp: [(16, 1), (24, 1)],
        lora_bias=True,
        sharded_cls="MergedColumnParallelLinearWithShardedLoRA",
    ),
    Case(
        "merged_3",
        lambda: MergedColumnParallelLinear(H, [8, 16, 24]),
        [("weight", 0, (8, H)), ("weight", 1, (16, H)), ("weight", 2, (24, H))],
        "linear",
        ["a", "b", "c"],
        H,
        [8, 16, 24],
        lambda tp: [(8, 1), (16, 1), (24, 1)],
    ),
    Case(
        "qkv_packed_kv2",
        lambda: QKVParallelLinear(H, HEAD, 4, 2, bias=True),
        _qkv_weights(2),
        "linear",
        ["qkv_proj"],
        H,
        [8 * HEAD],
        _qkv_layout(2),
        sharded_cls="QKVParallelLinearWithShardedLoRA",
    ),
    Case(
        "qkv_packed_kv1",
        lambda: QKVParallelLinear(H, HEAD, 4, 1, bias=True),
        _qkv_weights(1),
        "linear",
        ["qkv_proj"],
        H,
        [6 * HEAD],
        _qkv_layout(1),
        sharded_cls="QKVParallelLinearWithShardedLoRA",
    ),
    Case(
        "qkv_merged_kv2",
        lambda: QKVParallelLinear(H, HEAD, 4, 2, bias=True),
        _qkv_weights(2),
        "linear",
        ["q_proj", "k_proj", "v_proj"],
        H,
        [4 * HEAD, 2 * HEAD, 2 * HEAD],
        _qkv_layout(2),
        lora_bias=True,
        sharded_cls="MergedQKVParallelLinearWithShardedLoRA",
    ),
    Case(
        "qkv_merged_kv1",
        lambda: QKVParallelLinear(H, HEAD, 4, 1, bias=True),
        _qkv_weights(1),
        "linear",
        ["q_proj", "k_proj", "v_proj"],
        H,
        [4 * HEAD, HEAD, HEAD],
        _qkv_layout(1),
        sharded_cls="MergedQKVParallelLinearWithShardedLoRA",
    ),
    Case(
        "row",
        lambda: RowParallelLinear(48, H, bias=True),
        [("weight", None, (H, 48)), ("bias", None, (H,))],
        "linear",
        ["down"],
        48,
        [H],
        lambda tp: None,
        split_input=True,
        sharded_cls="RowParallelLinearWithShardedLoRA",
    ),
    Case(
        "embedding",
        lambda: VocabParallelEmbedding(V, H),
        [("weight", None, (V, H))],
        "embedding",
        ["embed_tokens"],
        V,
        [H],
        lambda tp: None,
    ),
    Case(
        "logits",
        lambda: ParallelLMHead(V, H),
        [("weight", None, (V, H))],
        "logits",
        ["lm_head"],
        H,
        [V],
        lambda tp: None,
    ),
]


def _gen(name: str, what: str) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, name + "/" + what)) * 7919)


def build_base(case: Case) -> torch.nn.Module:
    layer = case.make()
    g = _gen(case.name, "weights")
    params = dict(layer.named_parameters())
    for pname, shard, shape in case.weights:
        p = params[pname]
        full = torch.randn(*shape, generator=g)
        p.weight_loader(p, full) if shard is None else p.weight_loader(p, full, shard)
    return layer


def adapters(case: Case) -> dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]]:
    g = _gen(case.name, "adapters")
    out = {}
    for slot, ranks in SLOT_RANKS[len(case.slices)].items():
        pieces = []
        for r, n in zip(ranks, case.slices):
            if r is None:
                pieces.append(None)
            elif case.kind == "embedding":  # A (r, V), B (H, r)
                pieces.append((torch.randn(r, V, generator=g), torch.randn(H, r, generator=g)))
            else:  # A (r, in), B (out, r)
                pieces.append(
                    (0.5 * torch.randn(r, case.in_size, generator=g), 0.5 * torch.randn(n, r, generator=g))
                )
        out[slot] = pieces
    return out


def inputs(case: Case) -> tuple[torch.Tensor, list[int]]:
    g = _gen(case.name, "inputs")
    if case.kind == "embedding":
        x = torch.randint(0, V, (T,), generator=g)
    else:
        x = torch.randn(T, case.in_size, generator=g)
    slots = [SLOT_POOL[i] for i in torch.randperm(T, generator=g).tolist()]
    return x, slots


def _local_input(case: Case, x: torch.Tensor) -> torch.Tensor:
    if not case.split_input:
        return x
    n = x.shape[1] // get_tp_size()
    return x[:, get_tp_rank() * n : (get_tp_rank() + 1) * n]


def pick_class(case: Case, base, cfg: LoRAConfig):
    source = LogitsProcessor(V) if case.kind == "logits" else base
    return next(c for c in LORA_LAYER_CLASSES if c.can_replace_layer(source, cfg, case.packed, None))


def run_base(case: Case) -> torch.Tensor:
    base = build_base(case)
    x, _ = inputs(case)
    with torch.inference_mode():
        if case.kind == "logits":
            return LogitsProcessor(V)(base, x)
        return base(_local_input(case, x))


def run_lora(case: Case, fully_sharded: bool) -> tuple[torch.Tensor, str]:
    cfg = LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, fully_sharded_loras=fully_sharded)
    base = build_base(case)
    cls = pick_class(case, base, cfg)
    w = cls(LogitsProcessor(V), H, CPU) if cls is LogitsProcessorWithLoRA else cls(base)
    w.create_lora_weights(MAX_LORAS, cfg)
    w.set_mapping(PunicaWrapper(MAX_LORAS, CPU))
    g = _gen(case.name, "bias")
    for slot, pieces in adapters(case).items():
        w.set_lora(slot, [p and p[0] for p in pieces], [p and p[1] for p in pieces])
        if case.lora_bias and slot == 1:
            n = len(case.slices)
            biases = [torch.randn(s, generator=g) for s in case.slices]
            w.set_extras(slot, [None] * n, biases, [None] * n)
    x, slots = inputs(case)
    mapping = LoRAMapping.build(slots, slots, CPU)
    with torch.inference_mode(), forward_context(lora=mapping):
        y = w(base, x) if case.kind == "logits" else w(_local_input(case, x))
    return y, cls.__name__


def run_all() -> dict:
    """Every case on this rank: base layer alone, default LoRA mode, fully sharded LoRA mode."""
    out = {}
    for case in CASES:
        out[f"base/{case.name}"] = (run_base(case), None)
        out[f"default/{case.name}"] = run_lora(case, False)
        out[f"sharded/{case.name}"] = run_lora(case, True)
    # a collective that crosses ranks, so a rank that skipped a case would show up as a mismatch here
    out["gathered_ranks"] = (tp_all_gather(torch.tensor([float(get_tp_rank())])), None)
    return out


def reassemble(case: Case, per_rank: list[torch.Tensor]) -> torch.Tensor:
    """The full output from each rank's local output (a replicated output must agree on every rank)."""
    tp = len(per_rank)
    layout = case.layout(tp)
    if layout is None:
        for y in per_rank[1:]:
            torch.testing.assert_close(y, per_rank[0], rtol=0, atol=0)
        return per_rank[0]
    chunks, off = [], 0
    for full, replicas in layout:
        n = full * replicas // tp  # local width of this chunk
        chunks.append(torch.cat([per_rank[r][:, off : off + n] for r in range(0, tp, replicas)], dim=-1))
        off += n
    return torch.cat(chunks, dim=-1)


def run_fp16_large_activations() -> dict:
    """Row- and column-parallel layers of a bf16 model with fp16 LoRA storage (auto's on the GPU) and
    activations whose s = A x exceeds fp16's range, in the default and the fully sharded LoRA mode (whose
    shrink and expand are PunicaWrapper.add_shrink / add_expand). This rank's outputs by "mode/layer"."""
    from loraserve.lora.ops.precision import balance_to_fp16

    K, N, R, n_tok = 64, 32, 8, 4
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    a16, b16 = balance_to_fp16(torch.randn(R, K, generator=g) * 0.5, torch.randn(N, R, generator=g) * 0.5, "t")
    x = (torch.randn(n_tok, K, generator=g) * 12000).to(torch.bfloat16)
    out = {}
    for layer, make, packed in (("row", lambda: RowParallelLinear(K, N), ["down_proj"]),
                                ("column", lambda: ColumnParallelLinear(K, N), ["up_proj"])):  # fmt: skip
        for sharded in (False, True):
            base = make().to(torch.bfloat16)
            p = base.weight
            p.weight_loader(p, W)
            cfg = LoRAConfig(max_loras=1, max_lora_rank=R, lora_dtype=torch.float16, fully_sharded_loras=sharded)
            cls = next(c for c in LORA_LAYER_CLASSES if c.can_replace_layer(base, cfg, packed, None))
            w = cls(base)
            w.create_lora_weights(1, cfg)
            w.set_mapping(PunicaWrapper(1, CPU))
            w.set_lora(0, [a16], [b16])
            xl = x
            if layer == "row":
                k = K // get_tp_size()
                xl = x[:, get_tp_rank() * k : (get_tp_rank() + 1) * k]
            with torch.inference_mode(), forward_context(lora=LoRAMapping.build([0] * n_tok, [0] * n_tok, CPU)):
                y = w(xl)
            out[f"{'sharded' if sharded else 'default'}/{layer}"] = ((y[0] if isinstance(y, tuple) else y).float(), cls.__name__)
    return out
