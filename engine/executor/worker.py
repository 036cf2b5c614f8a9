"""A tensor-parallel worker: one process per rank, holding its slice of the model and KV cache.

Started by :class:`~.multiproc.MultiprocExecutor` (forkserver, or spawn); it joins the process
group, loads only its shards (the checkpoint is streamed and each tensor cut to this rank's rows
or columns before it is kept), tells the driver how many KV blocks it has, then runs whatever the
driver sends until told to stop or until the driver's end of the pipe closes. Every rank answers
every command: rank 0 with the logits, the others with None, so the driver knows the step is
done everywhere. A rank that fails says so and exits: its peers' collectives are out of step.
At load each rank reports its KV blocks, the bytes of one block and the bytes of its weights.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

from ..distributed import destroy_tensor_parallel, init_tensor_parallel
from ..memory.weights import weights_bytes
from .step_message import StepMessage, WireOutput


@dataclass(slots=True)
class WorkerSpec:
    """What a worker needs to load its slice: picklable, the same for every rank."""

    model: str
    dtype: torch.dtype
    device: str                  # "cpu", or the first CUDA device: rank r uses the r-th after it
    block_size: int
    kv_cache_memory: int | None  # per rank
    max_num_batched_tokens: int
    allow_pickle: bool
    trust_remote_code: bool
    num_threads: int
    quantization: str | None = None
    lora_config: object = None   # a LoRAConfig when enable_lora: every rank wraps its slice

    def device_for(self, rank: int) -> torch.device:
        device = torch.device(self.device)
        if device.type != "cuda":
            return device
        return torch.device("cuda", (device.index or 0) + rank)


@dataclass(slots=True)
class RunStep:
    message: StepMessage


@dataclass(slots=True)
class CaptureGraphs:
    max_batch: int
    max_model_len: int


@dataclass(slots=True)
class Shutdown:
    pass


def worker_main(rank: int, size: int, init_method: str, backend: str, spec: WorkerSpec, conn) -> None:
    """The worker process's entry point."""
    torch.set_num_threads(spec.num_threads)
    try:
        runner = _load(rank, size, init_method, backend, spec)
        conn.send(("ok", (runner.num_blocks, runner.bytes_per_block, weights_bytes(runner.model))))
    except ValueError as error:  # a refusal (a layer this split cannot cut): the driver raises it as one
        _send_quietly(conn, ("refused", str(error)))
        return
    except BaseException:  # noqa: BLE001 - the driver reports it
        _send_quietly(conn, ("error", traceback.format_exc()))
        return
    try:
        _serve(rank, runner, conn)
    finally:
        destroy_tensor_parallel()


def _load(rank: int, size: int, init_method: str, backend: str, spec: WorkerSpec):
    from ..loader import load_checkpoint
    from ..model_runner import ModelRunner

    device = spec.device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parallel = init_tensor_parallel(rank, size, init_method, backend)
    checkpoint = load_checkpoint(spec.model, spec.dtype, allow_pickle=spec.allow_pickle,
                                 trust_remote_code=spec.trust_remote_code, progress=False,
                                 quantization=spec.quantization)
    return ModelRunner(checkpoint, device, spec.dtype, spec.block_size, spec.kv_cache_memory,
                       lora_config=spec.lora_config, max_num_batched_tokens=spec.max_num_batched_tokens,
                       parallel=parallel)


def _serve(rank: int, runner, conn) -> None:
    adapters: dict = {}  # LoRA adapters the driver has sent, by cache_key (it says which to forget)
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if isinstance(command, Shutdown):
            return
        try:
            reply = _run(rank, runner, command, adapters)
        except BaseException:  # noqa: BLE001 - the driver fails the engine with it
            _send_quietly(conn, ("error", traceback.format_exc()))
            return
        if not _send_quietly(conn, ("ok", reply)):
            return


def _run(rank: int, runner, command, adapters: dict):
    if isinstance(command, CaptureGraphs):
        runner.enable_cuda_graphs(command.max_batch, command.max_model_len)
        return None
    message = command.message
    output = runner.run(message.to_batch(adapters), message.pending_tensor(runner.device))
    return WireOutput.of(output) if rank == 0 else None


def _send_quietly(conn, reply) -> bool:
    try:
        conn.send(reply)
        return True
    except (BrokenPipeError, EOFError, OSError):
        return False
