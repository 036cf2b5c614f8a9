"""Int8-activation GEMVs of GGUF Q4_0 / Q4_1 / Q8_0 block rows on the CPU (and, in panels, Q4_K / Q6_K;
``gguf_cpu_q8x_kernels.c``), as llama.cpp computes them: opt-in (``EngineConfig.cpu_int8_activations``), NOT
the exact bf16/float32 math.

Each row of x is quantized per block of 32 values: scale ``d = max|x| / 127`` (float32), codes
``q = round_half_even(x / d)`` (int8, as ``x * (1 / d)``), and ``xsum = d * sum(q)``. Then, per output
row, ``sum_b (dw_b * d_b) * isum_b + mw_b * xsum_b`` with ``isum_b`` the exact integer dot product of the
file's codes and x's codes (Q4_1: ``mw`` the file's fp16 minimum; Q4_0: ``mw = -8 dw``; Q8_0: none),
integer dot products by AVX-512 VNNI (``vpdpbusd``, 64 int8 products an instruction) or AVX2
(``vpmaddubsw``), else plain C. Each row of x gets the same bits whatever the number of rows in the call
(1..:data:`MAX_ROWS`) and the thread count. :func:`reference` is the same math in torch: bit-equal to
the plain-C path (:func:`gemv_scalar`); the vector paths sum the same float32 block terms in lanes.

Where the CPU has AVX-512 VNNI or AVX2, :func:`weight_routine` repacks a weight into panels of 16 output rows
(:func:`pack`, about the file's bytes; Q6_K's codes unpacked to bytes, 1.2x) so that each ``vpdpbusd``
adds 4 products into each row's own int32 lane: no horizontal sums, one float32 scale step per block
per 16 rows. AVX2 runs the same panels as two registers of 8 rows with ``vpmaddubsw`` (pairs summed in
int16, added up in int16 where they cannot overflow, then one ``vpmaddwd``): the same integer sums.
Measured 2026-12-02 (AMD EPYC Zen 4, 1 thread, CPU time, hot, load 1.5, vs the exact bf16
kernel of ``gguf_cpu_native``), G weights/s at 1 / 2 / 5 / 8 rows: Q4_1 [1536, 576] 60 / 46 / 24 / 16
(bf16 22 / 16 / 9.3 / 6.3); Q8_0 [49152, 576] 22 / 17 / 19 / 11 (14.5 / 12 / 7.1 / 4.6); Q4_K [8192,
2048] 68 / 54 / 22 / 17 (23 / 18 / 8.8 / 4.4); Q6_K [2048, 8192] 22 / 19 / 9.8 / 7.1 (17 / 13 / 8.1 / 5.0).
AVX2 (2026-12-04, AMD EPYC Zen 3, 1 thread, weights from DRAM, a noisy machine): Q4_K [8192, 2048] 0.41-0.8 ms
at 1 row against the exact float32 GEMV's 1.0-1.2; end to end, 1B Q4_K_M decode 1.06-1.15x llama.cpp's
(exact 0.67-0.80x). ``vpmaddubsw`` retires at the FMA's rate there (2 a cycle), so extra rows cost about as
much as on the exact path: a 5-row step 2.8-3.3 decode steps.

The library is built on first use by ``gguf_cpu_native``'s builder (same flags, cache, and
``HEARTH_LLM_KERNEL_CFLAGS``; e.g. ``-mno-avx512f`` builds the AVX2 path here).

>>> out = gemv(x, data, "Q4_1")        # float32 [M, N]; x float32 or bf16 [M, K], M <= 8
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import gguf_cpu_native

SOURCE = gguf_cpu_native.SOURCE.with_name("gguf_cpu_q8x_kernels.c")
QTYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 4, "Q4_K": 5, "Q6_K": 7}
# Types of the row kernel (:func:`gemv`, every build); the panels (:func:`pack`, AVX-512 VNNI or AVX2) also take Q4_K
# (x's blocks of 32 are its sub-blocks: scale d * sc, minimum -dmin * mn, as Q4_1's d and m) and Q6_K (two
# sub-blocks of 16 per block of x: (d * sc) * d_x * (isum - 32 * the 16 codes' sum of x)).
TYPES = ("Q4_0", "Q4_1", "Q8_0")
PANEL_TYPES = TYPES + ("Q4_K", "Q6_K")
MAX_ROWS = 8
BLOCK = 32
# bytes and values per block (Q4_K: a superblock of 256)
_FORMATS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32), "Q4_K": (144, 256), "Q6_K": (210, 256)}


def available() -> bool:
    """Whether the int8-activation kernels are built (or can be built now) here."""
    return _library() is not None


def path() -> str | None:
    """Which path this build runs: ``"avx512_vnni"``, ``"avx2"``, ``"c"``; None where not built."""
    library = _library()
    if library is None:
        return None
    return "avx512_vnni" if library.q8x_has_vnni() else "avx2" if library.q8x_has_avx2() else "c"


def supports(quant_type: str, num_rows: int) -> bool:
    """Whether the engine should run ``num_rows`` block rows of ``quant_type`` on int8 activations here: the
    panels only (AVX-512 VNNI or AVX2, rows in 16s; not Q8_0 on AVX2, slower there than the exact panels).
    The row kernel is slower than the exact kernels (AVX2, hot, 1 row: Q8_0 [49152, 576] 4.2 ms vs the float32
    panels' 1.6; Q4_1 [1536, 576] 0.14 vs 0.05 ms)."""
    if quant_type == "Q8_0" and has_panels() and not _library().q8x_has_vnni():
        # AVX2: Q8_0's exact float32 panels already stream at DRAM speed, and its int8 panels hold more bytes
        # (1.125 vs 1.0625 a weight): 1B Q8_0 decode 11.6 tok/s exact vs 10.5 int8 (AMD EPYC Zen 3, 1 thread)
        return False
    return quant_type in PANEL_TYPES and num_rows % PANEL_ROWS == 0 and has_panels()


def _check(x: torch.Tensor | None, data: torch.Tensor, quant_type: str, types=TYPES) -> tuple[int, int]:
    if quant_type not in types:
        raise ValueError(f"quant_type must be one of {types} for the int8-activation kernels, got {quant_type!r}")
    size, values = _FORMATS[quant_type]
    if (data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % size or data.device.type != "cpu"
            or (data.shape[0] > 1 and data.stride(1) != 1)):
        raise ValueError(f"data must be CPU uint8 rows of whole {size}-byte {quant_type} blocks (contiguous rows), "
                         f"got {data.dtype} {tuple(data.shape)} on {data.device}")
    num_columns = data.shape[1] // size * values
    if x is not None and (x.dim() != 2 or x.shape[1] != num_columns or not 1 <= x.shape[0] <= MAX_ROWS
                          or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu"):
        raise ValueError(f"x must be CPU float32/bf16 [1..{MAX_ROWS}, {num_columns}] for this {quant_type} weight, "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    return data.shape[0], num_columns


def _require():
    library = _library()
    if library is None:
        raise RuntimeError("the int8-activation GGUF CPU kernels are not built here (no working C compiler)")
    return library


def gemv(x: torch.Tensor, data: torch.Tensor, quant_type: str, num_threads: int | None = None,
         bf16_out: bool = False) -> torch.Tensor:
    """``x @ W.T`` with x quantized to int8 per block (module docstring): float32 ``[M, N]`` (bf16 with
    ``bf16_out``: the float32 sums rounded to nearest even) for float32 or bf16 ``x`` ``[M, K]``."""
    library = _require()
    num_rows, _ = _check(x, data, quant_type)
    x = x.contiguous()
    out = torch.empty(x.shape[0], num_rows, dtype=torch.bfloat16 if bf16_out else torch.float32)
    status = library.q8x_gemv(QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0), num_rows, x.shape[1],
                              x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], out.data_ptr(), num_rows,
                              int(bf16_out), num_threads or torch.get_num_threads())
    if status:
        raise RuntimeError(f"q8x_gemv failed for {quant_type} (status {status})")
    return out


def gemv_scalar(x: torch.Tensor, data: torch.Tensor, quant_type: str) -> torch.Tensor:
    """:func:`gemv` on the plain-C path whatever this build's vector path (float32 out; for tests)."""
    library = _require()
    num_rows, _ = _check(x, data, quant_type)
    x = x.contiguous()
    out = torch.empty(x.shape[0], num_rows, dtype=torch.float32)
    if library.q8x_gemv_scalar(QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0), num_rows, x.shape[1],
                               x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], out.data_ptr(), num_rows):
        raise RuntimeError(f"q8x_gemv_scalar failed for {quant_type}")
    return out


def gemv_routine(data: torch.Tensor, quant_type: str, bf16_out: bool = False):
    """:func:`gemv` with the weight bound and checked once: ``routine(x)`` for contiguous float32/bf16 ``x``
    ``[M, K]``, 1 <= M <= :data:`MAX_ROWS` (the caller's contract: not checked per call)."""
    library = _require()
    num_rows, _ = _check(None, data, quant_type)
    call, qtype, pointer, stride = library.q8x_gemv, QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0)
    get_num_threads, out_dtype, bf16_flag = torch.get_num_threads, torch.bfloat16 if bf16_out else torch.float32, \
        int(bf16_out)
    bfloat16 = torch.bfloat16

    def routine(x: torch.Tensor, _data=data) -> torch.Tensor:  # _data: keeps the weight alive
        out = torch.empty(x.shape[0], num_rows, dtype=out_dtype)
        call(qtype, pointer, stride, num_rows, x.shape[1], x.data_ptr(), int(x.dtype == bfloat16), x.shape[0],
             out.data_ptr(), num_rows, bf16_flag, get_num_threads())
        return out

    return routine


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C quantizer's ``(codes int8 [M, K], scales float32 [M, K / 32], xsums float32 [M, K / 32])``."""
    library = _require()
    if x.dim() != 2 or x.shape[1] % BLOCK or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32/bf16 [M, K] with K % {BLOCK} == 0, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0], x.shape[1] // BLOCK)
    sums = torch.empty_like(scales)
    library.q8x_quantize(x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1], codes.data_ptr(),
                         scales.data_ptr(), sums.data_ptr())
    return codes, scales, sums


PANEL_ROWS = 16


def has_panels() -> bool:
    """Whether this build runs the 16-row panel kernels (:func:`pack`; AVX-512 VNNI, or AVX2 with the same
    integer sums): one int32 lane per output row, so no horizontal sums; the fast path (the row kernel :func:`gemv`
    elsewhere)."""
    library = _library()
    return library is not None and bool(library.q8x_has_panels())


def pack(data: torch.Tensor, quant_type: str) -> torch.Tensor:
    """Block rows ``data`` ``[N, row_bytes]`` (``N % 16 == 0``) rearranged into panels of 16 rows (the C
    file's layout: each block's 16 fp16 scales, Q4_1's minimums or Q8_0's code sums, then the codes in
    4-byte groups), uint8 ``[N / 16, num_blocks * panel_bytes]`` for :func:`panel_gemv_routine`."""
    library = _require()
    num_rows, num_columns = _check(None, data, quant_type, PANEL_TYPES)
    if num_rows % PANEL_ROWS:
        raise ValueError(f"panels need rows in multiples of {PANEL_ROWS}, got {num_rows}")
    size = library.q8x_panel_bytes(QTYPE_IDS[quant_type])
    out = torch.empty(num_rows // PANEL_ROWS, num_columns // _FORMATS[quant_type][1] * size, dtype=torch.uint8)
    if library.q8x_pack(QTYPE_IDS[quant_type], data.data_ptr(), data.stride(0), num_rows, num_columns,
                        out.data_ptr()):
        raise RuntimeError(f"q8x_pack failed for {quant_type}")
    return out


def panel_gemv_routine(panels: torch.Tensor, quant_type: str, bf16_out: bool = False):
    """``routine(x)``: :func:`gemv` (same quantization of x, same integer sums; float32 lanes per output
    row) on :func:`pack`'s ``panels``, for contiguous float32/bf16 ``x`` ``[M, K]``, 1 <= M <=
    :data:`MAX_ROWS` (not checked per call), where :func:`has_panels`."""
    if not has_panels():
        raise ValueError("no int8-activation panel kernels in this build (needs AVX-512 VNNI or AVX2)")
    library = _library()
    size = library.q8x_panel_bytes(QTYPE_IDS.get(quant_type, -1))
    if (not size or panels.dtype != torch.uint8 or panels.dim() != 2 or panels.shape[1] % size
            or not panels.is_contiguous()):
        raise ValueError(f"panels must be contiguous uint8 [N / 16, blocks * {size}] of {quant_type} from pack, got "
                         f"{panels.dtype} {tuple(panels.shape)}")
    num_rows, num_columns = panels.shape[0] * PANEL_ROWS, panels.shape[1] // size * _FORMATS[quant_type][1]
    call, qtype, pointer = library.q8x_panel_gemv, QTYPE_IDS[quant_type], panels.data_ptr()
    get_num_threads, out_dtype, bf16_flag = torch.get_num_threads, torch.bfloat16 if bf16_out else torch.float32, \
        int(bf16_out)
    bfloat16 = torch.bfloat16

    def routine(x: torch.Tensor, _panels=panels) -> torch.Tensor:  # _panels: keeps the weight alive
        out = torch.empty(x.shape[0], num_rows, dtype=out_dtype)
        call(qtype, pointer, num_rows, num_columns, x.data_ptr(), int(x.dtype == bfloat16), x.shape[0],
             out.data_ptr(), num_rows, bf16_flag, get_num_threads())
        return out

    return routine


def weight_routine(data: torch.Tensor, quant_type: str, bf16_out: bool = False):
    """The fastest int8-activation ``routine(x)`` for block rows ``data`` here: the panels (a packed copy
    made now) where :func:`has_panels` and ``N % 16 == 0``, else the row kernel on ``data``."""
    if has_panels() and data.shape[0] % PANEL_ROWS == 0 and quant_type in PANEL_TYPES:
        return panel_gemv_routine(pack(data, quant_type), quant_type, bf16_out)
    return gemv_routine(data, quant_type, bf16_out)


# ---- the same math in torch ---------------------------------------------------------------------------

def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` in torch (bit-equal): per row and block of 32, ``d = max|x| / 127``,
    ``q = round(x * (1 / d))`` (half to even; 0 where d is 0), ``xsum = d * sum(q)``."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inverse[..., None]).clamp_(-127, 127)
    sums = d * codes.sum(-1)  # the integer sum is exact in float32 (|sum| <= 32 * 127)
    return codes.to(torch.int8).reshape(x.shape), d, sums


def block_codes(data: torch.Tensor, quant_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The file's ``(codes int32 [N, K / 32, 32], dw float32 [N, K / 32], mw float32 [N, K / 32] or None)``
    (Q4 codes 0..15 with ``mw`` the minimum, Q4_0's ``-8 dw``; Q8_0 signed codes, no minimum)."""
    _check(None, data, quant_type, PANEL_TYPES)
    blocks = data.reshape(data.shape[0], -1, _FORMATS[quant_type][0])

    def f16(offset):
        return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0].float()

    dw = f16(0)
    if quant_type == "Q4_K":
        from .gguf_reference import k_scales_and_mins

        num_rows, num_super = blocks.shape[:2]
        sc, mn = k_scales_and_mins(blocks[..., 4:16].reshape(-1, 12).int())
        sc, mn = sc.reshape(num_rows, num_super, 8).float(), mn.reshape(num_rows, num_super, 8).float()
        chunks = blocks[..., 16:].int().reshape(num_rows, num_super, 4, 1, 32)
        codes = torch.cat((chunks & 15, chunks >> 4), dim=3).reshape(num_rows, num_super * 8, 32)
        return codes, (dw[..., None] * sc).reshape(num_rows, -1), (-(f16(2)[..., None] * mn)).reshape(num_rows, -1)
    if quant_type == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).int(), dw, None
    qs = blocks[..., 4 if quant_type == "Q4_1" else 2:].int()
    codes = torch.cat((qs & 15, qs >> 4), dim=-1)
    return codes, dw, f16(2) if quant_type == "Q4_1" else -8.0 * dw


def q6_k_codes(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q6_K weight's ``(codes - 32 int32 [N, K / 16, 16], d * sc float32 [N, K / 16])`` (the reference's
    factors: their product is its dequantized weight)."""
    _check(None, data, "Q6_K", PANEL_TYPES)
    blocks = data.reshape(-1, 210)
    low = blocks[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat((low & 0x0F, low >> 4), dim=2).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    codes = (low | (high << 4)).int() - 32
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()
    scale = d * blocks[:, 192:208].contiguous().view(torch.int8).float()
    return codes.reshape(data.shape[0], -1, 16), scale.reshape(data.shape[0], -1)


def reference(x: torch.Tensor, data: torch.Tensor, quant_type: str) -> torch.Tensor:
    """:func:`gemv` in torch, float32 ``[M, N]``: bit-equal to :func:`gemv_scalar` (the block terms added
    in block order in float32, the plain-C path's order)."""
    if quant_type == "Q6_K":
        codes, scale = q6_k_codes(data)
        q, d, _ = quantize_rows_reference(x)
        isum = torch.einsum("nbj,mbj->mnb", codes, q.reshape(x.shape[0], -1, 16).int()).float()
        acc = torch.zeros(x.shape[0], data.shape[0])
        for b in range(codes.shape[1]):
            acc = acc + (scale[None, :, b] * d[:, None, b // 2]) * isum[:, :, b]
        return acc
    codes, dw, mw = block_codes(data, quant_type)
    q, d, sums = quantize_rows_reference(x)
    q = q.reshape(x.shape[0], -1, BLOCK).int()
    isum = torch.einsum("nbj,mbj->mnb", codes, q).float()  # exact integers (|isum| < 2^24)
    acc = torch.zeros(x.shape[0], data.shape[0])
    for b in range(codes.shape[1]):
        acc = acc + (dw[None, :, b] * d[:, None, b]) * isum[:, :, b]
        if mw is not None:
            acc = acc + mw[None, :, b] * sums[:, None, b]
    return acc


@functools.cache
def _library():
    with gguf_cpu_native._lock:
        built = gguf_cpu_native._built_library(SOURCE, "gguf_cpu_q8x")
    if built is None:
        return None
    library = ctypes.CDLL(str(built))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    library.q8x_gemv.argtypes = (c_int, ptr, i64, i64, i64, ptr, c_int, c_int, ptr, i64, c_int, c_int)
    library.q8x_gemv_scalar.argtypes = (c_int, ptr, i64, i64, i64, ptr, c_int, c_int, ptr, i64)
    library.q8x_quantize.argtypes = (ptr, c_int, c_int, i64, ptr, ptr, ptr)
    library.q8x_pack.argtypes = (c_int, ptr, i64, i64, i64, ptr)
    library.q8x_panel_gemv.argtypes = (c_int, ptr, i64, i64, ptr, c_int, c_int, ptr, i64, c_int, c_int)
    library.q8x_panel_bytes.argtypes = (c_int,)
    for function in (library.q8x_gemv, library.q8x_gemv_scalar, library.q8x_quantize, library.q8x_has_vnni,
                     library.q8x_has_avx2, library.q8x_has_panels, library.q8x_pack, library.q8x_panel_gemv,
                     library.q8x_panel_bytes):
        function.restype = c_int
    library.q8x_has_vnni.argtypes = library.q8x_has_avx2.argtypes = library.q8x_has_panels.argtypes = ()
    return library
