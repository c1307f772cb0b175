"""Sampling: greedy, temperature, top-k, top-p, min-p (HF's order), per-request seeds, logprobs.

Logprobs are those of the model's distribution (log-softmax of the raw logits, before temperature
and filters), as vLLM returns by default; the sampled token is always among them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.sampling import SamplingParams


@dataclass
class TopLogprobs:
    """For each row: the chosen token's (logprob, rank) and the top-k (ids, logprobs)."""

    token_logprob: list[float]
    token_rank: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def compute_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> TopLogprobs:
    """logprobs (B, V) fp32, token_ids (B,), ks[i] = top-k wanted for row i."""
    chosen = logprobs.gather(1, token_ids[:, None])  # (B, 1)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    kmax = max(ks) if ks else 0
    if kmax > 0:
        top_lp, top_id = logprobs.topk(kmax, dim=1)
        top_ids = [top_id[i, : ks[i]].tolist() for i in range(len(ks))]
        top_lps = [top_lp[i, : ks[i]].tolist() for i in range(len(ks))]
    else:
        top_ids, top_lps = [[] for _ in ks], [[] for _ in ks]
    return TopLogprobs(chosen[:, 0].tolist(), ranks.tolist(), top_ids, top_lps)


def apply_filters(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row (V,) of logits -> temperature-scaled logits with filtered-out tokens at -inf."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token if the mass strictly before it is < top_p (the first token is always kept)
        mass_before = probs.cumsum(-1) - probs
        remove_sorted = mass_before >= p.top_p
        remove = torch.zeros_like(remove_sorted).scatter(0, idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        self.default_generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_ids: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """logits (B, V) fp32 -> sampled token ids (B,) on the CPU.

        banned_ids[i]: tokens row i may not produce now (stop tokens before min_tokens).
        """
        logits = logits.float().cpu()
        if banned_ids is not None and any(banned_ids):
            logits = logits.clone()  # may be an inference-mode tensor (or the runner's own): no in-place
            for i, ids in enumerate(banned_ids):
                if ids:
                    logits[i, ids] = float("-inf")
        out = logits.argmax(dim=-1)
        for i, p in enumerate(params):
            if p.greedy:
                continue
            probs = apply_filters(logits[i], p).softmax(-1)
            gen = generators[i] or self.default_generator
            out[i] = torch.multinomial(probs, 1, generator=gen)[0]
        return out
