"""The in-process inference engine.

>>> from hearth_llm.engine import LLM, SamplingParams
>>> LLM().generate("Hello", SamplingParams(max_tokens=8))[0].outputs[0].text
"""
from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
from .async_llm import AsyncLLM, RateLimit, TenantRateLimiter
from .errors import (EngineClosedError, EngineDeadError, EngineError, EngineOverloadedError, RequestFailedError,
                     RequestTimeoutError)
from .registry import ChatPrompt, EngineCore, RequestStream, StreamOutput, Usage, get_engine, shutdown_engines

__all__ += ["AsyncLLM", "RateLimit", "TenantRateLimiter", "get_engine", "shutdown_engines", "EngineCore",
            "RequestStream", "StreamOutput", "Usage", "ChatPrompt", "EngineError", "EngineOverloadedError",
            "EngineDeadError", "EngineClosedError", "RequestFailedError", "RequestTimeoutError"]

from .lora import LoRARequest  # noqa: E402

__all__ += ["LoRARequest"]

from .memory import MemoryBudgetError, get_memory_budget, memory_report, set_memory_budget  # noqa: E402

__all__ += ["set_memory_budget", "get_memory_budget", "memory_report", "MemoryBudgetError"]
from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence

__all__ += ["BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
