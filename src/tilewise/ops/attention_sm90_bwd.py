"""Flash-attention backward for Hopper (sm_90a) in Gluon: warp-specialized, TMA-fed, async wgmma.

attention.py's backward runs it for the dense calls it covers (_gluon_backward_applies) where it is faster
than the Triton kernels (_gluon_wins: the first call of a shape class times both); the fused-QKV entry's
gradient views are written in place. Through flash_attention at 3217fbc (bench/attention.py): 440 / 387
TFLOP/s non-causal / causal at d128 4 x 4096 x 16 heads; the race keeps the Triton kernels at 1024 tokens
(GPT-2 124M, 32 x 1024 x 12 heads x 64 causal: 8.3 ms a step in these kernels against 6.9). Measured at
9a9ef10 (H200, bench/attention_sm90_bwd.py, backward TFLOP/s with the fastest config pair, counted as 2.5x the
forward's FLOPs): d128 4 x 4096 x 16 heads 437.8 against the
Triton backward's 421.2 non-causal and 389.0 against 363.4 causal (cuDNN 508.0 / 451.0); d64 4 x 4096 x 32
heads 368.6 / 328.3 against 364.0 / 323.6. The gradients agreed with the Triton backward's (max relative
difference under 0.6%). All 41 gpu tests passed at 2a6ac2d.

Replaces the two main kernels of attention.py's backward for the dense layout, `_attn_bwd_dkdv` and
`_attn_bwd_dq`; attention.py's own prep kernel (`_bwd_prep`, through its launcher `_backward_prep`) still
writes their inputs. The 7-GEMM split is kept (no atomics, bitwise repeatable gradients): Triton 3.6's
Gluon Hopper TMA module has no reduce-add copy (tma has async_copy_global_to_shared,
async_copy_shared_to_global, store_wait, make_tensor_descriptor only), and attention.py measured an
fp32-reduce dQ slower on the H200 (its module docstring).

Math (attention.py's, in base 2): with c = softmax_scale * log2(e), lse2 = lse * log2(e) (+inf for a row that
sees no key) and delta = rowsum(dO * O) (minus dLSE), both float32 (batch, heads_q, seqlen) from the prep:
P = exp2(S c - lse2), dP = dO V^T, dS = P * (dP - delta), dV = P^T dO, dK = dS^T Q * softmax_scale,
dQ = dS K * softmax_scale.

dK/dV kernel (`_attn_bwd_dkdv_sm90`), one program per (pair of BLOCK_N-row key tiles, kv head, batch):
- two consumer warpgroups (default partition and worker 0, 4 warps each): each owns one BLOCK_N-row K/V
  tile (the two side by side) and its dK, dV accumulators, and works in the transposed (key, query) frame:
  S^T = K Q_i^T, dP^T = V dO_i^T (A from shared memory, B the transposed Q / dO tile), P^T and dS^T in
  registers, dV += P^T dO_i and dK += dS^T Q_i (A from registers). Both read every Q/dO tile of one ring.
- one producer warp (worker 1): loads the two K and V tiles once, then streams (Q_i, dO_i) tiles with TMA
  into a STAGES-deep ring: for GQA over the query blocks of every query head of the kv head's group, in one
  flat loop (as attention.py's `_dkdv_blocks`), so dK, dV are summed over the group in registers. Each stage
  has q_full, do_full (TMA transaction counts) and one free barrier (count 2: an arrive per consumer when
  its four GEMMs of the stage are done). The producer waits on free with the opposite parity of its round.
- overlap in a consumer: S^T_i and dP^T_i are issued together; the exp2 of P^T_i runs while dP^T_i is on
  the tensor cores; dV += P^T_i dO_i is issued before dS^T_i is computed, so dS^T_i runs under it; then
  dK += dS^T_i Q_i. The two warpgroups run unsynchronized, so one's CUDA-core work overlaps the other's
  wgmmas (as in attention_sm90.py's forward).
- lse2 / delta of the query block are read by the consumers with plain loads issued before the GEMMs
  (64 floats each, from L2).

dQ kernel (`_attn_bwd_dq_sm90`), one program per (pair of BLOCK_M-row query tiles, head, batch):
- two consumer warpgroups, each with its own Q and dO tile (loaded once) and dQ accumulator; one producer
  warp streaming (K_j, V_j) into a ring with k_full / v_full / k_free / v_free (the forward's scheme).
- per key block: S = Q K_j^T and dP = dO V_j^T issued together, P under dP, dS, dQ += dS K_j.

dK/dV with dQ by atomics (`_attn_bwd_dkdv_dq_sm90`, backward(dq_mode="atomic"); not dispatched: slower). At
5c48d2c (H200, bench/attention_sm90_bwd.py) it was correct at every config (gradients within 0.3% of the Triton
backward's; 37 of its gpu tests passed before the run's time limit, none failed) but 0.80-0.85x the split mode:
d128 4 x 4096 x 16 372 / 327 TFLOP/s non-causal / causal against 439 / 388, 8 x 2048 x 16 341 / 281 against
421 / 346; d64 32 x 1024 x 12 235 / 179 against 295 / 216. Zeroing dq_acc and the cast took 0.10-0.13 ms of
it; the kernel alone (3.53 ms at d128 4 x 4096 non-causal) is slower than the dK/dV and dQ kernels together.
Where its time goes (da5663e, bench/attention_sm90_bwd_ablate.py, kernel alone, d128 8 x 2048 x 16 causal:
GPT-1.3B's shape): 1.04 ms with the consumers' atomics, 0.63 ms with them removed (the 5 GEMMs cost little more
than the split dK/dV kernel's 4: 0.56 ms; the dQ kernel is 0.39), 1.03 without the ds_ready handshake. So the
atomics are the cost, not the handshake.
Writer warps (a config's DQ_SLOTS > 0, FA3's dQ writer without its TMA reduce-add): each consumer stores its
partial (times softmax_scale) to its buffer of a shared-memory slot (128B-swizzled float32, BLOCK_M x DQ_N) and
arrives on the slot's dq_full (count 2); a 2-warp partition (_dq_writer) waits on it, loads 8-row slices and adds
them with 16-byte atomics (REDG.E.ADD.F32x4), then arrives on dq_free, which the consumers wait on before they
reuse the slot. The writer shares the producer warp's warpgroup slot, charged at its largest partition's
registers, so it has 24 (WRITER_REGS). At 1.3B's shape the kernel then takes 0.90 ms (0.77 without the atomics,
0.76 without the stores), at d128 4 x 4096 non-causal 2.90 against 3.48 (split: 1.86 + 1.24), at d64 32 x 1024 x
12 causal 0.50 against 0.59 (split 0.38 + 0.24). With the zeroing and the cast (0.10 ms) the whole backward is
still 0.95-0.97x the split mode at the e2e shapes (bench/results/sm90/attention_sm90_bwd_writer_da5663e.json:
325.0 against 337.7 TFLOP/s at 1.3B's, 204.1 against 215.3 at GPT-2 124M's), so it stays undispatched. A 1-warp
writer made it slower (1.34 ms: one warp cannot issue the 32 KB a step needs in time). Nor does it win in the
training step (bench/e2e_ab.py --attn-bwd atomic at d4f0276, bench/results/e2e_ab_atomic_d4f0276.json): at 1.3B
the kernel took 26.3 ms a step against the split kernels' 26.5, and the zeroing and the cast added 3.5 ms.
Design: the dK/dV kernel's grid, producer and loop, plus dQ_i = dS_i K, so 5 GEMMs a (key tile, query tile) instead
of 7 (no second S and dP). After dP^T_i each warpgroup stores dS^T_i (16-bit, BLOCK_N x BLOCK_M) to its half of
stage i's slot of ds_ring (fence_async_shared, then the partition's bar.sync), and takes dK's A from there too
(K-major, no register copy of dS^T). dQ_i's A is the slot's transposed view (MN-major, 16-bit wgmma takes it), B the
K tiles. SPLIT 1 (FA3's split): each warpgroup arrives on the stage's ds_ready (count 2) and waits for the other's
half, then computes dQ_i[:, its half of the columns] over both tiles' 2 BLOCK_N keys (two wgmmas, K = BLOCK_N each;
B a column slice of each K tile), so each adds BLOCK_M x D/2 and the pair's atomics halve. SPLIT 0: each warpgroup
dQ_i over its own keys, every column (no handshake, twice the atomics). The ring's free barrier now also frees the
stage's dS halves: a warpgroup overwrites its half only after the producer refilled the stage, i.e. after both
consumers' dQ wgmmas read it; for the same reason ds_ready can never run a phase ahead. Order in a step: S^T, dP^T;
P^T; dV (A P^T in registers); dS^T to shared memory; dK; [ds_ready]; wait dV (P^T's registers free); dQ; wait; free;
atomics (`gl.atomic_add(..., sem="relaxed")`, masked to query rows < seqlen). Keys past the end (the next sequence's
rows) would add to dQ: their S^T rows start at -inf (non-causal; causal masks them already). Registers at d128, 240
a consumer thread: dK + dV 128, S^T + dP^T 64, P^T 16 (as the dK/dV kernel) and dQ's 32 (64 x 64 fp32) only once S^T
/ dP^T are dead; SPLIT 0 at d128 (64 x 128, 64) spilled. The atomics' addresses: dq_acc is float32 (batch, heads_q,
seqlen, head_dim), so a step's tile is one block and each thread's 16 reductions are two base registers plus
immediates (in q's (batch, seqlen, heads) layout each took its own 64-bit address and the build spilled). The
accumulator layout gives each thread pairs of adjacent columns: PTX atom.global.gpu.relaxed.add.v2.f32, SASS
REDG.E.ADD.F32x2.STRONG.GPU (16 a thread a step at 64 x 64); a v4 layout would need a convert_layout through 16 KB
of shared memory a warpgroup. Shared memory at d128 (64, 64, 2, 1): K, V 64 KB, Q / dO ring 64 KB, ds_ring 2 stages
x 2 x 8 KB = 32 KB (164 KB). The backward zeroes dq_acc (torch.zeros), and one strided torch copy_ casts it into dq
(or the grads= view).

Masking: as the forward, by a branch on the boundary blocks only (causal diagonal, ragged end). In the dK/dV
kernel query rows past the end get lse2 = +inf (P = 0) and are masked; key rows past the end (the next
sequence's rows or TMA's zero fill) are computed and never stored. In the dQ kernel key columns past the end
are masked to P = 0; query rows past the end are never stored.

Supports: bf16 and fp16, head_dim 64 and 128, causal and non-causal, GQA (query head h uses kv head
h // (heads_q // heads_kv); dK, dV summed over the group), seqlen_q == seqlen_k of any length, the dense layout
only (no cu_seqlens, no sliding window, no dLSE), a positive softmax scale. Anything else raises ValueError
naming it (the caller falls back to attention.py).

Conventions (attention.py's `_attn_backward` with cu_seqlens=None): q, dout, o (batch, seqlen, heads_q,
head_dim), k, v (batch, seqlen, heads_kv, head_dim), lse float32 natural log (batch, heads_q, seqlen); dq, dk,
dv contiguous, the inputs' shapes and dtype.

The module imports on any Triton: without Gluon's Hopper API (or with another one) the kernels are not defined
and available() says False.
"""
from __future__ import annotations

import functools
import os

import torch

from .gluon_sm90 import builds_ahead
from .gluon_sm90 import (GLUON_ERROR as _GLUON_ERROR, ROLE_CONSTS, TensorDescriptor, aot_compile, as_rows,
                         check_dense, fence_async_shared, gl, gluon, grid_tile, invalidate_kv_ring, kv_ring_barriers,
                         mbarrier, new_output, on_sm90, query_pair_work, stream_kv, tensordesc_type, tma, token_rows,
                         warpgroup_mma, warpgroup_mma_wait)
from .launch import FastLauncher

LOG2E = 1.4426950408889634

# dkdv: (BLOCK_N keys per consumer warpgroup, BLOCK_M queries per ring tile, STAGES);
# dq: (BLOCK_M queries per consumer warpgroup, BLOCK_N keys per ring tile, STAGES);
# dkdv_dq (dq_mode="atomic"): dkdv's three, SPLIT (1: each warpgroup dQ's half of the columns over both key
# tiles; 0: every column over its own tile) and optionally DQ_SLOTS (> 0: the consumers hand their dQ partials
# to a writer warp through that many shared-memory slots, and it does the atomics). The first is the default.
# Only configs that build with 0 spills for bf16 / fp16, causal or not: d128 SPLIT 0 spilled 21 causal, d64
# BLOCK_M 128 spilled ~100, SPLIT with BLOCK_M 32 is no wgmma (M 32), the writer with SPLIT 0 at d64 spilled 10
# (its two buffers summed, 16 floats a thread each), d128 with two dQ slots 4 non-causal.
CONFIGS = {
    "dkdv": {128: [(64, 64, 2), (64, 32, 4)],
             64: [(64, 64, 3), (64, 128, 2), (64, 64, 4)]},
    "dq": {128: [(64, 64, 3), (64, 64, 2), (64, 128, 2)],
           64: [(64, 64, 3), (64, 128, 3), (64, 64, 4)]},
    "dkdv_dq": {128: [(64, 64, 2, 1), (64, 64, 2, 1, 1)],
                64: [(64, 64, 3, 0), (64, 64, 2, 1), (64, 64, 3, 1), (64, 64, 4, 0), (64, 64, 3, 1, 1),
                     (64, 64, 2, 1, 2), (64, 64, 3, 1, 2)]},
}
# dkdv_dq's writer warps (a config's fifth element > 0): their registers. They share the third warpgroup's slot with
# the producer warp, and that slot is charged its largest partition's count for all 128 threads: with the two
# consumer warpgroups at 240, 24 is all that is left (at 80 the default partition fell to 184 and spilled).
WRITER_REGS = 24
# Outputs start as NaN with TILEWISE_NAN_FILL=1 (read at import; the tests set _NAN_FILL), so unwritten
# elements show.
_NAN_FILL = os.environ.get("TILEWISE_NAN_FILL", "0") == "1"


if gl is not None:
    try:
        # ------------------------------------------------------------------------------------------
        # dK / dV
        # ------------------------------------------------------------------------------------------
        @gluon.jit
        def _dkdv_consumer(k_tile, v_tile, q_ring, do_ring, kv_bar, q_full, do_full, free,
                           DK, DV, LSE2, DELTA, key0, seqlen, b, hk, heads, out_row, h0, q_lo, n_iter,
                           qk_scale, softmax_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr):
            """One warpgroup's key tile (keys key0 .. key0 + BLOCK_N of sequence b, kv head hk) over n_iter
            (query head, query block) pairs of the ring, in the transposed frame."""
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_M, 16])
            g_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HEAD_DIM, 16])
            op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
            row_g: gl.constexpr = gl.SliceLayout(1, g_layout)
            col_g: gl.constexpr = gl.SliceLayout(0, g_layout)
            dtype: gl.constexpr = k_tile.dtype

            kpos = key0 + gl.arange(0, BLOCK_N, layout=row_s)
            cols = gl.arange(0, BLOCK_M, layout=col_s)
            zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
            dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
            dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
            inv_scale = 1.0 / qk_scale
            # a query block is masked when its first query lies before this tile's last key (causal) or its
            # last row past the end
            if CAUSAL:
                first_clean = key0 + BLOCK_N - 1
            else:
                first_clean = 0

            mbarrier.wait(kv_bar, 0)
            # the ring position and the (query head, query block) pair advance by counters, not divisions
            stage = 0
            phase = 0
            start_m = q_lo
            lrow = ((b * heads + h0) * seqlen).to(gl.int64)
            for it in range(n_iter):
                qpos = start_m + cols
                in_seq = qpos < seqlen
                # -lse2 / c and -delta start the S^T and dP^T accumulators, so the two vectors (16 registers
                # each in this column layout) are not live across the GEMMs
                # (both made before the first issue: written between the issues, ptxas waited for S^T first)
                lse2 = gl.load(LSE2 + lrow + qpos, mask=in_seq, other=float("inf"))
                delta = gl.load(DELTA + lrow + qpos, mask=in_seq, other=0.0)
                s_init = zero_s - gl.expand_dims(lse2 * inv_scale, 0)
                dp_init = zero_s - gl.expand_dims(delta, 0)

                mbarrier.wait(q_full.index(stage), phase)
                s_tok = warpgroup_mma(k_tile, q_ring.index(stage).permute((1, 0)), s_init, is_async=True)
                mbarrier.wait(do_full.index(stage), phase)
                dp_tok = warpgroup_mma(v_tile, do_ring.index(stage).permute((1, 0)), dp_init, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s_tok, ))          # S^T - lse2 / c done, dP^T may still run
                p = gl.exp2(s * qk_scale)
                if (start_m < first_clean) | (start_m + BLOCK_M > seqlen):
                    keep = gl.expand_dims(in_seq, 0)
                    if CAUSAL:
                        keep = keep & (gl.expand_dims(kpos, 1) <= gl.expand_dims(qpos, 0))
                    p = gl.where(keep, p, 0.0)
                p_op = gl.convert_layout(p.to(dtype), op_layout)
                dv_tok = warpgroup_mma(p_op, do_ring.index(stage), dv, is_async=True)
                dp = warpgroup_mma_wait(1, deps=(dp_tok, ))        # dP^T - delta done, dV may still run
                ds = p * dp
                ds_op = gl.convert_layout(ds.to(dtype), op_layout)
                dk_tok = warpgroup_mma(ds_op, q_ring.index(stage), dk, is_async=True)
                dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
                mbarrier.arrive(free.index(stage))
                stage += 1
                if stage == STAGES:
                    stage = 0
                    phase ^= 1
                start_m += BLOCK_M
                if start_m >= seqlen:   # the next query head of the group
                    start_m = q_lo
                    lrow += seqlen

            rows = key0 + gl.arange(0, BLOCK_N, layout=row_g)
            dcol = gl.arange(0, HEAD_DIM, layout=col_g)
            row64 = (b * seqlen + rows).to(gl.int64)
            offs = gl.expand_dims(row64 * out_row + hk * HEAD_DIM, 1) + gl.expand_dims(dcol, 0)
            mask = gl.expand_dims(rows < seqlen, 1) & gl.expand_dims(dcol < HEAD_DIM, 0)
            gl.store(DV + offs, dv.to(dtype), mask=mask)
            gl.store(DK + offs, (dk * softmax_scale).to(dtype), mask=mask)

        @gluon.jit
        def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, k_tiles, v_tiles, q_ring, do_ring, kv_bar,
                           q_full, do_full, free, kv_row, kv_col, q_row, h0, q_lo, seqlen_q, n_iter,
                           HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                           STAGES: gl.constexpr):
            """The two K and V tiles once, then (Q, dO) of (head h0 + g, query block) into stage it % STAGES once
            both consumers freed it."""
            mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_bar, k_tiles.index(0))
            tma.async_copy_global_to_shared(k_desc, [kv_row + BLOCK_N, kv_col], kv_bar, k_tiles.index(1))
            tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_bar, v_tiles.index(0))
            tma.async_copy_global_to_shared(v_desc, [kv_row + BLOCK_N, kv_col], kv_bar, v_tiles.index(1))
            stage = 0
            free_phase = 1   # the first round finds every stage free
            start_m = q_lo
            col = h0 * HEAD_DIM
            for it in range(n_iter):
                row = q_row + start_m
                mbarrier.wait(free.index(stage), free_phase)
                mbarrier.expect(q_full.index(stage), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [row, col], q_full.index(stage), q_ring.index(stage))
                mbarrier.expect(do_full.index(stage), do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(do_desc, [row, col], do_full.index(stage), do_ring.index(stage))
                stage += 1
                if stage == STAGES:
                    stage = 0
                    free_phase ^= 1
                start_m += BLOCK_M
                if start_m >= seqlen_q:   # the next query head of the group
                    start_m = q_lo
                    col += HEAD_DIM

        @gluon.jit
        def _attn_bwd_dkdv_sm90(q_desc, do_desc, k_desc, v_desc, DK, DV, LSE2, DELTA,
                                seqlen, heads, out_row, group, qk_scale, softmax_scale,
                                HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                                STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
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
            n_q = gl.cdiv(seqlen - q_lo, BLOCK_M)
            n_iter = n_q * group

            dtype: gl.constexpr = q_desc.dtype
            k_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
            q_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
            do_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
            kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            do_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_bar, count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(q_full.index(i), count=1)
                mbarrier.init(do_full.index(i), count=1)
                mbarrier.init(free.index(i), count=2)   # one arrive per consumer warpgroup
            fence_async_shared()

            key0 = n0
            key1 = n0 + BLOCK_N
            gl.warp_specialize([
                (_dkdv_consumer, (k_tiles.index(0), v_tiles.index(0), q_ring, do_ring, kv_bar, q_full, do_full,
                                  free, DK, DV, LSE2, DELTA, key0, seqlen, b, hk, heads, out_row, h0, q_lo,
                                  n_iter, qk_scale, softmax_scale, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, CAUSAL)),
                (_dkdv_consumer, (k_tiles.index(1), v_tiles.index(1), q_ring, do_ring, kv_bar, q_full, do_full,
                                  free, DK, DV, LSE2, DELTA, key1, seqlen, b, hk, heads, out_row, h0, q_lo,
                                  n_iter, qk_scale, softmax_scale, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, CAUSAL)),
                (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, k_tiles, v_tiles, q_ring, do_ring, kv_bar,
                                  q_full, do_full, free, b * seqlen + n0, hk * HEAD_DIM, b * seqlen, h0, q_lo,
                                  seqlen, n_iter, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES)),
            ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

            mbarrier.invalidate(kv_bar)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(q_full.index(i))
                mbarrier.invalidate(do_full.index(i))
                mbarrier.invalidate(free.index(i))

        # ------------------------------------------------------------------------------------------
        # dK / dV with dQ by atomics (dq_mode="atomic")
        # ------------------------------------------------------------------------------------------
        @gluon.jit
        def _dkdv_dq_consumer(k_tiles, v_tile, q_ring, do_ring, ds_ring, kv_bar, q_full, do_full, free, ds_ready,
                              dq_bufs, dq_full, dq_free,
                              DK, DV, DQA, LSE2, DELTA, key0, seqlen, b, heads, out_row, h0, q_lo, n_iter,
                              qk_scale, softmax_scale,
                              HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                              STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr, WG: gl.constexpr,
                              WRITER: gl.constexpr, DQ_SLOTS: gl.constexpr):
            """_dkdv_consumer's loop (warpgroup WG of the pair, keys key0 .. key0 + BLOCK_N) plus dQ_i: dS^T_i goes
            to ds_ring (stage, WG) and, SPLIT, dQ_i[:, WG half of the columns] = dS_i K over both tiles' keys once
            ds_ready says the other half is there; else dQ_i = dS_i K over its own keys, every column. The partial
            (times softmax_scale) is added to DQA (float32 (batch, heads_q, seqlen, head_dim)) with relaxed
            atomics, or with WRITER stored to this warpgroup's buffer of dq_bufs' slot for _dq_writer to add."""
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_M, 16])
            g_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HEAD_DIM, 16])
            DQ_N: gl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM
            q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, DQ_N, 16])
            op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
            row_g: gl.constexpr = gl.SliceLayout(1, g_layout)
            col_g: gl.constexpr = gl.SliceLayout(0, g_layout)
            row_q: gl.constexpr = gl.SliceLayout(1, q_layout)
            col_q: gl.constexpr = gl.SliceLayout(0, q_layout)
            k_tile = k_tiles.index(WG)
            dtype: gl.constexpr = k_tile.dtype

            kpos = key0 + gl.arange(0, BLOCK_N, layout=row_s)
            zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
            # keys past the end (the next sequence's rows) must not reach dQ: their S^T rows start at -inf (P^T
            # = 0; causal masks them already): two registers, no mask branch
            key_bias = gl.where(kpos < seqlen, 0.0, float("-inf"))
            cols = gl.arange(0, BLOCK_M, layout=col_s)
            qrows = gl.arange(0, BLOCK_M, layout=row_q)
            qoffs = gl.expand_dims(qrows * HEAD_DIM, 1) + gl.expand_dims(gl.arange(0, DQ_N, layout=col_q), 0)
            # the warpgroup's first dQ column (SPLIT: its half)
            DQ_COL: gl.constexpr = WG * DQ_N if SPLIT else 0
            zero_q = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=q_layout)
            dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
            dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
            inv_scale = 1.0 / qk_scale
            if CAUSAL:
                first_clean = key0 + BLOCK_N - 1
            else:
                first_clean = 0

            mbarrier.wait(kv_bar, 0)
            stage = 0
            phase = 0
            dslot = 0
            dfree_phase = 1   # the first round finds every dQ slot free
            start_m = q_lo
            lrow = ((b * heads + h0) * seqlen).to(gl.int64)
            for it in range(n_iter):
                qpos = start_m + cols
                in_seq = qpos < seqlen
                lse2 = gl.load(LSE2 + lrow + qpos, mask=in_seq, other=float("inf"))
                delta = gl.load(DELTA + lrow + qpos, mask=in_seq, other=0.0)
                if CAUSAL:
                    s_init = zero_s - gl.expand_dims(lse2 * inv_scale, 0)
                else:
                    s_init = gl.expand_dims(key_bias, 1) - gl.expand_dims(lse2 * inv_scale, 0)
                dp_init = zero_s - gl.expand_dims(delta, 0)

                mbarrier.wait(q_full.index(stage), phase)
                s_tok = warpgroup_mma(k_tile, q_ring.index(stage).permute((1, 0)), s_init, is_async=True)
                mbarrier.wait(do_full.index(stage), phase)
                dp_tok = warpgroup_mma(v_tile, do_ring.index(stage).permute((1, 0)), dp_init, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s_tok, ))
                p = gl.exp2(s * qk_scale)
                if (start_m < first_clean) | (start_m + BLOCK_M > seqlen):
                    keep = gl.expand_dims(in_seq, 0)
                    if CAUSAL:
                        keep = keep & (gl.expand_dims(kpos, 1) <= gl.expand_dims(qpos, 0))
                    p = gl.where(keep, p, 0.0)
                p_op = gl.convert_layout(p.to(dtype), op_layout)
                dv_tok = warpgroup_mma(p_op, do_ring.index(stage), dv, is_async=True)
                dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
                ds = (p * dp).to(dtype)
                ds_buf = ds_ring.index(2 * stage + WG)
                ds_buf.store(ds)
                fence_async_shared()   # the generic-proxy stores before the wgmmas' (async proxy) reads
                gl.thread_barrier()    # every thread's stores and fences before this warpgroup's wgmmas
                # dS^T from shared memory (K-major) as dK's A too: no register copy of dS^T stays live
                dk_tok = warpgroup_mma(ds_buf, q_ring.index(stage), dk, is_async=True)
                if SPLIT:
                    # both halves of dS_i (2 BLOCK_N keys) in place: each warpgroup's arrive follows its
                    # partition's bar.sync, so all 128 threads' stores (and fences) precede it
                    mbarrier.arrive(ds_ready.index(stage))
                    mbarrier.wait(ds_ready.index(stage), phase)
                dv, p_op = warpgroup_mma_wait(1, deps=(dv_tok, p_op))   # P^T's registers free for dQ's
                if SPLIT:
                    dq_tok = warpgroup_mma(ds_ring.index(2 * stage).permute((1, 0)),
                                           k_tiles.index(0).slice(WG * DQ_N, DQ_N, dim=1), zero_q,
                                           use_acc=False, is_async=True)
                    dq_tok = warpgroup_mma(ds_ring.index(2 * stage + 1).permute((1, 0)),
                                           k_tiles.index(1).slice(WG * DQ_N, DQ_N, dim=1), dq_tok, is_async=True)
                else:
                    dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_tile, zero_q, use_acc=False, is_async=True)
                dk, dq = warpgroup_mma_wait(0, deps=(dk_tok, dq_tok))
                mbarrier.arrive(free.index(stage))   # also frees this stage's dS halves (read by both)
                if WRITER:
                    # the partial to shared memory (16 8-byte stores a thread) for the writer warp's atomics,
                    # once the writer has read the slot's last round
                    mbarrier.wait(dq_free.index(dslot), dfree_phase)
                    dq_bufs.index(2 * dslot + WG).store(dq * softmax_scale)
                    gl.thread_barrier()   # every thread's stores before the arrive
                    mbarrier.arrive(dq_full.index(dslot))
                    dslot += 1
                    if dslot == DQ_SLOTS:
                        dslot = 0
                        dfree_phase ^= 1
                else:
                    # DQA is (batch, heads_q, seqlen, HEAD_DIM): the step's tile is one block, each thread's
                    # addresses one base and constant offsets
                    dqa = DQA + ((lrow + start_m) * HEAD_DIM + DQ_COL)
                    gl.atomic_add(dqa + qoffs, dq * softmax_scale, mask=gl.expand_dims(start_m + qrows < seqlen, 1),
                                  sem="relaxed")
                stage += 1
                if stage == STAGES:
                    stage = 0
                    phase ^= 1
                start_m += BLOCK_M
                if start_m >= seqlen:   # the next query head of the group
                    start_m = q_lo
                    lrow += seqlen

            # key0, hk, b again from the program ids: registers less across the loop (causal d128 spilled them)
            pid, hk, b = grid_tile(CAUSAL)
            rows = pid * (2 * BLOCK_N) + WG * BLOCK_N + gl.arange(0, BLOCK_N, layout=row_g)
            dcol = gl.arange(0, HEAD_DIM, layout=col_g)
            row64 = (b * seqlen + rows).to(gl.int64)
            col0 = hk.to(gl.int64) * HEAD_DIM   # int64: ptxas kept the int32 one in a spill slot
            offs = gl.expand_dims(row64 * out_row + col0, 1) + gl.expand_dims(dcol, 0)
            mask = gl.expand_dims(rows < seqlen, 1) & gl.expand_dims(dcol < HEAD_DIM, 0)
            gl.store(DV + offs, dv.to(dtype), mask=mask)
            gl.store(DK + offs, (dk * softmax_scale).to(dtype), mask=mask)

        @gluon.jit
        def _dq_writer(dq_bufs, dq_full, dq_free, DQA, seqlen, b, heads, h0, q_lo, n_iter,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT: gl.constexpr,
                       DQ_SLOTS: gl.constexpr, WRITER_WARPS: gl.constexpr):
            """WRITER_WARPS warps adding the consumers' dQ partials into DQA, in their (query head, query block) order:
            SPLIT, the two buffers of a slot are the two column halves of the tile; else both cover every
            column (each warpgroup's own keys) and are summed here, one atomic for the two. Rows CHUNK (the
            buffers' 8-row swizzle period) at a time over WRITER_WARPS warps, 16-byte relaxed atomics, rows past
            the end masked."""
            DQ_N: gl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM
            CHUNK: gl.constexpr = 8
            layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 * 4 // DQ_N,
                                                    DQ_N // 4], warps_per_cta=[WRITER_WARPS, 1], order=[1, 0])
            rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            dcol = gl.arange(0, DQ_N, layout=gl.SliceLayout(0, layout))
            offs = gl.expand_dims(rows * HEAD_DIM, 1) + gl.expand_dims(dcol, 0)
            slot = 0
            phase = 0
            start_m = q_lo
            lrow = ((b * heads + h0) * seqlen).to(gl.int64)
            for it in range(n_iter):
                mbarrier.wait(dq_full.index(slot), phase)
                base = DQA + (lrow + start_m) * HEAD_DIM
                for c in gl.static_range(BLOCK_M // CHUNK):
                    mask = gl.expand_dims(start_m + c * CHUNK + rows < seqlen, 1)
                    if SPLIT:
                        for half in gl.static_range(2):
                            part = dq_bufs.index(2 * slot + half).slice(c * CHUNK, CHUNK, dim=0).load(layout)
                            gl.atomic_add(base + (c * CHUNK * HEAD_DIM + half * DQ_N) + offs, part, mask=mask,
                                          sem="relaxed")
                    else:
                        part = (dq_bufs.index(2 * slot).slice(c * CHUNK, CHUNK, dim=0).load(layout)
                                + dq_bufs.index(2 * slot + 1).slice(c * CHUNK, CHUNK, dim=0).load(layout))
                        gl.atomic_add(base + c * CHUNK * HEAD_DIM + offs, part, mask=mask, sem="relaxed")
                mbarrier.arrive(dq_free.index(slot))
                slot += 1
                if slot == DQ_SLOTS:
                    slot = 0
                    phase ^= 1
                start_m += BLOCK_M
                if start_m >= seqlen:   # the next query head of the group
                    start_m = q_lo
                    lrow += seqlen

        @gluon.jit
        def _attn_bwd_dkdv_dq_sm90(q_desc, do_desc, k_desc, v_desc, DK, DV, DQA, LSE2, DELTA,
                                   seqlen, heads, out_row, group, qk_scale, softmax_scale,
                                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                                   STAGES: gl.constexpr, SPLIT: gl.constexpr, WRITER: gl.constexpr,
                                   DQ_SLOTS: gl.constexpr, WRITER_WARPS: gl.constexpr, CAUSAL: gl.constexpr,
                                   PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                   CONSUMER_REGS: gl.constexpr, WRITER_REGS: gl.constexpr):
            """_attn_bwd_dkdv_sm90's grid and producer; the consumers add dQ into DQA as they go."""
            pid, hk, b = grid_tile(CAUSAL)
            h0 = hk * group
            n0 = pid * (2 * BLOCK_N)
            if CAUSAL:
                q_lo = (n0 // BLOCK_M) * BLOCK_M
            else:
                q_lo = 0
            n_q = gl.cdiv(seqlen - q_lo, BLOCK_M)
            n_iter = n_q * group

            dtype: gl.constexpr = q_desc.dtype
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
            k_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
            q_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
            do_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
            # dS^T of (stage, warpgroup): K-major for dK's A, its transposed view MN-major for dQ's A
            ds_ring = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_N, BLOCK_M], ds_layout)
            kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            do_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            ds_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            DQ_N: gl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM
            if WRITER:
                dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_N], gl.float32)
                dq_bufs = gl.allocate_shared_memory(gl.float32, [2 * DQ_SLOTS, BLOCK_M, DQ_N], dq_layout)
                dq_full = gl.allocate_shared_memory(gl.int64, [DQ_SLOTS, 1], mbarrier.MBarrierLayout())
                dq_free = gl.allocate_shared_memory(gl.int64, [DQ_SLOTS, 1], mbarrier.MBarrierLayout())
                for i in gl.static_range(DQ_SLOTS):
                    mbarrier.init(dq_full.index(i), count=2)   # both warpgroups' partials stored
                    mbarrier.init(dq_free.index(i), count=1)   # the writer has read them
            else:   # placeholders: the consumers' atomics branch never touches them
                dq_bufs = ds_ring
                dq_full = ds_ready
                dq_free = ds_ready
            mbarrier.init(kv_bar, count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(q_full.index(i), count=1)
                mbarrier.init(do_full.index(i), count=1)
                mbarrier.init(free.index(i), count=2)       # one arrive per consumer warpgroup
                mbarrier.init(ds_ready.index(i), count=2)   # both halves of the stage's dS stored
            fence_async_shared()

            key0 = n0
            key1 = n0 + BLOCK_N
            # (one call per branch: a list of partitions cannot be a variable in a jit function)
            if WRITER:
                gl.warp_specialize([
                    (_dkdv_dq_consumer, (k_tiles, v_tiles.index(0), q_ring, do_ring, ds_ring, kv_bar, q_full, do_full,
                                         free, ds_ready, dq_bufs, dq_full, dq_free, DK, DV, DQA, LSE2, DELTA, key0,
                                         seqlen, b, heads, out_row, h0, q_lo, n_iter, qk_scale, softmax_scale, HEAD_DIM,
                                         BLOCK_N, BLOCK_M, STAGES, CAUSAL, SPLIT, 0, WRITER, DQ_SLOTS)),
                    (_dkdv_dq_consumer, (k_tiles, v_tiles.index(1), q_ring, do_ring, ds_ring, kv_bar, q_full, do_full,
                                         free, ds_ready, dq_bufs, dq_full, dq_free, DK, DV, DQA, LSE2, DELTA, key1,
                                         seqlen, b, heads, out_row, h0, q_lo, n_iter, qk_scale, softmax_scale, HEAD_DIM,
                                         BLOCK_N, BLOCK_M, STAGES, CAUSAL, SPLIT, 1, WRITER, DQ_SLOTS)),
                    (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, k_tiles, v_tiles, q_ring, do_ring, kv_bar,
                                      q_full, do_full, free, b * seqlen + n0, hk * HEAD_DIM, b * seqlen, h0, q_lo,
                                      seqlen, n_iter, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES)),
                    (_dq_writer, (dq_bufs, dq_full, dq_free, DQA, seqlen, b, heads, h0, q_lo, n_iter, HEAD_DIM,
                                  BLOCK_M, SPLIT, DQ_SLOTS, WRITER_WARPS)),
                ], [4, PRODUCER_WARPS, WRITER_WARPS], [CONSUMER_REGS, PRODUCER_REGS, WRITER_REGS])
                for i in gl.static_range(DQ_SLOTS):
                    mbarrier.invalidate(dq_full.index(i))
                    mbarrier.invalidate(dq_free.index(i))
            else:
                gl.warp_specialize([
                    (_dkdv_dq_consumer, (k_tiles, v_tiles.index(0), q_ring, do_ring, ds_ring, kv_bar, q_full, do_full,
                                         free, ds_ready, dq_bufs, dq_full, dq_free, DK, DV, DQA, LSE2, DELTA, key0,
                                         seqlen, b, heads, out_row, h0, q_lo, n_iter, qk_scale, softmax_scale, HEAD_DIM,
                                         BLOCK_N, BLOCK_M, STAGES, CAUSAL, SPLIT, 0, WRITER, DQ_SLOTS)),
                    (_dkdv_dq_consumer, (k_tiles, v_tiles.index(1), q_ring, do_ring, ds_ring, kv_bar, q_full, do_full,
                                         free, ds_ready, dq_bufs, dq_full, dq_free, DK, DV, DQA, LSE2, DELTA, key1,
                                         seqlen, b, heads, out_row, h0, q_lo, n_iter, qk_scale, softmax_scale, HEAD_DIM,
                                         BLOCK_N, BLOCK_M, STAGES, CAUSAL, SPLIT, 1, WRITER, DQ_SLOTS)),
                    (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, k_tiles, v_tiles, q_ring, do_ring, kv_bar,
                                      q_full, do_full, free, b * seqlen + n0, hk * HEAD_DIM, b * seqlen, h0, q_lo,
                                      seqlen, n_iter, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES)),
                ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

            mbarrier.invalidate(kv_bar)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(q_full.index(i))
                mbarrier.invalidate(do_full.index(i))
                mbarrier.invalidate(free.index(i))
                mbarrier.invalidate(ds_ready.index(i))

        # ------------------------------------------------------------------------------------------
        # dQ
        # ------------------------------------------------------------------------------------------
        @gluon.jit
        def _dq_consumer(q_tile, do_tile, k_ring, v_ring, qdo_bar, k_full, v_full, k_free, v_free,
                         DQ, LSE2, DELTA, out_row, row0, seqlen, b, h, heads, n_blocks, qk_scale,
                         softmax_scale,
                         HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, CAUSAL: gl.constexpr):
            """One warpgroup's query tile (rows row0 .. row0 + BLOCK_M of sequence b, head h) over n_blocks key
            blocks."""
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_N, 16])
            g_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HEAD_DIM, 16])
            op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
            row_g: gl.constexpr = gl.SliceLayout(1, g_layout)
            col_g: gl.constexpr = gl.SliceLayout(0, g_layout)
            dtype: gl.constexpr = q_tile.dtype

            qpos = row0 + gl.arange(0, BLOCK_M, layout=row_s)
            cols = gl.arange(0, BLOCK_N, layout=col_s)
            lrow = ((b * heads + h) * seqlen).to(gl.int64)
            lse2 = gl.load(LSE2 + lrow + qpos, mask=qpos < seqlen, other=float("inf"))
            delta = gl.load(DELTA + lrow + qpos, mask=qpos < seqlen, other=0.0)
            # a block is masked when its last key lies past this tile's first row (causal) or past the end
            if CAUSAL:
                limit = gl.minimum(row0 + 1, seqlen)
            else:
                limit = seqlen
            zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
            dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=g_layout)

            mbarrier.wait(qdo_bar, 0)
            for j in range(n_blocks):
                stage = j % STAGES
                phase = (j // STAGES) & 1
                mbarrier.wait(k_full.index(stage), phase)
                s_tok = warpgroup_mma(q_tile, k_ring.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                      is_async=True)
                mbarrier.wait(v_full.index(stage), phase)
                dp_tok = warpgroup_mma(do_tile, v_ring.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
                s = warpgroup_mma_wait(1, deps=(s_tok, ))          # S done, dP may still run
                p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
                start_n = j * BLOCK_N
                if start_n + BLOCK_N > limit:
                    kpos = start_n + cols
                    keep = gl.expand_dims(kpos, 0) < seqlen
                    if CAUSAL:
                        keep = keep & (gl.expand_dims(kpos, 0) <= gl.expand_dims(qpos, 1))
                    p = gl.where(keep, p, 0.0)
                dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
                mbarrier.arrive(v_free.index(stage))
                ds = p * (dp - gl.expand_dims(delta, 1))
                ds_op = gl.convert_layout(ds.to(dtype), op_layout)
                dq_tok = warpgroup_mma(ds_op, k_ring.index(stage), dq, is_async=True)
                dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
                mbarrier.arrive(k_free.index(stage))

            rows = row0 + gl.arange(0, BLOCK_M, layout=row_g)
            dcol = gl.arange(0, HEAD_DIM, layout=col_g)
            row64 = (b * seqlen + rows).to(gl.int64)
            ptrs = DQ + gl.expand_dims(row64 * out_row + h * HEAD_DIM, 1) + gl.expand_dims(dcol, 0)
            mask = gl.expand_dims(rows < seqlen, 1) & gl.expand_dims(dcol < HEAD_DIM, 0)
            gl.store(ptrs, (dq * softmax_scale).to(dtype), mask=mask)

        @gluon.jit
        def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_tiles, do_tiles, k_ring, v_ring, qdo_bar,
                         k_full, v_full, k_free, v_free, q_row, q_col, kv_row, kv_col, n_blocks,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
            """The two Q and dO tiles once, then K_j and V_j into stage j % STAGES once both consumers freed it."""
            mbarrier.expect(qdo_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row, q_col], qdo_bar, q_tiles.index(0))
            tma.async_copy_global_to_shared(q_desc, [q_row + BLOCK_M, q_col], qdo_bar, q_tiles.index(1))
            tma.async_copy_global_to_shared(do_desc, [q_row, q_col], qdo_bar, do_tiles.index(0))
            tma.async_copy_global_to_shared(do_desc, [q_row + BLOCK_M, q_col], qdo_bar, do_tiles.index(1))
            stream_kv(k_desc, v_desc, k_ring, v_ring, k_full, v_full, k_free, v_free, kv_row, kv_col, kv_row, kv_col,
                      n_blocks, BLOCK_N, STAGES, False)

        @gluon.jit
        def _attn_bwd_dq_sm90(q_desc, do_desc, k_desc, v_desc, DQ, LSE2, DELTA,
                              seqlen, heads, out_row, group, qk_scale, softmax_scale,
                              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                              STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                              PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr):
            """Grid (query tile pairs, heads_q, batch); causal pairs run latest (heaviest) first."""
            h, b, hk, m0, n_blocks = query_pair_work(seqlen, group, BLOCK_M, BLOCK_N, CAUSAL)

            dtype: gl.constexpr = q_desc.dtype
            q_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
            do_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
            k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
            qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_full, v_full, k_free, v_free = kv_ring_barriers(STAGES)
            mbarrier.init(qdo_bar, count=1)
            fence_async_shared()

            row0 = m0
            row1 = m0 + BLOCK_M
            gl.warp_specialize([
                (_dq_consumer, (q_tiles.index(0), do_tiles.index(0), k_ring, v_ring, qdo_bar, k_full, v_full,
                                k_free, v_free, DQ, LSE2, DELTA, out_row, row0, seqlen, b, h, heads, n_blocks,
                                qk_scale, softmax_scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
                (_dq_consumer, (q_tiles.index(1), do_tiles.index(1), k_ring, v_ring, qdo_bar, k_full, v_full,
                                k_free, v_free, DQ, LSE2, DELTA, out_row, row1, seqlen, b, h, heads, n_blocks,
                                qk_scale, softmax_scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
                (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_tiles, do_tiles, k_ring, v_ring, qdo_bar,
                                k_full, v_full, k_free, v_free, b * seqlen + m0, h * HEAD_DIM, b * seqlen,
                                hk * HEAD_DIM, n_blocks, BLOCK_M, BLOCK_N, STAGES)),
            ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

            mbarrier.invalidate(qdo_bar)
            invalidate_kv_ring(k_full, v_full, k_free, v_free, STAGES)
    except Exception as _e:  # noqa: BLE001 - a Gluon whose decorators or signatures differ
        _GLUON_ERROR = f"{type(_e).__name__}: {_e}"
        _attn_bwd_dkdv_sm90 = _attn_bwd_dq_sm90 = _attn_bwd_dkdv_dq_sm90 = None
else:
    _attn_bwd_dkdv_sm90 = _attn_bwd_dq_sm90 = _attn_bwd_dkdv_dq_sm90 = None
LAUNCHERS = {"dkdv": FastLauncher(_attn_bwd_dkdv_sm90), "dq": FastLauncher(_attn_bwd_dq_sm90),
             "dkdv_dq": FastLauncher(_attn_bwd_dkdv_dq_sm90)}   # kernel[grid]'s Python costs more than the rest


def _kernel(kind):
    return {"dkdv": _attn_bwd_dkdv_sm90, "dq": _attn_bwd_dq_sm90, "dkdv_dq": _attn_bwd_dkdv_dq_sm90}[kind]


def _tile_rows(kind, config):
    """(rows of a query tile, rows of a key tile) of the kernel's TMA descriptors."""
    if kind in ("dkdv", "dkdv_dq"):
        bn, bm = config[:2]
    else:
        bm, bn, _ = config
    return bm, bn


def _consts(kind, head_dim, causal, config):
    a, b, stages = config[:3]
    names = ("BLOCK_M", "BLOCK_N") if kind == "dq" else ("BLOCK_N", "BLOCK_M")
    extra = {}
    if kind == "dkdv_dq":
        slots = config[4] if len(config) > 4 else 0
        extra = {"SPLIT": bool(config[3]), "WRITER": slots > 0, "DQ_SLOTS": max(slots, 1), "WRITER_REGS": WRITER_REGS,
                 "WRITER_WARPS": config[5] if len(config) > 5 else 2}
    return {"HEAD_DIM": head_dim, names[0]: a, names[1]: b, "STAGES": stages, **extra, "CAUSAL": causal,
            **ROLE_CONSTS}


def compile_sm90(kind: str, head_dim: int, causal: bool, dtype: str = "bf16", config=None):
    """Kernel `kind` ('dkdv', 'dq' or 'dkdv_dq') compiled ahead of time for sm_90a (no GPU touched): dtype 'bf16'
    or 'fp16', config as in CONFIGS[kind]. What bench/attention_sm90_bwd_sass.py inspects and available() tries
    once."""
    fn = _kernel(kind)
    if fn is None:
        raise RuntimeError(f"no Gluon kernel in this Triton: {_GLUON_ERROR}")
    config = tuple(config) if config is not None else CONFIGS[kind][head_dim][0]
    bm, bn = _tile_rows(kind, config)
    q_layout, kv_layout = _smem_layouts(bm, bn, head_dim, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    qd = tensordesc_type(dtype, (bm, head_dim), q_layout)
    kd = tensordesc_type(dtype, (bn, head_dim), kv_layout)
    types = {"q_desc": qd, "do_desc": qd, "k_desc": kd, "v_desc": kd,
             "DK": f"*{dtype}", "DV": f"*{dtype}", "DQ": f"*{dtype}", "DQA": "*fp32", "LSE2": "*fp32",
             "DELTA": "*fp32",
             "qk_scale": "fp32", "softmax_scale": "fp32"}
    return aot_compile(fn, _consts(kind, head_dim, causal, config), types)


@functools.lru_cache(maxsize=None)
def _gluon_builds() -> bool:
    """Whether this Triton's Gluon builds both kernels (once, ahead of time: the API may differ from 3.6's)."""
    return builds_ahead(lambda: compile_sm90("dkdv", 128, False), lambda: compile_sm90("dq", 128, False))


def available(device) -> bool:
    """True on a CUDA sm_90 device whose Triton's Gluon builds these kernels (checked once per process)."""
    return (_attn_bwd_dkdv_sm90 is not None and _attn_bwd_dq_sm90 is not None and on_sm90(device)
            and _gluon_builds())


@functools.lru_cache(maxsize=None)
def _atomic_builds() -> bool:
    """Whether this Triton's Gluon builds dq_mode="atomic"'s kernel (once, ahead of time)."""
    return builds_ahead(lambda: compile_sm90("dkdv_dq", 128, False))


def available_atomic(device) -> bool:
    """available(device), and dq_mode="atomic"'s kernel builds too."""
    return available(device) and _attn_bwd_dkdv_dq_sm90 is not None and _atomic_builds()


def _check(dout, q, k, v, o, lse, causal, softmax_scale):
    if _attn_bwd_dkdv_sm90 is None or _attn_bwd_dq_sm90 is None:
        raise ValueError(f"attention_sm90_bwd: Gluon's Hopper API is not available ({_GLUON_ERROR})")
    check_dense("attention_sm90_bwd", q, k, v, causal, softmax_scale, CONFIGS["dq"])
    for name, t in (("dout", dout), ("o", o), ("lse", lse)):
        if not isinstance(t, torch.Tensor) or t.device != q.device:
            raise ValueError(f"attention_sm90_bwd: {name} must be a tensor on q's device ({q.device})")
    if not available(q.device):
        raise ValueError(f"attention_sm90_bwd: needs a CUDA sm_90 device, got {q.device}")
    if q.dtype not in (torch.bfloat16, torch.float16) or not all(t.dtype == q.dtype for t in (k, v, o, dout)):
        raise ValueError(f"attention_sm90_bwd: only bf16 and fp16 (q, k, v, o, dout alike), got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}, {o.dtype}, {dout.dtype}")
    batch, seqlen, heads, d = q.shape
    if o.shape != q.shape or dout.shape != q.shape:
        raise ValueError(f"attention_sm90_bwd: o {tuple(o.shape)} and dout {tuple(dout.shape)} must have q's "
                         f"shape {tuple(q.shape)}")
    if tuple(lse.shape) != (batch, heads, seqlen) or lse.dtype != torch.float32:
        raise ValueError(f"attention_sm90_bwd: lse must be float32 (batch, heads_q, seqlen), got "
                         f"{tuple(lse.shape)} {lse.dtype}")


@functools.lru_cache(maxsize=None)
def _smem_layouts(bm, bn, d, dtype):
    """The query-side (Q, dO) and key-side (K, V) tiles' shared-memory layouts, built once."""
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([bm, d], gdt), gl.NVMMASharedLayout.get_default_for([bn, d], gdt)


def _rows(t, name):
    rows = token_rows(t)
    if rows is None:
        raise ValueError(f"attention_sm90_bwd: {name} is not in a layout TMA tiles in place (see token_rows)")
    return rows


def _descriptors(q, dout, k, v, bm, bn):
    d = q.shape[-1]
    q_layout, kv_layout = _smem_layouts(bm, bn, d, q.dtype)
    q2, do2, k2, v2 = _rows(q, "q"), _rows(dout, "dout"), _rows(k, "k"), _rows(v, "v")
    return (TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [bm, d], q_layout),
            TensorDescriptor(do2, list(do2.shape), list(do2.stride()), [bm, d], q_layout),
            TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [bn, d], kv_layout),
            TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [bn, d], kv_layout))


def _output_rows(t, like, name) -> int:
    """The token-row stride of output t: a tensor of `like`'s shape and dtype whose token rows the kernels'
    stores address as token_rows does (a contiguous tensor, or a view of a fused QKV gradient)."""
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device or token_rows(t) is None:
        raise ValueError(f"attention_sm90_bwd: {name} must have shape {tuple(like.shape)}, {like.dtype}, on "
                         f"{like.device}, in token rows (see token_rows); got {tuple(t.shape)} {t.dtype} "
                         f"strides {t.stride()}")
    return t.stride(1)


def launch_dkdv(q, k, v, dout, dk, dv, lse2, delta, causal: bool, softmax_scale: float, config=None,
                num_warps: int = 4):
    """The Gluon replacement of attention.py's `_attn_bwd_dkdv` (dense): writes dk, dv (k's shape and dtype,
    token rows of one stride: contiguous, or views of a fused QKV gradient) from q, k, v, dout (token rows
    TMA tiles in place: see token_rows) and the prep's lse2, delta (float32 contiguous (batch, heads_q,
    seqlen))."""
    batch, seqlen, heads, d = q.shape
    heads_kv = k.shape[2]
    out_row = _output_rows(dk, k, "dk")
    if _output_rows(dv, k, "dv") != out_row:
        raise ValueError(f"attention_sm90_bwd: dk and dv must share their strides, got {dk.stride()} and "
                         f"{dv.stride()}")
    config = tuple(config) if config is not None else CONFIGS["dkdv"][d][0]
    bn, bm, stages = config
    descs = _descriptors(q, dout, k, v, bm, bn)
    grid = (-(-seqlen // (2 * bn)), heads_kv, batch)
    LAUNCHERS["dkdv"](grid, *descs, dk, dv, lse2, delta, seqlen, heads, out_row, heads // heads_kv,
                      softmax_scale * LOG2E, softmax_scale, **_consts("dkdv", d, causal, config), num_warps=num_warps)


def launch_dq(q, k, v, dout, dq, lse2, delta, causal: bool, softmax_scale: float, config=None,
              num_warps: int = 4):
    """The Gluon replacement of attention.py's `_attn_bwd_dq` (dense): writes dq (q's shape and dtype, token
    rows as launch_dkdv's dk); the inputs as launch_dkdv's."""
    batch, seqlen, heads, d = q.shape
    heads_kv = k.shape[2]
    out_row = _output_rows(dq, q, "dq")
    config = tuple(config) if config is not None else CONFIGS["dq"][d][0]
    bm, bn, stages = config
    descs = _descriptors(q, dout, k, v, bm, bn)
    grid = (-(-seqlen // (2 * bm)), heads, batch)
    LAUNCHERS["dq"](grid, *descs, dq, lse2, delta, seqlen, heads, out_row, heads // heads_kv,
                    softmax_scale * LOG2E, softmax_scale, **_consts("dq", d, causal, config), num_warps=num_warps)


def launch_dkdv_dq(q, k, v, dout, dk, dv, dq_acc, lse2, delta, causal: bool, softmax_scale: float, config=None,
                   num_warps: int = 4):
    """dq_mode="atomic"'s kernel: writes dk, dv as launch_dkdv and adds dQ (softmax_scale applied) into dq_acc, a
    zeroed float32 contiguous (batch, heads_q, seqlen, head_dim) tensor; the inputs as launch_dkdv's."""
    batch, seqlen, heads, d = q.shape
    heads_kv = k.shape[2]
    out_row = _output_rows(dk, k, "dk")
    if _output_rows(dv, k, "dv") != out_row:
        raise ValueError(f"attention_sm90_bwd: dk and dv must share their strides, got {dk.stride()} and "
                         f"{dv.stride()}")
    if (dq_acc.shape != (batch, heads, seqlen, d) or dq_acc.dtype != torch.float32 or not dq_acc.is_contiguous()
            or dq_acc.device != q.device):
        raise ValueError(f"attention_sm90_bwd: dq_acc must be float32 contiguous {(batch, heads, seqlen, d)} on "
                         f"{q.device}, got {tuple(dq_acc.shape)} {dq_acc.dtype}")
    config = tuple(config) if config is not None else CONFIGS["dkdv_dq"][d][0]
    bn, bm = config[:2]
    descs = _descriptors(q, dout, k, v, bm, bn)
    grid = (-(-seqlen // (2 * bn)), heads_kv, batch)
    LAUNCHERS["dkdv_dq"](grid, *descs, dk, dv, dq_acc, lse2, delta, seqlen, heads, out_row, heads // heads_kv,
                         softmax_scale * LOG2E, softmax_scale, **_consts("dkdv_dq", d, causal, config),
                         num_warps=num_warps)


DQ_MODES = ("split", "atomic")


def backward(dout, q, k, v, o, lse, causal: bool, softmax_scale: float, dkdv_config=None, dq_config=None,
             grads=None, dq_mode: str = "split", dkdv_dq_config=None):
    """(dq, dk, dv) of attention.py's dense backward with dLSE = None: attention.py's prep kernel
    (`_backward_prep`: lse2 = lse * log2(e), delta = rowsum(dO * O)), then the Gluon kernels. o and lse are
    the forward's (attention.py's or attention_sm90.py's, natural-log lse). grads: (dq, dk, dv) to write into
    (views of one fused QKV gradient, as attention.py's FlashAttnQKVFunction passes), else new contiguous
    tensors. dq_mode "split": the dK/dV and dQ kernels (7 GEMMs a tile pair, bitwise repeatable); "atomic": the
    dK/dV kernel that also adds dQ into a zeroed float32 buffer with atomics (5 GEMMs; dq repeatable only to
    the atomics' order), dkdv_dq_config as in CONFIGS["dkdv_dq"], then one cast into dq. Raises ValueError for
    what it does not support."""
    if dq_mode not in DQ_MODES:
        raise ValueError(f"attention_sm90_bwd: unknown dq_mode {dq_mode!r} (one of {', '.join(DQ_MODES)})")
    _check(dout, q, k, v, o, lse, causal, softmax_scale)
    if dq_mode == "atomic" and not available_atomic(q.device):
        raise ValueError(f"attention_sm90_bwd: dq_mode='atomic' does not build here ({_GLUON_ERROR})")
    from .attention import _backward_prep
    batch, seqlen, heads, d = q.shape
    q, _ = as_rows(q)
    k, _ = as_rows(k)
    v, _ = as_rows(v)
    dout, _ = as_rows(dout)
    if o.stride(-1) != 1:   # the prep reads o with its strides, the last one unit
        o = o.contiguous()
    lse2, delta = _backward_prep(dout, o, lse, None, None, batch, seqlen, seqlen, heads, 0)
    if grads is None:
        grads = tuple(new_output(t.shape, t.dtype, t.device, _NAN_FILL) for t in (q, k, v))
    dq, dk, dv = grads
    if dq_mode == "atomic":
        _output_rows(dq, q, "dq")
        dq_acc = torch.zeros((batch, heads, seqlen, d), dtype=torch.float32, device=q.device)
        launch_dkdv_dq(q, k, v, dout, dk, dv, dq_acc, lse2, delta, causal, float(softmax_scale), dkdv_dq_config)
        dq.copy_(dq_acc.transpose(1, 2))   # one strided cast (the scale is applied before the atomics)
        return dq, dk, dv
    launch_dkdv(q, k, v, dout, dk, dv, lse2, delta, causal, float(softmax_scale), dkdv_config)
    launch_dq(q, k, v, dout, dq, lse2, delta, causal, float(softmax_scale), dq_config)
    return dq, dk, dv
