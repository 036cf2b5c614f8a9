"""Whether a quantized checkpoint can be split over tensor-parallel ranks exactly, checked by
layer name before any worker starts.

Quantized weights split the way dense ones do (``models/linear.py``): a column-parallel layer
keeps its rank's output rows, and a quantized row is whole in every format, so any row split is
exact; a row-parallel layer (``o_proj``, ``down_proj``) keeps its rank's input columns, which
must be whole quantization blocks (GGUF: 32 values, 256 for the K-quants; AWQ/GPTQ: groups of
128). A boundary inside a block is refused, naming the layer, the format and the widths. MoE
experts and the vocabulary are dequantized before they are cut, so any split of them is exact.

Refused by name, because the split would not be exact or has never run:

* GPTQ act-order (``desc_act=True``): a row-parallel layer's inputs are stored in group order,
  so a rank's contiguous input slice is scattered over every group.
* FP8 (``quantization="fp8"``, FP8 checkpoints): the weights would split exactly, but the
  activations' dynamic per-token scales of a row-parallel layer would be taken over each rank's
  slice of the row, not the whole row, so TP=N would not compute what one GPU computes; and FP8
  needs CUDA, where no multi-GPU run has happened yet. Refused from the settings alone
  (:func:`refuse_unsplit_quantization`), so the refusal reads the same on any machine.

>>> refuse_unsplit_quantization(config.quantization, checkpoint.config, size=2)   # FP8, act-order
>>> check_quantized_split(meta_model, plan, size=2)                  # ValueError naming the layer
"""
from __future__ import annotations

from hearth_llm.kernels.quant import BLOCK_FORMATS

from ..models.linear import LinearBase


def refuse_unsplit_quantization(requested: str | None, config, size: int) -> None:
    """``ValueError`` naming the quantization that is not split over ranks (FP8, GPTQ act-order;
    see the module docstring); checked from the settings alone, before the quantization itself."""
    if size == 1:
        return
    quant_config = _quant_config(config)
    if requested == "fp8" or quant_config.get("quant_method") == "compressed-tensors":
        what = "quantization='fp8'" if requested == "fp8" else "an FP8 checkpoint (compressed-tensors)"
        raise ValueError(f"{what} cannot be combined with tensor_parallel_size={size} yet: a row-parallel layer's "
                         "dynamic per-token activation scales would cover only each rank's slice of the row")
    if quant_config.get("quant_method") == "gptq" and quant_config.get("desc_act"):
        raise ValueError(f"tensor_parallel_size={size}: GPTQ act-order (quantization_config.desc_act=True) cannot be "
                         "split: a rank's input columns are scattered over every group")


def check_quantized_split(model, plan, size: int) -> None:
    """``ValueError`` naming the row-parallel layer whose rank slice would cut a quantization
    block (see the module docstring); ``plan`` is ``models.quant.check_quantization``'s, ``model``
    built on meta."""
    if size == 1:
        return
    for name, quant_type in plan.weight_formats.items():
        layer, layer_name = _linear_of(model, name)
        if layer is None or not layer.splits_input or quant_type not in BLOCK_FORMATS:
            continue  # rows split whole; experts and the vocabulary are dequantized before the cut
        block = BLOCK_FORMATS[quant_type].block_size
        width = layer.input_size // size
        if width % block:
            raise ValueError(f"tensor_parallel_size={size} would cut {layer_name!r} inside its {quant_type} blocks: "
                             f"each rank's {width} of its {layer.input_size} input columns must be whole blocks "
                             f"of {block}")


def _linear_of(model, checkpoint_name: str) -> tuple[LinearBase | None, str]:
    target = model.param_for_checkpoint_name(checkpoint_name)
    if target is None:
        return None, ""
    module_name = target[0].rpartition(".")[0]
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None, module_name
    return (module if isinstance(module, LinearBase) else None), module_name


def _quant_config(config) -> dict:
    quant_config = getattr(config, "quantization_config", None)
    if quant_config is None:
        return {}
    if not isinstance(quant_config, dict):
        quant_config = quant_config.to_dict() if hasattr(quant_config, "to_dict") else vars(quant_config)
    return quant_config
