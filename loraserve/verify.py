"""``loraserve verify ADAPTER``: serve an adapter in loraserve and in transformers + PEFT, compare.

The certificate a user runs before deploying an adapter: the same prompts through both, greedy;
reports the largest |delta logprob| over prompt and generated positions, and whether the greedy
tokens agree; fails (exit code 1) above the threshold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colours.",
]


@dataclass
class PromptResult:
    prompt: str
    max_abs_diff: float
    tokens_equal: bool
    ours: list[int]
    reference: list[int]


@dataclass
class VerifyReport:
    adapter: str
    model: str
    threshold: float
    results: list[PromptResult] = field(default_factory=list)

    @property
    def max_abs_diff(self) -> float:
        return max(r.max_abs_diff for r in self.results)

    @property
    def token_agreement(self) -> float:
        return sum(r.tokens_equal for r in self.results) / len(self.results)

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.threshold and self.token_agreement == 1.0

    def render(self) -> str:
        lines = [f"adapter {self.adapter} on {self.model}", f"{'prompt':<40} {'max|dlogprob|':>14} {'tokens':>7}"]
        for r in self.results:
            lines.append(f"{r.prompt[:40]:<40} {r.max_abs_diff:>14.2e} {'same' if r.tokens_equal else 'DIFFER':>7}")
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(
            f"{verdict}: max |dlogprob| {self.max_abs_diff:.2e} (threshold {self.threshold:.0e}), "
            f"greedy token agreement {self.token_agreement:.0%}"
        )
        if not self.passed:
            lines.append("loraserve does not serve this adapter as PEFT computes it; do not deploy it, and report the case")
        return "\n".join(lines)


def _max_rank(adapter: Path) -> int:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    ranks = [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]
    return max(int(r) for r in ranks)


def verify_adapter(
    adapter: str,
    model: str | None = None,
    prompts: list[str] | None = None,
    max_tokens: int = 12,
    threshold: float = 1e-3,
) -> VerifyReport:
    try:
        from peft import PeftModel
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit("loraserve verify needs peft: pip install peft") from e
    from transformers import AutoModelForCausalLM

    from loraserve import LLM, LoRARequest, SamplingParams

    path = Path(adapter)
    llm = LLM(model, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=max(_max_rank(path), 1))
    engine = llm.engine
    tok = engine.tokenizer
    prompts = prompts or DEFAULT_PROMPTS
    lora = LoRARequest(path.name, 1, str(path))
    ref = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=torch.float32)
    ref = PeftModel.from_pretrained(ref, str(path)).eval()
    report = VerifyReport(str(path), engine.model_name, threshold)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    for text in prompts:
        if tok.chat_template:
            item = llm.apply_chat_template([{"role": "user", "content": text}])
        else:
            item = {"prompt": text, "prompt_token_ids": tok.encode(text)}
        ids = item["prompt_token_ids"]
        out = llm.generate([item], sp, lora_request=lora)[0]
        gen = out.outputs[0].token_ids
        full = ids + gen
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([full])).logits[0].float(), dim=-1)
            want = ref.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=tok.pad_token_id or 0)[0, len(ids):].tolist()
        ours = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        ours += [d[t].logprob for d, t in zip(out.outputs[0].logprobs, gen)]
        theirs = [lp[i - 1, full[i]].item() for i in range(1, len(full))]
        diff = max(abs(a - b) for a, b in zip(ours, theirs))
        report.results.append(PromptResult(text, diff, gen == want, gen, want))
    return report


def main(args) -> int:
    report = verify_adapter(args.adapter, args.model, args.prompt or None, args.max_tokens, args.threshold)
    print(report.render())
    return 0 if report.passed else 1
