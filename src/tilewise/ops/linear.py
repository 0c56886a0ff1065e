"""Dense linear layers: cuBLAS through F.linear in bf16/fp32.

FP8 linears swap the module (tilewise.fp8.Fp8Linear), not this function, because they carry scaling
state across steps.
"""
from __future__ import annotations

import torch.nn.functional as F


def linear(x, weight, bias=None):
    """x @ weight.T + bias."""
    return F.linear(x, weight, bias)
