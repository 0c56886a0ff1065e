"""FP8 casts: saturating E4M3 / E5M2 copies of a tensor, fused with its transposed copy (the operand layout
the weight-gradient GEMM needs) and its amax, all from one read of the tensor; for an output gradient, its
column sums (the bias gradient) too.

Two ways to scale, one kernel each:
- Per tensor (recipes "delayed" and "current"): y = clamp(x * scale, +-fp8_max), rounded to nearest even.
  Delayed scaling takes last step's scale from the device, so the cast is one pass: read 2 (bf16) or 4
  (fp32) bytes an element, write 1 per copy. Current scaling needs this tensor's amax first: one program
  per slice of x writes its partial maximum (a second read of x), and the cast kernel folds the partials
  itself, derives scale = fp8_max / amax / 2^margin (the given fallback where amax is 0, inf or NaN) and
  publishes scale and 1/scale. Nothing is zero-filled and nothing waits for the host.
- Per 1x128 block (recipe "blockwise"): every 128-column segment of a row gets its own scale, fp8_max over
  the segment's amax, and the transposed copy's rows (x's columns) get their own scales over 128-row
  segments of x. A 128x128 tile holds both kinds of segment, so both copies and both scale grids come
  from one read. The scales of a copy of shape (R, C) are stored as a (C/128, R) float32 array of inverse
  scales: its transpose is the (R, C/128) outer-dim-major grid torch._scaled_mm wants for a left operand,
  and the array itself the (C/128, R) grid it wants for a right operand given as a transposed view.
The amax: max|x| folded into a float32 slot with an int32 atomic max on its bits. For non-negative floats,
and NaN once the sign bit is cleared, integer order is float order, so NaN and inf win and reach the scale
update, which then skips them.
Both copies from one read only for 16-bit input. With both stores in one kernel, the ptxas that Triton 3.6
bundles (CUDA 12.8) miscompiles the transposed FP8 store for float32 input on sm_90: a quarter of its bytes
are foreign (NaN patterns among them), on every tile; CUDA 13.0's ptxas compiles the same code correctly,
and a kernel that writes only the transposed copy is correct with either. So a float32 tensor (the master
weight, cast once per optimizer step) takes two passes, the row-major copy and then the transposed one; the
gpu tests compare every copy bitwise against torch's cast for each input dtype and tile, and
bench/fp8_transpose_probe.py tells whether a Triton upgrade makes the split unnecessary.
Column sums (per-tensor casts): from the cast's own read of the tensor. The cast kernel with COL_SUMS runs
over (column blocks, parts) instead of one program a tile: each program casts a run of row tiles of its
column block exactly as the tile cast does, adds them up elementwise in an fp32 register tile, and ends
with one reduction across its rows, one partial row, which sum_partials (norm's second stage) adds up;
with delayed scaling its amax, likewise, is one atomic a program. A first fusion reduced across every
tile's rows (per 32-row partials), shuffles and barriers on every tile, and the dy cast ran at 0.25-0.30
of copy bandwidth on the H200 against 0.81-0.84 without the sums (bench/fp8.py at e387e02); the sums then
took a pass of their own, a second read of the tensor. With the amortized fusion the graphed dy cast runs at
0.54, 0.68 and 0.73 of copy bandwidth at widths 768, 2048 and 14336 (bench/fp8.py at 3d60c1f), against 0.47,
0.49 and 0.58 with the separate pass (e2de639). The 1x128 block cast keeps that pass (column_sums).
Tiles come from a fixed table by pass (_TILES), not an autotuner: its timing reruns cost host time on
every new shape and cannot run inside a CUDA graph capture. `bench/fp8.py --sweep` times the candidates
(_CAST_CONFIGS) on the GPU. A kernel variant that does not compile on the machine at hand falls back to a
path computing the same function (warned once, listed by fallbacks()), so a Triton upgrade costs speed,
never results.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
import triton
import triton.compiler.errors
import triton.language as tl
import triton.runtime.errors

from .activation import gelu_tanh
from .dispatch import INTERPRET as _INTERPRET, use_triton
from .launch import FastLauncher, cdiv
from .norm import partial_rows, sum_partials

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Smallest normal exponent and mantissa bits, for rounding onto the FP8 grid (interpreter only, below).
_FP8_GRID = {torch.float8_e4m3fn: (-6, 3), torch.float8_e5m2: (-14, 2)}
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FUSED_COPIES_DTYPES = (torch.bfloat16, torch.float16)  # both copies in one pass (see the module docstring)
BLOCK = 128                    # the block-scaling segment length (the "128" of 1x128)
_PARTS = 512                   # most amax partials of a current-scaling pass (one per program)
_MAX_ELEMENTS = 2 ** 31 - 2 ** 16  # the kernels index in int32, with a block of headroom
# Current scaling's scratch (float32): [scale, pad x3, 1/scale, pad x3, partial maxima x _PARTS]. scale and
# 1/scale each start a 16-byte block: torch._scaled_mm (cuBLASLt) rejects scale pointers that are not.
SCALE_INV_OFFSET = 4
_PARTS_AT = 8


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _abs_bits(x):
    # |x| as int32 bits: the sign bit cleared, so order among non-negatives (and NaN above inf) holds.
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _amax_partials_kernel(x_ptr, numel, scratch_ptr, PARTS_AT: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program p writes max|x| over its grid-stride share of x into scratch[PARTS_AT + p], as float bits
    (a program with nothing to read writes 0): every partial the cast kernel folds is written."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_E
    acc = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(pid * BLOCK_E, numel, step):
        offs = start + tl.arange(0, BLOCK_E)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
    tl.store(scratch_ptr + PARTS_AT + pid, tl.max(acc, axis=0).to(tl.float32, bitcast=True))


@triton.jit
def _col_sums_kernel(x_ptr, part_ptr, M, N, tiles_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    """Program (n, r) sums row tiles r * tiles_per_program ... of column block n elementwise in fp32 and writes
    one partial row, part[r]: one cross-warp reduction a program, not one a tile."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    first = tl.program_id(1) * tiles_per_program
    last = tl.minimum(first + tiles_per_program, tl.cdiv(M, BLOCK_M))
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tile in tl.range(first, last, num_stages=NUM_STAGES):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        acc += tl.load(x_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0,
                       eviction_policy="evict_first").to(tl.float32)
    tl.store(part_ptr + tl.program_id(1).to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def _round_to_fp8_grid(v, EMIN: tl.constexpr, MBITS: tl.constexpr):
    # Round-to-nearest-even onto the FP8 grid in float32: ulp = 2^(max(e, EMIN) - MBITS) and
    # (a + 1.5*2^23*ulp) - (1.5*2^23*ulp) rounds a = |v| to a multiple of ulp. Only under the interpreter,
    # whose float->fp8 conversion drops the mantissa carry (7.97 -> 4 in E4M3); the GPU's cvt.rn.satfinite
    # rounds correctly, and exact grid values convert exactly on both.
    # Rounds |v| and puts the sign back, so tiny negatives become -0 as in a hardware cast.
    bits = v.to(tl.int32, bitcast=True)
    a = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    e = tl.minimum(tl.maximum(((bits & 0x7FFFFFFF) >> 23) - 127, EMIN), 64)  # NaN: keep magic finite
    ulp = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0
    r = (a + magic) - magic
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _saturate_to_fp8(v, like_ptr, fp8_max, EXACT_ROUND: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """clamp(v, +-fp8_max) (NaN stays NaN) in the FP8 type of like_ptr."""
    v = tl.maximum(v, -fp8_max, propagate_nan=tl.PropagateNan.ALL)
    v = tl.minimum(v, fp8_max, propagate_nan=tl.PropagateNan.ALL)
    out_ty = like_ptr.dtype.element_ty
    if EXACT_ROUND:
        v = _round_to_fp8_grid(v, EMIN, MBITS)
        nan8 = tl.full([BLOCK_M, BLOCK_N], 0x7F, tl.uint8).to(out_ty, bitcast=True)  # NaN in both formats
        y = tl.where(v == v, v.to(out_ty), nan8)
    else:
        y = v.to(out_ty)
    return y


@triton.jit
def _tensor_scale(scale_ptr, scratch_ptr, n_parts, amax_acc_ptr, fp8_max, inv_margin, CURRENT: tl.constexpr,
                  ACC_AMAX: tl.constexpr, PARTS: tl.constexpr, PARTS_AT: tl.constexpr, SCALE_INV_AT: tl.constexpr):
    """The per-tensor scale. CURRENT: from the amax partials in scratch, and program (0, 0) (of either grid)
    publishes [scale, 1/scale] there and folds the amax into amax_acc, so each happens once a launch."""
    if CURRENT:
        idx = tl.arange(0, PARTS)
        parts = tl.load(scratch_ptr + PARTS_AT + idx, mask=idx < n_parts, other=0.0)
        amax_bits = tl.max(parts.to(tl.int32, bitcast=True), axis=0)
        amax = amax_bits.to(tl.float32, bitcast=True)
        fallback = tl.load(scale_ptr)
        # finite and positive (NaN fails every comparison); 3.4028234663852886e38 is float32's max
        ok = (amax > 0.0) & (amax <= 3.4028234663852886e38)
        fresh = tl.math.div_rn(fp8_max, tl.where(ok, amax, fp8_max)) * inv_margin
        scale = tl.where(ok & (fresh <= 3.4028234663852886e38), fresh, fallback)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scratch_ptr, scale)
            tl.store(scratch_ptr + SCALE_INV_AT, tl.math.div_rn(1.0, scale))
            if ACC_AMAX:
                tl.atomic_max(amax_acc_ptr, amax_bits)
    else:
        scale = tl.load(scale_ptr)
    return scale


@triton.jit
def _cast_tile(x_ptr, y_ptr, yt_ptr, M, N, offs_m, offs_n, scale, gelu_bias_ptr, fp8_max,
               WRITE_Y: tl.constexpr, WRITE_T: tl.constexpr, GELU: tl.constexpr, GELU_BIAS: tl.constexpr,
               EXACT_ROUND: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Casts the tile at rows offs_m, columns offs_n and returns what it cast in float32, 0 outside x (for
    the amax and the column sums). Offsets in int32: the launcher keeps M * N under _MAX_ELEMENTS."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if GELU:
        if GELU_BIAS:
            x += tl.load(gelu_bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        x = tl.where(mask, gelu_tanh(x), 0.0)   # outside x, gelu(bias) must not reach the amax
    y = _saturate_to_fp8(x * scale, yt_ptr, fp8_max, EXACT_ROUND, EMIN, MBITS, BLOCK_M, BLOCK_N)
    if WRITE_Y:
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], y, mask=mask)
    if WRITE_T:
        tl.store(yt_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(y), mask=tl.trans(mask))
    return x


@triton.jit
def _fp8_cast_kernel(x_ptr, y_ptr, yt_ptr, M, N, scale_ptr, scratch_ptr, n_parts, amax_acc_ptr, gelu_bias_ptr,
                     part_ptr, tiles_per_program, fp8_max, inv_margin,
                     CURRENT: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_T: tl.constexpr,
                     ACC_AMAX: tl.constexpr, GELU: tl.constexpr, GELU_BIAS: tl.constexpr, COL_SUMS: tl.constexpr,
                     EXACT_ROUND: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, PARTS: tl.constexpr,
                     PARTS_AT: tl.constexpr, SCALE_INV_AT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per-tensor cast (scale: _tensor_scale). GELU: x is a pre-activation; the tile cast (and its amax) is
    gelu_tanh(x + gelu_bias) (never written in 16 bits).
    Without COL_SUMS, program (m, n) casts tile (m, n). With COL_SUMS, program (n, r) casts row tiles
    r * tiles_per_program ... of column block n, adds them up elementwise in fp32 and writes one partial
    row, part[r] (summed over r by sum_partials), and the amax folds once a program: one cross-warp
    reduction and one atomic a program, not one a tile."""
    scale = _tensor_scale(scale_ptr, scratch_ptr, n_parts, amax_acc_ptr, fp8_max, inv_margin, CURRENT, ACC_AMAX,
                          PARTS, PARTS_AT, SCALE_INV_AT)
    if COL_SUMS:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        first = tl.program_id(1) * tiles_per_program
        last = tl.minimum(first + tiles_per_program, tl.cdiv(M, BLOCK_M))
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        amax_bits = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        for tile in range(first, last):
            x = _cast_tile(x_ptr, y_ptr, yt_ptr, M, N, tile * BLOCK_M + tl.arange(0, BLOCK_M), offs_n, scale,
                           gelu_bias_ptr, fp8_max, WRITE_Y, WRITE_T, GELU, GELU_BIAS, EXACT_ROUND, EMIN, MBITS,
                           BLOCK_M, BLOCK_N)
            acc += x
            if ACC_AMAX and not CURRENT:
                amax_bits = tl.maximum(amax_bits, _abs_bits(x))
        # part has (rows of programs) x N elements, at most M * N; int64 as in _col_sums_kernel
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * N + offs_n, tl.sum(acc, axis=0), mask=offs_n < N)
        if ACC_AMAX and not CURRENT:
            tl.atomic_max(amax_acc_ptr, tl.max(tl.max(amax_bits, axis=1), axis=0))
    else:
        x = _cast_tile(x_ptr, y_ptr, yt_ptr, M, N, tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M),
                       tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), scale, gelu_bias_ptr, fp8_max,
                       WRITE_Y, WRITE_T, GELU, GELU_BIAS, EXACT_ROUND, EMIN, MBITS, BLOCK_M, BLOCK_N)
        if ACC_AMAX and not CURRENT:
            tl.atomic_max(amax_acc_ptr, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))


@triton.jit
def _block_scales(amax, fp8_max):
    """scale = fp8_max / amax per block; 1 where amax is 0, inf or NaN or the scale overflows (a zero
    block stays zero, inf saturates as in the per-tensor casts, NaN stays NaN)."""
    ok = (amax > 0.0) & (amax <= 3.4028234663852886e38)
    fresh = tl.math.div_rn(fp8_max, tl.where(ok, amax, fp8_max))
    return tl.where(ok & (fresh <= 3.4028234663852886e38), fresh, 1.0)


@triton.jit
def _fp8_block_cast_kernel(x_ptr, y_ptr, yt_ptr, ys_ptr, yts_ptr, M, N, amax_acc_ptr, fp8_max,
                           WRITE_Y: tl.constexpr, WRITE_T: tl.constexpr, ACC_AMAX: tl.constexpr,
                           EXACT_ROUND: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                           BLOCK_S: tl.constexpr):
    """1x128 block cast of one 128x128 tile: y's rows are scaled per 128 columns, ys[pid_n, row] = 1/scale;
    y_t's rows (x's columns) per 128 rows of x, yts[pid_m, col] = 1/scale."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_n = pid_n * BLOCK_S + tl.arange(0, BLOCK_S)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = _abs_bits(x)
    if WRITE_Y:
        s = _block_scales(tl.max(bits, axis=1).to(tl.float32, bitcast=True), fp8_max)
        y = _saturate_to_fp8(x * s[:, None], y_ptr, fp8_max, EXACT_ROUND, EMIN, MBITS, BLOCK_S, BLOCK_S)
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], y, mask=mask)
        tl.store(ys_ptr + pid_n * M + offs_m, tl.math.div_rn(1.0, s), mask=offs_m < M)
    if WRITE_T:
        s = _block_scales(tl.max(bits, axis=0).to(tl.float32, bitcast=True), fp8_max)
        yt = _saturate_to_fp8(x * s[None, :], yt_ptr, fp8_max, EXACT_ROUND, EMIN, MBITS, BLOCK_S, BLOCK_S)
        tl.store(yt_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(yt), mask=tl.trans(mask))
        tl.store(yts_ptr + pid_m * N + offs_n, tl.math.div_rn(1.0, s), mask=offs_n < N)
    if ACC_AMAX:
        tl.atomic_max(amax_acc_ptr, tl.max(tl.max(bits, axis=1), axis=0))


# ----------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps) candidates of the per-tensor cast; bench/fp8.py --sweep times each.
_CAST_CONFIGS = [(64, 64, 4), (64, 64, 8), (64, 128, 8), (128, 64, 8), (32, 128, 4), (32, 256, 8),
                 (128, 128, 8), (128, 128, 16)]
_BLOCK_WARPS_CONFIGS = [8, 16]
# The per-tensor tile by pass: "t" writes a transposed copy (with or without y), "y" only the row-major one,
# "sums" either or both with the column sums (the dy cast; each program walks several row tiles of it).
# A memory-bound cast wants bytes in flight: sm_90 builds (16-byte aligned pointers, as Fp8Linear's are)
# of 64 x 128 with 8 warps take 40-62 registers a thread, so six programs share an SM (96 KB of reads in
# flight), where 128 x 128 takes 127 (two programs, 64 KB). A transposed FP8 copy wants BLOCK_M >= 32 (its
# rows are BLOCK_M bytes: at least one 32-byte sector). The column sums' loop holds an fp32 accumulator and
# the running |x| bits (register tiles both, so the reductions come once a program) besides the tile itself,
# and the transposed store's shared-memory addresses are hoisted out of it: with delayed scaling the sm_90
# builds of 64 x 64 x 4 take 128 registers a thread (Triton 3.6) or 168 (3.9), four or three programs an SM,
# and 64 x 128 x 8 128 or 173, two or one; one H200 timing (outside bench/) put 64 x 64 x 4 ahead at widths
# 768 to 14336. The H200 sweep has the last word.
_TILES = {"t": (64, 128, 8), "y": (64, 128, 8), "sums": (64, 64, 4)}
# The block-scaling cast's warps (its tile is fixed at 128 x 128): 16 warps take 99 registers a thread, 8
# take 182, 4 spill.
_BLOCK_WARPS = 16
_INTERPRETER_TILE = (32, 32, 4)


def _on_gpu(x) -> bool:
    return x.is_cuda and not _INTERPRET


_cast_launcher = FastLauncher(_fp8_cast_kernel)
_block_launcher = FastLauncher(_fp8_block_cast_kernel)
_amax_launcher = FastLauncher(_amax_partials_kernel)
_col_sums_launcher = FastLauncher(_col_sums_kernel)
# Launch plans: the kernel's launcher bound to one set of constexprs and options, made once per key (binding
# and hashing the keywords on every call would cost as much host time as the launch itself).
_PLANS: dict = {}


def _cast_plan(current, write_y, write_t, acc_amax, fp8_dtype, tile, gelu=False, gelu_bias=False,
               col_sums=False):
    key = ("cast", current, write_y, write_t, acc_amax, fp8_dtype, tile, gelu, gelu_bias, col_sums)
    plan = _PLANS.get(key)
    if plan is None:
        emin, mbits = _FP8_GRID[fp8_dtype]
        bm, bn, warps = tile
        plan = _PLANS[key] = _cast_launcher.bind(
            CURRENT=current, WRITE_Y=write_y, WRITE_T=write_t, ACC_AMAX=acc_amax, GELU=gelu, GELU_BIAS=gelu_bias,
            COL_SUMS=col_sums, EXACT_ROUND=_INTERPRET, EMIN=emin, MBITS=mbits, PARTS=_PARTS, PARTS_AT=_PARTS_AT,
            SCALE_INV_AT=SCALE_INV_OFFSET, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return plan


def _block_plan(write_y, write_t, acc_amax, fp8_dtype, warps):
    key = ("block", write_y, write_t, acc_amax, fp8_dtype, warps)
    plan = _PLANS.get(key)
    if plan is None:
        emin, mbits = _FP8_GRID[fp8_dtype]
        plan = _PLANS[key] = _block_launcher.bind(
            WRITE_Y=write_y, WRITE_T=write_t, ACC_AMAX=acc_amax, EXACT_ROUND=_INTERPRET,
            EMIN=emin, MBITS=mbits, BLOCK_S=BLOCK, num_warps=warps)
    return plan


_amax_gpu = _amax_launcher.bind(PARTS_AT=_PARTS_AT, BLOCK_E=4096, num_warps=8)
_amax_interpreted = _amax_launcher.bind(PARTS_AT=_PARTS_AT, BLOCK_E=1024, num_warps=4)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------
# Kernel variants that failed to compile on this machine (another Triton, another GPU): key -> (name,
# reason). The casts then take a path that computes the same function (the PyTorch reference), warn once,
# and the gpu tests and bench/fp8.py report them. Only compilation failures are caught, never errors of a
# kernel that ran.
_FALLBACKS: dict = {}
_COMPILE_ERRORS = tuple(e for e in (getattr(triton.compiler.errors, "CompilationError", None),
                                    getattr(triton.runtime.errors, "OutOfResources", None),
                                    getattr(triton.runtime.errors, "PTXASError", None)) if isinstance(e, type))


def fallbacks() -> dict:
    """{kernel variant: why it did not compile} for every FP8 cast kernel replaced by a slower path here."""
    return {name: why for name, why in _FALLBACKS.values()}


def _compiled(key, name, launch) -> bool:
    """launch(); False, with a warning once, when the kernel does not compile here. name() names the
    variant (called only then)."""
    if key in _FALLBACKS:
        return False
    try:
        launch()
        return True
    except Exception as e:  # noqa: BLE001 - filtered just below
        # MLIR pass failures surface as a RuntimeError naming the PassManager
        if not (isinstance(e, _COMPILE_ERRORS) or (isinstance(e, RuntimeError) and "PassManager" in str(e))):
            raise
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"
        name = name()
        _FALLBACKS[key] = (name, why)
        warnings.warn(f"tilewise.ops.fp8_cast: {name} did not compile ({why}); using a slower path",
                      RuntimeWarning, stacklevel=3)
        return False


def _launch_amax(x, scratch) -> int:
    """The current-scaling amax pass: partial maxima into scratch; returns how many (0: did not compile)."""
    numel = x.numel()
    if _on_gpu(x):
        parts = min(cdiv(numel, 4096), _PARTS)
        ok = _compiled("amax", lambda: "_amax_partials_kernel", lambda: _amax_gpu((parts,), x, numel, scratch))
        return parts if ok else 0
    parts = min(cdiv(numel, 1024), 4)
    _amax_interpreted((parts,), x, numel, scratch)
    return parts


_COL_SUMS_TILE = (32, 128, 4)   # rows, columns, warps: 32 fp32 accumulators a thread
_COL_SUMS_PROGRAMS = 1024       # about: enough resident programs (and loads in flight) to fill an H200
_col_sums_gpu = _col_sums_launcher.bind(BLOCK_M=_COL_SUMS_TILE[0], BLOCK_N=_COL_SUMS_TILE[1], NUM_STAGES=3,
                                        num_warps=_COL_SUMS_TILE[2], num_stages=3)
_col_sums_interpreted = _col_sums_launcher.bind(BLOCK_M=16, BLOCK_N=32, NUM_STAGES=3, num_warps=4, num_stages=3)


def _row_split(M, N, bm, bn) -> tuple:
    """(row tiles a program, programs a column block) for about _COL_SUMS_PROGRAMS programs of bm x bn tiles;
    every program gets at least one tile, so every partial row is written."""
    tiles = cdiv(M, bm)
    per = cdiv(tiles, max(1, min(tiles, _COL_SUMS_PROGRAMS // cdiv(N, bn))))
    return per, cdiv(tiles, per)


def column_sums(x, col_sums) -> None:
    """col_sums = x.sum(0) in fp32 (the block cast's): partial rows from _col_sums_kernel, summed by norm's
    second stage."""
    M, N = x.shape
    on_gpu = _on_gpu(x)
    bm, bn = _COL_SUMS_TILE[:2] if on_gpu else (16, 32)
    n_col = cdiv(N, bn)
    per, parts = _row_split(M, N, bm, bn)
    part = partial_rows(x.device, parts * N)
    launch = _col_sums_gpu if on_gpu else _col_sums_interpreted
    if _compiled(("col_sums",), lambda: "_col_sums_kernel", lambda: launch((n_col, parts), x, part, M, N, per)):
        sum_partials(part, parts, col_sums)
    else:
        torch.sum(x, dim=0, dtype=torch.float32, out=col_sums)


def _with_col_sums(x, col_sums, key, name, launch) -> bool:
    """launch() (False when it does not compile here), then the column sums, if asked for."""
    if not _compiled(key, name, launch):
        return False
    if col_sums is not None:   # x has rows: the callers cast only non-empty tensors
        column_sums(x, col_sums)
    return True


def cast_tiles(x, y, yt, col_sums=None) -> tuple:
    """The per-tensor cast's ((BLOCK_M, BLOCK_N, num_warps),) for this pass on this device."""
    if not _on_gpu(x):
        return (_INTERPRETER_TILE,)
    return (_TILES["sums" if col_sums is not None else "t" if yt is not None else "y"],)


def _launch_cast(x, y, yt, scale, scratch, n_parts, amax_i32, col_sums, fp8_dtype, margin, current,
                 tiles=None, gelu=False, gelu_bias=None) -> bool:
    """One per-tensor cast pass; False when it does not compile here (the caller takes the reference).

    scratch, n_parts: current scaling's buffer and how many amax partials _launch_amax wrote in it.
    tiles: ((BLOCK_M, BLOCK_N, num_warps), ...), each run in turn on the same buffers (a rerun must leave
    the same result: the tests check it); default cast_tiles(). gelu: cast gelu_tanh(x + gelu_bias) instead
    (delayed scaling: the amax pass of current scaling reads x itself). col_sums: x.sum(0) from the cast's
    own read (COL_SUMS: partial rows, then sum_partials); the sum of x, so never with gelu.
    """
    M, N = x.shape
    if M * N > _MAX_ELEMENTS:
        raise ValueError(f"fp8 cast: x is {M} x {N}; at most {_MAX_ELEMENTS} elements are supported")
    sums = col_sums is not None
    if gelu and sums:   # the bias gradient is of dy, which is never cast through a GELU
        raise ValueError("fp8 cast: col_sums would sum x, not the GELU output the cast quantizes")
    tiles = tuple(tiles) if tiles is not None else cast_tiles(x, y, yt, col_sums)
    write_y, write_t, acc = y is not None, yt is not None, amax_i32 is not None
    scratch = scratch if scratch is not None else scale
    amax_arg = amax_i32 if acc else scale.view(torch.int32)   # a stand-in when ACC_AMAX is off (never written)
    # a copy not asked for gets the other's pointer (never written: its WRITE_* is off)
    has_bias = gelu_bias is not None
    gb = gelu_bias if has_bias else scale                     # a stand-in when there is none (never read)
    tail = (FP8_MAX[fp8_dtype], 2.0 ** -margin)
    split = write_y and write_t and x.dtype not in _FUSED_COPIES_DTYPES
    # the first launch writes y (or the one copy asked for) and folds the amax; split: then yt alone
    first_y, first_t = write_y, write_t and not split
    first_args = (x, y if write_y else yt, yt if first_t else y, M, N, scale, scratch, n_parts, amax_arg, gb)

    def launch():
        for tile in tiles:
            grid = (cdiv(M, tile[0]), cdiv(N, tile[1]))
            if sums:   # one partial row per program of the (column blocks, parts) grid, then their sum
                per, parts = _row_split(M, N, tile[0], tile[1])
                part = partial_rows(x.device, parts * N)
                _cast_plan(current, first_y, first_t, acc, fp8_dtype, tile, gelu, has_bias, True)(
                    (grid[1], parts), *first_args, part, per, *tail)
                sum_partials(part, parts, col_sums)
            else:
                _cast_plan(current, first_y, first_t, acc, fp8_dtype, tile, gelu, has_bias)(
                    grid, *first_args, scale, 1, *tail)   # part_ptr, tiles_per_program: unused
            if split:
                _cast_plan(current, False, True, False, fp8_dtype, tile, gelu, has_bias)(
                    grid, x, yt, yt, M, N, scale, scratch, n_parts, amax_arg, gb, scale, 1, *tail)

    key = ("cast", current, write_y, write_t, acc, x.dtype, fp8_dtype, tiles, gelu, has_bias, sums)
    name = lambda: (f"_fp8_cast_kernel(CURRENT={current}, WRITE_Y={write_y}, WRITE_T={write_t}, ACC_AMAX={acc}, "
                    f"GELU={gelu}, COL_SUMS={sums}, tiles={tiles})")
    return _compiled(key, name, launch)


def _launch_block_cast(x, y, yt, ys, yts, amax_i32, col_sums, fp8_dtype, warps=None) -> bool:
    """One 1x128 block-scaling cast pass; False when it does not compile here."""
    M, N = x.shape
    if M * N > _MAX_ELEMENTS:
        raise ValueError(f"fp8 block cast: x is {M} x {N}; at most {_MAX_ELEMENTS} elements are supported")
    warps = warps if warps is not None else (_BLOCK_WARPS if _on_gpu(x) else 4)
    write_y, write_t, acc = y is not None, yt is not None, amax_i32 is not None
    some, some_s = (y, ys) if write_y else (yt, yts)  # stand-ins for what is not asked for (never written)
    args = (x, y if write_y else some, yt if write_t else some, ys if write_y else some_s,
            yts if write_t else some_s, M, N, amax_i32 if acc else some_s.view(torch.int32))
    grid = (cdiv(M, BLOCK), cdiv(N, BLOCK))
    split = write_y and write_t and x.dtype not in _FUSED_COPIES_DTYPES  # see the module docstring

    def launch():
        if split:  # the row-major copy with the amax, then the transposed copy alone
            _block_plan(True, False, acc, fp8_dtype, warps)(grid, x, y, y, ys, ys, M, N, args[-1], FP8_MAX[fp8_dtype])
            _block_plan(False, True, False, fp8_dtype, warps)(
                grid, x, yt, yt, yts, yts, M, N, args[-1], FP8_MAX[fp8_dtype])
        else:
            _block_plan(write_y, write_t, acc, fp8_dtype, warps)(grid, *args, FP8_MAX[fp8_dtype])

    key = ("block", write_y, write_t, acc, x.dtype, fp8_dtype, warps)
    name = lambda: f"_fp8_block_cast_kernel(WRITE_Y={write_y}, WRITE_T={write_t}, warps={warps})"
    return _with_col_sums(x, col_sums, key, name, launch)


# ----------------------------------------------------------------------------------------------------
# Public functions (validated once, for both paths)
# ----------------------------------------------------------------------------------------------------
def _check_scalar(name, t, device, what="fp8_cast"):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        got = f"{t.dtype} tensor of {t.numel()} elements" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{what}: {name} is a {got}; expected a float32 tensor of one element")
    if t.device != device:
        raise ValueError(f"{what}: {name} is on {t.device}; expected x's device {device}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: {name} must be contiguous")


def _check_x(x, fp8_dtype, rowwise, transpose, col_sums, what):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x is a {type(x).__name__}; expected a torch.Tensor")
    if fp8_dtype not in FP8_MAX:
        raise TypeError(f"{what}: fp8_dtype={fp8_dtype}; expected torch.float8_e4m3fn or torch.float8_e5m2")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{what}: x dtype {x.dtype}; expected bf16, fp16 or fp32")
    if x.dim() != 2:
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}; expected a 2-D (rows, cols) tensor")
    if x.numel() > _MAX_ELEMENTS:
        raise ValueError(f"{what}: x has {x.numel()} elements; at most {_MAX_ELEMENTS} are supported")
    if not (rowwise or transpose):
        raise ValueError(f"{what}: rowwise=False and transpose=False asks for no output")
    N = x.shape[1]
    if col_sums is not None and (col_sums.shape != (N,) or col_sums.dtype != torch.float32
                                 or col_sums.device != x.device or not col_sums.is_contiguous()):
        raise ValueError(f"{what}: col_sums is {col_sums.dtype} {tuple(col_sums.shape)} on {col_sums.device}; "
                         f"expected a contiguous float32 ({N},) on {x.device}")


def _check_cast_args(x, fp8_dtype, scale, amax, rowwise, transpose, out, out_t, col_sums, what):
    _check_x(x, fp8_dtype, rowwise, transpose, col_sums, what)
    _check_scalar("scale", scale, x.device, what)
    if amax is not None:
        _check_scalar("amax", amax, x.device, what)
    M, N = x.shape
    for name, o, shape, want in (("out", out, (M, N), rowwise), ("out_t", out_t, (N, M), transpose)):
        if o is None:
            continue
        if not want:
            raise ValueError(f"{what}: {name} given but its copy was not asked for")
        if o.shape != shape or o.dtype != fp8_dtype or not o.is_contiguous() or o.device != x.device:
            raise ValueError(f"{what}: {name} is {o.dtype} {tuple(o.shape)} on {o.device}; "
                             f"expected a contiguous {fp8_dtype} {shape} on {x.device}")


def _as_int32(amax):
    return amax.view(torch.int32) if amax is not None else None


def fp8_cast(x, fp8_dtype, scale, *, amax=None, rowwise=True, transpose=False, out=None, out_t=None,
             col_sums=None):
    """Delayed scaling: returns (y, y_t), y = saturate(x * scale) in fp8_dtype (None unless rowwise),
    y_t its (cols, rows) transpose (None unless transpose).

    scale: float32 one-element tensor on x's device (the quantization scale; dequantize with 1/scale).
    amax: optional float32 one-element tensor holding a non-negative value; max|x| is folded into it
    (NaN and inf propagate). out/out_t: optional preallocated contiguous outputs. col_sums: optional
    float32 (cols,) tensor that receives x.sum(0) in fp32 (a bias gradient, from the same read of x).
    """
    _check_cast_args(x, fp8_dtype, scale, amax, rowwise, transpose, out, out_t, col_sums, "fp8_cast")
    return cast_delayed(x, fp8_dtype, scale, _as_int32(amax), rowwise, transpose, out, out_t, col_sums)


def fp8_cast_current(x, fp8_dtype, fallback_scale, *, margin=0, amax=None, rowwise=True, transpose=False,
                     out=None, out_t=None, col_sums=None):
    """Current scaling: scale = fp8_max / max|x| / 2^margin from this tensor; where that amax is 0, inf or
    NaN (or the scale overflows), fallback_scale is used instead. Returns (y, y_t, scales), scales a float32
    (2,) tensor [scale, 1/scale] on the device, each element 16-byte aligned. amax, out, out_t, col_sums:
    as in fp8_cast.
    """
    _check_cast_args(x, fp8_dtype, fallback_scale, amax, rowwise, transpose, out, out_t, col_sums,
                     "fp8_cast_current")
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"fp8_cast_current: margin={margin!r}; expected a non-negative int")
    y, yt, scratch = cast_current(x, fp8_dtype, fallback_scale, margin, _as_int32(amax), rowwise, transpose, out,
                                  out_t, col_sums)
    return y, yt, current_scales(scratch)


def fp8_block_cast(x, fp8_dtype, *, amax=None, rowwise=True, transpose=False, col_sums=None):
    """1x128 block scaling: returns (y, y_scales, y_t, y_t_scales).

    y (rows, cols) in fp8_dtype, each 128-column segment of a row scaled by fp8_max / its amax (a zero,
    inf or NaN segment by 1); y_scales the (ceil(cols/128), rows) float32 inverse scales, so y.float() *
    y_scales.t() repeated 128 times along the columns recovers x. y_t (cols, rows) and y_t_scales
    (ceil(rows/128), cols) likewise for x.t(), whose segments are 128 rows of x. Entries not asked for are
    None. amax, col_sums: as in fp8_cast.
    """
    _check_x(x, fp8_dtype, rowwise, transpose, col_sums, "fp8_block_cast")
    if amax is not None:
        _check_scalar("amax", amax, x.device, "fp8_block_cast")
    return cast_block(x, fp8_dtype, _as_int32(amax), rowwise, transpose, col_sums)


def current_scratch(device) -> torch.Tensor:
    """Current scaling's float32 scratch: [scale, pad x3, 1/scale, pad x3, amax partials]; no fill needed."""
    return torch.empty(_PARTS_AT + _PARTS, dtype=torch.float32, device=device)


def current_scales(scratch: torch.Tensor) -> torch.Tensor:
    """The (2,) [scale, 1/scale] view of a scratch buffer; each element 16-byte aligned."""
    return scratch[0:_PARTS_AT:SCALE_INV_OFFSET]


# Unchecked entry points for callers whose arguments are well-formed by construction (Fp8Linear calls these
# on every step; the checks above cost more host time than the launch). amax_i32: the int32 view of a
# float32 amax slot, or None.
#
# roles: how each copy (row-major, transposed) is handed to torch._scaled_mm(a, b), so that it comes out of
# the cast in that layout, in one allocation and no view op a call. None: a plain (rows, cols) copy; "a": a
# left operand, the row-major copy itself, its block scales an (rows, cols/128) outer-dim-major view of the
# (cols/128, rows) buffer; "b": a right operand, the copy's transposed (column-major) view, its block scales
# the (cols/128, rows) buffer. The kernels write memory, which is the same whatever the role.
def _fp8_buffer(rows, cols, dtype, device, role):
    if role == "b":
        return torch.empty_strided((cols, rows), (1, cols), dtype=dtype, device=device)
    return torch.empty((rows, cols), dtype=dtype, device=device)


def _scale_buffer(rows, cols, device, role):
    nb = cdiv(cols, BLOCK)
    if role == "a":
        return torch.empty_strided((rows, nb), (1, rows), dtype=torch.float32, device=device)
    return torch.empty((nb, rows), dtype=torch.float32, device=device)


def _rowmajor(t, role):
    """The (rows, cols) row-major buffer behind a copy made for `role` (for the reference path's writes)."""
    return t.t() if role == "b" and t is not None else t


def _scales_rowmajor(t, role):
    return t.t() if role == "a" and t is not None else t


def _alloc(x, fp8_dtype, rowwise, transpose, out=None, out_t=None, roles=(None, None)):
    M, N = x.shape
    y = (out if out is not None else _fp8_buffer(M, N, fp8_dtype, x.device, roles[0])) if rowwise else None
    yt = (out_t if out_t is not None else _fp8_buffer(N, M, fp8_dtype, x.device, roles[1])) if transpose else None
    return y, yt


def gelu_fp32(x, bias=None):
    """gelu_tanh(x + bias) in float32: what a cast with gelu=True quantizes."""
    return F.gelu(x.float() + bias.float() if bias is not None else x.float(), approximate="tanh")


def cast_delayed(x, fp8_dtype, scale, amax_i32, rowwise, transpose, out=None, out_t=None, col_sums=None,
                 roles=(None, None), gelu=False, gelu_bias=None):
    """(y, y_t) scaled by scale, laid out for roles; see fp8_cast. gelu: x is a pre-activation, and the
    copies (and the amax) are of gelu_fp32(x, gelu_bias), from one read of x."""
    y, yt = _alloc(x, fp8_dtype, rowwise, transpose, out, out_t, roles)
    if use_triton(x) and x.numel() > 0 and _launch_cast(
            x.contiguous(), y, yt, scale, None, 0, amax_i32, col_sums, fp8_dtype, 0, current=False, gelu=gelu,
            gelu_bias=gelu_bias.contiguous() if gelu_bias is not None else None):
        return y, yt
    if gelu:
        x = gelu_fp32(x, gelu_bias)
    fp8_cast_reference(x, fp8_dtype, scale, amax=amax_i32.view(torch.float32) if amax_i32 is not None else None,
                       rowwise=rowwise, transpose=transpose, out=_rowmajor(y, roles[0]),
                       out_t=_rowmajor(yt, roles[1]), col_sums=col_sums)
    return y, yt


def cast_current(x, fp8_dtype, fallback_scale, margin, amax_i32, rowwise, transpose, out=None, out_t=None,
                 col_sums=None, roles=(None, None)):
    """(y, y_t, scratch): scratch[0] the scale used, scratch[SCALE_INV_OFFSET] its inverse; see
    fp8_cast_current."""
    y, yt = _alloc(x, fp8_dtype, rowwise, transpose, out, out_t, roles)
    scratch = current_scratch(x.device)
    if use_triton(x) and x.numel() > 0:
        xc = x.contiguous()
        n_parts = _launch_amax(xc, scratch)
        if n_parts and _launch_cast(xc, y, yt, fallback_scale, scratch, n_parts, amax_i32, col_sums, fp8_dtype,
                                    margin, current=True):
            return y, yt, scratch
    fp8_cast_current_reference(x, fp8_dtype, fallback_scale, margin=margin,
                               amax=amax_i32.view(torch.float32) if amax_i32 is not None else None,
                               rowwise=rowwise, transpose=transpose, out=_rowmajor(y, roles[0]),
                               out_t=_rowmajor(yt, roles[1]), col_sums=col_sums, scratch=scratch)
    return y, yt, scratch


def cast_block(x, fp8_dtype, amax_i32, rowwise, transpose, col_sums=None, roles=(None, None)):
    """(y, y_scales, y_t, y_t_scales), laid out for roles; see fp8_block_cast."""
    M, N = x.shape
    dev = x.device
    y, yt = _alloc(x, fp8_dtype, rowwise, transpose, roles=roles)
    ys = _scale_buffer(M, N, dev, roles[0]) if rowwise else None
    yts = _scale_buffer(N, M, dev, roles[1]) if transpose else None
    if not (use_triton(x) and x.numel() > 0 and _launch_block_cast(x.contiguous(), y, yt, ys, yts, amax_i32,
                                                                   col_sums, fp8_dtype)):
        fp8_block_cast_reference(
            x, fp8_dtype, amax=amax_i32.view(torch.float32) if amax_i32 is not None else None, rowwise=rowwise,
            transpose=transpose, col_sums=col_sums, outs=(_rowmajor(y, roles[0]), _scales_rowmajor(ys, roles[0]),
                                                          _rowmajor(yt, roles[1]), _scales_rowmajor(yts, roles[1])))
    return y, ys, yt, yts


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------
def current_scale_reference(amax, fp8_max, margin, fallback):
    """scale = fp8_max / amax / 2^margin, or fallback where amax is 0, inf, NaN or the scale overflows."""
    # A tensor numerator: python_float / tensor would multiply by a rounded reciprocal instead.
    fresh = torch.full_like(amax, fp8_max) / amax * (2.0 ** -margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(fresh)
    return torch.where(ok, fresh, fallback)


def _fold_amax(amax, xf):
    if amax is not None and xf.numel() > 0:
        amax.copy_(torch.maximum(amax, xf.abs().amax().reshape(amax.shape)))


def fp8_cast_reference(x, fp8_dtype, scale, *, amax=None, rowwise=True, transpose=False, out=None, out_t=None,
                       col_sums=None):
    """Plain PyTorch: the same casts, the amax folded with torch.maximum (NaN propagates)."""
    fmax = FP8_MAX[fp8_dtype]
    xf = x.float()
    q = (xf * scale.reshape(())).clamp(-fmax, fmax).to(fp8_dtype)
    y = yt = None
    if rowwise:
        y = q if out is None else out.copy_(q)
    if transpose:
        yt = q.t().contiguous() if out_t is None else out_t.copy_(q.t())
    _fold_amax(amax, xf)
    if col_sums is not None:
        torch.sum(xf, dim=0, out=col_sums)
    return y, yt


def fp8_cast_current_reference(x, fp8_dtype, fallback_scale, *, margin=0, amax=None, rowwise=True,
                               transpose=False, out=None, out_t=None, col_sums=None, scratch=None):
    """Returns (y, y_t, scales [scale, 1/scale]); with scratch, the scales are written into it as the kernel
    writes them (scratch[0], scratch[SCALE_INV_OFFSET])."""
    xf = x.float()
    cur = xf.abs().amax() if x.numel() > 0 else torch.zeros((), device=x.device)
    scale = current_scale_reference(cur, FP8_MAX[fp8_dtype], margin, fallback_scale.reshape(()))
    y, yt = fp8_cast_reference(x, fp8_dtype, scale.reshape(1), amax=amax, rowwise=rowwise, transpose=transpose,
                               out=out, out_t=out_t, col_sums=col_sums)
    scales = current_scales(scratch if scratch is not None else current_scratch(x.device))
    scales.copy_(torch.stack([scale, scale.reciprocal()]))
    return y, yt, scales


def block_scales_reference(t, fp8_max):
    """(scales (rows, ceil(cols/128)), segment amax) of a float32 (rows, cols) t: fp8_max / amax of each
    128-column segment, 1 where that amax is 0, inf or NaN or the scale overflows."""
    R, C = t.shape
    nb = -(-C // BLOCK)
    padded = torch.nn.functional.pad(t.abs(), (0, nb * BLOCK - C)) if C % BLOCK else t.abs()
    amax = padded.reshape(R, nb, BLOCK).amax(dim=-1)  # NaN propagates
    fresh = torch.full_like(amax, fp8_max) / amax
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(fresh)
    return torch.where(ok, fresh, torch.ones_like(fresh))


def _block_quantize_reference(t, fp8_dtype):
    """(q, inverse scales (ceil(cols/128), rows)) of a float32 (rows, cols) t in 1x128 segments."""
    fmax = FP8_MAX[fp8_dtype]
    s = block_scales_reference(t, fmax)
    q = (t * s.repeat_interleave(BLOCK, dim=1)[:, :t.shape[1]]).clamp(-fmax, fmax).to(fp8_dtype)
    return q, s.reciprocal().t().contiguous()


def fp8_block_cast_reference(x, fp8_dtype, *, amax=None, rowwise=True, transpose=False, col_sums=None,
                             outs=None):
    """Plain PyTorch fp8_block_cast; outs: optional (y, y_scales, y_t, y_t_scales) to write into."""
    xf = x.float()
    res = [None, None, None, None]
    if rowwise:
        res[0:2] = _block_quantize_reference(xf, fp8_dtype)
    if transpose:
        res[2:4] = _block_quantize_reference(xf.t(), fp8_dtype)
    if outs is not None:
        res = [o.copy_(r) if o is not None and r is not None else r for o, r in zip(outs, res)]
    _fold_amax(amax, xf)
    if col_sums is not None:
        torch.sum(xf, dim=0, out=col_sums)
    return tuple(res)


def block_dequantize_reference(q, inv_scales):
    """float32 values of a 1x128 block-scaled copy: q (rows, cols) times inv_scales (ceil(cols/128), rows)."""
    R, C = q.shape
    return q.float() * inv_scales.t().repeat_interleave(BLOCK, dim=1)[:, :C]
