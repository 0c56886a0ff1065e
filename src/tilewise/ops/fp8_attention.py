"""FP8 flash attention, forward and backward: QK^T, PV and the four backward GEMMs on E4M3 tensor cores.

fp8_flash_attention(q, k, v, ...) has flash_attention's interface (bf16/fp16/fp32 inputs and outputs, causal,
windows, GQA, packed varlen, return_lse) plus `rotate`. It is a sibling rather than a flag of
flash_attention because its numbers differ (~5% relative error against ~0.4% for bf16: a caller opts in by
name) and it has its own kernels, tuning keys and custom ops.

Scales. An E4M3 value has 3 mantissa bits: its relative rounding error is up to 2^-4 whatever the scale, so
a scale only keeps values inside E4M3's range [2^-9, 448]; it adds no precision. Every scale is a power of
two (the largest 2^e with amax * 2^e <= 448), so scaling is exact and the interpreter, the GPU and the
PyTorch emulation put each value on the same E4M3 bits (a divided scale rounds differently on each, and
bf16 inputs often land on E4M3 rounding ties).
- Q and dO: one scale per row (token, head). A row scale of the left operand of S = Q K^T or dP = dO V^T
  is a row scale of the product, folded into the FMA that already scales each score, so it costs nothing,
  and it depends on the row alone: the forward (each program quantizes its own Q tile) and the backward
  (which quantizes Q in a pass) get the same bits whatever their tiles.
- K and V: one scale per block of KV_BLOCK (128) rows of one head of one sequence. A key tile lies in one
  block, so its scale is a scalar per tile, multiplied into the row factor of S; for V the running output
  is kept in units of the current block's scale and rescaled with the softmax correction.
- P = exp(S - running max) lies in [0, 1] and is cast as P * 256 (an unscaled cast flushes p < 2^-9 to 0),
  made directly as exp2(x + 8) (no multiply per score), the 1/256 folded into the output.
- dV = P^T dO: dO's transposed copy has one scale per head (the largest over the query heads that share a
  K/V head, whose dV the kernel sums in one accumulator), so no scale lies along the reduction and P^T,
  normalized to [0, 1] in the backward, is cast as P^T * 256 like the forward's P: no row maximum, no
  accumulator rescaling. (Float64 emulation, N=4096 d=128, with dO's row scales: dV error 5.2% with this
  fixed P scale, 5.0% with per-row P scales; bench/attention.py --fp8 reports the kernel's.)
- The other backward left operands (dS^T with Q's row scales along its reduction, and dS): one scale per
  output row against its running maximum; the accumulator is rescaled (by a power of two) when it grows,
  as in online softmax.

Passes. K and V are quantized by a pass per call (it reads them once, writes 1 byte an element, V
transposed): FP8 wgmma wants both operands K-major, so PV needs V^T in memory, and quantizing K/V tiles in
the loop would redo it once per query block, on the CUDA cores the softmax already keeps busy. Q is
quantized by the forward kernel, each program its own tile, but through memory: the program stores its E4M3
tile to a scratch copy and loads it back after a barrier. Used straight from registers, the tile became the
register operand of the Q K^T wgmma, whose four k-steps then each waited for the one before (sm_90 SASS,
bench/fp8_attention_sass.py: 8 wgmma waits in the inner loop against 1), and that kernel ran 13-14% slower
than one loading a pre-quantized Q at every d128 cell (tuner timings at e2de639); a loaded tile reaches
the wgmmas from shared memory, k-steps back to back. The round trip costs a 1-byte store and an L2 read
an element; a pass would read Q (2 bytes) again and add a launch. Against a forward loading Q from a pass
(H200, commit 194bc8f, bench/attention.py --fp8-only, d128, forward TFLOP/s), the kernel's own quantization
was faster at N=4096 (666.8 vs 638.0 non-causal, 542.8 vs 539.6 causal) and N=16384 non-causal (739.1 vs
710.2), slower at N=16384 causal (681.8 vs 695.0); the pass was removed. The backward's pass writes Q, dO, K
(each also transposed, for the dK, dV, dQ GEMMs) and V in FP8; packed sequences start at multiples of 16
tokens in the transposed copies (TMA tiles start 16-byte aligned). A tensor's row-major and transposed
copies come from two launches (two reads): one kernel writing both is miscompiled by the ptxas Triton 3.6
bundles (tilewise.ops.fp8_cast says more).

On sm_90 the dense, unrotated forward may run fp8_attention_sm90's Gluon kernel instead (the same operands
from the same passes, Q quantized per row inside it into shared memory; outputs equal to rounding): the
first call of a key times both and keeps the faster (_gluon_forward_applies, attention._gluon_wins). The
backward does the same with fp8_attention_sm90_bwd's two Gluon kernels (dense, unrotated, no dLSE), which
read the same passes' operands (_gluon_backward_applies).

Backward (recomputed from the saved LSE, as the bf16 kernel). S and dP are recomputed on FP8 from the same
E4M3 Q and K as the forward: recomputing S in bf16 against the FP8 forward's LSE leaves P rows that do not
sum to 1 - on Gaussian inputs that happened to help (dQ 0.9% vs 3.8% error, float64 emulation, N=512), on
inputs with outlier channels the gradients were off by 1e5x. dV = P^T dO, dK = dS^T Q and dQ = dS K
run on FP8 too: in the emulation (Gaussian, N=4096, d=128) they cost dQ 6.3% / dK 6.2% / dV 5.0% error
against 5.4 / 5.3 / 3.8% with those three GEMMs in bf16 (the bf16 kernel: 0.4%), E5M2 was worse than E4M3
everywhere (dQ 7.0% vs 5.4% at N=512), so all six GEMMs run on FP8, E4M3 throughout. What stays in fp32:
delta = rowsum(dO * O) (from the bf16 O and dO), dS = P (dP - delta), softmax statistics, accumulators.
FP8 wgmma adds into its accumulator with fewer bits than fp32 (about 14, as DeepSeek-V3 reports), ~1e-4
relative, far below one E4M3 rounding (3.6% RMS), so accumulators stay in the tensor core (an fp32 add
outside would need a second register tile).

Rotation. rotate=True multiplies Q and K of every head by R = H diag(signs) (Sylvester's Hadamard matrix,
fixed random signs; head_dim a power of two >= 32) before quantizing: QK^T is unchanged and a few large
channels are spread over all of them. Float64 emulation, 4 channels per head x20 in Q, K, V, causal: output
error (relative) at N=512 d=128 34% for per-tensor FP8 (exact softmax), 33% with these block scales, 8.0%
with the rotation; at N=4096 39% and 13%. The channels' own rounding does the damage, whatever their scale;
only spreading them helps, more as head_dim grows (output RMSE 2.2-3.9x lower than per-tensor at d=64, 3.7-
5.5x at d=128). On Gaussian inputs all three are within 15% of each other (~4-5%). dQ and dK are rotated back
in the kernels' epilogues (a tf32 dot with R^T).

Bytes, forward: the pass reads K, V (2 bytes an element) and writes 1 byte each; the kernel reads Q once
(and its 1-byte scratch copy, from L2) and K, V at 1 byte an element once per query block (mostly from
L2), writes O, the LSE and the scratch copy.

Speed, and what bounds it (H200, d128, N4096, batch 4, 16 heads; bench/fp8_attention_ablate.py's variants,
first measured at commit 9517d98, when the forward used its Q tile from registers): the forward was 1.24x the
bf16 kernel non-causal and 1.14x causal, the backward 0.91x / 0.92x. The CUDA-core work is not what holds
them: without exp2 the non-causal forward runs 0.91 of its time, without exp2 and the E4M3 cast of P 0.89,
without the accumulator rescaling 0.97; the backward without exp2 0.95, without the dK/dQ rescaling 0.95,
without that and the |dS| row maxima 0.92.
What is left is the loop's shape: one warpgroup waits on each wgmma before the softmax that follows, and
Triton 3.6 offers no overlap of the two on Hopper (tl.range(warp_specialize=True) did not compile for the
4-warp configs and changed nothing for the 8-warp ones). Nor does issuing the next block's Q K^T before
this block's softmax by hand: in the sm_90 SASS the compiler waits for it at once.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from . import attention as attn
from .attention import (LOG2E, LN2, _cast, _dot, _head_rows, _keep, _key_program, _key_range, _load_tile,
                        _query_program, _query_range, _row_block, _store_delta_lse2, _store_tile)
from .dispatch import use_triton
from .launch import FastLauncher

FP8_MAX = 448.0  # the largest finite E4M3 value
P_SCALE = tl.constexpr(256.0)  # P in [0, 1] is cast as P * 256: a power of two, so the product is exact
P_LOG2 = tl.constexpr(8.0)     # log2(P_SCALE): the kernels make P * 256 as exp2(x + 8), no multiply
_INTERPRET = attn._INTERPRET
# Rows of one head of one sequence that share a K/V scale. Every key tile (BLOCK_N divides it) lies in one
# block. Smaller in the interpreter, so tiny test sequences span several blocks.
KV_BLOCK = 32 if _INTERPRET else 128
_ROWS_PER_QUANT_PROGRAM = 32 if _INTERPRET else 64  # rows a program of the row-scaled quantization pass takes
_TINY = 1e-30  # an amax at or below this counts as 0 (its power-of-two multiplier would overflow float32)


# ----------------------------------------------------------------------------------------------
# Triton helpers
# ----------------------------------------------------------------------------------------------

@triton.jit
def _round_e4m3(x):
    """x (float32) rounded to nearest even onto the E4M3 grid and saturated at 448, still float32. The
    interpreter's float32 -> fp8 conversion truncates instead of rounding (7.97 becomes 4), so there the
    values are put on the grid first; grid values convert exactly. The GPU's conversion rounds itself."""
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    expo = tl.maximum((bits >> 23) - 127, -6)  # below 2^-6 (subnormals) the spacing stays 2^-9
    spacing = ((expo - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    shift = spacing * 12582912.0  # 1.5 * 2^23 spacings: a + shift keeps whole spacings, rounded to even
    r = (a + shift) - shift
    return tl.where(x < 0, -r, r)


@triton.jit
def _e4m3(x, EMU: tl.constexpr):
    """float32 x, |x| <= 448, as tl.float8e4nv (round to nearest even)."""
    if EMU:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _scales(amax):
    """(2^e, 2^-e): 2^e the largest power of two with amax * 2^e <= 448, the multiplier onto the E4M3 range,
    and 2^-e the scale back. Powers of two make both products exact, so every kernel, the interpreter and
    torch put a value on the same E4M3 bits (a division would round differently on each and flip the
    rounding of values on a tie, which bf16 inputs hit often). amax <= 1e-30 (an all-zero row): (0, 1)."""
    bits = amax.to(tl.int32, bitcast=True)  # amax >= 0: exponent and mantissa fields
    above = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa > 1.75 = 448 / 2^8
    live = amax > 1e-30
    e = tl.where(live, 8 - ((bits >> 23) - 127) - above, 0)
    inv = ((e + 127) << 23).to(tl.float32, bitcast=True)
    scale = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return tl.where(live, inv, 0.0), scale


@triton.jit
def _quantize_tile(x, ROT, offs_d, ROWWISE: tl.constexpr, ROTATE: tl.constexpr, BLOCK_D: tl.constexpr,
                   EMU: tl.constexpr):
    """(x8, scale) of a (rows, BLOCK_D) tile: one scale per row (ROWWISE) or one for the tile, after the
    optional rotation x @ R (R: +-1 entries in bf16, exact; fp32 accumulation). The forward's inline Q and
    the quantization pass run this same code, so they produce the same bits."""
    if ROTATE:
        r = tl.load(ROT + offs_d[:, None] * BLOCK_D + offs_d[None, :])
        xf = _dot(_cast(x.to(tl.float32), tl.bfloat16, EMU), r, None, "tf32", EMU)
    else:
        xf = x.to(tl.float32)
    if ROWWISE:
        inv, scale = _scales(tl.max(tl.abs(xf), 1))
        x8 = _e4m3(xf * inv[:, None], EMU)
    else:
        inv, scale = _scales(tl.max(tl.max(tl.abs(xf), 1), 0))
        x8 = _e4m3(xf * inv, EMU)
    return x8, scale


@triton.jit
def _load_tile_t(ptrs, cols, n_cols, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 CHECK_COLS: tl.constexpr):
    """A (BLOCK_D, cols) tile of a transposed (head_dim, tokens) copy; cols >= n_cols, rows >= HEAD_DIM
    read as 0."""
    if CHECK_COLS:
        x = tl.load(ptrs, mask=(offs_d[:, None] < HEAD_DIM) & (cols[None, :] < n_cols), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _t_start(CU_T, b, VARLEN: tl.constexpr):
    """The column of sequence b's first token in a transposed copy: packed copies start every sequence at
    a multiple of 16 tokens (a TMA tile must start 16-byte aligned); batched ones at 0."""
    if VARLEN:
        t = tl.load(CU_T + b)
    else:
        t = b * 0
    return t


@triton.jit
def _operand_column(r):
    """Where token r goes in a key-permuted transposed copy (operand_order): inside each group of 16 tokens,
    bits 3, 2, 1 of r move to bits 1, 3, 2."""
    return (r & ~14) | (((r >> 3) & 1) << 1) | (((r >> 1) & 1) << 2) | (((r >> 2) & 1) << 3)


def operand_order(n: int) -> torch.Tensor:
    """The key permutation of a key-permuted transposed V copy (`_quantize(..., permuted=True)`), as an index:
    copy[..., operand_order(n)[r]] is token r (n a multiple of 16). fp8_attention_sm90's register P path
    reorders P's columns the same way, so that its E4M3 P moves from the wgmma accumulator layout to the
    A-operand layout inside each thread's registers; the product P V does not change under a permutation of
    the keys applied to both."""
    r = torch.arange(n)
    return (r & ~14) | (((r >> 3) & 1) << 1) | (((r >> 1) & 1) << 2) | (((r >> 2) & 1) << 3)


@triton.jit
def _acc_rows(acc, c, x, x_mult, amax, y8, EMU: tl.constexpr):
    """acc += (x * x_mult) @ y8 on FP8 tensor cores. x is quantized per row against c, the running row
    maximum of |x * x_mult| (amax: this tile's), and acc is kept in units of c's scale: rescaled (by a power
    of two, exactly) when c grows, as online softmax rescales its output. Returns (acc, c); the result is
    acc * _scales(c)[1]."""
    c_new = tl.maximum(c, amax)
    inv_old, _ = _scales(c)
    inv, _ = _scales(c_new)
    acc = acc * tl.where(inv_old > 0, inv / tl.where(inv_old > 0, inv_old, 1.0), 1.0)[:, None]
    acc = tl.dot(_e4m3(x * (inv * x_mult)[:, None], EMU), y8, acc)
    return acc, c_new


# ----------------------------------------------------------------------------------------------
# The quantization pass
# ----------------------------------------------------------------------------------------------

@triton.jit
def _fp8_quantize(X, X8, X8T, SC, TA, ROT, CU, CU_T,
                  sxb, sxs, sxh, s8b, s8s, s8h, stb, sth, std, scb, sch, seqlen, b0,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, ROWWISE: tl.constexpr,
                  ROTATE: tl.constexpr, WRITE_ROWS: tl.constexpr, WRITE_T: tl.constexpr, T_HEAD: tl.constexpr,
                  VARLEN: tl.constexpr, EMU: tl.constexpr, PERMUTE_T: tl.constexpr = False):
    """Grid (row blocks, heads, batch): ROWS rows of one head of one sequence to E4M3. Writes the row-major
    copy X8 (X's shape, contiguous), the transposed copy X8T (batch, heads, head_dim, padded tokens; packed:
    heads, head_dim, tokens with each sequence starting at CU_T) and the
    scales: per row in the LSE's layout (ROWWISE), else one per block of ROWS rows (batch, heads, blocks).
    T_HEAD: the transposed copy is scaled by _scales(TA[head]) instead (an amax per head; no rotation).
    PERMUTE_T: the transposed copy's tokens in operand_order (dense layout only)."""
    h, b, start, sl, r0 = _row_block(CU, seqlen, b0, VARLEN, ROWS)
    if r0 >= sl:
        return
    b64, h64, start64 = b.to(tl.int64), h.to(tl.int64), start.to(tl.int64)
    rows = r0 + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    x = _load_tile(_head_rows(X, sxb, sxs, sxh, b, start, h, rows, offs_d), rows, sl, offs_d, HEAD_DIM, BLOCK_D, True)
    x8, scale = _quantize_tile(x, ROT, offs_d, ROWWISE, ROTATE, BLOCK_D, EMU)
    if ROWWISE:
        tl.store(SC + b64 * scb + h64 * sch + start64 + rows, scale, mask=rows < sl)
    else:
        tl.store(SC + b64 * scb + h64 * sch + r0 // ROWS, scale)
    if WRITE_ROWS:
        _store_tile(_head_rows(X8, s8b, s8s, s8h, b, start, h, rows, offs_d), x8, rows, sl, offs_d, HEAD_DIM)
    if WRITE_T:
        tstart = _t_start(CU_T, b, VARLEN).to(tl.int64)
        cols = _operand_column(rows) if PERMUTE_T else rows
        ptrs = X8T + b64 * stb + h64 * sth + offs_d.to(tl.int64)[:, None] * std + tstart + cols[None, :]
        if T_HEAD:
            inv, _ = _scales(tl.load(TA + h))
            xt8 = _e4m3(tl.trans(x.to(tl.float32)) * inv, EMU)
        else:
            xt8 = tl.trans(x8)
        tl.store(ptrs, xt8, mask=(offs_d[:, None] < HEAD_DIM) & (rows[None, :] < sl))


_quantize_launch = FastLauncher(_fp8_quantize)


@triton.jit
def _fp8_bwd_prep(O, DO, DLSE, LSE, LSE2, DELTA, DO8, DOS, DOA, CU,
                  sob, sos, soh, sdb, sds, sdh, s8b, s8s, s8h, slb, slh, seqlen_q, b0, group,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, VARLEN: tl.constexpr,
                  HAS_DLSE: tl.constexpr, EMU: tl.constexpr):
    """The backward's passes over dO in one read of dO and O: attention._bwd_prep's delta and lse2, dO's
    row-major E4M3 copy and row scales (_fp8_quantize's, the same _quantize_tile), and max |dO| per K/V head
    into DOA (float32, zeroed; atomic max: the values are >= 0, so any order gives the same maximum). The
    three were a prep pass, a quantization pass and a strided torch reduction (66 us alone); with this kernel
    the FP8 backward's passes went from 304 to 221 us at 4 x 4096 x 16 x 128 on the H200
    (bench/results/sm90/attention_passes_{c755209,eeda825}.json)."""
    h, b, start, sq, m0 = _row_block(CU, seqlen_q, b0, VARLEN, ROWS)
    if m0 >= sq:
        return
    rows = m0 + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(_head_rows(O, sob, sos, soh, b, start, h, rows, offs_d), rows, sq, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_tile(_head_rows(DO, sdb, sds, sdh, b, start, h, rows, offs_d), rows, sq, offs_d, HEAD_DIM, BLOCK_D,
                    True)
    row = b.to(tl.int64) * slb + h.to(tl.int64) * slh + start.to(tl.int64) + rows
    inside = rows < sq
    _store_delta_lse2(o, do, DLSE, LSE, LSE2, DELTA, row, inside, HAS_DLSE)
    do8, scale = _quantize_tile(do, None, offs_d, True, False, BLOCK_D, EMU)
    tl.store(DOS + row, scale, mask=inside)
    _store_tile(_head_rows(DO8, s8b, s8s, s8h, b, start, h, rows, offs_d), do8, rows, sq, offs_d, HEAD_DIM)
    tl.atomic_max(DOA + h // group, tl.max(tl.max(tl.abs(do.to(tl.float32)), 1), 0))


_dout_prep_launch = FastLauncher(_fp8_bwd_prep)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

@triton.jit
def _fp8_fwd_blocks(acc, l_i, m_i, vs_i, q8, qc, k_base, vt_base, KS, VS, s_base, desc_k, desc_v,
                    k_row, kv_col, vt_row, vt_col, sks, std, qpos, offs_n, offs_d, lo, hi, mask_lo, mask_hi,
                    seqlen_k, left, right, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    KV_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, EMU: tl.constexpr):
    """Online softmax over key blocks [lo, hi). qc: the row factor (Q row scale * softmax scale * log2 e);
    a tile's K scale multiplies it, so each score still costs one FMA and one exp2. acc is kept in units
    of the current V block's scale vs_i / 448. MASKED as in attention._fwd_blocks (2: descriptor loads, the
    blocks outside [mask_lo, mask_hi) masked, interior and boundary in one loop). H200 at 5f25a2c, d128
    N4096, one loop against a loop per phase: the tuner's kernel times causal 0.423 / 0.438 ms, non-causal
    0.745 / 0.711 (rotated 0.449 / 0.461, 0.777 / 0.782); the whole forward by do_bench 1.5% (non-causal)
    and 2.8% (causal) faster. Within this run-to-run spread, so the bf16 kernel's structure is kept."""
    k_offs = offs_n[:, None] * sks + offs_d[None, :]
    vt_offs = offs_d[:, None] * std + offs_n[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N):
        kpos = start_n + offs_n
        start = tl.cast(start_n, tl.int64)
        blk = start_n // KV_BLOCK
        ks = tl.load(KS + s_base + blk)
        vs = tl.load(VS + s_base + blk)
        if USE_TMA:
            k8 = desc_k.load([k_row + start_n, kv_col])
        else:
            k8 = _load_tile(k_base + start * sks + k_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED > 0)
        s = tl.dot(q8, tl.trans(k8))
        c = qc * ks
        if MASKED > 0:
            if MASKED == 1:
                keep = _keep(qpos[:, None], kpos[None, :], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
                s = tl.where(keep, s, float("-inf"))
            elif (start_n < mask_lo) | (start_n >= mask_hi):
                keep = _keep(qpos[:, None], kpos[None, :], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * c)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: p = 0, not NaN
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * c)
            m_use = m_new
        p = tl.math.exp2(s * c[:, None] - (m_use - P_LOG2)[:, None])   # P * 256, E4M3-ready; l_i too
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * (alpha * (vs_i / vs))[:, None]
        if USE_TMA:
            vt8 = desc_v.load([vt_row, vt_col + start_n])
        else:
            vt8 = _load_tile_t(vt_base + start + vt_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED > 0)
        acc = tl.dot(_e4m3(p, EMU), tl.trans(vt8), acc)
        m_i = m_new
        vs_i = vs
    return acc, l_i, m_i, vs_i


@triton.jit
def _fp8_fwd(Q, Q8, ROT, K8, V8T, KS, VS, O, LSE, CU, CU_T, desc_k, desc_v,
             sqb, sqs, sqh, s8qb, s8qs, s8qh, skb, sks, skh, stb, sth, std, ssb, ssh, sob, sos, soh, slb, slh,
             seqlen_q, seqlen_k, rows_k, t_heads, group, qk_scale, left, right, b0,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             VARLEN: tl.constexpr, USE_TMA: tl.constexpr, KV_BLOCK: tl.constexpr, ROTATE: tl.constexpr,
             EMU: tl.constexpr, EMU_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (query blocks, heads, batch), latest query blocks first. The program quantizes its Q tile
    (rotated first with ROTATE) and passes it through Q8, a scratch copy it writes and reads back: a loaded
    tile feeds the Q K^T wgmmas from shared memory (the module docstring says why, and how it timed)."""
    m0, h, hk, b, start, sq, sk = _query_program(CU, seqlen_q, seqlen_k, group, b0, HAS_RIGHT, VARLEN, BLOCK_M)
    if m0 >= sq:
        return
    b64, h64, hk64, start64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64), start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    q8_ptrs = Q8 + b64 * s8qb + start64 * s8qs + h64 * s8qh + rows * s8qs + offs_d[None, :]
    x = _load_tile(Q + b64 * sqb + start64 * sqs + h64 * sqh + rows * sqs + offs_d[None, :],
                   offs_m, sq, offs_d, HEAD_DIM, BLOCK_D, True)
    x8, qs = _quantize_tile(x, ROT, offs_d, True, ROTATE, BLOCK_D, EMU)
    _store_tile(q8_ptrs, x8, offs_m, sq, offs_d, HEAD_DIM)
    tl.debug_barrier()   # every thread's share of the tile is in memory before any thread reads it back
    q8 = _load_tile(q8_ptrs, offs_m, sq, offs_d, HEAD_DIM, BLOCK_D, True)
    qc = qs * qk_scale
    off = sk - sq
    qpos = offs_m + off
    first = m0 + off
    last = tl.minimum(m0 + BLOCK_M, sq) - 1 + off
    lo, inner_lo, inner_hi, hi = _key_range(first, last, sk, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    vs_i = qk_scale * 0.0 + 1.0
    k_base = K8 + b64 * skb + start64 * sks + hk64 * skh
    tstart = _t_start(CU_T, b, VARLEN)
    vt_base = V8T + b64 * stb + hk64 * sth + tstart.to(tl.int64)
    s_base = b64 * ssb + hk64 * ssh
    k_row = b * rows_k + start
    kv_col = hk * HEAD_DIM
    vt_row = (b * t_heads + hk) * HEAD_DIM
    if USE_TMA:   # interior and boundary blocks in one loop, as attention._attn_fwd
        acc, l_i, m_i, vs_i = _fp8_fwd_blocks(acc, l_i, m_i, vs_i, q8, qc, k_base, vt_base, KS, VS, s_base,
                                              desc_k, desc_v, k_row, kv_col, vt_row, tstart, sks, std, qpos, offs_n,
                                              offs_d, lo, hi, inner_lo, inner_hi, sk, left, right, 2, HAS_LEFT,
                                              HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, KV_BLOCK, USE_TMA,
                                              EMU)
    else:
        acc, l_i, m_i, vs_i = _fp8_fwd_blocks(acc, l_i, m_i, vs_i, q8, qc, k_base, vt_base, KS, VS, s_base,
                                              desc_k, desc_v, k_row, kv_col, vt_row, tstart, sks, std, qpos, offs_n,
                                              offs_d, inner_lo, inner_hi, lo, hi, sk, left, right, 0, HAS_LEFT,
                                              HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, KV_BLOCK, USE_TMA,
                                              EMU)
        if HAS_LEFT:
            acc, l_i, m_i, vs_i = _fp8_fwd_blocks(acc, l_i, m_i, vs_i, q8, qc, k_base, vt_base, KS, VS, s_base,
                                                  desc_k, desc_v, k_row, kv_col, vt_row, tstart, sks, std, qpos,
                                                  offs_n, offs_d, lo, inner_lo, lo, hi, sk, left, right, 1,
                                                  HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, KV_BLOCK,
                                                  USE_TMA, EMU)
        acc, l_i, m_i, vs_i = _fp8_fwd_blocks(acc, l_i, m_i, vs_i, q8, qc, k_base, vt_base, KS, VS, s_base,
                                              desc_k, desc_v, k_row, kv_col, vt_row, tstart, sks, std, qpos, offs_n,
                                              offs_d, inner_hi, hi, lo, hi, sk, left, right, 1, HAS_LEFT,
                                              HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, KV_BLOCK, USE_TMA,
                                              EMU)

    empty = l_i == 0.0  # the row sees no key: output 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (vs_i / l_safe)[:, None]   # acc and l_i both carry P's factor 256
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe) - P_LOG2) * LN2)
    o_ptrs = O + b64 * sob + start64 * sos + h64 * soh + rows * sos + offs_d[None, :]
    _store_tile(o_ptrs, _cast(out, O.dtype.element_ty, EMU_BF16), offs_m, sq, offs_d, HEAD_DIM)
    tl.store(LSE + b64 * slb + h64 * slh + start64 + offs_m, lse, mask=offs_m < sq)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

@triton.jit
def _fp8_dkdv_step(dk, dv, ck, k8, v8, kc, vs, Q8, Q8T, DO8, DO8T, QS, DOS, LSE2, DELTA,
                   desc_q, desc_qt, desc_do, desc_dot, q_off, qt_off, l_off, q_row, q_col, qt_row, qt_col,
                   s8s, std, start_m, kpos, offs_m, offs_d, seqlen_q, seqlen_k, off, left, right,
                   MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, EMU: tl.constexpr):
    """One query block's share of dK, dV in the transposed (key, query) frame: P^T = exp2(K Q^T c - lse2),
    dP^T = V dO^T, dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q. The query rows' scales (Q, dO)
    lie along the reduction of the last two, so they multiply the left operand before its quantization."""
    rows = start_m + offs_m
    if USE_TMA:
        q8 = desc_q.load([q_row + start_m, q_col])
        do8 = desc_do.load([q_row + start_m, q_col])
        q8t = desc_qt.load([qt_row, qt_col + start_m])
        do8t = desc_dot.load([qt_row, qt_col + start_m])
    else:
        sm64 = tl.cast(start_m, tl.int64)
        r_offs = (sm64 + offs_m)[:, None] * s8s + offs_d[None, :]
        t_offs = offs_d.to(tl.int64)[:, None] * std + sm64 + offs_m[None, :]
        q8 = _load_tile(Q8 + q_off + r_offs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        do8 = _load_tile(DO8 + q_off + r_offs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        q8t = _load_tile_t(Q8T + qt_off + t_offs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        do8t = _load_tile_t(DO8T + qt_off + t_offs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    if MASKED:
        inside = rows < seqlen_q
        qs = tl.load(QS + l_off + rows, mask=inside, other=1.0)
        dos = tl.load(DOS + l_off + rows, mask=inside, other=1.0)
        lse2 = tl.load(LSE2 + l_off + rows, mask=inside, other=float("inf"))
        delta = tl.load(DELTA + l_off + rows, mask=inside, other=0.0)
    else:
        qs = tl.load(QS + l_off + rows)
        dos = tl.load(DOS + l_off + rows)
        lse2 = tl.load(LSE2 + l_off + rows)
        delta = tl.load(DELTA + l_off + rows)
    s_t = tl.dot(k8, tl.trans(q8))
    p_t = tl.math.exp2(s_t * (qs * kc)[None, :] - (lse2 - P_LOG2)[None, :])   # P^T * 256
    if MASKED:
        keep = _keep(rows[None, :] + off, kpos[:, None], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
        p_t = tl.where(keep & (rows[None, :] < seqlen_q), p_t, 0.0)
    dv = tl.dot(_e4m3(p_t, EMU), tl.trans(do8t), dv)   # dO^T scaled per head: no row scale here
    dp_t = tl.dot(v8, tl.trans(do8))
    # dS^T diag(Q row scales), the row scales and P's 1/256 folded into the per-query vectors (powers of two)
    qs_p = qs * (1.0 / P_SCALE)
    g = p_t * (dp_t * (dos * vs * qs_p)[None, :] - (delta * qs_p)[None, :])
    dk, ck = _acc_rows(dk, ck, g, 1.0, tl.max(tl.abs(g), 1), tl.trans(q8t), EMU)
    return dk, dv, ck


@triton.jit
def _fp8_dkdv_blocks(dk, dv, ck, k8, v8, kc, vs, Q8, Q8T, DO8, DO8T, QS, DOS, LSE2, DELTA,
                     desc_q, desc_qt, desc_do, desc_dot, q_off, qt_off, l_off, q_row, h0, qt_row, qt_col, group,
                     s8s, s8h, sth, std, slh, kpos, offs_m, offs_d, lo, hi, seqlen_q, seqlen_k, off, left, right,
                     MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, GQA: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     USE_TMA: tl.constexpr, EMU: tl.constexpr):
    """dK, dV of one key block over query blocks [lo, hi) of query head h0 or, with GQA, of each head of
    its group: one flat loop over (head, block) pairs, as in the bf16 kernel."""
    if GQA:
        n_blocks = (hi - lo + BLOCK_M - 1) // BLOCK_M
        for it in tl.range(0, n_blocks * group):
            g = it // n_blocks
            start_m = lo + (it - g * n_blocks) * BLOCK_M
            g64 = g.to(tl.int64)
            dk, dv, ck = _fp8_dkdv_step(dk, dv, ck, k8, v8, kc, vs, Q8, Q8T, DO8, DO8T, QS, DOS, LSE2,
                                        DELTA, desc_q, desc_qt, desc_do, desc_dot, q_off + g64 * s8h,
                                        qt_off + g64 * sth, l_off + g64 * slh, q_row, (h0 + g) * HEAD_DIM,
                                        qt_row + g * HEAD_DIM, qt_col, s8s, std, start_m, kpos, offs_m,
                                        offs_d, seqlen_q, seqlen_k, off, left, right, MASKED, HAS_LEFT,
                                        HAS_RIGHT, HEAD_DIM, BLOCK_D, USE_TMA, BLOCK_M, BLOCK_N, EMU)
    else:
        for start_m in tl.range(lo, hi, BLOCK_M):
            dk, dv, ck = _fp8_dkdv_step(dk, dv, ck, k8, v8, kc, vs, Q8, Q8T, DO8, DO8T, QS, DOS, LSE2,
                                        DELTA, desc_q, desc_qt, desc_do, desc_dot, q_off, qt_off, l_off,
                                        q_row, h0 * HEAD_DIM, qt_row, qt_col, s8s, std, start_m, kpos, offs_m,
                                        offs_d, seqlen_q, seqlen_k, off, left, right, MASKED, HAS_LEFT,
                                        HAS_RIGHT, HEAD_DIM, BLOCK_D, USE_TMA, BLOCK_M, BLOCK_N, EMU)
    return dk, dv, ck


@triton.jit
def _unrotate(x, ROT, offs_d, BLOCK_D: tl.constexpr):
    """x R^T for the +-1 matrix R the pass rotated Q and K by (tf32 dot: 1e-3 relative, far below FP8's)."""
    rt = tl.trans(tl.load(ROT + offs_d[:, None] * BLOCK_D + offs_d[None, :]).to(tl.float32))
    return tl.dot(x, rt, input_precision="tf32")


@triton.jit
def _fp8_bwd_dkdv(Q8, Q8T, K8, V8, DO8, DO8T, QS, DOS, KS, VS, DK, DV, LSE2, DELTA, DOA, ROT, CU, CU_T,
                  desc_q, desc_qt, desc_do, desc_dot,
                  s8qb, s8qs, s8qh, stb, sth, std, s8kb, s8ks, s8kh, ssb, ssh, sgb, sgs, sgh, slb, slh,
                  seqlen_q, seqlen_k, rows_q, t_heads, group, qk_scale, grad_scale, left, right, b0,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  VARLEN: tl.constexpr, USE_TMA: tl.constexpr, GQA: tl.constexpr, ROTATE: tl.constexpr,
                  KV_BLOCK: tl.constexpr, EMU: tl.constexpr, EMU_BF16: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (key blocks, kv heads, batch); dK and dV are written (contiguous, strides sg*). Q8/DO8 share a
    layout, as do Q8T/DO8T and K8/V8 (all written by the pass)."""
    n0, hk, b, start, sq, sk = _key_program(CU, seqlen_q, seqlen_k, b0, HAS_RIGHT, VARLEN, BLOCK_N)
    if n0 >= sk:
        return
    h0 = hk * group
    b64, hk64, h64, start64 = b.to(tl.int64), hk.to(tl.int64), h0.to(tl.int64), start.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_offs = b64 * s8kb + start64 * s8ks + hk64 * s8kh + offs_n.to(tl.int64)[:, None] * s8ks + offs_d[None, :]
    k8 = _load_tile(K8 + kv_offs, offs_n, sk, offs_d, HEAD_DIM, BLOCK_D, True)
    v8 = _load_tile(V8 + kv_offs, offs_n, sk, offs_d, HEAD_DIM, BLOCK_D, True)
    blk = b64 * ssb + hk64 * ssh + n0 // KV_BLOCK
    kc = tl.load(KS + blk) * qk_scale
    vs = tl.load(VS + blk)
    off = sk - sq
    lo, inner_lo, inner_hi, hi = _query_range(n0, tl.minimum(n0 + BLOCK_N, sk) - 1, sq, off, left, right,
                                              HAS_LEFT, HAS_RIGHT, BLOCK_M)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    ck = tl.zeros([BLOCK_N], tl.float32)
    q_off = b64 * s8qb + start64 * s8qs + h64 * s8qh
    tstart = _t_start(CU_T, b, VARLEN)
    qt_off = b64 * stb + h64 * sth + tstart.to(tl.int64)
    l_off = b64 * slb + h64 * slh + start64
    q_row = b * rows_q + start
    qt_row = (b * t_heads + h0) * HEAD_DIM
    dk, dv, ck = _fp8_dkdv_blocks(dk, dv, ck, k8, v8, kc, vs, Q8, Q8T, DO8, DO8T, QS, DOS, LSE2, DELTA,
                                      desc_q, desc_qt, desc_do, desc_dot, q_off, qt_off, l_off, q_row, h0, qt_row,
                                      tstart, group, s8qs, s8qh, sth, std, slh, offs_n, offs_m, offs_d,
                                      inner_lo, inner_hi, sq, sk, off, left, right, False, HAS_LEFT, HAS_RIGHT,
                                      GQA, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, USE_TMA, EMU)
    if HAS_RIGHT:
        dk, dv, ck = _fp8_dkdv_blocks(dk, dv, ck, k8, v8, kc, vs, Q8, Q8T, DO8, DO8T, QS, DOS, LSE2,
                                          DELTA, desc_q, desc_qt, desc_do, desc_dot, q_off, qt_off, l_off, q_row,
                                          h0, qt_row, tstart, group, s8qs, s8qh, sth, std, slh, offs_n, offs_m,
                                          offs_d, lo, inner_lo, sq, sk, off, left, right, True, HAS_LEFT,
                                          HAS_RIGHT, GQA, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, USE_TMA, EMU)
    dk, dv, ck = _fp8_dkdv_blocks(dk, dv, ck, k8, v8, kc, vs, Q8, Q8T, DO8, DO8T, QS, DOS, LSE2, DELTA,
                                      desc_q, desc_qt, desc_do, desc_dot, q_off, qt_off, l_off, q_row, h0, qt_row,
                                      tstart, group, s8qs, s8qh, sth, std, slh, offs_n, offs_m, offs_d,
                                      inner_hi, hi, sq, sk, off, left, right, True, HAS_LEFT, HAS_RIGHT,
                                      GQA, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, USE_TMA, EMU)
    dv = dv * (_scales(tl.load(DOA + h0))[1] / P_SCALE)
    dk = dk * (_scales(ck)[1] * grad_scale)[:, None]
    if ROTATE:
        dk = _unrotate(dk, ROT, offs_d, BLOCK_D)
    g_off = b64 * sgb + start64 * sgs + hk64 * sgh + offs_n.to(tl.int64)[:, None] * sgs + offs_d[None, :]
    _store_tile(DK + g_off, _cast(dk, DK.dtype.element_ty, EMU_BF16), offs_n, sk, offs_d, HEAD_DIM)
    _store_tile(DV + g_off, _cast(dv, DV.dtype.element_ty, EMU_BF16), offs_n, sk, offs_d, HEAD_DIM)


@triton.jit
def _fp8_dq_blocks(dq, cq, q8, do8, qc, dos, lse2, delta, K8, K8T, V8, KS, VS, desc_k, desc_kt, desc_v,
                   k_off, kt_off, s_base, k_row, k_col, kt_row, kt_col, s8s, std, qpos, offs_n, offs_d, lo, hi,
                   seqlen_k, left, right, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   KV_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, EMU: tl.constexpr):
    """dQ of one query block over key blocks [lo, hi): dQ += dS K with the tile's K scale folded into dS's
    row quantization."""
    r_offs = offs_n[:, None] * s8s + offs_d[None, :]
    t_offs = offs_d.to(tl.int64)[:, None] * std + offs_n[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N):
        kpos = start_n + offs_n
        start = tl.cast(start_n, tl.int64)
        blk = start_n // KV_BLOCK
        ks = tl.load(KS + s_base + blk)
        vs = tl.load(VS + s_base + blk)
        if USE_TMA:
            k8 = desc_k.load([k_row + start_n, k_col])
            v8 = desc_v.load([k_row + start_n, k_col])
            k8t = desc_kt.load([kt_row, kt_col + start_n])
        else:
            k8 = _load_tile(K8 + k_off + start * s8s + r_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
            v8 = _load_tile(V8 + k_off + start * s8s + r_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
            k8t = _load_tile_t(K8T + kt_off + start + t_offs, kpos, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        s = tl.dot(q8, tl.trans(k8))
        p = tl.math.exp2(s * (qc * ks)[:, None] - lse2[:, None])
        if MASKED:
            keep = _keep(qpos[:, None], kpos[None, :], seqlen_k, left, right, HAS_LEFT, HAS_RIGHT)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do8, tl.trans(v8))
        ds = p * (dp * (dos * vs)[:, None] - delta[:, None])
        dq, cq = _acc_rows(dq, cq, ds, ks, tl.max(tl.abs(ds), 1) * ks, tl.trans(k8t), EMU)
    return dq, cq


@triton.jit
def _fp8_bwd_dq(Q8, DO8, QS, DOS, K8, K8T, V8, KS, VS, DQ, LSE2, DELTA, ROT, CU, CU_T, desc_k, desc_kt, desc_v,
                s8qb, s8qs, s8qh, s8kb, s8ks, s8kh, stb, sth, std, ssb, ssh, sgb, sgs, sgh, slb, slh,
                seqlen_q, seqlen_k, rows_k, t_heads, group, qk_scale, grad_scale, left, right, b0,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                VARLEN: tl.constexpr, USE_TMA: tl.constexpr, ROTATE: tl.constexpr, KV_BLOCK: tl.constexpr,
                EMU: tl.constexpr, EMU_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Grid (query blocks, heads, batch), latest query blocks first; dQ is written (contiguous, strides sg*)."""
    m0, h, hk, b, start, sq, sk = _query_program(CU, seqlen_q, seqlen_k, group, b0, HAS_RIGHT, VARLEN, BLOCK_M)
    if m0 >= sq:
        return
    b64, h64, hk64, start64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64), start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_offs = b64 * s8qb + start64 * s8qs + h64 * s8qh + offs_m.to(tl.int64)[:, None] * s8qs + offs_d[None, :]
    q8 = _load_tile(Q8 + q_offs, offs_m, sq, offs_d, HEAD_DIM, BLOCK_D, True)
    do8 = _load_tile(DO8 + q_offs, offs_m, sq, offs_d, HEAD_DIM, BLOCK_D, True)
    row = b64 * slb + h64 * slh + start64 + offs_m
    inside = offs_m < sq
    qc = tl.load(QS + row, mask=inside, other=1.0) * qk_scale
    dos = tl.load(DOS + row, mask=inside, other=1.0)
    lse2 = tl.load(LSE2 + row, mask=inside, other=float("inf"))
    delta = tl.load(DELTA + row, mask=inside, other=0.0)
    off = sk - sq
    qpos = offs_m + off
    first = m0 + off
    last = tl.minimum(m0 + BLOCK_M, sq) - 1 + off
    lo, inner_lo, inner_hi, hi = _key_range(first, last, sk, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_N)
    k_off = b64 * s8kb + start64 * s8ks + hk64 * s8kh
    tstart = _t_start(CU_T, b, VARLEN)
    kt_off = b64 * stb + hk64 * sth + tstart.to(tl.int64)
    s_base = b64 * ssb + hk64 * ssh
    k_row = b * rows_k + start
    k_col = hk * HEAD_DIM
    kt_row = (b * t_heads + hk) * HEAD_DIM
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cq = tl.zeros([BLOCK_M], tl.float32)
    dq, cq = _fp8_dq_blocks(dq, cq, q8, do8, qc, dos, lse2, delta, K8, K8T, V8, KS, VS, desc_k, desc_kt, desc_v,
                            k_off, kt_off, s_base, k_row, k_col, kt_row, tstart, s8ks, std, qpos, offs_n, offs_d,
                            inner_lo, inner_hi, sk, left, right, False, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D,
                            BLOCK_M, BLOCK_N, KV_BLOCK, USE_TMA, EMU)
    if HAS_LEFT:
        dq, cq = _fp8_dq_blocks(dq, cq, q8, do8, qc, dos, lse2, delta, K8, K8T, V8, KS, VS, desc_k, desc_kt,
                                desc_v, k_off, kt_off, s_base, k_row, k_col, kt_row, tstart, s8ks, std, qpos, offs_n,
                                offs_d, lo, inner_lo, sk, left, right, True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D,
                                BLOCK_M, BLOCK_N, KV_BLOCK, USE_TMA, EMU)
    dq, cq = _fp8_dq_blocks(dq, cq, q8, do8, qc, dos, lse2, delta, K8, K8T, V8, KS, VS, desc_k, desc_kt, desc_v,
                            k_off, kt_off, s_base, k_row, k_col, kt_row, tstart, s8ks, std, qpos, offs_n, offs_d,
                            inner_hi, hi, sk, left, right, True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D,
                            BLOCK_M, BLOCK_N, KV_BLOCK, USE_TMA, EMU)
    dq = dq * (_scales(cq)[1] * grad_scale)[:, None]
    if ROTATE:
        dq = _unrotate(dq, ROT, offs_d, BLOCK_D)
    g_ptrs = DQ + b64 * sgb + start64 * sgs + h64 * sgh + offs_m.to(tl.int64)[:, None] * sgs + offs_d[None, :]
    _store_tile(g_ptrs, _cast(dq, DQ.dtype.element_ty, EMU_BF16), offs_m, sq, offs_d, HEAD_DIM)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head_dim class, as attention.CONFIGS (a fifth
# element "tma"/"ptr" keeps an entry to one load path). FP8 dots need every reduction dimension >= 32, so
# BLOCK_N >= 32 (PV), BLOCK_M >= 32 in dK/dV (P^T dO, dS^T Q) and BLOCK_N >= 32 in dQ (dS K); BLOCK_N must
# divide KV_BLOCK (128). FP8 tiles take half the shared memory of bf16 ones, so the forward can afford
# 128 x 128 score tiles with 3 stages. Compiled for sm_90 ahead of time (Triton 3.9's ptxas), causal and
# not: no register spills on the descriptor path except dK/dV with 64-row query tiles (100-250 spilled
# words, as the bf16 kernel's fastest dK/dV config has ~90) and head_dim 256 dK/dV; the pointer path spills
# more, so its candidates are fewer. Not yet timed on the H200: bench/attention.py --fp8-only times them
# (a config that does not compile or fit is skipped and recorded) and --sweep widens them.
FP8_CONFIGS = {
    "fp8_fwd": {64: [(128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
                128: [(128, 128, 8, 3, "tma"), (128, 64, 8, 3), (128, 128, 8, 2, "tma"), (64, 128, 4, 3, "tma"),
                      (64, 64, 4, 3, "tma"), (128, 128, 8, 4, "tma")],
                256: [(128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2)]},
    "fp8_dkdv": {64: [(64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 8, 3), (64, 64, 4, 2)],
                 128: [(32, 64, 4, 3), (64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 4), (32, 128, 8, 3),
                       (64, 64, 4, 3)],
                 256: [(32, 32, 4, 2), (32, 64, 8, 2)]},
    "fp8_dq": {64: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)],
               128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 2, "tma")],
               256: [(64, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)]},
}
_INTERPRET_CONFIG = {"fp8_fwd": (32, 32, 4, 1), "fp8_dkdv": (32, 32, 4, 1), "fp8_dq": (32, 32, 4, 1)}
_ENV = "TILEWISE_FP8_ATTN_CONFIGS"  # e.g. 'fp8_fwd=128,128,8,3/128,64,8,3;fp8_dq=128,64,8,3'

_FWD8 = attn._Kernel("fp8_fwd", _fp8_fwd, FP8_CONFIGS, _INTERPRET_CONFIG["fp8_fwd"], _ENV)
_DKDV8 = attn._Kernel("fp8_dkdv", _fp8_bwd_dkdv, FP8_CONFIGS, _INTERPRET_CONFIG["fp8_dkdv"], _ENV)
_DQ8 = attn._Kernel("fp8_dq", _fp8_bwd_dq, FP8_CONFIGS, _INTERPRET_CONFIG["fp8_dq"], _ENV)
KERNELS = (_FWD8, _DKDV8, _DQ8)


def set_candidates(name, configs, head_dim=None):
    """Replace FP8 kernel `name`'s candidates for one head_dim class or all, and forget the choices made."""
    for c in [head_dim] if head_dim is not None else list(FP8_CONFIGS[name]):
        FP8_CONFIGS[name][c] = [tuple(cfg) for cfg in configs]
    reset_tuning()


def reset_tuning():
    attn.reset_tuning(KERNELS)


def tuning_report():
    """{kernel: [{"key", "chosen", "ms"}]} of the FP8 kernels tuned in this process, and the FP8 Gluon
    kernels' races against them ("gluon_vs_triton")."""
    return attn.tuning_report(KERNELS, races="fp8_")


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_new, _cdiv, _pow2, _seq_strides = attn._new, attn._cdiv, attn._pow2, attn._seq_strides
_FP8 = torch.float8_e4m3fn


def _block_d(head_dim):
    return max(32, _pow2(head_dim))


@functools.lru_cache(maxsize=None)
def rotation(head_dim, device) -> torch.Tensor:
    """H diag(signs) as a (head_dim, head_dim) bf16 matrix of +-1: Sylvester's Hadamard matrix H with the
    columns' signs drawn once from a fixed seed. R R^T = head_dim * I, so (Q R)(K R)^T = head_dim * Q K^T."""
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(20240611 + head_dim)) * 2 - 1
    return (h * signs[None, :]).to(device=device, dtype=torch.bfloat16)


def _t_offsets(cu):
    """Packed transposed copies: sequence b's tokens start at column cu_t[b], its start in tokens rounded
    so that every sequence starts at a multiple of 16 (computed on the device: no host sync)."""
    padded = (cu[1:] - cu[:-1] + 15) // 16 * 16
    return torch.cat([cu.new_zeros(1), torch.cumsum(padded, 0)]).to(torch.int32)


def _new_transposed(x, packed, batch):
    """The transposed copy of x: (batch, heads, head_dim, tokens padded to 16), or packed (heads, head_dim,
    columns) with room for every sequence rounded up to 16 tokens. Rows of 16-byte multiples, so TMA can
    tile it; the padding (which tiles running past a sequence read) is zero, never NaN: zeroed from the start
    of the 16-token group the sequence ends in, since a key-permuted copy (operand_order) leaves some of that
    group's earlier columns to the padding."""
    heads, head_dim = x.shape[-2], x.shape[-1]
    if packed:
        cols = _cdiv(x.shape[0] + 16 * batch, 16) * 16
        return torch.zeros((heads, head_dim, cols), dtype=_FP8, device=x.device)
    n = x.shape[1]
    t = _new((x.shape[0], heads, head_dim, _cdiv(max(n, 1), 16) * 16), _FP8, x.device)
    t[..., n // 16 * 16:].zero_()
    return t


def _t_strides(t, packed):
    """(batch, head, head_dim row) strides of a transposed copy (none for the batch when packed)."""
    return (0, t.stride(0), t.stride(1)) if packed else (t.stride(0), t.stride(1), t.stride(2))


def _quantize(x, cu, cu_t, batch, seqlen, max_len, *, rowwise, rot=None, rows=True, transposed=False,
              t_amax=None, permuted=False):
    """E4M3 copies of x (q/k/v layout) and its scales: (x8 or None, x8t or None, scales). Row scales have
    the LSE's layout; block scales are (batch, heads, blocks of KV_BLOCK rows). t_amax: a float32 amax per
    head that scales the transposed copy instead (see _dout_passes). permuted: the transposed copy's tokens in
    operand_order (dense layout only; what fp8_attention_sm90's register P path reads)."""
    packed = cu is not None
    if permuted and (packed or not transposed):
        raise ValueError("fp8_attention._quantize: permuted is for the dense layout's transposed copy")
    heads, head_dim = x.shape[-2], x.shape[-1]
    dev = x.device
    x8 = _new(x.shape, _FP8, dev) if rows else None
    x8t = _new_transposed(x, packed, batch) if transposed else None
    total = x.shape[0] if packed else 0
    if rowwise:
        scales = _new((heads, total) if packed else (batch, heads, seqlen), torch.float32, dev)
        scale_strides = attn._lse_strides(heads, seqlen, total, packed)
        block = _ROWS_PER_QUANT_PROGRAM
    else:
        n_blocks = _cdiv(max(max_len, 1), KV_BLOCK)
        scales = _new((batch, heads, n_blocks), torch.float32, dev)
        scale_strides = (heads * n_blocks, n_blocks)
        block = KV_BLOCK
    if x.numel() == 0:
        return x8, x8t, scales
    block_d = _block_d(head_dim)
    warps = 8 if block * block_d >= 16384 else 4
    # Both copies in one kernel miscompile on sm_90 with Triton 3.6's ptxas (see tilewise.ops.fp8_cast; here
    # for bf16 input too): the row-major copy and the transposed one are written by separate launches.
    # Tried again at eeda825 for bf16 and fp16 input (the transposed E4M3 tile, or its values transposed as
    # float32 and cast again): wrong bytes in every row-scaled and every rotated case on the H200, clean only
    # for block scales without rotation (bench/results/sm90/attention_passes_eeda825.json).
    passes = [(True, False), (False, True)] if rows and transposed else [(rows, transposed)]
    for write_rows, write_t in passes:
        for b0 in range(0, batch, attn._MAX_GRID_YZ):
            nb = min(batch - b0, attn._MAX_GRID_YZ)
            _quantize_launch(
                (_cdiv(max_len, block), heads, nb),
                x, x8, x8t, scales, t_amax, rot, cu, cu_t, *_seq_strides(x, packed),
                *(_seq_strides(x8, packed) if rows else (0, 0, 0)),
                *(_t_strides(x8t, packed) if transposed else (0, 0, 0)), *scale_strides, seqlen, b0,
                HEAD_DIM=head_dim, BLOCK_D=block_d, ROWS=block, ROWWISE=rowwise, ROTATE=rot is not None,
                WRITE_ROWS=write_rows, WRITE_T=write_t, T_HEAD=t_amax is not None, VARLEN=packed,
                EMU=_INTERPRET, PERMUTE_T=permuted and write_t, num_warps=warps)
    return x8, x8t, scales


def _dout_passes(dout, out, lse, dlse, cu, cu_t, batch, seqlen_q, max_q, heads, kv_heads, total):
    """The backward's operands made from dO: (lse2, delta, do8, do8t, dos, do_amax). One pass
    (_fp8_bwd_prep) reads dO and O for lse2, delta (attention._backward_prep's), the row-major E4M3 dO and its
    row scales dos, and max |dO| per K/V head; a second writes the transposed copy do8t scaled by that
    maximum (do_amax, float32 (heads,): each query head gets its group's, since the dK/dV kernel sums a group
    into one dV accumulator, which needs one scale). dout has a unit last stride."""
    packed = cu is not None
    head_dim = dout.shape[-1]
    lse = lse.contiguous()
    lse2 = _new(lse.shape, torch.float32, dout.device)
    delta = _new(lse.shape, torch.float32, dout.device)
    dos = _new(lse.shape, torch.float32, dout.device)
    do8 = _new(dout.shape, _FP8, dout.device)
    amax = torch.zeros(kv_heads, dtype=torch.float32, device=dout.device)
    has_dlse = dlse is not None
    dlse_arg = dlse.contiguous() if has_dlse else lse
    for b0 in range(0, batch, attn._MAX_GRID_YZ):
        nb = min(batch - b0, attn._MAX_GRID_YZ)
        _dout_prep_launch(
            (_cdiv(max_q, _ROWS_PER_QUANT_PROGRAM), heads, nb), out, dout, dlse_arg, lse, lse2, delta, do8, dos,
            amax, cu, *_seq_strides(out, packed), *_seq_strides(dout, packed), *_seq_strides(do8, packed),
            *attn._lse_strides(heads, seqlen_q, total, packed), seqlen_q, b0, heads // kv_heads,
            HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), ROWS=_ROWS_PER_QUANT_PROGRAM, VARLEN=packed,
            HAS_DLSE=has_dlse, EMU=_INTERPRET, num_warps=8 if _ROWS_PER_QUANT_PROGRAM * head_dim >= 16384 else 4)
    do_amax = amax.repeat_interleave(heads // kv_heads) if heads != kv_heads else amax
    _, do8t, _ = _quantize(dout, cu, cu_t, batch, seqlen_q, max_q, rowwise=True, rows=False, transposed=True,
                           t_amax=do_amax)
    return lse2, delta, do8, do8t, dos, do_amax


def _t_descriptor(t, packed, block_cols):
    """A transposed copy as a 2-D (heads * head_dim rows, tokens) TMA descriptor, (head_dim, block) tiles."""
    d, n = t.shape[-2], t.shape[-1]
    rows = t.numel() // n
    shape, strides, block = [rows, n], [n, 1], [d, block_cols]
    if attn._DESC_DEFAULTS is None:
        return attn.TensorDescriptor(t, shape, strides, block)
    return attn._fast_descriptor(attn._DESC_DEFAULTS, t, shape, strides, block)


def _tma(device, head_dim):
    """The load path of the FP8 kernels: descriptors where the bf16 kernel would use them and every tile
    spans whole rows (head_dim a power of two >= 32; the copies are the pass's, always contiguous)."""
    mode = attn._tma_mode(device)
    return mode if mode != "off" and head_dim == _block_d(head_dim) else "off"


def _consts(q, left, right, packed):
    return dict(HEAD_DIM=q.shape[-1], BLOCK_D=_block_d(q.shape[-1]), HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
                VARLEN=packed, KV_BLOCK=KV_BLOCK, EMU=_INTERPRET,
                EMU_BF16=_INTERPRET and q.dtype == torch.bfloat16)


def _fp8_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate):
    """O (contiguous, q's dtype) and LSE (float32, natural log) of FP8 attention."""
    packed, batch, seqlen_q, seqlen_k, max_q, max_k, heads, kv_heads, head_dim = attn._common(q, k, cu_seqlens,
                                                                                               max_seqlen)
    out = _new(q.shape, q.dtype, q.device)
    total = q.shape[0] if packed else 0
    lse = _new((heads, total) if packed else (batch, heads, seqlen_q), torch.float32, q.device)
    if q.numel() == 0:
        return out, lse
    if k.numel() == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    cu = cu_seqlens.to(q.device) if packed else None
    cu_t = _t_offsets(cu) if packed else None
    rot = rotation(head_dim, q.device) if rotate else None
    k8, _, ks = _quantize(k, cu, cu_t, batch, seqlen_k, max_k, rowwise=False, rot=rot)
    _, v8t, vs = _quantize(v, cu, cu_t, batch, seqlen_k, max_k, rowwise=False, rows=False, transposed=True)
    q8 = _new(q.shape, _FP8, q.device)   # the kernel's scratch for its quantized Q tiles
    tma = _tma(q.device, head_dim)
    rows_k = 0 if packed else seqlen_k
    scalars = (*_seq_strides(q, packed), *_seq_strides(q8, packed),
               *_seq_strides(k8, packed), *_t_strides(v8t, packed), *ks.stride()[:2], *_seq_strides(out, packed),
               *attn._lse_strides(heads, seqlen_q, total, packed), seqlen_q, seqlen_k, rows_k,
               0 if packed else kv_heads, heads // kv_heads,
               softmax_scale * LOG2E / (head_dim if rotate else 1), left, right)

    def args(bm, bn, use_tma, b0):
        descs = ((attn._descriptor(k8, packed, bn), _t_descriptor(v8t, packed, bn)) if use_tma else (None, None))
        return (q, q8, rot, k8, v8t, ks, vs, out, lse, cu, cu_t, *descs, *scalars, b0)

    consts = {**_consts(q, left, right, packed), "ROTATE": rotate}
    key = (attn._bucket(max_q, max_k), q.dtype, *consts.values())

    def triton_forward():
        attn._run(_FWD8, tma, key, batch, lambda bm, bn, nb: (_cdiv(max_q, bm), heads, nb), args, consts)
        return out, lse

    if not packed and not rotate and _gluon_forward_applies(q, k, softmax_scale, left, right):
        from . import fp8_attention_sm90   # imports this module

        def gluon_forward():
            return fp8_attention_sm90.forward(q, k8, v8t, ks, vs, right == 0, softmax_scale)
        if attn._gluon_wins("fp8_fwd", q, k, right, gluon_forward, triton_forward):
            return gluon_forward()
    return triton_forward()


def _gluon_forward_applies(q, k, softmax_scale, left, right) -> bool:
    """Whether fp8_attention_sm90's Gluon forward computes this dense, unrotated call (on the K/V passes'
    operands): no window, equal sequence lengths, a 16-bit dtype, head_dim 64 or 128, a positive scale. Like
    the bf16 Gluon kernels it is raced against the Triton kernel per key (attention._gluon_wins)."""
    if not (attn._GLUON and q.is_cuda and left < 0 and right <= 0 and q.shape[1] == k.shape[1]
            and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128) and softmax_scale > 0
            and q.shape[0] <= attn._MAX_GRID_YZ and q.shape[2] <= attn._MAX_GRID_YZ):
        return False
    from . import fp8_attention_sm90
    return fp8_attention_sm90.available(q.device)


def _fp8_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate):
    """dQ, dK, dV (contiguous, in the input dtype) of FP8 attention."""
    packed, batch, seqlen_q, seqlen_k, max_q, max_k, heads, kv_heads, head_dim = attn._common(q, k, cu_seqlens,
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
    cu_t = _t_offsets(cu) if packed else None
    lse2, delta, do8, do8t, dos, do_amax = _dout_passes(dout, out, lse, dlse, cu, cu_t, batch, seqlen_q, max_q,
                                                        heads, kv_heads, total)
    rot = rotation(head_dim, q.device) if rotate else None
    q8, q8t, qs = _quantize(q, cu, cu_t, batch, seqlen_q, max_q, rowwise=True, rot=rot, transposed=True)
    k8, k8t, ks = _quantize(k, cu, cu_t, batch, seqlen_k, max_k, rowwise=False, rot=rot, transposed=True)
    v8, _, vs = _quantize(v, cu, cu_t, batch, seqlen_k, max_k, rowwise=False)
    tma = _tma(q.device, head_dim)
    rows_q, rows_k = (0, 0) if packed else (seqlen_q, seqlen_k)
    group = heads // kv_heads
    tail = (softmax_scale * LOG2E / (head_dim if rotate else 1), softmax_scale / (head_dim if rotate else 1),
            left, right)
    lse_strides = attn._lse_strides(heads, seqlen_q, total, packed)
    consts = {**_consts(q, left, right, packed), "ROTATE": rotate}
    bucket = attn._bucket(max_q, max_k)

    dkdv_scalars = (*_seq_strides(q8, packed), *_t_strides(q8t, packed), *_seq_strides(k8, packed),
                    *ks.stride()[:2], *_seq_strides(dk, packed), *lse_strides,
                    seqlen_q, seqlen_k, rows_q, 0 if packed else heads, group, *tail)

    def dkdv_args(bm, bn, use_tma, b0):
        descs = ((attn._descriptor(q8, packed, bm), _t_descriptor(q8t, packed, bm),
                  attn._descriptor(do8, packed, bm), _t_descriptor(do8t, packed, bm))
                 if use_tma else (None,) * 4)
        return (q8, q8t, k8, v8, do8, do8t, qs, dos, ks, vs, dk, dv, lse2, delta, do_amax, rot, cu, cu_t,
                *descs, *dkdv_scalars, b0)

    dkdv_consts = {**consts, "GQA": group > 1}

    dq_scalars = (*_seq_strides(q8, packed), *_seq_strides(k8, packed), *_t_strides(k8t, packed),
                  *ks.stride()[:2], *_seq_strides(dq, packed), *lse_strides,
                  seqlen_q, seqlen_k, rows_k, 0 if packed else kv_heads, group, *tail)

    def dq_args(bm, bn, use_tma, b0):
        descs = ((attn._descriptor(k8, packed, bn), _t_descriptor(k8t, packed, bn), attn._descriptor(v8, packed, bn))
                 if use_tma else (None,) * 3)
        return (q8, do8, qs, dos, k8, k8t, v8, ks, vs, dq, lse2, delta, rot, cu, cu_t, *descs, *dq_scalars, b0)

    def triton_backward():
        attn._run(_DKDV8, tma, (bucket, q.dtype, *dkdv_consts.values()), batch,
                  lambda bm, bn, nb: (_cdiv(max_k, bn), kv_heads, nb), dkdv_args, dkdv_consts)
        attn._run(_DQ8, tma, (bucket, q.dtype, *consts.values()), batch,
                  lambda bm, bn, nb: (_cdiv(max_q, bm), heads, nb), dq_args, consts)

    if not packed and not rotate and dlse is None and _gluon_backward_applies(q, k, softmax_scale, left, right):
        from . import fp8_attention_sm90_bwd as fb
        prepared = fb.Prepared(lse2, delta, q8, q8t, qs, do8, do8t, dos, do_amax, k8, k8t, ks, v8, vs)

        def gluon_backward():
            fb.backward(dout, q, k, v, out, lse, right == 0, softmax_scale, prepared=prepared, grads=(dq, dk, dv))
        if attn._gluon_wins("fp8_bwd", q, k, right, gluon_backward, triton_backward):
            gluon_backward()
            return dq, dk, dv
    triton_backward()
    return dq, dk, dv


def _gluon_backward_applies(q, k, softmax_scale, left, right) -> bool:
    """Whether fp8_attention_sm90_bwd's Gluon kernels compute this backward (on the passes' operands, which
    they share with the Triton kernels): the forward's conditions (the caller checks dense, unrotated, no
    dLSE). Raced against the Triton kernels per key as the forward is."""
    if not _gluon_forward_applies(q, k, softmax_scale, left, right):
        return False
    from . import fp8_attention_sm90_bwd
    return fp8_attention_sm90_bwd.available(q.device)


# ----------------------------------------------------------------------------------------------
# Custom ops and autograd (as flash_attention's: eager calls skip the op dispatch; torch.compile sees ops)
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("tilewise::fp8_flash_attn_fwd", mutates_args=())
def _fp8_attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                     max_seqlen: int, softmax_scale: float, left: int, right: int, rotate: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp8_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate)


@_fp8_attn_fwd_op.register_fake
def _fp8_attn_fwd_fake(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate):
    heads = q.shape[-2]
    lse_shape = (heads, q.shape[0]) if cu_seqlens is not None else (q.shape[0], heads, q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tilewise::fp8_flash_attn_bwd", mutates_args=())
def _fp8_attn_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                     max_seqlen: int, softmax_scale: float, left: int, right: int, rotate: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fp8_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate)


@_fp8_attn_bwd_op.register_fake
def _fp8_attn_bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.args = (max_seqlen, softmax_scale, left, right, rotate)


def _backward(ctx, dout, dlse, impl):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = impl(dout, q, k, v, out, lse, dlse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


class Fp8FlashAttnFunction(torch.autograd.Function):
    """Eager forward and backward of FP8 attention (the launchers, no op dispatch)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate):
        out, lse = _fp8_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate)
        _setup_context(ctx, (q, k, v, cu_seqlens, max_seqlen, softmax_scale, left, right, rotate), (out, lse))
        ctx.set_materialize_grads(False)   # an unused LSE's gradient stays None, not a zero tensor to read
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse, _fp8_backward)


def _op_backward(ctx, dout, dlse):
    return _backward(ctx, dout, dlse, torch.ops.tilewise.fp8_flash_attn_bwd)


torch.library.register_autograd("tilewise::fp8_flash_attn_fwd", _op_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------

def _check_fp8_args(q, softmax_scale, rotate):
    name = "fp8_flash_attention"
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"{name}: softmax_scale={softmax_scale!r}; FP8 attention needs a positive scale")
    head_dim = q.shape[-1]
    if rotate and (head_dim < 32 or head_dim & (head_dim - 1)):
        raise ValueError(f"{name}: rotate=True needs head_dim a power of two >= 32 (a Hadamard rotation), "
                         f"got {head_dim}")


def fp8_flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=None, cu_seqlens=None,
                        max_seqlen=None, rotate=False, return_lse=False):
    """Attention with its six GEMMs on FP8 (E4M3) tensor cores; flash_attention's layout, masks and return
    values (out, or (out, lse)), softmax_scale > 0. rotate=True applies a random-sign Hadamard rotation to Q
    and K first (head_dim a power of two >= 32): more accurate when a few channels are large. Outputs and
    gradients are in the inputs' dtype; their error against exact attention is ~5% (module docstring).
    CPU tensors run fp8_attention_reference, the same quantization in PyTorch."""
    attn.check_attention_args(q, k, v, causal, window, cu_seqlens, max_seqlen, fn="fp8_flash_attention")
    _check_fp8_args(q, softmax_scale, rotate)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if use_triton(q) and q.dtype != torch.float64:
        left, right = attn._effective_window(causal, window)
        if cu_seqlens is not None and max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        args = (q, k, v, cu_seqlens, int(max_seqlen or 0), float(softmax_scale), left, right, bool(rotate))
        if torch.compiler.is_compiling():
            out, lse = torch.ops.tilewise.fp8_flash_attn_fwd(*args)
        else:
            out, lse = Fp8FlashAttnFunction.apply(*args)
        return (out, lse) if return_lse else out
    return fp8_attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                   cu_seqlens=cu_seqlens, rotate=rotate, return_lse=return_lse)


# ----------------------------------------------------------------------------------------------
# References: the kernels' quantization in PyTorch, and the naive per-tensor baseline
# ----------------------------------------------------------------------------------------------

def _through(x, y):
    """y in the forward, the identity's gradient in the backward (a straight-through estimator)."""
    return x + (y - x).detach()


def _e4m3_round(x):
    return x.to(_FP8).to(x.dtype)


def _scales_ref(amax):
    """_scales in PyTorch: (2^e, 2^-e) with 2^e the largest power of two keeping amax * 2^e <= 448."""
    amax = amax.float()
    bits = amax.view(torch.int32)
    above = ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    live = amax > _TINY
    e = torch.where(live, 8 - ((bits >> 23) - 127) - above, torch.zeros_like(bits)).float()
    return torch.where(live, torch.exp2(e), torch.zeros_like(amax)), torch.exp2(-e)


def quantize_rows_reference(x):
    """x (float32, (..., head_dim)) on the E4M3 grid with one scale per row, dequantized (straight-through)."""
    inv, scale = _scales_ref(x.detach().abs().amax(-1, keepdim=True))
    return _through(x, _e4m3_round(x * inv) * scale)


def quantize_blocks_reference(x, block=None):
    """x (float32, (batch, seqlen, heads, head_dim)) with one scale per `block` rows (KV_BLOCK) of each head,
    dequantized (straight-through)."""
    block = KV_BLOCK if block is None else block
    b, n, h, d = x.shape
    pad = -n % block
    xp = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).reshape(b, (n + pad) // block, block, h, d)
    inv, scale = _scales_ref(xp.detach().abs().amax(dim=(2, 4), keepdim=True))
    y = (_e4m3_round(xp * inv) * scale).reshape(b, n + pad, h, d)[:, :n]
    return _through(x, y)


def _fp8_dense(q, k, v, causal, softmax_scale, window, rotate, kv_block):
    """(B, S, H, D) FP8 attention in PyTorch, float32: the kernels' quantization of Q, K, V and P (P against
    the final row maximum, where the kernel uses the running one), straight-through gradients."""
    head_dim = q.shape[-1]
    if q.shape[1] == 0 or k.shape[1] == 0:  # no query or no key: output 0, lse -inf
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
        return torch.zeros_like(q) + 0 * (q.sum() + k.sum() + v.sum()), lse  # still a function of q, k, v
    qf, kf, vf = (t.float() for t in (q, k, v))
    scale = softmax_scale
    if rotate:
        r = rotation(head_dim, q.device).float()
        qf, kf = qf.to(torch.bfloat16).float() @ r, kf.to(torch.bfloat16).float() @ r
        scale = softmax_scale / head_dim
    q8 = quantize_rows_reference(qf)
    k8 = quantize_blocks_reference(kf, kv_block)
    v8 = quantize_blocks_reference(vf, kv_block)
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q8, k8, v8))
    if group > 1:
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    scores = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    keep = attn.attention_mask(q.shape[1], k.shape[1], causal, window, q.device)
    scores = scores.masked_fill(~keep, float("-inf"))
    m = scores.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    l = p.sum(-1, keepdim=True)
    p8 = _through(p, _e4m3_round(p * P_SCALE.value) / P_SCALE.value)
    out = torch.matmul(p8, vt) / torch.where(l > 0, l, torch.ones_like(l))
    lse = torch.where(l[..., 0] > 0, (m + torch.log(l))[..., 0], torch.full_like(l[..., 0], float("-inf")))
    return out.transpose(1, 2).to(q.dtype), lse


def _per_sequence(fn, q, k, v, cu_seqlens, return_lse):
    """Apply fn((1, S, H, D) tensors) -> (out, lse) per packed document, or once for a batch."""
    if cu_seqlens is None:
        out, lse = fn(q, k, v)
    else:
        outs, lses = [], []
        bounds = cu_seqlens.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            o, l = fn(q[None, s:e], k[None, s:e], v[None, s:e])
            outs.append(o[0])
            lses.append(l[0])
        out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=-1)
    return (out, lse) if return_lse else out


def fp8_attention_reference(q, k, v, *, causal=False, softmax_scale=None, window=None, cu_seqlens=None,
                            rotate=False, return_lse=False, kv_block=None):
    """fp8_flash_attention's forward in PyTorch (float32 math on the same E4M3 values: row-scaled Q, K/V
    scaled per kv_block rows, P * 448 rounded), with straight-through gradients: the gradients of exact
    attention at the quantized inputs, not the FP8 backward's."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    kv_block = KV_BLOCK if kv_block is None else kv_block
    return _per_sequence(lambda a, b, c: _fp8_dense(a, b, c, causal, softmax_scale, window, rotate, kv_block),
                         q, k, v, cu_seqlens, return_lse)


def naive_fp8_attention(q, k, v, *, causal=False, softmax_scale=None, window=None, cu_seqlens=None,
                        return_lse=False):
    """The accuracy baseline: Q, K, V each quantized to E4M3 with one scale for the whole tensor (its amax
    -> 448), then exact attention in float32 on the dequantized values (no P quantization), straight-through
    gradients. Only the inputs' rounding separates it from exact attention, so it is the most favourable
    per-tensor FP8 baseline there is."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])

    def per_tensor(x):
        x = x.float()
        inv, scale = _scales_ref(x.detach().abs().amax())
        return _through(x, _e4m3_round(x * inv) * scale)

    qd, kd, vd = (per_tensor(t) for t in (q, k, v))
    res = attn.attention_reference(qd, kd, vd, causal=causal, softmax_scale=softmax_scale, window=window,
                                   cu_seqlens=cu_seqlens, return_lse=return_lse)
    if return_lse:
        return res[0].to(q.dtype), res[1]
    return res.to(q.dtype)
