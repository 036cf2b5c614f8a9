"""One tensor-parallel group per engine: join it, check a model can be split over it, leave it.

The linear layers already know how to hold a slice (:class:`~..models.linear.TensorParallel`:
rank, size and an in-place ``all_reduce``); this module makes that value from a real
``torch.distributed`` group (gloo on the CPU, NCCL on CUDA) and refuses, by field name, the
models and settings the split does not implement yet.

>>> check_tensor_parallel(arch, model, size=2)        # before any process is started
>>> parallel = init_tensor_parallel(rank, 2, "file:///tmp/store", "gloo")
>>> parallel.all_reduce(torch.ones(3))                # every rank's tensor becomes the sum
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..models.linear import ColumnLinear, LinearBase, QKVLinear, TensorParallel
from ..models.moe import FusedMoE

# Modules whose tensors every rank may hold whole (replicated) without changing the math: norms and
# rotary tables; the embedding and the LM head (split by vocabulary rows when loaded: models/vocab_parallel).
# Cohere's PerHeadLayerNorm (Command-R+) and OLMo 2's q/k RMSNorms stay whole too: each rank scales by its heads'
# rows (OLMo 2 all-reduces its sums of squares).
_REPLICATED_MODULES = ("RMSNorm", "LayerNorm", "GemmaRMSNorm", "RotaryEmbedding", "Embedding", "Linear",
                       "PerHeadLayerNorm")


# Modules whose math needs every rank's heads at once, which no split here provides (yet): why, by class name.
_UNSPLIT_MODULES: dict[str, str] = {}


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str,
                         timeout_s: float = 600.0) -> TensorParallel:
    """Join the default process group as ``rank`` of ``size`` and return the slice the linear
    layers are configured with. ``timeout_s`` bounds a collective that waits for a dead peer."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return TensorParallel(rank=rank, size=size, all_reduce=_all_reduce)


def _all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def destroy_tensor_parallel() -> None:
    """Leave the process group (a worker's last step)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def check_tensor_parallel(arch, model: nn.Module, size: int) -> None:
    """``ValueError`` naming the field when ``model`` (built on the meta device) cannot be split
    over ``size`` ranks: heads, key/value heads and the MLP width must divide evenly (key/value
    heads may instead be fewer than the ranks and divide them: each rank then keeps a copy of
    its query heads' one), the experts' intermediate width too, and every module holding tensors
    must be a split-aware layer (linear, MoE experts) or one that is safe to replicate."""
    if size == 1:
        return
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} must divide num_key_value_heads={kv_heads} "
                         f"(or be a multiple of it: key/value heads are then replicated)")
    for name, module in model.named_modules():
        why = _UNSPLIT_MODULES.get(type(module).__name__)
        if why is not None:
            raise ValueError(f"tensor_parallel_size={size} is not supported for {type(model).__name__}: {why} "
                             f"({name!r})")
        if isinstance(module, LinearBase):
            _check_linear(name, module, size)
        elif isinstance(module, FusedMoE):
            if module.intermediate_size % size:
                raise ValueError(f"tensor_parallel_size={size} must divide the experts' intermediate size "
                                 f"{module.intermediate_size} of {name!r} (moe_intermediate_size)")
        elif any(True for _ in module.parameters(recurse=False)) and type(module).__name__ not in _REPLICATED_MODULES:
            raise ValueError(f"tensor_parallel_size={size} is not supported for {type(model).__name__}: its module "
                             f"{name!r} ({type(module).__name__}) has no tensor-parallel split here")


def _check_linear(name: str, layer: LinearBase, size: int) -> None:
    if layer.splits_input and layer.input_size % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the input width {layer.input_size} of {name!r}")
    if isinstance(layer, ColumnLinear) and not isinstance(layer, QKVLinear):  # QKV: checked by heads
        for width in layer.output_sizes:
            if width % size:
                raise ValueError(f"tensor_parallel_size={size} must divide the output width {width} of {name!r} "
                                 f"(intermediate_size for an MLP)")
