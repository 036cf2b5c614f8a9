"""Multi-LoRA serving: PEFT adapters chosen per request over one base model, mixed in one batch.

- :mod:`.request`: :class:`LoRARequest` (name, directory), what a caller passes per request;
- :mod:`.adapter`: reading and checking a PEFT directory against the model's linear layers;
- :mod:`.manager`: known adapters, the CPU cache and the device slots;
- ``engine/models/lora_linear.py``: the linear-method wrapper that applies them, and
  ``kernels/lora``: the batched shrink/expand kernels.

>>> llm = LLM(model_dir, enable_lora=True, max_loras=8, max_lora_rank=64)
>>> llm.generate(["Hi"], params, lora_request=LoRARequest("support", "/adapters/support"))
"""
from .adapter import LoRAAdapter, load_adapter
from .manager import LoRAConfig, LoRAManager
from .request import LoRARequest, as_lora_request

__all__ = ["LoRAAdapter", "LoRAConfig", "LoRAManager", "LoRARequest", "as_lora_request", "load_adapter"]
