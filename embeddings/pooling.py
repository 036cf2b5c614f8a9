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
