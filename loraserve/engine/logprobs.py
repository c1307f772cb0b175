"""A step's logprobs: which rows of the step's logits are asked for, computed on the device, and
turned into ``{token id: Logprob}`` dicts on the host.

Prompt logprobs come first (one row per prompt token predicted, piece by piece, as chunked prefill
computes them), then the sampled tokens' rows. Everything is computed where the logits are; the
small result comes back with the sampled ids (``HostCopy``), so nothing here waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraserve.engine.sampler import TopLogprobs, logprob_stats
from loraserve.engine.sequence import Sequence
from loraserve.engine.transfer import to_device
from loraserve.outputs import Logprob


@dataclass
class LogprobRows:
    """Whose rows a step's logprob stats hold: the prompt pieces first, then the sampled tokens."""

    prompt: list[tuple[Sequence, int, list[int]]]  # seq, first position, the prompt tokens predicted
    ks: list[int]  # top-k kept per row
    sample_row0: int | None  # first row of the sampled tokens; None = their logprobs were not asked for


def step_logprob_stats(
    seqs: list[Sequence],
    prompt_logits: dict[int, tuple[int, torch.Tensor]],
    sample_seqs: list[Sequence],
    sample_logits: torch.Tensor | None,
    sampled: torch.Tensor | None,
) -> tuple[torch.Tensor | None, LogprobRows | None]:
    """The step's prompt logprobs and its sampled tokens' logprobs, as stats on the logits' device.

    ``prompt_logits``: seq_id -> (first position, logits of the positions after it);
    ``sampled``: the (len(sample_seqs),) sampled ids, every one a valid token id.
    (None, None) when nobody asked for any.
    """
    prompt = [(s, *prompt_logits[s.seq_id]) for s in seqs if s.seq_id in prompt_logits]
    want_sample = sampled is not None and any(s.params.logprobs is not None for s in sample_seqs)
    if not prompt and not want_sample:
        return None, None
    ks: list[int] = []
    targets: list[list[int]] = []
    for seq, first_pos, logits in prompt:
        targets.append(seq.prompt_token_ids[first_pos + 1 : first_pos + 1 + logits.shape[0]])
        ks += [seq.params.prompt_logprobs] * logits.shape[0]
    sample_row0 = len(ks) if want_sample else None
    if want_sample:
        ks += [s.params.logprobs or 0 for s in sample_seqs]
    kmax = max(ks)
    pieces = []
    if prompt:
        dev = prompt[0][2].device
        flat = to_device([t for ts in targets for t in ts], torch.long, dev)  # one copy up
        for (_, _, logits), ids in zip(prompt, flat.split([len(t) for t in targets])):
            pieces.append(logprob_stats(logits, ids, kmax))
    if want_sample:
        pieces.append(logprob_stats(sample_logits, sampled, kmax))
    stats = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    prompt_rows = [(seq, first_pos, ts) for (seq, first_pos, _), ts in zip(prompt, targets)]
    return stats, LogprobRows(prompt_rows, ks, sample_row0)


def logprob_dict(top: TopLogprobs, i: int, token: int, decode: Callable[[int], str]) -> dict[int, Logprob]:
    """Row ``i``'s top-k and the chosen ``token`` (always present), each with its decoded text."""
    d = {
        tid: Logprob(lp, r + 1, decode(tid))
        for r, (tid, lp) in enumerate(zip(top.top_ids[i], top.top_logprobs[i]))
    }
    if token not in d:
        d[token] = Logprob(top.token_logprob[i], top.token_rank[i], decode(token))
    return d


def record_prompt_logprobs(rows: LogprobRows, top: TopLogprobs, decode: Callable[[int], str]) -> None:
    """Store each prompt row's dict on its sequence, by the position it predicts from."""
    row = 0
    for seq, first_pos, ts in rows.prompt:
        for j, t in enumerate(ts):
            seq.prompt_logprobs_by_pos[first_pos + j] = logprob_dict(top, row + j, t, decode)
        row += len(ts)
