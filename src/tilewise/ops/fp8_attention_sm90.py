"""FP8 (E4M3) flash-attention forward for Hopper (sm_90a) in Gluon: warp-specialized, TMA-fed, async wgmma.

fp8_attention._fp8_forward runs it for the dense, unrotated calls it covers, raced per key against the Triton
kernel as the bf16 Gluon kernels are (attention._gluon_wins, key "fp8_fwd"). Measured at 9a9ef10 (H200,
bench/fp8_attention_sm90.py, d128, 4 x 4096 x 16 heads, forward TFLOP/s): non-causal 756.7 for the kernel alone (config 64,128,2 with P in shared memory)
and 689.7 with fp8_attention's K/V passes (0.12 ms of it), against 690.6 for fp8_attention's Triton forward
(passes included) and 628.1 for attention_sm90's bf16 forward in that process; causal 620.9 / 549.6 against
558.5 and 507.2. Its outputs agreed with the Triton FP8 forward's (max relative difference 0.2% at that
config).

Schedules measured since (bench/results/sm90/fp8_attention_sm90_schedules.json, the three runs of
bench/README's command; TFLOP/s kernel alone, d128; a run's bf16 Gluon forward in brackets):
- PERSISTENT (a config's sixth element; attention_sm90's schedule, one program per SM over the query-pair
  tiles): at 4 x 4096 x 16, 786.8 against 744.9 non-causal and 653.6 against 614.1 causal for (64,128,3,1,0,1)
  and (64,128,2,1) [604.8, 521.8]; at 1 x 16384 even non-causal (816.2 / 809.6) and slower causal (734.3 /
  785.4) [623.3, 630.0]: the default at d128 up to attention_sm90.PERSISTENT_UP_TO tokens, as in bf16
  (default_config).
- PINGPONG (fifth element; the two warpgroups take turns issuing their wgmmas, attention_sm90's barriers):
  within 2% of the loose ping-pong in every cell (e.g. 742.8 / 737.4, 802.9 / 791.1), so off.
- BLOCK_N 256 (P_SMEM=2: one P buffer per warpgroup in its bf16 Q tile's bytes, 181 KB of shared memory; two
  buffers need 246 KB): needs K/V scale blocks of 256 rows (bench --kv-block 256; fp8_attention.KV_BLOCK is
  128 on the GPU, so no CONFIGS entry). 781.9 against 737.4 at 4 x 4096 non-causal, 620.0 / 617.8 causal,
  799.8 / 791.1 and 846.4 / 771.9 at 1 x 16384, against BLOCK_N 128 in the same run: 1-10%.
So the kernel alone is 1.25-1.31x the bf16 Gluon forward at these shapes and 1.09-1.30x with the K/V passes,
short of the 1.4x the FP8 attention issue asks. ex2.approx.f16x2 would not halve the exp2s: ptxas makes it
two MUFU.EX2.F16 on sm_90.
Profiled at d9232eb (ncu, bench/attention_ncu.sh; bench/results/sm90/attention_ncu_fp8_fwd_d9232eb.json, 4 x
4096 x 16 non-causal): the persistent default ran 683 us at a 1.79 GHz SM clock with the tensor pipe 41.5%
busy (the bf16 Gluon forward: 72.1%) and 44.9% of issue slots used; no resource is saturated, the consumer
warps are latency-bound. Their loop body (527 instructions a warp a key block) is stalled on fixed-latency
dependencies (27% of its samples), issuing 24%, waiting on wgmmas and barriers 11%; by instruction the
MUFU.EX2s (19%: the FFMA results they wait on, and the MUFU queue) and the row maxima's FMNMXs (18.5%:
gl.max folds a thread's 32 values of a row in one dependent chain) lead. TREE_ROWS folds them as a tree
(gluon_sm90.row_max / row_sum; same instruction count, no spills): not timed yet, so off.

What it computes: exactly fp8_attention.py's forward kernel `_fp8_fwd` (dense layout, no rotation), on the
operands that fp8_attention.py's own quantization pass `_quantize` (kernel `_fp8_quantize`) writes for
`_fp8_forward`, so (o, lse) can replace that launch and feed fp8_attention.py's FP8 backward unchanged:
- K: E4M3, q's layout (batch, seqlen, heads_kv, head_dim), one power-of-two scale per KV_BLOCK (128) rows of
  one head of one sequence (ks: (batch, heads_kv, blocks)); a key tile (BLOCK_N divides KV_BLOCK) has one.
- V: E4M3, transposed (batch, heads_kv, head_dim, seqlen padded to 16, the padding zero), scaled as K
  (vs). FP8 wgmma wants both operands K-major, hence V^T for P V.
- Q: bf16/fp16, quantized per row inside the kernel (the same arithmetic as fp8_attention's
  `_quantize_tile` and `_scales`: row amax, the largest power of two 2^e with amax 2^e <= 448, cast to E4M3
  rounding to nearest even), so the bits are the Triton kernel's. Here a consumer warpgroup loads its bf16
  tile (TMA, shared memory) into registers, quantizes it and stores the E4M3 tile to shared memory, where
  the Q K^T wgmmas read it (no global scratch copy as in `_fp8_fwd`, no pass). The row scale folds into
  the score factor c = qs * qk_scale * ks, one FMA a score as before.
- P = exp2(s c - (m - 8)): P * 256 in [0, 256], cast to E4M3 (the 1/256 cancels between acc and l), the
  running output acc kept in units of the current V block's scale: rescaled by alpha * vs_prev / vs_cur
  (a power of two times the softmax correction) before the next block's P V is added.
- Epilogue: o = acc * (vs / l), lse = (m + log2 l - 8) ln 2 (natural log, (batch, heads_q, seqlen), float32,
  contiguous: what `_fp8_forward` returns for the dense layout and `_fp8_backward` reads).
The float operations are those of `_fp8_fwd`, in the same order, on the same wgmma instructions (E4M3 x E4M3
-> fp32), so the outputs agree to accumulation order (the key blocks are visited in the same order;
the reductions' order inside a tile may differ) and the occasional E4M3 rounding of a P element one float32
ulp from a rounding boundary.

Warp roles (gl.warp_specialize), as attention_sm90.py:
- two consumer warpgroups (the default partition and worker 0, 4 warps each), each owning one BLOCK_M-row
  query tile, side by side, both reading every K/V tile of the shared ring, unsynchronized with each other
  (a loose ping-pong: the schedulers interleave one's softmax with the other's wgmma).
- one producer warp (worker 1, few registers): the two bf16 Q tiles once, then K_j and V_j^T tiles with TMA
  into a STAGES-deep ring, each stage with k_full / v_full (TMA transaction counts) and k_free / v_free
  (count 2, one arrive per consumer warpgroup) mbarriers.
Inside a consumer warpgroup (FA3's intra-warpgroup overlap): at key block j issue S_j = Q8 K_j^T (both
operands in shared memory), then O += P_{j-1} V_{j-1} (V^T's tile K-major in shared memory; P_{j-1} in E4M3
either in shared memory, two buffers per warpgroup, config P_SMEM=1, the default, or in registers in the
k_width 4 dot-operand layout, P_SMEM=0, or in one buffer per warpgroup that is stored after P_{j-1} V_{j-1}
is waited for, P_SMEM=2, or in registers against a key-permuted V^T, P_SMEM=3, see CONFIGS), wait only for
S_j, run the softmax of S_j while P_{j-1} V_{j-1} is on the tensor cores, then wait for it and rescale O.
(Triton 3.6's wgmma wait cannot keep an 8-bit register operand alive as a dependency, "Unexpected bitwidth
in WGMMAWaitGroupOp: 8", so the register paths wait on the accumulator alone and rely on ptxas, which sees
the wgmma read those registers; in the SASS they are not rewritten before the wait.)

Masking: a key block reaching past the causal diagonal of the tile's first row or past the end of the
sequence is masked (a branch: interior blocks pay nothing); K rows past the end (the next sequence's, or
TMA's zero fill) score -inf; V^T columns past the end are the pass's zero padding or TMA's zero fill, so
P V adds 0 there. Query rows past the end are computed (from the next sequence's rows, quantized on their
own rows' scales) and never stored.

Supports: Q bf16 or fp16 (K, V prepared by the pass), head_dim 64 and 128, causal and non-causal, GQA
(query head h reads KV head h // (heads_q // heads_kv)), seqlen_q == seqlen_k of any length, the dense
layout only, a positive softmax scale. No cu_seqlens, no sliding windows, no rotation (rotate=True raises
ValueError): the caller falls back to fp8_attention.py's Triton kernel for those.

The module imports on any Triton: without Gluon's Hopper API as Triton 3.6 spells it the kernel is not
defined and available() says False.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from . import attention_sm90 as a9
from . import fp8_attention as f8
from .gluon_sm90 import builds_ahead
from .gluon_sm90 import (GLUON_ERROR as _GLUON_ERROR, ROLE_CONSTS, TensorDescriptor, aot_compile,
                         fence_async_shared, gl, gluon, invalidate_kv_ring, kv_ring_barriers, mbarrier, new_output,
                         on_sm90, produce_tiles, query_pair_tile, query_pair_work, row_max, row_sum, stream_kv,
                         tensordesc_type, tma, warpgroup_mma, warpgroup_mma_wait)
from .launch import FastLauncher

LOG2E = 1.4426950408889634
KV_BLOCK_GPU = 128   # fp8_attention.KV_BLOCK outside the interpreter: the block of rows a K/V scale covers

# (BLOCK_M per consumer warpgroup, BLOCK_N, STAGES[, P_SMEM]) per head_dim; the first is the default.
# BLOCK_N divides KV_BLOCK (one K/V scale per tile) and is >= 32 (the FP8 wgmma's reduction step for P V).
# P_SMEM (default 0): 1 passes P to the P V wgmma through shared memory (two buffers per warpgroup) instead
# of registers: the register path's layout change of an E4M3 P (accumulator layout to the k_width 4
# operand layout) costs ~240 byte-permute instructions a key block in Triton 3.6 (bench --aot-only), the
# shared-memory path 32 2-byte stores, a fence and a warpgroup barrier. Which is faster is for the H200 to say.
# The shared-memory path is the default: its non-causal key-block loop is 667 SASS instructions against
# 899 (the bf16 Gluon kernel's: 590); that the loop's issue bounds it was a guess (see the module docstring).
# P_SMEM=3 (P_PERMUTED) keeps P in registers with the keys of V^T in fp8_attention.operand_order (the K/V
# pass's `permuted` copy, forward(v_permuted=True)): the layout change then moves no data (_operand_order),
# and P crosses the loop's back edge in float32, cast at its wgmma (_p_operand). Its grid configs build
# without spills and with fewer loop instructions than P_SMEM=1 (no P stores, fence or barrier; the SASS
# checked ahead of time); with PERSISTENT it spills (27 words non-causal), so no such entry. Not timed on the
# GPU yet, so no default uses it.
# (.., P_SMEM, PINGPONG, PERSISTENT): see the module docstring; PERSISTENT with neither PINGPONG nor P_SMEM=2.
# Tried and removed: rescaling O only in key blocks where some row's factor is not exactly 1 (a flag a warp
# read after the P barrier): the same bits, but 0.89-0.96x the plain configs on the H200 (d128, (4, 4096, 16) and
# (1, 16384, 16), causal and not; bench/results/sm90/skip_rescale_1a9dc12.json).
P_PERMUTED = 3
CONFIGS = {
    128: [(64, 128, 2, 1), (64, 128, 3, 1), (64, 128, 4, 1), (64, 64, 3, 1), (64, 128, 2), (64, 128, 3),
          (64, 64, 3), (64, 128, 4), (64, 64, 4), (64, 128, 3, 1, 0, 1), (64, 128, 2, 1, 0, 1),
          (64, 128, 2, 1, 1), (64, 128, 2, 3), (64, 128, 3, 3), (64, 128, 2, 3, 1)],
    64: [(64, 128, 3, 1), (64, 128, 2, 1), (64, 128, 3), (64, 128, 2), (64, 64, 4), (64, 128, 4),
         (64, 128, 3, 1, 0, 1), (64, 128, 3, 3)],
}
# The softmax's row max and row sum as gluon_sm90.row_max / row_sum's trees (True) or gl.max / gl.sum's
# chains (False, the default). The trees build for sm_90a with no spills and give the same outputs to 0.3%
# (the sums' order), but ran slower on the H200 (bench/softmax_rows.py at 2062a2c, d128, (4, 4096, 16) and
# (1, 16384, 16): FP8 forward 0.88-0.98x, bf16 0.87-0.98x; bench/results/sm90/softmax_rows_2062a2c.json).
TREE_ROWS = False
# Tried and removed: 1 or 2 of every 4 softmax exponentials by a degree-3 polynomial on the FMA and integer
# pipes instead of MUFU.EX2 (FlashAttention-4's split; at FP8 rates a 64 x 128 tile's 8192 exp2s at 16 a clock
# take as long as its two wgmmas at peak). The outputs matched the float64 reference as before, but every cell
# ran slower, FP8 0.92-1.00x and 0.83-0.92x, bf16 0.89-0.94x and 0.83-0.89x (d128, 3 shapes, causal and not;
# bench/results/sm90/exp2_split_9d7ad99.json, bench/exp2_split.py at 9d7ad99): the loop's 672 instructions
# became 786 and 899, so issue and latency, not MUFU, bound the consumers.
# The persistent config that is the default up to attention_sm90.PERSISTENT_UP_TO tokens, where measured.
PERSISTENT_DEFAULT = {128: (64, 128, 3, 1, 0, 1)}


def default_config(head_dim: int, seqlen=None) -> tuple:
    """PERSISTENT_DEFAULT[head_dim] up to PERSISTENT_UP_TO tokens, else CONFIGS[head_dim][0] (also for None)."""
    if seqlen is not None and seqlen <= a9.PERSISTENT_UP_TO and head_dim in PERSISTENT_DEFAULT:
        return PERSISTENT_DEFAULT[head_dim]
    return CONFIGS[head_dim][0]


def _config(head_dim, config, seqlen=None):
    """(BLOCK_M, BLOCK_N, STAGES, P_SMEM, PINGPONG, PERSISTENT) of a config (default_config for None)."""
    cfg = tuple(config if config is not None else default_config(head_dim, seqlen))
    if len(cfg) not in (3, 4, 5, 6):
        raise ValueError(f"fp8_attention_sm90: config {cfg} is not (BLOCK_M, BLOCK_N, STAGES[, P_SMEM[, PINGPONG"
                         f"[, PERSISTENT]]])")
    bm, bn, stages, p_smem, pingpong, persistent = (*cfg, 0, 0, 0)[:6]
    if p_smem not in (0, 1, 2, P_PERMUTED) or pingpong not in (0, 1) or persistent not in (0, 1):
        raise ValueError(f"fp8_attention_sm90: config {cfg}: P_SMEM is 0, 1, 2 or {P_PERMUTED}, PINGPONG and "
                         f"PERSISTENT 0 or 1")
    if persistent and (pingpong or p_smem == 2):
        raise ValueError(f"fp8_attention_sm90: config {cfg}: PERSISTENT combines with neither PINGPONG (its turns "
                         f"count one tile's batches) nor P_SMEM=2 (the next tile's Q loads into that P buffer)")
    return bm, bn, stages, p_smem, pingpong, persistent


# Outputs start as NaN with TILEWISE_NAN_FILL=1 (read at import; the tests set _NAN_FILL), so unwritten
# elements show.
_NAN_FILL = os.environ.get("TILEWISE_NAN_FILL", "0") == "1"


if gl is not None:
    try:
        @gluon.jit
        def _scales(amax):
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
        def _e4m3_words(x):
            """x.to(float8e4nv), four consecutive elements of a thread to one 32-bit word with two cvt.e4m3x2
            (the same rounding: to nearest even, saturating to +-448)."""
            y = gl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
                "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [x], dtype=gl.int8, is_pure=True, pack=4)
            return y.to(gl.float8e4nv, bitcast=True)

        @gluon.jit
        def _operand_order(p, M: gl.constexpr, N: gl.constexpr):
            """P's columns in fp8_attention.operand_order (bits 3, 2, 1 of a key to bits 1, 3, 2 inside each
            16): as the A operand of P V^T with the keys of V^T so permuted, P in the wgmma accumulator layout
            reaches the k_width 4 operand layout without leaving its thread's registers (a standalone sm_90a
            build of the conversion has no SHFL, PRMT or shared-memory access)."""
            x = gl.reshape(p, [M, N // 32, 2, 2, 2, 2, 2])   # key bits 6-5, 4, 3, 2, 1, 0
            return gl.reshape(gl.permute(x, [0, 1, 2, 4, 5, 3, 6]), [M, N])

        @gluon.jit
        def _p_operand(p_op, p_layout: gl.constexpr, M: gl.constexpr, N: gl.constexpr, P_SMEM: gl.constexpr):
            """P V's A operand from what the loop carries: with P_SMEM=3 the float32 P, cast here, at the wgmma
            (an 8-bit tensor carried across the loop's back edge lives one element a register, and ptxas then
            spends two PRMTs a pair taking it apart and packing it again); else p_op itself."""
            if P_SMEM == 3:
                return _e4m3_words(gl.convert_layout(_operand_order(p_op, M, N), p_layout))
            else:
                return p_op

        @gluon.jit
        def _consumer(q_tile, q8_tile, p_tiles, k_ring, v_ring, q_bar, q_free, k_full, v_full, k_free, v_free,
                      my_turn, other_turn, O, LSE, KS, VS, s_base, row0, seqlen, b, h, heads, n_blocks, qk_scale,
                      q_phase, filled, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_BLOCK: gl.constexpr,
                      P_SMEM: gl.constexpr, PINGPONG: gl.constexpr, FIRST: gl.constexpr, PERSISTENT: gl.constexpr,
                      TREE: gl.constexpr):
            """One warpgroup's query tile (rows row0 .. row0 + BLOCK_M of sequence b, head h): quantize Q
            into q8_tile, then n_blocks key blocks with S_j's wgmma and P_{j-1} V_{j-1}'s in flight together.
            With PINGPONG the two warpgroups take turns issuing their batch of wgmmas (batch j of the FIRST,
            then batch j of the other, ...), as attention_sm90's: before batch j a warpgroup waits on my_turn
            for the other's batch j - 1 (FIRST) or j, after it arrives on other_turn. The Q tile is q_bar's phase
            q_phase and key block j is in the ring's slot filled + j (both 0 but in the PERSISTENT schedule,
            where the bf16 Q tile is released on q_free once quantized)."""
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_N, 32])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HEAD_DIM, 32])
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
            q_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                      warps_per_cta=[4, 1], order=[1, 0])
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
            fp8: gl.constexpr = gl.float8e4nv

            qpos = row0 + gl.arange(0, BLOCK_M, layout=row_s)
            cols = gl.arange(0, BLOCK_N, layout=col_s)
            if CAUSAL:
                limit = gl.minimum(row0 + 1, seqlen)
            else:
                limit = seqlen
            zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

            # Q per row to E4M3 (fp8_attention._quantize_tile, ROWWISE, no rotation), into shared memory
            mbarrier.wait(q_bar, q_phase)
            x = q_tile.load(q_layout).to(gl.float32)
            inv, qs = _scales(gl.max(gl.abs(x), 1))
            q8_tile.store((x * gl.expand_dims(inv, 1)).to(fp8))
            fence_async_shared()
            gl.thread_barrier()   # the whole tile in shared memory before the warpgroup's wgmma reads it
            if PERSISTENT:
                mbarrier.arrive(q_free)   # the bf16 tile is read: the producer may load the next tile's
            qc = gl.convert_layout(qs, row_s) * qk_scale

            # key block 0: its scores and softmax, no P V in flight yet
            ks = gl.load(KS + s_base)
            vs_i = gl.load(VS + s_base)
            first = filled % STAGES
            mbarrier.wait(k_full.index(first), (filled // STAGES) & 1)
            if PINGPONG and not FIRST:
                mbarrier.wait(my_turn, 0)
            tok = warpgroup_mma(q8_tile, k_ring.index(first).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if PINGPONG:
                mbarrier.arrive(other_turn)
            s = warpgroup_mma_wait(0, deps=(tok, ))
            mbarrier.arrive(k_free.index(first))
            if BLOCK_N > limit:
                kpos = cols
                keep = gl.expand_dims(kpos, 0) < seqlen
                if CAUSAL:
                    keep = keep & (gl.expand_dims(kpos, 0) <= gl.expand_dims(qpos, 1))
                s = gl.where(keep, s, float("-inf"))
            c = qc * ks
            m_i = row_max(s, BLOCK_M, BLOCK_N, row_s, TREE) * c
            p = gl.exp2(s * gl.expand_dims(c, 1) - gl.expand_dims(m_i - 8.0, 1))   # P * 256
            l_i = row_sum(p, BLOCK_M, BLOCK_N, row_s, TREE)
            if P_SMEM == 1:
                p_tiles.index(0).store(p.to(fp8))
                fence_async_shared()
                gl.thread_barrier()
                p_op = p_tiles.index(0)
            elif P_SMEM == 2:
                p_tiles.store(p.to(fp8))
                fence_async_shared()
                gl.thread_barrier()
                p_op = p_tiles
            elif P_SMEM == 3:
                p_op = p   # float32 across the loop's back edge (see _p_operand)
            else:
                p_op = gl.convert_layout(p.to(fp8), p_layout)
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

            for j in range(1, n_blocks):
                slot = filled + j
                stage = slot % STAGES
                phase = (slot // STAGES) & 1
                prev = (slot - 1) % STAGES
                prev_phase = ((slot - 1) // STAGES) & 1
                start_n = j * BLOCK_N
                blk = start_n // KV_BLOCK
                ks = gl.load(KS + s_base + blk)
                vs = gl.load(VS + s_base + blk)
                mbarrier.wait(k_full.index(stage), phase)
                mbarrier.wait(v_full.index(prev), prev_phase)
                if PINGPONG:
                    mbarrier.wait(my_turn, (j - FIRST) & 1)
                s_tok = warpgroup_mma(q8_tile, k_ring.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                      is_async=True)
                o_tok = warpgroup_mma(_p_operand(p_op, p_layout, BLOCK_M, BLOCK_N, P_SMEM),
                                      v_ring.index(prev).permute((1, 0)), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(other_turn)
                s = warpgroup_mma_wait(1, deps=(s_tok, ))   # S_j done, P_{j-1} V_{j-1} may still run
                mbarrier.arrive(k_free.index(stage))
                if start_n + BLOCK_N > limit:
                    kpos = start_n + cols
                    keep = gl.expand_dims(kpos, 0) < seqlen
                    if CAUSAL:
                        keep = keep & (gl.expand_dims(kpos, 0) <= gl.expand_dims(qpos, 1))
                    s = gl.where(keep, s, float("-inf"))
                c = qc * ks
                m_new = gl.maximum(m_i, row_max(s, BLOCK_M, BLOCK_N, row_s, TREE) * c)
                p = gl.exp2(s * gl.expand_dims(c, 1) - gl.expand_dims(m_new - 8.0, 1))
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + row_sum(p, BLOCK_M, BLOCK_N, row_s, TREE)
                m_i = m_new
                if P_SMEM == 1:   # the other buffer: P_{j-2} V_{j-2}, its last reader, was waited for
                    p_next = p_tiles.index(j % 2)
                    p_next.store(p.to(fp8))
                    fence_async_shared()
                elif P_SMEM == 2:
                    p8 = p.to(fp8)
                elif P_SMEM == 3:
                    p_next = p
                else:
                    p_next = gl.convert_layout(p.to(fp8), p_layout)
                acc = warpgroup_mma_wait(0, deps=(o_tok, ))   # (an E4M3 p_op cannot be a dep in 3.6)
                mbarrier.arrive(v_free.index(prev))
                if P_SMEM == 2:   # the one buffer: its reader P_{j-1} V_{j-1} is done
                    p_tiles.store(p8)
                    fence_async_shared()
                    p_next = p_tiles
                # acc from V_{j-1}'s units to V_j's, with the softmax correction (as _fp8_fwd_blocks)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha * (vs_i / vs), row_o), 1)
                vs_i = vs
                p_op = p_next
                if P_SMEM == 1 or P_SMEM == 2:
                    gl.thread_barrier()   # every thread's share of P_j stored before its wgmma

            last = (filled + n_blocks - 1) % STAGES
            mbarrier.wait(v_full.index(last), ((filled + n_blocks - 1) // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(my_turn, (n_blocks - FIRST) & 1)
            o_tok = warpgroup_mma(_p_operand(p_op, p_layout, BLOCK_M, BLOCK_N, P_SMEM),
                                  v_ring.index(last).permute((1, 0)), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(other_turn)
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(v_free.index(last))

            # epilogue as _fp8_fwd's: o = acc * (vs / l), lse = (m + log2 l - 8) ln 2; rows past the end unstored
            empty = l_i == 0.0
            l_safe = gl.where(empty, 1.0, l_i)
            f_o = gl.convert_layout(vs_i / l_safe, row_o)
            out = acc * gl.expand_dims(f_o, 1)
            rows = row0 + gl.arange(0, BLOCK_M, layout=row_o)
            dcol = gl.arange(0, HEAD_DIM, layout=col_o)
            row64 = (b * seqlen + rows).to(gl.int64)
            o_ptrs = O + gl.expand_dims(row64 * (heads * HEAD_DIM) + h * HEAD_DIM, 1) + gl.expand_dims(dcol, 0)
            o_mask = gl.expand_dims(rows < seqlen, 1) & gl.expand_dims(dcol < HEAD_DIM, 0)
            gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)
            lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe) - 8.0) * 0.6931471805599453)
            lse_ptrs = LSE + (b * heads + h).to(gl.int64) * seqlen + rows
            gl.store(lse_ptrs, gl.convert_layout(lse, row_o), mask=rows < seqlen)

        @gluon.jit
        def _producer(q_desc, k_desc, v_desc, q_tile0, q_tile1, k_ring, v_ring, q_bar, k_full, v_full, k_free,
                      v_free, q_row, q_col, kv_row, kv_col, vt_row, n_blocks,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
            """The two bf16 Q tiles once, then K_j and V_j^T into stage j % STAGES once both consumers freed it."""
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_tile0)
            tma.async_copy_global_to_shared(q_desc, [q_row + BLOCK_M, q_col], q_bar, q_tile1)
            stream_kv(k_desc, v_desc, k_ring, v_ring, k_full, v_full, k_free, v_free, kv_row, kv_col, vt_row, 0,
                      n_blocks, BLOCK_N, STAGES, True)

        @gluon.jit
        def _consumer_tiles(q_tile, q8_tile, p_tiles, k_ring, v_ring, q_bar, q_free, k_full, v_full, k_free, v_free,
                            O, LSE, KS, VS, ssb, ssh, seqlen, heads, group, n_pairs, units, section, n_tiles,
                            qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_BLOCK: gl.constexpr,
                            P_SMEM: gl.constexpr, SECOND: gl.constexpr, TREE: gl.constexpr):
            """A consumer warpgroup in the persistent schedule: _consumer for its query tile (the pair's second
            with SECOND) of tiles pid, pid + nprog, ..., the producer's order; tile i's Q is q_bar's phase
            i & 1, and the ring's slots run on from tile to tile."""
            filled = 0
            q_phase = 0
            for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
                h, b, hk, m0, n_blocks = query_pair_tile(t, n_pairs, heads, units, section, seqlen, group, BLOCK_M,
                                                         BLOCK_N, CAUSAL)
                s_base = b.to(gl.int64) * ssb + hk * ssh
                _consumer(q_tile, q8_tile, p_tiles, k_ring, v_ring, q_bar, q_free, k_full, v_full, k_free, v_free,
                          q_free, q_free, O, LSE, KS, VS, s_base, m0 + SECOND * BLOCK_M, seqlen, b, h, heads,
                          n_blocks, qk_scale, q_phase, filled, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, KV_BLOCK,
                          P_SMEM, False, not SECOND, True, TREE)
                filled += n_blocks
                q_phase ^= 1

        @gluon.jit(do_not_specialize=["batch", "section"])   # one build for any batch (the grid schedule's unused)
        def _fp8_fwd_sm90(q_desc, k_desc, v_desc, KS, VS, O, LSE, seqlen, heads, kv_heads, group, ssb, ssh,
                          qk_scale, batch, section, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_BLOCK: gl.constexpr,
                          P_SMEM: gl.constexpr, PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr, TREE: gl.constexpr,
                          PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
            """Grid (query tile pairs, heads_q, batch), causal pairs latest (heaviest) first; with PERSISTENT a
            grid (programs,) of at most one per SM over tiles pid, pid + programs, ... in query_pair_tile's
            order (`section`: its causal section, in units of (batch, head)), as attention_sm90's."""
            if not PERSISTENT:
                h, b, hk, m0, n_blocks = query_pair_work(seqlen, group, BLOCK_M, BLOCK_N, CAUSAL)

            qdt: gl.constexpr = q_desc.dtype
            fp8: gl.constexpr = gl.float8e4nv
            q8_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], fp8)
            q8_tiles = gl.allocate_shared_memory(fp8, [2, BLOCK_M, HEAD_DIM], q8_layout)
            k_ring = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_ring = gl.allocate_shared_memory(fp8, [STAGES, HEAD_DIM, BLOCK_N], v_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_full, v_full, k_free, v_free = kv_ring_barriers(STAGES)
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # see _consumer
            mbarrier.init(q_bar, count=1)
            mbarrier.init(turn.index(0), count=1)
            mbarrier.init(turn.index(1), count=1)
            q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())   # PERSISTENT only
            mbarrier.init(q_free, count=2)   # one arrive per consumer warpgroup and tile
            fence_async_shared()

            if P_SMEM == 2:
                # one P buffer per warpgroup, in the bytes of its bf16/fp16 Q tile (free once the consumer has
                # quantized it: its thread barrier after q8_tile.store); BLOCK_N == 2 HEAD_DIM, E4M3 P
                gl.static_assert(BLOCK_N == 2 * HEAD_DIM, "P_SMEM=2 needs BLOCK_N == 2 * HEAD_DIM")
                p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], fp8)
                p_all = gl.allocate_shared_memory(fp8, [2 * BLOCK_M, BLOCK_N], p_layout)
                q_all = p_all._reinterpret(qdt, [2 * BLOCK_M, HEAD_DIM], q_desc.layout)
                q_tile0 = q_all.slice(0, BLOCK_M)
                q_tile1 = q_all.slice(BLOCK_M, BLOCK_M)
                p0 = p_all.slice(0, BLOCK_M)
                p1 = p_all.slice(BLOCK_M, BLOCK_M)
            else:
                q_tiles = gl.allocate_shared_memory(qdt, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
                q_tile0 = q_tiles.index(0)
                q_tile1 = q_tiles.index(1)
                if P_SMEM == 1:
                    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], fp8)
                    p0 = gl.allocate_shared_memory(fp8, [2, BLOCK_M, BLOCK_N], p_layout)
                    p1 = gl.allocate_shared_memory(fp8, [2, BLOCK_M, BLOCK_N], p_layout)
                else:
                    p0 = q8_tiles
                    p1 = q8_tiles
            if PERSISTENT:
                n_pairs = gl.cdiv(seqlen, 2 * BLOCK_M)
                units = heads * batch
                n_tiles = n_pairs * units
                gl.warp_specialize([
                    (_consumer_tiles, (q_tile0, q8_tiles.index(0), p0, k_ring, v_ring, q_bar, q_free, k_full,
                                       v_full, k_free, v_free, O, LSE, KS, VS, ssb, ssh, seqlen, heads, group,
                                       n_pairs, units, section, n_tiles, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                                       STAGES, CAUSAL, KV_BLOCK, P_SMEM, 0, TREE)),
                    (_consumer_tiles, (q_tile1, q8_tiles.index(1), p1, k_ring, v_ring, q_bar, q_free, k_full,
                                       v_full, k_free, v_free, O, LSE, KS, VS, ssb, ssh, seqlen, heads, group,
                                       n_pairs, units, section, n_tiles, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                                       STAGES, CAUSAL, KV_BLOCK, P_SMEM, 1, TREE)),
                    (produce_tiles, (q_desc, k_desc, v_desc, q_tile0, q_tile1, k_ring, v_ring, q_bar, q_free,
                                     k_full, v_full, k_free, v_free, seqlen, heads, group, n_pairs, units, section,
                                     n_tiles, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, True)),
                ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
            else:
                s_base = b.to(gl.int64) * ssb + hk * ssh
                gl.warp_specialize([
                    (_consumer, (q_tile0, q8_tiles.index(0), p0, k_ring, v_ring, q_bar, q_free, k_full, v_full,
                                 k_free, v_free, turn.index(0), turn.index(1), O, LSE, KS, VS, s_base, m0, seqlen,
                                 b, h, heads, n_blocks, qk_scale, 0, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                                 KV_BLOCK, P_SMEM, PINGPONG, True, False, TREE)),
                    (_consumer, (q_tile1, q8_tiles.index(1), p1, k_ring, v_ring, q_bar, q_free, k_full, v_full,
                                 k_free, v_free, turn.index(1), turn.index(0), O, LSE, KS, VS, s_base,
                                 m0 + BLOCK_M, seqlen, b, h, heads, n_blocks, qk_scale, 0, 0, HEAD_DIM, BLOCK_M,
                                 BLOCK_N, STAGES, CAUSAL, KV_BLOCK, P_SMEM, PINGPONG, False, False, TREE)),
                    (_producer, (q_desc, k_desc, v_desc, q_tile0, q_tile1, k_ring, v_ring, q_bar, k_full, v_full,
                                 k_free, v_free, b * seqlen + m0, h * HEAD_DIM, b * seqlen, hk * HEAD_DIM,
                                 (b * kv_heads + hk) * HEAD_DIM, n_blocks, BLOCK_M, BLOCK_N, STAGES)),
                ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

            mbarrier.invalidate(q_bar)
            mbarrier.invalidate(q_free)
            mbarrier.invalidate(turn.index(0))
            mbarrier.invalidate(turn.index(1))
            invalidate_kv_ring(k_full, v_full, k_free, v_free, STAGES)
    except Exception as _e:  # noqa: BLE001 - a Gluon whose decorators or signatures differ
        _GLUON_ERROR = f"{type(_e).__name__}: {_e}"
        _fp8_fwd_sm90 = None
else:
    _fp8_fwd_sm90 = None
_FWD_LAUNCH = FastLauncher(_fp8_fwd_sm90)   # kernel[grid]'s Python is most of the forward's host time


@functools.lru_cache(maxsize=None)
def _layouts(head_dim, bm, bn, qdt):
    """(Q, K, V^T) shared layouts of the TMA tiles: Q (bm, d) in q's dtype, K (bn, d), V^T (d, bn) in E4M3."""
    return (gl.NVMMASharedLayout.get_default_for([bm, head_dim], qdt),
            gl.NVMMASharedLayout.get_default_for([bn, head_dim], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([head_dim, bn], gl.float8e4nv))


def compile_sm90(head_dim: int, causal: bool, dtype: str = "bf16", config=None):
    """The kernel compiled ahead of time for sm_90a (no GPU touched): dtype (Q's and O's) 'bf16' or 'fp16',
    config as in forward(). What bench/fp8_attention_sm90.py --aot-only inspects and available() tries once."""
    if _fp8_fwd_sm90 is None:
        raise RuntimeError(f"no Gluon kernel in this Triton: {_GLUON_ERROR}")
    bm, bn, stages, p_smem, pingpong, persistent = _config(head_dim, config)
    q_layout, k_layout, v_layout = _layouts(head_dim, bm, bn, {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype])
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CAUSAL=causal, KV_BLOCK=KV_BLOCK_GPU,
                  P_SMEM=p_smem, PINGPONG=bool(pingpong), PERSISTENT=bool(persistent), TREE=TREE_ROWS,
                  **ROLE_CONSTS)
    types = {"q_desc": tensordesc_type(dtype, (bm, head_dim), q_layout),
             "k_desc": tensordesc_type("fp8e4nv", (bn, head_dim), k_layout),
             "v_desc": tensordesc_type("fp8e4nv", (head_dim, bn), v_layout),
             "KS": "*fp32", "VS": "*fp32", "O": f"*{dtype}", "LSE": "*fp32", "qk_scale": "fp32"}
    return aot_compile(_fp8_fwd_sm90, consts, types)


@functools.lru_cache(maxsize=None)
def _gluon_builds() -> bool:
    """Whether this Triton's Gluon builds the kernel (once, ahead of time: the API may differ from 3.6's)."""
    return builds_ahead(lambda: compile_sm90(128, False))


def available(device) -> bool:
    """True on a CUDA sm_90 device whose Triton's Gluon builds this kernel (checked once per process), outside
    the interpreter (whose K/V scale blocks are 32 rows, not the kernel's 128)."""
    return _fp8_fwd_sm90 is not None and f8.KV_BLOCK == KV_BLOCK_GPU and on_sm90(device) and _gluon_builds()


def _fail(msg):
    raise ValueError(f"fp8_attention_sm90: {msg}")


def _check_qkv(q, k, v, causal, softmax_scale, rotate):
    """What fp8_forward and forward both need of the unquantized shapes (k, v: any tensors of K's shape)."""
    if _fp8_fwd_sm90 is None:
        _fail(f"Gluon's Hopper API is not available ({_GLUON_ERROR})")
    if rotate:
        _fail("rotate=True is not supported (use fp8_attention.py)")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        _fail("only the dense (batch, seqlen, heads, head_dim) layout is supported (no varlen / cu_seqlens)")
    if not available(q.device):
        _fail(f"needs q on a CUDA sm_90 device with Gluon, got {q.device}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        _fail(f"q must be bf16 or fp16, got {q.dtype}")
    if not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0 and math.isfinite(softmax_scale)):
        _fail(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    if not isinstance(causal, bool):
        _fail("causal must be a bool (no sliding windows)")
    batch, seqlen, heads, d = q.shape
    if d not in CONFIGS:
        _fail(f"head_dim {d} is not supported (only {sorted(CONFIGS)})")
    if batch * seqlen * heads == 0:
        _fail("empty inputs are not supported")
    if batch > 65535 or heads > 65535:
        _fail(f"batch {batch} or heads {heads} exceeds the grid's 65535")


def forward(q, k8, v8t, ks, vs, causal: bool, softmax_scale: float, *, rotate: bool = False, config=None,
            v_permuted: bool = False, num_warps: int = 4):
    """(o, lse) of FP8 attention from the operands fp8_attention._fp8_forward prepares for `_fp8_fwd`, for
    the dense layout: q (batch, seqlen, heads_q, d) bf16/fp16 (quantized per row in the kernel; the scratch
    copy q8 `_fp8_forward` allocates is not needed); k8 E4M3 (batch, seqlen, heads_kv, d) and ks, from
    `_quantize(k, None, None, batch, seqlen, seqlen, rowwise=False)`; v8t E4M3 (batch, heads_kv, d, seqlen
    padded to 16) and vs, from `_quantize(v, ..., rowwise=False, rows=False, transposed=True)`; ks, vs float32
    (batch, heads_kv, cdiv(seqlen, 128)). softmax_scale: natural units (the kernel folds log2 e in).
    Returns o (q's shape and dtype, contiguous) and lse (float32 natural log, (batch, heads_q, seqlen)), as
    `_fp8_forward`. config: (BLOCK_M per warpgroup, BLOCK_N, STAGES[, P_SMEM[, PINGPONG[, PERSISTENT]]]),
    default default_config(d, seqlen). v_permuted: v8t is the key-permuted copy (quantize_kv(permuted=True)),
    which a P_SMEM=3 config needs and every other refuses. Raises
    ValueError for what it does not support (the caller keeps `_fp8_fwd`)."""
    _check_qkv(q, k8, v8t, causal, softmax_scale, rotate)
    batch, seqlen, heads, d = q.shape
    if not isinstance(k8, torch.Tensor) or k8.dim() != 4 or k8.dtype != f8._FP8:
        _fail("k8 must be the pass's E4M3 (batch, seqlen, heads_kv, head_dim) tensor")
    kv_heads = k8.shape[2]
    if k8.shape[0] != batch or k8.shape[3] != d:
        _fail(f"k8 shape {tuple(k8.shape)} does not match q {tuple(q.shape)}")
    if k8.shape[1] != seqlen:
        _fail(f"seqlen_q != seqlen_k ({seqlen} != {k8.shape[1]}) is not supported")
    if heads % kv_heads:
        _fail(f"heads_q {heads} is not a multiple of heads_kv {kv_heads}")
    padded = -(-seqlen // 16) * 16
    if not isinstance(v8t, torch.Tensor) or v8t.dtype != f8._FP8 or tuple(v8t.shape) != (batch, kv_heads, d, padded):
        _fail(f"v8t must be the pass's transposed E4M3 copy ({batch}, {kv_heads}, {d}, {padded})")
    n_kvb = -(-seqlen // KV_BLOCK_GPU)
    for name, t in (("ks", ks), ("vs", vs)):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (batch, kv_heads, n_kvb)
                or t.stride(2) != 1):
            _fail(f"{name} must be float32 ({batch}, {kv_heads}, {n_kvb}) with unit last stride")
    if ks.stride() != vs.stride():
        _fail("ks and vs must share strides")
    if any(t.device != q.device for t in (k8, v8t, ks, vs)):
        _fail("all operands on q's device")
    bm, bn, stages, p_smem, pingpong, persistent = _config(d, config, seqlen)
    if (p_smem == P_PERMUTED) != bool(v_permuted):
        _fail(f"config P_SMEM={p_smem} with v_permuted={bool(v_permuted)}: P_SMEM={P_PERMUTED} reads the "
              f"key-permuted V^T copy (quantize_kv(permuted=True)), every other config the plain one")
    if KV_BLOCK_GPU % bn or bn < 32:
        _fail(f"BLOCK_N {bn} must divide {KV_BLOCK_GPU} and be >= 32")
    q = q.contiguous()
    if q.data_ptr() % 16:
        q = q.clone()
    k8 = k8.contiguous()
    v8t = v8t.contiguous()
    q2 = q.view(batch * seqlen, heads * d)
    k2 = k8.view(batch * seqlen, kv_heads * d)
    v2 = v8t.view(batch * kv_heads * d, padded)
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout, k_layout, v_layout = _layouts(d, bm, bn, gdt)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [bm, d], q_layout)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [bn, d], k_layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [d, bn], v_layout)
    o = new_output(q.shape, q.dtype, q.device, _NAN_FILL)
    lse = new_output((batch, heads, seqlen), torch.float32, q.device, _NAN_FILL)
    n_pairs = -(-seqlen // (2 * bm))
    group = heads // kv_heads
    if persistent:   # attention_sm90's schedule; the causal section counts K and V^T at one byte an element
        sms, l2_bytes = a9._device_sizes(q.device.index if q.device.index is not None else torch.cuda.current_device())
        grid = (min(sms, n_pairs * heads * batch), )
        section = a9._causal_section(seqlen, d, group, 1, l2_bytes) if causal else 1
    else:
        grid = (n_pairs, heads, batch)
        section = 1
    _FWD_LAUNCH(grid, q_desc, k_desc, v_desc, ks, vs, o, lse, seqlen, heads, kv_heads, group, ks.stride(0),
                ks.stride(1), softmax_scale * LOG2E, batch, section, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
                STAGES=stages, CAUSAL=causal, KV_BLOCK=KV_BLOCK_GPU, P_SMEM=p_smem, PINGPONG=bool(pingpong),
                PERSISTENT=bool(persistent), TREE=TREE_ROWS, **ROLE_CONSTS, num_warps=num_warps)
    return o, lse


def quantize_kv(k, v, permuted: bool = False):
    """fp8_attention._fp8_forward's K/V passes for the dense layout: (k8, v8t, ks, vs), the same calls;
    permuted: V^T's keys in fp8_attention.operand_order (for the P_SMEM=3 configs)."""
    batch, seqlen = k.shape[0], k.shape[1]
    k8, _, ks = f8._quantize(k, None, None, batch, seqlen, seqlen, rowwise=False)
    _, v8t, vs = f8._quantize(v, None, None, batch, seqlen, seqlen, rowwise=False, rows=False, transposed=True,
                              permuted=permuted)
    return k8, v8t, ks, vs


def fp8_forward(q, k, v, causal: bool, softmax_scale: float, *, rotate: bool = False, config=None):
    """(o, lse) of FP8 attention as fp8_attention's dense forward returns them (`_fp8_forward` with
    cu_seqlens=None, left/right from causal): fp8_attention.py's K/V quantization passes, then this kernel
    (Q quantized inside it). Raises ValueError for what the kernel does not support, before any pass runs."""
    _check_qkv(q, k, v, causal, softmax_scale, rotate)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (k, v)) or k.shape != v.shape:
        _fail("k and v must be (batch, seqlen, heads_kv, head_dim) tensors of one shape")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        _fail("q, k, v must share dtype and device")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        _fail(f"k, v shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if k.shape[1] != q.shape[1]:
        _fail(f"seqlen_q != seqlen_k ({q.shape[1]} != {k.shape[1]}) is not supported")
    if q.shape[2] % k.shape[2]:
        _fail(f"heads_q {q.shape[2]} is not a multiple of heads_kv {k.shape[2]}")
    permuted = _config(q.shape[-1], config, q.shape[1])[3] == P_PERMUTED
    k8, v8t, ks, vs = quantize_kv(k, v, permuted)
    return forward(q, k8, v8t, ks, vs, causal, softmax_scale, config=config, v_permuted=permuted)
