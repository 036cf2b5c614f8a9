"""The CPU path of the MoE block: tokens sorted by expert, one pair of matmuls per expert that has
tokens, results weighted and added back into their tokens' rows.

Python loops over the (at most E) active experts, never over tokens. Experts are visited in
ascending order and each adds its rows with ``index_add_``, the order HF transformers' eager
experts use, so float32 results agree with it to the last bit in most rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import check_moe_shapes


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """As :func:`reference.fused_moe`; the matmuls run in ``hidden.dtype`` (float32 or bf16), the
    weighted sum over a token's experts in float32.

    >>> hidden, w13, w2 = torch.randn(3, 8), torch.randn(4, 10, 8), torch.randn(4, 8, 5)
    >>> fused_moe(hidden, w13, w2, torch.full((3, 2), 0.5), torch.tensor([[0, 1], [1, 3], [3, 0]])).shape
    torch.Size([3, 8])
    """
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    # Stable, so each expert sees its tokens in batch order.
    order = torch.argsort(flat_ids, stable=True)
    rows_per_expert = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of_entry = order // top_k
    weight_of_entry = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, num_rows in enumerate(rows_per_expert):
        if num_rows == 0:
            continue
        rows = token_of_entry[start:start + num_rows]
        gate, up = F.linear(hidden[rows], w13[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, rows, expert_out.float() * weight_of_entry[start:start + num_rows, None])
        start += num_rows
    return out.to(hidden.dtype)
