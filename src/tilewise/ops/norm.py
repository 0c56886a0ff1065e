"""Residual add + dropout + LayerNorm/RMSNorm: h = residual + dropout(x [+ x_bias]), y = norm(h) * weight (+ bias).

Forward, one pass over rows. A tile is BLOCK_M whole rows (several when rows are narrow); the program forms
h in fp32, rounds it to the residual dtype and stores it, takes the fp32 mean and rstd of that stored h,
and writes y. The dropout mask comes from Philox keyed by (seed, row, column), so the backward regenerates
it and nothing is stored. Bytes: read x, residual; write y, h; plus 8 bytes of statistics a row (weight
and bias once per program). Rows wider than _MAX_ROW go one per program by chunks: the first pass writes h
and merges chunk statistics (Chan's formula), the second reads h back (from L2) and writes y.

Backward, one pass over rows: with hhat = (h - mean) * rstd and g = dy * weight,
    dh = rstd * (g - mean(g) - hhat * mean(g * hhat)) + dh_in        (RMSNorm drops the mean(g) term)
    dresidual = dh,  dx = keep * dh / (1 - p),
dh_in being the gradient arriving at h, which the next block consumes. Each program sums dy * hhat and dy
per column in registers over its row tiles and writes one fp32 row of partial sums; one small kernel sums
those rows into dweight and dbias in the parameters' dtypes, with no atomics. With an x_bias (the bias of
the linear layer that made x, added here instead of in its GEMM) the programs also sum dx per column, a third
section of partial rows: dx_bias comes out of the pass that writes dx. Bytes: read dy, dh_in, h;
write dx (which is also dresidual when there is no dropout and the dtypes agree). Rows wider than
_MAX_ROW: a per-row kernel takes mean(g) and mean(g * hhat) first, then the columns are split across
programs.

The row-tile kernels are persistent: as many programs as the GPU keeps resident (the driver's occupancy
figure for the compiled kernel), so all run in one wave; each walks tiles pid, pid + programs, ... in a
loop software-pipelined over NUM_STAGES (4): the loads of the next two or three tiles go to shared
memory asynchronously while this one is reduced and stored, so every program keeps memory busy. (With 2 stages
Triton issues the next tile's copies only after this tile's stores, checked in the sm_90 PTX: each
program then waits a full memory latency per tile, which is what held the first version back.)

Host side: a forward+backward is three launches (forward, backward, the dweight/dbias sums) through
FastLauncher (ops/launch.py), and every constant of a launch (config, constexprs, program count a wave)
comes from one dict lookup of a launch plan; the row statistics (mean, rstd) share one buffer. Without
dropout, a call signature seen before skips even that: its call plan (_CALLS) allocates the outputs and
launches directly (Python per forward 26 -> 21 us, per forward+backward 102 -> 87 us on a 2-core CPU with
the launches stubbed). A whole add_dropout_norm call seen before, without dropout and with its tensors in
the kernels' layout already, is prepared (_PREPARED): it skips the argument checks, the layout work and
Function.apply's Python wrapper, and PreparedAddDropoutNorm runs the two call plans. The plans allocate by
new_empty on 0-element templates (no keyword parsing), the partial sums go to buffers kept per stream
and size (partial_rows), and Triton 3.6's launches enter at its C function (ops/launch.py). At 32768 x 1024 a
forward+backward took 240 us of host time with the backward on autograd's worker thread at 38b812c and 363
at 44495b4 (the same code on a slower host), against 379 at 9bc6c82 (bench/host_threads.py; hosts' speeds
differ by up to 2x between runs). Most of that was the Python node on autograd's worker thread, so a prepared
call now runs in a C++ node instead (norm_node.cpp, through ops/native.py; see _native_plan), which launches
the same compiled kernels: at b0be7fc bench/fused.py timed that 32768 x 1024 forward+backward at 0.165 ms
under do_bench against 0.159 on the GPU alone.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import use_triton
from . import native
from .launch import BoundLauncher, FastLauncher, cdiv as _cdiv, current_stream, direct_launches_allowed

NORM_KINDS = ("layernorm", "rmsnorm")
_MAX_ROW = 8192         # widest row the row-tile kernels hold in registers (forward and backward)


@triton.jit
def _keep_mask(seed, rows, col0, thr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dropout keep-mask of the tile rows x [col0, col0 + BLOCK_N); col0 is a multiple of 4.

    One Philox call per (row, group of 4 columns) gives four 32-bit words, one per column; an element is
    kept when the top 31 bits of its word are >= thr = p * 2**31. The mask depends only on (seed, row,
    column), never on the tiling, so the backward and keep_mask() reproduce it.
    """
    tl.static_assert(BLOCK_N % 4 == 0)
    quads = (col0 // 4 + tl.arange(0, BLOCK_N // 4)).to(tl.uint32)
    c0 = tl.broadcast_to(quads[None, :], (BLOCK_M, BLOCK_N // 4))
    c1 = tl.broadcast_to(rows.to(tl.uint32)[:, None], (BLOCK_M, BLOCK_N // 4))
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero, zero)
    # interleave so that column 4*q + k takes word k of quad q
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_M, BLOCK_N))
    return (words >> 1).to(tl.int32) >= thr


@triton.jit
def _load_inputs(X, R, rows, cols, mask, stride_x, stride_r, HAS_RES: tl.constexpr):
    """x and residual of a tile, as stored."""
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    r = x
    if HAS_RES:
        r = tl.load(R + r64 * stride_r + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    return x, r


@triton.jit
def _residual_sum(x, r, xb, rows, col0, seed, thr, scale, HAS_RES: tl.constexpr, HAS_XB: tl.constexpr,
                  HAS_DROP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """residual + dropout(x + x_bias) of one tile, in fp32 (xb: the bias row, fp32, (1, BLOCK_N))."""
    h = x.to(tl.float32)
    if HAS_XB:
        h += xb
    if HAS_DROP:
        h = tl.where(_keep_mask(seed, rows, col0, thr, BLOCK_M, BLOCK_N), h * scale, 0.0)
    if HAS_RES:
        h += r.to(tl.float32)
    return h


@triton.jit(do_not_specialize=["seed"])
def _fwd_kernel(X, R, W, B, XB, Y, H, Stats, M, N, stride_x, stride_r, eps, seed, thr, scale, n_tiles,
                HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_XB: tl.constexpr, IS_RMS: tl.constexpr,
                HAS_DROP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Tiles of BLOCK_M whole rows in registers; program pid takes tiles pid, pid + programs, ...
    Stats holds the rows' rstd (RMSNorm), or their mean and then their rstd (LayerNorm)."""
    pid = tl.program_id(0)
    Mean = Stats
    Rstd = Stats
    if not IS_RMS:
        Rstd = Stats + M
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    for tile in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        # x_bias read each tile (from L1) rather than held across the loop: held, the 2048-wide forward with
        # an fp32 residual stream spilled at its 64 registers
        xb = w
        if HAS_XB:
            xb = tl.load(XB + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x, r = _load_inputs(X, R, rows, cols, mask, stride_x, stride_r, HAS_RES)
        h = _residual_sum(x, r, xb, rows, 0, seed, thr, scale, HAS_RES, HAS_XB, HAS_DROP, BLOCK_M, BLOCK_N)
        h = h.to(H.dtype.element_ty)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(H + offs, h, mask=mask)
        h = h.to(tl.float32)            # the statistics are those of the stored h, as the backward sees it
        if IS_RMS:
            hc = h
        else:
            mean = tl.sum(h, axis=1) / N
            tl.store(Mean + rows, mean, mask=row_ok)
            hc = tl.where(mask, h - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(hc * hc, axis=1) / N + eps)
        tl.store(Rstd + rows, rstd, mask=row_ok)
        y = hc * rstd[:, None] * w
        if HAS_BIAS:
            y += b
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _fwd_chunked_kernel(X, R, W, B, XB, Y, H, Stats, M, N, stride_x, stride_r, eps, seed, thr, scale,
                        HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_XB: tl.constexpr, IS_RMS: tl.constexpr,
                        HAS_DROP: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One wide row per program, by chunks: h and its statistics first, then y from h read back."""
    row = tl.program_id(0)
    Mean = Stats
    Rstd = Stats
    if not IS_RMS:
        Rstd = Stats + M
    rows = row + tl.arange(0, 1)
    r64 = rows.to(tl.int64)[:, None]
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for col0 in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        cols = col0 + tl.arange(0, BLOCK_N)
        mask = (cols < N)[None, :]
        x, r = _load_inputs(X, R, rows, cols, mask, stride_x, stride_r, HAS_RES)
        xb = 0.0
        if HAS_XB:
            xb = tl.load(XB + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        h = _residual_sum(x, r, xb, rows, col0, seed, thr, scale, HAS_RES, HAS_XB, HAS_DROP, 1, BLOCK_N)
        h = h.to(H.dtype.element_ty)
        tl.store(H + r64 * N + cols[None, :], h, mask=mask)
        h = h.to(tl.float32)
        if IS_RMS:
            m2 += tl.sum(h * h)
        else:
            n_chunk = tl.minimum(N - col0, BLOCK_N).to(tl.float32)
            mean_chunk = tl.sum(h) / n_chunk
            dev = tl.where(mask, h - mean_chunk, 0.0)
            delta = mean_chunk - mean
            total = count + n_chunk
            mean += delta * (n_chunk / total)
            m2 += tl.sum(dev * dev) + delta * delta * (count * n_chunk / total)
            count = total
    rstd = tl.rsqrt(m2 / N + eps)
    if not IS_RMS:
        tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)
    tl.debug_barrier()      # this program's h stores are visible to all its threads
    for col0 in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        cols = col0 + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        mask = col_ok[None, :]
        h = tl.load(H + r64 * N + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = (h.to(tl.float32) - mean) * rstd * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + r64 * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_row_sums_kernel(DY, H, W, Stats, C, M, N, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    """For wide rows: C1 = mean(g * hhat), C2 = mean(g) of each row, by chunks (C holds C1, then C2)."""
    row = tl.program_id(0)
    Mean = Stats
    Rstd = Stats
    if not IS_RMS:
        Rstd = Stats + M
    C1 = C
    C2 = C + M
    base = row.to(tl.int64) * N
    rstd = tl.load(Rstd + row)
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(Mean + row)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    for col0 in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        cols = col0 + tl.arange(0, BLOCK_N)
        ok = cols < N
        dy = tl.load(DY + base + cols, mask=ok, other=0.0).to(tl.float32)
        h = tl.load(H + base + cols, mask=ok, other=0.0).to(tl.float32)
        g = dy * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        acc1 += g * tl.where(ok, (h - mean) * rstd, 0.0)
        acc2 += g
    tl.store(C1 + row, tl.sum(acc1) / N)
    if not IS_RMS:
        tl.store(C2 + row, tl.sum(acc2) / N)


@triton.jit
def _load_tile_grads(DY, DHIN, H, Mean, Rstd, C1, C2, rows, row_ok, cols, col_ok, N, HAS_DHIN: tl.constexpr,
                     IS_RMS: tl.constexpr, SPLIT: tl.constexpr):
    """What the backward reads of a tile: dy, dh_in and h as stored, and the rows' statistics."""
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    dy = tl.load(DY + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    h = tl.load(H + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    dhin = dy
    if HAS_DHIN:
        dhin = tl.load(DHIN + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
    mean = rstd
    c1 = rstd
    c2 = rstd
    if not IS_RMS:
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
    if SPLIT:
        c1 = tl.load(C1 + rows, mask=row_ok, other=0.0)
        if not IS_RMS:
            c2 = tl.load(C2 + rows, mask=row_ok, other=0.0)
    return dy, dhin, h, mean, rstd, c1, c2


@triton.jit
def _tile_sums(x, SUM_EACH_TILE: tl.constexpr):
    """What a backward accumulator adds of a tile: x, or with SUM_EACH_TILE its column sums (1, BLOCK_N)."""
    if SUM_EACH_TILE:
        x = tl.sum(x, axis=0, keep_dims=True)
    return x


@triton.jit(do_not_specialize=["seed"])
def _bwd_kernel(DY, DHIN, H, W, Stats, C, DX, DR, Part, M, N, n_tiles, seed, thr, scale,
                HAS_DHIN: tl.constexpr, HAS_DR: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_XB: tl.constexpr,
                IS_RMS: tl.constexpr, HAS_DROP: tl.constexpr, SPLIT: tl.constexpr, SUM_EACH_TILE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Row tiles pid, pid + programs, ...; columns [pid1 * BLOCK_N, +BLOCK_N) (the whole row unless SPLIT,
    where the row sums come precomputed in C: C1 then C2). Part: the programs' dweight partial rows, then
    their dbias rows (HAS_BIAS), then their dx column sums, the x_bias gradient (HAS_XB). SUM_EACH_TILE: the
    accumulators are column sums, folded each tile (for tiles wide enough that a thread holds every row of its
    columns, so the fold is in registers), instead of whole tiles summed at the end: 768-wide rows with an
    fp32 residual stream and an x_bias spilled 18 registers with whole-tile accumulators, none folded."""
    pid = tl.program_id(0)
    Mean = Stats
    Rstd = Stats
    if not IS_RMS:
        Rstd = Stats + M
    C1 = C
    C2 = C + M
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    ACC_ROWS: tl.constexpr = 1 if SUM_EACH_TILE else BLOCK_M
    dw = tl.zeros([ACC_ROWS, BLOCK_N], tl.float32)
    db = tl.zeros([ACC_ROWS, BLOCK_N], tl.float32)
    dxb = tl.zeros([ACC_ROWS, BLOCK_N], tl.float32)
    for tile in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        dy, dhin, h, mean, rstd, c1, c2 = _load_tile_grads(DY, DHIN, H, Mean, Rstd, C1, C2, rows, row_ok, cols,
                                                           col_ok, N, HAS_DHIN, IS_RMS, SPLIT)
        dy = dy.to(tl.float32)
        if IS_RMS:
            hhat = h.to(tl.float32) * rstd[:, None]
        else:
            hhat = tl.where(mask, (h.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        dw += _tile_sums(dy * hhat, SUM_EACH_TILE)
        if HAS_BIAS:
            db += _tile_sums(dy, SUM_EACH_TILE)
        g = dy * w
        if SPLIT:
            dh = g - hhat * c1[:, None]
            if not IS_RMS:
                dh -= c2[:, None]
        elif IS_RMS:
            dh = g - hhat * (tl.sum(g * hhat, axis=1) / N)[:, None]
        else:
            s1, s2 = tl.split(tl.sum(tl.join(g * hhat, g), axis=1))     # both row sums in one reduction
            dh = g - hhat * (s1 / N)[:, None] - (s2 / N)[:, None]
        dh *= rstd[:, None]
        if HAS_DHIN:
            dh += dhin.to(tl.float32)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_DR:
            tl.store(DR + offs, dh.to(DR.dtype.element_ty), mask=mask)
        if HAS_DROP:
            dh = tl.where(_keep_mask(seed, rows, col0, thr, BLOCK_M, BLOCK_N), dh * scale, 0.0)
        dx = dh.to(DX.dtype.element_ty)
        tl.store(DX + offs, dx, mask=mask)
        if HAS_XB:
            dxb += _tile_sums(dx.to(tl.float32), SUM_EACH_TILE)    # the stored dx (0 in rows past M)
    part = pid.to(tl.int64) * N + cols
    section = tl.num_programs(0).to(tl.int64) * N
    tl.store(Part + part, tl.sum(dw, axis=0), mask=col_ok)
    if HAS_BIAS:
        tl.store(Part + section + part, tl.sum(db, axis=0), mask=col_ok)
    if HAS_XB:
        xb_part = Part + section + part
        if HAS_BIAS:
            xb_part += section
        tl.store(xb_part, tl.sum(dxb, axis=0), mask=col_ok)


@triton.jit
def _sum_partials_kernel(Part, DW, DB, DXB, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    """Second stage of up to three column sums: program_id(1) k sums the k-th section of R rows of fp32
    partials (each section follows the one before) into DW, DB or DXB, in that output's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    which = tl.program_id(1)
    base = Part + which.to(tl.int64) * R * N
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for r0 in tl.range(0, R, BLOCK_R, num_stages=NUM_STAGES):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & col_ok[None, :]
        acc += tl.load(base + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(DW + cols, total.to(DW.dtype.element_ty), mask=col_ok)
    elif which == 1:
        tl.store(DB + cols, total.to(DB.dtype.element_ty), mask=col_ok)
    else:
        tl.store(DXB + cols, total.to(DXB.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["seed"])
def _keep_mask_kernel(Out, M, N, seed, thr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    keep = _keep_mask(seed, rows, col0, thr, BLOCK_M, BLOCK_N)
    tl.store(Out + rows.to(tl.int64)[:, None] * N + cols[None, :], keep.to(tl.int8), mask=mask)


# ---------------------------------------------------------------------------------------------- launchers

class Config(NamedTuple):
    """A launch shape: rows a tile, columns a tile (a chunk when chunked), warps, chunked or not, the
    software-pipeline stages of the tile loop (stages - 2 tiles' loads, at least, in flight while one is
    computed), and waves: the row-tile kernels launch `waves` times as many programs as the GPU keeps
    resident (1: persistent, all in one wave), or with waves=0 one program a tile."""
    block_m: int
    block_n: int
    num_warps: int
    chunked: bool = False
    num_stages: int = 4
    waves: int = 1


# The row-tile kernels' launch configs by row width: an exact width's entry, else its power of two's (at
# least 16); wider rows than _MAX_ROW go by chunks. Edit here to retune: `bench/fused.py --sweep` on the
# H200 prints its best configs in this format. The defaults keep 8 elements a thread (16-byte loads of
# bf16) in tiles of at least 1024 elements (several narrow rows), 4 pipeline stages. Their sm_90 builds
# (Triton 3.6, bf16 with bf16 weights, no dropout) use 48-53 registers in the LayerNorm forward, 40-62 in
# the RMSNorm one, 64-85 and 60-64 in the backwards, and do not spill: 768- and 1024-wide rows keep 7-12
# programs an SM, 8192-wide rows one of 32 warps; with two or three tiles in flight a program, that is
# 60-200 KB of loads in flight an SM. The 8192-wide backward takes 3 stages (4 spill a register or two with
# fp32 weights); with an x_bias (its fp32 column sums a third accumulator) 3 stages spill too (4 local
# loads/stores; bf16 tensors, Triton 3.6).
#   width: (forward,                 backward)
_CONFIGS = {
    16:     (Config(64, 16, 4),      Config(64, 16, 4)),
    32:     (Config(32, 32, 4),      Config(32, 32, 4)),
    64:     (Config(16, 64, 4),      Config(16, 64, 4)),
    128:    (Config(8, 128, 4),      Config(8, 128, 4)),
    256:    (Config(4, 256, 4),      Config(4, 256, 4)),
    512:    (Config(2, 512, 4),      Config(2, 512, 4)),
    # 1024, 4096, 8192: the H200 sweep's best LayerNorm launches (bench/fused.py --sweep, commit 968abd7; GPU-only
    # forward 3911, 3780, 3834 GB/s, 1.08-1.10x the previous entries; RMSNorm's own entries are below)
    # 768 (GPT-2): the sweep at commit 8741da7, GPU-only forward 3919 GB/s (1.08x the 1024 entry's)
    768:    (Config(2, 1024, 4, False, 2, 1),   Config(4, 1024, 4, False, 3, 1)),
    1024:   (Config(1, 1024, 4, False, 2, 1),   Config(2, 1024, 4, False, 3, 1)),
    2048:   (Config(1, 2048, 8),     Config(1, 2048, 8)),
    4096:   (Config(2, 4096, 32, False, 3, 1),  Config(1, 4096, 16)),
    8192:   (Config(1, 8192, 32, False, 3, 1),  Config(1, 8192, 32, num_stages=3)),
}
_RMS_CONFIGS = {                # RMSNorm's entries where they differ from _CONFIGS (same format, looked up first)
    # 768, 1024: the sweep at commit 8741da7, GPU-only forward 3939 and 4086 GB/s (1.08x, 1.10x the entries
    # before), backward 1.03x, 1.04x; at 1024 the forward takes one program a row (waves=0)
    768:    (Config(1, 1024, 4, False, 2, 1),   Config(2, 1024, 4, False, 4, 1)),
    1024:   (Config(1, 1024, 4, False, 4, 0),   Config(1, 1024, 4, False, 2, 1)),
    # 4096, 8192: the forward by 2048-wide chunks, the sweep at commit a26ae5c: GPU-only 4037 and 3962 GB/s
    # (1.09x, 1.06x the one-tile rows before; the second chunk pass re-reads h from L2)
    4096:   (Config(1, 2048, 8, True, 3, 1),   Config(1, 4096, 16)),
    8192:   (Config(1, 2048, 8, True, 3, 1),   Config(1, 8192, 32, num_stages=3)),
}
# The model's norms keep the residual stream h in fp32 (the fp32 embeddings start it) with bf16 x and y, fp32
# weight, bias and x_bias: 12 bytes an element forward, 16 backward (dresidual apart from dx), so the
# bf16-tuned entries above are not theirs. Entries for the widths the presets use, from
# `bench/fused.py --model-sweep` on the H200 at 3b0735f (both norm kinds share them). The backward at 768
# spills under Triton 3.9's compiler (3.6, the H200's, keeps it in registers).
#   width: (forward,                            backward)
_FP32_STREAM_CONFIGS = {
    # fwd 3745 GB/s (the bf16 table's entry, within 2% of the best); bwd 4007 GB/s, 1.15x that entry's
    768: (Config(2, 1024, 4, False, 2, 1), Config(4, 1024, 4, False, 4, 1)),
    # fwd: the bf16 entry (the sweep's best, 2 rows of 16 warps at 3800 GB/s, 1.08x alone, took the 1.3B
    # step's 49 forwards from 5.44 to 5.77 ms at 895a925, on a GPU some 3% slower that run); bwd 3631 GB/s, 1.03x
    2048: (Config(1, 2048, 8), Config(1, 2048, 4, False, 4, 1)),
}
_CHUNKED = Config(1, 2048, 8, chunked=True, num_stages=3)       # rows wider than _MAX_ROW, both passes
_SUM_EACH_TILE_FROM = 1024      # tiles this wide fold the backward's column sums each tile (see _bwd_kernel)


def _table_config(width: int, is_rms: bool, which: int, fp32_stream: bool = False) -> Config:
    """The entry for this exact width, else for its power of two; an fp32 residual stream's table first
    (exact widths only), then RMSNorm's own."""
    if width > _MAX_ROW:
        return _CHUNKED
    if fp32_stream and width in _FP32_STREAM_CONFIGS:
        return _FP32_STREAM_CONFIGS[width][which]
    block_n = max(16, triton.next_power_of_2(width))
    for table in (_RMS_CONFIGS, _CONFIGS) if is_rms else (_CONFIGS,):
        entry = table.get(width) or table.get(block_n)
        if entry:
            return entry[which]
    raise AssertionError(f"no launch config for width {width}")


def forward_config(width: int, is_rms: bool = False, fp32_stream: bool = False) -> Config:
    return _table_config(width, is_rms, 0, fp32_stream)


def backward_config(width: int, is_rms: bool = False, fp32_stream: bool = False) -> Config:
    return _table_config(width, is_rms, 1, fp32_stream)


_DEVICE: dict = {}
_RESIDENT: dict = {}
_RESIDENT_INFO: dict = {}       # how each count was found (for bench/fused.py)
_LIBCUDA: list = []


def _driver_occupancy(function, threads: int, shared: int) -> int:
    """Blocks of a loaded kernel one SM keeps resident, as the CUDA driver computes it; 0 if it cannot."""
    try:
        if not _LIBCUDA:
            _LIBCUDA.append(ctypes.CDLL("libcuda.so.1"))
        blocks = ctypes.c_int(0)
        err = _LIBCUDA[0].cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), ctypes.c_void_p(int(function)), ctypes.c_int(threads), ctypes.c_size_t(shared))
        return blocks.value if err == 0 else 0
    except Exception:       # noqa: BLE001 - no driver library or no handle: the caller estimates
        return 0


def programs_per_wave(kernel, args, meta, device: torch.device, n_col: int = 1) -> int:
    """Programs along grid axis 0 that the device keeps resident at once for this launch: one wave (a
    fraction of a second wave would double the time). The count comes from the driver's occupancy
    calculator for the compiled kernel; failing that, from its registers and shared memory. On CPU (the
    interpreter) 3, so the row loops are exercised. A torch.dtype may stand in for a tensor argument not
    allocated yet (Triton's warmup takes one). It compiles on first use and keys on every argument: callers
    keep its result in their launch plans."""
    if device.type != "cuda":
        return 3
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE:
        props = triton.runtime.driver.active.utils.get_device_properties(idx)
        _DEVICE[idx] = (torch.cuda.get_device_properties(idx).multi_processor_count,
                        props.get("max_num_regs", 65536), props.get("max_shared_mem", 232448))
    n_sm, regs, smem = _DEVICE[idx]
    key = (id(kernel), idx, tuple(sorted(meta.items())),
           tuple(a.dtype if isinstance(a, torch.Tensor) else a if isinstance(a, torch.dtype) else type(a)
                 for a in args))
    if key not in _RESIDENT:
        warps = meta["num_warps"]
        info = {"source": "assumed 64 registers"}
        try:
            compiled = kernel.warmup(*args, grid=(1,), **meta)
            compiled._init_handles()
            shared = compiled.metadata.shared
            info = {"n_regs": compiled.n_regs, "n_spills": getattr(compiled, "n_spills", None), "shared": shared,
                    "source": "driver"}
            per_sm = _driver_occupancy(compiled.function, 32 * warps, shared)
            if per_sm <= 0:
                info["source"] = "registers and shared memory"
                per_thread = -(-max(compiled.n_regs, 1) // 8) * 8     # registers are allocated 8 at a time
                per_sm = min(regs // (per_thread * 32 * warps), 64 // warps, 32, smem // (shared + 1024))
        except Exception:   # noqa: BLE001 - a Triton without warmup/n_regs: half the SM, never a second wave
            per_sm = 16 // warps
        _RESIDENT[key] = max(1, per_sm)
        _RESIDENT_INFO[key] = info
    return max(1, n_sm * _RESIDENT[key] // n_col)


def launch_programs(per_wave: int, waves: int, n_tiles: int) -> int:
    """Programs of a row-tile launch: `waves` waves of resident programs (0: one a tile), at most one a tile."""
    return n_tiles if waves <= 0 else max(1, min(n_tiles, waves * per_wave))


def _dropout_params(p: float) -> tuple[int, float]:
    """Integer threshold on 31 random bits, and the 1/(1-p) rescale."""
    return min(int(round(p * 2 ** 31)), 2 ** 31 - 1), 1.0 / (1.0 - p)


_fwd_launch = FastLauncher(_fwd_kernel)
_fwd_chunked_launch = FastLauncher(_fwd_chunked_kernel)
_bwd_launch = FastLauncher(_bwd_kernel)
_bwd_row_sums_launch = FastLauncher(_bwd_row_sums_kernel)
_sum_partials_launch = FastLauncher(_sum_partials_kernel)

# Launch plans: what a launch needs besides the row count (config, constexprs, programs a wave, dropout
# constants), computed once per (pass, device, width, flags, dtypes) so a call only looks it up.
_PLANS: dict = {}


class _Plan(NamedTuple):
    cfg: Config
    launch: BoundLauncher       # the kernel's launcher with the plan's constexprs and options
    per_wave: int
    thr: int
    scale: float


def _plan(launcher: FastLauncher, cfg: Config, flags: dict, p: float, args, device, n_col: int = 1) -> _Plan:
    meta = dict(flags, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    per_wave = 0
    if launcher is not _fwd_chunked_launch:
        meta["BLOCK_M"] = cfg.block_m
        per_wave = programs_per_wave(launcher.kernel, args, meta, device, n_col)
    return _Plan(cfg, launcher.bind(**meta), per_wave, *_dropout_params(p))


# Call plans: a call signature seen before (every tensor's shape, strides, dtype, 16-byte alignment, the
# device and the flags; no dropout, whose seed changes every call) launches its kernels directly
# (ops.launch.BoundLauncher.direct), skipping the keyed launch's per-call key and argument classes. False:
# a signature the direct launch does not cover (the interpreter), which keeps the keyed path.
_CALLS: dict = {}
_MAX_CALLS = 1024


def _forward_signature(x, residual, weight, bias, is_rms, eps, h_dtype, x_bias=None):
    return (True, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15,
            None if residual is None else (residual.stride(), residual.dtype, residual.data_ptr() & 15),
            weight.dtype, weight.data_ptr() & 15, None if bias is None else (bias.dtype, bias.data_ptr() & 15),
            is_rms, eps, h_dtype, None if x_bias is None else (x_bias.dtype, x_bias.data_ptr() & 15))


_EMPTY: dict = {}


def _like(dtype, device) -> Optional[torch.Tensor]:
    """A 0-element tensor of dtype on device (None for None): its new_empty(shape) allocates what
    torch.empty(shape, dtype=dtype, device=device) does in a fraction of the host time, without the
    keyword parsing (1.3 against 7.3 us on the H200's machine, calling thread, bench/host_threads.py)."""
    if dtype is None:
        return None
    t = _EMPTY.get((dtype, device))
    if t is None:
        t = _EMPTY[(dtype, device)] = torch.empty(0, dtype=dtype, device=device)
    return t


class _NativeSpec(NamedTuple):
    """A call plan's launches as norm_node.cpp takes them (native.launch_spec's, None where not covered), and
    for a backward its gradients' dtypes (dx, dresidual, dweight, dbias, dx_bias; None where absent or dx
    serves) and partial-sum size. Plain values: a spec that held the first call's tensors would keep its
    outputs, and through their grad_fn the whole autograd graph of that call, alive."""
    launches: tuple
    grad_dtypes: tuple = ()
    n_part: int = 0


def _launch_spec(bound: BoundLauncher, grid, args, slots):
    entry = bound.entry(args)
    return None if entry is None else native.launch_spec(entry, grid, args, slots)


def _forward_call(plan: _Plan, grid, args, h_dtype):
    """The forward of one call signature (see _CALLS): new outputs and one direct launch with the keyed
    launch's arguments but the tensors."""
    launch = plan.launch.planned(args)
    if not launch:
        return launch
    x, stats = args[0], args[7]
    shape, stats_shape, scalars = x.shape, stats.shape, args[8:]
    y_like, h_like, stats_like = _like(x.dtype, x.device), _like(h_dtype, x.device), _like(torch.float32, x.device)

    def forward(x, residual, weight, bias, x_bias=None):
        y = y_like.new_empty(shape)
        h = h_like.new_empty(shape)
        stats = stats_like.new_empty(stats_shape)
        launch(grid, x, x if residual is None else residual, weight, weight if bias is None else bias,
               weight if x_bias is None else x_bias, y, h, stats, *scalars)
        return y, h, stats
    forward.native_spec = _NativeSpec((_launch_spec(plan.launch, grid, args, args[:8]),))   # slots: x .. stats
    return forward


def _forward(x, residual, weight, bias, is_rms, eps, p, seed, h_dtype, cfg: Optional[Config] = None,
             x_bias=None):
    """x, residual: rows of N elements (see _rows), M of them; x_bias: (N,) added to x before the dropout.
    Returns y and h in x's shape, and the fp32 row statistics stats: rstd (1, M) for RMSNorm, mean and rstd
    (2, M) for LayerNorm."""
    sig = None
    if cfg is None and p == 0.0:
        sig = _forward_signature(x, residual, weight, bias, is_rms, eps, h_dtype, x_bias)
        call = _CALLS.get(sig)
        if call:
            return call(x, residual, weight, bias, x_bias)
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    dev = x.device
    y = torch.empty(x.shape, dtype=x.dtype, device=dev)
    h = torch.empty(x.shape, dtype=h_dtype, device=dev)
    stats = torch.empty((1 if is_rms else 2, M), dtype=torch.float32, device=dev)
    if M == 0:
        return y, h, stats
    r = x if residual is None else residual
    b = weight if bias is None else bias
    xb = weight if x_bias is None else x_bias
    args = (x, r, weight, b, xb, y, h, stats, M, N, _row_stride(x), _row_stride(r), eps, seed)
    key = (True, dev, N, is_rms, residual is None, bias is None, x_bias is None, p, x.dtype, r.dtype, h_dtype,
           weight.dtype, b.dtype, xb.dtype, cfg)
    plan = _PLANS.get(key)
    if plan is None:
        cfg = cfg or forward_config(N, is_rms, h_dtype == torch.float32)
        flags = dict(HAS_RES=residual is not None, HAS_BIAS=bias is not None, HAS_XB=x_bias is not None,
                     IS_RMS=is_rms, HAS_DROP=p > 0.0)
        launcher = _fwd_chunked_launch if cfg.chunked else _fwd_launch
        thr, scale = _dropout_params(p)
        plan = _PLANS[key] = _plan(launcher, cfg, flags, p, args + (thr, scale, _cdiv(M, cfg.block_m)), dev)
    cfg = plan.cfg
    if cfg.chunked:
        grid, args = (M,), args + (plan.thr, plan.scale)
    else:
        n_tiles = _cdiv(M, cfg.block_m)
        grid, args = (launch_programs(plan.per_wave, cfg.waves, n_tiles),), args + (plan.thr, plan.scale, n_tiles)
    plan.launch(grid, *args)
    if sig is not None and sig not in _CALLS and len(_CALLS) < _MAX_CALLS:
        call = _forward_call(plan, grid, args, h_dtype)
        if call is not None:
            _CALLS[sig] = call
    return y, h, stats


# the second stage's tiles: 128 partial rows x 16 columns (two 32-byte sectors a row) a step, 4 warps: 48
# column blocks (times dweight and dbias) at width 768, enough programs to spread over the SMs
_SUM_COLUMNS = 16
_sum_partials = _sum_partials_launch.bind(BLOCK_R=128, BLOCK_N=_SUM_COLUMNS, NUM_STAGES=3, num_warps=4,
                                          num_stages=3)


# The fp32 partial-sum rows of a backward live in buffers kept per (device, stream, size) instead of a new
# allocation a call (5.5 us of host time on the H200's machine). The kernels that write and read one run in
# the order of the stream they are launched on, so one stream's calls never overlap on it, and another
# stream gets its own. A buffer is never replaced or freed: a CUDA graph that captured a launch keeps its
# address. Past _MAX_PARTIALS sizes (rows that vary call by call) a call allocates its own.
_PARTIALS: dict = {}
_MAX_PARTIALS = 64


def partial_rows(device: torch.device, n: int) -> torch.Tensor:
    """A flat fp32 buffer of n elements for partial sums on the current stream of `device`."""
    key = (device, current_stream(device), n)
    buf = _PARTIALS.get(key)
    if buf is None:
        buf = torch.empty(n, dtype=torch.float32, device=device)
        if len(_PARTIALS) < _MAX_PARTIALS:
            _PARTIALS[key] = buf
    return buf


def _sum_outputs(dw, db, dxb) -> tuple:
    """_sum_partials_kernel's three outputs: the column sums present (dw, then db, then dxb) in their sections'
    order, the unused places filled with dw."""
    if db is None:
        return (dw, dw, dw) if dxb is None else (dw, dxb, dw)
    return (dw, db, dw if dxb is None else dxb)


def sum_partials(part, rows: int, dw, db=None, dxb=None):
    """dw (and db, dxb) = the column sums of the fp32 partial rows in part: (rows, N) for dw, then as many
    for each of the others present, contiguous from part's first element; each written in its own dtype by
    one small kernel."""
    N = dw.shape[0]
    _sum_partials((_cdiv(N, _SUM_COLUMNS), 1 + (db is not None) + (dxb is not None)), part, *_sum_outputs(dw, db, dxb),
                  rows, N)


def _backward_signature(dy, dh, h, weight, is_rms, x_dtype, res_dtype, bias_dtype, split_dr, xb_dtype=None):
    """A backward call's signature (see _CALLS) for contiguous dy and dh; h, stats and weight are the
    forward's (contiguous, h and stats aligned)."""
    return (False, h.shape, h.dtype, h.device, dy.dtype, dy.data_ptr() & 15,
            None if dh is None else (dh.dtype, dh.data_ptr() & 15), weight.dtype, weight.data_ptr() & 15,
            is_rms, x_dtype, res_dtype, bias_dtype, split_dr, xb_dtype)


def _separate_dr(p, x_dtype, res_dtype, split_dr) -> bool:
    """Whether the backward writes dresidual beside dx: under dropout or in another dtype it differs from
    dx; split_dr asks for it anyway (see _split_dr). Otherwise dx serves for both."""
    return res_dtype is not None and (res_dtype != x_dtype or p != 0.0 or split_dr)


def _split_dr(x, residual) -> bool:
    """Whether x and residual both need a gradient and one of them is a leaf. Their gradients are one
    tensor without dropout, which autograd copies (a read and a write of it) before accumulating it into a
    leaf's .grad while the other still holds it; the row kernel writes the second one itself instead (a
    write). Between two non-leaves (the blocks of a model) the shared tensor costs nothing."""
    return (residual is not None and x.requires_grad and residual.requires_grad
            and (x.grad_fn is None or residual.grad_fn is None))


def _backward(dy, dh, h, weight, stats, is_rms, p, seed, x_dtype, res_dtype, bias_dtype, split_dr=False,
              cfg: Optional[Config] = None, xb_dtype=None):
    """dy, dh (may be None): the gradients arriving at y and h, in h's shape. Returns dx (in h's shape);
    dresidual (None where dx serves for it too, or there is no residual); dweight, dbias (None without a
    bias) and dx_bias (None without one, xb_dtype None), in the parameters' dtypes."""
    dy = dy.contiguous()                      # the kernel walks rows of N contiguous elements
    dh = dh.contiguous() if dh is not None else None
    sig = None
    if cfg is None and p == 0.0:
        sig = _backward_signature(dy, dh, h, weight, is_rms, x_dtype, res_dtype, bias_dtype, split_dr, xb_dtype)
        call = _CALLS.get(sig)
        if call:
            return call(dy, dh, h, weight, stats)
    N = h.shape[-1]
    M = h.numel() // N if N else 0
    dev = h.device
    separate = _separate_dr(p, x_dtype, res_dtype, split_dr)
    dx = torch.empty(h.shape, dtype=x_dtype, device=dev)
    dr = torch.empty(h.shape, dtype=res_dtype, device=dev) if separate else None
    if M == 0:
        return dx, dr, torch.zeros_like(weight), *(None if t is None else torch.zeros(N, dtype=t, device=dev)
                                                   for t in (bias_dtype, xb_dtype))
    dw = torch.empty(N, dtype=weight.dtype, device=dev)
    db = torch.empty(N, dtype=bias_dtype, device=dev) if bias_dtype is not None else None
    dxb = torch.empty(N, dtype=xb_dtype, device=dev) if xb_dtype is not None else None
    key = (False, dev, N, is_rms, dh is None, separate, bias_dtype, xb_dtype, p, dy.dtype, h.dtype, weight.dtype,
           x_dtype, res_dtype, cfg)
    plan = _PLANS.get(key)
    if plan is None:
        cfg = cfg or backward_config(N, is_rms, h.dtype == torch.float32)
        n_col = _cdiv(N, cfg.block_n) if cfg.chunked else 1
        flags = dict(HAS_DHIN=dh is not None, HAS_DR=separate, HAS_BIAS=bias_dtype is not None,
                     HAS_XB=xb_dtype is not None, IS_RMS=is_rms, HAS_DROP=p > 0.0, SPLIT=cfg.chunked,
                     SUM_EACH_TILE=cfg.block_n >= _SUM_EACH_TILE_FROM)
        # the program count (from the compiled kernel) sizes the partial sums: their dtype stands in until then
        args = (dy, dy if dh is None else dh, h, weight, stats, stats, dx, dx if dr is None else dr, torch.float32,
                M, N, _cdiv(M, cfg.block_m), seed, *_dropout_params(p))
        plan = _PLANS[key] = _plan(_bwd_launch, cfg, flags, p, args, dev, n_col)
    cfg = plan.cfg
    n_tiles = _cdiv(M, cfg.block_m)
    n_col = _cdiv(N, cfg.block_n) if cfg.chunked else 1
    c = stats
    if cfg.chunked:
        c = torch.empty((2, M), dtype=torch.float32, device=dev)
        _bwd_row_sums_launch((M,), dy, h, weight, stats, c, M, N, IS_RMS=is_rms, BLOCK_N=cfg.block_n,
                             NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    programs = launch_programs(plan.per_wave, cfg.waves, n_tiles)
    sections = 1 + (db is not None) + (dxb is not None)
    part = partial_rows(dev, sections * programs * N)
    args = (dy, dy if dh is None else dh, h, weight, stats, c, dx, dx if dr is None else dr, part, M, N, n_tiles,
            seed, plan.thr, plan.scale)
    plan.launch((programs, n_col), *args)
    sum_partials(part, programs, dw, db, dxb)
    if sig is not None and not cfg.chunked and sig not in _CALLS and len(_CALLS) < _MAX_CALLS:
        call = _backward_call(plan, (programs, n_col), args, dw, dr, db, dxb)
        if call is not None:
            _CALLS[sig] = call
    return dx, dr, dw, db, dxb


def _backward_call(plan: _Plan, grid, args, dw, dr, db, dxb):
    """The backward of one call signature (see _CALLS): new gradients, the row kernel's and the partial
    sums' direct launches (keyed on the first call's args and dw, dr, db, dxb)."""
    dx, part, programs, N = args[6], args[8], grid[0], args[10]
    sections = 1 + (db is not None) + (dxb is not None)
    sums_args = (part, *_sum_outputs(dw, db, dxb), programs, N)
    launch = plan.launch.planned(args)
    sums = _sum_partials.planned(sums_args) if launch else launch
    if not sums:
        return sums
    shape, device = dx.shape, dx.device
    dx_like, dw_like = _like(dx.dtype, device), _like(dw.dtype, device)
    dr_like, db_like = _like(None if dr is None else dr.dtype, device), _like(None if db is None else db.dtype, device)
    dxb_like = _like(None if dxb is None else dxb.dtype, device)
    n_part, scalars, sums_grid = sections * programs * N, args[9:], (_cdiv(N, _SUM_COLUMNS), sections)

    def backward(dy, dh, h, weight, stats):
        # the row kernel first, dweight's allocations while it runs: under a host-bound caller the GPU
        # idles from the forward's end to this launch (norm_node.cpp keeps this order)
        dx = dx_like.new_empty(shape)
        dr = dr_like.new_empty(shape) if dr_like is not None else None
        part = partial_rows(device, n_part)
        launch(grid, dy, dy if dh is None else dh, h, weight, stats, stats, dx, dx if dr is None else dr, part,
               *scalars)
        dw = dw_like.new_empty((N,))
        db = db_like.new_empty((N,)) if db_like is not None else None
        dxb = dxb_like.new_empty((N,)) if dxb_like is not None else None
        sums(sums_grid, part, *_sum_outputs(dw, db, dxb), programs, N)
        return dx, dr, dw, db, dxb
    slots = (*args[:5], dx, args[7], part, dw, db, dxb)     # norm_node.cpp's: dy, dh, h, weight, stats, dx, dr, ..
    backward.native_spec = _NativeSpec(
        (_launch_spec(plan.launch, grid, args, slots), _launch_spec(_sum_partials, sums_grid, sums_args, slots)),
        tuple(None if t is None else t.dtype for t in (dx, dr, dw, db, dxb)), n_part)
    return backward


# The kernels as custom ops: torch.compile sees them as opaque nodes with known output shapes, instead of
# tracing (and breaking its graph on) the launchers. Outputs that the eager launchers leave out (None) are
# empty tensors here.

@torch.library.custom_op("tilewise::add_dropout_norm_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
            is_rms: bool, eps: float, p: float, seed: int, h_dtype: torch.dtype, x_bias: Optional[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(x, residual, weight, bias, is_rms, eps, p, seed, h_dtype, x_bias=x_bias)


@_fwd_op.register_fake
def _(x, residual, weight, bias, is_rms, eps, p, seed, h_dtype, x_bias):
    return (torch.empty_like(x), x.new_empty(x.shape, dtype=h_dtype),
            x.new_empty((1 if is_rms else 2, x.numel() // x.shape[-1] if x.shape[-1] else 0),
                        dtype=torch.float32))


@torch.library.custom_op("tilewise::add_dropout_norm_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor, weight: torch.Tensor, stats: torch.Tensor,
            is_rms: bool, p: float, seed: int, x_dtype: torch.dtype, res_dtype: Optional[torch.dtype],
            bias_dtype: Optional[torch.dtype], split_dr: bool, xb_dtype: Optional[torch.dtype]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dr, dw, db, dxb = _backward(dy, dh, h, weight, stats, is_rms, p, seed, x_dtype, res_dtype, bias_dtype,
                                    split_dr, xb_dtype=xb_dtype)
    return (dx, dr if dr is not None else h.new_empty(0, dtype=x_dtype), dw,
            db if db is not None else weight.new_empty(0), dxb if dxb is not None else weight.new_empty(0))


@_bwd_op.register_fake
def _(dy, dh, h, weight, stats, is_rms, p, seed, x_dtype, res_dtype, bias_dtype, split_dr, xb_dtype):
    separate = _separate_dr(p, x_dtype, res_dtype, split_dr)
    return (h.new_empty(h.shape, dtype=x_dtype),
            h.new_empty(h.shape, dtype=res_dtype) if separate else h.new_empty(0, dtype=x_dtype),
            torch.empty_like(weight),
            *(weight.new_empty(weight.shape, dtype=t) if t is not None else weight.new_empty(0)
              for t in (bias_dtype, xb_dtype)))


def _fwd(x, residual, weight, bias, is_rms, eps, p, seed, h_dtype, x_bias):
    """The custom op while torch.compile traces; the launcher itself otherwise, skipping the op dispatch."""
    if torch.compiler.is_compiling():
        return torch.ops.tilewise.add_dropout_norm_fwd(x, residual, weight, bias, is_rms, eps, p, seed, h_dtype,
                                                       x_bias)
    return _forward(x, residual, weight, bias, is_rms, eps, p, seed, h_dtype, x_bias=x_bias)


def _bwd(dy, dh, h, weight, stats, is_rms, p, seed, x_dtype, res_dtype, bias_dtype, split_dr, xb_dtype):
    if torch.compiler.is_compiling():
        return torch.ops.tilewise.add_dropout_norm_bwd(dy, dh, h, weight, stats, is_rms, p, seed, x_dtype,
                                                       res_dtype, bias_dtype, split_dr, xb_dtype)
    return _backward(dy, dh, h, weight, stats, is_rms, p, seed, x_dtype, res_dtype, bias_dtype, split_dr,
                     xb_dtype=xb_dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels read it, rows of N = t.shape[-1] elements at one row stride with unit column stride:
    itself when contiguous or 2-D with unit column stride (no view: each op is host time), else a 2-D copy."""
    if t.is_contiguous() or (t.dim() == 2 and t.stride(1) == 1):
        return t
    return t.reshape(-1, t.shape[-1]).contiguous()


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.dim() == 2 else t.shape[-1]   # contiguous when not 2-D (see _rows)


def _input_grads(meta, dx, dr, dw, db, dxb):
    """The gradients of x, residual, weight, bias and x_bias from the backward's dx, dr, dw, db, dxb."""
    is_rms, p, seed, x_dtype, res_dtype, bias_dtype, xb_dtype, shape, split_dr = meta
    if dx.shape != shape:
        dx = dx.view(shape)
    dres = None
    if res_dtype is not None:
        # without dropout, in one dtype and unsplit, dx is dresidual: the same tensor object goes to both
        # (separate views of one buffer would alias two leaves' .grad)
        dres = (dr if dr.shape == shape else dr.view(shape)) if _separate_dr(p, x_dtype, res_dtype, split_dr) \
            else dx
    return dx, dres, dw, (db if bias_dtype is not None else None), (dxb if xb_dtype is not None else None)


def _general_backward(meta, dy, dh, h, weight, stats):
    is_rms, p, seed, x_dtype, res_dtype, bias_dtype, xb_dtype, shape, split_dr = meta
    # a gradient may arrive as a strided view (a slice of a larger one); the launcher makes it contiguous
    dy = torch.zeros(h.shape, dtype=x_dtype, device=h.device) if dy is None else _rows(dy)
    grads = _bwd(dy, None if dh is None else _rows(dh), h, weight, stats, is_rms, p, seed, x_dtype, res_dtype,
                 bias_dtype, split_dr, xb_dtype)
    return _input_grads(meta, *grads)


class AddDropoutNorm(torch.autograd.Function):
    """Any layout, dropout, torch.compile: the inputs are brought to rows (see _rows) and the launchers
    plan each call."""
    @staticmethod
    def forward(ctx, x, residual, weight, bias, x_bias, is_rms, eps, p, seed, h_dtype):
        weight = weight.contiguous()
        y, h, stats = _fwd(_rows(x), None if residual is None else _rows(residual), weight,
                           None if bias is None else bias.contiguous(), is_rms, eps, p, seed, h_dtype,
                           None if x_bias is None else x_bias.contiguous())
        ctx.save_for_backward(h, weight, stats)
        ctx.set_materialize_grads(False)
        ctx.meta = _meta(x, residual, bias, x_bias, is_rms, p, seed)
        if y.shape != x.shape:   # a strided x was copied to 2-D rows
            y, h = y.view(x.shape), h.view(x.shape)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, stats = ctx.saved_tensors
        return _general_backward(ctx.meta, dy, dh, h, weight, stats) + (None,) * 5


def _meta(x, residual, bias, x_bias, is_rms, p, seed) -> tuple:
    """What the backward needs to know of a call besides the saved tensors (see _input_grads)."""
    return (is_rms, p, seed, x.dtype, None if residual is None else residual.dtype,
            None if bias is None else bias.dtype, None if x_bias is None else x_bias.dtype, x.shape,
            _split_dr(x, residual))


# Prepared calls: add_dropout_norm's signatures seen before without dropout, with every argument already in
# the kernels' layout, whose forward has a call plan (_CALLS). Their signature covers everything
# check_norm_args reads, so a repeat skips the checks, the layout work and Function.apply's Python wrapper
# (functorch's unwrapping of dead wrappers, which never have a signature: their data_ptr raises), and runs
# PreparedAddDropoutNorm: the forward's call plan, then the backward's of the gradients' layout.
_PREPARED: dict = {}


class _Prepared(NamedTuple):
    forward: object         # the forward's call plan
    backward: dict          # the backward's call plans by the gradients' layout (see _grad_layout)
    meta: tuple             # AddDropoutNorm's ctx.meta
    native: object = None   # the call's norm_node.cpp plan (see _native_plan), used instead where allowed


def _param_signature(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def _op_signature(x, residual, weight, bias, kind, eps, residual_dtype, x_bias=None):
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15,
            None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device,
                                           residual.data_ptr() & 15),
            _param_signature(weight), _param_signature(bias), _param_signature(x_bias),
            kind, eps, residual_dtype, _split_dr(x, residual))


def _grad_layout(dy, dh):
    return dy.stride(), dy.dtype, dy.data_ptr() & 15, None if dh is None else (dh.stride(), dh.dtype,
                                                                                dh.data_ptr() & 15)


class PreparedAddDropoutNorm(torch.autograd.Function):
    """A prepared call (see _PREPARED): the inputs are the kernels' rows already."""
    @staticmethod
    def forward(ctx, x, residual, weight, bias, x_bias, prepared):
        y, h, stats = prepared.forward(x, residual, weight, bias, x_bias)
        ctx.save_for_backward(h, weight, stats)
        ctx.set_materialize_grads(False)
        ctx.prepared = prepared
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, stats = ctx.saved_tensors
        prepared = ctx.prepared
        layout = None
        if dy is not None:
            layout = _grad_layout(dy, dh)
            call = prepared.backward.get(layout)
            if call is not None:
                return _input_grads(prepared.meta, *call(dy, dh, h, weight, stats)) + (None,)
        grads = _general_backward(prepared.meta, dy, dh, h, weight, stats)
        if layout is not None and dy.is_contiguous() and (dh is None or dh.is_contiguous()):
            is_rms, _, _, x_dtype, res_dtype, bias_dtype, xb_dtype, _, split_dr = prepared.meta
            call = _CALLS.get(_backward_signature(dy, dh, h, weight, is_rms, x_dtype, res_dtype, bias_dtype,
                                                  split_dr, xb_dtype))
            if call and len(prepared.backward) < 16:
                prepared.backward[layout] = call
        return grads + (None,)


try:        # the C apply under Function.apply's Python wrapper (see _PREPARED)
    _apply_prepared = torch._C._FunctionBase.__dict__["apply"].__get__(None, PreparedAddDropoutNorm)
except (AttributeError, KeyError, TypeError):     # pragma: no cover - another torch: its own apply
    _apply_prepared = PreparedAddDropoutNorm.apply


def _prepare(sig, x, residual, weight, bias, x_bias, is_rms, eps, h_dtype):
    """Keep a prepared call for sig after a general call without dropout, where the inputs were the kernels'
    layout and the forward got a call plan."""
    if len(_PREPARED) >= _MAX_CALLS or _rows(x) is not x or (residual is not None and _rows(residual) is not
                                                            residual):
        return
    if not all(t is None or t.is_contiguous() for t in (weight, bias, x_bias)):
        return
    call = _CALLS.get(_forward_signature(x, residual, weight, bias, is_rms, eps, h_dtype, x_bias))
    if call:
        meta = _meta(x, residual, bias, x_bias, is_rms, 0.0, 0)
        _PREPARED[sig] = _Prepared(call, {}, meta, _native_plan(call, meta, x, residual, bias, x_bias, h_dtype))


# The C++ node (norm_node.cpp through ops/native.py): a prepared call's forward and, for the gradient layouts
# it has seen, its backward, with no Python on autograd's worker thread. A plan starts with the forward's
# launch; its Python fallback (the general backward) hands it the backward's launches for each gradient
# layout once that layout has a call plan, so from the third call on a call runs in C++ end to end.

def _native_plan(call, meta, x, residual, bias, x_bias, h_dtype):
    """A norm_node.cpp plan for a prepared call, or None (not CUDA, the extension unavailable, or a launch
    it does not cover)."""
    spec = getattr(call, "native_spec", None)
    if x.device.type != "cuda" or spec is None or spec.launches[0] is None or not native.launch_address():
        return None
    ext = native.norm_extension()
    if ext is None:
        return None
    learned = []

    def backward(dy, dh, h, weight, stats):
        grads = _general_backward(meta, dy, dh, h, weight, stats)
        if learned:
            _learn_native_backward(learned[0], meta, dy, dh, h, weight)
        return grads

    width = x.shape[-1]
    stats_shape = [1 if meta[0] else 2, x.numel() // width]
    plan = ext.NormPlan(native.launch_address(), backward, list(x.shape), stats_shape, _like(x.dtype, x.device),
                        _like(h_dtype, x.device), _like(torch.float32, x.device), residual is not None,
                        bias is not None, x_bias is not None)
    plan.set_forward(*spec.launches[0])
    learned.append(plan)
    return native.keep(plan)


def _learn_native_backward(plan, meta, dy, dh, h, weight):
    """Give plan the backward's launches for contiguous gradients like dy, dh once they have a call plan."""
    if dy is None or plan.has_backward(dh is not None) or not dy.is_contiguous() or \
            (dh is not None and not dh.is_contiguous()):
        return
    is_rms, _, _, x_dtype, res_dtype, bias_dtype, xb_dtype, _, split_dr = meta
    call = _CALLS.get(_backward_signature(dy, dh, h, weight, is_rms, x_dtype, res_dtype, bias_dtype, split_dr,
                                          xb_dtype))
    spec = getattr(call, "native_spec", None) if call else None
    if spec is None or None in spec.launches:
        return
    dev = h.device
    plan.set_grads(*(_like(t, dev) for t in spec.grad_dtypes))
    rows, sums = spec.launches
    plan.set_backward(dh is not None, dy.dtype, dy.data_ptr() & 15, None if dh is None else dh.dtype,
                      0 if dh is None else dh.data_ptr() & 15, *rows, *sums, partial_rows(dev, spec.n_part),
                      current_stream(dev) or 0)      # the partial sums' buffer of the current stream


def keep_mask(n_rows: int, width: int, p: float, seed: int, device="cpu") -> torch.Tensor:
    """The kernels' dropout keep-mask (bool, (n_rows, width)) for a given seed: element (i, j) is kept
    when add_dropout_norm's x is viewed as (n_rows, width) rows. For tests and A/B runs with the reference."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"keep_mask: p={p}; expected 0 <= p < 1")
    out = torch.empty((n_rows, width), dtype=torch.int8, device=device)
    if out.numel():
        thr, _ = _dropout_params(p)
        grid = (_cdiv(n_rows, 16), _cdiv(width, 256))
        _keep_mask_kernel[grid](out, n_rows, width, int(seed), thr, BLOCK_M=16, BLOCK_N=256, num_warps=4)
    return out.bool()


# --------------------------------------------------------------------------------------------- public op

def check_norm_args(x, residual, weight, bias, kind, dropout_p, residual_dtype, x_bias=None):
    """Raise ValueError/TypeError naming what is wrong with the arguments of add_dropout_norm."""
    for name, t in (("x", x), ("weight", weight), ("residual", residual), ("bias", bias), ("x_bias", x_bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"add_dropout_norm: {name} is a {type(t).__name__}; expected a torch.Tensor")
    if kind not in NORM_KINDS:
        raise ValueError(f"add_dropout_norm: kind={kind!r}; expected one of {NORM_KINDS}")
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    if x.dtype not in floats:
        raise ValueError(f"add_dropout_norm: x dtype {x.dtype} is not supported; use bf16, fp16 or fp32")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"add_dropout_norm: x shape {tuple(x.shape)}; expected (..., width) with width >= 1")
    width = x.shape[-1]
    if width > 65536:
        raise ValueError(f"add_dropout_norm: row width {width} is over the supported 65536")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_dropout_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if weight.shape != (width,):
        raise ValueError(f"add_dropout_norm: weight shape {tuple(weight.shape)}; expected ({width},)")
    for name, t in (("bias", bias), ("x_bias", x_bias)):
        if t is not None and t.shape != (width,):
            raise ValueError(f"add_dropout_norm: {name} shape {tuple(t.shape)}; expected ({width},)")
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if t is not None and t.dtype not in floats:
            raise ValueError(f"add_dropout_norm: {name} dtype {t.dtype}; expected a floating dtype")
        if t is not None and t.device != x.device:
            raise ValueError(f"add_dropout_norm: {name} is on {t.device} but x is on {x.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"add_dropout_norm: dropout_p={dropout_p}; expected 0 <= p < 1")
    if residual_dtype is not None and residual_dtype not in (torch.float32, x.dtype):
        raise ValueError(f"add_dropout_norm: residual_dtype={residual_dtype}; expected None, torch.float32 "
                         f"or x's dtype")


def add_dropout_norm(x, residual, weight, bias=None, *, x_bias=None, kind="layernorm", eps=1e-5, dropout_p=0.0,
                     training=True, seed=None, residual_dtype=None):
    """Returns (y, h): h = residual + dropout(x + x_bias) (residual, x_bias may be None), y = norm(h) * weight
    + bias.

    x_bias is the bias of the linear layer that made x, added here instead of in that layer's GEMM so its
    gradient (the column sums of dx) comes out of this backward's pass over dx instead of another one.
    h is kept in residual_dtype (default: residual's dtype, else x's), y in x's dtype. seed=None draws one
    from torch's CPU generator (no device sync); the same seed gives the same mask.
    """
    sig = None
    if not (dropout_p and training) and not torch.compiler.is_compiling():
        try:
            sig = _op_signature(x, residual, weight, bias, kind, eps, residual_dtype, x_bias)
            prepared = _PREPARED.get(sig)
        except (AttributeError, TypeError, RuntimeError):       # not tensors, or no storage: the checks say
            sig = prepared = None
        if prepared is not None and use_triton(x):
            if prepared.native is not None and native.enabled() and direct_launches_allowed():
                return prepared.native.apply(x, residual, weight, bias, x_bias)
            return _apply_prepared(x, residual, weight, bias, x_bias, prepared)
    check_norm_args(x, residual, weight, bias, kind, dropout_p, residual_dtype, x_bias)
    p = float(dropout_p) if training else 0.0
    if use_triton(x) and x.dtype != torch.float64:      # float64 stays on the reference
        if residual_dtype is None:
            residual_dtype = residual.dtype if residual is not None else x.dtype
        if p == 0.0:
            seed = 0
        elif seed is None:
            seed = int(torch.randint(0, 2 ** 31 - 1, (1,), device="cpu").item())     # host RNG: no device sync
        is_rms = kind == "rmsnorm"
        out = AddDropoutNorm.apply(x, residual, weight, bias, x_bias, is_rms, float(eps), p, int(seed),
                                   residual_dtype)
        if sig is not None and p == 0.0:
            _prepare(sig, x, residual, weight, bias, x_bias, is_rms, float(eps), residual_dtype)
        return out
    return add_dropout_norm_reference(x, residual, weight, bias, x_bias=x_bias, kind=kind, eps=eps, dropout_p=p,
                                      seed=seed, residual_dtype=residual_dtype)


def add_dropout_norm_reference(x, residual, weight, bias=None, *, x_bias=None, kind="layernorm", eps=1e-5,
                               dropout_p=0.0, seed=None, residual_dtype=None, keep_mask=None):
    """Plain PyTorch. keep_mask (bool, x's shape) replaces the random mask, to compare with a kernel's.
    x + x_bias is formed in fp32 at least, as the kernels form it."""
    if residual_dtype is None:
        residual_dtype = residual.dtype if residual is not None else x.dtype
    dropped = x
    if x_bias is not None:
        wide = torch.promote_types(x.dtype, torch.float32)
        dropped = x.to(wide) + x_bias.to(wide)
    if dropout_p > 0.0:
        if keep_mask is None:
            gen = None
            if seed is not None:
                gen = torch.Generator(device=x.device).manual_seed(int(seed))
            keep_mask = torch.rand(x.shape, device=x.device, generator=gen) >= dropout_p
        dropped = dropped * keep_mask / (1.0 - dropout_p)
    h = dropped.to(residual_dtype)
    if residual is not None:
        h = h + residual.to(residual_dtype)
    hf = h.float() if h.dtype in (torch.float16, torch.bfloat16) else h
    w = weight.to(hf.dtype)
    b = bias.to(hf.dtype) if bias is not None else None
    if kind == "layernorm":
        y = F.layer_norm(hf, (hf.shape[-1],), w, b, eps)
    else:
        y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w
        if b is not None:
            y = y + b
    return y.to(x.dtype), h
