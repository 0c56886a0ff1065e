"""Attention: softmax(Q K^T * scale + mask) V, with causal, sliding-window, GQA and packed varlen masks.

The Triton flash-attention kernels (tiled, online softmax, the N x N scores never in HBM) come with their
own issue; until they land the reference below serves every device.

Conventions (the flash-attn ones):
- q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); heads_q is a
  multiple of heads_kv, and query head h reads key/value head h // (heads_q // heads_kv).
- With cu_seqlens (int32, batch+1 increasing offsets) q, k, v are packed (total_tokens, heads, head_dim)
  and no token attends across a document boundary.
- causal with seqlen_q != seqlen_k aligns the mask to the bottom-right: query i sees keys
  j <= i + seqlen_k - seqlen_q. window=(left, right) keeps keys with
  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 means unbounded.
- A query row that sees no key gets output 0 and log-sum-exp -inf.
- return_lse=True also returns the natural-log log-sum-exp of the scaled scores, float32,
  (batch, heads_q, seqlen_q), or (heads_q, total_tokens) when packed.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .dispatch import use_triton


def check_attention_args(q, k, v, causal, window, cu_seqlens, max_seqlen):
    """Raise ValueError naming what is wrong with the arguments of flash_attention."""
    packed = cu_seqlens is not None
    rank = 3 if packed else 4
    layout = "(total_tokens, heads, head_dim)" if packed else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"flash_attention: {name} has shape {tuple(t.shape)}; expected {rank} dims {layout}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"flash_attention: dtype {q.dtype} is not supported; use bf16, fp16 or fp32")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v are on different devices ({q.device}, {k.device}, {v.device})")
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 256 or head_dim == 0:
        raise ValueError(f"flash_attention: head_dim {head_dim} must be a multiple of 8 between 8 and 256")
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if k.shape[-1] != head_dim:
        raise ValueError(f"flash_attention: q head_dim {head_dim} != k head_dim {k.shape[-1]}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"flash_attention: q batch {q.shape[0]} != k batch {k.shape[0]}")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"flash_attention: heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")
    if window is not None:
        if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
            raise ValueError(f"flash_attention: window={window!r}; expected (left, right) ints >= -1 (-1 = unbounded)")
    if packed:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("flash_attention: cu_seqlens must be a 1-d tensor of batch+1 offsets")
        if cu_seqlens.dtype != torch.int32:
            raise ValueError(f"flash_attention: cu_seqlens dtype is {cu_seqlens.dtype}; expected torch.int32")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"flash_attention: packed q has {q.shape[0]} tokens but k has {k.shape[0]}")
        # One small host read, only on the packed path: bad offsets would read out of bounds.
        offsets = cu_seqlens.cpu()
        if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) != q.shape[0]:
            raise ValueError(f"flash_attention: cu_seqlens must start at 0, not decrease, and end at total_tokens={q.shape[0]}")
        if max_seqlen is not None and int((offsets[1:] - offsets[:-1]).max()) > max_seqlen:
            raise ValueError(f"flash_attention: a sequence is longer than max_seqlen={max_seqlen}")


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=None, cu_seqlens=None,
                    max_seqlen=None, return_lse=False, deterministic=False):
    """Attention over q, k, v (layout in the module docstring); returns out, or (out, lse)."""
    check_attention_args(q, k, v, causal, window, cu_seqlens, max_seqlen)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if use_triton(q):
        raise NotImplementedError("the Triton flash-attention kernel has not landed yet; use ops.use('reference')")
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                               cu_seqlens=cu_seqlens, return_lse=return_lse)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def attention_mask(seqlen_q, seqlen_k, causal, window, device):
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may attend to key j."""
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def _dense_attention(q, k, v, causal, softmax_scale, window):
    """(B, S, H, D) math attention in q's dtype (float32 compute for low precision)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.transpose(1, 2).to(compute) for t in (q, k, v))
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale
    keep = attention_mask(q.shape[1], k.shape[1], causal, window, q.device)
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows that see no key -> 0
    out = torch.matmul(probs, vf).transpose(1, 2).to(q.dtype)
    return out, lse.float()


def attention_reference(q, k, v, *, causal=False, softmax_scale=None, window=None, cu_seqlens=None,
                        return_lse=False):
    """The PyTorch reference: SDPA for the plain cases, explicit math for the rest."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens is not None:
        outs, lses = [], []
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            o, l = _dense_attention(q[None, start:end], k[None, start:end], v[None, start:end],
                                    causal, softmax_scale, window)
            outs.append(o[0])
            lses.append(l[0])
        out = torch.cat(outs, dim=0)
        return (out, torch.cat(lses, dim=-1)) if return_lse else out
    plain = window is None and not return_lse and (not causal or q.shape[1] == k.shape[1])
    if plain and q.dtype != torch.float64:
        group = q.shape[2] // k.shape[2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if group > 1:
            kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale)
        return out.transpose(1, 2)
    out, lse = _dense_attention(q, k, v, causal, softmax_scale, window)
    return (out, lse) if return_lse else out
