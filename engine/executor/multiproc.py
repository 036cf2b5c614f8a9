"""Tensor parallelism over worker processes: the driver keeps the scheduler and the sampler, each
rank holds a slice of the model and of the KV cache.

The process model: the engine's own process (the driver) owns the scheduler, the KV block
bookkeeping, sampling and detokenizing, as with one device. It starts ``tensor_parallel_size``
worker processes (forked from a clean forkserver, or spawned; never forked from the driver), one
per device, joined in one ``torch.distributed`` group (gloo on the
CPU, NCCL on CUDA). Each step the driver sends every worker the same small step message over its
pipe; the workers run the forward pass together (Megatron-style: QKV and gate/up column-parallel,
o_proj and down_proj row-parallel with one all-reduce each; key/value heads split across ranks,
or replicated when there are fewer of them than ranks; embedding and LM head split by vocabulary
rows, :mod:`..models.vocab_parallel`; MoE experts each cut along their intermediate width, one
all-reduce per block, :func:`..models.moe.shard_experts`) and rank 0 sends back the logits the
sampler needs.

Quantized checkpoints (GGUF blocks, AWQ/GPTQ) split the same way, on block boundaries
(:mod:`..distributed.quantized_split`: FP8 and GPTQ act-order are refused by name). With LoRA the
driver reads and checks adapters against the whole model and sends each to the workers once;
every rank cuts its slice when it loads a slot (:mod:`..models.tp_lora`).

Failure: a worker that dies, fails, or does not answer within ``step_timeout_s`` tears the whole
group down (every process killed and reaped) and raises :class:`~..errors.EngineDeadError`, which
stops the engine: every pending request ends with that error. Workers also exit when the driver
goes away (their pipe closes), and are daemons, so none outlives the interpreter.

>>> llm = LLM("path/to/llama", tensor_parallel_size=2)      # two worker processes
"""
from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from multiprocessing import connection, get_all_start_methods, get_context
from multiprocessing.reduction import ForkingPickler

import torch
from torch import nn

from ..distributed import check_tensor_parallel
from ..distributed.quantized_split import check_quantized_split, refuse_unsplit_quantization
from ..errors import EngineDeadError
from ..lora.manager import LoRAManager
from ..models import model_class_for
from ..models.quant import check_quantization
from .step_message import AdapterShipper, step_message
from .worker import CaptureGraphs, RunStep, Shutdown, WorkerSpec, worker_main

LOAD_TIMEOUT_S = 600.0
STEP_TIMEOUT_S = 600.0   # the first CUDA step compiles kernels; a hang is caught by a dead peer sooner


@dataclass(slots=True)
class _Worker:
    rank: int
    process: object
    conn: object


class MultiprocExecutor:
    """The model runner's interface (``run``, ``num_blocks``, ``arch`` ...) over worker processes.

    >>> executor = MultiprocExecutor(config, checkpoint, size=2)
    >>> output = executor.run(batch)       # ForwardOutput, logits on the driver's device
    >>> executor.close()                   # workers stopped and reaped (also on garbage collection)
    """

    lora = None            # with enable_lora: the driver's LoRAManager (names, checks, CPU cache)
    kv_cache = None        # the cache lives in the workers
    decode_graphs = None   # captured in the workers

    def __init__(self, config, checkpoint, size: int, lora_config=None) -> None:
        _refuse_unsplit_settings(config, checkpoint, size)
        model_class = model_class_for(checkpoint.config)
        self.arch = model_class.arch_from_hf_config(checkpoint.config)
        refuse_unsplit_quantization(config.quantization, checkpoint.config, size)
        plan = check_quantization(config.quantization, checkpoint.config, checkpoint.weight_formats,
                                  checkpoint.weight_shapes(), config.torch_device)
        with torch.device("meta"):
            meta_model = model_class(self.arch)
        check_tensor_parallel(self.arch, meta_model, size)  # before any process starts
        check_quantized_split(meta_model, plan, size)
        self._adapter_shipper = None
        if lora_config is not None:
            # Adapters are read and checked here against the whole (meta) model; the workers get each
            # once, whole, and every rank keeps its cut (models/tp_lora.py). The wrapped meta layers
            # hold no memory.
            self.lora = LoRAManager(meta_model, lora_config, torch.device("cpu"), config.max_num_batched_tokens)
            self._adapter_shipper = AdapterShipper(lora_config.max_loras + lora_config.num_cpu_loras)
        self.model = _DriverModel(meta_model)
        self.device, self.dtype, self.block_size = config.torch_device, config.torch_dtype, config.block_size
        self.size = size
        self.step_timeout_s = STEP_TIMEOUT_S
        self.is_dead = False
        self._store_dir = tempfile.mkdtemp(prefix="hearth-tp-")
        self._workers = _start_workers(_worker_spec(config, size, lora_config), size, f"file://{self._store_dir}/store",
                                       "nccl" if self.device.type == "cuda" else "gloo")
        self._finalizer = weakref.finalize(self, _shut_down, self._workers, self._store_dir)
        blocks = self._replies(LOAD_TIMEOUT_S, "loading")
        self.num_blocks = min(num_blocks for num_blocks, _, _ in blocks.values())
        self.bytes_per_block = blocks[0][1]
        self.rank_weights_bytes = [blocks[rank][2] for rank in range(size)]  # each rank's slice

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank by rank."""
        return [worker.process.pid for worker in self._workers]

    def run(self, batch, pending_token_ids: torch.Tensor | None = None):
        """One forward pass on every rank; the logits (a ForwardOutput) on the driver's device."""
        replies = self._broadcast(RunStep(step_message(batch, pending_token_ids, self._adapter_shipper)), "a step")
        return replies[0].to(self.device)

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        if self.device.type == "cuda":
            self._broadcast(CaptureGraphs(max_batch, max_model_len), "capturing CUDA graphs")

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    # ---- talking to the workers ------------------------------------------------------------

    def _broadcast(self, command, what: str) -> dict:
        if self.is_dead:
            raise EngineDeadError("the tensor-parallel workers are gone (an earlier failure)")
        payload = bytes(ForkingPickler.dumps(command))  # pickled once for every rank
        for worker in self._workers:
            try:
                worker.conn.send_bytes(payload)
            except (BrokenPipeError, EOFError, OSError):
                self._die(f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) is gone "
                          f"(exit code {worker.process.exitcode}) before {what}")
        return self._replies(self.step_timeout_s, what)

    def _replies(self, timeout_s: float, what: str) -> dict:
        """Every rank's answer, by rank; a rank that dies, fails or stays silent kills the group."""
        pending = {worker.conn: worker for worker in self._workers}
        replies, deadline = {}, time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready = connection.wait(list(pending) + [w.process.sentinel for w in pending.values()], max(0.0, left))
            if not ready:
                ranks = sorted(w.rank for w in pending.values())
                self._die(f"tensor-parallel ranks {ranks} did not answer within {timeout_s:g} s ({what})")
            for conn in [c for c in ready if c in pending]:
                worker = pending.pop(conn)
                replies[worker.rank] = self._receive(worker, what)
            for worker in list(pending.values()):
                if worker.process.sentinel in ready and not worker.conn.poll():
                    self._die(f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) died "
                              f"(exit code {worker.process.exitcode}) during {what}")
        return replies

    def _receive(self, worker: _Worker, what: str):
        try:
            status, payload = worker.conn.recv()
        except (EOFError, OSError):
            self._die(f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) died during {what}")
        if status == "refused":  # a ValueError while loading (a setting this split cannot take): say it as one
            self._die(f"tensor-parallel rank {worker.rank}: {payload}", ValueError)
        if status == "error":
            self._die(f"tensor-parallel rank {worker.rank} failed during {what}:\n{payload}")
        return payload

    def _die(self, reason: str, error_type: type[Exception] = EngineDeadError):
        self.is_dead = True
        for worker in self._workers:  # at once: the survivors may be stuck in a collective
            if worker.process.is_alive():
                worker.process.kill()
        self.close()
        raise error_type(reason)


class _DriverModel(nn.Module):
    """What the engine reads of the model in the driver process, which holds none of its tensors."""

    def __init__(self, meta_model: nn.Module) -> None:
        super().__init__()
        self.architecture = type(meta_model).__name__
        self.kv_regime = getattr(meta_model, "kv_regime", None)  # Phi-3's rope switch, for the scheduler


def _refuse_unsplit_settings(config, checkpoint, size: int) -> None:
    if config.keep_alive is not None:
        raise ValueError(f"tensor_parallel_size={size} cannot be combined with keep_alive yet (sleep would have "
                         "to reach the workers)")
    if getattr(checkpoint, "_state_dict", None) is not None:
        # each worker streams its shards from config.model; weights built in memory cannot reach it
        raise ValueError(f"tensor_parallel_size={size} needs a checkpoint on disk (model=...), not weights in memory")
    device = config.torch_device
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices from {device}; "
                         f"{torch.cuda.device_count()} are visible")


def _worker_spec(config, size: int, lora_config=None) -> WorkerSpec:
    return WorkerSpec(model=config.model, dtype=config.torch_dtype, device=str(config.torch_device),
                      block_size=config.block_size, kv_cache_memory=config.kv_cache_memory,
                      max_num_batched_tokens=config.max_num_batched_tokens, allow_pickle=config.allow_pickle,
                      trust_remote_code=config.trust_remote_code, num_threads=max(1, config.num_threads // size),
                      quantization=config.quantization, lora_config=lora_config)


def _start_workers(spec: WorkerSpec, size: int, init_method: str, backend: str) -> list[_Worker]:
    context = _process_context()
    workers = []
    for rank in range(size):
        parent_end, child_end = context.Pipe()
        process = context.Process(target=worker_main, args=(rank, size, init_method, backend, spec, child_end),
                                  name=f"hearth-tp-rank{rank}", daemon=True)
        with _main_module_hidden():
            process.start()
        child_end.close()
        workers.append(_Worker(rank, process, parent_end))
    return workers


@contextlib.contextmanager
def _main_module_hidden():
    """Start a worker without telling it the user's ``__main__``: spawn and forkserver children
    otherwise re-run the user's script first (so a script without an ``if __name__ ==
    "__main__":`` guard would build its LLM again inside each worker). A worker needs nothing
    from ``__main__``: its target and arguments are ours."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


def _process_context():
    """Never fork the driver (its threads, its CUDA state). A forkserver is a fresh process that
    imports the worker code once (torch, transformers, our package: seconds on a small CPU) and
    forks each worker from that clean, single-threaded state, so a second engine's workers start
    at once; where there is none, spawn (each worker imports everything itself)."""
    if "forkserver" not in get_all_start_methods():
        return get_context("spawn")
    context = get_context("forkserver")
    context.set_forkserver_preload([f"{__package__}.preload"])
    return context


def _shut_down(workers: list[_Worker], store_dir: str) -> None:
    """Ask each worker to stop, then kill what is left; every process reaped."""
    for worker in workers:
        try:
            worker.conn.send(Shutdown())
        except (BrokenPipeError, EOFError, OSError):
            pass
    deadline = time.monotonic() + 5.0
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(5.0)
        worker.conn.close()
    shutil.rmtree(store_dir, ignore_errors=True)
