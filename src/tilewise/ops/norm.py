"""Residual add + dropout + LayerNorm/RMSNorm: h = residual + dropout(x), y = norm(h) * weight (+ bias).

Between the GEMMs of a transformer block these are memory-bound: fused, x and residual are read once and
y and h written once. The Triton kernels come with their own issue; until they land the reference serves
every device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton

NORM_KINDS = ("layernorm", "rmsnorm")


def check_norm_args(x, residual, weight, bias, kind, dropout_p, residual_dtype):
    """Raise ValueError naming what is wrong with the arguments of add_dropout_norm."""
    if kind not in NORM_KINDS:
        raise ValueError(f"add_dropout_norm: kind={kind!r}; expected one of {NORM_KINDS}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"add_dropout_norm: x dtype {x.dtype} is not supported; use bf16, fp16 or fp32")
    width = x.shape[-1]
    if width > 65536:
        raise ValueError(f"add_dropout_norm: row width {width} is over the supported 65536")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_dropout_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if weight.shape != (width,):
        raise ValueError(f"add_dropout_norm: weight shape {tuple(weight.shape)}; expected ({width},)")
    if bias is not None and bias.shape != (width,):
        raise ValueError(f"add_dropout_norm: bias shape {tuple(bias.shape)}; expected ({width},)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"add_dropout_norm: dropout_p={dropout_p}; expected 0 <= p < 1")
    if residual_dtype is not None and residual_dtype not in (torch.float32, x.dtype):
        raise ValueError(f"add_dropout_norm: residual_dtype={residual_dtype}; expected None, torch.float32 or x's dtype")


def add_dropout_norm(x, residual, weight, bias=None, *, kind="layernorm", eps=1e-5, dropout_p=0.0,
                     training=True, seed=None, residual_dtype=None):
    """Returns (y, h): h = residual + dropout(x) (residual may be None), y = norm(h) * weight + bias.

    h is kept in residual_dtype (default: residual's dtype, else x's), y in x's dtype.
    """
    check_norm_args(x, residual, weight, bias, kind, dropout_p, residual_dtype)
    p = dropout_p if training else 0.0
    if use_triton(x):
        raise NotImplementedError("the Triton add+dropout+norm kernel has not landed yet; use ops.use('reference')")
    return add_dropout_norm_reference(x, residual, weight, bias, kind=kind, eps=eps, dropout_p=p, seed=seed,
                                      residual_dtype=residual_dtype)


def add_dropout_norm_reference(x, residual, weight, bias=None, *, kind="layernorm", eps=1e-5, dropout_p=0.0,
                               seed=None, residual_dtype=None, keep_mask=None):
    """Plain PyTorch. keep_mask (bool, x's shape) replaces the random mask, to compare with a kernel's."""
    if residual_dtype is None:
        residual_dtype = residual.dtype if residual is not None else x.dtype
    dropped = x
    if dropout_p > 0.0:
        if keep_mask is None:
            gen = None
            if seed is not None:
                gen = torch.Generator(device=x.device).manual_seed(int(seed))
            keep_mask = torch.rand(x.shape, device=x.device, generator=gen) >= dropout_p
        dropped = x * keep_mask / (1.0 - dropout_p)
    h = dropped.to(residual_dtype)
    if residual is not None:
        h = h + residual.to(residual_dtype)
    hf = h.float() if h.dtype in (torch.float16, torch.bfloat16) else h
    w = weight.to(hf.dtype)
    b = bias.to(hf.dtype) if bias is not None else None
    if kind == "layernorm":
        y = F.layer_norm(hf, (hf.shape[-1],), w, b, eps)
    else:
        y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w
        if b is not None:
            y = y + b
    return y.to(x.dtype), h
