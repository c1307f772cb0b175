"""Adapters at scale, on the CPU (or a GPU if present): throughput vs number of distinct adapters.

Measures, in one run on one model:
  1. generation tokens/s with 1, 8, 64 and 512 distinct adapters under uniform and Zipf(1.1) traffic
     (max_loras slots, a host cache, the rest reloaded from disk), as a ratio to the base model;
  2. TTFT of a request on a cold adapter (on disk only) vs a resident one;
  3. the cost of heterogeneous ranks: a batch of rank-8 and rank-64 adapters in the LoRA op vs the
     same batch padded to rank 64 (what engines that pad every slot to max rank pay).

    python benchmarks/bench_adapters.py [--requests 256] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.forward_context import forward_context
from loraserve.lora.punica import LoRAMapping, PunicaWrapper

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 512, 1024, 4, 8, 4, 4096


def make_base(root: Path) -> Path:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    d = root / "base"
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1", unk_token="t0").save_pretrained(str(d))
    return d


def make_adapter(path: Path, seed: int, rank: int) -> str:
    g = torch.Generator().manual_seed(seed)
    head = HIDDEN // HEADS
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.v_proj": (HIDDEN, KV_HEADS * head)}
    t = {}
    for layer in range(LAYERS):
        for mod, (fin, fout) in shapes.items():
            k = f"base_model.model.model.layers.{layer}.{mod}"
            t[f"{k}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * 0.05
            t[f"{k}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.05
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps({"r": rank, "lora_alpha": rank, "target_modules": ["q_proj", "v_proj"]})
    )
    return str(path)


def traffic(n_adapters: int, n_requests: int, zipf: bool, rng: random.Random) -> list[int]:
    if n_adapters == 0:
        return [0] * n_requests
    if not zipf:
        return [rng.randrange(n_adapters) + 1 for _ in range(n_requests)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(n_adapters)]
    return [i + 1 for i in rng.choices(range(n_adapters), weights=weights, k=n_requests)]


def _timed(llm, prompts, sp, loras) -> float:
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=loras)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def run_throughput(base: Path, reqs: list[LoRARequest], args) -> list[dict]:
    """tokens/s per configuration, and its ratio to the base model timed alternately in the same run
    (base, config, base, config, ...), so drift of a shared machine cancels in the ratio."""
    rows = []
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(args.prompt_len)]}
        for _ in range(args.requests)
    ]
    base_llm = LLM(str(base), max_num_seqs=64)
    base_llm.generate(prompts[:4], sp)
    for n in (1, 8, 64, 512):
        for zipf in (False,) if n <= 1 else (False, True):
            llm = LLM(str(base), enable_lora=True, max_loras=8, max_cpu_loras=64, max_lora_rank=64, max_num_seqs=64)
            ids = traffic(n, args.requests, zipf, rng)
            loras = [reqs[i - 1] for i in ids]
            for r in {lr.lora_int_id: lr for lr in loras}.values():
                llm.add_lora(r)
            llm.generate(prompts[:4], sp, lora_request=loras[:4])  # warm up
            pairs = []
            for _ in range(args.repeat):
                b = _timed(base_llm, prompts, sp, None)
                c = _timed(llm, prompts, sp, loras)
                pairs.append((b, c, c / b))
            stats = dict(llm.engine.lora_manager.stats)
            rows.append(
                dict(
                    adapters=n,
                    traffic="zipf" if zipf else "uniform",
                    distinct=len(set(ids)),
                    base_tok_s=statistics.median(p[0] for p in pairs),
                    tok_s=statistics.median(p[1] for p in pairs),
                    vs_base=statistics.median(p[2] for p in pairs),
                    slot_loads=stats.get("slot_loads", 0),
                    disk_loads=stats.get("disk_loads", 0),
                )
            )
    return rows


def run_ttft(base: Path, reqs: list[LoRARequest]) -> tuple[float, float]:
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=64)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(2, 34))}]
    for r in reqs[:8]:
        llm.add_lora(r)  # 8 registered, host cache of 2: the early ones are on disk only afterwards
    llm.generate(prompt, sp, lora_request=reqs[7])
    t = time.perf_counter()
    llm.generate(prompt, sp, lora_request=reqs[7])
    resident = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompt, sp, lora_request=reqs[0])  # cold: parsed from disk, written into a slot
    cold = time.perf_counter() - t
    return cold, resident


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rank_cost(device: torch.device, tokens: int = 256, reps: int = 20) -> tuple[float, float]:
    """ms per add_lora_linear: 8 rank-8 + 8 rank-64 slots, own ranks vs all padded to 64."""
    S, R, n_in, n_out = 16, 64, 4096, 4096
    punica = PunicaWrapper(S, device)
    a = (torch.randn(S, 1, R, n_in, device=device) * 0.01,)
    b = (torch.randn(S, 1, n_out, R, device=device) * 0.01,)
    x = torch.randn(tokens, n_in, device=device)
    y = torch.zeros(tokens, n_out, device=device)
    slots = [i % S for i in range(tokens)]
    mapping = LoRAMapping.build(slots, [], device)
    own = [8] * 8 + [64] * 8
    padded = [64] * S
    out = []
    for ranks in (own, padded):
        with forward_context(lora=mapping):
            punica.add_lora_linear(y, x, a, b, (n_out,), ranks)
            _sync(device)
            t = time.perf_counter()
            for _ in range(reps):
                punica.add_lora_linear(y, x, a, b, (n_out,), ranks)
            _sync(device)
            out.append((time.perf_counter() - t) / reps * 1e3)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="alternating base/config timings per row")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_base(root)
        t = time.perf_counter()
        reqs = [
            LoRARequest(f"a{i}", i + 1, make_adapter(root / f"a{i}", i, 8 if i % 2 else 16))
            for i in range(512)
        ]
        print(f"made 512 adapters in {time.perf_counter() - t:.1f}s; device {'cuda' if torch.cuda.is_available() else 'cpu'}")
        rows = run_throughput(base, reqs, args)
        head = f"{'adapters':>8} {'traffic':>8} {'distinct':>8} {'base tok/s':>10} {'tok/s':>8} {'vs base':>8}"
        print(f"\n{head} {'slot loads':>10} {'disk loads':>10}")
        for r in rows:
            print(
                f"{r['adapters']:>8} {r['traffic']:>8} {r['distinct']:>8} {r['base_tok_s']:>10.1f} {r['tok_s']:>8.1f} "
                f"{r['vs_base']:>8.2f} {r['slot_loads']:>10} {r['disk_loads']:>10}"
            )
        cold, resident = run_ttft(base, reqs)
        print(
            f"\nTTFT resident adapter {resident * 1e3:.1f} ms, cold adapter (disk -> host -> slot) {cold * 1e3:.1f} ms"
        )
        own, padded = run_rank_cost(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        print(
            f"\nLoRA op, 256 tokens, 8 rank-8 + 8 rank-64 adapters: own ranks {own:.2f} ms, padded to 64 {padded:.2f} ms "
            f"(ratio {own / padded:.2f})"
        )


if __name__ == "__main__":
    main()
