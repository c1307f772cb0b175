"""Lay a parsed adapter out for our wrapped modules, validating it against the model.

Per wrapped module: the (A, B) of each slice (packed q/k/v or gate/up pieces; None = zeros) and the
PEFT extras that ride along: DoRA magnitudes, scaled lora_B biases, replacement biases
(``bias="all"/"lora_only"``), replacement embedding / lm_head weights (``modules_to_save`` and saved
embedding copies that differ from the base), trainable-token rows. Every tensor of the adapter must
land somewhere, or the adapter is refused naming the module.

Tied embeddings follow PEFT: a saved ``base_layer.weight`` copy is loaded into the one shared weight
(the lm_head copy wins when both are saved), so it replaces both modules; ``modules_to_save``
copies are untied; trainable tokens on the input embedding also replace the logits columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from loraserve.lora.errors import LoRAShapeError, LoRAUnknownModuleError, LoRAUnsupportedFeatureError
from loraserve.lora.layers import (
    BaseLayerWithLoRA,
    FusedMoEWithLoRA,
    LogitsProcessorWithLoRA,
    VocabParallelEmbeddingWithLoRA,
)
from loraserve.lora.mapping import LoRATarget, describe_unknown_module
from loraserve.lora.peft import LoRAAdapter, LoRAModuleWeights
from loraserve.lora.request import LoRARequest


@dataclass
class ModulePack:
    """One wrapped module's share of an adapter."""

    a: list[torch.Tensor | None]
    b: list[torch.Tensor | None]
    magnitudes: list[torch.Tensor | None]
    lora_biases: list[torch.Tensor | None]
    bias_replacements: list[torch.Tensor | None]
    weight: torch.Tensor | None = None  # vocab modules: full replacement weight
    tokens: tuple[list[int], torch.Tensor] | None = None  # vocab modules: trainable tokens

    @property
    def has_linear_extras(self) -> bool:
        return any(v is not None for v in self.magnitudes + self.lora_biases + self.bias_replacements)

    def write(self, module: BaseLayerWithLoRA, slot: int, lm_head_weight: torch.Tensor | None) -> None:
        module.set_lora(slot, self.a, self.b)
        if isinstance(module, (VocabParallelEmbeddingWithLoRA, LogitsProcessorWithLoRA)):
            ids, rows = self.tokens if self.tokens is not None else (None, None)
            kw = dict(weight=self.weight, token_ids=ids, token_rows=rows, magnitude=self.magnitudes[0])
            if self.weight is not None or self.tokens is not None or self.magnitudes[0] is not None:
                if isinstance(module, LogitsProcessorWithLoRA):
                    module.set_extras(slot, lm_head_weight, **kw)
                else:
                    module.set_extras(slot, **kw)
        elif self.has_linear_extras:
            module.set_extras(slot, self.magnitudes, self.lora_biases, self.bias_replacements)


@dataclass
class PackedAdapter:
    """An adapter laid out for our modules: module path -> ModulePack."""

    request: LoRARequest
    adapter: LoRAAdapter
    per_module: dict[str, ModulePack] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.adapter.nbytes


def _where(req: LoRARequest, name: str) -> str:
    return f"adapter {req.lora_name!r} ({req.lora_path}), module {name!r}"


def _check_shape(req: LoRARequest, name: str, w: LoRAModuleWeights, shape: tuple[int, int], is_embedding: bool) -> None:
    if w.is_embedding != is_embedding:
        kind = "an embedding" if is_embedding else "a linear layer"
        raise LoRAShapeError(f"{_where(req, name)}: the base module is {kind} but the adapter has the other kind of LoRA")
    a_cols, b_rows = shape
    if w.lora_a.shape[1] != a_cols or w.lora_b.shape[0] != b_rows:
        what = "vocab, hidden" if is_embedding else "in, out"
        raise LoRAShapeError(
            f"{_where(req, name)}: LoRA shapes A{tuple(w.lora_a.shape)} B{tuple(w.lora_b.shape)} do not fit the "
            f"base module ({what}) = {shape}; was the adapter trained for another base model?"
        )
    out_features = shape[1] if is_embedding else b_rows
    for what, v in (("lora_magnitude_vector", w.magnitude), ("lora_B.bias", w.lora_bias)):
        if v is not None and tuple(v.shape) != (out_features,):
            raise LoRAShapeError(f"{_where(req, name)}: {what} has shape {tuple(v.shape)}, expected ({out_features},)")


def _base_weight(model: nn.Module, name: str) -> torch.Tensor | None:
    module = dict(model.named_modules()).get(name)
    base = getattr(module, "base_layer", module)
    return getattr(base, "weight", None)


def _differs(copy: torch.Tensor, base_module: nn.Module) -> bool:
    """Does a saved full-vocab copy differ from this rank's shard of the base weight?"""
    w = base_module.weight
    start = getattr(base_module, "vocab_start", 0)
    n = getattr(base_module, "vocab_end", w.shape[0]) - start
    if copy.shape[1:] != w.shape[1:] or copy.shape[0] < start + n:
        return True
    return not torch.equal(copy[start : start + n].to(device=w.device, dtype=w.dtype), w[:n])


def vocab_replacements(model: nn.Module, adapter: LoRAAdapter, tied: bool) -> dict[str, torch.Tensor]:
    """Full replacement weights for 'model.embed_tokens' / 'lm_head', per PEFT's loading rules."""
    out = dict(adapter.weight_replacements)
    named = dict(model.named_modules())
    copies = adapter.base_weight_copies
    for name in copies:
        module = named.get(name)
        if getattr(getattr(module, "base_layer", module), "weight", None) is None:
            raise LoRAUnknownModuleError(
                f"adapter {adapter.name!r} ({adapter.path}) saves a copy of {name}.weight, which the model lacks"
            )
    if tied and copies:
        # one shared Parameter: PEFT writes every copy into it in module order, so lm_head's wins
        final = copies.get("lm_head", copies.get("model.embed_tokens"))
        emb = named["model.embed_tokens"]
        if final is not None and _differs(final, getattr(emb, "base_layer", emb)):
            for name in ("model.embed_tokens", "lm_head"):
                out.setdefault(name, final)
        return out
    for name, copy in copies.items():
        module = named[name]
        if _differs(copy, getattr(module, "base_layer", module)):
            out.setdefault(name, copy)
    return out


def pack_adapter(
    req: LoRARequest,
    adapter: LoRAAdapter,
    model: nn.Module,
    targets: dict[str, LoRATarget],
    modules: dict[str, BaseLayerWithLoRA],
    restricted: set[str],
    tp_size: int,
) -> PackedAdapter:
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    replacements = vocab_replacements(model, adapter, tied)
    tokens = dict(adapter.trainable_tokens)
    if tied and "model.embed_tokens" in tokens and "lm_head" not in tokens:
        tokens["lm_head"] = tokens["model.embed_tokens"]  # the output embedding is W' too
    consumed: set[str] = set(adapter.base_weight_copies)
    packed = PackedAdapter(req, adapter)
    for path, t in targets.items():
        wrapper = modules[path]
        if isinstance(wrapper, FusedMoEWithLoRA):  # per-expert A/B, from 3-D or per-expert 2-D keys
            a, b, used = wrapper.gather_adapter(adapter.modules, t.pieces, lambda n: _where(req, n))
            consumed.update(used)
            if used:
                n = len(a)
                packed.per_module[path] = ModulePack(a, b, [None] * n, [None] * n, [None] * n)
            continue
        shapes = wrapper.expected_shapes()
        if len(shapes) != len(t.pieces):
            raise LoRAUnknownModuleError(f"internal mapping error at {path}: {len(t.pieces)} pieces for {len(shapes)} slices")
        is_emb = isinstance(wrapper, VocabParallelEmbeddingWithLoRA)
        n = len(t.pieces)
        mp = ModulePack([None] * n, [None] * n, [None] * n, [None] * n, [None] * n)
        used = False
        for i, piece in enumerate(t.pieces):
            if piece is None:
                continue
            w = adapter.modules.get(piece)
            if w is not None and w.num_experts:
                raise LoRAShapeError(f"{_where(req, piece)}: a target_parameters (expert) LoRA on a module without experts")
            if w is not None:
                _check_shape(req, piece, w, shapes[i], is_emb)
                mp.a[i], mp.b[i], mp.magnitudes[i], mp.lora_biases[i] = w.lora_a, w.lora_b, w.magnitude, w.lora_bias
                consumed.add(piece)
                used = True
            bias = adapter.bias_replacements.get(piece)
            if bias is not None:
                if getattr(wrapper.base_layer, "bias", None) is None or tuple(bias.shape) != (shapes[i][1],):
                    raise LoRAShapeError(f"{_where(req, piece)}: a saved bias of shape {tuple(bias.shape)} does not fit the base module")
                mp.bias_replacements[i] = bias
                consumed.add(piece)
                used = True
        if isinstance(wrapper, (VocabParallelEmbeddingWithLoRA, LogitsProcessorWithLoRA)):
            name = t.pieces[0]
            vocab, hidden = (shapes[0] if is_emb else shapes[0][::-1])
            if name in replacements:
                mp.weight = replacements[name]
                if tuple(mp.weight.shape) != (vocab, hidden):
                    raise LoRAShapeError(f"{_where(req, name)}: replacement weight {tuple(mp.weight.shape)} != ({vocab}, {hidden})")
                consumed.add(name)
                used = True
            if name in tokens:
                ids, rows = tokens[name]
                if any(not 0 <= i < vocab for i in ids) or rows.shape[1] != hidden:
                    raise LoRAShapeError(f"{_where(req, name)}: trainable tokens {ids[:5]} or rows {tuple(rows.shape)} do not fit")
                if adapter.modules.get(name) is not None:
                    raise LoRAUnsupportedFeatureError(
                        f"{_where(req, name)}: trainable tokens together with LoRA on the same embedding are not supported yet"
                    )
                mp.tokens = (ids, rows)
                consumed.add(name)
                used = True
        if tp_size > 1 and (any(m is not None for m in mp.magnitudes) or (mp.has_linear_extras and t.module is not None and "Row" in type(wrapper).__name__)):
            raise LoRAUnsupportedFeatureError(
                f"{_where(req, path)}: DoRA and bias extras on row-parallel layers are not supported under tensor "
                f"parallelism yet; serve this adapter with --tensor-parallel-size 1"
            )
        if used:
            packed.per_module[path] = mp
    extra_names = set(adapter.modules) | set(adapter.bias_replacements) | set(replacements) | set(tokens)
    unknown = sorted(extra_names - consumed)
    if unknown:
        reasons = "; ".join(describe_unknown_module(model, n, restricted) for n in unknown[:3])
        raise LoRAUnknownModuleError(
            f"adapter {req.lora_name!r} ({req.lora_path}) targets {len(unknown)} module(s) this model cannot serve: {reasons}"
        )
    return packed
