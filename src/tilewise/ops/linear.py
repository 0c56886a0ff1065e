"""Dense linear layers: cuBLAS in bf16/fp16 under autocast, with the weight gradient written in fp32.

Under autocast, F.linear with an fp32 (master) weight casts the weight to bf16, and its backward makes the
weight's gradient in bf16 as the transpose of x^T @ dy; autograd then widens it to fp32 into the weight's
layout (the 1.3B step on the H200 at 194bc8f: 172 copy kernels, 4.9 ms; 4 remained at deec05a).
MasterWeightLinear casts the same way but has the GEMM write dW = dy^T @ x itself, in fp32 (cuBLAS
accumulates in fp32 anyway) and in the weight's own layout, so autograd takes it as the gradient with no
copy; dW is also no longer rounded to bf16 on the way. The bias gradient, the column sums of dy, comes from
the FP8 cast's column-sum kernel (fp32 partial rows, then one small reduction): 1781-3036 GB/s against
torch.sum's 1069-2903 at the e2e shapes (bench/linear.py, 9bb389e). Tried and reverted: the QKV projection's
bias gradient from the attention backward's tiles (each dK/dV and dQ tile's column sums, at 6b995f6). In the
GPT-2 124M step on the H200 the 0.56 ms pass went, but the Triton backward kernels took 0.36 ms longer and the
step was unchanged (58.77 against 58.73 ms; bench/results/e2e_qkv_bias_tiles_6b995f6.json).

With ops.cublaslt.GEMMS on (off until the H200 step measures it), its three GEMMs are cublaslt's instead of
torch's, so that cublaslt.TUNE can pick their algorithms, and the bias gradient comes from the weight
gradient's GEMM (BGRADB) instead of column_sums.

It runs where the Triton ops run (tilewise.ops' dispatch rule: CUDA tensors, or TILEWISE_OPS=triton);
the reference is F.linear under autocast. The fp32-output GEMM is torch.mm(a, b, out_dtype) on CUDA where
fp32_out_mm_ok finds it (torch >= 2.8; the fused cross-entropy asks the same); elsewhere (the CPU, an older
torch) the bf16 operands are widened exactly and multiplied in fp32.

FP8 linears swap the module (tilewise.fp8.Fp8Linear), not this function, because they carry scaling
state across steps.

Kept low-precision weights (KEEP_LOW_WEIGHTS; TILEWISE_KEEP_LOW_WEIGHTS=0 turns it off): the forward's cast
of each fp32 weight (the 1.3B bf16 step at c4f00fa: 170 copy kernels, 2.2 ms) is kept on
the weight (`low_weight`), and tilewise's AdamW, which reads every weight it updates anyway, writes the
updated weight's cast into that copy in the same pass (2 bytes a parameter more written), so later forwards
cast nothing. A copy is used only while it matches its weight: the weight's version counter and storage as
stamped when the copy was last written, so any other change of the weight (load_state_dict, an in-place
init, `.data =`) makes the next forward cast afresh. Copies are kept only for weights the AdamW kernel
updates (`mark_refreshed`): not for FSDP's unsharded weights (their DTensor shards are stepped by torch),
whose copies would hold the memory ZeRO-3 frees. The e2e step on the H200 at 2219f4c (bench/e2e.py, graphs):
1.3B 252.7 ms against 253.7 with fresh casts (memory-bound 25.7 against 27.6 ms, AdamW 11.1 against 10.5),
GPT-2 124M 59.3 against 59.2; peak memory the same (48.7 and 13.6 GB: the casts live through the step
anyway, saved for the backward).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import cublaslt
from .dispatch import use_triton
from .fp8_cast import column_sums

_HALF = (torch.bfloat16, torch.float16)


_FP32_OUT_MM_OK = {}  # (device, dtype) -> whether mm/addmm(..., torch.float32) accumulate correctly there


def fp32_out_mm_ok(device, dtype) -> bool:
    """mm and addmm with a float32 output from bf16/fp16 operands (CUDA, torch >= 2.8), checked once per
    device with the calls the fused cross-entropy's accumulation makes: mm into a NaN-filled accumulator
    (overwritten), then addmm adding into it in place. Checked with autocast off: under it the fp32 reference product ran in bf16 and
    the check failed, so inside the model's forward the head's gradient took the fallback (the 1.3B bf16
    step on the H200 at 95b2c65: a bf16 product per chunk added into the fp32 accumulator, 3 adds and 3
    copies of vocab x width, 1.6 ms; gone at 2a18bea). Never checked during a CUDA graph capture, which its
    synchronization would break (the fallback is used there, uncached)."""
    key = (str(device), dtype)
    if key not in _FP32_OUT_MM_OK:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        ok = False
        if device.type == "cuda":
            try:
                with torch.autocast(device.type, enabled=False):
                    a = torch.randn(64, 48, device=device, dtype=dtype).t()
                    b = torch.randn(64, 40, device=device, dtype=dtype)
                    acc = torch.full((48, 40), float("nan"), device=device)
                    torch.mm(a, b, torch.float32, out=acc)
                    torch.addmm(acc, a, b, torch.float32, out=acc)
                    ok = bool(torch.allclose(acc, 2 * (a.float() @ b.float()), rtol=1e-3, atol=1e-3))
            except (RuntimeError, TypeError):
                ok = False
        _FP32_OUT_MM_OK[key] = ok
    return _FP32_OUT_MM_OK[key]


KEEP_LOW_WEIGHTS = os.environ.get("TILEWISE_KEEP_LOW_WEIGHTS", "1") == "1"


def _stamp(weight) -> tuple:
    return weight._version, weight.data_ptr()


def low_weight(weight: torch.Tensor, dtype) -> torch.Tensor:
    """weight cast to dtype: its kept copy while that matches it (see the module docstring), else a fresh
    cast, kept when KEEP_LOW_WEIGHTS is on and the optimizer refreshes this weight. Traced by torch.compile,
    or first seen during a CUDA graph's capture (the copy would live in the graph's pool), it only casts."""
    if torch.compiler.is_compiling():
        return weight.to(dtype)
    kept = getattr(weight, "_tilewise_low", None)
    if kept is not None and kept[0].dtype == dtype and kept[1] == _stamp(weight):
        return kept[0]
    low = weight.to(dtype)
    if (KEEP_LOW_WEIGHTS and getattr(weight, "_tilewise_refreshed", False)
            and not (low.is_cuda and torch.cuda.is_current_stream_capturing())):
        weight._tilewise_low = (low, _stamp(weight))
    return low


def mark_refreshed(weight: torch.Tensor):
    """For the optimizer updating weight in place with its own kernel: the kept copy for it to rewrite (None
    if there is none yet); the weight is marked so the next forward keeps one."""
    weight._tilewise_refreshed = True
    kept = getattr(weight, "_tilewise_low", None)
    return None if kept is None else kept[0]


def restamp(weight: torch.Tensor) -> None:
    """After the optimizer rewrote weight's kept copy from the updated weight: the copy matches it again."""
    weight._tilewise_low = (weight._tilewise_low[0], _stamp(weight))


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16/fp16 operands, accumulated and written in fp32."""
    if a.is_cuda and (torch.compiler.is_compiling() or fp32_out_mm_ok(a.device, a.dtype)):
        return torch.mm(a, b, out_dtype=torch.float32)
    with torch.autocast(a.device.type, enabled=False):   # a backward traced under autocast (torch.compile)
        return torch.mm(a.float(), b.float())


def _routed(t: torch.Tensor) -> bool:
    """Whether MasterWeightLinear's GEMMs go through ops.cublaslt (its GEMMS switch, where it is available,
    outside torch.compile)."""
    return cublaslt.GEMMS and cublaslt.available(t.device) and not torch.compiler.is_compiling()


class MasterWeightLinear(torch.autograd.Function):
    """y = x @ weight.T + bias in `dtype` (autocast's) for an fp32 weight; dW and db come out in fp32. With
    cublaslt.GEMMS its three GEMMs are cublaslt's (the bias gradient then from the weight gradient's GEMM)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        x_low, w_low = x.to(dtype), low_weight(weight, dtype)
        b_low = None if bias is None else bias.to(dtype)
        if _routed(x_low) and x_low.is_contiguous() and x_low.numel():
            x2 = x_low.view(-1, x_low.shape[-1])
            y = cublaslt.matmul(x2, w_low.t(), torch.empty(x2.shape[0], w_low.shape[0], dtype=dtype,
                                                           device=x2.device), bias=b_low)
            y = y.view(*x_low.shape[:-1], w_low.shape[0])
        else:
            y = F.linear(x_low, w_low, b_low)   # autocast leaves `dtype` alone
        ctx.save_for_backward(x_low, w_low)
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_low, w_low = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x_low.reshape(-1, x_low.shape[-1])
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        want_b = want_b and ctx.has_bias
        dx = dw = db = None
        if _routed(dy2) and dy2.shape[0] > 0:
            dy2 = dy2.contiguous()
            if want_x:
                dx = cublaslt.matmul(dy2, w_low, torch.empty(dy2.shape[0], w_low.shape[1], dtype=dy2.dtype,
                                                             device=dy2.device))
                dx = dx.view(*dy.shape[:-1], w_low.shape[1]).to(ctx.x_dtype)
            if want_w:
                dw, db = cublaslt.wgrad(dy2, x2.contiguous(), bias_grad=want_b)
            elif want_b:
                db = dy2.sum(0, dtype=torch.float32)
            return dx, dw, db, None
        if want_x:
            dx = (dy2 @ w_low).view(*dy.shape[:-1], w_low.shape[1]).to(ctx.x_dtype)
        if want_w:
            dw = _mm_fp32(dy2.t(), x2)
        if want_b:
            if torch.compiler.is_compiling() or dy2.shape[0] == 0:   # torch.compile traces torch's sum, not a
                db = dy2.sum(0, dtype=torch.float32)                   # launcher; column_sums needs rows
            else:
                db = torch.empty(dy2.shape[1], dtype=torch.float32, device=dy2.device)
                column_sums(dy2.contiguous(), db)
        return dx, dw, db, None


def _autocast_dtype(x: torch.Tensor):
    """The autocast dtype in force for x's device when it is bf16/fp16, else None."""
    kind = x.device.type
    if kind not in ("cuda", "cpu") or not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    return dtype if dtype in _HALF else None


def linear(x, weight, bias=None):
    """x @ weight.T + bias (F.linear), with an fp32 weight under autocast by MasterWeightLinear."""
    if (weight.dtype == torch.float32 and torch.is_grad_enabled() and use_triton(x)
            and (bias is None or bias.dtype == torch.float32)):
        dtype = _autocast_dtype(x)
        if dtype is not None and x.dtype in (torch.float32, dtype):
            return MasterWeightLinear.apply(x, weight, bias, dtype)
    return F.linear(x, weight, bias)
