"""Rotary position embeddings, the rotate-half convention (as HF Llama stores its weights).

x (..., seqlen, heads, head_dim): the first and second halves of head_dim are the real and imaginary
parts that rotate by position * theta^(-2i/head_dim).
"""
from __future__ import annotations

import torch


def rope_cache(seqlen, head_dim, theta=10000.0, device=None):
    """(cos, sin), each float32 (seqlen, head_dim // 2)."""
    if head_dim % 2:
        raise ValueError(f"rope_cache: head_dim {head_dim} must be even")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate x (batch, seqlen, heads, head_dim) by the cached angles of its positions."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos[: x.shape[-3], None, :].to(compute)
    s = sin[: x.shape[-3], None, :].to(compute)
    x1, x2 = x.to(compute).chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
