"""Adapter key -> module mapping through LoRAManager on a model with two stacks of identical layer names.

A small "vision tower" and a language model both have ``layers.N.self_attn.q_proj`` / ``o_proj`` /
``mlp.gate_up_proj``. Adapters are written by hand (PEFT's file format) and the wrapped modules are
compared with plain torch on their base weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

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
from loraserve.lora.errors import LoRAError, LoRAUnknownModuleError
from loraserve.lora.layers import BaseLayerWithLoRA
from loraserve.lora.manager import LoRAManager
from loraserve.lora.request import LoRARequest
from loraserve.models.interfaces import SupportsLoRA

H, INTER, V, N_LAYERS, RANK, ALPHA = 16, 24, 40, 2, 4, 8
SCALE = ALPHA / RANK
CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, q_cls):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = q_cls(H, H)
        self.self_attn.o_proj = RowParallelLinear(H, H)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(H, [INTER, INTER])


class Stack(nn.Module):
    def __init__(self, q_cls, with_embedding: bool):
        super().__init__()
        if with_embedding:
            self.embed_tokens = VocabParallelEmbedding(V, H)
        self.layers = nn.ModuleList(Block(q_cls) for _ in range(N_LAYERS))


class TwoStackModel(nn.Module, SupportsLoRA):
    """Default hooks: every LoRA-capable module of both stacks may carry LoRA, keyed by its full path."""

    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    lm_attr = "model"

    def __init__(self):
        super().__init__()
        self.vision_tower = Stack(ReplicatedLinear, with_embedding=False)
        setattr(self, self.lm_attr, Stack(ColumnParallelLinear, with_embedding=True))
        self.lm_head = ParallelLMHead(V, H)
        self.logits_processor = LogitsProcessor(V)
        torch.manual_seed(0)
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape))


class HookedModel(TwoStackModel):
    """The tower never carries LoRA; the LM lives at ``language_model`` but adapters call it ``model``."""

    lm_attr = "language_model"

    def should_apply_lora(self, module_name: str) -> bool:
        return not module_name.startswith("vision_tower.")

    def map_lora_module_name(self, module_name: str) -> str | None:
        name = super().map_lora_module_name(module_name)
        if name.startswith("language_model."):
            return "model." + name[len("language_model.") :]
        return name


def write_adapter(path: Path, modules: dict[str, tuple[torch.Tensor, torch.Tensor]], embeddings=()) -> Path:
    """PEFT layout: adapter_config.json + adapter_model.safetensors; names in ``embeddings`` use lora_embedding_A/B."""
    path.mkdir(parents=True)
    tensors = {}
    for name, (a, b) in modules.items():
        if name in embeddings:
            tensors[f"base_model.model.{name}.lora_embedding_A"] = a.contiguous()
            tensors[f"base_model.model.{name}.lora_embedding_B"] = b.contiguous()
        else:
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    cfg = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": sorted({n.rpartition(".")[2] for n in modules}),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def random_lora(g, n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(RANK, n_in, generator=g), torch.randn(n_out, RANK, generator=g)


def stack_loras(g, prefix: str, with_up: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """q_proj, o_proj and gate_proj (up_proj only if asked) of every layer under prefix."""
    out = {}
    for i in range(N_LAYERS):
        out[f"{prefix}.layers.{i}.self_attn.q_proj"] = random_lora(g, H, H)
        out[f"{prefix}.layers.{i}.self_attn.o_proj"] = random_lora(g, H, H)
        out[f"{prefix}.layers.{i}.mlp.gate_proj"] = random_lora(g, H, INTER)
        if with_up:
            out[f"{prefix}.layers.{i}.mlp.up_proj"] = random_lora(g, H, INTER)
    return out


def make_manager(model, **cfg) -> LoRAManager:
    return LoRAManager(
        model, LoRAConfig(max_loras=2, max_lora_rank=8, **cfg), SimpleNamespace(hidden_size=H), CPU
    )


def delta(lora, x) -> torch.Tensor:
    a, b = lora
    return SCALE * (x.double() @ a.double().t() @ b.double().t())


def base_linear(module, x):
    base = module.base_layer if isinstance(module, BaseLayerWithLoRA) else module
    return F.linear(x, base.weight, base.bias)


def check_stack(model, our_prefix: str, adapter_prefix: str, loras: dict, x, rows: torch.Tensor) -> int:
    """Each linear of the stack: rows with the adapter get base + its delta (zero for a missing piece); others base.
    Returns how many (module, slice) pairs carried a delta."""
    n_delta = 0
    for i in range(N_LAYERS):
        layer = model.get_submodule(f"{our_prefix}.layers.{i}")
        for module, pieces, sizes in (
            (layer.self_attn.q_proj, ["self_attn.q_proj"], [H]),
            (layer.self_attn.o_proj, ["self_attn.o_proj"], [H]),
            (layer.mlp.gate_up_proj, ["mlp.gate_proj", "mlp.up_proj"], [INTER, INTER]),
        ):
            got = module(x)
            base = base_linear(module, x)
            expected = base.double().clone()
            off = 0
            for piece, n in zip(pieces, sizes):
                lora = loras.get(f"{adapter_prefix}.layers.{i}.{piece}")
                if lora is not None:
                    expected[rows, off : off + n] += delta(lora, x[rows])
                    n_delta += 1
                off += n
            if torch.equal(expected, base.double()):
                assert torch.equal(got, base), f"{our_prefix}.layers.{i}.{pieces} changed without an adapter"
            else:
                torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
                assert torch.equal(got[~rows], base[~rows])
    return n_delta


TOKEN_IDS = [1, 0, 1, 1, 0, 1, 1]  # lora_int_id per token (0 = base)


def test_lm_adapter_leaves_identically_named_tower_untouched(tmp_path):
    model = TwoStackModel()
    mgr = make_manager(model)
    # both stacks are wrapped (default hooks), and stay separate modules
    assert isinstance(model.vision_tower.layers[0].self_attn.q_proj, BaseLayerWithLoRA)
    assert isinstance(model.model.layers[0].self_attn.q_proj, BaseLayerWithLoRA)
    g = torch.Generator().manual_seed(1)
    loras = stack_loras(g, "model")
    emb = (torch.randn(RANK, V, generator=g), torch.randn(H, RANK, generator=g))
    head = random_lora(g, H, V)
    path = write_adapter(
        tmp_path / "lm",
        {**loras, "model.embed_tokens": emb, "lm_head": head},
        embeddings={"model.embed_tokens"},
    )
    assert mgr.add_adapter(LoRARequest("lm", 1, str(path)))

    T = len(TOKEN_IDS)
    rows = torch.tensor([i == 1 for i in TOKEN_IDS])
    x = torch.randn(T, H)
    ids = torch.randint(0, V, (T,), generator=g)
    logit_ids = [1, 0, 1]
    hidden = torch.randn(len(logit_ids), H)
    mapping = mgr.prepare_mapping(TOKEN_IDS, logit_ids)
    assert mapping is not None and mapping.has_lora
    with forward_context(lora=mapping):
        assert check_stack(model, "vision_tower", "vision_tower", {}, x, rows) == 0
        assert check_stack(model, "model", "model", loras, x, rows) == 3 * N_LAYERS  # q, o, gate; up missing
        # embedding: E[ids] + s * B A[:, ids]
        e = model.model.embed_tokens
        got = e(ids)
        base = e.base_layer.weight[ids]
        expected = base.double().clone()
        expected[rows] += SCALE * (emb[0].double()[:, ids[rows]].t() @ emb[1].double().t())
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
        # lm_head on the logits rows
        logits = model.logits_processor(model.lm_head, hidden)
        base = F.linear(hidden, model.lm_head.weight)
        lrows = torch.tensor([i == 1 for i in logit_ids])
        expected = base.double().clone()
        expected[lrows] += delta(head, hidden[lrows])
        torch.testing.assert_close(logits.double(), expected, atol=1e-4, rtol=1e-5)
        assert torch.equal(logits[~lrows], base[~lrows])


def test_tower_adapter_leaves_lm_untouched(tmp_path):
    model = TwoStackModel()
    mgr = make_manager(model)
    g = torch.Generator().manual_seed(2)
    loras = stack_loras(g, "vision_tower", with_up=True)
    mgr.add_adapter(LoRARequest("tower", 1, str(write_adapter(tmp_path / "tower", loras))))
    x = torch.randn(len(TOKEN_IDS), H)
    rows = torch.tensor([i == 1 for i in TOKEN_IDS])
    with forward_context(lora=mgr.prepare_mapping(TOKEN_IDS, [1])):
        assert check_stack(model, "model", "model", {}, x, rows) == 0
        assert check_stack(model, "vision_tower", "vision_tower", loras, x, rows) == 4 * N_LAYERS


def test_hooks_exclude_tower_and_rename_lm(tmp_path):
    model = HookedModel()
    mgr = make_manager(model)
    for m in model.vision_tower.modules():
        assert not isinstance(m, BaseLayerWithLoRA)
    assert isinstance(model.language_model.layers[0].self_attn.q_proj, BaseLayerWithLoRA)

    g = torch.Generator().manual_seed(3)
    loras = stack_loras(g, "model", with_up=True)  # HF names; lands on language_model.*
    assert mgr.add_adapter(LoRARequest("lm", 1, str(write_adapter(tmp_path / "lm", loras))))
    x = torch.randn(len(TOKEN_IDS), H)
    rows = torch.tensor([i == 1 for i in TOKEN_IDS])
    with forward_context(lora=mgr.prepare_mapping(TOKEN_IDS, [])):
        assert check_stack(model, "language_model", "model", loras, x, rows) == 4 * N_LAYERS
        for i in range(N_LAYERS):  # the tower, never wrapped, is the plain base
            q = model.vision_tower.layers[i].self_attn.q_proj
            assert torch.equal(q(x), F.linear(x, q.weight))


@pytest.mark.parametrize(
    "name",
    [
        "vision_tower.layers.0.self_attn.q_proj",  # excluded by should_apply_lora
        "vision_tower.layers.1.mlp.gate_proj",
        "language_model.layers.0.self_attn.q_proj",  # our path, not the name adapters use
    ],
)
def test_hooks_refuse_adapter_on_excluded_module(tmp_path, name):
    model = HookedModel()
    mgr = make_manager(model)
    g = torch.Generator().manual_seed(4)
    loras = {
        "model.layers.0.self_attn.q_proj": random_lora(g, H, H),
        name: random_lora(g, H, INTER if "gate" in name else H),
    }
    path = write_adapter(tmp_path / "bad", loras)
    with pytest.raises(LoRAUnknownModuleError) as e:
        mgr.add_adapter(LoRARequest("bad", 1, str(path)))
    assert isinstance(e.value, LoRAError)
    assert name in str(e.value) and "'bad'" in str(e.value)
    assert mgr.list_adapters() == []  # nothing registered
    assert mgr.prepare_mapping([0, 0], [0]) is None


def test_target_modules_restriction(tmp_path):
    model = TwoStackModel()
    mgr = make_manager(model, lora_target_modules=["q_proj", "up_proj"])
    lm0 = model.model.layers[0]
    assert isinstance(lm0.self_attn.q_proj, BaseLayerWithLoRA)
    assert isinstance(lm0.mlp.gate_up_proj, BaseLayerWithLoRA)  # up_proj piece kept
    assert type(lm0.self_attn.o_proj) is RowParallelLinear  # restricted away: not wrapped
    assert type(model.model.embed_tokens) is VocabParallelEmbedding

    g = torch.Generator().manual_seed(5)
    for bad in ("model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.o_proj"):
        loras = {
            "model.layers.0.self_attn.q_proj": random_lora(g, H, H),
            bad: random_lora(g, H, INTER if "gate" in bad else H),
        }
        with pytest.raises(LoRAUnknownModuleError, match="--lora-target-modules") as e:
            mgr.add_adapter(LoRARequest("restricted", 1, str(write_adapter(tmp_path / bad, loras))))
        assert bad in str(e.value)
    assert mgr.list_adapters() == []

    # an adapter within the restriction is served, the up_proj piece included and the gate rows untouched
    loras = {
        "model.layers.0.self_attn.q_proj": random_lora(g, H, H),
        "model.layers.1.mlp.up_proj": random_lora(g, H, INTER),
    }
    assert mgr.add_adapter(LoRARequest("ok", 2, str(write_adapter(tmp_path / "ok", loras))))
    x = torch.randn(len(TOKEN_IDS), H)
    ids = [2 if i else 0 for i in TOKEN_IDS]
    rows = torch.tensor([i == 2 for i in ids])
    with forward_context(lora=mgr.prepare_mapping(ids, [])):
        assert check_stack(model, "model", "model", loras, x, rows) == 2
        assert check_stack(model, "vision_tower", "vision_tower", {}, x, rows) == 0


class FusedTowerModel(nn.Module, SupportsLoRA):
    """Both stacks have a ``qkv_proj``: the LM's packs q/k/v (QKVParallelLinear), the tower's is one plain
    fused linear whose adapters carry a single LoRA under ``...qkv_proj``. Packing is the LM's, not the tower's."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self):
        super().__init__()
        self.vision_tower = nn.Module()
        self.vision_tower.qkv_proj = ReplicatedLinear(H, 3 * H)
        self.model = nn.Module()
        self.model.qkv_proj = QKVParallelLinear(H, 4, 4, 2)
        torch.manual_seed(0)
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape))


def test_packed_mapping_of_one_stack_does_not_split_an_unpacked_namesake(tmp_path):
    model = FusedTowerModel()
    mgr = make_manager(model)
    g = torch.Generator().manual_seed(6)
    # the tower's fused linear takes one LoRA over its whole output
    lora = random_lora(g, H, 3 * H)
    mgr.add_adapter(
        LoRARequest("tower", 1, str(write_adapter(tmp_path / "tower", {"vision_tower.qkv_proj": lora})))
    )
    x = torch.randn(3, H)
    with forward_context(lora=mgr.prepare_mapping([1, 1, 1], [])):
        got = model.vision_tower.qkv_proj(x)
    expected = base_linear(model.vision_tower.qkv_proj, x).double() + delta(lora, x)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


def test_adapter_on_nonexistent_piece_of_unpacked_namesake_is_a_lora_error(tmp_path):
    """``vision_tower.k_proj`` does not exist (the tower's qkv is one linear): refused with a LoRAError, not a crash."""
    model = FusedTowerModel()
    mgr = make_manager(model)
    g = torch.Generator().manual_seed(7)
    path = write_adapter(tmp_path / "bad", {"vision_tower.k_proj": random_lora(g, H, H)})
    with pytest.raises(LoRAError):
        mgr.add_adapter(LoRARequest("bad", 1, str(path)))
