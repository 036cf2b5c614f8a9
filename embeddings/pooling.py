"""Token vectors → one vector per text, as sentence-transformers' Pooling and Normalize modules do."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str, normalize: bool,
         dimensions: int | None = None) -> torch.Tensor:
    """``hidden [batch, length, width]`` and a right-padded ``attention_mask [batch, length]`` →
    float32 ``[batch, width]``, or ``[batch, dimensions]``: the first components (Matryoshka
    truncation), normalized after the cut when ``normalize``.

    >>> pool(torch.ones(2, 3, 4), torch.tensor([[1, 1, 0], [1, 1, 1]]), "mean", normalize=True)[0]
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    """
    if mode == "cls":        # one row per text: convert only those
        hidden = hidden[:, :1]
    hidden = hidden.float()  # pool in float32 whatever the model ran in
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    num_tokens = mask.sum(dim=1).clamp(min=1e-9)
    if mode == "mean":
        pooled = (hidden * mask).sum(dim=1) / num_tokens
    elif mode == "mean_sqrt_len":
        pooled = (hidden * mask).sum(dim=1) / num_tokens.sqrt()
    elif mode == "cls":
        pooled = hidden[:, 0]
    elif mode == "max":
        pooled = hidden.masked_fill(mask == 0, -1e9).amax(dim=1)
    elif mode == "lasttoken":
        last = attention_mask.sum(dim=1).long().clamp(min=1) - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:
        raise ValueError(f"pooling mode {mode!r} is not supported")
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, p=2, dim=1) if normalize else pooled


def pool_packed(hidden: torch.Tensor, bounds: list[int], mode: str, normalize: bool,
                dimensions: int | None = None) -> torch.Tensor:
    """:func:`pool` for unpadded rows: text ``i`` is ``hidden[bounds[i]:bounds[i + 1]]`` (a
    decoder's flat batch). Same result as padding them and calling :func:`pool`, without the copy.

    >>> pool_packed(torch.arange(6.).view(3, 2), [0, 2, 3], "lasttoken", normalize=False)
    tensor([[2., 3.],
            [4., 5.]])
    """
    hidden = hidden.float()
    starts = torch.tensor(bounds[:-1], device=hidden.device)
    ends = torch.tensor(bounds[1:], device=hidden.device)
    num_tokens = (ends - starts).unsqueeze(1).to(hidden.dtype)
    text_of_row = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), ends - starts)
    if mode == "lasttoken":
        pooled = hidden[ends - 1]
    elif mode == "cls":
        pooled = hidden[starts]
    elif mode in ("mean", "mean_sqrt_len"):
        sums = hidden.new_zeros(len(starts), hidden.shape[1]).index_add_(0, text_of_row, hidden)
        pooled = sums / (num_tokens if mode == "mean" else num_tokens.sqrt())
    elif mode == "max":
        pooled = hidden.new_full((len(starts), hidden.shape[1]), float("-inf")).scatter_reduce_(
            0, text_of_row.unsqueeze(1).expand_as(hidden), hidden, "amax")
    else:
        raise ValueError(f"pooling mode {mode!r} is not supported")
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, p=2, dim=1) if normalize else pooled
