"""Where a step's batches run on a CPU: whole forward passes side by side, one core each.

Two batches on two single-threaded workers beat one batch after the other on two threads: every
op of a threaded forward pass ends in a barrier, so a core lent to another process for a moment
stalls both, and the small ops (attention, layer norm) scale poorly. Side by side, each worker
runs its own batch start to end with nothing to wait for.

Single-threaded threads also keep the embedding engine from slowing the rest of the process: once
two threads of a process have each run multi-threaded OpenMP work, libgomp stops its idle threads
spinning and every other team's barriers sleep (sentence-transformers in the caller's thread: 4–6 %
slower; the LLM engine's decode steps: up to 35 %). So with workers, the engine thread itself runs
on one thread too (:func:`start_single_threaded`).
"""
from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import torch


class ForwardWorkers:
    """Threads that each run whole forward passes on one intra-op thread.

    >>> workers = ForwardWorkers(2)                          # on CUDA: ForwardWorkers(1, torch.device("cuda"))
    >>> future = workers.submit(runner.run, token_ids)     # float32 [len(token_ids), dimension]
    >>> workers.close()

    ``torch.set_num_threads`` holds per thread (OpenMP's and MKL's thread counts are thread-local),
    but it also sets the count that threads started later begin with; that one is put back once
    the workers have theirs, so the rest of the process keeps its threads.
    """

    def __init__(self, num_workers: int, device: torch.device | None = None) -> None:
        self.num_workers = num_workers
        num_threads = torch.get_num_threads()
        all_started = threading.Barrier(num_workers + 1)

        def start_worker() -> None:
            torch.get_num_threads()      # torch's lazy per-thread setup first, or it would undo the next line
            torch.set_num_threads(1)
            try:
                if device is not None and device.type == "cuda" and device.index is not None:
                    torch.cuda.set_device(device)    # kernels that launch on the current device (Triton) find it
            finally:
                all_started.wait()

        self._pool = concurrent.futures.ThreadPoolExecutor(
            num_workers, thread_name_prefix="hearth-embeddings-worker", initializer=start_worker)
        for _ in range(num_workers):     # the pool starts a thread per submission while none is idle
            self._pool.submit(int)
        all_started.wait()
        torch.set_num_threads(num_threads)

    def submit(self, forward: Callable[..., torch.Tensor], *args) -> concurrent.futures.Future:
        """Run ``forward(*args)`` under ``torch.inference_mode`` on the next free worker."""
        return self._pool.submit(_in_inference_mode, forward, *args)

    def close(self) -> None:
        """Drop forward passes not started yet, wait for those running, end the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def start_single_threaded(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread whose torch ops run on one intra-op thread, leaving the count that
    other threads start with as it was (see :class:`ForwardWorkers`)."""
    num_threads = torch.get_num_threads()
    is_set = threading.Event()

    def run() -> None:
        torch.get_num_threads()      # torch's lazy per-thread setup first, or it would undo the next line
        torch.set_num_threads(1)
        is_set.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    is_set.wait()
    torch.set_num_threads(num_threads)
    return thread


def _in_inference_mode(forward: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    with torch.inference_mode():
        return forward(*args)
