"""Attention: softmax(Q K^T * scale + mask) V, with causal, sliding-window, GQA and packed varlen masks.

Flash attention: the N x N scores never reach HBM.
- Forward: one program per (query block, head, batch). It keeps its Q tile on chip, streams K/V tiles and
  keeps a running row max m, row sum l and an fp32 accumulator (online softmax in base 2: log2(e) is folded
  into the scale; the row max is taken on the raw scores, so each score costs one FMA and one exp2). Key
  blocks come in three phases: the interior, where no mask applies and none is computed, and the boundary
  blocks (causal diagonal, window edges, the ragged end of the keys), where it is. With descriptor loads the
  forward runs all three in one loop, masking by a branch, so its pipeline fills once (3-5% at d128 on the
  H200); the backward kernels keep a loop per phase, which measured faster there. Blocks the mask removes
  entirely are never visited. Writes O and the natural-log LSE.
- Launch order: the query blocks of one head are neighbours in the grid, so the programs running at once
  share a few heads' K/V in L2 (a batch * head-major order streamed every head's K/V from HBM for each
  query block); within a head the heaviest (latest) causal query blocks go first.
- Backward: P = exp2(S * scale * log2(e) - lse2) is recomputed from the saved LSE. A small kernel writes
  delta = rowsum(dO * O) - dLSE and lse2; one kernel per key block accumulates dK and dV over the query
  blocks (with GQA, over the query blocks of every head of its group, in one flat loop); one kernel per
  query block accumulates dQ over the key blocks. No atomics anywhere, so gradients are bitwise repeatable
  whatever `deterministic` says. (dQ fused into the dK/dV kernel instead, each tile's dS K added into an
  fp32 accumulator by a TMA reduce as FlashAttention-2/3 do, was tried twice, dc58f8d and 701f54a, and
  measured slower on the H200: at head_dim 128 1.21 against 0.98 ms for N=2048 causal and 20.7 against
  12.6 ms for N=16384 non-causal, no faster at head_dim 64. The added time matches about 1.3 TB/s of fp32
  reduce traffic.)
- Bytes: forward reads Q and writes O once (plus 4 bytes of LSE per row) and reads K, V once per query
  block, mostly from L2; backward reads Q, K, V, O, dO and writes dQ, dK, dV, re-reading per block in the
  same way. Memory is O(N): no N x N tensor is kept.
- Hopper: on sm_90 the forward of a padded batch without a window, with equal query and key lengths, a
  16-bit dtype and head_dim 64 or 128 runs attention_sm90's Gluon kernel instead (a TMA producer warp,
  two consumer warpgroups, the softmax under the P V wgmma; same O and LSE conventions), and its backward
  (without a dLSE) attention_sm90_bwd's two Gluon kernels after this file's prep kernel, each where it is
  faster: the first call of a shape class times it against the Triton kernel (_gluon_wins; the Gluon kernels
  lose at short causal sequences). TILEWISE_ATTN_GLUON=0 keeps both on the Triton kernels, the ones the
  interpreter runs.
- Loads: when the layout allows it (CUDA sm90+, 16-bit dtype, head_dim a power of two, the heads of a token
  side by side) K, V, Q and dO tiles come through host TMA tensor descriptors; otherwise (and with
  TILEWISE_ATTN_TMA=0) through masked pointer loads. Both are the same kernels (USE_TMA constexpr), and the
  interpreter runs both. A TMA tile may run into the next sequence's rows: such keys are masked (boundary
  phase) and such queries get P = 0 (lse2 = +inf) or are never stored. If no descriptor config compiles
  (another Triton), the pointer path takes over by itself.
- Tiles: each kernel has a short list of (BLOCK_M, BLOCK_N, warps, stages) candidates per head_dim (CONFIGS);
  the first call with a new key (head_dim, mask, dtype, sequence-length class) times them and keeps the
  fastest over 100 ms of calls each (TUNE_REP_MS): long enough for the clocks to settle as in training,
  where a 25 ms timing picked a config the H200 ran at 1980 MHz for a moment and at 1755 MHz sustained
  (bench/attention_clocks.py). TILEWISE_ATTN_AUTOTUNE=0 takes the first that compiles; TILEWISE_ATTN_CONFIGS
  replaces the lists.
  Launches go through ops.launch.FastLauncher: after a key's first call the compiled kernel is launched
  directly (Triton's per-launch Python made short sequences host-bound on the H200's host). A padded batch's
  forward or backward called again with one call signature (shapes, strides, dtypes, alignment, mask, scale)
  goes further: its plan rebuilds only the tensor arguments and launches each kernel with
  BoundLauncher.direct (_forward_plan, _backward_plan).

Conventions (the flash-attn ones):
- q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); heads_q is a
  multiple of heads_kv, and query head h reads key/value head h // (heads_q // heads_kv).
- With cu_seqlens (int32, batch+1 increasing offsets) q, k, v are packed (total_tokens, heads, head_dim)
  and no token attends across a document boundary.
- flash_attention_qkv(qkv, heads_kv) takes q, k, v as one (..., heads_q + 2 * heads_kv, head_dim) tensor,
  the output of a fused projection, and gives it one gradient (split views would get three, concatenated).
- causal with seqlen_q != seqlen_k aligns the mask to the bottom-right: query i sees keys
  j <= i + seqlen_k - seqlen_q. window=(left, right) keeps keys with
  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 means unbounded.
- A query row that sees no key gets output 0 and log-sum-exp -inf.
- return_lse=True also returns the natural-log log-sum-exp of the scaled scores, float32,
  (batch, heads_q, seqlen_q), or (heads_q, total_tokens) when packed. Its gradient flows too.
- float64 inputs run the reference on every device (Triton has no fp64 tensor-core dot).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from . import attention_sm90, attention_sm90_bwd
from .dispatch import INTERPRET as _INTERPRET, use_triton
from .launch import FastLauncher

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host descriptors: pointer loads only
    TensorDescriptor = None

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # read inside a kernel: compiled Triton accepts only constexpr globals


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


# The (batch, head) units a grid of uneven tiles launches together (_grid_tile; gluon_sm90.GRID_SECTION's rule)
_GRID_SECTION = tl.constexpr(16)


@triton.jit
def _grid_tile(UNEVEN: tl.constexpr):
    """(tile, head, batch) of this program of a grid (tiles, heads, batch). UNEVEN (a right window, so causal:
    a unit's tiles differ in work): the programs in launch order take _GRID_SECTION (batch, head) units at a
    time and, in a section, every unit's tile 0, then every unit's tile 1, ... (gluon_sm90.heavy_first), so
    with tile 0 the heaviest the grid ends on light tiles and the SMs run out of work together. Otherwise the
    grid's order: a unit's tiles side by side, sharing its operands in L2."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if UNEVEN:
        n_tiles = tl.num_programs(0)
        heads = tl.num_programs(1)
        t = tile + n_tiles * (h + heads * b)
        first_unit = (t // (_GRID_SECTION * n_tiles)) * _GRID_SECTION
        in_section = t - first_unit * n_tiles
        size = tl.minimum(heads * tl.num_programs(2) - first_unit, _GRID_SECTION)
        tile = in_section // size
        unit = first_unit + in_section % size
        h = unit % heads
        b = unit // heads
    return tile, h, b


@triton.jit
def _query_program(CU, seqlen_q, seqlen_k, group, b0, UNEVEN: tl.constexpr, VARLEN: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """A program of the grid (query blocks, heads, batch), the latest query blocks first (the most causal
    work starts first; UNEVEN: in _grid_tile's order): (its first query row, head, kv head, batch, and the
    sequence's start, seqlen_q, seqlen_k). The kernel returns at once when the first row is past seqlen_q
    (varlen batches)."""
    tile, h, b = _grid_tile(UNEVEN)
    b += b0
    start, sq, sk = _seq_bounds(CU, b, seqlen_q, seqlen_k, VARLEN)
    return (tl.num_programs(0) - 1 - tile) * BLOCK_M, h, h // group, b, start, sq, sk


@triton.jit
def _key_program(CU, seqlen_q, seqlen_k, b0, UNEVEN: tl.constexpr, VARLEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program of the grid (key blocks, kv heads, batch), early key blocks first (seen by the most causal
    queries; UNEVEN: in _grid_tile's order): (its first key row, kv head, batch, and the sequence's start,
    seqlen_q, seqlen_k)."""
    tile, hk, b = _grid_tile(UNEVEN)
    b += b0
    start, sq, sk = _seq_bounds(CU, b, seqlen_q, seqlen_k, VARLEN)
    return tile * BLOCK_N, hk, b, start, sq, sk


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
                qpos, offs_n, offs_d, lo, hi, mask_lo, mask_hi, seqlen_k, left, right, qk_scale,
                MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SIGN: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr):
    """Online softmax over key blocks [lo, hi). m_i is in the scaled base-2 domain; the row maximum is taken
    on the raw scores and scaled once per row, so each score costs one FMA and one exp2. MASKED: 0 no
    block is masked, 1 every block is, 2 (descriptor loads, SIGN > 0) the blocks outside [mask_lo, mask_hi)
    are, by a branch: the interior and boundary blocks in one loop, so the software pipeline fills and
    drains once, not once per phase. H200 at 5f25a2c, tuner's kernel times at d128, one loop against a
    loop per phase: N2048 causal 0.319 / 0.329 ms, N4096 causal 0.585 / 0.618, non-causal 1.064 / 1.113
    (d64 causal 0.704 / 0.697). The backward kernels keep a loop per phase: merged the same way, dK/dV ran
    16% slower at d64 causal and 9% non-causal (not analysed; its lse2 and delta loads were masked in every
    block then), dQ 1-5% slower at three of four shapes."""
    k_offs = offs_n[:, None] * sks + offs_d[None, :]
    v_offs = offs_n[:, None] * svs + offs_d[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N):
        kpos = start_n + offs_n
        start = tl.cast(start_n, tl.int64)
        if USE_TMA:
            k = desc_k.load([k_row + start_n, kv_col])
        else:
            k = _load_tile(k_base + start * sks + k_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED > 0)
        s = _dot(q, tl.trans(k), None, DOT_PREC, EMU_BF16)
        if MASKED == 2:
            if (start_n < mask_lo) | (start_n >= mask_hi):
                keep = _keep(qpos[:, None], kpos[None, :], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: p = 0, not NaN
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
        elif MASKED == 1:
            keep = _keep(qpos[:, None], kpos[None, :], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
            if SIGN > 0:  # masked scores -inf: their exp2 is 0, no second select
                s = tl.where(keep, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: p = 0, not NaN
                p = tl.math.exp2(s * qk_scale - m_use[:, None])
            else:  # a negative scale turns the largest score into the smallest raw one; zero must not
                # meet a masked -inf (inf * 0 = NaN)
                if SIGN < 0:
                    ext = tl.min(tl.where(keep, s, float("inf")), 1)
                else:
                    ext = tl.max(tl.where(keep, s, float("-inf")), 1)
                m_blk = tl.where((ext == float("inf")) | (ext == float("-inf")), float("-inf"), ext * qk_scale)
                m_new = tl.maximum(m_i, m_blk)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.where(keep, tl.math.exp2(s * qk_scale - m_use[:, None]), 0.0)
        else:
            if SIGN < 0:
                m_new = tl.maximum(m_i, tl.min(s, 1) * qk_scale)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = desc_v.load([k_row + start_n, kv_col])
        else:
            v = _load_tile(v_base + start * svs + v_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED > 0)
        acc = _dot(_cast(p, v.dtype, EMU_BF16), v, acc, DOT_PREC, EMU_BF16)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, CU, desc_q, desc_k, desc_v,
              sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
              seqlen_q, seqlen_k, rows_q, rows_k, group, qk_scale, left, right, b0,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr, SIGN: tl.constexpr,
              DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (query blocks, heads, batch): the query blocks of one head run side by side and share its K/V
    in L2; the latest (most causal work) go first (with a right window in _grid_tile's order)."""
    m0, h, hk, b, start, sq, sk = _query_program(CU, seqlen_q, seqlen_k, group, b0, HAS_RIGHT, VARLEN, BLOCK_M)
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
    if USE_TMA and SIGN > 0:   # interior and boundary blocks in one loop (the _fwd_blocks docstring says why)
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                                    qpos, offs_n, offs_d, lo, hi, inner_lo, inner_hi, sk, left, right, qk_scale,
                                    2, HAS_LEFT, HAS_RIGHT, SIGN, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                                    USE_TMA, DOT_PREC, EMU_BF16)
    else:
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                                    qpos, offs_n, offs_d, inner_lo, inner_hi, lo, hi, sk, left, right, qk_scale,
                                    0, HAS_LEFT, HAS_RIGHT, SIGN, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                                    USE_TMA, DOT_PREC, EMU_BF16)
        if HAS_LEFT:
            acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks,
                                        svs, qpos, offs_n, offs_d, lo, inner_lo, lo, hi, sk, left, right, qk_scale,
                                        1, HAS_LEFT, HAS_RIGHT, SIGN, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                                        USE_TMA, DOT_PREC, EMU_BF16)
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row, kv_col, sks, svs,
                                    qpos, offs_n, offs_d, inner_hi, hi, lo, hi, sk, left, right, qk_scale,
                                    1, HAS_LEFT, HAS_RIGHT, SIGN, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                                    USE_TMA, DOT_PREC, EMU_BF16)

    empty = l_i == 0.0  # the row sees no key: output 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]  # one division per row, not per element
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    o_ptrs = O + b64 * sob + start64 * sos + h64 * soh + offs_m.to(tl.int64)[:, None] * sos + offs_d[None, :]
    _store_tile(o_ptrs, _cast(out, O.dtype.element_ty, EMU_BF16), offs_m, sq, offs_d, HEAD_DIM)
    tl.store(LSE + b64 * slb + h64 * slh + start64 + offs_m, lse, mask=offs_m < sq)


@triton.jit
def _row_block(CU, seqlen, b0, VARLEN: tl.constexpr, ROWS: tl.constexpr):
    """A program of a grid (row blocks, heads, batch) over rows of one head of one sequence, as the passes
    run: (head, batch, the sequence's start and length, the block's first row). The kernel returns at once
    when that row is past the length (varlen batches)."""
    h = tl.program_id(1)
    b = tl.program_id(2) + b0
    start, n, _ = _seq_bounds(CU, b, seqlen, seqlen, VARLEN)
    return h, b, start, n, tl.program_id(0) * ROWS


@triton.jit
def _head_rows(X, sb, ss, sh, b, start, h, rows, offs_d):
    """Pointers to the (rows, offs_d) elements of head h of sequence b (from its token `start`) of a tensor
    with batch, token and head strides sb, ss, sh: int64 offsets."""
    return (X + b.to(tl.int64) * sb + start.to(tl.int64) * ss + h.to(tl.int64) * sh
            + rows.to(tl.int64)[:, None] * ss + offs_d[None, :])


@triton.jit
def _bwd_prep(O, DO, DLSE, LSE, LSE2, DELTA, CU,
              sob, sos, soh, sdb, sds, sdh, slb, slh, seqlen_q, b0,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr,
              BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) - dLSE and lse2 = lse * log2(e), +inf where lse = -inf (then P = 0)."""
    h, b, start, sq, m0 = _row_block(CU, seqlen_q, b0, VARLEN, BLOCK_M)
    if m0 >= sq:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(_head_rows(O, sob, sos, soh, b, start, h, offs_m, offs_d), offs_m, sq, offs_d, HEAD_DIM, BLOCK_D,
                   True)
    do = _load_tile(_head_rows(DO, sdb, sds, sdh, b, start, h, offs_m, offs_d), offs_m, sq, offs_d, HEAD_DIM,
                    BLOCK_D, True)
    row = b.to(tl.int64) * slb + h.to(tl.int64) * slh + start.to(tl.int64) + offs_m
    _store_delta_lse2(o, do, DLSE, LSE, LSE2, DELTA, row, offs_m < sq, HAS_DLSE)


@triton.jit
def _store_delta_lse2(o, do, DLSE, LSE, LSE2, DELTA, row, mask, HAS_DLSE: tl.constexpr):
    """The prep kernels' shared rows (this module's and fp8_attention's dO pass): delta = rowsum(dO * O) - dLSE
    and lse2 = lse * log2(e), stored at the LSE layout's offsets `row`."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + row, mask=mask, other=0.0)
    lse = tl.load(LSE + row, mask=mask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + row, delta, mask=mask)
    tl.store(LSE2 + row, lse2, mask=mask)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, desc_q, desc_do, q_row, q_col, lse2_ptr, delta_ptr,
               start_m, kpos, offs_m, offs_d, seqlen_q, seqlen_k, off, left, right, qk_scale,
               MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr):
    """One query block's share of dK, dV, in the transposed (key, query) frame: P^T = exp2(K Q^T c - lse2),
    dV += P^T dO, dS^T = P^T * (V dO^T - delta), dK += dS^T Q."""
    rows = start_m + offs_m
    if USE_TMA:
        q = desc_q.load([q_row + start_m, q_col])
        do = desc_do.load([q_row + start_m, q_col])
    else:
        q = _load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        do = _load_tile(do_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    if MASKED:
        lse2 = tl.load(lse2_ptr + rows, mask=rows < seqlen_q, other=float("inf"))
        delta = tl.load(delta_ptr + rows, mask=rows < seqlen_q, other=0.0)
    else:
        lse2 = tl.load(lse2_ptr + rows)
        delta = tl.load(delta_ptr + rows)
    s_t = _dot(k, tl.trans(q), None, DOT_PREC, EMU_BF16)
    p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
    if MASKED:
        keep = _keep(rows[None, :] + off, kpos[:, None], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
        p_t = tl.where(keep & (rows[None, :] < seqlen_q), p_t, 0.0)
    dv = _dot(_cast(p_t, do.dtype, EMU_BF16), do, dv, DOT_PREC, EMU_BF16)
    dp_t = _dot(v, tl.trans(do), None, DOT_PREC, EMU_BF16)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = _dot(_cast(ds_t, q.dtype, EMU_BF16), q, dk, DOT_PREC, EMU_BF16)
    return dk, dv


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, LSE2, DELTA, desc_q, desc_do, q_row, h0, group,
                 sqs, sqh, sds, sdh, slh, kpos, offs_m, offs_d, lo, hi, seqlen_q, seqlen_k, off, left, right,
                 qk_scale, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr):
    """dK, dV of one key block over query blocks [lo, hi) of query head h0 or, with GQA, of each of the
    group's heads h0 .. h0 + group - 1: one flat loop over (head, block) pairs, never a loop around loops
    (that keeps the accumulators in registers: nested loops made ptxas spill them)."""
    q_offs = offs_m[:, None] * sqs + offs_d[None, :]
    do_offs = offs_m[:, None] * sds + offs_d[None, :]
    if GQA:
        n_blocks = (hi - lo + BLOCK_M - 1) // BLOCK_M
        for it in tl.range(0, n_blocks * group):
            g = it // n_blocks
            start_m = lo + (it - g * n_blocks) * BLOCK_M
            g64 = g.to(tl.int64)
            sm64 = tl.cast(start_m, tl.int64)
            dk, dv = _dkdv_step(dk, dv, k, v, q_base + g64 * sqh + sm64 * sqs + q_offs,
                                do_base + g64 * sdh + sm64 * sds + do_offs, desc_q, desc_do, q_row,
                                (h0 + g) * HEAD_DIM, LSE2 + l_base + g64 * slh, DELTA + l_base + g64 * slh,
                                start_m, kpos, offs_m, offs_d, seqlen_q, seqlen_k, off, left, right, qk_scale,
                                MASKED, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, USE_TMA, DOT_PREC, EMU_BF16)
    else:
        for start_m in tl.range(lo, hi, BLOCK_M):
            sm64 = tl.cast(start_m, tl.int64)
            dk, dv = _dkdv_step(dk, dv, k, v, q_base + sm64 * sqs + q_offs, do_base + sm64 * sds + do_offs,
                                desc_q, desc_do, q_row, h0 * HEAD_DIM, LSE2 + l_base, DELTA + l_base,
                                start_m, kpos, offs_m, offs_d, seqlen_q, seqlen_k, off, left, right, qk_scale,
                                MASKED, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, USE_TMA, DOT_PREC, EMU_BF16)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, CU, desc_q, desc_k, desc_v, desc_do,
                   sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
                   sgb, sgs, sgh, slb, slh,
                   seqlen_q, seqlen_k, rows_q, rows_k, group, qk_scale, softmax_scale, left, right, b0,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr, GQA: tl.constexpr,
                   DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (key blocks, kv heads, batch); dK and dV are written (contiguous, strides sg*). Early key
    blocks are seen by the most causal queries: they go first (_key_program)."""
    n0, hk, b, start, sq, sk = _key_program(CU, seqlen_q, seqlen_k, b0, HAS_RIGHT, VARLEN, BLOCK_N)
    if n0 >= sk:
        return
    h0 = hk * group
    b64, hk64, h64, start64 = b.to(tl.int64), hk.to(tl.int64), h0.to(tl.int64), start.to(tl.int64)
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
    q_base = Q + b64 * sqb + start64 * sqs + h64 * sqh
    do_base = DO + b64 * sdb + start64 * sds + h64 * sdh
    l_base = b64 * slb + h64 * slh + start64
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, LSE2, DELTA, desc_q, desc_do, q_row, h0, group,
                          sqs, sqh, sds, sdh, slh, offs_n, offs_m, offs_d, inner_lo, inner_hi, sq, sk, off,
                          left, right, qk_scale, False, HAS_LEFT, HAS_RIGHT, GQA, HEAD_DIM, BLOCK_D, BLOCK_M,
                          USE_TMA, DOT_PREC, EMU_BF16)
    if HAS_RIGHT:
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, LSE2, DELTA, desc_q, desc_do, q_row, h0,
                              group, sqs, sqh, sds, sdh, slh, offs_n, offs_m, offs_d, lo, inner_lo, sq, sk, off,
                              left, right, qk_scale, True, HAS_LEFT, HAS_RIGHT, GQA, HEAD_DIM, BLOCK_D, BLOCK_M,
                              USE_TMA, DOT_PREC, EMU_BF16)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, LSE2, DELTA, desc_q, desc_do, q_row, h0, group,
                          sqs, sqh, sds, sdh, slh, offs_n, offs_m, offs_d, inner_hi, hi, sq, sk, off,
                          left, right, qk_scale, True, HAS_LEFT, HAS_RIGHT, GQA, HEAD_DIM, BLOCK_D, BLOCK_M,
                          USE_TMA, DOT_PREC, EMU_BF16)
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
        s = _dot(q, tl.trans(k), None, DOT_PREC, EMU_BF16)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
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
                 seqlen_q, seqlen_k, rows_q, rows_k, group, qk_scale, softmax_scale, left, right, b0,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr,
                 DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (query blocks, heads, batch), latest query blocks first; dQ is written (contiguous, strides sg*)."""
    m0, h, hk, b, start, sq, sk = _query_program(CU, seqlen_q, seqlen_k, group, b0, HAS_RIGHT, VARLEN, BLOCK_M)
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
# Configs: candidates per kernel and head_dim, one chosen per key (timed on its first call)
# ----------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head_dim class (64: head_dim <= 64, 128: <= 128,
# 256: <= 256), the first of a load path its default when nothing is timed; a fifth element "tma" or "ptr"
# keeps an entry to that load path. Each compiles for sm_90 without register spills on its paths (an AOT
# check with ptxas, Triton 3.9; head_dim 256 dK/dV is the exception, with the fewest spills found). What
# spills: a 128-row tile with 4 warps at head_dim 128, a 128x128 score tile with 4 warps, dK/dV with
# 64 x 128 tiles at head_dim 128; the pointer path holds more addresses in registers than the descriptor
# path. BLOCK_M 64 entries serve short sequences, where more, shorter programs fill the GPU better.
# The H200 sweep (bench/attention.py --sweep) added the fastest neighbours: dK/dV at head_dim 128 runs
# best with 64 x 64 tiles, 4 warps and 2 stages (7.7 vs 8.2 ms at N=16k), dQ with 4 stages. That dK/dV
# entry is the exception at head_dim 128: its causal descriptor build has 38 local loads/stores (Triton 3.9),
# its pointer builds 92 and 239, so it is kept to the descriptor path.
# H200: 227 KB of shared memory per block, 64K registers per SM.
CONFIGS = {
    "fwd": {64: [(128, 128, 8, 3), (128, 64, 4, 3, "tma"), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3)],
            128: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (128, 128, 8, 2, "tma"),
                  (128, 128, 8, 3, "tma")],
            256: [(128, 32, 8, 2), (64, 64, 8, 2, "tma"), (128, 64, 8, 2, "tma")]},
    "dkdv": {64: [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2)],
             128: [(64, 64, 4, 2, "tma"), (32, 64, 4, 3), (32, 128, 8, 3), (32, 64, 4, 4)],
             256: [(16, 64, 8, 2, "tma"), (32, 32, 8, 2, "ptr"), (16, 32, 4, 2, "ptr")]},
    "dq": {64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3)],
           128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 2, "tma")],
           256: [(64, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2, "tma")]},
}
# The tuner's timing of a candidate: as the benchmark's (shared/BENCH.md), so a config whose clocks drop
# under sustained load is timed at the speed it keeps (see the module docstring).
TUNE_WARMUP_MS, TUNE_REP_MS = 25, 100
_INTERPRET_CONFIG = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
_MAX_GRID_YZ = 65535  # CUDA's limit on grid dims 1 and 2 (heads, batch); a larger batch is launched in chunks


class NoConfigError(RuntimeError):
    """No candidate config of a kernel compiled and ran for a key."""


def _env_configs(var="TILEWISE_ATTN_CONFIGS", names=None):
    """TILEWISE_ATTN_CONFIGS='fwd=128,64,8,3/64,64,4,3;dq=128,64,8,2' replaces a kernel's candidates (`var`
    and the kernel `names` it may set: another family of kernels, such as the FP8 ones, has its own)."""
    names = CONFIGS if names is None else names
    text = os.environ.get(var, "").strip()
    if not text:
        return {}
    out = {}
    try:
        for part in filter(None, text.split(";")):
            name, cfgs = part.split("=")
            out[name.strip()] = [tuple(int(x) for x in c.split(",")) for c in cfgs.split("/")]
        assert all(name in names and all(len(c) == 4 for c in cs) for name, cs in out.items())
    except (ValueError, AssertionError):
        example = ";".join(f"{n}=..." for n in names)
        raise ValueError(f"{var}={text!r}: expected 'NAME=BM,BN,WARPS,STAGES/...' per kernel, e.g. {example}")
    return out


class _Kernel:
    """A kernel and the config it runs with per key. The key holds what changes the best tile (the
    constexpr flags, the dtype, the sequence-length bucket); on the first call with a key every candidate
    is timed (TILEWISE_ATTN_AUTOTUNE=0: the first that compiles is taken, untimed). A candidate that fails
    to compile or launch is skipped; when none is left the key raises NoConfigError."""

    def __init__(self, name, fn, table=None, interpret_config=None, env_var="TILEWISE_ATTN_CONFIGS"):
        self.name, self.fn = name, fn
        self.launcher = FastLauncher(fn)   # Triton's per-launch Python, skipped after a key's first call
        # The family's table {kernel name: {head_dim class: candidates}} (CONFIGS here; set_candidates edits
        # it in place), the one config the interpreter runs, and the variable that may replace candidates.
        self.table = CONFIGS if table is None else table
        self.interpret_config = _INTERPRET_CONFIG[name] if interpret_config is None else interpret_config
        self.env_var = env_var
        self.chosen = {}   # key -> config
        self.bound = {}    # key -> (config, its BoundLauncher), from the key's second call on
        self.plans = {}    # a caller's call signature -> its direct launch plan (see _attn_forward)
        self.failed = {}   # key -> NoConfigError
        self.timings = {}  # key -> {config: ms, or the error it raised, or None when untimed}
        self.described = {}  # key -> its fields by name, for tuning_report()

    def candidates(self, block_d, use_tma):
        if _INTERPRET:
            return [self.interpret_config]
        override = _env_configs(self.env_var, self.table).get(self.name)
        if override:
            return override
        cls = 64 if block_d <= 64 else 128 if block_d <= 128 else 256
        path = "tma" if use_tma else "ptr"
        return [tuple(c[:4]) for c in self.table[self.name][cls] if len(c) == 4 or c[4] == path]

    def launch(self, cfg, grid, args, consts):
        bm, bn, warps, stages = cfg
        self.launcher(grid(bm, bn), *args(bm, bn), **consts, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                      num_stages=stages)

    def __call__(self, key, grid, args, consts):
        bound = self.bound.get(key)
        if bound is not None:   # the launcher with this key's constexprs and options fixed: no kwargs to hash
            bm, bn = bound[0][:2]
            bound[1](grid(bm, bn), *args(bm, bn))
            return
        cfg = self.chosen.get(key)
        if cfg is None:
            cfg, done = self._choose(key, grid, args, consts)
            if done:  # the untimed choice has just run with these arguments
                return
        self.launch(cfg, grid, args, consts)
        bm, bn, warps, stages = cfg
        self.bound[key] = (cfg, self.launcher.bind(**consts, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                                   num_stages=stages))

    def _choose(self, key, grid, args, consts):
        if key in self.failed:
            raise self.failed[key]
        cands = self.candidates(consts["BLOCK_D"], consts.get("USE_TMA", False))
        timed = len(cands) > 1 and os.environ.get("TILEWISE_ATTN_AUTOTUNE", "1") != "0"
        results, best, best_ms, last = {}, None, math.inf, None
        for cfg in cands:
            try:
                self.launch(cfg, grid, args, consts)  # compiles on first use
                if not timed:
                    results[cfg], best = None, cfg
                    break
                ms = triton.testing.do_bench(lambda: self.launch(cfg, grid, args, consts), warmup=TUNE_WARMUP_MS,
                                             rep=TUNE_REP_MS, return_mode="median")
            except Exception as e:  # noqa: BLE001 - any failure of one config (compiler, resources, launch)
                if _INTERPRET:
                    raise
                last = e
                results[cfg] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
                continue
            results[cfg] = ms
            if ms < best_ms:
                best, best_ms = cfg, ms
        self.timings[key] = results
        self.described[key] = {"seqlen_bucket": key[0], "dtype": str(key[1]).replace("torch.", ""), **consts}
        if best is None:
            err = NoConfigError(f"flash_attention: no {self.name} config compiled and ran for key {key}: {results}")
            err.__cause__ = last
            self.failed[key] = err
            raise err
        self.chosen[key] = best
        return best, not timed


_FWD = _Kernel("fwd", _attn_fwd)
_DKDV = _Kernel("dkdv", _attn_bwd_dkdv)
_DQ = _Kernel("dq", _attn_bwd_dq)
_KERNELS = (_FWD, _DKDV, _DQ)
fallbacks: list = []  # (kernel, key, error) each time the descriptor path gave way to pointer loads


def set_candidates(name, configs, head_dim=None):
    """Replace kernel `name`'s candidates ('fwd', 'dkdv', 'dq') for one head_dim class or all, on both
    load paths, and forget the configs chosen so far (the benchmark's sweep uses this)."""
    classes = [head_dim] if head_dim is not None else list(CONFIGS[name])
    for c in classes:
        CONFIGS[name][c] = [tuple(cfg) for cfg in configs]
    reset_tuning()


def reset_tuning(kernels=None):
    for kern in _KERNELS if kernels is None else kernels:
        kern.chosen.clear()
        kern.bound.clear()
        kern.plans.clear()
        kern.failed.clear()
        kern.timings.clear()
        kern.described.clear()
    if kernels is None:
        _GLUON_RACES.clear()
    fallbacks.clear()


def tuning_report(kernels=None, races=None):
    """{kernel: [{"key": {...}, "chosen": config or None, "ms": {config: ms or error}}]} of this process, and
    under "gluon_vs_triton" the Gluon races whose pass starts with `races` (all of them for kernels=None)."""
    report = {}
    for kern in _KERNELS if kernels is None else kernels:
        rows = []
        for key, results in kern.timings.items():
            rows.append({"key": kern.described[key],
                         "chosen": kern.chosen.get(key),
                         "ms": {",".join(map(str, c)): (round(v, 4) if isinstance(v, float) else v)
                                for c, v in results.items()}})
        report[kern.name] = rows
    races = "" if kernels is None and races is None else races
    if races is not None:
        report["gluon_vs_triton"] = [
            {"key": dict(zip(("pass", "seqlen_bucket", "batch_heads_bucket", "head_dim", "gqa", "causal", "dtype"),
                             (*key[:-1], str(key[-1]).replace("torch.", "")))),
             "chosen": race["winner"], "ms": {"gluon": round(race["gluon"], 4), "triton": round(race["triton"], 4)}}
            for key, race in _GLUON_RACES.items() if key[0].startswith(races)]
    return report


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

# Outputs start as NaN in the interpreter and with TILEWISE_NAN_FILL=1 (read at import), so unwritten
# elements show.
_NAN_FILL = _INTERPRET or os.environ.get("TILEWISE_NAN_FILL", "0") == "1"


def _new(shape, dtype, device):
    if _NAN_FILL:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _seq_strides(t, packed):
    """(batch, seq, head) strides; a packed tensor has no batch stride (documents are row ranges)."""
    st = t.stride()
    return (0, st[0], st[1]) if packed else st[:3]


@functools.lru_cache(maxsize=None)
def _is_sm90(index) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _tma_mode(device) -> str:
    """'off', 'auto' (descriptors on sm90+, pointer loads if no descriptor config compiles) or 'on'
    (descriptors, an error if they fail: TILEWISE_ATTN_TMA=1, as the tests use it)."""
    flag = os.environ.get("TILEWISE_ATTN_TMA", "auto").strip().lower()
    if flag in ("0", "off", "false"):
        return "off"
    if flag in ("1", "on", "true"):
        return "on"
    if TensorDescriptor is None:
        return "off"
    return "auto" if device.type == "cuda" and _is_sm90(device.index) else "off"


def _tma_layout_ok(t, packed) -> bool:
    """A (rows, heads * head_dim) 2-D view with 16-byte aligned rows exists: TMA can tile it."""
    shape, st = t.shape, t.stride()
    d = shape[-1]
    if t.dtype not in (torch.float16, torch.bfloat16) or d < 16 or d & (d - 1) or t.numel() == 0:
        return False
    heads, row_stride = shape[-2], st[-3]
    if st[-1] != 1 or st[-2] != d or row_stride < heads * d:
        return False
    if (row_stride * t.element_size()) % 16 or t.data_ptr() % 16:
        return False
    return packed or shape[0] == 1 or st[0] == shape[1] * row_stride


def _fast_descriptor(defaults, t, shape, strides, block):
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(defaults)
    desc.base, desc.shape, desc.strides, desc.block_shape = t, shape, strides, block
    return desc


def _descriptor_defaults():
    """The default fields of this Triton's TensorDescriptor dataclass, if filling them directly gives what
    its constructor gives (checked once on a small CPU tensor); else None and the constructor is used."""
    try:
        fields = dataclasses.fields(TensorDescriptor)
        defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        t = torch.empty(16, 16, dtype=torch.bfloat16)
        ref = TensorDescriptor(t, [16, 16], [16, 1], [16, 16])
        fast = _fast_descriptor(defaults, t, [16, 16], [16, 1], [16, 16])
        same = all(getattr(fast, f.name) is getattr(ref, f.name) or getattr(fast, f.name) == getattr(ref, f.name)
                   for f in fields)
        return defaults if same and type(fast) is type(ref) else None
    except Exception:  # noqa: BLE001 - not a plain dataclass in this Triton: use the constructor
        return None


_DESC_DEFAULTS = _descriptor_defaults() if TensorDescriptor is not None else None


def _descriptor(t, packed, block_rows):
    """The (rows, heads * head_dim) view of t as a host TMA descriptor with (block_rows, head_dim) tiles.
    _tma_layout_ok has checked what TensorDescriptor's __post_init__ checks (16-byte alignment, unit last
    stride, non-empty), so the fields are filled directly: the checks cost more host time than the rest of
    a launch."""
    rows = t.shape[0] if packed else t.shape[0] * t.shape[1]
    d = t.shape[-1]
    shape, strides, block = [rows, t.shape[-2] * d], [t.stride(-3), 1], [block_rows, d]
    if _DESC_DEFAULTS is None:
        return TensorDescriptor(t, shape, strides, block)
    return _fast_descriptor(_DESC_DEFAULTS, t, shape, strides, block)


def _tile_descriptors(use_tma, packed, bm, bn, q, k, v, dout=None):
    """The kernels' descriptor arguments: Q (and dO) in query tiles, K and V in key tiles; Nones on the
    pointer path."""
    n = 3 if dout is None else 4
    if not use_tma:
        return (None,) * n
    descs = (_descriptor(q, packed, bm), _descriptor(k, packed, bn), _descriptor(v, packed, bn))
    return descs if dout is None else descs + (_descriptor(dout, packed, bm),)


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


def _cdiv(a, b):  # plain Python: triton.cdiv is a constexpr function with a per-call cost in new Tritons
    return -(-a // b)


def _pow2(n):
    return 1 << max(n - 1, 0).bit_length()


def _flags(q, left, right):
    return dict(HEAD_DIM=q.shape[-1], BLOCK_D=max(16, _pow2(q.shape[-1])),
                HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, VARLEN=False,
                DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
                EMU_BF16=_INTERPRET and q.dtype == torch.bfloat16)


def _bucket(max_q, max_k):
    """Sequence-length class of a tuning key: powers of two from 256 to 16384."""
    return min(max(_pow2(max(max_q, max_k, 1)), 256), 16384)


def _run(kern, tma, key, batch, grid, args, consts) -> bool:
    """Launch over batch chunks of at most 65535 (grid dim 2): on the descriptor path when `tma` is 'auto'
    or 'on', pointer loads when 'off'; 'auto' falls back to pointer loads when no descriptor config of
    this key compiles (and notes it in `fallbacks`). Returns whether the descriptor path ran."""
    for b0 in range(0, batch, _MAX_GRID_YZ):
        nb = min(batch - b0, _MAX_GRID_YZ)
        g = lambda bm, bn: grid(bm, bn, nb)  # noqa: E731
        if tma != "off":
            try:
                kern(key + (True,), g, lambda bm, bn: args(bm, bn, True, b0), {**consts, "USE_TMA": True})
                continue
            except NoConfigError as e:
                if tma == "on":
                    raise
                if not any(f[0] == kern.name and f[1] == key for f in fallbacks):
                    fallbacks.append((kern.name, key, str(e.__cause__ or e)[:300]))
        kern(key + (False,), g, lambda bm, bn: args(bm, bn, False, b0), {**consts, "USE_TMA": False})
        tma = "off"   # later chunks take the path this one took
    return tma != "off"


_MAX_PLANS = 1024   # call signatures with a plan (a KV-cache decode makes a new one every token: past the
                    # cap they take the keyed path)


def _forward_signature(q, k, v, softmax_scale, left, right):
    """What fixes every argument of a padded-batch forward launch but the tensors' addresses, and the classes
    of those: shapes, strides, dtypes, device, 16-byte alignment, the mask, the scale and the TMA switch."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, softmax_scale, left, right,
            os.environ.get("TILEWISE_ATTN_TMA"))


def _forward_plan(key, use_tma, args, grid, lse_shape):
    """The forward of one call signature as a direct launch (ops.launch.BoundLauncher.direct): the same
    arguments as the keyed path's, built from the signature's constants and the new tensors; None until the
    key's config is bound (its second call) and while fast launches are switched off, False where the direct
    launch does not apply (the interpreter: the signature keeps the keyed path)."""
    direct = _direct_launch(_FWD, key, use_tma, args, grid, 9)   # 6 tensors and 3 descriptors lead
    if not direct:
        return direct
    launch, grid, scalars, bm, bn = direct

    def forward(q, k, v):
        out = _new(q.shape, q.dtype, q.device)
        lse = _new(lse_shape, torch.float32, q.device)
        launch(grid, q, k, v, out, lse, None, *_tile_descriptors(use_tma, False, bm, bn, q, k, v), *scalars)
        return out, lse
    return forward


def _direct_launch(kern, key, use_tma, args, grid, n_lead):
    """(launch, grid, scalars, bm, bn): kern's direct launch for the config bound to key on the path taken,
    the grid, and the arguments after the first n_lead (constant for a call signature), from the keyed path's
    args(bm, bn, use_tma, b0) and grid(bm, bn, nb); None before the key is bound and while fast launches are
    switched off, False where the direct launch does not apply (BoundLauncher.planned)."""
    bound = kern.bound.get(key + (use_tma,))
    if bound is None:
        return None
    (bm, bn), launcher = bound[0][:2], bound[1]
    example = args(bm, bn, use_tma, 0)
    launch = launcher.planned(example)
    if not launch:
        return launch
    return launch, grid(bm, bn, example[0].shape[0]), example[n_lead:], bm, bn


# The Gluon kernels (attention_sm90 forward, attention_sm90_bwd backward) take the padded-batch calls they
# cover on sm_90; TILEWISE_ATTN_GLUON=0 keeps every call on the Triton kernels below, which are also what the
# interpreter and CI run.
_GLUON = os.environ.get("TILEWISE_ATTN_GLUON", "1") != "0"


def _gluon_forward_applies(q, k, v, softmax_scale, left, right) -> bool:
    """Whether attention_sm90.forward computes this padded-batch call: no window (causal or not), equal
    sequence lengths, a 16-bit dtype, head_dim 64 or 128, a positive scale, and token rows TMA can tile in
    place (see attention_sm90.token_rows)."""
    return (_GLUON and left < 0 and right <= 0 and q.is_cuda and q.shape[1] == k.shape[1]
            and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in attention_sm90.CONFIGS
            and softmax_scale > 0 and q.numel() > 0 and q.shape[0] <= _MAX_GRID_YZ
            and q.shape[2] <= _MAX_GRID_YZ and all(attention_sm90.token_rows(t) is not None for t in (q, k, v))
            and attention_sm90.available(q.device))


# Whether a covered call runs the Gluon kernel or the Triton one is measured, not assumed: the first call of a
# key (pass, sequence-length and batch x heads classes, head_dim, GQA, causal, dtype) times both, as the config
# tuner times configs, and keeps the faster. On the H200 (2a6ac2d, 0b78516) the Gluon forward won from
# seqlen 2048 up (4 x 4096 x 16, d128 causal: 493 against 435 TFLOP/s) and lost at 1024 (16 x 1024 x 32, d64
# causal: 232 against 297), and in the GPT-2 124M step (32 x 1024 x 12, d64 causal) the Gluon backward took
# 8.3 ms against the Triton one's 6.9. With TILEWISE_ATTN_AUTOTUNE=0 the Gluon kernel runs, untimed.
_GLUON_RACES: dict = {}   # key -> {"gluon": ms, "triton": ms, "winner": "gluon" or "triton"}


_TRITON_ONLY = [False]


@contextlib.contextmanager
def triton_kernels_only():
    """Inside the block every raced call takes its Triton kernel, and no race is run: the benchmarks'
    Triton baselines (fp8_attention's calls included)."""
    old, _TRITON_ONLY[0] = _TRITON_ONLY[0], True
    try:
        yield
    finally:
        _TRITON_ONLY[0] = old


def _gluon_key(kind, q, k, right):
    batch, seqlen, heads, head_dim = q.shape
    return kind, _bucket(seqlen, seqlen), _pow2(batch * heads), head_dim, k.shape[2] != heads, right == 0, q.dtype


def _gluon_wins(kind, q, k, right, gluon_call, triton_call) -> bool:
    """Whether the Gluon kernel runs this call (see _GLUON_RACES); the first call of a key races the two."""
    if _TRITON_ONLY[0]:
        return False
    key = _gluon_key(kind, q, k, right)
    race = _GLUON_RACES.get(key)
    if race is None:
        if os.environ.get("TILEWISE_ATTN_AUTOTUNE", "1") == "0":
            return True
        ms = {}
        for name, call in (("triton", triton_call), ("gluon", gluon_call)):
            call()   # compiles (and tunes the Triton kernel's config) outside the timing
            ms[name] = triton.testing.do_bench(call, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median")
        race = _GLUON_RACES[key] = {**ms, "winner": min(ms, key=ms.get)}
    return race["winner"] == "gluon"


def _gluon_backward_applies(q, k, v, dlse, softmax_scale, left, right, grads) -> bool:
    """Whether attention_sm90_bwd.backward computes this padded-batch backward: the forward's conditions,
    no gradient of the LSE, and given gradients (the fused-QKV views) in token rows, dK's strides dV's."""
    return (dlse is None and _gluon_forward_applies(q, k, v, softmax_scale, left, right)
            and attention_sm90_bwd.available(q.device)
            and (grads is None or (all(attention_sm90.token_rows(g) is not None for g in grads)
                                   and grads[1].stride() == grads[2].stride())))


def _attn_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right):
    """O (contiguous, q's dtype) and LSE (float32, natural log), from the Gluon forward where it covers the
    call and wins (_gluon_wins), else from the Triton one."""
    if cu_seqlens is None and _gluon_forward_applies(q, k, v, softmax_scale, left, right):
        def gluon():
            return attention_sm90.forward(q, k, v, causal=right == 0, softmax_scale=softmax_scale)
        if _gluon_wins("fwd", q, k, right, gluon,
                       lambda: _triton_forward(q, k, v, None, max_seqlen, softmax_scale, left, right)):
            return gluon()
    return _triton_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right)


def _triton_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right):
    """_attn_forward on the Triton kernel. A padded batch's call signature seen before launches through its
    plan (_forward_plan): the Python below, a third of the forward's host time on the H200's host, runs once
    per signature."""
    sig = None
    if cu_seqlens is None:
        sig = _forward_signature(q, k, v, softmax_scale, left, right)
        plan = _FWD.plans.get(sig)
        if plan:
            return plan(q, k, v)
    packed, batch, seqlen_q, seqlen_k, max_q, max_k, heads, kv_heads, head_dim = _common(q, k, cu_seqlens,
                                                                                          max_seqlen)
    out = _new(q.shape, q.dtype, q.device)
    total = q.shape[0] if packed else 0
    lse = _new((heads, total) if packed else (batch, heads, seqlen_q), torch.float32, q.device)
    if q.numel() == 0:
        return out, lse
    if k.numel() == 0:  # no key anywhere
        return out.zero_(), lse.fill_(float("-inf"))
    tma = _tma_mode(q.device)
    if tma != "off" and not all(_tma_layout_ok(t, packed) for t in (q, k, v)):
        tma = "off"
    cu = cu_seqlens.to(q.device) if packed else None
    rows_q, rows_k = (0, 0) if packed else (seqlen_q, seqlen_k)
    scalars = (*_seq_strides(q, packed), *_seq_strides(k, packed), *_seq_strides(v, packed),
               *_seq_strides(out, packed), *_lse_strides(heads, seqlen_q, total, packed),
               seqlen_q, seqlen_k, rows_q, rows_k, heads // kv_heads, softmax_scale * LOG2E, left, right)

    def args(bm, bn, use_tma, b0):
        return (q, k, v, out, lse, cu if packed else None, *_tile_descriptors(use_tma, packed, bm, bn, q, k, v),
                *scalars, b0)

    consts = _flags(q, left, right)
    consts["VARLEN"] = packed
    consts["SIGN"] = (softmax_scale > 0) - (softmax_scale < 0)
    key = (_bucket(max_q, max_k), q.dtype, *consts.values())
    grid = lambda bm, bn, nb: (_cdiv(max_q, bm), heads, nb)  # noqa: E731
    use_tma = _run(_FWD, tma, key, batch, grid, args, consts)
    if sig is not None and sig not in _FWD.plans and batch <= _MAX_GRID_YZ and len(_FWD.plans) < _MAX_PLANS:
        plan = _forward_plan(key, use_tma, args, grid, lse.shape)
        if plan is not None:
            _FWD.plans[sig] = plan
    return out, lse


_bwd_prep_launch = FastLauncher(_bwd_prep)
_PREP_ROWS = 64
_prep_launchers: dict = {}   # (head_dim, packed, has_dlse) -> the prep kernel's launcher, constexprs bound


def _backward_prep(dout, out, lse, dlse, cu, batch, seqlen_q, max_q, heads, total, record=None):
    """(lse2, delta) of the backward: lse * log2(e) (+inf for rows that see no key) and rowsum(dO * O) - dLSE,
    both in the LSE's layout. dout has a unit last stride. record: a list that gets each launch's
    (launcher, grid, arguments)."""
    packed = cu is not None
    head_dim = out.shape[-1]
    lse = lse.contiguous()
    lse2 = _new(lse.shape, torch.float32, out.device)
    delta = _new(lse.shape, torch.float32, out.device)
    has_dlse = dlse is not None
    launcher = _prep_launchers.get((head_dim, packed, has_dlse))
    if launcher is None:
        launcher = _prep_launchers[head_dim, packed, has_dlse] = _bwd_prep_launch.bind(
            HEAD_DIM=head_dim, BLOCK_D=max(16, _pow2(head_dim)), VARLEN=packed, HAS_DLSE=has_dlse,
            BLOCK_M=_PREP_ROWS)
    dlse_arg = dlse.contiguous() if has_dlse else lse
    for b0 in range(0, batch, _MAX_GRID_YZ):
        nb = min(batch - b0, _MAX_GRID_YZ)
        grid = (_cdiv(max_q, _PREP_ROWS), heads, nb)
        args = (out, dout, dlse_arg, lse, lse2, delta, cu, *_seq_strides(out, packed), *_seq_strides(dout, packed),
                *_lse_strides(heads, seqlen_q, total, packed), seqlen_q, b0)
        launcher(grid, *args)
        if record is not None:
            record.append((launcher, grid, args))
    return lse2, delta


def _backward_signature(dout, q, k, v, out, lse, dlse, softmax_scale, left, right, grads):
    """_forward_signature's counterpart for a padded-batch backward: every tensor's shape, strides, dtype and
    16-byte alignment (the gradients' too when they are given views), the mask, the scale, the TMA switch."""
    tensors = (dout, q, k, v, out, lse) + ((dlse,) if dlse is not None else ()) + (grads or ())
    return (tuple((t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in tensors), dlse is None,
            grads is None, q.device, softmax_scale, left, right, os.environ.get("TILEWISE_ATTN_TMA"))


def _backward_plan(record, dout_in, lse_in, dlse_in):
    """The backward of one call signature as three direct launches, from the keyed path's `record`: each
    launch's (launcher, grid, arguments), the kernels' as (kernel, key, use_tma, args(bm, bn, use_tma, b0),
    grid(bm, bn, nb), how many arguments precede the scalars). None or False as _forward_plan's. The tensors
    change per call; everything else (the copies the keyed path made of dout, lse and dlse included) is fixed
    by the signature."""
    if len(record) != 3:
        return None
    (prep, prep_grid, prep_args), *kernels = record
    launches = [_direct_launch(*kernel) for kernel in kernels]
    if any(launch is None for launch in launches):
        return None
    prep_direct = prep.planned(prep_args)
    if not prep_direct or not all(launches):
        return False
    dout_copied = prep_args[1] is not dout_in          # the keyed path's .contiguous() copies, by the signature
    lse_copied = prep_args[3] is not lse_in
    dlse_copied = dlse_in is not None and prep_args[2] is not dlse_in
    dout_for_kernels = kernels[0][3](0, 0, False, 0)[3]
    dout_recopied = dout_for_kernels is not prep_args[1]
    prep_scalars = prep_args[7:]
    (dkdv, dkdv_grid, dkdv_scalars, bm1, bn1), (dq_launch, dq_grid, dq_scalars, bm2, bn2) = launches
    tma1, tma2 = kernels[0][2], kernels[1][2]

    def backward(dout, q, k, v, out, lse, dlse, grads):
        dq, dk, dv = (_new(t.shape, t.dtype, t.device) for t in (q, k, v)) if grads is None else grads
        if dout_copied:
            dout = dout.contiguous()
        lse = lse.contiguous() if lse_copied else lse
        dlse_arg = (dlse.contiguous() if dlse_copied else dlse) if dlse is not None else lse
        lse2 = _new(lse.shape, torch.float32, out.device)
        delta = _new(lse.shape, torch.float32, out.device)
        prep_direct(prep_grid, out, dout, dlse_arg, lse, lse2, delta, None, *prep_scalars)
        if dout_recopied:
            dout = dout.contiguous()
        dkdv(dkdv_grid, q, k, v, dout, dk, dv, lse2, delta, None,
             *_tile_descriptors(tma1, False, bm1, bn1, q, k, v, dout), *dkdv_scalars)
        dq_launch(dq_grid, q, k, v, dout, dq, lse2, delta, None,
                  *_tile_descriptors(tma2, False, bm2, bn2, q, k, v, dout), *dq_scalars)
        return dq, dk, dv
    return backward


def _attn_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale, left, right,
                   grads=None):
    """dQ, dK, dV in the input dtype: contiguous, or written into `grads`, three views of one gradient (the
    fused-QKV entry; dK and dV share their strides). From the Gluon backward where it covers the call and wins
    (_gluon_wins), else from the Triton one."""
    if cu_seqlens is None and _gluon_backward_applies(q, k, v, dlse, softmax_scale, left, right, grads):
        def gluon():
            return attention_sm90_bwd.backward(dout, q, k, v, out, lse, causal=right == 0,
                                               softmax_scale=softmax_scale, grads=grads)
        if _gluon_wins("bwd", q, k, right, gluon, lambda: _triton_backward(
                dout, q, k, v, out, lse, dlse, None, max_seqlen, softmax_scale, left, right, grads)):
            return gluon()
    return _triton_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale, left, right,
                            grads)


def _triton_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale, left, right,
                     grads=None):
    """_attn_backward on the Triton kernels. A padded batch's call signature seen before launches through its
    plan (_backward_plan), as the forward does."""
    sig = None
    if cu_seqlens is None:
        sig = _backward_signature(dout, q, k, v, out, lse, dlse, softmax_scale, left, right, grads)
        plan = _DQ.plans.get(sig)
        if plan:
            return plan(dout, q, k, v, out, lse, dlse, grads)
    dout_in = dout
    packed, batch, seqlen_q, seqlen_k, max_q, max_k, heads, kv_heads, head_dim = _common(q, k, cu_seqlens,
                                                                                          max_seqlen)
    if grads is None:
        dq, dk, dv = (_new(t.shape, t.dtype, t.device) for t in (q, k, v))
    else:
        dq, dk, dv = grads
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    total = q.shape[0] if packed else 0
    cu = cu_seqlens.to(q.device) if packed else None
    lse_strides = _lse_strides(heads, seqlen_q, total, packed)
    consts = _flags(q, left, right)
    consts["VARLEN"] = packed
    record = [] if sig is not None else None
    lse2, delta = _backward_prep(dout, out, lse, dlse, cu, batch, seqlen_q, max_q, heads, total, record)

    tma = _tma_mode(q.device)
    if tma != "off" and not _tma_layout_ok(dout, packed):
        dout = dout.contiguous()
    if tma != "off" and not all(_tma_layout_ok(t, packed) for t in (q, k, v, dout)):
        tma = "off"
    rows_q, rows_k = (0, 0) if packed else (seqlen_q, seqlen_k)
    group = heads // kv_heads
    strides = (*_seq_strides(q, packed), *_seq_strides(k, packed), *_seq_strides(v, packed),
               *_seq_strides(dout, packed))
    tail = (seqlen_q, seqlen_k, rows_q, rows_k, group, softmax_scale * LOG2E, softmax_scale, left, right)
    bucket = _bucket(max_q, max_k)

    def descs(bm, bn, use_tma):
        return _tile_descriptors(use_tma, packed, bm, bn, q, k, v, dout)

    dkdv_scalars = (*strides, *_seq_strides(dk, packed), *lse_strides, *tail)
    dkdv_consts = {**consts, "GQA": group > 1}
    dkdv_key = (bucket, q.dtype, *dkdv_consts.values())
    dkdv_grid = lambda bm, bn, nb: (_cdiv(max_k, bn), kv_heads, nb)  # noqa: E731
    dkdv_tensors = (q, k, v, dout, dk, dv, lse2, delta, cu)
    dkdv_args = lambda bm, bn, use_tma, b0: (*dkdv_tensors, *descs(bm, bn, use_tma), *dkdv_scalars, b0)  # noqa: E731
    dkdv_tma = _run(_DKDV, tma, dkdv_key, batch, dkdv_grid, dkdv_args, dkdv_consts)
    dq_scalars = (*strides, *_seq_strides(dq, packed), *lse_strides, *tail)
    dq_key = (bucket, q.dtype, *consts.values())
    dq_grid = lambda bm, bn, nb: (_cdiv(max_q, bm), heads, nb)  # noqa: E731
    dq_tensors = (q, k, v, dout, dq, lse2, delta, cu)
    dq_args = lambda bm, bn, use_tma, b0: (*dq_tensors, *descs(bm, bn, use_tma), *dq_scalars, b0)  # noqa: E731
    dq_tma = _run(_DQ, tma, dq_key, batch, dq_grid, dq_args, consts)
    if sig is not None and sig not in _DQ.plans and batch <= _MAX_GRID_YZ and len(_DQ.plans) < _MAX_PLANS:
        record += [(_DKDV, dkdv_key, dkdv_tma, dkdv_args, dkdv_grid, len(dkdv_tensors) + 4),   # + 4 descriptors
                   (_DQ, dq_key, dq_tma, dq_args, dq_grid, len(dq_tensors) + 4)]
        plan = _backward_plan(record, dout_in, lse, dlse)
        if plan is not None:
            _DQ.plans[sig] = plan
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
    """Forward and backward of flash attention for eager calls: the launchers run directly, with no op
    dispatch on the host path (and a forward(ctx, ...) without setup_context, which Function.apply would
    bind through inspect.signature on every call). Under torch.compile flash_attention calls the custom op
    tilewise::flash_attn_fwd instead, whose autograd formula (below) calls the backward op, so tracing sees
    two opaque ops."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right):
        out, lse = _attn_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right)
        _setup_context(ctx, (q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right), (out, lse))
        ctx.set_materialize_grads(False)   # an unused LSE's gradient stays None, not a zero tensor to read
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse, _attn_backward)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.args = (max_seqlen, softmax_scale, left, right)


def _backward(ctx, dout, dlse, impl):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = impl(dout, q, k, v, out, lse, dlse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


class FlashAttnQKVFunction(torch.autograd.Function):
    """Flash attention on q, k, v split from one (..., heads_q + 2 * heads_kv, head_dim) tensor (a fused QKV
    projection). Its backward writes dQ, dK and dV into one gradient of that tensor, where three gradients of
    split views would cost a concatenation (a read and a write of the whole gradient)."""

    @staticmethod
    def forward(ctx, qkv, heads_kv, cu_seqlens, max_seqlen, softmax_scale, left, right):
        q, k, v = _split_qkv(qkv, heads_kv)
        out, lse = _attn_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right)
        ctx.save_for_backward(qkv, out, lse, cu_seqlens)
        ctx.args = (heads_kv, max_seqlen, softmax_scale, left, right)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        qkv, out, lse, cu_seqlens = ctx.saved_tensors
        heads_kv, max_seqlen, softmax_scale, left, right = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dqkv = _new(qkv.shape, qkv.dtype, qkv.device)
        _attn_backward(dout, *_split_qkv(qkv, heads_kv), out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale,
                       left, right, grads=_split_qkv(dqkv, heads_kv))
        return dqkv, None, None, None, None, None, None


def _split_qkv(qkv, heads_kv):
    return qkv.split([qkv.shape[-2] - 2 * heads_kv, heads_kv, heads_kv], dim=-2)


def _op_backward(ctx, dout, dlse):
    return _backward(ctx, dout, dlse, torch.ops.tilewise.flash_attn_bwd)


torch.library.register_autograd("tilewise::flash_attn_fwd", _op_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------

def check_attention_args(q, k, v, causal, window, cu_seqlens, max_seqlen, fn="flash_attention"):
    """Raise ValueError naming what is wrong with the arguments of flash_attention (or of `fn`, a sibling
    with the same interface)."""
    packed = cu_seqlens is not None
    rank = 3 if packed else 4
    layout = "(total_tokens, heads, head_dim)" if packed else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)}; expected {rank} dims {layout}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"{fn}: dtype {q.dtype} is not supported; use bf16, fp16 or fp32")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v are on different devices ({q.device}, {k.device}, {v.device})")
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 256 or head_dim == 0:
        raise ValueError(f"{fn}: head_dim {head_dim} must be a multiple of 8 between 8 and 256")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if k.shape[-1] != head_dim:
        raise ValueError(f"{fn}: q head_dim {head_dim} != k head_dim {k.shape[-1]}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"{fn}: q batch {q.shape[0]} != k batch {k.shape[0]}")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{fn}: heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")
    if window is not None:
        if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
            raise ValueError(f"{fn}: window={window!r}; expected (left, right) ints >= -1 (-1 = unbounded)")
    if packed:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"{fn}: cu_seqlens must be a 1-d tensor of batch+1 offsets")
        if cu_seqlens.dtype != torch.int32:
            raise ValueError(f"{fn}: cu_seqlens dtype is {cu_seqlens.dtype}; expected torch.int32")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"{fn}: packed q has {q.shape[0]} tokens but k has {k.shape[0]}")
        if torch.compiler.is_compiling():
            return  # the offsets are data: reading them would break the graph; checked in eager runs
        # One small host read, only on the packed path: bad offsets would read out of bounds.
        offsets = cu_seqlens.cpu()
        if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) != q.shape[0]:
            raise ValueError(f"{fn}: cu_seqlens must start at 0, not decrease, and end at total_tokens={q.shape[0]}")
        if max_seqlen is not None and int((offsets[1:] - offsets[:-1]).max()) > max_seqlen:
            raise ValueError(f"{fn}: a sequence is longer than max_seqlen={max_seqlen}")


def flash_attention_qkv(qkv, heads_kv, *, causal=False, softmax_scale=None, window=None, cu_seqlens=None,
                        max_seqlen=None, return_lse=False):
    """flash_attention(q, k, v) for q, k, v = qkv.split([heads_q, heads_kv, heads_kv], dim=-2): qkv is
    (batch, seqlen, heads_q + 2 * heads_kv, head_dim), or (total_tokens, ...) with cu_seqlens. The gradient
    reaches qkv as one tensor (see FlashAttnQKVFunction); the other options are flash_attention's."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() not in (3, 4):
        raise ValueError(f"flash_attention_qkv: qkv must be a 4-d (batch, seqlen, heads, head_dim) or packed 3-d "
                         f"tensor, got {getattr(qkv, 'shape', type(qkv).__name__)}")
    heads = qkv.shape[-2]
    if not isinstance(heads_kv, int) or heads_kv < 1 or heads - 2 * heads_kv < 1:
        raise ValueError(f"flash_attention_qkv: heads_kv={heads_kv!r} does not fit qkv's {heads} heads "
                         f"(heads_q + 2 * heads_kv, heads_q >= 1)")
    q, k, v = _split_qkv(qkv, heads_kv)
    check_attention_args(q, k, v, causal, window, cu_seqlens, max_seqlen, fn="flash_attention_qkv")
    if not (use_triton(qkv) and qkv.dtype != torch.float64) or torch.compiler.is_compiling():
        # the reference, or the custom op under torch.compile (which plans the gradient's layout itself)
        return flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                               cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, return_lse=return_lse)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(qkv.shape[-1])
    out, lse = FlashAttnQKVFunction.apply(qkv, heads_kv,
                                          *_kernel_options(causal, softmax_scale, window, cu_seqlens, max_seqlen))
    return (out, lse) if return_lse else out


def _kernel_options(causal, softmax_scale, window, cu_seqlens, max_seqlen):
    """(cu_seqlens, max_seqlen, softmax_scale, left, right) as the launchers take them."""
    left, right = _effective_window(causal, window)
    if cu_seqlens is not None and max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return cu_seqlens, int(max_seqlen or 0), float(softmax_scale), left, right


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
        args = (q, k, v, *_kernel_options(causal, softmax_scale, window, cu_seqlens, max_seqlen))
        if torch.compiler.is_compiling():
            out, lse = torch.ops.tilewise.flash_attn_fwd(*args)
        else:
            out, lse = FlashAttnFunction.apply(*args)
        return (out, lse) if return_lse else out
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                               cu_seqlens=cu_seqlens, return_lse=return_lse)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def sdpa_attention(q, k, v, *, causal=False):
    """torch's F.scaled_dot_product_attention in flash_attention's (batch, seqlen, heads, head_dim) layout,
    its backend picked by torch (cuDNN in the e2e baseline's profile on the H200): model.attention='sdpa',
    the yardstick that bench/e2e.py times beside the Triton kernel. GQA without repeating K and V; a causal
    query block shorter than its keys (decoding from a cache) ends at the last key, as in flash_attention."""
    check_attention_args(q, k, v, causal, None, None, None, fn="sdpa_attention")
    if causal and q.shape[1] != k.shape[1]:
        return attention_reference(q, k, v, causal=True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


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
