"""Vocabulary-parallel embedding, lm_head and the logits processor.

The vocabulary is split in contiguous ranges across ranks (padded to a multiple of the TP size).
``ParallelLMHead`` may share its weight Parameter with the embedding (``tie_word_embeddings``):
one tensor, two modules, so LoRA can wrap each independently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.distributed.comm import tp_all_gather, tp_all_reduce
from loraserve.distributed.parallel_state import get_tp_rank, get_tp_size
from loraserve.layers.linear import linear


def pad_vocab(vocab_size: int, multiple: int) -> int:
    return (vocab_size + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab(num_embeddings, self.tp_size)
        self.shard_size = self.num_embeddings_padded // self.tp_size
        # NOTE: clamped, so a rank whose whole shard is padding (tiny vocab, many ranks) holds no token
        self.vocab_start = min(self.tp_rank * self.shard_size, num_embeddings)
        self.vocab_end = min(self.tp_rank * self.shard_size + self.shard_size, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.zeros(self.shard_size, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocab-parallel. Use ``tie_to(embedding)`` to share the embedding's weight."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight  # the same Parameter: zero extra memory

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - use LogitsProcessor
        raise RuntimeError("ParallelLMHead is applied through LogitsProcessor(lm_head, hidden)")


class LogitsProcessor(nn.Module):
    """hidden (T, H) -> logits (T, vocab) in fp32: this rank's shard, gathered across ranks, padding cut."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def get_logits_shard(self, lm_head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, lm_head.weight)

    def gather(self, shard_logits: torch.Tensor) -> torch.Tensor:
        return tp_all_gather(shard_logits)[..., : self.vocab_size]

    def forward(self, lm_head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(self.get_logits_shard(lm_head, hidden)).float()
