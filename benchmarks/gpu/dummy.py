"""Model dirs and PEFT adapters for GPU benchmarks, without any checkpoint or hub access.

- ``make_model_dir``: config.json (a real HF config of the named shape) + a word-level tokenizer over
  the whole vocabulary; no weights: serve it with ``LLM(..., load_format="dummy")`` (random weights).
- ``make_adapter``: a PEFT LoRA adapter dir (adapter_config.json + adapter_model.safetensors) with
  random A and B for the given modules, in PEFT's key layout, readable by PEFT and by loraserve.
  ``adapter_tensors`` + ``write_adapter`` are its two halves, for callers that write many adapters from
  shared tensors (benchmarks/bench_scale.py); ``SLORA_MODULES`` is S-LoRA's shape (q, k, v, o only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

SHAPES = {
    # name -> (config class, kwargs)
    "llama-3.1-8b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2.5-0.5b": (
        "Qwen2Config",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
    "tiny-llama": (
        "LlamaConfig",
        dict(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
    ),
}
LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SLORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]  # S-LoRA's experiments' shape


def hf_config(shape: str, **overrides):
    import transformers

    cls, kw = SHAPES[shape]
    kw = {**kw, "eos_token_id": 1, "bos_token_id": None, "pad_token_id": 0, **overrides}
    return getattr(transformers, cls)(**kw)


def make_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="t1", unk_token="t0", pad_token="t0"
    ).save_pretrained(str(path))


def make_model_dir(path: Path, shape: str) -> Path:
    """config.json + tokenizer for ``shape``; weights come from load_format='dummy' (or save your own)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.save_pretrained(str(path))
    make_tokenizer(path, cfg.vocab_size)
    return path


def _module_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA target module of one Llama-family layer."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }


def adapter_tensors(
    cfg,
    rank: int = 16,
    seed: int = 0,
    std: float = 0.02,
    dtype=torch.bfloat16,
    modules: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """PEFT-keyed random A and B (never zero) for ``modules`` (default all seven) of every layer."""
    modules = LLAMA_MODULES if modules is None else modules
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for mod, (n_in, n_out) in _module_shapes(cfg).items():
            if mod.rpartition(".")[2] not in modules:
                continue
            key = f"base_model.model.model.layers.{i}.{mod}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) * std).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * std).to(dtype)
    return tensors


def write_adapter(
    path: Path, tensors: dict[str, torch.Tensor], rank: int, alpha: int = 32, modules: list[str] | None = None
) -> Path:
    """adapter_model.safetensors of ``tensors`` + a PEFT LoRA adapter_config.json (r, alpha, target modules)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": LLAMA_MODULES if modules is None else modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "base_model_name_or_path": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def make_adapter(
    path: Path,
    cfg,
    rank: int = 16,
    alpha: int = 32,
    seed: int = 0,
    std: float = 0.02,
    dtype=torch.bfloat16,
    modules: list[str] | None = None,
) -> Path:
    """A PEFT LoRA adapter on ``modules`` (default q, k, v, o, gate, up, down) of every layer, random A and B."""
    return write_adapter(path, adapter_tensors(cfg, rank, seed, std, dtype, modules), rank, alpha, modules)
