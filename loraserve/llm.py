"""The offline API, with vLLM's names: ``LLM(...).generate(prompts, sampling_params, lora_request=...)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from loraserve.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from loraserve.engine.engine import LLMEngine
from loraserve.lora.request import LoRARequest
from loraserve.outputs import RequestOutput
from loraserve.sampling import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]

PromptType = str | dict


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        seed: int = 0,
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        max_cpu_loras: int | None = None,
        lora_dtype: str = "auto",
        lora_target_modules: list[str] | None = None,
        fully_sharded_loras: bool = False,
        tensor_parallel_size: int = 1,
        distributed_timeout_s: float = 60.0,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float = 2.0,
        device: str | None = None,
        progress: bool = False,
        load_format: str = "auto",
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
    ):
        """vLLM's arguments. enforce_eager: never use CUDA graphs (on by default on a CUDA device).
        async_scheduling: launch each decode step before reading the last one back (None = on for a
        CUDA device at TP=1, off on the CPU)."""
        lora = None
        if enable_lora:
            lora = LoRAConfig(
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                max_cpu_loras=max_cpu_loras,
                lora_dtype=lora_dtype,
                lora_target_modules=lora_target_modules,
                fully_sharded_loras=fully_sharded_loras,
            )
        self.config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                device=device,
                load_format=load_format,
                enforce_eager=enforce_eager,
            ),
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, kv_cache_memory_gb=kv_cache_memory_gb),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                async_scheduling=async_scheduling,
            ),
            lora=lora,
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size, distributed_timeout_s=distributed_timeout_s
            ),
        )
        self.engine = LLMEngine(self.config, progress=progress)

    def shutdown(self) -> None:
        """End the tensor-parallel worker processes (also done at exit); this LLM cannot generate afterwards."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    @staticmethod
    def _per_prompt(value, n: int, what: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"got {len(value)} {what} for {n} prompts; pass one, or one per prompt")
            return list(value)
        return [value] * n

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        loras = self._per_prompt(lora_request, len(prompts), "lora_requests")
        items = []
        for p, sp, lr in zip(prompts, params, loras):
            if isinstance(p, dict):
                items.append((p.get("prompt"), sp, list(p["prompt_token_ids"]), lr))
            else:
                items.append((p, sp, None, lr))
        return self._run_to_completion(items)

    def _run_to_completion(self, items: list[tuple]) -> list[RequestOutput]:
        """Run (prompt, params, prompt_token_ids, lora_request) items to completion; outputs in order.

        A request the engine fails comes back finished with finish_reason "error" and its ``error``.
        """
        eng = self.engine
        ids = []
        try:
            for prompt, params, tok_ids, lora in items:
                rid = eng.new_request_id()
                eng.add_request(rid, prompt, params, tok_ids, lora)
                ids.append(rid)
            done: dict[str, RequestOutput] = {}
            while len(done) < len(ids):
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o
        except BaseException:
            for rid in ids:  # a refused prompt or an interrupt leaves none of this call's requests behind
                eng.abort_request(rid)
            raise
        return [done[r] for r in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template) for c in convs]
        return self.generate(prompts, sampling_params, lora_request)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True, chat_template=None):
        tok = self.engine.tokenizer
        ids = tok.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tokenize=True
        )
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        text = tok.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tokenize=False
        )
        return {"prompt": text, "prompt_token_ids": list(ids)}

    # ---- adapters (the manager's dynamic API) ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._lora().add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora().remove_adapter(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._lora().pin(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._lora().list_adapters()

    def _lora(self):
        if self.engine.lora_manager is None:
            raise RuntimeError("LoRA is disabled; create the LLM with enable_lora=True")
        return self.engine.lora_manager
