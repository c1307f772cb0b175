"""End to end on the GPU: loraserve (base vs 8 mixed adapters; eager, CUDA graphs, and CUDA graphs with
async scheduling, the default) vs HF + PEFT.

Shapes: Llama-3.1-8B and Qwen2.5-0.5B (tied embeddings), bf16, random weights (``load_format=
"dummy"``; no checkpoint), random prompts. Batch 32 x prompt 128 -> 128 new tokens, greedy, EOS
ignored. 8 rank-16 adapters (PEFT format, random A and B) on q, k, v, o, gate, up, down, assigned
round-robin (request i uses adapter i % 8). Throughput = generated tokens / wall time of the whole
batch (prefill included); decode-step ms = median wall time of the engine's decode steps.

HF transformers + PEFT: ``generate(..., adapter_names=[...])`` (PEFT's mixed-batch LoRA) on the same
GPU in the same process, with fewer new tokens (``--hf-new-tokens``) because it is slow; its decode
step = (t(N new) - t(1 new)) / (N - 1).

Parity: a tiny random Llama (saved as a real checkpoint), 4 adapters + base in one batch, bf16:
max |logprob difference| of loraserve (eager and graphs) vs HF + PEFT over prompt and decode tokens.

    python benchmarks/gpu/bench_e2e.py --json /tmp/e2e.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dummy import hf_config, make_adapter, make_model_dir, make_tokenizer  # noqa: E402

from loraserve import LLM, LoRARequest, SamplingParams  # noqa: E402

N_ADAPTERS = 8
DEVICE = "cuda"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(llm: LLM, prompts, loras, new_tokens: int) -> tuple[float, list[float], list[list[int]]]:
    """(total seconds, per-step seconds, generated ids) driving the engine's step loop directly."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rids = []
    for p, lr in zip(prompts, loras):
        rid = eng.new_request_id()
        eng.add_request(rid, None, sp, p, lr)
        rids.append(rid)
    steps, done = [], {}
    sync()
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        ts = time.perf_counter()
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        steps.append(time.perf_counter() - ts)
    total = time.perf_counter() - t0
    return total, steps, [done[r] for r in rids]


_KERNEL_KINDS = (  # substring of a kernel's name -> its category, first match wins
    ("lora", ("_lora_shrink", "_lora_expand", "_moe_lora")),
    ("attention", ("paged_attention", "_attn", "attention")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90", "cublas", "_moe_gemm", "_decode_linear")),  # the LoRA expand rides in _decode_linear
)


def kernel_breakdown(llm: LLM, prompts, loras, steps: int = 3) -> dict:
    """GPU kernel ms per eager decode step by category (torch.profiler, CUDA activity), graphs off."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    graphs, eng.runner.graphs = eng.runner.graphs, None
    sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for p, lr in zip(prompts, loras):
        eng.add_request(eng.new_request_id(), None, sp, p, lr)
    for _ in range(3):  # prefill + warm decode steps
        eng.step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        sync()
    while eng.has_unfinished_requests():
        eng.step()
    eng.runner.graphs = graphs
    out: dict[str, float] = {}
    top = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = ev.cuda_time_total
        if us <= 0:
            continue
        kind = next((k for k, subs in _KERNEL_KINDS if any(s in ev.key for s in subs)), "other")
        out[kind] = out.get(kind, 0.0) + us / 1e3 / steps
        top.append((us / steps, ev.count / steps, ev.key[:60]))
    res = {k: round(v, 3) for k, v in sorted(out.items())}
    # the kernels that take most of a step: (µs per step, launches per step, µs per launch, name)
    res["top"] = [(round(t, 1), round(c, 1), round(t / max(c, 1e-9), 2), name) for t, c, name in sorted(top, reverse=True)[:14]]
    return res


def bench_ours(model_dir: Path, adapters: list[Path], prompts, new_tokens: int, lora_dtype: str = "auto",
               profile_steps: bool = True) -> dict:
    n = len(prompts)
    llm = LLM(
        str(model_dir), dtype="bfloat16", load_format="dummy", enable_lora=True, max_loras=N_ADAPTERS,
        max_lora_rank=16, max_num_seqs=n, max_num_batched_tokens=4096, max_model_len=512,
        num_kv_blocks=n * (512 // 16) + 8, lora_dtype=lora_dtype, enforce_eager=True,
    )  # fmt: skip
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    mixed = [reqs[i % N_ADAPTERS] for i in range(n)]
    base = [None] * n
    res = {}
    for mode in ("eager", "graphs_sync", "graphs"):  # graphs: with async scheduling (the default)
        llm.engine.async_scheduling = mode == "graphs"
        if mode == "graphs_sync":
            llm.engine.runner.enable_cuda_graphs(n, 512)
        for name, loras in (("base", base), ("mixed", mixed)):
            timed_generate(
                llm, prompts, loras, 4
            )  # warm-up: kernels compiled, adapters resident, graphs captured
            timings = getattr(llm.engine, "step_timings", None)
            if timings is not None:
                timings.reset()
            total, steps, ids = timed_generate(llm, prompts, loras, new_tokens)
            res[f"{mode}_{name}"] = dict(
                tok_s=n * new_tokens / total,
                total_s=total,
                decode_ms=1e3 * statistics.median(steps[1:]),
                prefill_ms=1e3 * steps[0],
                ids=ids,
            )
            if timings is not None:
                res[f"{mode}_{name}"]["phase_ms_per_step"] = {k: round(v["mean_ms"], 3) for k, v in timings.as_dict().items()}
    g = llm.engine.runner.graphs
    res["graph_stats"] = dict(g.stats)
    if profile_steps:
        from triton.testing import do_bench

        for (bucket, use_lora, *_variant), (graph, _) in g.graphs.items():  # GPU time of one decode step, no host work
            if bucket == n:
                key = f"graph_replay_ms_{'lora' if use_lora else 'base'}"
                assert key not in res, f"two LoRA graph variants of bucket {n}: {list(g.graphs)}"
                res[key] = do_bench(
                    graph.replay, warmup=5, rep=50, return_mode="median"
                )
        res["kernels_ms_per_step_base"] = kernel_breakdown(llm, prompts, base)
        res["kernels_ms_per_step_mixed"] = kernel_breakdown(llm, prompts, mixed)
    for name in ("base", "mixed"):  # greedy ids, graphs (async) and graphs_sync vs eager
        for mode in ("graphs_sync", "graphs"):
            same = sum(a == b for a, b in zip(res[f"eager_{name}"]["ids"], res[f"{mode}_{name}"]["ids"]))
            res[f"{mode}_vs_eager_same_seqs_{name}"] = f"{same}/{n}"
    for v in res.values():
        if isinstance(v, dict):
            v.pop("ids", None)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


def hf_generate(model, ids, mask, names: list[str], k: int) -> float:
    """Seconds for HF generate of exactly k new tokens (greedy, PEFT mixed batch by adapter_names)."""
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, adapter_names=names, max_new_tokens=k, min_new_tokens=k,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    sync()
    return time.perf_counter() - t0


def bench_hf(cfg, adapters: list[Path], prompts, new_tokens: int) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    model = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="a0")
    for i, p in enumerate(adapters[1:], start=1):
        model.load_adapter(str(p), adapter_name=f"a{i}")
    ids = torch.tensor(prompts, device=DEVICE)
    mask = torch.ones_like(ids)
    n = len(prompts)
    res = {}
    for name, names in (("base", ["__base__"] * n), ("mixed", [f"a{i % N_ADAPTERS}" for i in range(n)])):
        hf_generate(model, ids, mask, names, 2)
        t1, tn = hf_generate(model, ids, mask, names, 1), hf_generate(model, ids, mask, names, new_tokens)
        res[name] = dict(tok_s=n * new_tokens / tn, total_s=tn, decode_ms=1e3 * (tn - t1) / (new_tokens - 1))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


ASYNC: bool | None = None  # --no-async: False; None = the engine's default (on on CUDA)


def parity(root: Path) -> dict:
    """Max |Δ logprob| of loraserve vs HF + PEFT, bf16, tiny Llama, 4 adapters + base in one batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    cfg = hf_config("tiny-llama")
    d = root / "tiny"
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    make_tokenizer(d, cfg.vocab_size)
    adapters = [
        make_adapter(root / f"tiny_a{i}", cfg, rank=16, seed=100 + i, std=0.05, dtype=torch.float32)
        for i in range(4)
    ]
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(2, cfg.vocab_size, (int(k),), generator=g).tolist()
        for k in torch.randint(8, 60, (10,), generator=g)
    ]
    names = [None if i % 5 == 4 else i % 5 for i in range(len(prompts))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)

    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).to(DEVICE)
    hf = PeftModel.from_pretrained(hf, str(adapters[0]), adapter_name="a0")
    for i in range(1, 4):
        hf.load_adapter(str(adapters[i]), adapter_name=f"a{i}")
    hf.eval()
    out = {}
    modes = {"eager": "auto", "graphs": "auto", "graphs, fp32 LoRA weights": "float32", "graphs, bf16 LoRA weights": "bfloat16"}
    for mode, ldt in modes.items():
        llm = LLM(
            str(d), dtype="bfloat16", enable_lora=True, max_loras=4, max_lora_rank=16, num_kv_blocks=128,
            async_scheduling=ASYNC, lora_dtype=ldt,
        )
        if mode.startswith("graphs"):
            llm.engine.runner.enable_cuda_graphs(16, llm.engine.max_model_len)
        reqs = [None if a is None else LoRARequest(f"a{a}", a + 1, str(adapters[a])) for a in names]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=reqs)
        worst = 0.0
        for p, a, o in zip(prompts, names, outs):
            ids = p + o.outputs[0].token_ids
            with torch.no_grad():
                logits = hf(
                    torch.tensor([ids], device=DEVICE), adapter_names=["__base__" if a is None else f"a{a}"]
                ).logits[0]
            ref = torch.log_softmax(logits.float(), -1)
            ours = [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
            ours += [o.outputs[0].logprobs[j][t].logprob for j, t in enumerate(o.outputs[0].token_ids)]
            theirs = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
            worst = max(worst, max(abs(x - y) for x, y in zip(ours, theirs)))
        out[mode] = worst
        del llm
    return out


def use_decode_tiles(path: str) -> None:
    """Serve decode_linear with the tiles a sweep picked (shapes it did not sweep keep the defaults)."""
    from loraserve.layers import triton_decode_linear as dl

    with open(path) as f:
        table = {k: dl.DecodeTiles(**v) for k, v in json.load(f).items()}
    default = dl.default_tiles
    dl.default_tiles = lambda M, N, K, dtype, slices=None: table.get(f"{N},{K}") or default(M, N, K, dtype, slices)
    print(f"decode tiles: {table}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-new-tokens", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--bf16-loras", action="store_true", help="also run with LoRA weights stored in bf16")
    ap.add_argument("--lora-dtypes", default="", help="also run (graphs) with these LoRA storage dtypes, e.g. float32,bfloat16")
    ap.add_argument("--json", default=None)
    ap.add_argument("--parity-only", action="store_true")
    ap.add_argument("--no-async", action="store_true", help="async scheduling off (LLM(async_scheduling=False))")
    ap.add_argument("--decode-tiles", default=None, help="JSON {'N,K': tiles} from bench_decode_linear --tiles-out")
    args = ap.parse_args()
    extra_dtypes = [d for d in args.lora_dtypes.split(",") if d] + (["bfloat16"] if args.bf16_loras else [])
    if args.decode_tiles:
        use_decode_tiles(args.decode_tiles)
    if args.no_async:
        global ASYNC
        ASYNC = False
    import peft
    import transformers
    import triton

    print(
        f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"transformers {transformers.__version__} | peft {peft.__version__}",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.time()
        results["parity"] = parity(root)
        print(
            f"parity (tiny Llama, bf16, 4 adapters + base): {results['parity']}  [{time.time() - t0:.0f}s]",
            flush=True,
        )
        if args.parity_only:
            return
        for shape in args.shapes.split(","):
            t0 = time.time()
            cfg = hf_config(shape)
            mdir = make_model_dir(root / shape, shape)
            adapters = [make_adapter(root / f"{shape}-a{i}", cfg, rank=16, seed=i) for i in range(N_ADAPTERS)]
            g = torch.Generator().manual_seed(0)
            prompts = torch.randint(2, cfg.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
            r = {"ours": bench_ours(mdir, adapters, prompts, args.new_tokens)}
            print(f"{shape} ours: {json.dumps(r['ours'])}  [{time.time() - t0:.0f}s]", flush=True)
            for ldt in extra_dtypes:  # bfloat16: vLLM's default (the model's dtype); float32: PEFT's
                r[f"ours_{ldt}_loras"] = bench_ours(mdir, adapters, prompts, args.new_tokens, ldt, False)
                print(f"{shape} ours, {ldt} LoRA weights: {json.dumps(r[f'ours_{ldt}_loras'])}", flush=True)
            if not args.skip_hf:
                r["hf"] = bench_hf(cfg, adapters, prompts, args.hf_new_tokens)
                print(f"{shape} hf+peft: {json.dumps(r['hf'])}  [{time.time() - t0:.0f}s]", flush=True)
            results[shape] = r
    print()
    print(
        f"batch {args.batch} x prompt {args.prompt_len} -> {args.new_tokens} new tokens (HF: {args.hf_new_tokens}), greedy, bf16"
    )
    print(
        "| model | engine | mode | base tok/s | 8-adapter tok/s | base decode ms | 8-adapter decode ms | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        r = results[shape]
        for mode in ("eager", "graphs_sync", "graphs"):
            b, m = r["ours"][f"{mode}_base"], r["ours"][f"{mode}_mixed"]
            print(
                f"| {shape} | loraserve | {mode} | {b['tok_s']:.0f} | {m['tok_s']:.0f} | {b['decode_ms']:.2f} | "
                f"{m['decode_ms']:.2f} | {m['decode_ms'] / b['decode_ms']:.2f}x |"
            )
        for ldt in extra_dtypes:
            b, m = r[f"ours_{ldt}_loras"]["graphs_base"], r[f"ours_{ldt}_loras"]["graphs_mixed"]
            print(
                f"| {shape} | loraserve | graphs, {ldt} LoRA weights | {b['tok_s']:.0f} | {m['tok_s']:.0f} | "
                f"{b['decode_ms']:.2f} | {m['decode_ms']:.2f} | {m['decode_ms'] / b['decode_ms']:.2f}x |"
            )
        if "hf" in r:
            b, m = r["hf"]["base"], r["hf"]["mixed"]
            print(
                f"| {shape} | HF+PEFT | eager | {b['tok_s']:.0f} | {m['tok_s']:.0f} | {b['decode_ms']:.2f} | "
                f"{m['decode_ms']:.2f} | {m['decode_ms'] / b['decode_ms']:.2f}x |"
            )
    for shape in args.shapes.split(","):
        o = results[shape]["ours"]
        print(f"{shape}: GPU time of one decode step (graph replay) ms: "
              + ", ".join(f"{k[len('graph_replay_ms_'):]} {v:.2f}" for k, v in o.items() if k.startswith("graph_replay_ms_")))  # fmt: skip
        print(f"{shape}: greedy ids equal to eager: " + ", ".join(f"{k}: {v}" for k, v in o.items() if "same_seqs" in k))
        for k in ("kernels_ms_per_step_base", "kernels_ms_per_step_mixed"):
            if k in o:
                print(f"{shape}: {k}: {o[k]}")
        for k in ("graphs_base", "graphs_mixed"):
            if "phase_ms_per_step" in o.get(k, {}):
                print(f"{shape}: {k} host phases ms/step: {o[k]['phase_ms_per_step']}")
    print(f"parity max |Δ logprob| vs HF+PEFT (bf16): {results['parity']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
