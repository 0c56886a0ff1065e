"""Cross-entropy over a vocabulary, plain and fused with the output projection.

linear_cross_entropy never needs the full (tokens, vocab) logits: the fused kernel computes logits and
their gradient chunk by chunk of rows. The Triton kernels come with their own issue; until they land the
reference (which does materialize the logits, in float32) serves every device.

Both take ignore_index (those targets count neither in the loss nor in the mean) and z_loss (adds
z_loss * logsumexp(logits)^2 per token, the PaLM auxiliary loss that keeps the softmax normalizer near 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton

REDUCTIONS = ("mean", "sum", "none")


def _check(logits_shape, target, reduction, name):
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction={reduction!r}; expected one of {REDUCTIONS}")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: target dtype {target.dtype}; expected int64 or int32")
    if tuple(target.shape) != tuple(logits_shape[:-1]):
        raise ValueError(f"{name}: target shape {tuple(target.shape)} does not match rows {tuple(logits_shape[:-1])}")


def cross_entropy(logits, target, *, ignore_index=-100, z_loss=0.0, reduction="mean"):
    """Cross-entropy of logits (..., vocab) against int targets (...)."""
    _check(logits.shape, target, reduction, "cross_entropy")
    if use_triton(logits):
        raise NotImplementedError("the Triton cross-entropy kernel has not landed yet; use ops.use('reference')")
    return cross_entropy_reference(logits, target, ignore_index=ignore_index, z_loss=z_loss, reduction=reduction)


def linear_cross_entropy(hidden, weight, target, *, bias=None, ignore_index=-100, z_loss=0.0, reduction="mean"):
    """cross_entropy(hidden @ weight.T + bias, target) without materializing the logits on the fused path."""
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy: hidden width {hidden.shape[-1]} != weight in-features {weight.shape[-1]}")
    _check(tuple(hidden.shape[:-1]) + (weight.shape[0],), target, reduction, "linear_cross_entropy")
    if use_triton(hidden):
        raise NotImplementedError("the Triton linear+cross-entropy kernel has not landed yet; use ops.use('reference')")
    return cross_entropy_reference(F.linear(hidden, weight, bias), target, ignore_index=ignore_index,
                                   z_loss=z_loss, reduction=reduction)


def cross_entropy_reference(logits, target, *, ignore_index=-100, z_loss=0.0, reduction="mean"):
    logits = logits.reshape(-1, logits.shape[-1])
    target = target.reshape(-1).long()
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(compute)
    lse = torch.logsumexp(logits, dim=-1)
    valid = target != ignore_index
    picked = logits.gather(1, torch.where(valid, target, 0)[:, None])[:, 0]
    loss = (lse - picked)
    if z_loss:
        loss = loss + z_loss * lse.pow(2)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    total = loss.sum()
    return total if reduction == "sum" else total / valid.sum().clamp(min=1)
