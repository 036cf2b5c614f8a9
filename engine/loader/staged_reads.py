"""Tensors of safetensors files read straight into device memory through a few pinned host buffers.

The plain stream (``hf_dir._stream_safetensors``) reads each tensor into fresh pageable memory (the
kernel zero-fills every new page first) and the weight loader copies it to the device synchronously,
through the driver's own bounce buffer: one thread, two extra passes over the bytes, no overlap. For
an 8B model that is ~16 GB read three times. Here reader threads ``os.preadv`` fixed-size chunks of
the files into a ring of pinned buffers, and the main thread queues each filled chunk's host-to-device
copy on the current stream as soon as its read is done; a buffer is refilled once the copy that reads
it has finished (a CUDA event). A tensor comes out on the device in the file's dtype, so the model's
weight loaders copy (and cast, if the dtypes differ) device to device.

>>> entries = [TensorEntry("w", "model.safetensors", torch.bfloat16, (4096, 4096), 80, 80 + 2 * 4096 * 4096)]
>>> stats = ReadStats()
>>> for name, tensor in stream_to_device(entries, torch.device("cuda"), stats=stats):
...     print(name, tensor.device, tensor.shape)
w cuda:0 torch.Size([4096, 4096])

On a CPU ``device`` the same code runs without pinned memory or events (the copies are then
synchronous): that is how the chunking is tested without a GPU.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

CHUNK_BYTES = 16 << 20
NUM_BUFFERS = 16          # 256 MiB pinned: enough reads in flight to keep 8 threads busy
NUM_THREADS = 8


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes are: ``path``, bytes ``[start, end)``, stored as ``dtype`` in ``shape``."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(slots=True)
class ReadStats:
    """What a :func:`stream_to_device` pass did; filled in as it runs."""

    num_bytes: int = 0
    num_tensors: int = 0
    seconds: float = 0.0                     # first read submitted to last tensor handed out
    seconds_waiting_for_reads: float = 0.0   # the main thread blocked on a chunk still being read
    seconds_in_consumer: float = 0.0         # spent outside the stream (the weight loaders' copies)


@dataclass(slots=True)
class _Chunk:
    entry_index: int
    file_offset: int
    length: int
    target_offset: int


def stream_to_device(entries: Iterable[TensorEntry], device: torch.device, *, chunk_bytes: int = CHUNK_BYTES,
                     num_buffers: int = NUM_BUFFERS, num_threads: int = NUM_THREADS,
                     stats: ReadStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor on device)`` for each entry, in order; the reads run ``num_buffers`` chunks ahead."""
    entries = list(entries)
    stats = stats if stats is not None else ReadStats()
    chunks = _plan_chunks(entries, chunk_bytes)
    is_cuda = device.type == "cuda"
    buffers = [torch.empty(min(chunk_bytes, max((c.length for c in chunks), default=1)), dtype=torch.uint8,
                           pin_memory=is_cuda) for _ in range(min(num_buffers, max(len(chunks), 1)))]
    views = [memoryview(buffer.numpy()) for buffer in buffers]
    files = {path: os.open(path, os.O_RDONLY) for path in dict.fromkeys(entry.path for entry in entries)}
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="hearth-weight-read") as pool:
            def submit(index: int, after=None):
                chunk = chunks[index]
                slot = index % len(buffers)
                fd = files[entries[chunk.entry_index].path]
                return pool.submit(_read, fd, views[slot], chunk.file_offset, chunk.length, after)

            pending = deque(submit(index) for index in range(min(len(buffers), len(chunks))))
            next_chunk = 0
            for entry_index, entry in enumerate(entries):
                target = torch.empty(entry.end - entry.start, dtype=torch.uint8, device=device)
                while next_chunk < len(chunks) and chunks[next_chunk].entry_index == entry_index:
                    chunk, slot = chunks[next_chunk], next_chunk % len(buffers)
                    waited = time.perf_counter()
                    pending.popleft().result()
                    stats.seconds_waiting_for_reads += time.perf_counter() - waited
                    target[chunk.target_offset:chunk.target_offset + chunk.length].copy_(
                        buffers[slot][:chunk.length], non_blocking=is_cuda)
                    copied = _record_event() if is_cuda else None
                    if next_chunk + len(buffers) < len(chunks):  # the same buffer, once this copy has read it
                        pending.append(submit(next_chunk + len(buffers), copied))
                    next_chunk += 1
                stats.num_bytes += entry.end - entry.start
                stats.num_tensors += 1
                handed_out = time.perf_counter()
                yield entry.name, target.view(entry.dtype).reshape(entry.shape)
                stats.seconds_in_consumer += time.perf_counter() - handed_out
                del target
    finally:
        for fd in files.values():
            os.close(fd)
        stats.seconds = time.perf_counter() - started


def _plan_chunks(entries: list[TensorEntry], chunk_bytes: int) -> list[_Chunk]:
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    chunks = []
    for index, entry in enumerate(entries):
        size = entry.end - entry.start
        if size != math.prod(entry.shape) * torch.empty((), dtype=entry.dtype).element_size():
            raise ValueError(f"tensor {entry.name!r}: {size} bytes in the file, {entry.shape} of {entry.dtype} "
                             "needs another size")
        for offset in range(0, size, chunk_bytes):
            chunks.append(_Chunk(index, entry.start + offset, min(chunk_bytes, size - offset), offset))
    return chunks


def _read(fd: int, view: memoryview, offset: int, length: int, after) -> None:
    """Fill ``view[:length]`` from ``fd`` at ``offset``; first wait for ``after`` (the copy that last
    read this buffer). Runs on a reader thread: preadv and the event wait release the GIL."""
    if after is not None:
        after.synchronize()
    done = 0
    while done < length:
        num_read = os.preadv(fd, [view[done:length]], offset + done)
        if num_read == 0:
            raise ValueError(f"the file ends {length - done} bytes before a tensor does")
        done += num_read


def _record_event():
    event = torch.cuda.Event()
    event.record()
    return event
