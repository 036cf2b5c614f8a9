"""Where a step's forward pass runs: the seam between the engine loop and the device(s).

The engine talks to one object with the model runner's interface (``run(batch,
pending_token_ids) -> ForwardOutput``, ``num_blocks``, ``bytes_per_block``, ``arch``, ``model``,
``device``, ``dtype``, ``enable_cuda_graphs``); :func:`make_executor` picks it from the config:

* ``tensor_parallel_size == 1``: the :class:`~..model_runner.ModelRunner` itself, in this process
  (the uniprocess executor: no copy, no message, exactly the single-device path);
* ``tensor_parallel_size > 1``: :class:`~.multiproc.MultiprocExecutor`, one worker process per rank.

>>> runner = make_executor(config, checkpoint)
>>> output = runner.run(scheduler.schedule())
"""
from __future__ import annotations

from .multiproc import MultiprocExecutor


def make_executor(config, checkpoint, lora_config=None):
    """The executor ``config`` asks for, loaded (see the module docstring)."""
    size = getattr(config, "tensor_parallel_size", 1)
    if size > 1:
        return MultiprocExecutor(config, checkpoint, size, lora_config=lora_config)
    from ..model_runner import ModelRunner

    runner = ModelRunner(checkpoint, config.torch_device, config.torch_dtype, config.block_size,
                         config.kv_cache_memory, lora_config=lora_config,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         kv_cache_dtype=config.kv_cache_torch_dtype)
    if getattr(config, "cpu_int8_activations", False):  # opt-in: see EngineConfig
        from ..models.gguf_linear_method import use_int8_activations

        use_int8_activations(runner.model)
    return runner


__all__ = ["make_executor", "MultiprocExecutor"]
