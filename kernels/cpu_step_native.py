"""The C kernels of ``cpu_step_kernels.c``: the ops of a CPU decode step between its matmuls (RMSNorm
of ``x + residual``, SwiGLU, and rotary + cache write + attention of a few query rows in one pass),
built with the system's C compiler on first use and called through ctypes.

Why: on a small model (SmolLM2-135M, 1 thread, AVX-512 EPYC) these ops cost more than the quantized
matmuls: ~270-350 µs a layer as torch ops (each op ~1.5 µs of dispatch, the norm ~12 µs, rotary, cache
write and attention ~160 µs with their per-layer index and mask bookkeeping) against ~230 µs for the
four GEMVs. One C call each does the same arithmetic in one pass over the rows (norm ~1.5 µs, SwiGLU
~2 µs, attention of one row over 200 positions ~23 µs hot, 35-45 in a step; see engine/models/cpu_step.py).
The attention computes each query row exactly as a one-row call would (a verification's rows get a
decode step's bits), reads the cache in place, and spreads (sequence, kv head) pairs over torch's
OpenMP threads when the work is large.

The values are the torch references' (``norm/reference.py``, ``activation/reference.py``,
``rotary``/``kv_cache``/``attention`` references): float32 arithmetic, rounded to bf16 at the points
where the references round; sums and exponentials in a different order or approximation, so equal to
a few float32 ulps (fp32) or one bf16 ulp (bf16), which the tests check. The library is cached under
``~/.cache/hearth_llm/kernels`` (``HEARTH_LLM_KERNEL_CACHE``), keyed by source, flags, compiler and
CPU flags. :func:`available` is False where no compiler is found or the build fails; callers then run
their torch routines. ``HEARTH_LLM_CPU_STEP_KERNELS=0`` turns them off (A/B runs).

>>> normed, summed = rms_norm(x, weight, 1e-5, residual)      # float32 or bf16 [rows, dim]
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .native_build import build_library

SOURCE = Path(__file__).with_name("cpu_step_kernels.c")
# -fopenmp: torch's libgomp is already loaded and the loader reuses it (same soname): one thread pool.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")
# Extra compiler flags, after FLAGS (shared with the GGUF kernels): ``HEARTH_LLM_KERNEL_CFLAGS=-mno-avx512f``
# builds the AVX2 paths on an AVX-512 machine, to test them there.
DTYPE_IDS = {torch.float32: 0, torch.bfloat16: 1}
# A head wider than this does not fit the kernel's rotary scratch.
MAX_HEAD_DIM = 512
_lock = threading.Lock()


# Read once: callers ask on every op.
IS_TURNED_OFF = os.environ.get("HEARTH_LLM_CPU_STEP_KERNELS", "1") == "0"


def available() -> bool:
    """Whether the kernels are built (or can be built now) for this machine and not turned off."""
    return not IS_TURNED_OFF and _library() is not None


def _contiguous_rows(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether :func:`rms_norm` takes these tensors: contiguous CPU float32/bf16 of one dtype, 2-D."""
    return (x.dtype in DTYPE_IDS and weight.dtype == x.dtype and x.dim() == 2 and weight.shape == x.shape[-1:]
            and _contiguous_rows(x, weight) and (residual is None or (
                residual.dtype == x.dtype and residual.shape == x.shape and _contiguous_rows(residual))))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, sum_out: torch.Tensor | None = None):
    """``(normed, x + residual)`` as ``norm.reference.rms_norm``, for tensors :func:`supports_rms_norm` takes.

    ``out`` / ``sum_out``: where to write them (``sum_out`` may be ``residual`` or ``x``: updated in place).
    """
    normed = torch.empty_like(x) if out is None else out
    summed = (x if residual is None else torch.empty_like(x)) if sum_out is None else sum_out
    status = _library().step_rms_norm(DTYPE_IDS[x.dtype], x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                                      weight.data_ptr(), eps, x.shape[0], x.shape[1], normed.data_ptr(),
                                      0 if summed is x else summed.data_ptr())
    if status:
        raise MemoryError("step_rms_norm: out of memory")
    return normed, summed


def supports_silu_and_mul(x: torch.Tensor) -> bool:
    return x.dtype in DTYPE_IDS and x.dim() == 2 and x.shape[1] % 2 == 0 and _contiguous_rows(x)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``activation.reference.silu_and_mul`` of a 2-D ``[rows, 2 * I]`` tensor :func:`supports_silu_and_mul` takes;
    into ``out`` (contiguous ``[rows, I]``, x's dtype) when given."""
    inter = x.shape[1] // 2
    if out is None or out.shape != (x.shape[0], inter) or out.dtype != x.dtype or not out.is_contiguous():
        out = x.new_empty(x.shape[0], inter)
    if _library().step_silu_and_mul(DTYPE_IDS[x.dtype], x.data_ptr(), x.shape[0], inter, out.data_ptr()):
        raise MemoryError("step_silu_and_mul: out of memory")
    return out


def supports_rope_cache_attention(qkv: torch.Tensor, cos_sin_cache: torch.Tensor, key_cache: torch.Tensor,
                                  value_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`rope_cache_attention` takes these: one float dtype throughout, contiguous caches
    ``[blocks, block_size, Hkv, D]``, rows of ``qkv`` with unit stride, a NeoX table ``[*, R]``, R even, R <= D."""
    dtype = qkv.dtype
    rotary_dim = cos_sin_cache.shape[-1]
    return (dtype in DTYPE_IDS and cos_sin_cache.dtype == dtype and key_cache.dtype == dtype
            and value_cache.dtype == dtype and qkv.dim() == 2 and qkv.stride(1) == 1 and head_dim <= MAX_HEAD_DIM
            and rotary_dim % 2 == 0 and rotary_dim <= head_dim and cos_sin_cache.is_contiguous()
            and key_cache.is_contiguous() and value_cache.is_contiguous() and qkv.device.type == "cpu")


def rope_cache_attention(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads,
                         query_start_loc, context_lens, block_tables, scale, sliding_window=None):
    """The heads' attention outputs ``[T, H * D]`` from the fused projection ``qkv`` ``[T, (H + 2 Hkv) * D]``:
    NeoX rotary of queries and keys, keys and values written at ``slot_mapping``, causal paged attention
    (as ``rotary_embedding``, ``write_kv_cache`` then ``paged_attention`` of the references, no soft cap);
    the int64 metadata as the model runner builds it. For inputs :func:`supports_rope_cache_attention` takes."""
    num_tokens = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    out = qkv.new_empty(num_tokens, num_heads * head_dim)
    status = _library().step_rope_cache_attention(
        DTYPE_IDS[qkv.dtype], qkv.data_ptr(), qkv.stride(0), num_tokens, num_heads, num_kv_heads, head_dim,
        positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[-1], key_cache.data_ptr(),
        value_cache.data_ptr(), slot_mapping.data_ptr(), key_cache.shape[1], context_lens.shape[0],
        query_start_loc.data_ptr(), context_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), scale,
        sliding_window or 0, out.data_ptr(), torch.get_num_threads())
    if status:
        raise MemoryError("step_rope_cache_attention: out of memory")
    return out


class AttentionStep:
    """:func:`rope_cache_attention` with one step's metadata checked and bound once, for all layers.

    >>> step = AttentionStep.of(positions, slot_mapping, query_start_loc, context_lens, block_tables)
    >>> heads = step.attend(qkv, cos_sin_cache, key_cache, value_cache, 9, 3, 0.125)
    """

    __slots__ = ("_tensors", "_args")

    @classmethod
    def of(cls, positions, slot_mapping, query_start_loc, context_lens, block_tables,
           cache_shape: tuple | None = None, max_position: int | None = None) -> "AttentionStep | None":
        """The bound step, or None where the metadata is not contiguous int64 CPU tensors (block tables:
        unit-stride rows) or the lengths do not agree. With ``cache_shape`` (``[blocks, block_size, ...]``)
        and ``max_position`` (the rotary table's rows), also None unless every slot, block id, context
        length and position lies inside them (the C kernel indexes without checks; the torch routines
        then raise their own errors)."""
        tensors = (positions, slot_mapping, query_start_loc, context_lens, block_tables)
        if not all(t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous() for t in tensors[:4]):
            return None
        if (block_tables.dtype != torch.int64 or block_tables.device.type != "cpu" or block_tables.dim() != 2
                or block_tables.stride(1) != 1 or positions.dim() != 1 or positions.shape != slot_mapping.shape
                or query_start_loc.shape[0] != context_lens.shape[0] + 1
                or block_tables.shape[0] < context_lens.shape[0]):
            return None
        if cache_shape is not None and not _inside(positions, slot_mapping, context_lens, block_tables, cache_shape,
                                                   max_position):
            return None
        step = cls()
        step._tensors = tensors  # keeps them alive while the pointers are bound
        step._args = (positions.shape[0], positions.data_ptr(), slot_mapping.data_ptr(), context_lens.shape[0],
                      query_start_loc.data_ptr(), context_lens.data_ptr(), block_tables.data_ptr(),
                      block_tables.stride(0))
        return step

    def attend(self, qkv, cos_sin_cache, key_cache, value_cache, num_heads, num_kv_heads, scale,
               sliding_window=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`rope_cache_attention` of this step for one layer (the caller checked
        :func:`supports_rope_cache_attention` for the tables and caches; ``qkv`` is checked here), into
        ``out`` when it is a contiguous ``[T, H * D]`` tensor of qkv's dtype."""
        num_tokens, positions, slots, num_seqs, query_start_loc, context_lens, tables, table_stride = self._args
        head_dim = key_cache.shape[-1]
        if (qkv.shape[0] != num_tokens or qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.dtype != key_cache.dtype
                or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim):
            raise ValueError(f"qkv of {tuple(qkv.shape)} {qkv.dtype} does not fit this step of {num_tokens} tokens "
                             f"and a {key_cache.dtype} cache")
        if (out is None or out.shape != (num_tokens, num_heads * head_dim) or out.dtype != qkv.dtype
                or not out.is_contiguous()):
            out = qkv.new_empty(num_tokens, num_heads * head_dim)
        status = _library().step_rope_cache_attention(
            DTYPE_IDS[qkv.dtype], qkv.data_ptr(), qkv.stride(0), num_tokens, num_heads, num_kv_heads, head_dim,
            positions, cos_sin_cache.data_ptr(), cos_sin_cache.shape[-1], key_cache.data_ptr(), value_cache.data_ptr(),
            slots, key_cache.shape[1], num_seqs, query_start_loc, context_lens, tables, table_stride, scale,
            sliding_window or 0, out.data_ptr(), torch.get_num_threads())
        if status:
            raise MemoryError("step_rope_cache_attention: out of memory")
        return out


class _StepLinear(ctypes.Structure):
    _fields_ = [("num_runs", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("qtype", ctypes.c_int64 * 4), ("rows", ctypes.c_int64 * 4), ("row_stride", ctypes.c_int64 * 4),
                ("kind", ctypes.c_int64 * 4), ("data", ctypes.c_void_p * 4), ("kernel", ctypes.c_void_p * 4),
                ("bias", ctypes.c_void_p)]


class _StepLayer(ctypes.Structure):
    _fields_ = [("qkv", _StepLinear), ("o", _StepLinear), ("gate_up", _StepLinear), ("down", _StepLinear),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("input_eps", ctypes.c_double), ("post_eps", ctypes.c_double),
                ("q_eps", ctypes.c_double), ("k_eps", ctypes.c_double), ("cos_sin", ctypes.c_void_p),
                ("rotary_dim", ctypes.c_int64), ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("sliding_window", ctypes.c_int64), ("scale", ctypes.c_double)]


# Block runs a linear of the layer loop may have (more: the Python loop runs that model).
MAX_LINEAR_RUNS = 4
_ROWS_KERNEL, _PANEL_KERNEL, _INT8_KERNEL = 0, 1, 2


@dataclass(frozen=True, slots=True)
class StepRun:
    """One run of a linear's output rows as a CPU step multiplies it: ``data`` the GGUF block rows of
    ``quant_type`` (bf16 steps: the bf16-out GEMV; float32: the float32 GEMV), or with ``panels`` the
    float32 panels of ``gguf_cpu_native.pack_panels`` (the panel GEMV), or with ``int8`` the panels of
    ``gguf_cpu_q8x.pack`` (the int8-activation GEMV).

    >>> StepRun("Q4_K", blocks), StepRun("Q4_1", panels, panels=True), StepRun("Q4_K", q8x_panels, int8=True)
    """

    quant_type: str
    data: torch.Tensor
    panels: bool = False
    # data: gguf_cpu_q8x.pack's panels of 16 rows, multiplied by the int8-activation kernel
    # (EngineConfig.cpu_int8_activations)
    int8: bool = False


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """What :class:`DecoderLayers` reads of one plain decoder layer: tensors of the step's dtype, each
    linear as ``(runs, bias)`` with runs a list of :class:`StepRun` in output order.

    >>> LayerWeights(norm1.weight, norm2.weight, 1e-5, 1e-5, (qkv_runs, None), (o_runs, None),
    ...              (gate_up_runs, None), (down_runs, None), cos_sin, 9, 3, 64, 0.125, None)
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    input_eps: float
    post_eps: float
    qkv: tuple
    o: tuple
    gate_up: tuple
    down: tuple
    cos_sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    q_norm: tuple | None = None  # (weight, eps) of Qwen3's per-head norms
    k_norm: tuple | None = None


class DecoderLayers:
    """Every plain decoder layer of a float32 or bf16 step of up to ``gguf_cpu_native.MAX_ROWS`` rows in
    one C call (``step_decoder_layers``): per layer the calls ``engine/models/cpu_step.py`` makes from Python
    (RMSNorm, the GGUF GEMVs, per-head norms, rotary + cache + attention, SwiGLU), in the same order, so
    the same bits. Built once per model from :class:`LayerWeights`; :meth:`of` is None where a weight does
    not fit (a dtype, a layout, too many runs), and then the Python loop runs it.

    >>> layers = DecoderLayers.of(weights)
    >>> hidden, residual = layers.run(hidden, step, kv_caches)
    """

    __slots__ = ("_layers", "_keep", "_widths", "_max_rows", "_scratch", "hidden_size", "dtype")

    @classmethod
    def of(cls, weights: list[LayerWeights]) -> "DecoderLayers | None":
        from .quant import gguf_cpu_native

        if not weights or not available() or not gguf_cpu_native.available():
            return None
        dtype, hidden_size = weights[0].input_norm.dtype, weights[0].input_norm.shape[0]
        if dtype not in DTYPE_IDS:
            return None
        gguf = gguf_cpu_native._library()
        kernels = {(False, torch.bfloat16): gguf.gguf_gemv_bf16_out, (False, torch.float32): gguf.gguf_gemv,
                   (True, torch.float32): gguf.gguf_panel_gemv}
        from .quant import gguf_cpu_q8x

        if gguf_cpu_q8x.has_panels():
            kernels["int8", torch.bfloat16] = kernels["int8", torch.float32] = gguf_cpu_q8x._library().q8x_panel_gemv
        kernels = {key: ctypes.cast(function, ctypes.c_void_p).value for key, function in kernels.items()}
        array = (_StepLayer * len(weights))()
        keep = []
        for layer, spec in zip(array, weights):
            tensors = [spec.input_norm, spec.post_norm, spec.cos_sin] + [n[0] for n in (spec.q_norm, spec.k_norm) if n]
            if (not all(t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu" for t in tensors)
                    or spec.input_norm.shape != (hidden_size,) or spec.head_dim > MAX_HEAD_DIM
                    or spec.cos_sin.shape[-1] % 2 or spec.cos_sin.shape[-1] > spec.head_dim
                    or (spec.q_norm is None) != (spec.k_norm is None)):
                return None
            widths = (hidden_size, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim,
                      spec.num_heads * spec.head_dim, hidden_size)
            linears = (("qkv", spec.qkv, hidden_size, widths[1]), ("o", spec.o, widths[2], hidden_size),
                       ("gate_up", spec.gate_up, hidden_size, None), ("down", spec.down, None, hidden_size))
            for name, (runs, bias), in_features, out_features in linears:
                if not _fill_linear(getattr(layer, name), runs, bias, dtype, kernels, in_features, out_features, keep):
                    return None
            if layer.gate_up.out_features % 2 or layer.down.in_features != layer.gate_up.out_features // 2:
                return None
            layer.input_norm, layer.post_norm = spec.input_norm.data_ptr(), spec.post_norm.data_ptr()
            layer.input_eps, layer.post_eps = spec.input_eps, spec.post_eps
            if spec.q_norm is not None:
                if spec.q_norm[0].shape != (spec.head_dim,) or spec.k_norm[0].shape != (spec.head_dim,):
                    return None
                layer.q_norm, layer.q_eps = spec.q_norm[0].data_ptr(), spec.q_norm[1]
                layer.k_norm, layer.k_eps = spec.k_norm[0].data_ptr(), spec.k_norm[1]
            layer.cos_sin, layer.rotary_dim = spec.cos_sin.data_ptr(), spec.cos_sin.shape[-1]
            layer.num_heads, layer.num_kv_heads, layer.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
            layer.sliding_window, layer.scale = spec.sliding_window or 0, spec.scale
            keep.extend(tensors)
        plan = cls()
        plan._layers, plan._keep, plan.hidden_size, plan.dtype = array, keep, hidden_size, dtype
        plan._max_rows, plan._scratch = gguf_cpu_native.MAX_ROWS, {}
        plan._widths = [max(widths) for widths in zip(*[
            (layer.qkv.out_features, layer.o.in_features, layer.gate_up.out_features, layer.down.in_features)
            for layer in array])]
        return plan

    def run(self, hidden: torch.Tensor, step: "AttentionStep", kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` after every layer for ``hidden`` ``[rows, hidden_size]`` of the layers' dtype
        (contiguous, rows <= ``gguf_cpu_native.MAX_ROWS``), ``step`` bound to this step's metadata, each layer's
        ``(key_cache, value_cache)`` (that dtype, contiguous; the caller checked them as for ``AttentionStep``)."""
        rows = hidden.shape[0]
        num_tokens, positions, slots, num_seqs, query_start_loc, context_lens, tables, table_stride = step._args
        if (rows != num_tokens or hidden.dtype != self.dtype or hidden.shape[1] != self.hidden_size
                or rows > self._max_rows or not hidden.is_contiguous()):
            raise ValueError(f"hidden of {tuple(hidden.shape)} {hidden.dtype} does not fit this step of {num_tokens} "
                             f"tokens and {self.hidden_size}-wide {self.dtype} layers (up to "
                             f"{self._max_rows} contiguous rows)")
        out, residual = torch.empty_like(hidden), torch.empty_like(hidden)  # the caller keeps these
        normed, qkv, heads, gate_up, act = self._scratch_for(rows)
        caches = (ctypes.c_void_p * (2 * len(self._layers)))(
            *[cache.data_ptr() for pair in kv_caches for cache in pair])
        status = _library().step_decoder_layers(
            DTYPE_IDS[self.dtype], self._layers, len(self._layers), caches, rows, self.hidden_size, hidden.data_ptr(),
            out.data_ptr(), residual.data_ptr(), normed.data_ptr(), qkv.data_ptr(), heads.data_ptr(),
            gate_up.data_ptr(), act.data_ptr(), positions, slots, kv_caches[0][0].shape[1], num_seqs,
            query_start_loc, context_lens, tables, table_stride, torch.get_num_threads())
        if status > 0:
            raise MemoryError("step_decoder_layers: out of memory")
        if status < 0:
            raise RuntimeError(f"step_decoder_layers: a GEMV refused its arguments (status {status})")
        return out, residual


    def _scratch_for(self, rows: int) -> tuple:
        """The step's scratch rows (normed, qkv, heads, gate_up, act), made once per row count: read and
        written only inside one call, which the engine thread makes one at a time."""
        scratch = self._scratch.get(rows)
        if scratch is None:
            widths = (self.hidden_size, *self._widths)
            scratch = self._scratch[rows] = tuple(torch.empty(rows, width, dtype=self.dtype) for width in widths)
        return scratch


def _int8_panel_shape(panels: torch.Tensor, quant_type: str) -> tuple[int | None, int | None]:
    """``(rows, columns)`` of ``gguf_cpu_q8x.pack``'s panels, or ``(None, None)`` where they are not such."""
    from .quant import gguf_cpu_q8x

    size = gguf_cpu_q8x._library().q8x_panel_bytes(gguf_cpu_q8x.QTYPE_IDS.get(quant_type, -1))
    if (not size or panels.dtype != torch.uint8 or panels.dim() != 2 or panels.shape[1] % size
            or not panels.is_contiguous()):
        return None, None
    return panels.shape[0] * gguf_cpu_q8x.PANEL_ROWS, panels.shape[1] // size * gguf_cpu_q8x._FORMATS[quant_type][1]


def _fill_linear(linear: _StepLinear, runs: list[StepRun], bias, dtype: torch.dtype, kernels: dict,
                 in_features: int | None, out_features: int | None, keep) -> bool:
    """One linear's runs and bias into ``linear``; False where they do not fit the C loop."""
    from .quant import gguf_cpu_native

    if not runs or len(runs) > MAX_LINEAR_RUNS:
        return False
    num_inputs, total = None, 0
    for index, run in enumerate(runs):
        kernel = kernels.get(("int8" if run.int8 else run.panels, dtype))
        if kernel is None or run.data.device.type != "cpu":
            return False
        if run.int8:
            num_rows, width = _int8_panel_shape(run.data, run.quant_type)
            if num_rows is None:
                return False
        elif run.panels:
            num_rows, width = gguf_cpu_native._panel_shape(run.data, run.quant_type)
            if not run.data.is_contiguous():
                return False
        else:
            num_rows, width = gguf_cpu_native._check(None, run.data, run.quant_type)
            if run.data.stride(1) != 1:
                return False
        if num_inputs is not None and width != num_inputs:
            return False
        num_inputs = width
        linear.qtype[index], linear.rows[index] = gguf_cpu_native.QTYPE_IDS[run.quant_type], num_rows
        linear.row_stride[index], linear.data[index] = run.data.stride(0), run.data.data_ptr()
        linear.kind[index] = _INT8_KERNEL if run.int8 else _PANEL_KERNEL if run.panels else _ROWS_KERNEL
        linear.kernel[index] = kernel
        total += num_rows
        keep.append(run.data)
    if (in_features is not None and num_inputs != in_features) or (out_features is not None and total != out_features):
        return False
    if bias is not None:
        if bias.dtype != dtype or bias.shape != (total,) or not bias.is_contiguous():
            return False
        linear.bias = bias.data_ptr()
        keep.append(bias)
    linear.num_runs, linear.in_features, linear.out_features = len(runs), num_inputs, total
    return True


def _inside(positions, slot_mapping, context_lens, block_tables, cache_shape, max_position) -> bool:
    num_blocks, block_size = cache_shape[0], cache_shape[1]
    if positions.numel() == 0 or context_lens.numel() == 0:
        return False
    slots_low, slots_high = torch.aminmax(slot_mapping)
    positions_low, positions_high = torch.aminmax(positions)
    contexts_low, contexts_high = torch.aminmax(context_lens)
    used_columns = -(-int(contexts_high) // block_size)
    if used_columns > block_tables.shape[1]:
        return False
    blocks_low, blocks_high = torch.aminmax(block_tables[:context_lens.shape[0], :used_columns])
    return (0 <= int(slots_low) and int(slots_high) < num_blocks * block_size and 0 <= int(positions_low)
            and (max_position is None or int(positions_high) < max_position) and int(contexts_low) >= 0
            and 0 <= int(blocks_low) and int(blocks_high) < num_blocks)


@functools.cache
def _library():
    with _lock:
        path = _built_library()
        if path is None:
            return None
        library = ctypes.CDLL(str(path))
    i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    library.step_rms_norm.argtypes = (c_int, ptr, ptr, ptr, c_float, i64, i64, ptr, ptr)
    library.step_silu_and_mul.argtypes = (c_int, ptr, i64, i64, ptr)
    library.step_rope_cache_attention.argtypes = (
        c_int, ptr, i64, i64, c_int, c_int, c_int, ptr, ptr, c_int, ptr, ptr, ptr, c_int, c_int, ptr, ptr, ptr, i64,
        c_float, i64, ptr, c_int)
    library.step_decoder_layers.argtypes = (
        c_int, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr,
        i64, c_int)
    for function in (library.step_rms_norm, library.step_silu_and_mul, library.step_rope_cache_attention,
                     library.step_decoder_layers):
        function.restype = c_int
    return library


def _built_library() -> Path | None:
    return build_library(SOURCE, "cpu_step", FLAGS, "CPU step kernels", libraries=("-lm",))
