"""Memory shared by every engine in a process: one budget per device (:mod:`.budget`), the KV
cache shrunk while requests run (:mod:`.kv_cache`), and sleep and wake (:mod:`.sleep`).

>>> from hearth_llm.engine import set_memory_budget, memory_report
>>> set_memory_budget("cuda", 0.8)
>>> llm = LLM("meta-llama/Llama-3.1-8B-Instruct", keep_alive="5m")   # sleeps after 5 idle minutes
>>> llm.sleep(level=1); llm.generate("Hi")                          # the request wakes it
"""
from .budget import (MemoryBudget, MemoryBudgetError, device_memory_bytes, get_memory_budget, memory_report,
                     set_memory_budget)
from .holders import EngineMemory, WeightsBooking, book_weights, plan_load
from .sleep import SLEEP_LEVELS, SleepState, check_sleep_level

__all__ = ["MemoryBudget", "MemoryBudgetError", "get_memory_budget", "set_memory_budget", "memory_report",
           "device_memory_bytes", "EngineMemory", "WeightsBooking", "book_weights", "plan_load", "SLEEP_LEVELS",
           "SleepState", "check_sleep_level"]
