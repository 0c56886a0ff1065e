"""Attention: softmax(Q K^T * scale + mask) V, with causal, sliding-window, GQA and packed varlen masks.

Flash attention: the N x N scores never reach HBM.
- Forward: one program per (query block, batch * head). It keeps its Q tile on chip, streams K/V tiles and
  keeps a running row max m, row sum l and an fp32 accumulator (online softmax in base 2: log2(e) is folded
  into the scale, so each score costs one exp2). Key blocks come in three phases: the interior, where no
  mask applies and none is computed, and the boundary blocks (causal diagonal, window edges, the ragged
  end of the keys), where it is. Blocks the mask removes entirely are never visited. Writes O and the
  natural-log LSE; the heaviest (latest) causal query blocks are launched first.
- Backward: P = exp2(S * scale * log2(e) - lse2) is recomputed from the saved LSE. A small kernel writes
  delta = rowsum(dO * O) - dLSE and lse2; one kernel per key block accumulates dK and dV over the query
  blocks (and over the query heads of its GQA group); one kernel per query block accumulates dQ over the key
  blocks. No atomics anywhere, so gradients are bitwise repeatable whatever `deterministic` says.
- Bytes: forward reads Q and writes O once (plus 4 bytes of LSE per row) and reads K, V once per query
  block, mostly from L2; backward reads Q, K, V, O, dO and writes dQ, dK, dV, re-reading per block in the
  same way. Memory is O(N): no N x N tensor is kept.
- Loads: when the layout allows it (CUDA sm90+, 16-bit dtype, head_dim a power of two, the heads of a token
  side by side) K, V, Q and dO tiles come through host TMA tensor descriptors; otherwise (and with
  TILEWISE_ATTN_TMA=0) through masked pointer loads. Both are the same kernels (USE_TMA constexpr), and the
  interpreter runs both. A TMA tile may run into the next sequence's rows: such keys are masked (boundary
  phase) and such queries get P = 0 (lse2 = +inf) or are never stored.

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
  (batch, heads_q, seqlen_q), or (heads_q, total_tokens) when packed. Its gradient flows too.
- float64 inputs run the reference on every device (Triton has no fp64 tensor-core dot).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import use_triton

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # read inside a kernel: compiled Triton accepts only constexpr globals
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _cast(x, dtype: tl.constexpr, EMU_BF16: tl.constexpr):
    """x in `dtype`. EMU_BF16 (interpreter only: its cast truncates) rounds to nearest even by hand."""
    if EMU_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        y = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr):
    """a @ b (+ acc) in fp32. EMU_BF16 (interpreter only: it multiplies bf16 bit patterns as integers)
    upcasts the bf16 operands first, which is exact."""
    if EMU_BF16:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        c = tl.dot(a, b, acc, input_precision=DOT_PREC)
    return c


@triton.jit
def _load_tile(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """A (rows, BLOCK_D) tile; rows >= n_rows and columns >= HEAD_DIM read as 0."""
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _store_tile(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr):
    tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _seq_bounds(CU, b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(start row, seqlen_q, seqlen_k) of sequence b: its slice of the packed tensors when VARLEN."""
    if VARLEN:
        start = tl.load(CU + b)
        sq = tl.load(CU + b + 1) - start
        sk = sq
    else:
        start = b * 0
        sq = seqlen_q + b * 0
        sk = seqlen_k + b * 0
    return start, sq, sk


@triton.jit
def _key_range(first, last, seqlen_k, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Key blocks for query positions first..last (bottom-right aligned): [lo, hi) holds every key any of
    them sees, [inner_lo, inner_hi) the blocks every one of them sees entirely (no mask needed)."""
    if HAS_LEFT:
        lo = tl.maximum(first - left, 0) // BLOCK_N * BLOCK_N
        inner_lo = (tl.maximum(last - left, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    else:
        lo = first * 0
        inner_lo = lo
    if HAS_RIGHT:
        hi = tl.minimum(last + right + 1, seqlen_k)
        inner_hi = tl.maximum(tl.minimum(first + right + 1, seqlen_k), 0) // BLOCK_N * BLOCK_N
    else:
        hi = seqlen_k + first * 0
        inner_hi = seqlen_k // BLOCK_N * BLOCK_N + first * 0
    hi = tl.maximum(hi, lo)
    inner_lo = tl.minimum(tl.maximum(inner_lo, lo), hi)
    inner_hi = tl.minimum(tl.maximum(inner_hi, inner_lo), hi)
    return lo, inner_lo, inner_hi, hi


@triton.jit
def _query_range(first, last, seqlen_q, off, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Query blocks for keys first..last: query i (position i + off) sees key j iff j - right <= i + off
    <= j + left. [lo, hi) holds every query that sees one of them, [inner_lo, inner_hi) the full blocks
    that see all of them."""
    if HAS_RIGHT:
        lo = tl.maximum(first - right - off, 0) // BLOCK_M * BLOCK_M
        inner_lo = (tl.maximum(last - right - off, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        lo = first * 0
        inner_lo = lo
    if HAS_LEFT:
        hi = tl.minimum(last + left - off + 1, seqlen_q)
        inner_hi = tl.maximum(tl.minimum(first + left - off + 1, seqlen_q), 0) // BLOCK_M * BLOCK_M
    else:
        hi = seqlen_q + first * 0
        inner_hi = seqlen_q // BLOCK_M * BLOCK_M + first * 0
    hi = tl.maximum(hi, lo)
    inner_lo = tl.minimum(tl.maximum(inner_lo, lo), hi)
    inner_hi = tl.minimum(tl.maximum(inner_hi, inner_lo), hi)
    return lo, inner_lo, inner_hi, hi


@triton.jit
def _keep(qpos, kpos, seqlen_k, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """The mask of a boundary block: broadcast qpos/kpos to the tile shape before calling."""
    keep = kpos < seqlen_k
    if HAS_RIGHT:
        keep = keep & (kpos <= qpos + right)
    if HAS_LEFT:
        keep = keep & (kpos >= qpos - left)
    return keep


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                qpos, offs_n, offs_d, lo, hi, seqlen_k, left, right, qk_scale,
                MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr):
    """Online softmax over key blocks [lo, hi) (base 2; qk_scale includes log2(e))."""
    k_offs = offs_n[:, None] * sks + offs_d[None, :]
    v_offs = offs_n[:, None] * svs + offs_d[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N):
        kpos = start_n + offs_n
        start = tl.cast(start_n, tl.int64)
        if USE_TMA:
            k = desc_k.load([k_row + start_n, kv_col])
        else:
            k = _load_tile(k_base + start * sks + k_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        s = _dot(q, tl.trans(k), None, DOT_PREC, EMU_BF16) * qk_scale
        if MASKED:
            keep = _keep(qpos[:, None], kpos[None, :], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: p = 0, not NaN
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = desc_v.load([k_row + start_n, kv_col])
        else:
            v = _load_tile(v_base + start * svs + v_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        acc = _dot(_cast(p, v.dtype, EMU_BF16), v, acc, DOT_PREC, EMU_BF16)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, CU, desc_q, desc_k, desc_v,
              sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
              seqlen_q, seqlen_k, rows_q, rows_k, n_heads, group, qk_scale, left, right,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr,
              DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)  # latest query blocks (most causal work) first
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    hk = h // group
    start, sq, sk = _seq_bounds(CU, b, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    b64, h64, hk64, start64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64), start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + b64 * sqb + start64 * sqs + h64 * sqh
    k_base = K + b64 * skb + start64 * sks + hk64 * skh
    v_base = V + b64 * svb + start64 * svs + hk64 * svh
    if USE_TMA:
        q = desc_q.load([b * rows_q + start + m0, h * HEAD_DIM])
    else:
        q = _load_tile(q_base + offs_m.to(tl.int64)[:, None] * sqs + offs_d[None, :], offs_m, sq, offs_d,
                       HEAD_DIM, BLOCK_D, True)
    off = sk - sq
    qpos = offs_m + off
    first = m0 + off
    last = tl.minimum(m0 + BLOCK_M, sq) - 1 + off
    lo, inner_lo, inner_hi, hi = _key_range(first, last, sk, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_row = b * rows_k + start
    kv_col = hk * HEAD_DIM
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                                qpos, offs_n, offs_d, inner_lo, inner_hi, sk, left, right, qk_scale,
                                False, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA, DOT_PREC,
                                EMU_BF16)
    if HAS_LEFT:
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                                    qpos, offs_n, offs_d, lo, inner_lo, sk, left, right, qk_scale,
                                    True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA, DOT_PREC,
                                    EMU_BF16)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                                qpos, offs_n, offs_d, inner_hi, hi, sk, left, right, qk_scale,
                                True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA, DOT_PREC,
                                EMU_BF16)

    empty = l_i == 0.0  # the row sees no key: output 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    o_ptrs = O + b64 * sob + start64 * sos + h64 * soh + offs_m.to(tl.int64)[:, None] * sos + offs_d[None, :]
    _store_tile(o_ptrs, _cast(out, O.dtype.element_ty, EMU_BF16), offs_m, sq, offs_d, HEAD_DIM)
    tl.store(LSE + b64 * slb + h64 * slh + start64 + offs_m, lse, mask=offs_m < sq)


@triton.jit
def _bwd_prep(O, DO, DLSE, LSE, LSE2, DELTA, CU,
              sob, sos, soh, sdb, sds, sdh, slb, slh, seqlen_q, n_heads,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr,
              BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) - dLSE and lse2 = lse * log2(e), +inf where lse = -inf (then P = 0)."""
    pid_bh = tl.program_id(0)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    start, sq, _ = _seq_bounds(CU, b, seqlen_q, seqlen_q, VARLEN)
    m0 = tl.program_id(1) * BLOCK_M
    if m0 >= sq:
        return
    b64, h64, start64 = b.to(tl.int64), h.to(tl.int64), start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(O + b64 * sob + start64 * sos + h64 * soh + offs_m.to(tl.int64)[:, None] * sos + offs_d[None, :],
                   offs_m, sq, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_tile(DO + b64 * sdb + start64 * sds + h64 * sdh + offs_m.to(tl.int64)[:, None] * sds + offs_d[None, :],
                    offs_m, sq, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = b64 * slb + h64 * slh + start64 + offs_m
    mask = offs_m < sq
    if HAS_DLSE:
        delta -= tl.load(DLSE + row, mask=mask, other=0.0)
    lse = tl.load(LSE + row, mask=mask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + row, delta, mask=mask)
    tl.store(LSE2 + row, lse2, mask=mask)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, desc_q, desc_do, q_row, q_col, sqs, sds, lse2_ptr, delta_ptr,
                 kpos, offs_m, offs_d, lo, hi, seqlen_q, seqlen_k, off, left, right, qk_scale,
                 MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr):
    """dK, dV of one key block over query blocks [lo, hi), in the transposed (key, query) frame."""
    q_offs = offs_m[:, None] * sqs + offs_d[None, :]
    do_offs = offs_m[:, None] * sds + offs_d[None, :]
    for start_m in tl.range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        if USE_TMA:
            q = desc_q.load([q_row + start_m, q_col])
            do = desc_do.load([q_row + start_m, q_col])
        else:
            start = tl.cast(start_m, tl.int64)
            q = _load_tile(q_base + start * sqs + q_offs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
            do = _load_tile(do_base + start * sds + do_offs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        if MASKED:
            lse2 = tl.load(lse2_ptr + rows, mask=rows < seqlen_q, other=float("inf"))
            delta = tl.load(delta_ptr + rows, mask=rows < seqlen_q, other=0.0)
        else:
            lse2 = tl.load(lse2_ptr + rows)
            delta = tl.load(delta_ptr + rows)
        s_t = _dot(k, tl.trans(q), None, DOT_PREC, EMU_BF16) * qk_scale
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASKED:
            keep = _keep(rows[None, :] + off, kpos[:, None], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
            p_t = tl.where(keep & (rows[None, :] < seqlen_q), p_t, 0.0)
        dv = _dot(_cast(p_t, do.dtype, EMU_BF16), do, dv, DOT_PREC, EMU_BF16)
        dp_t = _dot(v, tl.trans(do), None, DOT_PREC, EMU_BF16)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _dot(_cast(ds_t, q.dtype, EMU_BF16), q, dk, DOT_PREC, EMU_BF16)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, CU, desc_q, desc_k, desc_v, desc_do,
                   sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
                   sgb, sgs, sgh, slb, slh,
                   seqlen_q, seqlen_k, rows_q, rows_k, n_kv_heads, group, qk_scale, softmax_scale, left, right,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr,
                   DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key block, batch * kv head); dK and dV are written (contiguous, strides sg*)."""
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)  # early key blocks are seen by the most causal queries: they go first
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    start, sq, sk = _seq_bounds(CU, b, seqlen_q, seqlen_k, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= sk:
        return
    b64, hk64, start64 = b.to(tl.int64), hk.to(tl.int64), start.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_TMA:
        k = desc_k.load([b * rows_k + start + n0, hk * HEAD_DIM])
        v = desc_v.load([b * rows_k + start + n0, hk * HEAD_DIM])
    else:
        rows = offs_n.to(tl.int64)[:, None]
        k = _load_tile(K + b64 * skb + start64 * sks + hk64 * skh + rows * sks + offs_d[None, :],
                       offs_n, sk, offs_d, HEAD_DIM, BLOCK_D, True)
        v = _load_tile(V + b64 * svb + start64 * svs + hk64 * svh + rows * svs + offs_d[None, :],
                       offs_n, sk, offs_d, HEAD_DIM, BLOCK_D, True)
    off = sk - sq
    first = n0
    last = tl.minimum(n0 + BLOCK_N, sk) - 1
    lo, inner_lo, inner_hi, hi = _query_range(first, last, sq, off, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    q_row = b * rows_q + start
    for g in range(group):
        h = hk * group + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * sqb + start64 * sqs + h64 * sqh
        do_base = DO + b64 * sdb + start64 * sds + h64 * sdh
        row_base = b64 * slb + h64 * slh + start64
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, desc_q, desc_do, q_row, h * HEAD_DIM, sqs, sds,
                              LSE2 + row_base, DELTA + row_base, offs_n, offs_m, offs_d, inner_lo, inner_hi,
                              sq, sk, off, left, right, qk_scale, False, HAS_LEFT, HAS_RIGHT,
                              HEAD_DIM, BLOCK_D, BLOCK_M, USE_TMA, DOT_PREC, EMU_BF16)
        if HAS_RIGHT:
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, desc_q, desc_do, q_row, h * HEAD_DIM, sqs, sds,
                                  LSE2 + row_base, DELTA + row_base, offs_n, offs_m, offs_d, lo, inner_lo,
                                  sq, sk, off, left, right, qk_scale, True, HAS_LEFT, HAS_RIGHT,
                                  HEAD_DIM, BLOCK_D, BLOCK_M, USE_TMA, DOT_PREC, EMU_BF16)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, desc_q, desc_do, q_row, h * HEAD_DIM, sqs, sds,
                              LSE2 + row_base, DELTA + row_base, offs_n, offs_m, offs_d, inner_hi, hi,
                              sq, sk, off, left, right, qk_scale, True, HAS_LEFT, HAS_RIGHT,
                              HEAD_DIM, BLOCK_D, BLOCK_M, USE_TMA, DOT_PREC, EMU_BF16)
    dk = dk * softmax_scale
    g_off = b64 * sgb + start64 * sgs + hk64 * sgh + offs_n.to(tl.int64)[:, None] * sgs + offs_d[None, :]
    _store_tile(DK + g_off, _cast(dk, DK.dtype.element_ty, EMU_BF16), offs_n, sk, offs_d, HEAD_DIM)
    _store_tile(DV + g_off, _cast(dv, DV.dtype.element_ty, EMU_BF16), offs_n, sk, offs_d, HEAD_DIM)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
               qpos, offs_n, offs_d, lo, hi, seqlen_k, left, right, qk_scale,
               MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr):
    """dQ of one query block over key blocks [lo, hi)."""
    k_offs = offs_n[:, None] * sks + offs_d[None, :]
    v_offs = offs_n[:, None] * svs + offs_d[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N):
        kpos = start_n + offs_n
        if USE_TMA:
            k = desc_k.load([k_row + start_n, kv_col])
            v = desc_v.load([k_row + start_n, kv_col])
        else:
            start = tl.cast(start_n, tl.int64)
            k = _load_tile(k_base + start * sks + k_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
            v = _load_tile(v_base + start * svs + v_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        s = _dot(q, tl.trans(k), None, DOT_PREC, EMU_BF16) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            keep = _keep(qpos[:, None], kpos[None, :], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
            p = tl.where(keep, p, 0.0)
        dp = _dot(do, tl.trans(v), None, DOT_PREC, EMU_BF16)
        ds = p * (dp - delta[:, None])
        dq = _dot(_cast(ds, k.dtype, EMU_BF16), k, dq, DOT_PREC, EMU_BF16)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, LSE2, DELTA, CU, desc_q, desc_k, desc_v, desc_do,
                 sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sgb, sgs, sgh, slb, slh,
                 seqlen_q, seqlen_k, rows_q, rows_k, n_heads, group, qk_scale, softmax_scale, left, right,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr,
                 DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query block, batch * head); dQ is written (contiguous, strides sg*)."""
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    hk = h // group
    start, sq, sk = _seq_bounds(CU, b, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    b64, h64, hk64, start64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64), start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_TMA:
        q = desc_q.load([b * rows_q + start + m0, h * HEAD_DIM])
        do = desc_do.load([b * rows_q + start + m0, h * HEAD_DIM])
    else:
        rows = offs_m.to(tl.int64)[:, None]
        q = _load_tile(Q + b64 * sqb + start64 * sqs + h64 * sqh + rows * sqs + offs_d[None, :],
                       offs_m, sq, offs_d, HEAD_DIM, BLOCK_D, True)
        do = _load_tile(DO + b64 * sdb + start64 * sds + h64 * sdh + rows * sds + offs_d[None, :],
                        offs_m, sq, offs_d, HEAD_DIM, BLOCK_D, True)
    row = b64 * slb + h64 * slh + start64 + offs_m
    lse2 = tl.load(LSE2 + row, mask=offs_m < sq, other=float("inf"))
    delta = tl.load(DELTA + row, mask=offs_m < sq, other=0.0)
    off = sk - sq
    qpos = offs_m + off
    first = m0 + off
    last = tl.minimum(m0 + BLOCK_M, sq) - 1 + off
    lo, inner_lo, inner_hi, hi = _key_range(first, last, sk, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_N)
    k_base = K + b64 * skb + start64 * sks + hk64 * skh
    v_base = V + b64 * svb + start64 * svs + hk64 * svh
    k_row = b * rows_k + start
    kv_col = hk * HEAD_DIM
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                    qpos, offs_n, offs_d, inner_lo, inner_hi, sk, left, right, qk_scale, False,
                    HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA, DOT_PREC, EMU_BF16)
    if HAS_LEFT:
        dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                        qpos, offs_n, offs_d, lo, inner_lo, sk, left, right, qk_scale, True,
                        HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA, DOT_PREC, EMU_BF16)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                    qpos, offs_n, offs_d, inner_hi, hi, sk, left, right, qk_scale, True,
                    HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA, DOT_PREC, EMU_BF16)
    dq = dq * softmax_scale
    g_ptrs = DQ + b64 * sgb + start64 * sgs + h64 * sgh + offs_m.to(tl.int64)[:, None] * sgs + offs_d[None, :]
    _store_tile(g_ptrs, _cast(dq, DQ.dtype.element_ty, EMU_BF16), offs_m, sq, offs_d, HEAD_DIM)


# ----------------------------------------------------------------------------------------------
# Autotuning: Hopper configs on the GPU, one small config in the interpreter
# ----------------------------------------------------------------------------------------------

def _cfg(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages,
                         pre_hook=_set_block_shapes)


def _set_block_shapes(nargs):
    """TMA descriptors take the tile shape of the config the autotuner is about to run."""
    rows = {"desc_q": "BLOCK_M", "desc_do": "BLOCK_M", "desc_k": "BLOCK_N", "desc_v": "BLOCK_N"}
    for name, block in rows.items():
        desc = nargs.get(name)
        if desc is not None and not isinstance(desc, torch.Tensor):
            desc.block_shape = [nargs[block], nargs["BLOCK_D"]]


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head_dim class: <= 64, <= 128, > 128 (tile dim).
# H200: 228 KB smem and 64K registers per SM. Forward: a 128-row Q tile per program, K/V streamed
# (Q + stages * (K + V) tiles stay under ~200 KB). dK/dV: a 128-row key block per program (the dK, dV
# accumulators live in registers), Q/dO streamed. dQ: a 128-row query block, K/V streamed.
_FWD = {64: [(128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4)],
        128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 4)],
        256: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)]}
_DKDV = {64: [(64, 128, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3)],
         128: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3)],
         256: [(32, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2)]}
_DQ = {64: [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
       128: [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
       256: [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2)]}


def _configs(table, interpret_shape):
    if _INTERPRET:
        return [_cfg(*interpret_shape, 4, 1)]
    seen, out = set(), []
    for entries in table.values():
        for e in entries:
            if e not in seen:
                seen.add(e)
                out.append(_cfg(*e))
    return out


def _pruner(table):
    """Keep the configs of the head_dim class; TILEWISE_ATTN_AUTOTUNE=0 keeps its first one, untimed."""
    def prune(configs, nargs, **kwargs):
        d = {**nargs, **kwargs}["BLOCK_D"]
        wanted = table[64 if d <= 64 else 128 if d <= 128 else 256]
        if os.environ.get("TILEWISE_ATTN_AUTOTUNE", "1") == "0":
            wanted = wanted[:1]
        keep = [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
        return keep or configs[:1]
    return prune


# The key holds what changes the best tile: head_dim, the mask kind, the load path (and the dtype, which
# the autotuner adds itself). Sequence length is left out so a new length does not re-tune.
_KEY = ["BLOCK_D", "HAS_LEFT", "HAS_RIGHT", "VARLEN", "USE_TMA"]
_attn_fwd_tuned = triton.autotune(_configs(_FWD, (32, 16)), key=_KEY,
                                  prune_configs_by={"early_config_prune": _pruner(_FWD)})(_attn_fwd)
_attn_bwd_dkdv_tuned = triton.autotune(_configs(_DKDV, (16, 32)), key=_KEY,
                                       prune_configs_by={"early_config_prune": _pruner(_DKDV)})(_attn_bwd_dkdv)
_attn_bwd_dq_tuned = triton.autotune(_configs(_DQ, (32, 16)), key=_KEY,
                                     prune_configs_by={"early_config_prune": _pruner(_DQ)})(_attn_bwd_dq)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

def _nan_fill() -> bool:
    """Outputs start as NaN in the interpreter and with TILEWISE_NAN_FILL=1, so unwritten elements show."""
    return _INTERPRET or os.environ.get("TILEWISE_NAN_FILL", "0") == "1"


def _new(shape, dtype, device):
    if _nan_fill():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _seq_strides(t, packed):
    """(batch, seq, head) strides; a packed tensor has no batch stride (documents are row ranges)."""
    if packed:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _want_tma(device) -> bool:
    flag = os.environ.get("TILEWISE_ATTN_TMA", "auto").strip().lower()
    if flag in ("0", "off", "false"):
        return False
    if flag in ("1", "on", "true"):
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_layout_ok(t, packed) -> bool:
    """A (rows, heads * head_dim) 2-D view with 16-byte aligned rows exists: TMA can tile it."""
    d = t.shape[-1]
    if t.dtype not in (torch.float16, torch.bfloat16) or d < 16 or d & (d - 1) or t.numel() == 0:
        return False
    heads, row_stride = t.shape[-2], t.stride(-3)
    if t.stride(-1) != 1 or t.stride(-2) != d or row_stride < heads * d:
        return False
    if (row_stride * t.element_size()) % 16 or t.data_ptr() % 16:
        return False
    return packed or t.shape[0] == 1 or t.stride(0) == t.shape[1] * row_stride


def _descriptor(t, packed):
    from triton.tools.tensor_descriptor import TensorDescriptor
    rows = t.shape[0] if packed else t.shape[0] * t.shape[1]
    d = t.shape[-1]
    # block_shape is a placeholder: the autotuner's pre_hook sets the config's tile before each launch.
    return TensorDescriptor(t, [rows, t.shape[-2] * d], [t.stride(-3), 1], [16, d])


def _lse_strides(heads, seqlen_q, total, packed):
    return (0, total) if packed else (heads * seqlen_q, seqlen_q)


def _common(q, k, cu_seqlens, max_seqlen):
    packed = cu_seqlens is not None
    if packed:
        batch, seqlen_q, seqlen_k = cu_seqlens.numel() - 1, 0, 0
        max_q = max_k = int(max_seqlen)
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        max_q, max_k = seqlen_q, seqlen_k
    heads, kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    return packed, batch, seqlen_q, seqlen_k, max_q, max_k, heads, kv_heads, head_dim


def _flags(q, left, right):
    return dict(HEAD_DIM=q.shape[-1], BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])),
                HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
                DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
                EMU_BF16=_INTERPRET and q.dtype == torch.bfloat16)


def _attn_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right, use_tma=None):
    """O (contiguous, q's dtype) and LSE (float32, natural log)."""
    packed, batch, seqlen_q, seqlen_k, max_q, max_k, heads, kv_heads, head_dim = _common(q, k, cu_seqlens,
                                                                                          max_seqlen)
    out = _new(q.shape, q.dtype, q.device)
    total = q.shape[0] if packed else 0
    lse = _new((heads, total) if packed else (batch, heads, seqlen_q), torch.float32, q.device)
    if q.numel() == 0:
        return out, lse
    if k.numel() == 0:  # no key anywhere
        return out.zero_(), lse.fill_(float("-inf"))
    if use_tma is None:
        use_tma = _want_tma(q.device)
    use_tma = use_tma and all(_tma_layout_ok(t, packed) for t in (q, k, v))
    descs = [_descriptor(t, packed) for t in (q, k, v)] if use_tma else [None] * 3
    cu = cu_seqlens.to(q.device) if packed else None
    rows_q, rows_k = (0, 0) if packed else (seqlen_q, seqlen_k)
    grid = lambda meta: (batch * heads, triton.cdiv(max_q, meta["BLOCK_M"]))  # noqa: E731
    _attn_fwd_tuned[grid](
        q, k, v, out, lse, cu, *descs,
        *_seq_strides(q, packed), *_seq_strides(k, packed), *_seq_strides(v, packed),
        *_seq_strides(out, packed), *_lse_strides(heads, seqlen_q, total, packed),
        seqlen_q, seqlen_k, rows_q, rows_k, heads, heads // kv_heads, softmax_scale * LOG2E, left, right,
        VARLEN=packed, USE_TMA=use_tma, **_flags(q, left, right))
    return out, lse


def _attn_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale, left, right,
                   use_tma=None):
    """dQ, dK, dV (contiguous, in the input dtype)."""
    packed, batch, seqlen_q, seqlen_k, max_q, max_k, heads, kv_heads, head_dim = _common(q, k, cu_seqlens,
                                                                                          max_seqlen)
    dq = _new(q.shape, q.dtype, q.device)
    dk = _new(k.shape, k.dtype, k.device)
    dv = _new(v.shape, v.dtype, v.device)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    total = q.shape[0] if packed else 0
    cu = cu_seqlens.to(q.device) if packed else None
    lse_strides = _lse_strides(heads, seqlen_q, total, packed)
    lse = lse.contiguous()
    lse2 = _new(lse.shape, torch.float32, q.device)
    delta = _new(lse.shape, torch.float32, q.device)
    has_dlse = dlse is not None
    flags = _flags(q, left, right)
    prep_rows = 64
    _bwd_prep[(batch * heads, triton.cdiv(max_q, prep_rows))](
        out, dout, dlse.contiguous() if has_dlse else lse, lse, lse2, delta, cu,
        *_seq_strides(out, packed), *_seq_strides(dout, packed), *lse_strides, seqlen_q, heads,
        HEAD_DIM=head_dim, BLOCK_D=flags["BLOCK_D"], VARLEN=packed, HAS_DLSE=has_dlse, BLOCK_M=prep_rows)

    if use_tma is None:
        use_tma = _want_tma(q.device)
    if use_tma and not _tma_layout_ok(dout, packed):
        dout = dout.contiguous()
    use_tma = use_tma and all(_tma_layout_ok(t, packed) for t in (q, k, v, dout))
    descs = [_descriptor(t, packed) for t in (q, k, v, dout)] if use_tma else [None] * 4
    rows_q, rows_k = (0, 0) if packed else (seqlen_q, seqlen_k)
    strides = (*_seq_strides(q, packed), *_seq_strides(k, packed), *_seq_strides(v, packed),
               *_seq_strides(dout, packed))
    group = heads // kv_heads
    grid_kv = lambda meta: (batch * kv_heads, triton.cdiv(max_k, meta["BLOCK_N"]))  # noqa: E731
    _attn_bwd_dkdv_tuned[grid_kv](
        q, k, v, dout, dk, dv, lse2, delta, cu, *descs, *strides, *_seq_strides(dk, packed), *lse_strides,
        seqlen_q, seqlen_k, rows_q, rows_k, kv_heads, group, softmax_scale * LOG2E, softmax_scale, left, right,
        VARLEN=packed, USE_TMA=use_tma, **flags)
    grid_q = lambda meta: (batch * heads, triton.cdiv(max_q, meta["BLOCK_M"]))  # noqa: E731
    _attn_bwd_dq_tuned[grid_q](
        q, k, v, dout, dq, lse2, delta, cu, *descs, *strides, *_seq_strides(dq, packed), *lse_strides,
        seqlen_q, seqlen_k, rows_q, rows_k, heads, group, softmax_scale * LOG2E, softmax_scale, left, right,
        VARLEN=packed, USE_TMA=use_tma, **flags)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Custom ops and autograd (torch.compile traces through them without a graph break)
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("tilewise::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                    max_seqlen: int, softmax_scale: float, left: int, right: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return _attn_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right)


@_flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right):
    heads = q.shape[-2]
    lse_shape = (heads, q.shape[0]) if cu_seqlens is not None else (q.shape[0], heads, q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tilewise::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                    max_seqlen: int, softmax_scale: float, left: int, right: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attn_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale, left, right)


@_flash_attn_bwd.register_fake
def _flash_attn_bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale, left, right):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class FlashAttnFunction(torch.autograd.Function):
    """Forward and backward of flash attention. The same setup_context/backward are registered as the
    autograd formula of the custom op tilewise::flash_attn_fwd, which is what flash_attention calls, so
    eager and torch.compile run one path; FlashAttnFunction.apply is the same computation without the op."""

    @staticmethod
    def forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right):
        return _attn_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.args = (max_seqlen, softmax_scale, left, right)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = torch.ops.tilewise.flash_attn_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd("tilewise::flash_attn_fwd", FlashAttnFunction.backward,
                                setup_context=FlashAttnFunction.setup_context)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------

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
        if torch.compiler.is_compiling():
            return  # the offsets are data: reading them would break the graph; checked in eager runs
        # One small host read, only on the packed path: bad offsets would read out of bounds.
        offsets = cu_seqlens.cpu()
        if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) != q.shape[0]:
            raise ValueError(f"flash_attention: cu_seqlens must start at 0, not decrease, and end at total_tokens={q.shape[0]}")
        if max_seqlen is not None and int((offsets[1:] - offsets[:-1]).max()) > max_seqlen:
            raise ValueError(f"flash_attention: a sequence is longer than max_seqlen={max_seqlen}")


def _effective_window(causal, window):
    """(left, right) with causal folded in; -1 = unbounded. The same rule as attention_mask."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=None, cu_seqlens=None,
                    max_seqlen=None, return_lse=False, deterministic=False):
    """Attention over q, k, v (layout in the module docstring); returns out, or (out, lse).

    Gradients are always deterministic (dQ has its own kernel, no atomics); `deterministic` is accepted
    for flash-attn compatibility. With cu_seqlens under torch.compile, pass max_seqlen (an int).
    """
    check_attention_args(q, k, v, causal, window, cu_seqlens, max_seqlen)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if use_triton(q) and q.dtype != torch.float64:
        left, right = _effective_window(causal, window)
        if cu_seqlens is not None and max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out, lse = torch.ops.tilewise.flash_attn_fwd(q, k, v, cu_seqlens, int(max_seqlen or 0),
                                                     float(softmax_scale), left, right)
        return (out, lse) if return_lse else out
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
