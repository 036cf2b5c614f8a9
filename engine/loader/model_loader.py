"""From a checkpoint to a loaded model: every check first, then build, choose methods, stream.

The order is the contract: (1) the model class, every config field and the quantization (the
checkpoint's ``quantization_config``; ``checkpoint.quantization``, what the user asked) are
checked (``arch_from_hf_config``, ``models.quant.check_quantization``), (2) the model is built on
the ``meta`` device, each linear layer gets its method from the checkpoint's tensor formats, and
the checkpoint's weight names and shapes (headers only) are checked against it, (3) memory
is allocated and weights stream in one at a time. A refusal at (1) or (2) costs no weight read
and no allocation; a failure at (3) leaves nothing behind (the half-loaded model is freed before
the error propagates).

>>> model, arch = load_model(load_checkpoint("default", torch.bfloat16), torch.device("cpu"), torch.bfloat16)
"""
from __future__ import annotations

import traceback

import torch
from torch import nn

from ...kernels import cpu_ops
from ..models import model_class_for
from ..models.arch import ArchConfig
from ..models.gguf_linear_method import GGUF_INT4, GGUFInt4LinearMethod
from ..models.linear import LinearBase, TensorParallel, configure_linears
from ..models.moe import shard_experts
from ..models.vocab_parallel import shard_vocabulary
from ..models.quant import QuantizationPlan, check_quantization, dense_layer_method, quantized_layer_method
from .checkpoint import LoadedCheckpoint


def load_model(checkpoint: LoadedCheckpoint, device: torch.device, dtype: torch.dtype,
               parallel: TensorParallel | None = None) -> tuple[nn.Module, ArchConfig]:
    """The model for ``checkpoint`` on ``device`` in ``dtype``, loaded, in eval mode, and its arch;
    with ``parallel``, only this tensor-parallel rank's slice of each linear layer."""
    model_class = model_class_for(checkpoint.config)
    arch = model_class.arch_from_hf_config(checkpoint.config)
    shapes = checkpoint.weight_shapes()
    plan = check_quantization(getattr(checkpoint, "quantization", None), checkpoint.config,
                              checkpoint.weight_formats, shapes, device)
    with torch.device("meta"):
        model = model_class(arch)
    # Methods first: a quantized method's tensors (an FP8 layer's weight_scale) are what the
    # checkpoint's names and shapes are checked against.
    configure_linears(model, _method_chooser(model, plan.weight_formats, device, dtype, plan), parallel=parallel)
    if parallel is not None:
        shard_vocabulary(model, parallel)  # embedding and LM head by vocabulary rows
        shard_experts(model, parallel)     # each expert's intermediate columns
    if shapes is not None:
        model.check_checkpoint(plan.checkpoint_shapes(shapes), checkpoint.source)
    try:
        model = _empty_on(model, device, dtype)
        model.materialize_buffers(dtype)
        model.load_weights(plan.weights(checkpoint.weights(_read_device(plan, device)), shapes))
    except BaseException as error:
        # The traceback's frames hold the half-loaded model; clear them so it is freed now, even
        # if the caller keeps the exception.
        model = None
        traceback.clear_frames(error.__traceback__)
        raise
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the staged reads' device tensors: the KV cache is sized from what is free
    elif device.type == "cpu":
        cpu_ops.release_freed_heap()  # the load's freed temporaries: ~120 MiB resident on a 1B Q4_K_M otherwise
    return model.eval(), arch


def _empty_on(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype).to_empty(device=device)`` for a model built on meta: floating tensors in
    ``dtype`` (cast on meta: casting after would convert uninitialised float32), others as they are.

    Made with ``torch.empty``: ``empty_like`` and ``to`` of a meta tensor run torch's Python meta
    decompositions, whose first use imports ``torch.fx``'s symbolic shapes (~1 s of a cold start).
    """
    return model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                              device=device))


def _read_device(plan: QuantizationPlan, device: torch.device) -> torch.device | None:
    """Where the checkpoint may put the tensors it yields: straight onto a CUDA ``device`` when the
    weights load as stored (the quantization schemes repack host tensors as they stream by)."""
    if device.type != "cuda" or plan.scheme is not None or plan.requested is not None or plan.weight_formats:
        return None
    return device


def _method_chooser(model, weight_formats: dict[str, str], device: torch.device, dtype: torch.dtype,
                    plan: QuantizationPlan = QuantizationPlan()):
    """``(layer name, layer) -> method or None``: quantized layers get their method from the plan
    (``models/quant``: FP8 as stored; GGUF blocks where it keeps them), else Q4 blocks the int4 CPU
    method where it runs; unquantized
    layers get the plan's method (FP8 under ``quantization="fp8"``); everything else keeps the
    dense default (which dequantizes quantized values)."""
    layer_formats: dict[str, dict] = {}
    for name, quant_type in weight_formats.items():
        target = model.param_for_checkpoint_name(name)
        if target is None:
            continue
        param_name, shard_id = target
        module_name, _, tensor_name = param_name.rpartition(".")
        if tensor_name == "weight":
            layer_formats.setdefault(module_name, {})[shard_id] = quant_type

    def choose(name: str, layer: LinearBase):
        formats = layer_formats.get(name, {})
        if not formats:  # stored unquantized
            return dense_layer_method(layer, plan)
        shards = set(layer.shard_ids) if None not in formats else {None}
        if shards != set(formats):
            return None
        method = quantized_layer_method(formats, layer, plan, device, dtype)
        if method is not None:
            return method
        if not set(formats.values()) <= set(GGUFInt4LinearMethod.quant_types):
            return None
        return GGUF_INT4 if GGUFInt4LinearMethod.supports(layer, device, dtype) else None

    return choose
