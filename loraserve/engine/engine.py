"""LLMEngine: add_request / step / abort.

``step()`` is the algorithm: schedule -> run the model (prepare + forward) -> sample -> postprocess.
Everything else (LoRA slots, KV blocks, detokenization) lives behind one object each; each phase's
wall time accumulates in ``step_timings`` (engine/timings.py).

Sampling and logprobs run on the logits' device; the sampled ids and the logprob numbers asked for
come back to the host in one transfer per step (``HostCopy``: non-blocking, then one event).

Async scheduling (``SchedulerConfig.async_scheduling``; on by default on CUDA at TP=1): between
queueing step k (forward + sampling) and reading its ids back, ``step()`` queues step k+1 when it is
a plain decode of the same sequences (``_launch_ahead``): each one's new token is step k's sample,
gathered on the device. The host then post-processes step k (detokenize, stop checks) while the
device runs step k+1, and the next ``step()`` call finishes k+1. Invariants:

- ``step()`` still returns step k's outputs on its k-th call: at most one step is carried over
  (``_inflight``), and the outputs are the synchronous engine's (same ids, texts, logprobs).
- A sequence that step k stops (EOS, stop token or string) or that is aborted meanwhile still runs in
  step k+1; that token is discarded, never appended. Its blocks are freed at once: any later use of
  them is queued behind step k+1 on the same stream. Sequences that step k surely ends (max_tokens,
  max_model_len) are left out of step k+1.
- Step k+1 is launched only when it is the step ``schedule()`` would make next (nobody waits, every
  running sequence decodes, KV slots without preemption: ``Scheduler.schedule_ahead``). A new
  request therefore waits one step: the carried step finishes, then the next call schedules it.
- Sampling step k+1 counts step k's token as one pending output (``min_tokens``); seeded generators
  draw in step order. Unseeded random sampling shares one generator across rows, so discarded rows
  shift its draws: it is a valid sample, not the synchronous engine's.
- Nothing on the way of step k+1 waits for the device (engine/transfer.py); eager forwards still
  copy inside some layers (attention work lists, LoRA mappings), so the full overlap needs graphs.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from loraserve.config import EngineConfig, resolve_dtype
from loraserve.engine.detokenizer import detokenize_incrementally, fast_decoder, find_stop_string
from loraserve.engine.failures import FailureIsolation, non_finite_message
from loraserve.engine.kv_cache import BlockManager
from loraserve.engine.logprobs import LogprobRows, logprob_dict, record_prompt_logprobs, step_logprob_stats
from loraserve.engine.model_runner import ModelRunner, RunnerOutput, size_kv_cache
from loraserve.engine.sampler import NO_TOKEN, Sampler, TopLogprobs, unpack_logprobs
from loraserve.engine.scheduler import ScheduledBatch, Scheduler
from loraserve.engine.sequence import Request, Sequence
from loraserve.engine.timings import StepClock, StepTimings
from loraserve.engine.transfer import HostCopy, to_device
from loraserve.engine.worker import EngineDeadError, start_tensor_parallel
from loraserve.lora.request import LoRARequest
from loraserve.models.loader import build_model, resolve_model_dir
from loraserve.outputs import RequestOutput
from loraserve.sampling import SamplingParams

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request is invalid (too long, bad token ids, ...); the message says how to fix it."""


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; nothing of it is read back yet."""

    batch: ScheduledBatch
    out: RunnerOutput
    sampled: torch.Tensor | None  # (len(out.sample_seqs),) ids on the device; None = no sequence samples
    logprob_rows: LogprobRows | None
    readback: HostCopy  # [sampled ids, logprob stats] on their way to the host

    @property
    def decode_only(self) -> bool:
        """Every sequence ran one token and samples: the shape a next step can be launched ahead of."""
        one_each = all(n == 1 for n in self.batch.num_new_tokens)
        return one_each and len(self.out.sample_seqs) == len(self.batch.seqs)


class LLMEngine(FailureIsolation):
    def __init__(self, config: EngineConfig, progress: bool = True):
        self.config = config
        mc = config.model
        self.model_dir, self.model_name = resolve_model_dir(mc.model, config.env)
        self.hf_config = AutoConfig.from_pretrained(str(self.model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self._decode = fast_decoder(self.tokenizer)
        self.device = torch.device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, getattr(self.hf_config, "dtype", None), self.device)
        self.max_model_len = mc.max_model_len or getattr(self.hf_config, "max_position_embeddings", 2048)
        self.vocab_size = self.hf_config.vocab_size
        torch.manual_seed(mc.seed)
        # tensor parallelism (engine/worker.py): None at TP=1; under torchrun, ranks > 0 serve here and exit
        self.workers = start_tensor_parallel(config, self.model_dir)
        self.model = build_model(
            self.hf_config, self.model_dir, self.device, self.dtype, mc.load_format, mc.seed, progress
        )

        self.lora_manager = None
        if config.lora is not None:
            from loraserve.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, config.lora, self.hf_config, self.device)

        sc = config.scheduler
        num_blocks = size_kv_cache(
            self.model, config.cache, self.dtype, self.device, sc.max_num_seqs, self.max_model_len
        )
        self.blocks = BlockManager(num_blocks, config.cache.block_size)
        self.scheduler = Scheduler(sc, self.blocks, adapters=self.lora_manager)
        self.runner = ModelRunner(self.model, self.blocks, self.dtype, self.device, self.lora_manager)
        self.async_scheduling = self._use_async_scheduling()
        self._inflight: LaunchedStep | None = None  # launched ahead by the last step() call
        self.num_launched_ahead = 0  # steps launched before the previous one was read back
        self.num_discarded_tokens = 0  # tokens of those steps for sequences that had finished meanwhile
        if self.workers is not None:
            self.workers.attach(self.runner, self.lora_manager, num_blocks)
        if self._use_cuda_graphs():
            self.runner.enable_cuda_graphs(sc.max_num_seqs, self.max_model_len)
        self.sampler = Sampler(mc.seed)
        self.step_timings = StepTimings()
        self._sync_device = self.device if config.env.profile_sync else None
        self.eos_token_ids = self._eos_ids()
        self.requests: dict[str, Request] = {}
        self.consecutive_step_failures = 0
        self.dead: EngineDeadError | None = None  # set once a failure leaves the engine unable to go on
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()

    def _use_cuda_graphs(self) -> bool:
        """CUDA graphs by default where they work: a CUDA device, GPU attention, TP=1, not enforce_eager."""
        return (
            self.device.type == "cuda"
            and self.runner.gpu_attention
            and self.config.parallel.tensor_parallel_size == 1
            and not self.config.model.enforce_eager
        )

    def _use_async_scheduling(self) -> bool:
        """Async scheduling as configured; by default on for a CUDA device. Never under tensor
        parallelism: the workers would need the device-side token ids of each step."""
        want = self.config.scheduler.async_scheduling
        if want is None:
            want = self.device.type == "cuda"
        if want and self.workers is not None:
            if self.config.scheduler.async_scheduling:
                logger.warning("async scheduling does not support tensor parallelism; steps run one by one")
            return False
        return want

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.hf_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(src)
        return ids

    # ---- requests -------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._req_ids))

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.check_healthy()
        if not self.requests:  # idle: failures before now were not "in a row" with what comes next
            self.consecutive_step_failures = 0
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        self.validate_prompt(prompt_token_ids, params)
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            if self.lora_manager is None:
                raise RequestError("this engine was started without LoRA; restart with enable_lora=True")
            self.lora_manager.add_adapter(lora_request)  # parses and validates now: errors before queuing
        seqs = []
        for i in range(params.n):
            # completion i uses seed + i; its generator is made on the device when it first samples
            seed = None if params.seed is None else params.seed + i
            seqs.append(
                Sequence(
                    next(self._seq_ids), request_id, i, list(prompt_token_ids), params, lora_request, seed
                )
            )
        req = Request(request_id, prompt, list(prompt_token_ids), params, lora_request, seqs)
        self.requests[request_id] = req
        for s in seqs:
            if self.lora_manager is not None and lora_request is not None:
                self.lora_manager.acquire(lora_request.lora_int_id)
            self.scheduler.add(s)

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                f"(prompt + at least one new token must fit); shorten the prompt or raise --max-model-len"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}); pass ids of this model"
            )
        # NOTE: the longest this request can get must fit the whole cache, or preemption livelocks
        # (it evicts itself forever); the last sampled token needs no KV, hence the - 1.
        reach = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if self.blocks.blocks_for(reach - 1) > self.blocks.num_blocks:
            raise RequestError(
                f"the request can reach {reach} tokens (prompt {len(ids)} + max_tokens), which need "
                f"{self.blocks.blocks_for(reach - 1)} KV blocks but the cache has {self.blocks.num_blocks}; "
                f"raise the KV cache size, lower max_tokens or shorten the prompt"
            )

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_healthy(self) -> bool:
        """False once the engine gave up (``_fail_step``), a tensor-parallel worker died or a collective
        failed: the engine cannot recover."""
        return self.dead is None and (self.workers is None or self.workers.is_healthy())

    def check_healthy(self) -> None:
        """A dead engine, or under tensor parallelism a dead worker: fails every request and raises
        EngineDeadError."""
        err: EngineDeadError | None = self.dead
        if err is None and self.workers is not None:
            err = self.workers.failure()
        if err is not None:
            for rid in list(self.requests):
                self.abort_request(rid)
            raise err

    def shutdown(self) -> None:
        """End the tensor-parallel workers (nothing to do at TP=1); the engine cannot step afterwards."""
        if self.workers is not None:
            self.workers.shutdown()

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run (prepare, forward) -> sample -> postprocess; the outputs of the
        requests it touched. Under async scheduling the last call may have launched it already, and
        this call may launch the next one before reading this one back."""
        self.check_healthy()
        clock = self.step_timings.start(self._sync_device)
        batches: list[ScheduledBatch] = []  # what this call runs: the requests to fail if it raises
        try:
            launched, self._inflight = self._inflight, None
            if launched is None:  # nothing carried over from the last call: schedule now
                if failed := self._fail_broken_reloads():
                    return failed
                batch = self.scheduler.schedule()
                clock.lap("schedule")
                if batch.empty:
                    return self._idle()
                batches.append(batch)
                launched = self._launch(batch, clock)  # prepare -> forward -> sample, queued on the device
            else:
                batches.append(launched.batch)
            # async scheduling: queue the next step before reading this one back (None: steps run one by one)
            self._inflight = self._launch_ahead(launched, clock)
            token_ids, top = self._read_back(launched)  # the step's one wait on the device
            clock.lap("wait")
            outputs = self._postprocess(launched, token_ids, top)
            clock.lap("postprocess")
            self.consecutive_step_failures = 0
            return outputs
        except EngineDeadError:
            raise
        except Exception as e:
            return self._fail_step(e, batches)
        finally:
            clock.stop()

    def _launch(
        self, batch: ScheduledBatch, clock: StepClock, input_ids: torch.Tensor | None = None
    ) -> LaunchedStep:
        """Queue the batch's forward, sampling and logprobs on the device, and their copy back to the host.

        ``input_ids``: the token ids of a batch scheduled ahead, on the device.
        """
        try:
            prepared, plan = self.runner.prepare(batch, input_ids)
            clock.lap("prepare")
            out = self.runner.forward(prepared, plan)
            clock.lap("forward", sync=True)
        except EngineDeadError:  # a tensor-parallel worker died mid-step: fail every request
            self.check_healthy()
            raise
        # a step scheduled ahead samples while the last step's token is not appended: one pending each
        sampled = self._sample(out, pending=1 if batch.ahead else 0)
        # NOTE: NO_TOKEN (-1) marks a row whose logits were not finite; the logprobs gather a valid id
        valid = sampled.clamp(min=0) if sampled is not None else None
        stats, rows = step_logprob_stats(
            batch.seqs, out.prompt_logits, out.sample_seqs, out.sample_logits, valid
        )
        clock.lap("sample", sync=True)
        return LaunchedStep(batch, out, sampled, rows, HostCopy(sampled, stats))

    def _launch_ahead(self, current: LaunchedStep, clock: StepClock) -> LaunchedStep | None:
        """Async scheduling: launch the decode step after ``current`` before reading ``current`` back.

        Its sequences are current's that go on (all but those current surely ends or that finished
        meanwhile), each fed the token current samples for it, gathered on the device. None when async
        scheduling is off, current is not a plain decode, or the scheduler would make another step.

        NOTE: its adapters are current's, still in their slots, so preparing it writes no LoRA slot:
        such a write runs on the manager's copy stream, which does not wait for current.
        """
        if not self.async_scheduling or not current.decode_only:
            return None
        seqs = current.out.sample_seqs
        rows = [i for i, s in enumerate(seqs) if not s.is_finished and not self._ends_after_one_more(s)]
        batch = self.scheduler.schedule_ahead(current.batch, [seqs[i] for i in rows])
        clock.lap("schedule")
        if batch.empty:
            return None
        ids = current.sampled.clamp(min=0)  # a NO_TOKEN row's sequence fails: its next token is dropped
        if len(rows) < len(seqs):
            ids = ids.index_select(0, to_device(rows, torch.long, ids.device))
        self.num_launched_ahead += 1
        return self._launch(batch, clock, ids)

    def _ends_after_one_more(self, seq: Sequence) -> bool:
        """Whether the token being sampled for ``seq`` (not appended yet) surely ends it (length)."""
        max_tokens = seq.params.max_tokens
        by_max_tokens = max_tokens is not None and len(seq.output_token_ids) + 1 >= max_tokens
        return by_max_tokens or seq.num_tokens + 1 >= self.max_model_len

    def _read_back(self, launched: LaunchedStep) -> tuple[list[int], TopLogprobs | None]:
        """Wait for this step's results alone (not for a step launched after it): its sampled ids, and
        the top logprobs of its logprob rows."""
        ids, stats = launched.readback.wait()
        top = unpack_logprobs(stats, launched.logprob_rows.ks) if stats is not None else None
        return (ids.tolist() if ids is not None else []), top

    def _idle(self) -> list[RequestOutput]:
        """Nothing runnable: requests wait on adapter loads; wait a bit for one."""
        if self.lora_manager is not None and self.scheduler.has_unfinished():
            self.lora_manager.wait_for_loads()
        return []

    def _sample(self, out: RunnerOutput, pending: int = 0) -> torch.Tensor | None:
        """The sampled ids (len(sample_seqs),) on the logits' device; None when no sequence samples.

        ``pending``: output tokens each sequence has that are not appended yet (a step scheduled ahead).
        """
        if not out.sample_seqs:
            return None
        dev = out.sample_logits.device
        params = [s.params for s in out.sample_seqs]
        gens = [s.generator_on(dev) for s in out.sample_seqs]
        banned = [self._banned_ids(s, pending) for s in out.sample_seqs]
        return self.sampler(out.sample_logits, params, gens, banned)

    def _banned_ids(self, seq: Sequence, pending: int = 0) -> list[int] | torch.Tensor:
        """The stop tokens ``seq`` may not produce yet (before min_tokens); built once per sequence."""
        if len(seq.output_token_ids) + pending >= seq.params.min_tokens:
            return []
        if seq.banned_ids is None:
            stops = set(seq.params.stop_token_ids)
            if not seq.params.ignore_eos:
                stops |= self.eos_token_ids
            seq.banned_ids = torch.tensor(sorted(stops), dtype=torch.long)
        return seq.banned_ids

    def _postprocess(
        self, launched: LaunchedStep, token_ids: list[int], top: TopLogprobs | None
    ) -> list[RequestOutput]:
        """Append the sampled tokens, record logprobs, check stops; the outputs of the requests it touched.

        ``top``: the logprobs of the step's logprob rows (``LogprobRows``), None when it has none.
        """
        batch, out = launched.batch, launched.out
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if not seq.is_finished:  # finished meanwhile: stopped by the step before (async) or aborted
                seq.num_computed_tokens += n
        rows = launched.logprob_rows
        if rows is not None:
            record_prompt_logprobs(rows, top, self._decode_token)
        row0 = rows.sample_row0 if rows is not None else None
        now = time.monotonic()
        failed: dict[str, str] = {}
        for i, (seq, tok) in enumerate(zip(out.sample_seqs, token_ids)):
            if seq.is_finished:  # a token of a step launched ahead, after the sequence stopped: dropped
                self.num_discarded_tokens += 1
                continue
            if tok == NO_TOKEN:
                failed[seq.request_id] = non_finite_message(seq)
                continue
            if seq.prompt_logprobs is None and seq.params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None] + [
                    seq.prompt_logprobs_by_pos[p] for p in range(seq.num_prompt_tokens - 1)
                ]
            seq.output_token_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if row0 is not None and seq.logprobs is not None:
                seq.logprobs.append(logprob_dict(top, row0 + i, tok, self._decode_token))
            self._check_stop(seq, tok)
        touched = {s.request_id for s in batch.seqs} - failed.keys()
        outs = [self._fail_request(r, msg) for r, msg in failed.items() if r in self.requests]
        return outs + [self._request_output(self.requests[r]) for r in touched if r in self.requests]

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        new_text = detokenize_incrementally(self._decode, seq)
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                return self._finish(seq, "stop")
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
                return self._finish(seq, "stop")
            stop = find_stop_string(seq, len(new_text)) if p.stop_list else None
            if stop is not None:
                seq.stop_reason = stop
                return self._finish(seq, "stop")
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.lora_manager is not None and seq.lora_int_id:
            self.lora_manager.release(seq.lora_int_id)

    def _request_output(self, req: Request) -> RequestOutput:
        if req.finished:
            self.requests.pop(req.request_id, None)
        return req.output()
