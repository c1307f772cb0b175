"""Read and validate a PEFT LoRA adapter dir -> ``LoRAAdapter`` (per-module A, scaled B).

Follows ../shared/reference/peft_semantics.md:
- tensor keys decide which modules carry LoRA (``base_model.model.`` prefix, ``lora_A/B.weight``,
  ``lora_embedding_A/B``); ``target_modules`` is only validated;
- per-module r and alpha from ``rank_pattern`` / ``alpha_pattern`` in the file's key order, first
  ``re.match(rf"(.*\\.)?({key})$", name)`` wins (matched in linear time, ``patterns.py``); ``use_rslora``
  gives alpha / sqrt(r);
- the scale is folded into B in fp32;
- ``unembed_tokens`` (Tinker exports) is ``lm_head``;
- ``target_parameters`` on MoE experts (PEFT's ParamWrapper): A (E*r, in), B (out, E*r) become per-expert
  A (E, r, in) = A[e*r:(e+1)*r], B (E, out, r) = B[:, e::E], named by the parameter path
  (``...mlp.experts.gate_up_proj``), which is also what rank_pattern / alpha_pattern match (r per expert);
- features we do not serve yet are refused by name;
- nothing is served unchecked: the files are read confined, capped and hashed (``files.py``), the config's
  numbers and the tensors must be finite and their magnitudes bounded (``checks.py``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraserve.lora.checks import check_config_values, check_finite_tensors, check_magnitudes
from loraserve.lora.errors import (
    LoRAFormatError,
    LoRARankError,
    LoRAUnsupportedFeatureError,
)
from loraserve.lora.files import (
    BIN_NAME,
    CONFIG_NAME,
    SAFETENSORS_NAME,
    AdapterFiles,
    check_cancel,
    read_adapter_files,
)
from loraserve.lora.ops.precision import to_storage
from loraserve.lora.param_targets import EXPERT_PARAMS, resolve_param_targets
from loraserve.lora.patterns import PatternTable, check_target_regex, dot_suffixes

__all__ = [
    "BIN_NAME",
    "CONFIG_NAME",
    "EXPERT_PARAMS",
    "SAFETENSORS_NAME",
    "LoRAAdapter",
    "LoRAModuleWeights",
    "load_adapter",
    "resolve_param_targets",
]
PREFIX = "base_model.model."
DEFAULT_MAX_WEIGHTS_BYTES = 8 << 30
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq")
_MODULE_ALIASES = {"model.unembed_tokens": "lm_head", "unembed_tokens": "lm_head"}


@dataclass
class LoRAModuleWeights:
    """One module's LoRA. Linear: A (r, in), B (out, r). Embedding: A (r, V), B (H, r). B is pre-scaled."""

    module_name: str  # HF module path, without the base_model.model. prefix
    lora_a: torch.Tensor
    lora_b: torch.Tensor  # s * B, folded in fp32
    rank: int
    scaling: float
    is_embedding: bool = False
    magnitude: torch.Tensor | None = None  # DoRA m: (out,) for linear, (H,) for embedding
    lora_bias: torch.Tensor | None = None  # s * lora_B.bias, folded in fp32
    # > 0: a target_parameters LoRA on a 3-D expert parameter, A (E, r, in), B (E, out, r)
    num_experts: int = 0


@dataclass
class LoRAAdapter:
    """A parsed adapter. Besides the LoRA pairs, what PEFT also loads over the base model:

    - ``bias_replacements``: module -> bias (``bias="all"/"lora_only"``), replacing the base bias;
    - ``weight_replacements``: module -> full weight (``modules_to_save`` copies of embed_tokens /
      lm_head, and saved ``base_layer.weight`` embedding copies);
    - ``trainable_tokens``: embedding module -> (token ids, replacement rows).
    """

    name: str
    path: str
    config: dict
    modules: dict[str, LoRAModuleWeights]
    # embedding copies saved beside the adapter (module name -> full weight), compared with the base
    base_weight_copies: dict[str, torch.Tensor] = field(default_factory=dict)
    bias_replacements: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_replacements: dict[str, torch.Tensor] = field(default_factory=dict)
    trainable_tokens: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    # what was read from disk to build it, one entry per adapter dir (a mixture: per component, in order):
    # the real paths and sha256 digests a re-read after a host-cache eviction must find again
    sources: tuple[AdapterFiles, ...] = ()

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        n = sum(m.lora_a.nbytes + m.lora_b.nbytes for m in self.modules.values())
        n += sum(t.nbytes for t in self.weight_replacements.values())
        n += sum(t.nbytes for t in self.bias_replacements.values())
        return n + sum(rows.nbytes for _, rows in self.trainable_tokens.values())


def _refuse(path: Path, feature: str, fix: str) -> LoRAUnsupportedFeatureError:
    return LoRAUnsupportedFeatureError(f"adapter {path}: {feature} is not supported yet; {fix}")


def check_supported(cfg: dict, path: Path) -> None:
    """Refuse, by name, every PEFT feature that would change the math we serve."""
    f = path / CONFIG_NAME
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(f, f"peft_type {peft_type!r}", "only LoRA adapters can be served")
    if cfg.get("bias", "none") not in ("none", "all", "lora_only"):
        raise LoRAFormatError(f"adapter {f}: bias must be 'none', 'all' or 'lora_only', got {cfg['bias']!r}")
    if cfg.get("use_dora") and cfg.get("lora_bias"):
        raise LoRAFormatError(f"adapter {f}: use_dora and lora_bias cannot be combined (PEFT refuses it too)")
    if cfg.get("fan_in_fan_out") and cfg.get("use_dora"):
        raise _refuse(f, "DoRA with fan_in_fan_out (Conv1D bases)", "serve a model with nn.Linear layers")
    tp = cfg.get("target_parameters")
    if tp is not None and not (isinstance(tp, list) and all(isinstance(t, str) for t in tp)):
        raise LoRAFormatError(f"adapter {f}: target_parameters must be a list of parameter names, got {tp!r}")
    for t in tp or []:
        if t.rpartition(".")[2] not in EXPERT_PARAMS:
            raise _refuse(
                f,
                f"target_parameters entry {t!r} (only MoE expert parameters {', '.join(EXPERT_PARAMS)} are served)",
                "target that layer with target_modules instead",
            )
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise _refuse(
            f,
            f"init_lora_weights={init!r} (it modifies the base weights at load time)",
            "convert it to plain LoRA with PEFT's path_initial_model_for_weight_conversion",
        )
    if cfg.get("layer_replication"):
        raise _refuse(f, "layer_replication", "serve a model without replicated layers")
    if cfg.get("alora_invocation_tokens"):
        raise _refuse(f, "aLoRA (alora_invocation_tokens)", "serve it as a plain LoRA adapter")
    for key, feature in (
        ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
        ("kasa_config", "KaSA"),
        ("use_qalora", "QALoRA"),
    ):
        if cfg.get(key):
            raise _refuse(f, feature, "serve a plain LoRA adapter")


def _validate_targets(cfg: dict, f: Path) -> None:
    t = cfg.get("target_modules")
    if t is None or isinstance(t, list) and all(isinstance(x, str) for x in t):
        return
    if isinstance(t, str):
        if t not in ("all-linear", "all"):
            check_target_regex(t, f"adapter {f}")
        return
    raise LoRAFormatError(
        f"adapter {f}: target_modules must be a list of names or a regex string, got {str(t)[:80]}"
    )


def parse_config(data: bytes, f: Path) -> dict:
    """adapter_config.json's bytes -> dict, keeping the file's key order (which rank_pattern needs)."""
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAFormatError(f"adapter {f}: invalid JSON ({e}); re-save the adapter config") from e
    except RecursionError:
        raise LoRAFormatError(
            f"adapter {f}: invalid JSON (nested too deeply); re-save the adapter config"
        ) from None
    if not isinstance(cfg, dict):
        raise LoRAFormatError(f"adapter {f}: expected a JSON object")
    return cfg


def parse_tensors(data: bytes, wfile: Path) -> dict[str, torch.Tensor]:
    """The weights file's bytes (safetensors, or a PyTorch pickle read with weights_only) -> state dict."""
    try:
        if wfile.name == SAFETENSORS_NAME:
            from safetensors.torch import load

            return dict(sorted(load(data).items()))  # key order as safetensors' load_file gives it
        # NOTE: weights_only=True: a .bin adapter is a pickle; never run code from it
        sd = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise LoRAFormatError(
            f"adapter {wfile}: cannot read the weights file ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise LoRAFormatError(f"adapter {wfile}: expected a state dict of tensors")
    return sd


_KEY_SUFFIXES = (
    (".lora_A.weight", "lora_A"),
    (".lora_B.weight", "lora_B"),
    (".lora_B.bias", "lora_bias"),
    (".lora_embedding_A", "lora_embedding_A"),
    (".lora_embedding_B", "lora_embedding_B"),
    (".lora_magnitude_vector", "magnitude"),
    (".token_adapter.trainable_tokens_delta", "trainable_tokens"),
    (".base_layer.weight", "base_layer.weight"),
    (".base_layer.bias", "bias"),
)


def _split_key(key: str, f: Path, modules_to_save: set[str]) -> tuple[str, str]:
    """'base_model.model.X.lora_A.weight' -> ('X', 'lora_A'); full-module keys of modules_to_save -> 'weight'/'bias'."""
    if not key.startswith(PREFIX):
        raise LoRAFormatError(f"adapter {f}: tensor key {key!r} lacks the {PREFIX!r} prefix PEFT writes")
    k = key[len(PREFIX) :]
    for suffix, kind in _KEY_SUFFIXES:
        if k.endswith(suffix):
            return k[: -len(suffix)], kind
    for suffix, kind in ((".weight", "weight"), (".bias", "bias")):
        if k.endswith(suffix):
            module = k[: -len(suffix)]
            if kind == "weight" and modules_to_save.isdisjoint(dot_suffixes(module)):
                break
            return module, kind  # a modules_to_save copy, or a bias saved with bias="all"
    raise LoRAFormatError(f"adapter {f}: unrecognized tensor key {key!r} (is this a PEFT LoRA adapter?)")


def _trainable_token_ids(cfg: dict, module: str, f: Path) -> list[int]:
    spec = cfg.get("trainable_token_indices")
    if isinstance(spec, list):
        return [int(i) for i in spec]
    if isinstance(spec, dict):
        for name, ids in spec.items():
            if module == name or module.endswith("." + name):
                return [int(i) for i in ids]
    raise LoRAFormatError(
        f"adapter {f}: trainable tokens for {module!r} but trainable_token_indices does not name it"
    )


def _expert_param_lora(
    param: str, a: torch.Tensor, b: torch.Tensor, r: int, scaling: float, f: Path, dtype: torch.dtype
) -> LoRAModuleWeights:
    """PEFT's ParamWrapper factors -> per expert: A_e = A[e*r:(e+1)*r], B_e = B[:, e::E] (B scaled in fp32)."""
    if a.shape[0] % r or b.shape[1] != a.shape[0]:
        raise LoRARankError(
            f"adapter {f}: parameter {param!r} has A{tuple(a.shape)} B{tuple(b.shape)}, not (E*r, in), (out, E*r) "
            f"with r={r} (rank_pattern/alpha_pattern are matched in file order); fix adapter_config.json"
        )
    E = a.shape[0] // r
    a3 = a.float().reshape(E, r, a.shape[1])  # (E, r, in)
    b3 = b.float().reshape(b.shape[0], r, E).permute(2, 0, 1)  # (E, out, r)
    a3, b3 = _stored(a3, b3 * scaling, dtype, f, param)
    return LoRAModuleWeights(
        module_name=param,
        lora_a=a3,
        lora_b=b3,
        rank=r,
        scaling=scaling,
        num_experts=E,
    )


def _stored(
    a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, f, module: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and scaled B (fp32) in the storage dtype (``precision.to_storage``: fp16 is balanced per rank)."""
    try:
        return to_storage(a, b, dtype, f"adapter {f}: module {module!r}")
    except ValueError as e:
        raise LoRAFormatError(str(e)) from None


def _extras_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of an adapter's tensors beside its LoRA pairs (biases, magnitudes, replacement weights,
    trainable tokens): fp16 is a storage format for the pairs (balanced), so with it they stay fp32 and
    are rounded once, where used, to the model's dtype."""
    return torch.float32 if dtype == torch.float16 else dtype


def store_adapter(adapter: LoRAAdapter, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter with its LoRA pairs in ``dtype`` (``precision.to_storage``) and its extras in
    ``_extras_dtype``: for one combined in fp32 (a mixture)."""
    modules, ex = {}, _extras_dtype(dtype)
    for name, m in adapter.modules.items():
        a, b = _stored(m.lora_a, m.lora_b, dtype, adapter.path, name)
        modules[name] = dataclasses.replace(
            m, lora_a=a, lora_b=b,
            magnitude=None if m.magnitude is None else m.magnitude.to(ex),
            lora_bias=None if m.lora_bias is None else m.lora_bias.to(ex),
        )  # fmt: skip
    return dataclasses.replace(adapter, modules=modules)


def load_adapter(
    path: str | Path,
    name: str,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    *,
    out_dtype: torch.dtype | None = None,
    root: str | Path | None = None,
    expect: AdapterFiles | None = None,
    max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES,
    cancel: threading.Event | None = None,
) -> LoRAAdapter:
    """Parse and validate an adapter dir; the LoRA pairs in ``dtype`` (fp16: balanced per rank,
    ``precision.balance_to_fp16``), the rest in ``_extras_dtype(dtype)``. Raises a LoRAError subclass
    naming the file, module and fix.

    The files are read once, as ``files.read_adapter_files`` says (``root``: confined under it;
    ``expect``: the same real paths and sha256 as a registration read, else LoRAChangedError; the
    weights file at most ``max_weights_bytes``); ``sources`` of the result records what was read.
    Values are checked as ``checks.py`` says, the magnitudes for a model computing in ``out_dtype``
    (default ``dtype``). ``cancel``: once set, the parse stops with LoRALoadCancelledError."""
    path = Path(path)
    ex_dtype = _extras_dtype(dtype)
    cfg_bytes, w_bytes, wname, files = read_adapter_files(
        path, root=root, expect=expect, max_weights_bytes=max_weights_bytes, cancel=cancel
    )
    cfg = parse_config(cfg_bytes, path / CONFIG_NAME)
    check_config_values(cfg, f"adapter {name!r} ({path / CONFIG_NAME})")
    check_supported(cfg, path)
    _validate_targets(cfg, path / CONFIG_NAME)
    wfile = path / wname
    tensors = parse_tensors(w_bytes, wfile)
    del w_bytes  # the tensors are copies
    if not tensors:
        raise LoRAFormatError(f"adapter {wfile}: holds no tensors")
    check_finite_tensors(tensors, f"adapter {name!r} ({wfile})", cancel)

    mts = set(cfg.get("modules_to_save") or [])
    parts: dict[str, dict[str, torch.Tensor]] = {}
    copies: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor] = {}
    replacements: dict[str, torch.Tensor] = {}
    tokens: dict[str, tuple[list[int], torch.Tensor]] = {}
    for key, t in tensors.items():
        module, kind = _split_key(key, wfile, mts)
        alias = _MODULE_ALIASES.get(module, module)
        if kind == "base_layer.weight":
            copies[alias] = t
        elif kind == "weight":
            replacements[alias] = t.float().to(ex_dtype)
        elif kind == "bias":
            biases[alias] = t.float().to(ex_dtype)
        elif kind == "trainable_tokens":
            ids = _trainable_token_ids(cfg, module, wfile)
            if t.dim() != 2 or t.shape[0] != len(ids):
                raise LoRAFormatError(
                    f"adapter {wfile}: {key} has shape {tuple(t.shape)} for {len(ids)} token ids"
                )
            tokens[alias] = (ids, t.float().to(ex_dtype))
        else:
            parts.setdefault(module, {})[kind] = t

    r_default, alpha_default = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    where = f"adapter {path / CONFIG_NAME}"
    rank_pattern = PatternTable(cfg.get("rank_pattern") or {}, "rank_pattern", where)
    alpha_pattern = PatternTable(cfg.get("alpha_pattern") or {}, "alpha_pattern", where)
    rslora = bool(cfg.get("use_rslora", False))
    modules: dict[str, LoRAModuleWeights] = {}
    params = resolve_param_targets(cfg, parts, wfile)
    for module, p in parts.items():
        check_cancel(cancel, f"adapter {path}")
        is_emb = "lora_embedding_A" in p or "lora_embedding_B" in p
        ka, kb = ("lora_embedding_A", "lora_embedding_B") if is_emb else ("lora_A", "lora_B")
        if "magnitude" in p and not cfg.get("use_dora"):
            raise LoRAFormatError(
                f"adapter {wfile}: module {module!r} has a DoRA magnitude but use_dora is false"
            )
        if cfg.get("use_dora") and ka in p and "magnitude" not in p:
            raise LoRAFormatError(
                f"adapter {wfile}: use_dora is set but module {module!r} has no lora_magnitude_vector"
            )
        if ka not in p or kb not in p:
            missing = ka if ka not in p else kb
            raise LoRAFormatError(
                f"adapter {wfile}: module {module!r} has no {missing} tensor; the file is incomplete"
            )
        a, b = p[ka], p[kb]
        if a.dim() != 2 or b.dim() != 2:
            raise LoRAFormatError(
                f"adapter {wfile}: module {module!r}: LoRA tensors must be 2-D, got {tuple(a.shape)}, {tuple(b.shape)}"
            )
        param = params.get(module)
        r, alpha = rank_pattern.lookup(param or module), alpha_pattern.lookup(param or module)
        r = r_default if r is None else r
        alpha = alpha_default if alpha is None else alpha
        if param is not None:  # target_parameters: r counts per expert
            if r > max_rank:
                raise LoRARankError(
                    f"adapter {path.name!r} ({path}) has rank {r} > max_lora_rank {max_rank} at parameter {param!r}; "
                    f"restart with --max-lora-rank {r}"
                )
            scaling = alpha / math.sqrt(r) if rslora else alpha / r
            modules[param] = _expert_param_lora(param, a, b, r, scaling, wfile, dtype)
            continue
        if a.shape[0] != r or b.shape[1] != r:
            raise LoRARankError(
                f"adapter {wfile}: module {module!r} has rank {a.shape[0]} tensors but the config gives r={r} "
                f"(rank_pattern/alpha_pattern are matched in file order); fix adapter_config.json"
            )
        if r > max_rank:
            raise LoRARankError(
                f"adapter {path.name!r} ({path}) has rank {r} > max_lora_rank {max_rank} at module {module!r}; "
                f"restart with --max-lora-rank {r}"
            )
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        mod_name = _MODULE_ALIASES.get(module, module)
        # NOTE: fold the scale in fp32, as PEFT computes s * B(Ax) with fp32 adapter weights
        a_st, b_st = _stored(a.float(), b.float() * scaling, dtype, wfile, module)
        modules[mod_name] = LoRAModuleWeights(
            module_name=mod_name,
            lora_a=a_st,
            lora_b=b_st,
            rank=r,
            scaling=scaling,
            is_embedding=is_emb,
            magnitude=p["magnitude"].float().to(ex_dtype) if "magnitude" in p else None,
            lora_bias=(p["lora_bias"].float() * scaling).to(ex_dtype) if "lora_bias" in p else None,
        )
    if not (modules or replacements or biases or tokens):
        raise LoRAFormatError(f"adapter {wfile}: holds no LoRA tensors")
    adapter = LoRAAdapter(
        name=name or path.name,
        path=str(path),
        config=cfg,
        modules=modules,
        base_weight_copies=copies,
        bias_replacements=biases,
        weight_replacements=replacements,
        trainable_tokens=tokens,
        sources=(files,),
    )
    check_magnitudes(adapter, dtype, out_dtype or dtype, cancel)
    return adapter
