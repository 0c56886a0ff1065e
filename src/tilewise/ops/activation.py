"""Fused activations: bias + GELU (tanh approximation) and SwiGLU.

Each reads its input once and writes its output once; the Triton kernels come with their own issue, and
until they land the reference serves every device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton


def bias_gelu(x, bias=None):
    """gelu_tanh(x + bias), bias broadcast over the last dim."""
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias_gelu: bias shape {tuple(bias.shape)}; expected ({x.shape[-1]},)")
    if use_triton(x):
        raise NotImplementedError("the Triton bias+GELU kernel has not landed yet; use ops.use('reference')")
    return bias_gelu_reference(x, bias)


def swiglu(gate_up):
    """silu(gate) * up, where gate and up are the first and second halves of the last dim."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: last dim {gate_up.shape[-1]} must be even (gate and up halves)")
    if use_triton(gate_up):
        raise NotImplementedError("the Triton SwiGLU kernel has not landed yet; use ops.use('reference')")
    return swiglu_reference(gate_up)


def bias_gelu_reference(x, bias=None):
    return F.gelu(x + bias if bias is not None else x, approximate="tanh")


def swiglu_reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
