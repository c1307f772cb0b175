"""CUDA graphs of decode steps: one graph per batch-size bucket and per {base, LoRA, LoRA with the embedding's
and lm_head's deltas} (GPU only).

A decode step (every sequence has one new token and samples) of B sequences replays the graph of
the smallest bucket >= B. Everything the forward reads per step lives in static buffers that are
refilled before the replay: token ids, positions, KV slots, seq_info + block tables, and the LoRA
mapping as a static ``SegmentMeta`` (every slot has a segment; empty ones have length 0, which the
kernels skip). Padding rows write their K/V to a scratch slot past the block manager's blocks and
have query length 0, so attention skips them; their logits are dropped.

The LoRA graph serves any mix of plain adapters: which slot each token uses, and each slot's rank,
are data, not shapes. Steps that use an adapter with PEFT extras (DoRA, biases, replacement weights,
trainable tokens) run eagerly: the layers pick that path on the host. Ranks live in device copies
that ``refresh_ranks`` brings up to date before every replay (an adapter loaded into a slot after
capture changes them). Whether the embedding and lm_head add their deltas is part of the key
(``LoRAManager.slots_have_vocab_lora``, ``LoRAMapping.vocab_lora``): most adapters have none, and their steps'
graph skips those launches (the lm_head's run over the whole vocabulary); a step with an adapter that has one
replays the graph that runs them. So is whether every slot of the step has its linear layers' A exactly in
their weights' dtype (``LoRAMapping.a_exact_in_w``: the GEMMs that compute o's and down's shrink then read one
piece of A, not two). So a bucket has up to four LoRA graphs, each captured at the first step that needs it (a
capture mid-serve: its time, and a logits buffer of its own in the graphs' pool).

The static buffers are filled from pinned host memory by non-blocking copies (engine/transfer.py),
and a step scheduled ahead (async scheduling) copies its token ids from the device: filling them
never waits for the step still running on the device, and stream order keeps that step's replay
reading the old contents.

Graphs are captured lazily, at the first decode step of a bucket, after one eager warm-up run of
the same static inputs (which also compiles the Triton kernels). A capture that fails (a layer that
syncs to the host, an op that cannot be captured) raises ``GraphCaptureError``; the runner then
turns graphs off and runs the step eagerly.
"""

from __future__ import annotations

import torch

from loraserve.engine.transfer import copy_from_host
from loraserve.forward_context import AttentionMetadata, forward_context
from loraserve.lora.punica import LoRAMapping, SegmentMeta


class GraphCaptureError(RuntimeError):
    """Capturing a decode graph failed (the cause is chained); the step itself can still run eagerly."""


def _buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    b = 16
    while b < max_batch:
        out.append(b)
        b += 16
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_model_len: int, scratch_slot: int):
        self.runner = runner
        self.device = runner.device
        self.buckets = _buckets(max_batch)
        self.max_batch = self.buckets[-1]
        bs = runner.blocks.block_size
        self.max_blocks = -(-max_model_len // bs)
        dev = self.device
        self.scratch_slot = scratch_slot
        # rows: input ids, positions, KV slots, LoRA slot per token (-1 = base)
        self.longs = torch.zeros(4, self.max_batch, dtype=torch.long, device=dev)
        self.tables = torch.zeros(self.max_batch, 3 + self.max_blocks, dtype=torch.int32, device=dev)
        lm = runner.lora_manager
        self.max_loras = lm.max_loras if lm is not None else 0
        self.meta_bufs = {
            b: torch.zeros(b + 3 * self.max_loras, dtype=torch.int32, device=dev) for b in self.buckets
        }
        # (bucket, LoRA, the embedding's and lm_head's deltas, A exactly in W's dtype) -> (graph, its logits)
        self.graphs: dict[tuple[int, bool, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.stats = {"replays": 0, "captures": 0}

    def can_run(self, step) -> bool:
        B = len(step.input_ids)
        lm = self.runner.lora_manager
        return (
            0 < B <= self.max_batch
            and len(step.query_lens) == B
            and len(step.logit_rows) == B
            and max(step.query_lens) == 1
            and max(len(t) for t in step.block_tables) <= self.max_blocks
            # NOTE: layers choose their PEFT-extras path (DoRA, biases, ...) on the host; a graph would
            # replay whatever it saw at capture, so steps using such adapters run eagerly
            and not (step.token_slots is not None and lm.slots_have_extras(step.token_slots))
        )

    def _bucket(self, B: int) -> int:
        return next(b for b in self.buckets if b >= B)

    def _fill(self, step, Bp: int, use_lora: bool) -> None:
        B = len(step.input_ids)
        pad = Bp - B
        slots = step.token_slots if step.token_slots is not None else [-1] * B
        longs = [
            step.input_ids + [0] * pad,
            step.positions + [0] * pad,
            step.slot_mapping + [self.scratch_slot] * pad,
            slots + [-1] * pad,
        ]
        copy_from_host(self.longs[:, :Bp], longs)
        if step.device_input_ids is not None:  # scheduled ahead: the ids are the last step's samples
            self.longs[0, :B].copy_(step.device_input_ids)
        rows = [
            [qs, n, c] + t + [0] * (self.max_blocks - len(t))
            for t, qs, n, c in zip(step.block_tables, step.query_starts, step.query_lens, step.context_lens)
        ]
        rows += [[B + i, 0, 0] + [0] * self.max_blocks for i in range(pad)]
        copy_from_host(self.tables[:Bp], rows)
        if use_lora:
            copy_from_host(self.meta_bufs[Bp], SegmentMeta.static_host(slots, Bp, self.max_loras))

    def _contexts(self, Bp: int, use_lora: bool, vocab_lora: bool, a_exact: bool):
        md = AttentionMetadata(
            slot_mapping=self.longs[2, :Bp],
            query_starts=list(range(Bp)),
            query_lens=[1] * Bp,
            context_lens=[1] * Bp,
            kv_slots=[],
            block_tables=self.tables[:Bp, 3:],
            seq_info=self.tables[:Bp, :3],
            block_size=self.runner.blocks.block_size,
        )
        mapping = None
        if use_lora:
            meta = SegmentMeta(self.meta_bufs[Bp], Bp, self.max_loras, Bp, static=True)
            token_slots = self.longs[3, :Bp]
            placeholder = [(0, token_slots[:0])]  # non-empty: the layers take the LoRA path
            mapping = LoRAMapping(
                token_slots=token_slots,
                logit_slots=token_slots,  # decode: the logits rows are the tokens, in order
                token_segments=placeholder,
                logit_segments=placeholder,
                token_order=token_slots,  # unused by the kernels, which read the static meta
                seg_starts=[0],
                seg_lens=[0],
                token_meta=meta,
                logit_meta=meta,
                vocab_lora=vocab_lora,
                a_exact_in_w=a_exact,
            )
        return md, mapping

    def _forward(self, Bp: int, use_lora: bool, vocab_lora: bool, a_exact: bool) -> torch.Tensor:
        md, mapping = self._contexts(Bp, use_lora, vocab_lora, a_exact)
        with forward_context(attn=md, lora=mapping, cuda_graph=True):
            hidden = self.runner.model(self.longs[0, :Bp], self.longs[1, :Bp])
            return self.runner.model.compute_logits(hidden)

    def _capture(self, Bp: int, use_lora: bool, vocab_lora: bool, a_exact: bool):
        torch.cuda.synchronize(self.device)
        self._forward(Bp, use_lora, vocab_lora, a_exact)  # warm-up: compiles kernels, creates cached device tensors
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(
                g, pool=self.pool, capture_error_mode="thread_local"
            ):  # adapter loads may run beside
                logits = self._forward(Bp, use_lora, vocab_lora, a_exact)
        except Exception as e:
            # NOTE: when capture_end raises, torch.cuda.graph leaves its side stream current
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize(self.device)
            raise GraphCaptureError(f"batch bucket {Bp}: {type(e).__name__}: {e}") from e
        if self.pool is None:
            self.pool = g.pool()
        self.stats["captures"] += 1
        return g, logits

    @torch.inference_mode()
    def run(self, step) -> torch.Tensor:
        """Logits (B, V) fp32 of a decode step, by graph replay."""
        B = len(step.input_ids)
        Bp = self._bucket(B)
        use_lora = step.token_slots is not None and self.max_loras > 0
        self._fill(step, Bp, use_lora)
        lm = self.runner.lora_manager
        vocab_lora = use_lora and lm.slots_have_vocab_lora(step.token_slots)
        a_exact = use_lora and lm.slots_a_exact_in_w(step.token_slots)
        if use_lora:
            lm.punica.kernels.refresh_ranks()
        key = (Bp, use_lora, vocab_lora, a_exact)
        if key not in self.graphs:
            self.graphs[key] = self._capture(Bp, use_lora, vocab_lora, a_exact)
            self._fill(step, Bp, use_lora)  # the warm-up and capture ran on these buffers
        g, logits = self.graphs[key]
        g.replay()
        self.stats["replays"] += 1
        return logits[:B].clone()
