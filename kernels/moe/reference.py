"""Plain-torch reference of a mixture-of-experts block: the semantics every faster path is tested against.

Experts are stored stacked, as the kernels want them:

- ``w13`` ``[E, 2 I, H]``: each expert's gate projection (rows ``:I``) then its up projection (rows ``I:``);
- ``w2``  ``[E, H, I]``: each expert's down projection.

A token's output is ``sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x))`` over its
``top_k`` chosen experts ``e = topk_ids[t, k]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to its ``top_k`` experts: softmax over all experts (in float32), keep the ``top_k``
    largest probabilities, and with ``renormalize`` rescale those to sum to 1.

    This is the routing of Mixtral (always renormalised), Qwen2-MoE and Qwen3-MoE (renormalised when the
    config says ``norm_topk_prob``). Returns float32 weights ``[T, top_k]`` and int64 expert ids ``[T, top_k]``.

    >>> weights, ids = select_experts(torch.tensor([[0.0, 2.0, 1.0]]), top_k=2, renormalize=True)
    >>> ids.tolist(), round(weights.sum().item(), 6)
    ([[1, 2]], 1.0)
    """
    check_top_k(top_k, router_logits.shape[-1])
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The MoE block's output ``[T, H]`` for tokens ``hidden`` ``[T, H]`` routed by ``topk_weights`` /
    ``topk_ids`` ``[T, top_k]``; computed in float32 from each (token, expert) pair's own weights, cast to
    ``hidden.dtype`` at the end. Memory grows with ``T * top_k * I * H``: it is for tests, not serving.

    >>> hidden, w13, w2 = torch.randn(3, 8), torch.randn(4, 2 * 5, 8), torch.randn(4, 8, 5)
    >>> weights, ids = select_experts(torch.randn(3, 4), top_k=2, renormalize=False)
    >>> fused_moe(hidden, w13, w2, weights, ids).shape
    torch.Size([3, 8])
    """
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    intermediate_size = w2.shape[2]
    x = hidden.float()
    gate_up = torch.einsum("th,tknh->tkn", x, w13[topk_ids.long()].float())
    gate, up = gate_up.split(intermediate_size, dim=-1)
    expert_out = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2[topk_ids.long()].float())
    return (expert_out * topk_weights.float()[..., None]).sum(dim=1).to(hidden.dtype)


def check_top_k(top_k: int, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an integer in [1, num_experts={num_experts}], got {top_k!r}")


def check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids) -> None:
    """``ValueError`` naming the argument whose shape does not fit the others."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [num_tokens, hidden_size], got shape {tuple(hidden.shape)}")
    num_tokens, hidden_size = hidden.shape
    if w13.dim() != 3 or w13.shape[2] != hidden_size or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [num_experts, 2 * intermediate_size, {hidden_size}] for hidden of shape "
                         f"{tuple(hidden.shape)}, got {tuple(w13.shape)}")
    num_experts, intermediate_size = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden_size, intermediate_size):
        raise ValueError(f"w2 must be [{num_experts}, {hidden_size}, {intermediate_size}] to match w13, "
                         f"got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [{num_tokens}, top_k], got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must have the shape of topk_ids {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
