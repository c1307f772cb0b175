"""Build the batch tensors, run the model inside one forward_context, return the logits needed.

Tokens of all scheduled sequences are flattened (varlen). Logits are computed only for rows that
are needed: the last token of a sequence that samples now, and every prompt position of a sequence
that asked for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from loraserve.config import CacheConfig
from loraserve.engine.kv_cache import BlockManager
from loraserve.engine.scheduler import ScheduledBatch
from loraserve.engine.sequence import Sequence
from loraserve.forward_context import AttentionMetadata, forward_context
from loraserve.layers.attention import Attention


@dataclass
class RunnerOutput:
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_logits: torch.Tensor | None = None  # (len(sample_seqs), V) fp32
    # seq -> (first predicted prompt position, logits (n, V) predicting prompt tokens there onward)
    prompt_logits: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def size_kv_cache(
    model: nn.Module, cache: CacheConfig, dtype: torch.dtype, device: torch.device, max_seqs: int, max_len: int
) -> int:
    layers = attention_layers(model)
    per_block = 2 * cache.block_size * dtype.itemsize * sum(a.num_kv_heads * a.head_dim for a in layers)
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cache.gpu_memory_utilization)
    else:
        budget = int(cache.kv_cache_memory_gb * (1 << 30))
    enough = max_seqs * ((max_len + cache.block_size - 1) // cache.block_size)
    return max(1, min(budget // per_block, enough))


class ModelRunner:
    def __init__(self, model: nn.Module, blocks: BlockManager, dtype: torch.dtype, device: torch.device, lora_manager=None):
        self.model = model
        self.blocks = blocks
        self.device = device
        self.lora_manager = lora_manager
        num_slots = blocks.num_blocks * blocks.block_size
        self.kv_caches = []
        for attn in attention_layers(model):
            k = torch.zeros(num_slots, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
            v = torch.zeros_like(k)
            attn.bind_kv_cache(k, v)
            self.kv_caches.append((k, v))

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.blocks.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        starts, lens, ctx_lens, kv_slots = [], [], [], []
        token_lora: list[int] = []  # lora_int_id of each token (0 = base)
        logit_rows: list[int] = []
        logit_lora: list[int] = []
        out = RunnerOutput()
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # seq, first row, n rows, first position
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            all_ids = seq.token_ids
            starts.append(len(ids))
            lens.append(n)
            ctx_lens.append(end)
            ids.extend(all_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq, start, end))
            kv_slots.append(torch.tensor(self._slots(seq, 0, end), dtype=torch.long, device=self.device))
            token_lora.extend([seq.lora_int_id] * n)
            if seq.wants_prompt_logprobs:
                # rows at positions p in [start, min(end, prompt_len - 1)) predict prompt token p + 1
                last = min(end, seq.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows.append((seq, len(logit_rows), last - start, start))
                    first_row = starts[-1]
                    logit_rows.extend(range(first_row, first_row + last - start))
                    logit_lora.extend([seq.lora_int_id] * (last - start))
            if end == seq.num_tokens:  # caught up: this step samples the next token
                out.sample_seqs.append(seq)
        sample_row0 = len(logit_rows)
        for seq, s, n in zip(batch.seqs, starts, lens):
            if seq in out.sample_seqs:
                logit_rows.append(s + n - 1)
                logit_lora.append(seq.lora_int_id)

        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            query_starts=starts,
            query_lens=lens,
            context_lens=ctx_lens,
            kv_slots=kv_slots,
        )
        lora_mapping = None
        if self.lora_manager is not None:
            lora_mapping = self.lora_manager.prepare_mapping(token_lora, logit_lora)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        with forward_context(attn=md, lora=lora_mapping):
            hidden = self.model(input_ids, pos)
            rows = torch.tensor(logit_rows, dtype=torch.long, device=dev)
            logits = self.model.compute_logits(hidden[rows]) if logit_rows else None
        for seq, row0, n, first_pos in prompt_rows:
            out.prompt_logits[seq.seq_id] = (first_pos, logits[row0 : row0 + n])
        if out.sample_seqs:
            out.sample_logits = logits[sample_row0:]
        return out
