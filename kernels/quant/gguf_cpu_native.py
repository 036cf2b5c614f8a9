"""The C kernels of ``gguf_cpu_kernels.c`` (GGUF block rows read in place), built with the system's C
compiler on first use and called through ctypes.

Why C: a decode step is bound by decoding the weight's blocks as they stream in (one core reads
~8 GB/s here), and nothing else measured here did that fast enough with the weights exact. Measured
(1 thread, [8192, 2048], one row, Xeon with AVX-512 BF16/AMX, 2 shared cores): torch inductor's C++
codegen of a dequantize-and-dot torch function reached 5.5-7 G weights/s on Q8_0 but 0.2-3 G/s on
the bit-packed types (its loops over nibbles and bit planes do not vectorize) after 1-17 s of
compiling per shape; torch's ``_weight_int4pack_mm_for_cpu`` runs 13-15 G/s but only with bf16
scales (Q4's fp16 scales rounded: not exact; its float32 path is 0.4 G/s) and cannot hold 5/6/8-bit
codes; ``_weight_int8pack_mm`` has per-row scales only (Q8_0 has one per 32); torchao has no wheel
for this torch; the numba kernels (``gguf_numba.py``) ran 0.2-0.4x llama.cpp end to end. These
AVX-512 kernels: Q4_K 10-12 G/s, Q8_0 ~13 G/s, Q6_K ~7 G/s (bf16 x); Q4_1 with bf16 x (four blocks per
step) 16-18 G/s hot ([1536, 576], 1 row; torch's int4 kernel 19-20 G/s on bf16-rounded scales), the same
as the int4 kernel on the bundled SmolLM2's whole weight set (memory-bound). With AVX2 + FMA + F16C and
no AVX-512 (e.g. AMD Zen 2/3), Q4_0/Q4_1/Q8_0 rows decode into AVX2 registers, and the float32 engine's
pure Q4 layers run panels of 8 rows (:func:`pack_panels`, :func:`panel_gemv_routine`; [1536, 576], 1 row,
hot, AMD EPYC: Q4_1 12.4 G weights/s vs the AVX2 row GEMV 7.4 and a dense float32 matmul 6.1); the
other types plain C loops.

Steps of several rows (speculative verification, a few sequences) run every row of x against each
decoded block in one pass, the same operations per row whatever M is (so a verify step's rows get a
one-row step's bits; bf16 kernels for Q4_0/Q4_1/Q8_0/Q4_K/Q6_K). Measured 2026-12-02 (AMD EPYC Zen 4,
AVX-512 BF16, 1 thread, CPU ms, interleaved with the previous build, load 2.6-4): [8192, 2048] hot, 1 / 5 /
8 rows: Q4_1 0.63 / 1.74 / 3.54 (was 0.62 / 2.07 / 3.96), Q4_K 0.76 / 1.86 / 3.70 (0.73 / 3.62 / 4.85),
Q6_K 0.95 / 2.13 / 3.47 (0.96 / 3.35 / 4.34), Q8_0 bf16 0.97 / 2.12 / 4.18 (float32 before: 0.98 / 5.10 /
6.95); the bundled SmolLM2's 120 linears (cold), Q4_1: 6.5 / 14.2 / 22.0 ms (6.5 / 17.5 / 25.2). A 5-row
step stays ~2x a 1-row one: vdpbf16ps runs one per cycle here (32 products), so each row of x costs at
least K N / 32 cycles of multiplies, about what streaming a Q4 weight from DRAM costs; 8 rows of a
2048-wide x no longer fit L1 beside the weight (M = 6-8 cost more per row).

The shared library is cached under ``~/.cache/hearth_llm/kernels`` (``HEARTH_LLM_KERNEL_CACHE``),
keyed by the source, the compiler flags, the compiler and this CPU's flags, so the compile (~5 s)
happens once per machine. :func:`available` is False where no compiler is found or the build fails
(then ``gguf_cpu`` runs its torch path, slower but the same values).

>>> out = gemv(x.float(), data, "Q4_K")        # float32 [M, N] for M <= 8
"""
from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

from ..native_build import build_library

SOURCE = Path(__file__).with_name("gguf_cpu_kernels.c")
QTYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7, "W4G128": 8}
# The kernel keeps one accumulator set per row of x in registers; more rows take the tiled path.
MAX_ROWS = 8
# -ffp-contract=off: the weights are decoded with separate multiplies and adds, as the reference does.
# -O2, not -O3: measured faster for Q4_K (1.35-1.64 vs 1.75-1.99 ms, [8192, 2048], one row), Q5_K and
# Q8_0, the same for Q6_K in bf16, and compiles in ~5 s instead of ~6-23 s.
FLAGS = ("-O2", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
# Extra compiler flags from the environment, after FLAGS: e.g. ``HEARTH_LLM_KERNEL_CFLAGS=-mno-avx512f``
# builds the AVX2 paths (float32 panels, AVX2 row GEMVs) on an AVX-512 machine, to test them there.
_lock = threading.Lock()


def available() -> bool:
    """Whether the kernels are built (or can be built now) for this machine."""
    return _library() is not None


def gemv(x: torch.Tensor, data: torch.Tensor, quant_type: str, num_threads: int | None = None) -> torch.Tensor:
    """float32 ``x @ W.T`` for float32 ``x`` ``[M, K]`` (M <= :data:`MAX_ROWS`) and uint8 block rows
    ``data`` ``[N, row_bytes]`` (rows may be strided; each row's blocks contiguous)."""
    library = _library()
    if library is None:
        raise RuntimeError("the GGUF CPU kernels are not built here (no working C compiler)")
    num_rows, num_columns = _check(x, data, quant_type)
    if x.dtype != torch.float32 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be float32 with 1..{MAX_ROWS} rows, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], num_rows, dtype=torch.float32)
    status = library.gguf_gemv(QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0), num_rows, num_columns,
                               x.data_ptr(), x.shape[0], out.data_ptr(), num_rows,
                               num_threads or torch.get_num_threads())
    if status:
        raise RuntimeError(f"gguf_gemv failed for {quant_type} (status {status})")
    return out


def has_avx512() -> bool:
    """Whether this build runs the AVX-512 paths (False for AVX2 or portable builds, e.g. under
    ``HEARTH_LLM_KERNEL_CFLAGS=-mno-avx512f``)."""
    library = _library()
    return library is not None and bool(library.gguf_has_avx512())


def has_vector_float32(quant_type: str) -> bool:
    """Whether this build's float32 GEMV (:func:`gemv`) for ``quant_type`` is vectorized: every type with
    AVX-512; with AVX2 + FMA + F16C the types of the common files (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K);
    elsewhere none (scalar decoders)."""
    library = _library()
    return (library is not None and quant_type in QTYPE_IDS
            and bool(library.gguf_has_vector_float32(QTYPE_IDS[quant_type])))


def has_bf16(quant_type: str) -> bool:
    """Whether this build multiplies ``quant_type`` blocks by bf16 ``x`` directly (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K
    with AVX-512 BF16: bf16 dot products of the exact integer codes, then the file's scales in float32)."""
    library = _library()
    return library is not None and quant_type in QTYPE_IDS and bool(library.gguf_has_bf16(QTYPE_IDS[quant_type]))


def gemv_bf16(x: torch.Tensor, data: torch.Tensor, quant_type: str, num_threads: int | None = None) -> torch.Tensor:
    """float32 ``x @ W.T`` for bf16 ``x`` ``[M, K]`` (M <= :data:`MAX_ROWS`), where :func:`has_bf16`."""
    if not has_bf16(quant_type):
        raise ValueError(f"no bf16 kernel for {quant_type} in this build")
    num_rows, num_columns = _check(x, data, quant_type)
    if x.dtype != torch.bfloat16 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be bf16 with 1..{MAX_ROWS} rows, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], num_rows, dtype=torch.float32)
    status = _library().gguf_gemv_bf16(QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0), num_rows,
                                       num_columns, x.data_ptr(), x.shape[0], out.data_ptr(), num_rows,
                                       num_threads or torch.get_num_threads())
    if status:
        raise RuntimeError(f"gguf_gemv_bf16 failed for {quant_type} (status {status})")
    return out


# Types whose bf16 kernel can also write bf16 out (gemv_routine's ``bf16_out``): every bf16 kernel's.
BF16_OUT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


def gemv_routine(data: torch.Tensor, quant_type: str, bf16: bool = False, bf16_out: bool = False):
    """:func:`gemv` (``bf16``: :func:`gemv_bf16`) with the weight bound and checked once:
    ``routine(x)`` for contiguous float32 (bf16) ``x`` ``[M, K]``, 1 <= M <= :data:`MAX_ROWS` (the
    caller's contract: not checked per call). ``bf16_out`` (bf16 x, :data:`BF16_OUT_TYPES`): the output
    in bf16, the float32 sums rounded to nearest even in the kernel (equal to ``routine(x).bfloat16()``).
    ``routine(x, out=view)`` writes into ``view`` (``[M, N]`` of the output dtype, unit column stride: e.g. one
    run's columns of a fused layer's output)."""
    library = _library()
    if library is None:
        raise RuntimeError("the GGUF CPU kernels are not built here (no working C compiler)")
    if (bf16 or bf16_out) and not has_bf16(quant_type):
        raise ValueError(f"no bf16 kernel for {quant_type} in this build")
    if bf16_out and quant_type not in BF16_OUT_TYPES:
        raise ValueError(f"bf16_out is for {BF16_OUT_TYPES}, not {quant_type}")
    num_rows, num_columns = _check(None, data, quant_type)
    call = library.gguf_gemv_bf16_out if bf16_out else library.gguf_gemv_bf16 if bf16 else library.gguf_gemv
    qtype, pointer, stride = QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0)
    get_num_threads = torch.get_num_threads
    out_dtype = torch.bfloat16 if bf16_out else torch.float32

    def routine(x: torch.Tensor, out: torch.Tensor | None = None, _data=data) -> torch.Tensor:  # _data: keeps W alive
        if out is None:
            out = torch.empty(x.shape[0], num_rows, dtype=out_dtype)
        call(qtype, pointer, stride, num_rows, num_columns, x.data_ptr(), x.shape[0], out.data_ptr(), out.stride(0),
             get_num_threads())
        return out

    return routine


# Types with panel kernels (float32 x, AVX2 + FMA + F16C): eight output rows per vector.
PANEL_TYPES = ("Q4_0", "Q4_1", "Q8_0")
PANEL_ROWS = 8


def has_panels(quant_type: str) -> bool:
    """Whether this build runs ``quant_type`` weights repacked into panels (:func:`pack_panels`): Q4_0,
    Q4_1 and Q8_0 where the CPU has AVX2, FMA and F16C (the float32 decode path of CPUs without
    AVX-512 BF16)."""
    library = _library()
    return library is not None and quant_type in PANEL_TYPES and bool(library.gguf_has_panels(QTYPE_IDS[quant_type]))


def pack_panels(data: torch.Tensor, quant_type: str) -> torch.Tensor:
    """Block rows ``data`` ``[N, row_bytes]`` (``N % 8 == 0``) rearranged into panels of 8 rows: the
    same bytes, block ``b`` of 8 rows side by side (their fp16 scales, then their codes byte-interleaved),
    a uint8 ``[N / 8, 8 * row_bytes]`` tensor for :func:`panel_gemv_routine`."""
    library = _library()
    if library is None:
        raise RuntimeError("the GGUF CPU kernels are not built here (no working C compiler)")
    num_rows, num_columns = _check(None, data, quant_type)
    if quant_type not in PANEL_TYPES or num_rows % PANEL_ROWS:
        raise ValueError(f"panels need {'/'.join(PANEL_TYPES)} rows in multiples of {PANEL_ROWS}; got {quant_type} "
                         f"with {num_rows} rows")
    out = torch.empty(num_rows // PANEL_ROWS, PANEL_ROWS * data.shape[1], dtype=torch.uint8)
    if library.gguf_panel_pack(QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0), num_rows, num_columns,
                               out.data_ptr()):
        raise RuntimeError(f"gguf_panel_pack failed for {quant_type}")
    return out


def unpack_panels(panels: torch.Tensor, quant_type: str) -> torch.Tensor:
    """The block rows ``[N, row_bytes]`` that :func:`pack_panels` made ``panels`` from (the same bytes put
    back; torch only): per panel and block, 8 fp16 d (Q4_1: then 8 fp16 m), then code byte i of the 8 rows
    side by side.

    >>> torch.equal(unpack_panels(pack_panels(blocks, "Q4_1"), "Q4_1"), blocks)  # blocks: [N % 8 == 0, bytes]
    True
    """
    from .gguf_reference import block_format

    num_rows, num_columns = _panel_shape(panels, quant_type)
    size = block_format(quant_type).type_size
    heads = 4 if quant_type == "Q4_1" else 2  # bytes of fp16 scales per row and block
    blocks = panels.view(num_rows // PANEL_ROWS, -1, PANEL_ROWS * size)  # [panels, blocks, bytes]
    scales = blocks[..., :PANEL_ROWS * heads].unflatten(-1, (heads // 2, PANEL_ROWS, 2)).permute(0, 1, 3, 2, 4)
    codes = blocks[..., PANEL_ROWS * heads:].unflatten(-1, (size - heads, PANEL_ROWS)).transpose(-1, -2)
    rows = torch.cat([scales.flatten(-2), codes], dim=-1)  # [panels, blocks, 8 rows, bytes]
    return rows.transpose(1, 2).reshape(num_rows, -1).contiguous()


def dequantize_panels(panels: torch.Tensor, quant_type: str) -> torch.Tensor:
    """float32 ``[N, K]`` values of :func:`pack_panels`'s output (bit-equal to dequantizing the blocks)."""
    num_rows, num_columns = _panel_shape(panels, quant_type)
    out = torch.empty(num_rows, num_columns, dtype=torch.float32)
    if _library().gguf_panel_dequant(QTYPE_IDS[quant_type], panels.data_ptr(), num_rows, num_columns, out.data_ptr()):
        raise RuntimeError(f"gguf_panel_dequant failed for {quant_type}")
    return out


def dequantize_panels_t(panels: torch.Tensor, quant_type: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[K, N]``: :func:`dequantize_panels`'s values transposed (made in that layout, no
    transpose pass), for ``x @ W.T`` as ``x @ dequantize_panels_t(...)``; into ``out`` (contiguous
    float32 of at least K * N values, e.g. a reused scratch) where given."""
    num_rows, num_columns = _panel_shape(panels, quant_type)
    if out is None:
        out = torch.empty(num_columns, num_rows, dtype=torch.float32)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < num_rows * num_columns:
        raise ValueError(f"out must be contiguous float32 of at least {num_rows * num_columns} values")
    else:
        out = out.view(-1)[:num_rows * num_columns].view(num_columns, num_rows)
    if _library().gguf_panel_dequant_t(QTYPE_IDS[quant_type], panels.data_ptr(), num_rows, num_columns,
                                       out.data_ptr()):
        raise RuntimeError(f"gguf_panel_dequant_t failed for {quant_type}")
    return out


def panel_gemv_routine(panels: torch.Tensor, quant_type: str):
    """``routine(x)`` = float32 ``x @ W.T`` for contiguous float32 ``x`` ``[M, K]``, 1 <= M <=
    :data:`MAX_ROWS` (the caller's contract: not checked per call), ``W`` in :func:`pack_panels`'s
    panels, where :func:`has_panels`. Each row of ``x`` gets the same bits whatever ``M`` is."""
    if not has_panels(quant_type):
        raise ValueError(f"no panel kernel for {quant_type} in this build (needs AVX2, FMA and F16C; types "
                         f"{PANEL_TYPES})")
    num_rows, num_columns = _panel_shape(panels, quant_type)
    call, qtype, pointer = _library().gguf_panel_gemv, QTYPE_IDS[quant_type], panels.data_ptr()
    get_num_threads = torch.get_num_threads

    def routine(x: torch.Tensor, _panels=panels) -> torch.Tensor:  # _panels: keeps the weight alive
        out = torch.empty(x.shape[0], num_rows, dtype=torch.float32)
        call(qtype, pointer, num_rows, num_columns, x.data_ptr(), x.shape[0], out.data_ptr(), num_rows,
             get_num_threads())
        return out

    return routine


def _panel_shape(panels: torch.Tensor, quant_type: str) -> tuple[int, int]:
    from .gguf_reference import block_format

    fmt = block_format(quant_type)
    panel_block = PANEL_ROWS * fmt.type_size
    if (_library() is None or quant_type not in PANEL_TYPES or panels.dtype != torch.uint8 or panels.dim() != 2
            or panels.shape[1] % panel_block or not panels.is_contiguous()):
        raise ValueError(f"panels must be contiguous uint8 [N / 8, 8 * row_bytes] of {quant_type} (one of "
                         f"{PANEL_TYPES}) from pack_panels, got {panels.dtype} {tuple(panels.shape)}")
    return panels.shape[0] * PANEL_ROWS, panels.shape[1] // panel_block * fmt.block_size


def dequantize(data: torch.Tensor, quant_type: str, num_threads: int | None = None) -> torch.Tensor:
    """float32 ``[N, K]`` values of uint8 block rows ``data`` (bit-equal to ``gguf_reference.dequantize``)."""
    out, status = _dequantize_with("gguf_dequant", data, quant_type, torch.float32, num_threads)
    if status:
        raise RuntimeError(f"gguf_dequant failed for {quant_type} (status {status})")
    return out


def dequantize_bf16(data: torch.Tensor, quant_type: str, num_threads: int | None = None) -> torch.Tensor | None:
    """bf16 ``[N, K]`` values of block rows ``data``: :func:`dequantize` rounded to bf16 (nearest even,
    as ``.to(torch.bfloat16)``) in one pass; None where this build has no AVX-512 BF16."""
    out, status = _dequantize_with("gguf_dequant_bf16", data, quant_type, torch.bfloat16, num_threads)
    return None if status else out


def _dequantize_with(function: str, data: torch.Tensor, quant_type: str, dtype: torch.dtype,
                     num_threads: int | None) -> tuple[torch.Tensor, int]:
    """``[N, K]`` values of block rows ``data`` in ``dtype`` by the library's ``function``, and its status."""
    library = _library()
    if library is None:
        raise RuntimeError("the GGUF CPU kernels are not built here (no working C compiler)")
    num_rows, num_columns = _check(None, data, quant_type)
    out = torch.empty(num_rows, num_columns, dtype=dtype)
    status = getattr(library, function)(QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0), num_rows, num_columns,
                                        out.data_ptr(), num_threads or torch.get_num_threads())
    return out, status


def int4pack_dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, start: int,
                        stop: int) -> torch.Tensor:
    """float32 rows ``start:stop`` of a weight in torch's CPU int4 layout (``packed`` from
    ``_convert_weight_to_int4pack_for_cpu``, bf16 ``scales_and_zeros`` ``[K / group_size, N, 2]``): the
    values ``_weight_int4pack_mm_for_cpu`` multiplies by. Needs ``N % 64 == 0`` (the layout's row blocks)."""
    library = _library()
    if library is None:
        raise RuntimeError("the GGUF CPU kernels are not built here (no working C compiler)")
    num_groups, num_rows, _ = scales_and_zeros.shape
    num_columns = num_groups * group_size
    if (packed.dtype != torch.uint8 or packed.numel() * 2 != num_rows * num_columns or num_rows % 64
            or scales_and_zeros.dtype != torch.bfloat16 or not 0 <= start <= stop <= num_rows):
        raise ValueError(f"int4pack_dequantize needs a uint8 int4 pack of [N, K] with N % 64 == 0, bf16 scales and "
                         f"0 <= start <= stop <= N; got {packed.dtype} {tuple(packed.shape)}, "
                         f"{scales_and_zeros.dtype} {tuple(scales_and_zeros.shape)}, rows {start}:{stop}")
    packed, scales_and_zeros = packed.contiguous(), scales_and_zeros.contiguous()
    out = torch.empty(stop - start, num_columns, dtype=torch.float32)
    status = library.int4pack_dequant(packed.data_ptr(), scales_and_zeros.data_ptr(), num_rows, num_columns,
                                      group_size, start, stop, out.data_ptr())
    if status:
        raise RuntimeError(f"int4pack_dequant failed (status {status})")
    return out


def int4pack_dequantize_t(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, start: int,
                          stop: int) -> torch.Tensor:
    """:func:`int4pack_dequantize` transposed, ``[K, stop - start]`` (``start``/``stop`` multiples of
    64): the layout gives 16 rows' codes per vector, so this is the fast one (``x @ tile``)."""
    library = _library()
    if library is None:
        raise RuntimeError("the GGUF CPU kernels are not built here (no working C compiler)")
    num_groups, num_rows, _ = scales_and_zeros.shape
    num_columns = num_groups * group_size
    if (packed.dtype != torch.uint8 or packed.numel() * 2 != num_rows * num_columns or num_rows % 64 or start % 64
            or stop % 64 or scales_and_zeros.dtype != torch.bfloat16 or not 0 <= start <= stop <= num_rows):
        raise ValueError(f"int4pack_dequantize_t needs a uint8 int4 pack of [N, K] with N % 64 == 0, bf16 scales and "
                         f"row bounds in multiples of 64; got {packed.dtype} {tuple(packed.shape)}, "
                         f"{scales_and_zeros.dtype} {tuple(scales_and_zeros.shape)}, rows {start}:{stop}")
    packed, scales_and_zeros = packed.contiguous(), scales_and_zeros.contiguous()
    out = torch.empty(num_columns, stop - start, dtype=torch.float32)
    status = library.int4pack_dequant_t(packed.data_ptr(), scales_and_zeros.data_ptr(), num_rows, num_columns,
                                        group_size, start, stop, out.data_ptr())
    if status:
        raise RuntimeError(f"int4pack_dequant_t failed (status {status})")
    return out


# ---- batches on AMX: gguf_cpu_amx.c ----------------------------------------------------------------

AMX_SOURCE = Path(__file__).with_name("gguf_cpu_amx.c")
# Weight rows decoded per tile: about this many bytes of bf16 (the tile and x's 32-row block share L2).
AMX_TILE_BYTES = 256 << 10


def has_amx() -> bool:
    """Whether batches can run on AMX tiles decoded from the blocks (:func:`amx_linear`): the CPU and
    Linux grant AMX's tile state, this build has AMX-BF16, and the bf16 block decoder is built."""
    return _amx_dequant_pointer() is not None


def amx_linear(x: torch.Tensor, data: torch.Tensor, quant_type: str, bf16_out: bool = True,
               num_threads: int | None = None) -> torch.Tensor:
    """``x @ W.T`` for bf16 ``x`` ``[M, K]`` (any M) and block rows ``data`` ``[N, row_bytes]`` (``N % 16 ==
    0``), where :func:`has_amx`: each tile of ``W``'s rows decoded exactly to bf16 (:func:`dequantize_bf16`'s
    values, those of a bf16 dense copy) in L2 and multiplied on AMX with float32 sums; no copy of ``W``
    is kept. bf16 out (the float32 sums rounded to nearest even), or float32."""
    return amx_routine(data, quant_type, bf16_out)(x.contiguous(), num_threads)


def amx_routine(data: torch.Tensor, quant_type: str, bf16_out: bool = True):
    """:func:`amx_linear` with the weight bound and checked once: ``routine(x)`` for contiguous bf16 ``x``
    ``[M, K]``, ``M >= 1`` (the caller's contract: not checked per call); ``routine(x, out=view)`` writes
    into ``view`` (``[M, N]`` of the output dtype, unit column stride: e.g. a run's columns of a fused layer)."""
    dequant = _amx_dequant_pointer()
    if dequant is None:
        raise RuntimeError("AMX batches are not available here (no AMX-BF16 CPU or kernel permission, or no "
                           "C compiler)")
    num_rows, num_columns = _check(None, data, quant_type)
    if num_rows % 16 or data.stride(0) < data.shape[1]:
        raise ValueError(f"amx_routine needs rows in multiples of 16, got {num_rows}")
    tile_rows = max(32, AMX_TILE_BYTES // (2 * num_columns) // 32 * 32)
    call, qtype, pointer, stride = _amx_library().gguf_amx_linear, QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0)
    out_dtype = torch.bfloat16 if bf16_out else torch.float32
    get_num_threads = torch.get_num_threads

    def routine(x: torch.Tensor, num_threads: int | None = None, out: torch.Tensor | None = None,
                _data=data) -> torch.Tensor:  # _data: keeps W alive
        if out is None:
            out = torch.empty(x.shape[0], num_rows, dtype=out_dtype)
        status = call(dequant, qtype, pointer, stride, num_rows, num_columns, x.data_ptr(), x.shape[1], x.shape[0],
                      out.data_ptr(), out.stride(0), bf16_out, tile_rows, num_threads or get_num_threads())
        if status:
            raise RuntimeError(f"gguf_amx_linear failed for {quant_type} (status {status})")
        return out

    return routine


@functools.cache
def _amx_library():
    with _lock:
        path = build_library(AMX_SOURCE, "gguf_cpu_amx", FLAGS, "GGUF AMX kernels")
        if path is None:
            return None
        library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.gguf_amx_available.argtypes = ()
    library.gguf_amx_available.restype = ctypes.c_int
    library.gguf_amx_linear.argtypes = (ptr, ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int,
                                        i64, ctypes.c_int)
    library.gguf_amx_linear.restype = ctypes.c_int
    return library


@functools.cache
def _amx_dequant_pointer() -> int | None:
    """The address of ``gguf_dequant_bf16`` (the AMX kernel's tile decoder), where AMX runs here."""
    amx = _amx_library()
    if amx is None or not amx.gguf_amx_available() or _library() is None:
        return None
    probe = torch.zeros(1, 34, dtype=torch.uint8)  # one Q8_0 block: does this build decode to bf16?
    if dequantize_bf16(probe, "Q8_0", num_threads=1) is None:
        return None
    return ctypes.cast(_library().gguf_dequant_bf16, ctypes.c_void_p).value


def _check(x, data: torch.Tensor, quant_type: str) -> tuple[int, int]:
    from .gguf_reference import block_format

    fmt = block_format(quant_type)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % fmt.type_size or data.device.type != "cpu":
        raise ValueError(f"data must be CPU uint8 rows of whole {fmt.type_size}-byte {quant_type} blocks, got "
                         f"{data.dtype} {tuple(data.shape)} on {data.device}")
    if data.shape[0] > 1 and data.stride(1) != 1:
        raise ValueError("data's rows must be contiguous")
    num_columns = fmt.num_columns(data.shape[1])
    if x is not None and (x.dim() != 2 or x.shape[1] != num_columns or x.device.type != "cpu"):
        raise ValueError(f"x must be a CPU [M, {num_columns}] tensor for this {quant_type} weight, got "
                         f"{tuple(x.shape)} on {x.device}")
    return data.shape[0], num_columns


@functools.cache
def _library():
    with _lock:
        path = _built_library()
        if path is None:
            return None
        # OpenMP: torch's own libgomp is already loaded, and the loader reuses it for this library
        # (same soname), so both share one thread pool.
        library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.gguf_gemv.argtypes = (ctypes.c_int, ptr, i64, i64, i64, ptr, ctypes.c_int, ptr, i64, ctypes.c_int)
    library.gguf_dequant.argtypes = (ctypes.c_int, ptr, i64, i64, i64, ptr, ctypes.c_int)
    library.gguf_gemv_bf16.argtypes = library.gguf_gemv.argtypes
    library.gguf_gemv_bf16_out.argtypes = library.gguf_gemv.argtypes
    library.gguf_gemv_bf16_out.restype = ctypes.c_int
    library.gguf_has_bf16.argtypes = (ctypes.c_int,)
    library.gguf_has_panels.argtypes = (ctypes.c_int,)
    library.gguf_has_vector_float32.argtypes = (ctypes.c_int,)
    library.gguf_has_vector_float32.restype = ctypes.c_int
    library.gguf_has_avx512.argtypes = ()
    library.gguf_has_avx512.restype = ctypes.c_int
    library.gguf_panel_pack.argtypes = (ctypes.c_int, ptr, i64, i64, i64, ptr)
    library.gguf_panel_dequant.argtypes = (ctypes.c_int, ptr, i64, i64, ptr)
    library.gguf_panel_dequant_t.argtypes = library.gguf_panel_dequant.argtypes
    library.gguf_panel_dequant_t.restype = ctypes.c_int
    library.gguf_panel_gemv.argtypes = (ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int, ptr, i64, ctypes.c_int)
    for function in (library.gguf_has_panels, library.gguf_panel_pack, library.gguf_panel_dequant,
                     library.gguf_panel_gemv):
        function.restype = ctypes.c_int
    library.int4pack_dequant.argtypes = (ptr, ptr, i64, i64, i64, i64, i64, ptr)
    library.int4pack_dequant_t.argtypes = library.int4pack_dequant.argtypes
    library.gguf_dequant_bf16.argtypes = library.gguf_dequant.argtypes
    library.gguf_dequant_bf16.restype = ctypes.c_int
    library.int4pack_dequant.restype = library.int4pack_dequant_t.restype = ctypes.c_int
    library.gguf_gemv.restype = library.gguf_dequant.restype = ctypes.c_int
    library.gguf_gemv_bf16.restype = library.gguf_has_bf16.restype = ctypes.c_int
    return library


def _built_library(source_path: Path = SOURCE, prefix: str = "gguf_cpu") -> Path | None:
    """The shared library of ``source_path`` (built now unless cached), or None where it cannot be built.
    Also builds ``gguf_cpu_q8x_kernels.c`` (``gguf_cpu_q8x.py``), with the same flags and cache."""
    return build_library(source_path, prefix, FLAGS, "GGUF CPU kernels")
