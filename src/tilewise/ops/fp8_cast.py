"""Saturating per-tensor casts to FP8 (E4M3 / E5M2), fused with the transposed copy and the amax.

y = clamp(x * scale, -fp8_max, fp8_max) rounded to nearest even in the FP8 dtype. One pass over a 2-D
tile grid reads x once and writes y (row-major), y^T (the operand layout the weight-gradient GEMM needs)
or both, and folds max|x| into a float32 amax with an int32 atomic max on its bits: for non-negative
floats, and NaN once the sign bit is cleared, integer order is float order, so NaN and inf win and reach
the scale update, which then skips them.
Optionally the same pass sums x's columns (the bias gradient when x is dy) over blocks of 32 rows into a
(rows/32, cols) fp32 partials buffer that one torch.sum reduces: deterministic, no float atomics. The
partials' layout does not depend on the tile size, so the autotuner's reruns with other tiles (which write
into the same buffer) leave the same values in every slot; a per-tile layout left stale partials there.
Bytes, delayed scaling: read 2 (bf16) or 4 (fp32) per element, write 1 per copy. Current scaling needs
this step's amax before it can scale, so it first runs an amax pass (a second read of x); the cast
kernel then derives scale = fp8_max / amax / 2^margin on the device, falling back to the given scale
when amax is 0, inf or NaN. Nothing here synchronizes with the host.
A kernel variant that does not compile on the machine at hand falls back to a path computing the same
function (warned once, listed by fallbacks()), so a Triton upgrade degrades speed, never results.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.compiler.errors
import triton.language as tl
import triton.runtime.errors
import triton.testing

from .dispatch import use_triton

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Smallest normal exponent and mantissa bits, for rounding onto the FP8 grid (interpreter only, below).
_FP8_GRID = {torch.float8_e4m3fn: (-6, 3), torch.float8_e5m2: (-14, 2)}
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _abs_bits(x):
    # |x| as int32 bits: the sign bit cleared, so order among non-negatives (and NaN above inf) holds.
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _amax_kernel(x_ptr, numel, amax_ptr, BLOCK: tl.constexpr):
    """Grid-stride max|x| over a contiguous tensor; one atomic per program."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


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
def _fp8_cast_kernel(x_ptr, y_ptr, yt_ptr, M, N,
                     scale_ptr, amax_in_ptr, scale_out_ptr, amax_acc_ptr, colsum_ptr,
                     fp8_max, inv_margin,
                     CURRENT: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_T: tl.constexpr,
                     ACC_AMAX: tl.constexpr, COL_SUMS: tl.constexpr, EXACT_ROUND: tl.constexpr,
                     EMIN: tl.constexpr, MBITS: tl.constexpr, SUB_M: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if CURRENT:
        # Every program derives the same scale from the amax pass; program 0 publishes it.
        amax_bits = tl.load(amax_in_ptr)
        amax = amax_bits.to(tl.float32, bitcast=True)
        fallback = tl.load(scale_ptr)
        fresh = tl.math.div_rn(fp8_max, amax) * inv_margin
        # finite and positive (NaN fails every comparison); 3.4028234663852886e38 is float32's max
        ok = (amax > 0.0) & (amax <= 3.4028234663852886e38) & (fresh <= 3.4028234663852886e38)
        scale = tl.where(ok, fresh, fallback)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(scale_out_ptr, scale)
            # 1/scale four floats on (SCALE_INV_OFFSET): GEMM scales must sit at 16-byte aligned addresses
            tl.store(scale_out_ptr + 4, tl.math.div_rn(1.0, scale))
            if ACC_AMAX:
                tl.atomic_max(amax_acc_ptr, amax_bits)
    else:
        scale = tl.load(scale_ptr)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)

    v = x * scale
    v = tl.maximum(v, -fp8_max, propagate_nan=tl.PropagateNan.ALL)
    v = tl.minimum(v, fp8_max, propagate_nan=tl.PropagateNan.ALL)
    out_ty = yt_ptr.dtype.element_ty
    if EXACT_ROUND:
        v = _round_to_fp8_grid(v, EMIN, MBITS)
        nan8 = tl.full([BLOCK_M, BLOCK_N], 0x7F, tl.uint8).to(out_ty, bitcast=True)  # NaN in both formats
        y = tl.where(v == v, v.to(out_ty), nan8)
    else:
        y = v.to(out_ty)

    if WRITE_Y:
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], y, mask=mask)
    if WRITE_T:
        tl.store(yt_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(y), mask=tl.trans(mask))
    if ACC_AMAX and not CURRENT:
        tl.atomic_max(amax_acc_ptr, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))
    if COL_SUMS:  # column sums of each SUB_M-row block of the tile: partials row = global row // SUB_M
        if BLOCK_M == SUB_M:  # one block: no reshape, no size-1 dimension
            tl.store(colsum_ptr + pid_m * N + offs_n, tl.sum(x, axis=0), mask=offs_n < N)
        else:
            part = tl.sum(tl.reshape(x, [BLOCK_M // SUB_M, SUB_M, BLOCK_N]), axis=1)
            rows = pid_m * (BLOCK_M // SUB_M) + tl.arange(0, BLOCK_M // SUB_M)
            n_parts = (M + SUB_M - 1) // SUB_M
            tl.store(colsum_ptr + rows[:, None] * N + offs_n[None, :], part,
                     mask=(rows[:, None] < n_parts) & (offs_n[None, :] < N))


_CAST_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w)
    for bm, bn, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4))
]
_SUB_M = 32  # rows per column-sum partial; divides every config's BLOCK_M and the interpreter's tile
assert all(c.kwargs["BLOCK_M"] % _SUB_M == 0 for c in _CAST_CONFIGS)
# Autotuning reruns the kernel with every config on the real buffers: harmless only because every side
# effect is idempotent and tile-independent (the stores, the atomic max, the column-sum partials). Short
# timing runs (5 + 20 ms a config): a memory-bound kernel of 10-300 us is measured often enough in that.
_fp8_cast_kernel_tuned = triton.autotune(
    _CAST_CONFIGS, key=["M", "N", "CURRENT", "WRITE_Y", "WRITE_T", "ACC_AMAX", "COL_SUMS"],
    do_bench=lambda kernel_call, quantiles: triton.testing.do_bench(kernel_call, warmup=5, rep=20,
                                                                    quantiles=quantiles))(_fp8_cast_kernel)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Kernel variants that failed to compile on this machine (another Triton, another GPU): key -> reason. The
# casts then take a path that computes the same function (the fused column sums become a torch.sum; a
# whole kernel becomes the PyTorch reference), warn once, and the gpu tests and bench/fp8.py report them.
# Only compilation failures are caught, never errors of a kernel that ran.
_FALLBACKS: dict = {}
_COMPILE_ERRORS = tuple(e for e in (getattr(triton.compiler.errors, "CompilationError", None),
                                    getattr(triton.runtime.errors, "OutOfResources", None),
                                    getattr(triton.runtime.errors, "PTXASError", None),
                                    getattr(triton.runtime.errors, "AutotunerError", None)) if isinstance(e, type))


def fallbacks() -> dict:
    """{kernel variant: why it did not compile} for every FP8 cast kernel replaced by a slower path here."""
    return {name: why for name, why in _FALLBACKS.values()}


def _compiled(key, launch) -> bool:
    """launch() on the GPU; False, with a warning once, when the kernel does not compile here."""
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
        name = "_amax_kernel" if key == "amax" else "_fp8_cast_kernel(" + ", ".join(
            f"{k}={v}" for k, v in zip(("CURRENT", "WRITE_Y", "WRITE_T", "ACC_AMAX", "COL_SUMS"), key)) + ")"
        _FALLBACKS[key] = (name, why)
        warnings.warn(f"tilewise.ops.fp8_cast: {name} did not compile ({why}); using a slower path",
                      RuntimeWarning, stacklevel=3)
        return False


def _on_gpu(x) -> bool:
    return x.is_cuda and not _interpreting()


def _launch_amax(x, amax_i32) -> bool:
    numel = x.numel()
    if _on_gpu(x):
        block, warps = 4096, 8
        progs = min(triton.cdiv(numel, block), 4 * _num_sms(x.device.index or 0))
        return _compiled("amax", lambda: _amax_kernel[(progs,)](x, numel, amax_i32, BLOCK=block, num_warps=warps))
    progs = min(triton.cdiv(numel, 1024), 4)
    _amax_kernel[(progs,)](x, numel, amax_i32, BLOCK=1024, num_warps=4)
    return True


def _new_partials(M, N, device):
    # Every SUB_M-row block's partial is written whatever the tile, so no fill (the tests fill NaN here).
    return torch.empty(triton.cdiv(M, _SUB_M), N, dtype=torch.float32, device=device)


def _launch_cast(x, y, yt, scale, amax_in, scale_out, amax_acc, col_sums, fp8_dtype, margin, current,
                 tiles=None) -> bool:
    """One pass of _fp8_cast_kernel; False when it does not compile here (the caller takes the reference).

    tiles: [(BLOCK_M, BLOCK_N, num_warps), ...] replaces the autotuner: each runs in turn on the same
    buffers, as the autotuner's timing runs do (the tests check that this leaves the right result).
    """
    M, N = x.shape
    if M * N >= 2 ** 31:  # the kernels index in int32
        raise ValueError(f"fp8 cast: x is {M} x {N}; at most 2^31 - 1 elements are supported")
    emin, mbits = _FP8_GRID[fp8_dtype]
    dummy = yt if yt is not None else y
    flags = dict(CURRENT=current, WRITE_Y=y is not None, WRITE_T=yt is not None, ACC_AMAX=amax_acc is not None,
                 EXACT_ROUND=_interpreting(), EMIN=emin, MBITS=mbits, SUB_M=_SUB_M)
    if tiles is None and not _on_gpu(x):
        tiles = [(32, 32, 4)]
    direct = tiles is not None  # fixed tiles: no autotuner and no compile guard

    def launch(partials):
        args = (x, y if y is not None else dummy, yt if yt is not None else dummy, M, N,
                scale, amax_in if amax_in is not None else scale,
                scale_out if scale_out is not None else scale,
                amax_acc if amax_acc is not None else scale.view(torch.int32),
                partials if partials is not None else scale,
                FP8_MAX[fp8_dtype], 2.0 ** -margin)
        if direct:
            for bm, bn, warps in tiles:
                _fp8_cast_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
                    *args, **flags, COL_SUMS=partials is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
        else:
            grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))
            _fp8_cast_kernel_tuned[grid](*args, **flags, COL_SUMS=partials is not None)
        return True

    key = (current, y is not None, yt is not None, amax_acc is not None)
    if col_sums is None:
        return launch(None) if direct else _compiled(key + (False,), lambda: launch(None))
    partials = _new_partials(M, N, x.device)
    if launch(partials) if direct else _compiled(key + (True,), lambda: launch(partials)):
        torch.sum(partials, dim=0, out=col_sums)
        return True
    # the fused column sums did not compile here: the cast alone, then a second read of x for the sums
    if not _compiled(key + (False,), lambda: launch(None)):
        return False
    torch.sum(x, dim=0, dtype=torch.float32, out=col_sums)
    return True


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


def _check_cast_args(x, fp8_dtype, scale, amax, rowwise, transpose, out, out_t, col_sums, what):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x is a {type(x).__name__}; expected a torch.Tensor")
    if fp8_dtype not in FP8_MAX:
        raise TypeError(f"{what}: fp8_dtype={fp8_dtype}; expected torch.float8_e4m3fn or torch.float8_e5m2")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{what}: x dtype {x.dtype}; expected bf16, fp16 or fp32")
    if x.dim() != 2:
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}; expected a 2-D (rows, cols) tensor")
    if x.numel() >= 2 ** 31:
        raise ValueError(f"{what}: x has {x.numel()} elements; at most 2^31 - 1 are supported")
    if not (rowwise or transpose):
        raise ValueError(f"{what}: rowwise=False and transpose=False asks for no output")
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
    if col_sums is not None and (col_sums.shape != (N,) or col_sums.dtype != torch.float32
                                 or col_sums.device != x.device or not col_sums.is_contiguous()):
        raise ValueError(f"{what}: col_sums is {col_sums.dtype} {tuple(col_sums.shape)} on {col_sums.device}; "
                         f"expected a contiguous float32 ({N},) on {x.device}")


def _alloc(x, fp8_dtype, rowwise, transpose, out, out_t):
    M, N = x.shape
    y = (out if out is not None else torch.empty((M, N), dtype=fp8_dtype, device=x.device)) if rowwise else None
    yt = (out_t if out_t is not None else torch.empty((N, M), dtype=fp8_dtype, device=x.device)) if transpose else None
    return y, yt


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
    return cast_delayed(x, fp8_dtype, scale, amax, rowwise, transpose, out, out_t, col_sums)


def fp8_cast_current(x, fp8_dtype, fallback_scale, *, margin=0, amax=None, rowwise=True, transpose=False,
                     out=None, out_t=None, col_sums=None):
    """Current scaling: scale = fp8_max / max|x| / 2^margin from this tensor; where that amax is 0, inf or
    NaN (or the scale overflows), fallback_scale is used instead. Returns (y, y_t, scales), scales a float32
    (2,) tensor [scale, 1/scale] on the device. amax, out, out_t, col_sums: as in fp8_cast.
    """
    _check_cast_args(x, fp8_dtype, fallback_scale, amax, rowwise, transpose, out, out_t, col_sums,
                     "fp8_cast_current")
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"fp8_cast_current: margin={margin!r}; expected a non-negative int")
    return cast_current(x, fp8_dtype, fallback_scale, margin, amax, rowwise, transpose, out, out_t, col_sums)


# Current scaling's scratch: [amax bits, pad x3, scale, pad x3, 1/scale, pad x3]. Each value starts a
# 16-byte block because torch._scaled_mm (cuBLASLt) rejects scale pointers that are not 16-byte aligned.
SCALE_INV_OFFSET = 4


def current_scratch(device) -> torch.Tensor:
    return torch.zeros(3 * SCALE_INV_OFFSET, dtype=torch.float32, device=device)


def current_scales(scratch: torch.Tensor) -> torch.Tensor:
    """The (2,) [scale, 1/scale] view of a scratch buffer; each element 16-byte aligned."""
    return scratch[SCALE_INV_OFFSET::SCALE_INV_OFFSET]


# Unchecked entry points for callers whose arguments are well-formed by construction (Fp8Linear calls these
# on every step; the checks above cost more host time than the launch).
def cast_delayed(x, fp8_dtype, scale, amax, rowwise, transpose, out=None, out_t=None, col_sums=None):
    y, yt = _alloc(x, fp8_dtype, rowwise, transpose, out, out_t)
    if use_triton(x) and x.numel() > 0 and _launch_cast(
            x.contiguous(), y, yt, scale, None, None, amax.view(torch.int32) if amax is not None else None,
            col_sums, fp8_dtype, 0, current=False):
        return y, yt
    return fp8_cast_reference(x, fp8_dtype, scale, amax=amax, rowwise=rowwise, transpose=transpose, out=y, out_t=yt,
                              col_sums=col_sums)


def cast_current(x, fp8_dtype, fallback_scale, margin, amax, rowwise, transpose, out=None, out_t=None,
                 col_sums=None):
    y, yt = _alloc(x, fp8_dtype, rowwise, transpose, out, out_t)
    if use_triton(x) and x.numel() > 0:
        xc = x.contiguous()
        scratch = current_scratch(x.device)
        if _launch_amax(xc, scratch[:1].view(torch.int32)) and _launch_cast(
                xc, y, yt, fallback_scale, scratch[:1].view(torch.int32), scratch[SCALE_INV_OFFSET:],
                amax.view(torch.int32) if amax is not None else None, col_sums, fp8_dtype, margin, current=True):
            return y, yt, current_scales(scratch)
    return fp8_cast_current_reference(x, fp8_dtype, fallback_scale, margin=margin, amax=amax, rowwise=rowwise,
                                      transpose=transpose, out=y, out_t=yt, col_sums=col_sums)


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------
def current_scale_reference(amax, fp8_max, margin, fallback):
    """scale = fp8_max / amax / 2^margin, or fallback where amax is 0, inf, NaN or the scale overflows."""
    # A tensor numerator: python_float / tensor would multiply by a rounded reciprocal instead.
    fresh = torch.full_like(amax, fp8_max) / amax * (2.0 ** -margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(fresh)
    return torch.where(ok, fresh, fallback)


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
    if amax is not None and x.numel() > 0:
        amax.copy_(torch.maximum(amax, xf.abs().amax().reshape(amax.shape)))
    if col_sums is not None:
        torch.sum(xf, dim=0, out=col_sums)
    return y, yt


def fp8_cast_current_reference(x, fp8_dtype, fallback_scale, *, margin=0, amax=None, rowwise=True,
                               transpose=False, out=None, out_t=None, col_sums=None):
    xf = x.float()
    cur = xf.abs().amax() if x.numel() > 0 else torch.zeros((), device=x.device)
    scale = current_scale_reference(cur, FP8_MAX[fp8_dtype], margin, fallback_scale.reshape(()))
    y, yt = fp8_cast_reference(x, fp8_dtype, scale.reshape(1), amax=amax, rowwise=rowwise, transpose=transpose,
                               out=out, out_t=out_t, col_sums=col_sums)
    scales = current_scales(current_scratch(x.device))
    scales.copy_(torch.stack([scale, scale.reciprocal()]))
    return y, yt, scales
