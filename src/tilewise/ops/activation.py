"""Fused activations: bias + GELU (tanh approximation) and SwiGLU, forward and backward.

bias_gelu: y = gelu_tanh(x + b), written as u * sigmoid(2z) with u = x + b, z = sqrt(2/pi) (u + 0.044715 u^3)
(the same function as 0.5 u (1 + tanh z)). Forward reads x once and writes y once. Backward recomputes u
from x and b: dx = dy * (s + 2 u s (1 - s) z'(u)), s = sigmoid(2z); dbias = sum of dx over rows, in two
stages (each persistent program sums its row tiles in registers into an fp32 row of partials; norm's
sum_partials kernel sums those into the bias's dtype). Bytes: forward x, y; backward dy, x, dx.

swiglu: gate_up (..., 2F) -> silu(gate) * up, gate the first half of the last dim, up the second.
Backward: dgate = dy * up * s (1 + gate (1 - s)), s = sigmoid(gate); dup = dy * silu(gate). Bytes: forward
3F a row, backward 5F a row.

Math is in fp32 whatever the storage dtype. The logistic function divides with the GPU's approximate
reciprocal (rcp.approx, within an ulp) rather than the division that `/` and tl.sigmoid compile to, which
was a quarter of the time of the FP8 cast that fuses the GELU (see _sigmoid).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import INTERPRET, use_triton
from .launch import FastLauncher, cdiv as _cdiv
from .norm import launch_programs, partial_rows, programs_per_wave, sum_partials


# The interpreter runs no inline assembly: there _sigmoid divides.
_APPROX_RCP = tl.constexpr(not INTERPRET)


@triton.jit
def _sigmoid(z):
    """1 / (1 + exp(-z)) in fp32 with rcp.approx for the division (1 + e >= 1: no subnormal; e = inf gives 0).
    The GELU-fused FP8 cast of a 16384 x 8192 bf16 tensor took 0.278 ms with tl.sigmoid's division and 0.204
    with this on the H200 (a copy: 0.130); both differ from torch's GELU in 2e-7 of the FP8 codes."""
    e = tl.math.exp2(-1.4426950408889634 * z)
    if _APPROX_RCP:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / (1.0 + e)


@triton.jit
def gelu_tanh(u):
    """gelu_tanh(u) = u * sigmoid(2 sqrt(2/pi) (u + 0.044715 u^3)), in fp32 (also the FP8 cast's fused GELU)."""
    return u * _sigmoid(1.5957691216057308 * (u + 0.044715 * u * u * u))     # 2 sqrt(2/pi) = 1.59576...


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, M, N, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    u = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, gelu_tanh(u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(DY, X, B, DX, DBp, M, N, n_tiles, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Row tiles pid, pid + programs, ... of column block pid1, software-pipelined (the next tiles' loads
    in flight while one computes); the bias gradient summed per column in registers, one row of partials a
    program."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    db = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tile in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        u = tl.load(X + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if HAS_BIAS:
            u += b
        u2 = u * u
        s = _sigmoid(1.5957691216057308 * (u + 0.044715 * u2 * u))     # sigmoid(2z)
        dx = dy * (s + u * s * (1.0 - s) * (1.5957691216057308 * (1.0 + 3.0 * 0.044715 * u2)))
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db += dx
    if HAS_BIAS:
        tl.store(DBp + pid.to(tl.int64) * N + cols, tl.sum(db, axis=0), mask=col_ok)


@triton.jit
def _swiglu_fwd_kernel(GU, Y, M, F, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    gate_offs = r64 * (2 * F) + cols[None, :]
    g = tl.load(GU + gate_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + gate_offs + F, mask=mask, other=0.0).to(tl.float32)
    y = g * _sigmoid(g) * u
    tl.store(Y + r64 * F + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, GU, DGU, M, F, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    gate_offs = r64 * (2 * F) + cols[None, :]
    dy = tl.load(DY + r64 * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GU + gate_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + gate_offs + F, mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(g)
    dgate = dy * u * s * (1.0 + g * (1.0 - s))
    dup = dy * g * s
    tl.store(DGU + gate_offs, dgate.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + gate_offs + F, dup.to(DGU.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------- launchers

_bias_gelu_fwd_launch = FastLauncher(_bias_gelu_fwd_kernel)
_bias_gelu_bwd_launch = FastLauncher(_bias_gelu_bwd_kernel)
_swiglu_fwd_launch = FastLauncher(_swiglu_fwd_kernel)
_swiglu_bwd_launch = FastLauncher(_swiglu_bwd_kernel)


def _tile(width: int) -> tuple[int, int, int]:
    """Elementwise tiles of 4096 elements (16 a thread over 8 warps), at most 1024 columns wide."""
    block_n = min(1024, max(16, triton.next_power_of_2(width)))
    return max(1, 4096 // block_n), block_n, 8


def _rows_cols(t) -> tuple[int, int]:
    """(rows, columns) of a contiguous tensor read as rows of its last dimension."""
    n = t.shape[-1]
    return (t.numel() // n if n else 0), n


def _bias_gelu_forward(x, bias, out_dtype):
    """x: contiguous, any shape (rows of its last dim); y in x's shape."""
    M, N = _rows_cols(x)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if M:
        bm, bn, warps = _tile(N)
        _bias_gelu_fwd_launch((_cdiv(M, bm), _cdiv(N, bn)), x, x if bias is None else bias, y, M, N,
                              HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return y


def _bias_gelu_bwd_tile(width: int) -> tuple[int, int, int]:
    """Tiles of 1024 elements, 8 a thread (4 warps), at most 1024 columns wide; 4 pipeline stages."""
    block_n = min(1024, max(16, triton.next_power_of_2(width)))
    return max(1, 1024 // block_n), block_n, 4


# (device, width, bias?, dtypes) -> (rows a tile, column blocks, bound launcher, programs a wave)
_BWD_PLANS: dict = {}


def _bias_gelu_backward(dy, x, bias):
    """Returns dx and the bias gradient in the bias's dtype (None without a bias). A persistent launch (one
    wave of resident programs) over row tiles; dbias = the sums of the programs' partial rows."""
    M, N = _rows_cols(x)
    dev = x.device
    dx = torch.empty(x.shape, dtype=x.dtype, device=dev)
    if bias is None:
        db = None
    elif M == 0:
        return dx, torch.zeros_like(bias)
    else:
        db = torch.empty(N, dtype=bias.dtype, device=dev)
    if M == 0:
        return dx, db
    b = x if bias is None else bias
    key = (dev, N, bias is None, dy.dtype, x.dtype, b.dtype)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        bm, bn, warps = _bias_gelu_bwd_tile(N)
        n_col = _cdiv(N, bn)
        meta = dict(HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=4, num_warps=warps, num_stages=4)
        # the program count (from the compiled kernel) sizes the partial sums: their dtype stands in until then
        args = (dy, x, b, dx, dx if bias is None else torch.float32, M, N, _cdiv(M, bm))
        per_wave = programs_per_wave(_bias_gelu_bwd_kernel, args, meta, dev, n_col)
        plan = _BWD_PLANS[key] = (bm, n_col, _bias_gelu_bwd_launch.bind(**meta), per_wave)
    bm, n_col, launch, per_wave = plan
    n_tiles = _cdiv(M, bm)
    programs = launch_programs(per_wave, 1, n_tiles)
    part = dx if bias is None else partial_rows(dev, programs * N)
    launch((programs, n_col), dy, x, b, dx, part, M, N, n_tiles)
    if bias is not None:
        sum_partials(part, programs, db)
    return dx, db


def _swiglu_forward(gu):
    M, F2 = _rows_cols(gu)
    y = torch.empty((*gu.shape[:-1], F2 // 2), dtype=gu.dtype, device=gu.device)
    if M and F2:
        bm, bn, warps = _tile(F2 // 2)
        _swiglu_fwd_launch((_cdiv(M, bm), _cdiv(F2 // 2, bn)), gu, y, M, F2 // 2, BLOCK_M=bm, BLOCK_N=bn,
                           num_warps=warps)
    return y


def _swiglu_backward(dy, gu):
    M, F2 = _rows_cols(gu)
    dgu = torch.empty_like(gu)
    if M and F2:
        bm, bn, warps = _tile(F2 // 2)
        _swiglu_bwd_launch((_cdiv(M, bm), _cdiv(F2 // 2, bn)), dy, gu, dgu, M, F2 // 2, BLOCK_M=bm,
                           BLOCK_N=bn, num_warps=warps)
    return dgu


# Custom ops, so torch.compile keeps them as opaque nodes in its graph.

@torch.library.custom_op("tilewise::bias_gelu_fwd", mutates_args=())
def _bias_gelu_fwd_op(x: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    return _bias_gelu_forward(x, bias, out_dtype)


@_bias_gelu_fwd_op.register_fake
def _(x, bias, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("tilewise::bias_gelu_bwd", mutates_args=())
def _bias_gelu_bwd_op(dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    dx, db = _bias_gelu_backward(dy, x, bias)
    return dx, (db if db is not None else x.new_empty(0))


@_bias_gelu_bwd_op.register_fake
def _(dy, x, bias):
    return torch.empty_like(x), (torch.empty_like(bias) if bias is not None else x.new_empty(0))


@torch.library.custom_op("tilewise::swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _swiglu_forward(gate_up)


@_swiglu_fwd_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("tilewise::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return _swiglu_backward(dy, gate_up)


@_swiglu_bwd_op.register_fake
def _(dy, gate_up):
    return torch.empty_like(gate_up)


def _call(op, launcher, *args):
    """The custom op while torch.compile traces; the launcher itself otherwise, skipping the op dispatch."""
    return op(*args) if torch.compiler.is_compiling() else launcher(*args)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels read it, contiguous rows of its last dim: itself when contiguous (no view: each op is
    host time), else a contiguous 2-D copy."""
    return t if t.is_contiguous() else t.reshape(-1, t.shape[-1]).contiguous()


def _shaped(t: torch.Tensor, shape) -> torch.Tensor:
    """t viewed as `shape` when a strided input was copied to 2-D rows; itself otherwise."""
    return t if t.shape == shape else t.view(shape)


class BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        out_dtype = x.dtype     # an fp32 master bias does not widen a bf16 activation (see bias_gelu)
        x2, bias = _rows(x), None if bias is None else bias.contiguous()
        y = _call(torch.ops.tilewise.bias_gelu_fwd, _bias_gelu_forward, x2, bias, out_dtype)
        ctx.save_for_backward(x2, bias)
        ctx.shape = x.shape
        return _shaped(y, x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        dx, db = _call(torch.ops.tilewise.bias_gelu_bwd, _bias_gelu_backward, _rows(dy), x2, bias)
        return _shaped(dx, ctx.shape), (db if bias is not None else None)


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gu = _rows(gate_up)
        ctx.save_for_backward(gu)
        ctx.shape = gate_up.shape
        y = _call(torch.ops.tilewise.swiglu_fwd, _swiglu_forward, gu)
        return _shaped(y, (*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @staticmethod
    def backward(ctx, dy):
        (gu,) = ctx.saved_tensors
        return _shaped(_call(torch.ops.tilewise.swiglu_bwd, _swiglu_backward, _rows(dy), gu), ctx.shape)


# --------------------------------------------------------------------------------------------- public ops

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_input(name, what, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} is a {type(t).__name__}; expected a torch.Tensor")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name}: {what} dtype {t.dtype}; expected bf16, fp16 or fp32")
    if t.dim() < 1:
        raise ValueError(f"{name}: {what} is a 0-dim tensor; expected at least one dimension")


def bias_gelu(x, bias=None):
    """gelu_tanh(x + bias), bias broadcast over the last dim, in x's dtype.

    The sum is formed in fp32 and rounded once. An fp32 bias (a master parameter beside a bf16 activation
    under autocast) does not promote the output, as nn.Linear's bias does not under autocast: a widened
    output would cost a write of twice the bytes here and a cast back to bf16 in the next matmul, both ways.
    """
    _check_input("bias_gelu", "x", x)
    if bias is not None:
        _check_input("bias_gelu", "bias", bias)
        if bias.shape != (x.shape[-1],):
            raise ValueError(f"bias_gelu: bias shape {tuple(bias.shape)}; expected ({x.shape[-1]},)")
        if bias.device != x.device:
            raise ValueError(f"bias_gelu: bias is on {bias.device} but x is on {x.device}")
    if use_triton(x) and x.dtype != torch.float64 and (bias is None or bias.dtype != torch.float64):
        return BiasGelu.apply(x, bias)
    return bias_gelu_reference(x, bias)


def bias_gelu_grad(dy, x, bias=None):
    """(dx, dbias) of y = bias_gelu(x, bias) given dy: the kernel's backward (dbias None without a bias), for
    callers that fuse the forward elsewhere (Fp8Linear.after_gelu casts the GELU's output to FP8 itself)."""
    if use_triton(x) and x.dtype != torch.float64:
        x2 = _rows(x)
        dx, db = _bias_gelu_backward(_rows(dy), x2, None if bias is None else bias.contiguous())
        return _shaped(dx, x.shape), db
    with torch.enable_grad():
        xr = x.detach().requires_grad_(True)
        br = bias.detach().requires_grad_(True) if bias is not None else None
        y = bias_gelu_reference(xr, br)
        grads = torch.autograd.grad(y, [xr] + ([br] if br is not None else []), dy)
    return grads[0], (grads[1] if br is not None else None)


def swiglu(gate_up):
    """silu(gate) * up, where gate and up are the first and second halves of the last dim."""
    _check_input("swiglu", "gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: last dim {gate_up.shape[-1]} must be even (gate and up halves)")
    if use_triton(gate_up) and gate_up.dtype != torch.float64:
        return SwiGLU.apply(gate_up)
    return swiglu_reference(gate_up)


def bias_gelu_reference(x, bias=None):
    return F.gelu(x + bias if bias is not None else x, approximate="tanh").to(x.dtype)


def swiglu_reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
