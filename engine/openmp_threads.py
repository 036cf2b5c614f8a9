"""Giving back a caller's idle OpenMP threads, so that the engine's own keep spinning between regions.

libgomp, the OpenMP runtime torch ships on Linux, lets an idle thread spin ~300,000 pauses for the
next parallel region, but only 100 (its "throttled" spin) once the process holds more OpenMP
threads than it has cores; after that a thread waits in the kernel and must be woken. Every thread
that has run a parallel torch op keeps its team of idle threads for the rest of its life. So once a
caller's thread (a notebook's main thread) has run torch, the process holds the engine thread's
team and the caller's, more threads than cores on a small CPU, and each of the ~150 short parallel
regions of a decode step ends in a sleep and a wake-up: on 2 cores, single-stream decode fell to
0.76x (``hearth-llm bench cpu --interference``), ~300 voluntary context switches a token against
~0 before.

:func:`release_caller_threads`, called on the caller's thread when it hands the engine requests,
ends that thread's idle team (``omp_pause_resource``, OpenMP 5.0), so the count is the engine's own
again; the caller's next parallel torch op starts a new team (some 100 us, once).

>>> torch.mm(a, b)             # this thread now keeps an idle OpenMP team
>>> release_caller_threads()   # gone; the engine thread's team spins again
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads end, the runtime stays initialized

_lock = threading.Lock()
_pause: Callable[[], object] | None = None
_looked = False


def release_caller_threads() -> None:
    """End the calling thread's idle OpenMP team, if it has one; a no-op without libgomp (another
    OpenMP runtime, not Linux, torch not loaded) and inside a parallel region (libgomp refuses)."""
    pause = _pause_function()
    if pause is not None:
        pause()


def _pause_function() -> Callable[[], object] | None:
    global _pause, _looked
    if _looked:
        return _pause
    with _lock:
        if not _looked and "torch" in sys.modules:  # its libgomp is loaded with it; before, look again later
            _pause, _looked = _find_pause(), True
    return _pause


def _find_pause() -> Callable[[], object] | None:
    path = _loaded_libgomp()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)  # already loaded: the same copy torch uses, not a second one
        pause, initial_device = library.omp_pause_resource, library.omp_get_initial_device
    except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0
        return None
    pause.argtypes, pause.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    initial_device.argtypes, initial_device.restype = [], ctypes.c_int
    host = initial_device()
    return lambda: pause(OMP_PAUSE_SOFT, host)


def _loaded_libgomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's own copy), from /proc/self/maps."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libgomp") and ".so" in path:
                    return path
    except OSError:
        return None
    return None
