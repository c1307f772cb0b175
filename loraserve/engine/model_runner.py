"""Build the batch tensors, run the model inside one forward_context, return the logits needed.

Tokens of all scheduled sequences are flattened (varlen). Logits are computed only for rows that
are needed: the last token of a sequence that samples now, and every prompt position of a sequence
that asked for prompt logprobs.

``run`` = ``prepare`` (the batch as plain lists, ``PreparedStep``; makes its adapters resident) +
``forward`` (``execute``, the model's forward, then the logits split per sequence). Under tensor
parallelism rank 0's ``forward`` hands each step to ``on_step``, which broadcasts it, and every rank
calls ``execute`` on it (engine/worker.py). The engine calls ``prepare`` and ``forward`` itself, to
time them apart.

A step scheduled ahead (``ScheduledBatch.ahead``, async scheduling) runs before the previous step's
tokens are appended: its input ids are that step's samples, still on the device, and it queues its
work without waiting for the device (host data goes up through pinned memory, engine/transfer.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from loraserve.config import CacheConfig
from loraserve.engine.cuda_graphs import DecodeGraphs, GraphCaptureError
from loraserve.engine.kv_cache import BlockManager
from loraserve.engine.scheduler import ScheduledBatch
from loraserve.engine.sequence import Sequence
from loraserve.engine.transfer import to_device
from loraserve.forward_context import AttentionMetadata, forward_context
from loraserve.layers.attention import Attention
from loraserve.lora.punica import LoRAMapping

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_logits: torch.Tensor | None = None  # (len(sample_seqs), V) fp32
    # seq -> (first predicted prompt position, logits (n, V) predicting prompt tokens there onward)
    prompt_logits: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass
class PreparedStep:
    """One forward's inputs as plain lists: rank 0 builds it, and under TP every rank executes it."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # KV cache slot of each new token
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # per sequence
    logit_rows: list[int]  # hidden rows whose logits are computed
    token_slots: list[int] | None = None  # LoRA slot of each token (-1 = base); None = no adapter in the batch
    logit_slots: list[int] | None = None
    # a step scheduled ahead: the input ids, on the device (input_ids then holds -1 placeholders)
    device_input_ids: torch.Tensor | None = None


@dataclass
class _OutputPlan:
    """Rank 0's bookkeeping to turn the logits of a step into a RunnerOutput."""

    out: RunnerOutput
    prompt_rows: list[tuple[Sequence, int, int, int]]  # seq, first row, n rows, first position
    sample_row0: int


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
        # NOTE: on CUDA one spare block past the manager's: the scratch slot of CUDA-graph padding rows
        self.scratch_slot = num_slots
        if device.type == "cuda":
            num_slots += blocks.block_size
        self.kv_caches = []
        for attn in attention_layers(model):
            k = torch.zeros(num_slots, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
            v = torch.zeros_like(k)
            attn.bind_kv_cache(k, v)
            self.kv_caches.append((k, v))
        layers = attention_layers(model)
        self.gpu_attention = bool(layers) and layers[0]._kernel is not None
        self.on_step = None  # tensor parallelism: rank 0's hook that broadcasts each PreparedStep
        self.graphs = None  # DecodeGraphs once enable_cuda_graphs() ran

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Replay decode steps of up to max_batch sequences from CUDA graphs (GPU attention only)."""
        if not self.gpu_attention:
            raise RuntimeError("CUDA graphs need the GPU attention kernel (a CUDA device with Triton)")
        self.graphs = DecodeGraphs(self, max_batch, max_model_len, self.scratch_slot)

    def _gpu_seq_tables(self, block_tables, starts, lens, ctx_lens) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq_info (B, 3), block_tables (B, max_blocks)) int32 views of one host->device copy."""
        width = max(len(t) for t in block_tables)
        rows = [[qs, n, c] + t + [0] * (width - len(t)) for t, qs, n, c in zip(block_tables, starts, lens, ctx_lens)]
        packed = to_device(rows, torch.int32, self.device)
        return packed[:, :3], packed[:, 3:]

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        return self._table_slots(seq.block_table, start, end)

    def _table_slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.blocks.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def run(self, batch: ScheduledBatch, device_input_ids: torch.Tensor | None = None) -> RunnerOutput:
        return self.forward(*self.prepare(batch, device_input_ids))

    @torch.inference_mode()
    def forward(self, step: PreparedStep, plan: _OutputPlan) -> RunnerOutput:
        """Run a prepared step (on every TP rank, via on_step) and split its logits per sequence."""
        if self.on_step is not None:
            self.on_step(step)
        logits = self.execute(step)
        out = plan.out
        for seq, row0, n, first_pos in plan.prompt_rows:
            out.prompt_logits[seq.seq_id] = (first_pos, logits[row0 : row0 + n])
        if out.sample_seqs:
            out.sample_logits = logits[plan.sample_row0 :]
        return out

    @torch.inference_mode()
    def prepare(
        self, batch: ScheduledBatch, device_input_ids: torch.Tensor | None = None
    ) -> tuple[PreparedStep, _OutputPlan]:
        """The batch as plain lists, and how to read its logits. Writes the batch's adapters into slots.

        A batch scheduled ahead (``batch.ahead``) comes with its input ids on the device
        (``device_input_ids``, one per sequence): each sequence's token at position ``seq.num_tokens``.
        """
        assert batch.ahead == (device_input_ids is not None), "device ids go with a batch scheduled ahead"
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        starts, lens, ctx_lens = [], [], []
        token_lora: list[int] = []  # lora_int_id of each token (0 = base)
        logit_rows: list[int] = []
        logit_lora: list[int] = []
        out = RunnerOutput()
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # seq, first row, n rows, first position
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_tokens if batch.ahead else seq.num_computed_tokens
            end = start + n
            starts.append(len(ids))
            lens.append(n)
            ctx_lens.append(end)
            ids.extend([-1] * n if batch.ahead else seq.token_slice(start, end))
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq, start, end))
            token_lora.extend([seq.lora_int_id] * n)
            if seq.wants_prompt_logprobs:
                # rows at positions p in [start, min(end, prompt_len - 1)) predict prompt token p + 1
                last = min(end, seq.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows.append((seq, len(logit_rows), last - start, start))
                    first_row = starts[-1]
                    logit_rows.extend(range(first_row, first_row + last - start))
                    logit_lora.extend([seq.lora_int_id] * (last - start))
            if end == seq.num_tokens or batch.ahead:  # caught up (or ahead): it samples the next token
                out.sample_seqs.append(seq)
        sample_row0 = len(logit_rows)
        for seq, s, n in zip(batch.seqs, starts, lens):
            if seq in out.sample_seqs:
                logit_rows.append(s + n - 1)
                logit_lora.append(seq.lora_int_id)

        token_slots, logit_slots = None, None
        if self.lora_manager is not None:
            # NOTE: slots only; execute() builds the LoRAMapping (device tensors) when the step runs
            # eagerly. A CUDA-graph step reads the slots from static buffers: building it there cost
            # ~1 ms of host time per decode step with 8 adapters, for nothing.
            slots = self.lora_manager.prepare_slots(token_lora, logit_lora)
            if slots is not None:
                token_slots, logit_slots = slots
        block_tables = [seq.block_table for seq in batch.seqs]
        step = PreparedStep(
            ids, positions, slot_mapping, starts, lens, ctx_lens, block_tables, logit_rows, token_slots, logit_slots,
            device_input_ids,
        )  # fmt: skip
        return step, _OutputPlan(out, prompt_rows, sample_row0)

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> torch.Tensor | None:
        """The forward of one step (on every TP rank): logits (len(logit_rows), V) fp32, or None."""
        if self.graphs is not None and self.graphs.can_run(step):
            try:
                return self.graphs.run(step)
            except GraphCaptureError as e:
                logger.warning(
                    "CUDA graph capture failed (%s); CUDA graphs are now off and every step runs eagerly. "
                    "To skip capturing, start the engine with enforce_eager=True (--enforce-eager).",
                    e,
                )
                self.graphs = None
        dev = self.device
        kv_slots = []
        if not self.gpu_attention:  # the torch reference gathers each sequence's slots
            kv_slots = [
                torch.tensor(self._table_slots(t, 0, c), dtype=torch.long, device=dev)
                for t, c in zip(step.block_tables, step.context_lens)
            ]
        # NOTE: every host->device copy here is non-blocking (engine/transfer.py), so an eager step
        # scheduled ahead does not wait for the step before it (layers may still copy on their own)
        md = AttentionMetadata(
            slot_mapping=to_device(step.slot_mapping, torch.long, dev),
            query_starts=step.query_starts,
            query_lens=step.query_lens,
            context_lens=step.context_lens,
            kv_slots=kv_slots,
            block_size=self.blocks.block_size,
        )
        if self.gpu_attention:
            md.seq_info, md.block_tables = self._gpu_seq_tables(
                step.block_tables, step.query_starts, step.query_lens, step.context_lens
            )
        lora_mapping = None
        if step.token_slots is not None:
            lora_mapping = LoRAMapping.build(step.token_slots, step.logit_slots, dev)
        input_ids = step.device_input_ids
        if input_ids is None:
            input_ids = to_device(step.input_ids, torch.long, dev)
        pos = to_device(step.positions, torch.long, dev)
        with forward_context(attn=md, lora=lora_mapping):
            hidden = self.model(input_ids, pos)
            rows = to_device(step.logit_rows, torch.long, dev)
            return self.model.compute_logits(hidden[rows]) if step.logit_rows else None
