"""The embedding and the LM head split by vocabulary rows across tensor-parallel ranks.

Rank ``r`` of ``n`` holds rows ``r * ceil(V / n)`` onwards (the last rank's tail rows past the
vocabulary are zero padding). The embedding looks up the ids in its range, zeros the others, and
one all-reduce sums the ranks' rows into every token's embedding; the LM head multiplies by its
rows, writes them into its columns of a zeroed ``[tokens, vocab]`` buffer, and one all-reduce
assembles the full logits on every rank (a sum of disjoint columns: exact). Swapped in for
``nn.Embedding`` / ``nn.Linear`` on the meta-device model before loading
(:func:`shard_vocabulary`); each rank copies only its rows out of the checkpoint tensor, so a
tied head shares its embedding's slice.

>>> shard_vocabulary(model, TensorParallel(rank=1, size=2, all_reduce=all_reduce))
>>> model.embed_tokens.weight.shape          # vocab 320, hidden 64
torch.Size([160, 64])
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import TensorParallel
from .linear_method import dense_value


class _VocabRows(nn.Module):
    """A ``[rows of this rank, embedding_dim]`` weight loaded from the full checkpoint tensor."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.parallel = num_embeddings, embedding_dim, parallel
        self.rows_per_rank = -(-num_embeddings // parallel.size)
        self.vocab_start = parallel.rank * self.rows_per_rank
        self.num_real_rows = max(0, min(num_embeddings - self.vocab_start, self.rows_per_rank))
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, embedding_dim), requires_grad=False)
        self._attach_loader()

    def _attach_loader(self) -> None:
        self.weight.weight_loader = self.weight_loader
        self.weight.checkpoint_shape = lambda shard_id=None: (self.num_embeddings, self.embedding_dim)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)  # to_empty makes a new Parameter: re-attach
        self._attach_loader()
        return module

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        rows = dense_value(loaded.narrow(0, self.vocab_start, self.num_real_rows), param.dtype)
        param.data.zero_()  # padding rows past the vocabulary stay zero
        param.data.narrow(0, 0, self.num_real_rows).copy_(rows)


class VocabParallelEmbedding(_VocabRows):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        is_elsewhere = (local < 0) | (local >= self.num_real_rows)
        hidden = F.embedding(local.masked_fill(is_elsewhere, 0), self.weight)
        hidden.masked_fill_(is_elsewhere.unsqueeze(-1), 0)
        self.parallel.all_reduce(hidden)
        return hidden


class VocabParallelLMHead(_VocabRows):
    bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden.new_zeros(hidden.shape[0], self.num_embeddings)
        if self.num_real_rows:
            local = F.linear(hidden, self.weight[:self.num_real_rows])
            logits.narrow(1, self.vocab_start, self.num_real_rows).copy_(local)
        self.parallel.all_reduce(logits)
        return logits


def shard_vocabulary(model: nn.Module, parallel: TensorParallel) -> None:
    """Swap ``model.embed_tokens`` and ``model.lm_head`` for their vocab-parallel versions (on the
    meta-device model, before loading); a tied head is re-tied to the embedding's slice."""
    if parallel.size == 1:
        return
    embed, head = model.embed_tokens, model.lm_head
    is_tied = head.weight is embed.weight
    with torch.device(embed.weight.device):
        model.embed_tokens = VocabParallelEmbedding(embed.num_embeddings, embed.embedding_dim, parallel)
        model.lm_head = VocabParallelLMHead(head.out_features, head.in_features, parallel)
    if is_tied:
        model.lm_head.weight = model.embed_tokens.weight
