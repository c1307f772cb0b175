"""Measuring for bench_scale.py through the public API only: ``LLM(...)``, ``add_lora`` / ``remove_lora``,
``llm.engine.add_request / step / has_unfinished_requests / abort_request``.

A pass adds its requests on their timeline (all at 0: offline) and steps the engine until all finish. Per step
it records the wall time and the requests it returned; a step counts as a decode step when it returned tokens
and none of them was a request's first (no prefill finished in it). TTFT = the end of the step that returned a
request's first token - the request's scheduled arrival.
"""

from __future__ import annotations

import gc
import inspect
import statistics
import time
from dataclasses import dataclass, field

import torch
from scale_workload import AdapterIds, Request, make_requests

from loraserve import LLM, LoRARequest, SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class PassResult:
    total_s: float
    gen_tokens: int
    n_requests: int
    ttft_s: list[float]  # per request, in request order (None-free: a request without a token is an error)
    step_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    decode_batch: list[int] = field(default_factory=list)
    # distinct adapters among a decode step's requests
    decode_distinct: list[int] = field(default_factory=list)
    decode_bytes: list[int] = field(default_factory=list)  # their adapter bytes
    errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    prefill_s: float | None = None  # offline: until the last request's first token

    def summary(self) -> dict:
        return dict(
            tok_s=self.gen_tokens / self.total_s if self.total_s > 0 else None,
            req_s=self.n_requests / self.total_s if self.total_s > 0 else None,
            total_s=self.total_s,
            gen_tokens=self.gen_tokens,
            n_requests=self.n_requests,
            steps=len(self.step_s),
            decode_steps=len(self.decode_s),
            decode_ms=1e3 * statistics.median(self.decode_s) if self.decode_s else None,
            decode_batch=statistics.median(self.decode_batch) if self.decode_batch else None,
            distinct_per_step=statistics.median(self.decode_distinct) if self.decode_distinct else None,
            adapter_bytes_per_step=statistics.median(self.decode_bytes) if self.decode_bytes else None,
            prefill_tok_s=self.prompt_tokens / self.prefill_s if self.prefill_s else None,
            ttft_p50_ms=None if not self.ttft_s else 1e3 * pct(self.ttft_s, 0.5),
            ttft_p99_ms=None if not self.ttft_s else 1e3 * pct(self.ttft_s, 0.99),
            errors=len(self.errors),
            first_error=self.errors[0] if self.errors else None,
        )


def run_pass(
    llm: LLM, reqs: list[Request], loras: list[LoRARequest | None], bytes_of=None, timeline: bool = False
) -> PassResult:
    """Serve ``reqs`` (``loras[i]`` for request i). timeline: add each at its ``arrival_s`` (Poisson), else all at
    once. bytes_of(lora_int_id) -> adapter bytes, for the decode steps' adapter bytes. Offline, prefill tok/s =
    prompt tokens / time to the last first token (the decodes that continuous batching mixes in included)."""
    eng = llm.engine
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s) if timeline else list(range(len(reqs)))
    arrival = {}  # request id -> scheduled arrival (s from t0)
    lora_of, first, done, errors = {}, {}, {}, []
    res = PassResult(0.0, 0, len(reqs), [])
    nxt = 0
    sync()
    t0 = time.perf_counter()
    try:
        while nxt < len(order) or eng.has_unfinished_requests():
            now = time.perf_counter() - t0
            while nxt < len(order) and (not timeline or reqs[order[nxt]].arrival_s <= now):
                i = order[nxt]
                r = reqs[i]
                rid = eng.new_request_id()
                sp = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
                eng.add_request(rid, None, sp, r.prompt, loras[i])
                arrival[rid] = r.arrival_s if timeline else 0.0
                lora_of[rid] = loras[i].lora_int_id if loras[i] is not None else 0
                nxt += 1
            if not eng.has_unfinished_requests():
                time.sleep(max(0.0, reqs[order[nxt]].arrival_s - (time.perf_counter() - t0)))
                continue
            ts = time.perf_counter()
            outs = eng.step()
            te = time.perf_counter()
            res.step_s.append(te - ts)
            got_first = False
            for o in outs:
                n = len(o.outputs[0].token_ids) if o.outputs else 0
                if n and o.request_id not in first:
                    first[o.request_id] = te - t0
                    got_first = True
                if o.finished:
                    done[o.request_id] = n
                    if o.error is not None or (o.outputs and o.outputs[0].finish_reason == "error"):
                        errors.append(o.error or "error")
            if outs and not got_first:
                res.decode_s.append(te - ts)
                res.decode_batch.append(len(outs))
                ids = {lora_of[o.request_id] for o in outs} - {0}
                res.decode_distinct.append(len(ids))
                res.decode_bytes.append(sum(bytes_of(i) for i in ids) if bytes_of else 0)
        sync()
        res.total_s = time.perf_counter() - t0
    except BaseException:
        for rid in arrival:  # leave nothing of this pass behind in the engine
            eng.abort_request(rid)
        raise
    res.gen_tokens = sum(done.values())
    res.ttft_s = [first[r] - arrival[r] for r in arrival if r in first]
    res.prompt_tokens = sum(len(r.prompt) for r in reqs)
    if not timeline and first:
        res.prefill_s = max(first.values())
    res.errors = errors
    return res


def ramp_sizes(batch: int) -> list[int]:
    """The running batch sizes ``ramp_warmup`` steps through; its longest request has 1 + len() new tokens."""
    return sorted({s for s in (1, 2, 4) if s <= batch} | set(range(8, batch + 1, 8)) | {batch})


def ramp_warmup(
    llm: LLM, batch: int, prompt_len: int, vocab: int, loras: list[LoRARequest | None], seed: int
) -> None:
    """One untimed pass whose running batch steps down through every size in {1, 2, 4, multiples of 8} <= batch,
    so every decode graph bucket a later pass meets is captured (and its kernels compiled) here, not in a timing.
    Request i lives for 1 + (number of those sizes > i) tokens."""
    sizes = ramp_sizes(batch)
    lengths = [(prompt_len, 1 + sum(s > i for s in sizes)) for i in range(batch)]
    reqs = make_requests(lengths, None, vocab, seed)
    res = run_pass(llm, reqs, [loras[i % len(loras)] for i in range(batch)])
    if res.errors:
        raise RuntimeError(f"warm-up failed: {res.errors[0]}")


def llm_kwargs(kw: dict) -> tuple[dict, list[str]]:
    """The arguments this loraserve's ``LLM`` takes, and the names it does not (dropped, reported)."""
    params = inspect.signature(LLM.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kw, []
    return {k: v for k, v in kw.items() if k in params}, [k for k in kw if k not in params]


def free_llm(llm) -> None:
    """Stop what the engine runs beside it (tensor-parallel workers); the caller drops its references and then
    calls ``release_memory``."""
    if llm is not None:
        try:
            llm.shutdown()
        except Exception:
            pass


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_headroom_gb() -> float | None:
    """Free device memory plus what torch's allocator holds unused, in GiB (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return (free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / (1 << 30)


def probe_cold(
    llm: LLM, ids: AdapterIds, max_loras: int, prompt_len: int, vocab: int, reps: int, seed: int
) -> dict:
    """TTFT of one request (max_tokens 1) on an idle engine, median of ``reps``, by where its adapter is:
    base (none); resident (used just before); registered but never used ("cold": files in the page cache);
    not registered (the request carries the path); 8 of each cold kind at once (p50 and max of the 8);
    used, then ``max_loras`` other adapters served (evicted from a slot today; in host memory)."""

    def ttft(loras: list[LoRARequest | None], k: int) -> list[float]:
        reqs = make_requests([(prompt_len, 1)] * len(loras), None, vocab, seed + k)
        res = run_pass(llm, reqs, loras)
        if res.errors:
            raise RuntimeError(res.errors[0])
        return res.ttft_s

    out, used = {}, []
    hot = ids.warm_for([0])[0]
    ttft([hot], 0)
    out["base"] = statistics.median(ttft([None], 1 + k)[0] for k in range(reps))
    out["resident"] = statistics.median(ttft([hot], 10 + k)[0] for k in range(reps))
    cold = ids.cold_ids(reps + 8)
    used += cold
    ids.store.read_into_page_cache([r.lora_int_id for r in cold])
    out["registered_unused"] = statistics.median(ttft([cold[k]], 20 + k)[0] for k in range(reps))
    t8 = ttft(cold[reps:], 30)
    out["registered_unused_8_at_once_p50"], out["registered_unused_8_at_once_max"] = (
        statistics.median(t8),
        max(t8),
    )
    unreg = [ids.new() for _ in range(reps + 8)]
    used += unreg
    ids.store.read_into_page_cache([r.lora_int_id for r in unreg])
    out["unregistered"] = statistics.median(ttft([unreg[k]], 40 + k)[0] for k in range(reps))
    t8 = ttft(unreg[reps:], 50)
    out["unregistered_8_at_once_p50"], out["unregistered_8_at_once_max"] = statistics.median(t8), max(t8)
    others = []
    if max_loras < 64 or len(ids.warm) > max_loras:
        others = list(ids.warm_for(range(1, max_loras + 1)).values())
    if others:  # evict ``hot`` from a max_loras-slot engine: serve max_loras others, then ``hot``
        ttft([hot], 60)
        ttft(others, 61)
        out["after_max_loras_others"] = ttft([hot], 62)[0]
    ids.retire(used)
    return {k: 1e3 * v for k, v in out.items()}


def copy_bandwidth(nbytes: int | None = None, reps: int = 5) -> dict:
    """GB/s of a pinned host -> device copy and of a device -> device copy (the copy's own bytes, and the HBM
    traffic, read + write = 2x), best of ``reps``. On the CPU: a host memcpy, for the same fields."""
    cuda = torch.cuda.is_available()
    nbytes = nbytes or ((1 << 30) if cuda else (64 << 20))
    dev = "cuda" if cuda else "cpu"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)

    def best(fn) -> float:
        fn()
        sync()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return nbytes / min(ts) / 1e9

    h2d = best(lambda: a.copy_(host, non_blocking=True))
    d2d = best(lambda: b.copy_(a))
    return dict(bytes=nbytes, h2d_gbps=h2d, d2d_copy_gbps=d2d, hbm_gbps=2 * d2d)


def bench_hf(
    cfg, store, counts: list[int], batch: int, prompt_len: int, new_tokens: int, dtype, seed: int
) -> dict:
    """HF transformers + PEFT mixed-batch ``generate(adapter_names=...)``, as benchmarks/gpu/bench_e2e.py does:
    the base and ``counts`` adapters (request i uses adapter i % n). tok/s = batch * new_tokens / t(new_tokens);
    decode step = (t(new_tokens) - t(1)) / (new_tokens - 1)."""
    from bench_e2e import hf_generate
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    t = time.perf_counter()
    n_max = max(counts)
    model = PeftModel.from_pretrained(model, str(store.paths[0]), adapter_name="a0")
    for i in range(1, n_max):
        model.load_adapter(str(store.paths[i % len(store.paths)]), adapter_name=f"a{i}")
    load_s = time.perf_counter() - t
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, cfg.vocab_size, (batch, prompt_len), generator=g).to(dev)
    mask = torch.ones_like(ids)
    res = {"adapters_load_s": load_s, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens}
    for n in [0, *counts]:
        names = ["__base__"] * batch if n == 0 else [f"a{i % n}" for i in range(batch)]
        hf_generate(model, ids, mask, names, 2)
        t1, tn = hf_generate(model, ids, mask, names, 1), hf_generate(model, ids, mask, names, new_tokens)
        res[str(n)] = dict(
            tok_s=batch * new_tokens / tn, total_s=tn, decode_ms=1e3 * (tn - t1) / max(1, new_tokens - 1)
        )
    del model
    release_memory()
    return res
