"""Sampling: greedy, temperature, top-k, top-p, min-p (HF's order), per-request seeds, logprobs.

Everything runs on the logits' device, batched over rows: greedy rows are one argmax, the other
rows go through ``apply_filters_batched`` (the vectorised ``apply_filters``, which stays the
single-row reference) and one ``torch.multinomial`` per generator (all unseeded rows share the
default one). Only the (B,) token ids, and the few logprob numbers asked for, reach the host.
Nothing here waits for the device: the few host tables (params, rows, banned ids) go up through
pinned memory (engine/transfer.py), so sampling a step scheduled ahead queues behind the step still
running (torch.multinomial checks its input with an on-device assert, not a host read).

Logprobs are those of the model's distribution (log-softmax of the raw logits, before temperature
and filters), as vLLM returns by default; the sampled token is always among them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.engine.transfer import to_device
from loraserve.sampling import SamplingParams

NEG_INF = float("-inf")
NO_TOKEN = -1  # a sampled id where the row's logits were not finite: its request fails, nothing is drawn


@dataclass
class TopLogprobs:
    """For each row: the chosen token's (logprob, rank) and the top-k (ids, logprobs)."""

    token_logprob: list[float]
    token_rank: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def logprob_stats(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """logits (n, V), token_ids (n,) on the same device -> (n, 2 + 2k) fp64 on that device.

    Columns: the token's logprob, its rank (1 = most likely), the top-k logprobs, the top-k ids.
    NOTE: fp64 holds the fp32 logprobs and every id / rank exactly, so one tensor is one transfer.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids[:, None])  # (n, 1)
    ranks = (lp > chosen).sum(dim=1, keepdim=True) + 1  # (n, 1)
    top_lp, top_id = lp.topk(k, dim=1)  # (n, k)
    return torch.cat([chosen.double(), ranks.double(), top_lp.double(), top_id.double()], dim=1)


def unpack_logprobs(stats: torch.Tensor, ks: list[int]) -> TopLogprobs:
    """Rows of ``logprob_stats`` (any k >= max(ks)) -> host lists, row i keeping its top ks[i]. One transfer."""
    kmax = (stats.shape[1] - 2) // 2
    rows = stats.tolist()
    return TopLogprobs(
        [r[0] for r in rows],
        [int(r[1]) for r in rows],
        [[int(t) for t in r[2 + kmax : 2 + kmax + k]] for r, k in zip(rows, ks)],
        [r[2 : 2 + k] for r, k in zip(rows, ks)],
    )


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> TopLogprobs:
    """logits (B, V), token_ids (B,), ks[i] = top-k wanted for row i."""
    return unpack_logprobs(logprob_stats(logits, token_ids, max(ks, default=0)), ks)


def apply_filters(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row (V,) of logits -> temperature-scaled logits with filtered-out tokens at -inf.

    The reference semantics, one row at a time; the sampler runs ``apply_filters_batched``, which
    tests hold equal to this. Among equal logits the lower token id sorts first (top-p ties).
    """
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if p.top_p < 1.0:
        sorted_logits, idx = logits.sort(descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        # keep a token if the mass strictly before it is < top_p (the first token is always kept)
        mass_before = probs.cumsum(-1) - probs
        remove_sorted = mass_before >= p.top_p
        remove = torch.zeros_like(remove_sorted).scatter(0, idx, remove_sorted)
        logits = logits.masked_fill(remove, NEG_INF)
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), NEG_INF)
    return logits


def apply_filters_batched(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``apply_filters`` on every row at once: logits (n, V), params[i] for row i (none greedy).

    Vectorised over rows: one host->device copy of the params, at most one sort, no per-row kernels.
    Which filters run at all is decided on the host from ``params``, so nothing syncs.
    """
    n, V = logits.shape
    assert len(params) == n, (len(params), n)
    use_k = [0 < p.top_k < V for p in params]
    use_p = [p.top_p < 1.0 for p in params]
    use_m = [p.min_p > 0.0 for p in params]
    # NOTE: top_k as a float: every k <= V fits fp32 exactly, so the params are one (4, n) copy
    table = to_device(
        [
            [p.temperature for p in params],
            [p.top_k if u else V for p, u in zip(params, use_k)],
            [p.top_p for p in params],
            [p.min_p for p in params],
        ],
        torch.float32,
        logits.device,
    )
    temperature, top_k, top_p, min_p = table[:, :, None]  # each (n, 1)
    x = logits / temperature
    if any(use_p):
        # one sort serves both filters: the k-th largest value, then top-p over the top-k
        # survivors, whose sorted order is the same prefix (the cut values all sort behind)
        sorted_x, idx = x.sort(dim=-1, descending=True, stable=True)  # (n, V)
        if any(use_k):
            kth = sorted_x.gather(1, top_k.long() - 1)  # (n, 1); -inf where top_k is off (k = V)
            kth = kth.masked_fill(top_k >= V, NEG_INF)
            x = x.masked_fill(x < kth, NEG_INF)
            sorted_x = sorted_x.masked_fill(sorted_x < kth, NEG_INF)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        # NOTE: rows with top_p = 1 are excluded explicitly: their float mass can exceed 1; the most
        # likely token is always kept, so no top_p (a tiny one rounds to 0 in fp32) empties a row
        remove_sorted = (mass_before >= top_p) & (top_p < 1.0)  # (n, V)
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(1, idx, remove_sorted)
        x = x.masked_fill(remove, NEG_INF)
    elif any(use_k):
        kmax = max(p.top_k for p, u in zip(params, use_k) if u)
        vals = x.topk(kmax, dim=-1).values  # (n, kmax)
        kth = vals.gather(1, top_k.long().clamp(max=kmax) - 1)  # (n, 1)
        kth = kth.masked_fill(top_k >= V, NEG_INF)
        x = x.masked_fill(x < kth, NEG_INF)
    if any(use_m):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), NEG_INF)
    return x


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._default: dict[torch.device, torch.Generator] = {}  # per device, made at first use

    def default_generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded rows on ``device``, seeded with the engine seed."""
        gen = self._default.get(device)
        if gen is None:
            gen = self._default[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_ids: list[list[int] | torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """logits (B, V) -> sampled token ids (B,) long, on the logits' device.

        generators[i]: row i's own generator (on that device), or None for the default one.
        banned_ids[i]: tokens row i may not produce now (stop tokens before min_tokens): a list, or a
        host tensor the caller keeps (nothing per token is built in Python each step).
        A row whose logits hold a NaN or +Inf, or whose every token is banned, gets ``NO_TOKEN``:
        one row's bad numbers never reach another row, and never reach ``torch.multinomial``
        (whose device-side assert would end the CUDA context for every request).
        """
        dev = logits.device
        logits = logits.float()
        if banned_ids is not None and any(len(ids) for ids in banned_ids):
            cols = [torch.as_tensor(ids, dtype=torch.long) for ids in banned_ids]
            lens = torch.tensor([len(c) for c in cols])
            rows = torch.repeat_interleave(torch.arange(len(cols)), lens)
            rc = torch.stack([rows, torch.cat(cols)])  # (2, total banned)
            rows, cols = (rc.pin_memory() if dev.type == "cuda" else rc).to(dev, non_blocking=True)
            logits = logits.index_put((rows, cols), torch.full((), NEG_INF, device=dev))  # out of place
        # NOTE: max propagates NaN, so one reduction gives the greedy ids and the rows to refuse
        best, out = logits.max(dim=-1)
        bad = ~torch.isfinite(best)  # (B,)
        # non-greedy rows, grouped by generator (every unseeded row shares the default one) and
        # ordered by group, so each group is one multinomial on a contiguous slice
        groups: dict[int, tuple[torch.Generator, list[int]]] = {}
        for i, (p, g) in enumerate(zip(params, generators)):
            if not p.greedy:
                g = g if g is not None else self.default_generator(dev)
                groups.setdefault(id(g), (g, []))[1].append(i)
        if not groups:
            return out.masked_fill(bad, NO_TOKEN)
        order = [i for _, rows in groups.values() for i in rows]
        rows = to_device(order, torch.long, dev)
        # NOTE: each row shifted by its max first (no filter changes under a shift): huge but finite
        # logits over a small temperature would overflow to inf, and softmax would make that NaN
        shifted = logits[rows] - best[rows, None]
        probs = apply_filters_batched(shifted, [params[i] for i in order]).softmax(-1)  # (n, V)
        probs = probs.masked_fill(bad[rows, None], 1.0)  # any valid distribution: the row is refused below
        draws, start = [], 0
        for g, group in groups.values():
            draws.append(torch.multinomial(probs[start : start + len(group)], 1, generator=g)[:, 0])
            start += len(group)
        return out.index_copy(0, rows, torch.cat(draws)).masked_fill(bad, NO_TOKEN)
