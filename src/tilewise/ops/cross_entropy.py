"""Cross-entropy over a vocabulary, plain and fused with the output projection.

cross_entropy: Triton programs over rows. The forward takes a row's logsumexp (an online max and sum of
exponentials over BLOCK_V slices) and writes loss = lse - x[target] (+ z_loss * lse^2) and lse, one float
each per row. The backward writes dlogits = (softmax - onehot + 2 * z_loss * lse * softmax) * scale, scale
being the upstream gradient over the number of counted targets. A row no wider than BLOCK_V is loaded once
a launch and held in registers (WHOLE_ROW), so a launch doing both passes reads it once; a wider row is
streamed, twice by such a launch (the second read partly from L2). Bytes of the plain op: the forward
reads the logits once; the backward reads them once and writes the gradient once.
How the rows are launched (slice width, warps, one program per row or a few per SM striding over the
rows) is a RowConfig, picked by bench/cross_entropy.py --sweep.

linear_cross_entropy: the (tokens, vocab) logits never exist. Rows go in equal chunks of at most
CHUNK_BYTES of logits (up to CHUNK_BYTES_MAX on a GPU where fewer, larger chunks fill its SMs:
default_chunk_rows); for each chunk cuBLAS writes the chunk's logits in the input dtype, one launch of the
row kernel does the forward and the backward of every row and overwrites the logits with their gradient,
then grad_hidden[chunk] = dlogits @ W goes straight into its slice and grad_W += dlogits.T @ hidden[chunk]
is one GEMM with beta=1 into a float32 accumulator. All of it runs in the forward, stream-ordered, without
a host sync; the backward multiplies by the upstream scalar, rounding grad_W to the weight's dtype in the
same op (once, as the unfused path does, however many chunks). reduction="none" has a gradient per row,
unknown in the forward, so its backward recomputes the chunk logits instead. Under autocast an fp32 weight
(the model's tied embedding) is cast inside the op, so its gradient leaves the fp32 accumulator in fp32:
autocast's own cast would round it to bf16 and its backward widen it back, one more pass over vocab x width.

ignore_index targets count neither in the loss nor in the mean and get zero gradient. z_loss adds
z_loss * lse^2 per token (PaLM's auxiliary loss that keeps the softmax normalizer near 1). A target outside
[0, vocab) that is not ignore_index raises on CPU tensors; on the GPU (no host sync) its loss is NaN.
The kernels take bf16, fp16 and fp32 and compute in fp32; float64 runs the reference on every device.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import cublaslt
from .dispatch import use_triton
from .launch import FastLauncher, cdiv
from .linear import fp32_out_mm_ok

REDUCTIONS = ("mean", "sum", "none")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)
# Logits of one row chunk in linear_cross_entropy. On the H200 at 16384 x 768 x 50304 bf16, 4096-row chunks
# (412 MB) took 7.34 ms and 13.5% of the unfused path's peak memory, 2048-row chunks 7.76 ms and 9.4%.
CHUNK_BYTES = 512 << 20
# A chunk may grow up to CHUNK_BYTES_MAX when the CHUNK_BYTES split leaves the chunks' grad_hidden GEMM
# (chunk rows x width) idling part of its last wave of GEMM_TILE output tiles over the SMs, as the fewest
# chunks that fill at least WAVE_FILL of their waves (see default_chunk_rows).
CHUNK_BYTES_MAX = 1280 << 20
GEMM_TILE = (256, 128)
WAVE_FILL = 0.9
WHOLE_ROW_MAX = 4096  # default RowConfig: rows up to this wide are read once (WHOLE_ROW)


# ----------------------------------------------------------------------------------------------- kernels

@triton.jit
def _round_to_bf16(x):
    """x (fp32) rounded to bf16, nearest even, by integer ops: the interpreter's own cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _row_max(x):
    """The max of a row held in registers, as fp32, computed without widening a 16-bit row: tl.max would,
    and that fp32 copy would stay live into the backward (spilling at vocab 50304). bf16 goes through
    order-preserving integer keys (the interpreter compares bf16 values wrongly)."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True)
        low15 = tl.full([], 0x7FFF, tl.int16)
        top = tl.reduce(bits ^ ((bits >> 15) & low15), 0, _maximum)
        top = top ^ ((top >> 15) & low15)
        return top.to(tl.bfloat16, bitcast=True).to(tl.float32)
    elif x.dtype == tl.float16:
        return tl.reduce(x, 0, _maximum).to(tl.float32)
    else:
        return tl.max(x.to(tl.float32), axis=0)


@triton.jit
def _widen(x):
    """x to fp32; bf16 by integer ops, a conversion the compiler does not merge with x.to(tl.float32)
    (merged, one fp32 copy of the row would stay live from the forward into the backward)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _dlogits(x, cols, target, lse, scale, z_coef, HAS_Z: tl.constexpr, OUT_BF16: tl.constexpr):
    """The gradient of one slice of a row, fp32 in; rounded to bf16 when the output is bf16."""
    p = tl.exp(x - lse)
    g = (p - tl.where(cols == target, 1.0, 0.0)) * scale
    if HAS_Z:
        g += p * z_coef
    if OUT_BF16:
        g = _round_to_bf16(g)
    return g


@triton.jit
def _ce_row(row, logits_ptr, stride_logits, grad_ptr, stride_grad, target_ptr, loss_ptr, lse_ptr, scale_ptr,
            stride_scale, n_vocab, ignore_index, z_loss, FORWARD: tl.constexpr, BACKWARD: tl.constexpr,
            HAS_Z: tl.constexpr, OUT_BF16: tl.constexpr, WHOLE_ROW: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row (int64 index). FORWARD: loss and lse. BACKWARD: dlogits (may be written over the logits)."""
    cols0 = tl.arange(0, BLOCK_V)
    x_row = logits_ptr + row * stride_logits
    target = tl.load(target_ptr + row).to(tl.int64)
    valid = target != ignore_index
    out_of_range = (target < 0) | (target >= n_vocab)
    counted = valid & (not out_of_range)
    # The column to subtract one at, as int32 (cols are int32: an int64 compare doubles their registers).
    hot = tl.where(counted, target, -1).to(tl.int32)
    if FORWARD:
        # Read x[target] first: when the gradient overwrites the logits, the cross-warp reductions below
        # (barriers) order this read before any warp's first store.
        x_t = tl.load(x_row + target, mask=counted, other=0.0).to(tl.float32)
    if WHOLE_ROW:
        # Kept in the input dtype between the passes, widened where used: half the registers of fp32.
        x_all = tl.load(x_row + cols0, mask=cols0 < n_vocab, other=float("-inf"))

    if FORWARD:
        # -1e30, not -inf, so that a row (or slice) of -inf logits cannot make exp(-inf - -inf) = NaN.
        if WHOLE_ROW:
            # The sum of exponentials widens the row in a conversion that dies as it is summed.
            m = tl.maximum(_row_max(x_all), -1.0e30)
            s = tl.sum(tl.exp(x_all.to(tl.float32) - m), axis=0)
        else:
            m = tl.full([], -1.0e30, tl.float32)
            s = tl.full([], 0.0, tl.float32)
            for start in range(0, n_vocab, BLOCK_V):
                cols = start + cols0
                x = tl.load(x_row + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
                m = m_new
        lse = m + tl.log(s)
        loss = lse - x_t
        if HAS_Z:
            loss += z_loss * lse * lse
        loss = tl.where(valid, loss, 0.0)
        loss = tl.where(valid & out_of_range, float("nan"), loss)
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
    else:
        lse = tl.load(lse_ptr + row)

    if BACKWARD:
        scale = tl.load(scale_ptr + row * stride_scale).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)
        z_coef = 2.0 * z_loss * lse * scale
        g_row = grad_ptr + row * stride_grad
        if WHOLE_ROW:
            g = _dlogits(_widen(x_all), cols0, hot, lse, scale, z_coef, HAS_Z, OUT_BF16)
            tl.store(g_row + cols0, g.to(grad_ptr.dtype.element_ty), mask=cols0 < n_vocab)
        else:
            for start in range(0, n_vocab, BLOCK_V):
                cols = start + cols0
                mask = cols < n_vocab
                x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
                g = _dlogits(x, cols, hot, lse, scale, z_coef, HAS_Z, OUT_BF16)
                tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ce_row_kernel(logits_ptr, stride_logits, grad_ptr, stride_grad, target_ptr, loss_ptr, lse_ptr,
                   scale_ptr, stride_scale, n_rows, n_vocab, ignore_index, z_loss,
                   FORWARD: tl.constexpr, BACKWARD: tl.constexpr, HAS_Z: tl.constexpr, OUT_BF16: tl.constexpr,
                   WHOLE_ROW: tl.constexpr, BLOCK_V: tl.constexpr, STRIDED: tl.constexpr):
    """Row pid; STRIDED: rows pid, pid + programs, ... (no loop otherwise: the compiler would hoist the
    column indices out of it and hold them in registers across rows)."""
    if STRIDED:
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            _ce_row(tl.cast(row, tl.int64), logits_ptr, stride_logits, grad_ptr, stride_grad, target_ptr,
                    loss_ptr, lse_ptr, scale_ptr, stride_scale, n_vocab, ignore_index, z_loss,
                    FORWARD, BACKWARD, HAS_Z, OUT_BF16, WHOLE_ROW, BLOCK_V)
    else:
        _ce_row(tl.program_id(0).to(tl.int64), logits_ptr, stride_logits, grad_ptr, stride_grad, target_ptr,
                loss_ptr, lse_ptr, scale_ptr, stride_scale, n_vocab, ignore_index, z_loss,
                FORWARD, BACKWARD, HAS_Z, OUT_BF16, WHOLE_ROW, BLOCK_V)


@triton.jit
def _times_kernel(x_ptr, g_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = x * g[0] in fp32, rounded once to out's dtype (bf16 by integer ops, as the row kernel rounds)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(g_ptr)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + offs, _round_to_bf16(y), mask=mask)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------- launchers

@dataclass(frozen=True)
class RowConfig:
    """How the row kernel is launched. block_v: the vocabulary slice a loop step reads, a power of two
    >= 128; one that covers the row holds it in registers and reads it once (for bf16 at vocab 50304,
    RowConfig(65536, 32) compiles for sm_90 without register spills). num_warps per program.
    programs_per_sm: 0 runs one program per row; k runs k x (SM count) programs, each striding over the
    rows, which bounds the rows in flight (and so what the backward's second read of a row needs from L2)."""
    block_v: int
    num_warps: int
    programs_per_sm: int = 0

    def check(self):
        b, w, p = self.block_v, self.num_warps, self.programs_per_sm
        for name, v in (("block_v", b), ("num_warps", w), ("programs_per_sm", p)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"RowConfig: {name}={v!r}; expected an int")
        if b < 128 or b & (b - 1):
            raise ValueError(f"RowConfig: block_v={b}; expected a power of two >= 128")
        if w not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"RowConfig: num_warps={w}; expected a power of two from 1 to 32")
        # At least 4 elements per thread: no element is held by two threads, which could race when the
        # gradient is written over the logits.
        if b < 128 * w:
            raise ValueError(f"RowConfig: block_v={b} with num_warps={w}; expected block_v >= 128 * num_warps")
        if p < 0:
            raise ValueError(f"RowConfig: programs_per_sm={p}; expected 0 (one program per row) or more")
        return self


# The launch of rows wider than WHOLE_ROW_MAX: 16384 x 50304 bf16 took 1.32 ms forward+backward on the
# H200 (87% of the copy bandwidth, counting two reads and a write).
WIDE_ROWS = RowConfig(4096, 8)


def default_row_config(n_vocab):
    """The whole row when it is at most WHOLE_ROW_MAX wide (up to 8 warps), else WIDE_ROWS."""
    block = max(128, triton.next_power_of_2(n_vocab))
    if block <= WHOLE_ROW_MAX:
        return RowConfig(block, max(1, min(8, block // 512)))
    return WIDE_ROWS


_ce_row_launch = FastLauncher(_ce_row_kernel)  # ~100 us of host time less per launch after the first


@functools.lru_cache(maxsize=None)
def _sm_count(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter: a small grid, so that a test sees programs striding over several rows


def ce_rows(logits, target, *, ignore_index, z_loss, loss=None, lse=None, grad=None, scale=None, config=None):
    """Run the row kernel on 2-D logits (rows, vocab) with unit column stride and 1-D target (rows,).

    With loss given, the forward writes loss and lse (float32, (rows,)); without it lse is read. With grad
    given (it may be logits itself), the backward writes dlogits scaled by `scale`: float32 of one element
    (every row) or (rows,) (one per row). config: a RowConfig, None for default_row_config(vocab).
    Returns the launched kernel (the benchmark reads its n_regs and n_spills), None for no rows.
    """
    n_rows, n_vocab = logits.shape
    if n_rows == 0:
        return None
    config = (config or default_row_config(n_vocab)).check()
    forward, backward = loss is not None, grad is not None
    if backward:
        per_row = scale.numel() == n_rows and n_rows > 1
        stride_scale = scale.stride(0) if per_row else 0
    else:
        scale, stride_scale = lse, 0
    programs = n_rows
    if config.programs_per_sm:
        programs = min(n_rows, config.programs_per_sm * _sm_count(logits.device))
    out = grad if backward else logits
    return _ce_row_launch(
        (programs,), logits, logits.stride(0), out, out.stride(0), target, loss if forward else lse, lse, scale,
        stride_scale, n_rows, n_vocab, ignore_index, float(z_loss), FORWARD=forward, BACKWARD=backward,
        HAS_Z=z_loss != 0.0, OUT_BF16=backward and grad.dtype == torch.bfloat16,
        WHOLE_ROW=config.block_v >= n_vocab, BLOCK_V=config.block_v, STRIDED=programs < n_rows,
        num_warps=config.num_warps)


def _mm_accumulate(acc, a, b, first):
    """acc (float32) = a @ b when first, else acc += a @ b; a and b in the input dtype. Without an fp32-output
    GEMM (the CPU) a product in the input dtype is copied or added: right, but more bytes a chunk."""
    if a.dtype == acc.dtype:
        torch.addmm(acc, a, b, beta=0 if first else 1, out=acc)
    elif fp32_out_mm_ok(acc.device, a.dtype):
        if first:
            torch.mm(a, b, torch.float32, out=acc)
        else:
            torch.addmm(acc, a, b, torch.float32, out=acc)
    elif first:
        acc.copy_(a @ b)
    else:
        acc.add_(a @ b)


def _equal_rows(n_rows, chunks, most):
    """Rows per chunk of `chunks` equal chunks, in a multiple of 128 rows (cuBLAS tiles) where a chunk has
    that many, at most `most`."""
    rows = cdiv(n_rows, chunks)
    if rows >= 128:
        rows = min(most, cdiv(rows, 128) * 128) if most >= 128 else rows
    return rows


def wave_fill(rows, width, sms) -> float:
    """The share of its waves a (rows x width) GEMM output of GEMM_TILE tiles keeps busy on `sms` SMs."""
    tiles = cdiv(rows, GEMM_TILE[0]) * cdiv(width, GEMM_TILE[1])
    return tiles / (cdiv(tiles, sms) * sms)


def default_chunk_rows(n_rows, n_vocab, element_size, width=None, sms=None):
    """Rows per chunk: the rows split into equal chunks whose logits take at most about CHUNK_BYTES, in a
    multiple of 128 rows (cuBLAS tiles) where the chunk has that many; at least 1, at most n_rows.
    Given the hidden width and the device's SM count: where that chunk's grad_hidden GEMM fills less than
    WAVE_FILL of its waves, the fewest chunks of at most CHUNK_BYTES_MAX that fill more. GPT-2 124M on the
    H200 (32768 rows, width 768, 132 SMs): 7 chunks of 4736 rows fill 0.86 of a wave (114 tiles), 3 of 11008
    rows 0.98 of two (258), and the step took 59.2 and 59.5 ms against 60.4 and 60.3 for 7 chunks, alternating in
    one device session (bench/results/e2e_ab_head_rows_dfdafa8.json), 14.2 GB at peak against 13.6."""
    row_bytes = max(1, n_vocab * element_size)
    most = max(1, CHUNK_BYTES // row_bytes)
    if n_rows <= most:
        return max(1, n_rows)
    chunks = cdiv(n_rows, most)
    rows = _equal_rows(n_rows, chunks, most)
    if width and sms and wave_fill(rows, width, sms) < WAVE_FILL:
        largest = max(1, CHUNK_BYTES_MAX // row_bytes)
        for fewer in range(cdiv(n_rows, largest), chunks):
            candidate = _equal_rows(n_rows, fewer, largest)
            if wave_fill(candidate, width, sms) >= WAVE_FILL:
                return candidate
    return rows


def _fused_chunks(hidden, weight, bias, target, lse, *, ignore_index, z_loss, chunk_rows, loss=None,
                  scale=None, want=(False, False, False), config=None):
    """Chunk loop of linear_cross_entropy. With loss: the forward (loss, lse); with any of want (grad of
    hidden, weight, bias) also the backward, scaled by `scale` (one element or one per row). Returns
    grad_hidden in hidden's dtype and grad_weight, grad_bias as float32 accumulators (or None)."""
    n, width = hidden.shape
    vocab = weight.shape[0]
    want_h, want_w, want_b = want
    grads = want_h or want_w or want_b
    if not grads and loss is None:
        return None, None, None
    dev = hidden.device
    gh = torch.empty_like(hidden) if want_h else None
    gw = torch.zeros if n == 0 else torch.empty
    gw = gw((vocab, width), device=dev, dtype=torch.float32) if want_w else None
    gb = torch.zeros(vocab, device=dev, dtype=torch.float32) if want_b else None
    per_row = scale is not None and scale.numel() == n and n > 1
    buf = torch.empty((min(chunk_rows, n), vocab), device=dev, dtype=hidden.dtype)
    wt = weight.t()
    routed = cublaslt.GEMMS and cublaslt.available(dev) and not torch.compiler.is_compiling()
    for i, start in enumerate(range(0, n, chunk_rows)):
        stop = min(start + chunk_rows, n)
        h = hidden[start:stop]
        logits = buf[: stop - start]
        if routed:   # ops.cublaslt's GEMMS switch: the three GEMMs there (TUNE picks their algorithms)
            cublaslt.matmul(h, wt, logits, bias=bias)
        elif bias is None:
            torch.mm(h, wt, out=logits)
        else:
            torch.addmm(bias, h, wt, out=logits)
        ce_rows(logits, target[start:stop], ignore_index=ignore_index, z_loss=z_loss,
                loss=None if loss is None else loss[start:stop], lse=lse[start:stop],
                grad=logits if grads else None, scale=scale[start:stop] if per_row else scale, config=config)
        if want_h:
            if routed:
                cublaslt.matmul(logits, weight, gh[start:stop])
            else:
                torch.mm(logits, weight, out=gh[start:stop])
        if want_w:
            if routed:
                cublaslt.matmul(logits.t(), h, gw, accumulate=i > 0)
            else:
                _mm_accumulate(gw, logits.t(), h, first=i == 0)
        if want_b:
            gb += logits.sum(0, dtype=torch.float32)
    return gh, gw, gb


def _no_autocast(t):
    """The chunk loop's GEMMs name their dtypes: autocast off around it (linear.fp32_out_mm_ok says what it broke)."""
    return torch.autocast(t.device.type, enabled=False)


TIMES_BLOCK = 4096
_times_launch = FastLauncher(_times_kernel)


def _times(t, g, dtype):
    """t * g (g: one float32 element on t's device) rounded once to dtype; None stays None. A Triton pass
    where the kernels run: torch.mul by a one-element device tensor broadcasts it, which keeps its kernel from
    vectorizing (GPT-2 124M on the H200 at d5d762d, bench/results/e2e.json: the two non-vectorized multiplies,
    bf16 and fp32, of these sizes took 0.097 and 0.115 ms; the copy bandwidth would move their bytes in ~0.025
    and ~0.07). Not yet timed on the GPU."""
    if t is None:
        return None
    out = torch.empty(t.shape, device=t.device, dtype=dtype)
    if torch.compiler.is_compiling() or not use_triton(t) or t.dtype == torch.float64 or dtype == torch.float64:
        return torch.mul(t, g, out=out)
    if t.numel():
        _times_launch((cdiv(t.numel(), TIMES_BLOCK),), t.contiguous(), g.reshape(1).contiguous(), out, t.numel(),
                      BLOCK=TIMES_BLOCK, num_warps=8)
    return out


def _mean_scale(target, ignore_index, reduction):
    """float32 of one element: 1 / (number of counted targets) for mean, 1 for sum; no host sync."""
    if reduction == "sum":
        return torch.ones(1, device=target.device, dtype=torch.float32)
    counted = (target != ignore_index).sum().clamp(min=1)
    return (1.0 / counted.to(torch.float32)).reshape(1)


# ------------------------------------------------------------------------------------- autograd.Functions

class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, z_loss, reduction):
        vocab = logits.shape[-1]
        logits2d = logits.reshape(-1, vocab)
        if logits2d.stride(-1) != 1:
            logits2d = logits2d.contiguous()
        target1d = target.reshape(-1).contiguous()
        n = target1d.numel()
        loss = torch.empty((n,), device=logits.device, dtype=torch.float32)  # the kernel writes every row
        lse = torch.empty((n,), device=logits.device, dtype=torch.float32)
        ce_rows(logits2d, target1d, ignore_index=ignore_index, z_loss=z_loss, loss=loss, lse=lse)
        scale = _mean_scale(target1d, ignore_index, reduction) if reduction != "none" else None
        ctx.save_for_backward(logits2d, target1d, lse, scale)
        ctx.args = (ignore_index, z_loss, reduction, logits.shape)
        if reduction == "none":
            return loss.view(target.shape)
        return loss.sum() * scale[0]

    @staticmethod
    def backward(ctx, grad_out):
        logits2d, target1d, lse, scale = ctx.saved_tensors
        ignore_index, z_loss, reduction, shape = ctx.args
        if reduction == "none":
            scale = grad_out.reshape(-1).to(torch.float32).contiguous()
        else:
            scale = grad_out.to(torch.float32).reshape(1) * scale
        grad = torch.empty_like(logits2d)
        ce_rows(logits2d, target1d, ignore_index=ignore_index, z_loss=z_loss, lse=lse, grad=grad, scale=scale)
        return grad.view(shape), None, None, None, None


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, z_loss, reduction, chunk_rows, config):
        """weight and bias may be fp32 masters of a bf16/fp16 hidden: cast here, their gradients in fp32."""
        n = hidden.shape[0]
        hidden = hidden.contiguous()
        target = target.contiguous()
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        ctx.args = (ignore_index, z_loss, reduction, chunk_rows, config, want,
                    (hidden.dtype, weight.dtype, None if bias is None else bias.dtype))
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
        # The kernel writes every row of loss and lse, so they start empty.
        loss = torch.empty((n,), device=hidden.device, dtype=torch.float32)
        lse = torch.empty((n,), device=hidden.device, dtype=torch.float32)
        kw = dict(ignore_index=ignore_index, z_loss=z_loss, chunk_rows=chunk_rows, loss=loss, config=config)
        if reduction == "none":
            with _no_autocast(hidden):
                _fused_chunks(hidden, weight, bias, target, lse, **kw)
            ctx.save_for_backward(hidden, weight, bias, target, lse)
            return loss
        scale = _mean_scale(target, ignore_index, reduction)
        with _no_autocast(hidden):
            grads = _fused_chunks(hidden, weight, bias, target, lse, scale=scale, want=want, **kw)
        ctx.save_for_backward(*grads)
        return loss.sum() * scale[0]

    @staticmethod
    def backward(ctx, grad_out):
        ignore_index, z_loss, reduction, chunk_rows, config, want, dtypes = ctx.args
        if reduction == "none":
            hidden, weight, bias, target, lse = ctx.saved_tensors
            scale = grad_out.reshape(-1).to(torch.float32).contiguous()
            with _no_autocast(hidden):
                gh, gw, gb = _fused_chunks(hidden, weight, bias, target, lse, ignore_index=ignore_index,
                                           z_loss=z_loss, chunk_rows=chunk_rows, scale=scale, want=want,
                                           config=config)
            gw, gb = (None if t is None else t.to(d) for t, d in zip((gw, gb), dtypes[1:]))
        else:
            g = grad_out.to(torch.float32)
            gh, gw, gb = (_times(t, g, d) for t, d in zip(ctx.saved_tensors, dtypes))
        return gh, gw, gb, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------ public functions

def _check(logits_shape, target, reduction, name, *, dtype=None, device=None, ignore_index=-100, z_loss=0.0):
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction={reduction!r}; expected one of {REDUCTIONS}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{name}: target is a {type(target).__name__}; expected a torch.Tensor of int64 or int32")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: target dtype {target.dtype}; expected int64 or int32")
    if len(logits_shape) < 1 or logits_shape[-1] < 1:
        raise ValueError(f"{name}: logits shape {tuple(logits_shape)}; expected (..., vocab) with vocab >= 1")
    if tuple(target.shape) != tuple(logits_shape[:-1]):
        raise ValueError(f"{name}: target shape {tuple(target.shape)} does not match rows {tuple(logits_shape[:-1])}")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype {dtype}; expected one of bf16, fp16, fp32, fp64")
    if device is not None and target.device != device:
        raise ValueError(f"{name}: target is on {target.device} but the logits are on {device}; expected one device")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{name}: ignore_index={ignore_index!r}; expected an int")
    if isinstance(z_loss, bool) or not isinstance(z_loss, numbers.Real):
        raise TypeError(f"{name}: z_loss={z_loss!r}; expected a float")
    if not (math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"{name}: z_loss={z_loss}; expected a finite value >= 0")
    if target.device.type == "cpu" and target.numel():
        vocab = logits_shape[-1]
        bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
        if bool(bad.any()):
            raise ValueError(f"{name}: target value {int(target[bad][0])} is outside [0, {vocab}) and is not "
                             f"ignore_index={ignore_index}")


def cross_entropy(logits, target, *, ignore_index=-100, z_loss=0.0, reduction="mean"):
    """Cross-entropy of logits (..., vocab) against int targets (...).

    Returns a float32 scalar (mean over counted targets, or sum), or float32 of target's shape for "none";
    float64 logits give float64.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"cross_entropy: logits is a {type(logits).__name__}; expected a torch.Tensor")
    _check(logits.shape, target, reduction, "cross_entropy", dtype=logits.dtype, device=logits.device,
           ignore_index=ignore_index, z_loss=z_loss)
    if use_triton(logits) and logits.dtype in KERNEL_DTYPES:
        return CrossEntropyFunction.apply(logits, target, int(ignore_index), float(z_loss), reduction)
    return cross_entropy_reference(logits, target, ignore_index=ignore_index, z_loss=z_loss, reduction=reduction)


def _fp32_master(weight, hidden_dtype) -> bool:
    """An fp32 weight of a bf16/fp16 hidden (autocast's master weight): the fused op casts it itself and
    returns its gradient in fp32."""
    return weight.dtype == torch.float32 and hidden_dtype in (torch.bfloat16, torch.float16)


def linear_cross_entropy(hidden, weight, target, *, bias=None, ignore_index=-100, z_loss=0.0, reduction="mean"):
    """cross_entropy(hidden @ weight.T + bias, target) without materializing the logits on the fused path.

    hidden (..., width), weight (vocab, width), bias (vocab,) or None, target (...), all in one dtype;
    under autocast they are cast to the autocast dtype first, as F.linear would be, except that an fp32
    weight (and bias) is cast inside the fused op, which returns its gradient in fp32 straight from the
    fp32 accumulator (autocast's cast would round it to bf16 and widen it back: one more pass over the
    vocab x width gradient, and bf16 rounding).
    """
    device_type = hidden.device.type if isinstance(hidden, torch.Tensor) else "cpu"
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden = hidden.to(dtype)
        if not (isinstance(weight, torch.Tensor) and _fp32_master(weight, hidden.dtype)
                and (bias is None or getattr(bias, "dtype", None) == torch.float32)):
            weight = weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
    return linear_cross_entropy_fused(hidden, weight, target, bias=bias, ignore_index=ignore_index,
                                      z_loss=z_loss, reduction=reduction)


def linear_cross_entropy_fused(hidden, weight, target, *, bias=None, ignore_index=-100, z_loss=0.0,
                               reduction="mean", chunk_rows=None, row_config=None):
    """linear_cross_entropy with the chunk size (None: default_chunk_rows) and the row kernel's launch
    (a RowConfig, None: default_row_config(vocab)) exposed, for tests and tuning."""
    name = "linear_cross_entropy"
    for what, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {what} is a {type(t).__name__}; expected a torch.Tensor")
    if hidden.ndim < 1:
        raise ValueError(f"{name}: hidden is 0-d; expected (..., width)")
    if weight.ndim != 2:
        raise ValueError(f"{name}: weight shape {tuple(weight.shape)}; expected 2-D (vocab, width)")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"{name}: hidden width {hidden.shape[-1]} != weight in-features {weight.shape[-1]}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: hidden dtype {hidden.dtype}; expected one of bf16, fp16, fp32, fp64")
    if (weight.dtype != hidden.dtype and not _fp32_master(weight, hidden.dtype)) or weight.device != hidden.device:
        raise ValueError(f"{name}: weight is {weight.dtype} on {weight.device}, hidden {hidden.dtype} on "
                         f"{hidden.device}; expected the same device and dtype (or an fp32 weight)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{name}: bias is a {type(bias).__name__}; expected a torch.Tensor or None")
        if tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(f"{name}: bias {tuple(bias.shape)} {bias.dtype} on {bias.device}; expected "
                             f"({weight.shape[0]},) {weight.dtype} on {weight.device}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"{name}: chunk_rows={chunk_rows!r}; expected None or an int >= 1")
    if row_config is not None:
        if not isinstance(row_config, RowConfig):
            raise TypeError(f"{name}: row_config is a {type(row_config).__name__}; expected a RowConfig or None")
        row_config.check()
    _check(tuple(hidden.shape[:-1]) + (weight.shape[0],), target, reduction, name, device=hidden.device,
           ignore_index=ignore_index, z_loss=z_loss)
    if not (use_triton(hidden) and hidden.dtype in KERNEL_DTYPES):
        w, b = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
        return cross_entropy_reference(F.linear(hidden, w, b), target, ignore_index=ignore_index,
                                       z_loss=z_loss, reduction=reduction)
    width = hidden.shape[-1]
    hidden2d, target1d = hidden.reshape(-1, width), target.reshape(-1)
    if chunk_rows is None:
        sms = _sm_count(hidden.device) if hidden.is_cuda else None
        chunk_rows = default_chunk_rows(hidden2d.shape[0], weight.shape[0], hidden.element_size(), width, sms)
    loss = LinearCrossEntropyFunction.apply(hidden2d, weight, bias, target1d, int(ignore_index), float(z_loss),
                                            reduction, chunk_rows, row_config)
    return loss.view(target.shape) if reduction == "none" else loss


# ------------------------------------------------------------------------------------------------ reference

def cross_entropy_reference(logits, target, *, ignore_index=-100, z_loss=0.0, reduction="mean"):
    """Plain PyTorch in float32 (float64 for float64 logits); "none" returns target's shape."""
    shape = target.shape
    logits = logits.reshape(-1, logits.shape[-1])
    target = target.reshape(-1).long()
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(compute)
    lse = torch.logsumexp(logits, dim=-1)
    valid = target != ignore_index
    picked = logits.gather(1, torch.where(valid, target, 0)[:, None])[:, 0]
    loss = (lse - picked)
    if z_loss:
        loss = loss + z_loss * lse.pow(2)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.view(shape)
    total = loss.sum()
    return total if reduction == "sum" else total / valid.sum().clamp(min=1)
