"""Flash-attention forward for Hopper (sm_90a) in Gluon: warp-specialized, TMA-fed, async wgmma.

attention.py runs it for the padded-batch calls it covers on sm_90 (see _gluon_forward_applies there) where
it is faster (_gluon_wins: the first call of a shape class times it against the Triton kernel, which keeps the
short causal sequences: 16 x 1024 x 32 heads x 64, 232 against 297 TFLOP/s at 2a6ac2d); the Triton kernel
stays the interpreter's (and CI's) sibling, which tests/ops/test_attention_sm90.py
compares it with on the GPU.

Algorithm: the online softmax of attention.py's forward (base 2, log2(e) folded into the scale, the row max
taken on the raw scores and scaled once per row), one program per (pair of query tiles, head, batch), or
with PERSISTENT (below) one program per SM looping over those tiles.

Warp roles (gl.warp_specialize):
- two consumer warpgroups (the default partition and worker 0, 4 warps each, most of the registers). Each
  owns its own BLOCK_M-row query tile, the two side by side, and both read every K/V tile of the shared
  ring. They run unsynchronized with each other, so the warp schedulers interleave one warpgroup's softmax
  with the other's wgmma (a loose "ping-pong": no barrier forces the alternation).
- one producer warp (worker 1, few registers): loads the two Q tiles, then streams K and V tiles with
  TMA into a STAGES-deep shared-memory ring. Each stage has four mbarriers: k_full / v_full (the TMA
  transaction count, armed with expect) and k_free / v_free (count 2: one arrive per consumer warpgroup
  when its wgmma has finished reading the tile). The producer waits on a stage's free barrier with the
  opposite parity of its fill round, so the first round through the ring does not wait.

Overlap inside a consumer warpgroup (FA3's intra-warpgroup pipelining): at key block j it issues the
async wgmma S_j = Q K_j^T, then the async wgmma O += P_{j-1} V_{j-1} (P from registers), waits only for
S_j (warpgroup_mma_wait(1)), runs the softmax of S_j while P_{j-1} V_{j-1} is still on the tensor cores,
then waits for it and rescales O. So the tensor cores always have the next GEMM queued during the exp2s.

Persistent schedule (PERSISTENT, a config's fifth element; the default up to 8192 tokens, see CONFIGS). The
kernel runs one CTA per SM (registers), so where a program has few key blocks (16 x 1024 causal at BLOCK_M 64: 4.5 on
average) the grid above exposes every program's prologue (barrier init, the Q load, the first K/V loads) and
epilogue: the reason it loses at short causal sequences. With PERSISTENT the grid is min(SMs, tiles) programs,
program p taking tiles p, p + programs, ... of the (query tile pair, head, batch) tiles in query_pair_tile's
order (non-causal: the grid's; causal: heaviest first within sections of (batch, head) units whose K/V fit in
part of L2, _causal_section). The producer loads a tile's Q pair once both consumers arrived on q_free (count
2: each after its last Q K^T of the tile before; waited with the opposite parity of the tile's, so the first
does not wait) and streams K/V into the ring with a slot count that runs on across tiles (stream_kv_from), so
the next tile's Q and first K/V blocks load under the consumers' last P V and epilogue. A consumer waits on
q_bar with its tile's parity (its i-th tile: phase i & 1) and counts the ring's slots as the producer does;
the epilogue is the same. Q is single-buffered: a second pair would fit beside the d128 ring at STAGES 2 (164
KB + 32 KB) but not at STAGES 3 (229 KB), and q_free starts the load before the epilogue anyway. Not with
PINGPONG (its turn barriers count one tile's batches).

Masking: a key block is masked (by a branch, so the interior blocks pay nothing) when it reaches past the
causal diagonal of the warpgroup's first row or past the end of the sequence. K/V tiles come from the
(batch * seqlen, heads * head_dim) view, so the rows past a sequence's end are the next sequence's (or
TMA's zero fill at the end of the tensor): their scores are set to -inf, so P is 0 there. Query rows past
the end are computed from such rows and never stored.

Supports: bf16 and fp16, head_dim 64 and 128, causal and non-causal, GQA (query head h reads KV head
h // (heads_q // heads_kv)), seqlen_q == seqlen_k of any length, the dense layout only (no cu_seqlens, no
sliding window), a positive softmax scale. Anything else: forward() raises ValueError (the caller falls
back to attention.py).

Conventions (matched to attention.py's dense forward, `_attn_forward` with cu_seqlens=None, which writes
what `flash_attention(..., return_lse=True)` returns): q (batch, seqlen, heads_q, head_dim), k and v
(batch, seqlen, heads_kv, head_dim), each with the heads of a token side by side and the rows of a
sequence contiguous; o contiguous, q's shape and dtype; lse float32, natural log of the sum of
exp(scores * softmax_scale), contiguous (batch, heads_q, seqlen_q), so attention.py's backward can
consume (o, lse) as its own.

Measured (H200, bench/attention_sm90.py, forward TFLOP/s): at 0277bcd, d128 4 x 4096 x 16 heads 593.8
against the Triton kernel's 509.4 non-causal and 526.9 against 455.0 causal, 1 x 16384 633.8 / 611.1 against
508.8 / 533.9 (cuDNN 611.8 / 556.1); d64 4 x 4096 x 32 heads 446.4 / 387.8 against 421.8 / 383.4. At 9a9ef10
(4 x 4096 x 16, d128) 585.7 / 536.3 against 468.4 / 465.9; PINGPONG made it slower (582.4 / 506.5), so it is
off.

The module imports on any Triton: without Gluon's Hopper API (or with another one) the kernel is not
defined and available() says False.
"""
from __future__ import annotations

import functools
import os

import torch

from .gluon_sm90 import builds_ahead
from .gluon_sm90 import (GLUON_ERROR as _GLUON_ERROR, ROLE_CONSTS, TensorDescriptor, aot_compile, as_rows,
                         check_dense, fence_async_shared, gl, gluon, invalidate_kv_ring, kv_ring_barriers, mbarrier,
                         new_output, on_sm90, produce_tiles, query_pair_tile, query_pair_work, row_max, row_sum,
                         stream_kv, tensordesc_type, tma, token_rows, warpgroup_mma, warpgroup_mma_wait)
from .launch import FastLauncher

LOG2E = 1.4426950408889634
# The softmax's row max and row sum as gluon_sm90.row_max / row_sum's trees (True) or gl.max / gl.sum's
# chains (False, the default). The trees build for sm_90a with no spills and give the same outputs to 0.3%
# (the sums' order), but ran slower on the H200 (bench/softmax_rows.py at 2062a2c, d128, (4, 4096, 16) and
# (1, 16384, 16): FP8 forward 0.88-0.98x, bf16 0.87-0.98x; bench/results/sm90/softmax_rows_2062a2c.json).
TREE_ROWS = False
# A polynomial for some of the exponentials instead of MUFU.EX2: tried and removed, see fp8_attention_sm90.

# (BLOCK_M per consumer warpgroup, BLOCK_N, STAGES) per head_dim; the first is the grid schedule's default. A
# fourth element 1 turns on PINGPONG (see _consumer), slower where measured (see above): no default uses it. A
# fifth element 1 turns on the persistent schedule (PERSISTENT, see above; not with PINGPONG); the first such
# entry is the default up to PERSISTENT_UP_TO tokens (default_config).
CONFIGS = {
    128: [(64, 128, 2), (64, 64, 3), (64, 128, 3), (64, 64, 4), (64, 128, 2, 0, 1), (64, 128, 3, 0, 1)],
    64: [(64, 128, 3), (64, 64, 4), (64, 128, 2), (128, 64, 3), (64, 128, 4, 0, 1), (64, 128, 3, 0, 1)],
}
# At c724bc2 (H200, bench/attention_sm90.py, TFLOP/s of the best grid config against the persistent default)
# the persistent schedule won at 1024 to 4096 tokens: d128 4 x 4096 x 16 non-causal 666 against 610, causal
# 565 / 537, 8 x 2048 x 16 580 / 542 and 463 / 448; d64 4 x 4096 x 32 467 / 435 and 408 / 387, 16 x 1024 x 32
# 396 / 359 and 285 / 236. At 16384 (1 x 16384 x 16, d128) it lost: 619 / 629 non-causal, 544 / 617 causal.
# A snake order of the causal rounds (c4f00fa: every other round reversed, so program 0 no longer takes every
# round's heaviest tile) lifted that causal cell to 599 / 615 but measured worse at 4096 and 2048 tokens
# (persistent / grid 0.98 and 1.02 against 1.05 and 1.03 without it), so the plain round robin stays.
PERSISTENT_UP_TO = 8192
# The share of L2 a causal section of the persistent schedule's K/V may take (see _causal_section): a guess,
# not measured.
_L2_SHARE = 0.5
# Outputs start as NaN with TILEWISE_NAN_FILL=1 (read at import; the tests set _NAN_FILL), so unwritten
# elements show.
_NAN_FILL = os.environ.get("TILEWISE_NAN_FILL", "0") == "1"


if gl is not None:
    try:
        @gluon.jit
        def _consumer(q_tile, k_ring, v_ring, q_bar, q_free, k_full, v_full, k_free, v_free, my_turn, other_turn,
                      O, LSE, row0, seqlen, b, h, heads, n_blocks, qk_scale, q_phase, filled,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                      FIRST: gl.constexpr, PERSISTENT: gl.constexpr, TREE: gl.constexpr):
            """One warpgroup's query tile (rows row0 .. row0 + BLOCK_M of sequence b, head h) over n_blocks
            key blocks: S_j's wgmma and P_{j-1} V_{j-1}'s are in flight together, the softmax of S_j runs
            under the latter. With PINGPONG the two warpgroups take turns issuing their wgmmas (batch j of
            the FIRST one, then batch j of the other, ...; the tensor cores run them in that order), so
            one's softmax falls under the other's GEMMs: before its batch j a warpgroup waits on my_turn for
            the other's batch j - 1 (FIRST) or j, after it arrives on other_turn. The Q tile is q_bar's phase
            q_phase, key block j is in the ring's slot filled + j (both 0 but in the PERSISTENT schedule, see
            _consumer_tiles, where it arrives on q_free once its last Q K^T is done)."""
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_N, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HEAD_DIM, 16])
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
            dtype: gl.constexpr = q_tile.dtype

            qpos = row0 + gl.arange(0, BLOCK_M, layout=row_s)
            cols = gl.arange(0, BLOCK_N, layout=col_s)
            # a block is masked when its last key lies past this tile's first row (causal) or past the end
            if CAUSAL:
                limit = gl.minimum(row0 + 1, seqlen)
            else:
                limit = seqlen
            zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

            mbarrier.wait(q_bar, q_phase)

            # key block 0: its scores and softmax, no P V in flight yet
            first = filled % STAGES
            mbarrier.wait(k_full.index(first), (filled // STAGES) & 1)
            if PINGPONG and not FIRST:
                mbarrier.wait(my_turn, 0)
            tok = warpgroup_mma(q_tile, k_ring.index(first).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if PINGPONG:
                mbarrier.arrive(other_turn)
            s = warpgroup_mma_wait(0, deps=(tok, ))
            mbarrier.arrive(k_free.index(first))
            if BLOCK_N > limit:
                kpos = cols
                if CAUSAL and PERSISTENT:
                    # key < seqlen follows for every stored row (key <= row < seqlen); kept, it is a
                    # tile-invariant mask hoisted out of the tile loop, live through the key-block loop
                    # (14 spill instructions at d128, BLOCK_N 128)
                    keep = gl.expand_dims(kpos, 0) <= gl.expand_dims(qpos, 1)
                else:
                    keep = gl.expand_dims(kpos, 0) < seqlen
                    if CAUSAL:
                        keep = keep & (gl.expand_dims(kpos, 0) <= gl.expand_dims(qpos, 1))
                s = gl.where(keep, s, float("-inf"))
            m_i = row_max(s, BLOCK_M, BLOCK_N, row_s, TREE) * qk_scale
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_i, 1))
            l_i = row_sum(p, BLOCK_M, BLOCK_N, row_s, TREE)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

            for j in range(1, n_blocks):
                slot = filled + j
                stage = slot % STAGES
                phase = (slot // STAGES) & 1
                prev = (slot - 1) % STAGES
                prev_phase = ((slot - 1) // STAGES) & 1
                mbarrier.wait(k_full.index(stage), phase)
                mbarrier.wait(v_full.index(prev), prev_phase)
                if PINGPONG:
                    mbarrier.wait(my_turn, (j - FIRST) & 1)
                s_tok = warpgroup_mma(q_tile, k_ring.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                      is_async=True)
                o_tok = warpgroup_mma(p_op, v_ring.index(prev), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(other_turn)
                s = warpgroup_mma_wait(1, deps=(s_tok, ))   # S_j done, P_{j-1} V_{j-1} may still run
                mbarrier.arrive(k_free.index(stage))
                start_n = j * BLOCK_N
                if start_n + BLOCK_N > limit:
                    kpos = start_n + cols
                    keep = gl.expand_dims(kpos, 0) < seqlen
                    if CAUSAL:
                        keep = keep & (gl.expand_dims(kpos, 0) <= gl.expand_dims(qpos, 1))
                    s = gl.where(keep, s, float("-inf"))
                m_new = gl.maximum(m_i, row_max(s, BLOCK_M, BLOCK_N, row_s, TREE) * qk_scale)
                p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + row_sum(p, BLOCK_M, BLOCK_N, row_s, TREE)
                m_i = m_new
                p_next = gl.convert_layout(p.to(dtype), p_layout)
                acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
                mbarrier.arrive(v_free.index(prev))
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p_op = p_next

            if PERSISTENT:
                mbarrier.arrive(q_free)   # every Q K^T of the tile done: the producer may load the next Q pair
            last = (filled + n_blocks - 1) % STAGES
            mbarrier.wait(v_full.index(last), ((filled + n_blocks - 1) // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(my_turn, (n_blocks - FIRST) & 1)
            o_tok = warpgroup_mma(p_op, v_ring.index(last), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(other_turn)
            acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(v_free.index(last))

            # epilogue: O = acc / l, lse = (m + log2 l) ln 2, rows past the end not stored
            l_o = gl.convert_layout(l_i, row_o)
            out = acc * gl.expand_dims(1.0 / l_o, 1)
            rows = row0 + gl.arange(0, BLOCK_M, layout=row_o)
            dcol = gl.arange(0, HEAD_DIM, layout=col_o)
            row64 = (b * seqlen + rows).to(gl.int64)
            o_ptrs = O + gl.expand_dims(row64 * (heads * HEAD_DIM) + h * HEAD_DIM, 1) + gl.expand_dims(dcol, 0)
            o_mask = gl.expand_dims(rows < seqlen, 1) & gl.expand_dims(dcol < HEAD_DIM, 0)
            gl.store(o_ptrs, out.to(dtype), mask=o_mask)
            lse = (gl.convert_layout(m_i, row_o) + gl.log2(l_o)) * 0.6931471805599453
            lse_ptrs = LSE + (b * heads + h).to(gl.int64) * seqlen + rows
            gl.store(lse_ptrs, lse, mask=rows < seqlen)

        @gluon.jit
        def _producer(q_desc, k_desc, v_desc, q_tiles, k_ring, v_ring, q_bar, k_full, v_full, k_free, v_free,
                      q_row, kv_row, kv_col, q_col, n_blocks,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
            """The two Q tiles once, then K_j and V_j into stage j % STAGES once both consumers freed it."""
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_tiles.index(0))
            tma.async_copy_global_to_shared(q_desc, [q_row + BLOCK_M, q_col], q_bar, q_tiles.index(1))
            stream_kv(k_desc, v_desc, k_ring, v_ring, k_full, v_full, k_free, v_free, kv_row, kv_col, kv_row, kv_col,
                      n_blocks, BLOCK_N, STAGES, False)

        @gluon.jit
        def _consumer_tiles(q_tile, k_ring, v_ring, q_bar, q_free, k_full, v_full, k_free, v_free, O, LSE, seqlen,
                            heads, group, n_pairs, units, section, n_tiles, qk_scale,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, CAUSAL: gl.constexpr, SECOND: gl.constexpr, TREE: gl.constexpr):
            """A consumer warpgroup in the persistent schedule: _consumer for its query tile (the pair's
            second with SECOND) of tiles pid, pid + nprog, ..., the producer's order. Tile i's Q is q_bar's
            phase i & 1; the ring's slots run on from tile to tile as the producer fills them."""
            filled = 0
            q_phase = 0
            for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
                h, b, hk, m0, n_blocks = query_pair_tile(t, n_pairs, heads, units, section, seqlen, group, BLOCK_M,
                                                         BLOCK_N, CAUSAL)
                _consumer(q_tile, k_ring, v_ring, q_bar, q_free, k_full, v_full, k_free, v_free, q_free, q_free,
                          O, LSE, m0 + SECOND * BLOCK_M, seqlen, b, h, heads, n_blocks, qk_scale, q_phase, filled,
                          HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, False, not SECOND, True, TREE)
                filled += n_blocks
                q_phase ^= 1

        @gluon.jit(do_not_specialize=["batch", "section"])   # one build for any batch (the grid schedule's unused)
        def _attn_fwd_sm90(q_desc, k_desc, v_desc, O, LSE, seqlen, heads, group, qk_scale, batch, section,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                           PERSISTENT: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, TREE: gl.constexpr):
            """Grid (query tile pairs, heads_q, batch), causal pairs latest (heaviest) first; with PERSISTENT a
            grid (programs,) of at most one per SM, each over tiles pid, pid + programs, ... in
            query_pair_tile's order (`section`: its causal section, in units of (batch, head))."""
            if not PERSISTENT:
                h, b, hk, m0, n_blocks = query_pair_work(seqlen, group, BLOCK_M, BLOCK_N, CAUSAL)

            dtype: gl.constexpr = q_desc.dtype
            q_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
            k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_full, v_full, k_free, v_free = kv_ring_barriers(STAGES)
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # see _consumer
            mbarrier.init(q_bar, count=1)
            mbarrier.init(turn.index(0), count=1)
            mbarrier.init(turn.index(1), count=1)
            if PERSISTENT:
                q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
                mbarrier.init(q_free, count=2)   # one arrive per consumer warpgroup and tile
            fence_async_shared()

            if PERSISTENT:
                n_pairs = gl.cdiv(seqlen, 2 * BLOCK_M)
                units = heads * batch
                n_tiles = n_pairs * units
                gl.warp_specialize([
                    (_consumer_tiles, (q_tiles.index(0), k_ring, v_ring, q_bar, q_free, k_full, v_full, k_free,
                                       v_free, O, LSE, seqlen, heads, group, n_pairs, units, section, n_tiles,
                                       qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, 0, TREE)),
                    (_consumer_tiles, (q_tiles.index(1), k_ring, v_ring, q_bar, q_free, k_full, v_full, k_free,
                                       v_free, O, LSE, seqlen, heads, group, n_pairs, units, section, n_tiles,
                                       qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, 1, TREE)),
                    (produce_tiles, (q_desc, k_desc, v_desc, q_tiles.index(0), q_tiles.index(1), k_ring, v_ring,
                                     q_bar, q_free, k_full, v_full, k_free, v_free, seqlen, heads, group, n_pairs,
                                     units, section, n_tiles, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, False)),
                ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
                mbarrier.invalidate(q_free)
            else:
                row0 = m0
                row1 = m0 + BLOCK_M
                gl.warp_specialize([
                    (_consumer, (q_tiles.index(0), k_ring, v_ring, q_bar, q_bar, k_full, v_full, k_free, v_free,
                                 turn.index(0), turn.index(1), O, LSE, row0, seqlen, b, h, heads, n_blocks,
                                 qk_scale, 0, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, PINGPONG, True, False,
                                 TREE)),
                    (_consumer, (q_tiles.index(1), k_ring, v_ring, q_bar, q_bar, k_full, v_full, k_free, v_free,
                                 turn.index(1), turn.index(0), O, LSE, row1, seqlen, b, h, heads, n_blocks,
                                 qk_scale, 0, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, PINGPONG, False,
                                 False, TREE)),
                    (_producer, (q_desc, k_desc, v_desc, q_tiles, k_ring, v_ring, q_bar, k_full, v_full, k_free,
                                 v_free, b * seqlen + m0, b * seqlen, hk * HEAD_DIM, h * HEAD_DIM, n_blocks,
                                 BLOCK_M, BLOCK_N, STAGES)),
                ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

            mbarrier.invalidate(q_bar)
            mbarrier.invalidate(turn.index(0))
            mbarrier.invalidate(turn.index(1))
            invalidate_kv_ring(k_full, v_full, k_free, v_free, STAGES)
    except Exception as _e:  # noqa: BLE001 - a Gluon whose decorators or signatures differ
        _GLUON_ERROR = f"{type(_e).__name__}: {_e}"
        _attn_fwd_sm90 = None
else:
    _attn_fwd_sm90 = None
_FWD_LAUNCH = FastLauncher(_attn_fwd_sm90)   # kernel[grid]'s Python is most of the forward's host time


def compile_sm90(head_dim: int, causal: bool, dtype: str = "bf16", config=None):
    """The kernel compiled ahead of time for sm_90a (no GPU touched): dtype 'bf16' or 'fp16', config as in
    forward(). What bench/attention_sm90_sass.py inspects and available() tries once."""
    if _attn_fwd_sm90 is None:
        raise RuntimeError(f"no Gluon kernel in this Triton: {_GLUON_ERROR}")
    bm, bn, stages, pingpong, persistent = _config(config if config is not None else CONFIGS[head_dim][0],
                                                   head_dim)
    q_layout, kv_layout = _smem_layouts(bm, bn, head_dim, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CAUSAL=causal, PINGPONG=pingpong,
                  PERSISTENT=persistent, TREE=TREE_ROWS, **ROLE_CONSTS)
    types = {"q_desc": tensordesc_type(dtype, (bm, head_dim), q_layout),
             "k_desc": tensordesc_type(dtype, (bn, head_dim), kv_layout),
             "v_desc": tensordesc_type(dtype, (bn, head_dim), kv_layout),
             "O": f"*{dtype}", "LSE": "*fp32", "qk_scale": "fp32"}
    return aot_compile(_attn_fwd_sm90, consts, types)


@functools.lru_cache(maxsize=None)
def _gluon_builds() -> bool:
    """Whether this Triton's Gluon builds the kernel (once, ahead of time: the API may differ from 3.6's)."""
    return builds_ahead(lambda: compile_sm90(128, False))


def available(device) -> bool:
    """True on a CUDA sm_90 device whose Triton's Gluon builds this kernel (checked once per process)."""
    return _attn_fwd_sm90 is not None and on_sm90(device) and _gluon_builds()


def _check(q, k, v, causal, softmax_scale):
    if _attn_fwd_sm90 is None:
        raise ValueError(f"attention_sm90: Gluon's Hopper API is not available ({_GLUON_ERROR})")
    check_dense("attention_sm90", q, k, v, causal, softmax_scale, CONFIGS)
    if not available(q.device):
        raise ValueError(f"attention_sm90: needs q, k, v on a CUDA sm_90 device, got {q.device}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention_sm90: only bf16 and fp16 (all three alike), got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")


@functools.lru_cache(maxsize=None)
def _smem_layouts(bm, bn, d, dtype):
    """The Q and K/V tiles' shared-memory layouts (built once: each call of get_default_for is host time)."""
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([bm, d], gdt), gl.NVMMASharedLayout.get_default_for([bn, d], gdt)


def default_config(head_dim: int, seqlen: int) -> tuple:
    """The persistent schedule's first config of CONFIGS up to PERSISTENT_UP_TO tokens, else the grid's."""
    table = CONFIGS[head_dim]
    if seqlen <= PERSISTENT_UP_TO:
        return next(c for c in table if len(c) > 4 and c[4])
    return table[0]


def _config(config, head_dim):
    """(BLOCK_M, BLOCK_N, STAGES, PINGPONG, PERSISTENT) of a config (BLOCK_M, BLOCK_N, STAGES[, PINGPONG[,
    PERSISTENT]]). PINGPONG's turn barriers count batches within one tile, so the persistent schedule does not
    take it."""
    bm, bn, stages, *flags = config
    if len(flags) > 2:
        raise ValueError(f"attention_sm90: config {tuple(config)} is not (BLOCK_M, BLOCK_N, STAGES[, PINGPONG[, "
                         "PERSISTENT]])")
    pingpong, persistent = (bool(f) for f in (*flags, 0, 0)[:2])
    if pingpong and persistent:
        raise ValueError(f"attention_sm90: config {tuple(config)}: PINGPONG and PERSISTENT do not combine")
    return bm, bn, stages, pingpong, persistent


@functools.lru_cache(maxsize=None)
def _device_sizes(index):
    """(SM count, L2 bytes) of CUDA device index, read once."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, getattr(props, "L2_cache_size", 50 << 20)


def _causal_section(seqlen, head_dim, group, element_size, l2_bytes):
    """The (batch, head) units of a causal section of the persistent schedule (see query_pair_tile): as many
    as have their K and V in _L2_SHARE of L2, a KV head counted once for the `group` query heads that read it
    (GQA), at least 1."""
    kv_bytes = 2 * seqlen * head_dim * element_size
    return max(1, int(l2_bytes * _L2_SHARE) * group // kv_bytes)


def forward(q, k, v, causal: bool, softmax_scale: float, config=None, num_warps: int = 4):
    """(o, lse) as attention.py's dense forward returns them: o like q (contiguous), lse float32 natural
    log (batch, heads_q, seqlen). config: (BLOCK_M per warpgroup, BLOCK_N, STAGES[, PINGPONG[, PERSISTENT]]),
    default default_config(head_dim, seqlen)."""
    _check(q, k, v, causal, softmax_scale)
    batch, seqlen, heads, d = q.shape
    bm, bn, stages, pingpong, persistent = _config(config if config is not None else default_config(d, seqlen), d)
    group = heads // k.shape[2]
    q, q2 = as_rows(q)
    k, k2 = as_rows(k)
    v, v2 = as_rows(v)
    q_layout, kv_layout = _smem_layouts(bm, bn, d, q.dtype)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [bm, d], q_layout)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [bn, d], kv_layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [bn, d], kv_layout)
    o = new_output(q.shape, q.dtype, q.device, _NAN_FILL)
    lse = new_output((batch, heads, seqlen), torch.float32, q.device, _NAN_FILL)
    n_pairs = -(-seqlen // (2 * bm))
    if persistent:
        sms, l2_bytes = _device_sizes(q.device.index if q.device.index is not None else torch.cuda.current_device())
        grid = (min(sms, n_pairs * heads * batch), )
        section = _causal_section(seqlen, d, group, q.element_size(), l2_bytes) if causal else 1
    else:
        grid = (n_pairs, heads, batch)
        section = 1
    _FWD_LAUNCH(grid, q_desc, k_desc, v_desc, o, lse, seqlen, heads, group, softmax_scale * LOG2E, batch,
                section, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CAUSAL=causal, PINGPONG=pingpong,
                PERSISTENT=persistent, TREE=TREE_ROWS, **ROLE_CONSTS, num_warps=num_warps)
    return o, lse
