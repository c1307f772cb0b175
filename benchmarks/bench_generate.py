"""Generation throughput: loraserve vs Hugging Face transformers ``generate()``, same run.

Both engines get the same model weights, dtype and device, the same random prompts (token ids, so
no tokenizer differences) and produce exactly ``max_tokens`` new tokens per prompt, greedily, with
EOS ignored (loraserve: ``ignore_eos=True``; transformers: ``eos_token_id=None`` and
``min_new_tokens``). Throughput = generated tokens / wall time of the whole batch, prefill included,
from the fastest of ``--repeat`` runs. Each engine first runs one short warm-up batch that is not
timed; timed rounds alternate the engines.

    python benchmarks/bench_generate.py --batch 4 --prompt-len 32 --max-tokens 32
    loraserve bench --batch 4 --prompt-len 32 --max-tokens 32      # the same, through the CLI
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class EngineRun:
    name: str
    seconds: list[float]  # one per timed repeat
    token_ids: list[list[int]]  # generated ids per prompt, from the last repeat
    gen_tokens: int

    @property
    def best_s(self) -> float:
        return min(self.seconds)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        # NOTE: from the fastest run: on a shared machine, other processes only ever add time, so the
        # minimum is the run least disturbed by them (the median and every run are reported too).
        return self.gen_tokens / self.best_s


@dataclass
class BenchResult:
    model: str
    dtype: str
    device: str
    batch: int
    prompt_len: int
    max_tokens: int
    repeat: int
    runs: list[EngineRun]
    env: dict = field(default_factory=dict)


def make_prompts(
    vocab_size: int, special_ids: set[int], batch: int, prompt_len: int, seed: int
) -> list[list[int]]:
    """Random token ids (no special tokens), one list per prompt, all of length prompt_len."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(vocab_size) if i not in special_ids])
    idx = torch.randint(len(allowed), (batch, prompt_len), generator=g)  # (B, L)
    return allowed[idx].tolist()


Runner = Callable[[int], list[list[int]]]  # n new tokens -> generated ids per prompt


def loraserve_runner(llm, prompts: list[list[int]]) -> Runner:
    from loraserve.sampling import SamplingParams

    def generate(n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs]

    return generate


def transformers_runner(model, pad_id: int, prompts: list[list[int]]) -> Runner:
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # (B, L), left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, L)
    device = next(model.parameters()).device
    input_ids, mask = input_ids.to(device), mask.to(device)

    def generate(n: int) -> list[list[int]]:
        cfg = GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=pad_id
        )
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=cfg)
        return out[:, width:].tolist()  # (B, n) -> lists; .tolist() waits for the device

    return generate


def measure(runners: dict[str, Runner], batch: int, max_tokens: int, repeat: int) -> list[EngineRun]:
    """One untimed warm-up each, then `repeat` rounds that alternate the engines.

    NOTE: alternating (A B A B, not A A B B) spreads load changes on a shared machine over both
    engines, so the ratio stays meaningful even when the absolute numbers drift.
    """
    for fn in runners.values():
        fn(2)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    ids: dict[str, list[list[int]]] = {}
    for _ in range(repeat):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            ids[name] = fn(max_tokens)
            seconds[name].append(time.perf_counter() - t0)
            lens = {len(t) for t in ids[name]}
            assert lens == {max_tokens}, f"{name} generated {lens} tokens per prompt, not {max_tokens}"
    return [EngineRun(name, seconds[name], ids[name], batch * max_tokens) for name in runners]


def run(
    model: str | None = None,
    dtype: str = "auto",
    device: str | None = None,
    seed: int = 0,
    batch: int = 8,
    prompt_len: int = 64,
    max_tokens: int = 64,
    repeat: int = 1,
) -> BenchResult:
    import transformers
    from transformers import AutoModelForCausalLM

    from loraserve.llm import LLM

    if min(batch, prompt_len, max_tokens, repeat) < 1:
        raise ValueError("--batch, --prompt-len, --max-tokens and --repeat must be >= 1")
    total = prompt_len + max_tokens
    blocks_per_seq = -(-total // 16)
    llm = LLM(
        model=model,
        dtype=dtype,
        device=device,
        seed=seed,
        max_model_len=total,
        max_num_seqs=batch,
        max_num_batched_tokens=max(4096, batch * prompt_len),
        num_kv_blocks=batch * blocks_per_seq,
    )
    engine = llm.engine
    tok = engine.tokenizer
    prompts = make_prompts(engine.vocab_size, set(tok.all_special_ids), batch, prompt_len, seed)
    hf = (
        AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.dtype)
        .to(engine.device)
        .eval()
    )
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    runners = {
        "loraserve": loraserve_runner(llm, prompts),
        "transformers generate": transformers_runner(hf, pad_id, prompts),
    }
    load_before = os.getloadavg()[0]
    runs = measure(runners, batch, max_tokens, repeat)

    env = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "nproc": os.cpu_count(),
        "load_avg_1m": f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}",
    }
    return BenchResult(
        model=engine.model_name,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=str(engine.device),
        batch=batch,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        repeat=repeat,
        runs=runs,
        env=env,
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def format_report(r: BenchResult) -> str:
    ours, ref = r.runs[0], r.runs[-1]
    lines = [
        f"model {r.model} | {r.dtype} | {r.device} | batch {r.batch} | prompt {r.prompt_len} tokens | "
        f"{r.max_tokens} new tokens | best of {r.repeat} alternating timed run(s) after 1 warm-up",
        "",
        "| engine | batch | prompt len | new tokens | best (s) | median (s) | each run (s) | gen tokens/s (best) | vs transformers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in r.runs:
        lines.append(
            f"| {e.name} | {r.batch} | {r.prompt_len} | {r.max_tokens} | {e.best_s:.2f} | {e.median_s:.2f} | "
            f"{' '.join(f'{x:.2f}' for x in e.seconds)} | "
            f"{e.tokens_per_s:.1f} | {e.tokens_per_s / ref.tokens_per_s:.2f}x |"
        )
    div = [_first_divergence(a, b) for a, b in zip(ours.token_ids, ref.token_ids)]
    same = sum(d is None for d in div)
    lines.append("")
    lines.append(f"greedy outputs identical to transformers: {same}/{len(div)} sequences")
    if same < len(div):
        lines.append(f"first differing position per sequence: {div}")
    lines.append(", ".join(f"{k} {v}" for k, v in r.env.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="HF model dir or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1)
    a = p.parse_args(argv)
    result = run(a.model, a.dtype, a.device, a.seed, a.batch, a.prompt_len, a.max_tokens, a.repeat)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
