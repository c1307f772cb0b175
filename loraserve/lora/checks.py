"""Value checks an adapter passes before it is served: finite config values, finite tensors, and
magnitude bounds under which no LoRA product can overflow.

The magnitude bound (``check_magnitudes``). For a linear LoRA with A (r, in) and B (out, r) (the scale
already folded into B, as stored), and an input with |x_j| <= X:

    |(A x)_i|   <= ||A_i||_1 * X                          the shrink, held in the product's dtype
    |(B A x)_o| <= sum_i |B_oi| * ||A_i||_1 * X            the delta, added into the model's dtype

Each is reached when x's signs line up with a row, so nothing smaller holds for every input; both cost
one pass over A and an (out, r) @ (r,) product, and are tighter than max|A| * max|B| * r * in. An
adapter is refused when the shrink bound exceeds the largest value of the product's dtype
(``precision.compute_dtype``), or the delta bound (plus |s * lora_B.bias|) that of the model's dtype.
Embedding LoRA reads one column of A per token (no input to bound): |delta_h| <= sum_i |B_hi| * max_j
|A_ij|, held to the same limit / X as the other deltas (headroom for embed_scale and what follows). Tensors
that replace base ones (modules_to_save weights, biases, trainable-token rows, embedding copies, DoRA
magnitudes) are held to the rule for one base entry: |v| * X within the model's dtype.

X = ``INPUT_BOUND`` = 256. LoRA-targeted projections mostly read normalized activations (a few tens at
most); 256 keeps headroom above that without refusing real adapters on fp16 models, whose whole range
is 65504. A delta is also held below sqrt(float32's max / width) per entry (width = the module's outputs):
what a delta adds reaches a norm, whose fp32 sum of squares over the width would overflow past that,
and the layer's output would be 0 or NaN for every token. On bf16 and fp32 models that is the binding
limit (about 2.9e17 at width 4096, while real adapters stay under about 1e4): weights scaled by 1e30, or
values that become inf when rounded to the storage dtype, are refused, naming the module. Bounds are
computed in float64, so the check itself cannot overflow on any fp32 input.
"""

from __future__ import annotations

import math
import threading

import torch

from loraserve.lora.errors import LoRAFormatError, LoRAValueError
from loraserve.lora.files import check_cancel
from loraserve.lora.ops.precision import compute_dtype

INPUT_BOUND = 256.0
FP32_MAX = torch.finfo(torch.float32).max
MAX_LIST_ENTRIES = 4096  # target_parameters / modules_to_save entries: each is compared with every module


def _nonfinite(cfg) -> tuple[str, float] | None:
    """The first float in the config that is NaN or +-inf, as (path, value); JSON allows NaN/Infinity."""
    todo = [("", cfg)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return where.lstrip("."), v
        if isinstance(v, dict):
            todo.extend((f"{where}[{k!r}]" if where else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            todo.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
    return None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite_number(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an int past float's range
        return False


def check_config_values(cfg: dict, where: str) -> None:
    """Every number in the config finite; r and rank_pattern values positive ints; lora_alpha and
    alpha_pattern values finite numbers; lists that are scanned per module capped. LoRAValueError or
    LoRAFormatError naming ``where`` (the config file) and the key."""
    bad = _nonfinite(cfg)
    if bad is not None:
        raise LoRAValueError(f"{where}: {bad[0]} is {bad[1]}; every number in the config must be finite")
    if "r" in cfg and not (_is_int(cfg["r"]) and cfg["r"] >= 1):
        raise LoRAValueError(f"{where}: r must be a positive integer, got {cfg['r']!r}")
    if "lora_alpha" in cfg and not _is_finite_number(cfg["lora_alpha"]):
        raise LoRAValueError(
            f"{where}: lora_alpha must be a finite number, got {str(cfg['lora_alpha'])[:40]}"
        )
    for key, ok, what in (
        ("rank_pattern", lambda v: _is_int(v) and v >= 1, "a positive integer"),
        ("alpha_pattern", _is_finite_number, "a finite number"),
    ):
        pattern = cfg.get(key)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise LoRAFormatError(
                f"{where}: {key} must be an object of pattern -> value, got {type(pattern).__name__}"
            )
        for k, v in pattern.items():
            if not ok(v):
                raise LoRAValueError(f"{where}: {key}[{k!r}] must be {what}, got {str(v)[:40]}")
    for key in ("target_parameters", "modules_to_save"):
        v = cfg.get(key)
        if v is None:
            continue
        if not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise LoRAFormatError(f"{where}: {key} must be a list of names, got {str(v)[:80]}")
        if len(v) > MAX_LIST_ENTRIES:
            raise LoRAFormatError(
                f"{where}: {key} has {len(v)} entries, more than the {MAX_LIST_ENTRIES} loraserve reads"
            )
    spec = cfg.get("trainable_token_indices")
    if spec is not None:
        lists = list(spec.values()) if isinstance(spec, dict) else [spec]
        if not all(isinstance(ids, list) and all(_is_int(i) for i in ids) for ids in lists):
            raise LoRAFormatError(f"{where}: trainable_token_indices must hold lists of token ids (integers)")


def check_finite_tensors(
    tensors: dict[str, torch.Tensor], where: str, cancel: threading.Event | None = None
) -> None:
    """Every floating tensor of the weights file free of NaN and inf; LoRAValueError naming the key."""
    for key, t in tensors.items():
        check_cancel(cancel, where)
        if not t.is_floating_point():
            continue
        v = t if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else t.float()
        if not bool(torch.isfinite(v).all()):
            n_nan = int(torch.isnan(v).sum())
            raise LoRAValueError(
                f"{where}: tensor {key!r} holds {n_nan} NaN and {int(torch.isinf(v).sum())} inf values; "
                f"the adapter file is broken (re-export it)"
            )


def _too_large(where: str, what: str, bound: float, limit: float, dtype: torch.dtype) -> LoRAValueError:
    return LoRAValueError(
        f"{where}: {what} can reach {bound:.3g} for inputs |x| <= {INPUT_BOUND:g}, beyond {dtype}'s largest "
        f"value {limit:.3g}; such weights could overflow when served (re-export or retrain the adapter)"
    )


def check_magnitudes(
    adapter, lora_dtype: torch.dtype, out_dtype: torch.dtype, cancel: threading.Event | None = None
) -> None:
    """The module docstring's bounds on a stored ``LoRAAdapter`` (pairs in ``lora_dtype``) served on a
    model computing in ``out_dtype``; LoRAValueError naming the adapter, the module and the bound."""
    where = f"adapter {adapter.name!r} ({adapter.path})"
    out_max = torch.finfo(out_dtype).max
    mid_dtype = compute_dtype(out_dtype, lora_dtype)
    mid_max = torch.finfo(mid_dtype).max
    for name, m in adapter.modules.items():
        check_cancel(cancel, where)
        here = f"{where}: module {name!r}"
        a, b = m.lora_a.double().abs(), m.lora_b.double().abs()
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise LoRAValueError(
                f"{here}: its LoRA weights overflow {m.lora_a.dtype} storage (inf after rounding)"
            )
        if m.is_embedding:  # A (r, V): a token reads one column
            shrink = a.amax(dim=-1)  # (r,)
        else:  # A (..., r, in)
            shrink = a.sum(dim=-1)  # (..., r)
            if shrink.numel() and float(shrink.amax()) * INPUT_BOUND > mid_max:
                raise _too_large(
                    here, "the shrink |A x|", float(shrink.amax()) * INPUT_BOUND, mid_max, mid_dtype
                )
        delta = (
            float((b @ shrink.unsqueeze(-1)).amax()) * INPUT_BOUND if b.numel() and shrink.numel() else 0.0
        )
        if m.lora_bias is not None:
            delta += float(m.lora_bias.double().abs().amax())
        if not delta <= out_max:  # (NaN fails too)
            raise _too_large(here, "the LoRA delta |s B A x|", delta, out_max, out_dtype)
        width = b.shape[-2] if b.dim() >= 2 else 1
        norm_limit = math.sqrt(FP32_MAX / max(width, 1))
        if not delta <= norm_limit:
            raise LoRAValueError(
                f"{here}: the LoRA delta |s B A x| can reach {delta:.3g} for inputs |x| <= {INPUT_BOUND:g}, "
                f"beyond {norm_limit:.3g} (the square root of float32's largest value over its {width} outputs): "
                "a norm reading it would overflow its sum of squares (re-export or retrain the adapter)"
            )
        if m.magnitude is not None:
            _check_entries(f"{here}: lora_magnitude_vector", m.magnitude, out_max, out_dtype)
    extras = [(f"replacement weight of {k!r}", t) for k, t in adapter.weight_replacements.items()]
    extras += [(f"replacement bias of {k!r}", t) for k, t in adapter.bias_replacements.items()]
    extras += [(f"embedding copy {k!r}", t) for k, t in adapter.base_weight_copies.items()]
    extras += [(f"trainable token rows of {k!r}", rows) for k, (_, rows) in adapter.trainable_tokens.items()]
    for what, t in extras:
        check_cancel(cancel, where)
        _check_entries(f"{where}: {what}", t, out_max, out_dtype)


def _check_entries(here: str, t: torch.Tensor, limit: float, dtype: torch.dtype) -> None:
    if not t.numel():
        return
    worst = float(t.double().abs().amax()) * INPUT_BOUND
    if not worst <= limit:
        raise _too_large(here, "an entry times x", worst, limit, dtype)
