"""FP8 (E4M3) flash-attention backward for Hopper (sm_90a) in Gluon: warp-specialized, TMA-fed, async wgmma.

Dispatched by fp8_attention._fp8_backward for dense, unrotated calls without dLSE, raced per key against the
Triton FP8 backward on the same passes' operands (attention._gluon_wins). On the H200 (bench/attention.py
--fp8-only, d128, the whole backward with its passes) it won every race: 2.83 against 3.15 ms at 4 x 4096 x 16
non-causal, 1.63 / 1.76 causal, 11.0 / 12.3 at 1 x 16384, 5.68 / 6.21 causal. The 64-query dK/dV tiles
(CONFIGS) made that: with the 32-query ones its kernels and passes summed to 3.67 ms at 4 x 4096, more than
the Triton backward's 3.35 (bench/fp8_attention_sm90_bwd.py).

History. First GPU run at c724bc2 (H200, bench/fp8_attention_sm90_bwd.py): correct at the bench's shapes
(within 0.7% of the Triton FP8 backward) but slower than the bf16 Gluon backward: both kernels alone 416
TFLOP/s against 459 at d128 4 x 4096 x 16 non-causal (366 against 389 causal; 438 against 466 at 1 x 16384),
and with prepare()'s quantization passes (0.80 ms of 3.61 there) 380. The dK/dV kernel (2.26 ms, its
32-query tiles) was twice the dQ kernel's 1.07. Its gpu tests crashed at their first ragged case (batch 3,
seqlen 1, 4 / 2 heads, d64: "illegal instruction"). bench/fp8_attention_sm90_bwd_probe.py (each kernel and
shape in its own process, at 81d9cc1) found the dK/dV kernel crashing at every seqlen not a multiple of 16
and the dQ kernel never: the dK/dV kernel's 1-D TMA tiles of the per-query vectors started at (batch * heads
+ h) * seqlen + query, not 16-byte aligned there. Their rows are now padded to 16 (_padded_rows), and all 38
gpu tests of tests/ops/test_fp8_attention_sm90_bwd.py passed at 430a7e0.

What it computes: the two main kernels of fp8_attention.py's backward (`_fp8_bwd_dkdv`, `_fp8_bwd_dq`) for the
dense layout, on exactly the operands `_fp8_backward` prepares (prepare() below makes the same calls:
fp8_attention's `_dout_passes` and `_quantize`), with the same scale rules:
- lse2 = lse * log2(e), delta = rowsum(dO * O), float32 (batch, heads_q, seqlen), from the bf16/fp16 O, dO.
- Q: E4M3, one power-of-two scale per row (qs, the LSE's layout), row-major (batch, seqlen, heads_q, d) and
  transposed (batch, heads_q, d, seqlen padded to 16, the padding zero). dO: the same (dos), except that its
  transposed copy is scaled by one power of two per head (`_dout_passes`: the maximum over the query heads of a
  GQA group) instead of its row scales. K: E4M3 row-major and transposed, one scale per KV_BLOCK (128) rows of
  one head (ks, (batch, heads_kv, blocks)); V: E4M3 row-major, scaled as K (vs). FP8 wgmma on sm_90 reads both
  shared-memory operands K-major, hence the transposed copies: the B operand of a GEMM that reduces over
  tokens is a (d, tokens) tile of one, viewed (tokens, d).
- All six GEMMs are E4M3 x E4M3 -> fp32 wgmma (SASS QGMMA):
  S^T = K Q^T and dP^T = V dO^T (the dK/dV kernel's transposed frame; B: the row-major Q, dO tiles);
  S = Q K^T and dP = dO V^T (the dQ kernel; B: the row-major K, V tiles), recomputed from the same E4M3 Q, K;
  dV += (P^T 256) dO (B: dO's transposed tile, one scale per head, so no scale lies along the reduction;
  P^T = exp2(S^T c - (lse2 - 8)) is in [0, 256]: no row maximum, no rescaling; the epilogue multiplies by
  dO's head scale / 256);
  dK += dS^T Q (B: Q's transposed tile) and dQ += dS K (B: K's transposed tile) with dS's left operand
  quantized with one scale per output row against its running maximum |dS^T diag(qs)| (dK; Q's row scales
  and P's 1/256 folded in before the maximum) or |dS| ks (dQ; the tile's K scale folded in), the accumulator
  multiplied by the power of two new/old scale when the maximum grows (fp8_attention's `_acc_rows`; here the
  factor is inv_new * scale_old, the same power of two as inv_new / inv_old, without a division).
  dK, dQ are multiplied by the final maximum's scale and softmax_scale in the epilogue.
The float operations are `_fp8_dkdv_step`'s and `_fp8_dq_blocks`' (same factors, same order inside an
element), so dV and the S, P, dP, dS values agree with the Triton kernels' to float32 rounding. What differs is
where the running maxima are taken: their maxima are over this kernel's tiles, in this kernel's order (query
blocks ascending from the first the key tile sees, for GQA head by head; the Triton dK/dV kernel visits the
unmasked blocks first and takes 32-row query blocks at its default config). A different running maximum only
changes dS's scale by a power of two, so its E4M3 rounding moves only for elements in E4M3's subnormal range
(below 2^-6 of 448 / the row maximum, ~1/28672 of it) and for the accumulator's reduced-precision adds;
dQ's order and BLOCK_N (64) match the Triton kernel's default, so dQ agrees as closely as dV.
The tests bound the difference to the Triton FP8 backward and, as the forward's tests do, the error against a
float64 reference by a factor of the Triton FP8 backward's own.

dK/dV kernel (`_fp8_bwd_dkdv_sm90`), one program per (pair of BLOCK_N-row key tiles, kv head, batch), causal
pairs from the earliest (the most queries) up:
- two consumer warpgroups (the default partition and worker 0, 4 warps each), each owning one BLOCK_N-row K/V
  tile, its dK and dV accumulators and its running maxima, in the transposed (key, query) frame.
- one producer warp (worker 1, few registers): the two K and two V tiles once (kv_bar), then per (query head,
  query block) of the kv head's group, in one flat loop, into a STAGES-deep ring: Q_i, dO_i (row-major E4M3)
  and the block's qs, dos qs / 256, lse2 - 8, delta qs / 256 (float32, four 1-D TMA tiles of the flat
  (batch * heads * seqlen) arrays _dkdv_rows makes) on qdo_full, and Q_i^T, dO_i^T (transposed E4M3) on
  t_full; one free barrier per stage (count 2, an arrive per consumer), waited with the opposite parity of its
  round. The per-query vectors come through
  shared memory because, loaded by the consumers from global memory, their 4 x 16 per-thread elements in the
  column layout (64 loads and their 64-bit addresses a tile) spilled ~220 registers and doubled the loop.
- per ring tile, software-pipelined by hand: issue S^T_i and dP^T_i, then the previous tile's dK (its operand
  dS^T_{i-1} made last iteration); wait for S^T_i alone (which retires dV_{i-1} too); exp2 of P^T_i under
  dP^T_i and dK_{i-1}; P^T_i to E4M3; issue dV_i; wait for dP^T_i; dS^T_i and its row maxima under dK_{i-1}
  and dV_i; wait for dK_{i-1} (frees tile i-1's stage), rescale dK, cast dS^T_i to E4M3; next tile, with dV_i
  still running. The order exists for ptxas: a wgmma whose accumulator the loop reads (dK, rescaled) must not
  be in flight across the loop's back edge, or ptxas serializes every wgmma of the kernel (C7514; seen with
  dK and dQ deferred to the next iteration's first wait); dV, read only by wgmmas, may be. A stage is
  released one tile late, so the ring wants STAGES >= 3 where shared memory allows. The two warpgroups run
  unsynchronized, one's CUDA-core work under the other's wgmmas.
- P^T and dS^T reach their wgmmas (the A operand) through shared memory (P_SMEM=1: one tile each per
  warpgroup, written after the wait that retired its last reader, fenced, a warpgroup barrier). The register
  path (P_SMEM=0, the k_width 4 dot-operand layout FP8 wgmma wants) is refused for dK/dV: dV's 8-bit register
  operand would be in flight across the back edge and ptxas serializes the kernel.

dQ kernel (`_fp8_bwd_dq_sm90`), one program per (pair of BLOCK_M-row query tiles, query head, batch), causal
pairs latest (heaviest) first:
- two consumer warpgroups, each with its own E4M3 Q and dO tile (loaded once) and dQ accumulator; one
  producer warp streaming (K_j, V_j, K_j^T) into a ring with k_full / v_full / kt_full and one free barrier.
  The row vectors (qs, dos, lse2, delta) are 2 registers a thread in this frame: plain loads, once.
- per key block: issue S_j, dP_j, then dQ_{j-1} (dS_{j-1} K_{j-1}); wait for S_j; P_j under dP_j and
  dQ_{j-1}; wait for dP_j; dS_j and its row maxima under dQ_{j-1}; wait for it (frees block j-1's stage),
  rescale dQ, cast dS_j. Nothing is in flight across the back edge. dS_j reaches its wgmma through shared
  memory (P_SMEM=1) or registers (P_SMEM=0, in the k_width 4 layout: a byte permute, ~70 PRMT a block).

Masking, as the bf16 Gluon backward: a branch on the boundary blocks only (causal diagonal, ragged end). In
the dK/dV kernel query columns past the end get lse2 = +inf and are masked to P = 0; their Q / dO rows (the
next sequence's, or TMA's zero fill) are finite E4M3 values, their transposed columns the pass's zero padding
or TMA's zero fill. Key rows past the end are computed and never stored. In the dQ kernel key columns past
the end are masked; query rows past the end are never stored.

Supports: bf16 and fp16 inputs (q, k, v, o, dout alike; dq, dk, dv in that dtype, contiguous), head_dim 64 and
128, causal and non-causal, GQA (query head h uses kv head h // (heads_q // heads_kv); dK, dV summed over the
group in registers), seqlen_q == seqlen_k of any length, the dense layout only, a positive softmax scale. Not
supported (ValueError naming it; the caller keeps fp8_attention.py's kernels): cu_seqlens, sliding windows,
dLSE, rotate=True (it would need the epilogues' back-rotation dK R^T, dQ R^T).

Conventions: `_fp8_backward(dout, q, k, v, out, lse, None, None, 0, softmax_scale, -1, 0 if causal else -1,
False)`'s: q, dout, out (batch, seqlen, heads_q, d), k, v (batch, seqlen, heads_kv, d), lse float32 natural
log (batch, heads_q, seqlen); returns (dq, dk, dv) contiguous in the inputs' shapes and dtype.

The module imports on any Triton: without Gluon's Hopper API as Triton 3.6 spells it the kernels are not
defined and available() says False; outside the interpreter only (its KV_BLOCK is 32 rows, not 128).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from . import fp8_attention as f8
from .gluon_sm90 import builds_ahead
from .gluon_sm90 import (GLUON_ERROR as _GLUON_ERROR, ROLE_CONSTS, TensorDescriptor, aot_compile, check_dense,
                         fence_async_shared, gl, gluon, grid_tile, mbarrier, new_output, on_sm90, query_pair_work,
                         tensordesc_type, tma, warpgroup_mma, warpgroup_mma_wait)
from .launch import FastLauncher

try:
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_init
except Exception:  # noqa: BLE001 - another Triton: the kernels are not defined then anyway
    warpgroup_mma_init = None

LOG2E = 1.4426950408889634
KV_BLOCK_GPU = 128   # fp8_attention.KV_BLOCK outside the interpreter: the rows one K/V scale covers
P_SCALE = 256.0      # P^T in [0, 1] is cast as P^T * 256 (fp8_attention.P_SCALE)

# dkdv: (BLOCK_N keys per consumer warpgroup, BLOCK_M queries per ring tile, STAGES, P_SMEM);
# dq: (BLOCK_M queries per consumer warpgroup, BLOCK_N keys per ring tile, STAGES, P_SMEM). The first is the
# default. Key tiles lie in one K/V scale block (BLOCK_N divides 128); every GEMM's reduction is >= 32 (the
# E4M3 wgmma's k step): BLOCK_M >= 32 in dK/dV (dV, dK reduce over the ring tile's queries), BLOCK_N >= 32 in
# dQ. P_SMEM: 1 passes P^T / dS^T / dS to their wgmma through shared memory, 0 (dQ only) through registers.
# Every entry builds for sm_90a with no spills, causal or not, bf16 or fp16 gradients (bench/
# fp8_attention_sm90_bwd.py --aot-only), except d128 dK/dV's 64-query entries: causal, they spill (one store
# and one load, 8 bytes of stack), and the default still runs 1.31-1.40x faster than (64, 32, 4, 1) on the
# H200, causal too (d128, (4, 4096, 16) and (1, 16384, 16): bench/fp8_attention_sm90_bwd.py --configs). Left
# out for what the build said: dK/dV d64 (64, 128) and dQ d128 (64, 128) (spills), and dK/dV with P_SMEM=0
# (ptxas serializes every wgmma: dV's 8-bit register operand is in flight across the loop's back edge).
# Tried and removed: rescaling the dK / dQ accumulator only where some row's scale changed (a flag a warp read
# after the dS barrier, so no new barrier): the same bits, but 0.92-0.99x the plain kernels on the H200 (d128,
# (4, 4096, 16) and (1, 16384, 16), causal and not; bench/results/sm90/skip_rescale_1a9dc12.json).
CONFIGS = {
    "dkdv": {128: [(64, 64, 3, 1), (64, 32, 4, 1), (64, 32, 3, 1), (64, 64, 2, 1)],
             64: [(64, 64, 3, 1), (64, 64, 4, 1), (64, 64, 2, 1), (64, 32, 4, 1)]},
    "dq": {128: [(64, 64, 3, 1), (64, 64, 4, 1), (64, 64, 2, 1), (64, 64, 3, 0)],
           64: [(64, 64, 3, 1), (64, 128, 3, 1), (64, 64, 4, 1), (64, 64, 3, 0)]},
}
# Outputs start as NaN with TILEWISE_NAN_FILL=1 (read at import; the tests set _NAN_FILL), so unwritten
# elements show.
_NAN_FILL = os.environ.get("TILEWISE_NAN_FILL", "0") == "1"


if gl is not None and warpgroup_mma_init is not None:
    try:
        @gluon.jit
        def _pow2_scales(amax):
            """fp8_attention._scales: (2^e, 2^-e), 2^e the largest power of two with amax * 2^e <= 448;
            amax <= 1e-30: (0, 1). The same integer arithmetic, so the same bits."""
            bits = amax.to(gl.int32, bitcast=True)
            above = ((bits & 0x7FFFFF) > 0x600000).to(gl.int32)   # mantissa > 1.75 = 448 / 2^8
            live = amax > 1e-30
            e = gl.where(live, 8 - ((bits >> 23) - 127) - above, 0)
            inv = ((e + 127) << 23).to(gl.float32, bitcast=True)
            scale = ((127 - e) << 23).to(gl.float32, bitcast=True)
            return gl.where(live, inv, 0.0), scale

        @gluon.jit
        def _running_max(c, inv_c, scale_c, amax):
            """fp8_attention._acc_rows' bookkeeping: the new running row maximum, its (2^e, 2^-e) and the factor
            the accumulator is rescaled by (inv_new / inv_old, exact: powers of two; 1 while nothing was
            added)."""
            c_new = gl.maximum(c, amax)
            inv, scale = _pow2_scales(c_new)
            factor = gl.where(inv_c > 0, inv * scale_c, 1.0)
            return c_new, inv, scale, factor

        @gluon.jit
        def _left_operand(x8, tile, op_layout: gl.constexpr, P_SMEM: gl.constexpr):
            """An E4M3 left operand (the accumulator layout) for its wgmma: stored to its shared-memory tile
            (fenced for the async proxy, every warp's rows in place), or in the k_width 4 register layout."""
            if P_SMEM:
                tile.store(x8)
                fence_async_shared()
                gl.thread_barrier()
                op = tile
            else:
                op = gl.convert_layout(x8, op_layout)
            return op

        # ------------------------------------------------------------------------------------------
        # dK / dV
        # ------------------------------------------------------------------------------------------
        @gluon.jit
        def _dkdv_issue_scores(k_tile, v_tile, q_ring, do_ring, qdo_full, stage, phase, zero_s):
            """S^T = K Q_i^T and dP^T = V dO_i^T issued together (both operands in shared memory)."""
            mbarrier.wait(qdo_full.index(stage), phase)
            s_tok = warpgroup_mma(k_tile, q_ring.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
            dp_tok = warpgroup_mma(v_tile, do_ring.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
            return s_tok, dp_tok

        @gluon.jit
        def _dkdv_probs(s, rows_ring, stage, kc, key0, start_m, first_clean, seqlen, BLOCK_M: gl.constexpr,
                        CAUSAL: gl.constexpr):
            """P^T * 256 = exp2(S^T (qs kc) - (lse2 - 8)), masked on the boundary blocks only. qs and lse2 - 8
            come from the ring (rows 0 and 2 of the stage's query-row vectors; past the end of the last head:
            TMA's zeros, of another head's rows: finite values, both masked here)."""
            col_s: gl.constexpr = gl.SliceLayout(0, s.type.layout)
            row_s: gl.constexpr = gl.SliceLayout(1, s.type.layout)
            qs = rows_ring.index(4 * stage).load(col_s)
            lse8 = rows_ring.index(4 * stage + 2).load(col_s)
            p = gl.exp2(s * gl.expand_dims(qs * kc, 0) - gl.expand_dims(lse8, 0))
            if (start_m < first_clean) | (start_m + BLOCK_M > seqlen):
                cols = gl.arange(0, BLOCK_M, layout=col_s)
                keep = gl.expand_dims(cols < seqlen - start_m, 0)
                if CAUSAL:   # key <= query: (key - start_m) <= column
                    rel = key0 - start_m + gl.arange(0, s.type.shape[0], layout=row_s)
                    keep = keep & (gl.expand_dims(rel, 1) <= gl.expand_dims(cols, 0))
                p = gl.where(keep, p, 0.0)
            return p

        @gluon.jit
        def _dkdv_dst(p, dp, rows_ring, stage, vs):
            """dS^T diag(qs) / 256 = P^T (dP^T diag(dos qs / 256) vs - diag(delta qs / 256)): the query rows'
            scales and P's 1/256 folded into the two per-query factors launch_dkdv makes (rows 1 and 3 of the
            stage's query-row vectors; products of powers of two, so exact)."""
            col_s: gl.constexpr = gl.SliceLayout(0, p.type.layout)
            ds_mul = rows_ring.index(4 * stage + 1).load(col_s)
            ds_sub = rows_ring.index(4 * stage + 3).load(col_s)
            return p * (dp * gl.expand_dims(ds_mul * vs, 0) - gl.expand_dims(ds_sub, 0))

        @gluon.jit
        def _dkdv_consumer(k_tile, v_tile, q_ring, do_ring, qt_ring, dot_ring, rows_ring, p_tile, ds_tile, kv_bar,
                           qdo_full, t_full, free, DK, DV, KS, VS, DOA, s_base,
                           key0, seqlen, b, hk, heads, kv_heads, h0, q_lo, n_iter, qk_scale, softmax_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_BLOCK: gl.constexpr,
                           P_SMEM: gl.constexpr):
            """One warpgroup's key tile (keys key0 .. key0 + BLOCK_N of sequence b, kv head hk) over n_iter
            (query head, query block) tiles of the ring, in the transposed frame (`_fp8_dkdv_step`'s math).
            Software-pipelined by hand: tile i issues S^T_i, dP^T_i and then tile i-1's dK, so no wgmma whose
            accumulator the loop reads is in flight across the loop's back edge (ptxas serializes every wgmma
            of the kernel otherwise); only dV_i (never read in the loop) is."""
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_M, 32])
            g_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HEAD_DIM, 32])
            op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=4)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
            row_g: gl.constexpr = gl.SliceLayout(1, g_layout)
            col_g: gl.constexpr = gl.SliceLayout(0, g_layout)
            fp8: gl.constexpr = gl.float8e4nv

            zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
            # the tile's K and V block scales (a tile wholly past the end reads the last block's: never stored)
            blk = s_base + gl.minimum(key0, seqlen - 1) // KV_BLOCK
            kc = gl.load(KS + blk) * qk_scale
            vs = gl.load(VS + blk)
            # a query block is masked when its first query lies before this tile's last key (causal) or its
            # last row past the end
            if CAUSAL:
                first_clean = key0 + BLOCK_N - 1
            else:
                first_clean = 0

            mbarrier.wait(kv_bar, 0)
            # tile 0: no dK in flight yet. dK's running row maximum |dS^T diag(qs) / 256| starts at 0.
            stage = 0
            phase = 0
            start_m = q_lo
            s_tok, dp_tok = _dkdv_issue_scores(k_tile, v_tile, q_ring, do_ring, qdo_full, stage, phase, zero_s)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            p = _dkdv_probs(s, rows_ring, stage, kc, key0, start_m, first_clean, seqlen, BLOCK_M, CAUSAL)
            p_op = _left_operand(p.to(fp8), p_tile, op_layout, P_SMEM)
            mbarrier.wait(t_full.index(stage), phase)
            dv_tok = warpgroup_mma(p_op, dot_ring.index(stage).permute((1, 0)),
                                   gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout), is_async=True)
            dp = warpgroup_mma_wait(1, deps=(dp_tok, ))   # dP^T_0 done, dV_0 may still run
            g = _dkdv_dst(p, dp, rows_ring, stage, vs)
            ck = gl.max(gl.abs(g), 1)
            inv_c, scale_c = _pow2_scales(ck)
            g_op = _left_operand((g * gl.expand_dims(inv_c, 1)).to(fp8), ds_tile, op_layout, P_SMEM)
            dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)

            # the ring position and the (query head, query block) pair advance by counters, not divisions
            for it in range(1, n_iter):
                prev = stage
                stage += 1
                if stage == STAGES:
                    stage = 0
                    phase ^= 1
                start_m += BLOCK_M
                if start_m >= seqlen:   # the next query head of the group
                    start_m = q_lo
                s_tok, dp_tok = _dkdv_issue_scores(k_tile, v_tile, q_ring, do_ring, qdo_full, stage, phase, zero_s)
                dk_tok = warpgroup_mma(g_op, qt_ring.index(prev).permute((1, 0)), dk, is_async=True)   # tile i-1
                s = warpgroup_mma_wait(2, deps=(s_tok, ))   # S^T_i done (and dV_{i-1}); dP^T_i, dK_{i-1} may run
                p = _dkdv_probs(s, rows_ring, stage, kc, key0, start_m, first_clean, seqlen, BLOCK_M,
                                CAUSAL)
                p_op = _left_operand(p.to(fp8), p_tile, op_layout, P_SMEM)   # its last reader dV_{i-1} is done
                mbarrier.wait(t_full.index(stage), phase)
                dv_tok = warpgroup_mma(p_op, dot_ring.index(stage).permute((1, 0)), dv_tok, is_async=True)
                dp = warpgroup_mma_wait(2, deps=(dp_tok, ))   # dP^T_i done; dK_{i-1}, dV_i may run
                g = _dkdv_dst(p, dp, rows_ring, stage, vs)
                ck, inv_c, scale_c, factor = _running_max(ck, inv_c, scale_c, gl.max(gl.abs(g), 1))
                dk = warpgroup_mma_wait(1, deps=(dk_tok, ))   # dK_{i-1} done: tile i-1's stage is free
                mbarrier.arrive(free.index(prev))
                dk = dk * gl.expand_dims(gl.convert_layout(factor, row_g), 1)
                g_op = _left_operand((g * gl.expand_dims(inv_c, 1)).to(fp8), ds_tile, op_layout, P_SMEM)
            dk_tok = warpgroup_mma(g_op, qt_ring.index(stage).permute((1, 0)), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))

            # dV in dO^T's per-head scale and P's 256; dK in its running maximum's scale
            # (the program's coordinates are read again here rather than kept live across the loop)
            pid_e, hk_e, b_e = grid_tile(CAUSAL)
            tile_key0 = key0 - pid_e * (2 * BLOCK_N)   # 0 or BLOCK_N: this warpgroup's tile
            key0 = pid_e * (2 * BLOCK_N) + tile_key0
            _, do_scale = _pow2_scales(gl.load(DOA + hk_e * (heads // kv_heads)))
            rows = gl.arange(0, BLOCK_N, layout=row_g)
            dcol = gl.arange(0, HEAD_DIM, layout=col_g)
            row_stride = kv_heads * HEAD_DIM
            tile = (b_e * seqlen + key0).to(gl.int64) * row_stride + hk_e * HEAD_DIM
            offs = gl.expand_dims(rows * row_stride, 1) + gl.expand_dims(dcol, 0)
            mask = gl.expand_dims(rows < seqlen - key0, 1) & gl.expand_dims(dcol < HEAD_DIM, 0)
            out_dtype: gl.constexpr = DK.dtype.element_ty
            gl.store(DV + tile + offs, (dv * (do_scale / 256.0)).to(out_dtype), mask=mask)
            dk_row = gl.convert_layout(scale_c * softmax_scale, row_g)
            gl.store(DK + tile + offs, (dk * gl.expand_dims(dk_row, 1)).to(out_dtype), mask=mask)

        @gluon.jit
        def _dkdv_producer(q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, qs_desc, dsmul_desc, lse8_desc,
                           dssub_desc, k_tiles, v_tiles, q_ring, do_ring, qt_ring, dot_ring, rows_ring, kv_bar,
                           qdo_full, t_full, free, kv_row, kv_col, q_row, q_col0, qt_row0, q_lo, seqlen, vstride,
                           n_iter, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                           STAGES: gl.constexpr):
            """The two K and V tiles once, then the E4M3 Q, dO tiles (row-major) and the block's qs, ds_mul,
            lse2 - 8, ds_sub (float32, rows 4 stage .. 4 stage + 3 of rows_ring) on qdo_full, and the Q^T, dO^T tiles
            (transposed) on t_full, of (head h0 + g, query block) into stage it % STAGES once both consumers
            freed it. The vectors are 1-D tiles of the flat (batch * heads_q * vstride) arrays (vstride: seqlen
            rounded up to 16, so every tile starts 64-byte aligned)."""
            mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_bar, k_tiles.index(0))
            tma.async_copy_global_to_shared(k_desc, [kv_row + BLOCK_N, kv_col], kv_bar, k_tiles.index(1))
            tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_bar, v_tiles.index(0))
            tma.async_copy_global_to_shared(v_desc, [kv_row + BLOCK_N, kv_col], kv_bar, v_tiles.index(1))
            stage = 0
            free_phase = 1   # the first round finds every stage free
            start_m = q_lo
            col = q_col0
            qt_row = qt_row0
            lrow = (qt_row0 // HEAD_DIM) * vstride   # (b * heads_q + h0) * vstride
            for it in range(n_iter):
                row = q_row + start_m
                mbarrier.wait(free.index(stage), free_phase)
                bar = qdo_full.index(stage)
                mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + 4 * qs_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [row, col], bar, q_ring.index(stage))
                tma.async_copy_global_to_shared(do_desc, [row, col], bar, do_ring.index(stage))
                tma.async_copy_global_to_shared(qs_desc, [lrow + start_m], bar, rows_ring.index(4 * stage))
                tma.async_copy_global_to_shared(dsmul_desc, [lrow + start_m], bar, rows_ring.index(4 * stage + 1))
                tma.async_copy_global_to_shared(lse8_desc, [lrow + start_m], bar, rows_ring.index(4 * stage + 2))
                tma.async_copy_global_to_shared(dssub_desc, [lrow + start_m], bar, rows_ring.index(4 * stage + 3))
                mbarrier.expect(t_full.index(stage), qt_desc.block_type.nbytes + dot_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(dot_desc, [qt_row, start_m], t_full.index(stage),
                                                dot_ring.index(stage))
                tma.async_copy_global_to_shared(qt_desc, [qt_row, start_m], t_full.index(stage),
                                                qt_ring.index(stage))
                stage += 1
                if stage == STAGES:
                    stage = 0
                    free_phase ^= 1
                start_m += BLOCK_M
                if start_m >= seqlen:   # the next query head of the group
                    start_m = q_lo
                    col += HEAD_DIM
                    qt_row += HEAD_DIM
                    lrow += vstride

        @gluon.jit
        def _fp8_bwd_dkdv_sm90(q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, qs_desc, dsmul_desc, lse8_desc,
                               dssub_desc, DK, DV, KS, VS, DOA, seqlen, vstride, heads, kv_heads, group, ssb, ssh,
                               qk_scale, softmax_scale,
                               HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_BLOCK: gl.constexpr,
                               P_SMEM: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr):
            """Grid (key tile pairs, kv heads, batch); causal: early key tiles (the most queries) go first, in
            grid_tile's order."""
            pid, hk, b = grid_tile(CAUSAL)
            h0 = hk * group
            n0 = pid * (2 * BLOCK_N)
            if CAUSAL:
                q_lo = (n0 // BLOCK_M) * BLOCK_M
            else:
                q_lo = 0
            n_iter = gl.cdiv(seqlen - q_lo, BLOCK_M) * group

            fp8: gl.constexpr = gl.float8e4nv
            k_tiles = gl.allocate_shared_memory(fp8, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_tiles = gl.allocate_shared_memory(fp8, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
            q_ring = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
            do_ring = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
            qt_ring = gl.allocate_shared_memory(fp8, [STAGES, HEAD_DIM, BLOCK_M], qt_desc.layout)
            dot_ring = gl.allocate_shared_memory(fp8, [STAGES, HEAD_DIM, BLOCK_M], dot_desc.layout)
            rows_ring = gl.allocate_shared_memory(gl.float32, [4 * STAGES, BLOCK_M], qs_desc.layout)
            if P_SMEM:
                pl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], fp8)
                p_tiles = gl.allocate_shared_memory(fp8, [2, BLOCK_N, BLOCK_M], pl)
                ds_tiles = gl.allocate_shared_memory(fp8, [2, BLOCK_N, BLOCK_M], pl)
            else:   # unused placeholders
                p_tiles = k_tiles
                ds_tiles = k_tiles
            kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            qdo_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            t_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_bar, count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(qdo_full.index(i), count=1)
                mbarrier.init(t_full.index(i), count=1)
                mbarrier.init(free.index(i), count=2)   # one arrive per consumer warpgroup
            fence_async_shared()

            s_base = b.to(gl.int64) * ssb + hk * ssh
            key0 = n0
            key1 = n0 + BLOCK_N
            gl.warp_specialize([
                (_dkdv_consumer, (k_tiles.index(0), v_tiles.index(0), q_ring, do_ring, qt_ring, dot_ring, rows_ring,
                                  p_tiles.index(0), ds_tiles.index(0), kv_bar, qdo_full, t_full, free, DK, DV,
                                  KS, VS, DOA, s_base, key0, seqlen, b, hk, heads, kv_heads, h0,
                                  q_lo, n_iter, qk_scale, softmax_scale, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES,
                                  CAUSAL, KV_BLOCK, P_SMEM)),
                (_dkdv_consumer, (k_tiles.index(1), v_tiles.index(1), q_ring, do_ring, qt_ring, dot_ring, rows_ring,
                                  p_tiles.index(1), ds_tiles.index(1), kv_bar, qdo_full, t_full, free, DK, DV,
                                  KS, VS, DOA, s_base, key1, seqlen, b, hk, heads, kv_heads, h0,
                                  q_lo, n_iter, qk_scale, softmax_scale, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES,
                                  CAUSAL, KV_BLOCK, P_SMEM)),
                (_dkdv_producer, (q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, qs_desc, dsmul_desc,
                                  lse8_desc, dssub_desc, k_tiles, v_tiles, q_ring, do_ring, qt_ring, dot_ring,
                                  rows_ring, kv_bar, qdo_full, t_full, free, b * seqlen + n0,
                                  hk * HEAD_DIM, b * seqlen, h0 * HEAD_DIM, (b * heads + h0) * HEAD_DIM, q_lo,
                                  seqlen, vstride, n_iter, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES)),
            ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

            mbarrier.invalidate(kv_bar)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(qdo_full.index(i))
                mbarrier.invalidate(t_full.index(i))
                mbarrier.invalidate(free.index(i))

        # ------------------------------------------------------------------------------------------
        # dQ
        # ------------------------------------------------------------------------------------------
        @gluon.jit
        def _dq_issue_scores(q_tile, do_tile, k_ring, v_ring, k_full, v_full, stage, phase, zero_s):
            """S = Q K_j^T and dP = dO V_j^T issued together (both operands in shared memory)."""
            mbarrier.wait(k_full.index(stage), phase)
            s_tok = warpgroup_mma(q_tile, k_ring.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
            mbarrier.wait(v_full.index(stage), phase)
            dp_tok = warpgroup_mma(do_tile, v_ring.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
            return s_tok, dp_tok

        @gluon.jit
        def _dq_probs(s, qc, ks, lse2, qpos, cols, start_n, limit, seqlen, BLOCK_N: gl.constexpr,
                      CAUSAL: gl.constexpr):
            """P = exp2(S (qc ks) - lse2), masked on the boundary blocks only."""
            p = gl.exp2(s * gl.expand_dims(qc * ks, 1) - gl.expand_dims(lse2, 1))
            if start_n + BLOCK_N > limit:
                kpos = start_n + cols
                keep = gl.expand_dims(kpos, 0) < seqlen
                if CAUSAL:
                    keep = keep & (gl.expand_dims(kpos, 0) <= gl.expand_dims(qpos, 1))
                p = gl.where(keep, p, 0.0)
            return p

        @gluon.jit
        def _dq_consumer(q_tile, do_tile, k_ring, v_ring, kt_ring, x_tile, qdo_bar, k_full, v_full, kt_full, free,
                         DQ, QS, DOS, LSE2, DELTA, KS, VS, s_base, row0, seqlen, b, h, heads, n_blocks, qk_scale,
                         softmax_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_BLOCK: gl.constexpr,
                         P_SMEM: gl.constexpr):
            """One warpgroup's query tile (rows row0 .. row0 + BLOCK_M of sequence b, head h) over n_blocks key
            blocks (`_fp8_dq_blocks`' math). Block j issues S_j, dP_j and then block j-1's dQ, which runs under
            the softmax of S_j; nothing is in flight across the loop's back edge (see _dkdv_consumer)."""
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_N, 32])
            g_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HEAD_DIM, 32])
            op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=4)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
            row_g: gl.constexpr = gl.SliceLayout(1, g_layout)
            col_g: gl.constexpr = gl.SliceLayout(0, g_layout)
            fp8: gl.constexpr = gl.float8e4nv

            qpos = row0 + gl.arange(0, BLOCK_M, layout=row_s)
            cols = gl.arange(0, BLOCK_N, layout=col_s)
            lrow = ((b * heads + h) * seqlen).to(gl.int64)
            inside = qpos < seqlen
            qc = gl.load(QS + lrow + qpos, mask=inside, other=1.0) * qk_scale
            dos = gl.load(DOS + lrow + qpos, mask=inside, other=1.0)
            lse2 = gl.load(LSE2 + lrow + qpos, mask=inside, other=float("inf"))
            delta = gl.load(DELTA + lrow + qpos, mask=inside, other=0.0)
            # a block is masked when its last key lies past this tile's first row (causal) or past the end
            if CAUSAL:
                limit = gl.minimum(row0 + 1, seqlen)
            else:
                limit = seqlen
            zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

            mbarrier.wait(qdo_bar, 0)
            # block 0: no dQ in flight yet. dQ's running row maximum |dS| ks starts at 0.
            ks = gl.load(KS + s_base)
            vs = gl.load(VS + s_base)
            s_tok, dp_tok = _dq_issue_scores(q_tile, do_tile, k_ring, v_ring, k_full, v_full, 0, 0, zero_s)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            p = _dq_probs(s, qc, ks, lse2, qpos, cols, 0, limit, seqlen, BLOCK_N, CAUSAL)
            dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
            ds = p * (dp * gl.expand_dims(dos * vs, 1) - gl.expand_dims(delta, 1))
            cq = gl.max(gl.abs(ds), 1) * ks
            inv_c, scale_c = _pow2_scales(cq)
            x_op = _left_operand((ds * gl.expand_dims(inv_c * ks, 1)).to(fp8), x_tile, op_layout, P_SMEM)
            dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=g_layout)

            for j in range(1, n_blocks):
                stage = j % STAGES
                phase = (j // STAGES) & 1
                prev = (j - 1) % STAGES
                prev_phase = ((j - 1) // STAGES) & 1
                start_n = j * BLOCK_N
                blk = start_n // KV_BLOCK
                ks = gl.load(KS + s_base + blk)
                vs = gl.load(VS + s_base + blk)
                s_tok, dp_tok = _dq_issue_scores(q_tile, do_tile, k_ring, v_ring, k_full, v_full, stage, phase,
                                                 zero_s)
                mbarrier.wait(kt_full.index(prev), prev_phase)
                dq_tok = warpgroup_mma(x_op, kt_ring.index(prev).permute((1, 0)), dq, is_async=True)   # block j-1
                s = warpgroup_mma_wait(2, deps=(s_tok, ))   # S_j done; dP_j, dQ_{j-1} may run
                p = _dq_probs(s, qc, ks, lse2, qpos, cols, start_n, limit, seqlen, BLOCK_N, CAUSAL)
                dp = warpgroup_mma_wait(1, deps=(dp_tok, ))   # dP_j done; dQ_{j-1} may run
                ds = p * (dp * gl.expand_dims(dos * vs, 1) - gl.expand_dims(delta, 1))
                cq, inv_c, scale_c, factor = _running_max(cq, inv_c, scale_c, gl.max(gl.abs(ds), 1) * ks)
                dq = warpgroup_mma_wait(0, deps=(dq_tok, ))   # dQ_{j-1} done: block j-1's stage is free
                mbarrier.arrive(free.index(prev))
                dq = dq * gl.expand_dims(gl.convert_layout(factor, row_g), 1)
                x_op = _left_operand((ds * gl.expand_dims(inv_c * ks, 1)).to(fp8), x_tile, op_layout, P_SMEM)
            last = (n_blocks - 1) % STAGES
            mbarrier.wait(kt_full.index(last), ((n_blocks - 1) // STAGES) & 1)
            dq_tok = warpgroup_mma(x_op, kt_ring.index(last).permute((1, 0)), dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq_tok, ))

            rows = row0 + gl.arange(0, BLOCK_M, layout=row_g)
            dcol = gl.arange(0, HEAD_DIM, layout=col_g)
            row64 = (b * seqlen + rows).to(gl.int64)
            ptrs = DQ + gl.expand_dims(row64 * (heads * HEAD_DIM) + h * HEAD_DIM, 1) + gl.expand_dims(dcol, 0)
            mask = gl.expand_dims(rows < seqlen, 1) & gl.expand_dims(dcol < HEAD_DIM, 0)
            dq_row = gl.convert_layout(scale_c * softmax_scale, row_g)
            gl.store(ptrs, (dq * gl.expand_dims(dq_row, 1)).to(DQ.dtype.element_ty), mask=mask)

        @gluon.jit
        def _dq_producer(q_desc, do_desc, k_desc, v_desc, kt_desc, q_tiles, do_tiles, k_ring, v_ring, kt_ring,
                         qdo_bar, k_full, v_full, kt_full, free, q_row, q_col, kv_row, kv_col, kt_row, n_blocks,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
            """The two E4M3 Q and dO tiles once, then K_j, V_j (row-major) and K_j^T (transposed) into stage
            j % STAGES once both consumers freed it."""
            mbarrier.expect(qdo_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row, q_col], qdo_bar, q_tiles.index(0))
            tma.async_copy_global_to_shared(q_desc, [q_row + BLOCK_M, q_col], qdo_bar, q_tiles.index(1))
            tma.async_copy_global_to_shared(do_desc, [q_row, q_col], qdo_bar, do_tiles.index(0))
            tma.async_copy_global_to_shared(do_desc, [q_row + BLOCK_M, q_col], qdo_bar, do_tiles.index(1))
            for j in range(n_blocks):
                stage = j % STAGES
                free_phase = ((j // STAGES) & 1) ^ 1   # the first round finds every stage free
                mbarrier.wait(free.index(stage), free_phase)
                mbarrier.expect(k_full.index(stage), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, kv_col], k_full.index(stage),
                                                k_ring.index(stage))
                mbarrier.expect(v_full.index(stage), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, kv_col], v_full.index(stage),
                                                v_ring.index(stage))
                mbarrier.expect(kt_full.index(stage), kt_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(kt_desc, [kt_row, j * BLOCK_N], kt_full.index(stage),
                                                kt_ring.index(stage))

        @gluon.jit
        def _fp8_bwd_dq_sm90(q_desc, do_desc, k_desc, v_desc, kt_desc, DQ, QS, DOS, LSE2, DELTA, KS, VS,
                             seqlen, heads, kv_heads, group, ssb, ssh, qk_scale, softmax_scale,
                             HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_BLOCK: gl.constexpr,
                             P_SMEM: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr):
            """Grid (query tile pairs, heads_q, batch); causal pairs run latest (heaviest) first."""
            h, b, hk, m0, n_blocks = query_pair_work(seqlen, group, BLOCK_M, BLOCK_N, CAUSAL)

            fp8: gl.constexpr = gl.float8e4nv
            q_tiles = gl.allocate_shared_memory(fp8, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
            do_tiles = gl.allocate_shared_memory(fp8, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
            k_ring = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_ring = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
            kt_ring = gl.allocate_shared_memory(fp8, [STAGES, HEAD_DIM, BLOCK_N], kt_desc.layout)
            if P_SMEM:
                xl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], fp8)
                x_tiles = gl.allocate_shared_memory(fp8, [2, BLOCK_M, BLOCK_N], xl)
            else:   # an unused placeholder
                x_tiles = q_tiles
            qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            kt_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            mbarrier.init(qdo_bar, count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(k_full.index(i), count=1)
                mbarrier.init(v_full.index(i), count=1)
                mbarrier.init(kt_full.index(i), count=1)
                mbarrier.init(free.index(i), count=2)   # one arrive per consumer warpgroup
            fence_async_shared()

            s_base = b.to(gl.int64) * ssb + hk * ssh
            row0 = m0
            row1 = m0 + BLOCK_M
            gl.warp_specialize([
                (_dq_consumer, (q_tiles.index(0), do_tiles.index(0), k_ring, v_ring, kt_ring, x_tiles.index(0),
                                qdo_bar, k_full, v_full, kt_full, free, DQ, QS, DOS, LSE2, DELTA, KS, VS, s_base,
                                row0, seqlen, b, h, heads, n_blocks, qk_scale, softmax_scale, HEAD_DIM, BLOCK_M,
                                BLOCK_N, STAGES, CAUSAL, KV_BLOCK, P_SMEM)),
                (_dq_consumer, (q_tiles.index(1), do_tiles.index(1), k_ring, v_ring, kt_ring, x_tiles.index(1),
                                qdo_bar, k_full, v_full, kt_full, free, DQ, QS, DOS, LSE2, DELTA, KS, VS, s_base,
                                row1, seqlen, b, h, heads, n_blocks, qk_scale, softmax_scale, HEAD_DIM, BLOCK_M,
                                BLOCK_N, STAGES, CAUSAL, KV_BLOCK, P_SMEM)),
                (_dq_producer, (q_desc, do_desc, k_desc, v_desc, kt_desc, q_tiles, do_tiles, k_ring, v_ring, kt_ring,
                                qdo_bar, k_full, v_full, kt_full, free, b * seqlen + m0, h * HEAD_DIM, b * seqlen,
                                hk * HEAD_DIM, (b * kv_heads + hk) * HEAD_DIM, n_blocks, BLOCK_M, BLOCK_N, STAGES)),
            ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

            mbarrier.invalidate(qdo_bar)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(k_full.index(i))
                mbarrier.invalidate(v_full.index(i))
                mbarrier.invalidate(kt_full.index(i))
                mbarrier.invalidate(free.index(i))
    except Exception as _e:  # noqa: BLE001 - a Gluon whose decorators or signatures differ
        _GLUON_ERROR = f"{type(_e).__name__}: {_e}"
        _fp8_bwd_dkdv_sm90 = _fp8_bwd_dq_sm90 = None
else:
    _fp8_bwd_dkdv_sm90 = _fp8_bwd_dq_sm90 = None
    if gl is not None:
        _GLUON_ERROR = "ImportError: warpgroup_mma_init"
LAUNCHERS = {"dkdv": FastLauncher(_fp8_bwd_dkdv_sm90), "dq": FastLauncher(_fp8_bwd_dq_sm90)}
# (kernel[grid]'s Python costs more host time than the rest of the backward's)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

def _fail(msg):
    raise ValueError(f"fp8_attention_sm90_bwd: {msg}")


def _kernel(kind):
    if kind not in ("dkdv", "dq"):
        _fail(f"kernel kind must be 'dkdv' or 'dq', got {kind!r}")
    return {"dkdv": _fp8_bwd_dkdv_sm90, "dq": _fp8_bwd_dq_sm90}[kind]


def _config(kind, head_dim, config):
    """(a, b, STAGES, P_SMEM) of a config of kernel `kind` (CONFIGS[kind][head_dim][0] for None), checked:
    dkdv (BLOCK_N, BLOCK_M, ...), dq (BLOCK_M, BLOCK_N, ...)."""
    cfg = tuple(config) if config is not None else CONFIGS[kind][head_dim][0]
    if len(cfg) not in (3, 4) or not all(isinstance(x, int) for x in cfg):
        _fail(f"{kind} config {cfg} is not (BLOCK, BLOCK, STAGES[, P_SMEM]) of ints")
    cfg = cfg if len(cfg) == 4 else (*cfg, 1)
    key_rows, query_rows = (cfg[0], cfg[1]) if kind == "dkdv" else (cfg[1], cfg[0])
    if KV_BLOCK_GPU % key_rows or key_rows < 32:
        _fail(f"{kind} config {cfg}: the key tile ({key_rows} rows) must divide {KV_BLOCK_GPU} and be >= 32")
    if query_rows < 32 or query_rows & (query_rows - 1):
        _fail(f"{kind} config {cfg}: the query tile ({query_rows} rows) must be a power of two >= 32")
    if cfg[0] != 64:
        _fail(f"{kind} config {cfg}: a consumer warpgroup's tile is 64 rows (one m64 wgmma)")
    if cfg[2] < 2:
        _fail(f"{kind} config {cfg}: STAGES must be >= 2")
    if kind == "dkdv" and not cfg[3]:
        _fail(f"dkdv config {cfg}: P_SMEM=0 is not supported (ptxas serializes the kernel's wgmmas)")
    return cfg


def _consts(kind, head_dim, causal, cfg):
    a, b, stages, p_smem = cfg
    names = ("BLOCK_N", "BLOCK_M") if kind == "dkdv" else ("BLOCK_M", "BLOCK_N")
    return {"HEAD_DIM": head_dim, names[0]: a, names[1]: b, "STAGES": stages, "CAUSAL": causal,
            "KV_BLOCK": KV_BLOCK_GPU, "P_SMEM": bool(p_smem), **ROLE_CONSTS}


@functools.lru_cache(maxsize=None)
def _layouts(kind, head_dim, cfg):
    """The shared layouts of the kernel's E4M3 TMA tiles: (row-major query-side (rows, d), transposed
    query-side (d, rows), row-major key-side, transposed key-side)."""
    fp8 = gl.float8e4nv
    bq, bk = (cfg[1], cfg[0]) if kind == "dkdv" else (cfg[0], cfg[1])
    return (gl.NVMMASharedLayout.get_default_for([bq, head_dim], fp8),
            gl.NVMMASharedLayout.get_default_for([head_dim, bq], fp8),
            gl.NVMMASharedLayout.get_default_for([bk, head_dim], fp8),
            gl.NVMMASharedLayout.get_default_for([head_dim, bk], fp8))


@functools.lru_cache(maxsize=None)
def _rows_layout(block):
    """The shared layout of a 1-D float32 tile of query-row values (the dK/dV kernel's _dkdv_rows)."""
    return gl.NVMMASharedLayout.get_default_for([block], gl.float32)


def _padded_rows(x, vstride):
    """x (float32 (batch, heads_q, seqlen)) with its rows vstride apart (zeros after seqlen): a 1-D TMA tile
    whose start is not 16-byte aligned crashed the dK/dV kernel ("illegal instruction" at every seqlen not a
    multiple of 16, bench/fp8_attention_sm90_bwd_probe.py at 81d9cc1), and a tile starts at row * seqlen."""
    if x.shape[-1] == vstride:
        return x
    out = x.new_zeros((*x.shape[:-1], vstride))
    out[..., :x.shape[-1]] = x
    return out


def _vector_desc(x, block):
    """A float32 (batch, heads_q, seqlen) array as a flat 1-D TMA tensor, block-element tiles: a tile running
    past a head's end reads the next head's values (masked by the kernel), past the array's end zeros."""
    flat = x.view(-1)
    return TensorDescriptor(flat, [flat.numel()], [1], [block], _rows_layout(block))


def compile_sm90(kind: str, head_dim: int, causal: bool, dtype: str = "bf16", config=None):
    """Kernel `kind` ('dkdv' or 'dq') compiled ahead of time for sm_90a (no GPU touched): dtype the gradients'
    ('bf16' or 'fp16'; every other operand is E4M3 or float32), config as in CONFIGS[kind]. What
    bench/fp8_attention_sm90_bwd.py --aot-only inspects and available() tries once."""
    fn = _kernel(kind)
    if fn is None:
        raise RuntimeError(f"no Gluon kernel in this Triton: {_GLUON_ERROR}")
    cfg = _config(kind, head_dim, config)
    bq, bk = (cfg[1], cfg[0]) if kind == "dkdv" else (cfg[0], cfg[1])
    rows_l, rows_t_l, keys_l, keys_t_l = _layouts(kind, head_dim, cfg)
    qd = tensordesc_type("fp8e4nv", (bq, head_dim), rows_l)
    qtd = tensordesc_type("fp8e4nv", (head_dim, bq), rows_t_l)
    kd = tensordesc_type("fp8e4nv", (bk, head_dim), keys_l)
    ktd = tensordesc_type("fp8e4nv", (head_dim, bk), keys_t_l)
    vd = tensordesc_type("fp32", (bq, ), _rows_layout(bq))
    types = {"q_desc": qd, "do_desc": qd, "qt_desc": qtd, "dot_desc": qtd, "k_desc": kd, "v_desc": kd,
             "kt_desc": ktd, "qs_desc": vd, "dsmul_desc": vd, "lse8_desc": vd, "dssub_desc": vd,
             "DK": f"*{dtype}", "DV": f"*{dtype}", "DQ": f"*{dtype}", "QS": "*fp32",
             "DOS": "*fp32", "LSE2": "*fp32", "DELTA": "*fp32", "KS": "*fp32", "VS": "*fp32", "DOA": "*fp32",
             "qk_scale": "fp32", "softmax_scale": "fp32"}
    return aot_compile(fn, _consts(kind, head_dim, causal, cfg), types)


@functools.lru_cache(maxsize=None)
def _gluon_builds() -> bool:
    """Whether this Triton's Gluon builds both kernels (once, ahead of time: the API may differ from 3.6's)."""
    return builds_ahead(lambda: compile_sm90("dkdv", 128, False), lambda: compile_sm90("dq", 128, False))


def available(device) -> bool:
    """True on a CUDA sm_90 device whose Triton's Gluon builds both kernels (checked once per process), outside
    the interpreter (whose K/V scale blocks are 32 rows, not the kernels' 128)."""
    return (_fp8_bwd_dkdv_sm90 is not None and _fp8_bwd_dq_sm90 is not None and f8.KV_BLOCK == KV_BLOCK_GPU
            and on_sm90(device) and _gluon_builds())


class Prepared(NamedTuple):
    """What fp8_attention._fp8_backward's prep and quantization passes write (dense layout, no rotation), as
    prepare() returns it: the kernels' inputs."""
    lse2: torch.Tensor    # float32 (batch, heads_q, seqlen): lse * log2(e)
    delta: torch.Tensor   # float32 (batch, heads_q, seqlen): rowsum(dO * O)
    q8: torch.Tensor      # E4M3 (batch, seqlen, heads_q, d), row scales qs
    q8t: torch.Tensor     # E4M3 (batch, heads_q, d, seqlen padded to 16), row scales qs
    qs: torch.Tensor      # float32 (batch, heads_q, seqlen)
    do8: torch.Tensor     # E4M3 (batch, seqlen, heads_q, d), row scales dos
    do8t: torch.Tensor    # E4M3 (batch, heads_q, d, padded seqlen), scaled by _scales(do_amax[head])
    dos: torch.Tensor     # float32 (batch, heads_q, seqlen)
    do_amax: torch.Tensor  # float32 (heads_q,): max |dO| over each head's GQA group
    k8: torch.Tensor      # E4M3 (batch, seqlen, heads_kv, d), block scales ks
    k8t: torch.Tensor     # E4M3 (batch, heads_kv, d, padded seqlen), block scales ks
    ks: torch.Tensor      # float32 (batch, heads_kv, cdiv(seqlen, 128))
    v8: torch.Tensor      # E4M3 (batch, seqlen, heads_kv, d), block scales vs
    vs: torch.Tensor      # float32 (batch, heads_kv, cdiv(seqlen, 128))


def _check(dout, q, k, v, out, lse, causal, softmax_scale, rotate):
    if _fp8_bwd_dkdv_sm90 is None or _fp8_bwd_dq_sm90 is None:
        _fail(f"Gluon's Hopper API is not available ({_GLUON_ERROR})")
    if rotate:
        _fail("rotate=True is not supported (the epilogues' back-rotation is not implemented; use "
              "fp8_attention.py)")
    check_dense("fp8_attention_sm90_bwd", q, k, v, causal, softmax_scale, CONFIGS["dq"])
    for name, t in (("dout", dout), ("out", out), ("lse", lse)):
        if not isinstance(t, torch.Tensor) or t.device != q.device:
            _fail(f"{name} must be a tensor on q's device ({q.device})")
    if not available(q.device):
        _fail(f"needs a CUDA sm_90 device with Gluon (and no interpreter), got {q.device}")
    if q.dtype not in (torch.bfloat16, torch.float16) or not all(t.dtype == q.dtype for t in (k, v, out, dout)):
        _fail(f"only bf16 and fp16 (q, k, v, out, dout alike), got {q.dtype}, {k.dtype}, {v.dtype}, "
              f"{out.dtype}, {dout.dtype}")
    batch, seqlen, heads, _ = q.shape
    if out.shape != q.shape or dout.shape != q.shape:
        _fail(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must have q's shape {tuple(q.shape)}")
    if tuple(lse.shape) != (batch, heads, seqlen) or lse.dtype != torch.float32:
        _fail(f"lse must be float32 (batch, heads_q, seqlen), got {tuple(lse.shape)} {lse.dtype}")


def prepare(dout, q, k, v, out, lse) -> Prepared:
    """The kernels' inputs, by the calls fp8_attention._fp8_backward makes for the dense layout without
    rotation or dLSE: its dO passes (lse2, delta, dO per row and transposed on its per-head amax), Q per row
    (also transposed), K per block (also transposed), V per block."""
    batch, seqlen, heads, _ = q.shape
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    lse2, delta, do8, do8t, dos, do_amax = f8._dout_passes(dout, out, lse, None, None, None, batch, seqlen, seqlen,
                                                           heads, k.shape[2], 0)
    q8, q8t, qs = f8._quantize(q, None, None, batch, seqlen, seqlen, rowwise=True, rot=None, transposed=True)
    k8, k8t, ks = f8._quantize(k, None, None, batch, seqlen, seqlen, rowwise=False, rot=None, transposed=True)
    v8, _, vs = f8._quantize(v, None, None, batch, seqlen, seqlen, rowwise=False)
    return Prepared(lse2, delta, q8, q8t, qs, do8, do8t, dos, do_amax, k8, k8t, ks, v8, vs)


def _rows_desc(x8, block_rows, layout):
    """A row-major E4M3 copy (batch, seqlen, heads, d) as the (batch * seqlen, heads * d) TMA matrix."""
    b, n, h, d = x8.shape
    x2 = x8.view(b * n, h * d)
    return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [block_rows, d], layout)


def _t_desc(x8t, block_cols, layout):
    """A transposed E4M3 copy (batch, heads, d, padded seqlen) as the (batch * heads * d, padded seqlen) TMA
    matrix, (d, block_cols) tiles (fp8_attention._t_descriptor's tiling, with the Gluon tile layout)."""
    d, n = x8t.shape[-2], x8t.shape[-1]
    x2 = x8t.view(-1, n)
    return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [d, block_cols], layout)


def _check_prepared(prep: Prepared, q, k):
    batch, seqlen, heads, d = q.shape
    kv_heads = k.shape[2]
    padded = -(-seqlen // 16) * 16
    n_kvb = -(-seqlen // KV_BLOCK_GPU)
    want = {"q8": (batch, seqlen, heads, d), "do8": (batch, seqlen, heads, d), "q8t": (batch, heads, d, padded),
            "do8t": (batch, heads, d, padded), "k8": (batch, seqlen, kv_heads, d), "v8": (batch, seqlen, kv_heads, d),
            "k8t": (batch, kv_heads, d, padded)}
    for name, shape in want.items():
        t = getattr(prep, name)
        if t.dtype != f8._FP8 or tuple(t.shape) != shape or not t.is_contiguous():
            _fail(f"{name} must be the pass's contiguous E4M3 {shape}, got {tuple(t.shape)} {t.dtype}")
    for name in ("lse2", "delta", "qs", "dos"):
        t = getattr(prep, name)
        if t.dtype != torch.float32 or tuple(t.shape) != (batch, heads, seqlen) or not t.is_contiguous():
            _fail(f"{name} must be contiguous float32 ({batch}, {heads}, {seqlen})")
    for name in ("ks", "vs"):
        t = getattr(prep, name)
        if t.dtype != torch.float32 or tuple(t.shape) != (batch, kv_heads, n_kvb) or t.stride(2) != 1:
            _fail(f"{name} must be float32 ({batch}, {kv_heads}, {n_kvb}) with unit last stride")
    if prep.ks.stride() != prep.vs.stride():
        _fail("ks and vs must share strides")
    if prep.do_amax.dtype != torch.float32 or tuple(prep.do_amax.shape) != (heads,):
        _fail(f"do_amax must be float32 ({heads},)")


def _new_grad(like, name, given):
    if given is None:
        return new_output(like.shape, like.dtype, like.device, _NAN_FILL)
    if given.shape != like.shape or given.dtype != like.dtype or given.device != like.device \
            or not given.is_contiguous():
        _fail(f"{name} must be contiguous {tuple(like.shape)} {like.dtype} on {like.device}")
    return given


def _dkdv_rows(prep: Prepared):
    """The dK/dV kernel's per-query vectors: qs, ds_mul = dos qs / 256, lse2 - 8 and ds_sub = delta qs / 256
    (the factors of P^T * 256 and dS^T diag(qs) / 256, made once per query rather than per key tile by every
    thread holding the column). At d128 (64, 64, 3, 1) the sm_90a consumer loop went from 639 to 567 SASS
    instructions (725 to 639 causal) and the kernel from 1.70 to 1.62 ms on the H200 at 4 x 4096 x 16
    (0.977 to 0.958 causal; bench/fp8_attention_sm90_bwd.py)."""
    qs_p = prep.qs * (1.0 / 256.0)
    return prep.qs, prep.dos * qs_p, prep.lse2 - 8.0, prep.delta * qs_p


def launch_dkdv(prep: Prepared, q, k, dk, dv, causal: bool, softmax_scale: float, config=None):
    """The Gluon replacement of fp8_attention's `_fp8_bwd_dkdv` (dense, no rotation): writes dk, dv (k's shape,
    contiguous, the gradients' dtype) from prepare()'s operands."""
    batch, seqlen, heads, d = q.shape
    kv_heads = k.shape[2]
    cfg = _config("dkdv", d, config)
    bn, bm = cfg[0], cfg[1]
    rows_l, rows_t_l, keys_l, _ = _layouts("dkdv", d, cfg)
    descs = (_rows_desc(prep.q8, bm, rows_l), _rows_desc(prep.do8, bm, rows_l), _t_desc(prep.q8t, bm, rows_t_l),
             _t_desc(prep.do8t, bm, rows_t_l), _rows_desc(prep.k8, bn, keys_l), _rows_desc(prep.v8, bn, keys_l))
    grid = (-(-seqlen // (2 * bn)), kv_heads, batch)
    vstride = -(-seqlen // 16) * 16
    vectors = [_vector_desc(_padded_rows(t, vstride), bm) for t in _dkdv_rows(prep)]
    LAUNCHERS["dkdv"](grid, *descs, *vectors, dk, dv, prep.ks, prep.vs, prep.do_amax, seqlen, vstride, heads,
                      kv_heads, heads // kv_heads, prep.ks.stride(0), prep.ks.stride(1), softmax_scale * LOG2E,
                      softmax_scale, **_consts("dkdv", d, causal, cfg), num_warps=4)


def launch_dq(prep: Prepared, q, k, dq, causal: bool, softmax_scale: float, config=None):
    """The Gluon replacement of fp8_attention's `_fp8_bwd_dq` (dense, no rotation): writes dq (q's shape,
    contiguous, the gradients' dtype) from prepare()'s operands."""
    batch, seqlen, heads, d = q.shape
    kv_heads = k.shape[2]
    cfg = _config("dq", d, config)
    bm, bn = cfg[0], cfg[1]
    rows_l, _, keys_l, keys_t_l = _layouts("dq", d, cfg)
    descs = (_rows_desc(prep.q8, bm, rows_l), _rows_desc(prep.do8, bm, rows_l), _rows_desc(prep.k8, bn, keys_l),
             _rows_desc(prep.v8, bn, keys_l), _t_desc(prep.k8t, bn, keys_t_l))
    grid = (-(-seqlen // (2 * bm)), heads, batch)
    LAUNCHERS["dq"](grid, *descs, dq, prep.qs, prep.dos, prep.lse2, prep.delta, prep.ks, prep.vs, seqlen, heads,
                    kv_heads, heads // kv_heads, prep.ks.stride(0), prep.ks.stride(1), softmax_scale * LOG2E,
                    softmax_scale, **_consts("dq", d, causal, cfg), num_warps=4)


def backward(dout, q, k, v, out, lse, causal: bool, softmax_scale: float, *, rotate: bool = False,
             dkdv_config=None, dq_config=None, prepared: Prepared = None, grads=None):
    """(dq, dk, dv) of FP8 attention as fp8_attention._fp8_backward returns them for the dense layout
    (cu_seqlens None, dLSE None, left -1, right 0 if causal else -1): its prep and quantization passes
    (prepare(), or `prepared` from an earlier call on the same tensors), then the two Gluon kernels. out and
    lse are the FP8 forward's (fp8_attention's or fp8_attention_sm90's). grads: contiguous (dq, dk, dv) to
    write into, else new ones (NaN-filled with _NAN_FILL). Raises ValueError for what it does not support,
    before any pass runs."""
    _check(dout, q, k, v, out, lse, causal, softmax_scale, rotate)
    d = q.shape[-1]
    dkdv_cfg = _config("dkdv", d, dkdv_config)
    dq_cfg = _config("dq", d, dq_config)
    prep = prepare(dout, q, k, v, out, lse) if prepared is None else prepared
    _check_prepared(prep, q, k)
    given = grads if grads is not None else (None, None, None)
    dq = _new_grad(q, "dq", given[0])
    dk = _new_grad(k, "dk", given[1])
    dv = _new_grad(v, "dv", given[2])
    launch_dkdv(prep, q, k, dk, dv, causal, float(softmax_scale), dkdv_cfg)
    launch_dq(prep, q, k, dq, causal, float(softmax_scale), dq_cfg)
    return dq, dk, dv
