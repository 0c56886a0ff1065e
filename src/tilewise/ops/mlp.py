"""The GELU MLP, down(gelu_tanh(up(x) + up_bias)), with the GELU inside cuBLASLt's GEMM epilogues.

Forward: one GEMM writes gelu(x @ W_up.T + b) and, kept for the backward, its input (GELU_AUX_BIAS); a plain
GEMM multiplies by W_down. Backward: dW_down = dy.T @ act; dh = (dy @ W_down) * gelu'(pre) in one GEMM
(DGELU); dW_up and db_up from one GEMM (BGRADB); dx = dh @ W_up. All six are cublaslt's, so cublaslt.TUNE
picks their algorithms too. Against the unfused chain (ops.linear,
ops.bias_gelu, ops.linear) that leaves out the bias + GELU kernels' reads and writes of the tokens x ff_dim
activation, three of its passes a layer, and keeps the same tensors for the backward (the GELU's input and
output, x, the two bf16 weights). Weight and bias gradients come out in fp32 as MasterWeightLinear's do.

It runs where ops.linear's MasterWeightLinear runs (fp32 weights under bf16/fp16 autocast, the Triton side of
the dispatch rule) when cuBLASLt is loaded, the widths are multiples of 8, torch.compile is not tracing and
CUBLASLT_MLP is on; everywhere else gelu_mlp is the unfused chain. CUBLASLT_MLP stays off until the H200
step measures it against the chain (bench/mlp.py; bench/e2e_ab.py --cublaslt mlp).
"""
from __future__ import annotations

import torch

from . import cublaslt
from .activation import bias_gelu
from .dispatch import use_triton
from .linear import _autocast_dtype, linear, low_weight

CUBLASLT_MLP = False


class GeluMLP(torch.autograd.Function):
    """y = gelu_tanh(x @ up_weight.T + up_bias) @ down_weight.T in `dtype`, fp32 (master) parameters."""

    @staticmethod
    def forward(ctx, x, up_weight, up_bias, down_weight, dtype):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
        w_up, w_down = low_weight(up_weight, dtype), low_weight(down_weight, dtype)
        b_up = None if up_bias is None else low_weight(up_bias, dtype)
        act, pre = cublaslt.gelu_bias(x2, w_up, b_up, keep_pre=any(ctx.needs_input_grad))
        y = cublaslt.matmul(act, w_down.t(), torch.empty(act.shape[0], w_down.shape[0], dtype=dtype,
                                                         device=act.device))
        ctx.save_for_backward(x2, w_up, pre, act, w_down)
        ctx.x_dtype, ctx.x_shape, ctx.has_bias = x.dtype, x.shape, up_bias is not None
        return y.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w_up, pre, act, w_down = ctx.saved_tensors
        need_x, need_w_up, need_b_up, need_w_down = ctx.needs_input_grad[:4]
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = dw_up = db_up = dw_down = None
        if need_w_down:
            dw_down, _ = cublaslt.wgrad(dy2, act)
        dh = cublaslt.dgelu(dy2, w_down, pre)
        if need_w_up or need_b_up:
            dw_up, db_up = cublaslt.wgrad(dh, x2, bias_grad=ctx.has_bias and need_b_up)
        if need_x:
            dx = cublaslt.matmul(dh, w_up, torch.empty(dh.shape[0], w_up.shape[1], dtype=dh.dtype, device=dh.device))
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        return dx, dw_up, db_up, dw_down, None


def _fused(x, up_weight, up_bias, down_weight):
    """The autocast dtype GeluMLP runs in for these operands, or None where it does not run."""
    if not (CUBLASLT_MLP and use_triton(x) and cublaslt.available(x.device)) or torch.compiler.is_compiling():
        return None
    if up_weight.dtype != torch.float32 or down_weight.dtype != torch.float32:
        return None
    if up_bias is not None and up_bias.dtype != torch.float32:
        return None
    if x.shape[-1] % 8 or up_weight.shape[0] % 8 or down_weight.shape[0] % 8:
        return None
    dtype = _autocast_dtype(x)
    return dtype if dtype is not None and x.dtype in (torch.float32, dtype) else None


def gelu_mlp(x, up_weight, up_bias, down_weight):
    """down(gelu_tanh(x @ up_weight.T + up_bias)) with down = x @ down_weight.T (no bias: the model adds the
    down projection's bias in the next norm). up_bias may be None."""
    if up_weight.dim() != 2 or down_weight.dim() != 2 or up_weight.shape[1] != x.shape[-1] \
            or down_weight.shape[1] != up_weight.shape[0]:
        raise ValueError(f"gelu_mlp: x {tuple(x.shape)}, up_weight {tuple(up_weight.shape)}, down_weight "
                         f"{tuple(down_weight.shape)}; expected up_weight (ff, {x.shape[-1]}) and down_weight (d, ff)")
    if up_bias is not None and up_bias.shape != (up_weight.shape[0],):
        raise ValueError(f"gelu_mlp: up_bias shape {tuple(up_bias.shape)}; expected ({up_weight.shape[0]},)")
    dtype = _fused(x, up_weight, up_bias, down_weight)
    if dtype is not None:
        return GeluMLP.apply(x, up_weight, up_bias, down_weight, dtype)
    return linear(bias_gelu(linear(x, up_weight), up_bias), down_weight)
