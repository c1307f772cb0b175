"""Every LoRA wrapper family against an independent plain-torch computation.

For each family: a base layer with random weights, 4 slots holding adapters of different ranks (1..8,
one slot left empty), ~20 tokens with random slots including -1. Per token the output must be
base(x) + concat_i B_i(A_i x) for its slot (zero for missing pieces), computed here in float64 from
the raw A/B tensors, never through loraserve's ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.nn.functional as F

from loraserve.config import LoRAConfig
from loraserve.forward_context import forward_context
from loraserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from loraserve.layers.vocab import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from loraserve.lora.layers import (
    LORA_LAYER_CLASSES,
    ColumnParallelLinearWithLoRA,
    LogitsProcessorWithLoRA,
    MergedColumnParallelLinearVariableSliceWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    ReplicatedLinearWithLoRA,
    RowParallelLinearWithLoRA,
    VocabParallelEmbeddingWithLoRA,
)
from loraserve.lora.punica import LoRAMapping, PunicaWrapper

MAX_LORAS, MAX_RANK = 4, 8
CPU = torch.device("cpu")
# every value appears at least once; slot 2 stays empty
SLOT_POOL = [-1, -1, -1, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, -1, 0, 1]
EMPTY_SLOT = 2


def fill_random(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, dtype=torch.float32).to(p.dtype))


def random_slots(seed: int, n: int = len(SLOT_POOL)) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    pool = (SLOT_POOL * (n // len(SLOT_POOL) + 1))[:n]
    return [pool[i] for i in torch.randperm(n, generator=g).tolist()]


@dataclass
class LinearCase:
    name: str
    make: object  # () -> base layer
    packed: list[str]
    cls: type
    slice_sizes: list[int]  # full output size of each LoRA slice, in concatenation order
    in_size: int
    # per set slot: per slice rank (None = no LoRA on that slice)
    slot_ranks: dict[int, list[int | None]] = field(default_factory=dict)


def _ranks(n_slices: int) -> dict[int, list[int | None]]:
    """Slots 0, 1, 3 set (2 empty); ranks differ per slot (1 and max included) and per slice; some slices None."""
    if n_slices == 1:
        return {0: [1], 1: [MAX_RANK], 3: [5]}
    if n_slices == 2:
        return {0: [1, 3], 1: [MAX_RANK, None], 3: [None, 5]}
    return {0: [1, 2, 3], 1: [MAX_RANK, None, 4], 3: [None, 5, None]}


LINEAR_CASES = [
    LinearCase(
        "replicated", lambda: ReplicatedLinear(16, 24, bias=True), ["fc"], ReplicatedLinearWithLoRA, [24], 16
    ),
    LinearCase(
        "column",
        lambda: ColumnParallelLinear(16, 24, bias=True),
        ["up"],
        ColumnParallelLinearWithLoRA,
        [24],
        16,
    ),
    LinearCase(
        "merged_as_one",  # a packed gate_up checkpoint (one LoRA over the whole fused output)
        lambda: MergedColumnParallelLinear(16, [12, 20]),
        ["gate_up_proj"],
        ColumnParallelLinearWithLoRA,
        [32],
        16,
    ),
    LinearCase(
        "merged_2",
        lambda: MergedColumnParallelLinear(16, [12, 20], bias=True),
        ["gate_proj", "up_proj"],
        MergedColumnParallelLinearWithLoRA,
        [12, 20],
        16,
    ),
    LinearCase(
        "merged_3",
        lambda: MergedColumnParallelLinear(16, [8, 12, 20]),
        ["a", "b", "c"],
        MergedColumnParallelLinearVariableSliceWithLoRA,
        [8, 12, 20],
        16,
    ),
    LinearCase(
        "qkv_packed",  # 4 q heads, 2 kv heads, head 8: q 32, k 16, v 16
        lambda: QKVParallelLinear(32, 8, 4, 2, bias=True),
        ["qkv_proj"],
        QKVParallelLinearWithLoRA,
        [64],
        32,
    ),
    LinearCase(
        "qkv_merged",
        lambda: QKVParallelLinear(32, 8, 4, 2, bias=True),
        ["q_proj", "k_proj", "v_proj"],
        MergedQKVParallelLinearWithLoRA,
        [32, 16, 16],
        32,
    ),
    LinearCase(
        "row", lambda: RowParallelLinear(24, 16, bias=True), ["down"], RowParallelLinearWithLoRA, [16], 24
    ),
]
for _c in LINEAR_CASES:
    _c.slot_ranks = _ranks(len(_c.slice_sizes))


def make_adapters(case: LinearCase, seed: int) -> dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for slot, ranks in case.slot_ranks.items():
        pieces = []
        for r, n in zip(ranks, case.slice_sizes):
            if r is None:
                pieces.append(None)
            else:
                pieces.append((torch.randn(r, case.in_size, generator=g), torch.randn(n, r, generator=g)))
        out[slot] = pieces
    return out


def build_wrapper(case: LinearCase, adapters, dtype=torch.float32):
    torch.manual_seed(0)
    base = case.make() if dtype == torch.float32 else _make_in_dtype(case, dtype)
    fill_random(base)
    w = case.cls(base)
    w.create_lora_weights(MAX_LORAS, LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK))
    w.set_mapping(PunicaWrapper(MAX_LORAS, CPU))
    for slot, pieces in adapters.items():
        a = [None if p is None else p[0] for p in pieces]
        b = [None if p is None else p[1] for p in pieces]
        if len(pieces) == 1:
            w.set_lora(slot, a[0], b[0])  # a single slice may come as a bare tensor
        else:
            w.set_lora(slot, a, b)
    return base, w


def _make_in_dtype(case: LinearCase, dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return case.make()
    finally:
        torch.set_default_dtype(prev)


def reference_delta(case: LinearCase, adapters, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """(T, sum(slice_sizes)) float64: B_slot(A_slot x) per slice, concatenated; zeros for -1/empty/None."""
    T = x.shape[0]
    delta = torch.zeros(T, sum(case.slice_sizes), dtype=torch.float64)
    xd = x.double()
    for t, s in enumerate(slots):
        if s < 0 or s not in adapters:
            continue
        off = 0
        for piece, n in zip(adapters[s], case.slice_sizes):
            if piece is not None:
                a, b = piece
                delta[t, off : off + n] = b.double() @ (a.double() @ xd[t])
            off += n
    return delta


def plain_base(base, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, base.weight, base.bias)


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.name)
def test_linear_wrapper_matches_per_token_reference(case):
    adapters = make_adapters(case, seed=1)
    base, w = build_wrapper(case, adapters)
    slots = random_slots(seed=2)
    x = torch.randn(len(slots), case.in_size)
    ref_base = plain_base(base, x)
    expected = ref_base.double() + reference_delta(case, adapters, x, slots)

    with forward_context(lora=LoRAMapping.build(slots, [], CPU)):
        got = w(x)

    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # tokens with no adapter (-1 or the empty slot) get the base output bit for bit
    no_lora = torch.tensor([s < 0 or s == EMPTY_SLOT for s in slots])
    assert torch.equal(got[no_lora], ref_base[no_lora])
    # the delta is really there for every adapter token (non-trivial test)
    for t, s in enumerate(slots):
        if s in adapters:
            assert not torch.allclose(got[t], ref_base[t])


@pytest.mark.parametrize("case", [c for c in LINEAR_CASES if len(c.slice_sizes) > 1], ids=lambda c: c.name)
def test_missing_slices_give_zero_delta_on_their_rows(case):
    adapters = make_adapters(case, seed=3)
    base, w = build_wrapper(case, adapters)
    slots = random_slots(seed=4)
    x = torch.randn(len(slots), case.in_size)
    ref_base = plain_base(base, x)
    with forward_context(lora=LoRAMapping.build(slots, [], CPU)):
        got = w(x)
    bounds = [0]
    for n in case.slice_sizes:
        bounds.append(bounds[-1] + n)
    checked = 0
    for t, s in enumerate(slots):
        for i, piece in enumerate(adapters.get(s, [None] * len(case.slice_sizes))):
            lo, hi = bounds[i], bounds[i + 1]
            if piece is None:
                assert torch.equal(got[t, lo:hi], ref_base[t, lo:hi]), (t, s, i)
                checked += 1
            else:
                assert not torch.allclose(got[t, lo:hi], ref_base[t, lo:hi]), (t, s, i)
    assert checked > 0


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.name)
def test_reset_lora_gives_base_back(case):
    adapters = make_adapters(case, seed=5)
    base, w = build_wrapper(case, adapters)
    slots = random_slots(seed=6)
    x = torch.randn(len(slots), case.in_size)
    ref_base = plain_base(base, x)
    w.reset_lora(1)
    remaining = {s: p for s, p in adapters.items() if s != 1}
    with forward_context(lora=LoRAMapping.build(slots, [], CPU)):
        got = w(x)
    rows = torch.tensor([s == 1 for s in slots])
    assert torch.equal(got[rows], ref_base[rows])
    expected = ref_base.double() + reference_delta(case, remaining, x, slots)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.name)
def test_set_lora_overwrites_a_higher_rank_adapter(case):
    """Slot 1 holds a rank-8 adapter; writing a rank-1 one there must leave nothing of the old one."""
    adapters = make_adapters(case, seed=7)
    base, w = build_wrapper(case, adapters)
    g = torch.Generator().manual_seed(8)
    new = [
        (torch.randn(1, case.in_size, generator=g), torch.randn(n, 1, generator=g)) for n in case.slice_sizes
    ]
    w.set_lora(1, [p[0] for p in new], [p[1] for p in new])
    adapters = {**adapters, 1: new}
    slots = random_slots(seed=9)
    x = torch.randn(len(slots), case.in_size)
    with forward_context(lora=LoRAMapping.build(slots, [], CPU)):
        got = w(x)
    expected = plain_base(base, x).double() + reference_delta(case, adapters, x, slots)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.name)
def test_no_mapping_is_exactly_base(case):
    adapters = make_adapters(case, seed=10)
    base, w = build_wrapper(case, adapters)
    x = torch.randn(20, case.in_size)
    ref_base = plain_base(base, x)
    assert torch.equal(w(x), ref_base)  # outside any forward context
    with forward_context():  # a context without a LoRA mapping
        assert torch.equal(w(x), ref_base)
    with forward_context(lora=LoRAMapping.build([-1] * 20, [-1] * 3, CPU)):
        assert torch.equal(w(x), ref_base)


# ---- bf16 base, fp32 LoRA: bf16(fp32(base(x)) + fp32 delta) ------------------------------------------


def assert_bf16_rounding_close(got: torch.Tensor, exact: torch.Tensor) -> None:
    """got is bf16; exact the fp64 value whose bf16 rounding is expected. Allow 1 bf16 ulp (a tie may flip)."""
    assert got.dtype == torch.bfloat16
    expected = exact.to(torch.bfloat16)
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    diff = (got.float() - expected.float()).abs()
    assert (diff <= ulp).all(), f"max excess over 1 ulp: {(diff - ulp).max()}"
    assert (diff == 0).float().mean() > 0.95, "most elements must round exactly as the reference"


@pytest.mark.parametrize("case", [LINEAR_CASES[i] for i in (0, 3, 6, 7)], ids=lambda c: c.name)
def test_bf16_base_fp32_lora_rounds_once(case):
    adapters = make_adapters(case, seed=11)
    base, w = build_wrapper(case, adapters, dtype=torch.bfloat16)
    assert base.weight.dtype == torch.bfloat16 and w.lora_a_stacked[0].dtype == torch.float32
    slots = random_slots(seed=12)
    x = torch.randn(len(slots), case.in_size).to(torch.bfloat16)
    base_bf16 = base(x)  # the base layer's own bf16 output (its parity with nn.Linear is tested below)
    exact = base_bf16.double() + reference_delta(case, adapters, x.float(), slots)
    with forward_context(lora=LoRAMapping.build(slots, [], CPU)):
        got = w(x)
    assert_bf16_rounding_close(got, exact)
    no_lora = torch.tensor([s < 0 or s == EMPTY_SLOT for s in slots])
    assert torch.equal(got[no_lora], base_bf16[no_lora])
    # the mixed rule (round the delta to bf16 first, then add in bf16) must be distinguishable here
    mixed = base_bf16 + reference_delta(case, adapters, x.float(), slots).to(torch.bfloat16)
    assert not torch.equal(got, mixed)


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.name)
def test_bf16_base_layer_equals_nn_linear(case):
    """HF's nn.Linear is F.linear(x, W, b): one rounding with the bias. At TP=1 the base layer must match it
    bit for bit, or bf16(base + delta) cannot equal PEFT's."""
    torch.manual_seed(0)
    base = _make_in_dtype(case, torch.bfloat16)
    fill_random(base)
    x = torch.randn(20, case.in_size).to(torch.bfloat16)
    got, ref = base(x), F.linear(x, base.weight, base.bias)
    assert torch.equal(got, ref), (
        f"{(got != ref).float().mean():.0%} of elements differ, max {(got.float() - ref.float()).abs().max()}"
    )


@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.float16])
def test_gemm_shrink_rows_follow_set_and_reset(lora_dtype):
    """A row-parallel layer's A as more rows of its bf16 weight (``gemm_shrink_rows``, the GEMM that computes
    the deferred delta's shrink): pieces in W's dtype whose sum is every slot's A (exactly for fp16 A, to 16
    significant bits for fp32), rewritten in place by set_lora and reset_lora (a captured graph reads them)."""
    case = LINEAR_CASES[-1]
    assert case.cls is RowParallelLinearWithLoRA
    adapters = make_adapters(case, seed=21)
    torch.manual_seed(0)
    base = _make_in_dtype(case, torch.bfloat16)
    w = case.cls(base)
    w.create_lora_weights(MAX_LORAS, LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, lora_dtype=lora_dtype))
    assert w.lora_a_stacked[0].dtype == lora_dtype
    for slot, ((a, b),) in adapters.items():
        w.set_lora(slot, a, b)

    def assert_rows_are_a(rows: torch.Tensor) -> None:
        a = w.lora_a_stacked[0][:, 0].double()
        assert rows.dtype == torch.bfloat16 and rows.shape == (2, MAX_LORAS, MAX_RANK, case.in_size)
        tol = 0.0 if lora_dtype == torch.float16 else 2.0**-16
        torch.testing.assert_close(rows.double().sum(0), a, rtol=tol, atol=0)

    rows = w.gemm_shrink_rows()
    assert_rows_are_a(rows)
    assert rows[:, EMPTY_SLOT].abs().sum() == 0, "an empty slot's rows are zero"
    g = torch.Generator().manual_seed(22)
    w.set_lora(EMPTY_SLOT, torch.randn(3, case.in_size, generator=g), torch.randn(16, 3, generator=g))
    assert w.gemm_shrink_rows().data_ptr() == rows.data_ptr(), "written in place"
    assert rows[:, EMPTY_SLOT, :3].abs().sum() > 0 and rows[:, EMPTY_SLOT, 3:].abs().sum() == 0
    assert_rows_are_a(rows)
    w.reset_lora(1)
    assert rows[:, 1].abs().sum() == 0, "reset_lora zeroes the slot's rows"
    assert_rows_are_a(rows)


def test_gemm_shrink_rows_take_one_piece_where_every_active_slot_has_a_in_ws_dtype():
    """Where every slot of the step has its A exactly in W's dtype (bf16 numbers stored in fp16), ``gemm_shrink_rows``
    is the first piece alone (the second is zeros there); an active slot whose A is not, or no mapping, gives both.
    The mapping's ``a_exact_in_w`` (a CUDA graph's key) decides where set; reset_lora makes a slot exact (zeros)."""
    case = LINEAR_CASES[-1]
    assert case.cls is RowParallelLinearWithLoRA
    torch.manual_seed(0)
    w = case.cls(_make_in_dtype(case, torch.bfloat16))
    w.create_lora_weights(MAX_LORAS, LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, lora_dtype=torch.float16))
    g = torch.Generator().manual_seed(23)
    b = torch.randn(16, 4, generator=g)
    w.set_lora(0, torch.randn(4, case.in_size, generator=g).to(torch.bfloat16).float(), b)
    w.set_lora(1, torch.randn(4, case.in_size, generator=g), b)  # fp32 numbers: fp16's 11 bits, not bf16's 8
    assert w.slot_a_exact_in_w[:2] == [True, False]
    full = w.gemm_shrink_rows()
    assert len(full) == 2 and full[1, 0].abs().sum() == 0 and full[1, 1].abs().sum() > 0

    def rows_for(slots, a_exact=None):
        with forward_context(lora=replace(LoRAMapping.build(slots, slots, CPU), a_exact_in_w=a_exact)):
            return w.gemm_shrink_rows()

    one = rows_for([0, -1, 0])
    assert one.shape == (1, *full.shape[1:]) and one.data_ptr() == full.data_ptr(), "the first piece, a view"
    assert len(rows_for([0, 1])) == 2 and len(rows_for([0], a_exact=False)) == 2
    assert len(rows_for([0, 1], a_exact=True)) == 1, "the graph's key decides"
    w.reset_lora(1)
    assert w.slot_a_exact_in_w[1] and len(rows_for([0, 1])) == 1


# ---- embedding ----------------------------------------------------------------------------------------

V, H = 50, 16
EMB_RANKS = {0: 1, 1: MAX_RANK, 3: 5}


def make_embedding(dtype=torch.float32):
    torch.manual_seed(0)
    base = VocabParallelEmbedding(V, H, params_dtype=dtype)
    fill_random(base)
    w = VocabParallelEmbeddingWithLoRA(base)
    w.create_lora_weights(MAX_LORAS, LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK))
    w.set_mapping(PunicaWrapper(MAX_LORAS, CPU))
    g = torch.Generator().manual_seed(13)
    adapters = {
        s: (torch.randn(r, V, generator=g), torch.randn(H, r, generator=g)) for s, r in EMB_RANKS.items()
    }
    for s, (a, b) in adapters.items():
        w.set_lora(s, a, b)
    return base, w, adapters


def embedding_reference(base, adapters, ids, slots) -> tuple[torch.Tensor, torch.Tensor]:
    base_out = base.weight[ids]  # (T, H)
    delta = torch.zeros(len(slots), H, dtype=torch.float64)
    for t, s in enumerate(slots):
        if s in adapters:
            a, b = adapters[s]
            delta[t] = b.double() @ a.double()[:, ids[t]]
    return base_out, delta


def test_embedding_matches_per_token_reference():
    base, w, adapters = make_embedding()
    slots = random_slots(seed=14)
    ids = torch.randint(0, V, (len(slots),), generator=torch.Generator().manual_seed(15))
    base_out, delta = embedding_reference(base, adapters, ids, slots)
    with forward_context(lora=LoRAMapping.build(slots, [], CPU)):
        got = w(ids)
    torch.testing.assert_close(got.double(), base_out.double() + delta, atol=1e-5, rtol=1e-5)
    no_lora = torch.tensor([s not in adapters for s in slots])
    assert torch.equal(got[no_lora], base_out[no_lora])
    assert torch.equal(w(ids), base_out)
    with forward_context(lora=LoRAMapping.build([-1] * len(slots), [], CPU)):
        assert torch.equal(w(ids), base_out)
    w.reset_lora(3)
    with forward_context(lora=LoRAMapping.build(slots, [], CPU)):
        got = w(ids)
    rows = torch.tensor([s == 3 for s in slots])
    assert torch.equal(got[rows], base_out[rows])


def test_embedding_bf16_base_rounds_once():
    base, w, adapters = make_embedding(torch.bfloat16)
    slots = random_slots(seed=16)
    ids = torch.randint(0, V, (len(slots),), generator=torch.Generator().manual_seed(17))
    base_out, delta = embedding_reference(base, adapters, ids, slots)
    with forward_context(lora=LoRAMapping.build(slots, [], CPU)):
        got = w(ids)
    assert_bf16_rounding_close(got, base_out.double() + delta)


# ---- logits (lm_head LoRA) ----------------------------------------------------------------------------


def make_logits(dtype=torch.float32):
    torch.manual_seed(0)
    lm_head = ParallelLMHead(V, H, params_dtype=dtype)
    fill_random(lm_head)
    w = LogitsProcessorWithLoRA(LogitsProcessor(V), H, CPU)
    w.create_lora_weights(MAX_LORAS, LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK))
    w.set_mapping(PunicaWrapper(MAX_LORAS, CPU))
    g = torch.Generator().manual_seed(18)
    adapters = {
        s: (torch.randn(r, H, generator=g), torch.randn(V, r, generator=g)) for s, r in EMB_RANKS.items()
    }
    for s, (a, b) in adapters.items():
        w.set_lora(s, [a], [b])
    return lm_head, w, adapters


def logits_reference(lm_head, adapters, hidden, logit_slots):
    base = F.linear(hidden, lm_head.weight)
    delta = torch.zeros(hidden.shape[0], V, dtype=torch.float64)
    for t, s in enumerate(logit_slots):
        if s in adapters:
            a, b = adapters[s]
            delta[t] = b.double() @ (a.double() @ hidden[t].double())
    return base, delta


def test_logits_use_logit_slots_per_row():
    lm_head, w, adapters = make_logits()
    token_slots = random_slots(seed=19)
    # logits rows are a different set than tokens (e.g. last token of each sequence), with other slots
    logit_slots = [3, -1, 0, 1, 2, 1, 3]
    hidden = torch.randn(len(logit_slots), H)
    base, delta = logits_reference(lm_head, adapters, hidden, logit_slots)
    with forward_context(lora=LoRAMapping.build(token_slots, logit_slots, CPU)):
        got = w(lm_head, hidden)
    assert got.dtype == torch.float32 and got.shape == (len(logit_slots), V)
    torch.testing.assert_close(got.double(), base.double() + delta, atol=1e-5, rtol=1e-5)
    for t, s in enumerate(logit_slots):
        if s in adapters:
            assert not torch.allclose(got[t], base[t])
        else:
            assert torch.equal(got[t], base[t])
    # no mapping / all -1 logit rows (even with LoRA tokens) -> exactly base
    assert torch.equal(w(lm_head, hidden), base)
    with forward_context(lora=LoRAMapping.build(token_slots, [-1] * len(logit_slots), CPU)):
        assert torch.equal(w(lm_head, hidden), base)
    # logit rows with adapters while no token carries one still get the lm_head delta
    with forward_context(lora=LoRAMapping.build([-1] * len(token_slots), logit_slots, CPU)):
        torch.testing.assert_close(w(lm_head, hidden).double(), base.double() + delta, atol=1e-5, rtol=1e-5)
    w.reset_lora(0)
    with forward_context(lora=LoRAMapping.build(token_slots, logit_slots, CPU)):
        got = w(lm_head, hidden)
    assert torch.equal(got[2], base[2])


def test_logits_bf16_lm_head_rounds_once():
    lm_head, w, adapters = make_logits(torch.bfloat16)
    logit_slots = [3, -1, 0, 1, 2, 1, 3, 0]
    hidden = torch.randn(len(logit_slots), H).to(torch.bfloat16)
    base, delta = logits_reference(lm_head, adapters, hidden, logit_slots)
    with forward_context(lora=LoRAMapping.build(logit_slots, logit_slots, CPU)):
        got = w(lm_head, hidden)
    assert got.dtype == torch.float32  # handed to the sampler in fp32, after one bf16 rounding
    assert_bf16_rounding_close(got.to(torch.bfloat16), base.double() + delta)
    assert torch.equal(got.to(torch.bfloat16).float(), got)


def test_vocab_wrappers_skip_their_delta_where_no_active_slot_has_a_rank():
    """The embedding and the lm_head add no delta where none of the step's slots has a rank there (slot 2 is empty):
    the base output, the same bits, and no punica call; the mapping's ``vocab_lora`` (a CUDA graph's key) decides
    instead where set: False skips the slots' real deltas, True runs the launches (adding zeros: the same bits)."""
    base, emb, _ = make_embedding(torch.bfloat16)
    lm_head, logits, _ = make_logits(torch.bfloat16)
    calls = []
    for w, name in ((emb, "add_lora_embedding"), (logits, "add_lora_logits")):
        real = getattr(w.punica_wrapper, name)
        setattr(w.punica_wrapper, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    ids = torch.tensor([5, 9, 2])
    hidden = torch.randn(3, H).to(torch.bfloat16)
    base_emb, base_logits = base.weight[ids], F.linear(hidden, lm_head.weight).float()

    def run(slots, vocab_lora=None, logit_slots=None):
        calls.clear()
        mapping = replace(LoRAMapping.build(slots, logit_slots or slots, CPU), vocab_lora=vocab_lora)
        with forward_context(lora=mapping):
            return emb(ids), logits(lm_head, hidden)

    got_emb, got_logits = run([2, -1, 2])
    assert calls == [] and torch.equal(got_emb, base_emb) and torch.equal(got_logits, base_logits)
    got_emb, got_logits = run([2, -1, 2], vocab_lora=True)
    assert calls == ["add_lora_embedding", "add_lora_logits"]
    assert torch.equal(got_emb, base_emb) and torch.equal(got_logits, base_logits), "zero ranks add exactly zero"
    got_emb, got_logits = run([2, 1, 2])
    assert calls == ["add_lora_embedding", "add_lora_logits"]
    assert not torch.equal(got_emb[1], base_emb[1]) and not torch.equal(got_logits[1], base_logits[1])
    got_emb, got_logits = run([2, 1, 2], vocab_lora=False)
    assert calls == [] and torch.equal(got_emb, base_emb) and torch.equal(got_logits, base_logits)
    # each wrapper looks at its own rows' slots: the embedding at the tokens', the lm_head at the logits rows'
    got_emb, got_logits = run([2, 2, 2], logit_slots=[1, -1, 2])
    assert calls == ["add_lora_logits"] and torch.equal(got_emb, base_emb) and not torch.equal(got_logits, base_logits)
    logits.reset_lora(1)  # slot 1: a rank in the embedding only
    got_emb, got_logits = run([1, -1, 2], logit_slots=[1, 1, 2])
    assert calls == ["add_lora_embedding"] and not torch.equal(got_emb, base_emb) and torch.equal(got_logits, base_logits)


# ---- can_replace_layer: exactly one class claims each case ----------------------------------------------


def _claimants(layer, packed):
    cfg = LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK)
    return [c for c in LORA_LAYER_CLASSES if c.can_replace_layer(layer, cfg, packed, None)]


REPLACE_CASES = [
    ("replicated", lambda: ReplicatedLinear(16, 24), ["fc"], ReplicatedLinearWithLoRA),
    ("column", lambda: ColumnParallelLinear(16, 24), ["up"], ColumnParallelLinearWithLoRA),
    (
        "merged_as_one",
        lambda: MergedColumnParallelLinear(16, [12, 20]),
        ["gate_up_proj"],
        ColumnParallelLinearWithLoRA,
    ),
    (
        "merged_2",
        lambda: MergedColumnParallelLinear(16, [12, 20]),
        ["gate_proj", "up_proj"],
        MergedColumnParallelLinearWithLoRA,
    ),
    (
        "merged_3",
        lambda: MergedColumnParallelLinear(16, [8, 12, 20]),
        ["a", "b", "c"],
        MergedColumnParallelLinearVariableSliceWithLoRA,
    ),
    (
        "merged_4",
        lambda: MergedColumnParallelLinear(16, [8, 8, 12, 20]),
        ["a", "b", "c", "d"],
        MergedColumnParallelLinearVariableSliceWithLoRA,
    ),
    ("qkv_packed", lambda: QKVParallelLinear(32, 8, 4, 2), ["qkv_proj"], QKVParallelLinearWithLoRA),
    (
        "qkv_merged",
        lambda: QKVParallelLinear(32, 8, 4, 2),
        ["q_proj", "k_proj", "v_proj"],
        MergedQKVParallelLinearWithLoRA,
    ),
    ("row", lambda: RowParallelLinear(24, 16), ["down"], RowParallelLinearWithLoRA),
    ("embedding", lambda: VocabParallelEmbedding(V, H), ["embed_tokens"], VocabParallelEmbeddingWithLoRA),
    ("logits", lambda: LogitsProcessor(V), ["lm_head"], LogitsProcessorWithLoRA),
]


@pytest.mark.parametrize("name,make,packed,expected", REPLACE_CASES, ids=[c[0] for c in REPLACE_CASES])
def test_exactly_one_class_claims(name, make, packed, expected):
    assert _claimants(make(), packed) == [expected]


@pytest.mark.parametrize(
    "make,packed",
    [
        (lambda: ParallelLMHead(V, H), ["lm_head"]),  # its LoRA lives on the logits processor
        (lambda: MergedColumnParallelLinear(16, [12, 20]), ["a", "b", "c"]),  # more names than outputs
        (lambda: MergedColumnParallelLinear(16, [8, 12, 20]), ["a", "b"]),  # fewer names than outputs
        (lambda: QKVParallelLinear(32, 8, 4, 2), ["q_proj", "k_proj"]),
    ],
    ids=["lm_head", "merged_2_given_3", "merged_3_given_2", "qkv_given_2"],
)
def test_no_class_claims_mismatched_layers(make, packed):
    assert _claimants(make(), packed) == []
