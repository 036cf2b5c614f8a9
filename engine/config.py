"""Engine settings: every field can be passed to ``LLM(...)`` / ``AsyncLLM(...)`` as a keyword."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .spec_decode.config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# LLM(quantization=...) values (engine/models/quant implements them).
QUANTIZATION_METHODS = ("gguf", "fp8")
# kv_cache_dtype -> what the cache stores (None: the model dtype)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


@dataclass(slots=True)
class EngineConfig:
    """How the engine loads the model and shares out compute and memory.

    >>> EngineConfig(model="default", max_num_seqs=32, kv_cache_memory="512MiB")

    - ``model``: ``"default"`` (SmolLM2-135M-Instruct), a HF directory, a ``.gguf`` file, or a hub id.
    - ``dtype``: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``. ``"auto"`` is bfloat16 on CUDA; on a
      CPU with native bfloat16 (AVX512-BF16 or AMX) it is bfloat16 for GGUF files (the bundled default
      included) and for model directories stored in 16 bits, float32 otherwise.
    - ``device``: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``.
    - ``max_model_len``: longest prompt + output; default the model's context, capped by the KV cache.
    - ``block_size``: tokens per KV cache block.
    - ``enable_prefix_caching``: reuse the KV of shared prompt prefixes across requests.
    - ``max_num_seqs``: most sequences in one step.
    - ``max_num_batched_tokens``: the per-step token budget shared by prefill chunks and decodes.
    - ``kv_cache_memory``: bytes (int or ``"2GiB"``) for the KV cache; default 1 GiB on CPU, on CUDA an
      equal share of the device's memory budget (``set_memory_budget``, 90 % of the GPU by default; at
      most 90 % of the free memory after the weights). Every engine of the process draws from that
      budget: a later engine may take back free blocks, down to one ``max_model_len`` sequence.
    - ``allow_pickle``: allow pickled ``.bin`` weights (read with ``weights_only=True``).
    - ``trust_remote_code``: always refused; present so the refusal is explicit.
    - ``seed``: seeds sampling of requests without their own seed.
    - ``max_waiting_requests``: bound of the waiting queue (AsyncLLM backpressure).
    - ``num_threads``: torch CPU threads; default the cores this process may use (its CPU affinity and
      container quota), never more than torch would use on its own.
    - ``adaptive_threads``: on the CPU, run each step on the thread count (1, half or ``num_threads``)
      measured fastest for steps of its size (:mod:`~.thread_governor`): small decode steps often
      go faster on one thread when the cores are contended. ``False``: always ``num_threads``.
    - ``show_progress``: progress bars while loading.
    - ``grammar_compile_timeout``: seconds a structured-output grammar may take to compile.
    - ``cuda_graphs``: on CUDA, capture decode steps as CUDA graphs (startup takes a few seconds).
    - ``async_scheduling``: schedule and launch step N+1 while the device runs step N, reading step N's
      tokens one step late; ``None`` turns it on for CUDA (the CPU has no device to overlap with).
    - ``enable_lora``: serve PEFT LoRA adapters chosen per request (``LoRARequest``); ``max_loras``: distinct
      adapters per step (device slots); ``max_lora_rank``: the largest ``r`` accepted (slots are sized for
      it); ``max_cpu_loras``: loaded adapters kept on the CPU (default ``max_loras``).
    - ``speculative``: speculative decoding, a dict of :class:`~.spec_decode.SpeculativeConfig` fields,
      e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``; None: off. It turns async scheduling off
      (a proposal needs the tokens before it), so ``async_scheduling=True`` with it is refused.
    - ``keep_alive``: put the engine to sleep after it has been idle this long (seconds, or ``"30s"``,
      ``"5m"``, ``"1h"``); the next request wakes it. None: never. Handles on one model share one
      engine: the last handle that gives ``keep_alive`` sets it.
    - ``sleep_level``: what ``keep_alive`` sleep drops: 1 the KV cache (on a GPU the weights move to
      pinned host memory), 2 the KV cache and the weights (reloaded from the checkpoint on wake).
    - ``quantization``: None runs what the checkpoint holds; ``"gguf"`` keeps a GGUF file's block-quantized
      weights (Q4_0 .. Q6_K) in their blocks on every device, the CPU included (memory ~1x the file's
      tensors; CPU decode is slower than a dense copy); ``"fp8"`` quantizes a 16/32-bit checkpoint's linear
      layers to FP8 e4m3 at load (per-channel weight scales, dynamic per-token activation scales; CUDA of
      compute capability >= 8.9, the CPU emulates it slowly). Checked against the checkpoint before weights are read.
    - ``tensor_parallel_size``: split the model over this many worker processes (one per GPU on CUDA, from
      ``device`` on; CPU processes with gloo otherwise), Megatron-style (:mod:`~.executor.multiproc`); the
      scheduler and the sampler stay in this process. ``kv_cache_memory`` is then per rank. 1: this process only.
    - ``engine_core``: where the engine loop runs: ``"thread"`` (a thread of this process) or ``"process"`` (a
      child process behind the same classes, :mod:`~.core_process`): there other torch work of this process
      (a notebook's tensors, HF models) cannot slow its OpenMP threads down, nor it theirs; outputs cross a
      pipe. ``LLM.engine`` is then a read-only view; LoRA and tensor parallelism need ``"thread"``.
    - ``kv_cache_dtype``: ``"auto"`` stores keys and values in ``dtype``; ``"fp8"`` (or ``"fp8_e4m3"``) stores
      them in FP8 e4m3 (1 byte each: twice the tokens per GiB, half the bytes each decode step reads),
      CUDA of compute capability >= 8.9 only. Each layer has its own key and value scale, fixed at 1.0
      (as vLLM's default without a calibrated checkpoint): values beyond +-448 saturate.
    - ``release_caller_threads``: on the CPU, ``add_request`` ends the calling thread's idle OpenMP team (one
      its own torch work left behind, :mod:`~.openmp_threads`), so the engine thread's team keeps spinning
      between its parallel regions instead of sleeping in each; the caller's next parallel op starts a new
      team. ``False`` (the default until measured on a quiet CPU): leave the caller's threads alone.
    - ``cpu_int8_activations``: opt-in, CPU GGUF models, CPUs with AVX-512 VNNI or AVX2: steps of up to 8 rows
      (decode, speculative verify, a short prompt's prefill) of the Q4_0/Q4_1/Q8_0/Q4_K/Q6_K layers (bfloat16
      engines' blocks; float32 engines' blocks and panels; Q8_0 not on AVX2, where its exact panels are
      faster) and of the block LM head quantize their input to int8 per row
      per block of 32 (scale max|x| / 127) and take integer dot products with the file's codes, as llama.cpp
      computes (:mod:`~hearth_llm.kernels.quant.gguf_cpu_q8x`): faster, but not the exact bf16 math of the
      default (logits move by the activations' quantization error; each row's result is independent of the
      step's other rows, so speculative greedy output equals plain greedy output with the option). Larger
      steps are unchanged. The kernels' repacked copy of those weights stays beside the blocks (memory: up to
      ~2x the file's tensors). Measured (1 thread, AMD EPYC Zen 4): SmolLM2 Q4_1 decode 1.2x -> 2.0x
      llama.cpp's. ``False`` (default): exact block math.
    """

    model: str = "default"
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False
    seed: int = 0
    max_waiting_requests: int = 4096
    num_threads: int | None = None
    adaptive_threads: bool = True
    show_progress: bool = True
    grammar_compile_timeout: float = 10.0
    cuda_graphs: bool = True
    async_scheduling: bool | None = None
    enable_lora: bool = False
    max_loras: int = 8
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    speculative: SpeculativeConfig | dict | None = None
    keep_alive: float | str | None = None
    sleep_level: int = 1
    quantization: str | None = None
    tensor_parallel_size: int = 1
    engine_core: str = "thread"
    kv_cache_dtype: str = "auto"
    release_caller_threads: bool = False
    cpu_int8_activations: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ValueError(f"model must be a non-empty str or path, got {self.model!r}")
        self.model = str(self.model)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            _positive_int(name, getattr(self, name))
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.block_size > 256:
            raise ValueError(f"block_size must be in [1, 256], got {self.block_size}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes("kv_cache_memory", self.kv_cache_memory)
        if self.num_threads is None:
            self.num_threads = default_num_threads()
        _positive_int("num_threads", self.num_threads)
        for name in ("enable_prefix_caching", "allow_pickle", "trust_remote_code", "show_progress", "cuda_graphs",
                     "adaptive_threads", "release_caller_threads", "cpu_int8_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        self._validate_lora()
        self.speculative = SpeculativeConfig.coerce(self.speculative)
        if self.speculative is not None and self.async_scheduling:
            raise ValueError("async_scheduling=True cannot be combined with speculative decoding: proposals need "
                             "the previous step's tokens on the host; leave async_scheduling None or False")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be None or one of {list(QUANTIZATION_METHODS)}, got "
                             f"{self.quantization!r}")
        self.keep_alive = parse_seconds("keep_alive", self.keep_alive)
        if isinstance(self.sleep_level, bool) or self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        self._validate_engine_core()
        self._validate_kv_cache_dtype()
        self._validate_cpu_int8_activations()

    def _validate_cpu_int8_activations(self) -> None:
        if not self.cpu_int8_activations:
            return
        if self.torch_device.type != "cpu":
            raise ValueError(f"cpu_int8_activations=True is for the CPU engine; the device is "
                             f"{self.torch_device.type}: leave it False")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"cpu_int8_activations=True is not supported with tensor_parallel_size="
                             f"{self.tensor_parallel_size}; leave it False")
        if self.quantization is not None and self.quantization != "gguf":
            raise ValueError(f"cpu_int8_activations=True needs a GGUF model's blocks, not quantization="
                             f"{self.quantization!r}")
        name = self.model.lower()
        if name != "default" and os.path.exists(self.model) and not name.endswith(".gguf"):
            raise ValueError(f"cpu_int8_activations=True needs a GGUF model (a .gguf file or 'default'), got "
                             f"{self.model!r}")

    def _validate_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if KV_CACHE_DTYPES[self.kv_cache_dtype] is None:
            return
        device = self.torch_device
        if device.type != "cuda":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs CUDA (its kernels are Triton's); the "
                             f"device is {device.type}: use kv_cache_dtype='auto'")
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs FP8 e4m3 support (compute capability "
                             f">= 8.9); this GPU has {torch.cuda.get_device_capability(device)}")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with tensor_parallel_size="
                             f"{self.tensor_parallel_size} yet; use kv_cache_dtype='auto'")

    def _validate_engine_core(self) -> None:
        if self.engine_core not in ("thread", "process"):
            raise ValueError(f"engine_core must be 'thread' or 'process', got {self.engine_core!r}")
        if self.engine_core == "process" and self.enable_lora:
            raise ValueError("engine_core='process' cannot be combined with enable_lora=True yet (adapters are "
                             "added through the in-process engine); use engine_core='thread'")
        if self.engine_core == "process" and self.tensor_parallel_size > 1:
            raise ValueError(f"engine_core='process' cannot be combined with tensor_parallel_size="
                             f"{self.tensor_parallel_size} (its workers would be a daemon's children); use 'thread'")

    def _validate_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            _positive_int(name, getattr(self, name))
        if self.max_lora_rank > 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None:
            _positive_int("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """What the paged KV cache stores: ``torch_dtype``, or FP8 e4m3 for ``kv_cache_dtype="fp8"``."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if has_native_cpu_bf16() and _is_stored_in_16_bits(self.model) else torch.float32

    @classmethod
    def from_kwargs(cls, model: str = "default", **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)


def _is_stored_in_16_bits(model: str) -> bool:
    """GGUF files (quantized far below bf16) and HF directories whose config says 16-bit: for these
    bf16 compute keeps what the file holds. Float32 checkpoints keep float32, so their outputs stay
    token-equal to float32 transformers."""
    if model == "default" or model.endswith(".gguf"):
        return True
    config_path = Path(model).expanduser() / "config.json"
    try:
        declared = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    stored = declared.get("dtype") or declared.get("torch_dtype")
    return stored in ("bfloat16", "float16")


def has_native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively; without it bf16 is emulated and slower than fp32
    (:func:`~.cpu_features.cpu_dtype_path` says which flag decided; its flags are read once)."""
    from .cpu_features import cpu_dtype_path

    return cpu_dtype_path().has_native_bf16


def default_num_threads() -> int:
    """The cores this process may run on: its CPU affinity, capped by a container's CPU quota and by
    torch's own setting (physical cores, or what the user chose)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, min(cores, torch.get_num_threads()))


def _cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time a container may use (cgroup v2 ``cpu.max`` or v1 CFS quota), or None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def parse_bytes(name: str, value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"512 MiB"`` → bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be bytes as an int or a str like '2GiB', got {value!r}")
    if isinstance(value, int):
        amount = value
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):]
        if unit not in _UNITS or not digits:
            raise ValueError(f"{name} must be bytes as an int or a str like '2GiB', got {value!r}")
        amount = int(float(digits) * _UNITS[unit])
    else:
        raise ValueError(f"{name} must be bytes as an int or a str like '2GiB', got {value!r}")
    if amount <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return amount


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_seconds(name: str, value: float | str | None) -> float | None:
    """``30``, ``"30s"``, ``"5m"``, ``"1h"`` → seconds; None stays None (never)."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        unit = text[-1:] if text[-1:] in ("s", "m", "h") else ""
        try:
            value = float(text[:len(text) - len(unit)]) * _SECONDS[unit]
        except ValueError:
            raise ValueError(f"{name} must be seconds (a number, or a str like '30s', '5m', '1h') or None, "
                             f"got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be seconds >= 0 (a number, or a str like '30s', '5m', '1h') or None "
                         f"(never), got {value!r}")
    return float(value)
