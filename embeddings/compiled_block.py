"""The second half of a BERT layer — output projection, residual, layer norm, feed-forward,
residual, layer norm — as one ``torch.compile``d function, for CUDA in half precision.

Eager, that half is four GEMMs and seven memory-bound passes over the activations (two bias adds
folded into the GEMMs, but the residual adds, the GELU and the two layer norms each read and
write every token). Inductor keeps the GEMMs on cuBLAS and fuses the rest into three kernels
(bias + residual + norm twice, bias + GELU once), so each token's activations are read and
written about half as often. The function takes the weights as arguments, so one compiled graph
serves every layer (torch guards on shapes and dtypes, not on which layer passes them), and the
token count is marked dynamic, so batches of any size reuse it.

Inductor computes the pointwise chain in float32 and rounds once at the end where eager rounds
after each op, so the results differ from the eager path by half-precision rounding (closer to
float32, not further). float32 and the CPU never take this path (the exact ones stay eager).

>>> block = compiled_block()               # None where torch.compile cannot run
>>> hidden = block(hidden, attended, *layer_weights, eps, "gelu")
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("hearth_llm")


def feed_forward_half(hidden: torch.Tensor, attended: torch.Tensor, out_weight: torch.Tensor,
                      out_bias: torch.Tensor, attention_norm_weight: torch.Tensor,
                      attention_norm_bias: torch.Tensor, up_weight: torch.Tensor, up_bias: torch.Tensor,
                      down_weight: torch.Tensor, down_bias: torch.Tensor, output_norm_weight: torch.Tensor,
                      output_norm_bias: torch.Tensor, eps: float, activation: str) -> torch.Tensor:
    """What :class:`~.bert.BertLayer` computes after attention, in plain torch (compiled by
    :func:`compiled_block`)."""
    width = (hidden.shape[-1],)
    hidden = F.layer_norm(hidden + F.linear(attended, out_weight, out_bias), width, attention_norm_weight,
                          attention_norm_bias, eps)
    up = F.linear(hidden, up_weight, up_bias)
    if activation == "gelu":
        up = F.gelu(up)
    elif activation == "gelu_tanh":
        up = F.gelu(up, approximate="tanh")
    elif activation == "relu":
        up = F.relu(up)
    return F.layer_norm(hidden + F.linear(up, down_weight, down_bias), width, output_norm_weight,
                        output_norm_bias, eps)


@functools.cache
def compiled_block():
    """:func:`feed_forward_half` under ``torch.compile`` (compiled at its first call), or None
    where this torch has no working compiler."""
    try:
        compiled = torch.compile(feed_forward_half, fullgraph=True, dynamic=False)
    except Exception as error:  # noqa: BLE001 - no compiler here: the eager path runs
        logger.info("torch.compile unavailable for the embedding encoder (%s); it runs eagerly", error)
        return None

    def run(hidden: torch.Tensor, attended: torch.Tensor, *weights_eps_activation) -> torch.Tensor:
        torch._dynamo.mark_dynamic(hidden, 0)      # any token count reuses the one graph
        torch._dynamo.mark_dynamic(attended, 0)
        return compiled(hidden, attended, *weights_eps_activation)

    return run
