"""The bundled default model as an HF transformers model: the peer the CPU benchmarks run against.

transformers reads this GGUF only with ``accelerate`` installed (and takes ~20 s), so the peer gets
the weights our loader already converted.
"""
from __future__ import annotations

import torch


def default_model_in_transformers(dtype: torch.dtype = torch.float32):
    """``(LlamaForCausalLM, tokenizer)`` holding the bundled SmolLM2 weights, in ``dtype``, in eval mode.

    >>> model, tokenizer = default_model_in_transformers(torch.bfloat16)
    """
    from transformers import LlamaForCausalLM

    from hearth_llm.engine.loader import load_checkpoint

    checkpoint = load_checkpoint("default", torch.float32, progress=False)
    model = LlamaForCausalLM(checkpoint.config)
    missing, unexpected = model.load_state_dict(checkpoint.state_dict, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"state dict does not fit LlamaForCausalLM: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    return model.to(dtype).eval(), checkpoint.tokenizer
