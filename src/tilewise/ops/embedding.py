"""Token + position embedding: x[b, t] = weight[idx[b, t]] + pos_weight[start + t], forward and backward.

Forward: one pass, each program gathering a tile of token rows and adding their position rows. Bytes: the
gathered rows read and the output written once (the position table, a few MB, stays in L2).
Backward: the position gradient is dx summed over the batch (torch's reduction); the token gradient is a
deterministic segment sum. The tokens are sorted once (torch.sort, stable), searchsorted gives each vocabulary
row its run of sorted positions, and one program per block of vocabulary rows sums its rows' runs in fp32 in
a fixed order, up to 16 rows a step, and writes every row of the dense gradient (zeros where a row has no
token). A frequent token's run is one program's serial steps: a token at 5% of GPT-2 124M's 32768 positions
takes 103 steps of 16 rows (bench/embedding.py times Zipf-distributed ids beside uniform ones). Bytes: dx read
once, the (vocab, width) gradient written once. torch's dense embedding backward takes a sort, two kernels
over the runs and a zero fill (GPT-2 124M on the H200 at d5d762d: 0.226 + 0.222 ms, bench/results/e2e.json),
and the unfused forward's broadcast add of the position rows is a kernel of its own (the profile's one
non-vectorized fp32 add, 0.081 ms).

The Triton path runs on CUDA tensors (or TILEWISE_OPS=triton) outside torch.compile, which traces the
reference (F.embedding and the add) and fuses it itself, when TRITON_EMBEDDING is on: off until the H200
measures it (bench/embedding.py, and the step: bench/e2e_ab.py --embedding triton). A token id outside the
vocabulary raises on CPU tensors; on the GPU (no host sync) its row is NaN, and it adds to no row of the
gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import use_triton
from .launch import cdiv

TRITON_EMBEDDING = False
ROWS_PER_PROGRAM = 8    # vocabulary rows a backward program writes
FWD_ELEMENTS = 4096     # a forward program's tile: this many elements over width rounded up to a power of 2
BWD_ELEMENTS = 16384    # a backward step's tile: at most 16 token rows


@triton.jit
def _embed_fwd_kernel(IDX, W, P, OUT, n_tokens, seqlen, start, vocab, width, HAS_POS: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token rows pid * ROWS ..; a token id outside [0, vocab) gets a row of NaN (no host sync to raise)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_tokens
    mask = row_ok[:, None] & (cols < width)[None, :]
    ids = tl.load(IDX + rows, mask=row_ok, other=0).to(tl.int64)
    valid = (ids >= 0) & (ids < vocab)
    x = tl.load(W + ids[:, None] * width + cols[None, :], mask=mask & valid[:, None], other=0.0).to(tl.float32)
    if HAS_POS:
        pos = (start + rows % seqlen).to(tl.int64)
        x += tl.load(P + pos[:, None] * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.where(valid[:, None], x, float("nan"))
    tl.store(OUT + rows.to(tl.int64)[:, None] * width + cols[None, :], x.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _embed_bwd_kernel(DX, ORDER, OFFSETS, DW, vocab, width, ROWS: tl.constexpr, RUN: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """Vocabulary rows pid * ROWS ..: row v sums dx at the sorted positions offsets[v] .. offsets[v + 1], RUN
    rows a step (a frequent token's run is many steps: each loads RUN rows at once)."""
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < width
    lanes = tl.arange(0, RUN)
    for r in range(ROWS):
        v = tl.program_id(0) * ROWS + r
        if v < vocab:
            begin = tl.load(OFFSETS + v)
            end = tl.load(OFFSETS + v + 1)
            acc = tl.zeros([BLOCK_D], tl.float32)
            for j in range(begin, end, RUN):
                pos = j + lanes
                ok = pos < end
                tokens = tl.load(ORDER + pos, mask=ok, other=0)
                rows = tl.load(DX + tokens[:, None] * width + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                               other=0.0)
                acc += tl.sum(rows.to(tl.float32), axis=0)
            tl.store(DW + v.to(tl.int64) * width + cols, acc.to(DW.dtype.element_ty), mask=col_ok)


def forward_meta(width: int) -> dict:
    """The forward kernel's constexprs and warps at this width: tiles of FWD_ELEMENTS, at most 32 a thread."""
    block = triton.next_power_of_2(width)
    return dict(ROWS=max(1, FWD_ELEMENTS // block), BLOCK_D=block, num_warps=max(1, min(8, block // 256)))


def backward_meta(width: int) -> dict:
    """The backward kernel's: steps of up to 16 rows over 8 warps (sm_90a builds without spills at widths 768
    and 2048: 87 and 101 registers; tests/ops/test_embedding.py builds them)."""
    block = triton.next_power_of_2(width)
    return dict(ROWS=ROWS_PER_PROGRAM, RUN=min(16, max(1, BWD_ELEMENTS // block)), BLOCK_D=block, num_warps=8)


def _forward(idx, weight, pos_weight, start):
    flat = idx.reshape(-1)
    out = torch.empty(*idx.shape, weight.shape[1], dtype=weight.dtype, device=weight.device)
    if flat.numel():
        meta = forward_meta(weight.shape[1])
        _embed_fwd_kernel[(cdiv(flat.numel(), meta["ROWS"]),)](
            flat, weight, weight if pos_weight is None else pos_weight, out, flat.numel(), idx.shape[-1], start,
            weight.shape[0], weight.shape[1], HAS_POS=pos_weight is not None, **meta)
    return out


def _token_grad(dx2, idx_flat, vocab, dtype):
    """The (vocab, width) gradient of weight[idx] given dx2 (tokens, width), in a fixed summation order."""
    dw = torch.empty(vocab, dx2.shape[1], dtype=dtype, device=dx2.device)
    sorted_ids, order = torch.sort(idx_flat, stable=True)
    offsets = torch.searchsorted(sorted_ids, torch.arange(vocab + 1, device=dx2.device, dtype=sorted_ids.dtype))
    _embed_bwd_kernel[(cdiv(vocab, ROWS_PER_PROGRAM),)](dx2, order, offsets, dw, vocab, dx2.shape[1],
                                                        **backward_meta(dx2.shape[1]))
    return dw


class Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx, weight, pos_weight, start):
        ctx.save_for_backward(idx)
        ctx.vocab, ctx.dtype, ctx.start = weight.shape[0], weight.dtype, start
        ctx.pos_rows = None if pos_weight is None else pos_weight.shape[0]
        return _forward(idx, weight, pos_weight, start)

    @staticmethod
    def backward(ctx, dx):
        (idx,) = ctx.saved_tensors
        dx2 = dx.reshape(-1, dx.shape[-1]).contiguous()
        dw = dp = None
        if ctx.needs_input_grad[1]:
            dw = _token_grad(dx2, idx.reshape(-1), ctx.vocab, ctx.dtype)
        if ctx.pos_rows is not None and ctx.needs_input_grad[2]:
            seqlen = idx.shape[-1]
            dp = torch.zeros(ctx.pos_rows, dx.shape[-1], dtype=ctx.dtype, device=dx.device)
            dp[ctx.start:ctx.start + seqlen] = dx.reshape(-1, seqlen, dx.shape[-1]).sum(0, dtype=torch.float32)
        return None, dw, dp, None


def embedding(idx, weight, pos_weight=None, start=0):
    """weight[idx] + pos_weight[start + t] for idx (..., T) of token ids, t the position along the last dim;
    without pos_weight, weight[idx]. Out: (..., T, width) in weight's dtype."""
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding: idx dtype {idx.dtype}; expected int32 or int64 token ids")
    if weight.dim() != 2:
        raise ValueError(f"embedding: weight shape {tuple(weight.shape)}; expected (vocab, width)")
    if idx.dim() == 0:
        raise ValueError("embedding: idx is a 0-dim tensor; expected token ids (..., T)")
    if pos_weight is not None:
        if pos_weight.dim() != 2 or pos_weight.shape[1] != weight.shape[1] or pos_weight.dtype != weight.dtype:
            raise ValueError(f"embedding: pos_weight {tuple(pos_weight.shape)} {pos_weight.dtype}; expected "
                             f"(positions, {weight.shape[1]}) {weight.dtype}")
        if start < 0 or start + idx.shape[-1] > pos_weight.shape[0]:
            raise ValueError(f"embedding: positions {start} .. {start + idx.shape[-1]} of a {pos_weight.shape[0]}-row "
                             f"position table")
    if (TRITON_EMBEDDING and use_triton(weight) and not torch.compiler.is_compiling()
            and weight.dtype != torch.float64):
        if not idx.is_cuda and idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < weight.shape[0]):
            raise ValueError(f"embedding: token ids {int(idx.min())} .. {int(idx.max())}; expected 0 .. "
                             f"{weight.shape[0] - 1}")
        return Embedding.apply(idx.contiguous(), weight.contiguous(), None if pos_weight is None
                               else pos_weight.contiguous(), start)
    return embedding_reference(idx, weight, pos_weight, start)


def embedding_reference(idx, weight, pos_weight=None, start=0):
    x = F.embedding(idx, weight)
    if pos_weight is not None:
        x = x + pos_weight[start:start + idx.shape[-1]]
    return x
