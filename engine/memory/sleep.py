"""Sleep and wake of an idle :class:`LLMEngine` (as vLLM's sleep mode, Ollama's ``keep_alive``).

- level 1: the KV cache is dropped; on a GPU the weights move to pinned host memory (on the CPU
  they stay where they are: host memory is where they would go). Waking copies them back.
- level 2: the KV cache and the weights are dropped; waking loads the weights from the checkpoint.

Either way waking makes a fresh, empty KV cache (the prefix cache starts cold) and captures the
CUDA graphs again: captured graphs hold the old tensors' addresses, so they are dropped at sleep.

>>> state = put_to_sleep(engine, level=1)      # between steps, with no request in the engine
>>> wake_up(engine, state, num_blocks=state.num_blocks)
"""
from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass

import torch

from ..block_pool import BlockPool
from .kv_cache import new_kv_cache, recapture_cuda_graphs, set_kv_cache
from .weights import OffloadedWeights, offload_weights

SLEEP_LEVELS = (1, 2)


@dataclass(slots=True)
class SleepState:
    level: int
    num_blocks: int                        # the cache's size when it fell asleep
    kv_shape: tuple                        # with num_blocks in dimension 2
    kv_dtype: torch.dtype
    offloaded: OffloadedWeights | None     # level 1 on a GPU: the weights in host memory

    @property
    def keeps_weights_on_device(self) -> bool:
        return self.level == 1 and self.offloaded is None


def check_sleep_level(level: object) -> int:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"level must be 1 (drop the KV cache, weights to host memory) or 2 (drop both, "
                         f"reload on wake), got {level!r}")
    return level


def check_can_sleep(engine, level: int) -> None:
    """What sleeping cannot handle yet raises ValueError naming it."""
    draft = getattr(getattr(engine, "proposer", None), "runner", None)
    if draft is not None:
        raise ValueError("sleep is not supported with a draft model (speculative method 'draft_model'): "
                         "its weights and KV cache are not moved")
    if getattr(engine.config, "tensor_parallel_size", 1) > 1:
        raise ValueError(f"sleep is not supported with tensor_parallel_size={engine.config.tensor_parallel_size}: "
                         "the weights and KV cache live in the worker processes")
    if level == 2 and getattr(engine.runner, "lora", None) is not None:
        raise ValueError("sleep level 2 is not supported with enable_lora=True: the LoRA manager wraps the "
                         "loaded model's layers, which a reload would replace; use level 1")


def put_to_sleep(engine, level: int) -> SleepState:
    """Drop what ``level`` drops; the engine must hold no request (the caller waits for that)."""
    check_sleep_level(level)
    check_can_sleep(engine, level)
    if engine.has_unfinished_requests():
        raise RuntimeError("an engine sleeps only when it holds no request")
    runner = engine.runner
    state = SleepState(level, runner.num_blocks, tuple(runner.kv_cache.shape), runner.kv_cache.dtype, None)
    if level == 1 and runner.device.type == "cuda":
        # First: if host memory runs out, nothing has changed yet.
        state.offloaded = offload_weights(runner.model, runner.device, pin_memory=True)
    runner.decode_graphs = None
    set_kv_cache(runner, None)
    engine.kv_cache.pool = BlockPool(0, engine.kv_cache.enable_prefix_caching)   # its contents are gone
    engine.kv_cache.num_cached_blocks.clear()
    if level == 2:
        # The scheduler's hook is a bound method of the model: it would keep the weights alive.
        engine.scheduler.kv_regime_of = None
        runner.model = None
    _return_memory(runner.device)
    return state


def deepen_sleep(engine, state: SleepState) -> None:
    """From level 1 to level 2: the weights go too (host copies included)."""
    check_can_sleep(engine, 2)
    state.level, state.offloaded = 2, None
    engine.scheduler.kv_regime_of = None
    engine.runner.model = None
    _return_memory(engine.runner.device)


def wake_up(engine, state: SleepState, num_blocks: int) -> None:
    """Bring back what sleep dropped, with a KV cache of ``num_blocks`` blocks."""
    runner = engine.runner
    if state.level == 2:
        runner.model = _reload_model(engine)
        engine.scheduler.kv_regime_of = getattr(runner.model, "kv_regime", None)
    elif state.offloaded is not None:
        state.offloaded.restore(runner.device)
    shape = (*state.kv_shape[:2], num_blocks, *state.kv_shape[3:])
    set_kv_cache(runner, new_kv_cache(shape, state.kv_dtype, runner.device))
    engine.kv_cache.pool = BlockPool(num_blocks, engine.kv_cache.enable_prefix_caching)
    recapture_cuda_graphs(engine)


def _reload_model(engine):
    from ..loader import load_checkpoint
    from ..loader.model_loader import load_model

    config = engine.config
    checkpoint = load_checkpoint(config.model, engine.runner.dtype, allow_pickle=config.allow_pickle,
                                 trust_remote_code=config.trust_remote_code, progress=False)
    checkpoint.quantization = getattr(config, "quantization", None)  # as LLMEngine loads it
    model, _ = load_model(checkpoint, engine.runner.device, engine.runner.dtype)
    if getattr(config, "cpu_int8_activations", False):  # as make_executor applies it after the first load
        from ..models.gguf_linear_method import use_int8_activations

        use_int8_activations(model)
    return model


def _return_memory(device: torch.device) -> None:
    gc.collect()  # modules in reference cycles hold tensors until a collection
    if device.type == "cuda":
        torch.cuda.empty_cache()  # back to the device, where mem_get_info and other processes see it
    else:
        _trim_host_heap()


def _trim_host_heap() -> None:
    """Give freed heap pages back to the OS. glibc raises its mmap threshold after large frees, so in a
    long-lived process a model's tensors end up on the heap, and freeing them leaves the RSS as it was."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc (musl, macOS): nothing to trim, or its allocator returns pages itself
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
