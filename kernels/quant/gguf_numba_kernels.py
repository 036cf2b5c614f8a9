"""The numba kernels behind ``gguf_numba.py`` (imported on first use: importing numba costs ~0.5 s
of a cold start, and its OpenMP pool is set up here). See ``gguf_numba.py`` for what they compute."""
from __future__ import annotations

import os

import numpy as np

# numba's OpenMP pool is a second OpenMP runtime next to torch's; its idle threads spin by default
# and starve torch's on a busy CPU (measured: prefill 14 -> 331 tok/s on 2 cores with PASSIVE). The
# variable is read when that runtime starts, i.e. by the first parallel launch below; torch's own
# runtime started long before and keeps its setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402
from numba import prange  # noqa: E402

_FASTMATH = {"reassoc"}  # reorder sums only: no FMA contraction, no finite-math assumptions


def _use_openmp() -> bool:
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        return False
    numba.config.THREADING_LAYER = "omp"
    return True


PARALLEL = _use_openmp()


@numba.njit(inline="always")
def _f16(row, offset, table):
    return table[np.int64(row[offset]) | (np.int64(row[offset + 1]) << 8)]


@numba.njit(inline="always")
def _k_scale_min(row, o, s):
    """Q4_K/Q5_K: sub-block ``s``'s 6-bit scale and min (the 12 bytes at ``o + 4``)."""
    a, b, c = np.int64(row[o + 4 + s]), np.int64(row[o + 8 + s]), np.int64(row[o + 4 + s % 4])
    if s < 4:
        return np.float32(a & 63), np.float32(b & 63)
    return np.float32((b & 15) | ((c >> 6) << 4)), np.float32((b >> 4) | ((a >> 6) << 4))


# One function per format: row · x with each weight decoded as gguf_reference decodes it.
# Each is a single fused loop (decode, multiply, add) that LLVM vectorizes.


@numba.njit(boundscheck=False, fastmath=_FASTMATH)
def _q4_0_row(row, x, table):
    total = np.float32(0.0)
    for b in range(row.shape[0] // 18):
        o, xo = b * 18, b * 32
        d = _f16(row, o, table)
        for j in range(16):
            byte = row[o + 2 + j]
            total += d * np.float32(np.int64(byte & 15) - 8) * x[xo + j]
            total += d * np.float32(np.int64(byte >> 4) - 8) * x[xo + j + 16]
    return total


@numba.njit(boundscheck=False, fastmath=_FASTMATH)
def _q4_1_row(row, x, table):
    total = np.float32(0.0)
    for b in range(row.shape[0] // 20):
        o, xo = b * 20, b * 32
        d, m = _f16(row, o, table), _f16(row, o + 2, table)
        for j in range(16):
            byte = row[o + 4 + j]
            total += (d * np.float32(byte & 15) + m) * x[xo + j]
            total += (d * np.float32(byte >> 4) + m) * x[xo + j + 16]
    return total


@numba.njit(boundscheck=False, fastmath=_FASTMATH)
def _q5_row(row, x, table, has_min):
    size = 24 if has_min else 22
    total = np.float32(0.0)
    for b in range(row.shape[0] // size):
        o, xo = b * size, b * 32
        d = _f16(row, o, table)
        m = _f16(row, o + 2, table) if has_min else np.float32(0.0)
        high, low = (o + 4, o + 8) if has_min else (o + 2, o + 6)
        for j in range(32):
            hb = (np.int64(row[high + j // 8]) >> (j % 8)) & 1
            q = ((np.int64(row[low + j % 16]) >> (4 * (j // 16))) & 15) | (hb << 4)
            w = d * np.float32(q) + m if has_min else d * np.float32(q - 16)
            total += w * x[xo + j]
    return total


@numba.njit(boundscheck=False, fastmath=_FASTMATH)
def _q8_0_row(row, x, table):
    total = np.float32(0.0)
    for b in range(row.shape[0] // 34):
        o, xo = b * 34, b * 32
        d = _f16(row, o, table)
        part = np.float32(0.0)
        for j in range(32):
            q = np.int64(row[o + 2 + j])
            part += np.float32(q - 256 if q >= 128 else q) * x[xo + j]
        total += part * d
    return total


@numba.njit(boundscheck=False, fastmath=_FASTMATH)
def _k_row(row, x, table, has_high):
    size = 176 if has_high else 144
    total = np.float32(0.0)
    for b in range(row.shape[0] // size):
        o = b * size
        d, dmin = _f16(row, o, table), _f16(row, o + 2, table)
        codes = o + 48 if has_high else o + 16
        for s in range(8):
            sc, mn = _k_scale_min(row, o, s)
            scale, minimum = d * sc, dmin * mn
            base, shift, xo = codes + (s // 2) * 32, 4 * (s % 2), b * 256 + s * 32
            for l in range(32):
                q = (np.int64(row[base + l]) >> shift) & 15
                if has_high:
                    q |= ((np.int64(row[o + 16 + l]) >> s) & 1) << 4
                total += (scale * np.float32(q) - minimum) * x[xo + l]
    return total


@numba.njit(boundscheck=False, fastmath=_FASTMATH)
def _q6_k_row(row, x, table):
    total = np.float32(0.0)
    for b in range(row.shape[0] // 210):
        o = b * 210
        d = _f16(row, o + 208, table)
        for g16 in range(16):  # 16 groups of 16 values share a scale
            sc = np.int64(row[o + 192 + g16])
            scale = d * np.float32(sc - 256 if sc >= 128 else sc)
            h, g, l0 = g16 // 8, (g16 % 8) // 2, (g16 % 2) * 16
            low_base, high_base = o + h * 64 + (g % 2) * 32, o + 128 + h * 32
            xo = b * 256 + g16 * 16
            for k in range(16):
                l = l0 + k
                low = (np.int64(row[low_base + l]) >> (4 * (g // 2))) & 15
                high = (np.int64(row[high_base + l]) >> (2 * g)) & 3
                total += scale * np.float32((low | (high << 4)) - 32) * x[xo + k]
    return total


@numba.njit(boundscheck=False, fastmath=_FASTMATH)
def _w4g128_row(row, x, table):
    total = np.float32(0.0)
    for b in range(row.shape[0] // 68):
        o, xo = b * 68, b * 128
        s, z = _f16(row, o, table), np.int64(row[o + 2])
        for j in range(64):
            byte = np.int64(row[o + 4 + j])
            total += s * np.float32((byte & 15) - z) * x[xo + j]
            total += s * np.float32((byte >> 4) - z) * x[xo + j + 64]
    return total


@numba.njit(inline="always")
def _row_dot(qtype, row, x, table):
    if qtype == 0:
        return _q4_0_row(row, x, table)
    if qtype == 1:
        return _q4_1_row(row, x, table)
    if qtype == 2 or qtype == 3:
        return _q5_row(row, x, table, qtype == 3)
    if qtype == 4:
        return _q8_0_row(row, x, table)
    if qtype == 5 or qtype == 6:
        return _k_row(row, x, table, qtype == 6)
    if qtype == 8:
        return _w4g128_row(row, x, table)
    return _q6_k_row(row, x, table)


def _make_gemv(parallel: bool):
    rows = prange if parallel else range

    @numba.njit(parallel=parallel, boundscheck=False, cache=True, nogil=True)
    def gemv(x, data, qtype, table, out):
        for n in rows(data.shape[0]):
            row = data[n]
            for i in range(x.shape[0]):  # a few rows: each decodes the weight row again
                out[i, n] = _row_dot(qtype, row, x[i], table)

    return gemv

_gemv = _make_gemv(PARALLEL)
